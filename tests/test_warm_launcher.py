"""The tests' warm launcher (tests/warm_launcher.py, issue 45.2): a forked child is what a cold
`python -m MODULE` would have been (exit status, exact output, env, cwd, umask, signal state, /proc),
real signals reach it, an env read at import is honoured by a server that imported under it (or by
running cold), and a server with threads refuses to fork. Compared against the same command started
cold by subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import REPO, TINY, _env, last_logged_step, start_trainer, wait_for, warm_launcher
from warm_launcher import WarmLauncher

PROBE_INIT = """
import os
import numpy  # its OpenBLAS pool: a warm child must have the cold one's
AT_IMPORT = os.environ.get("WPROBE_AT_IMPORT", "unset")
from wprobe import imported  # a submodule the server's imports load: `-m wprobe.imported` runs cold
"""
PROBE_IMPORTED = """
if __name__ == "__main__":  # the probe, from a module the server has imported
    import runpy
    runpy.run_module("wprobe.__main__", run_name="__main__")
"""
PROBE_MAIN = r"""
import json, os, signal, subprocess, sys, time
import wprobe

action = sys.argv[1]
if action == "exit":
    sys.stdout.buffer.write(b"out \xff\x00 bytes\nno newline")
    sys.stderr.buffer.write(b"err \xfe\n")
    print("text", end="")
    sys.exit(int(sys.argv[2]))
elif action == "message":
    sys.exit("a message for stderr")
elif action == "raise":
    raise ValueError("boom")
elif action == "interrupt":
    raise KeyboardInterrupt
elif action == "at-import":
    print(wprobe.AT_IMPORT)
elif action == "echo":  # its token on both streams, what its server imported under, its own exit status
    print(sys.argv[2], wprobe.AT_IMPORT, flush=True)
    print(sys.argv[2], file=sys.stderr)
    sys.exit(int(sys.argv[3]))
elif action == "sleep":
    print("ready", flush=True)
    time.sleep(600)
elif action == "spawn":
    child = subprocess.run([sys.executable, "-c", "import os, sys; print(os.getppid()); sys.exit(7)"],
                           capture_output=True, text=True)
    print(os.getpid(), child.stdout.strip(), child.returncode)
elif action == "thread":
    import threading
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    print("main done")
elif action == "proc":
    print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
                      "nice": os.getpriority(os.PRIO_PROCESS, 0)}))
elif action == "time":
    print(time.time())
elif action == "burn":  # this much CPU time, then the CPU time it took
    while time.process_time() < float(sys.argv[2]):
        pass
    print(time.process_time())
