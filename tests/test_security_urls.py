"""Issue 24, the URL gate (rundir.url_to_fs / open_url): every fsspec URL the project opens passes the
protocol allow-list first, so a policy, a config or a command line cannot make this process a client
of internal addresses (finding 3); and what comes through is read bounded (finding 4c, 4d)."""

from __future__ import annotations

import ast
import os

import pytest

from andrea_core.checkpoint import HEADER
from andrea_core.config import ConfigError, load_run_config
from andrea_core.data.shards import declared_tokenizer_hash
from andrea_core.data.tokens import user_tokenizer
from tests.conftest import REPO, _env, andrea
from tests.test_security_inputs import http_server  # noqa: F401 (a fixture)
from tests.tiny import tiny_config

GATE = REPO / "andrea_core" / "run" / "rundir.py"


def file_only_env() -> dict[str, str]:
    return {**_env(), "ANDREA_ALLOWED_PROTOCOLS": "file"}


def test_an_arm_path_over_http_is_never_fetched(tmp_path, http_server):  # noqa: F811
    policy = tmp_path / "ssrf.yaml"
    policy.write_text(
        "name: ssrf\narms:\n"
        f"  - {{name: secret, kind: text, paths: ['{http_server.url}/secret.txt']}}\n"
        "  - {name: stdlib-code, kind: python-stdlib}\n"
    )
    cfg = tiny_config(tmp_path)
    proc = andrea("data", "stats", str(policy), "--config", cfg, env=file_only_env(), check=False)
    assert http_server.requests == []
    # The arm is unavailable (not drawn), like any arm whose files cannot be reached; the others train.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "unavailable: arm 'secret' path: protocol 'http' is not allowed" in proc.stdout
    assert "SECRET" not in proc.stdout + proc.stderr


def test_a_data_tokenizer_over_http_is_never_fetched(tmp_path, http_server):  # noqa: F811
    cfg = tiny_config(tmp_path, data__tokenizer=f"{http_server.url}/tokenizer.json", model__vocab_size=512)
    proc = andrea("data", "stats", "stdlib-only", "--config", cfg, env=file_only_env(), check=False)
    assert http_server.requests == []
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.tokenizer: protocol 'http' is not allowed" in proc.stderr


def test_a_tokens_arms_tokenizer_over_http_is_never_fetched(http_server, monkeypatch):  # noqa: F811
    monkeypatch.setenv("ANDREA_ALLOWED_PROTOCOLS", "file")
    with pytest.raises(ConfigError, match="tokens arm tokenizer: protocol 'http' is not allowed"):
        declared_tokenizer_hash(f"{http_server.url}/tokenizer.json")
    assert http_server.requests == []


def test_andrea_inspect_of_an_http_url_is_never_fetched(http_server):  # noqa: F811
    proc = andrea("inspect", f"{http_server.url}/step_000100.bin", env=file_only_env(), check=False)
    assert http_server.requests == []
    assert proc.returncode == 2 and "andrea inspect: protocol 'http' is not allowed" in proc.stderr


def test_a_tokens_arms_tokenizer_linked_to_dev_zero_is_refused_by_its_bound(tmp_path, monkeypatch):
    """4c: was a MemoryError traceback."""
    monkeypatch.setenv("ANDREA_MAX_SIDECAR_BYTES", str(1 << 20))
    (tmp_path / "tokenizer.json").symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match=r"tokenizer .*tokenizer\.json.*: more than 1048576 bytes"):
        declared_tokenizer_hash(str(tmp_path / "tokenizer.json"))


def test_a_huge_data_tokenizer_is_refused_by_its_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("ANDREA_MAX_SIDECAR_BYTES", str(1 << 20))
    huge = tmp_path / "tokenizer.json"
    with open(huge, "wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB that cost no disk
    cfg = load_run_config(tiny_config(tmp_path))
    with pytest.raises(ConfigError, match=r"data.tokenizer: .*tokenizer\.json: more than 1048576 bytes"):
        user_tokenizer(str(huge), cfg)


def test_andrea_inspect_refuses_a_sparse_huge_file_from_its_header(tmp_path):
    """4d: a 3 GB file whose header claims one parameter is refused without being read."""
    path = tmp_path / "step_000100.bin"
    with open(path, "wb") as f:
        f.write(HEADER.pack(100, 1))
        f.truncate(3 * 10**9)
    proc = andrea("inspect", str(path), check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "3000000000 bytes where 8 + 12*1 = 20 are required" in proc.stdout
    assert os.stat(path).st_blocks * 512 < 1 << 20  # still sparse: nothing was written either


# --- every fsspec open goes through the gate ---------------------------------------------------------

OPENERS = {"open", "open_files", "open_local", "url_to_fs", "filesystem", "get_fs_token_paths", "get_mapper"}
SOURCES = sorted(p for d in ("andrea_core", "tasks", "flows", "scripts") for p in (REPO / d).rglob("*.py"))


def fsspec_opens(text: str, name: str) -> list[str]:
    """Every way `text` could open an fsspec URL itself: fsspec.X() or `from fsspec... import X`."""
    found = []
    for node in ast.walk(ast.parse(text, name)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsspec"):
            found += [f"{where}: from {node.module} import {a.name}" for a in node.names if a.name in OPENERS]
        if isinstance(node, ast.Attribute) and node.attr in OPENERS:
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "fsspec":
                found.append(f"{where}: fsspec.{'.'.join(reversed(chain))}")
    return found


def test_no_fsspec_url_is_opened_outside_the_gate():
    found = []
    for path in SOURCES:
        if path != GATE:
            found += fsspec_opens(path.read_text(), str(path.relative_to(REPO)))
    assert found == []


def test_the_walk_above_can_fail():
    planted = (
        "import fsspec\nfrom fsspec.core import url_to_fs\nfsspec.open('x')\nfsspec.core.url_to_fs('y')\n"
    )
    assert fsspec_opens(planted, "x.py") == [
        "x.py:2: from fsspec.core import url_to_fs",
        "x.py:3: fsspec.open",
        "x.py:4: fsspec.core.url_to_fs",
    ]
    assert fsspec_opens(GATE.read_text(), "rundir.py") != []  # the gate itself opens them


def test_a_cache_lock_planted_as_a_symlink_is_not_followed(tmp_path):
    """9: a `.lock` link in a corpus cache folder had its target truncated when the cache was built."""
    from andrea_core.data.corpora import CorpusError, open_corpus
    from andrea_core.data.policy import ArmSpec
    from andrea_core.data.shards import corpus_cache, corpus_cache_dir
    from andrea_core.data.tokens import ByteTokenizer

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text to cache " * 200)
    source = open_corpus(ArmSpec("mine", "text", paths=[str(tmp_path / "corpus")]), 10**6)
    folder = corpus_cache_dir(source, ByteTokenizer(), 0.1)
    folder.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (folder / ".lock").symlink_to(victim)
    with pytest.raises(CorpusError, match=r"\.lock: a symlink where the cache's lock file should be"):
        corpus_cache(source, ByteTokenizer(), 0.1)
    assert victim.read_text() == "precious\n"
