"""The Prefect layer end to end: a real local Prefect server (this test worker's, tests/prefect_ephemeral.py:
127.0.0.1, a free port, PREFECT_HOME in a temporary folder) and a process worker started here, the
repository's prefect.yaml deployed with `prefect deploy --all`, real trainer processes, and the UI in
headless Chromium.

The tests share one server and "live" run and build on each other in file order, like an operator's
day: train, audit-fork the live run, refuse a busy GPU, cancel, lose a worker and a flow-run process;
while the server notices that loss (a minute: its lease and heartbeat windows), the work goes on with a
second worker: train again and pivot; then the tests that need no worker: the UI, refusals at
submission, a pivot called in this process. Figures (server start,
flow durations, cancellation to checkpoint) are written to test-output/prefect/timings.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from uuid import UUID

import httpx
import pytest
import torch

from andrea_core.checkpoint import checkpoint_name, restore
from andrea_core.config import ConfigError
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import load_policy
from andrea_core.data.tokens import run_tokenizer
from andrea_core.model.gpt import GPT
from andrea_core.ops.fork import BRANCH_NAME_SCHEMA
from andrea_core.ops.supervise import LossLogSnapshot, TrainerProcess, wait_for_first_entry_after
from andrea_core.run.lock import LockError, live_trainer
from andrea_core.run.loss_log import parse_lines, read_history
from andrea_core.run.record import read_run
from andrea_core.run.rundir import ARCHIVE, FORKS, LOSS_LOG, POLICY_YAML, SAMPLES, STATE, RunDir
from andrea_core.run.samples import read_audits
from andrea_core.train.optim import build_optimizer, lr_at
from andrea_core.train.trainer import step_seed
from tasks.artifacts import run_key, run_name
from tests.browser import Chromium, chromium_path
from tests.conftest import REPO, last_logged_step, library_run, wait_for
from tests.prefect_ephemeral import PrefectServer
from tests.tiny import tiny_config

pytestmark = pytest.mark.slow

PREFECT = str(Path(sys.executable).parent / "prefect")
OUT = REPO / "test-output" / "prefect"
LIVE_PACE = 0.1  # 10 steps/s at most: a checkpoint every 10 s, little CPU on a small machine
TIMINGS: dict[str, float] = {}
CRASH_AFTER_S = 60
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
# How often a wait asks the Prefect API (or parses the whole .loss.json): 4 times a second, not
# conftest.wait_for's 50. At 50 a minute's wait for a lease was 3,000 requests: the server's CPU, taken
# from the trainers and flow runs of both test workers on a 2-core machine.
API_POLL_S = 0.25
# A wait that lasts a minute or more by design (an audit fork's six trainers, a pivot's stop and resume,
# a GPU slot's lease running out): once a second. Its end is seen up to a second late; it asks the
# server a quarter as often as API_POLL_S (each request some milliseconds of the server's CPU and the
# client's: tests/test_prefect_flows.py's figures in the commit that set this).
LONG_POLL_S = 1.0


def _timed(name: str, value: float) -> None:
    TIMINGS[name] = round(value, 1) if name.endswith("(s)") else float(f"{value:.3g}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "timings.json").write_text(json.dumps(TIMINGS, indent=1) + "\n")


class Stack:
    """The server (this test worker's), this module's worker and what the tests share."""

    def __init__(self, server: PrefectServer, module: str):
        self.home = server.home
        self.api = server.api
        self.ui = server.ui
        self.worker_name = f"andrea-test-{module}"  # another module's worker may still show ONLINE
        self.env = {
            **server.env(),
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            # The crash automation's window, 90 s for an operator: 60 here (heartbeats come every 30 s).
            "ANDREA_CRASH_AFTER_S": str(CRASH_AFTER_S),
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            "PYTHONUNBUFFERED": "1",
        }
        self.worker: subprocess.Popen | None = None
        self.live: dict = {}  # run dir and flow run of the trainer the tests share
        self.cancelled: list[UUID] = []  # flow runs cancelled: the crash automation must leave them alone
        self.crashed: dict = {}  # the train flow run whose process was killed, its trainer's last step
        self.doomed: dict = {}  # run dir and flow run of the train run whose process will be killed
        self.setup_output = self.deploy_output = ""

    def cli(self, *args: str, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [PREFECT, "--no-prompt", *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"prefect {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def start_worker(self, name: str | None = None) -> None:
        """Start the worker's process (named `name`, from then on); wait_for_worker waits for it to come
        online."""
        self.worker_name = name or self.worker_name
        log = open(OUT / "worker.log", "ab")
        self.worker = subprocess.Popen(
            [PREFECT, "worker", "start", "--pool", "andrea", "--type", "process", "--name", self.worker_name],
            env=self.env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def wait_for_worker(self) -> None:
        with client() as c:
            wait_for(
                lambda: any(
                    w.name == self.worker_name and w.status.value == "ONLINE"
                    for w in c.read_workers_for_work_pool("andrea")
                ),
                timeout=120,
                what="the worker to come online",
                every=API_POLL_S,
            )

    def stop_worker(self) -> None:
        if self.worker and self.worker.poll() is None:
            self.worker.terminate()  # an idle worker needs a second SIGTERM
            try:
                self.worker.wait(5)
            except subprocess.TimeoutExpired:
                self.worker.terminate()
                try:
                    self.worker.wait(20)
                except subprocess.TimeoutExpired:
                    self.worker.kill()


def client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


@pytest.fixture(scope="module")
def stack(request, prefect_server, tmp_path_factory, token_cache_dir):
    """The server, set up (scripts/prefect_setup.py) and deployed (`prefect deploy --all`), and a worker
    of this module's own. A module whose REUSE_DEPLOYMENTS is true takes the setup and deployments an
    earlier module made on this worker's server, where one did (the same prefect.yaml and automations,
    the same ANDREA_CRASH_AFTER_S); this module always makes its own: its first test is about them."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    OUT.mkdir(parents=True, exist_ok=True)
    s = Stack(prefect_server, request.module.__name__.rsplit(".", 1)[-1])
    _timed("server start to healthy (s)", prefect_server.start_s)
    try:
        with temporary_settings(updates={PREFECT_API_URL: s.api, PREFECT_HOME: str(s.home)}):
            if getattr(request.module, "REUSE_DEPLOYMENTS", False) and prefect_server.deployed:
                s.setup_output = prefect_server.deployed["setup"]
                s.deploy_output = prefect_server.deployed["deploy"]
                s.start_worker()
                s.wait_for_worker()
            else:
                t0 = time.monotonic()
                setup = subprocess.run(
                    [sys.executable, "scripts/prefect_setup.py", "--gpus", "0"],
                    env=s.env,
                    cwd=REPO,
                    capture_output=True,
                    text=True,
                    timeout=180,
                )
                assert setup.returncode == 0, setup.stdout + setup.stderr
                s.setup_output = setup.stdout
                _timed("scripts/prefect_setup.py (s)", time.monotonic() - t0)
                # The worker's start (a cold `prefect` process) overlaps the deploy's: the pool exists.
                t0 = time.monotonic()
                s.start_worker()
                s.deploy_output = s.cli("deploy", "--all").stdout
                _timed("prefect deploy --all (s)", time.monotonic() - t0)
                s.wait_for_worker()
                _timed("worker start to online, from before the deploy (s)", time.monotonic() - t0)
                prefect_server.deployed.update(setup=s.setup_output, deploy=s.deploy_output)
            yield s
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=10)  # this process's flow runs' logs, under these settings
    finally:
        _stop_trainers(tmp_path_factory.getbasetemp())
        s.stop_worker()


