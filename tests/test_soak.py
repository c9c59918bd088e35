"""The chaos soak's CI version (issue 28, issue 45.5): bench/soak.py's seeded schedule with every fault
kind of a store exactly once, over one run, with zero invariant violations, and each fault that says what
it did shown to have done it. Locally (on a tmpfs seen through bench/powercut.py) 29 kinds: the 14
common ones, disk-full, the power-cut layer's 7 where FUSE mounts (issue 48), the machine's 4 (clock
steps, a suspend, an OOM kill, a full cache; issue 48 items 4-5) and the 3 features under chaos (issue
48 item 6); on moto (tests/test_soak_s3.py) 25: the 14 common ones, s3-deny, s3-lost-reply, the
relay's 5 storage faults (issue 48 item 3), cache-full (an S3 run's cache holds its appended files'
mirrors) and the 3 features; the other machine kinds, drawn on S3 by bench/soak.py too, are the
trainer's machine's and thrown here by the local round. One round a store: each round trains its
run and its reference from zero, prepares its data and checks its end once, so a kind costs its fault
alone; its trainers and commands start warm (`bench/soak.py --warm`: tests/warm_launcher.py's fork
servers, ~2 s of CPU less a start; ANDREA_SOAK_WARM=0 starts them cold, as a user's). Its purpose is that
the harness works and a fault of every kind passes; the long rounds (`--faults 40` and `--faults 1000`)
and their figures stay in bench/README.md. Each store in a module of its own, so that the two go to
the suite's two workers side by side."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, library_run, wait_for

pytestmark = pytest.mark.slow
sys.path.insert(0, str(REPO / "bench"))
from powercut import fuse_unavailable  # noqa: E402

NO_LAYER = fuse_unavailable()
COMMON = ["sigkill", "sigkill-write", "sigkill-renewal", "sigkill-startup", "sigterm", "sigusr1"]
COMMON += ["sigstop-short", "sigstop-long", "sigterm-waiting", "pivot", "abandon", "fork", "readers"]
COMMON += ["second-trainer"]
LAYER = ["power-cut", "eio-write", "eio-fsync", "eio-read", "short-write", "bitrot", "bitflip"]
# The machine's (issue 48, items 4-5): root for the tmpfs and the memory cgroup, cc for the clock shim.
SYSTEM = ["clock-step", "suspend", "oom-trainer", "cache-full"]
# The relay's (issue 48 item 3): a store slow, throttled, hung, partitioned, a complete's reply lost.
STORAGE = ["s3-slow", "s3-503", "s3-hang", "s3-partition", "lost-complete"]
# Features under chaos (issue 48 item 6), on both stores.
FEATURES = ["guard-rollback", "pivot-remote", "data-change"]
KINDS = {
    "local": [*COMMON, "disk-full", *([] if NO_LAYER else LAYER), *SYSTEM, *FEATURES],
    "s3": [*COMMON, "s3-deny", "s3-lost-reply", *STORAGE, "cache-full", *FEATURES],
}
# bench/soak.py's S3 kinds the S3 round leaves to the local one: the trainer's machine's clocks and
# memory do not depend on where its run lives (figures on S3: bench/README.md).
S3_IN_THE_LOCAL_ROUND = ["clock-step", "suspend", "oom-trainer"]


# Each round's seed, ranked by bench/soak_ci_seeds.py: of seeds 1-20,000, a schedule of KINDS[store]
# that waits little (its model: the drawn sleeps, pauses, outages and hangs, a kill's rerun, the steps
# a fault waits for) among those that still kill every pivot, fork, remote pivot and guard rollback
# partway, as seed 1 did. Modelled seconds, seed 1 -> SEEDS: local 66.8 -> 51.2 (the best 48.1), S3
# 113.1 -> 93.9 (the best). A seed is a schedule, not a figure: should the soak draw differently one
# day, these still throw each kind once (rerun the script).
SEEDS = {"local": 16422, "s3": 11723}


def run_soak(
    store: str, kinds: list[str], each: int, work: Path, timeout: float = 3600
) -> tuple[int, str, dict]:
    """bench/soak.py --faults each*len(kinds) --seed SEEDS[store] --kinds KINDS on `store`: its exit
    status, its output (also in WORK.out, beside its folder, for the post-mortem), and its table
    (kind -> (injected, survived, violations), every kind of the store: 0 for those not drawn)."""
    # --warm: the trainers and commands forked by a fork server with torch imported (tests/warm_launcher.py);
    # ANDREA_SOAK_WARM=0: cold. (The crossed status of 2026-12-06 was the soak's own: it judged
    # self.procs[-1], the reference thread's pivot; test_a_status_read_is_judged_on_its_own_output...)
    warm = [] if os.environ.get("ANDREA_SOAK_WARM") == "0" else ["--warm"]
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "soak.py"),
            *warm,
            "--faults",
            str(each * len(kinds)),
            "--seed",
            str(SEEDS[store]),
            "--store",
            store,
            "--kinds",
            ",".join(kinds),
            "--work",
            str(work),
            "--ref-ahead",  # the reference keeps up a grid step at a time (100): a data change waits less
            "100",
        ],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    work.with_name(work.name + ".out").write_text(out)
    table = re.findall(r"^([a-z0-9-]+)\s+(\d+)\s+(\d+)\s+[\d.]+\s+(.+)$", out, re.M)
    return proc.returncode, out, {kind: tuple(rest) for kind, *rest in table}


def did(out: str, kind: str) -> dict[str, str]:
    """The soak's 'what the faults did' line of `kind`: name -> value."""
    m = re.search(rf"^  {kind}: (.*)$", out, re.M)
    assert m, (kind, out[-6000:])
    items = re.split(r", (?![^()]*\))", m.group(1))  # not at a comma inside a name's parentheses
    return dict(re.fullmatch(r"(.*) (\S+)", item).groups() for item in items)


