"""Shared test helpers: real trainer processes on the tiny config, a shared token cache."""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("ANDREA_SHARED", REPO.parent / "shared"))
TINY = str(REPO / "configs" / "andrea-tiny.yaml")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="session", autouse=True)
def token_cache_dir(tmp_path_factory) -> Path:
    """One token cache for the whole session: arms are tokenized once, as on a real machine."""
    # Under pytest-xdist the workers share one (its builder's flock lets one tokenize, the others wait).
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    shared = tmp_path_factory.getbasetemp().parent / "token-cache" if worker else None  # popen-gwN's parent
    d = Path(os.environ.get("ANDREA_TEST_CACHE_DIR") or shared or tmp_path_factory.mktemp("token-cache"))
    d.mkdir(parents=True, exist_ok=True)
    os.environ["ANDREA_CACHE_DIR"] = str(d)
    return d


def _session_root(tmp_path_factory) -> Path:
    """The folder every worker of this test session shares: under pytest-xdist popen-gwN's parent."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], dict]) -> tuple[Path, dict]:
    """`build(folder)` once per test session, by whichever worker asks first; the others wait on its
    flock and take what it built: a trained run read by modules that go to several workers is trained
    once, not once a worker. Returns the folder and what `build` returned (JSON). A build that failed
    halfway is redone by the next to ask."""
    import fcntl
    import shutil

    root = _session_root(tmp_path_factory)
    folder, done = root / f"built-{name}", root / f"built-{name}.json"
    with open(root / f"built-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            done.write_text(json.dumps(build(folder)))
    return folder, json.loads(done.read_text())


def library_run(tmp_path_factory, to: Path, max_steps: int, *args: str, **overrides) -> Path:
    """A library of trained runs (issue 45.1): andrea-tiny (tests/tiny.py's tiny_config with `overrides`)
    trained from step 0 by `andrea train --max-steps MAX_STEPS ARGS`, once per test session for each
    recipe (built_once: modules that ask for the same recipe, on either worker, share one training),
    then copied (shutil.copytree, links kept) to `to`, which is returned: the copy is the caller's to
    change. For tests that need a run at step N and are not about creating or training one."""
    import shutil

    from tests.tiny import tiny_config

    recipe = [str(max_steps), *args, *(f"{k}={v}" for k, v in sorted(overrides.items()))]
    name = "library-" + re.sub(r"[^A-Za-z0-9=.]+", "-", "-".join(recipe)).strip("-")

    def train(folder: Path) -> dict:
        cfg = tiny_config(folder, **overrides)
        run = str(folder / "run")
        andrea("train", "--config", cfg, "--run-dir", run, "--max-steps", str(max_steps), *args)
        return {}

    folder, _ = built_once(tmp_path_factory, name, train)
    shutil.copytree(folder / "run", to, symlinks=True)
    return to


@pytest.fixture
def one_thread():
    """Small ops run fastest on one thread; results do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def last_logged_step(run: RunDir | Path | str) -> int:
    """The newest step of a run's canonical loss history (0 before the first): a trainer's progress."""
    history = read_history(run if isinstance(run, RunDir) else RunDir(str(run)))
    return history[-1].step if history else 0


def lock_released(run: Path | str) -> bool:
    """No trainer holds the run: its lock is absent, or left `released` by a clean exit (lock.py)."""
    lock = Path(run) / ".trainer.json"
    return not lock.exists() or json.loads(lock.read_text()).get("released") is True


def andrea(
    *args: str,
    timeout: float = 900,
    check: bool = True,
    env: dict[str, str] | None = None,
    cold: bool = False,
) -> subprocess.CompletedProcess:
    """Run the `andrea` CLI as a real process, as an operator would (`env`: instead of `_env()`).
    Forked warm by the worker's launcher (tests/warm_launcher.py) unless `cold` (a test about start-up,
    import laziness, the process's parent or command line) or ANDREA_WARM_LAUNCHER=0."""
    launcher = None if cold else warm_launcher()
    proc = (launcher.run if launcher else subprocess.run)(
        [sys.executable, "-m", "andrea_core", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or _env(),
        cwd=REPO,
    )
    if check and proc.returncode != 0:
        cmd = " ".join(args)
        raise AssertionError(f"andrea {cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


_launcher = None


def warm_launcher():
    """This worker's fork server with torch and the trainer imported (issue 45.2), started by the first
    caller; None under ANDREA_WARM_LAUNCHER=0. Stopped at the end of the session (warm_launcher_server)."""
    global _launcher
    if os.environ.get("ANDREA_WARM_LAUNCHER", "1") == "0":
        return None
    if _launcher is None:
        from warm_launcher import ANDREA_PRELOAD, WarmLauncher

        _sweep_dead_launcher_folders()
        _launcher = WarmLauncher(list(ANDREA_PRELOAD), _env(), str(REPO))
        atexit.register(_stop_launcher_at_exit, os.getpid())
    return _launcher


def _stop_launcher_at_exit(owner: int) -> None:
    """At this worker's exit, however it ends (no session teardown after an internal error or an
    interrupt): its servers stop and their folders go. Not in a forked child that exits through
    Python (its atexit runs too, and the servers are its parent's)."""
    if os.getpid() == owner and _launcher is not None:
        _launcher.stop()


def _sweep_dead_launcher_folders() -> None:
    """Remove the /tmp/warm-launcher-* folders of servers that are gone without their owner's stop
    (a test process killed by a signal runs no atexit; the server exits when its lifeline closes):
    ours, holding a socket no process listens on (not bound in /proc/net/unix). A live server's
    socket is bound from the moment its file exists, and the sockets are listed after the folders:
    a server that starts meanwhile is in the listing, so only dead servers' folders match."""
    import shutil
    import tempfile

    with contextlib.suppress(OSError):
        candidates = []
        for folder in Path(tempfile.gettempdir()).glob("warm-launcher-*"):
            with contextlib.suppress(OSError):
                if folder.stat().st_uid == os.getuid() and (folder / "sock").is_socket():
                    candidates.append(folder)
        with open("/proc/net/unix") as f:
            bound = {line.split()[-1] for line in f.read().splitlines()[1:] if len(line.split()) > 7}
        for folder in candidates:
            if str(folder / "sock") not in bound:
                shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def warm_launcher_server():
    """Stops this worker's warm launcher, if a test started it; how many of its starts were warm, why
    the others were cold, and why each server after the first was started, in
    test-output/warm-launcher-<worker>.txt."""
    yield
    if _launcher is not None:
        _launcher.stop()
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        report = REPO / "test-output" / f"warm-launcher-{worker}.txt"
        report.parent.mkdir(exist_ok=True)
        reasons = collections.Counter(_launcher.cold)
        lines = [f"{_launcher.warm} warm, {len(_launcher.cold)} cold, {1 + len(_launcher.started)} servers"]
        lines += [f"{n} cold: {why}" for why, n in reasons.most_common()]
        report.write_text("\n".join(lines + [f"server started: {why}" for why in _launcher.started]) + "\n")


_IMPORTED = """import json, runpy, sys
modules = sys.argv.pop(1).split(",")
sys.argv = ["andrea", *sys.argv[1:]]
try:
    runpy.run_module("andrea_core", run_name="__main__")
except SystemExit as e:
    assert not e.code, f"exit {e.code}"
print("imported:", json.dumps(sorted(m for m in modules if m in sys.modules)))
"""


def andrea_imports(module: str, *args: str, timeout: float = 300) -> bool:
    """Whether `andrea ARGS`, run to a clean exit in a fresh process, imported `module` (any of them,
    when it names several, comma-separated)."""
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORTED, module, *args],
        capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, f"andrea {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("imported: "), proc.stdout
    return bool(json.loads(last.removeprefix("imported: ")))


def start_trainer(
    *args: str, log: Path | None = None, env: dict[str, str] | None = None, cold: bool = False
) -> subprocess.Popen:
    """`andrea train ARGS` as a real process (stdout and stderr to `log`), warm unless `cold` (andrea)."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    launcher = None if cold else warm_launcher()
    return (launcher.popen if launcher else subprocess.Popen)(
        [sys.executable, "-m", "andrea_core", "train", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env or _env(),
        cwd=REPO,
    )


@contextlib.contextmanager
def flock_held_elsewhere(path: Path) -> Iterator[int]:
    """A live process of its own holds `path`'s flock (as a writer holds its temporary's, or its
    mirror's) until the block ends, then is killed: its pid inside the block."""
    code = "import fcntl, sys, time\nf = open(sys.argv[1], 'rb')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
    code += "print('held', flush=True)\ntime.sleep(600)\n"
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def wait_for(
    predicate: Callable[[], object],
    timeout: float = 300,
    what: str = "condition",
    every: float | None = None,
) -> object:
    """`predicate()`'s first truthy value, polled every `every` seconds; by default every 20 ms, and
    every 50 ms once it has waited 2 s (a wait that long is for a trainer's steps, which a poll 30 ms
    later still sees; an S3 predicate costs 6.7 ms of CPU a call here and in moto). A wait, not a timing
    assertion: the default is generous so that a loaded machine is slow, not red (a `mix` fixture's first
    checkpoint took over 120 s at load 14). A predicate that asks a server (Prefect's API) or parses a
    whole file polls slower: each call costs the server, or this process, CPU the trainers need."""
    start = time.monotonic()
    deadline = start + timeout
    while (now := time.monotonic()) < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every or (0.02 if now - start < 2 else 0.05))
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def refused(proc: subprocess.CompletedProcess, *named: str) -> str:
    """The one `andrea: error:` line of a refusal (exit 2), which must name each of `named`."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("andrea: error:")]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stdout, proc.stderr)
    for what in named:
        assert what in lines[0], (what, lines[0])
    return lines[0]


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory) -> Path:
    """andrea-tiny trained straight to step 300 on the CPU (checkpoints 100, 200, 300), once per session
    (built_once: by whichever worker first needs it): the uninterrupted run that resume tests compare
    against, wherever their own run lives (checkpoint bytes do not depend on the store). Read it; copy
    it before changing anything."""

    def train(folder: Path) -> dict:
        andrea(
            "train",
            "--config",
            TINY,
            "--run-dir",
            str(folder / "run"),
            "--max-steps",
            "300",
            "--device",
            "cpu",
        )
        return {}

    return built_once(tmp_path_factory, "tiny-reference", train)[0] / "run"


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode, its own process on 127.0.0.1) for the session.
    This process and every trainer it starts reach it through s3fs: FSSPEC_S3_ENDPOINT_URL, AWS_*."""
    from s3_server import start_s3_server

    server = start_s3_server()
    server.use_in_this_process()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One real Prefect server for this worker's modules (tests/prefect_ephemeral.py), started when the
    first of them asks; its log in test-output/prefect/server-<worker>.log."""
    from prefect_ephemeral import start_prefect_server

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    log = REPO / "test-output" / "prefect" / f"server-{worker}.log"
    server = start_prefect_server(tmp_path_factory.mktemp("prefect-home"), log)
    yield server
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)  # this process's flow runs' logs, while the server still answers
    server.stop()


_bucket_numbers = itertools.count()


@pytest.fixture
def s3_bucket(s3_server, request) -> str:
    """A fresh, empty bucket for one test: its s3:// URL."""
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:50].strip("-")
    name = f"{name}-{next(_bucket_numbers)}"
    s3_server.client().mkdir(name)
    return f"s3://{name}"


