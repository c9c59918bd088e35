"""The operator's view of a run in the Prefect UI (issue 26.2, 26.6): the live dashboard artifact
`run-<name>` updated at every checkpoint, read back through the Prefect API and looked at in headless
Chromium; the progress artifact's loss, tokens/s and ETA; the trainer table's loss; a clean cancel from the
CLI that reads as one (issue 46.3); the audit-fork schedule shipped inactive and enabled by one
command; the flow run's name after a pivot. This test worker's server (its deployments, where
test_prefect_flows made them first) and a worker of this module's own (test_prefect_flows' Stack)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_prefect_flows import (  # noqa: F401 (stack: the fixture)
    API_POLL_S,
    REPO,
    artifact,
    assert_a_clean_cancel,
    client,
    progress_artifact,
    stack,
    start_deployment,
    wait_for_final,
)

from andrea_core.checkpoint import checkpoint_name
from andrea_core.run.lock import live_trainer
from andrea_core.run.loss_log import ema_curve, read_history
from andrea_core.run.rundir import RunDir
from flows.train import train_run_name
from tasks.artifacts import run_key
from tests.browser import Chromium, chromium_path
from tests.conftest import wait_for
from tests.tiny import tiny_config

OUT = REPO / "test-output" / "prefect-dashboard"
EVERY = 20
# The stack's setup and deployments, taken from test_prefect_flows where it ran first on this test
# worker's server (it asserts them as prefect.yaml makes them and changes none): a cold
# `prefect deploy --all` and a setup process saved. Run alone, this module makes its own.
REUSE_DEPLOYMENTS = True


def artifact_versions(key: str) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with client() as c:
        found = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return sorted(found, key=lambda a: a.created)


def markdown_versions(key: str, texts: list[str]) -> None:
    """Versions of the markdown artifact `key`, one a text, oldest first, as create_markdown_artifact
    makes them outside a flow (type markdown, no description, no run), through one API client, not
    a client a call: the setup of a pruning test, not its subject."""
    from prefect.client.schemas.actions import ArtifactCreate

    with client() as c:
        for text in texts:
            c.create_artifact(ArtifactCreate(type="markdown", key=key, data=text))


def row(markdown: str, name: str) -> str:
    plain = markdown.replace("\\", "")  # markdown_text's escapes, off: the text as the UI shows it
    m = re.search(rf"^\| {re.escape(name)} \| (.*) \|$", plain, flags=re.M)
    assert m, f"no row {name!r} in:\n{markdown[:3000]}"
    return m.group(1)


@pytest.mark.slow
def test_the_dashboard_of_a_live_run_then_a_clean_cancel(stack, tmp_path):  # noqa: F811
    run = RunDir(str(tmp_path / "dash"))
    cfg = tiny_config(tmp_path, train__checkpoint_every=EVERY, train__log_every=10)
    flow_run_id = start_deployment(
        "train/train", run_dir=run.url, config=cfg, max_steps=100_000, pace=0.1, device="cpu"
    )
    wait_for(lambda: live_trainer(run), timeout=300, what="the trainer of the train flow run")
    with client() as c:
        assert c.read_flow_run(flow_run_id).name == "train-dash"

    # One version a redraw: at the flow's start, at the trainer's "started" event (no checkpoint yet),
    # and at each checkpoint it publishes. A redraw that ran late on a loaded machine may already show
    # the next checkpoint; none shows an older one, and none is skipped or doubled.
    def checkpoint_of(page: str) -> int | None:
        named = re.search(r"^\| newest valid checkpoint \| step\\_(\d+)\\.bin \|$", page, re.M)
        return int(named[1]) if named else None

    def two_checkpoints_drawn():
        versions = artifact_versions(run_key("run", run.url))
        return len(versions) >= 4 and checkpoint_of(versions[3].data) is not None and versions[:4]

    versions = wait_for(
        two_checkpoints_drawn, timeout=300, what="the dashboard after 2 checkpoints", every=API_POLL_S
    )
    drawn = [checkpoint_of(v.data) for v in versions]
    assert drawn[0] is None and drawn[1] in (None, EVERY), drawn
    assert EVERY <= drawn[2] <= drawn[3] <= drawn[2] + EVERY and drawn[3] >= 2 * EVERY, drawn
    page = versions[-1].data
    assert page.startswith("### Run dash: TRAINING")
    assert row(page, "newest valid checkpoint") == checkpoint_name(drawn[3])
    step, target = map(int, re.match(r"(\d+) of (\d+) ", row(page, "step")).groups())
    assert step >= drawn[3] and target == 100_000
    assert row(page, "step").endswith("(target from trainer command line)")  # a live one: its own
    # The loss row is the run's own: the bias-corrected EMA of .loss.json to the page's step, and that
    # step's loss (the history is append-only: the trainer's later steps leave these as they were).
    losses = [e.loss for e in read_history(run) if e.step <= step]
    assert len(losses) == step
    assert row(page, "loss (EMA)") == f"{ema_curve(losses)[-1]:.4f} (last step {losses[-1]:.4f})"
    # The held-out loss row is that audit's, as .samples.json holds it.
    held_out = row(page, "held-out loss")
    audit_step = int(re.search(r"audit of step (\d+)", held_out)[1])
    audits = {a["step"]: a for a in json.loads(Path(run.path(".samples.json")).read_text())["audits"]}
    want = ", ".join(f"{arm} {v:.4f}" for arm, v in audits[audit_step]["metrics"]["val_loss"].items())
    assert held_out == f"{want} (audit of step {audit_step})" and audit_step >= EVERY
    # A live trainer's speed, within its pace (--pace 0.1: at most 10 steps/s of 8 x 64 tokens).
    tokens_per_s = int(row(page, "tokens/s").replace(",", ""))
    assert 0 < tokens_per_s <= 1.1 * 8 * 64 / 0.1, row(page, "tokens/s")
    assert "(step 100000 at " in row(page, "ETA")
    assert row(page, "phase") == "1 since step 0, policy stdlib-only (uniform mixer)"
    assert row(page, "bandit mix").startswith("stdlib-code 100.0% (state of step ")
    assert "#### Newest samples (audit of step" in page and "](data:image/png;base64," in page

    # The progress bar: its first update has no ETA yet (no pace seen), a later one does (updates come
    # at most every 2 s, a loaded machine's log lines in bursts: waited for, not assumed).
    pattern = rf"{re.escape(run.url)}: step (\d+) of 100000 - loss (\d\.\d{{4}}), ([\d,]+) tokens/s, ETA .+"
    said = wait_for(
        lambda: re.fullmatch(pattern, progress_artifact(flow_run_id).description.replace("\\", "")),
        timeout=120,
        what="a progress bar with an ETA",
        every=API_POLL_S,
    )
    # Its tokens/s is the trainer's own, over its last log window (a burst: not the minute's mean).
    assert 0 < int(said[3].replace(",", "")) <= 1.5 * 8 * 64 / 0.1, said[0]

    exe = chromium_path()
    assert exe, "chromium is not installed (scripts/test.sh installs it)"
    OUT.mkdir(parents=True, exist_ok=True)
    with Chromium(exe) as browser:
        text = browser.open(f"{stack.ui}/artifacts/artifact/{versions[-1].id}", ["Run dash", "bandit mix"])
        wait_for(
            lambda: browser.evaluate(
                "[...document.images].some(i => i.src.startsWith('data:image/png') && i.naturalWidth > 0)"
            ),
            timeout=30,
            what="the dashboard's loss plot to render",
        )
        browser.screenshot(OUT / "dashboard.png")
        assert "held-out loss" in text and "newest valid checkpoint" in text
        key = run_key("run", run.url)
        browser.open(f"{stack.ui}/artifacts/key/{key}", [key])
        browser.screenshot(OUT / "dashboard-key.png")

    # A clean cancel from the CLI: Cancelled, its trainer task Cancelled naming the checkpoint, no
    # Crashed task, no "Crash detected", no ERROR line but Prefect's "Finished in state Cancelled".
    stack.cli("flow-run", "cancel", str(flow_run_id))
    log = assert_a_clean_cancel(flow_run_id, run)
    assert "was not updated" not in log  # every publish (and prune) went
    table = artifact(run_key("trainer", run.url)).data
    assert re.search(r"\| loss \| \d\.\d{4} \|", table) and "| reason | SIGTERM |" in table


def test_a_dashboard_keeps_only_its_newest_versions(stack):  # noqa: F811
    """Prefect keeps every version of an artifact: the dashboard, published at each checkpoint of a run
    of weeks, keeps its newest ANDREA_DASHBOARD_VERSIONS (tasks/artifacts.keep_newest_versions)."""
    from tasks.artifacts import keep_newest_versions

    markdown_versions("run-prune", [f"version {i}" for i in range(5)])
    assert keep_newest_versions("run-prune", 2) == 3
    assert [a.data for a in artifact_versions("run-prune")] == ["version 3", "version 4"]
    assert keep_newest_versions("run-prune", 2) == 0
    assert artifact("run-prune").data == "version 4"  # the newest, as the UI's key page shows it


def test_a_dashboard_keeps_its_newest_48_versions_by_default(stack, tmp_path, monkeypatch):  # noqa: F811
    """ANDREA_DASHBOARD_VERSIONS unset: publish_dashboard keeps the newest 48 versions of its key."""
    from tasks.artifacts import publish_dashboard

    monkeypatch.delenv("ANDREA_DASHBOARD_VERSIONS", raising=False)
    run = RunDir(str(tmp_path / "kept"))
    run.makedirs()
    key = run_key("run", run.url)
    markdown_versions(key, [f"version {i}" for i in range(49)])
    publish_dashboard(run.url)  # the 50th version: the two oldest go
    kept = artifact_versions(key)
    assert [a.data for a in kept[:-1]] == [f"version {i}" for i in range(2, 49)]
    assert len(kept) == 48 and kept[-1].data.startswith("### Run kept: STARTING")


def test_two_runs_of_one_name_keep_their_own_dashboards(stack, tmp_path, monkeypatch):  # noqa: F811
    """Two run folders both called `run` (two experiments' folders): each dashboard is its own key's, so
    neither shows in, or prunes, the other's history (one key `run-run` for both, before 2026-12-05)."""
    from tasks.artifacts import publish_dashboard

    monkeypatch.setenv("ANDREA_DASHBOARD_VERSIONS", "1")
    a, b = (RunDir(str(tmp_path / exp / "run")) for exp in ("exp-a", "exp-b"))
    for run in (a, b):
        run.makedirs()
    publish_dashboard(a.url)
    publish_dashboard(a.url)
    publish_dashboard(b.url)
    key_a, key_b = run_key("run", a.url), run_key("run", b.url)
    assert key_a != key_b and key_a.startswith("run-run-") and re.fullmatch(r"run-run-[0-9a-f]{8}", key_b)
    (page_a,), (page_b,) = artifact_versions(key_a), artifact_versions(key_b)
    assert "STARTING" in page_a.data and "exp-a" in page_a.data and "exp-b" in page_b.data
    assert len(run_key("audit-fork", str(tmp_path / ("x" * 300))) + "-plot") <= 120


def test_a_train_flow_run_is_named_after_its_phase(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.makedirs()
    assert train_run_name(run.url) == "train-run"
    run.makedirs("archive/phase_001_step_000200")  # as a pivot leaves it
    assert train_run_name(run.url) == "train-run-phase2"


@pytest.mark.slow
def test_the_audit_fork_schedule_ships_inactive_and_one_command_enables_it(stack, tmp_path):  # noqa: F811
    with client() as c:
        (schedule,) = c.read_deployment_by_name("audit-fork/audit-fork").schedules
    assert not schedule.active  # a fresh setup never forks a run that does not exist
    run = str(tmp_path / "my-run")
    # The command docs/operations.md gives:
    stack.cli("deploy", "--name", "audit-fork", "--param", f"run_dir={run}", "--cron", "0 */6 * * *")
    with client() as c:
        fork = c.read_deployment_by_name("audit-fork/audit-fork")
    # prefect.yaml's inactive schedule stays beside the one the command adds: exactly one fires.
    (schedule,) = [s for s in fork.schedules if s.active]
    assert schedule.schedule.cron == "0 */6 * * *"
    assert fork.parameters["run_dir"] == run and len(fork.parameters["branches"]) == 2
