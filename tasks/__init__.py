"""Prefect tasks: thin wrappers over andrea_core, one clear job each (docs/design.md "Layout").

trainer.py    run and follow a trainer process, signal the trainer of a run, wait for a checkpoint,
              stop a trainer and wait for its exit
gpu.py        hold the GPU's concurrency slot while a trainer runs
pivot.py      the run-directory steps of a pivot: check the policy, archive, keep the loss log, install
fork.py       copy a checkpoint into branch runs, compare the branches
artifacts.py  publish reports, plots and status as Prefect artifacts
"""
