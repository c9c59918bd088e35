"""The embedded demo: the whole life of a run on Prefect's ephemeral mode (no server to start).

train andrea-tiny on this machine's Python standard library (a `train` flow run), pivot at the next
checkpoint boundary to the polish policy (a `pivot` flow run, whose resumed trainer is a new `train`
flow run), then audit-fork the result into two branches and compare them (an `audit-fork` flow run).

  bash scripts/demo.sh            # or: python -m flows.demo --help
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import yaml
from prefect import flow

from andrea_core.config import REPO_ROOT, load_run_config
from andrea_core.data.prepare import prepare, resolve_target
from andrea_core.ops.supervise import wait_for_logged_step
from andrea_core.run.rundir import RunDir
from flows._background import start_subflow
from flows.audit_fork import audit_fork
from flows.pivot import pivot
from flows.train import train

DEFAULT_BRANCHES = [
    {"name": "base", "overrides": {}},
    {"name": "low-lr", "overrides": {"train.lr": 1.0e-3, "train.min_lr": 1.0e-4}},
]


def with_threads(config: str, threads: int, folder: Path) -> str:
    """The config with its intra-op thread count set: on a 2-core machine that also runs the Prefect
    server, one thread is several times faster than two, whose OpenMP workers spin-wait on each other."""
    cfg = load_run_config(config).with_overrides({"train.num_threads": threads}, f"demo config {config}")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{cfg.name}.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return str(path)


@flow(name="demo")
def demo(
    workdir: str = str(REPO_ROOT / "runs" / "demo"),
    config: str = "andrea-tiny",
    policy: str = "polish",
    pivot_decided_at: int = 120,
    max_steps: int = 400,
    fork_steps: int = 100,
    pace: float = 0.05,  # slow enough that the pivot, decided mid-run, lands while the trainer is live
    threads: int = 1,
) -> dict:
    folder = Path(workdir) / time.strftime("%Y%m%d-%H%M%S")
    run_dir = RunDir(folder / "main").url
    config = with_threads(config, threads, folder)
    # As an operator runs `andrea data prepare` before a pivot: the pivot policy's token caches are built
    # now, so that the pivot checks its data in seconds while the trainer is still live.
    prepare(resolve_target(policy, config), warn=print)
    first = start_subflow(train, run_dir=run_dir, config=config, max_steps=max_steps, pace=pace, device="cpu")
    # The pivot is decided mid-run, while the trainer is live; it lands on the next checkpoint boundary.
    wait_for_logged_step(RunDir(run_dir), pivot_decided_at, timeout=600)
    # The resumed trainer unpaced: only the first needs to be slow enough for the pivot to land live.
    pivoted = pivot(
        run_dir, policy, at="boundary", restart="subflow", max_steps=max_steps, pace=0.0, device="cpu"
    )
    before_pivot = first.result()
    # Unpaced too: only the main run needs to be slow enough for the pivot to land while it is live. Two
    # replicates a branch, the fewest that measure training noise (the verdict's test; `andrea fork`
    # and the deployment make 3): four short branch runs, one after another.
    forked = audit_fork(run_dir, DEFAULT_BRANCHES, steps=fork_steps, pace=0.0, device="cpu", replicates=2)
    return {"run_dir": run_dir, "first_train": before_pivot, "pivot": pivoted, "audit_fork": forked}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=str(REPO_ROOT / "runs" / "demo"), help="where the demo's runs go")
    p.add_argument("--policy", default="polish", help="the policy to pivot to (configs/policies/)")
    p.add_argument("--pivot-at", type=int, default=120, help="the step at which the pivot is decided")
    p.add_argument("--max-steps", type=int, default=400, help="train the main run to this step")
    p.add_argument("--fork-steps", type=int, default=100, help="steps each audit-fork branch trains")
    a = p.parse_args()
    t0 = time.perf_counter()
    result = demo(
        workdir=a.workdir,
        policy=a.policy,
        pivot_decided_at=a.pivot_at,
        max_steps=a.max_steps,
        fork_steps=a.fork_steps,
    )
    fork = result["audit_fork"]
    print()
    print(f"andrea demo finished in {time.perf_counter() - t0:.0f}s")
    print(f"  run:        {result['run_dir']}")
    print(f"  before:     {result['first_train']['summary']}")
    print(
        f"  pivot:      step {result['pivot']['boundary']} -> policy {result['pivot']['policy']!r}, "
        f"archive {result['pivot']['archive']['folder']}"
    )
    print(f"  branches:   {', '.join(b['url'] for b in fork['branches'])}")
    print(f"  verdict:    {fork['verdict']}")
    print(f"  report:     {fork['report']}")
    print(f"  plot:       {fork['plot']}")
    home = os.environ.get("PREFECT_HOME", str(Path.home() / ".prefect"))
    print(f"  Prefect:    the flow runs and artifacts are kept in {home}; to browse them in the UI:")
    print(f"              PREFECT_HOME={home} .venv/bin/prefect server start  (then http://127.0.0.1:4200)")


if __name__ == "__main__":
    main()