elif action == "state":
    def proc(name):
        return [x.decode() for x in open(f"/proc/self/{name}", "rb").read().split(b"\0")]
    cmdline = proc("cmdline")
    cmdline[0] = os.path.normpath(cmdline[0])
    environ = dict(x.split("=", 1) for x in proc("environ") if "=" in x)
    umask = os.umask(0)
    print(json.dumps({
        "argv": sys.argv, "orig_argv": sys.orig_argv, "cmdline": cmdline, "env": dict(os.environ),
        "proc_environ": environ, "cwd": os.getcwd(), "umask": umask, "path0": sys.path[0],
        "main": sorted(k for k in vars(sys.modules["__main__"]) if not k.startswith("__")),
        "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "handlers": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                     if s not in (signal.SIGKILL, signal.SIGSTOP) and hasattr(s, "name")},
        "stdio": [(f.encoding, f.errors, f.line_buffering, f.write_through, f.mode)
                  for f in (sys.stdin, sys.stdout, sys.stderr)],
        "threads": len(os.listdir("/proc/self/task")),
    }, sort_keys=True))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """A launcher whose server preloads `wprobe` (a package read by a module-level env lookup), its env."""
    root = tmp_path_factory.mktemp("warm")
    (root / "wprobe").mkdir()
    (root / "wprobe" / "__init__.py").write_text(PROBE_INIT)
    (root / "wprobe" / "__main__.py").write_text(PROBE_MAIN)
    (root / "wprobe" / "imported.py").write_text(PROBE_IMPORTED)
    (root / "wthread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    env = {**_env(), "PYTHONPATH": f"{root}{os.pathsep}{REPO}"}
    launcher = WarmLauncher(["wprobe"], env, str(root))
    yield launcher, env, root
    launcher.stop()


def both(launcher, env, cwd, *args, **kwargs):
    """The probe run warm (through the launcher) and cold (subprocess.run): (warm, cold)."""
    argv = [sys.executable, "-m", "wprobe", *args]
    kw = {"env": env, "cwd": cwd, "capture_output": True, "timeout": 120, **kwargs}
    warm = launcher.run(argv, **kw)
    cold = subprocess.run(argv, **kw)
    return warm, cold


@pytest.mark.parametrize("code", [0, 3, 255])
def test_exit_status_and_exact_bytes_are_the_cold_ones(probe, code):
    launcher, env, root = probe
    before = len(launcher.cold)
    warm, cold = both(launcher, env, root, "exit", str(code))
    assert len(launcher.cold) == before, launcher.cold  # it did run warm
    assert warm.returncode == cold.returncode == code
    assert warm.stdout == cold.stdout == b"out \xff\x00 bytes\nno newlinetext"
    assert warm.stderr == cold.stderr == b"err \xfe\n"


@pytest.mark.parametrize(
    ("action", "code", "last_line"),
    [
        ("message", 1, "a message for stderr"),
        ("raise", 1, "ValueError: boom"),
        ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ],
)
def test_an_exception_ends_as_python_ends_it(probe, action, code, last_line):
    """SystemExit(str) -> the text on stderr, exit 1; an exception -> the same traceback, exit 1; an
    unhandled KeyboardInterrupt -> death by SIGINT, as python does."""
    launcher, env, root = probe
    warm, cold = both(launcher, env, root, action, text=True)
    assert warm.returncode == cold.returncode == code, (warm.stderr, cold.stderr)
    assert warm.stderr.splitlines()[-1] == last_line
    assert warm.stderr == cold.stderr  # the same traceback, frame by frame


def test_a_warm_child_has_the_state_a_cold_one_has(probe, tmp_path):
    """argv, env (os.environ and /proc/PID/environ), /proc/PID/cmdline, cwd, umask, blocked signals,
    signal dispositions, stdio, __main__'s namespace, thread count (numpy's BLAS pool) all as cold."""
    launcher, env, _ = probe
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {**env, "WPROBE_ONLY_HERE": "x y=z"}
    env.pop("TERM", None)
    old_umask = os.umask(0o027)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    try:
        warm, cold = both(launcher, env, cwd, "state", "--flag", "ü", text=True)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR2])
        os.umask(old_umask)
    assert warm.returncode == cold.returncode == 0, (warm.stderr, cold.stderr)
    w, c = json.loads(warm.stdout), json.loads(cold.stdout)
    assert w == c
    assert w["env"]["WPROBE_ONLY_HERE"] == "x y=z" and w["proc_environ"] == w["env"]
    assert w["cwd"] == str(cwd) and w["umask"] == 0o027 and int(signal.SIGUSR2) in w["sigmask"]
    assert w["cmdline"] == [os.path.normpath(sys.executable), "-m", "wprobe", "state", "--flag", "ü", ""]


def test_a_variable_read_at_import_is_honoured_by_a_server_that_imported_it(probe):
    """wprobe reads WPROBE_AT_IMPORT when imported, in the server; a request that changes it goes to a
    server started under the request's env, so the child sees its own value, as a cold one would, and
    the first server still serves the first env."""
    launcher, env, root = probe
    same = launcher.popen(
        [sys.executable, "-m", "wprobe", "at-import"], env=env, cwd=root, stdout=subprocess.PIPE
    )
    assert same.communicate(timeout=60)[0] == b"unset\n" and same.warm
    changed = {**env, "WPROBE_AT_IMPORT": "changed"}
    cold = len(launcher.cold)
    warm, cold_run = both(launcher, changed, root, "at-import")
    assert warm.stdout == cold_run.stdout == b"changed\n" and len(launcher.cold) == cold, launcher.cold
    assert "WPROBE_AT_IMPORT" in launcher.started[-1]
    assert [s.env.get("WPROBE_AT_IMPORT") for s in launcher.servers] == ["changed", None]
    again = launcher.run(
        [sys.executable, "-m", "wprobe", "at-import"], env=env, cwd=root, capture_output=True
    )
    assert again.stdout == b"unset\n" and len(launcher.cold) == cold and len(launcher.servers) == 2


