"""A resume that proves itself (issue 46.4): a resumed trainer compares the losses of the steps it trains
again with those an earlier segment of .loss.json logged, and records the verdict in segments.jsonl,
its log, `andrea status` and the dashboard: "verified" to the bit on the CPU, a warning naming the steps
where a promised equality fails."""

from __future__ import annotations

import json
import math
import shutil
import signal

import pytest
from conftest import andrea, last_logged_step, start_trainer, wait_for

from andrea_core.ops.dashboard import dashboard_rows
from andrea_core.ops.status import run_status
from andrea_core.run.resume_check import SEGMENTS, ResumeCheck, describe, newest_check, read_records
from andrea_core.run.rundir import LOSS_LOG, RunDir
from tests.tiny import tiny_config


@pytest.mark.slow
def test_a_sigkill_between_checkpoints_then_a_resume_reports_verified_with_the_steps(tmp_path):
    config = tiny_config(tmp_path, train__checkpoint_every=20, train__max_steps=40)
    run = tmp_path / "run"
    proc = start_trainer("--config", config, "--run-dir", str(run), "--pace", "0.05", "--device", "cpu")
    wait_for(lambda: last_logged_step(run) >= 25, what="the trainer to pass step 25")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed = last_logged_step(run)
    checkpoint = RunDir(str(run)).checkpoint_steps()[-1]
    assert killed < 40 and killed % 20 and checkpoint == 20, (killed, checkpoint)

    out = andrea("train", "--run-dir", str(run), "--device", "cpu").stdout
    verdict = f"resume verified: steps 21..{killed} equal to the bit (segment 2 against 1)"
    assert f"andrea: {verdict}\n" in out
    record = newest_check(RunDir(str(run)))
    assert {k: record[k] for k in ("segment", "first", "last", "steps", "against")} == {
        "segment": 2, "first": 21, "last": killed, "steps": killed - 20, "against": [1],
    }  # fmt: skip
    assert (record["promised"], record["equal"], record["max_diff"], record["differing"]) == (
        True,
        True,
        0.0,
        [],
    )
    opened = [r for r in read_records(RunDir(str(run))) if r["event"] == "opened"]
    assert [(r["segment"], r["start_step"]) for r in opened] == [(1, 0), (2, 20)]
    assert opened[1]["conditions"]["device"] == "cpu" and opened[1]["conditions"]["num_threads"] == 1
    status = andrea("status", str(run)).stdout
    assert f"  resume      {verdict}\n" in status and "PROBLEM" not in status
    assert json.loads(andrea("status", str(run), "--json").stdout)[0]["resume"] == record
    st = run_status(str(run))
    assert dashboard_rows(st, None, None, None)["resume check"] == verdict


@pytest.mark.slow
def test_an_altered_logged_loss_makes_the_resume_warn_naming_the_step(tmp_path, tiny_reference):
    """tiny_reference (checkpoints 100, 200, 300), its step 300 checkpoint gone as after a crash just
    before it: the resume trains 201.. again. Step 250's logged loss is moved by one ulp."""
    run = tmp_path / "run"
    shutil.copytree(tiny_reference, run)
    (run / "step_000300.bin").unlink()
    lines = (run / LOSS_LOG).read_text().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if json.loads(line)["step"] == 250)
    entry = json.loads(lines[i])
    entry["loss"] = math.nextafter(entry["loss"], math.inf)
    lines[i] = json.dumps(entry, separators=(",", ":")) + "\n"
    (run / LOSS_LOG).write_text("".join(lines))
    segment = max(json.loads(line)["segment"] for line in lines)

    out = andrea("train", "--run-dir", str(run), "--device", "cpu", "--max-steps", "260").stdout
    record = newest_check(RunDir(str(run)))
    assert (record["first"], record["last"], record["steps"], record["against"]) == (201, 260, 60, [segment])
    assert (record["promised"], record["equal"], record["differing"]) == (True, False, [250])
    assert 0 < record["max_diff"] < 1e-6
    warning = describe(record)
    assert warning.startswith(
        "WARNING: resume NOT verified: step(s) 250 of steps 201..260 differ from segment "
    )
    assert f"andrea: {warning}\n" in out
    status = andrea("status", str(run)).stdout
    assert f"  PROBLEM     {warning}\n" in status and "resume verified" not in status
    rows = dashboard_rows(run_status(str(run)), None, None, None)
    assert warning in rows.values() and "resume check" not in rows


def test_what_is_compared_and_what_is_not(tmp_path):
    """The check's rules on a fabricated log: equal bits verified; another phase's steps not compared;
    another device or a segment of unrecorded conditions compared but not promised; a forged record
    skipped."""
    run = RunDir(str(tmp_path))
    cpu = {"device": "cpu", "world_size": 1, "num_threads": 1, "environment": {"torch": "x"},
           "data": {"a": "f1"}, "policy": "p1", "phase_start": 0, "bandit_restored": True}  # fmt: skip
    lines = [{"step": s, "loss": 5.0 - s / 100, "lr": 1e-3, "segment": 1, "time": 0} for s in range(1, 31)]
    run.write_atomic(LOSS_LOG, "".join(json.dumps(x) + "\n" for x in lines).encode())
    logged = []
    ResumeCheck(run, 1, 0, cpu, logged.append)  # segment 1's conditions: nothing logged before it

    check = ResumeCheck(run, 2, 20, cpu, logged.append)
    for s in range(21, 31):
        check.observe(s, 5.0 - s / 100)
    assert logged == ["resume verified: steps 21..30 equal to the bit (segment 2 against 1)"]
    assert check.finish() is None  # once only

    cuda = {**cpu, "device": "cuda:0", "world_size": 2}
    check = ResumeCheck(run, 3, 20, cuda, logged.append)
    check.observe(21, 5.0 - 21 / 100 + 2e-7)
    check.observe(22, 5.0 - 22 / 100)
    record = check.finish()
    assert (record["promised"], record["equal"], record["first"], record["last"]) == (False, False, 21, 22)
    assert record["why"] == "cuda:0 now: on CUDA exact bits are not promised; world size 1 then 2"
    assert logged[-1].startswith("resume check: steps 21..22 largest difference 2e-07 from segment 1's")

    other_phase = {**cpu, "policy": "p2", "phase_start": 20}
    check = ResumeCheck(run, 4, 20, other_phase, logged.append)
    check.observe(21, 1.0)
    assert check.finish() is None and check.compared == 0  # the old phase's steps are not this one's

    unknown = RunDir(str(tmp_path / "older"))  # a log from before segments.jsonl: no conditions recorded
    unknown.makedirs()
    unknown.write_atomic(LOSS_LOG, (tmp_path / LOSS_LOG).read_bytes())
    check = ResumeCheck(unknown, 2, 10, cpu, logged.append)
    check.observe(11, 4.89)
    assert check.finish()["why"] == "segment 1's conditions were not recorded"

    run.append(SEGMENTS, b'{"format": 1, "event": "checked", "segment": 9, "first": "x"}\n')
    warnings = []
    assert newest_check(run, warnings.append)["segment"] == 3 and "malformed" in warnings[0]
