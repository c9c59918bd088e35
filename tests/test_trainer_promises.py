"""Promises of the README and docs/design.md that no other test held the code to: the sample audit's window
and schedule, the device `auto` picks, the resume warnings for another environment, and the GPU slot a
device string maps to."""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from conftest import andrea
from tiny import tiny_config

from andrea_core.config import ConfigError
from andrea_core.model.device import pick_device
from andrea_core.ops.supervise import gpu_slot_name
from andrea_core.run.rundir import RUN_YAML, RunDir
from andrea_core.run.samples import read_audits


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


def test_a_resume_in_another_environment_warns_naming_the_difference(tmp_path):
    """Another torch version (as on another machine), and a frozen thread count above this machine's
    cores: the run trains on, with a warning for each."""
    threads = (os.cpu_count() or 1) + 1
    run = tmp_path / "run"
    andrea("train", "--config", tiny_config(tmp_path, train__num_threads=threads), "--run-dir", str(run),
           "--max-steps", "4")  # fmt: skip
    record = yaml.safe_load((run / RUN_YAML).read_text())
    record["environment"]["torch"] = "2.12.0+cpu"
    (run / RUN_YAML).write_text(yaml.safe_dump(record, sort_keys=False))

    out = andrea("train", "--run-dir", str(run), "--max-steps", "8").stdout
    assert (
        f"warning: torch is {torch.__version__!r} here but the run was created with '2.12.0+cpu': resumed "
        "CPU results will match the original only to rounding, not bit for bit"
    ) in out
    assert f"warning: num_threads {threads} exceeds this machine's {os.cpu_count()} cores" in out
    assert RunDir(str(run)).checkpoint_steps() == [4, 8]


def test_gpu_slot_names():
    assert gpu_slot_name("test-gpu", "cpu") == "test-gpu"  # an explicit name, as given
    assert gpu_slot_name(None, "cuda:1") is None and gpu_slot_name("", "cpu") is None
    assert gpu_slot_name("auto", "cpu") is None  # the CPU holds no GPU slot
    if not torch.cuda.is_available():
        assert gpu_slot_name("auto", "auto") is None
        return
    assert gpu_slot_name("auto", "auto") == f"gpu-{torch.cuda.current_device()}"
    assert gpu_slot_name("auto", "cuda") == f"gpu-{torch.cuda.current_device()}"
    for i in range(torch.cuda.device_count()):
        assert gpu_slot_name("auto", f"cuda:{i}") == f"gpu-{i}"


def test_auto_maps_a_cuda_device_string_to_its_gpu_slot(monkeypatch):
    """On a machine without CUDA, the mapping of "cuda:N" strings alone (no device is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_slot_name("auto", "cuda:0") == "gpu-0"
    assert gpu_slot_name("auto", "cuda:3") == "gpu-3"
