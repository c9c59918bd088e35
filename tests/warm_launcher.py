"""A warm launcher for the tests' `python -m andrea_core ...` processes (issue 45.2): a fork server.

The server (this file run as a script, one per xdist worker) imports torch and the trainer once, runs
no torch op, and forks a child for each request; the child becomes what `python -m MODULE ARGS` started
by subprocess.Popen would have been: real pid, real signals, the request's env, cwd, umask, signal mask
and stdio fds (passed over a Unix socket with SCM_RIGHTS), Python's own signal dispositions, and a
/proc/PID/cmdline and /proc/PID/environ that show its argv and env (rewritten in place: the lock and
`andrea status` read them). A `train` child starts with the trainer nonce its cold re-exec would have
given it (andrea_core.signals.nonce_environment). It exits as python does: SystemExit's code, a
traceback and 1, non-daemon threads joined, atexit run, stdio flushed. The server sends back each
child's wait status; `WarmLauncher.popen` returns a subprocess.Popen whose wait/poll read it.

A child may start in a session of its own (Popen's start_new_session: setsid, so its pid is its
session's and group's, for killpg) and at a lower priority (`nice`: WarmPopen's own keyword, nice(1)'s
increment, applied by the child with nice(2) before it runs; a cold start runs `nice -n N` instead).
A request is run cold (a plain Popen) when warm could differ: a module not preloaded, Popen options
the server cannot apply (pass_fds, preexec_fn, user/group), an argv or env larger than
the server's /proc room, or an import that iterated os.environ and an env that differs from the
server's. An env that differs in a variable read while importing (recorded by watching os.environ
during the imports, plus the prefixes C libraries read at load: OpenMP, BLAS, torch, locale, the
dynamic linker, Python's own, and the launcher's `load_vars`: names a C library loaded in the server
reads once, such as an LD_PRELOAD'd shim's file) goes to a server whose imports read that env:
WarmLauncher keeps up to `max_servers`, starting one under the request's env when none matches (cold
when it cannot). The server refuses to fork while it has more than one thread (OpenMP/BLAS pools do
not survive fork): the caller gets an error.
Known, accepted differences: a warm child's parent is the server (tests about parent death, the
command line or start-up stay cold: conftest's cold=True), its argv[0] in /proc is sys.executable
padded with extra slashes (the same file), and it shares the server's str hash seed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref

# What the suite's and the soak's servers import: the CLI, the trainer (torch) and s3fs, which an S3
# run's process imports at its first S3 URL (0.33 CPU-s a warm child saves; it reads at import only
# variables no request changes: *_NO_EXTENSIONS, S3FS_LOGGING_LEVEL, SSLKEYLOGFILE).
ANDREA_PRELOAD = ("andrea_core.cli", "andrea_core.train.trainer", "s3fs")
ARGV_ROOM = 16 * 1024  # bytes of /proc/PID/cmdline a child may fill
ENV_ROOM = 96 * 1024  # bytes of /proc/PID/environ a child may fill
ENV_DIFFERS = "env differs in variables read at import"
ROOM_VAR = "_WARM_LAUNCHER_ROOM"
BLAS_VAR = "_WARM_LAUNCHER_OPENBLAS_NUM_THREADS"  # the base env's own OPENBLAS_NUM_THREADS ("" = unset)
LOAD_VAR = "_WARM_LAUNCHER_LOAD_VARS"  # the launcher's load_vars, comma-separated
# Variables read when a library loads (C getenv, or Python's start-up), not through os.environ.
IMPORT_TIME_PREFIXES = (
    "PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "TORCH", "PYTORCH", "CUDA",
    "NVIDIA_", "LD_", "MALLOC_", "GLIBC_", "LC_", "LANG", "TZ", "NPY_", "NUMPY_", "TQDM_",
)  # fmt: skip
# Modules that iterate os.environ at import, and how a child redoes what they read (None: cold).
ITERATING_IMPORTS = {"fsspec/config.py": "fsspec", "tqdm/utils.py": None}
# CPU seconds of warm children whose exit this process has read but whose server it has not yet reaped:
# a server's children are its own children, not ours, so RUSAGE_CHILDREN counts them only once we wait
# for the server. cpu_seconds() adds these, so that a test's figure counts the children it started.
_unreaped_children_cpu = 0.0


def cpu_seconds() -> float:
    """CPU time of this process, of every descendant it waited for, and of the warm children whose exit
    it has read (tests/conftest.py's per-module figures)."""
    import resource

    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + _unreaped_children_cpu


def _proc_regions() -> tuple[int, int, int, int]:
    """arg_start, arg_end, env_start, env_end of this process (/proc/self/stat fields 48-51)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return tuple(int(fields[n - 3]) for n in (48, 49, 50, 51))  # type: ignore[return-value]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def cmdline_bytes(argv: list[str], room: int) -> bytes | None:
    """argv as /proc/PID/cmdline shows it, exactly `room` bytes: argv[0] (an absolute path) padded with
    slashes, which name the same file; None if it does not fit."""
    raw = [os.fsencode(a) for a in argv]
    extra = room - sum(len(a) + 1 for a in raw)
    if extra < 0:
        return None
    head, tail = os.path.split(raw[0])
    raw[0] = head + b"/" * (extra + 1) + tail if extra else raw[0]
    return b"\0".join(raw) + b"\0"


def environ_bytes(env: dict[str, str], room: int) -> bytes | None:
    block = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
    return None if len(block) > room else block + b"\0" * (room - len(block))


def blas_threads(env: dict[str, str]) -> int:
    """The OpenBLAS pool size a cold process with `env` starts with (OpenBLAS's blas_get_cpu_number)."""
    procs = len(os.sched_getaffinity(0))
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        with contextlib.suppress(ValueError):
            if int(env.get(name, "0")) > 0:
                return min(int(env[name]), procs)
    return procs


class Server:
    """The fork server: `python tests/warm_launcher.py SOCKET PRELOAD,... ROOM` (see WarmLauncher)."""

    def __init__(self, sock_path: str, preload: list[str], lifeline: int = -1) -> None:
        self.lifeline = lifeline  # EOF once every process holding its other end has exited
        self.dispositions = {}
        for sig in signal.valid_signals():
            with contextlib.suppress(OSError, ValueError, TypeError):
                handler = signal.getsignal(sig)
                if handler is not None:
                    self.dispositions[sig] = handler
        self.regions = _proc_regions()
        self.base = dict(os.environ)
        self.base.pop(ROOM_VAR, None)
        blas = self.base.pop(BLAS_VAR, "")
        load_vars = {v for v in self.base.pop(LOAD_VAR, "").split(",") if v}
        if blas:
            self.base["OPENBLAS_NUM_THREADS"] = blas
        else:
            self.base.pop("OPENBLAS_NUM_THREADS", None)
        self.import_reads, self.refresh, self.any_env_cold = self._import(preload)
        self.import_reads |= load_vars  # read once by a C library already loaded here (WarmLauncher)
        # `-m PACKAGE` of a preloaded package, or `-m PACKAGE.MODULE` of one whose MODULE the imports
        # left alone (run fresh as __main__, as a cold start runs it: bench/NAME.py as bench.NAME)
        self.runnable = {m.split(".")[0] for m in preload}
        self.blas = self._blas_setter()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(sock_path)
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.children: dict[int, socket.socket] = {}

    def _import(self, preload: list[str]) -> tuple[set[str], set[str], bool]:
        """Import `preload` watching os.environ: the keys read one by one, and who iterated it."""
        cls = type(os.environ)
        get, iterate = cls.__getitem__, cls.__iter__
        reads: set[str] = set()
        iterators: list[str] = []
        iterating: list = []  # the frames that iterated os.environ (kept: no frame reuse meanwhile)

        def caller():  # the first frame above os.environ's own code and collections.abc's views
            frame = sys._getframe(2)
            while frame and frame.f_code.co_filename.startswith(("<frozen", os.path.dirname(os.__file__))):
                frame = frame.f_back
            return frame

        def watched_get(env, key):
            frame = caller()
            if not any(frame is f for f in iterating):  # not a read of every key by an iteration
                reads.add(key)
            return get(env, key)

        def watched_iter(env):
            frame = caller()
            iterating.append(frame)
            iterators.append(frame.f_code.co_filename if frame else "?")
            return iterate(env)

        cls.__getitem__, cls.__iter__ = watched_get, watched_iter
        try:
            for module in preload:
                __import__(module)
        finally:
            cls.__getitem__, cls.__iter__ = get, iterate
        refresh, unknown = set(), False
        for path in iterators:
            known = next((v for k, v in ITERATING_IMPORTS.items() if path.endswith(k)), "unknown")
            if known == "unknown":
                unknown = True
            elif known is not None:  # None: tqdm, whose prefix is in IMPORT_TIME_PREFIXES
                refresh.add(known)
        return reads, refresh, unknown

    def _blas_setter(self):
        for line in open("/proc/self/maps"):
            path = line.split()[-1]
            if "openblas" in os.path.basename(path).lower():
                lib = ctypes.CDLL(path)
                for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_"):
                    if hasattr(lib, name):
                        return getattr(lib, name)
                return getattr(lib, "openblas_set_num_threads", None)
        return None

    def _runnable(self, module: str) -> bool:
        package = module.split(".")[0]
        return package in self.runnable and (module == package or module not in sys.modules)

    def why_cold(self, req: dict) -> str | None:
        argv = req["argv"]
        if len(argv) < 2 or argv[0] != "-m" or not self._runnable(argv[1]):
            return f"not a preloaded `-m` module: {argv[:2]}"
        env = req["env"]
        changed = {k for k in env.keys() | self.base.keys() if env.get(k) != self.base.get(k)}
        if changed and self.any_env_cold:
            return "an import iterated os.environ: any env change is run cold"
        early = sorted(k for k in changed if k in self.import_reads or k.startswith(IMPORT_TIME_PREFIXES))
        if early:
            return f"{ENV_DIFFERS}: {early}"
        if cmdline_bytes([sys.executable, *argv], self.regions[1] - self.regions[0]) is None:
            return "argv larger than the server's /proc room"
        if (
            environ_bytes({**env, "ANDREA_TRAINER_NONCE": "0" * 48}, self.regions[3] - self.regions[2])
            is None
        ):
            return "env larger than the server's /proc room"
        return None

    def serve(self) -> None:
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(self.wake_r, selectors.EVENT_READ)
        if self.lifeline >= 0:
            sel.register(self.lifeline, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                if key.fileobj == self.lifeline:  # the test process is gone: so are we
                    os.kill(os.getpid(), signal.SIGTERM)
                elif key.fileobj is self.listener:
                    conn, _ = self.listener.accept()
                    try:
                        self._request(conn)
                    except OSError:
                        conn.close()
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
            self._reap()

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                cpu = usage.ru_utime + usage.ru_stime  # the child's and its reaped descendants'
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"status": status, "cpu_s": cpu}).encode())
                conn.close()

    def _request(self, conn: socket.socket) -> None:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        try:
            req = json.loads(data)
            reason = self.why_cold(req)
            if reason is not None:
                # "env": a server whose imports read this request's env could run it (WarmLauncher).
                conn.send(json.dumps({"cold": reason, "env": reason.startswith(ENV_DIFFERS)}).encode())
                conn.close()
                return
            threads = _threads()
            if threads != 1:
                conn.send(json.dumps({"refused": f"the fork server has {threads} threads, not 1"}).encode())
                conn.close()
                return
            pid = os.fork()
            if pid == 0:
                try:
                    self._become(req, fds, conn)
                finally:
                    os._exit(1)
            self.children[pid] = conn
            conn.send(json.dumps({"pid": pid}).encode())
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)  # the child's own copies stay open in the child

    def _become(self, req: dict, fds: list[int], conn: socket.socket) -> None:
        """In the child: become `python ARGV` as Popen would have started it, run it, exit."""
        try:
            signal.set_wakeup_fd(-1)
            for sig, handler in self.dispositions.items():
                with contextlib.suppress(OSError, ValueError):
                    signal.signal(sig, handler)
            for obj in (conn, self.listener):
                obj.close()
            for fd in (
                self.wake_r,
                self.wake_w,
                self.lifeline,
                *(c.fileno() for c in self.children.values()),
            ):
                with contextlib.suppress(OSError):
                    os.close(fd)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            os.umask(req["umask"])
            os.chdir(req["cwd"])
            if req.get("session"):
                os.setsid()  # as Popen's start_new_session: its own session and process group
            if req.get("nice"):
                os.nice(req["nice"])  # as nice(1): relative to the server's, which is the launcher's
            argv = [sys.executable, *req["argv"]]
            env = dict(req["env"])
            os.environ.clear()  # unsetenv each: libc's environ no longer points into the old block
            os.environ.update(env)
            if argv[3:4] == ["train"] and argv[2] == "andrea_core":
                # What `andrea train`'s re-exec (signals.become_trainer_process) would have given it.
                from andrea_core.signals import nonce_environment

                os.environ.update(nonce_environment(os.getpid()))
            a0, a1, e0, e1 = self.regions
            ctypes.memmove(a0, cmdline_bytes(argv, a1 - a0), a1 - a0)
            ctypes.memmove(e0, environ_bytes(dict(os.environ), e1 - e0), e1 - e0)
            if "fsspec" in self.refresh:
                import fsspec.config as fc

                fc.conf.clear()
                fc.set_conf_files(fc.conf_dir, fc.conf)
                fc.set_conf_env(fc.conf)
            if self.blas is not None and blas_threads(env) > 1:
                self.blas(blas_threads(env))
            sys.argv, sys.orig_argv = [argv[1], *argv[3:]], argv
            sys.path.insert(0, os.getcwd())  # as `python -m` (the server removed its own first entry)
            _reopen_stdio()
            signal.pthread_sigmask(signal.SIG_SETMASK, req["sigmask"])
        except BaseException:
            import traceback

            os.write(2, f"warm launcher: child set-up failed:\n{traceback.format_exc()}".encode())
            os._exit(1)
        _run_as_main(argv[2])


