"""Issue 17: inputs an operator may receive from someone else (a run directory, a policy, a URL) can
neither run code, reach other hosts, escape the cache, exhaust memory nor leak into error messages.

Each test reproduces the attack of its item on the real code path and checks what the issue expects.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from andrea_core.checkpoint import CheckpointError, encode_header
from andrea_core.config import ConfigError, load_run_config, parse_run_config
from andrea_core.data.policy import ArmSpec, SourceUnavailable, load_policy, parse_policy
from andrea_core.data.sources import open_source
from andrea_core.run.lineage import fork_records, format_lineage, read_lineage
from andrea_core.run.loss_log import parse_entries, parse_lines, read_history
from andrea_core.run.retention import protected_steps
from andrea_core.run.rundir import FORKS, LOSS_LOG, RunDir
from tests.conftest import REPO, TINY, _env, andrea, library_run

# --- 17.1: a policy names packages; nothing it names is ever imported ---------------------------

DOC = "A docstring long enough to be kept by the docstrings arm, surely."
PAYLOAD = '"""' + DOC + '"""\nopen({marker!r}, "w").write("pwned")\n'


def plant_payload(folder: Path, marker: Path) -> None:
    """`folder/evil/payload/__init__.py` writes `marker` when imported; `evil` is a namespace package."""
    pkg = folder / "evil" / "payload"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(PAYLOAD.format(marker=str(marker)))


def docstrings_policy(packages: list[str]) -> str:
    return (
        "name: evil\narms:\n"
        "  - {name: stdlib-code, kind: python-stdlib}\n"
        f"  - {{name: repo-docstrings, kind: docstrings, packages: {json.dumps(packages)}}}\n"
    )


def test_package_lookup_never_imports_what_a_policy_names(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "marker"
    plant_payload(tmp_path, marker)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    # The check-new-policy task's own call, on an arm built without the policy parser's checks.
    for packages in (["evil.payload.x"], ["this.x"], ["evil.payload"]):
        with pytest.raises(SourceUnavailable):
            open_source(ArmSpec("repo-docstrings", "docstrings", packages=packages), 100_000)
    # A plain name found on sys.path is read as text (its docstrings), never imported.
    monkeypatch.syspath_prepend(str(tmp_path / "evil"))
    source = open_source(ArmSpec("repo-docstrings", "docstrings", packages=["payload"]), 100_000)
    assert [f.name for f in source.files] == ["__init__.py"]
    assert list(source.documents()) == [DOC]
    assert not marker.exists()
    assert "Beautiful is better than ugly" not in capsys.readouterr().out  # `this` prints the Zen
    assert not {"this", "evil", "evil.payload", "payload"} & (set(sys.modules) - before)


@pytest.mark.parametrize("bad", ["evil.payload.x", "this.x", "../x", "a-b", "", "1abc", "os/path"])
def test_policy_package_names_must_be_plain_identifiers(bad):
    with pytest.raises(ConfigError, match=r"policy\.yaml: arms\[1\]\.packages\[0\]: .*plain"):
        parse_policy(load_yaml_text(docstrings_policy([bad])), "policy.yaml")


def load_yaml_text(text: str):
    import yaml

    return yaml.safe_load(text)


@pytest.mark.slow
def test_resuming_a_run_whose_policy_names_a_payload_runs_nothing(tmp_path, tmp_path_factory, monkeypatch):
    marker = tmp_path / "marker"
    plant_payload(tmp_path, marker)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the run's folder is importable, as runs/ is
    run = library_run(tmp_path_factory, tmp_path / "run", 10)  # andrea-tiny at step 10
    (run / "policy.yaml").write_text(docstrings_policy(["evil.payload.x"]))
    out = andrea("train", "--run-dir", str(run), "--max-steps", "20", check=False)
    assert out.returncode == 2, out.stderr
    assert "arms[1].packages[0]" in out.stderr and "plain" in out.stderr
    assert not marker.exists()


# --- 17.3: arm names become cache file names ----------------------------------------------------


@pytest.mark.parametrize("bad", ["../escaped", "a/b", ".hidden", "", "x" * 65, "a b", "tab\tname", "é"])
def test_arm_names_are_validated_when_a_policy_loads(bad):
    raw = {"name": "p", "arms": [{"name": "ok", "kind": "python-stdlib"}, {"name": bad, "kind": "prose"}]}
    with pytest.raises(ConfigError, match=r"p\.yaml: arms\[1\]\.name: .*letters, digits"):
        parse_policy(raw, "p.yaml")


@pytest.mark.parametrize(
    "bad", ["sign in again at https://evil.example", "ops@evil.example", "a\nb", "[x](y)", ".hidden", "é", ""]
)
def test_a_policy_name_is_validated_like_an_arm_name(bad):
    """Issue 43.11: a policy's name is shown by status, the dashboard and artifacts: an arm name's rule."""
    raw = {"name": bad, "arms": [{"name": "ok", "kind": "python-stdlib"}]}
    with pytest.raises(ConfigError, match=r"p\.yaml: name: .*letters, digits"):
        parse_policy(raw, "p.yaml")
    assert parse_policy(raw | {"name": "tiny-mix_2.1"}, "p.yaml").name == "tiny-mix_2.1"


def test_token_cache_refuses_a_path_like_arm_name_even_unparsed(tmp_path, monkeypatch):
    from andrea_core.data.sources import Source
    from andrea_core.data.tokens import ByteTokenizer, token_cache

    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "a" / "b" / "cache"))
    f = tmp_path / "doc.txt"
    f.write_text("x" * 5000)
    source = Source(ArmSpec("../../escaped", "prose", paths=[str(f)]), [f], 5000)
    with pytest.raises(ValueError, match="arm name"):
        token_cache(source, ByteTokenizer())
    assert not list(tmp_path.glob("**/escaped-*"))


# --- 17.4: run URLs only over allowed protocols --------------------------------------------------


class RecordingServer:
    """A real HTTP server on 127.0.0.1 that records every request it gets."""

    def __init__(self):
        self.requests: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.requests.append(self.path)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"SECRET-METADATA-REPLY")

            do_HEAD = do_GET  # noqa: N815

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def http_server():
    server = RecordingServer()
    yield server
    server.stop()


def test_run_dir_refuses_a_protocol_outside_the_allow_list(http_server, monkeypatch):
    monkeypatch.delenv("ANDREA_ALLOWED_PROTOCOLS", raising=False)
    for url in (f"{http_server.url}/branch", f"simplecache::{http_server.url}/branch"):
        with pytest.raises(ConfigError) as e:
            RunDir(url).exists("run.yaml")
        assert "protocol 'http'" in str(e.value) and "ANDREA_ALLOWED_PROTOCOLS" in str(e.value)
        assert "SECRET" not in str(e.value)
    assert http_server.requests == []
    for ok in ("memory://ok-run", "file:///tmp/ok-run", "/tmp/ok-run", "relative/run"):
        RunDir(ok)
    monkeypatch.setenv("ANDREA_ALLOWED_PROTOCOLS", "file,memory")
    with pytest.raises(ConfigError, match="protocol 's3'.*file, memory"):
        RunDir("s3://bucket/run")
    RunDir("/tmp/still-local")


def test_lineage_does_not_follow_a_forks_line_to_a_refused_protocol(tmp_path, tmp_path_factory, http_server):
    run = library_run(tmp_path_factory, tmp_path / "run", 5)  # andrea-tiny at step 5
    line = {"step": 5, "branches": [f"{http_server.url}/branch"], "names": ["b"], "time": 1.0}
    (run / FORKS).write_text(json.dumps(line) + "\n")
    text = andrea("lineage", str(run)).stdout
    assert "refused" in text and "protocol 'http'" in text and "SECRET" not in text
    assert http_server.requests == []
    lin = read_lineage(str(run))
    assert lin.phases[-1].forks[0].branches[0].run is None
    assert "b" in format_lineage(lin)


# --- 17.5: size checked before a file is read whole ----------------------------------------------

# VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across fork + exec, so a child of a large
# pytest process (a gigabyte after the export tests) would report its parent's peak as its own.
RSS_CHILD = """
import sys
sys.path.insert(0, {repo!r})
{body}
hwm = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print("maxrss_kb", hwm[0])
"""


def run_measured(body: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, int]:
    """Run `body` in a fresh Python process; its output and its peak RSS in MB."""
    proc = subprocess.run(
        [sys.executable, "-c", RSS_CHILD.format(repo=str(REPO), body=body)],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
        cwd=tmp_path,
    )
    rss = [int(w.split()[1]) for w in proc.stdout.splitlines() if w.startswith("maxrss_kb")]
    assert rss, proc.stdout + proc.stderr
    return proc, rss[0] // 1024


def test_a_huge_checkpoint_is_refused_from_its_header_without_reading_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "step_000100.bin", "wb") as f:
        f.write(encode_header(100, 1))
        f.truncate(3 * 2**30)  # sparse: 3 GiB apparent size, nothing on disk
    body = f"""
