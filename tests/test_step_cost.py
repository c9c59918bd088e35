"""What a CPU step of the trainer costs besides its model (issue 31), kept to what nanoGPT's loop pays:
no batch thread to hand over to, one fused AdamW kernel per tensor, a step seed that seeds only what
the step draws from. Each keeps the bits: the trainer's losses are a plain loop's, dropout included.
Speed itself is shown by bench/peer_nanogpt.py, never timed here."""

from __future__ import annotations

import threading

import torch
from conftest import TINY, andrea_imports
from tiny import tiny_config

from andrea_core.checkpoint import checkpoint_name
from andrea_core.config import load_run_config
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import load_policy
from andrea_core.data.tokens import run_tokenizer
from andrea_core.model.gpt import GPT
from andrea_core.run.loss_log import read_history
from andrea_core.run.rundir import RunDir
from andrea_core.train.optim import build_optimizer, lr_at
from andrea_core.train.trainer import Trainer, step_seed


class ThreadRecordingTrainer(Trainer):
    """The real trainer; it notes which thread draws each batch."""

    def _build(self) -> None:
        super()._build()
        self.drawn_on: list[str] = []
        batch = self.data.batch

        def recorded(step, **kwargs):
            self.drawn_on.append(threading.current_thread().name)
            return batch(step, **kwargs)

        self.data.batch = recorded


def test_a_cpu_trainer_draws_every_batch_on_the_thread_that_trains(tmp_path):
    cfg = load_run_config(tiny_config(tmp_path, train__checkpoint_every=5, train__sample_every=10**6))
    run = str(tmp_path / "run")
    trainer = ThreadRecordingTrainer(run, cfg, max_steps=12, device="cpu", log=lambda m: None)
    trainer.train()
    # A background builder on a CPU competes with the step's own threads for the cores, and the loop
    # takes the batch right after starting it: there is nothing for it to overlap.
    assert trainer.drawn_on == [threading.main_thread().name] * 12
    assert not [t.name for t in threading.enumerate() if t.name.startswith("andrea-batch")]


def test_the_cpu_optimizer_is_fused_adamw():
    cfg = load_run_config(TINY)
    optimizer = build_optimizer(GPT(cfg.model), cfg.train, "cpu")
    # One kernel per tensor instead of a dozen passes and temporaries (the for-loop AdamW nanoGPT gets
    # on a CPU): a third of the time the optimizer took, at 37 parameter tensors.
    assert [g["fused"] for g in optimizer.param_groups] == [True, True]


def test_trainer_losses_with_dropout_are_a_plain_loops_bit_for_bit(tmp_path):
    """The step seed reaches dropout exactly as torch.manual_seed(step_seed) would, and the trainer's
    step is a plain loop's over torch's own fused AdamW, bit for bit: 30 steps, dropout 0.1,
    checkpoints on the way; the losses, and the weights, m and v of the last checkpoint."""
    cfg = load_run_config(
        tiny_config(tmp_path, model__dropout=0.1, train__checkpoint_every=10, train__sample_every=10**6)
    )
    run = tmp_path / "run"
    Trainer(str(run), cfg, max_steps=30, device="cpu", log=lambda m: None).train()
    logged = [e.loss for e in read_history(RunDir(str(run)))]

    torch.set_num_threads(cfg.train.num_threads)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    # torch.optim.AdamW itself over build_optimizer's groups and settings (train/adamw.py's class skips
    # only torch's wrappers).
    optimizer = torch.optim.AdamW(build_optimizer(model, cfg.train, "cpu").param_groups)
    data = DataPipeline(cfg, load_policy(cfg.data.policy)[0], tokenizer=run_tokenizer(RunDir(str(run)), cfg))
    losses = []
    for step in range(1, 31):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.train)
        batch = data.batch(step)  # stdlib-only: one arm, a uniform mixer that learns nothing
        torch.manual_seed(step_seed(cfg.train.seed, step))
        _, loss = model(batch.x, batch.y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert logged == losses
    params = list(model.parameters())
    plain = torch.cat(
        [torch.cat([p.detach().reshape(-1) for p in params])]
        + [torch.cat([optimizer.state[p][k].reshape(-1) for p in params]) for k in ("exp_avg", "exp_avg_sq")]
    )
    saved = RunDir(str(run)).read_checkpoint(30, model.n_params)
    assert torch.equal(torch.from_numpy(saved.flat.copy()), plain)


# Imported by nothing a trainer start needs: torch.optim's methods import torch._dynamo on their first
# call (1.5 s of a 3.7-s CPU trainer start, measured) only to mark themselves for a compiler that never
# traces them here; tensorboard's TensorFlow stub (boto3, absl: 0.27 CPU-s) held the only masked CRC-32C
# the event files need (andrea_core/train/tensorboard.py has its own).
NEVER_AT_START = "torch._dynamo,tensorboard.compat.tensorflow_stub"


def test_a_trainer_start_and_resume_import_nothing_they_never_use(tmp_path):
    """A real `andrea train` that creates a run, trains, writes its TensorBoard events and checkpoints,
    and one that resumes it, import none of NEVER_AT_START."""
    config = tiny_config(tmp_path, train__max_steps=4, train__checkpoint_every=2)
    run = str(tmp_path / "run")
    train = ("train", "--run-dir", run, "--device", "cpu")
    assert not andrea_imports(NEVER_AT_START, *train, "--config", config, "--max-steps", "2")
    assert RunDir(run).checkpoint_steps() == [2]
    assert not andrea_imports(NEVER_AT_START, *train, "--max-steps", "4")
    assert RunDir(run).checkpoint_steps() == [2, 4]
    assert len(RunDir(run).listdir("tensorboard")) == 2  # a segment a start: the events were written


def test_a_cpu_resume_under_the_fused_adamw_is_bit_exact(tmp_path):
    """Its step count, m and v come back from the checkpoint into the fused kernel's state: 20 steps
    straight and 10 + a resume to 20 write the same checkpoint bytes (tests/test_resume.py does it
    with signals at andrea-tiny's one thread)."""
    cfg = load_run_config(tiny_config(tmp_path, train__checkpoint_every=10, train__sample_every=10**6))
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    Trainer(straight, cfg, max_steps=20, device="cpu", log=lambda m: None).train()
    Trainer(resumed, cfg, max_steps=10, device="cpu", log=lambda m: None).train()
    Trainer(resumed, cfg, max_steps=20, device="cpu", log=lambda m: None).train()
    name = checkpoint_name(20)
    assert (tmp_path / "straight" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes()