def _reopen_stdio() -> None:
    """sys.stdin/stdout/stderr over fds 0-2 as Python's start-up makes them (create_stdio)."""
    import io

    unbuffered = bool(getattr(sys.__stderr__, "write_through", False))  # python -u / PYTHONUNBUFFERED
    for fd, name, write in ((0, "stdin", False), (1, "stdout", True), (2, "stderr", True)):
        like = getattr(sys, "__" + name + "__") or getattr(sys, name)
        try:
            raw = io.FileIO(fd, "wb" if write else "rb", closefd=False)
        except OSError:
            setattr(sys, name, None)
            setattr(sys, "__" + name + "__", None)
            continue
        buf = raw if (write and unbuffered) else (io.BufferedWriter(raw) if write else io.BufferedReader(raw))
        line = not unbuffered and write and (raw.isatty() or fd == 2)
        text = io.TextIOWrapper(
            buf,
            encoding=like.encoding,
            errors=like.errors,
            newline="\n",
            line_buffering=line,
            write_through=unbuffered,
        )
        text.mode = "w" if write else "r"
        setattr(sys, name, text)
        setattr(sys, "__" + name + "__", text)


def _run_as_main(module: str) -> None:
    """`python -m MODULE` from here on, through to os._exit with python's exit status."""
    import atexit
    import runpy
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    code, interrupted = 0, False
    try:
        runpy._run_module_as_main(module, alter_argv=True)  # what `python -m` calls
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        tb = e.__traceback__.tb_next if e.__traceback__ else None  # not this frame: python has none
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
    try:
        threading._shutdown()
    except BaseException as e:
        sys.excepthook(type(e), e, e.__traceback__)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            code = 120 if code == 0 else code
    if interrupted:  # python re-raises an unhandled KeyboardInterrupt as death by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