from andrea_core.run.rundir import RunDir
from andrea_core.checkpoint import CheckpointError
try:
    RunDir({str(run)!r}).read_checkpoint(100)
except CheckpointError as e:
    print("refused:", e)
"""
    proc, rss_mb = run_measured(body, tmp_path)
    assert (
        f"refused: {run}/step_000100.bin: {3 * 2**30} bytes where 8 + 12*1 = 20 are required" in proc.stdout
    )
    assert rss_mb < 1024, f"peak RSS {rss_mb} MB reading a refused checkpoint"
    with pytest.raises(CheckpointError, match="20 are required"):
        RunDir(str(run)).read_checkpoint(100)


def test_a_huge_loss_log_is_refused_with_a_clear_error_and_small_memory(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / LOSS_LOG, "wb") as f:
        f.write(b'{"step":1,"loss":2.5,"lr":0.1,"arm":null,"tokens":1,"segment":1,"time":1.0}\n')
        f.truncate(2**30)  # a 1 GiB sparse tail
    body = f"""
from andrea_core.cli import main
print("rc", main(["loss", {str(run)!r}]))
"""
    proc, rss_mb = run_measured(body, tmp_path)
    assert "rc 2" in proc.stdout, proc.stdout + proc.stderr
    assert f"{run}/.loss.json: {2**30} bytes" in proc.stderr and "ANDREA_MAX_LOSS_LOG_BYTES" in proc.stderr
    assert rss_mb < 1024, f"peak RSS {rss_mb} MB reading a refused loss log"


def test_sidecar_bound_is_configurable(tmp_path, monkeypatch):
    run = RunDir(str(tmp_path))
    run.write_text(FORKS, json.dumps({"step": 1, "branches": [], "names": []}) + "\n" + " " * 5000)
    monkeypatch.setenv("ANDREA_MAX_SIDECAR_BYTES", "1000")
    with pytest.raises(
        ConfigError, match=r"forks\.jsonl: \d+ bytes, more than the limit of 1000 .*ANDREA_MAX_SIDECAR"
    ):
        fork_records(run)
    monkeypatch.setenv("ANDREA_MAX_SIDECAR_BYTES", "100000")
    assert [r["step"] for r in fork_records(run)] == [1]


def test_run_yaml_and_policy_yaml_reads_are_bounded_too(tmp_path, monkeypatch):
    """run.yaml was read whole whatever its size (noted last session): a multi-GB run.yaml planted in
    a shared run directory would have taken the reader's memory before any check."""
    from andrea_core.data.policy import read_policy
    from andrea_core.run.record import read_run

    run = tmp_path / "run"
    andrea("train", "--config", TINY, "--run-dir", str(run), "--max-steps", "1", "--device", "cpu")
    for name in ("run.yaml", "policy.yaml"):
        (run / name).write_text((run / name).read_text() + "#" * 5000 + "\n")
    monkeypatch.setenv("ANDREA_MAX_SIDECAR_BYTES", "4000")
    for name, read in (("run.yaml", read_run), ("policy.yaml", read_policy)):
        with pytest.raises(ConfigError, match=rf"{name}: \d+ bytes, more than the limit of 4000"):
            read(RunDir(str(run)))
    proc = andrea("train", "--run-dir", str(run), "--max-steps", "2", "--device", "cpu", check=False)
    assert proc.returncode == 2 and "run.yaml" in proc.stderr and "ANDREA_MAX_SIDECAR_BYTES" in proc.stderr