def test_a_variable_read_at_import_runs_cold_where_no_server_can_import_it(probe):
    """At most max_servers: the least recently used idle one is stopped for a new env; a busy one (its
    child's exit status comes through it) never, and with every server busy the request runs cold."""
    _, env, root = probe
    launcher = WarmLauncher(["wprobe"], env, str(root), max_servers=2)
    sleepers = []
    try:
        sleeper = launcher.popen(
            [sys.executable, "-m", "wprobe", "sleep"], env=env, cwd=root, stdout=subprocess.PIPE
        )
        sleepers.append(sleeper)
        assert sleeper.warm and sleeper.stdout.readline() == b"ready\n"
        first = launcher.servers[0]
        for value in ("one", "two"):  # "two" stops the idle server of "one", never the sleeper's
            out = launcher.run(
                [sys.executable, "-m", "wprobe", "at-import"],
                env={**env, "WPROBE_AT_IMPORT": value}, cwd=root, capture_output=True,
            )  # fmt: skip
            assert out.stdout == f"{value}\n".encode() and not launcher.cold, launcher.cold
        assert [s.env.get("WPROBE_AT_IMPORT") for s in launcher.servers] == ["two", None]
        assert launcher.servers[1] is first and first.proc.poll() is None
        busy = launcher.popen(
            [sys.executable, "-m", "wprobe", "sleep"], env={**env, "WPROBE_AT_IMPORT": "two"}, cwd=root,
            stdout=subprocess.PIPE,
        )  # fmt: skip
        sleepers.append(busy)
        assert busy.warm and busy.stdout.readline() == b"ready\n"
        out = launcher.run(
            [sys.executable, "-m", "wprobe", "at-import"],
            env={**env, "WPROBE_AT_IMPORT": "three"}, cwd=root, capture_output=True,
        )  # fmt: skip
        assert out.stdout == b"three\n" and len(launcher.servers) == 2
        assert launcher.cold == ["env differs in variables read at import: ['WPROBE_AT_IMPORT']"]
        for proc in sleepers:
            proc.kill()
            assert proc.wait(timeout=60) == -signal.SIGKILL  # its status still comes through its server
    finally:
        for proc in sleepers:
            if proc.returncode is None:  # a failed test: by pid, as its server may be gone
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGKILL)
            proc.stdout.close()
        launcher.stop()


def test_real_signals_reach_a_warm_child_and_its_status_says_so(probe):
    launcher, env, root = probe
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = launcher.popen(
            [sys.executable, "-m", "wprobe", "sleep"], env=env, cwd=root, stdout=subprocess.PIPE
        )
        assert proc.warm and proc.stdout.readline() == b"ready\n"
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        os.kill(proc.pid, sig)  # a real signal to the real pid
        assert proc.wait(timeout=60) == -sig
        proc.stdout.close()


def test_a_warm_child_spawns_its_own_children_and_joins_its_threads(probe):
    launcher, env, root = probe
    warm = launcher.run(
        [sys.executable, "-m", "wprobe", "spawn"], env=env, cwd=root, capture_output=True, text=True
    )
    pid, grandchild_parent, grandchild_code = warm.stdout.split()
    assert warm.returncode == 0 and pid == grandchild_parent and grandchild_code == "7"
    warm, cold = both(launcher, env, root, "thread", text=True)
    assert warm.stdout == cold.stdout == "main done\nthread done\n"  # non-daemon threads joined at exit


def test_a_warm_childs_cpu_time_counts_once_its_exit_is_read_and_once_only(probe):
    """The suite's CPU figures (conftest): a warm child is its server's child, not this process's, so
    its CPU time comes with its exit status and counts from then; once its server is reaped (and the
    child's time is in this process's RUSAGE_CHILDREN through it), it is no longer added."""
    import warm_launcher

    _, env, root = probe
    launcher = WarmLauncher(["wprobe"], env, str(root))
    unreaped = warm_launcher._unreaped_children_cpu
    try:
        before = warm_launcher.cpu_seconds()
        argv = [sys.executable, "-m", "wprobe", "burn", "0.5"]
        burnt = float(launcher.run(argv, env=env, cwd=root, capture_output=True, text=True).stdout)
        assert burnt >= 0.5 and warm_launcher._unreaped_children_cpu - unreaped >= burnt
        assert warm_launcher.cpu_seconds() - before >= burnt
    finally:
        launcher.stop()
    assert warm_launcher._unreaped_children_cpu == pytest.approx(unreaped, abs=1e-9)


def test_a_server_with_threads_refuses_to_fork(probe):
    _, env, root = probe
    launcher = WarmLauncher(["wprobe", "wthread"], env, str(root))
    try:
        with pytest.raises(RuntimeError, match="refused to fork: the fork server has 2 threads, not 1"):
            launcher.popen([sys.executable, "-m", "wprobe", "exit", "0"], env=env, cwd=root)
    finally:
        launcher.stop()