def pytest_terminal_summary(terminalreporter) -> None:
    """Each module's time, slowest first (_report_module_times). A skip is never silent: every skipped
    test, and why, in a banner at the end of the run (before pytest's own short summary and closing
    line), so that CI output shows what this machine did not check (a missing systemd-analyze, no
    CAP_SYS_ADMIN for a tmpfs, no unshare)."""
    _report_module_times(terminalreporter)
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.write_sep(
        "!", f"{len(skipped)} TESTS SKIPPED: NOT CHECKED ON THIS MACHINE", red=True, bold=True
    )
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        terminalreporter.write_line(f"SKIPPED {report.nodeid}: {reason.removeprefix('Skipped: ')}", red=True)


# The suite's modules, slowest first, from tests/module_times.txt: each module's seconds (its tests'
# setup, call and teardown, module fixtures included) as the last whole run on this 2-core machine
# measured them; scripts/test.sh rewrites the file at the end of every run (ANDREA_MODULE_TIMES) and
# prints it, so the order is derived, never kept by hand. Two workers take whole modules in collection
# order (scripts/test.sh: --dist loadfile --no-loadscope-reorder), so the longest go first and the last
# to start are short: a long module started last would keep one worker busy while the other idles
# (longest-processing-time first). An order only: a module missing there runs after these, in its usual
# place, and a stale entry costs time, never a result.
MODULE_TIMES = REPO / "tests" / "module_times.txt"


