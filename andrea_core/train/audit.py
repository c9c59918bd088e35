"""The sample audit: fixed prompts, a fixed seed, metrics that need no external model (docs/design.md).

Every `train.sample_every` steps (default: every checkpoint), at every SIGUSR1 checkpoint, at the last
step and once at step 0 of a new run, the trainer records an audit in `.samples.json`: the samples
generated from PROMPTS, the validation loss of each arm on its fixed held-out batch, and text metrics
of the samples (distinct-1/2, repetition rate, gzip compression ratio). The file keeps the newest
KEEP_AUDITS audits and is replaced atomically. An audit is a pure function of the weights: each prompt
samples from its own torch.Generator seeded from the run's seed and the prompt's index, so it never
shifts the training stream, its completion does not depend on the other prompts of the batch, and two
identical runs record identical audits. All prompts are generated in one batch with a KV cache, and
all arms' validation losses come from one forward pass.

With train.audit_async the audit runs on a thread (on CUDA, on a stream of its own) from a copy of the
weights taken at its step, while training goes on: on a GPU most of an audit is the host launching
small decode kernels, time the training loop need not wait for. The audit is the same; only when it is
written changes (before the next audit starts, and before the trainer exits).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from andrea_core.config import RunConfig
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.tokens import DOC_SEPARATOR
from andrea_core.model.gpt import GPT
from andrea_core.run.rundir import SAMPLES, RunDir
from andrea_core.run.samples import FORMAT, KEEP_AUDITS, audit_line, read_audits, text_metrics

PROMPTS = ("def ", "import ", "The ", "class ")  # the last resort: a run whose held-out data has no prompt
PROMPTS_PER_ARM = 2  # held-out documents per arm whose first tokens are the default prompts
MAX_PROMPTS = 8
PROMPT_TOKENS = 8
SCAN_TOKENS = 1 << 16  # of each arm's held-out split, where the prompts are looked for
NEW_TOKENS = 64
TEMPERATURE = 0.8
VAL_SEQS = 8  # held-out windows per arm


# --- model-side measurements ---------------------------------------------------------------------


@torch.no_grad()
def validation_losses(
    model: GPT, data: DataPipeline, device: str, n_seqs: int = VAL_SEQS
) -> dict[str, float]:
    """Mean cross-entropy of the model on each arm's fixed held-out batch: all arms in one forward
    pass and one read back to the host (one device sync for the lot)."""
    arms = list(data.arms)
    xs, ys = zip(*(data.val_batch(arm, n_seqs) for arm in arms), strict=True)
    logits, _ = model(torch.cat(xs).to(device))
    per_token = F.cross_entropy(
        logits.float().flatten(0, 1), torch.cat(ys).to(device).flatten(), reduction="none"
    )
    return dict(zip(arms, per_token.view(len(arms), -1).mean(dim=1).tolist(), strict=True))


def prompt_generator(seed: int, i: int, device: str) -> torch.Generator:
    """Prompt i's own sampling generator: its tokens depend on (seed, i) alone, not on the batch."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + i) % 2**63)


@contextlib.contextmanager
def one_cpu_thread(device: str) -> Iterator[None]:
    """Decoding with a KV cache is a long chain of tiny ops (4 rows at a time): on the CPU, a second
    intra-op thread only adds its hand-over at every op (measured on a busy 2-core machine: 16 s for
    the audit's 4 x 64 tokens at 2 threads, 0.8 s at 1). The run's thread count is restored after."""
    if device != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _head(tokens: Any, n: int) -> list[int]:
    n = min(n, len(tokens))
    if isinstance(tokens, np.ndarray):
        return tokens[:n].tolist()
    return tokens.rows(np.array([0]), n)[0].tolist()  # ShardedTokens