def test_a_warm_trainer_is_the_products_own_and_stops_cleanly(tmp_path):
    """A warm `andrea train`: the lock's nonce check (/proc/PID/environ, cmdline, cwd) accepts it, the
    product's signal path (SIGTERM -> checkpoint, exit 0) works, and it ran warm."""
    from andrea_core.command import process_argv, trainer_run_dir
    from andrea_core.run.lock import read_lock
    from andrea_core.run.rundir import RunDir

    run = tmp_path / "run"
    log = tmp_path / "train.log"
    argv = ("--config", TINY, "--run-dir", str(run), "--device", "cpu", "--pace", "0.2")
    proc = start_trainer(*argv, log=log)
    try:
        assert getattr(proc, "warm", False) or os.environ.get("ANDREA_WARM_LAUNCHER") == "0"
        wait_for(lambda: last_logged_step(run) >= 2, 300, "step 2")
        lock = read_lock(RunDir(str(run)))
        assert lock.pid == proc.pid and lock.why_not_our_trainer() is None
        assert trainer_run_dir(process_argv(proc.pid)) == str(run)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "SIGTERM" in text and RunDir(str(run)).checkpoint_steps(), text


def test_a_start_after_torch_set_its_inductor_cache_dir_runs_warm():
    """torch sets TORCHINDUCTOR_CACHE_DIR in this process at its first optimizer step here (a test
    that trains in process), a variable read at import by its prefix: starts with it and without it
    both run warm, each on a server whose imports read it as the start has it (CI once ran 46 warm,
    178 cold on one worker)."""
    if os.environ.get("ANDREA_WARM_LAUNCHER") == "0":
        pytest.skip("ANDREA_WARM_LAUNCHER=0")
    import torch

    name, before = "TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        if before is None:
            model = torch.nn.Linear(2, 2)
            optimizer = torch.optim.AdamW(model.parameters())
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
            assert name in os.environ, "torch no longer sets TORCHINDUCTOR_CACHE_DIR at an optimizer step"
        value = os.environ[name]
        launcher = warm_launcher()
        cold = len(launcher.cold)
        for env in ({k: v for k, v in _env().items() if k != name}, _env()):
            proc = start_trainer("--help", env=env)
            assert proc.warm and proc.wait(timeout=120) == 0, launcher.cold[cold:]
            assert any(s.env.get(name) == env.get(name) for s in launcher.servers)
        assert len(launcher.cold) == cold and {s.env.get(name) for s in launcher.servers} >= {None, value}
    finally:
        if before is None:
            os.environ.pop(name, None)


def test_andrea_warm_launcher_0_turns_it_off(monkeypatch):
    import conftest

    monkeypatch.setenv("ANDREA_WARM_LAUNCHER", "0")
    assert conftest.warm_launcher() is None
    proc = start_trainer("--help")
    assert type(proc) is subprocess.Popen and proc.wait(timeout=120) == 0


