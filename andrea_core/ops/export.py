"""`andrea export`: a checkpoint as a Hugging Face model folder that `transformers` loads as
`GPT2LMHeadModel` with no custom code.

    OUT_DIR/model.safetensors   the weights under GPT-2's names (safetensors: no pickle either way)
    OUT_DIR/config.json         a GPT2Config that describes exactly this model
    OUT_DIR/tokenizer.json      the run's frozen BPE, or for a bytes run a byte-level one (id = byte)
    OUT_DIR/generation_config.json  max_length = the context (n_positions): `generate` stops within it

ANDREA's GPT is GPT-2's architecture with three differences, each written so that GPT-2 computes the
same function: the head is untied (`tie_word_embeddings: false`, `lm_head.weight` of its own), the MLP
uses exact GELU (`activation_function: "gelu"`, where GPT-2's default is the tanh approximation), and
the linear layers have no bias (GPT-2's are written as zeros). GPT-2's Conv1D stores its weight as
[in, out], the transpose of nn.Linear's [out, in]. The fused qkv projection splits into q, k and v in
the same order in both, and both scale attention by 1/sqrt(head_dim).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from andrea_core.atomic import fsync_dir, makedirs_durable, temp_path
from andrea_core.checkpoint import checkpoint_name
from andrea_core.config import ConfigError
from andrea_core.model.weights import meta_model, named_weights
from andrea_core.model_config import ModelConfig
from andrea_core.run.record import RunWeights, read_weights
from andrea_core.run.rundir import TOKENIZER_JSON

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# ANDREA parameter name -> (GPT-2 name, is a Conv1D: transpose the weight and add a zero bias).
_RENAMES: list[tuple[re.Pattern, str, bool]] = [
    (re.compile(r"^tok_emb\.weight$"), r"transformer.wte.weight", False),
    (re.compile(r"^pos_emb\.weight$"), r"transformer.wpe.weight", False),
    (re.compile(r"^blocks\.(\d+)\.(ln_1|ln_2)\.(weight|bias)$"), r"transformer.h.\1.\2.\3", False),
    (re.compile(r"^blocks\.(\d+)\.attn\.qkv\.weight$"), r"transformer.h.\1.attn.c_attn", True),
    (re.compile(r"^blocks\.(\d+)\.attn\.proj\.weight$"), r"transformer.h.\1.attn.c_proj", True),
    (re.compile(r"^blocks\.(\d+)\.mlp\.fc\.weight$"), r"transformer.h.\1.mlp.c_fc", True),
    (re.compile(r"^blocks\.(\d+)\.mlp\.proj\.weight$"), r"transformer.h.\1.mlp.c_proj", True),
    (re.compile(r"^ln_f\.(weight|bias)$"), r"transformer.ln_f.\1", False),
    (re.compile(r"^head\.weight$"), r"lm_head.weight", False),
]


class ExportError(ValueError):
    """The model cannot be written as GPT-2 (a parameter without a counterpart), or OUT_DIR is in use."""


def gpt2_state_dict(
    named: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """ANDREA's named weights under GPT2LMHeadModel's names and layouts, with GPT-2's biases as zeros."""
    out: dict[str, torch.Tensor] = {}
    for name, w in named.items():
        for pattern, target, conv1d in _RENAMES:
            if pattern.match(name):
                hf = pattern.sub(target, name)
                if conv1d:
                    out[f"{hf}.weight"] = w.t().contiguous().to(dtype)
                    out[f"{hf}.bias"] = torch.zeros(w.shape[0], dtype=dtype)
                else:
                    out[hf] = w.contiguous().to(dtype)
                break
        else:
            raise ExportError(f"parameter {name} has no GPT-2 counterpart; the export mapping needs updating")
    return out


def gpt2_config(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """A GPT2Config (as config.json) under which GPT2LMHeadModel computes what ANDREA's GPT does."""
    model = meta_model(cfg)
    eps = {m.eps for m in model.modules() if isinstance(m, torch.nn.LayerNorm)}
    if len(eps) != 1:
        raise ExportError(f"GPT-2 has one layer_norm_epsilon; this model's LayerNorms use {sorted(eps)}")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": model.blocks[0].mlp.fc.out_features,
        "activation_function": "gelu",  # exact erf GELU, as F.gelu's default; GPT-2's "gelu_new" is tanh
        "layer_norm_epsilon": eps.pop(),
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": False,
        # GPT-2's defaults name its own <|endoftext|> (50256), which is no token of this vocabulary.
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
        "dtype": dtype,
    }


@dataclass
class ExportResult:
    out_dir: str
    run: str
    step: int
    dtype: str
    files: list[str]


def export_checkpoint(
    run_url: str,
    out_dir: str | os.PathLike,
    step: int | None = None,
    dtype: str = "float32",
    warn: Callable[[str], None] | None = None,
) -> ExportResult:
    """Write the run's checkpoint at `step` (default: the newest valid one) to `out_dir` as a Hugging
    Face GPT-2 folder. Everything is checked before the first write, and the folder appears whole: it
    is written beside its final name and renamed into place."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if "://" in os.fspath(out_dir):
        raise ExportError(f"{out_dir}: OUT_DIR must be a local folder (export there, then upload it)")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: already exists and is not an empty folder; export to a new one")
    weights: RunWeights = read_weights(run_url, step, warn=warn)
    ckpt, cfg = weights.checkpoint, weights.model_config
    tensors = gpt2_state_dict(named_weights(cfg, ckpt), DTYPES[dtype])
    config = gpt2_config(cfg, dtype)
    tokenizer = weights.run.read_bytes(TOKENIZER_JSON) if weights.run.exists(TOKENIZER_JSON) else None
    if tokenizer is None and weights.record.config.data.tokenizer == "bytes":
        from andrea_core.data.tokens import ByteTokenizer

        tokenizer = ByteTokenizer.to_json()
    # Past n_positions GPT-2 has no position embedding (an IndexError in generate): say the limit.
    generation = {"max_length": cfg.block_size, "bos_token_id": None, "eos_token_id": None}

    makedirs_durable(out.parent)  # the folder it is published into survives a power cut too
    tmp = temp_path(out)
    tmp.mkdir()
    try:
        metadata = {"format": "pt", "andrea_run": weights.run.url, "andrea_step": str(ckpt.step)}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata=metadata)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
        if tokenizer is not None:
            (tmp / TOKENIZER_JSON).write_bytes(tokenizer)
        # safetensors creates its file 0600 whatever the umask: give it the mode open() gave the others.
        os.chmod(tmp / WEIGHTS_FILE, (tmp / CONFIG_FILE).stat().st_mode & 0o777)
        files = sorted(p.name for p in tmp.iterdir())
        for name in files:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        # rename(2) replaces an empty directory, so an empty OUT_DIR made beforehand is fine.
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(str(out), weights.run.url, ckpt.step, dtype, files)


def format_export(result: ExportResult) -> str:
    return (
        f"exported {result.run} {checkpoint_name(result.step)} as GPT2LMHeadModel ({result.dtype}) "
        f"to {result.out_dir}: {', '.join(result.files)}"
    )
