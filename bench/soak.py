"""A chaos soak (issue 28): a seeded schedule of every fault the project claims to survive, thrown at one
long andrea-tiny run, and the invariants checked against a reference run that makes the same pivots and
forks at the same steps with no fault.

Everything is real: trainers are `python -m andrea_core train` processes, signals are kill(2), the disk
is a tmpfs that is filled for real, the object store is the tests' moto server (tests/moto_s3.py) whose
IAM policy denies puts, and a lost reply is a relay in front of it that forwards a put to the store and
then drops the connection instead of the answer. The soak itself is the supervisor: after a fault it
restarts the trainer as systemd's Restart=on-failure (or an operator) would.

    python bench/soak.py --faults 1000 --seed 1              # local tmpfs run directory (needs root)
    python bench/soak.py --faults 1000 --seed 1 --store s3   # on moto

The invariants (issue 28): (1) the final checkpoint (and every checkpoint both runs kept) is
byte-identical to the reference's; (2) the canonical loss history equals the reference's; (3) every
archived phase holds the reference's sidecars (policy.yaml byte for byte, each step's bandit state and
audit equal); (4) every fork branch is complete, its fork point kept; (5) never two writers: the lock's
generation never goes down, `.loss.json`'s segments never go back in file order (a paused, taken-over
trainer appending after its successor), and a trainer that lost its lease publishes no checkpoint after
the takeover (from its log, stamped as read) and exits 2; (6) nothing outside the run directory and its
branches was created or changed; (7) every stop, takeover, pivot, fork and reader ends within its bound;
(8) retention kept what its rules keep (the required checkpoints from the store's own listings during the
soak as well as the trainers' logs); (9) a power cut keeps every checkpoint a trainer logged as
written, byte for byte; (10) invariants of their own (issue 48, item 7): every checkpoint the run ends
with read by the soak's own reader of the format, itself checked first on the hand-made vectors
(../shared/testdata/checkpoints), and `andrea status` never says CRASHED of a trainer alive throughout,
nor TRAINING with none alive. `--seed` draws the same schedule; a violation prints the schedule's prefix up to
the fault that showed it.

The local store's run directory is seen through the power-cut layer (bench/powercut.py, issue 48): a
FUSE filesystem over the tmpfs that drops what was not fsynced at a "power-cut" and fails writes,
fsyncs and reads with EIO, writes short, and tears or bit-flips a checkpoint ("eio-write", "eio-fsync",
"eio-read", "short-write", "bitrot", "bitflip"); `--no-layer` (or no FUSE here) leaves those kinds out.
On S3 every process reaches moto through its host's endpoint of a relay (tests/s3_relay.py) that loses
replies, makes the store slow ("s3-slow") or throttled ("s3-503"), holds a request past the lease's ttl
("s3-hang"), partitions the holder's host while another takes over ("s3-partition"), and drops a
CompleteMultipartUpload reply after the server applied it ("lost-complete"). The machine's kinds
(clock-step, suspend, oom-trainer, cache-full) run on both stores: on S3 the cache folder that fills up
also holds the mirrors of the run's appended files.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "bench")]

from s3_relay import Relay, RelayFaults  # noqa: E402 (tests/s3_relay.py)

from andrea_core.checkpoint import checkpoint_name  # noqa: E402
from andrea_core.run.loss_log import newest_segments, parse_entries  # noqa: E402
from andrea_core.run.rundir import LOCK, REFUSED  # noqa: E402
from andrea_core.run.store import REPLACE_WAIT_S  # noqa: E402

PYTHON = sys.executable
RENEW_S, TTL_S = 1.0, 3.0  # the lease's timing for every process of the soak (ANDREA_LEASE_*)
TERM_BOUND = 90.0  # SIGTERM to exit 0: one step and one checkpoint (plus a loaded machine's slack)
# A paused holder's lease taken over after it stops: the ttl, a renewal, the watcher's poll, the
# flock's wait (a holder paused inside its renewal) and a loaded machine's slack.
TAKEOVER_BOUND = TTL_S + RENEW_S + 1.0 + REPLACE_WAIT_S + 2.5
TOOL_BOUND = 240.0  # a pivot, a fork, a reader
HOSTS = ("soak-a", "soak-b")  # ANDREA_TEST_HOST: two "machines" sharing the run directory

COMMON = ["sigkill", "sigkill-write", "sigkill-renewal", "sigkill-startup", "sigterm", "sigusr1"]
COMMON += ["sigstop-short", "sigstop-long", "sigterm-waiting", "pivot", "abandon", "fork", "readers"]
COMMON += ["second-trainer"]
# The power-cut layer's (bench/powercut.py): the local store's run directory is a FUSE mount over its tmpfs.
LAYER = ["power-cut", "eio-write", "eio-fsync", "eio-read", "short-write", "bitrot", "bitflip"]
# The relay's (tests/s3_relay.py, issue 48 item 3): storage slow, throttled, hung, partitioned from the
# holder's host, and a CompleteMultipartUpload applied with its reply lost.
STORAGE = ["s3-slow", "s3-503", "s3-hang", "s3-partition", "lost-complete"]
# The machine's (issue 48, items 4-5): the wall clock stepped and a suspend (bench/clockshim.c in every
# process of a host), the kernel's OOM killer in a memory cgroup (tests/memcg.py), a full cache folder.
# On both stores: a trainer's machine faults do not depend on where its run lives, and an S3 run's
# cache folder holds its token shards and the mirrors of its appended files (rundir.MirroredAppendFile).
SYSTEM = ["clock-step", "suspend", "oom-trainer", "cache-full"]
# Features under chaos (issue 48 item 6), on both stores: a guard divergence with a crash around its
# rollback, and a pivot asked from the other host (--at now/boundary, --restart or not) with faults
# landing mid-pivot.
FEATURES = ["guard-rollback", "pivot-remote", "data-change"]
KINDS = {
    "local": [*COMMON, "disk-full", *LAYER, *SYSTEM, *FEATURES],
    "s3": [*COMMON, "s3-deny", "s3-lost-reply", *STORAGE, *SYSTEM, *FEATURES],
}
# Drawn only when named in --kinds: a kind that meets a known, open product defect. None now: `bitflip`
# was one until the checkpoint carried a checksum (issue 48; checkpoint.py's trailer).
OPT_IN: set[str] = set()
# The run's files a disk error is aimed at (a substring of the path: a checkpoint's temporary name too).
# A file is written as `.NAME.tmp.PID.RANDOM` (rundir._create_temp), then renamed: a regular expression
# on the layer's path of the run's own file (not a branch's) and its temporaries.
DISK_TARGETS = ["step_", "loss.json", "state.json", "trainer.json", "samples.json"]
PIVOT_KILLS = [
    None,
    "checkpointed",
    "stopped",
    "archive-move-1",
    "archived",
    "loss-kept",
    "installed",
    "finished",  # complete (journal cleared), not yet exited: the rerun must find it done
    "random",
]
HALF_DONE = ["stopped", "archive-move-1", "archived", "loss-kept"]
POLICIES = ("tiny-mix", "stdlib-only")  # the run's policy and the one it pivots to and back from


def draw_schedule(seed: int, n: int, store: str, every: int, kinds: list[str] | None = None) -> list[dict]:
    """The faults, drawn from `seed` alone: the same seed gives the same schedule (`kinds`: only those)."""
    rng = random.Random(seed)
    out, deck = [], []
    for i in range(n):
        if not deck:  # every kind once per round, in a drawn order: 40 faults throw each kind twice or more
            deck = [k for k in KINDS[store] if (k in kinds if kinds else k not in OPT_IN)]
            rng.shuffle(deck)
        kind = deck.pop()
        f = {"i": i, "kind": kind, "gap_steps": rng.randint(0, 2 * every)}
        if kind in ("sigkill", "sigkill-startup"):
            f["after_s"] = round(rng.uniform(0.0, 4.0), 2)
        elif kind == "sigkill-write":
            f["after_s"] = round(rng.uniform(0.0, 0.08), 3)
        elif kind == "sigstop-short":
            # A pause costs the holder nothing while shorter than its lease's margin, ttl - renew, less
            # its renewal's own time (lock.Lease): 0.6 of the margin leaves 0.8 s for that renewal. (Up
            # to 0.6 x ttl, fault 140 of 2026-12-06 paused 1.54 s, leaving 0.46 s at a trainer's start
            # on a loaded machine: the waiter took over, as the lease allows.)
            f["stop_s"] = round(rng.uniform(0.2, 0.6 * (TTL_S - RENEW_S)), 2)
        elif kind == "sigstop-long":
            f["stop_s"] = round(rng.uniform(TTL_S + 2.0, 3 * TTL_S + 2.0), 2)
        elif kind in ("disk-full", "s3-deny"):
            # Alternately shorter and longer than the lease's ttl, and (the disk) with room for the small
            # files or not a byte left: every pairing within four outages.
            n = sum(g["kind"] == kind for g in out)
            short, long_ = rng.uniform(0.5, TTL_S / 2), rng.uniform(TTL_S + 1, 4 * TTL_S)
            f["for_s"] = round(long_ if n % 2 else short, 2)
            f["leave"] = 0 if n // 2 % 2 else 256 * 1024
        elif kind == "s3-lost-reply":
            f["key"] = rng.choice(["step_", ".state.json", ".trainer.json", ".loss.json", ".samples.json"])
        elif kind == "s3-slow":
            # Every request held 0.05-0.5 s, up to 0.6-2.5 s: some past the lease's renew interval.
            f["for_s"] = round(rng.uniform(4.0, 12.0), 2)
            f["latency"] = (round(rng.uniform(0.05, 0.5), 2), round(rng.uniform(0.6, 2.5 * RENEW_S), 2))
        elif kind == "s3-503":
            f["for_s"] = round(rng.uniform(3.0, 10.0), 2)
            f["fraction"] = rng.choice([0.1, 0.3, 0.5])
        elif kind == "s3-hang":
            # One request of the holder held past the ttl, then delivered: a renewal (with a trainer of
            # the other host watching the lease, it takes over; the renewal lands after), a complete,
            # or whatever comes next.
            f["match"] = rng.choice(["trainer", "complete", "any"])
            f["hang_s"] = round(rng.uniform(TTL_S + 1.5, 3 * TTL_S + 2.0), 2)
            f["waiter"] = f["match"] == "trainer" or rng.random() < 0.5
        elif kind == "s3-partition":
            # Every request of the holder's host refused (or held, delivered once healed), reads included,
            # while a trainer of the other host takes the run over; healed after_s later.
            f["mode"] = rng.choice(["refuse", "hang"])
            f["after_s"] = round(rng.uniform(1.0, 6.0), 2)
        elif kind == "lost-complete":
            f["key"] = rng.choice(["step_", ".state.json", ".samples.json", ".loss.json"])
            f["retry"] = rng.choice(["gone", "idempotent"])
        elif kind == "power-cut":
            # A random moment, or aimed: right after a checkpoint boundary (its writes in flight), or a
            # pivot or a fork under way (cut at kill_s into it).
            f["at"] = rng.choice(["random", "checkpoint", "pivot", "fork"])
            f["after_s"] = round(rng.uniform(0.0, 0.08) if f["at"] == "checkpoint" else rng.uniform(0, 4), 3)
        elif kind in ("eio-write", "eio-fsync", "short-write"):
            f["match"] = rng.choice(DISK_TARGETS)
            f["count"] = rng.choice([1, 1, 3])
        elif kind == "eio-read":
            f["match"] = rng.choice(["step_", "loss.json", "state.json", "run.yaml", "policy.yaml"])
        elif kind in ("bitrot", "bitflip"):
            f["how"] = "tear" if kind == "bitrot" else "flip"
            f["at"] = round(rng.uniform(0.0, 1.0), 3)
        elif kind == "pivot":
            f["kill"] = rng.choice(PIVOT_KILLS)
            f["kill_s"] = round(rng.uniform(0.5, 8.0), 2)
        elif kind == "abandon":
            f["kill"] = rng.choice(HALF_DONE)
        elif kind == "fork":
            f["kill"] = rng.choice(["checkpoint", "random", None])
            f["kill_s"] = round(rng.uniform(0.2, 3.0), 2)
        elif kind in FEATURES:
            f.update(draw_feature(rng, kind))
        f.update(draw_system(rng, kind))
        out.append(f)
    return out


def draw_system(rng: random.Random, kind: str) -> dict:
    """The SYSTEM kinds' parameters (nothing drawn for the others: their schedules stay as they were)."""
    if kind == "clock-step":  # back or forward, by half a minute (inside status's window) up to a day
        return {"shift_s": rng.choice([-1, 1]) * rng.choice([30, 600, 86400]), "waiter": rng.random() < 0.5}
    if kind == "suspend":  # longer than the ttl; at a random moment or as a checkpoint's step is logged
        return {
            "stop_s": round(rng.uniform(TTL_S + 2.0, 3 * TTL_S + 2.0), 2),
            "at": rng.choice(["random", "ckpt"]),
        }
    if kind == "oom-trainer":
        return {"after_s": round(rng.uniform(0.0, 4.0), 2)}
    if kind == "cache-full":
        return {"leave": rng.choice([0, 64 * 1024])}
    return {}


SUPERVISOR_BALLAST = 320 << 20  # the oom-trainer supervisor's, to be larger than its trainer


def _oom_score_adj(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/oom_score_adj").read_text())
    except (OSError, ValueError):
        return None


def system_unavailable() -> dict[str, str]:
    """The SYSTEM kinds that cannot run here, and why: the clocks need a C compiler (the shim), an OOM
    kill a memory cgroup (root), a full cache a tmpfs of its own (root)."""
    import shutil as _shutil

    from memcg import unavailable

    out = {}
    if not _shutil.which("cc"):
        out.update(dict.fromkeys(["clock-step", "suspend"], "no C compiler (cc) for bench/clockshim.c"))
    if why := unavailable():
        out["oom-trainer"] = why
    if os.geteuid() != 0:
        out["cache-full"] = "the cache folder is a tmpfs of its own (mount: needs root)"
    return out


def system_missing(kinds: list[str] | None, ap: argparse.ArgumentParser) -> None:
    """Leave out the SYSTEM kinds that cannot run here (saying so); refuse them when named in --kinds."""
    missing = system_unavailable()
    for kind, why in missing.items():
        print(f"soak: {kind} is not drawn: {why}")
    for store in KINDS:
        KINDS[store] = [k for k in KINDS[store] if k not in missing]
    if kinds and set(kinds) & set(missing):
        ap.error(f"--kinds: {sorted(set(kinds) & set(missing))} cannot run here ({missing})")


# pivot-remote: a trainer kill drawn later than this many seconds comes as the pivot asks it to stop.
AT_STOP_S = 2.0


def draw_feature(rng: random.Random, kind: str) -> dict:
    """A feature fault's parameters (issue 48 item 6)."""
    if kind == "guard-rollback":
        # A non-finite step `ahead` steps on (ANDREA_TEST_GUARD_NAN_AT), and a SIGKILL around its rollback:
        # at one of the guard's own points (ANDREA_TEST_GUARD_SIGNAL), after_s after it, or none.
        kill = rng.choice([None, "set-aside", "recorded", "restored", "after"])
        return {"ahead": rng.randint(3, 12), "kill": kill, "after_s": round(rng.uniform(0.0, 1.5), 2)}
    if kind == "data-change":  # a file of the prose arm's local folder added, changed or removed
        return {"change": rng.choice(["add", "change", "remove"])}
    # pivot-remote: asked from the other host; the pivot or the trainer SIGKILLed kill_s into it (a trainer
    # drawn past AT_STOP_S: as the pivot asks it to stop), or none.
    return {
        "at": rng.choice(["now", "boundary"]),
        "restart": rng.choice([True, False]),
        "kill": rng.choice([None, "pivot", "trainer"]),
        "kill_s": round(rng.uniform(0.3, 4.0), 2),
    }


# --- stores ------------------------------------------------------------------------------------------


class LocalStore:
    """A run directory on a tmpfs of its own (mounted here; needs root), filled for real; seen through
    the power-cut layer (bench/powercut.py, a FUSE mount whose bytes are on the tmpfs) when FUSE
    mounts here, else on the tmpfs itself (and the layer's kinds are not drawn)."""

    name = "local"

    def __init__(self, work: Path, size_mb: int, layer: bool = True):
        self.disk = work / "disk"
        self.disk.mkdir()
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(self.disk)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"soak: cannot mount a tmpfs (needs root): {proc.stderr.strip()}")
        self.layer = None
        self.root = self.disk
        if layer:
            from powercut import Layer

            (self.disk / "layer").mkdir()
            self.layer = Layer(self.disk / "layer", work / "fs", work / "logs" / "powercut.log")
            self.root = work / "fs"
        self.run_url = str(self.root / "run")
        self.filler: Path | None = None

    def env(self, host: str) -> dict[str, str]:
        return {}

    def url(self, name: str) -> str:
        return str(self.root / name)

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir())

    def files(self, top: str) -> dict[str, str]:
        """relative path -> sha256 of every file under `top` (a name beside the run, '' for all)."""
        out = {}
        base = self.root / top if top else self.root
        for p in sorted(base.rglob("*")):
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(self.root))] = hashlib.sha256(p.read_bytes()).hexdigest()
        return out

    def read(self, rel: str) -> bytes | None:
        try:
            return (self.root / rel).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def listdir(self, rel: str) -> list[str]:
        p = self.root / rel
        return sorted(c.name for c in p.iterdir()) if p.is_dir() else []

    def copy_out(self, names: list[str], dest: Path) -> None:
        for n in names:
            shutil.copytree(self.root / n, dest / n, symlinks=True)

    def fill(self, leave: int) -> None:
        from full import fill  # tests/full.py: the full-disk tests' filler

        self.filler = fill(self.disk, leave, prefix=".soak-filler-")

    def unfill(self) -> None:
        if self.filler is not None:
            self.filler.unlink(missing_ok=True)
            self.filler = None

    def close(self) -> None:
        self.unfill()
        if self.layer is not None:
            self.layer.close()
        subprocess.run(["umount", "-l", str(self.disk)], check=False)


DENY_PUTS = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Deny", "Action": "s3:PutObject", "Resource": "*"}],
}
ALLOW_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