def read_module_times(path: Path = MODULE_TIMES) -> dict[str, float]:
    """`{module stem: seconds}` from a module-times file (`stem seconds` a line, `#` comments)."""
    times: dict[str, float] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            fields = line.split("#", 1)[0].split()
            if len(fields) == 2:
                times[fields[0]] = float(fields[1])
    return times


_last_times = read_module_times()
SLOWEST_FIRST = sorted(_last_times, key=_last_times.__getitem__, reverse=True)
_module_seconds: dict[str, float] = {}
_module_cpu: dict[str, float] = {}
_test_cpu: dict[str, float] = {}  # by node id: test-output/test-cpu.txt
CPU_PROPERTY = "cpu_s"  # a phase's CPU seconds, carried to the controller in the report's user_properties
SESSION = "(the workers' session servers)"  # their stop at each worker's end: a row of its own


def _timed_phase(item: pytest.Item, when: str):
    """A phase's CPU time: this process's and its descendants' once waited for (a server stopped at a
    fixture's teardown counts there, a trainer when its test reaps it, a warm child when its exit is
    read); a process left to init is not counted."""
    from warm_launcher import cpu_seconds

    start = cpu_seconds()
    yield
    item.user_properties.append((f"{CPU_PROPERTY}:{when}", cpu_seconds() - start))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    yield from _timed_phase(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield from _timed_phase(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    # The last test's teardown is also the session's: this worker's servers (a Prefect server's, moto's,
    # the warm launcher's whole lives) are stopped and reaped in it, and counted apart (SESSION).
    yield from _timed_phase(item, "teardown" if nextitem is not None else "session")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase's duration and CPU time to its module's totals (under xdist the controller sees
    every report)."""
    stem = Path(report.nodeid.split("::", 1)[0]).stem
    properties = dict(report.user_properties)
    if report.when == "teardown" and f"{CPU_PROPERTY}:session" in properties:
        stem = nodeid = SESSION  # a worker's last teardown: its session's servers, not its last test's
        cpu = properties[f"{CPU_PROPERTY}:session"]
    else:
        nodeid, cpu = report.nodeid, properties.get(f"{CPU_PROPERTY}:{report.when}", 0.0)
    _module_seconds[stem] = _module_seconds.get(stem, 0.0) + report.duration
    _module_cpu[stem] = _module_cpu.get(stem, 0.0) + cpu
    _test_cpu[nodeid] = _test_cpu.get(nodeid, 0.0) + cpu


def _report_module_times(terminalreporter) -> None:
    """Print each module's seconds, slowest first; where ANDREA_MODULE_TIMES names a file, merge them
    into it (the modules that did not run keep their last figure)."""
    if not _module_seconds or hasattr(terminalreporter.config, "workerinput"):
        return
    terminalreporter.write_sep("-", "seconds a module (setup, tests, teardown), slowest first")
    # The suite keeps both cores busy: its wall time follows the CPU time it spends, so both are shown
    # (CPU: the module's process and the processes it reaped; one left to init is not counted).
    terminalreporter.write_line(f"{'wall':>8}  {'CPU':>8}  module")
    ranked = sorted(_module_seconds.items(), key=lambda kv: -kv[1])
    for stem, seconds in ranked:
        terminalreporter.write_line(f"{seconds:8.1f}  {_module_cpu.get(stem, 0.0):8.1f}  {stem}")
    walls, cpus = sum(_module_seconds.values()), sum(_module_cpu.values())
    terminalreporter.write_line(f"{walls:8.1f}  {cpus:8.1f}  in all (the workers together)")
    # Each test's CPU seconds: a module fixture's set-up counts for the test that first needed it; the
    # session's servers (a Prefect server's, moto's, the warm launcher's whole lives), stopped and reaped
    # in the teardown of each worker's last test, count under SESSION.
    by_test = sorted(_test_cpu.items(), key=lambda kv: -kv[1])
    out = REPO / "test-output" / "test-cpu.txt"
    out.parent.mkdir(exist_ok=True)
    out.write_text("".join(f"{cpu:8.1f}  {nodeid}\n" for nodeid, cpu in by_test))
    terminalreporter.write_line(f"each test's CPU seconds, most first: {out.relative_to(REPO)}")
    target = os.environ.get("ANDREA_MODULE_TIMES")
    if target:
        ran = {k: round(v, 1) for k, v in _module_seconds.items() if k != SESSION}
        merged = read_module_times(Path(target)) | ran
        lines = [f"{stem} {merged[stem]}" for stem in sorted(merged, key=lambda k: -merged[k])]
        header = "# seconds a test module, slowest first: written by scripts/test.sh (tests/conftest.py)\n"
        Path(target).write_text(header + "\n".join(lines) + "\n")


# The modules whose tests use the worker's Prefect server (the prefect_server fixture, directly or
# through another): one work unit, so that one worker starts the one server of the session and creates
# the deployments once (REUSE_DEPLOYMENTS), where three workers each started one (8.7 CPU-s to healthy,
# 1.3 CPU-s a minute idle) and deployed to it. The collection fails naming a module missing here.
PREFECT_SERVER_MODULES = frozenset(
    {
        "test_prefect_flows",
        "test_prefect_dashboard",
        "test_cli_pivot_fork",
        "test_audit_fork_flow",
        "test_pivot_checks",
        "test_train_flow_cancel",
        "test_train_settings",
    }
)
PREFECT_SERVER_UNIT = "(the modules of the Prefect server)"


def work_unit(nodeid: str) -> str:
    """The work unit a test goes out in: its module's file, or PREFECT_SERVER_UNIT for those modules."""
    path = nodeid.split("::", 1)[0]
    return PREFECT_SERVER_UNIT if Path(path).stem in PREFECT_SERVER_MODULES else path


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadfile (scripts/test.sh) with the Prefect server's modules as one unit (work_unit)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class PrefectServerModulesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return PrefectServerModulesTogether(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: in-module order kept
    unlisted = sorted(
        {i.path.stem for i in items if "prefect_server" in i.fixturenames} - PREFECT_SERVER_MODULES
    )
    if unlisted:
        raise pytest.UsageError(
            f"tests/conftest.py: PREFECT_SERVER_MODULES misses {', '.join(unlisted)}, whose tests use "
            "the prefect_server fixture: add them (else a worker of their own starts a second server)"
        )