def test_a_child_starts_in_its_own_session_at_its_nice_value_as_a_cold_one_does(probe):
    """start_new_session: the warm child's pid is its session's and its process group's (the soak
    kills a machine's processes by group), as a cold Popen's; `nice`: its niceness is this process's
    plus the increment, as `nice -n N python ...`'s. Without either: this process's session, group and
    niceness, as cold. A killpg of a warm child's group kills it, not its server."""
    launcher, env, root = probe
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    argv = [sys.executable, "-m", "wprobe", "proc"]
    for session, nice in ((False, 0), (True, 0), (False, 7), (True, 5)):
        cold_before = len(launcher.cold)
        warm = launcher.popen(
            argv, env=env, cwd=root, stdout=subprocess.PIPE, start_new_session=session, nice=nice
        )
        w = json.loads(warm.communicate(timeout=120)[0])
        assert warm.warm and warm.returncode == 0 and len(launcher.cold) == cold_before, launcher.cold
        cold = subprocess.run(
            ["nice", "-n", str(nice), *argv], env=env, cwd=root, capture_output=True,
            start_new_session=session, timeout=120,
        )  # fmt: skip
        c = json.loads(cold.stdout)
        assert w["pid"] == warm.pid and w["nice"] == c["nice"] == min(19, ours + nice), (w, c, ours)
        if session:
            assert w["sid"] == w["pgid"] == w["pid"] and c["sid"] == c["pgid"] == c["pid"], (w, c)
        else:
            assert (w["sid"], w["pgid"]) == (c["sid"], c["pgid"]) == (os.getsid(0), os.getpgid(0))
    sleeper = launcher.popen(
        [sys.executable, "-m", "wprobe", "sleep"], env=env, cwd=root, stdout=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert sleeper.warm and sleeper.stdout.readline() == b"ready\n"
        os.killpg(sleeper.pid, signal.SIGKILL)
        assert sleeper.wait(timeout=60) == -signal.SIGKILL
        assert all(s.proc.poll() is None for s in launcher.servers)
    finally:
        if sleeper.returncode is None:
            with contextlib.suppress(OSError):
                os.kill(sleeper.pid, signal.SIGKILL)
        sleeper.stdout.close()


def test_a_cold_start_is_niced_as_a_warm_one(probe):
    """A start the server cannot run warm (a module its imports loaded) gets its `nice` by nice(1)."""
    launcher, env, root = probe
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    proc = launcher.popen(
        [sys.executable, "-m", "wprobe.imported", "proc"], env=env, cwd=root, stdout=subprocess.PIPE,
        nice=6, start_new_session=True,
    )  # fmt: skip
    got = json.loads(proc.communicate(timeout=120)[0])
    assert not proc.warm and proc.returncode == 0 and proc.args[:2] == [sys.executable, "-m"]
    assert got["nice"] == min(19, ours + 6) and got["sid"] == got["pid"] == proc.pid, got


def test_a_variable_a_preloaded_shim_reads_at_load_gets_a_server_of_its_own(probe, tmp_path):
    """The soak's clock shim (bench/clockshim.c, LD_PRELOAD'd) maps the file $ANDREA_SOAK_CLOCK_FILE
    names at its first clock read, in the server: named in load_vars, a start with another host's clock
    file goes to a server started under it and reads that host's clock, as a cold start does (not
    named, the first server would fork it with the first host's clock)."""
    import shutil
    import struct
    import time

    if shutil.which("cc") is None:
        pytest.skip("no C compiler for bench/clockshim.c")
    launcher, env, root = probe
    shim = tmp_path / "clockshim.so"
    subprocess.run(
        ["cc", "-O2", "-shared", "-fPIC", "-o", str(shim), str(REPO / "bench" / "clockshim.c"), "-ldl"],
        check=True,
    )
    clocks = {}
    for host, wall in (("a", 0), ("b", 10**6)):
        clocks[host] = tmp_path / f"clock-{host}"
        clocks[host].write_bytes(struct.pack("=qq", wall * 10**9, 0))
    envs = {h: {**env, "LD_PRELOAD": str(shim), "ANDREA_SOAK_CLOCK_FILE": str(f)} for h, f in clocks.items()}
    shimmed = WarmLauncher(["wprobe"], envs["a"], str(root), load_vars=("ANDREA_SOAK_CLOCK_FILE",))
    try:
        for host in ("a", "b", "a"):
            argv = [sys.executable, "-m", "wprobe", "time"]
            warm = shimmed.popen(argv, env=envs[host], cwd=root, stdout=subprocess.PIPE)
            ahead = float(warm.communicate(timeout=120)[0]) - time.time()
            cold = subprocess.run(argv, env=envs[host], cwd=root, capture_output=True, timeout=120)
            assert warm.warm and not shimmed.cold, shimmed.cold
            expected = 10**6 if host == "b" else 0
            assert abs(ahead - expected) < 60 and abs(float(cold.stdout) - time.time() - expected) < 60
        assert len(shimmed.servers) == 2 and "ANDREA_SOAK_CLOCK_FILE" in shimmed.started[0], shimmed.started
    finally:
        shimmed.stop()


def test_a_submodule_the_server_did_not_import_runs_warm_as_main(probe):
    """`-m PACKAGE.MODULE` of a preloaded package (how bench/NAME.py runs warm: bench.NAME) whose MODULE
    the server's imports left alone: executed fresh as __main__, the cold run's status and bytes."""
    launcher, env, root = probe
    argv = [sys.executable, "-m", "wprobe.__main__", "exit", "3"]
    kw = {"env": env, "cwd": root, "capture_output": True, "timeout": 120}
    before = len(launcher.cold)
    warm, cold = launcher.run(argv, **kw), subprocess.run(argv, **kw)
    assert len(launcher.cold) == before, launcher.cold  # it did run warm
    assert warm.returncode == cold.returncode == 3
    assert warm.stdout == cold.stdout == b"out \xff\x00 bytes\nno newlinetext"
    assert warm.stderr == cold.stderr == b"err \xfe\n"


def test_what_the_server_cannot_apply_runs_cold(probe):
    """`-c`, a module the server imported (run as __main__ it would run twice), or Popen options it
    cannot apply: an ordinary Popen."""
    launcher, env, root = probe
    extra, other = os.pipe()
    os.close(other)
    for argv, kwargs in (
        ([sys.executable, "-c", "import os; print(os.getppid() == int(os.environ['PARENT']))"], {}),
        ([sys.executable, "-m", "wprobe.imported", "at-import"], {}),
        ([sys.executable, "-m", "wprobe", "at-import"], {"pass_fds": (extra,)}),
        ([sys.executable, "-m", "wprobe", "at-import"], {"preexec_fn": os.getpid}),
    ):
        proc = launcher.popen(
            argv, env={**env, "PARENT": str(os.getpid())}, cwd=root, stdout=subprocess.PIPE, **kwargs
        )
        out = proc.communicate(timeout=120)[0]
        assert not proc.warm and proc.returncode == 0 and out in (b"True\n", b"unset\n"), launcher.cold[-1]
    os.close(extra)


def test_a_server_started_from_a_thread_outlives_the_thread_and_not_its_process(probe):
    """A server started from a test's worker thread (test_lease_outage rides two outages on two
    threads) serves on after that thread ends: PR_SET_PDEATHSIG, which it had, fires when the thread
    that started it exits, and every later start found its socket refusing (CI, 2026-12-06). It still
    ends with the process that started it, however that one dies (its lifeline: SIGKILL here)."""
    import threading

    _, env, root = probe
    made: list[WarmLauncher] = []  # its first server is started by the thread that makes it
    started = threading.Thread(target=lambda: made.append(WarmLauncher(["wprobe"], env, str(root))))
    started.start()
    started.join()
    (fresh,) = made
    try:
        (server,) = fresh.servers
        warm = fresh.run(
            [sys.executable, "-m", "wprobe", "exit", "3"], env=env, cwd=root, capture_output=True
        )
        assert warm.returncode == 3 and server.proc.poll() is None and not fresh.cold
    finally:
        fresh.stop()
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(root)], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    pid = int(owner.stdout.readline())
    os.kill(owner.pid, signal.SIGKILL)
    assert owner.wait(60) == -signal.SIGKILL
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z", 60, "the server's exit")