class S3Store:
    """The run directory in a bucket of the tests' moto server (IAM checked, as test_full_disk's
    fixture sets it up), reached by every process through the dropping relay."""

    name = "s3"
    bucket = "soak"

    def __init__(self, work: Path):
        import boto3
        from s3_server import CREDENTIALS, start_s3_server

        os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
        try:
            self.server = start_s3_server()
        finally:
            del os.environ["INITIAL_NO_AUTH_ACTION_COUNT"]
        boot = dict(endpoint_url=self.server.endpoint, region_name="us-east-1")
        iam = boto3.client("iam", **boot, aws_access_key_id="root", aws_secret_access_key="root")
        iam.create_user(UserName="trainer")
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(ALLOW_ALL))
        creds = dict(aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"])
        self.iam = boto3.client("iam", **boot, **creds)
        self.s3 = boto3.client("s3", **boot, **creds)
        self.s3.create_bucket(Bucket=self.bucket)
        # One relay endpoint a host (tests/s3_relay.py), their faults shared: a partition cuts one off.
        self.relay = RelayFaults(head=self._etag)
        self.relays = {h: Relay(self.server.port, self.relay, host=h) for h in HOSTS}
        self._env = {
            **CREDENTIALS,
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        }
        self.run_url = f"s3://{self.bucket}/run"

    def env(self, host: str) -> dict[str, str]:
        relay = self.relays.get(host)  # the reference's own host: its run is local, no relay
        return {**self._env, "FSSPEC_S3_ENDPOINT_URL": relay.endpoint if relay else self.server.endpoint}

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def _etag(self, key: str) -> str | None:
        try:
            return self.s3.head_object(Bucket=self.bucket, Key=key)["ETag"].strip('"')
        except self.s3.exceptions.ClientError:
            return None

    def _keys(self, prefix: str = "") -> dict[str, str]:
        out, token = {}, None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            page = self.s3.list_objects_v2(**kw)
            for o in page.get("Contents", []):
                out[o["Key"]] = o["ETag"].strip('"')
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    def names(self) -> list[str]:
        return sorted({k.split("/", 1)[0] for k in self._keys()})

    def files(self, top: str) -> dict[str, str]:
        return self._keys(f"{top}/" if top else "")

    def read(self, rel: str) -> bytes | None:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=rel)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None

    def listdir(self, rel: str) -> list[str]:
        prefix = rel.rstrip("/") + "/"
        return sorted({k[len(prefix) :].split("/", 1)[0] for k in self._keys(prefix)})

    def copy_out(self, names: list[str], dest: Path) -> None:
        for n in names:
            for key in self._keys(f"{n}/"):
                p = dest / key
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(self.read(key) or b"")

    def deny(self, on: bool) -> None:
        if on:
            self.iam.put_user_policy(
                UserName="trainer", PolicyName="deny", PolicyDocument=json.dumps(DENY_PUTS)
            )
        else:
            self.iam.delete_user_policy(UserName="trainer", PolicyName="deny")

    def close(self) -> None:
        self.relay.heal()  # requests a partition holds are let go
        for r in self.relays.values():
            r.shutdown()
        self.server.stop()


# --- processes ---------------------------------------------------------------------------------------


@dataclass
class Proc:
    """A process the soak started, its output read on a thread and stamped with the time it was read."""

    popen: subprocess.Popen
    what: str
    host: str
    lines: list[tuple[float, str]] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    expect_exit: bool = False  # the soak asked it to stop (or killed it)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.popen.stdout:
            self.lines.append((time.time(), raw.decode(errors="replace").rstrip("\n")))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def tail(self, n: int = 12) -> str:
        return "\n".join(line for _, line in self.lines[-n:])

    def step(self) -> int:
        for _, line in reversed(self.lines):
            m = re.search(r"step (\d+)/", line)
            if m:
                return int(m.group(1))
        return 0

    def first(self, pattern: str, after: float = 0.0) -> float | None:
        """When a line matching `pattern` was read (the first after `after`), or None."""
        for t, line in list(self.lines):
            if t >= after and re.search(pattern, line):
                return t
        return None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class Violation(Exception):
    pass


def retention_missing(
    need: set[int], published: set[int], have: set[int], damaged: set[int], refused: set[int]
) -> tuple[list[int], set[int]]:
    """(8)'s verdict: the checkpoints `need`ed, and the newest three published or had, that the run
    does not have; and those of them lost to the soak's own damage, never counted missing. A checkpoint the
    soak damaged itself (bitrot: the newest at a kill, torn or flipped) is refused by the next start
    and moved to refused/ (nothing is deleted); the run has it again only if it trains through that
    step again and that write goes through. Lost to the fault, not to retention, where refused/ holds
    it (a 230-fault prefix of seed 1 tore step_012765.bin, the one checkpoint a full disk had let
    through since 12265, and ended retraining at 12695); one refused that the soak did not damage is
    missing like any other."""
    lost = (damaged & refused) - have
    excused = lost & (need | set(sorted(published | have)[-3:]))  # what would have been missing
    need = need | set(sorted((published - lost) | have)[-3:])
    return sorted(need - have - lost), excused