class WarmPopen(subprocess.Popen):
    """subprocess.Popen whose child is forked by a WarmLauncher server (or, when the server says so,
    started cold as usual). pid, signals, pipes, communicate, wait and poll behave as Popen's."""

    def __init__(self, launcher: WarmLauncher, args, nice: int = 0, **kwargs) -> None:
        """`nice`: the child's niceness above this process's, as `nice -n NICE ARGS` would start it."""
        self._launcher, self._conn, self.warm, self._nice = launcher, None, False, int(nice)
        self._server: _Server | None = None
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):  # fmt: skip
        plain = (
            not shell and executable is None and preexec_fn is None and not pass_fds and restore_signals
            and gid is None and gids is None and uid is None and umask < 0
            and process_group in (None, -1) and list(args[:1]) == [sys.executable]
        )  # fmt: skip
        reply = {"cold": "Popen options the server does not apply"}
        if plain:
            fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1]
            fds.append(errwrite if errwrite != -1 else 2)
            mask = os.umask(0o22)
            os.umask(mask)
            req = {
                "argv": [os.fsdecode(a) for a in args[1:]],
                "env": {
                    os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()
                },
                "cwd": os.path.abspath(os.fsdecode(cwd) if cwd is not None else os.getcwd()),
                "umask": mask,
                "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
                "session": bool(start_new_session),
                "nice": self._nice,
            }
            reply = self._launcher.request(req, fds, self)  # a pid: adopted (_adopt) there
        if "cold" in reply:
            self._launcher.cold.append(reply["cold"])
            if self._nice:
                args = ["nice", "-n", str(self._nice), *args]
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                          startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                          c2pwrite, errread, errwrite, restore_signals, gid, gids, uid,
                                          umask, start_new_session, process_group)  # fmt: skip
        if "refused" in reply:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
            raise RuntimeError(f"warm launcher refused to fork: {reply['refused']}")
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _adopt(self, pid: int, conn: socket.socket, server: _Server) -> None:
        """The forked child's pid and the connection its exit status comes back on: set by the
        launcher, under its lock, before the server lists this Popen among its children (another
        thread's start may poll them)."""
        self.pid, self._conn, self.warm, self._child_created = pid, conn, True, True
        self._server = server

    def _try_wait(self, wait_flags):
        if self._conn is None:
            return super()._try_wait(wait_flags)
        self._conn.setblocking(not wait_flags & os.WNOHANG)
        try:
            data = self._conn.recv(4096)
        except BlockingIOError:
            return 0, 0
        self._conn.close()
        self._conn = None
        if not data:  # the server is gone: the child's status cannot be known
            raise ChildProcessError(f"warm launcher lost child {self.pid}")
        reply = json.loads(data)
        if self._server is not None:
            self._server.children_cpu(reply.get("cpu_s", 0.0))
        return self.pid, reply["status"]

    def _internal_poll(self, _deadstate=None, **_):
        if not self.warm:
            return super()._internal_poll(_deadstate)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


