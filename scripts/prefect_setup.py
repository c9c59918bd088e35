"""The operator's Prefect setup, safe to run again: the `process` work pool, one-slot concurrency
limits for this machine's GPUs, and the automations in automations/ (created, or updated in place).
Then deploy the flows with `prefect deploy --all` (see docs/operations.md).

    PREFECT_API_URL=http://127.0.0.1:4200/api python scripts/prefect_setup.py [--pool andrea] [--gpus N]

ANDREA_CRASH_AFTER_S sets the crash automation's window (automations/crash-silent-train-runs.yaml: 90 s
after a train run's last heartbeat); it must exceed the 30 s between heartbeats (tests shorten it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, WorkPoolCreate
from prefect.events.schemas.automations import AutomationCore
from prefect.exceptions import ObjectNotFound

REPO = Path(__file__).resolve().parent.parent
CRASH_AUTOMATION = "andrea-crash-silent-train-runs"
CRASH_AFTER_ENV = "ANDREA_CRASH_AFTER_S"
HEARTBEAT_S = 30  # prefect.yaml's PREFECT_FLOWS_HEARTBEAT_FREQUENCY


def with_crash_window(doc: dict) -> dict:
    """The crash automation with ANDREA_CRASH_AFTER_S as its window (and in its message), if set."""
    text = os.environ.get(CRASH_AFTER_ENV)
    if doc.get("name") != CRASH_AUTOMATION or not text:
        return doc
    if not text.isdigit() or int(text) <= HEARTBEAT_S:
        print(f"prefect_setup: error: {CRASH_AFTER_ENV}={text!r}: expected whole seconds over {HEARTBEAT_S}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    old = doc["trigger"]["within"]
    doc["trigger"]["within"] = int(text)
    for action in doc["actions"]:
        if "message" in action:
            action["message"] = action["message"].replace(
                f"No heartbeat for {old} s", f"No heartbeat for {text} s"
            )
    return doc


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", default="andrea", help="name of the process work pool (prefect.yaml's)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to create gpu-N limits for (default: all)")
    a = p.parse_args(argv)
    gpus = gpu_count() if a.gpus is None else a.gpus
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(a.pool)
            print(f"work pool {a.pool!r}: exists")
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=a.pool, type="process"))
            print(f"work pool {a.pool!r}: created (type process)")

        for i in range(gpus):
            name = f"gpu-{i}"
            try:
                limit = client.read_global_concurrency_limit_by_name(name)
                print(f"concurrency limit {name!r}: exists ({limit.limit} slot(s))")
            except ObjectNotFound:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
                print(f"concurrency limit {name!r}: created (1 slot: one trainer per GPU)")

        for path in sorted((REPO / "automations").glob("*.yaml")):
            automation = AutomationCore.model_validate(with_crash_window(yaml.safe_load(path.read_text())))
            existing = client.read_automations_by_name(automation.name)
            if existing:
                client.update_automation(existing[0].id, automation)
                print(f"automation {automation.name!r}: updated from {path.relative_to(REPO)}")
            else:
                client.create_automation(automation)
                print(f"automation {automation.name!r}: created from {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
