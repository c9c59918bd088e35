"""A memory-limited cgroup, and the kernel's OOM killer made to kill a chosen process in it (issue 48,
memory): for tests/test_oom.py and bench/soak.py's oom kinds. Real kernel parts only: the group is a
cgroup (v1's memory hierarchy, else v2's), the kill is the kernel's own.

How a kill is aimed: the target (and its children) are moved into a fresh group, their memory charged
to it (v1 move_charge_at_immigrate; v2 charges what they allocate next), the limit is set a little above
what the group uses, and a "hog" of the group writes past it into a memfd: shmem charged to the group
but in nobody's resident set, so the OOM killer, which picks the task with the largest resident set
(plus oom_score_adj/1000 of the limit), never picks the hog for its size, and the target dies as when
it is the one that grew. The hog is SIGKILLed (by a thread of its own) the moment the group counts an
OOM kill, freeing what it wrote: one fault, one kill. (Lowering the hog's own oom_score_adj needs
CAP_SYS_RESOURCE, which root here lacks: the earlier -999 was refused, unseen; and a hog still writing
once the target was dead but not yet uncharged made the kernel kill the next largest task of the
group, the supervisor.) `victims` names the group's processes the kernel log says were killed. Every
group is named `andrea-test-*`; those of a killed earlier test or soak, left empty, are removed by the
next one. Needs root and a memory cgroup controller; `unavailable()` says why not."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "andrea-test-"


def _base() -> tuple[Path, int] | None:
    """(the memory hierarchy's root, cgroup version), or None."""
    if (ROOT / "memory" / "memory.limit_in_bytes").is_file():
        return ROOT / "memory", 1
    for root in (ROOT, ROOT / "unified"):
        controllers = root / "cgroup.controllers"
        if controllers.is_file() and "memory" in controllers.read_text().split():
            return root, 2
    return None


def unavailable() -> str | None:
    """Why a memory cgroup cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "making a memory cgroup needs root"
    if _base() is None:
        return "no memory cgroup controller mounted under /sys/fs/cgroup"
    return None


def sweep() -> None:
    """Remove the empty groups left by a test or soak killed before it removed its own."""
    base = _base()
    if base is None:
        return
    for group in base[0].glob(PREFIX + "*"):
        with contextlib.suppress(OSError):
            if not (group / "cgroup.procs").read_text().strip():
                group.rmdir()


class MemoryGroup:
    """A memory cgroup of its own (`with`: removed on the way out, its processes moved back first)."""

    def __init__(self, name: str):
        base = _base()
        assert base is not None, unavailable()
        self.base, self.version = base
        sweep()
        self.path = self.base / f"{PREFIX}{name}-{os.getpid()}"
        self.path.mkdir()
        if self.version == 1:
            with contextlib.suppress(OSError):  # deprecated on new kernels: then new allocations only
                (self.path / "memory.move_charge_at_immigrate").write_text("3")
        self.hogs: list[subprocess.Popen] = []
        self.victims: list[int] | None = None  # the last oom_kill's, as the kernel log names them

    def __enter__(self) -> MemoryGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    @contextlib.contextmanager
    def joined(self):
        """This process in the group while the block runs (a process it starts there is born in the
        group, as under a systemd unit's MemoryMax), moved back to where it was after."""
        before = next(
            line.split(":", 2)[2]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if (line.split(":")[1] == "memory") == (self.version == 1)
            and (self.version == 1 or line.startswith("0::"))
        )
        self.add(os.getpid())
        try:
            yield self
        finally:
            (self.base / before.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        with contextlib.suppress(OSError):
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        return []

    def usage(self) -> int:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return int((self.path / name).read_text())

    def limit(self, nbytes: int) -> None:
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        (self.path / name).write_text(str(nbytes))

    def _events(self) -> Path:
        return self.path / ("memory.oom_control" if self.version == 1 else "memory.events")

    def kills(self) -> int:
        for line in self._events().read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def oom_kill(self, target: int, headroom: int = 32 << 20, timeout: float = 60.0) -> bool:
        """Make the OOM killer kill `target` (a process of this group): the limit set `headroom` above
        the group's use, a hog writing past it until the group's first OOM kill. True if the kernel
        killed it (its group counted an OOM kill and it is gone); `victims` then names the group's
        processes the kernel log says it killed (None: the log is not readable here)."""
        from andrea_core.oom import OomWatch

        members = set(self.pids())
        watch = OomWatch(target)  # the kernel log from here on
        before = self.kills()
        self.limit(self.usage() + headroom)
        hog = subprocess.Popen(
            [sys.executable, "-c", HOG, str(self.path / "cgroup.procs"), str(self._events()), str(before)]
            + [str(target), str(4 * headroom)],
            stdin=subprocess.DEVNULL,
        )
        self.hogs.append(hog)
        with contextlib.suppress(subprocess.TimeoutExpired):
            hog.wait(timeout)
        if hog.poll() is None:
            hog.kill()
            hog.wait()
        deadline = time.monotonic() + timeout
        while _alive(target) and self.kills() > before and time.monotonic() < deadline:
            time.sleep(0.01)  # killed: its exit (every thread's) takes a moment
        readable = watch.reads_kernel_log
        self.victims = [pid for pid, _ in watch.killed() if pid in members] if readable else None
        watch.close()
        return self.kills() > before and not _alive(target)

    def remove(self) -> None:
        for hog in self.hogs:
            if hog.poll() is None:
                hog.kill()
                hog.wait()
        with contextlib.suppress(OSError):
            self.limit(-1 if self.version == 1 else "max")  # type: ignore[arg-type]
        parent = self.path.parent / "cgroup.procs"
        for _ in range(50):
            for pid in self.pids():
                with contextlib.suppress(OSError):
                    parent.write_text(str(pid))
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # a dying process still charged to it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is dead: only its parent has not reaped it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


# The hog: joins the group, writes into a memfd (charged to the group, in no resident set) until it has
# written its bound. A thread of its own watches the group's OOM kill count (and the target) and, the
# moment a kill is counted, SIGKILLs the hog: a dying task's charge is let through, so the hog stops at
# once. Without it the hog, still inside the write that hit the limit, retried the charge; the victim,
# niced and with its memory not yet uncharged (the kernel hides it from the OOM killer once its pages
# are unmapped, before they are uncharged), no longer counted, and the kernel killed the next largest
# task of the group 9 ms later: the supervisor (dmesg, soak --kinds oom-trainer --seed 1, 2 of 6).
HOG = """
import os, signal, sys, threading, time
procs, events, before, target, most = sys.argv[1:3] + [int(a) for a in sys.argv[3:]]
with open(procs, "w") as f:
    f.write(str(os.getpid()))
def kills():
    with open(events) as f:
        for line in f.read().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0
def gone():
    try:
        with open(f"/proc/{target}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
def watch():
    while kills() <= before and not gone():
        time.sleep(0.0002)
    os.kill(os.getpid(), signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
fd, chunk, written = os.memfd_create("andrea-test-hog"), b"x" * (1 << 20), 0
while written < most:
    try:
        written += os.write(fd, chunk)
    except OSError:  # ENOMEM: the charge failed (a kill is on its way)
        time.sleep(0.01)
"""

if __name__ == "__main__":  # a look by hand: python tests/memcg.py (kills a child born in a group by OOM)
    print(unavailable() or "memory cgroups available")
    with MemoryGroup("manual") as g:
        with g.joined():
            victim = subprocess.Popen(
                [sys.executable, "-c", "import time; x = b'x' * (64 << 20); time.sleep(60)"]
            )
        time.sleep(1)
        print("usage", g.usage(), "killed:", g.oom_kill(victim.pid), "victims", g.victims, "pid", victim.pid)
        print("exit", victim.wait(), "kills", g.kills())
