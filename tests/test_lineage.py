"""`andrea lineage`: the tree of a run's phases (pivots) and forks, read from the run directories."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import TINY
from test_retention import fabricated_run

from andrea_core import cli
from andrea_core.checkpoint import checkpoint_name, encode
from andrea_core.ops.fork import BranchSpec, fork
from andrea_core.ops.pivot import pivot_run_directory
from andrea_core.run.rundir import RunDir


def copy_checkpoint(src: RunDir, step: int, dst: RunDir, new_step: int) -> None:
    ckpt = src.read_checkpoint(step)
    dst.write_atomic(checkpoint_name(new_step), encode(new_step, ckpt.flat))


def test_lineage_prints_phases_and_forks_recursively(tmp_path, capsys):
    url = str(tmp_path / "run")
    run = fabricated_run(url, [100, 200, 300])
    a, b = fork(url, [BranchSpec("a"), BranchSpec("b", {"train.lr": 1e-3})], step=200)
    pivot_run_directory(run, 300, (Path(TINY).parent / "policies" / "default.yaml").read_text())
    copy_checkpoint(run, 300, run, 400)
    (c,) = fork(url, [BranchSpec("c")], step=400)
    copy_checkpoint(RunDir(a), 200, RunDir(a), 500)
    (d,) = fork(a, [BranchSpec("d")], step=500)
    RunDir(b).fs.rm(RunDir(b).root, recursive=True)  # an operator deleted a branch

    assert cli.main(["lineage", url]) == 0
    assert capsys.readouterr().out == (
        f"{url}  newest checkpoint step_000400.bin\n"
        "├── phase 1  steps 0..300  policy stdlib-only  [archive/phase_001_step_000300]\n"
        "│   └── fork at step 200: a, b\n"
        f"│       ├── {a}  newest checkpoint step_000500.bin\n"
        "│       │   └── phase 1  steps 200..500 (current)  policy stdlib-only\n"
        "│       │       └── fork at step 500: d\n"
        f"│       │           └── {d}  newest checkpoint step_000500.bin\n"
        "│       │               └── phase 1  steps 500..500 (current)  policy stdlib-only\n"
        f"│       └── {b}  (missing: no run.yaml there)\n"
        "└── phase 2  steps 300..400 (current)  policy default\n"
        "    └── fork at step 400: c\n"
        f"        └── {c}  newest checkpoint step_000400.bin\n"
        "            └── phase 1  steps 400..400 (current)  policy default\n"
    )

    assert cli.main(["lineage", d]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"{d}  newest checkpoint step_000500.bin",
        f"(branch 'd' forked from {a} at step 500)",
    ]
    assert cli.main(["lineage", url, "--json"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert [(p["number"], p["start"], p["end"]) for p in tree["phases"]] == [(1, 0, 300), (2, 300, None)]
    assert [f["step"] for f in tree["phases"][0]["forks"]] == [200]


def test_lineage_shows_a_branchs_config_changes(tmp_path, capsys):
    url = str(tmp_path / "run")
    fabricated_run(url, [100])
    (b,) = fork(url, [BranchSpec("b", {"train.lr": 1e-3})])
    assert cli.main(["lineage", url]) == 0
    assert f"{b}  train.lr=0.001  newest checkpoint step_000100.bin" in capsys.readouterr().out


def test_a_fork_is_placed_in_its_phase_by_step_whatever_the_wall_clock_said():
    """forks.jsonl's and phase.json's times are wall clocks (issue 48, clocks): a fork made in phase 2
    after the clock was stepped back an hour has a time before phase 1 closed, and was listed under
    phase 1. The step decides; the time only at the boundary step, which either phase can hold."""
    from andrea_core.run.lineage import Fork, Phase, _phase_of

    def tree() -> list[Phase]:
        return [Phase(1, 0, 200, "a", "phase-1", closed_at=10_000.0), Phase(2, 200, None, "b", None)]

    assert _phase_of(tree(), Fork(260, 10_000.0 - 3600, [])).number == 2  # stepped back: still phase 2
    assert _phase_of(tree(), Fork(120, 10_000.0 + 3600, [])).number == 1  # stepped forward: phase 1
    assert _phase_of(tree(), Fork(200, 9_999.0, [])).number == 1  # at the boundary: before the close
    assert _phase_of(tree(), Fork(200, 10_001.0, [])).number == 2  # after it
    assert _phase_of(tree(), Fork(200, None, [])).number == 1