class Soak:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args = args
        self.work = work
        self.every = args.every
        self.big = 10**6
        self.wind_down = threading.Event()  # SIGUSR1: no fault after the one under way, then the checks
        (work / "logs").mkdir()
        self.cache = Path(args.cache) if args.cache else work / "cache"
        self.store = (
            LocalStore(work, args.disk_mb, layer=args.layer) if args.store == "local" else S3Store(work)
        )
        self.did: dict[str, Counter] = defaultdict(Counter)  # what each layer fault did, summed
        from tiny import tiny_config

        self.policies = self._freeze_policies()

        self.config = tiny_config(
            work,
            name="soak",
            **{
                "train__checkpoint_every": self.every,
                "train__sample_every": 4 * self.every,
                "train__log_every": 1,
                "train__max_steps": self.big,
                "data__policy": self.policies["tiny-mix"],
                "retention__keep_last": 3,
                "retention__keep_every": 10 * self.every,
                # guard-rollback's divergences escalate only within 500 steps, and 8 may (not 4): a
                # long round's are hundreds of steps apart, each answered, none the bound's stop.
                "train__guard__rollback_window": 500,
                "train__guard__max_rollbacks": 8,
            },
        )
        self.host = HOSTS[0]
        self.trainer: Proc | None = None
        self.procs: list[Proc] = []
        self.violations: list[tuple[int, str, str]] = []  # (fault index, invariant, what)
        self.stats: dict[str, Counter] = defaultdict(Counter)
        self.wall: dict[str, float] = defaultdict(float)
        self.phases: dict[str, float] = {}  # seconds of wall time each phase of the soak took, in order
        # ("pivot", boundary, policy) / ("fork", step, branches, through) / ("data", step, what), in order
        self.events: list[tuple] = []
        self.policy = "tiny-mix"
        self.generations: list[tuple[float, int]] = []
        # A trainer taken over, when, and the run's checkpoints in the store before the takeover (its
        # line "checkpoint step_N.bin (...)" may come after it: a write the store committed before the
        # takeover, reported once the paused holder runs again, is not a publish after it).
        self.lost_leases: list[tuple[Proc, float, set[int]]] = []
        self.fault_i = -1
        # Every checkpoint a listing of the store showed, and when it last did (invariant (8)).
        self.listed: dict[int, float] = {}
        self.damaged: set[int] = set()  # the run's checkpoints the soak tore or flipped itself (bitrot)
        # Each pivot's boundary and when it was done: its closed phase's tail was published before.
        self.closed: list[tuple[int, float]] = []
        self.readers: Counter = (
            Counter()
        )  # `andrea status` answers checked against the truth (invariant (10))
        self.forks = 0
        self.settled = 0  # the run's newest checkpoint when the fault in progress began (reference())
        self.stopping = False
        self.ref_error: BaseException | None = None
        # guard-rollback: the data positions whose batch makes a step non-finite (every trainer started
        # after one is drawn, the reference's too, has them: ANDREA_TEST_GUARD_NAN_AT), and per fault
        # the step that diverges and the rollback it must make.
        self.poisoned: list[int] = []
        self.divergences: list[dict] = []
        self.launcher = None  # --warm's (tests/warm_launcher.py), started at the first start
        self.launcher_lock = threading.Lock()

    def _freeze_policies(self) -> dict[str, str]:
        """tiny-mix and stdlib-only as files of the soak's own, their prose arm reading a copy of the
        text it would read (site-packages' .md/.rst/.txt/METADATA), made once: a package installed
        into the shared environment during the soak must not change the reference's data."""
        import yaml

        from andrea_core.data.policy import ArmSpec
        from andrea_core.data.sources import _files_for

        prose = self.work / "prose"
        prose.mkdir()
        total = 0
        # The files the product's prose arm lists by default, in its order (the copies' names keep it).
        for i, f in enumerate(_files_for(ArmSpec(name="docs-prose", kind="prose"))):
            if total >= 2_000_000:
                break
            dest = prose / f"{i:06d}__{f.name}"
            dest.write_bytes(f.read_bytes())
            total += dest.stat().st_size
        out = {}
        for name in POLICIES:
            doc = yaml.safe_load((REPO / "configs" / "policies" / f"{name}.yaml").read_text())
            for arm in doc["arms"]:
                if arm["kind"] == "prose":
                    arm["paths"] = [str(prose)]
            path = self.work / f"{name}.yaml"
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            out[name] = str(path)
        return out

    # --- plumbing ------------------------------------------------------------------------------

    def env(self, host: str | None = None, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.store.env(host or self.host))
        env.update(
            PYTHONPATH=str(REPO),
            PYTHONUNBUFFERED="1",
            ANDREA_CACHE_DIR=str(self.cache),
            ANDREA_LEASE_RENEW_S=str(RENEW_S),
            ANDREA_LEASE_TTL_S=str(TTL_S),
            ANDREA_TEST_HOST=host or self.host,
        )
        env.update(self._clock_env(host or self.host))
        env.pop("ANDREA_TEST_PIVOT_KILL_AFTER", None)
        env.pop("ANDREA_TEST_FORK_KILL_AFTER", None)
        env.pop("ANDREA_TEST_GUARD_SIGNAL", None)
        if self.poisoned:
            env["ANDREA_TEST_GUARD_NAN_AT"] = ",".join(map(str, self.poisoned))
        env.update(extra)
        return env

    def spawn(
        self,
        what: str,
        argv: list[str],
        host: str | None = None,
        nice: int | None = None,
        cold: bool = False,
        **extra: str,
    ) -> Proc:
        """`python -m andrea_core ARGV` at `nice` (the soak's --nice), in a session of its own (a power
        cut kills its group); forked by the warm launcher under --warm unless `cold`."""
        nice = self.args.nice if nice is None else nice
        env = self.env(host, **extra)
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        launcher = None if cold else self._launcher(env)
        if launcher is not None:
            popen = launcher.popen([PYTHON, "-m", "andrea_core", *argv], nice=nice, **kw, cwd=REPO,
                                   start_new_session=True)  # fmt: skip
        else:
            popen = subprocess.Popen(["nice", "-n", str(nice), PYTHON, "-m", "andrea_core", *argv], **kw,
                                     cwd=REPO, start_new_session=True)  # fmt: skip
        p = Proc(popen, what, host or self.host)
        self.procs.append(p)
        return p

    def _launcher(self, env: dict[str, str]):
        """The warm launcher (tests/warm_launcher.py) of --warm, started at the first start (its first
        server imports under that start's env); None without --warm. A fork server per clock file:
        bench/clockshim.c, LD_PRELOAD'd in the server, maps its host's file once there."""
        if not self.args.warm:
            return None
        with self.launcher_lock:
            if self.launcher is None:
                from warm_launcher import ANDREA_PRELOAD, WarmLauncher

                load_vars = ("ANDREA_SOAK_CLOCK_FILE",)
                self.launcher = WarmLauncher(
                    list(ANDREA_PRELOAD), env, str(REPO), max_servers=3, load_vars=load_vars
                )
            return self.launcher

    def tool(self, what: str, argv: list[str], timeout: float = TOOL_BOUND, **extra: str) -> tuple[int, str]:
        """`andrea ARGV` run to its end: its exit status and its output."""
        rc, p = self.tool_proc(what, argv, timeout, **extra)
        return rc, p.text()

    def tool_proc(
        self, what: str, argv: list[str], timeout: float = TOOL_BOUND, **extra: str
    ) -> tuple[int, Proc]:
        """`andrea ARGV` run to its end: its exit status and its own Proc. Never self.procs[-1]: the
        reference thread spawns into that list too, and a status read from it once judged the
        reference's `andrea pivot` (CI, 2026-12-06, invariant (10))."""
        p = self.spawn(what, argv, **extra)
        rc = p.wait(timeout)
        if rc is None:
            p.signal(signal.SIGKILL)
            p.wait(30)
            self.violate("7", f"`andrea {' '.join(argv)}` did not end within {timeout:g}s:\n{p.tail()}")
            return -9999, p
        time.sleep(0.05)  # the reader thread's last lines
        return rc, p

    def violate(self, invariant: str, what: str) -> None:
        self.violations.append((self.fault_i, invariant, what))
        print(f"  VIOLATION ({invariant}) at fault {self.fault_i}: {what}", flush=True)

    def start_trainer(
        self, first: bool = False, host: str | None = None, cold: bool = False, **extra: str
    ) -> Proc:
        argv = ["train", "--run-dir", self.store.run_url, "--device", "cpu", "--max-steps", str(self.big)]
        if first:
            argv[1:1] = ["--config", self.config]
        p = self.spawn("trainer", argv, host, cold=cold, **extra)
        return p

    def _held_generation(self, holder: Proc) -> int | None:
        """The lock's generation once `holder` holds it (its pid, not released): a trainer just started
        may not have taken the lock yet, and a fault's "the generation did not change" read before it
        did compared against None or its predecessor's (seed 2: "None -> 9"). Bounded: after 60 s, or
        once `holder` exited, the generation as it stands."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and holder.popen.poll() is None:
            doc = self.lock() or {}
            if doc.get("pid") == holder.pid and not doc.get("released"):
                return doc.get("generation")
            time.sleep(0.05)
        return (self.lock() or {}).get("generation")

    def lock(self) -> dict | None:
        raw = self.store.read("run/.trainer.json")
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            return None
        if isinstance(doc, dict) and isinstance(doc.get("generation"), int):
            g = doc["generation"]
            if self.generations and g < self.generations[-1][1]:
                self.violate("5", f"the lock's generation went down: {self.generations[-1][1]} -> {g}")
            self.generations.append((time.time(), g))
        return doc if isinstance(doc, dict) else None

    def wait_steps(self, n: int, timeout: float = 300.0) -> None:
        """Let the live trainer train `n` more steps (restarting it if it ended on its own)."""
        self.ensure_trainer()
        target = self.trainer.step() + n
        deadline = time.monotonic() + timeout
        while self.trainer.step() < target:
            if self.trainer.popen.poll() is not None:
                self.ensure_trainer()
                target = min(target, self.trainer.step() + n)
            if time.monotonic() > deadline:
                self.violate("7", f"the trainer made no progress for {timeout:g}s:\n{self.trainer.tail()}")
                return
            time.sleep(0.02)

    def wait_training(self, p: Proc, timeout: float = 300.0) -> bool:
        """Until `p` logs its first step (True), or exits (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if p.step() > 0 or p.first(r"training steps"):
                return True
            if p.popen.poll() is not None:
                return False
            time.sleep(0.02)
        self.violate("7", f"a trainer did not start training within {timeout:g}s:\n{p.tail()}")
        return False

    def ensure_trainer(self) -> None:
        """The supervisor: a trainer that ended unasked is restarted (and reported when it should not
        have ended: any exit we did not cause is a violation, as Restart=on-failure would mask it)."""
        for _ in range(5):
            t = self.trainer
            if t is not None and t.popen.poll() is None:
                return
            if t is not None and not t.expect_exit:
                self.violate("7", f"the trainer exited {t.popen.returncode} unasked:\n{t.tail()}")
            self.trainer = self.start_trainer()
            if self.wait_training(self.trainer):
                self.lock()
                return
        raise Violation(f"the trainer cannot be restarted:\n{self.trainer.tail()}")

    def stop_trainer(self, sig: int = signal.SIGTERM, bound: float = TERM_BOUND) -> int | None:
        t = self.trainer
        if t is None or t.popen.poll() is not None:
            return None if t is None else t.popen.returncode
        t.expect_exit = True
        t.signal(sig)
        if sig == signal.SIGSTOP:
            return None
        rc = t.wait(bound)
        if rc is None:
            self.violate("7", f"the trainer did not exit within {bound:g}s of signal {sig}:\n{t.tail()}")
            t.signal(signal.SIGKILL)
            rc = t.wait(30)
        return rc

    def checkpoints(self) -> list[int]:
        """The run's checkpoints as the store lists them now (each listing is kept: invariant (8))."""
        listed = sorted(
            int(m.group(1)) for n in self.store.listdir("run") if (m := re.fullmatch(r"step_(\d+)\.bin", n))
        )
        self.listed.update(dict.fromkeys(listed, time.time()))
        return listed

    # --- faults ----------------------------------------------------------------------------------

    def f_sigkill(self, f: dict) -> None:
        time.sleep(f["after_s"])
        self.stop_trainer(signal.SIGKILL)
        # (10) a reader asked while nothing trains (the killed trainer dead, not yet restarted)
        rc, p = self.tool_proc("status", ["status", self.store.run_url])
        if rc == 0:
            self._status_truth(p, alive=False)

    def status_read(self) -> tuple[int, Proc]:
        """`andrea status` of the run now, judged (10) when it answers: alive if this host's trainer ran
        from before it started to after it ended (unknown otherwise), the read's start the `since` that
        tells the layer's race apart (as the readers fault's reads). Its exit status and its Proc."""
        holder = self.trainer
        alive_before = holder is not None and holder.popen.poll() is None
        since = time.monotonic()
        rc, p = self.tool_proc("status", ["status", self.store.run_url])
        if rc == 0:
            alive = alive_before and holder.popen.poll() is None
            self._status_truth(p, alive=True if alive else None, since=since)
        return rc, p

    def _status_truth(self, p: Proc, alive: bool | None, since: float | None = None) -> None:
        """(10) `andrea status`'s state against the truth: a trainer of this host alive throughout is
        TRAINING (never CRASHED, STOPPED or COMPLETED); none alive is never TRAINING. None: unknown.
        One answer is the power-cut layer's, not the product's: STOPPED, no trainer running, while the
        layer replaced the lock by a rename (its renewal) during the read, which started at monotonic
        `since`: its name was there throughout, and libfuse's path race answered ENOENT (bench/README.md,
        the layer's limits); counted apart, named in the table, never a pass for any other answer."""
        m = re.search(r": (TRAINING|CRASHED|REMOTE|CREATING|PIVOTING|COMPLETED|STOPPED): ", p.text())
        state = m.group(1) if m else "no state line"
        if alive and state == "STOPPED" and since is not None and self.store.layer is not None:
            replaced = self.store.layer.call("replaced", since=since)["paths"]
            if f"/run/{LOCK}" in replaced and ": STOPPED: no trainer running" in p.text():
                self.readers["alive -> STOPPED, the lock replaced under the read (the layer's race)"] += 1
                return
        self.readers[f"{'alive' if alive else 'dead' if alive is False else 'changed'} -> {state}"] += 1
        if alive and state != "TRAINING":
            self.violate("10", f"andrea status said {state} of a live trainer:\n{p.tail()}")
        elif alive is False and state in ("TRAINING", "CREATING"):
            self.violate("10", f"andrea status said {state} with no trainer alive:\n{p.tail()}")

    def f_sigkill_write(self, f: dict) -> None:
        """SIGKILL aimed at a checkpoint's writes: right after the boundary step is logged, the bandit
        state, the loss log's sync and the checkpoint's bytes follow within milliseconds."""
        self._at_boundary()
        time.sleep(f["after_s"])
        self.stop_trainer(signal.SIGKILL)

    def f_sigkill_renewal(self, f: dict) -> None:
        """SIGKILL right as the lease is renewed (the lock's bytes seen to change)."""
        before = self.store.read("run/.trainer.json")
        deadline = time.monotonic() + 10 * RENEW_S
        while time.monotonic() < deadline:
            if self.store.read("run/.trainer.json") != before:
                break
            time.sleep(0.005)
        self.stop_trainer(signal.SIGKILL)

    def f_sigkill_startup(self, f: dict) -> None:
        """SIGKILL `after_s` into a trainer's start: cold under --warm too, its imports and re-exec
        (the window the kill is aimed at) as a user's start has them."""
        self.stop_trainer(signal.SIGKILL)
        self.trainer = self.start_trainer(cold=True)
        time.sleep(f["after_s"])
        self.stop_trainer(signal.SIGKILL)

    def f_sigterm(self, f: dict) -> None:
        step = self.trainer.step()
        rc = self.stop_trainer(signal.SIGTERM)
        if rc != 0:
            self.violate("7", f"SIGTERM at step {step}: exit {rc}, not 0:\n{self.trainer.tail()}")

    def f_sigusr1(self, f: dict) -> None:
        t = self.trainer
        since = time.time()
        t.signal(signal.SIGUSR1)
        deadline = time.monotonic() + TERM_BOUND
        while time.monotonic() < deadline and not t.first(r"checkpoint step_\d+\.bin \(", since):
            if t.popen.poll() is not None:
                self.violate("7", f"SIGUSR1 ended the trainer (exit {t.popen.returncode}):\n{t.tail()}")
                return
            time.sleep(0.02)
        if not t.first(r"checkpoint step_\d+\.bin \(", since):
            self.violate("7", f"SIGUSR1: no checkpoint within {TERM_BOUND:g}s:\n{t.tail()}")

    def _waiter(self, wait_s: float) -> Proc:
        """A trainer on the other host, started against the live run, watching its lease."""
        other = HOSTS[1 - HOSTS.index(self.host)]
        w = self.start_trainer(host=other, ANDREA_LEASE_WAIT_S=str(wait_s))
        deadline = time.monotonic() + 120
        while (
            time.monotonic() < deadline
            and w.popen.poll() is None
            and not w.first("watching whether it renews")
        ):
            time.sleep(0.02)
        return w

    def f_sigstop_short(self, f: dict) -> None:
        holder = self.trainer
        g0 = self._held_generation(holder)
        w = self._waiter(0.0)
        holder.signal(signal.SIGSTOP)
        time.sleep(f["stop_s"])
        holder.signal(signal.SIGCONT)
        rc = w.wait(TTL_S + 60)
        if rc != 2:
            self.violate(
                "5",
                f"a trainer started while the holder was paused {f['stop_s']}s exited {rc}, "
                f"not 2:\n{w.tail()}",
            )
            if rc is None:
                w.signal(signal.SIGKILL)
        if holder.popen.poll() is not None:
            self.violate(
                "7",
                f"a pause of {f['stop_s']}s, inside the lease's margin (ttl - renew), ended the holder "
                f"(exit {holder.popen.returncode}):\n{holder.tail()}",
            )
        g1 = (self.lock() or {}).get("generation")
        if g1 != g0 and holder.popen.poll() is None:
            self.violate("5", f"a pause inside the lease's margin changed the lock's generation {g0} -> {g1}")

    def f_sigstop_long(self, f: dict) -> None:
        holder = self.trainer
        g0 = self._held_generation(holder)
        w = self._waiter(4 * TTL_S + f["stop_s"] + 30)
        stopped = time.time()
        holder.signal(signal.SIGSTOP)
        holder.expect_exit = True
        deadline = time.monotonic() + max(f["stop_s"], TAKEOVER_BOUND)
        took = None
        present: set[int] = set()  # the checkpoints of the newest listing made before the takeover
        while time.monotonic() < deadline:
            took = w.first(r"taking over the stale lock")
            if took or w.popen.poll() is not None:
                break
            listed = set(self.checkpoints())
            if (self.lock() or {}).get("generation") == g0:  # read after the listing: it came first
                present = listed
            time.sleep(0.02)
        wait_more = f["stop_s"] - (time.time() - stopped)
        if wait_more > 0:
            time.sleep(wait_more)
        holder.signal(signal.SIGCONT)
        if took is None:
            waiter = f"exited {w.popen.returncode}" if w.popen.poll() is not None else "still waiting"
            self.violate(
                "7",
                f"a holder paused {f['stop_s']}s (> ttl {TTL_S:g}s) was not taken over within "
                f"{TAKEOVER_BOUND:g}s; the waiter: {waiter}:\n{w.tail()}",
            )
            w.expect_exit = True
            w.signal(signal.SIGKILL)
            w.wait(30)
            if holder.popen.poll() is None:
                return  # the holder goes on
            self.trainer = holder
            return
        if took - stopped > TAKEOVER_BOUND:
            self.violate("7", f"takeover of a paused holder took {took - stopped:.1f}s > {TAKEOVER_BOUND:g}s")
        rc = holder.wait(TERM_BOUND)
        self.lost_leases.append((holder, took, present))
        if rc != 2:
            self.violate(
                "5", f"a taken-over trainer, resumed, exited {rc}, not 2 (lost its lease):\n{holder.tail()}"
            )
            if rc is None:
                holder.signal(signal.SIGKILL)
                holder.wait(30)
        self.trainer, self.host = w, w.host
        if not self.wait_training(w):
            w.expect_exit = False

    def f_sigterm_waiting(self, f: dict) -> None:
        """SIGTERM to a trainer still waiting for another host's lease (systemctl stop while it starts):
        it exits 0 before its first step, at once, not after its wait."""
        w = self._waiter(600.0)
        if w.popen.poll() is not None:
            self.violate(
                "5", f"a trainer started against a live lease exited {w.popen.returncode}:\n{w.tail()}"
            )
            return
        w.expect_exit = True
        w.signal(signal.SIGTERM)
        rc = w.wait(TERM_BOUND)
        if rc != 0:
            self.violate(
                "7", f"SIGTERM to a trainer waiting for a lease: exit {rc}, not 0 within {TERM_BOUND:g}s"
            )
            if rc is None:
                w.signal(signal.SIGKILL)
                w.wait(30)

    def f_disk_full(self, f: dict) -> None:
        self._outage(f, self.store.fill, self.store.unfill, "the disk full")

    def f_s3_deny(self, f: dict) -> None:
        self._outage(f, lambda leave: self.store.deny(True), lambda: self.store.deny(False), "puts denied")

    def _outage(self, f: dict, begin, end, what: str) -> None:
        t = self.trainer
        begin(f.get("leave", 0))
        try:
            deadline = time.monotonic() + f["for_s"]
            while time.monotonic() < deadline:
                if t.popen.poll() is not None:
                    break
                time.sleep(0.05)
        finally:
            end()
        # Ended during the outage, or the next boundary after it publishes a checkpoint again.
        self._checkpoint_after(t, f"{what} for {f['for_s']}s")

    def f_s3_lost_reply(self, f: dict) -> None:
        relay, t = self.store.relay, self.trainer
        n = len(relay.dropped)
        relay.armed = f"run/{f['key']}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(relay.dropped) == n and t.popen.poll() is None:
            time.sleep(0.02)
        relay.armed = None
        if len(relay.dropped) == n:
            return  # nothing of that key was put in a minute (the trainer may have ended: see below)
        self._checkpoint_after(t, f"a lost reply to a put of {relay.dropped[-1][1]}")

    # --- storage slow or gone (S3, the relay's faults: tests/s3_relay.py) ---------------------------

    def f_s3_slow(self, f: dict) -> None:
        """Every request of every host held a drawn latency: training goes on, a checkpoint after."""
        relay, t0 = self.store.relay, time.time()
        n0 = len(relay.delays)

        def begin(_):
            relay.latency = tuple(f["latency"])

        def end():
            relay.latency = None

        self._outage(f, begin, end, f"a store answering {f['latency'][0]}-{f['latency'][1]} s late")
        d, delays = self.did["s3-slow"], relay.delays[n0:]
        d["requests delayed"] += len(delays)
        d[f"delayed past the renew interval ({RENEW_S:g} s)"] += sum(x > RENEW_S for x in delays)
        d["seconds of delay"] += round(sum(delays), 1)
        d["renewals that failed"] += sum(
            "lease renewal" in line and "failed" in line for t, line in self.trainer.lines if t >= t0
        )

    def f_s3_503(self, f: dict) -> None:
        """A fraction of requests answered 503 SlowDown (not applied): the SDK's and s3fs's retries."""
        relay, t0 = self.store.relay, time.time()
        n0 = sum(relay.throttled.values())

        def begin(_):
            relay.slowdown = f["fraction"]

        def end():
            relay.slowdown = 0.0

        self._outage(f, begin, end, f"503 SlowDown to {f['fraction']:.0%} of requests")
        d = self.did["s3-503"]
        d["503 answered"] += sum(relay.throttled.values()) - n0
        d["publishes that failed (trained on)"] += sum(
            "NOT written" in line or "renewal" in line and "failed" in line
            for t, line in self.trainer.lines
            if t >= t0
        )

    def f_s3_hang(self, f: dict) -> None:
        """One request of the holder held hang_s (> ttl), then delivered; maybe with a trainer of the
        other host watching the lease. Its renewal held: the watcher takes over, the holder's renewal
        lands after and it stops (exit 2), publishing nothing after the takeover. Anything else held:
        the lease is renewed meanwhile, the watcher is stopped (SIGTERM, exit 0), training goes on."""
        relay, holder, d = self.store.relay, self.trainer, self.did["s3-hang"]
        match = {
            "trainer": r"^PUT .*/run/\.trainer\.json",
            "complete": r"^POST .*/run/[^?]*\?uploadId=",
            "any": r".",
        }[f["match"]]
        g0 = self._held_generation(holder)
        w = self._waiter(4 * TTL_S + f["hang_s"] + 30) if f["waiter"] else None
        n0 = len(relay.hung)
        relay.hang = {"host": self.host, "match": match, "for_s": f["hang_s"]}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(relay.hung) == n0 and holder.popen.poll() is None:
            time.sleep(0.02)
        relay.hang = None
        if len(relay.hung) == n0:
            d["never hit (no such request in 60 s)"] += 1
            if w is not None:
                self._stop_waiter(w)
            return
        held_at = time.time()
        d[f"held {f['match']}"] += 1
        d["seconds held"] += f["hang_s"]
        took, present = None, set()
        while w is not None and time.time() < held_at + f["hang_s"] + TAKEOVER_BOUND:
            took = w.first(r"taking over the stale lock")
            if took or w.popen.poll() is not None or time.time() > held_at + f["hang_s"] + 1:
                break
            listed = set(self.checkpoints())
            if (self.lock() or {}).get("generation") == g0:
                present = listed
            time.sleep(0.02)
        if took:
            d["taken over (the holder's lease unrenewed past the ttl)"] += 1
            self._lost_holder(holder, w, took, present, f"a request held {f['hang_s']} s")
            return
        if w is not None:
            self._stop_waiter(w)
        if holder.popen.poll() is not None:
            self.violate(
                "7",
                f"a request held {f['hang_s']} s ended the holder (exit {holder.popen.returncode}), "
                f"no takeover:\n{holder.tail()}",
            )
            holder.expect_exit = True
            return
        self._checkpoint_after(holder, f"a request held {f['hang_s']} s")
        d["trained on"] += 1

    def f_s3_partition(self, f: dict) -> None:
        """Every request of the holder's host refused (or held until healed), reads included, while a
        trainer of the other host waits for the lease and takes the run over; the old holder, still
        running, is healed after_s later: it must stop (exit 2) and have published nothing after."""
        relay, holder, d = self.store.relay, self.trainer, self.did["s3-partition"]
        g0 = self._held_generation(holder)
        w = self._waiter(4 * TTL_S + 60)
        before = Counter(relay.partitioned)
        cut = time.time()
        relay.cut_off(self.host, f["mode"])
        took, present = None, set()
        try:
            deadline = time.monotonic() + TAKEOVER_BOUND + 10
            while time.monotonic() < deadline:
                took = w.first(r"taking over the stale lock")
                if took or w.popen.poll() is not None:
                    break
                listed = set(self.checkpoints())
                if (self.lock() or {}).get("generation") == g0:
                    present = listed
                time.sleep(0.02)
            if took:
                # The holder runs on, partitioned, while the new holder trains: a reader on its host too.
                reader = self.spawn("status", ["status", self.store.run_url], host=holder.host)
                time.sleep(f["after_s"])
                alive = holder.popen.poll() is None
                d["old holder still running at the heal"] += alive
        finally:
            relay.heal()
        cutoff = Counter(relay.partitioned) - before  # what the partition cut off: "mode METHOD"
        d["requests cut off"] += sum(cutoff.values())
        d["reads cut off (GET/HEAD)"] += sum(v for k, v in cutoff.items() if k.split()[1] in ("GET", "HEAD"))
        if not took:
            self.violate(
                "7",
                f"a holder partitioned from the store ({f['mode']}) was not taken over within "
                f"{TAKEOVER_BOUND + 10:g}s:\n{w.tail()}",
            )
            self._stop_waiter(w)
            return
        d[f"taken over ({f['mode']})"] += 1
        d["seconds to takeover"] += round(took - cut, 1)
        rc = reader.wait(TOOL_BOUND)
        time.sleep(0.05)
        d[f"reader on the partitioned host: exit {rc}"] += 1
        if rc is None or "Traceback" in reader.text():
            self.violate("7", f"andrea status on a partitioned host: exit {rc}:\n{reader.tail()}")
            reader.signal(signal.SIGKILL)
        self._lost_holder(holder, w, took, present, f"a partition ({f['mode']})")

    def f_lost_complete(self, f: dict) -> None:
        """The next CompleteMultipartUpload of f["key"] applied, its reply dropped (the object checked
        to exist with the ETag the reply named); the retry answered 404 NoSuchUpload (S3 forgot the
        upload) or forwarded (moto's idempotent 200). The write must count as done: no error about it,
        a checkpoint logged as written when it was one, and training goes on."""
        relay, t, d = self.store.relay, self.trainer, self.did["lost-complete"]
        n = len(relay.completes_lost)
        relay.lost_complete = {"key": f"run/{f['key']}", "retry": f["retry"]}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(relay.completes_lost) == n and t.popen.poll() is None:
            time.sleep(0.02)
        relay.lost_complete = None
        if len(relay.completes_lost) == n:
            d["never hit (no complete of it in 60 s)"] += 1
            return
        lost = relay.completes_lost[-1]
        name = lost["key"].rsplit("/", 1)[1]
        d["replies dropped"] += 1
        d["object there with the dropped reply's ETag"] += lost["held"]
        if not lost["held"]:
            self.violate(
                "7", f"lost-complete: the complete of {name} was not applied (the fault did nothing)"
            )
        self._checkpoint_after(t, f"the lost reply of the complete of {name}")
        time.sleep(0.1)
        d[f"retry answered {'/'.join(map(str, lost['retries'])) or 'never'}"] += 1
        d["read back after NoSuchUpload (objstore._failed)"] += bool(lost["read_back"])
        said = [
            line
            for at, line in t.lines
            if at >= lost["at"] - 0.5 and ("ERROR" in line or "warning" in line) and name in line
        ]
        if said:
            self.violate(
                "7", f"a committed {name} whose complete reply was lost was reported failed: {said[0]}"
            )
        if name.startswith("step_"):
            if t.first(rf"checkpoint {re.escape(name)} \(", lost["at"] - 5):
                d["checkpoint logged as written"] += 1
            elif t.popen.poll() is None:
                self.violate("7", f"{name}: committed, its complete reply lost, never logged as written")

    def _checkpoint_after(self, t: Proc, what: str) -> None:
        since = time.time()
        deadline = time.monotonic() + TERM_BOUND
        while time.monotonic() < deadline and t.popen.poll() is None:
            if t.first(r"checkpoint step_\d+\.bin \(", since):
                return
            time.sleep(0.05)
        if t.popen.poll() is not None:
            self.violate("7", f"{what} ended training (exit {t.popen.returncode}):\n{t.tail()}")
            t.expect_exit = True
        else:
            self.violate("7", f"after {what} no checkpoint was written again:\n{t.tail()}")

    def _stop_waiter(self, w: Proc) -> None:
        """A trainer of the other host that did not take over: gone on its own (exit 2: it saw a
        renewal), or stopped while it waits (SIGTERM: exit 0)."""
        w.expect_exit = True
        if w.popen.poll() is None:
            w.signal(signal.SIGTERM)
        rc = w.wait(TERM_BOUND)
        if rc not in (0, 2):
            self.violate("7", f"a trainer watching a live lease exited {rc}:\n{w.tail()}")
            if rc is None:
                w.signal(signal.SIGKILL)
                w.wait(30)

    def _lost_holder(self, holder: Proc, w: Proc, took: float, present: set[int], what: str) -> None:
        """`w` took the run over from `holder`, which still runs: it must find its lease lost and exit 2
        (and publish nothing after `took`: checked at the end)."""
        holder.expect_exit = True
        rc = holder.wait(TERM_BOUND)
        self.lost_leases.append((holder, took, present))
        if rc != 2:
            self.violate("5", f"after {what}, the taken-over holder exited {rc}, not 2:\n{holder.tail()}")
            if rc is None:
                holder.signal(signal.SIGKILL)
                holder.wait(30)
        self.trainer, self.host = w, w.host
        if not self.wait_training(w):
            w.expect_exit = False

    # --- the power-cut layer's faults (local store) ---------------------------------------------

    def _machine_procs(self) -> list[Proc]:
        """The soak's live processes on the run's machine: all but the reference's (its own folder)."""
        return [p for p in self.procs if p.popen.poll() is None and not p.what.startswith("ref")]

    def _power_cut(self) -> dict:
        """Every process of the machine dies at once, then the disk loses what was not durable."""
        procs = self._machine_procs()
        for p in procs:
            p.expect_exit = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # its children too (a data prepare, a torchrun agent)
        for p in procs:
            if p.wait(30) is None:
                raise Violation(f"pid {p.pid} ({p.what}) survived SIGKILL for 30 s")
        # (9) durability: a checkpoint a trainer logged as written survives the cut, byte for byte.
        published = {
            int(m.group(1))
            for p in self.procs
            if p.what == "trainer"
            for _, line in p.lines
            if (m := re.search(r"checkpoint step_(\d+)\.bin \(", line))
        }
        promised = {s: self._sha(f"run/{checkpoint_name(s)}") for s in set(self.checkpoints()) & published}
        dropped = self.store.layer.cut()
        for s, sha in sorted(promised.items()):
            now = self._sha(f"run/{checkpoint_name(s)}")
            if now != sha:
                what = "is gone" if now is None else "has other bytes"
                self.violate("9", f"{checkpoint_name(s)}, logged as written, {what} after a power cut")
        # A new boot: the lock file itself may be back at an older generation (its rename not yet
        # durable), with every holder of the old one dead.
        self.generations.clear()
        d = self.did["power-cut"]
        d["bytes"] += dropped["bytes"]
        d["entries"] += dropped["entries"]
        d["files"] += dropped["files"]
        d["reverted"] += dropped["reverted"]
        d["cuts that dropped something"] += bool(dropped["bytes"] or dropped["entries"])
        if self.args.verbose:
            print(f"  power cut: {dropped}", flush=True)
        return dropped

    def _sha(self, rel: str) -> str | None:
        data = self.store.read(rel)
        return None if data is None else hashlib.sha256(data).hexdigest()

    def f_power_cut(self, f: dict) -> None:
        if f["at"] == "checkpoint":
            self._at_boundary()
            time.sleep(f["after_s"])
            self._power_cut()
        elif f["at"] == "pivot":
            policy = POLICIES[1 - POLICIES.index(self.policy)]
            before = self._phases()
            self.trainer.expect_exit = True
            p = self.spawn("pivot", self._pivot_cmd(policy))
            time.sleep(f["after_s"] * 2)
            done = p.popen.poll() == 0
            self._power_cut()
            self.did["power-cut"]["mid-pivot"] += not done
            if not done:  # as the operator would: the same pivot again, finished or made from scratch
                rc, out = self.tool("pivot", self._pivot_cmd(policy))
                if rc != 0:
                    self.violate("7", f"the pivot rerun after a power cut exited {rc}:\n{out[-2000:]}")
            new = self._phases() - before
            if len(new) > 1:
                self.violate("3", f"one pivot (cut, rerun) made {len(new)} phase folders: {sorted(new)}")
            if new:
                boundary = int(re.search(r"step_(\d+)", max(new)).group(1))
                self.events.append(("pivot", boundary, policy))
                self.closed.append((boundary, time.time()))
                self.policy = policy
        elif f["at"] == "fork":
            have = self.checkpoints()
            grid = [s for s in have if s % (10 * self.every) == 0]
            if not grid:
                time.sleep(f["after_s"])
                self._power_cut()
                return
            step = grid[-1]
            self.forks += 1
            names = [f"f{self.forks}a", f"f{self.forks}b"]
            argv = ["fork", self.store.run_url, "--step", str(step), "--replicates", "1"]
            for n in names:
                argv += ["--branch", n]
            self.spawn("fork", argv)
            time.sleep(f["after_s"] / 2)
            self._power_cut()
            self.did["power-cut"]["mid-fork"] += 1
            rc, out = self.tool("fork", argv)  # the fork again: it finishes what the cut left
            if rc != 0:
                self.violate("4", f"andrea fork --step {step} after a power cut exited {rc}:\n{out[-2000:]}")
                return
            self.events.append(self._fork_event(step, names))
        else:
            time.sleep(f["after_s"])
            self._power_cut()

    def _at_boundary(self) -> None:
        """Until the live trainer has just logged a checkpoint boundary's step (its writes follow)."""
        t = self.trainer
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and t.popen.poll() is None:
            s = t.step()
            if s and s % self.every == 0 and t.first(rf"step {s}/", time.time() - 0.05):
                return
            time.sleep(0.002)

    def _disk_error(self, f: dict, fault: str) -> None:
        """Arm `fault` on the run's files matching f["match"]; wait for it to fire; then the trainer
        either trains on and publishes a checkpoint again, or stopped with an error naming what
        failed (exit 1, restarted as Restart=on-failure would): never silently, never exit 0."""
        layer, t = self.store.layer, self.trainer
        n0 = layer.call("fired")["n"]
        layer.arm(fault, rf"^/run/\.?\.?{re.escape(f['match'])}", count=f["count"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and t.popen.poll() is None:
            if layer.call("fired", since=n0)["fired"]:
                break
            time.sleep(0.02)
        unfired = layer.call("disarm")["unfired"]
        fired = layer.call("fired", since=n0)["fired"]
        self.did[self._kind]["fired"] += len(fired)
        if not fired:
            self.did[self._kind]["never hit (file not written in 60 s)"] += 1
            return
        self._after_disk_error(t, f"{fault} on {fired[0]['path']}", unfired)

    def _after_disk_error(self, t: Proc, what: str, unfired: list) -> None:
        since = time.time()
        deadline = time.monotonic() + TERM_BOUND
        while time.monotonic() < deadline and t.popen.poll() is None:
            if t.first(r"checkpoint step_\d+\.bin \(", since):
                self.did[self._kind]["trained on"] += 1
                return
            time.sleep(0.05)
        if t.popen.poll() is None:
            self.violate("7", f"after {what} no checkpoint was written again:\n{t.tail()}")
            return
        rc = t.popen.returncode
        t.expect_exit = True
        time.sleep(0.05)
        self.did[self._kind][f"stopped (exit {rc})"] += 1
        if rc == 0 or "Traceback" in t.text():
            self.violate(
                "7", f"{what}: the trainer exited {rc} (a clear error and exit 1 expected):\n{t.tail()}"
            )

    def f_eio_write(self, f: dict) -> None:
        self._disk_error(f, "write")

    def f_eio_fsync(self, f: dict) -> None:
        self._disk_error(f, "fsync")

    def f_short_write(self, f: dict) -> None:
        self._disk_error(f, "short")

    def f_eio_read(self, f: dict) -> None:
        """A read error at start: the trainer stopped, the next start's read of f["match"] fails once;
        every other one its stat instead (twice: the kernel retries a failed lookup once), which a
        reader must not take for "absent" (a fresh bandit, remedies dropped). Chosen by the fault's
        index, not drawn: the schedule of a seed stays what it was."""
        layer = self.store.layer
        self.stop_trainer(signal.SIGTERM)
        n0 = layer.call("fired")["n"]
        op = "stat" if f["i"] % 2 else "read"
        self.did["eio-read"][f"armed on {op}"] += 1
        layer.arm(op, rf"^/run/\.?{re.escape(f['match'])}", count=2 if op == "stat" else 1)
        t = self.trainer = self.start_trainer()
        started = self.wait_training(t, timeout=TOOL_BOUND)
        layer.call("disarm")
        fired = layer.call("fired", since=n0)["fired"]
        self.did["eio-read"]["fired"] += len(fired)
        if not fired:
            self.did["eio-read"]["never hit (not read at start)"] += 1
            return
        if started:
            self.did["eio-read"]["started anyway"] += 1
            return
        rc = t.popen.wait(30)
        time.sleep(0.05)
        t.expect_exit = True
        self.did["eio-read"][f"refused to start (exit {rc})"] += 1
        if rc == 0 or "Traceback" in t.text():
            self.violate(
                "7", f"a read EIO on {fired[0]['path']} at start: exit {rc}, not a clear error:\n{t.tail()}"
            )

    def f_bitflip(self, f: dict) -> None:
        self.f_bitrot(f)

    def f_bitrot(self, f: dict) -> None:
        """A crash, and the newest checkpoint found torn (or bit-flipped) at the next start: refused
        (named), the one before used; the run then rewrites it when it passes that step again."""
        self.stop_trainer(signal.SIGKILL)
        have = self.checkpoints()
        if len(have) < 2:
            self.did["bitrot"]["no checkpoint to rot"] += 1
            return
        name = checkpoint_name(have[-1])
        boundaries = {int(m.group(1)) for n in self._phases() if (m := re.search(r"_step_(\d+)$", n))}
        if have[-1] in boundaries:
            self._rot_a_boundary(f, name)
            return
        rot = self.store.layer.call("rot", path=f"/run/{name}", how=f["how"], at=f["at"])
        self.damaged.add(have[-1])
        self.did[self._kind][f"{f['how']}ped" if f["how"] == "flip" else "torn"] += 1
        t = self.trainer = self.start_trainer()
        if not self.wait_training(t):
            return  # ensure_trainer reports the exit
        resumed = re.search(r"resuming \S+ from (step_\d+\.bin)", t.text())
        if re.search(rf"refusing checkpoint \S*{re.escape(name)}", t.text()):
            self.did[self._kind]["refused, naming it"] += 1
        else:
            self.violate("1", f"a {f['how']} of {name} ({rot}) was not refused at start:\n{t.tail()}")
        if resumed and resumed.group(1) == name:
            self.violate("1", f"the trainer resumed from the damaged {name} ({rot}):\n{t.tail()}")

    def _rot_a_boundary(self, f: dict, name: str) -> None:
        """The newest checkpoint is a pivot's boundary, damaged: resuming before it would train the
        previous policy's steps again under the new one, so the trainer refuses to start (exit 2, the
        boundary named, "restore it from a copy"; tests/test_powercut.py); the operator's copy put back,
        the next start resumes from it."""
        copy = self.store.read(f"run/{name}")
        rot = self.store.layer.call("rot", path=f"/run/{name}", how=f["how"], at=f["at"])
        t = self.trainer = self.start_trainer()
        started = self.wait_training(t, timeout=TOOL_BOUND)
        if started:
            self.violate(
                "1", f"a {f['how']} of the pivot boundary {name} ({rot}) did not stop the start:\n{t.tail()}"
            )
            return
        rc = t.popen.wait(30)
        t.expect_exit = True
        said = t.text()
        if rc != 2 or f"starts at {name} (the pivot's boundary), which is not valid" not in said:
            self.violate(
                "1",
                f"a {f['how']} of the pivot boundary {name}: exit {rc}, not its error:\n{t.tail()}",
            )
            return
        self.did[self._kind]["a pivot's boundary: refused (exit 2), restored from a copy"] += 1
        path = Path(self.store.run_url) / name  # the operator's restore: whole, then renamed, synced
        tmp = path.with_name(f".{name}.restore")
        with open(tmp, "wb") as out:
            out.write(copy)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        t = self.trainer = self.start_trainer()
        if self.wait_training(t) and not re.search(rf"resuming \S+ from {re.escape(name)}", t.text()):
            self.violate("1", f"restored, the pivot boundary {name} was not resumed from:\n{t.tail()}")

    def _phases(self) -> set[str]:
        return {n for n in self.store.listdir("run/archive") if n.startswith("phase_")}

    def _pivot_cmd(self, policy: str) -> list[str]:
        return [
            "pivot",
            self.store.run_url,
            "--policy",
            self.policies[policy],
            "--no-restart",
            "--max-steps",
            str(self.big),
            "--timeout",
            str(TOOL_BOUND),
        ]

    def _run_pivot(self, policy: str, kill: str | None, kill_s: float = 0.0) -> int:
        argv = self._pivot_cmd(policy)
        if self.trainer is not None:
            self.trainer.expect_exit = True  # the pivot stops it (exit 0)
        if kill == "random":
            p = self.spawn("pivot", argv)
            time.sleep(kill_s)
            p.signal(signal.SIGKILL)
            rc = p.wait(TOOL_BOUND)
            return -9 if rc is None else rc
        extra = {"ANDREA_TEST_PIVOT_KILL_AFTER": kill} if kill else {}
        rc, out = self.tool("pivot", argv, **extra)
        if rc not in (0, -9):
            self.violate("7", f"andrea pivot exited {rc}:\n{out[-2000:]}")
        return rc

    def f_pivot(self, f: dict) -> None:
        policy = POLICIES[1 - POLICIES.index(self.policy)]
        before = self._phases()
        rc = self._run_pivot(policy, f["kill"], f.get("kill_s", 0.0))
        if rc != 0:  # killed: rerun the same pivot, as the journal says to
            self._settle_after_kill()
            rc, out = self.tool("pivot", self._pivot_cmd(policy))
            if rc != 0:
                self.violate("7", f"the rerun pivot exited {rc}:\n{out[-2000:]}")
        new = self._phases() - before
        if len(new) > 1:
            self.violate("3", f"one pivot made {len(new)} phase folders: {sorted(new)}")
        if new:
            boundary = int(re.search(r"step_(\d+)", max(new)).group(1))
            self.events.append(("pivot", boundary, policy))
            self.closed.append((boundary, time.time()))
            self.policy = policy
        self.trainer.expect_exit = True
        self.ensure_trainer()

    def _settle_after_kill(self) -> None:
        """A pivot killed before it stopped the trainer leaves it training: fine. Killed after, the
        trainer is gone and the rerun finishes the stop."""
        if self.trainer is not None and self.trainer.popen.poll() is not None:
            self.trainer.expect_exit = True

    def f_abandon(self, f: dict) -> None:
        policy = POLICIES[1 - POLICIES.index(self.policy)]
        before = self._phases()
        self._run_pivot(policy, f["kill"])
        # As systemd would: a start, refused with the journal's two ways out (exit 2).
        refused = self.start_trainer()
        rc = refused.wait(TOOL_BOUND)
        time.sleep(0.05)
        if rc != 2 or "pivot.json" not in refused.text():
            self.violate(
                "7", f"a trainer on a half-done pivot exited {rc}, not 2 naming pivot.json:\n{refused.tail()}"
            )
            if rc is None:
                refused.signal(signal.SIGKILL)
            if rc == 0 or rc is None:
                self.trainer = refused
        rc, out = self.tool("abandon", ["pivot", self.store.run_url, "--abandon"])
        if rc != 0:
            self.violate("7", f"andrea pivot --abandon exited {rc}:\n{out[-2000:]}")
        if self._phases() != before:
            self.violate("3", f"--abandon left the phases {sorted(self._phases())}, not {sorted(before)}")
        if self.trainer is not None:
            self.trainer.expect_exit = True
        self.ensure_trainer()

    def f_fork(self, f: dict) -> None:
        # A multiple of keep_every stays for good; the newest grid checkpoint (before the first) may be
        # deleted by retention while the fork reads it (a clear refusal, then retried on a newer one).
        have = self.checkpoints()
        grid = [s for s in have if s % (10 * self.every) == 0] or [s for s in have if s % self.every == 0]
        if not grid:
            return
        step = grid[-1]
        self.forks += 1
        names = [f"f{self.forks}a", f"f{self.forks}b"]
        argv = ["fork", self.store.run_url, "--step", str(step), "--replicates", "1"]
        for n in names:
            argv += ["--branch", n]
        if f["kill"] == "checkpoint":
            self.tool("fork", argv, ANDREA_TEST_FORK_KILL_AFTER=f"{names[0]}/{checkpoint_name(step)}")
        elif f["kill"] == "random":
            p = self.spawn("fork", argv)
            time.sleep(f["kill_s"])
            p.signal(signal.SIGKILL)
            p.wait(TOOL_BOUND)
        rc, out = self.tool("fork", argv)
        if rc == 2 and "no such file" in out and step % (10 * self.every) and step not in self.checkpoints():
            return  # retention deleted it meanwhile, before any line was added: nothing was forked
        if rc != 0:
            self.violate("4", f"andrea fork --step {step} exited {rc}:\n{out[-2000:]}")
            return
        self.events.append(self._fork_event(step, names))

    def _fork_event(self, step: int, names: list[str]) -> tuple:
        """("fork", step, names, through): the reference forks once trained through `through`. A fork
        copies the parent's checkpoint `step` as it is at that moment; a guard rollback that went back
        past `step` set the first one aside and its remedied replay wrote another (skip, lr factor).
        The reference meets each poisoned step only when it trains through it, so a fork the soak made
        after such a rollback is made there after the reference's own: it trains through D first
        (`--kinds guard-rollback,fork --faults 2 --seed 25`: the rollback at 107 to 50, the fork at 100;
        forked before 107, the reference's branches held the first 100, refused/ in both parents)."""
        past = [d["step"] for d in self.divergences if d["to"] < step <= d["step"]]
        through = (max(past) // self.every + 1) * self.every if past else step  # the checkpoint after D
        return ("fork", step, names, through)

    def f_readers(self, f: dict) -> None:
        run = self.store.run_url
        cmds = [["status", run], ["gc", run, "--dry-run"], ["gc", run], ["lineage", run]]
        fork = next((e for e in reversed(self.events) if e[0] == "fork"), None)
        if fork:
            branches = [f"{run}-fork{fork[1]}-{n}" for n in fork[2]]
            cmds.append(
                [
                    "compare",
                    *branches,
                    "--out",
                    str(self.work / f"report-{self.fault_i}"),
                    "--val-sequences",
                    "4",
                ]
            )
        holder = self.trainer
        alive_before = holder is not None and holder.popen.poll() is None
        since = time.monotonic()
        procs = [(c, self.spawn(c[0], c)) for c in cmds]
        for c, p in procs:
            rc = p.wait(TOOL_BOUND)
            time.sleep(0.05)
            if c[0] == "status" and rc == 0:
                # (10) what it said against what was true: alive from before it started to after it ended
                alive = alive_before and holder.popen.poll() is None
                self._status_truth(p, alive=True if alive else None, since=since)
            if rc is None:
                p.signal(signal.SIGKILL)
                self.violate("7", f"andrea {c[0]} did not end within {TOOL_BOUND:g}s")
            elif rc == 2 and c[0] == "gc" and "--dry-run" not in c and "is in use by trainer" in p.text():
                pass  # gc takes the lock (retention is the trainer's while it runs): a clear refusal
            elif rc != 0:
                self.violate("7", f"andrea {' '.join(c[:1])} exited {rc} on a live run:\n{p.tail()}")

    def f_second_trainer(self, f: dict) -> None:
        before = self.lock()
        second = self.start_trainer()
        rc = second.wait(TOOL_BOUND)
        if rc != 2:
            self.violate("5", f"a second trainer on the live run exited {rc}, not 2:\n{second.tail()}")
            if rc is None:
                second.signal(signal.SIGKILL)
        after = self.lock()
        if (
            before
            and after
            and (before.get("pid"), before.get("generation")) != (after.get("pid"), after.get("generation"))
        ):
            if self.trainer.popen.poll() is None:
                self.violate("5", f"a refused second trainer changed the lock: {before} -> {after}")

    # --- the machine's faults (issue 48, items 4-5) ----------------------------------------------

    def _system_setup(self, schedule: list[dict]) -> None:
        """What the SYSTEM kinds drawn need, before anything starts: the clock shim built and a clock
        file for each host (all offsets 0), the cache folder a tmpfs of its own."""
        kinds = {f["kind"] for f in schedule}
        self.clocks: dict[str, Path] = {}
        self.cache_mounted = False
        if kinds & {"clock-step", "suspend"}:
            shim = self.work / "clockshim.so"
            subprocess.run(
                [
                    "cc",
                    "-O2",
                    "-shared",
                    "-fPIC",
                    "-o",
                    str(shim),
                    str(REPO / "bench" / "clockshim.c"),
                    "-ldl",
                ],
                check=True,
            )
            self.shim = shim
            for host in HOSTS:
                self.clocks[host] = self.work / f"clock-{host}"
                self.clocks[host].write_bytes(struct.pack("=qq", 0, 0))
        if "cache-full" in kinds:
            self.cache.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1024m", "tmpfs", str(self.cache)], check=True)
            self.cache_mounted = True

    def _system_close(self) -> None:
        if getattr(self, "cache_mounted", False):
            subprocess.run(["umount", "-l", str(self.cache)], check=False)
            self.cache_mounted = False

    def _clock_env(self, host: str) -> dict[str, str]:
        """A process of `host` reads that machine's clocks (bench/clockshim.c), when clock kinds are drawn."""
        if host not in getattr(self, "clocks", {}):  # the reference's machine ("soak-ref") keeps time
            return {}
        return {"LD_PRELOAD": str(self.shim), "ANDREA_SOAK_CLOCK_FILE": str(self.clocks[host])}

    def _shift_clock(self, host: str, wall: float = 0.0, mono: float = 0.0) -> tuple[float, float]:
        """Step `host`'s wall clock by `wall` s, its monotonic clock by `mono`: its offsets after."""
        path = self.clocks[host]
        w, m = struct.unpack("=qq", path.read_bytes())
        w, m = w + round(wall * 1e9), m + round(mono * 1e9)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, struct.pack("=qq", w, m), 0)  # in place: the processes map these 16 bytes
        finally:
            os.close(fd)
        return w / 1e9, m / 1e9

    def _clock_seen(self, p: Proc, since: float) -> float | None:
        """How far `p`'s wall clock is from ours: its first log line stamped after `since`, against when
        it was read (to a second: the stamp's resolution)."""
        import calendar

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for t, line in list(p.lines):
                m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)Z ", line)
                if t >= since and m:
                    return calendar.timegm(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) - t
            if p.popen.poll() is not None:
                break
            time.sleep(0.05)
        return None

    def f_clock_step(self, f: dict) -> None:
        """The holder's machine's wall clock stepped back or forward (NTP, `date -s`), with a trainer of
        the other machine watching the lease or not: the lease is neither lost nor taken over, the next
        checkpoint is written, and `andrea status` on the stepped machine gives the speed the trainer
        trains at (its loss log's times jump with the clock)."""
        holder, host, d = self.trainer, self.host, self.did["clock-step"]
        g0 = self._held_generation(holder)
        w = self._waiter(2 * TTL_S) if f["waiter"] else None
        stepped = time.time()
        offset, _ = self._shift_clock(host, wall=f["shift_s"])
        d["stepped back" if f["shift_s"] < 0 else "stepped forward"] += 1
        self._checkpoint_after(holder, f"a wall-clock step of {f['shift_s']:+g}s")
        seen = self._clock_seen(holder, stepped + 0.5)
        if seen is not None and abs(seen - offset) <= 2.5:
            d["trainer's clock seen stepped"] += 1
        else:
            self.violate("7", f"the trainer's log stamps are {seen}s from ours, its clock offset {offset:g}s")
        # Its lease renewals (every RENEW_S) stamped by the stepped clock: the newest within 10 s.
        deadline, off_by = time.monotonic() + 10, None
        while time.monotonic() < deadline and holder.popen.poll() is None:
            lock = self.lock() or {}
            off_by = (lock.get("renewed_at") or 0) - time.time() - offset
            if abs(off_by) < 5:
                d["lease renewals stamped by the stepped clock"] += 1
                break
            time.sleep(0.2)
        else:
            self.violate(
                "7", f"the holder's lease renewals are {off_by}s off its stepped clock ({offset:g}s)"
            )
        lock = self.lock() or {}
        if lock.get("generation") != g0 and holder.popen.poll() is None:
            self.violate(
                "5", f"a wall-clock step changed the lock's generation {g0} -> {lock.get('generation')}"
            )
        if w is not None:
            if w.first(r"taking over the stale lock"):
                self.violate(
                    "5", f"a wall-clock step of the holder's machine let another take over:\n{w.tail()}"
                )
            self._stop_waiter(w)
            d["waiter saw the lease renewed"] += 1
        if holder.popen.poll() is not None:
            return

        # (10) status's speed on the stepped machine, once ten steps are logged since the step, against
        # the rate the soak saw this trainer's steps at over status's own window, the last minute up to
        # the newest step it read (the soak's clock, never stepped; the checkpoints and audits that
        # window holds, not a burst: ten steps between two checkpoints ran 44.7 steps/s where the
        # trainer's last minute, a checkpoint every 5 steps, held 6.2, once a warm status answered at
        # once): within x3. Up to its answer instead, the window held the steps logged while status ran:
        # a trainer started 15 steps before, an audit's 3 s pause after them, read 13.85 steps/s against
        # 4.44 (the S3 round of 2026-12-07, fault 544; status's 13.85 was the steps it measured).
        def since_step() -> list[float]:
            return [
                t for t, line in list(holder.lines) if t > stepped + 0.5 and re.search(r"step \d+/", line)
            ]

        def last_minute(newest: int) -> list[float]:
            """The soak's stamps of the step lines of status's window: the minute up to the line of the
            newest step status read (`newest`), not up to its answer: the steps logged while it ran
            (an audit's pause among them) are not in what it measured."""
            logged = [
                (t, int(m[1])) for t, line in list(holder.lines) if (m := re.search(r"step (\d+)/", line))
            ]
            end = next((t for t, step in logged if step == newest), None)
            return [] if end is None else [t for t, step in logged if end - 60 <= t <= end and step <= newest]

        deadline = time.monotonic() + 120
        while len(since_step()) < 10 and holder.popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        steps = since_step()
        if len(steps) < 10:
            d["status not asked (the trainer ended)"] += 1
            return
        rc, out = self.tool("status", ["status", self.store.run_url])
        newest = re.search(r"^\s*step\s+(\d+) of ", out, re.M)
        steps = []
        if newest:  # its line may reach the soak just after status read the step from .loss.json
            deadline = time.monotonic() + 10
            while len(steps := last_minute(int(newest[1]))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        m = re.search(r"speed\s+[\d,]+ tokens/s, ([\d.]+) steps/s", out)
        truth = (len(steps) - 1) / max(steps[-1] - steps[0], 1e-3) if len(steps) > 1 else math.nan
        if rc != 0 or m is None or len(steps) < 2:
            self.violate(
                "10",
                f"after a clock step of {f['shift_s']:+g}s and {len(steps)} steps since, status gave no "
                f"speed (the trainer ran {truth:.2f} steps/s):\n{out[-2000:]}",
            )
            return
        said = float(m.group(1))
        ratio = round(said / truth, 2)
        d["status's speed / the true one (max)"] = max(d.get("status's speed / the true one (max)", 0), ratio)
        if not 1 / 3 <= ratio <= 3:
            self.violate(
                "10",
                f"after a clock step of {f['shift_s']:+g}s status said {said} steps/s, "
                f"the trainer ran {truth:.2f}:\n{out[-2000:]}",
            )

    def f_suspend(self, f: dict) -> None:
        """The holder's machine suspended longer than the ttl (its monotonic clock stops, CLOCK_BOOTTIME
        and the wall clock run on: SIGSTOP, then its host's monotonic offset moved back by the time
        stopped), aimed at a random moment or a checkpoint's writes, while a trainer of the other
        machine watches: that one takes over; the woken holder publishes nothing and exits 2."""
        holder, host, d = self.trainer, self.host, self.did["suspend"]
        g0 = self._held_generation(holder)
        w = self._waiter(4 * TTL_S + f["stop_s"] + 30)
        if f["at"] == "ckpt":
            self._at_boundary()  # holder is the live trainer
        stopped = time.time()
        holder.signal(signal.SIGSTOP)
        holder.expect_exit = True
        took, present = None, set()
        deadline = time.monotonic() + max(f["stop_s"], TAKEOVER_BOUND)
        while time.monotonic() < deadline and w.popen.poll() is None:
            took = w.first(r"taking over the stale lock")
            if took:
                break
            listed = set(self.checkpoints())
            if (self.lock() or {}).get("generation") == g0:
                present = listed
            time.sleep(0.02)
        time.sleep(max(0.0, f["stop_s"] - (time.time() - stopped)))
        asleep = time.time() - stopped
        self._shift_clock(host, mono=-asleep)  # the wake: its monotonic clock did not count the sleep
        holder.signal(signal.SIGCONT)
        d["suspends"] += 1
        d["seconds the monotonic clock stopped"] += asleep
        if took is None:
            self.violate("7", f"a holder suspended {asleep:.1f}s was not taken over:\n{w.tail()}")
            w.expect_exit = True
            w.signal(signal.SIGKILL)
            w.wait(30)
            holder.expect_exit = holder.popen.poll() is not None
            return
        d["taken over"] += 1
        self._lost_holder(holder, w, took, present, f"a suspend of {asleep:.1f}s")
        if holder.popen.returncode == 2:
            d["woken holder exited 2"] += 1

    def f_oom_trainer(self, f: dict) -> None:
        """The trainer, started by the product's supervisor (supervise.TrainerProcess, as the Prefect
        task starts it) in a memory cgroup, killed there by the kernel's OOM killer: the kernel takes
        the trainer (its oom_score_adj raised by the product), never the supervisor, though that holds
        more memory than the trainer (a ballast: a Prefect flow-run process is about 330 MB resident,
        a CPU trainer here about 285 MB); the supervisor's error names it, status says it is not
        training, and the next trainer resumes.
        The claim is the kernel's first choice, as tests/test_oom.py's: the kernel may kill a second
        process of the group 4-9 ms after the trainer (the hog's retried charge while the trainer is
        still charged: the injector's artifact, not what a real OOM does), then the episode's second
        victim is named in the report and the fault thrown again in a fresh group, at most 3 episodes;
        a first victim other than the trainer is a violation at once."""
        from memcg import MemoryGroup

        d = self.did["oom-trainer"]
        rc = self.stop_trainer(signal.SIGTERM)
        if rc != 0:
            self.violate("7", f"SIGTERM before the OOM fault: exit {rc}:\n{self.trainer.tail()}")
        for episode in range(3):
            judged = self._oom_episode(f, MemoryGroup(f"soak-{self.fault_i}-{episode}"), d, last=episode == 2)
            if judged:
                return

    def _oom_episode(self, f: dict, group, d: Counter, last: bool) -> bool:
        """One OOM kill of the supervised trainer in `group` (a fresh MemoryGroup): False if the kernel
        killed a second process after the trainer (the episode named, nothing more judged) and another
        may be thrown."""
        from andrea_core.oom import TRAINER_OOM_BIAS

        with group:
            code = (
                "import sys; from andrea_core.ops.supervise import TrainerProcess\n"
                "open(sys.argv[2], 'w').write(sys.argv[3])\n"  # born in the group, its trainer too
                "ballast = b'x' * int(sys.argv[5])\n"  # as large as a flow-run process, charged there
                "t = TrainerProcess(sys.argv[1], device='cpu', max_steps=int(sys.argv[4])).start()\n"
                "for line in t.lines(): print(line, flush=True)\n"
                "print('OUTCOME: ' + t.outcome().describe(), flush=True)\n"
            )
            argv = [
                PYTHON,
                "-c",
                code,
                self.store.run_url,
                str(group.path / "cgroup.procs"),
                "0",
                str(self.big),
                str(SUPERVISOR_BALLAST),
            ]
            # Cold under --warm too: a `python -c` supervisor that puts itself in the group before the
            # product's TrainerProcess starts the trainer there (the start under test, cold as a user's).
            popen = subprocess.Popen(
                ["nice", "-n", str(self.args.nice), *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=self.env(), cwd=REPO, start_new_session=True,
            )  # fmt: skip
            sup = Proc(popen, "trainer", self.host)
            self.procs.append(sup)
            self.trainer = sup
            if not self.wait_training(sup):
                return True
            time.sleep(f["after_s"])
            pid = (self.lock() or {}).get("pid")
            if not isinstance(pid, int) or pid not in group.pids():
                self.violate("7", f"the supervised trainer (pid {pid}) is not in its group {group.pids()}")
                return True
            adj = {p: _oom_score_adj(p) for p in (popen.pid, pid)}
            if adj[pid] != min(1000, adj[popen.pid] + TRAINER_OOM_BIAS):
                self.violate(
                    "7", f"the trainer's oom_score_adj is {adj[pid]}, its supervisor's {adj[popen.pid]}"
                )
            kills = group.kills()
            killed = group.oom_kill(pid)
            kills, victims = group.kills() - kills, group.victims
            sup.expect_exit = True
            names = {pid: "the trainer", popen.pid: "the supervisor"}
            again = killed and victims is not None and victims[:1] == [pid] and len(victims) > 1 and not last
            if again:  # the episode's second kill (the docstring): named, the fault thrown again
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
            rc = sup.wait(TERM_BOUND)
            said = next((line for _, line in sup.lines if line.startswith("OUTCOME: ")), "")
        if self.args.verbose:
            shown = "unreadable" if victims is None else [names.get(v, v) for v in victims]
            print(f"  oom-trainer: {kills} OOM kill(s), the kernel log names {shown}; supervisor exit {rc}")
        if not killed:
            self.violate("7", f"the kernel did not kill the trainer in its memory cgroup:\n{sup.tail()}")
            return True
        d["killed by the kernel"] += 1
        if victims is not None:
            d["the kernel log names the trainer first"] += victims[:1] == [pid]
            d["the kernel log names the supervisor first"] += victims[:1] == [popen.pid]
        who = f"trainer {pid}, supervisor {popen.pid}"
        if victims is not None and victims[:1] != [pid]:
            self.violate("7", f"the kernel's first OOM victim was not the trainer: {victims} ({who})")
            return True
        if again or (victims is not None and len(victims) > 1):
            second = " and ".join(str(names.get(v, v)) for v in victims[1:])  # ", " parts the report
            d[f"episodes the kernel killed again after the trainer ({second})"] += 1
            if again:
                return False
            d["the supervisor not judged (3 episodes, each killed twice)"] += 1  # as test_oom skips
            return True
        if kills != 1:  # one fault, one kill (the group's count; the kernel log may be unreadable here)
            self.violate("7", f"{kills} OOM kills, the kernel log names {victims} ({who})")
        if "killed by the kernel: out of memory" in said:
            d["supervisor said out of memory"] += 1
        else:
            self.violate("7", f"an OOM-killed trainer's supervisor said: {said or sup.tail()}")
        if rc != 0:
            self.violate("7", f"the supervisor exited {rc}:\n{sup.tail()}")
        else:
            d["supervisor survived"] += 1
        st, p = self.tool_proc("status", ["status", self.store.run_url])
        if st == 0:
            self._status_truth(p, alive=False)
        return True

    def f_cache_full(self, f: dict) -> None:
        """The cache folder (token shards; on S3 also the mirrors of the run's appended files: a tmpfs of
        its own) full, not a byte or 64 kB left, while a trainer is killed and another starts: it resumes
        and trains; then filled to the last byte under the running trainer (its appends to .loss.json's
        mirror fail there on S3) for two checkpoints' steps: it trains on; status answers. The end's
        invariants check the loss log it published byte for byte against the reference's history."""
        from full import fill

        d = self.did["cache-full"]
        filler = fill(self.cache, f["leave"], prefix=".soak-filler-")
        try:
            d["cache filled"] += 1
            self.stop_trainer(signal.SIGKILL)
            self.trainer = self.start_trainer()
            if self.wait_training(self.trainer):
                n = self.trainer.step()
                self.wait_steps(3)
                d["resumed and trained on a full cache"] += self.trainer.step() >= n + 3
                under = fill(self.cache, 0, prefix=".soak-filler-")  # what its start freed, taken too
                try:
                    n = self.trainer.step()
                    self.wait_steps(2 * self.every)
                    d["trained on as the cache filled under it"] += self.trainer.step() >= n + 2 * self.every
                finally:
                    under.unlink(missing_ok=True)
            else:
                self.violate("7", f"a trainer did not start with the cache full:\n{self.trainer.tail()}")
                self.trainer.expect_exit = True
            rc, p = self.status_read()
            if rc != 0:
                self.violate("7", f"andrea status on a full cache exited {rc}:\n{p.text()[-2000:]}")
        finally:
            filler.unlink(missing_ok=True)

    # --- features under chaos (issue 48 item 6) ---------------------------------------------------

    def _guard_events(self) -> list:
        from andrea_core.run.guard_events import parse_events

        return parse_events(self.store.read("run/guard.jsonl") or b"", warn=lambda _: None)

    def _phase_start(self) -> int:
        return max((e[1] for e in self.events if e[0] == "pivot"), default=0)

    def f_guard_rollback(self, f: dict) -> None:
        """A non-finite step D (its batch's data position poisoned), D at least rollback_margin past the
        phase's start so that a checkpoint far enough back exists in both runs; a SIGKILL at one of the
        rollback's own points, or after it. The run must roll back once, to the newest kept checkpoint
        at least rollback_margin before D, skip the poisoned batch and train past D."""
        from andrea_core.run.guard_events import Remedies

        d, margin = self.did["guard-rollback"], 50  # train.guard.rollback_margin's default
        self.stop_trainer(signal.SIGTERM)  # the trainer to come has the poisoned position in its env
        before = self._guard_events()
        first = len(self.procs)  # this fault's trainers are spawned from here on (the reference's too)
        step = max(self.checkpoints(), default=0)
        # A checkpoint (the phase's boundary, or one from step 50 on) at least rollback_margin before D:
        # else a branch's or a phase's rollback goes to its floor, remedied from there.
        D = max(step + f["ahead"], (self._phase_start() or 10 * self.every) + margin + f["ahead"])
        # A checkpoint this run never wrote (a full disk's) may send its rollback further back than the
        # reference's (retention keeps every one that may become the rollback point, so only that far);
        # the remedy starts from the same anchor all the same (guard.py remedy_from), so every later
        # step is the reference's: the soak throws that case as it comes.
        self.poisoned.append(Remedies(before).data_step(D))
        listed = self.checkpoints()
        extra = {"ANDREA_TEST_GUARD_SIGNAL": f"{f['kill']}:SIGKILL"} if f["kill"] != "after" else {}
        t = self.trainer = self.start_trainer(**(extra if f["kill"] else {}))
        said = rf"guard: non-finite-\S+ at step {D} "
        deadline = time.monotonic() + TOOL_BOUND
        seen = set(listed)  # every checkpoint listed before the spike: the rollback's candidates
        while time.monotonic() < deadline and t.popen.poll() is None and not t.first(said):
            seen.update(self.checkpoints())
            time.sleep(0.02)
        if f["kill"] == "after" and t.first(said):
            time.sleep(f["after_s"])
            self.stop_trainer(signal.SIGKILL)
        elif f["kill"]:
            rc = t.wait(TOOL_BOUND)
            t.expect_exit = True
            d[f"killed at {f['kill']}" if rc == -signal.SIGKILL else f"not killed at {f['kill']} ({rc})"] += 1
        self.ensure_trainer()
        t = self.trainer
        deadline = time.monotonic() + TOOL_BOUND
        while time.monotonic() < deadline and t.popen.poll() is None and t.step() <= D + 1:
            # Killed before the event was recorded (at set-aside), the rollback is decided again by the
            # replay, against what it wrote retraining from the first decision's target: with a gap in
            # the first timeline (a full disk's unwritten checkpoints) a newer one, the fault-free run's
            # (fault 332, 2026-12-06: 10285 first, then 10650, written by the replay, unseen here).
            if len(self._guard_events()) == len(before):
                seen.update(self.checkpoints())
            time.sleep(0.05)
        self._checkpoint_after(t, f"a divergence at step {D}")
        new = self._guard_events()[len(before) :]
        if len(new) != 1 or new[0].action != "rollback" or new[0].step != D:
            self.violate("11", f"a non-finite step at {D}: guard.jsonl's new events {new}, not one rollback")
            return
        e, floor = new[0], self._phase_start()
        listed = sorted(seen)  # every checkpoint listed until the event was recorded
        far = [s for s in listed if floor <= s <= D - margin]
        kept = [
            s for s in far if s % (10 * self.every) == 0 or s in {x[1] for x in self.events if x[0] != "data"}
        ]
        initial = e.rolled_back_to == 0 == floor and not far  # the initial weights: step 0's checkpoint
        if (e.rolled_back_to not in listed and not initial) or (far and e.rolled_back_to > D - margin):
            self.violate(
                "11", f"the rollback at {D} went to {e.rolled_back_to}, not a kept checkpoint {listed}"
            )
        elif kept and e.rolled_back_to < max(kept):
            self.violate("11", f"the rollback at {D} went to {e.rolled_back_to}, {max(kept)} was kept")
        elif e.remedy_from != max(e.rolled_back_to, D - margin):
            # The remedy's anchor is the spike's, not the checkpoint's: a full disk's unwritten grid
            # checkpoint moves the target back, never the data the run trains on after (guard_events).
            self.violate(
                "11",
                f"the rollback at {D} to {e.rolled_back_to} remedies from {e.remedy_from}, not {D - margin}",
            )
        else:
            d["rolled back to a checkpoint kept before the spike"] += 1
        mine = [p for p in self.procs[first:] if p.what == "trainer"]  # not the reference's, spawned beside
        if any("guard: replaying" in line for p in mine for _, line in p.lines):
            d["replayed by a restart"] += 1
        self.divergences.append({"step": D, "to": e.rolled_back_to})

    def f_data_change(self, f: dict) -> None:
        """Between two starts, a file of the prose arm's local folder added, changed or removed (README
        "When data changes"): the trainer resumed at step S warns naming the arm and data.jsonl records
        {"step": S, "arm": "docs-prose", "event": "changed"} when the policy in force reads that folder,
        nothing when it does not. The reference makes the same change at the same step (it stops at S,
        the soak waits), so the runs still agree byte for byte afterwards."""
        import yaml

        d = self.did["data-change"]
        self.stop_trainer(signal.SIGTERM)
        step = max(self.checkpoints(), default=0)
        applied = threading.Event()
        self.events.append(("data", step, {"change": f["change"], "i": self.fault_i, "applied": applied}))
        deadline = time.monotonic() + 1800
        while not applied.wait(1.0):
            if self.ref_error is not None or not self.ref_thread.is_alive() or time.monotonic() > deadline:
                raise Violation(f"the reference did not make the data change at step {step}")
        before = (self.store.read("run/data.jsonl") or b"").count(b"\n")
        t = self.trainer = self.start_trainer()
        if not self.wait_training(t):
            return  # ensure_trainer reports the exit
        resumed = re.search(r"resuming \S+ from step_(\d+)\.bin", t.text())
        at = int(resumed.group(1)) if resumed else None
        lines = (self.store.read("run/data.jsonl") or b"").split(b"\n")[before:]
        new = [json.loads(x) for x in lines if x.strip()]
        doc = yaml.safe_load(Path(self.policies[self.policy]).read_text())
        reads = any(a["kind"] == "prose" for a in doc["arms"])
        want = [{"step": at, "arm": "docs-prose", "event": "changed"}] if reads else []
        got = [{k: e.get(k) for k in ("step", "arm", "event")} for e in new]
        warned = bool(t.first(r"warning: arm 'docs-prose': its source changed"))
        if got != want or warned != reads:
            self.violate(
                "11",
                f"a file {f['change']}d at step {at}: data.jsonl's new lines {got}, not {want}; "
                f"warned: {warned}:\n{t.tail()}",
            )
        else:
            d[
                f"{f['change']}: seen in data.jsonl and warned"
                if reads
                else f"{f['change']}: arm not in force"
            ] += 1
        # The change is done once a checkpoint past it is written: until then a later fault that tears
        # the newest checkpoint (S) sends the run back before the change, to retrain steps the reference
        # trained on the old data with the new (no run could do otherwise: the old data is gone).
        self._checkpoint_after(t, f"a data change at step {at}")

    def _change_data(self, change: str, i: int) -> None:
        """The data change of fault `i` to the prose arm's folder (sorted by name: the arm reads its
        first files, data.max_source_bytes)."""
        from andrea_core.data.policy import ArmSpec
        from andrea_core.data.sources import _files_for

        prose = self.work / "prose"
        files = _files_for(ArmSpec(name="docs-prose", kind="prose", paths=[str(prose)]))  # what it reads
        if change == "add":
            (prose / f"000000_{i:05d}__soak-added.md").write_text(f"Added by the soak's fault {i}.\n" * 20)
        elif change == "change":
            files[0].write_bytes(files[0].read_bytes() + f"\nChanged by the soak's fault {i}.\n".encode())
        elif len(files) > 2:
            files[1].unlink()

    def _our_trainer(self, pid: int) -> bool:
        """Whether `pid` is still a trainer of this run (checked before it is signalled)."""
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return b"andrea_core" in argv and b"train" in argv and self.store.run_url.encode() in argv

    def f_pivot_remote(self, f: dict) -> None:
        """`andrea pivot --at now|boundary --restart|--no-restart` from the other host while the trainer
        runs (a request through the run directory), the pivot or the trainer SIGKILLed kill_s into it,
        a trainer drawn past AT_STOP_S as the pivot asks it to stop (a trainer restarted at once, as
        systemd would: the pivot stops it too; a pivot that failed, the same command again). Then: one
        phase folder more, its boundary checkpoint in the run,
        .loss.json's bytes before the pivot a prefix of its bytes after, and with --restart a trainer
        of the pivoting host training past the boundary (stopped, SIGTERM, by its pid, checked)."""
        d, other = self.did["pivot-remote"], HOSTS[1 - HOSTS.index(self.host)]
        policy = POLICIES[1 - POLICIES.index(self.policy)]
        # A request id of its own (the `pivot` kind gives none): its rerun is known exactly, not inferred
        # from the policy in force (design.md "A completed pivot, rerun").
        argv = [*self._pivot_cmd(policy), "--at", f["at"], "--request-id", f"soak-{self.fault_i}"]
        if f["restart"]:
            argv[argv.index("--no-restart")] = "--restart"
        before, loss = self._phases(), self.store.read("run/.loss.json") or b""
        loss = loss[: loss.rfind(b"\n") + 1]
        self.trainer.expect_exit = True
        p = self.spawn("pivot", argv, host=other)
        at_stop = f["kill"] == "trainer" and f["kill_s"] > AT_STOP_S
        if at_stop:
            # The trainer dies as the pivot asks it to stop (it reads the request at its next renewal),
            # and the restart below takes the lease over while the pivot waits for the stop (issue 48,
            # seed 1: the pivot took that for the stop and left a half-done pivot no rerun finished).
            deadline = time.monotonic() + TOOL_BOUND
            while p.first(r" to stop \(") is None and p.popen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
        elif f["kill"]:
            time.sleep(f["kill_s"])
        if f["kill"]:
            victim = p if f["kill"] == "pivot" else self.trainer
            killed = victim.popen.poll() is None
            victim.signal(signal.SIGKILL)
            at_stop = at_stop and killed
            how = "as the pivot asked it to stop" if at_stop else "mid-pivot"
            d[f"{f['kill']} killed {how}" if killed else f"{f['kill']} done before the kill"] += 1
            if f["kill"] == "trainer" and killed:
                # As systemd would (Restart=on-failure): a trainer again, which the pivot must find.
                self.trainer = self.start_trainer()
                self.trainer.expect_exit = True
        rc = p.wait(TOOL_BOUND)
        if at_stop and rc == 0:
            took = p.first(r"took the run over \(lease generation") is not None
            d["pivot finished: the restart took the run over, stopped too" if took else "pivot finished"] += 1
        if rc != 0:
            if not f["kill"]:
                self.violate("7", f"andrea pivot from {other} exited {rc}:\n{p.tail()}")
            d[f"pivot exited {rc} (killed: {f['kill']})"] += 1
            if self.trainer.popen.poll() is not None:  # a pivot half-done refuses it (exit 2): fine
                self.trainer = self.start_trainer()
                self.wait_training(self.trainer)
                self.trainer.expect_exit = True
            p = self.spawn("pivot", argv, host=other)
            rc = p.wait(TOOL_BOUND)
            d["rerun"] += 1
            if rc != 0:
                self.violate("7", f"the rerun pivot from {other} exited {rc}:\n{p.tail()}")
        time.sleep(0.05)
        new = self._phases() - before
        if len(new) != 1:
            self.violate("3", f"a pivot from {other} made {len(new)} phase folders: {sorted(new)}")
        if new:
            boundary = int(re.search(r"step_(\d+)", max(new)).group(1))
            self.events.append(("pivot", boundary, policy))
            self.closed.append((boundary, time.time()))
            self.policy = policy
            if f["at"] == "boundary" and boundary % self.every:
                self.violate("11", f"--at boundary pivoted at {boundary}, off the checkpoint grid")
            if self.store.read(f"run/{checkpoint_name(boundary)}") is None:
                self.violate("11", f"the pivot's boundary {checkpoint_name(boundary)} is not in the run")
            d[f"pivoted --at {f['at']}"] += 1
        after = self.store.read("run/.loss.json") or b""
        if not after.startswith(loss):
            self.violate(
                "11", f"a pivot from {other}: .loss.json's {len(loss)} bytes before are not a prefix"
            )
        else:
            d[".loss.json a byte prefix of before"] += 1
        if f["restart"] and rc == 0:
            self._stop_restarted(p, other)
        if f["restart"] and f["kill"] == "pivot":
            # The killed pivot may have started its trainer before it died, one its rerun cannot name (a
            # trainer elsewhere held the run): left waiting, it takes the run once that one stops, and
            # the soak's next trainer is refused (seed 5, --kinds pivot-remote, fault 5). Stopped here.
            known = {q.pid for q in self.procs}
            for pid in sorted(int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()):
                if pid not in known and self._terminate(pid, gone_ok=True):
                    d["a killed pivot's own trainer, not named by its rerun, stopped"] += 1

    def _stop_restarted(self, pivot: Proc, host: str) -> None:
        """The trainer `pivot --restart` started detached (its pid in the pivot's output and the lock):
        it trains past the boundary on `host`, then is stopped (SIGTERM) for the soak's own trainer."""
        d = self.did["pivot-remote"]
        # The start's own line, or the summary's (a rerun resuming after 'installed' prints only that).
        m = re.search(r"resumed trainer pid (\d+)", pivot.text()) or re.search(
            r"resumed at step \d+, trainer pid (\d+) \(output in ", pivot.text()
        )
        lock = self.lock() or {}
        # A rerun that finds the new phase trained by a trainer of the other host (the soak's restart,
        # as systemd there would) starts none of its own and names that one (issue 48): it goes on.
        kept = re.search(r"trainer pid (\d+) on (\S+) \(cannot be checked from here\)", pivot.text())
        # A rerun of a pivot that completed (killed before it exited) finds it done and names the trainer
        # holding the run: the one the first run resumed on `host` (fault 363, 2026-12-06).
        done = re.search(r"already \(.*\): nothing done; trainer pid (\d+) on (\S+) holds the", pivot.text())
        if m is None and done is not None and done.group(2) == host:
            m = done
        # Or the soak's restart took the released lock between the install and the pivot's own trainer's
        # start (fault 144, 2026-12-07): the pivot names it, and its own trainer apart, refused or
        # waiting on that lease (stopped here, as the trainer it would have been).
        started = r"; the one this pivot started(?:, pid (\d+), waits for the run| found the run taken)"
        own = re.search(started, pivot.text())
        if kept is not None and (m is None or own is not None):
            pid, on = int(kept.group(1)), kept.group(2)
            mine = self.trainer.popen.poll() is None and self.trainer.pid == pid and self.host == on
            if mine and lock.get("pid") == pid and lock.get("host") == on and on != host:
                if own is None:
                    d["the new phase already trained elsewhere: no second trainer started"] += 1
                    return
                if own.group(1) is not None:  # it may have been refused since: gone is fine
                    self._terminate(int(own.group(1)), gone_ok=True)
                d["the soak's restart took the new phase first, named; the pivot's own "
                  + ("waited, stopped" if own.group(1) else "refused")] += 1  # fmt: skip
                return
        if not m or lock.get("pid") != int(m.group(1)) or lock.get("host") != host:
            self.violate(
                "11",
                f"pivot --restart: no resumed trainer of {host} holds the lock ({lock}):\n{pivot.tail()}",
            )
            return
        if self._terminate(int(m.group(1))):
            d["restarted on the pivoting host"] += 1
            self.host = host

    def _terminate(self, pid: int, gone_ok: bool = False) -> bool:
        """SIGTERM a trainer `pivot --restart` started (not the soak's child: checked to be a trainer of
        the run first) and wait for its exit; False if it is not one (a violation unless `gone_ok`)."""
        if not self._our_trainer(pid):
            if gone_ok:
                return False
            self.violate("11", f"pivot --restart: pid {pid} is not a trainer of the run")
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + TERM_BOUND
        while time.monotonic() < deadline and self._our_trainer(pid):
            time.sleep(0.05)
        if self._our_trainer(pid):
            self.violate(
                "7", f"the restarted trainer pid {pid} did not stop within {TERM_BOUND:g}s of SIGTERM"
            )
            os.kill(pid, signal.SIGKILL)
        return True

    # --- the soak --------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Token caches built before anything is watched: a trainer start reads them."""
        for policy in POLICIES:
            argv = ["data", "prepare", self.policies[policy], "--config", self.config]
            rc, out = self.tool("data", argv, timeout=900)
            if rc != 0:
                raise SystemExit(f"soak: andrea data prepare {policy} failed:\n{out}")

    def outside(self) -> dict[str, str]:
        """Every file the soak watches that is neither in the run directory nor in a branch of it."""
        snap = {}
        for name in self.store.names():
            if name == "run" or name.startswith("run-fork"):
                continue
            snap.update(
                {
                    f"store:{k}": v
                    for k, v in self.store.files(name).items()
                    if not k.startswith(".soak-filler")
                }
            )
        for p in sorted(self.cache.rglob("*")):
            # runs/: the append mirrors of a run on a store without append (rundir.MirroredAppendFile),
            # the run's own scratch, removed by the next open of their file after their writer's kill.
            if p.is_file() and p.relative_to(self.cache).parts[0] != "runs":
                snap[f"cache:{p.relative_to(self.cache)}"] = f"{p.stat().st_size}:{p.stat().st_mtime_ns}"
        # The processes' working directory: a file left there (a report, a log) is an untracked file.
        git = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        for line in git.stdout.splitlines():
            if line.startswith("?? "):
                snap[f"repo:{line[3:]}"] = "untracked"
        return snap

    def phase(self, name: str, since: float) -> float:
        """Record `name` as having taken the wall time since `since` (time.time()); returns now."""
        now = time.time()
        self.phases[name] = round(now - since, 1)
        return now

    def run(self, schedule: list[dict]) -> None:
        t = time.time()
        self._system_setup(schedule)
        self.prepare()
        watched = self.outside()
        t = self.phase("setup and data prepare", t)
        self.trainer = self.start_trainer(first=True)
        if not self.wait_training(self.trainer):
            raise SystemExit(f"soak: the first trainer did not start:\n{self.trainer.tail()}")
        self.start_reference()
        t_start = self.phase("first trainer start", t)
        self.injected = 0
        for f in schedule:
            if self.args.time_limit and time.time() - t_start > self.args.time_limit:
                print(f"time limit: {self.injected} of {len(schedule)} faults injected", flush=True)
                break
            if self.wind_down.is_set():
                print(f"SIGUSR1: {self.injected} of {len(schedule)} faults injected", flush=True)
                break
            self.injected += 1
            self.fault_i = f["i"]
            n_before = len(self.violations)
            self.wait_steps(f["gap_steps"])
            self.settled = max(self.checkpoints(), default=0)
            t0 = time.perf_counter()
            kind = self._kind = f["kind"]
            self.stats[kind]["injected"] += 1
            try:
                getattr(self, "f_" + kind.replace("-", "_"))(f)
                self.ensure_trainer()
            except Violation as e:
                self.violate("7", str(e))
                raise
            finally:
                self.wall[kind] += time.perf_counter() - t0
            if len(self.violations) == n_before:
                self.stats[kind]["survived"] += 1
            else:
                for _, inv, _ in self.violations[n_before:]:
                    self.stats[kind][f"violations ({inv})"] += 1
            if self.args.verbose:
                print(
                    f"fault {f['i']:4d} {kind:16s} step {self.trainer.step():6d} "
                    f"{'ok' if len(self.violations) == n_before else 'VIOLATION'}",
                    flush=True,
                )
        # The end: stop on a step, then train to the next grid step and complete there.
        t = self.phase("faults", t_start)
        self.fault_i = self.injected
        self.stop_trainer(signal.SIGTERM)
        last = max(self.checkpoints())
        self.final = (last // self.every + 2) * self.every
        final = self.spawn(
            "trainer",
            ["train", "--run-dir", self.store.run_url, "--device", "cpu", "--max-steps", str(self.final)],
        )
        rc = final.wait(600)
        if rc != 0:
            self.violate("7", f"the last trainer (to step {self.final}) exited {rc}:\n{final.tail()}")
        elif left := self.loss_log_mirrors():
            # Every start opens .loss.json after every kill, removing the dead writers' mirrors, and
            # the last one closed its own: none may be left (rundir.MirroredAppendFile).
            self.violate("6", f"the run's loss log mirrors left in the cache after a clean exit: {left}")
        self.phase("last trainer", t)
        self.soak_s = time.time() - t_start
        self.lock()
        now = self.outside()
        changed = sorted(k for k in set(watched) | set(now) if watched.get(k) != now.get(k))
        if any(e[0] == "data" for e in self.events):
            # A changed arm's token cache of its new fingerprint, built by a start (data-change): added
            # to the cache, never an existing file changed or removed.
            changed = [k for k in changed if not (k.startswith("cache:") and k not in watched)]
        if changed:
            self.violate("6", f"changed outside the run and its branches: {changed[:20]}")

    def loss_log_mirrors(self) -> list[str]:
        """The run's .loss.json mirrors in the processes' cache (a store without append keeps one per
        writer while it runs), by name."""
        from andrea_core.run.rundir import RunDir

        saved = os.environ.get("ANDREA_CACHE_DIR")
        os.environ["ANDREA_CACHE_DIR"] = str(self.cache)
        try:
            folder = RunDir(self.store.run_url).cache_path(".loss.json").parent
        finally:
            os.environ.pop("ANDREA_CACHE_DIR") if saved is None else os.environ.update(ANDREA_CACHE_DIR=saved)
        return sorted(p.name for p in folder.glob(".loss.json.*")) if folder.is_dir() else []

    # --- the reference and the invariants --------------------------------------------------------

    def reference(self) -> Path:
        """The same run with no fault, made on a thread beside the soak (a core the soak's one-thread
        trainer leaves idle, at nice 19): stopped at each event's step (`--max-steps`), the event replayed
        there with the same command (pivot offline at the newest checkpoint, fork --step), trained on.
        Between events it trains ahead once `--ref-ahead` steps behind (fewer starts in a long round,
        less lag for a data change to wait on in a short one), but only to a grid step at or below
        `self.settled`, the newest checkpoint of the run when the fault in progress began: every later
        pivot's boundary is at or above it, and a later fork's step is a keep_every multiple, which
        the reference keeps too. Each stop is on the audit and keep_every grids, as an event's is."""
        ref_root = self.work / "ref"
        ref_root.mkdir()
        ref, host, grid = ref_root / "run", "soak-ref", 20 * self.every  # a multiple of both grids
        self.ref_work = Counter()  # the reference's processes and the seconds they ran (phases' line)
        at, done = 0, 0  # the reference's step; events replayed
        ahead = self.args.ref_ahead  # the least step ahead it trains to between events
        while not self.stopping:
            settled = self.settled // grid * grid  # read before the events: earlier faults' are all in
            if done < len(self.events):
                event = self.events[done]
            elif getattr(self, "final", None) is not None:
                event = ("end", self.final, None)
            elif settled - at >= ahead:
                event = ("ahead", settled, None)
            else:
                time.sleep(0.5)
                continue
            if event[1] < at and event[0] != "fork":
                raise SystemExit(f"soak: the reference passed {event} (at step {at}): the soak's order broke")
            # A fork made after a rollback past its step: the reference's own rollback first.
            to = max(event[1], event[3]) if event[0] == "fork" else event[1]
            if to > at:
                argv = ["train", "--run-dir", str(ref), "--device", "cpu", "--max-steps", str(to)]
                if at == 0:
                    argv[1:1] = ["--config", self.config]
                # At nice 19 while faults are thrown (their timing is the run's); to the end at the soak's
                # own: no fault is left to disturb, and the round waits on it (a CI worker's other
                # module, at nice 0, left a nice-19 trainer next to nothing).
                nice = self.args.nice if event[0] == "end" else 19
                p, t0 = self.spawn("ref", argv, host, nice=nice, FSSPEC_S3_ENDPOINT_URL=""), time.time()
                rc = p.wait(1800)
                self.ref_work.update({"trainers": 1, f"steps to {event[0]}": to - at})
                self.ref_work["seconds"] += round(time.time() - t0, 1)
                if rc != 0:
                    raise SystemExit(f"soak: the reference trainer failed:\n{p.tail(30)}")
                at = to
            if event[0] == "pivot":
                argv = ["pivot", str(ref), "--policy", self.policies[event[2]], "--no-restart"]
                p = self.spawn("ref-pivot", [*argv, "--max-steps", str(self.big)], host, nice=19)
                if p.wait(600) != 0:
                    raise SystemExit(f"soak: the reference pivot failed:\n{p.tail(30)}")
            elif event[0] == "fork":
                argv = ["fork", str(ref), "--step", str(event[1]), "--replicates", "1"]
                for n in event[2]:
                    argv += ["--branch", n]
                p = self.spawn("ref-fork", argv, host, nice=19)
                if p.wait(600) != 0:
                    raise SystemExit(f"soak: the reference fork failed:\n{p.tail(30)}")
            elif event[0] == "data":
                self._change_data(event[2]["change"], event[2]["i"])
                event[2]["applied"].set()
            elif event[0] == "end":
                return ref_root
            done += event[0] in ("pivot", "fork", "data")
        raise SystemExit("soak: stopped before the reference was made")

    def start_reference(self) -> None:
        """`reference()` on a thread; `join_reference()` waits for it and returns its folder."""

        def run() -> None:
            try:
                self.ref_root = self.reference()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread by join_reference
                self.ref_error = e

        self.ref_thread = threading.Thread(target=run, name="reference", daemon=True)
        self.ref_thread.start()

    def join_reference(self) -> Path:
        self.ref_thread.join()
        if self.ref_error is not None:
            raise self.ref_error
        return self.ref_root

    def check(self, ref_root: Path) -> None:
        self.fault_i = -1
        got_root = self.work / "got"
        got_root.mkdir()
        self.store.copy_out(
            [n for n in self.store.names() if n == "run" or n.startswith("run-fork")], got_root
        )
        got, ref = got_root / "run", ref_root / "run"

        def steps(d: Path) -> list[int]:
            return sorted(
                int(m.group(1))
                for p in d.glob("step_*.bin")
                if (m := re.fullmatch(r"step_(\d+)\.bin", p.name))
            )

        # (1) the final checkpoint, and every checkpoint both kept, byte for byte
        final = checkpoint_name(self.final)
        if not (got / final).exists():
            self.violate("1", f"no final {final}")
        elif (got / final).read_bytes() != (ref / final).read_bytes():
            self.violate("1", f"{final} differs from the reference's")
        for s in sorted(set(steps(got)) & set(steps(ref))):
            if (got / checkpoint_name(s)).read_bytes() != (ref / checkpoint_name(s)).read_bytes():
                self.violate("1", f"{checkpoint_name(s)} differs from the reference's")

        # (2) the canonical loss history
        def history(d: Path) -> list[tuple]:
            entries, _ = parse_entries((d / ".loss.json").read_bytes())
            return [(e.step, e.loss, e.lr, e.arm, e.tokens) for e in newest_segments(entries)]

        hg, hr = history(got), history(ref)
        if hg != hr:
            first = next(
                (i for i, (a, b) in enumerate(zip(hg, hr, strict=False)) if a != b), min(len(hg), len(hr))
            )
            self.violate(
                "2",
                f"canonical loss history differs from step {first + 1} (lengths {len(hg)}, {len(hr)}): "
                f"{hg[first : first + 1]} vs {hr[first : first + 1]}",
            )

        self._check_views(got)

        # (11) data.jsonl: what each start saw of the arms' sources (data-change), the reference's
        def seen(d: Path) -> list[tuple]:
            p = d / "data.jsonl"
            lines = [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []
            return [(e.get("step"), e.get("arm"), e.get("event"), e.get("fingerprint")) for e in lines]

        if seen(got) != seen(ref):
            self.violate(
                "11", f"data.jsonl differs from the reference's: {seen(got)[-3:]} vs {seen(ref)[-3:]}"
            )

        # (3) archived phases (and the phase in force): policy.yaml, each step's bandit state and audit
        pg = sorted(p.name for p in (got / "archive").glob("phase_*")) if (got / "archive").exists() else []
        pr = sorted(p.name for p in (ref / "archive").glob("phase_*")) if (ref / "archive").exists() else []
        if pg != pr:
            self.violate("3", f"archived phases {pg}, the reference's {pr}")
        start = 0  # each phase trains (start, boundary]: its own boundary's bandit state, unless empty
        for name in sorted(set(pg) & set(pr)):
            boundary = int(name.split("_step_")[1])
            self._same_sidecars(
                got / "archive" / name,
                ref / "archive" / name,
                f"archive/{name}",
                boundary=boundary,
                trained=boundary > start,
            )
            start = boundary
        self._same_sidecars(got, ref, "the phase in force", boundary=self.final)

        # (4) fork branches: complete, their fork point kept in the parent, one forks.jsonl line each
        lines = (
            [json.loads(x) for x in (got / "forks.jsonl").read_text().splitlines() if x.strip()]
            if (got / "forks.jsonl").exists()
            else []
        )
        keyed = Counter((int(x["step"]), tuple(x.get("names", []))) for x in lines)
        for _, step, names, _ in (e for e in self.events if e[0] == "fork"):
            if keyed.get((step, tuple(names)), 0) != 1:
                self.violate(
                    "4",
                    f"forks.jsonl has {keyed.get((step, tuple(names)), 0)} lines for the fork at "
                    f"{step} {names}",
                )
            if not (got / checkpoint_name(step)).exists():
                self.violate("4", f"the fork point {checkpoint_name(step)} was not kept")
            for n in names:
                b = got_root / f"run-fork{step}-{n}"
                if not (b / "run.yaml").exists():
                    self.violate("4", f"branch {b.name} is unfinished (no run.yaml)")
                    continue
                rb = ref_root / f"run-fork{step}-{n}"
                for rel in ("run.yaml", "policy.yaml", checkpoint_name(step), ".loss.json"):
                    a, r = b / rel, rb / rel
                    if rel == "run.yaml":
                        continue  # names its parent's URL: another store, another path
                    if not a.exists() or a.read_bytes() != r.read_bytes():
                        if rel == ".loss.json" and a.exists() and history(b) == history(rb):
                            continue
                        self.violate("4", f"branch {b.name}: {rel} differs from the reference branch's")

        # (5) never two writers: .loss.json's segments never go back in file order; a trainer taken over
        # published nothing after its takeover
        entries, _ = parse_entries((got / ".loss.json").read_bytes())
        high = 0
        for e in entries:
            if e.segment < high:
                self.violate(
                    "5",
                    f".loss.json: a line of segment {e.segment} (step {e.step}) after segment {high}'s: "
                    "a writer that was not the holder",
                )
                break
            high = e.segment
        for p, took, present in self.lost_leases:
            late = [
                line
                for t, line in p.lines
                if t > took + 0.5
                and (m := re.search(r"checkpoint step_(\d+)\.bin \(", line))
                and int(m.group(1)) not in present
            ]
            if late:
                self.violate("5", f"trainer pid {p.pid} published after its lease was taken over: {late}")

        # (8) retention: pivot boundaries, fork points, and of the checkpoints the run published the
        # multiples of keep_every and the newest keep_last, less a closed phase's tail (moved into its
        # archive folder by the pivot). Published: what the store's own listings showed during the soak
        # (self.listed, after every fault and in every wait on the run), and what the trainers' logs
        # say they wrote (an outage legitimately skips some): a log that lies cannot hide a loss.
        have = set(steps(got))
        seen = dict(self.listed)  # each checkpoint published, and when it was last seen or said
        for p in self.procs:
            if p.what == "trainer":
                for t, line in p.lines:
                    if m := re.search(r"checkpoint step_(\d+)\.bin \(", line):
                        seen[int(m.group(1))] = max(t, seen.get(int(m.group(1)), t))
        published = set(seen)
        tails = {
            int(m.group(1))
            for a in (got / "archive").glob("phase_*/step_*.bin")
            if (m := re.search(r"step_(\d+)", a.name))
        }
        # A closed phase's tail (past its pivot's boundary, last published before that pivot was done)
        # is the archive's, or gone before it: the old phase's own retention keeps its newest keep_last,
        # and a tail holds more when a pivot --at now chose a grid checkpoint written as it asked, its
        # request's checkpoint one more (seed 1's 578: 578, 580, 585 and the stop's 587 past 575).
        tails |= {s for s in published if any(b < s and seen[s] <= t for b, t in self.closed)}
        published -= tails - have
        need = {e[1] for e in self.events if e[0] != "data"} | {
            s for s in published if s % (10 * self.every) == 0
        }
        refused = {
            int(m.group(1))
            for a in (got / REFUSED).glob("step_*.bin.*")  # the trainer's name there: step_N.bin.TIME
            if (m := re.match(r"step_(\d+)\.bin\.", a.name))
        }
        missing, lost = retention_missing(need, published, have, self.damaged, refused)
        if lost:
            print(f"(8) lost to the soak's own bitrot, refused and not written again: {sorted(lost)}")
        if missing:
            self.violate("8", f"retention did not keep {[checkpoint_name(s) for s in missing]}")

        # (10) every checkpoint the run and its branches end with (archives included), read by the soak's
        # own reader of the format, which first gives the hand-made vectors their README's verdicts
        _check_spec_reader()
        n_params = set()
        self.spec_read = 0
        for p in sorted(got_root.rglob("step_*.bin")):
            data = p.read_bytes()
            problem = spec_problem(data, p.name)
            self.spec_read += 1
            if problem:
                self.violate("10", f"{p.relative_to(got_root)}: {problem}")
            else:
                n_params.add(struct.unpack_from("<i", data, 4)[0])
        if len(n_params) > 1:
            self.violate(
                "10", f"the run's checkpoints hold {sorted(n_params)} parameters: one model, one count"
            )

    def _check_views(self, got: Path) -> None:
        """(11) Views and records of their own against .loss.json (issue 48 item 7): the canonical
        history is every step 1..final once, all finite; guard.jsonl holds exactly the rollbacks the
        soak caused (step and target), each with the diverging step and a segment opened at its
        target + 1 in .loss.json after it; TensorBoard's train/loss and train/lr, read by tensorboard's
        own reader, hold the canonical value of every step they show, and no step the history lacks."""
        import math

        import numpy as np
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        from andrea_core.run.guard_events import parse_events

        entries, _ = parse_entries((got / ".loss.json").read_bytes())
        history = newest_segments(entries)
        if [e.step for e in history] != list(range(1, self.final + 1)):
            self.violate("11", f"the canonical history's steps are not 1..{self.final} once each")
        bad = [e.step for e in history if not (math.isfinite(e.loss) and math.isfinite(e.lr))]
        if bad:
            self.violate("11", f"the canonical history has non-finite steps {bad[:10]}")
        guard = got / "guard.jsonl"
        events = parse_events(guard.read_bytes() if guard.exists() else b"", warn=lambda _: None)
        rollbacks = sorted((e.step, e.rolled_back_to) for e in events if e.action == "rollback")
        caused = sorted((x["step"], x["to"]) for x in self.divergences)
        if rollbacks != caused or len(events) != len(rollbacks):
            self.violate(
                "11",
                f"guard.jsonl's events {[(e.action, e.step, e.rolled_back_to) for e in events]}, "
                f"the soak caused {caused}",
            )
        for step, to in rollbacks:
            at = next((i for i, e in enumerate(entries) if e.step == step), None)
            opened = at is not None and any(
                e.step == to + 1 and e.segment != entries[i - 1].segment
                for i, e in enumerate(entries[at + 1 :], at + 1)
            )
            if not opened:
                self.violate(
                    "11",
                    f"the rollback at {step} to {to}: no segment of .loss.json opens at {to + 1} after it",
                )
        self.views = Counter(rollbacks=len(rollbacks))
        folder = got / "tensorboard"
        if not folder.is_dir():
            self.violate("11", "no TensorBoard events in the run")
            return
        logging.getLogger("tensorboard").setLevel(logging.ERROR)  # each purge at a START, said: expected
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        canon = {e.step: e for e in history}
        # What trainers said: the soak's own, and those `andrea pivot --restart` started (RUN/trainer.log).
        said = [line for p in self.procs if p.what == "trainer" for _, line in p.lines]
        if (got / "trainer.log").is_file():
            said += (got / "trainer.log").read_text(errors="replace").splitlines()
        warned = {
            int(m.group(1))
            for line in said
            if (m := re.search(r"\.segment(\d+): .*TensorBoard event\(s\) not written", line))
        }
        for tag, field_ in (("train/loss", "loss"), ("train/lr", "lr")):
            shown = [(e.step, e.value) for e in acc.Scalars(tag)]
            wrong = [
                (s, v)
                for s, v in shown
                if s not in canon or float(np.float32(getattr(canon[s], field_))) != v
            ]
            if wrong or len({s for s, _ in shown}) != len(shown):
                self.violate(
                    "11", f"TensorBoard's {tag}: {len(wrong)} values not the history's, first {wrong[:3]}"
                )
            self.views[f"{tag} steps shown"] = len(shown)
            missing = sorted(set(canon) - {s for s, _ in shown})
            self.views[f"{tag} steps missing"] = len(missing)
            # A step may be missing only where its segment's trainer said its events were not written
            # (a flush refused, then the trainer killed before one landed them); none is lost silently.
            unsaid = [s for s in missing if canon[s].segment not in warned]
            if unsaid:
                self.violate(
                    "11",
                    f"TensorBoard's {tag}: {len(unsaid)} steps of the history missing, no trainer said so: "
                    f"first {unsaid[:5]} (segments {sorted({canon[s].segment for s in unsaid})[:5]})",
                )

    def _same_sidecars(self, got: Path, ref: Path, where: str, boundary: int, trained: bool = True) -> None:
        """policy.yaml, each step's bandit state and audit as the reference's; the bandit state of
        `boundary` required unless the phase trained no step (two pivots at one boundary, the second
        before a trainer of the phase between them trained: seed 2's phase_003_step_000315 had no
        .state.json, nor the reference's), whose fresh bandit was never written."""
        a, r = got / "policy.yaml", ref / "policy.yaml"
        if (a.read_bytes() if a.exists() else None) != (r.read_bytes() if r.exists() else None):
            self.violate("3", f"{where}: policy.yaml differs")

        def states(d: Path) -> dict[int, dict]:
            p = d / ".state.json"
            if not p.exists():
                return {}
            doc = json.loads(p.read_text())
            return {
                int(e["step"]): {k: v for k, v in e.items() if k != "previous"}
                for e in [doc, *doc.get("previous", [])]
            }

        def audits(d: Path) -> dict[int, dict]:
            p = d / ".samples.json"
            if not p.exists():
                return {}
            doc = json.loads(p.read_text())
            items = doc.get("audits", doc) if isinstance(doc, dict) else doc
            return {int(x["step"]): x for x in items}

        sg, sr = states(got), states(ref)
        if (boundary not in sg or boundary not in sr) and (trained or sg or sr):
            self.violate(
                "3",
                f"{where}: the bandit state of step {boundary} is missing "
                f"(soak {sorted(sg)}, reference {sorted(sr)})",
            )
        for s in sorted(set(sg) & set(sr)):
            if sg[s] != sr[s]:
                self.violate("3", f"{where}: the bandit state of step {s} differs from the reference's")
        ag, ar = audits(got), audits(ref)
        for s in sorted(set(ag) & set(ar)):
            if _audit_key(ag[s]) != _audit_key(ar[s]):
                self.violate("3", f"{where}: the audit of step {s} differs from the reference's")
        # The reference stops at each event's step with --max-steps, and a trainer's last step is always
        # audited: its audits off the audit grid are the reference's own, not the run's.
        lost = [s for s in ar if s not in ag and (not ag or s > min(ag)) and s % (4 * self.every) == 0]
        if lost:
            self.violate("3", f"{where}: audits of steps {lost} are missing")

    def close(self) -> None:
        self.stopping = True  # the reference's thread starts nothing more
        if getattr(self.store, "layer", None) is not None:
            with contextlib.suppress(Exception):
                self.layer_stats = self.store.layer.call("stats")
                if self.layer_stats["n_internal"]:
                    self.violations.append(
                        (-1, "layer", f"{self.layer_stats['n_internal']} errors of its own")
                    )
        for p in list(self.procs):
            if p.popen.poll() is None:
                p.signal(signal.SIGCONT)
                p.signal(signal.SIGKILL)
                p.wait(30)
        if self.launcher is not None:
            self.launcher.stop()
        self._system_close()
        self.store.close()


VECTORS = REPO.parent / "shared" / "testdata" / "checkpoints"  # the team's hand-made vectors
if not VECTORS.is_dir():
    VECTORS = REPO / "tests" / "data" / "checkpoints"  # their copy in the repository


def spec_problem(data: bytes, name: str) -> str | None:
    """What is wrong with checkpoint `data` named `name`, read from the format's description alone (the
    vectors' README and docs/design.md; not the project's reader): little-endian [int32 step]
    [int32 n_params][n x f32 weights][n x f32 m][n x f32 v], then either nothing (the legacy form,
    8 + 12n bytes) or the trailer [char[3] "ANC"][uint8 1][uint32 CRC-32 (zlib) of every byte before
    it] (8 + 12n + 8 bytes); the step the name's, every float finite, v (Adam's second moment) never
    negative."""
    import numpy as np

    if len(data) < 8:
        return f"{len(data)} bytes: no header"
    step, n = struct.unpack_from("<ii", data)
    if n <= 0:
        return f"n_params is {n}"
    body = 8 + 12 * n
    if len(data) not in (body, body + 8):
        return f"{len(data)} bytes where 8 + 12*{n} = {body} (or {body + 8}, with the trailer) are required"
    if len(data) == body + 8:
        magic, version, crc = struct.unpack_from("<3sBI", data, body)
        if (magic, version) != (b"ANC", 1):
            return f"the trailer is {magic!r} version {version}, not b'ANC' version 1"
        if zlib.crc32(data[:body]) != crc:
            return f"the checksum does not match (the trailer's {crc:08x})"
    m = re.fullmatch(r"step_(\d+)\.bin", name)
    if not m or int(m.group(1)) != step:
        return f"header step {step} disagrees with the name {name}"
    floats = np.frombuffer(data, dtype="<f4", offset=8, count=3 * n)
    if not np.isfinite(floats).all():
        return f"a non-finite value at float {int(np.argmin(np.isfinite(floats)))}"
    if (floats[2 * n :] < 0).any():
        return "a negative second moment (v)"
    return None


def _check_spec_reader() -> None:
    """spec_problem gives every hand-made vector its README's verdict (valid: only step_000042.bin)."""
    vectors = sorted(VECTORS.rglob("step_*.bin"))
    if not vectors:
        raise SystemExit(f"soak: no checkpoint vectors at {VECTORS}")
    for v in vectors:
        valid = v.parent == VECTORS
        if (spec_problem(v.read_bytes(), v.name) is None) != valid:
            raise SystemExit(f"soak: its checkpoint reader's verdict on the vector {v} is not the README's")


def _audit_key(audit: dict) -> dict:
    """An audit without the wall-clock fields it records (when it ran, how long it took)."""
    return {k: v for k, v in audit.items() if k not in ("time", "seconds", "elapsed_s", "wall_s")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--time-limit",
        type=float,
        default=0,
        help="inject no fault after this many seconds (or after SIGUSR1 comes), then the end checks",
    )
    ap.add_argument("--store", choices=("local", "s3"), default="local")
    ap.add_argument("--every", type=int, default=5, help="checkpoint_every of the run (5)")
    ap.add_argument(
        "--disk-mb",
        type=int,
        default=0,
        help="tmpfs size (default: 48 + 8 per fault, or 24 per pivot where that is more)",
    )
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--work", help="keep the soak's files here (default: a temporary folder, removed)")
    ap.add_argument("--cache", help="ANDREA_CACHE_DIR of every process (default: WORK/cache, built first)")
    ap.add_argument("--kinds", help="comma-separated fault kinds to draw from (default: every kind)")
    ap.add_argument("--verbose", action="store_true", help="one line per fault")
    ap.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="inject only the first N faults of the --faults schedule (a replay of a prefix: the same "
        "faults and disk as the whole round), then the end checks",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="start the trainers and commands from a fork server with torch imported "
        "(tests/warm_launcher.py; the CI rounds do): seconds less a start, not a user's start",
    )
    ap.add_argument(
        "--ref-ahead",
        type=int,
        default=0,
        help="the reference trains ahead once this many steps behind the run's settled checkpoint "
        "(a multiple of 20 x --every; default 200 x --every: few starts in a long round)",
    )
    ap.add_argument(
        "--no-layer",
        dest="layer",
        action="store_false",
        help="local store: the run directory on the tmpfs itself, not through the power-cut layer",
    )
    args = ap.parse_args()
    args.ref_ahead = args.ref_ahead or 200 * args.every
    if args.ref_ahead <= 0 or args.ref_ahead % (20 * args.every):
        ap.error(
            f"--ref-ahead: {args.ref_ahead} is not a positive multiple of 20 x --every ({20 * args.every})"
        )
    kinds = args.kinds.split(",") if args.kinds else None
    if args.store == "local" and args.layer:
        from powercut import fuse_unavailable

        why = fuse_unavailable()
        if why:
            print(f"soak: no power-cut layer ({why}): its kinds ({', '.join(LAYER)}) are not drawn")
            args.layer = False
    if args.store == "local" and not args.layer:
        KINDS["local"] = [k for k in KINDS["local"] if k not in LAYER and k not in OPT_IN]
        if kinds and set(kinds) & {*LAYER, *OPT_IN}:
            ap.error(f"--kinds: {sorted(set(kinds) & {*LAYER, *OPT_IN})} need the power-cut layer (FUSE)")
    system_missing(kinds, ap)
    unknown = sorted(set(kinds or []) - set(KINDS[args.store]))
    if unknown:
        ap.error(
            f"--kinds: {unknown} are not fault kinds of --store {args.store} ({', '.join(KINDS[args.store])})"
        )
    schedule = draw_schedule(args.seed, args.faults, args.store, args.every, kinds)
    # What the run keeps grows with it: a checkpoint of every keep_every steps (1.6 MB each: 3.2 GB by
    # step 100,000, about fault 900) and two branches a fork, each with its copy of the loss log (15 MB
    # there). 4 MB a fault filled the disk for good at fault 894 (2026-12-04); it is RAM, used as filled.
    # A pivot archives the tail past its boundary (up to 13 checkpoints, 21 MB, seen), so a round of
    # mostly pivots needs more: 20 pivot-remote faults filled 208 MB (--seed 5, 2026-12-08).
    # The whole schedule's, before --stop-after cuts it: a replay of a prefix gets the round's disk.
    pivots = sum(f["kind"] in ("pivot", "pivot-remote") for f in schedule)
    args.disk_mb = args.disk_mb or 48 + max(8 * args.faults, 24 * pivots)
    if args.stop_after:
        schedule = schedule[: args.stop_after]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="andrea-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)  # the processes it started are stopped on the way out
    soak = Soak(args, work)
    # SIGUSR1: inject no fault after the one under way, then the end checks, as --time-limit does (a
    # round started in the background ignores SIGINT: the shell set it so).
    signal.signal(signal.SIGUSR1, lambda signum, frame: soak.wind_down.set())
    aborted = interrupted = None
    try:
        try:
            soak.run(schedule)
        except Violation as e:
            aborted = str(e)
        except KeyboardInterrupt as e:  # SIGTERM, or SIGINT in a terminal: what was injected, no checks
            interrupted = str(e) or "SIGINT"
        if aborted is None and interrupted is None:
            t = time.time()
            ref_root = soak.join_reference()
            t = soak.phase("waiting for the reference", t)
            soak.check(ref_root)
            soak.phase("end checks", t)
    finally:
        soak.close()
        for i, p in enumerate(soak.procs):  # each process's output, for the post-mortem
            (work / "logs" / f"{i:04d}-{p.what}-{p.pid}.log").write_text(p.text() + "\n")
    wall = time.time() - t0
    print(
        f"\nsoak: store {args.store}, seed {args.seed}, {args.faults} faults, "
        f"checkpoint every {args.every} steps, "
        f"lease renew {RENEW_S:g}s / ttl {TTL_S:g}s; final step {getattr(soak, 'final', '?')}; "
        f"{sum(e[0] == 'pivot' for e in soak.events)} pivots, "
        f"{sum(e[0] == 'fork' for e in soak.events)} forks"
    )
    print(f"{'fault kind':18s} {'injected':>8s} {'survived':>8s} {'wall s':>8s}  violations")
    for kind in KINDS[args.store]:
        if kind in OPT_IN and not soak.stats[kind]["injected"]:
            continue
        c = soak.stats[kind]
        v = ", ".join(f"{k.split()[1]} x{n}" for k, n in sorted(c.items()) if k.startswith("violations"))
        print(f"{kind:18s} {c['injected']:8d} {c['survived']:8d} {soak.wall[kind]:8.1f}  {v or '-'}")
    if soak.did:
        print("what the faults did (bench/powercut.py, tests/s3_relay.py; summed over each kind's faults):")
        for kind in [*LAYER, *OPT_IN, *STORAGE, *SYSTEM, *FEATURES]:
            if soak.did.get(kind):
                print(
                    f"  {kind}: "
                    + ", ".join(
                        f"{k} {round(v, 2) if isinstance(v, float) else v}" for k, v in soak.did[kind].items()
                    )
                )
    layer = getattr(soak.store, "layer", None)
    if layer is not None:
        with contextlib.suppress(Exception):
            st = soak.layer_stats
            print(
                f"layer: {st['fsync']} file fsyncs, {st['fsyncdir']} folder fsyncs, {st['cuts']} cuts; "
                f"its own errors: {st['n_internal']}"
            )
            for e in st["internal_errors"]:
                print("  layer error: " + e.splitlines()[0])
    if soak.readers:
        print(f"(10) andrea status against the truth: {dict(soak.readers)}")
    if getattr(soak, "views", None):
        print(f"(11) guard.jsonl and TensorBoard against .loss.json: {dict(soak.views)}")
    if getattr(soak, "spec_read", 0):
        print(f"(10) checkpoints read by the soak's own reader of the format: {soak.spec_read}")
    end = [v for v in soak.violations if v[0] < 0 or v[0] >= getattr(soak, "injected", 0)]
    for _, inv, what in end:
        print(f"at the end ({inv}): {what.splitlines()[0]}")
    mirrors = list((soak.cache / "runs").rglob("*.json.*")) if (soak.cache / "runs").exists() else []
    if mirrors:
        print(
            f"append mirrors left in the cache (killed writers', of files none opened since): {len(mirrors)}"
        )
    if args.store == "s3":
        relay = soak.store.relay
        print(f"replies lost after the write: {[(k, status) for _, k, status in relay.dropped]}")
        print(
            "complete replies lost (key, object there with that ETag, the retries' answers, read back): "
            f"{[(c['key'], c['held'], c['retries'], c['read_back']) for c in relay.completes_lost]}"
        )
    print(f"phases (wall s): {soak.phases}; the reference: {dict(getattr(soak, 'ref_work', {}))}")
    if soak.launcher is not None:
        why = Counter(soak.launcher.cold)
        print(
            f"warm launcher: {soak.launcher.warm} starts warm, {len(soak.launcher.cold)} cold "
            f"({dict(why)}), {1 + len(soak.launcher.started)} servers"
        )
    if interrupted:
        print(f"interrupted ({interrupted}) after {getattr(soak, 'injected', 0)} faults: no end checks")
    print(
        f"violations: {len(soak.violations)}; wall time {wall:.0f} s "
        f"(soak {getattr(soak, 'soak_s', 0):.0f} s)"
    )
    if soak.violations or aborted:
        injected = getattr(soak, "injected", args.faults)
        first = min((v[0] for v in soak.violations if 0 <= v[0] < injected), default=injected - 1)
        print(f"schedule prefix to the first violation (--seed {args.seed} reproduces it):")
        for f in schedule[: first + 1]:
            print("  " + json.dumps(f))
        # What the trainers said went wrong: in CI the work folder is gone with the test's tmp_path.
        said = [
            f"  {i:04d} {line[:160]}"
            for i, p in enumerate(soak.procs)
            if p.what == "trainer"
            for _, line in p.lines
            if re.search(r"ERROR|warning|Traceback|NOT written", line)
        ]
        print(f"the trainers' errors and warnings ({len(said)}; the last 25; logs in {work / 'logs'}):")
        print("\n".join(said[-25:]))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if soak.violations or aborted or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
