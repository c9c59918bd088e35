"""MLflow: the run as one MLflow run, a view of .loss.json and the audits beside TensorBoard's
(tensorboard.py) and under its rules. Off unless MLFLOW_TRACKING_URI names an http(s) tracking server
(ANDREA_MLFLOW=0 turns it off again); MLFLOW_EXPERIMENT_NAME picks the experiment ("andrea").

Logged: train/loss and train/lr of every step, and at each audit val_loss/<arm> and audit/<figure>,
all with their step and wall time, sent at each checkpoint (the loop only appends a tuple) by one
thread through MLflow's REST API (httpx: no mlflow import, nothing more to install). Only steps up to
the newest checkpoint are sent, so what the MLflow run holds is always a prefix of the canonical history:
after a kill it is continued from the resume point, with nothing to take back.

One MLflow run per ANDREA run, found again by its tag `andrea.run_key` (a hash of the run's URL), and
continued at every start. At a start or a guard rollback the view checks it against the run files: what
it lacks below the segment's first step is back-filled from .loss.json's canonical history (read_history,
as TensorBoard's first file is) and the audits; if it holds a step at or past that first step (a guard
rollback, a pivot's archived tail, a torn checkpoint), that history was abandoned, MLflow cannot take
metrics back, so a new MLflow run is made from the canonical history and the old one is tagged
`andrea.superseded_by` and deleted (MLflow's trash: restorable). Its metric history thus equals the
canonical history. A pivot tags the phase in force; a fork's branch names its parent
(`andrea.parent`, `andrea.fork_step`, `andrea.branch`) and is nested under the parent's MLflow run
(`mlflow.parentRunId`) when the parent has one.
A view never stops training: an unreachable or failing server is one warning per cause; the metrics wait
in memory (at most MAX_PENDING steps; past that the oldest are dropped and re-read from .loss.json) and
are retried at the next checkpoint. Replies are read bounded (MAX_REPLY bytes) and checked.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from andrea_core.run.lineage import branch_of, phases
from andrea_core.run.loss_log import read_history
from andrea_core.run.record import read_run
from andrea_core.run.rundir import RunDir

ENV_URI = "MLFLOW_TRACKING_URI"
ENV_EXPERIMENT = "MLFLOW_EXPERIMENT_NAME"
ENV = "ANDREA_MLFLOW"  # "0": off even where MLFLOW_TRACKING_URI is set
DEFAULT_EXPERIMENT = "andrea"
BATCH = 1000  # MLflow's log-batch limit: 1000 metrics per request
MAX_PENDING = 200_000  # steps waiting for a server that is down; past it the oldest are re-read later
MAX_REPLY = 4 << 20  # bytes of one reply read, at most
TIMEOUT = 5.0  # seconds for one request
CLOSE_WAIT = 10.0  # seconds the trainer's exit waits for the last send
MAX_AUDIT_METRICS = 500  # an audit's metrics sent (a policy has far fewer arms)
KEY_RE = re.compile(r"[A-Za-z0-9_./ -]{1,250}")  # what MLflow accepts as a metric key


class MlflowError(Exception):
    """A request the tracking server did not answer as asked (the warning's cause)."""


def tracking_uri() -> str | None:
    """MLFLOW_TRACKING_URI when the view is on (None: off)."""
    uri = os.environ.get(ENV_URI, "").strip()
    return uri if uri and os.environ.get(ENV, "1") != "0" else None


def shown_uri(uri: str) -> str:
    """`uri` without a password or token in its user part: what a warning may print."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username or parts.password:
        parts = parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])
    return urllib.parse.urlunsplit(parts)


def check_uri(uri: str) -> str | None:
    """Why `uri` cannot be used (None: it can): an http(s) URL with a host, nothing else."""
    try:
        parts = urllib.parse.urlsplit(uri)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number in 0..65535)
    except ValueError as e:
        return f"not a URL ({e})"
    if parts.scheme not in ("http", "https"):
        return "only an http(s):// tracking server is supported (not a local mlruns folder or a database)"
    if not parts.hostname:
        return "no host"
    if parts.query or parts.fragment or any(ord(c) < 0x21 for c in uri):
        return "a query, a fragment or a control character"
    return None


def run_key(url: str) -> str:
    """The tag value that finds a run's MLflow run: its URL's hash (a URL may hold quotes)."""
    return hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def open_view(
    run: RunDir,
    segment: int,
    first_step: int,
    audits: list[dict[str, Any]],
    log: Callable[[str], None] = print,
    previous: MlflowView | _Off | None = None,
) -> MlflowView | _Off:
    """The view for a segment starting at `first_step` (`audits`: those of the run up to it). A guard
    rollback passes the previous segment's view: it restarts there (one sender thread per trainer)."""
    if isinstance(previous, MlflowView):
        previous.restart(segment, first_step, audits)
        return previous
    uri = tracking_uri()
    if uri is None:
        return _Off()
    problem = check_uri(uri)
    if problem is not None:
        log(f"warning: {ENV_URI}={shown_uri(uri)!r}: {problem}; no MLflow run is logged, training goes on")
        return _Off()
    try:
        return MlflowView(run, uri, segment, first_step, audits, log)
    except Exception as e:  # noqa: BLE001 (a view: httpx missing, a bad certificate setting: never the run's end)
        log(f"warning: MLflow at {shown_uri(uri)}: not started ({type(e).__name__}: {e}); training goes on")
        return _Off()


class _Off:
    """MLflow not configured: every call is nothing."""

    def step(self, step: int, loss: float, lr: float, t: float) -> None:
        pass

    def audit(self, audit: dict[str, Any]) -> None:
        pass

    def flush(self, step: int) -> None:
        pass

    def close(self, clean: bool = True) -> None:
        pass


class MlflowView:
    def __init__(
        self,
        run: RunDir,
        uri: str,
        segment: int,
        first_step: int,
        audits: list[dict[str, Any]],
        log: Callable[[str], None] = print,
    ):
        import httpx  # only when configured: a trainer without MLflow imports nothing more

        self.run, self.log, self.uri = run, log, shown_uri(uri)
        parts = urllib.parse.urlsplit(uri)
        auth: Any = None
        if os.environ.get("MLFLOW_TRACKING_USERNAME"):
            auth = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ.get("MLFLOW_TRACKING_PASSWORD", ""))
        elif parts.username:
            auth = (urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or ""))
        headers = {}
        if os.environ.get("MLFLOW_TRACKING_TOKEN"):
            headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
        self._http = httpx.Client(
            base_url=shown_uri(uri).rstrip("/") + "/api/2.0/mlflow/",
            auth=auth,
            headers=headers,
            timeout=TIMEOUT,
            verify=os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() != "true",
            follow_redirects=False,
        )
        self.experiment = os.environ.get(ENV_EXPERIMENT, "").strip() or DEFAULT_EXPERIMENT
        self.key = run_key(run.url)
        self.run_id: str | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._warned: set[str] = set()
        self._failing = False
        self._gen = 0
        self._status = "FINISHED"
        self.restart(segment, first_step, audits)
        self._thread = threading.Thread(target=self._work, name="andrea-mlflow", daemon=True)
        self._thread.start()

    # --- the trainer's side: cheap -------------------------------------------------------------

    def restart(self, segment: int, first_step: int, audits: list[dict[str, Any]]) -> None:
        """A new segment from `first_step` (a start, a guard rollback): what was not sent is dropped
        (its steps are re-read from .loss.json if they stand) and the MLflow run is checked again."""
        with self._lock:
            self._gen += 1
            self.segment, self.first_step = segment, first_step
            self.frontier = first_step - 1  # the newest step a checkpoint stands for
            self._train: list[tuple[int, float, float, float]] = []  # (step, loss, lr, time)
            self._audits: list[tuple[int, dict[str, float], float]] = []  # (step, metrics, time)
            self._known = [a for a in audits if isinstance(a, dict) and type(a.get("step")) is int]
            self._resolved = False

    def step(self, step: int, loss: float, lr: float, t: float) -> None:
        with self._lock:
            self._train.append((step, loss, lr, t))
            if len(self._train) > MAX_PENDING:
                # A server down for long: the oldest steps go, and are read back from .loss.json.
                del self._train[: MAX_PENDING // 2]
                self._resolved = False

    def audit(self, audit: dict[str, Any]) -> None:
        """An audit's held-out loss per arm and its text figures (called from the audit's thread)."""
        with self._lock:
            self._audits.append((audit["step"], _audit_metrics(audit), time.time()))

    def flush(self, step: int) -> None:
        """Checkpoint `step` is written: send what is pending up to it, on the sender thread."""
        with self._lock:
            self.frontier = max(self.frontier, step)
        self._wake.set()

    def close(self, clean: bool = True) -> None:
        """At the trainer's exit: the last send (bounded by CLOSE_WAIT), and the run's status."""
        with self._lock:
            self._stop, self._status = True, "FINISHED" if clean else "FAILED"
        self._wake.set()
        self._thread.join(CLOSE_WAIT)
        if self._thread.is_alive():
            self.log(f"warning: MLflow at {self.uri}: the last metrics were not sent within {CLOSE_WAIT:g}s")
        self._http.close()

    # --- the sender thread ---------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                stop = self._stop
            try:
                self._sync()
                if stop and self.run_id is not None:
                    self._post("runs/update", {"run_id": self.run_id, "status": self._status,
                                               "end_time": _ms(time.time())})  # fmt: skip
                if self._failing:
                    self._failing = False
                    self.log(f"MLflow at {self.uri}: sending again, run {self.run_id}")
            except Exception as e:  # noqa: BLE001 (a view: whatever fails is a warning, never the run's end)
                self._warn(e)
            if stop:
                return

    def _sync(self) -> None:
        with self._lock:
            gen, resolved = self._gen, self._resolved
        if not resolved:
            self._resolve(gen)
        while True:
            with self._lock:
                if gen != self._gen:
                    return  # a rollback meanwhile: the next wake checks the MLflow run again
                train = [p for p in self._train if p[0] <= self.frontier][: (BATCH - 100) // 2]
                audits, room = [], BATCH - 2 * len(train)  # two metrics a step; one request at most
                for a in self._audits:
                    if a[0] <= self.frontier and len(a[1]) <= room:
                        audits.append(a)
                        room -= len(a[1])
            if not train and not audits:
                return
            self._log_batch(_train_metrics(train) + [m for a in audits for m in _metrics_of(*a)])
            with self._lock:
                if gen == self._gen:
                    self._train = self._train[len(train) :]  # they are the oldest: appended in step order
                    self._audits = [a for a in self._audits if a not in audits]

    def _resolve(self, gen: int) -> None:
        """Find or make this run's MLflow run, and bring it to the canonical history below the
        segment's first step (and the first step still waiting in memory)."""
        with self._lock:
            first_step, segment = self.first_step, self.segment
            pending = self._train[0][0] if self._train else self.frontier + 1
            known, waiting = list(self._known), {a[0] for a in self._audits}
        experiment = self._experiment()
        tags = self._tags(segment, experiment)
        found = self._find(experiment)
        latest: dict[str, int] = {}  # key: the step of its newest metric
        if found is not None:
            for m in (found.get("data") or {}).get("metrics") or []:
                if isinstance(m, dict) and isinstance(m.get("key"), str):
                    latest[m["key"]] = int(m.get("step", 0))
        newest = max(latest.values(), default=-1)
        if found is not None and newest >= first_step:
            old = found["info"]["run_id"]
            self.run_id = self._create(experiment, tags + [_tag("andrea.supersedes", old)])
            note = [_tag("andrea.superseded_by", self.run_id), _tag("andrea.superseded_at_step", first_step)]
            self._post("runs/log-batch", {"run_id": old, "tags": note})
            self._post("runs/delete", {"run_id": old})
            self.log(
                f"MLflow: run {old} held step {newest}, past this segment's restart at step {first_step} "
                f"(an abandoned timeline): continued as run {self.run_id} from .loss.json; {old} is in "
                "MLflow's trash"
            )
            latest = {}
        elif found is not None:
            self.run_id = found["info"]["run_id"]
            self._post("runs/update", {"run_id": self.run_id, "status": "RUNNING"})
            self._post("runs/log-batch", {"run_id": self.run_id, "tags": tags})
        else:
            self.run_id = self._create(experiment, tags)
        logged = latest.get("train/loss", 0)
        audited = max((s for k, s in latest.items() if not k.startswith("train/")), default=-1)
        with self._lock:  # what a send whose reply was lost delivered after all: not sent twice
            if gen == self._gen:
                self._train = [p for p in self._train if p[0] > logged]
                self._audits = [a for a in self._audits if a[0] > audited]
        metrics: list[dict] = []
        if logged + 1 < pending:
            history = [e for e in read_history(self.run) if logged < e.step < pending]
            metrics += _train_metrics([(e.step, e.loss, e.lr, e.time) for e in history])
        for a in known:
            step = a.get("step")
            if type(step) is int and audited < step < first_step and step not in waiting:
                metrics += _metrics_of(step, _audit_metrics(a), time.time())
        for i in range(0, len(metrics), BATCH):
            self._log_batch(metrics[i : i + BATCH])
        with self._lock:
            if gen == self._gen:
                self._resolved = True

    def _tags(self, segment: int, experiment: str) -> list[dict]:
        tags = [
            _tag("andrea.run", self.run.url[:5000]),
            _tag("andrea.run_key", self.key),
            _tag("andrea.segment", segment),
        ]
        closed = phases(self.run)
        tags.append(_tag("andrea.phase", len(closed) + 1))
        if closed:
            tags += [_tag("andrea.pivots", len(closed)), _tag("andrea.phase_start", closed[-1][1])]
        lineage = read_run(self.run).lineage
        parent = lineage.get("parent")
        if isinstance(parent, str):
            tags.append(_tag("andrea.parent", parent[:5000]))
            tags.append(_tag("andrea.fork_step", lineage.get("parent_step")))
            branch = branch_of(self.run, lineage)
            if branch.name is not None:
                tags.append(_tag("andrea.branch", branch.name))
            tags.append(_tag("andrea.replicate", f"{branch.replicate + 1}/{branch.replicates}"))
            parents = self._search(experiment, run_key(parent))
            if parents:
                tags.append(_tag("mlflow.parentRunId", parents[0]["info"]["run_id"]))
        return tags

    # --- requests ------------------------------------------------------------------------------

    def _experiment(self) -> str:
        reply = self._get("experiments/get-by-name", {"experiment_name": self.experiment}, missing_ok=True)
        if reply is None:
            reply = self._post("experiments/create", {"name": self.experiment}, exists_ok=True)
            if reply is None:  # created meanwhile by another trainer
                reply = self._get("experiments/get-by-name", {"experiment_name": self.experiment})
            else:
                return _text(reply.get("experiment_id"), "experiment_id")
        experiment = reply.get("experiment") or {}
        if experiment.get("lifecycle_stage") == "deleted":
            raise MlflowError(
                f"experiment {self.experiment!r} is deleted: restore it, or set {ENV_EXPERIMENT}"
            )
        return _text(experiment.get("experiment_id"), "experiment_id")

    def _search(self, experiment: str, key: str) -> list[dict]:
        reply = self._post(
            "runs/search",
            {
                "experiment_ids": [experiment],
                "filter": f"tags.`andrea.run_key` = '{key}'",
                "run_view_type": "ACTIVE_ONLY",
                "max_results": 10,
                "order_by": ["attributes.start_time DESC"],
            },
        )
        runs = [r for r in reply.get("runs") or [] if isinstance(r, dict) and isinstance(r.get("info"), dict)]
        for r in runs:
            _text(r["info"].get("run_id"), "run_id")
        return runs

    def _find(self, experiment: str) -> dict | None:
        runs = self._search(experiment, self.key)
        return runs[0] if runs else None

    def _create(self, experiment: str, tags: list[dict]) -> str:
        name = self.run.url.rstrip("/").rsplit("/", 1)[-1][:250] or "run"
        reply = self._post(
            "runs/create",
            {"experiment_id": experiment, "start_time": _ms(time.time()), "run_name": name, "tags": tags},
        )
        return _text((reply.get("run") or {}).get("info", {}).get("run_id"), "run_id")

    def _log_batch(self, metrics: list[dict]) -> None:
        if metrics:
            self._post("runs/log-batch", {"run_id": self.run_id, "metrics": metrics})

    def _get(self, path: str, params: dict, missing_ok: bool = False) -> dict | None:
        return self._request("GET", path, missing_ok=missing_ok, params=params)

    def _post(self, path: str, body: dict, exists_ok: bool = False) -> dict | None:
        data = json.dumps(body, allow_nan=False).encode()
        return self._request("POST", path, exists_ok=exists_ok, content=data,
                             headers={"Content-Type": "application/json"})  # fmt: skip

    def _request(self, method: str, path: str, missing_ok=False, exists_ok=False, **kw: Any) -> dict | None:
        with self._http.stream(method, path, **kw) as reply:
            body, size = [], 0
            for chunk in reply.iter_bytes():
                size += len(chunk)
                if size > MAX_REPLY:
                    raise MlflowError(f"{path}: a reply of more than {MAX_REPLY} bytes")
                body.append(chunk)
            status = reply.status_code
        try:
            value = json.loads(b"".join(body) or b"{}")
        except (ValueError, RecursionError):
            value = None
        code = value.get("error_code") if isinstance(value, dict) else None
        if missing_ok and code == "RESOURCE_DOES_NOT_EXIST":
            return None
        if exists_ok and code == "RESOURCE_ALREADY_EXISTS":
            return None
        if status != 200 or not isinstance(value, dict):
            said = value.get("message") if isinstance(value, dict) else None
            raise MlflowError(f"{path}: HTTP {status}{f' {code}' if code else ''}: {str(said)[:300]}")
        return value

    def _warn(self, e: Exception) -> None:
        """Once per cause, as TensorBoard's view does: a server down for a week says so once."""
        self._failing = True
        cause = f"{type(e).__name__}: {e}"
        if cause not in self._warned:
            self._warned.add(cause)
            self.log(
                f"warning: MLflow at {self.uri}: metrics not sent ({cause}); training goes on, they are "
                "retried at the next checkpoint and this warning is not repeated"
            )


def _ms(t: float) -> int:
    return int(round(t * 1000))


def _tag(key: str, value: Any) -> dict:
    return {"key": key, "value": str(value)}


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value):
        raise MlflowError(f"the server's {what} is not an id: {str(value)[:80]!r}")
    return value


def _number(v: float) -> float | str:
    """A double as proto3's JSON mapping has it: NaN and the infinities as strings."""
    if math.isfinite(v):
        return v
    return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")


def _train_metrics(entries: list[tuple[int, float, float, float]]) -> list[dict]:
    out = []
    for step, loss, lr, t in entries:
        ms = _ms(t)
        out.append({"key": "train/loss", "value": _number(loss), "timestamp": ms, "step": step})
        out.append({"key": "train/lr", "value": _number(lr), "timestamp": ms, "step": step})
    return out


def _audit_metrics(audit: dict[str, Any]) -> dict[str, float]:
    """val_loss/<arm> and audit/<figure> of an audit (a .samples.json's: checked, not trusted)."""
    metrics = audit.get("metrics") if isinstance(audit.get("metrics"), dict) else {}
    out = {}
    val = metrics.get("val_loss") if isinstance(metrics.get("val_loss"), dict) else {}
    for arm, loss in val.items():
        out[f"val_loss/{arm}"] = loss
    for key in ("distinct_1", "distinct_2", "repetition", "gzip_ratio"):
        if key in metrics:
            out[f"audit/{key}"] = metrics[key]
    good = [(k, float(v)) for k, v in out.items() if KEY_RE.fullmatch(k) and type(v) in (int, float)]
    return dict(good[:MAX_AUDIT_METRICS])


def _metrics_of(step: int, metrics: dict[str, float], t: float) -> list[dict]:
    ms = _ms(t)
    return [
        {"key": k, "value": _number(v), "timestamp": ms, "step": step} for k, v in sorted(metrics.items())
    ]