def soak(store: str, kinds: list[str], work: Path) -> str:
    """bench/soak.py on `store`: every kind of `kinds` injected once and survived, 0 violations, and the
    faults of the kinds drawn shown to have done what they claim. Its output."""
    returncode, out, table = run_soak(store, kinds, 1, work)
    # Exactly `kinds` drawn (the table's other kinds at 0).
    drawn = {kind: row for kind, row in table.items() if row[0] != "0"}
    assert sorted(drawn) == sorted(kinds), out[-6000:]
    for kind, row in drawn.items():
        assert row == ("1", "1", "-"), (kind, out[-6000:])
    assert re.search(r"^violations: 0;", out, re.M), out[-6000:]
    assert returncode == 0, out[-6000:]
    if os.environ.get("ANDREA_SOAK_WARM") != "0":  # --warm was given, and its starts were forked
        launched = re.search(r"^warm launcher: (\d+) starts warm, (\d+) cold", out, re.M)
        assert launched and int(launched.group(1)) > 0, out[-6000:]
    features_did_what_they_claim(out)
    if set(STORAGE) & set(kinds):
        storage_did_what_it_claims(out)
    unreached = [
        why for kind in sorted(set(SYSTEM) & set(kinds)) if (why := SYSTEM_CLAIMS[kind](did(out, kind)))
    ]
    if unreached:
        pytest.skip(f"the round passed; a claim not reached: {unreached}")
    return out


def features_did_what_they_claim(out: str) -> None:
    """Each feature fault's own outcome (issue 48 item 6), from the soak's 'what the faults did' lines,
    and (11): guard.jsonl holds the one rollback, TensorBoard shows steps, each the history's."""
    guard = did(out, "guard-rollback")
    assert guard["rolled back to a checkpoint kept before the spike"] == "1", guard
    pivot = did(out, "pivot-remote")
    assert pivot[".loss.json a byte prefix of before"] == "1", pivot
    assert sum(int(v) for k, v in pivot.items() if k.startswith("pivoted --at ")) == 1, pivot
    data = did(out, "data-change")
    outcomes = ("seen in data.jsonl and warned", "not in force")
    assert sum(int(v) for k, v in data.items() if k.endswith(outcomes)) == 1, data
    views = re.search(r"^\(11\) guard.jsonl and TensorBoard against .loss.json: (.*)$", out, re.M)
    assert (
        views and "'rollbacks': 1," in views.group(1) and "'train/loss steps shown': 0" not in views.group(1)
    )


