"""The sample audit: at every checkpoint, metrics from its own texts, reproducible, and showing learning."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal

import pytest
import torch
from conftest import TINY, andrea, last_logged_step
from data_runs import EVERY, STEPS, mix_runs
from tiny import tiny_config

from andrea_core.checkpoint import checkpoint_name, restore
from andrea_core.config import ConfigError, load_run_config
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import load_policy
from andrea_core.model.device import pick_device
from andrea_core.model.gpt import GPT
from andrea_core.run.record import read_run
from andrea_core.run.rundir import SAMPLES, RunDir
from andrea_core.run.samples import FORMAT, read_audits
from andrea_core.train.audit import Auditor, run_audit, validation_losses
from andrea_core.train.optim import build_optimizer
from andrea_core.train.trainer import Trainer


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    return mix_runs(tmp_path_factory)


@pytest.mark.slow
def test_an_audit_at_every_checkpoint_with_metrics_computed_from_its_own_texts(mix):
    run = mix.uninterrupted
    audits = read_audits(run)
    assert [a["step"] for a in audits] == [0, *range(EVERY, STEPS + 1, EVERY)]
    assert set(run.checkpoint_steps()) <= {a["step"] for a in audits}
    for audit in audits:
        # The same held-out prompts at every audit (test_audit_prompts.py: which ones).
        assert [s["prompt"] for s in audit["samples"]] == [s["prompt"] for s in audits[0]["samples"]]
        assert audit["settings"]["prompts"] == "held-out" and all(s["arm"] for s in audit["samples"])
        texts = [s["completion"] for s in audit["samples"]]
        assert all(texts)
        raw = "\n".join(texts).encode()
        assert audit["metrics"]["gzip_ratio"] == len(raw) / len(gzip.compress(raw, 9, mtime=0))
        words = [w for t in texts for w in t.split()]
        assert audit["metrics"]["distinct_1"] == len(set(words)) / len(words)
    # The SIGUSR1 checkpoint of the other run has its audit too (DESIGN: every checkpoint has one).
    assert mix.usr1_step in {a["step"] for a in read_audits(mix.interrupted)}


@pytest.mark.slow
def test_the_audits_validation_loss_is_that_of_the_checkpoint_it_sits_on(mix):
    run = mix.uninterrupted
    cfg = read_run(run).config
    torch.set_num_threads(cfg.train.num_threads)
    model = GPT(cfg.model)
    restore(run.read_checkpoint(STEPS, model.n_params), model, build_optimizer(model, cfg.train, "cpu"))
    data = DataPipeline.for_run(run, cfg, warn=lambda line: None)
    recorded = read_audits(run)[-1]
    assert recorded["step"] == STEPS
    assert validation_losses(model.eval(), data, "cpu") == recorded["metrics"]["val_loss"]


@pytest.mark.slow
def test_two_identical_runs_record_equal_audits(mix):
    a = {x["step"]: x for x in read_audits(mix.uninterrupted)}
    b = {x["step"]: x for x in read_audits(mix.interrupted)}
    common = sorted(a.keys() & b.keys())
    assert common == [0, *range(EVERY, STEPS + 1, EVERY)]  # also the ones after the resume
    for step in common:
        assert a[step] == b[step], step


@pytest.mark.slow
def test_validation_loss_falls_on_every_arm(mix):
    audits = read_audits(mix.uninterrupted)
    start, end = audits[0]["metrics"]["val_loss"], audits[-1]["metrics"]["val_loss"]
    assert audits[0]["step"] == 0 and audits[-1]["step"] == STEPS
    assert set(start) == set(end) == {"stdlib-code", "repo-docstrings", "docs-prose"}
    for arm in start:
        # From about ln(256) = 5.5 nats per byte untrained; a real model learns each arm.
        assert end[arm] < 0.75 * start[arm], (arm, start[arm], end[arm])


@pytest.mark.slow
def test_andrea_audit_prints_the_newest_audit_as_a_table(mix):
    run = mix.uninterrupted
    newest = read_audits(run)[-1]
    out = andrea("audit", run.url).stdout
    assert out.startswith(f"audit at step {STEPS} (tokenizer bytes)")
    for arm, loss in newest["metrics"]["val_loss"].items():
        assert f"{arm:<24}{loss:>10.4f}" in out
    assert f"{'gzip_ratio':<24}{newest['metrics']['gzip_ratio']:>10.4f}" in out
    assert json.loads(andrea("audit", run.url, "--json").stdout) == newest
    assert andrea("audit", run.url, "--step", str(EVERY)).stdout.startswith(f"audit at step {EVERY} ")
    missing = andrea("audit", run.url, "--step", "7", check=False)
    assert missing.returncode == 1 and "no sample audit at step 7" in missing.stderr


def test_an_audit_draws_nothing_from_the_global_rng_and_restores_the_model_mode(one_thread):
    cfg = load_run_config(TINY)
    policy, _ = load_policy(cfg.data.policy)
    data = DataPipeline(cfg, policy, warn=lambda line: None)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = run_audit(model, data, cfg, 5, "cpu")
    assert torch.equal(torch.get_rng_state(), before)
    assert model.training
    assert run_audit(model, data, cfg, 5, "cpu") == first


def test_an_unreadable_samples_file_is_refused_naming_it(tmp_path):
    run = RunDir(str(tmp_path))
    run.write_text(SAMPLES, '{"format": 1, "audits": [{"step": "ten"}]}')
    with pytest.raises(ConfigError, match=rf"{tmp_path}/{SAMPLES}: not a sample audit file of format 1"):
        read_audits(run)
    proc = andrea("audit", run.url, check=False)
    assert proc.returncode == 2 and "not a sample audit file" in proc.stderr


@pytest.mark.slow
def test_a_resumed_step_whose_audit_is_missing_is_audited_again_from_its_checkpoint(tiny_reference, tmp_path):
    """A trainer killed between publishing checkpoint 300 and writing its audit (or on a disk too full
    for it) leaves exactly this run: the next trainer audits step 300 from the checkpoint, and that is
    the audit the uninterrupted run recorded, bit for bit."""
    run = tmp_path / "run"
    shutil.copytree(tiny_reference, run)
    recorded = {a["step"]: a for a in read_audits(RunDir(str(run)))}
    assert 300 in recorded
    kept = [a for step, a in recorded.items() if step != 300]
    (run / SAMPLES).write_text(json.dumps({"format": FORMAT, "audits": kept}))
    out = andrea("train", "--run-dir", str(run), "--max-steps", "300", "--device", "cpu")
    assert "the sample audit of step 300 is missing: auditing it now" in out.stdout + out.stderr
    assert read_audits(RunDir(str(run))) == [*kept, recorded[300]]
    again = andrea("train", "--run-dir", str(run), "--max-steps", "300", "--device", "cpu")
    assert "is missing" not in again.stdout + again.stderr  # present: nothing is audited twice
    assert read_audits(RunDir(str(run))) == [*kept, recorded[300]]


# --- issue 14.4 (review): a stop seen during an off-grid sample audit still checkpoints that step -----------


def test_sigterm_during_an_off_grid_audit_checkpoints_that_step(tmp_path, monkeypatch):
    cfg = load_run_config(tiny_config(tmp_path, train__checkpoint_every=20, train__sample_every=3))
    url = str(tmp_path / "run")
    real_record = Auditor.record

    def record(self, step):
        if step == 27:  # an audit off the checkpoint grid: the SIGTERM lands while it runs
            os.kill(os.getpid(), signal.SIGTERM)
        return real_record(self, step)

    monkeypatch.setattr(Auditor, "record", record)
    result = Trainer(url, cfg, max_steps=200, device="cpu", log=lambda m: None).train()
    run = RunDir(url)
    assert result.reason == "SIGTERM" and result.step == 27
    assert result.checkpoint == checkpoint_name(27)
    assert run.checkpoint_steps() == [20, 27] and run.read_checkpoint(27).step == 27
    assert last_logged_step(run) == 27  # nothing trained that the checkpoint does not hold


# --- promises of the README and docs/design.md no test held the code to: the sample audit's window
# and schedule, and the device `auto` picks


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """andrea-tiny, 110 steps, an audit every 5 steps (not the default: every checkpoint, 100), the
    device left to `auto`."""
    tmp = tmp_path_factory.mktemp("audited")
    run = tmp / "run"
    proc = andrea("train", "--config", tiny_config(tmp, train__sample_every=5), "--run-dir", str(run),
                  "--max-steps", "110")  # fmt: skip
    return RunDir(str(run)), proc.stdout


def test_samples_json_keeps_the_newest_20_audits_of_a_non_default_schedule(audited):
    run, _ = audited
    # Audits at 0 (the untrained baseline), 5, 10, ..., 110: 23 in all, of which the newest 20 stay.
    assert [a["step"] for a in read_audits(run)] == list(range(15, 111, 5))
    assert run.checkpoint_steps() == [100, 110]


def test_device_auto_picks_cuda_when_present_else_the_cpu(audited, monkeypatch):
    _, out = audited
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"parameters on {here}\n" in out  # what the trainer used, on this machine
    # Both branches wherever the suite runs: the choice depends on whether CUDA is there, nothing else.
    for available, picked in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        assert pick_device("auto") == picked
        assert pick_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match="--device cuda:1: CUDA is not available on this machine"):
        pick_device("cuda:1")
