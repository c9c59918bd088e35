"""Publishing to the Prefect UI: artifacts keyed by run, so each run's latest report is one click away."""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from typing import TYPE_CHECKING
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from andrea_core.config import limit
from andrea_core.ops.loss_view import png_data_uri
from andrea_core.run.rundir import RunDir
from andrea_core.untrusted import markdown_text

if TYPE_CHECKING:  # ops/compare imports torch: the train and pivot flow-run processes never need it
    from andrea_core.ops.compare import Comparison


def artifact_key(*parts: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")[:120]


def run_name(run_dir: str) -> str:
    return _last_part(RunDir(run_dir).url)


def _last_part(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def run_key(kind: str, run_dir: str) -> str:
    """The key of one run's artifact of `kind` ("run", "trainer", "audit-fork"): `<kind>-<name>-<digest>`,
    the name for the UI's eye, the digest (8 hex of the SHA-256 of the run's canonical URL) so that two
    runs of one name (two folders called `run`, a local one and an S3 one, `A_1` and `a-1`) never show
    in, or prune, each other's history: a key is all Prefect groups an artifact's versions by."""
    url = RunDir(run_dir).url  # canonical: the digest and the name are of the same URL
    digest = hashlib.sha256(url.encode()).hexdigest()[:8]
    return f"{artifact_key(kind, _last_part(url))[:106].rstrip('-')}-{digest}"  # "-plot" fits in 120


class TrainingProgress:
    """A progress artifact showing step/total of one trainer with its loss, tokens/s and ETA, updated at
    most every `every` seconds (each update is an API call; the trainer logs far more often than the
    UI needs). The ETA is this flow run's own pace: steps seen over the time it saw them."""

    def __init__(self, run_dir: str, total: int | None, every: float = 2.0):
        self.run_dir = run_dir
        self.every = every
        self._last = 0.0
        self.total = total
        self._first: tuple[float, int] | None = None  # (monotonic time, step) of the first step seen
        self._id: UUID = create_progress_artifact(0.0, description=self._describe(None))

    def _describe(
        self, step: int | None, loss: float | None = None, tokens_per_s: float | None = None
    ) -> str:
        text = f"{self.run_dir}: step {step if step is not None else '?'} of {self.total or '?'}"
        if loss is not None:
            text += f" - loss {loss:.4f}"
        if tokens_per_s is not None:
            text += f", {tokens_per_s:,.0f} tokens/s"
        eta = self.eta_s(step)
        if eta is not None:
            text += f", ETA {_duration(eta)}"
        return markdown_text(text)

    def eta_s(self, step: int | None) -> float | None:
        if step is None or self._first is None or not self.total or step <= self._first[1]:
            return None
        t0, s0 = self._first
        return (self.total - step) * (time.monotonic() - t0) / (step - s0)

    def update(
        self,
        step: int | None,
        total: int | None,
        force: bool = False,
        loss: float | None = None,
        tokens_per_s: float | None = None,
    ) -> None:
        self.total = total or self.total
        now = time.monotonic()
        if step is not None and self._first is None:
            self._first = (now, step)
        if step is None or not self.total or (now - self._last < self.every and not force):
            return
        self._last = now
        update_progress_artifact(
            self._id, min(100.0, 100.0 * step / self.total), self._describe(step, loss, tokens_per_s)
        )


def _duration(seconds: float) -> str:
    from andrea_core.ops.status import _ago

    return _ago(seconds)


def publish_dashboard(run_dir: str) -> dict:
    """The run's dashboard (andrea_core.ops.dashboard) as the markdown artifact `run-<name>-<digest>`:
    the UI's Artifacts page shows its newest version, its history one per checkpoint (the newest
    ANDREA_DASHBOARD_VERSIONS, 48 unless set)."""
    from andrea_core.ops.dashboard import dashboard

    markdown, facts = dashboard(run_dir)
    key = run_key("run", run_dir)
    create_markdown_artifact(
        markdown=markdown,
        key=key,
        description=markdown_text(f"dashboard of {run_dir}: step {facts['step']} of {facts['target']}"),
    )
    keep_newest_versions(key, limit("ANDREA_DASHBOARD_VERSIONS"))
    return facts


def keep_newest_versions(key: str, keep: int) -> int:
    """Delete all but the newest `keep` versions of artifact `key`; how many went. Prefect keeps every
    version it is given: a dashboard published at each checkpoint of a run of weeks would be thousands of
    rows. At most a page of the API's (its default limit) a call: an old backlog goes over a few."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        old = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            sort=ArtifactSort.CREATED_DESC,
            offset=keep,
        )
        for version in old:
            with contextlib.suppress(ObjectNotFound):  # deleted meanwhile (another publisher's prune)
                client.delete_artifact(version.id)
    return len(old)


def status_markdown(title: str, rows: dict[str, object]) -> str:
    """A heading and a two-column table; every value escaped (run URLs and trainer error lines are
    inputs: shown as text, never rendered as links, images or HTML)."""
    body = "\n".join(f"| {markdown_text(k)} | {markdown_text(v)} |" for k, v in rows.items())
    return f"### {markdown_text(title)}\n\n| | |\n|---|---|\n{body}\n"


def publish_status(run_dir: str, title: str, rows: dict[str, object]) -> None:
    """A small markdown table keyed by the run: the UI's Artifacts page shows its latest version."""
    create_markdown_artifact(
        markdown=status_markdown(title, rows),
        key=run_key("trainer", run_dir),
        description=markdown_text(f"trainer status of {run_dir}"),
    )


@task(name="publish-fork-report", cache_policy=NO_CACHE)
def publish_fork_report(comparison: Comparison, report_dir: str) -> dict[str, str]:
    """The audit report as a markdown artifact with the plot embedded (a data URI: the UI needs no
    access to the run's storage), the plot as an image artifact, and both as files in `report_dir`."""
    # Lazy: keeps the train and pivot flow-run processes torch-free (docs/design.md "Layout").
    from andrea_core.ops.compare import plot_comparison, report_markdown, write_report

    logger = get_run_logger()
    png = plot_comparison(comparison)
    uri = png_data_uri(png)
    key = run_key("audit-fork", comparison.parent)
    create_markdown_artifact(
        markdown=report_markdown(comparison, uri),
        key=key,
        description=markdown_text(
            f"audit fork of {comparison.parent} at step {comparison.fork_step}: {comparison.verdict}"
        ),
    )
    create_image_artifact(
        image_url=uri, key=f"{key}-plot", description=f"loss of the branches forked at {comparison.fork_step}"
    )
    paths = {**write_report(comparison, report_dir, png), "artifact_key": key}
    logger.info(f"audit report: {paths['report']} (plot {paths['plot']}); Prefect artifact {key!r}")
    return paths