def _stop_trainers(base: Path) -> None:
    """Leave no trainer behind: each one's flow run then ends on its own. Only real trainers are
    stopped: another test's lock that names a process that is no trainer (a test's own lock) is
    refused by the identity check and left alone."""
    for lock in base.glob("**/.trainer.json"):
        try:
            trainer = live_trainer(RunDir(lock.parent))
        except (LockError, ConfigError, OSError):
            # Another module's forged, huge or linked lock (the workers' base folders hold every module's
            # runs): refused by name, and no trainer of ours.
            continue
        if trainer is not None and trainer.why_not_our_trainer() is None:
            trainer.stop()


# --- helpers over the API ----------------------------------------------------------------------------


def start_deployment(name: str, **parameters) -> UUID:
    with client() as c:
        deployment = c.read_deployment_by_name(name)
        return c.create_flow_run_from_deployment(deployment.id, parameters=parameters).id


def wait_for_final(flow_run_id: UUID, timeout: float = 420, every: float = API_POLL_S):
    with client() as c:
        run = wait_for(
            lambda: (r := c.read_flow_run(flow_run_id)).state and r.state.type.value in FINAL and r,
            timeout=timeout,
            what=f"flow run {flow_run_id} to finish",
            every=every,
        )
    return run


def flow_run_logs(flow_run_id: UUID) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    where, logs = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), []
    with client() as c:
        while page := c.read_logs(where, limit=200, offset=len(logs)):  # the API's largest page
            logs += page
    return "\n".join(entry.message for entry in logs)


def task_runs_of(flow_run_id: UUID) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client() as c:
        return c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def assert_a_clean_cancel(flow_run_id: UUID, run: RunDir) -> str:
    """What the API shows of a cancelled `train` flow run: Cancelled; its trainer task Cancelled with
    the step and the checkpoint the trainer wrote (which is in the run directory, valid, of the last
    step trained); no task run Crashed; no "Crash detected" and no Crashed in the log, whose only ERROR
    line is Prefect's own "Finished in state Cancelled". Returns the log."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    run_state = wait_for_final(flow_run_id, timeout=180).state
    assert run_state.type.value == "CANCELLED", run_state
    stopped_at = read_history(run)[-1].step
    name = checkpoint_name(stopped_at)
    assert run.checkpoint_steps()[-1] == stopped_at and run.read_checkpoint(stopped_at).step == stopped_at
    # A task run's states reach the server as events (its task run recorder records them), and may land
    # after the flow run's final state, which the flow-run process sets through the API: waited for.
    tasks = wait_for(
        lambda: (t := task_runs_of(flow_run_id)) and all(x.state.type.value in FINAL for x in t) and t,
        timeout=60,
        what="the flow run's task runs to be final",
        every=API_POLL_S,
    )
    assert [t.state.type.value for t in tasks if t.state.type.value != "COMPLETED"] == ["CANCELLED"], [
        (t.name, t.state) for t in tasks
    ]
    (trainer,) = [t for t in tasks if t.name == f"trainer {run_name(run.url)}"]
    assert trainer.state.type.value == "CANCELLED", trainer.state
    said = f"cancelled from Prefect: {run.url}: trainer checkpointed at step {stopped_at} ({name})"
    said += " and stopped as asked ("
    assert trainer.state.message.startswith(said), trainer.state.message
    with client() as c:
        messages = [s.message or "" for s in c.read_flow_run_states(flow_run_id)]
        assert [m for m in messages if m.startswith(said)], messages  # the flow run's own Cancelled state

    def log_to_the_end() -> list:  # up to the flow run's closing line, the last its process sends
        where, logs = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), []
        with client() as c:
            while page := c.read_logs(where, limit=200, offset=len(logs)):
                logs += page
        return any(e.task_run_id is None and e.message.startswith("Finished in ") for e in logs) and logs

    logs = wait_for(log_to_the_end, timeout=60, what="the flow run's closing log line", every=API_POLL_S)
    text = "\n".join(e.message for e in logs)
    assert said in text and "Crash detected" not in text and "Crashed" not in text
    # The flow run's closing line says Cancelled (the engine's copy of the state: tasks/trainer.py).
    closing = [e.message for e in logs if e.task_run_id is None and e.message.startswith("Finished in ")]
    assert len(closing) == 1 and closing[0].startswith(f"Finished in state Cancelled('{said}"), closing
    errors = [e.message for e in logs if e.level >= 40]
    assert all(m.startswith("Finished in state Cancelled(") for m in errors), errors
    return text


def automation_firings(stack: Stack, name: str = "andrea-crash-silent-train-runs") -> list[str]:
    """The resources (flow runs) an automation fired for: its `prefect.automation.triggered` events."""
    with client() as c:
        (automation,) = c.read_automations_by_name(name)
    body = {
        "filter": {
            "event": {"name": ["prefect.automation.triggered"]},
            "resource": {"id": [f"prefect.automation.{automation.id}"]},
        },
        "limit": 50,
    }
    events = httpx.post(f"{stack.api}/events/filter", json=body, timeout=10).json()["events"]
    return [e["payload"]["triggering_labels"].get("prefect.resource.id") for e in events]


def artifact(key: str):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with client() as c:
        found = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert found, f"no artifact with key {key!r}"
    return max(found, key=lambda a: a.created)


def files_of(run: RunDir) -> dict[str, str]:
    root = Path(run.url)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def ensure_live_train(stack: Stack, run: RunDir) -> dict:
    """A `train` deployment run of `run` whose trainer is live, past its first checkpoint and has logged
    a step of its own (.loss.json read from then on holds its segment)."""
    trainer = live_trainer(run)
    if trainer is None or not stack.live.get("flow_run_id"):
        at = last_logged_step(run)
        params = {"run_dir": run.url, "max_steps": 100_000, "pace": LIVE_PACE, "gpu_slot": "test-gpu"}
        if not run.exists("run.yaml"):
            params["config"] = tiny_config(Path(run.url).parent)
        t0 = time.monotonic()
        flow_run_id = start_deployment("train/train", **params)
        wait_for(lambda: live_trainer(run), timeout=300, what="the trainer of the train flow run")
        _timed("train flow run: created to trainer live (s)", time.monotonic() - t0)
        stack.live = {"run": run, "flow_run_id": flow_run_id}
        wait_for(lambda: last_logged_step(run) > at, timeout=300, what="its first step", every=API_POLL_S)
    wait_for(lambda: run.checkpoint_steps(), timeout=300, what="a first checkpoint")
    return stack.live


@pytest.fixture(scope="module")
def live_run(stack, tmp_path_factory) -> RunDir:
    """andrea-tiny at step 100, copied from the library (conftest.library_run): the train deployment
    resumes it. Creating a run through the deployment is test_prefect_dashboard's."""
    return RunDir(library_run(tmp_path_factory, tmp_path_factory.mktemp("runs") / "live", 100))


