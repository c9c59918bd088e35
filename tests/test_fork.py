"""`andrea fork --replicates K` (issue 42): K runs a branch identical but for their data order, made as a
fork makes one branch (validated before any write, completed by a rerun), printed one line a branch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_retention import fabricated_run

from andrea_core.config import ConfigError
from andrea_core.ops.fork import BranchSpec
from andrea_core.run.record import read_run
from andrea_core.run.rundir import FORKS, RunDir
from tests.conftest import REPO, _env, andrea

NAMES = ["a", "a.r1", "a.r2", "b", "b.r1", "b.r2"]


def test_andrea_fork_makes_three_replicates_a_branch_by_default(tmp_path):
    parent = fabricated_run(str(tmp_path / "p"), [100])
    out = andrea("fork", parent.url, "--branch", "a", "--branch", "b", "--set", "train.lr=1e-3")
    base = f"{parent.url}-fork100"
    assert out.stdout == f"a: {base}-a\nb: {base}-b\n"  # one line a branch: what to compare
    assert (
        f"  replicate 2: {base}-b.r2\n" in out.stderr and "then `andrea compare` the branches'" in out.stderr
    )
    (line,) = [json.loads(x) for x in parent.read_text(FORKS).splitlines()]
    assert line["names"] == NAMES and line["replicates"] == 3
    assert line["branches"] == [f"{base}-{n}" for n in NAMES]
    runs = [read_run(RunDir(u)) for u in line["branches"]]
    assert [r.config.train.seed for r in runs] == [1337, 1_001_340, 2_001_343] * 2
    assert [r.config.train.lr for r in runs] == [3e-3] * 3 + [1e-3] * 3
    assert [(r.lineage["branch"], r.lineage["replicate"]) for r in runs] == [
        ("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)
    ]  # fmt: skip
    # Every run holds the fork point: each can be trained with `andrea train --run-dir`.
    assert all(RunDir(u).checkpoint_steps() == [100] for u in line["branches"])


@pytest.mark.parametrize("bad", ["0", "65", "x"])
def test_a_bad_replicates_count_is_refused_before_anything_is_written(tmp_path, bad):
    parent = fabricated_run(str(tmp_path / "p"), [100])
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = andrea("fork", parent.url, "--replicates", bad, "--branch", "a", check=False)
    assert proc.returncode == 2
    if bad == "x":
        assert "argument --replicates: invalid int value: 'x'" in proc.stderr
    else:
        assert f"andrea: error: replicates: expected a whole number 1..64, got {bad}" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not parent.exists(FORKS)


def test_one_replicate_is_the_fork_it_always_was(tmp_path):
    parent = fabricated_run(str(tmp_path / "p"), [100])
    out = andrea("fork", parent.url, "--replicates", "1", "--branch", "a")
    (line,) = [json.loads(x) for x in parent.read_text(FORKS).splitlines()]
    assert line["names"] == ["a"] and "replicates" not in line and out.stderr == ""
    lineage = read_run(RunDir(line["branches"][0])).lineage
    assert not {"replicate", "replicates", "seed"} & set(lineage)


def test_a_fork_of_replicates_killed_mid_copy_is_completed_by_a_rerun(tmp_path):
    parent = fabricated_run(str(tmp_path / "p"), [100])
    args = [sys.executable, "-m", "andrea_core", "fork", parent.url, "--branch", "a", "--branch", "b"]
    killed = subprocess.run(args, env={**_env(), "ANDREA_TEST_FORK_KILL_AFTER": "a/step_000100.bin"},
                            cwd=REPO, capture_output=True, timeout=600)  # fmt: skip
    assert killed.returncode == -9
    base = Path(f"{parent.url}-fork100")
    assert not Path(f"{base}-a/run.yaml").exists() and not Path(f"{base}-a.r1").exists()
    andrea("fork", parent.url, "--branch", "a", "--branch", "b")
    assert len(parent.read_text(FORKS).splitlines()) == 1
    assert all(RunDir(f"{base}-{n}").exists("run.yaml") for n in NAMES)


def test_the_audit_flows_replicates_are_checked_before_any_write(tmp_path):
    from tasks.fork import check_audit_parameters

    parent = fabricated_run(str(tmp_path / "p"), [100])
    specs = [BranchSpec("a"), BranchSpec("b", {"train.lr": 1e-3})]
    with pytest.raises(ConfigError, match=r"^replicates: expected a whole number 1\.\.64, got True$"):
        check_audit_parameters.fn(parent.url, specs, 10, 4, None, True)
    check_audit_parameters.fn(parent.url, specs, 10, 4, None, 2)
    assert not parent.exists(FORKS)
