"""The GPU path's behaviours, checked on the CPU: the KV cache and batched prompts of the sample audit,
the trainer's one-step-late loss read and batch prefetch, gradient accumulation, the fused chunked
head and loss."""

from __future__ import annotations

import functools
import signal
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, last_logged_step, start_trainer, wait_for
from tiny import tiny_config

from andrea_core.checkpoint import checkpoint_name
from andrea_core.config import ConfigError, load_run_config
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import load_policy
from andrea_core.model.gpt import GPT
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir
from andrea_core.run.samples import read_audits
from andrea_core.train import audit as audit_module
from andrea_core.train.audit import generate_samples, prompt_generator, validation_losses
from andrea_core.train.trainer import Trainer

PROMPTS = [[10, 20, 30, 40], [50, 60, 70, 80, 90, 100, 110], [120], [130, 140, 150, 160, 170, 180]]


@functools.cache
def _trained_weights(seed: int) -> dict[str, torch.Tensor]:
    """The weights of tiny_model(seed), trained once per module (on one thread, whichever test asks
    first) rather than once per test: 9 tests asked for the same 30 steps."""
    cfg = load_run_config(TINY)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = GPT(cfg.model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        text = torch.tensor(list(b"def f(x):\n    return x + 1\n" * 40))
        for i in range(30):
            x = torch.stack([text[j : j + 64] for j in range(i, i + 64, 8)])
            y = torch.stack([text[j + 1 : j + 65] for j in range(i, i + 64, 8)])
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def tiny_model(seed: int = 0) -> GPT:
    """andrea-tiny (block_size 64), trained a little so that its distributions are not near-uniform: a
    fresh model of its own (a test may train or change it) holding _trained_weights(seed)."""
    model = GPT(load_run_config(TINY).model)
    model.load_state_dict(_trained_weights(seed))
    return model.eval()


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    width = max(map(len, prompts))
    return torch.tensor([[0] * (width - len(p)) + p for p in prompts]), [len(p) for p in prompts]


def generators(seed: int, n: int) -> list[torch.Generator]:
    return [prompt_generator(seed, i, "cpu") for i in range(n)]


# 100 new tokens run past block_size 64: the cache gives way to the sliding window there.
@pytest.mark.parametrize("new_tokens", [24, 100])
def test_cached_and_uncached_generation_give_the_same_tokens(one_thread, new_tokens):
    model = tiny_model()
    idx, lengths = left_padded(PROMPTS)
    for seed in range(6):
        for temperature in (0.8, 1.0):
            cached = model.generate(idx, new_tokens, temperature, generators(seed, 4), lengths=lengths)
            plain = model.generate(
                idx, new_tokens, temperature, generators(seed, 4), lengths=lengths, use_cache=False
            )
            assert cached.shape == (4, idx.shape[1] + new_tokens)
            assert torch.equal(cached, plain), (seed, temperature)
            for i, prompt in enumerate(PROMPTS):  # and one prompt alone, no padding
                one = [prompt_generator(seed, i, "cpu")]
                alone = model.generate(torch.tensor([prompt]), new_tokens, temperature, one)
                one = [prompt_generator(seed, i, "cpu")]
                alone_plain = model.generate(
                    torch.tensor([prompt]), new_tokens, temperature, one, use_cache=False
                )
                assert torch.equal(alone, alone_plain), (seed, i)


def test_a_batch_of_prompts_gives_each_prompt_what_it_gets_alone(one_thread):
    model = tiny_model()
    idx, lengths = left_padded(PROMPTS)
    width = idx.shape[1]
    for seed in range(6):
        batch = model.generate(idx, 40, 0.8, generators(seed, 4), lengths=lengths)
        for i, prompt in enumerate(PROMPTS):
            alone = model.generate(torch.tensor([prompt]), 40, 0.8, [prompt_generator(seed, i, "cpu")])
            assert torch.equal(batch[i, width - len(prompt) :], alone[0]), (seed, i)
            assert batch[i, : width - len(prompt)].eq(0).all()  # the padding is left as it was


def test_the_audits_samples_are_each_prompts_own_and_its_validation_losses_the_per_arm_ones(one_thread):
    cfg = load_run_config(TINY)
    data = DataPipeline(cfg, load_policy(cfg.data.policy)[0], warn=lambda line: None)
    model = tiny_model()
    samples = generate_samples(model, data, cfg.train.seed, "cpu")
    for i, s in enumerate(samples):
        prompt = data.tokenizer.encode(s["prompt"])
        gen = [prompt_generator(cfg.train.seed, i, "cpu")]
        alone = model.generate(torch.tensor([prompt]), 64, 0.8, gen)[0, len(prompt) :].tolist()
        assert s["completion"] == data.tokenizer.decode(alone)
    batched = validation_losses(model, data, "cpu")
    for arm in data.arms:  # one forward for all arms gives each arm's own loss, to float32 rounding
        x, y = data.val_batch(arm, 8)
        with torch.no_grad():
            alone = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).item()
        assert batched[arm] == pytest.approx(alone, rel=1e-6, abs=0)


