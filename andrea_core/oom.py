"""Out-of-memory kills as the kernel records them (issue 48, memory): whether a process that died, or
one of its children (a torchrun rank), was killed by the kernel's OOM killer, so that the error a user
sees says so ("killed by the kernel: out of memory") rather than a bare signal 9 or exit 1.

Two records, read when the process starts and again once it has died (`OomWatch`):
  - its memory cgroup's count of OOM kills (cgroup v2 `memory.events`, v1 `memory.oom_control`:
    `oom_kill N`), readable by anyone: more kills in its group than at its start;
  - the kernel log (/dev/kmsg, readable by root or where dmesg is not restricted), from where it ended at
    the start on: "Killed process PID (NAME)", which names the process.
Either is enough; with neither readable nothing is claimed.

And the kernel's choice made right (`prefer_oom_kill`): a launched trainer raises its own oom_score_adj
TRAINER_OOM_BIAS above its launcher's before it execs (andrea_core.pdeathsig), so that in an OOM the
kernel kills the trainer, never the supervisor that would report it and start the next one (docs/design.md
"Processes"). Standard library only."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
KMSG = "/dev/kmsg"
KILLED_RE = re.compile(r"Killed process (\d+) \(([^)]*)\)")
KMSG_BYTES = 1 << 20  # the most read from the kernel log at once (its ring is smaller)
TRAINER_OOM_BIAS = 500  # a trainer's oom_score_adj above its launcher's (the kernel's range: -1000..1000)
OOM_SCORE_ADJ_MAX = 1000


def prefer_oom_kill(bias: int = TRAINER_OOM_BIAS) -> int | None:
    """Raise this process's oom_score_adj by `bias` (to at most 1000; its children inherit it), which
    any process may do: the OOM killer's score is its resident memory plus adj/1000 of the memory it may
    use. The value now in force, or None where there is no such file (OSError: the kernel refused it)."""
    path = Path("/proc/self/oom_score_adj")
    try:
        own = int(path.read_text())
    except (OSError, ValueError):
        return None
    want = min(OOM_SCORE_ADJ_MAX, own + max(0, bias))
    if want != own:
        with open(path, "w") as f:  # a refusal (EACCES from an LSM) is raised at the close
            f.write(str(want))
    return int(path.read_text())


def memory_group(pid: int) -> Path | None:
    """The folder of `pid`'s memory cgroup (v1's memory hierarchy, else v2's unified one), or None."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = [
        line.split(":", 2)[2]
        for line in lines
        if line.count(":") >= 2 and "memory" in line.split(":")[1].split(",")
    ]
    v2 = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
    candidates = [CGROUP_ROOT / "memory" / p.lstrip("/") for p in v1]
    candidates += [root / p.lstrip("/") for p in v2 for root in (CGROUP_ROOT, CGROUP_ROOT / "unified")]
    for folder in candidates:
        if (folder / "memory.oom_control").is_file() or (folder / "memory.events").is_file():
            return folder
    return None


def group_kills(folder: Path | None) -> int | None:
    """The OOM kills its memory cgroup has counted, or None if it cannot be read."""
    if folder is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        with contextlib.suppress(OSError, ValueError):
            for line in (folder / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return None


def group_limit(folder: Path | None) -> int | None:
    """Its memory limit in bytes (None: none, or unreadable)."""
    for name in ("memory.max", "memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError, TypeError):
            value = int((folder / name).read_text())  # v2 "max" raises: no limit
            return value if value < 1 << 60 else None  # v1's "no limit" is a huge number
    return None


class OomWatch:
    """Taken right after process `pid` started (its memory cgroup and the kernel log's end then);
    `why()` once it has died: what the kernel says it did, or None."""

    def __init__(self, pid: int):
        self.pid = pid
        self.group = memory_group(pid)
        self.kills = group_kills(self.group)
        self._kmsg: int | None = None
        try:
            self._kmsg = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self._kmsg, 0, os.SEEK_END)  # only the records written from now on
        except OSError:
            self.close()

    @property
    def reads_kernel_log(self) -> bool:
        return self._kmsg is not None

    def close(self) -> None:
        if self._kmsg is not None:
            with contextlib.suppress(OSError):
                os.close(self._kmsg)
            self._kmsg = None

    def killed(self) -> list[tuple[int, str]]:
        """The kernel log's "Killed process" records since the watch began: (pid, its message)."""
        out, read = [], 0
        while self._kmsg is not None and read < KMSG_BYTES:
            try:
                record = os.read(self._kmsg, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten before they were read: go on with the rest
                continue
            except OSError:
                break
            if not record:
                break
            read += len(record)
            message = record.decode(errors="replace").split(";", 1)[-1].splitlines()[0]
            m = KILLED_RE.search(message)
            if m:
                out.append((int(m.group(1)), message.strip()))
        return out

    def why(self) -> str | None:
        """'killed by the kernel: out of memory (...)' if its cgroup counted an OOM kill since the
        start or the kernel log says it killed `pid` (another process of its cgroup: named), else None."""
        try:
            killed = self.killed()
        finally:
            self.close()
        after = group_kills(self.group)
        more = after - self.kills if after is not None and self.kills is not None else 0
        ours = [message for pid, message in killed if pid == self.pid]
        if not ours and more <= 0:
            return None
        where = []
        if self.group is not None and more > 0:
            limit = group_limit(self.group)
            size = f", limit {limit / 2**20:.0f} MiB" if limit is not None else ""
            where.append(
                f"memory cgroup {self.group}{size}: {more} OOM kill{'s' if more > 1 else ''} while it ran"
            )
        if ours:
            where.append(f"kernel log: {ours[-1][:200]}")
        elif killed:
            pid, message = killed[-1]
            where.append(f"kernel log: {message[:200]}")
        return f"killed by the kernel: out of memory ({'; '.join(where)})"
