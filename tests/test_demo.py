"""The README's first command: scripts/demo.sh runs flows/demo.py on Prefect's ephemeral mode. Here the
same flow with the environment demo.sh sets, shortened: the pivot decided at step 20 (taken at the next
boundary: 100, or 200 on a machine slow to start the pivot), the main run to 230, branches 20 steps
further. About a minute and a half here, most of it Prefect's and the trainers' start-up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import ARCHIVE, RunDir
from andrea_core.untrusted import markdown_text

pytestmark = pytest.mark.slow


def test_demo_sh_runs_the_demo_flow_with_its_arguments():
    script = (REPO / "scripts" / "demo.sh").read_text()
    assert "unset PREFECT_API_URL" in script
    assert script.rstrip().endswith('exec .venv/bin/python -m flows.demo "$@"')


def test_the_demo_flow_on_prefects_ephemeral_mode(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}  # no server of ours
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
    )
    (tmp_path / "prefect").mkdir()
    args = ["--workdir", str(tmp_path / "runs"), "--pivot-at", "20", "--max-steps", "230"]
    args += ["--fork-steps", "20"]
    proc = subprocess.run(
        [sys.executable, "-m", "flows.demo", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "andrea demo finished in" in proc.stdout
    main = RunDir(re.search(r"^  run: +(\S+)$", proc.stdout, re.M).group(1))
    pivot = re.search(r"^  pivot: +step (\d+) -> policy 'polish', archive (\S+)$", proc.stdout, re.M)
    boundary = int(pivot.group(1))
    assert boundary in (100, 200) and pivot.group(2).endswith(f"phase_001_step_{boundary:06d}")
    assert main.checkpoint_steps()[-1] == 230 and main.listdir(ARCHIVE) == [f"phase_001_step_{boundary:06d}"]
    assert [e.step for e in read_history(main)] == list(range(1, 231))
    branches = re.search(r"^  branches: +(.+)$", proc.stdout, re.M).group(1).split(", ")
    assert len(branches) == 2 and all(RunDir(b).checkpoint_steps()[-1] == 250 for b in branches)
    verdict = re.search(r"^  verdict: +(.+)$", proc.stdout, re.M).group(1)
    report = Path(re.search(r"^  report: +(\S+)$", proc.stdout, re.M).group(1)).read_text()
    plot = Path(re.search(r"^  plot: +(\S+)$", proc.stdout, re.M).group(1)).read_bytes()
    # The report shows the verdict as escaped markdown (inputs are never rendered), under its headline.
    assert markdown_text(verdict) in report and plot[:8] == b"\x89PNG\r\n\x1a\n"
    assert ("**Winner: `" in report) != ("**No winner" in report)
    assert f"kept in {tmp_path / 'prefect'}" in proc.stdout