class _Server:
    """One fork server process (Server, run as this file) whose imports read `env`."""

    def __init__(
        self, preload: list[str], env: dict[str, str], cwd: str, load_vars: tuple[str, ...] = ()
    ) -> None:
        self.env = dict(env)
        self.folder = tempfile.mkdtemp(prefix="warm-launcher-")
        self.sock_path = os.path.join(self.folder, "sock")
        self.children: weakref.WeakSet[WarmPopen] = weakref.WeakSet()  # forked by it, perhaps running
        self._children_cpu = 0.0  # of its children whose exit was read (cpu_seconds)
        server_env = {**env, ROOM_VAR: "x" * ENV_ROOM, BLAS_VAR: env.get("OPENBLAS_NUM_THREADS", "")}
        server_env[LOAD_VAR] = ",".join(load_vars)
        server_env["OPENBLAS_NUM_THREADS"] = "1"  # no BLAS pool in the server; a child gets its own
        # The server's lifeline: a pipe whose write end only this process holds (not inherited across
        # exec). Not PR_SET_PDEATHSIG, which fires when the *thread* that started it exits: a server
        # started from a test's worker thread (test_lease_outage's) died with that thread, and every
        # later start of the worker found its socket refusing (CI, 2026-12-06).
        lifeline, self._lifeline = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), self.sock_path, ",".join(preload), str(lifeline),
                 "#" * ARGV_ROOM],
                env=server_env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                pass_fds=(lifeline,),
            )  # fmt: skip
        finally:
            os.close(lifeline)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.sock_path + ".ready"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"warm launcher server did not start (exit {self.proc.returncode})")
            time.sleep(0.02)

    def request(self, req: dict, fds: list[int]) -> tuple[dict, socket.socket | None]:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.sock_path)
        socket.send_fds(conn, [json.dumps(req).encode()], fds)
        reply = json.loads(conn.recv(1 << 16) or b'{"refused": "the server closed the connection"}')
        if "pid" not in reply:
            conn.close()
            return reply, None
        return reply, conn

    def busy(self) -> bool:
        """Whether a child it forked may still run (its exit status comes through this server)."""
        return any(child.poll() is None for child in list(self.children))

    def children_cpu(self, seconds: float) -> None:
        """A child's CPU seconds, read with its exit: counted by cpu_seconds until this server is reaped."""
        global _unreaped_children_cpu
        self._children_cpu += seconds
        _unreaped_children_cpu += seconds

    def stop(self) -> None:
        global _unreaped_children_cpu
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait()
        _unreaped_children_cpu -= self._children_cpu  # now in our RUSAGE_CHILDREN, through the server's
        self._children_cpu = 0.0
        if self._lifeline >= 0:  # once: a number closed twice may be another thread's new pipe by then
            os.close(self._lifeline)
            self._lifeline = -1
        for name in ("sock", "sock.ready"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.folder, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)