def storage_did_what_it_claims(out: str) -> None:
    """The relay's faults (issue 48 item 3), each once: the dropped CompleteMultipartUpload reply was a
    committed object, the partition ended in a takeover of the still-running holder, the store did
    answer late and did answer 503, a request was held."""
    lost = did(out, "lost-complete")
    assert int(lost["replies dropped"]) == int(lost["object there with the dropped reply's ETag"]) >= 1, lost
    part = did(out, "s3-partition")
    taken = sum(int(v) for k, v in part.items() if k.startswith("taken over ("))
    assert taken == 1 and int(part["requests cut off"]) > 0, part
    assert int(did(out, "s3-503")["503 answered"]) > 0
    assert int(did(out, "s3-slow")["requests delayed"]) > 0
    assert int(did(out, "s3-hang").get("seconds held", "0").split(".")[0]) > 0


def _clock_step(step: dict) -> None:
    """The trainer's log stamps and its lease renewals carry the stepped wall clock."""
    assert step["trainer's clock seen stepped"] == "1", step
    assert step["lease renewals stamped by the stepped clock"] == "1", step


def _suspend(suspend: dict) -> None:
    """The suspended holder was taken over and exited 2 when it woke, its monotonic clock stopped."""
    assert suspend["taken over"] == suspend["woken holder exited 2"] == "1", suspend
    assert float(suspend["seconds the monotonic clock stopped"]) > 3.0, suspend


def _oom(oom: dict) -> str | None:
    """The kernel's OOM killer killed the trainer in its memory cgroup first, not its larger supervisor,
    which survived and said so. An episode in which the kernel killed again after the trainer (the
    hog's retried charge: tests/test_oom.py's decision) is named and thrown again, at most 3; after 3
    the supervisor's part is not reached: why, for the round to be skipped at its end (as test_oom's)."""
    episodes = int(oom["killed by the kernel"])
    assert 1 <= episodes <= 3 and oom["the kernel log names the trainer first"] == str(episodes), oom
    again = sum(int(v) for k, v in oom.items() if k.startswith("episodes the kernel killed again after"))
    if "the supervisor not judged (3 episodes, each killed twice)" in oom:
        assert episodes == again == 3, oom
        return f"the kernel killed twice in each of 3 OOM episodes, the trainer first: {oom}"
    assert again == episodes - 1, oom
    assert oom["supervisor said out of memory"] == oom["supervisor survived"] == "1", oom
    return None


def _cache_full(cache: dict) -> None:
    """A trainer resumed and trained with the cache folder full, and trained on as it filled under it
    (on S3 its loss log's mirror there: the end's invariants check what it published)."""
    assert cache["resumed and trained on a full cache"] == "1", cache
    assert cache["trained on as the cache filled under it"] == "1", cache


SYSTEM_CLAIMS = {
    "clock-step": _clock_step,
    "suspend": _suspend,
    "oom-trainer": _oom,
    "cache-full": _cache_full,
}


def test_a_did_line_with_a_comma_inside_a_name_is_read_whole():
    """CI on 2026-12-07: the kernel killed twice in each of 3 OOM episodes, and "the supervisor not judged
    (3 episodes, each killed twice) 1" split at its inner comma failed the round (3 != 2) where it should
    have been skipped, naming why."""
    line = "  oom-trainer: killed by the kernel 3, the kernel log names the trainer first 3, episodes the "
    line += "kernel killed again after the trainer (the supervisor) 3, the supervisor not judged (3 "
    line += "episodes, each killed twice) 1"
    oom = did(f"x\n{line}\ny\n", "oom-trainer")
    assert oom == {
        "killed by the kernel": "3",
        "the kernel log names the trainer first": "3",
        "episodes the kernel killed again after the trainer (the supervisor)": "3",
        "the supervisor not judged (3 episodes, each killed twice)": "1",
    }
    assert _oom(oom).startswith("the kernel killed twice in each of 3 OOM episodes, the trainer first")


