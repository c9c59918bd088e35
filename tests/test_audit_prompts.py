"""Audit prompts from the run's own held-out data (issue 26.5): the first tokens of fixed held-out
documents of each arm, the same at every audit, recorded in .samples.json; or train.audit_prompts."""

from __future__ import annotations

import pytest
import torch
import yaml
from tiny import tiny_config

from andrea_core.config import ConfigError, load_run_config
from andrea_core.data.corpora import is_validation
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import load_policy
from andrea_core.model.gpt import GPT
from andrea_core.train.audit import PROMPT_TOKENS, audit_prompts, run_audit

LINES = ["Shall I compare thee to a summer's day?", "Now is the winter of our discontent", "O Romeo, Romeo!"]


@pytest.fixture
def bard(tmp_path, monkeypatch):
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "sonnets"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"{i:02d}.txt").write_text(f"{LINES[i % 3]} ({i})\n" + "Thou art more lovely. " * 40)
    policy = tmp_path / "bard.yaml"
    policy.write_text(f'name: bard\narms:\n  - {{name: verse, kind: text, paths: ["{corpus}"]}}\n')
    cfg = load_run_config(tiny_config(tmp_path, data__policy=str(policy), data__val_fraction=0.2))
    held_out = [f"{i:02d}.txt" for i in range(40) if is_validation(f"{i:02d}.txt:0", 0.2)]
    return cfg, held_out, corpus


def test_the_default_prompts_are_the_first_tokens_of_held_out_documents(bard, one_thread):
    cfg, held_out, corpus = bard
    assert len(held_out) >= 2
    data = DataPipeline(cfg, load_policy(cfg.data.policy)[0], warn=lambda m: None)
    first = [(corpus / name).read_bytes()[:PROMPT_TOKENS].decode() for name in held_out[:2]]
    assert audit_prompts(data, cfg) == [("verse", first[0]), ("verse", first[1])]
    assert all(any(p.startswith(line[:PROMPT_TOKENS]) for line in LINES) for p in first)  # no "def "
    torch.manual_seed(0)
    model = GPT(cfg.model)
    audit = run_audit(model, data, cfg, 10, "cpu")
    assert [(s["arm"], s["prompt"]) for s in audit["samples"]] == [("verse", p) for p in first]
    assert audit["settings"]["prompts"] == "held-out"
    assert run_audit(model, data, cfg, 20, "cpu")["samples"] == audit["samples"]  # the same every audit


def test_train_audit_prompts_replace_them_and_bad_ones_are_refused(bard, tmp_path, one_thread):
    cfg, _, _ = bard
    mine = cfg.with_overrides({"train.audit_prompts": ["To be, or not", "Friends, Romans"]}, "test")
    data = DataPipeline(mine, load_policy(mine.data.policy)[0], warn=lambda m: None)
    torch.manual_seed(0)
    audit = run_audit(GPT(mine.model), data, mine, 10, "cpu")
    assert [s["prompt"] for s in audit["samples"]] == ["To be, or not", "Friends, Romans"]
    assert audit["settings"]["prompts"] == "train.audit_prompts" and "arm" not in audit["samples"][0]
    for bad in ([], [""], ["x" * 1001]):
        raw = {**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "audit_prompts": bad}}
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError, match="train.audit_prompts must be 1 to 16 non-empty prompts"):
            load_run_config(str(path))
