"""The README's own-data journey (issue 46.1), run as a user pastes it: the ```bash block after "From
your files to a trained run" is taken from README.md and run by bash, line for line, in a folder that
holds the repository's docs and README (what it reads) with the `andrea` command on PATH. The run it
trains has the --set and --policy values it was given, in run.yaml and in training."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from andrea_core.run.loss_log import read_history
from andrea_core.run.record import read_run
from andrea_core.run.rundir import RunDir
from andrea_core.train.optim import lr_at
from tests.conftest import REPO, _env

MARK = "From your files to a trained run"


def readme_block(mark: str) -> str:
    """The first ```bash block after `mark` in README.md, as it stands there."""
    text = (REPO / "README.md").read_text()
    assert mark in text, f"README.md no longer says {mark!r}"
    match = re.search(r"```bash\n(.*?)```", text[text.index(mark) :], re.S)
    assert match, f"no ```bash block after {mark!r}"
    return match.group(1)


@pytest.mark.slow
def test_readme_own_data_commands_train_a_run(tmp_path):
    script = readme_block(MARK)
    assert "andrea train --config andrea-tiny --policy my-data.yaml" in script
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    env = _env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # the venv's `andrea`
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"README block failed:\n{proc.stdout}\n{proc.stderr}"
    run = tmp_path / "runs" / "my-data"
    frozen = yaml.safe_load((run / "run.yaml").read_text())
    assert frozen["train"]["max_steps"] == 40 and frozen["train"]["checkpoint_every"] == 20
    assert frozen["train"]["lr"] == 1e-3 and frozen["data"]["policy"] == "my-data.yaml"
    # The policy the run trains on is the user's, its path frozen absolute (README "Your own data").
    policy = yaml.safe_load((run / "policy.yaml").read_text())
    assert policy["name"] == "my-data" and policy["arms"][0]["paths"] == [f"{tmp_path}/my-data/"]
    assert sorted(p.name for p in run.glob("step_*.bin")) == ["step_000020.bin", "step_000040.bin"]
    history = read_history(RunDir(str(run)))
    assert [e.step for e in history] == list(range(1, 41)) and {e.arm for e in history} == {"docs"}
    # The trainer used the --set learning rate: each step's logged lr is the schedule of lr 1e-3
    # (andrea-tiny's own is 3e-3).
    train = read_run(RunDir(str(run))).config.train
    assert train.lr == 1e-3 and [e.lr for e in history] == [lr_at(s, train) for s in range(1, 41)]
    assert "COMPLETED" in proc.stdout and "step        40 of 40" in proc.stdout
    assert "The trainer " in proc.stdout  # the sample's prompt, continued