# --- 17.8: a malformed line in any JSON Lines file is skipped and counted ------------------------

NESTED = b"[" * 200_000 + b"]" * 200_000


def test_deeply_nested_loss_line_is_skipped_like_a_torn_one(tmp_path):
    good = b'{"step":1,"loss":2.5,"lr":0.1,"arm":null,"tokens":1,"segment":1,"time":1.0}'
    later = b'{"step":2,"loss":2.0,"lr":0.1,"arm":null,"tokens":1,"segment":1,"time":2.0}'
    data = b"\n".join([good, NESTED, b'{"a":' * 100_000, later]) + b"\n"
    entries, skipped = parse_entries(data)
    assert [e.step for e in entries] == [1, 2] and skipped == 2
    objs, skipped = parse_lines(data)
    assert [o["step"] for o in objs] == [1, 2] and skipped == 2
    (tmp_path / LOSS_LOG).write_bytes(data)
    assert [e.step for e in read_history(RunDir(str(tmp_path)))] == [1, 2]


def test_malformed_forks_lines_are_skipped_by_every_reader(tmp_path, tmp_path_factory):
    run_path = library_run(tmp_path_factory, tmp_path / "run", 5)  # andrea-tiny at step 5
    run = RunDir(str(run_path))
    lines = [
        json.dumps({"step": 5, "branches": [], "names": ["a"], "time": 1.0}).encode(),
        b"junk that is not json",
        NESTED,
        b'{"step": "five", "branches": []}',
        b'["not", "an", "object"]',
        b'{"step": 5, "branches": "not a list", "names": []}',
        b'{"step": 5, "br',  # torn
    ]
    (run_path / FORKS).write_bytes(b"\n".join(lines))
    warnings: list[str] = []
    records = fork_records(run, warn=warnings.append)
    assert [(r["step"], r["names"]) for r in records] == [(5, ["a"])]
    assert warnings == [f"{run.path(FORKS)}: skipped 6 malformed line(s): lines 2, 3, 4, 5, 6, 7"]
    assert protected_steps(run)[5] == ["fork point (a)"]
    lin = read_lineage(run.url)
    assert [f.step for p in lin.phases for f in p.forks] == [5]


