"""The run lock (.trainer.json) and config validation: refused before any work, naming the field."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import yaml
from conftest import TINY, andrea, start_trainer, wait_for

from andrea_core.config import ConfigError, load_run_config, parse_run_config
from andrea_core.run.lock import TrainerIdentity, read_lock
from andrea_core.run.rundir import RunDir


def test_second_trainer_on_a_live_run_is_refused(tmp_path):
    run = tmp_path / "run"
    first = start_trainer("--config", TINY, "--run-dir", str(run), "--pace", "0.05")
    try:
        # A live run: its lock held and its run.yaml written (the trainer takes the lock before it creates
        # the run; a start in between is told the run does not exist yet, not that it is in use).
        holder = wait_for(
            lambda: (run / "run.yaml").exists() and read_lock(RunDir(str(run))),
            what="the first trainer's run",
        )
        assert holder.pid == first.pid and holder.is_alive()
        proc = andrea("train", "--run-dir", str(run), check=False)
        assert proc.returncode == 2
        assert f"in use by trainer pid {first.pid}" in proc.stderr
        assert first.poll() is None  # the refused start did not disturb the live trainer
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0


def test_lock_of_a_dead_trainer_is_taken_over(tmp_path):
    run = tmp_path / "run"
    andrea("train", "--config", TINY, "--run-dir", str(run), "--max-steps", "10")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = TrainerIdentity.of_this_process(str(run))
    # A lock as written before leases and pid namespaces (both null): read through lock._upgraded, its
    # holder judged by its pid here, and taken over as any dead holder's.
    stale = TrainerIdentity(dead.pid, stale.host, stale.boot_id, 12345, stale.started_at, stale.run_dir)
    (run / ".trainer.json").write_text(json.dumps(stale.__dict__))
    assert not stale.is_alive()

    proc = andrea("train", "--run-dir", str(run), "--max-steps", "20")
    assert f"taking over the stale lock of dead trainer pid {dead.pid}" in proc.stdout
    assert (run / "step_000020.bin").exists()
    assert json.loads((run / ".trainer.json").read_text())["released"], "left released at the clean exit"


def test_recycled_pid_is_not_our_trainer():
    me = TrainerIdentity.of_this_process("x")
    assert me.is_alive()
    recycled = TrainerIdentity(me.pid, me.host, me.boot_id, (me.proc_start or 0) + 1, 0.0, "x")
    assert not recycled.is_alive()
    with pytest.raises(ProcessLookupError, match="not signalling"):
        recycled.signal(signal.SIGUSR1)


def _tiny_raw() -> dict:
    with open(TINY) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r["train"].update(lerning_rate=1e-3), "unknown field(s) lerning_rate"),
        (lambda r: r["model"].update(n_layer="two"), "model.n_layer: expected int, got str 'two'"),
        (lambda r: r["model"].pop("n_embd"), "model.n_embd is missing"),
        (lambda r: r["train"].update(lr=-1.0), "train.lr"),
        (lambda r: r["model"].update(n_head=3), "model.n_head must divide model.n_embd"),
        (lambda r: r.update(extra=1), "unknown field(s) extra"),
    ],
)
def test_bad_config_is_rejected_naming_the_field(mutate, message):
    raw = _tiny_raw()
    mutate(raw)
    with pytest.raises(ConfigError) as err:
        parse_run_config(raw, "bad.yaml")
    assert message in str(err.value) and "bad.yaml" in str(err.value)


def test_bad_config_file_is_rejected_before_any_work(tmp_path):
    raw = _tiny_raw()
    raw["train"]["batch_size"] = 2.5
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    proc = andrea("train", "--config", str(bad), "--run-dir", str(run), check=False)
    assert proc.returncode == 2
    assert "train.batch_size: expected int, got float 2.5" in proc.stderr and str(bad) in proc.stderr
    assert not run.exists()  # nothing was created


def test_resume_with_a_different_config_is_refused(tmp_path):
    run = tmp_path / "run"
    andrea("train", "--config", TINY, "--run-dir", str(run), "--max-steps", "5")
    raw = _tiny_raw()
    raw["train"]["lr"] = 1e-2
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(raw))
    proc = andrea("train", "--config", str(other), "--run-dir", str(run), check=False)
    assert proc.returncode == 2 and "differs from the frozen run.yaml in train.lr" in proc.stderr


def test_shipped_configs_load_and_have_their_sizes():
    import torch

    from andrea_core.model.gpt import GPT

    sizes = {}
    for name in ("andrea-tiny", "andrea-12m", "andrea-120m"):
        with torch.device("meta"):
            sizes[name] = GPT(load_run_config(name).model).n_params
    assert abs(sizes["andrea-12m"] / 12.8e6 - 1) <= 0.02
    assert abs(sizes["andrea-120m"] / 120e6 - 1) <= 0.03
    print({k: f"{v:,} params, {8 + 12 * v:,} byte checkpoint" for k, v in sizes.items()})