OWNER = """
import sys, time
sys.path.insert(0, "tests")
from warm_launcher import WarmLauncher
launcher = WarmLauncher(["wprobe"], dict(__import__("os").environ), sys.argv[1])
launcher.run([sys.executable, "-m", "wprobe", "exit", "0"], capture_output=True)
print(launcher.servers[0].proc.pid, flush=True)
time.sleep(600)
"""


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    return "gone"


def test_starts_from_many_threads_at_once_each_get_their_own_output_and_exit_status(probe):
    """Many threads start commands through one launcher at once (as bench/soak.py's main and
    reference threads do), each with its own token, exit status and import-read env, over two servers
    for three envs, so that a start also stops an idle server (polling the others' children) or runs
    cold: every caller reads exactly its own child's stdout and stderr and gets its own exit status,
    and every start is counted once, warm or cold. The interpreter switches threads every 10 us
    here, so that starts interleave mid-way."""
    import threading

    _, env, root = probe
    launcher = WarmLauncher(["wprobe"], env, str(root), max_servers=2)
    results, errors = [], []

    def starts(thread: int) -> None:
        for i in range(6):
            token, code = f"t{thread}-{i}", 1 + (thread * 6 + i) % 250
            value = "abc"[(thread + i) % 3]
            try:
                out = launcher.run(
                    [sys.executable, "-m", "wprobe", "echo", token, str(code)],
                    env={**env, "WPROBE_AT_IMPORT": value}, cwd=root, capture_output=True, timeout=120,
                )  # fmt: skip
                results.append((token, code, value, out.returncode, out.stdout, out.stderr))
            except Exception as e:  # noqa: BLE001 - reported with its start below
                errors.append((token, repr(e)))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=starts, args=(n,)) for n in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        sys.setswitchinterval(interval)
        launcher.stop()
    assert not errors, errors
    assert len(results) == 72
    wrong = [
        r for r in results if (r[3], r[4], r[5]) != (r[1], f"{r[0]} {r[2]}\n".encode(), f"{r[0]}\n".encode())
    ]
    assert not wrong, (wrong, launcher.cold)
    assert launcher.warm > 0 and launcher.warm + len(launcher.cold) == 72, (launcher.warm, launcher.cold)