class RecordingTrainer(Trainer):
    """The real trainer; it only notes the loss tensors its steps return and the order in which the
    data pipeline is asked for batches and told of losses (the prefetch thread asks from its own)."""

    def _build(self) -> None:
        super()._build()
        self.losses: list[torch.Tensor] = []
        self.events: list[tuple[str, int]] = []
        lock = threading.Lock()
        batch, observe = self.data.batch, self.data.observe

        def recorded_batch(step, **kwargs):  # the guard's data position passes through
            with lock:
                self.events.append(("batch", step))
            return batch(step, **kwargs)

        def recorded_observe(step, arm, loss):
            with lock:
                self.events.append(("observe", step))
            return observe(step, arm, loss)

        self.data.batch, self.data.observe = recorded_batch, recorded_observe

    def _step(self, x, y, step=None):
        loss = super()._step(x, y, step)
        self.losses.append(loss.clone())
        return loss


def test_logged_losses_are_the_steps_tensors_and_the_mixer_hears_of_s_before_batch_s_plus_2(tmp_path):
    cfg = load_run_config(tiny_config(tmp_path, train__checkpoint_every=7, data__policy="tiny-mix"))
    trainer = RecordingTrainer(str(tmp_path / "run"), cfg, max_steps=25, log=lambda line: None)
    trainer.train()
    logged = {e.step: e.loss for e in read_history(RunDir(str(tmp_path / "run")))}
    assert logged == {s: loss.item() for s, loss in enumerate(trainer.losses, start=1)}
    at = {event: i for i, event in enumerate(trainer.events)}
    assert sorted(at) == sorted([("batch", s) for s in range(1, 26)] + [("observe", s) for s in range(1, 25)])
    for s in range(1, 25):
        assert at[("batch", s + 1)] < at[("observe", s)], s  # one step late ...
        if s + 2 <= 25:
            assert at[("observe", s)] < at[("batch", s + 2)], s  # ... and never later


def test_grad_accum_steps_must_divide_the_batch(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"train.grad_accum_steps must be a positive divisor of "
        r"train.batch_size \(8\), got 3",
    ):
        load_run_config(tiny_config(tmp_path, train__grad_accum_steps=3))
    with pytest.raises(ConfigError, match=r"train.grad_accum_steps must be a positive divisor"):
        load_run_config(tiny_config(tmp_path, train__grad_accum_steps=0))


def train_each(tmp_path, field: str, values, max_steps: int, **overrides) -> dict:
    """One andrea-tiny run per value of `field` (a train.* setting), trained in this process to
    `max_steps`; the run directories by value."""
    runs = {}
    for value in values:
        path = tiny_config(tmp_path, name=f"{field}-{value}", **{f"train__{field}": value}, **overrides)
        runs[value] = tmp_path / f"{field}-{value}"
        Trainer(str(runs[value]), load_run_config(path), max_steps=max_steps, log=lambda line: None).train()
    return runs


def test_two_micro_batches_of_4_train_as_one_batch_of_8(tmp_path):
    runs = train_each(tmp_path, "grad_accum_steps", (1, 2), 40)
    one, two = (read_history(RunDir(str(runs[a]))) for a in (1, 2))
    assert [e.step for e in one] == [e.step for e in two] == list(range(1, 41))
    assert [(e.lr, e.arm, e.tokens) for e in one] == [(e.lr, e.arm, e.tokens) for e in two]
    diffs = [abs(a.loss - b.loss) for a, b in zip(one, two, strict=True)]
    weights = [RunDir(str(r)).read_checkpoint(40).weights for r in runs.values()]
    print(f"|loss(2x4) - loss(1x8)|: step 1 {diffs[0]:.2e}, max over 40 steps {max(diffs):.2e}")
    assert diffs[0] <= 2e-6  # the same weights, the same tokens: the mean of means, rounded
    assert max(diffs) <= 1e-4  # float32 rounding, compounded over 40 optimizer steps
    assert abs(weights[0] - weights[1]).max() <= 1e-4


@pytest.mark.slow
def test_sigterm_and_resume_are_bit_exact_with_gradient_accumulation(tmp_path):
    """B stops off the grid (between 10 and 30), resumes across checkpoint 30 and ends at 31 with A's
    bytes (31 steps, not 60: one step past the grid checkpoint is as much a case as 30, each step is 4
    micro-batches; the stop still has 20 steps of room before the grid)."""
    config = tiny_config(tmp_path, train__grad_accum_steps=4, train__checkpoint_every=30)
    a, b = tmp_path / "a", tmp_path / "b"
    Trainer(str(a), load_run_config(config), max_steps=31, log=lambda line: None).train()
    proc = start_trainer("--config", config, "--run-dir", str(b), "--max-steps", "31", "--pace", "0.03")
    wait_for(lambda: last_logged_step(b) >= 10, what="step 10")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    stopped = RunDir(str(b)).checkpoint_steps()[-1]
    assert 10 <= stopped < 30
    Trainer(str(b), max_steps=31, log=lambda line: None).train()
    assert RunDir(str(b)).checkpoint_steps() == [stopped, 30, 31]  # the resume crossed the grid
    assert (a / checkpoint_name(31)).read_bytes() == (b / checkpoint_name(31)).read_bytes()
    assert [(e.step, e.loss) for e in read_history(RunDir(str(a)))] == [
        (e.step, e.loss) for e in read_history(RunDir(str(b)))
    ]


