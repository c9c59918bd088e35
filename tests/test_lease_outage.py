"""A storage outage longer than a lease (issue 23.2): a full tmpfs (not a byte left) or a store denying
s3:PutObject (IAM policy) for four times the lease's ttl, at the default lease timings (renew 10 s,
ttl 30 s: lock.DEFAULT_LEASE_*) scaled by 0.2, so that the test takes minutes less: renew 2 s, ttl
6 s, a 24 s outage (120 s at the defaults; longer than the 20 s that ended training before). The
trainer's lock records the timings it ran under, and the test checks them. A failed renewal is not a
lost lease: training goes on, nothing is published meanwhile, the first checkpoint boundary after the
outage writes a valid checkpoint, and the trainer exits 0 at the end. README.md says the same.
The two outages are ridden out at once, each by its own trainer (the module's `outages`), and each
test claims its own ride's outcome: the module waits out one 24 s outage, not two."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from test_full_disk import (
    DENY_PUTS,
    fill,
    loss_lines_whole_but_last_of,
    progress_step,
    store_with_iam,
    tmpfs_disk,
)

from andrea_core.checkpoint import CheckpointError
from andrea_core.run.lock import DEFAULT_LEASE_RENEW_S, DEFAULT_LEASE_TTL_S, LEASE_RENEW_ENV, LEASE_TTL_ENV
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir
from tests.conftest import _env, start_trainer, wait_for
from tests.tiny import tiny_config

EVERY = 20
RENEW_S, TTL_S = DEFAULT_LEASE_RENEW_S * 2 / 10, DEFAULT_LEASE_TTL_S * 2 / 10  # the defaults x 0.2
OUTAGE_S = 4 * TTL_S
LEASE = {LEASE_RENEW_ENV: f"{RENEW_S:g}", LEASE_TTL_ENV: f"{TTL_S:g}"}


def valid_steps(run: RunDir) -> dict[int, bytes]:
    out = {}
    for step in run.checkpoint_steps():
        try:
            run.read_checkpoint(step)
            out[step] = run.read_bytes(f"step_{step:06d}.bin")
        except (CheckpointError, FileNotFoundError):
            pass
    return out


def ride_out_an_outage(run: RunDir, tmp_path, start_outage, end_outage) -> None:
    cfg = tiny_config(tmp_path, train__checkpoint_every=EVERY, train__max_steps=100_000, train__log_every=5)
    log = tmp_path / "trainer.log"
    env = {k: v for k, v in _env().items() if not k.startswith("ANDREA_LEASE_")} | LEASE
    args = ("--config", cfg, "--run-dir", run.url, "--device", "cpu", "--pace", "0.03")
    trainer = start_trainer(*args, env=env, log=log)
    try:
        # Listed first, then read: valid_steps reads and checks every checkpoint (on moto too), which a
        # 20 ms poll would do hundreds of times, on the CPU the trainers need.
        two = lambda: len(run.checkpoint_steps()) >= 2 and len(valid_steps(run)) >= 2  # noqa: E731
        wait_for(two, timeout=300, what="two checkpoints", every=0.2)
        held = json.loads(run.read_bytes(".trainer.json"))
        assert (held["lease_renew_s"], held["lease_ttl_s"]) == (RENEW_S, TTL_S) == (2, 6), held
        start_outage()
        t0 = time.monotonic()
        kept = valid_steps(run)
        at_start = progress_step(log)
        while time.monotonic() - t0 < OUTAGE_S:
            assert trainer.poll() is None, f"the trainer exited during the outage:\n{log.read_text()[-3000:]}"
            time.sleep(1)
        text = log.read_text()
        assert "lost its lease" not in text and "could not be confirmed" not in text, text[-3000:]
        assert "the lease renewal" in text and "nothing is published until a renewal goes through" in text
        assert progress_step(log) >= at_start + 5 * EVERY, "training did not go on through the outage"
        assert valid_steps(run) == kept, "something was published during the outage"

        end_outage()
        ended_at = progress_step(log)
        after = lambda: max(run.checkpoint_steps(), default=0) > ended_at and max(valid_steps(run)) > ended_at  # noqa: E731
        wait_for(after, timeout=300, what="a checkpoint after the outage", every=0.2)
        first = min(s for s in valid_steps(run) if s > max(kept))
        # The first boundary after the outage (progress lines lag by up to log_every steps).
        assert first <= (ended_at // EVERY + 1) * EVERY + EVERY, (first, ended_at)
        renewed = lambda: "is renewed again" in log.read_text()  # noqa: E731
        wait_for(renewed, timeout=60, what="the renewal after it", every=0.2)
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    print(f"outage of {OUTAGE_S:g}s ridden out; first checkpoint after it: step {first} (ended ~{ended_at})")
    held = json.loads(run.read_bytes(".trainer.json"))
    assert held["released"] and held["generation"] == 1, "the same lease throughout"
    loss_lines_whole_but_last_of(run.read_bytes(".loss.json"))
    history = [e.step for e in read_history(run)]
    assert history == list(range(1, history[-1] + 1)), "the loss history has a gap"


def _full_disk(tmp_path) -> None:
    with tmpfs_disk(tmp_path / "disk") as disk:
        filler = []
        ride_out_an_outage(
            RunDir(str(disk / "run")),
            tmp_path,
            lambda: filler.append(fill(disk, 0)),
            lambda: filler[0].unlink(),
        )


def _store_refusing_puts(tmp_path, iam) -> None:
    policy = json.dumps(DENY_PUTS)
    ride_out_an_outage(
        RunDir("s3://refusing/run"),
        tmp_path,
        lambda: iam.put_user_policy(UserName="trainer", PolicyName="deny-puts", PolicyDocument=policy),
        lambda: iam.delete_user_policy(UserName="trainer", PolicyName="deny-puts"),
    )


@pytest.fixture(scope="module")
def outages(tmp_path_factory) -> dict[str, BaseException | None]:
    """Both outages ridden out at the same time, each by its own trainer on its own thread: what each
    ride raised (an assertion, a skip), or None. The store's keys are in this process's environment
    (and so in both trainers') throughout; the full disk's trainer has no use for them."""
    outcome: dict[str, BaseException | None] = {}

    def ride(name: str, how, *args) -> None:
        try:
            how(tmp_path_factory.mktemp(name), *args)
            outcome[name] = None
        except BaseException as e:  # noqa: BLE001 (handed to the test that claims it)
            outcome[name] = e

    with pytest.MonkeyPatch.context() as monkeypatch, store_with_iam(monkeypatch) as (iam, _):
        rides = [
            threading.Thread(target=ride, args=("full-disk", _full_disk)),
            threading.Thread(target=ride, args=("refusing-puts", _store_refusing_puts, iam)),
        ]
        for thread in rides:
            thread.start()
        for thread in rides:
            thread.join()
    return outcome


def _claim(outages: dict[str, BaseException | None], name: str) -> None:
    if outages[name] is not None:
        raise outages[name]


@pytest.mark.slow
def test_a_full_disk_for_longer_than_a_lease_does_not_end_training(outages):
    _claim(outages, "full-disk")


@pytest.mark.slow
def test_a_store_refusing_puts_for_longer_than_a_lease_does_not_end_training(outages):
    _claim(outages, "refusing-puts")