# --- 17.9: bounds on policy and model size --------------------------------------------------------


def test_a_policy_with_too_many_arms_is_refused_before_work(monkeypatch):
    raw = {"name": "big", "arms": [{"name": f"a{i}", "kind": "python-stdlib"} for i in range(5000)]}
    with pytest.raises(
        ConfigError, match=r"big\.yaml: arms: 5000 arms, more than the limit of 64 .*ANDREA_MAX_ARMS"
    ):
        parse_policy(raw, "big.yaml")
    monkeypatch.setenv("ANDREA_MAX_ARMS", "5000")
    assert len(parse_policy(raw, "big.yaml").arms) == 5000


def test_a_policy_file_too_large_is_refused_unread(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.write(b"name: big\n")
        f.truncate(2**30)
    too_big = rf"{big}: {2**30} bytes, more than the limit of 1048576 .*ANDREA_MAX_POLICY_BYTES"
    with pytest.raises(ConfigError, match=too_big):
        load_policy(str(big))


def test_a_model_too_large_is_refused_before_torch_allocates(monkeypatch):
    raw = load_run_config(TINY).to_dict()
    raw["model"]["n_embd"] = 65536
    with pytest.raises(
        ConfigError, match=r"run\.yaml: model: about 103\.1 billion parameters.*ANDREA_MAX_PARAMS"
    ):
        parse_run_config(raw, "run.yaml")
    raw["model"]["n_embd"], raw["model"]["n_head"] = 8, 1
    raw["model"]["vocab_size"] = 2**24 + 1
    raw["data"]["tokenizer"] = "bpe"
    with pytest.raises(ConfigError, match=r"model\.vocab_size must be at most 16777216"):
        parse_run_config(raw, "run.yaml")
    monkeypatch.setenv("ANDREA_MAX_PARAMS", "1000")
    with pytest.raises(ConfigError, match="limit of 1000"):
        parse_run_config(load_run_config(TINY).to_dict(), "run.yaml")


def test_estimated_parameter_count_is_the_models():
    from andrea_core.config import estimated_n_params
    from andrea_core.model.gpt import GPT

    for name in ("andrea-tiny", "andrea-12m"):
        cfg = load_run_config(name).model
        import torch

        with torch.device("meta"):
            assert estimated_n_params(cfg) == GPT(cfg).n_params


# --- 17.10: parse errors name the file and position, never the contents --------------------------


def test_a_credentials_file_as_policy_does_not_leak_into_the_error(tmp_path):
    creds = tmp_path / "credentials"
    creds.write_text(
        "[default]\naws_access_key_id = AKIASECRETSECRET\naws_secret_access_key = wJalrXUt/K7MDENG\n"
    )
    with pytest.raises(ConfigError) as e:
        load_policy(str(creds))
    msg = str(e.value)
    assert msg.startswith(f"{creds}: not valid YAML at line 2, column 1")
    assert "AKIA" not in msg and "aws_" not in msg and "wJal" not in msg
    for text in (
        "key: 'unterminated\n",
        "a: [1, 2\n",
        "a: !!python/object/apply:os.system ['echo SECRET']\n",
    ):
        creds.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_policy(str(creds))
        assert "line" in str(e.value) and "SECRET" not in str(e.value) and "unterminated" not in str(e.value)


def test_loss_log_snapshot_reads_segments_past_a_nested_line(tmp_path):
    """Issue 18.3: the pivot's snapshot reads with the fast reader, which also skips a line that
    json.loads cannot parse without exceeding the recursion limit."""
    from andrea_core.ops.supervise import LossLogSnapshot

    lines = [
        b'{"step":1,"loss":2.5,"lr":0.1,"arm":null,"tokens":1,"segment":1,"time":1.0}',
        NESTED,
        b'{"step":1,"loss":2.5,"lr":0.1,"arm":null,"tokens":1,"segment":3,"time":1.0}',
    ]
    data = b"\n".join(lines) + b"\n"
    (tmp_path / LOSS_LOG).write_bytes(data)
    snap = LossLogSnapshot.take(RunDir(str(tmp_path)))
    assert snap.segments == [1, 3] and snap.size == len(data)