class WarmLauncher:
    """Fork servers with `preload` imported; `popen`/`run` as subprocess's, warm where they can be.

    The first server imports under `env`. A request whose env differs from every server's in a
    variable read at import gets a server of its own, started then under the request's env (torch sets
    TORCHINDUCTOR_CACHE_DIR in a test process once it has run an optimizer step there, and every later
    start differs in it); at most `max_servers`, the least recently used idle one stopped for a new one.
    Cold when none can be had (all busy) or one would not start under that env. `load_vars`: variables
    read when the server starts that its import watch cannot see, treated as read at import (the soak's
    clock shim, LD_PRELOAD'd, maps the file $ANDREA_SOAK_CLOCK_FILE names at its first clock read)."""

    def __init__(
        self,
        preload: list[str],
        env: dict[str, str],
        cwd: str,
        max_servers: int = 3,
        load_vars: tuple[str, ...] = (),
    ) -> None:
        self.preload, self.cwd, self.max_servers = list(preload), cwd, max_servers
        self.load_vars = tuple(load_vars)
        self.env = dict(env)  # the first server's environment (what its warm children's imports read)
        self.warm = 0  # children forked warm
        self.cold: list[str] = []  # why each cold start was cold
        self.started: list[str] = []  # why each server after the first was started
        self.servers = [_Server(self.preload, env, cwd, self.load_vars)]  # the most recently used first
        self._unstartable: set[frozenset] = set()  # envs under which a server did not start
        self._lock = threading.Lock()  # one request at a time: the servers' order, a new server

    def request(self, req: dict, fds: list[int], popen: WarmPopen) -> dict:
        """Ask the servers, the most recently used first, to fork `req`; the server's reply (a pid, or
        why it runs cold). A forked child's pid and the connection its exit status comes back on are
        `popen`'s (WarmPopen._adopt) before it is counted among its server's children: a start on
        another thread polls those (busy()), and must not find one without its pid."""
        with self._lock:
            for server in self.servers:
                reply, conn = server.request(req, fds)
                if not reply.get("env"):
                    break
            else:
                server = self._server_for(req["env"], reply["cold"])
                if server is None:
                    return reply
                reply, conn = server.request(req, fds)
            self.servers.remove(server)
            self.servers.insert(0, server)
            if conn is not None:
                popen._adopt(reply["pid"], conn, server)
                server.children.add(popen)
                self.warm += 1
            return reply

    def _server_for(self, env: dict[str, str], why: str) -> _Server | None:
        """A new server whose imports read `env`, room made for it; None if it cannot be had."""
        key = frozenset(env.items())
        if key in self._unstartable:
            return None
        if len(self.servers) >= self.max_servers:
            idle = [s for s in reversed(self.servers) if not s.busy()]
            if not idle:
                return None
            self.servers.remove(idle[0])
            idle[0].stop()
        try:
            server = _Server(self.preload, env, self.cwd, self.load_vars)
        except RuntimeError:
            self._unstartable.add(key)
            return None
        self.servers.append(server)
        self.started.append(why)
        return server

    def popen(self, args, **kwargs) -> WarmPopen:
        """subprocess.Popen's arguments, and `nice` (WarmPopen)."""
        return WarmPopen(self, args, **kwargs)

    def run(
        self, args, *, input=None, capture_output=False, timeout=None, check=False, **kwargs
    ) -> subprocess.CompletedProcess:
        """subprocess.run, through this launcher."""
        if capture_output:
            kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
        if input is not None:
            kwargs["stdin"] = subprocess.PIPE
        with self.popen(args, **kwargs) as proc:
            try:
                stdout, stderr = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired as e:
                proc.kill()
                e.output, e.stderr = proc.communicate()
                raise
            except BaseException:
                proc.kill()
                raise
        result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        if check:
            result.check_returncode()
        return result

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []


def _server_main(sock_path: str, preload: str, lifeline: int) -> None:
    server = Server(sock_path, [m for m in preload.split(",") if m], lifeline)
    if _threads() != 1:
        print(f"warm launcher: {_threads()} threads after the imports", file=sys.stderr)
    open(sock_path + ".ready", "w").close()
    server.serve()


if __name__ == "__main__":
    sys.path.pop(0)  # this folder: a child's sys.path[0] is its cwd, as under `python -m`
    _server_main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