def test_every_kind_the_soak_draws_is_thrown_by_the_suite():
    """bench/soak.py's kinds, each thrown in CI by a store's round (KINDS): a kind added to the soak and
    to neither round fails here."""
    import soak as bench_soak

    assert set(bench_soak.KINDS["local"]) - bench_soak.OPT_IN == {
        *COMMON,
        "disk-full",
        *LAYER,
        *SYSTEM,
        *FEATURES,
    }
    assert set(bench_soak.KINDS["s3"]) == set(KINDS["s3"]) | set(S3_IN_THE_LOCAL_ROUND)
    assert set(S3_IN_THE_LOCAL_ROUND) <= set(KINDS["local"])
    assert set(SYSTEM_CLAIMS) == set(SYSTEM), "each machine kind's claim is checked"


def test_a_status_read_is_judged_on_its_own_output_while_another_thread_spawns(tmp_path_factory, tmp_path):
    """bench/soak.py's reader (invariant (10)) judges the `andrea status` it started, even when the
    reference thread starts a command of its own while that status runs: the soak once judged
    self.procs[-1], the last process any thread started, and a CI round (2026-12-06, moto) reported
    the reference's `andrea pivot` output as the reader's status. Here the sigkill fault's reader asks
    about a run that has stopped while a second thread starts an `andrea status` of a folder that
    holds no run (no state line) as soon as the reader's process is started. Real processes, cold. The
    run: the session library's andrea-tiny at step 10 (a copy; any run trained to its end will do)."""
    import argparse
    import threading
    import types
    from collections import Counter

    from soak import Soak

    run = library_run(tmp_path_factory, tmp_path / "run", 10)  # test_distributed's too: built once
    (tmp_path / "empty").mkdir()
    soak = Soak.__new__(Soak)  # the plumbing spawn/tool/f_sigkill read, without a store's mounts
    soak.args = argparse.Namespace(nice=0, warm=False)
    soak.store = types.SimpleNamespace(run_url=str(run), env=lambda host: {})
    soak.host, soak.cache, soak.fault_i = "soak-a", tmp_path / "cache", 0
    soak.poisoned, soak.trainer = [], None
    soak.procs, soak.violations, soak.readers, soak.launcher = [], [], Counter(), None
    other = []

    def beside() -> None:  # the reference thread's start, while the reader's status runs
        wait_for(lambda: soak.procs, 60, "the reader's status started", every=0.001)
        other.append(soak.spawn("ref-status", ["status", str(tmp_path / "empty")], host="soak-ref"))

    thread = threading.Thread(target=beside)
    thread.start()
    soak.f_sigkill({"after_s": 0})
    thread.join(120)
    assert other and other[0].wait(120) is not None and soak.procs == [soak.procs[0], other[0]]
    said = re.search(r": (STOPPED|COMPLETED): ", soak.procs[0].text())  # a run trained to its end
    assert said, soak.procs[0].text()
    state = said.group(1)
    assert soak.readers == Counter({f"dead -> {state}": 1}), (soak.readers, other[0].text())
    assert soak.violations == []


def test_a_seeded_fault_of_every_kind_on_a_tmpfs_breaks_no_invariant(tmp_path):
    """The local round: every kind once, the machine's too where they can run (else the round runs
    without them and the test is skipped at its end, naming them and why)."""
    if os.geteuid() != 0:
        pytest.skip("the soak mounts a tmpfs of its own (needs root; CI runs as root)")
    from soak import system_unavailable

    missing = system_unavailable()
    soak("local", [k for k in KINDS["local"] if k not in missing], tmp_path / "soak")
    if missing:
        pytest.skip(f"the round passed; soak kinds that cannot run here were left out: {missing}")