def held_out_prompts(data: DataPipeline) -> list[tuple[str, str]]:
    """(arm, prompt): the first PROMPT_TOKENS tokens of the first PROMPTS_PER_ARM held-out documents of
    each arm. A corpus cache's held-out split is whole documents, each followed by DOC_SEPARATOR: the
    first starts at 0, the others after a separator. Elsewhere (the embedded arms' tail-of-stream
    split, token shards) the split may begin mid-document and the separator also parts paragraphs: a
    prompt starts after one. A pure function of the arms' held-out data: the same prompts at every
    audit of a phase, and a Shakespeare run is prompted with Shakespeare, not with code."""
    tok = data.tokenizer
    sep = tok.encode(DOC_SEPARATOR)
    per_arm = max(1, min(PROMPTS_PER_ARM, MAX_PROMPTS // max(1, len(data.arms))))
    found: list[tuple[str, str]] = []
    for arm, token_arm in data.arms.items():
        head, taken, k = _head(token_arm.val, SCAN_TOKENS), 0, len(sep)
        whole_documents = token_arm.info.get("documents") is not None  # a corpus cache (data/shards.py)
        for i in range(0 if whole_documents else k, len(head) - PROMPT_TOKENS):
            if taken == per_arm or len(found) == MAX_PROMPTS:
                break
            if (i > 0 and head[i - k : i] != sep) or head[i : i + k] == sep:
                continue  # not a document's start, or inside a run of separators
            text = tok.decode(head[i : i + PROMPT_TOKENS]).rstrip("\ufffd")  # no half a character
            if text.strip() and DOC_SEPARATOR not in text:
                found.append((arm, text))
                taken += 1
    return found


def audit_prompts(data: DataPipeline, cfg: RunConfig) -> list[tuple[str | None, str]]:
    """(arm or None, prompt) of the run's audits: train.audit_prompts if the config gives them, else
    `held_out_prompts`, else the fixed PROMPTS."""
    if cfg.train.audit_prompts:
        return [(None, p) for p in cfg.train.audit_prompts]
    return held_out_prompts(data) or [(None, p) for p in PROMPTS]


@torch.no_grad()
def generate_samples(
    model: GPT,
    data: DataPipeline,
    seed: int,
    device: str,
    new_tokens: int = NEW_TOKENS,
    own_threads: bool = True,
    prompts: list[tuple[str | None, str]] | None = None,
) -> list[dict[str, str]]:
    """One completion per prompt, all prompts in one batch with a KV cache (GPT.generate).

    Prompts of different token lengths are left-padded and the padding masked out, so each prompt's
    completion is the one it would get alone, from its own generator (`prompt_generator`).
    `own_threads`: may set the process's CPU thread count while it runs (not from a second thread).
    """
    tok = data.tokenizer
    prompts = prompts if prompts is not None else [(None, p) for p in PROMPTS]
    # A prompt longer than the context keeps its newest block_size - 1 tokens (one is generated at once).
    keep = data.cfg.model.block_size - 1
    encoded = [tok.encode(p)[-keep:] for _, p in prompts]
    width = max(len(e) for e in encoded)
    idx = torch.tensor([[0] * (width - len(e)) + e for e in encoded], device=device)
    generators = [prompt_generator(seed, i, device) for i in range(len(prompts))]
    with one_cpu_thread(device) if own_threads else contextlib.nullcontext():
        out = model.generate(
            idx, new_tokens, temperature=TEMPERATURE, generator=generators, lengths=[len(e) for e in encoded]
        ).tolist()
    return [
        {"prompt": p, "completion": tok.decode(row[width:]), **({"arm": arm} if arm else {})}
        for (arm, p), row in zip(prompts, out, strict=True)
    ]


def run_audit(
    model: GPT,
    data: DataPipeline,
    cfg: RunConfig,
    step: int,
    device: str,
    own_threads: bool = True,
    prompts: list[tuple[str | None, str]] | None = None,
) -> dict[str, Any]:
    """The audit of the model as it is now; leaves the model's mode and every global RNG untouched.
    `prompts`: audit_prompts(data, cfg) unless given (the Auditor computes them once per start)."""
    prompts = prompts if prompts is not None else audit_prompts(data, cfg)
    was_training = model.training
    model.eval()  # no dropout: nothing draws from the global RNG, and the audit measures the model
    try:
        val = validation_losses(model, data, device)
        samples = generate_samples(
            model, data, cfg.train.seed, device, own_threads=own_threads, prompts=prompts
        )
    finally:
        model.train(was_training)
    source = "train.audit_prompts" if cfg.train.audit_prompts else "held-out" if prompts[0][0] else "fixed"
    return {
        "step": step,
        "tokenizer": data.tokenizer.id,
        "settings": {
            "seed": cfg.train.seed,
            "temperature": TEMPERATURE,
            "new_tokens": NEW_TOKENS,
            "prompts": source,
        },
        "samples": samples,
        "metrics": {"val_loss": val, **text_metrics([s["completion"] for s in samples])},
    }


class Auditor:
    """Records the trainer's audits; one per trainer start. `record` audits now; `start` audits a copy
    of the weights on a thread (train.audit_async), one at a time, its errors reported by `log` (a
    file that cannot be written) or raised at the next `start` or `wait` (anything else)."""

    def __init__(
        self,
        run: RunDir,
        cfg: RunConfig,
        model: GPT,
        data: DataPipeline,
        device: str,
        start_step: int,
        log: Callable[[str], None] = print,
    ):
        self.run, self.cfg, self.model, self.data, self.device = run, cfg, model, data, device
        self.log, self.start_step = log, start_step
        self.on_written: Callable[[dict[str, Any]], None] | None = None
        self.prompts = audit_prompts(data, cfg)  # once: the same at every audit of this start's phase
        # Audits past the resume point belong to a timeline that was abandoned with its checkpoints.
        found = read_audits(run)
        self.audits = [a for a in found if a["step"] <= start_step]
        self.abandoned = len(found) - len(self.audits)  # dropped from the file by drop_abandoned()
        self._weights: GPT | None = None  # the copy a background audit reads, reused
        self._stream: Any = None  # on CUDA, the stream background audits run on
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # Steps whose audit is in `audits` but not in the file: a write that failed (a full disk, a
        # refusing store). Each later write carries them; `flush` retries at the next checkpoint and
        # at exit, so one failed write loses nothing while the trainer lives.
        self.unwritten: list[int] = []
        self._file = threading.Lock()  # the trainer's flush and a background audit's write

    def adopt(self, old: Auditor) -> None:
        """Take over the audits the previous segment's auditor (`old`) holds but could not write, those
        at or below this start's step (a guard rollback after a failed flush): they are written with the
        next checkpoint, as `old` would have written them; the file alone no longer has them."""
        carried = [a for a in old.audits if a["step"] in old.unwritten and a["step"] <= self.start_step]
        if carried:
            steps = {a["step"] for a in carried}
            mine = [a for a in self.audits if a["step"] not in steps]
            self.audits = sorted([*mine, *carried], key=lambda a: a["step"])[-KEEP_AUDITS:]
            self.unwritten = sorted(steps & {a["step"] for a in self.audits})

    def drop_abandoned(self) -> None:
        """Write the file without the audits past this start's step, if it has any (a guard rollback, a
        fallback past a torn checkpoint): left there, one would pass for the audit of its step retrained
        on another timeline if the trainer stopped between that checkpoint and its audit. A write that
        fails is logged; the next write drops them."""
        if not self.abandoned:
            return
        with self._file:
            try:
                self._store()
            except OSError as e:
                self.log(f"ERROR: the sample audits past step {self.start_step} could not be dropped: {e}")
                return
        self.abandoned = 0

    def record(self, step: int) -> dict[str, Any]:
        self.wait()
        audit = run_audit(self.model, self.data, self.cfg, step, self.device, prompts=self.prompts)
        self._write(audit)
        return audit

    def audit(self, step: int, background: bool = False) -> None:
        """The trainer's audit of `step`, now or (`background`) on a thread. A file that cannot be
        written is logged, not raised: the audit's file, not training, is what a full disk or a refusing
        store stops."""
        if background:
            self.start(step)
            return
        try:
            self.record(step)
        except OSError as e:
            self._not_written(step, e)

    def _not_written(self, step: int, e: OSError) -> None:
        self.log(
            f"ERROR: the sample audit of step {step} was NOT written: {type(e).__name__}: {e}; it is "
            "kept, and written with the next checkpoint"
        )

    def _write(self, audit: dict[str, Any]) -> None:
        with self._file:
            self.audits = [*(a for a in self.audits if a["step"] < audit["step"]), audit][-KEEP_AUDITS:]
            kept = {a["step"] for a in self.audits}
            self.unwritten = sorted({*(s for s in self.unwritten if s in kept), audit["step"]})
            self._store()
        self.log(audit_line(audit))
        if self.on_written is not None:
            self.on_written(audit)  # the TensorBoard view (trainer.py)

    def flush(self) -> None:
        """Write the audits a failed write left out of the file (at a checkpoint, and at exit). An
        audit in flight writes them itself; a write failing again is logged and retried next time."""
        if not self.unwritten or (self._thread is not None and self._thread.is_alive()):
            return
        with self._file:
            steps = self.unwritten
            try:
                self._store()
            except OSError as e:
                self.log(
                    f"ERROR: the sample audits of steps {steps} are still NOT written: "
                    f"{type(e).__name__}: {e}"
                )
                return
        self.log(f"the sample audits of steps {steps} are written (late)")

    def _store(self) -> None:
        """The file as `audits` holds it (under `_file`); `unwritten` is cleared only once it is."""
        self.run.write_json(SAMPLES, {"format": FORMAT, "audits": self.audits})
        self.unwritten = []

    @torch.no_grad()
    def start(self, step: int) -> None:
        """Audit the weights of `step` on a thread while training goes on."""
        self.wait()  # the previous audit is done with the copy
        if self._weights is None:
            # A copy, not a new GPT: initialising one would draw from the global RNG training uses.
            self._weights = copy.deepcopy(self.model).requires_grad_(False)
            self._stream = torch.cuda.Stream(self.device) if self.device.startswith("cuda") else None
        else:
            for mine, theirs in zip(self._weights.parameters(), self.model.parameters(), strict=True):
                mine.copy_(theirs)  # on CUDA: queued after the step's optimizer update
        ready = None
        if self.device.startswith("cuda"):
            ready = torch.cuda.Event()
            ready.record()
        self._thread = threading.Thread(
            target=self._run, args=(step, ready), name="andrea-audit", daemon=True
        )
        self._thread.start()

    def _run(self, step: int, ready: Any) -> None:
        try:
            stream = self._stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None:
                    stream.wait_event(ready)  # the copy of this step's weights is complete
                # It ends in reads to the host: nothing of it is left queued when the thread ends.
                audit = run_audit(
                    self._weights,
                    self.data,
                    self.cfg,
                    step,
                    self.device,
                    own_threads=False,
                    prompts=self.prompts,
                )
            self._write(audit)
        except OSError as e:
            self._not_written(step, e)
        except BaseException as e:
            self._error = e

    def wait(self) -> None:
        """Until the audit in flight is written; its failure, other than writing, is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
