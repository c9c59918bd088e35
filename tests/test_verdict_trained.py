"""The verdict on real branches (issue 42): andrea-tiny forked at step 100 (a copy of the session's
reference run), every run trained 100 more steps in this process. Two branches identical but for
train.seed (A/A), scored on 256 held-out sequences: today's rule (one run a branch, a winner above 2
paired held-out standard errors) names a winner here, the verdict names none. lr 1e-4 against the
default (A/B, the same seeds): told apart, the right way round, on the same 256 sequences (at 32 this
fork's lead was within noise: bench/README.md, power at 32). bench/verdict_calibration.py measures
the rates over many forks; this pins one of each."""

from __future__ import annotations

import math
import shutil

import pytest

from andrea_core.ops.compare import compare_branches
from andrea_core.ops.fork import BranchSpec, fork
from andrea_core.run.rundir import RunDir

pytestmark = pytest.mark.slow  # nine runs of 100 steps: ~2 minutes on an idle 2-core machine

SEEDS = (11, 12)
ONE_THREAD = {"train.num_threads": 1}  # on a small shared machine one thread is fastest


@pytest.fixture(scope="module")
def trained_fork(tiny_reference, tmp_path_factory):
    from andrea_core.train.trainer import Trainer

    parent = RunDir(str(shutil.copytree(tiny_reference, tmp_path_factory.mktemp("verdict") / "parent")))
    specs = [
        BranchSpec("a", {"train.seed": SEEDS[0], **ONE_THREAD}),
        BranchSpec("b", {"train.seed": SEEDS[1], **ONE_THREAD}),
        BranchSpec("low-lr", {"train.seed": SEEDS[0], "train.lr": 1e-4, **ONE_THREAD}),
    ]
    urls = fork(parent.url, specs, 100, log=lambda m: None, replicates=3)
    for url in urls:
        assert Trainer(url, max_steps=200, device="cpu", log=lambda m: None).train().step == 200
    return parent, {s.name: urls[3 * i] for i, s in enumerate(specs)}


def todays_winner(c, first: str, second: str) -> str | None:
    """Today's rule on replicate 0 of each branch: the paired held-out margin over 2 standard errors."""
    diff = c.branch(second).runs[0].per_sequence - c.branch(first).runs[0].per_sequence
    margin, se = diff.mean(), diff.std(ddof=1) / math.sqrt(diff.size)
    return None if abs(margin) <= 2 * se else (first if margin > 0 else second)


def test_an_aa_fork_at_256_held_out_sequences_names_no_winner(trained_fork):
    parent, urls = trained_fork
    c = compare_branches(parent.url, [urls["a"], urls["b"]], 100, val_sequences=256, warn=lambda m: None)
    assert c.step == 200 and [b.replicates for b in c.branches] == [3, 3]
    assert todays_winner(c, "a", "b") is not None, "today's rule names a winner of this A/A fork"
    assert c.winner is None and c.verdict.startswith("no winner: within noise")
    # Training is the larger part of the noise: what one fixed held-out sample could not see.
    assert c.noise_training > c.noise_held_out


def test_an_ab_fork_is_told_apart_the_right_way_round(trained_fork):
    parent, urls = trained_fork
    c = compare_branches(parent.url, [urls["low-lr"], urls["a"]], 100, val_sequences=256, warn=lambda m: None)
    assert c.winner == "a" and c.runner_up == "low-lr"
    assert c.margin > c.critical * c.noise and c.df == 4
