"""`train`: start or resume a run as a Prefect flow run.

The trainer runs as a child process in this flow run's process group: a cancellation from the UI, the CLI
or the API reaches it as SIGTERM, it checkpoints the step in flight, and only then does the flow run end,
Cancelled, its trainer task Cancelled with the step it checkpointed. The final state of any other end says
at which step the trainer stopped and why."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from andrea_core.config import parse_settings
from andrea_core.run.rundir import RunDir
from andrea_core.train.setup import train_config
from tasks.artifacts import run_name
from tasks.gpu import holding_gpu_slots
from tasks.trainer import end_cancelled, run_trainer, trainer_outcome


def train_run_name(run_dir: str) -> str:
    """`train-<run>`, and `-phaseN` after a pivot (phase N > 1): two flow runs of one run, one name each."""
    from andrea_core.run.lineage import phases

    try:
        phase = len(phases(RunDir(run_dir))) + 1
    except Exception:  # an unlistable run directory: the flow reports it; the name stays plain
        phase = 1
    return f"train-{run_name(run_dir)}" + (f"-phase{phase}" if phase > 1 else "")


def _flow_run_name() -> str:
    return train_run_name(flow_run.parameters["run_dir"])


@flow(name="train", flow_run_name=_flow_run_name)
def train(
    run_dir: str,
    config: str | None = None,
    max_steps: int | None = None,
    device: str = "auto",
    pace: float = 0.0,
    gpu_slot: str | None = "auto",
    slot_timeout_s: float | None = None,
    nproc_per_node: int = 1,
    settings: dict | list | None = None,
    policy: str | None = None,
) -> State:
    """Train `run_dir` up to `max_steps` (default: the run config's).

    config: a config name or YAML path, only to create a new run; a resume reads the frozen run.yaml.
    gpu_slot: the one-trainer-per-GPU concurrency slot to hold ("auto": gpu-N for CUDA device N,
        none on the CPU; or an explicit name). slot_timeout_s: how long to wait for it (None: forever).
    nproc_per_node: data-parallel ranks on this machine (torchrun; one GPU each, and the slots of all
        of them: gpu-0 .. gpu-N-1); batch_size stays the global batch. The UI shows the job as one run.
    settings: a new run's config settings, {"train.lr": 1e-3} or ["train.lr=1e-3"] (`andrea train
        --set`); policy: its data policy (`--policy`). Checked before any work, as `andrea train` checks them.
    """
    run_dir = RunDir(run_dir).url
    # The same check as `andrea train`'s, before a GPU slot is taken or a trainer started.
    given = parse_settings(settings, "settings")
    train_config(RunDir(run_dir), config, given, policy)
    with holding_gpu_slots(gpu_slot, device, slot_timeout_s, nproc_per_node):
        ran = run_trainer(
            run_dir,
            config,
            max_steps,
            device,
            pace,
            nproc_per_node=nproc_per_node,
            settings=given or None,
            policy=policy,
            return_state=True,
        )
    outcome = trainer_outcome(ran)
    if outcome.get("cancelled"):
        return end_cancelled(outcome)
    final = Completed if outcome["ok"] else Failed
    return final(message=outcome["summary"], data=outcome)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Run the train flow in this process (no worker needed).")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--device", default="auto")
    p.add_argument("--pace", type=float, default=0.0)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--set", action="append", dest="settings", metavar="KEY=VALUE")
    p.add_argument("--policy")
    a = p.parse_args()
    train(
        a.run_dir,
        a.config,
        a.max_steps,
        a.device,
        a.pace,
        nproc_per_node=a.nproc_per_node,
        settings=a.settings,
        policy=a.policy,
    )
