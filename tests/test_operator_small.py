"""The small frictions a new user met (issue 26.6): a reader that goes away, a shipped schedule that
fires at a run that does not exist."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, _env
from tiny import tiny_config

from andrea_core.config import load_run_config
from andrea_core.run.rundir import RunDir
from andrea_core.train.setup import create_run


def test_a_reader_gone_ends_the_command_quietly(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    create_run(run, load_run_config(tiny_config(tmp_path)))
    # `andrea status RUN ... | head -c 100`: far more output than a pipe holds, the reader gone early.
    proc = subprocess.Popen(
        [sys.executable, "-m", "andrea_core", "status", *[run.url] * 200],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=REPO,
    )
    assert proc.stdout.read(100).startswith(run.url.encode())
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert (proc.wait(timeout=120), stderr) == (128 + 13, b"")  # as if ended by SIGPIPE, no traceback
