"""The sample audit's file, `.samples.json`, and what is measured from the samples' text alone (the
audit itself, which needs the model, is audit.py). Torch-free, so that `andrea status` and `andrea
audit` start in a fraction of a second.
"""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from typing import Any

from andrea_core.config import ConfigError
from andrea_core.run.rundir import SAMPLES, RunDir

FORMAT = 1
KEEP_AUDITS = 20
REPETITION_N = 3


# --- text metrics (of the generated completions; words are whitespace-separated) ---------------


def ngrams(words: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Unique word n-grams over all n-grams, pooled across the samples (Li et al. 2016); 0 if none."""
    grams = [g for t in texts for g in ngrams(t.split(), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def repetition_rate(text: str, n: int = REPETITION_N) -> float:
    """Share of a text's word n-grams that already occurred earlier in the same text (loops)."""
    grams = ngrams(text.split(), n)
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def gzip_ratio(texts: Sequence[str]) -> float:
    """Raw bytes over gzip bytes of the samples joined by newlines: higher is more repetitive."""
    raw = "\n".join(texts).encode()
    return len(raw) / len(gzip.compress(raw, compresslevel=9, mtime=0)) if raw else 0.0


def text_metrics(texts: Sequence[str]) -> dict[str, float]:
    return {
        "distinct_1": distinct_n(texts, 1),
        "distinct_2": distinct_n(texts, 2),
        "repetition": sum(repetition_rate(t) for t in texts) / len(texts) if texts else 0.0,
        "gzip_ratio": gzip_ratio(texts),
    }


# --- .samples.json -----------------------------------------------------------------------------


def read_audits(run: RunDir, name: str = SAMPLES) -> list[dict[str, Any]]:
    """The audits in .samples.json (or `name`: a closed phase's, in its archive folder), oldest first
    ([] when there is none yet)."""
    if not run.exists(name):
        return []
    try:
        doc = run.read_json(name)
        if doc.get("format") != FORMAT or not all(isinstance(a["step"], int) for a in doc["audits"]):
            raise ValueError(f"format {doc.get('format')!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            f"{run.path(name)}: not a sample audit file of format {FORMAT} ({type(e).__name__}: {e}); "
            "move it aside to start a new one"
        ) from None
    return doc["audits"]


# --- the operator's view -------------------------------------------------------------------------


def audit_line(audit: dict[str, Any]) -> str:
    """The trainer's one log line for an audit: the held-out loss of every arm and the text metrics."""
    m = audit["metrics"]
    arms = ", ".join(f"{arm} {loss:.4f}" for arm, loss in m["val_loss"].items())
    return (
        f"audit of step {audit['step']}: held-out loss {arms}; distinct-2 {m['distinct_2']:.3f}, "
        f"repetition {m['repetition']:.3f}"
    )


def format_audit(audit: dict[str, Any], width: int = 100) -> str:
    m = audit["metrics"]
    lines = [
        f"audit at step {audit['step']} (tokenizer {audit['tokenizer']})",
        "",
        f"{'arm':<24}{'val loss':>10}",
    ]
    lines += [f"{arm:<24}{loss:>10.4f}" for arm, loss in m["val_loss"].items()]
    lines += ["", f"{'metric':<24}{'value':>10}"]
    lines += [f"{k:<24}{m[k]:>10.4f}" for k in ("distinct_1", "distinct_2", "repetition", "gzip_ratio")]
    lines += ["", "samples:"]
    for s in audit["samples"]:
        text = repr(s["prompt"] + s["completion"])
        lines.append(f"  {text if len(text) <= width else text[: width - 3] + '...'}")
    return "\n".join(lines)
