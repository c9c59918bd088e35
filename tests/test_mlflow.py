"""MLflow's view of a run (issue 46.2), against a real MLflow tracking server (`mlflow server` on
127.0.0.1 with its SQLite store, from the venv scripts/test.sh makes: .venv-mlflow, pinned in
tests/mlflow-server.txt), read back through MLflow's own client in that venv: after a SIGKILL and a
resume, a guard rollback, a pivot and a fork, the MLflow run's metric history is .loss.json's canonical
history, step for step and to the bit; a server that is down is one warning and training goes on."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import REPO, _env, andrea, last_logged_step, start_trainer, wait_for
from guard_parent import guard_parent_fixture  # noqa: F401 (the guard_parent fixture)
from tiny import tiny_config

from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir
from andrea_core.run.samples import read_audits
from andrea_core.train.mlflow_view import run_key

VENV = Path(os.environ.get("ANDREA_MLFLOW_VENV", REPO / ".venv-mlflow"))
PACE = "0.1"  # seconds per step at least: a SIGUSR1 and a SIGKILL land between checkpoints, and the
# checkpoint SIGUSR1 wrote reaches MLflow before checkpoint 400 (8 s or more on one thread)

# Everything the test reads back, through MLflow's own client (not this product's REST calls): one
# process of the server's venv for the module (importing mlflow takes seconds), answering each request
# line (a tracking URI and an experiment name, as JSON) with one line of JSON.
READ_BACK = """
import json, sys, traceback
from mlflow import MlflowClient
from mlflow.entities import ViewType
for request in sys.stdin:
    try:
        uri, name = json.loads(request)
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(name)
        ids = [experiment.experiment_id] if experiment else []
        out = []
        for r in client.search_runs(ids, run_view_type=ViewType.ALL) if ids else []:
            history = {
                key: [[m.step, m.value, m.timestamp] for m in client.get_metric_history(r.info.run_id, key)]
                for key in r.data.metrics
            }
            info = {"id": r.info.run_id, "stage": r.info.lifecycle_stage, "status": r.info.status}
            out.append({**info, "tags": r.data.tags, "history": history})
        print(json.dumps({"runs": out}), flush=True)
    except Exception:
        print(json.dumps({"error": traceback.format_exc()}), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tracking_server(root: Path, port: int | None = None) -> Iterator[Callable[[], str]]:
    """A real `mlflow server` on 127.0.0.1 with its SQLite store in `root`, started at once and stopped
    when the block ends; the block gets `ready()`, which waits until the server answers (the first
    call) and returns its URI. Its job runner is off (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false): a
    tracking store needs none, and it is seven huey consumers and a runner, each a process importing
    mlflow: at load 13 here the server was up in 88 s at 12.1 s of CPU with them (stopped in 31 s),
    58 s at 6.8 s without (stopped in 4 s)."""
    mlflow = VENV / "bin" / "mlflow"
    assert mlflow.exists(), f"{mlflow} is missing: scripts/test.sh makes it (tests/mlflow-server.txt)"
    port = port or free_port()
    log = open(root / "server.log", "wb")
    env = {**os.environ, "MLFLOW_TRACKING_URI": "", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(
        [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env,
    )  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    answered = []

    def up() -> bool:
        assert server.poll() is None, (root / "server.log").read_text()[-3000:]
        try:
            return httpx.get(f"{uri}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def ready() -> str:
        if not answered:
            wait_for(up, timeout=180, what="the MLflow server")
            # Its tracking API answers once before any trainer asks: the first call loads the store's
            # handlers (seconds on a loaded machine), which a trainer's first send, at its product
            # timeout (mlflow_view.TIMEOUT), would otherwise pay.
            search = f"{uri}/api/2.0/mlflow/experiments/search"
            searched = httpx.post(search, json={"max_results": 1}, timeout=180)
            assert searched.status_code == 200, searched.text
            answered.append(True)
        return uri

    try:
        yield ready
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture(scope="module", autouse=True)
def mlflow_server_starting(request, tmp_path_factory) -> Iterator[Callable[[], str] | None]:
    """The module's one real tracking server (SQLite store, bound to 127.0.0.1), started as the module
    starts, so that its start-up (a minute of a loaded machine) goes on while the tests that need no
    server run (they come first in this file), as does the reader's import of mlflow. None when no
    selected test of the module asks for the server."""
    wanted = any("mlflow_server" in item.fixturenames for item in request.session.items
                 if item.module is request.module)  # fmt: skip
    if not wanted:
        yield None
        return
    request.getfixturevalue("mlflow_reader")
    with tracking_server(tmp_path_factory.mktemp("mlflow-server")) as ready:
        yield ready


@pytest.fixture(scope="module")
def mlflow_server(mlflow_server_starting: Callable[[], str]) -> str:
    """The module's tracking server's URI, once it answers."""
    return mlflow_server_starting()


def env_for(uri: str, experiment: str, **extra: str) -> dict[str, str]:
    return {**_env(), "MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": experiment, **extra}


@pytest.fixture(scope="module")
def mlflow_reader() -> Iterator[subprocess.Popen]:
    """The module's reader (READ_BACK), a process of the server's venv, until the module ends."""
    reader = subprocess.Popen(
        [str(VENV / "bin" / "python"), "-c", READ_BACK],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    yield reader
    reader.stdin.close()
    try:
        reader.wait(timeout=30)
    except subprocess.TimeoutExpired:
        reader.kill()
        reader.wait()


def mlflow_runs(reader: subprocess.Popen, uri: str, experiment: str) -> list[dict]:
    """Every run of `experiment` on the server at `uri`, with its tags and each metric's history."""
    import select

    reader.stdin.write(json.dumps([uri, experiment]) + "\n")
    reader.stdin.flush()
    assert select.select([reader.stdout], [], [], 300)[0], "the MLflow reader did not answer in 300 s"
    line = reader.stdout.readline()
    assert line, f"the MLflow reader exited {reader.wait()} (its traceback above)"
    reply = json.loads(line)
    assert "error" not in reply, reply["error"]
    return reply["runs"]


def active(runs: list[dict]) -> list[dict]:
    return [r for r in runs if r["stage"] == "active"]


def assert_canonical(mlflow_run: dict, run: RunDir) -> None:
    """train/loss and train/lr are the canonical history, one value per step, to the bit; val_loss/ARM
    and audit/FIGURE are the audits .samples.json holds."""
    history = read_history(run)
    assert history
    for key, field in (("train/loss", "loss"), ("train/lr", "lr")):
        got = sorted((step, value) for step, value, _ in mlflow_run["history"][key])
        assert got == [(e.step, getattr(e, field)) for e in history], key
    # Every audit .samples.json holds (a pivot archives the closed phase's: MLflow keeps those too).
    audits = read_audits(run)
    assert audits
    for arm in audits[-1]["metrics"]["val_loss"]:
        got = dict(unique_steps(mlflow_run, f"val_loss/{arm}"))
        assert [got[a["step"]] for a in audits] == [a["metrics"]["val_loss"][arm] for a in audits]
    got = dict(unique_steps(mlflow_run, "audit/distinct_2"))
    assert [got[a["step"]] for a in audits] == [a["metrics"]["distinct_2"] for a in audits]


def unique_steps(mlflow_run: dict, key: str) -> list[tuple[int, float]]:
    """(step, value) of a metric's history, sorted; each step once."""
    got = sorted((step, value) for step, value, _ in mlflow_run["history"][key])
    assert len({s for s, _ in got}) == len(got), f"{key}: a step logged twice"
    return got


# First the tests that need no server: the module's server starts meanwhile (mlflow_server_starting).


def test_a_tracking_server_that_is_down_is_one_warning_and_training_completes(tmp_path):
    run_dir = tmp_path / "run"
    env = env_for(f"http://127.0.0.1:{free_port()}", "down")  # nothing listens there
    cfg = tiny_config(tmp_path, train__checkpoint_every=10)
    proc = andrea("train", "--config", cfg, "--run-dir", str(run_dir), "--max-steps", "30", "--device", "cpu",
                  env=env, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warned = [x for x in (proc.stdout + proc.stderr).splitlines() if "MLflow" in x]
    assert len(warned) == 1 and "andrea: warning: MLflow at http://127.0.0.1:" in warned[0], warned
    assert "training goes on" in warned[0] and "ConnectError" in warned[0]
    assert [e.step for e in read_history(RunDir(str(run_dir)))] == list(range(1, 31))
    assert RunDir(str(run_dir)).checkpoint_steps() == [10, 20, 30]


def test_mlflow_is_off_unless_configured(tmp_path, monkeypatch):
    """Without MLFLOW_TRACKING_URI (or with ANDREA_MLFLOW=0) a trainer imports no HTTP client."""
    from conftest import andrea_imports

    for name in [k for k in os.environ if k.startswith("MLFLOW_")]:
        monkeypatch.delenv(name)
    cfg = tiny_config(tmp_path, train__checkpoint_every=5)
    args = (
        "train",
        "--config",
        cfg,
        "--run-dir",
        str(tmp_path / "run"),
        "--max-steps",
        "5",
        "--device",
        "cpu",
    )
    assert andrea_imports("httpx", *args) is False
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("ANDREA_MLFLOW", "0")
    assert andrea_imports("httpx", *args[:-2], "--max-steps", "10", "--device", "cpu") is False


@pytest.mark.parametrize(
    "uri, problem",
    [
        ("file:///tmp/mlruns", "only an http(s):// tracking server"),
        ("sqlite:///mlflow.db", "only an http(s):// tracking server"),
        ("http://user:s3cret@", "no host"),
        ("http://user:s3cret@host:99999", "not a URL"),
        ("http://host/?token=1", "a query"),
    ],
)
def test_a_uri_that_is_not_a_tracking_server_is_one_warning_naming_it(uri, problem, tmp_path, monkeypatch):
    """A local mlruns folder or a database (MLflow's other stores) is not sent to: one warning, its
    password not shown, and the view is off."""
    from andrea_core.train.mlflow_view import _Off, open_view

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    said: list[str] = []
    view = open_view(RunDir(str(tmp_path)), 1, 1, [], log=said.append)
    assert isinstance(view, _Off)
    (line,) = said
    assert line.startswith("warning: MLFLOW_TRACKING_URI=") and problem in line and "s3cret" not in line


def test_a_killed_and_resumed_run_is_one_mlflow_run_whose_history_is_the_canonical_one(
    mlflow_server, mlflow_reader, guard_parent, tmp_path
):
    """A trained run (copied: the session's andrea-tiny to step 300 on one thread, checkpoints 100, 200,
    300, tests/guard_parent.py) trains on with MLflow on: its first start back-fills steps 1..300 from
    .loss.json; a SIGUSR1 checkpoint is sent; a SIGKILL after it loses the steps since (logged in
    .loss.json's segment, never sent); the resume trains them again and continues the same MLflow run."""
    run_dir = tmp_path / "run"
    shutil.copytree(guard_parent, run_dir)
    run = RunDir(str(run_dir))
    env = env_for(mlflow_server, "killed")
    proc = start_trainer("--run-dir", str(run_dir), "--max-steps", "400", "--pace", PACE, "--device", "cpu",
                         log=tmp_path / "a.log", env=env)  # fmt: skip
    wait_for(lambda: last_logged_step(run) >= 320, what="step 320")
    before = set(run.checkpoint_steps())
    proc.send_signal(signal.SIGUSR1)
    (usr1,) = wait_for(lambda: set(run.checkpoint_steps()) - before, what="the SIGUSR1 checkpoint")
    assert usr1 < 390

    def sent() -> int:  # the newest train/loss step the server holds (0: no run yet)
        # A wait's probe, not a timing assertion: httpx's default 5 s timeout failed it at load 21
        # (the server's one worker busy with a trainer's batch), so as long as the wait itself.
        reply = httpx.get(f"{mlflow_server}/api/2.0/mlflow/experiments/get-by-name",
                          params={"experiment_name": "killed"}, timeout=300).json()  # fmt: skip
        if "experiment" not in reply:
            return 0
        experiment = reply["experiment"]["experiment_id"]
        found = httpx.post(f"{mlflow_server}/api/2.0/mlflow/runs/search",
                           json={"experiment_ids": [experiment]}, timeout=300).json()  # fmt: skip
        runs = found.get("runs", [])
        assert len(runs) <= 1
        metrics = runs[0]["data"].get("metrics", []) if runs else []
        return max([m["step"] for m in metrics if m["key"] == "train/loss"] + [0])

    # Each probe is two requests to the server's one worker, which the trainer's sends wait behind:
    # every 0.5 s (wait_for's note on servers), not every 20 ms.
    wait_for(lambda: sent() == usr1, what=f"MLflow to hold step {usr1}", every=0.5)
    wait_for(lambda: last_logged_step(run) >= usr1 + 5, what="5 steps past the checkpoint")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = last_logged_step(run)
    assert usr1 + 5 <= killed_at < 400 and run.checkpoint_steps()[-1] == usr1
    assert sent() == usr1  # nothing past the newest checkpoint was sent

    out = andrea("train", "--run-dir", str(run_dir), "--device", "cpu", env=env)
    assert [x for x in (out.stdout + out.stderr).splitlines() if "MLflow" in x] == []
    history = read_history(run)
    assert len({e.segment for e in history}) >= 3  # the reference's, the killed start's, the resume's

    (mlflow_run,) = mlflow_runs(
        mlflow_reader, mlflow_server, "killed"
    )  # one MLflow run: continued, none superseded
    assert mlflow_run["stage"] == "active" and mlflow_run["status"] == "FINISHED"
    assert mlflow_run["tags"]["andrea.run"] == run.url
    assert mlflow_run["tags"]["andrea.run_key"] == run_key(run.url)
    assert mlflow_run["tags"]["andrea.phase"] == "1" and "mlflow.parentRunId" not in mlflow_run["tags"]
    assert len(mlflow_run["history"]["train/loss"]) == 400  # no step twice
    assert_canonical(mlflow_run, run)
    stamps = {step: t for step, _, t in mlflow_run["history"]["train/loss"]}
    # Steps 1..300 were back-filled from .loss.json, with their logged times; the steps trained again
    # after the kill are the resume's (logged after its segment's first line), not the killed start's.
    assert [stamps[e.step] for e in history[:300]] == [round(e.time * 1000) for e in history[:300]]
    resumed = min(e.time for e in history if e.segment == history[-1].segment)
    assert all(stamps[s] >= round(resumed * 1000) - 1 for s in range(usr1 + 1, killed_at + 1))


def test_after_a_guard_rollback_the_mlflow_run_is_the_canonical_history(
    mlflow_server, mlflow_reader, tmp_path
):
    """The batch at data position 25 poisons a step: the guard rolls back to checkpoint 10 while MLflow
    holds steps 1..20 of the abandoned timeline, which it cannot take back: the MLflow run is made again
    from the canonical history and the old one is tagged and put in MLflow's trash."""
    from test_guard import POISON, poisoned_config

    run_dir = tmp_path / "run"
    env = env_for(mlflow_server, "rollback", ANDREA_TEST_GUARD_NAN_AT=str(POISON))
    cfg = poisoned_config(tmp_path)
    # Steps 1..20 first (the MLflow run holds them when the trainer exits), then on: the poisoned step 25
    # rolls back to checkpoint 10, and 11..20 as MLflow holds them are an abandoned timeline.
    andrea(
        "train", "--config", cfg, "--run-dir", str(run_dir), "--max-steps", "20", "--device", "cpu", env=env
    )
    (first,) = active(mlflow_runs(mlflow_reader, mlflow_server, "rollback"))
    assert sorted(s for s, _, _ in first["history"]["train/loss"]) == list(range(1, 21))
    out = andrea("train", "--run-dir", str(run_dir), "--max-steps", "60", "--device", "cpu", env=env)
    run = RunDir(str(run_dir))
    assert [e.step for e in read_history(run)] == list(range(1, 61))
    assert any(
        json.loads(x)["action"] == "rollback" for x in (run_dir / "guard.jsonl").read_text().splitlines()
    )

    runs = mlflow_runs(mlflow_reader, mlflow_server, "rollback")
    (current,) = active(runs)
    (old,) = [r for r in runs if r["stage"] == "deleted"]
    assert old["id"] == first["id"]
    assert (
        old["tags"]["andrea.superseded_by"] == current["id"]
        and current["tags"]["andrea.supersedes"] == old["id"]
    )
    assert old["tags"]["andrea.superseded_at_step"] == "11"
    assert max(s for s, _, _ in old["history"]["train/loss"]) >= 11  # it held the abandoned steps
    assert f"MLflow: run {old['id']} held step" in out.stdout + out.stderr
    assert current["status"] == "FINISHED" and len(current["history"]["train/loss"]) == 60
    assert_canonical(current, run)
    # The abandoned timeline's losses differ from the canonical ones at the steps it shares with them.
    abandoned = {s: v for s, v, _ in old["history"]["train/loss"] if s > 10}
    canonical = {e.step: e.loss for e in read_history(run)}
    assert any(v != canonical[s] and not math.isnan(v) for s, v in abandoned.items())


def test_a_pivot_is_tagged_and_a_forks_branch_is_nested_under_its_parent(
    mlflow_server, mlflow_reader, tmp_path
):
    parent = tmp_path / "parent"
    env = env_for(mlflow_server, "lineage")
    cfg = tiny_config(tmp_path, train__checkpoint_every=10)
    andrea(
        "train", "--config", cfg, "--run-dir", str(parent), "--max-steps", "20", "--device", "cpu", env=env
    )
    andrea("pivot", str(parent), "--policy", "tiny-mix", "--no-restart", env=env)  # at step 20
    andrea("train", "--run-dir", str(parent), "--max-steps", "30", "--device", "cpu", env=env)
    out = andrea("fork", str(parent), "--step", "10", "--branch", "b", "--replicates", "1", env=env)
    (url,) = [line.split(": ", 1)[1] for line in out.stdout.strip().splitlines()]
    andrea("train", "--run-dir", url, "--max-steps", "25", "--device", "cpu", env=env)

    runs = active(mlflow_runs(mlflow_reader, mlflow_server, "lineage"))
    assert len(runs) == 2
    (p,) = [r for r in runs if r["tags"]["andrea.run"] == RunDir(str(parent)).url]
    (b,) = [r for r in runs if r["tags"]["andrea.run"] == RunDir(url).url]
    assert p["tags"]["andrea.phase"] == "2" and p["tags"]["andrea.phase_start"] == "20"
    assert p["tags"]["andrea.pivots"] == "1"
    assert_canonical(p, RunDir(str(parent)))
    assert b["tags"]["mlflow.parentRunId"] == p["id"]
    assert b["tags"]["andrea.parent"] == RunDir(str(parent)).url and b["tags"]["andrea.fork_step"] == "10"
    assert b["tags"]["andrea.branch"] == "b"
    # The branch's history is its .loss.json's: the parent's steps 1..10, then its own 11..25.
    branch_history = read_history(RunDir(url))
    assert [e.step for e in branch_history] == list(range(1, 26))
    got = sorted((s, v) for s, v, _ in b["history"]["train/loss"])
    assert got == [(e.step, e.loss) for e in branch_history]
    parents = {s: v for s, v, _ in p["history"]["train/loss"]}
    assert got[:10] == [(s, parents[s]) for s in range(1, 11)]


@contextlib.contextmanager
def forwarding(port: int, to: str) -> Iterator[None]:
    """127.0.0.1:`port` forwards to the server at `to` until the block ends: a tracking server that
    comes up at a chosen moment (a real `mlflow server` takes a minute to start on a loaded machine)."""
    import select
    import socketserver
    import threading

    target = ("127.0.0.1", int(to.rsplit(":", 1)[1]))

    class Pipe(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            with socket.create_connection(target) as upstream:
                ends = {self.request: upstream, upstream: self.request}
                while True:
                    ready, _, _ = select.select(list(ends), [], [], 30)
                    if not ready:
                        return
                    for end in ready:
                        data = end.recv(1 << 16)
                        if not data:
                            return
                        ends[end].sendall(data)

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    with socketserver.ThreadingTCPServer(("127.0.0.1", port), Pipe) as server:
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield
        finally:
            server.shutdown()


def test_a_server_that_comes_back_gets_every_step_at_the_next_checkpoint(
    mlflow_server, mlflow_reader, tmp_path
):
    """Down at the first checkpoints (one warning), up from a later one: the steps that waited in memory
    and those since are sent then, and the MLflow run is the canonical history, as if never down."""
    run_dir = tmp_path / "run"
    port = free_port()
    env = env_for(f"http://127.0.0.1:{port}", "back")
    cfg = tiny_config(tmp_path, train__checkpoint_every=10)
    proc = start_trainer("--config", cfg, "--run-dir", str(run_dir), "--max-steps", "60", "--pace", "0.2",
                         "--device", "cpu", log=tmp_path / "train.log", env=env)  # fmt: skip
    wait_for(lambda: "MLflow at" in (tmp_path / "train.log").read_text(), what="the warning")
    with forwarding(port, mlflow_server):
        assert last_logged_step(run_dir) < 50  # checkpoints 50 and 60 are still to come
        assert proc.wait(timeout=600) == 0
    (mlflow_run,) = mlflow_runs(mlflow_reader, mlflow_server, "back")
    out = (tmp_path / "train.log").read_text()
    warned = [x for x in out.splitlines() if "warning: MLflow" in x]
    assert len(warned) == 1 and "ConnectError" in warned[0], warned
    assert f"MLflow at http://127.0.0.1:{port}: sending again, run {mlflow_run['id']}" in out
    assert mlflow_run["status"] == "FINISHED" and len(mlflow_run["history"]["train/loss"]) == 60
    assert_canonical(mlflow_run, RunDir(str(run_dir)))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