DOOMED_SLOT = "test-gpu-doomed"  # its own GPU slot: its lease runs out while test-gpu's is asserted free


@pytest.fixture(scope="module")
def doomed_run(stack, tmp_path_factory) -> RunDir:
    """Another copy of andrea-tiny at step 100: the run whose train flow-run process
    test_a_killed_flow_run_process_leaves_its_trainer_to_stop_with_a_checkpoint kills."""
    return RunDir(library_run(tmp_path_factory, tmp_path_factory.mktemp("runs") / "doomed", 100))


def start_doomed_train(stack: Stack, run: RunDir) -> dict:
    """The `train` deployment run of `run` (on DOOMED_SLOT) whose process the kill test kills, created
    once. The cancel test creates it as soon as its cancelled run is Cancelled (no heartbeat of that
    run comes after: the crash test's premise), so that its flow-run process and trainer (cold starts:
    half a minute on a loaded machine) start while the cancel test reads the API, not in the kill test."""
    if not stack.doomed:
        params = {"run_dir": run.url, "max_steps": 100_000, "pace": LIVE_PACE, "gpu_slot": DOOMED_SLOT}
        stack.doomed = {"run": run, "flow_run_id": start_deployment("train/train", **params)}
    return stack.doomed


# --- the tests -----------------------------------------------------------------------------------


def test_prefect_deploy_all_creates_the_deployments(stack):
    assert "andrea-crash-silent-train-runs" in stack.setup_output
    for name in ("train/train", "pivot/pivot", "audit-fork/audit-fork"):
        assert name in stack.deploy_output
    with client() as c:
        pool = c.read_work_pool("andrea")
        assert pool.type == "process"
        train = c.read_deployment_by_name("train/train")
        assert train.entrypoint == "flows/train.py:train" and train.work_pool_name == "andrea"
        assert train.job_variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
        assert train.pull_steps[0]["prefect.deployments.steps.set_working_directory"]["directory"] == str(
            REPO
        )
        fork = c.read_deployment_by_name("audit-fork/audit-fork")
        (schedule,) = fork.schedules
        assert schedule.schedule.cron == "0 */6 * * *" and not schedule.active  # enabled per run (issue 26)
        assert fork.parameters["run_dir"] == "runs/andrea-12m" and len(fork.parameters["branches"]) == 2
        (automation,) = c.read_automations_by_name("andrea-crash-silent-train-runs")
        assert automation.enabled and automation.actions[0].type == "change-flow-run-state"
        assert automation.trigger.within.total_seconds() == CRASH_AFTER_S  # ANDREA_CRASH_AFTER_S
        assert f"No heartbeat for {CRASH_AFTER_S} s" in automation.actions[0].message


def test_prefect_setup_creates_gpu_limits_and_is_safe_to_run_twice(stack, monkeypatch):
    """The script's main, twice in this process (its run as a script, in its own process, is the stack
    fixture's, whose output test_prefect_deploy_all_creates_the_deployments reads): each a cold Python
    start with Prefect's import saved."""
    import contextlib
    import io
    import runpy

    monkeypatch.setenv("ANDREA_CRASH_AFTER_S", stack.env["ANDREA_CRASH_AFTER_S"])  # as stack.env has it
    setup = runpy.run_path(str(REPO / "scripts" / "prefect_setup.py"))  # not run as __main__
    outputs = []
    for _ in range(2):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert setup["main"](["--gpus", "1"]) == 0
        outputs.append(out.getvalue())
    assert "concurrency limit 'gpu-0': created (1 slot: one trainer per GPU)" in outputs[0]
    assert "concurrency limit 'gpu-0': exists (1 slot(s))" in outputs[1]
    for out in outputs:
        assert "work pool 'andrea': exists" in out and "'gpu-1'" not in out
        assert "automation 'andrea-crash-silent-train-runs': updated from automations/" in out
    with client() as c:
        limits = [x for x in c.read_global_concurrency_limits(limit=200) if x.name.startswith("gpu-")]
        assert [(x.name, x.limit, x.active_slots) for x in limits] == [("gpu-0", 1, 0)]
        assert len(c.read_automations_by_name("andrea-crash-silent-train-runs")) == 1


