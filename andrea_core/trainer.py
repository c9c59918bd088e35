"""The trainer: one OS process that owns the model, AdamW, the data and all writes to its run directory.

Signals only set flags; the work happens at the step boundary (contract):
  SIGTERM / SIGINT  finish the step in flight, checkpoint it, flush the sidecars, exit 0.
  SIGUSR1           finish the step in flight, checkpoint it, train on.
Every random draw is a pure function of (seed, step), so a resume from step S replays exactly what
the uninterrupted run would have done after S.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from andrea_core import lock, signals
from andrea_core.checkpoint import CheckpointError, checkpoint_name, restore
from andrea_core.checkpointer import Checkpointer
from andrea_core.config import ConfigError, RunConfig
from andrea_core.data.pipeline import DataPipeline
from andrea_core.loss_log import LossWriter
from andrea_core.model import GPT
from andrea_core.optim import build_optimizer, lr_at
from andrea_core.progress import Progress
from andrea_core.retention import apply_retention
from andrea_core.rundir import REFUSED, RUN_YAML, RunDir
from andrea_core.runs import config_differences, create_run, environment, read_policy, read_run


@dataclass
class TrainResult:
    step: int  # the last step trained (and checkpointed)
    reason: str  # "completed", "SIGTERM", "SIGINT", "already-complete"
    checkpoint: str | None


def pick_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {requested}: CUDA is not available on this machine")
    if requested != "cpu" and not requested.startswith("cuda"):
        raise ConfigError(f"--device {requested}: expected auto, cpu or cuda[:N]")
    return requested


def step_seed(seed: int, step: int) -> int:
    """Seed of the global torch RNG for one step (dropout): independent of how the run got there."""
    return (seed * 1_000_003 + step) % (2**63)


def prepare_run(run: RunDir, cfg: RunConfig | None) -> RunConfig:
    """The run's frozen config: created from `cfg` for a new run, checked against it for an old one."""
    if not run.exists(RUN_YAML):
        if cfg is None:
            raise ConfigError(f"{run.url}: no run here yet; pass --config to create one")
        return create_run(run, cfg).config
    frozen = read_run(run).config
    if cfg is not None and cfg != frozen:
        diffs = ", ".join(config_differences(cfg, frozen))
        raise ConfigError(
            f"{run.url}: --config differs from the frozen {RUN_YAML} in {diffs}; "
            "resume without --config, or fork the run to change its config"
        )
    return frozen