@pytest.mark.parametrize("chunk", [1, 100, 511, 512, 4096])
def test_the_fused_chunked_head_and_loss_equal_the_plain_ones(chunk):
    """LinearCrossEntropy: the same loss and the same gradient of every parameter as the plain head and
    cross-entropy, up to float32 rounding, whatever the chunk (one token, uneven, exact, larger)."""
    model = tiny_model()
    model.train()
    tokens = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(3))
    x, y = tokens[:, :-1], tokens[:, 1:]
    results = []
    for loss_chunk in (0, chunk):
        logits, loss = model(x, y, loss_chunk=loss_chunk)
        assert (logits is None) == (loss_chunk > 0)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    (plain, plain_grads), (fused, fused_grads) = results
    assert abs(plain.item() - fused.item()) <= 2e-6 * plain.item()
    for (name, _), a, b in zip(model.named_parameters(), plain_grads, fused_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), name


def test_a_run_with_the_fused_loss_trains_like_the_plain_one_and_is_refused_when_negative(tmp_path):
    runs = train_each(tmp_path, "loss_chunk_tokens", (0, 200), 30)
    histories = {chunk: read_history(RunDir(str(run))) for chunk, run in runs.items()}
    diffs = [abs(a.loss - b.loss) for a, b in zip(histories[0], histories[200], strict=True)]
    assert len(diffs) == 30 and diffs[0] <= 2e-6 and max(diffs) <= 1e-4
    with pytest.raises(ConfigError, match=r"train.loss_chunk_tokens must be >= 0"):
        load_run_config(tiny_config(tmp_path, train__loss_chunk_tokens=-1))
    with pytest.raises(ConfigError, match=r"train.compile_mode must be one of default, reduce-overhead"):
        load_run_config(tiny_config(tmp_path, train__compile_mode="fastest"))


def test_background_audits_are_the_same_audits_and_change_nothing_of_training(tmp_path):
    """train.audit_async: each audit from a copy of its step's weights on a thread, while training goes
    on. The same .samples.json byte for byte (the last step's audit, still in flight at the end, is
    waited for), the same losses, the same final checkpoint. Four audits in 30 steps (every 10), not 60
    (every 20): the steps between audits add no case."""
    runs = train_each(tmp_path, "audit_async", (False, True), 30, train__checkpoint_every=10)
    sync, background = runs[False], runs[True]
    assert [a["step"] for a in read_audits(RunDir(str(background)))] == [0, 10, 20, 30]
    assert (sync / ".samples.json").read_bytes() == (background / ".samples.json").read_bytes()
    assert [(e.step, e.loss) for e in read_history(RunDir(str(sync)))] == [
        (e.step, e.loss) for e in read_history(RunDir(str(background)))
    ]
    assert (sync / checkpoint_name(30)).read_bytes() == (background / checkpoint_name(30)).read_bytes()


class AuditWatchingTrainer(Trainer):
    """The real trainer; each step notes itself, and each audit of a step before the last waits (up to
    60 s) until the trainer has taken a later step: only an audit in the background lets it."""

    def _build(self) -> None:
        super()._build()
        self.steps_taken = 0
        self.audits: list[tuple[int, str, bool]] = []  # (step, thread, whether training went on meanwhile)
        self.stepped = threading.Condition()
        real = audit_module.run_audit

        def watched_audit(model, data, cfg, step, device, **kw):
            with self.stepped:
                at = self.steps_taken
                went_on = step == self.max_steps or self.stepped.wait_for(
                    lambda: self.steps_taken > at, timeout=60
                )
            self.audits.append((step, threading.current_thread().name, went_on))
            return real(model, data, cfg, step, device, **kw)

        self._unpatch = lambda: setattr(audit_module, "run_audit", real)
        audit_module.run_audit = watched_audit

    def _step(self, x, y, step=None):
        loss = super()._step(x, y, step)
        with self.stepped:
            self.steps_taken += 1
            self.stepped.notify_all()
        return loss


def test_audit_async_audits_on_a_thread_while_the_trainer_takes_its_next_steps(tmp_path):
    cfg = load_run_config(tiny_config(tmp_path, train__audit_async=True, train__checkpoint_every=10))
    trainer = AuditWatchingTrainer(str(tmp_path / "run"), cfg, max_steps=30, log=lambda line: None)
    try:
        trainer.train()
    finally:
        trainer._unpatch()
    # Step 0's audit (the untrained baseline) is taken as the trainer is built; the others are the
    # background's, each with the trainer a step further on before it began.
    assert trainer.audits == [
        (10, "andrea-audit", True),
        (20, "andrea-audit", True),
        (30, "andrea-audit", True),
    ]
    assert [a["step"] for a in read_audits(RunDir(str(tmp_path / "run")))] == [0, 10, 20, 30]
