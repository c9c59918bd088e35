"""After a pivot the bandit starts fresh: the resumed trainer must not feed it the old phase's last step
(a phantom pull, and of an arm the new policy may not have at all)."""

from __future__ import annotations

from andrea_core.ops.pivot import pivot_run_directory
from andrea_core.run.rundir import STATE, RunDir
from tests.conftest import andrea, library_run

DOCS_ONLY = """\
name: docs-only
mixer: uniform
arms:
  - name: repo-docstrings
    kind: docstrings
"""


def test_resume_after_a_pivot_that_drops_the_boundary_steps_arm(tmp_path, tmp_path_factory):
    run = RunDir(library_run(tmp_path_factory, tmp_path / "run", 100))  # andrea-tiny at step 100
    pivot_run_directory(run, 100, DOCS_ONLY)  # step 100 was drawn from stdlib-code, gone now
    resumed = andrea("train", "--run-dir", run.url, "--max-steps", "102")
    assert "a fresh bandit from step 100" in resumed.stdout
    assert "completed step 102" in resumed.stdout
    # At checkpoint 102 the bandit has heard of step 101 only (losses arrive one step late): not of
    # step 100, which the old phase's bandit drew.
    state = run.read_json(STATE)
    assert state["step"] == 102
    assert state["arms"] == {"repo-docstrings": {"p": 1.0, "pulls": 1}}
