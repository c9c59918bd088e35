"""`pivot`: change a run's data policy mid-run without retraining (docs/design.md "Pivot sequence").

  1. take the pivot checkpoint: the next one on the grid (at="boundary") or one right now (at="now",
     SIGUSR1); with no trainer running, the newest valid checkpoint
  2. stop the trainer (SIGTERM) and wait for its exit
  3. archive .samples.json, .state.json, the old policy and any checkpoint past the pivot point
  4. leave .loss.json exactly as it is (checked byte for byte)
  5. install the new policy
  6. restart the trainer from the pivot checkpoint (full weights, Adam m and v, a fresh bandit) as a new
     `train` flow run, and confirm its first step is pivot+1 with the old history an untouched prefix

A bad policy, a policy the trainer would refuse on this machine's data, a device that is not here, a
max_steps not beyond the pivot point or a train deployment that does not exist are refused before step 1:
nothing is touched. From step 1 until the new policy is installed, pivot.json records the pivot under
way, so that retention never deletes its checkpoint; it is also the pivot's journal (andrea_core.ops.pivot):
rerunning the same pivot after a crash at any step completes it exactly once. A resumed trainer that
dies before its first step is reported at once, with its error. The driver is andrea_core.ops.pivot's
run_pivot, the one `andrea pivot` runs in a shell: this flow gives it its tasks (tasks/pivot.as_task)
and its way of restarting the trainer (a `train` deployment run or subflow)."""

from __future__ import annotations

from typing import Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.deployments import run_deployment
from prefect.states import Completed, State

from andrea_core.ops import pivot as driver
from andrea_core.run.rundir import RunDir
from flows._background import start_subflow
from flows.train import train
from tasks.artifacts import run_name
from tasks.pivot import as_task, check_new_policy, flow_run_ended, subflow_ended


@task(name="restart-trainer", cache_policy=NO_CACHE)
def restart_trainer(deployment: str, parameters: dict) -> dict:
    """Step 6: the resumed trainer as a new run of the `train` deployment, so that the UI keeps showing
    the run under its own flow run (linked to this pivot as its subflow)."""
    started = run_deployment(name=deployment, parameters=parameters, timeout=0)
    get_run_logger().info(f"resumed trainer: flow run {started.name!r} ({started.id}) of {deployment}")
    return {"flow_run_id": str(started.id), "flow_run_name": started.name}


def _restart(how: str, train_deployment: str, pace: float, gpu_slot: str | None) -> driver.Restart | None:
    """The flow's way of starting the resumed trainer, with the options the driver gives it."""
    if how == "none":
        return None

    def start(run: RunDir, options: dict) -> driver.Resumed:
        params = {
            "run_dir": run.url,
            "max_steps": options["max_steps"],
            "device": options["device"],
            "pace": pace,
            "gpu_slot": gpu_slot,
            # A torchrun job resumes at the world size it was stopped at.
            "nproc_per_node": options.get("nproc_per_node", 1),
        }
        if how == "deployment":
            started = restart_trainer(train_deployment, params)
            return driver.Resumed(started, flow_run_ended(started["flow_run_id"]))
        background = start_subflow(train, **params)
        return driver.Resumed({"subflow": "train"}, subflow_ended(background), background.result)

    return driver.Restart(how, start)


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    return f"pivot-{run_name(flow_run.parameters['run_dir'])}"


@flow(name="pivot", flow_run_name=_flow_run_name)
def pivot(
    run_dir: str,
    policy: str,
    at: Literal["boundary", "now"] = "boundary",
    restart: Literal["deployment", "subflow", "none"] = "deployment",
    max_steps: int | None = None,
    device: str = "auto",
    pace: float = 0.0,
    gpu_slot: str | None = "auto",
    train_deployment: str = "train/train",
    timeout_s: float = 1800.0,
    request_id: str | None = None,
) -> State:
    """Pivot `run_dir` to `policy` (a name under configs/policies/ or a YAML path).

    restart: "deployment" starts the resumed trainer as a run of `train_deployment` (needs a worker);
        "subflow" runs it as a `train` subflow in this process until it ends (the embedded demo);
        "none" leaves the run stopped under its new policy.
    max_steps: the new phase's target (default: the run's newest target); device, pace, gpu_slot:
        passed to the resumed `train` run.
    request_id: this request's id: a rerun with it finds the pivot done; another id pivots again, to the
        policy in force too (none: a pivot to the policy in force is done already).
    """
    run = RunDir(run_dir)
    # Every parameter, the policy and its data are checked here, before anything is touched.
    checked = check_new_policy(run.url, policy, restart, max_steps, device, train_deployment, request_id)
    result = driver.run_pivot(
        run,
        checked,
        at=at,
        restart=_restart(restart, train_deployment, pace, gpu_slot),
        timeout_s=timeout_s,
        log=get_run_logger().info,
        step=as_task,
    )
    if result.get("already"):
        message = (
            f"{run.url}: policy {checked.policy.name!r} already in force since step {result['boundary']}"
            if request_id is None
            else f"{run.url}: {result['what']}"
        )
        return Completed(message=message + "; nothing to do", data=result)
    message = (
        f"pivoted {run.url} at step_{result['boundary']:06d}.bin to policy {result['policy']!r}; "
        f"closed phase in {result['archive']['folder']}"
    )
    if restart == "none":
        return Completed(message=message + "; trainer left stopped (restart='none')", data=result)
    confirmed = result["resumed"]
    if "first_loss" in confirmed:
        message += f"; resumed at step {confirmed['first_step']} with loss {confirmed['first_loss']:.4f}"
    if "resumed_outcome" in result:
        message += f"; then {result['resumed_outcome']['summary']}"
    return Completed(message=message, data=result)
