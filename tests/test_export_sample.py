"""`andrea export` (a Hugging Face GPT2LMHeadModel folder) and `andrea sample`, end to end on andrea-tiny.

The reference model in these tests is restored the trainer's way (GPT + AdamW + checkpoint.restore),
not through the export's or the sampler's own loading code, so that a mistake shared by those two
cannot pass unseen.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import andrea, andrea_imports, library_run
from tiny import tiny_config

from andrea_core.checkpoint import checkpoint_name, encode, restore
from andrea_core.config import load_run_config
from andrea_core.data.tokens import run_tokenizer
from andrea_core.model.gpt import GPT
from andrea_core.ops.export import ExportError, gpt2_state_dict
from andrea_core.run.record import read_run
from andrea_core.run.rundir import TOKENIZER_JSON, RunDir
from andrea_core.train.optim import build_optimizer

STEPS, EVERY = 20, 10


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """andrea-tiny (raw bytes), checkpoints at steps 10 and 20: the library's run of that recipe
    (conftest.library_run, test_fork's, test_pivot_abandon's and test_pivot_elsewhere's: one training
    for all), this module's copy. Exporting and sampling are not about training: any two checkpoints
    whose models differ serve (the logits' size is asserted where it matters)."""
    run = tmp_path_factory.mktemp("export") / "run"
    every = dict(train__checkpoint_every=EVERY, train__sample_every=10**6)
    library_run(tmp_path_factory, run, STEPS, "--device", "cpu", **every)
    assert RunDir(str(run)).checkpoint_steps() == [EVERY, STEPS]
    return run


def reference_model(run_dir: Path, step: int) -> GPT:
    run = RunDir(str(run_dir))
    cfg = read_run(run).config
    model = GPT(cfg.model)
    ckpt = run.read_checkpoint(step, model.n_params)
    restore(ckpt, model, build_optimizer(model, cfg.train, "cpu"))
    return model.eval()


def tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def corrupt_copy(run_dir: Path, dest: Path, step: int) -> Path:
    """A copy of the run whose checkpoint `step` has a NaN in its weights, as a diverged trainer writes it:
    size, header and checksum intact (a NaN the checksum does not cover is refused for its checksum)."""
    shutil.copytree(run_dir, dest)
    path = dest / checkpoint_name(step)
    data = path.read_bytes()
    n = int.from_bytes(data[4:8], "little", signed=True)
    flat = np.frombuffer(data, dtype="<f4", count=3 * n, offset=8).copy()
    flat[10] = np.nan
    path.write_bytes(encode(step, flat))
    return path


def assert_refused(proc, *names: str) -> None:
    """Exit status 2 and one line on stderr that names each of `names`; nothing on stdout."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for name in names:
        assert name in lines[0], lines[0]
    assert proc.stdout == ""


# --- export ----------------------------------------------------------------------------------------


def test_export_loads_in_transformers_with_the_same_logits(trained, tmp_path):
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    out = tmp_path / "hf"
    proc = andrea("export", str(trained), str(out))
    assert f"{checkpoint_name(STEPS)}" in proc.stdout
    # A bytes run's tokenizer.json is written for it (byte-level, id = byte value: see below).
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"]
    assert config["tie_word_embeddings"] is False
    assert config["activation_function"] == "gelu"
    assert (config["n_positions"], config["vocab_size"], config["dtype"]) == (64, 256, "float32")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["andrea_step"] == str(STEPS)
        zero_biases = [k for k in f.keys() if k.endswith(("c_attn.bias", "c_proj.bias", "c_fc.bias"))]
        assert len(zero_biases) == 2 * 4  # two layers: c_attn, attn.c_proj, c_fc, mlp.c_proj
        assert all(not f.get_tensor(k).any() for k in zero_biases)

    hf, info = GPT2LMHeadModel.from_pretrained(str(out), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing, unexpected or mismatched keys
    hf.eval()
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()  # untied

    ours = reference_model(trained, STEPS)
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, _ = ours(tokens)
        got = hf(tokens).logits
    diff = (want - got).abs().max().item()
    assert diff <= 1e-4, f"max abs logit difference {diff}"
    # The test can fail: GPT-2's default tanh GELU alone moves these logits by more than the bound.
    assert want.abs().max().item() > 1.0


def test_export_of_an_older_step_and_in_bfloat16(trained, tmp_path):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    andrea("export", str(trained), str(tmp_path / "f32"), "--step", str(EVERY))
    andrea("export", str(trained), str(tmp_path / "bf16"), "--step", str(EVERY), "--dtype", "bfloat16")
    f32, bf16 = (
        load_file(str(tmp_path / "f32" / "model.safetensors")),
        load_file(str(tmp_path / "bf16" / "model.safetensors")),
    )
    assert f32.keys() == bf16.keys()
    for k in f32:
        assert bf16[k].dtype == torch.bfloat16
        assert torch.equal(bf16[k], f32[k].to(torch.bfloat16)), k
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"

    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "f32")).eval()
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, _ = reference_model(trained, EVERY)(tokens)
        assert (want - hf(tokens).logits).abs().max().item() <= 1e-4
        newest, _ = reference_model(trained, STEPS)(tokens)
        assert (newest - hf(tokens).logits).abs().max().item() > 1e-2  # it really is step 10's model


def test_export_refuses_a_corrupt_checkpoint_and_touches_nothing(trained, tmp_path):
    run = tmp_path / "run"
    corrupt_copy(trained, run, STEPS)
    before = tree_digest(run)
    out = tmp_path / "hf"
    proc = andrea("export", str(run), str(out), "--step", str(STEPS), check=False)
    assert_refused(proc, str(run / checkpoint_name(STEPS)), "non-finite value in weights at index 10")
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")] == []
    assert tree_digest(run) == before

    # Without --step the newest valid checkpoint is exported, and the refused one is named.
    proc = andrea("export", str(run), str(out))
    assert checkpoint_name(EVERY) in proc.stdout
    assert f"{checkpoint_name(STEPS)}: non-finite value in weights" in proc.stderr
    assert tree_digest(run) == before


def test_export_bad_inputs_exit_2_naming_them(trained, tmp_path):
    assert_refused(
        andrea("export", str(tmp_path / "nope"), str(tmp_path / "o"), check=False), "nope", "run.yaml"
    )
    proc = andrea("export", str(trained), str(tmp_path / "o"), "--step", "70", check=False)
    assert_refused(proc, str(trained / checkpoint_name(70)), "no such file")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert_refused(andrea("export", str(trained), str(busy), check=False), str(busy), "not an empty folder")
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    assert_refused(
        andrea("export", str(trained), "s3://bucket/hf", check=False), "s3://bucket/hf", "local folder"
    )
    assert not (tmp_path / "o").exists()


def test_export_never_unpickles(trained, tmp_path, monkeypatch):
    from andrea_core.ops.export import export_checkpoint

    def refuse(*a, **k):
        raise AssertionError("export unpickled something")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    result = export_checkpoint(str(trained), tmp_path / "hf")
    assert result.step == STEPS


def test_export_of_a_bpe_run_carries_its_tokenizer(tmp_path):
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

    run = tmp_path / "bpe-run"
    cfg = tiny_config(tmp_path, "tiny-bpe", data__tokenizer="bpe", model__vocab_size=384)
    andrea("train", "--config", cfg, "--run-dir", str(run), "--max-steps", "2")
    out = tmp_path / "hf"
    andrea("export", str(run), str(out))
    assert (out / TOKENIZER_JSON).read_bytes() == (run / TOKENIZER_JSON).read_bytes()

    text = "def read_config(path):\n    return open(path).read()\n"
    ours = run_tokenizer(RunDir(str(run)), read_run(RunDir(str(run))).config)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(out / TOKENIZER_JSON))
    ids = hf_tok(text)["input_ids"]
    assert ids == ours.encode(text) and max(ids) >= 256  # real merges, not bytes
    hf = GPT2LMHeadModel.from_pretrained(str(out)).eval()
    with torch.no_grad():
        want, _ = reference_model(run, 2)(torch.tensor([ids]))
        assert (want - hf(torch.tensor([ids])).logits).abs().max().item() <= 1e-4


def test_export_of_a_bytes_run_round_trips_bytes_and_generates_within_its_context(trained, tmp_path):
    from transformers import GenerationConfig, GPT2LMHeadModel, PreTrainedTokenizerFast

    out = tmp_path / "hf"
    andrea("export", str(trained), str(out))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(out / TOKENIZER_JSON))
    text = "def f(x):\r\n\treturn x  # héllo ☃ \x00\x7f\n\n  end"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8")) and len(tok) == 256  # the ids are the bytes
    assert tok.decode(ids) == text
    assert GenerationConfig.from_pretrained(str(out)).max_length == 64  # andrea-tiny's block_size
    # generate without a length stops at the context: the model has no position past it (an
    # IndexError before generation_config.json said so).
    hf = GPT2LMHeadModel.from_pretrained(str(out)).eval()
    prompt = torch.tensor([tok("def ")["input_ids"]])
    with torch.no_grad():
        got = hf.generate(prompt, do_sample=False, pad_token_id=0)
    assert got.shape == (1, 64)
    greedy = reference_model(trained, STEPS)
    idx = prompt
    with torch.no_grad():
        while idx.shape[1] < 64:
            logits, _ = greedy(idx)
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert got.tolist() == idx.tolist()


# --- sample ----------------------------------------------------------------------------------------


def reference_sample(
    run_dir: Path, step: int, prompt: str, tokens: int, temperature: float, seed: int
) -> str:
    """The sampler's contract written out, apart from `GPT.generate` (no KV cache, no batching): all
    `tokens` uniform numbers drawn up front from a generator seeded with `seed`, and token t the first
    whose cumulative softmax(logits / temperature) passes the t-th of them, over a full forward pass of
    the newest block_size tokens."""
    model = reference_model(run_dir, step)
    block = model.cfg.block_size
    idx = list(prompt.encode())
    u = torch.rand(1, tokens, generator=torch.Generator().manual_seed(seed))[0]
    with torch.no_grad():
        for t in range(tokens):
            logits, _ = model(torch.tensor([idx[-block:]]))
            cdf = torch.softmax(logits[0, -1].float() / temperature, dim=-1).cumsum(0)
            idx.append(min(int((cdf <= u[t] * cdf[-1]).sum()), len(cdf) - 1))
    return bytes(idx).decode("utf-8", errors="replace")


def sampled(*args: str) -> dict:
    """`andrea sample ... --json`: JSON keeps every generated character (a pipe in text mode would
    turn a sampled carriage return into a newline)."""
    return json.loads(andrea("sample", *args, "--json").stdout)


@pytest.mark.slow
def test_sample_is_the_checkpoints_text_for_a_seed(trained):
    args = (str(trained), "--prompt", "def ", "--tokens", "48", "--temperature", "0.9")
    first = sampled(*args, "--seed", "3")
    assert (first["step"], first["device"], first["prompt"]) == (STEPS, "cpu", "def ")
    assert "def " + first["completion"] == reference_sample(trained, STEPS, "def ", 48, 0.9, 3)
    assert sampled(*args, "--seed", "4")["completion"] != first["completion"]
    older = sampled(*args, "--seed", "3", "--step", str(EVERY))
    assert (older["step"], "def " + older["completion"]) == (
        EVERY,
        reference_sample(trained, EVERY, "def ", 48, 0.9, 3),
    )

    plain = andrea("sample", *args, "--seed", "3")  # the operator's form: the text on stdout
    assert plain.stdout.startswith("def ") and len(plain.stdout) > 40


def test_sample_top_k_1_is_greedy(trained):
    model = reference_model(trained, STEPS)
    idx = torch.tensor([list(b"import ")])
    with torch.no_grad():
        for _ in range(32):  # greedy decoding, written out: the likeliest token every time
            logits, _ = model(idx[:, -64:])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    greedy = bytes(idx[0].tolist()).decode("utf-8", errors="replace")
    out = sampled(str(trained), "--prompt", "import ", "--tokens", "32", "--top-k", "1", "--seed", "5")
    assert "import " + out["completion"] == greedy


def test_sample_temperature_0_is_greedy_and_the_settings_line_is_plain(trained):
    model = reference_model(trained, STEPS)
    idx = torch.tensor([list(b"class ")])
    with torch.no_grad():
        for _ in range(24):
            logits, _ = model(idx[:, -64:])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    greedy = bytes(idx[0].tolist()).decode("utf-8", errors="replace")
    for seed in ("1", "2"):  # greedy: the seed changes nothing
        out = sampled(
            str(trained), "--prompt", "class ", "--tokens", "24", "--temperature", "0", "--seed", seed
        )
        assert "class " + out["completion"] == greedy
    plain = andrea("sample", str(trained), "--prompt", "class ", "--tokens", "24", "--temperature", "0")
    assert plain.stderr == f"# {trained} step {STEPS} on cpu: 24 tokens, greedy (temperature 0)\n"
    plain = andrea("sample", str(trained), "--prompt", "class ", "--tokens", "5", "--top-k", "3")
    assert plain.stderr == f"# {trained} step {STEPS} on cpu: 5 tokens, temperature 0.8, top-k 3, seed 0\n"
    proc = andrea("sample", str(trained), "--prompt", "x", "--temperature", "-1", check=False)
    assert_refused(proc, "--temperature -1.0: must be 0 (greedy) or positive")


def test_sample_and_export_never_import_torch_dynamo(trained, tmp_path):
    """Their model is built on the meta device, where each weight init would run torch's Python
    reference and import torch._dynamo (1.5 s of a 3.5-s `andrea sample`): the inits are skipped there
    (model/weights.py). Real commands, run to a clean exit; the export is a loadable folder."""
    assert not andrea_imports("torch._dynamo", "sample", str(trained), "--prompt", "def", "--tokens", "8")
    assert not andrea_imports("torch._dynamo", "export", str(trained), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").is_file()


def test_sample_bad_inputs_exit_2_naming_them(trained, tmp_path):
    assert_refused(andrea("sample", str(tmp_path / "nope"), "--prompt", "x", check=False), "nope", "run.yaml")
    proc = andrea("sample", str(trained), "--step", "70", "--prompt", "x", check=False)
    assert_refused(proc, str(trained / checkpoint_name(70)), "no such file")
    run = tmp_path / "run"
    corrupt_copy(trained, run, EVERY)
    before = tree_digest(run)
    proc = andrea("sample", str(run), "--step", str(EVERY), "--prompt", "x", check=False)
    assert_refused(proc, str(run / checkpoint_name(EVERY)), "non-finite value in weights")
    assert tree_digest(run) == before
    assert_refused(andrea("sample", str(trained), "--prompt", "", check=False), "--prompt")
    assert_refused(andrea("sample", str(trained), "--prompt", "x", "--top-k", "0", check=False), "--top-k")


# --- issue 43.17 (review): export's modes -------------------------------------------------------------------


def test_export_writes_every_file_with_one_mode(tmp_path):
    """model.safetensors was 0600 (safetensors' own create), config.json and the others 0644."""
    from conftest import TINY

    from andrea_core.config import load_run_config
    from andrea_core.ops.export import export_checkpoint
    from andrea_core.train.trainer import Trainer

    cfg = load_run_config(TINY).with_overrides({"train.checkpoint_every": 2, "train.sample_every": 10**6})
    Trainer(str(tmp_path / "run"), cfg, max_steps=2, device="cpu", log=lambda m: None).train()
    out = tmp_path / "hf"
    old = os.umask(0o022)
    try:
        result = export_checkpoint(str(tmp_path / "run"), out)
    finally:
        os.umask(old)
    modes = {name: (out / name).stat().st_mode & 0o777 for name in result.files}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


# --- export (issue 30: a promise no test held the code to)


def test_export_fails_naming_a_parameter_missing_from_its_rename_table():
    model = GPT(load_run_config("andrea-tiny").model)
    named = dict(model.named_parameters())
    assert set(gpt2_state_dict(named))  # every parameter of today's model has its GPT-2 name
    named["blocks.0.attn.rotary.inv_freq"] = torch.zeros(4)  # a parameter a later model might add
    with pytest.raises(
        ExportError, match=r"parameter blocks\.0\.attn\.rotary\.inv_freq has no GPT-2 counterpart"
    ):
        gpt2_state_dict(named)