class Trainer:
    def __init__(
        self,
        run_url: str,
        cfg: RunConfig | None = None,
        *,
        max_steps: int | None = None,
        device: str = "auto",
        pace: float = 0.0,
        log: Callable[[str], None] | None = None,
        keep_signal_handlers: bool = False,
    ):
        self.run = RunDir(run_url)
        self.device = pick_device(device)
        self.cfg = prepare_run(self.run, cfg)
        self.max_steps = max_steps or self.cfg.train.max_steps
        self.pace = pace
        # The CLI process keeps its handlers to the end; in-process callers get the defaults back.
        self.keep_signal_handlers = keep_signal_handlers
        self.progress = Progress(self.max_steps, self.cfg.train.log_every)
        self.log = log or self.progress.message

    # --- setup -------------------------------------------------------------------------------

    def _check_environment(self) -> None:
        record = read_run(self.run)
        now = environment()
        for key, was in record.environment.items():
            if now.get(key) != was and self.device == "cpu":
                self.log(
                    f"warning: {key} is {now.get(key)!r} here but the run was created with {was!r}: "
                    "resumed CPU results will match the original only to rounding, not bit for bit"
                )
        threads = self.cfg.train.num_threads
        if threads > (os.cpu_count() or threads):
            self.log(f"warning: num_threads {threads} exceeds this machine's {os.cpu_count()} cores")

    def _build(self) -> None:
        torch.set_num_threads(self.cfg.train.num_threads)
        torch.manual_seed(self.cfg.train.seed)
        self.model = GPT(self.cfg.model).to(self.device)
        self.optimizer = build_optimizer(self.model, self.cfg.train, self.device)
        self.checkpointer = Checkpointer(self.run, self.model, self.optimizer)
        self.data = DataPipeline(self.cfg, read_policy(self.run), warn=self.log)
        self.start_step = 0
        self.run.discard_incomplete_writes(self.log)  # we hold the lock: any write in flight is a dead one's
        ckpt = self.run.newest_valid_checkpoint(self.model.n_params, warn=self.log)
        if ckpt is not None:
            restore(ckpt, self.model, self.optimizer)
            self.start_step = ckpt.step
            self._set_aside_refused(newer_than=ckpt.step)
            self.log(f"resuming {self.run.url} from {checkpoint_name(ckpt.step)}")
        elif self.run.checkpoint_steps():
            raise CheckpointError(self.run.url, "no valid checkpoint to resume (all were refused)")
        else:
            self.log(f"new run {self.run.url}: {self.model.n_params:,} parameters on {self.device}")
        self.loss_log = LossWriter(self.run)
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if self.device.startswith("cuda")
            else contextlib.nullcontext()
        )
        self.step_fn = torch.compile(self._step) if self.cfg.train.compile else self._step

    def _set_aside_refused(self, newer_than: int) -> None:
        """Move refused checkpoints past the resume point to refused/: kept as evidence, never
        overwritten by this run's own checkpoint of the same step, never resumed from."""
        for step in self.run.checkpoint_steps():
            if step > newer_than:
                name = checkpoint_name(step)
                self.run.move(name, f"{REFUSED}/{name}.{int(time.time())}")
                self.log(f"moved refused {name} to {REFUSED}/ (nothing is deleted)")

    # --- the loop ----------------------------------------------------------------------------

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast:
            _, loss = self.model(x, y)
        loss.backward()
        if self.cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def save(self, step: int) -> str:
        """Checkpoint `step`: the loss log is durable first, so every checkpoint has its history."""
        self.loss_log.flush(durable=True)
        name = self.checkpointer.save(step)
        self.log(f"checkpoint {name} ({self.checkpointer.last_write_s:.2f}s)")
        apply_retention(self.run, self.cfg.retention, self.model.n_params, self.log, newest=step)
        return name

    def train(self) -> TrainResult:
        me = lock.acquire(self.run, log=self.log)
        flags = signals.install()
        try:
            self._check_environment()
            self._build()
            return self._loop(flags)
        finally:
            if hasattr(self, "checkpointer"):
                self.checkpointer.wait()
            if hasattr(self, "loss_log"):
                self.loss_log.close()
            lock.release(self.run, me)
            if not self.keep_signal_handlers:
                signals.uninstall()

    def _loop(self, flags: signals.TrainerSignals) -> TrainResult:
        t = self.cfg.train
        step, last_saved = self.start_step, None
        if step >= self.max_steps:
            self.log(f"already at step {step} >= max_steps {self.max_steps}; nothing to do")
            return TrainResult(step, "already-complete", None)
        tokens_per_step = t.batch_size * self.cfg.model.block_size
        self.log(f"training steps {step + 1}..{self.max_steps} (pid {os.getpid()})")
        while step < self.max_steps:
            if flags.stop and step == self.start_step:
                self.log(f"{flags.stop} before the first step: nothing to checkpoint, exiting")
                return TrainResult(step, flags.stop, None)
            step += 1
            t0 = time.perf_counter()
            lr = lr_at(step, t)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            batch = self.data.batch(step)
            torch.manual_seed(step_seed(t.seed, step))
            x = batch.x.to(self.device, non_blocking=True)
            y = batch.y.to(self.device, non_blocking=True)
            loss = self.step_fn(x, y).item()
            if not math.isfinite(loss):
                self.loss_log.flush(durable=True)
                raise FloatingPointError(
                    f"loss is {loss} at step {step}; not checkpointing a diverged model "
                    f"(newest checkpoint: {last_saved or 'none from this start'})"
                )
            self.data.observe(step, batch.arm, loss)
            self.loss_log.log(step, loss, lr, batch.arm, tokens_per_step, time.time())
            self.loss_log.flush()
            on_grid = step % t.checkpoint_every == 0
            if on_grid or step == self.max_steps or flags.stop or flags.checkpoint:
                if flags.checkpoint and not on_grid:
                    self.log(f"SIGUSR1: checkpoint of step {step} requested")
                flags.checkpoint = False
                last_saved = self.save(step)
            next_ckpt = min(self.max_steps, (step // t.checkpoint_every + 1) * t.checkpoint_every)
            self.progress.step(step, loss, tokens_per_step, next_ckpt)
            if flags.stop:
                self.checkpointer.wait()
                self.log(f"{flags.stop}: stopped at step {step}, checkpoint {last_saved}")
                return TrainResult(step, flags.stop, last_saved)
            if self.pace > 0:
                time.sleep(max(0.0, self.pace - (time.perf_counter() - t0)))
        self.checkpointer.wait()
        self.log(f"completed step {step}, checkpoint {last_saved}")
        return TrainResult(step, "completed", last_saved)
