"""The trainer: one OS process that owns the model, AdamW, the data and all writes to its run directory.

Signals only set flags; the work happens at the step boundary (contract):
  SIGTERM / SIGINT  finish the step in flight, checkpoint it, flush the sidecars, exit 0.
  SIGUSR1           finish the step in flight, checkpoint it (with its sample audit), train on.
Every random draw is a pure function of (seed, step), so a resume from step S replays exactly what
the uninterrupted run would have done after S.

The loss of step s is read one step late, while step s+1 runs, so that the loop never waits for the
device except there (and at a checkpoint). On CUDA the read waits for step s alone: the loss is copied
to pinned host memory right behind step s, marked by an event (a plain .item() would queue its copy
behind step s+1 and wait for the device to go idle). On CUDA the batch of step s+1 is built, pinned and
copied to the device on a background thread; on the CPU it is built inline (see _BatchPrefetch).

The mixer hears of step s's loss after batch s+1 is drawn and before batch s+2 is, at every step,
whatever happened in between (a checkpoint, a signal, a restart: a resumed run re-reads its start step's
loss from .loss.json). So batch selection stays a pure function of (seed, step, mixer state), and the
mixer state at checkpoint S has heard of steps up to S-1.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from andrea_core import signals, untrusted
from andrea_core.checkpoint import CheckpointError, checkpoint_name, restore
from andrea_core.config import RunConfig
from andrea_core.data.pipeline import Batch, DataPipeline
from andrea_core.model.device import attention_kernels, pick_device
from andrea_core.model.gpt import GPT
from andrea_core.run import lock
from andrea_core.run.lineage import require_fork_point, require_phase_start
from andrea_core.run.loss_log import LossWriter, read_history
from andrea_core.run.pivot_journal import require_no_half_pivot
from andrea_core.run.record import environment, read_run
from andrea_core.run.resume_check import ResumeCheck
from andrea_core.run.retention import apply_retention
from andrea_core.run.rundir import LOSS_LOG, REFUSED, RUN_YAML, RunDir
from andrea_core.run.target import check_max_steps, read_target, set_target
from andrea_core.train import distributed, events
from andrea_core.train.audit import Auditor
from andrea_core.train.checkpoint_writer import Checkpointer
from andrea_core.train.guard import Divergence, Guard, roll_back
from andrea_core.train.mlflow_view import open_view
from andrea_core.train.optim import build_optimizer, lr_at
from andrea_core.train.progress import Progress
from andrea_core.train.setup import prepare_run
from andrea_core.train.tensorboard import TensorBoardLog


@dataclass
class TrainResult:
    step: int  # the last step trained (and checkpointed)
    reason: str  # "completed", "SIGTERM", "SIGINT", "already-complete"
    checkpoint: str | None


@dataclass
class _StepLoss:
    """A trained step whose loss stays where it is until `Trainer._read` brings it to the host."""

    step: int
    arm: str | None
    lr: float
    # The loss (or [loss, gradient norm]) on the CPU; on CUDA its pinned host copy, filled later.
    pending: torch.Tensor | None
    ready: torch.cuda.Event | None = None  # CUDA: recorded right after the copy into `pending`
    loss: float | None = None
    grad_norm: float | None = None


class _BatchPrefetch:
    """Builds a step's batch (and on CUDA pins it and queues its copy to the device) on a background
    thread, while the loop goes on. The caller starts it only where it would otherwise draw that batch
    itself, once the mixer is in the state that batch must be drawn from (see Trainer._loop).

    On the CPU there is no thread: the step's own intra-op threads hold the cores and the loop takes
    the batch right after starting it, so a builder there overlaps nothing and costs a hand-over and a
    core taken from the step (issue 31); `take` builds the same batch on the training thread."""

    def __init__(self, build: Callable[[int], tuple], device: str):
        # The current CUDA device is per thread: the builder's pinning and copies go to the trainer's.
        index = torch.device(device).index if device.startswith("cuda") else None
        init = (lambda: torch.cuda.set_device(index)) if index is not None else None
        self._build = build
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="andrea-batch", initializer=init)
            if device.startswith("cuda")
            else None
        )
        self._pending: tuple[int, Future] | None = None

    def start(self, step: int) -> None:
        if self._pool is not None:
            self._pending = (step, self._pool.submit(self._build, step))

    def take(self, step: int) -> tuple:
        """The batch of `step`: the one built in the background, or built now if none was started."""
        if self._pending is None:
            return self._build(step)
        started, future = self._pending
        self._pending = None
        built = future.result()
        if started != step:  # a batch drawn for another step has already moved the mixer on
            raise RuntimeError(f"prefetched the batch of step {started}, but step {step} asked for one")
        return built

    def discard(self) -> None:
        """Drop the batch being built for a step that will not come (a rollback), once it is built."""
        if self._pending is not None:
            self._pending[1].exception()
            self._pending = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class _RankZeroOnly:
    """Stands in, on ranks above 0, for what writes to the run directory (loss log, checkpointer,
    auditor): rank 0 owns the run directory, the other ranks hold the same state and write nothing."""

    records: list = []

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def step_seed(seed: int, step: int) -> int:
    """Seed of the global torch RNG for one step (dropout): independent of how the run got there."""
    return (seed * 1_000_003 + step) % (2**63)


def seed_step(seed: int, device: str) -> None:
    """torch.manual_seed(seed) for what a step on `device` draws from: the CPU generator and, on CUDA,
    the current device's (each rank's own). The same bits; but torch.manual_seed also queues a lazy
    seed of every CUDA device, formatting a stack trace each time (0.28 ms a step, a CPU-only one too)."""
    torch.default_generator.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.manual_seed(seed)


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
        train_args: list[str] | None = None,
    ):
        self.run = RunDir(run_url)
        self.train_args = train_args  # its command line's options, recorded in the lock (pivot restarts)
        self.world = distributed.world_from_env()
        self.device = distributed.rank_device(self.world, pick_device(device))
        distributed.init(self.world, self.device)
        if max_steps is not None:
            check_max_steps(max_steps)
        # Rank 0 speaks for the job: one progress stream, one set of messages, as one trainer would.
        quiet = None if self.world.is_main else open(os.devnull, "w")  # noqa: SIM115 (lives as long as we do)
        # its total and log_every once the run is known; rank 0's progress is also a structured event
        self.progress = Progress(0, 1, stream=quiet, events=self.world.is_main)
        self.log = (log or self.progress.message) if self.world.is_main else self.progress.message
        # The CLI process keeps its handlers to the end; in-process callers get the defaults back.
        self.keep_signal_handlers = keep_signal_handlers
        self.lease: lock.Lease | None = None
        self._taken_requests: set[str] = set()  # ids of the run-directory requests acted on
        self._stopped_waiting: str | None = None
        existed = True
        if self.world.is_main and cfg is not None and not self.run.exists(RUN_YAML):
            # A new run is created under the lease: `andrea status` sees a live trainer CREATING it
            # (not "no run here"), and of two trainers started on one new directory only one creates it.
            existed = self.run.root_exists()
            try:
                self._take_lease(signals.install())
            except lock.StoppedWaiting as e:
                self._stopped_waiting = str(e)  # train() says so and returns: nothing was created
        try:
            if self._stopped_waiting is None:
                with distributed.main_first(self.world):  # rank 0 creates the run; the others read it
                    self.cfg = prepare_run(self.run, cfg)
            else:
                self.cfg = cfg
        except BaseException:
            # A refused creation (bad data, an infeasible policy) leaves nothing: not even our lock,
            # nor the directory if the lease made it.
            self._release(clean=False, remove=not self.run.exists(RUN_YAML))
            if not existed:
                self.run.remove_root_if_empty()
            raise
        distributed.check_batch(self.world, self.cfg.train.batch_size, self.cfg.train.grad_accum_steps)
        # The run's target: --max-steps (recorded in target.jsonl under the lock: train()), else the
        # one in force (run/target.py).
        self._new_target = max_steps
        target = read_target(self.run, self.cfg.train.max_steps, warn=self.log)
        self.max_steps = max_steps or target.max_steps
        self.progress.total, self.progress.log_every = self.max_steps, self.cfg.train.log_every
        self.pace = pace

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
        if self.device.startswith("cuda"):
            if torch.device(self.device).index is not None:
                torch.cuda.set_device(torch.device(self.device))  # events and pinned copies follow it
            # TF32 for the float32 matmuls left outside bf16 autocast, on CUDA only (the CPU stays
            # bit-exact). The flag, not fp32_precision: inductor still reads the global getter, which
            # raises once the per-backend API has been used for one backend alone (torch 2.13).
            torch.backends.cuda.matmul.allow_tf32 = True
        torch.manual_seed(self.cfg.train.seed)
        self.model = GPT(self.cfg.model).to(self.device)
        self.optimizer = build_optimizer(self.model, self.cfg.train, self.device)
        self.checkpointer = (
            Checkpointer(
                self.run,
                self.model,
                self.optimizer,
                asynchronous=self.cfg.train.async_checkpoint,
                log=self.log,
            )
            if self.world.is_main
            else _RankZeroOnly()  # and no 12-bytes-a-parameter snapshot buffer on the other ranks
        )
        with distributed.main_first(self.world):  # rank 0 tokenizes the arms into the cache first
            self.data = DataPipeline.for_run(self.run, self.cfg, warn=self.log)
        self.start_step = 0
        refusals: list[str] = []
        with distributed.main_first(self.world):  # rank 0 tidies the run directory; the others read it
            if self.world.is_main:
                self.run.discard_incomplete_writes(self.log)  # we hold the lock: any write in flight is dead
            ckpt = self.run.newest_valid_checkpoint(
                self.model.n_params, warn=lambda m: (refusals.append(m), self.log(m))
            )
        require_fork_point(self.run, ckpt)  # a half-built fork branch must not train from scratch
        require_phase_start(self.run, ckpt)  # nor a pivoted run from before its boundary
        if ckpt is not None:
            restore(ckpt, self.model, self.optimizer)
            self.start_step = ckpt.step
            if self.world.is_main:
                self._set_aside_refused(newer_than=ckpt.step)
            legacy = "" if ckpt.checksum is not None else " (the legacy form: it has no checksum)"
            self.log(f"resuming {self.run.url} from {checkpoint_name(ckpt.step)}{legacy}")
        elif self.run.checkpoint_steps():
            # Every one refused: often not the files but the model they are checked against (run.yaml's).
            newest = refusals[0] if refusals else "none could be read"
            raise CheckpointError(
                self.run.url,
                f"no valid checkpoint to resume: all were refused, the newest as "
                f"{newest.removeprefix('refusing checkpoint ').removesuffix('; trying the previous one')}; "
                f"the model they must fit is the one in {RUN_YAML}",
            )
        else:
            self.log(f"new run {self.run.url}: {self.model.n_params:,} parameters on {self.device}")
        with distributed.main_first(self.world):  # rank 0 may set an unloadable .state.json aside
            self.data.resume(self.start_step)
        if self.world.is_main:
            self._open_segment(self.start_step)
        else:
            self.auditor = self.loss_log = self.tensorboard = _RankZeroOnly()
            self.resume_check = self.mlflow = _RankZeroOnly()
        if ckpt is None:
            self.auditor.record(0)  # the untrained model: what every later audit is read against
        elif self.world.is_main and self._audit_missing(self.start_step):
            # Its trainer stopped between the checkpoint and its audit (killed, a full disk): these are
            # the weights it audited, and an audit is a pure function of them (audit.py).
            self.log(f"the sample audit of step {self.start_step} is missing: auditing it now")
            self.auditor.audit(self.start_step)
        # The divergence guard (guard.py): its events shape which batches and learning rates come next.
        # guard.jsonl is replayed as input: each line checked against the run, each obeyed one logged.
        self.guard = Guard(
            self.run,
            self.cfg.train.guard,
            self.cfg.model.vocab_size,
            self.log,
            self.world.is_main,
            horizon=max(self.max_steps, self.cfg.train.lr_decay_steps),
            start_step=self.start_step,
        )
        self.guard.restart(self.start_step, self.data.store.phase.start_step)
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if self.device.startswith("cuda")
            else contextlib.nullcontext()
        )
        # Compile the model, not the step: backward and the fused AdamW stay eager, as in a plain loop.
        mode = self.cfg.train.compile_mode
        self.forward = (
            torch.compile(self.model, mode=None if mode == "default" else mode)
            if self.cfg.train.compile
            else self.model
        )
        if self.world.distributed:
            # Every rank starts from the same weights (the same seed or checkpoint): DDP's broadcast of
            # rank 0's changes nothing, its gradient all-reduce averages the ranks' shares of the batch.
            self.forward = torch.nn.parallel.DistributedDataParallel(
                self.forward,
                device_ids=[torch.device(self.device)] if self.device.startswith("cuda") else None,
            )
        self.batches = _BatchPrefetch(self._build_batch, self.device)

    def _set_aside_refused(self, newer_than: int) -> None:
        """Move refused checkpoints past the resume point to refused/: kept as evidence, never
        overwritten by this run's own checkpoint of the same step, never resumed from."""
        for step in self.run.checkpoint_steps():
            if step > newer_than:
                name = checkpoint_name(step)
                self.run.move(name, f"{REFUSED}/{name}.{int(time.time())}")
                self.log(f"moved refused {name} to {REFUSED}/ (nothing is deleted)")

    # --- the loop ----------------------------------------------------------------------------

    def _to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device == "cpu":
            return batch.x, batch.y
        # From pinned memory the copies are queued behind the running step instead of waiting for it.
        x, y = (t.contiguous().pin_memory() for t in (batch.x, batch.y))
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _build_batch(self, step: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        batch = self.data.batch(step, position=self.guard.data_step(step))
        return (batch.arm, *self._to_device(batch))

    def _step(self, x: torch.Tensor, y: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """One optimizer step over the global batch, in train.grad_accum_steps micro-batches; returns
        the mean of their losses, still on the device, and leaves the gradient norm before clipping in
        `self.grad_norm` (on the device; None where not measured). `step`: the loop's step, for the
        divergence guard (None: a bare step, as the benchmarks take one)."""
        n = self.cfg.train.grad_accum_steps
        total = None
        for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True) if n > 1 else [(x, y)]):
            # Under torchrun each rank trains on its own rows of the micro-batch; DDP averages the
            # gradients once, at the last micro-batch (no_sync before it).
            xm, ym = distributed.my_rows(self.world, xm), distributed.my_rows(self.world, ym)
            sync = i == n - 1 or not self.world.distributed
            with self.autocast, attention_kernels(self.device), self._no_sync(not sync):
                _, loss = self.forward(xm, ym, loss_chunk=self.cfg.train.loss_chunk_tokens)
                # Each micro-batch's mean scaled by 1/n: the gradients add up to the global batch's mean.
                (loss / n if n > 1 else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        total = distributed.global_mean(self.world, total)  # the logged loss: the mean over all ranks
        if step is not None:
            self.guard.poison(step, self.model)  # ANDREA_TEST_GUARD_NAN_AT (tests only)
        norm = None
        if self.cfg.train.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        elif step is not None and self.guard.enabled:
            norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.model.parameters() if p.grad is not None]
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_norm = norm
        return total / n if n > 1 else total

    def _no_sync(self, skip: bool) -> contextlib.AbstractContextManager:
        return self.forward.no_sync() if skip else contextlib.nullcontext()

    def _send_home(
        self, loss: torch.Tensor, grad_norm: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start bringing a step's loss (and gradient norm: one tensor [loss, norm], one copy) to the
        host. On CUDA the copy to pinned memory is queued right behind the step, and an event after it,
        so that reading it waits for this step alone."""
        if grad_norm is not None:
            loss = torch.stack([loss.float(), grad_norm.float()])
        if self.device == "cpu":
            return loss, None
        host = torch.empty(loss.shape, dtype=loss.dtype, pin_memory=True)
        host.copy_(loss, non_blocking=True)
        ready = torch.cuda.Event(blocking=True)  # a waiting host sleeps instead of spinning a core
        ready.record()
        return host, ready

    def save(self, step: int, audit: bool = False) -> str:
        """Checkpoint `step` (written in the background unless train.async_checkpoint is false).
        The bandit state is written before the checkpoint, so every checkpoint has its bandit
        (data/state.py); the writer makes the loss log durable before the checkpoint's bytes, so every
        checkpoint has its history; the audit comes after, so every checkpoint has its audit."""
        if not self.world.is_main:
            return checkpoint_name(step)  # rank 0 owns the run directory; every rank has the same state
        self.loss_log.flush()
        self.auditor.flush()  # audits a full disk kept out of the file, before this checkpoint is said
        try:
            self.data.save_state(step)
        except OSError as e:
            # A full disk, a store refusing puts: a checkpoint without its bandit would resume another
            # mixer, so none is written; training goes on and the next boundary tries again.
            self.checkpointer.refuse(
                step, OSError(f"its bandit state could not be written: {type(e).__name__}: {e}")
            )
            if audit:
                self._audit(step)
            return checkpoint_name(step)
        for arm, state in (self.data.mixer.state_dict().get("arms") or {}).items():
            self.tensorboard.scalar(step, f"bandit/p/{arm}", state["p"])
        # The view durable up to this step before the checkpoint can be published: a resume from it
        # (after a kill or a power cut right after the publish) never re-logs these steps.
        self.tensorboard.flush()
        name = self.checkpointer.save(
            step,
            before_write=lambda _: self.loss_log.sync(),
            # Retention deletes only once this newer checkpoint is published (and re-validated).
            after_publish=self._published,
        )
        self.mlflow.flush(step)  # MLflow's view, if configured: sent up to this checkpoint, off this thread
        if audit:
            self._audit(step)
        return name

    def _published(self, step: int) -> None:
        events.emit("checkpoint", step=step, name=checkpoint_name(step))  # for the supervisor (events.py)
        self._retain(step)

    def _retain(self, step: int) -> None:
        """Retention after step's checkpoint is published. Its failure (a denied delete, a listing
        error, an unreadable forks.jsonl) is a retention error, not a failed checkpoint: the checkpoint
        stands, nothing is lost but disk space, and the next checkpoint retries retention whole."""
        try:
            plan = apply_retention(
                self.run,
                self.cfg.retention,
                self.model.n_params,
                self.log,
                newest=step,
                guard=self.cfg.train.guard,
            )
        except Exception as e:
            self.log(
                f"ERROR: retention after {checkpoint_name(step)} failed: {type(e).__name__}: {e}. "
                "The checkpoint is written and kept; retention runs again at the next checkpoint."
            )
            return
        try:
            self.data.store.keep_states(set(plan.keep))
        except OSError as e:
            self.log(f"ERROR: the bandit states of the kept checkpoints could not be written back: {e}")

    def _open_segment(self, step: int) -> None:
        """The run's record from `step` on (rank 0), at a start and after a guard rollback: a new
        .loss.json segment, the audits up to `step`, and a TensorBoard file whose START at step+1
        makes TensorBoard drop any abandoned steps, as the canonical history does (tensorboard.py)."""
        previous = getattr(self, "auditor", None)  # a rollback's: its unwritten audits are carried over
        self.auditor = Auditor(self.run, self.cfg, self.model, self.data, self.device, step, log=self.log)
        if isinstance(previous, Auditor):
            self.auditor.adopt(previous)
        self.auditor.drop_abandoned()
        self.loss_log = LossWriter(self.run, warn=self.log)
        # The steps an earlier segment logged and this one trains again, compared (run/resume_check.py);
        # a rollback's segment trains them under its remedy, so it only records its conditions.
        if isinstance(previous, Auditor):
            self.resume_check.finish()
        self.resume_check = ResumeCheck(
            self.run, self.loss_log.segment, step, self._conditions(), self.log, compare=previous is None
        )
        # The TensorBoard view: events buffered in memory, appended at checkpoints.
        self.tensorboard = TensorBoardLog(self.run, self.loss_log.segment, step + 1, self.log)
        # MLflow's, if configured (mlflow_view.py): one sender per trainer, restarted at a rollback.
        view = getattr(self, "mlflow", None)
        self.mlflow = open_view(
            self.run, self.loss_log.segment, step + 1, self.auditor.audits, self.log, view
        )
        self.auditor.on_written = lambda audit: (self.tensorboard.audit(audit), self.mlflow.audit(audit))

    def _conditions(self) -> dict:
        """What bit-equality with another segment rests on (docs/design.md "Determinism")."""
        return {
            "device": self.device,
            "world_size": self.world.world_size,
            "num_threads": torch.get_num_threads(),
            "environment": environment(),
            "data": {name: getattr(arm, "fingerprint", "") for name, arm in self.data.arms.items()},
            "policy": self.data.policy.hash,
            "phase_start": self.data.store.phase.start_step,
            "bandit_restored": self.start_step == 0 or bool(self.data.store.restored),
        }

    def _audit_missing(self, step: int) -> bool:
        """A resumed step on the audit grid whose audit .samples.json lacks. Not a phase's first step:
        that audit belongs to the phase before it (archived by the pivot, or the fork's source)."""
        on_grid = step % self.cfg.train.audit_every == 0
        first = step <= self.data.store.phase.start_step
        return on_grid and not first and all(a["step"] != step for a in self.auditor.audits)

    def _audit(self, step: int) -> None:
        self.auditor.audit(step, background=self.cfg.train.audit_async)

    def _read(self, result: _StepLoss) -> float:
        """Bring a step's loss to the host (waiting for that step only), check it and log it, once."""
        if result.loss is None:
            if result.ready is not None:
                result.ready.synchronize()
            values = result.pending.tolist()
            result.loss, result.grad_norm = (values, None) if result.pending.dim() == 0 else values
            result.pending = result.ready = None
            tokens = self.cfg.train.batch_size * self.cfg.model.block_size
            self.loss_log.log(
                result.step, result.loss, result.lr, result.arm, tokens, time.time(), result.grad_norm
            )
            self.loss_log.flush()
            self.resume_check.observe(result.step, result.loss)
            if not math.isfinite(result.loss) and not self.guard.enabled:
                self.loss_log.flush(durable=True)
                newest = self.checkpointer.records[-1].name if self.checkpointer.records else None
                raise FloatingPointError(
                    f"loss is {result.loss} at step {result.step}; not checkpointing a diverged model "
                    f"(newest checkpoint: {newest or 'none from this start'})"
                )
            now = time.time()
            self.tensorboard.scalar(result.step, "train/loss", result.loss, now)
            self.tensorboard.scalar(result.step, "train/lr", result.lr, now)
            self.mlflow.step(result.step, result.loss, result.lr, now)
            self.guard.check(result.step, result.loss, result.grad_norm, result.arm)  # raises Divergence
            every = self.cfg.train.checkpoint_every
            next_ckpt = min(self.max_steps, (result.step // every + 1) * every)
            self.progress.step(result.step, result.loss, tokens, next_ckpt)
            if result.step % self.cfg.train.log_every == 0:
                self.tensorboard.scalar(result.step, "train/tokens_per_s", self.progress.tokens_per_s, now)
        return result.loss

    def _start_loss(self) -> _StepLoss | None:
        """The start step's loss as .loss.json holds it: the mixer hears of it before batch start+2
        is drawn, exactly as it did in the run that wrote the checkpoint."""
        if self.start_step == 0 or not self.data.store.restored:
            # A fresh bandit (a pivot's new phase, a fork under a policy of its own, a lost state) did
            # not draw the start step's batch: that loss would be a phantom pull from another phase,
            # perhaps of an arm the new policy does not have.
            return None
        for entry in reversed(read_history(self.run)):
            if entry.step == self.start_step:
                return _StepLoss(entry.step, entry.arm, entry.lr, None, loss=entry.loss)
        self.log(f"warning: .loss.json has no step {self.start_step}: the mixer will not hear of its loss")
        return None

    def _take_request(self, flags: signals.TrainerSignals) -> None:
        """At each lease renewal: a checkpoint or stop request in the run directory (lock.send_request,
        from a machine that cannot signal this process) sets the flag SIGUSR1 / SIGTERM would; the loop
        acts on it at the next step boundary. Each request (its id) is taken once and never removed: a
        removal could lose a request written between the read and the delete (issue 43.7); a request
        left behind is inert (taken already, or addressed to this lease's generation only)."""
        request = lock.read_request(self.run, self.lease.generation)
        if request is None or request["id"] in self._taken_requests:
            return
        # Said before the flag is set: the loop's answer ("SIGUSR1: checkpoint of step N requested")
        # must follow its cause in the log, not race it from the main thread.
        self.log(
            f"{request['request']} requested by {untrusted.shown(request['by'])} "
            f"through {self.run.path(lock.REQUEST)} "
            f"(as {'SIGTERM' if request['request'] == 'stop' else 'SIGUSR1'})"
        )
        self._taken_requests.add(request["id"])
        if request["request"] == "stop":
            flags.stop = flags.stop or "SIGTERM"
        else:
            flags.checkpoint = True

    def _check_lease(self) -> None:
        if self.lease is not None and self.lease.lost is not None:
            raise lock.LeaseLost(self.lease.lost)

    def _finish(self, step: int, reason: str, last_saved: str | None) -> TrainResult:
        """Exit paths wait for the write in flight. A failed final write has no later boundary to retry
        it, so it is retried here once; failing again, the exit says so (status 1, not 0)."""
        if not self.world.is_main:
            return TrainResult(step, reason, last_saved)
        self.auditor.wait()  # a background audit of the last step is part of the run's record
        record = self.checkpointer.wait()
        self._check_lease()  # a write refused by the fence is not retried: the run is someone else's
        if record is not None and record.error is not None:
            self.save(step)
            record = self.checkpointer.wait()
            if record.error is not None:
                intact = self.run.checkpoint_steps()
                self.log(
                    f"ERROR: {reason} at step {step}, but its checkpoint could not be written; the newest "
                    f"checkpoint on disk is {checkpoint_name(intact[-1]) if intact else 'none'}"
                )
                return TrainResult(step, "checkpoint-failed", None)
        if reason == "completed":
            self.log(f"completed step {step}, checkpoint {last_saved}")
        else:
            self.log(f"{reason}: stopped at step {step}, checkpoint {last_saved}")
        return TrainResult(step, reason, last_saved)

    def _take_lease(self, flags: signals.TrainerSignals) -> None:
        """The lock as a lease: renewed on its own thread, checked before every publish (lock.Lease).
        Under torchrun rank 0 holds it for the job: the other ranks never write the run directory.
        A stop while it waits for another trainer's lease ends the wait (StoppedWaiting)."""
        self.lease = lock.Lease.take(
            self.run,
            log=self.log,
            world_size=self.world.world_size,
            agent_pid=self.world.agent_pid,
            stopped=lambda: flags.stop,
            train_args=self.train_args,
        )
        self.lease.on_renewal = lambda: self._take_request(flags)

    def _release(self, clean: bool, remove: bool = False) -> None:
        if self.lease is not None:
            self.lease.release(remove=remove)
            self.lease = None
        distributed.shutdown(self.world, clean=clean)
        if not self.keep_signal_handlers:
            signals.uninstall()

    def train(self) -> TrainResult:
        flags = signals.install()
        if self.world.is_main and self.lease is None and self._stopped_waiting is None:
            try:
                self._take_lease(flags)  # taken already by __init__ if it created the run
            except lock.StoppedWaiting as e:
                self._stopped_waiting = str(e)
        if self._stopped_waiting is not None:
            # Nothing was started: no checkpoint to write, the lock never ours.
            self.log(f"{flags.stop} before the first step: {self._stopped_waiting}")
            self._release(clean=True)
            return TrainResult(0, flags.stop, None)
        try:
            require_no_half_pivot(self.run)  # a pivot left half done: rerun it or abandon it first
            if self._new_target is not None and self.world.is_main:
                steps = self.run.checkpoint_steps()
                set_target(
                    self.run,
                    self._new_target,
                    self.cfg.train.max_steps,
                    step=steps[-1] if steps else 0,
                    by="andrea train --max-steps",
                    warn=self.log,
                )
            self._check_environment()
            self._build()
            while True:
                try:
                    return self._loop(flags)
                except Divergence as d:
                    # Back to a checkpoint before it, remedied, and the loop again from there (guard.py);
                    # at the guard's bound DivergedTooOften instead, and the trainer stops.
                    roll_back(self, d)
        finally:
            if hasattr(self, "batches"):
                self.batches.close()  # a batch being built draws from the mixer: let it finish
            if hasattr(self, "checkpointer"):
                self.checkpointer.wait()  # an error must not leave a write running past the lock
            if hasattr(self, "auditor"):
                with contextlib.suppress(Exception):  # the error on its way out is the one to report
                    self.auditor.wait()
                with contextlib.suppress(Exception):  # a lost lease refuses it: the run is someone else's
                    self.auditor.flush()  # every exit's last chance: a failed write has no later checkpoint
            if hasattr(self, "tensorboard"):
                with contextlib.suppress(lock.LeaseLost):  # the run is someone else's: nothing more of ours
                    self.tensorboard.flush()  # the last audit's events; a view: its failure is a warning
            if hasattr(self, "resume_check"):
                with contextlib.suppress(lock.LeaseLost):  # its verdict over the steps trained again so far
                    self.resume_check.finish()
            if hasattr(self, "mlflow"):
                self.mlflow.close(clean=sys.exc_info()[0] is None)  # bounded; a view: never raises
            if hasattr(self, "loss_log"):
                # A lost lease refuses the last publish (the unpublished tail stays in the cache mirror).
                with contextlib.suppress(lock.LeaseLost):
                    try:
                        self.loss_log.close()
                    except OSError as e:  # a full disk at exit: said once, not as a traceback
                        self.log(
                            f"ERROR: {self.run.path(LOSS_LOG)}: its last lines could not be written at exit "
                            f"({type(e).__name__}: {e}); every checkpoint's history was written before it"
                        )
            self._release(clean=sys.exc_info()[0] is None)

    def _loop(self, flags: signals.TrainerSignals) -> TrainResult:
        t = self.cfg.train
        step, last_saved = self.start_step, None
        if step >= self.max_steps:
            self.log(f"already at step {step} >= max_steps {self.max_steps}; nothing to do")
            return TrainResult(step, "already-complete", None)
        self.log(f"training steps {step + 1}..{self.max_steps} (pid {os.getpid()})")
        if self.world.is_main:
            events.emit("started", first_step=step + 1, max_steps=self.max_steps)
        previous = self._start_loss()  # the step whose loss the mixer has yet to hear of
        # Under torchrun `flags` is what all ranks agreed on (an all-reduce of `received`, every step).
        received, flags = flags, distributed.share_flags(self.world, flags, consume=False)
        while step < self.max_steps:
            if flags.stop and step == self.start_step:
                self.log(f"{flags.stop} before the first step: nothing to checkpoint, exiting")
                return TrainResult(step, flags.stop, None)
            self._check_lease()  # taken over while paused: stop before anything else is written
            step += 1
            t0 = time.perf_counter()
            lr = lr_at(step, t) * self.guard.lr_factor(step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            arm, x, y = self.batches.take(step)
            if self.guard.test_noise is not None:  # tests only (guard.py: ANDREA_TEST_GUARD_NOISE)
                y = self.guard.corrupt(step, y, self.cfg.model.vocab_size)
            seed_step(step_seed(t.seed, step), self.device)
            current = _StepLoss(step, arm, lr, *self._send_home(self._step(x, y, step), self.grad_norm))
            if previous is not None:
                self.data.observe(previous.step, previous.arm, self._read(previous))
            previous = current
            flags = distributed.share_flags(self.world, received)  # every rank, this step
            on_grid = step % t.checkpoint_every == 0
            audit = step % t.audit_every == 0 or flags.checkpoint or step == self.max_steps
            stop_seen = flags.stop  # one landing later is acted on once this step's work is done
            checkpointed = on_grid or step == self.max_steps or flags.stop or flags.checkpoint
            if checkpointed:
                if flags.checkpoint and not on_grid:
                    self.log(f"SIGUSR1: checkpoint of step {step} requested")
                if flags.stop:
                    self.log(f"{flags.stop}: checkpointing step {step}, then exiting")
                flags.checkpoint = False
                self._read(current)  # logged before its checkpoint; the mixer still hears of it later
                last_saved = self.save(step, audit)
            elif audit:
                self._audit(step)
                if flags.stop:  # it came during the audit: this step is still the one in flight
                    self.log(f"{flags.stop}: checkpointing step {step}, then exiting")
                    self._read(current)
                    last_saved = self.save(step)
            if flags.stop:
                if not stop_seen and checkpointed:
                    # It landed while this step's checkpoint was written or audited: that step was the
                    # one in flight, and its checkpoint, begun before the signal, is the one it asks for.
                    self.log(f"{flags.stop} during step {step}'s checkpoint: exiting with it")
                return self._finish(step, flags.stop, last_saved)
            if step < self.max_steps:
                # Only now: batch step+1 is drawn from the mixer that has heard of step-1 and that any
                # checkpoint of this step has saved, exactly as if the loop drew it at its next turn.
                self.batches.start(step + 1)
            if self.pace > 0:
                time.sleep(max(0.0, self.pace - (time.perf_counter() - t0)))
        return self._finish(step, "completed", last_saved)