def test_audit_fork_of_a_live_run(stack, live_run):
    live = ensure_live_train(stack, live_run)
    trainer = live_trainer(live_run)
    # The parent trains on throughout: the fork races its checkpoint and sidecar writes.
    before = files_of(live_run)
    loss_before = live_run.read_bytes(LOSS_LOG)
    forks_before = live_run.read_bytes(FORKS) if live_run.exists(FORKS) else b""
    t0 = time.monotonic()
    flow_run_id = start_deployment(
        "audit-fork/audit-fork",
        run_dir=live_run.url,
        branches=[
            {"name": "base"},
            {"name": "frozen", "overrides": {"train.lr": 1e-9, "train.min_lr": 0.0}},
        ],
        steps=60,
        val_sequences=64,
    )
    run = wait_for_final(flow_run_id, every=LONG_POLL_S)
    _timed("audit-fork flow run: created to completed (s)", time.monotonic() - t0)
    after = files_of(live_run)
    assert run.state.type.value == "COMPLETED", run.state.message
    assert run.state.message.startswith("base converges best")

    # The parent: what it had is unchanged (its config, policy, checkpoints, the loss log a prefix of
    # itself); what it wrote meanwhile is its own training's, on its grid; forks.jsonl gained one line.
    every = read_run(live_run).config.train.checkpoint_every
    assert after["run.yaml"] == before["run.yaml"] and after[POLICY_YAML] == before[POLICY_YAML]
    for name in (k for k in before if re.fullmatch(r"step_\d+\.bin", k)):
        assert after.get(name, before[name]) == before[name], name  # or released by retention
    assert live_run.read_bytes(LOSS_LOG).startswith(loss_before)
    new_checkpoints = sorted(
        set(live_run.checkpoint_steps()) - {int(k[5:-4]) for k in before if k[5:-4].isdigit()}
    )
    assert all(s % every == 0 for s in new_checkpoints), (
        f"an off-grid checkpoint: signalled? {new_checkpoints}"
    )
    forks_after = live_run.read_bytes(FORKS)
    assert forks_after.startswith(forks_before)
    (record,) = [json.loads(line) for line in forks_after[len(forks_before) :].splitlines()]
    step = record["step"]
    assert step in live_run.checkpoint_steps(), "a fork point is never released by retention"
    assert step >= max(int(k[5:11]) for k in before if re.fullmatch(r"step_\d{6}\.bin", k))
    # The deployment's default: 3 replicates a branch (the verdict's training noise, ops/compare.py).
    assert record["names"] == ["base", "base.r1", "base.r2", "frozen", "frozen.r1", "frozen.r2"]
    # The trainer saw no signal: the same process trains on, and its log has no signal line.
    assert live_trainer(live_run) == trainer and trainer.is_alive()
    logs = flow_run_logs(live["flow_run_id"])
    assert "andrea: training steps" in logs and "SIGUSR1" not in logs and "SIGTERM" not in logs

    # The branches: lineage, their own training, the same checkpoint to start from.
    for name, url in zip(record["names"], record["branches"], strict=True):
        branch = RunDir(url)
        lineage = read_run(branch).lineage
        assert (
            lineage["parent"] == live_run.url
            and lineage["parent_step"] == step
            and lineage["branch"] == name.split(".r")[0]
        )
        assert branch.read_bytes(checkpoint_name(step)) == live_run.read_bytes(checkpoint_name(step))
        branch.read_checkpoint(step + 60)
    assert read_run(RunDir(record["branches"][3])).config.train.lr == 1e-9

    # The report and the plot, as artifacts and as files.
    report = artifact(run_key("audit-fork", live_run.url))
    assert report.type == "markdown"
    assert "**Winner: `base`**" in report.data and "base converges best" in report.data
    assert "](data:image/png;base64,iVBORw0KGgo" in report.data
    plot = artifact(run_key("audit-fork", live_run.url) + "-plot")
    assert plot.type == "image" and plot.data.startswith("data:image/png;base64,")
    folder = Path(f"{live_run.url}-fork{step}-report")
    assert (folder / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "**Winner: `base`**" in (folder / "report.md").read_text()
    assert trainer.is_alive(), "the parent trainer trains on"
    assert last_logged_step(live_run) > max(step, 0), "and its steps go on"


def test_audit_fork_refuses_a_busy_gpu(stack, live_run):
    """The live trainer holds the "test-gpu" slot: an audit fork on that GPU waits, then fails clearly
    (it never shares the GPU), before it has written anything. The flow is called in this process
    against the server that holds the slot (the slot is the server's; a deployment run's start, a
    flow-run process, is test_audit_fork_of_a_live_run's)."""
    from flows.audit_fork import audit_fork

    ensure_live_train(stack, live_run)
    with client() as c:
        limit = c.read_global_concurrency_limit_by_name("test-gpu")
        assert limit.limit == 1 and limit.active_slots == 1
    forks_before = live_run.read_bytes(FORKS)
    state = audit_fork(
        live_run.url,
        branches=[{"name": "a"}, {"name": "b", "overrides": {"train.lr": 1e-3}}],
        steps=10,
        gpu_slot="test-gpu",
        slot_timeout_s=1,
        return_state=True,
    )
    assert state.type.value == "FAILED"
    assert "GpuBusy: concurrency slot 'test-gpu' stayed taken for 1s" in state.message
    assert live_run.read_bytes(FORKS) == forks_before
    assert not list(Path(live_run.url).parent.glob("live-fork*-a"))


def _running_train_runs(c, run: RunDir):
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterState

    runs = c.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=["train"])),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type={"any_": ["RUNNING"]})),
    )
    return [r for r in runs if r.parameters.get("run_dir") == run.url]


