"""Real andrea-tiny-mix runs shared by the data-proxy and audit tests (trained once per test session).

`uninterrupted` trains 200 steps in one go. `interrupted` trains the same config, gets a SIGUSR1 after
its first checkpoint (an off-grid checkpoint with its audit, training on) and a SIGTERM after step 100,
and is then resumed to step 200 by a second trainer process.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO, andrea, built_once, last_logged_step, start_trainer, wait_for

from andrea_core.checkpoint import checkpoint_name
from andrea_core.run.rundir import RunDir

MIX = str(REPO / "configs" / "andrea-tiny-mix.yaml")
STEPS = 200
EVERY = 50  # andrea-tiny-mix's checkpoint_every


@dataclass
class MixRuns:
    uninterrupted: RunDir
    interrupted: RunDir
    usr1_step: int  # the off-grid checkpoint SIGUSR1 asked for
    stop_step: int  # the checkpoint SIGTERM wrote
    resume_log: str  # what the resumed trainer printed


def mix_runs(tmp_path_factory) -> MixRuns:
    """The two runs, trained once per test session (conftest.built_once: the audit and data-resume
    modules may run on different workers)."""
    folder, meta = built_once(tmp_path_factory, "mix-runs", _train_mix_runs)
    a, b = (RunDir(str(folder / n)) for n in ("mix-uninterrupted", "mix-interrupted"))
    return MixRuns(a, b, meta["usr1_step"], meta["stop_step"], meta["resume_log"])


def _train_mix_runs(base: Path) -> dict:
    a, b = base / "mix-uninterrupted", base / "mix-interrupted"
    andrea("train", "--config", MIX, "--run-dir", str(a), "--max-steps", str(STEPS))

    run_b = RunDir(str(b))
    # --pace only sleeps between steps, so the signals land mid-run on a loaded machine too.
    trainer = start_trainer("--config", MIX, "--run-dir", str(b), "--max-steps", str(STEPS), "--pace", "0.03")
    try:
        wait_for(lambda: run_b.exists(checkpoint_name(EVERY)), what="first checkpoint")
        trainer.send_signal(signal.SIGUSR1)
        usr1 = wait_for(
            lambda: next((s for s in run_b.checkpoint_steps() if s % EVERY), None), what="SIGUSR1 checkpoint"
        )
        # Past checkpoint 100 (and its audit), so that the SIGTERM checkpoint is one of its own.
        wait_for(lambda: last_logged_step(run_b) > 2 * EVERY + 2, what="step 103")
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=120) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
    stop = run_b.checkpoint_steps()[-1]
    resumed = andrea("train", "--run-dir", str(b), "--max-steps", str(STEPS))
    return {"usr1_step": usr1, "stop_step": stop, "resume_log": resumed.stdout + resumed.stderr}
