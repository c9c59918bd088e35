"""A run's dashboard: one markdown page with where the run stands (`andrea status`), its loss (EMA and
held-out per arm), speed and ETA, checkpoints, phase and policy with the bandit's current mix, the newest
samples and the loss plot embedded. The Prefect train flow publishes it as the keyed artifact
`run-<name>-<digest>` at the start and at every checkpoint (tasks/artifacts.py); any tool can write it to
a file.
Every input-derived string is escaped (untrusted.markdown_text, or untrusted.shown inside
untrusted.markdown_code): shown, never rendered, never a link.
"""

from __future__ import annotations

import time
from typing import Any

from andrea_core.checkpoint import checkpoint_name
from andrea_core.config import ConfigError
from andrea_core.ops.loss_view import loss_view, plot_view, png_data_uri
from andrea_core.ops.status import RunStatus, run_status
from andrea_core.run.loss_log import read_history
from andrea_core.run.resume_check import describe as describe_check
from andrea_core.run.rundir import STATE, RunDir
from andrea_core.run.samples import read_audits
from andrea_core.untrusted import markdown_code, markdown_text, shown


def bandit_mix(run: RunDir) -> tuple[int, dict[str, float]] | None:
    """(step, {arm: probability}) of the bandit state in .state.json (written at each checkpoint)."""
    if not run.exists(STATE):
        return None
    try:
        doc = run.read_json(STATE)
        return int(doc["step"]), {str(a): float(v["p"]) for a, v in doc["arms"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return None  # an unreadable state is status's problem to report, not the dashboard's


def _duration(seconds: float) -> str:
    from andrea_core.ops.status import _ago

    return _ago(seconds)


def dashboard_rows(st: RunStatus, ema: float | None, last_loss: float | None, mix) -> dict[str, str]:
    pct = f" ({100 * st.step / st.max_steps:.1f}%)" if st.max_steps else ""
    rows: dict[str, str] = {
        "state": f"{st.state.upper()}: {st.summary}",
        "step": f"{st.step} of {st.max_steps}{pct} (target from {st.max_steps_from})",
        "loss (EMA)": "n/a" if ema is None else f"{ema:.4f} (last step {last_loss:.4f})",
    }
    if st.audit:
        arms = ", ".join(f"{arm} {v:.4f}" for arm, v in st.audit["val_loss"].items())
        rows["held-out loss"] = f"{arms} (audit of step {st.audit['step']})"
    rows["tokens/s"] = "n/a" if st.tokens_per_s is None else f"{st.tokens_per_s:,.0f}"
    rows["ETA"] = (
        "n/a"
        if st.eta_s is None
        else f"{_duration(st.eta_s)} (step {st.max_steps} at "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(time.time() + st.eta_s))})"
    )
    rows["newest valid checkpoint"] = (
        checkpoint_name(st.newest_checkpoint) if st.newest_checkpoint is not None else "none yet"
    )
    for i, refused in enumerate(st.refused_checkpoints):
        rows[f"REFUSED {i + 1}"] = refused
    rows["phase"] = (
        f"{st.phase} since step {st.phase_start}, policy {st.policy or '?'} ({st.mixer or '?'} mixer)"
    )
    if mix is not None:
        step, p = mix
        rows["bandit mix"] = ", ".join(f"{arm} {v:.1%}" for arm, v in p.items()) + f" (state of step {step})"
    if st.resume and (st.resume["equal"] or not st.resume["promised"]):  # a failed one is a PROBLEM row
        rows["resume check"] = describe_check(st.resume)
    for problem in st.problems:
        rows[f"PROBLEM {len([k for k in rows if k.startswith('PROBLEM')]) + 1}"] = problem
    rows["updated"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return rows


def dashboard(url: str) -> tuple[str, dict[str, Any]]:
    """(markdown, facts): the page, and the figures it shows (for the progress artifact and tests)."""
    run = RunDir(url)
    name = run.url.rstrip("/").rsplit("/", 1)[-1]
    try:
        # One read of the loss history for both the status and the plot: weeks of steps are tens of MB.
        history = read_history(run)
        st = run_status(url, history=history)
    except ConfigError as e:  # no run.yaml and no trainer holding the lock yet: it is starting
        page = f"### Run {markdown_text(name)}: STARTING\n\n{markdown_text(e)}; the trainer is starting up\n"
        return page, {"state": "starting", "step": 0, "target": None, "ema": None, "checkpoint": None}
    if st.state == "creating":
        view, png = None, None
    else:
        view = loss_view(run, history)
        png = plot_view(view, title=f"{run.url}: loss")
    ema = view.ema[-1] if view and view.ema else None
    last = view.history[-1].loss if view and view.history else None
    mix = bandit_mix(run)
    rows = dashboard_rows(st, ema, last, mix)
    body = "\n".join(f"| {markdown_text(k)} | {markdown_text(v)} |" for k, v in rows.items())
    parts = [
        f"### Run {markdown_text(name)}: {markdown_text(st.state.upper())}",
        "",
        "| | |",
        "|---|---|",
        body,
    ]
    try:
        audits = read_audits(run) if st.state != "creating" else []
    except ConfigError:
        audits = []
    if audits:
        a = audits[-1]
        parts += ["", f"#### Newest samples (audit of step {a['step']})", ""]
        for s in a.get("samples") or []:
            arm = f" ({markdown_text(s['arm'])})" if s.get("arm") else ""
            prompt, completion = (markdown_code(shown(s.get(k, ""))) for k in ("prompt", "completion"))
            parts.append(f"- {prompt}{arm} → {completion}")
    if png is not None:
        parts += ["", f"![loss of {markdown_text(name)}]({png_data_uri(png)})"]
    facts = {
        "state": st.state,
        "step": st.step,
        "target": st.max_steps,
        "ema": ema,
        "tokens_per_s": st.tokens_per_s,
        "eta_s": st.eta_s,
        "checkpoint": st.newest_checkpoint,
        "phase": st.phase,
    }
    return "\n".join(parts) + "\n", facts