def expected_losses(run, boundary, policy, steps, ckpt, zero_moments=False) -> list[float]:
    """Replay the trainer's first `steps` steps after `boundary` in this process, from the checkpoint
    alone: its weights and Adam moments, a fresh bandit, batches as a pure function of (seed, step)."""
    cfg = read_run(run).config
    torch.set_num_threads(cfg.train.num_threads)
    model = GPT(cfg.model)
    optimizer = build_optimizer(model, cfg.train, "cpu")
    restore(ckpt, model, optimizer)
    if zero_moments:
        for state in optimizer.state.values():
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
    data = DataPipeline(cfg, policy, tokenizer=run_tokenizer(run, cfg))  # a fresh bandit
    losses, previous = [], None
    for step in range(boundary + 1, boundary + 1 + steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.train)
        batch = data.batch(step)
        torch.manual_seed(step_seed(cfg.train.seed, step))
        _, loss = model(batch.x, batch.y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if previous is not None:  # the bandit hears of a step's loss one step late, as in the trainer
            data.observe(*previous)
        previous = (step, batch.arm, loss.item())
        losses.append(loss.item())
    return losses


def progress_artifact(flow_run_id: UUID):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    where = ArtifactFilter(
        type=ArtifactFilterType(any_=["progress"]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
    )
    with client() as c:
        found = c.read_artifacts(artifact_filter=where)
    return found[0] if len(found) == 1 else None


def test_cancelling_a_train_run_leaves_a_checkpoint_of_the_step_in_flight(stack, live_run, doomed_run):
    live = ensure_live_train(stack, live_run)
    trainer = live_trainer(live_run)
    # The run's progress bar: one progress artifact, step of total, following the trainer.
    at = last_logged_step(live_run)
    bar = wait_for(
        lambda: (
            (a := progress_artifact(live["flow_run_id"]))
            and int(re.search(r"step (\d+) of", a.description)[1]) > at
            and a
        ),
        timeout=60,
        what="the progress artifact to pass the trainer's current step",
        every=API_POLL_S,
    )
    step = int(
        re.search(r"step (\d+) of 100000 - loss ", bar.description)[1]
    )  # loss, tokens/s, ETA: issue 26
    assert (
        bar.description.replace("\\", "").startswith(f"{live_run.url}: step {step} of 100000")
        and bar.data == 100.0 * step / 100_000
    )
    t0 = time.monotonic()
    cancel_wall = time.time()
    # The UI's Cancel, its very request (prefect/server/ui: setFlowRunState, {type: cancelling, name:
    # Cancelling}, force): what `prefect flow-run cancel` (test_prefect_dashboard) sends too.
    set_state = {"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True}
    reply = httpx.post(f"{stack.api}/flow_runs/{live['flow_run_id']}/set_state", json=set_state, timeout=30)
    assert reply.status_code == 201 and reply.json()["status"] == "ACCEPT", reply.text
    stack.cancelled.append(live["flow_run_id"])
    wait_for(lambda: not trainer.is_alive(), timeout=60, what="the trainer to exit")
    exited_wall = time.time()
    run = wait_for_final(live["flow_run_id"], timeout=120)
    _timed("cancel: API call to Cancelled state (s)", time.monotonic() - t0)
    assert run.state.type.value == "CANCELLED"
    start_doomed_train(stack, doomed_run)  # the kill test's run starts while this test reads the API

    # Cancelled, its trainer task Cancelled naming the checkpoint, no Crashed task, no "Crash detected".
    logs = assert_a_clean_cancel(live["flow_run_id"], live_run)
    stopped_at = read_history(live_run)[-1].step
    name = checkpoint_name(stopped_at)
    written = os.stat(live_run.path(name)).st_mtime
    with client() as c:
        states = c.read_flow_run_states(live["flow_run_id"])
    cancelling = next(s.timestamp for s in states if s.type.value == "CANCELLING").timestamp()
    _timed("cancel: Cancelling state to checkpoint durable (s)", written - cancelling)
    _timed("cancel: API call to checkpoint durable (s)", written - cancel_wall)
    assert f"andrea: SIGTERM: stopped at step {stopped_at}, checkpoint {name}" in logs
    every = read_run(live_run).config.train.checkpoint_every
    during = f"andrea: SIGTERM during step {stopped_at}'s checkpoint: exiting with it"
    if f"andrea: SIGTERM: checkpointing step {stopped_at}, then exiting" in logs or stopped_at % every:
        # Seen at a step's end: the step in flight is checkpointed after the signal (off the grid, it can
        # only be that: its log line may reach the API late).
        assert during not in logs
        assert 0 < written - cancelling < 30, "durable well inside the worker's 30 s before SIGKILL"
    else:
        # The SIGTERM came while the trainer wrote or audited the checkpoint of a grid step it had just
        # taken: that step was the one in flight (docs/design.md "Signals"). Its write began before the
        # signal and runs in the background, so it may be durable before the Cancelling state or just
        # after it (17 ms after, once, 2026-12-07); the trainer says which way it went, finishes the
        # audit, and exits with that checkpoint and nothing newer.
        assert stopped_at % every == 0 and during in logs, (stopped_at, written - cancelling)
        assert stopped_at in [a["step"] for a in read_audits(live_run)], "the audit in flight was finished"
        assert written - cancelling < 30 and 0 < exited_wall - cancelling < 30, "well inside the 30 s"
    with client() as c:
        wait_for(
            lambda: c.read_global_concurrency_limit_by_name("test-gpu").active_slots == 0,
            timeout=30,
            what="the GPU slot to be released",
            every=API_POLL_S,
        )
    status = artifact(run_key("trainer", live_run.url))
    assert f"| step | {stopped_at} |" in status.data and "| reason | SIGTERM |" in status.data
    assert "| ended | cancelled |" in status.data
    # When and by which flow run: a later SIGKILL of a flow-run process would leave this one stale.
    # The flow run's name and id, escaped as every input in an artifact is: train-live \(ID\).
    assert f"\\({live['flow_run_id']}\\) |" in status.data and "| written | 20" in status.data
    stack.live = {}


def test_a_killed_flow_run_process_leaves_its_trainer_to_stop_with_a_checkpoint(stack, doomed_run):
    """Worker and flow-run process killed outright: the trainer stops itself with a checkpoint
    (parent-death SIGTERM). What the server makes of the silent run (the lease of its GPU slot runs
    out, the automation marks it Crashed: a minute at least) is checked by
    test_a_dead_train_flow_run_is_marked_crashed_and_a_new_run_resumes, last in the module: the tests
    between it and this one run in that minute instead of a wait, the pivot's deployment runs on a
    second worker this one starts (another name: the killed one stays listed ONLINE, the server's
    foreman being off). Its train flow run is doomed_run's, created by an earlier test
    (start_doomed_train)."""
    live = start_doomed_train(stack, doomed_run)
    trainer = wait_for(
        lambda: live_trainer(doomed_run), timeout=300, what="the trainer of the train flow run"
    )
    wait_for(lambda: doomed_run.checkpoint_steps(), timeout=300, what="a first checkpoint")
    flow_process = int(Path(f"/proc/{trainer.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    # A train flow run's process never loads torch (its trainer does): tasks/artifacts.py's lazy import.
    maps = Path(f"/proc/{flow_process}/maps").read_text()
    assert "libtorch" not in maps and "libc10" not in maps, "the train flow-run process loaded torch"
    wait_for(
        lambda: _heartbeats(stack, live["flow_run_id"]),
        timeout=120,
        what="a first heartbeat",
        every=API_POLL_S,
    )
    stack.worker.kill()
    stack.worker.wait()
    os.kill(flow_process, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: not trainer.is_alive(), timeout=60, what="the orphaned trainer to stop")
    stopped_at = read_history(doomed_run)[-1].step
    assert doomed_run.checkpoint_steps()[-1] == stopped_at
    doomed_run.read_checkpoint(stopped_at)
    stack.crashed = {"flow_run_id": live["flow_run_id"], "stopped_at": stopped_at, "killed": killed}
    stack.start_worker(f"{stack.worker_name}-2")  # online by the time the pivot's runs are picked up


def test_pivot_of_a_live_run(stack, live_run):
    """A pivot of the live run, resumed after the cancel by a new train run on the second worker, while
    the server notices the killed flow run."""
    live = ensure_live_train(stack, live_run)
    old_trainer = live_trainer(live_run)
    old_policy = live_run.read_bytes(POLICY_YAML)
    # The sidecars of the closing phase, the trainer's own: its bandit's .state.json (written with each
    # checkpoint, before it) and its audit's .samples.json (step 0's, before the first step).
    assert live_run.exists(SAMPLES) and live_run.exists(STATE), live_run.listdir("")
    old_hash = json.loads(live_run.read_bytes(STATE))["policy_hash"]
    assert old_hash == load_policy("stdlib-only")[0].hash
    loss_before = live_run.read_bytes(LOSS_LOG)
    new_policy, new_policy_text = load_policy("polish")

    t0 = time.monotonic()
    # Through the API: `prefect deployment run` (a cold process) is the refusal test's.
    pivot_id = start_deployment(
        "pivot/pivot", run_dir=live_run.url, policy="polish", max_steps=100000, pace=LIVE_PACE,
        gpu_slot="test-gpu",
    )  # fmt: skip
    run = wait_for_final(pivot_id, every=LONG_POLL_S)
    _timed(
        "pivot flow run (created to completed, incl. the resumed trainer's first step) (s)",
        time.monotonic() - t0,
    )
    assert run.state.type.value == "COMPLETED", run.state.message
    boundary = int(re.search(r"at step_(\d+)\.bin", run.state.message).group(1))
    every = read_run(live_run).config.train.checkpoint_every
    assert boundary % every == 0

    # The boundary checkpoint is the newest of the old phase left in place; the tail went to the archive.
    ckpt = live_run.read_checkpoint(boundary)
    (folder,) = [f for f in live_run.listdir(ARCHIVE) if f.endswith(f"_step_{boundary:06d}")]
    archive = RunDir(live_run.path(f"{ARCHIVE}/{folder}"))
    assert archive.read_bytes(POLICY_YAML) == old_policy
    archived = json.loads(archive.read_bytes(STATE))  # the old phase's bandit, as the trainer left it
    assert archived["policy_hash"] == old_hash and archived["step"] >= boundary
    assert read_audits(archive), "the old phase's audits were not archived"
    assert all(s > boundary for s in archive.checkpoint_steps())
    assert "SIGTERM" in flow_run_logs(live["flow_run_id"])

    # The new phase: the new policy, a new trainer, a fresh bandit, .loss.json an untouched prefix.
    assert live_run.read_bytes(POLICY_YAML) == new_policy_text.encode()
    new_trainer = live_trainer(live_run)
    assert new_trainer is not None and new_trainer.pid != old_trainer.pid
    # The bandit of the new phase: fresh, of the new policy, nothing of the old phase kept. Its state
    # is written with the first checkpoint after the boundary.
    wait_for(lambda: live_run.exists(STATE), timeout=300, what="the new phase's first .state.json")
    state = json.loads(live_run.read_bytes(STATE))
    assert state["policy_hash"] == new_policy.hash != old_hash
    assert state["step"] > boundary and all(e["step"] > boundary for e in state.get("previous", []))
    wait_for(
        lambda: read_history(live_run)[-1].step >= boundary + 2,
        timeout=120,
        what="two new steps",
        every=API_POLL_S,
    )
    loss_now = live_run.read_bytes(LOSS_LOG)
    assert loss_now[: len(loss_before)] == loss_before
    appended, _ = parse_lines(loss_now[len(loss_before) :])
    old_segment = max(json.loads(line)["segment"] for line in loss_before.splitlines())
    new_entries = [e for e in appended if e["segment"] > old_segment]
    assert [e["step"] for e in new_entries[:2]] == [boundary + 1, boundary + 2]

    # The first losses are what the pivot checkpoint predicts: its weights give step boundary+1's loss,
    # and its Adam m and v (not fresh zeros) give step boundary+2's.
    # Bit for bit: the CPU at the run's thread count is deterministic (docs/design.md "Determinism").
    actual = [e["loss"] for e in new_entries[:2]]
    assert actual == expected_losses(live_run, boundary, new_policy, steps=2, ckpt=ckpt)
    # With m and v lost (zeros), the first loss is the same (weights alone set it), the second is not.
    zeroed = expected_losses(live_run, boundary, new_policy, steps=2, ckpt=ckpt, zero_moments=True)
    assert zeroed[0] == actual[0] and zeroed[1] != actual[1], "lost m and v show at the second step"
    _timed("pivot: second loss with m and v zeroed, relative change", abs(zeroed[1] / actual[1] - 1))

    # The resumed trainer is a `train` flow run of its own, a subflow of the pivot.
    with client() as c:
        resumed = _running_train_runs(c, live_run)
        assert len(resumed) == 1 and resumed[0].id != live["flow_run_id"]
        assert resumed[0].parent_task_run_id is not None
    stack.live = {"run": live_run, "flow_run_id": resumed[0].id}
    old = wait_for_final(live["flow_run_id"], timeout=60)
    assert old.state.type.value == "COMPLETED" and "stopped at step" in old.state.message
    # The live run's last test: its trainer stops (SIGTERM, identity-checked) as the pivot stopped the
    # old one, and trains no longer than the tests that need it.
    new_trainer.stop()
    stack.live = {}


def test_the_ui_shows_the_flow_runs_and_the_fork_report(stack, live_run):
    exe = chromium_path()
    assert exe, "chromium is not installed (scripts/test.sh installs it)"
    report = artifact(run_key("audit-fork", live_run.url))
    t0 = time.monotonic()
    with Chromium(exe) as browser:
        text = browser.open(f"{stack.ui}/runs", ["train-live", "pivot-live", "audit-fork-live"], timeout=120)
        browser.screenshot(OUT / "ui-runs.png")
        assert "Cancelled" in text and "Completed" in text
        text = browser.open(f"{stack.ui}/artifacts/artifact/{report.id}", ["Winner:", "base converges best"])
        wait_for(
            lambda: browser.evaluate(
                "[...document.images].some(i => i.src.startsWith('data:image/png') && i.naturalWidth > 0)"
            ),
            timeout=30,
            what="the report's embedded plot to render",
        )
        browser.screenshot(OUT / "ui-fork-report.png")
        assert f"Audit fork of {live_run.url}" in text and "held-out loss" in text
    _timed("UI check in headless chromium (s)", time.monotonic() - t0)
    assert (OUT / "ui-runs.png").stat().st_size > 10_000 and (
        OUT / "ui-fork-report.png"
    ).stat().st_size > 10_000


def test_audit_fork_bad_branches_are_refused_when_the_run_is_submitted(stack, tmp_path):
    """`branches` is a list of tasks.fork.Branch: the deployment's parameter schema describes its fields
    (the UI's form), and the server refuses a misspelled key or a bad branch name at submission, naming
    the field; no flow run is created. So does a pivot `at` outside its Literal."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with client() as c:
        schema = c.read_deployment_by_name("audit-fork/audit-fork").parameter_openapi_schema
    branches = schema["properties"]["branches"]
    assert branches["type"] == "array"
    branch = schema["definitions"][branches["items"]["$ref"].rsplit("/", 1)[1]]
    assert branch["type"] == "object" and branch["additionalProperties"] is False
    assert set(branch["properties"]) == {"name", "overrides", "url"} and branch["required"] == ["name"]
    assert branch["properties"]["name"]["pattern"] == BRANCH_NAME_SCHEMA
    assert branch["properties"]["overrides"]["type"] == "object"

    def runs_of(deployment: str) -> int:
        with client() as c:
            where = DeploymentFilter(name=DeploymentFilterName(any_=[deployment]))
            return len(c.read_flow_runs(deployment_filter=where))

    run_dir = str(tmp_path / "never-written")
    refused = {
        (
            "audit-fork/audit-fork",
            "branches",
            '[{"name": "a"}, {"name": "b", "overide": {"train.lr": 1e-3}}]',
        ): (
            "Validation failed for field 'branches[1]'. Failure reason: Additional properties are not "
            "allowed ('overide' was unexpected)"
        ),
        ("audit-fork/audit-fork", "branches", '[{"name": "a"}, {"name": "q/../../escaped"}]'): (
            "Validation failed for field 'branches[1].name'. Failure reason: 'q/../../escaped' does not "
            f"match '{BRANCH_NAME_SCHEMA}'"
        ),
        ("pivot/pivot", "at", "later"): (
            "Validation failed for field 'at'. Failure reason: 'later' is not one of ['boundary', 'now']"
        ),
    }
    before = {name: runs_of(name.split("/")[1]) for name in ("audit-fork/audit-fork", "pivot/pivot")}
    # The first as an operator submits it, `prefect deployment run` (a cold process: its exit status and
    # the server's refusal in its output); the others through the API, whose reply the CLI prints.
    for i, ((deployment, param, value), error) in enumerate(refused.items()):
        extra = {"policy": "polish"} if deployment == "pivot/pivot" else {}
        if i == 0:
            options = [a for k, v in extra.items() for a in ("--param", f"{k}={v}")]
            proc = stack.cli(
                "deployment", "run", deployment, "--param", f"run_dir={run_dir}", *options,
                "--param", f"{param}={value}", check=False,
            )  # fmt: skip
            output = " ".join((proc.stdout + proc.stderr).split())  # the console wraps long lines
            assert proc.returncode == 1, output
        else:
            from prefect.exceptions import PrefectHTTPStatusError

            parameters = {
                "run_dir": run_dir,
                **extra,
                param: json.loads(value) if param == "branches" else value,
            }
            with client() as c, pytest.raises(PrefectHTTPStatusError) as refusal:
                c.create_flow_run_from_deployment(
                    c.read_deployment_by_name(deployment).id, parameters=parameters
                )
            assert refusal.value.response.status_code == 409, refusal.value.response.text
            output = " ".join(refusal.value.response.json()["detail"].split())
        assert f"Error creating flow run: {error}" in output
    assert {name: runs_of(name.split("/")[1]) for name in before} == before
    assert not (tmp_path / "never-written").exists()


def test_pivot_in_process_refuses_a_bad_policy_then_pivots_now(stack, tmp_path):
    """The pivot flow called in this process (against the test server), on a trainer started here.
    A policy whose floors sum above 1 fails the pivot before the trainer is signalled or a file moves;
    then at="now" pivots at the checkpoint a SIGUSR1 asks for, off the grid, and with restart="none"
    leaves the run stopped under its new policy."""
    from flows.pivot import pivot

    run = RunDir(tmp_path / "run")
    trainer = TrainerProcess(run.url, config=tiny_config(tmp_path), max_steps=100_000, pace=LIVE_PACE).start()
    try:
        wait_for(lambda: run.exists(LOSS_LOG) and read_history(run), timeout=300, what="the first steps")
        bad = tmp_path / "bad-policy.yaml"
        bad.write_text(
            "name: bad\narms:\n  - {name: stdlib-code, kind: python-stdlib, floor: 0.7}\n"
            "  - {name: docs-prose, kind: prose, floor: 0.6}\n"
        )
        identity = live_trainer(run)
        policy_before, steps_before = run.read_bytes(POLICY_YAML), run.checkpoint_steps()
        at = last_logged_step(run)
        # at="now" would send SIGUSR1 first thing: the refusal must come before it.
        with pytest.raises(ConfigError, match=r"bad-policy\.yaml: infeasible policy: floors sum to 1\.3 > 1"):
            pivot(run.url, str(bad), at="now", restart="none")
        assert run.read_bytes(POLICY_YAML) == policy_before and not run.exists(ARCHIVE)
        wait_for(
            lambda: last_logged_step(run) >= at + 5, timeout=120, what="the trainer to train on", every=0.1
        )
        assert live_trainer(run) == identity and identity.is_alive()
        assert all(s % 100 == 0 for s in run.checkpoint_steps() if s not in steps_before), "no SIGUSR1"

        wait_for(
            lambda: 20 <= last_logged_step(run) % 100 < 50, timeout=120, what="a step off the grid", every=0.1
        )
        result = pivot(run.url, "polish", at="now", restart="none")
    finally:
        lines: list[str] = []
        outcome = trainer.stop(on_line=lines.append)  # all it printed: nobody read its output before
    boundary = result["boundary"]
    assert boundary % 100 != 0, "a checkpoint written on request, not one of the grid"
    # One SIGUSR1 in the trainer's whole life (the good pivot's), one SIGTERM (the pivot's stop).
    assert [x for x in lines if "SIGUSR1" in x] == [
        f"andrea: SIGUSR1: checkpoint of step {boundary} requested"
    ]
    assert len([x for x in lines if re.match(r"andrea: SIGTERM: stopped at step", x)]) == 1
    assert outcome.reason == "SIGTERM" and outcome.step >= boundary
    assert run.checkpoint_steps()[-1] == boundary
    assert run.read_bytes(POLICY_YAML) == load_policy("polish")[1].encode()
    assert live_trainer(run) is None
    archived = RunDir(result["archive"]["folder"])
    assert archived.read_bytes(POLICY_YAML) == load_policy(read_run(run).config.data.policy)[1].encode()
    assert all(s > boundary for s in archived.checkpoint_steps())


def test_a_dead_train_flow_run_is_marked_crashed_and_a_new_run_resumes(stack, doomed_run):
    """The flow run whose process test_a_killed_flow_run_process_leaves_its_trainer_to_stop_with_a_checkpoint
    killed: its GPU slot's lease runs out, the automation marks the silent run Crashed (and no cancelled
    one), a new run resumes from the trainer's last checkpoint. Last in the module."""
    assert stack.crashed, (
        "test_a_killed_flow_run_process_leaves_its_trainer_to_stop_with_a_checkpoint ran first"
    )
    live = {"flow_run_id": stack.crashed["flow_run_id"]}
    stopped_at, t0 = stack.crashed["stopped_at"], stack.crashed["killed"]
    assert read_history(doomed_run)[-1].step == stopped_at == doomed_run.checkpoint_steps()[-1]
    # Nobody renews the dead process's lease on the GPU slot: it runs out (60 s) and frees the slot.
    with client() as c:
        wait_for(
            lambda: c.read_global_concurrency_limit_by_name(DOOMED_SLOT).active_slots == 0,
            timeout=240,
            what="the dead flow run's GPU slot lease to run out",
            every=LONG_POLL_S,
        )
    # An upper bound: the module's tests in between ran first (the figure is at least the lease's 60 s).
    _timed("crash: flow-run process SIGKILL to GPU slot free (s)", time.monotonic() - t0)

    run = wait_for_final(live["flow_run_id"], timeout=300, every=LONG_POLL_S)
    _timed("crash: flow-run process SIGKILL to Crashed (s)", time.monotonic() - t0)
    assert run.state.type.value == "CRASHED" and f"No heartbeat for {CRASH_AFTER_S} s" in run.state.message
    # The automation fired for this run, and for no cancelled one: their windows opened at older
    # heartbeats and closed before this run's did, each with the run's Cancelled event in it.
    assert stack.cancelled, "the cancel test runs before this one (the module's order)"
    fired = wait_for(
        lambda: (f := automation_firings(stack)) and f"prefect.flow-run.{live['flow_run_id']}" in f and f,
        timeout=60,
        what="the crash automation's triggered event",
        every=API_POLL_S,
    )
    with client() as c:
        for cancelled in stack.cancelled:
            assert f"prefect.flow-run.{cancelled}" not in fired, fired
            assert c.read_flow_run(cancelled).state.type.value == "CANCELLED"
            assert _last_heartbeat(stack, cancelled) < _last_heartbeat(stack, live["flow_run_id"])

    # A later `train` run resumes from that checkpoint (called in this process: the worker is gone).
    from flows.train import train

    at_stop = LossLogSnapshot.take(doomed_run)
    outcome = train(doomed_run.url, max_steps=stopped_at + 3, gpu_slot=DOOMED_SLOT, slot_timeout_s=120)
    assert outcome["reason"] == "completed" and outcome["step"] == stopped_at + 3
    first = wait_for_first_entry_after(doomed_run, at_stop, timeout=1)
    assert first["step"] == stopped_at + 1, "the new run resumed from the dead run's last checkpoint"


def _last_heartbeat(stack: Stack, flow_run_id: UUID) -> datetime:
    beats = _heartbeats(stack, flow_run_id)  # the newest first
    assert beats, f"flow run {flow_run_id} sent no heartbeat"
    return max(datetime.fromisoformat(e["occurred"]) for e in beats)


def _heartbeats(stack: Stack, flow_run_id: UUID) -> list:
    body = {
        "filter": {
            "event": {"name": ["prefect.flow-run.heartbeat"]},
            "resource": {"id": [f"prefect.flow-run.{flow_run_id}"]},
        },
        "limit": 5,
    }
    return httpx.post(f"{stack.api}/events/filter", json=body, timeout=10).json().get("events", [])
