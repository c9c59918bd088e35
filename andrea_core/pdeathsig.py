"""Exec a command that receives SIGTERM when the process that launched it dies.

    python -m andrea_core.pdeathsig PARENT_PID COMMAND [ARGS...]

A trainer launched by an orchestrator (a Prefect flow-run process) is that process's child. If the
orchestrator is killed outright (SIGKILL, the OOM killer), the trainer must not train on unsupervised,
holding the GPU and the run lock where nobody watches it: with Linux's parent-death signal it gets the
same SIGTERM as any other stop, checkpoints the step in flight and exits, and the next run resumes.
And the other way round: in an out-of-memory kill the kernel must take the trainer, not its launcher,
which reports it and starts the next one; the command's oom_score_adj is raised above the launcher's
(andrea_core.oom.prefer_oom_kill), before the exec, so a torchrun agent's ranks inherit it too.
Standard library only (andrea_core.signals and andrea_core.oom are), so that the exec happens before
any heavy import.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from andrea_core.oom import prefer_oom_kill
from andrea_core.signals import nonce_environment

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m andrea_core.pdeathsig PARENT_PID COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent, command = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            print(
                f"andrea: warning: prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}",
                file=sys.stderr,
            )
        # The launcher may have died before the request took effect: then nobody would ever signal us.
        if os.getppid() != parent:
            print(f"andrea: error: launcher pid {parent} is gone; not starting {command[0]}", file=sys.stderr)
            return 3
        try:
            prefer_oom_kill()
        except OSError as e:
            print(f"andrea: warning: could not raise oom_score_adj: {e}", file=sys.stderr)
    # The signal request survives exec; the pid and process group stay. The trainer's nonce is given
    # here, tagged with that pid, so that the trainer need not re-exec itself to get one.
    os.execvpe(command[0], command, nonce_environment(os.getpid()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
