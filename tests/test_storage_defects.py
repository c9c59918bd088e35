"""Issue 43's storage defects, each an attack on the real path layer or store: a run file hard-linked to
a file outside the run (9), a lying object store (10, a tiny HTTP server on 127.0.0.1 speaking S3's
GET), an export whose files differ in mode (17), and the loss log's mirror in the cache of a machine
shared by two pid namespaces (7)."""

from __future__ import annotations

import http.server
import os
import threading

import fsspec.config
import pytest

from andrea_core.run.loss_log import LossWriter
from andrea_core.run.rundir import LOSS_LOG, TARGET, RunDir, UnsafeRunPath

MiB = 2**20

# --- 9: hard links ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [TARGET, "guard.jsonl", "tensorboard/events.out.tfevents.1.host"])
def test_an_append_through_a_hard_link_to_a_file_outside_the_run_is_refused(tmp_path, name):
    run = RunDir(tmp_path / "run")
    run.makedirs("tensorboard")
    outside = tmp_path / "victim.txt"
    outside.write_bytes(b"the victim's own bytes\n")
    os.link(outside, tmp_path / "run" / name)
    with pytest.raises(UnsafeRunPath, match=r"a hard link \(2 links\) where a run file should be"):
        run.append(name, b'{"max_steps": 500, "by": "andrea pivot"}\n', lines=not name.startswith("tensor"))
    assert outside.read_bytes() == b"the victim's own bytes\n"


def test_the_loss_log_and_a_trainer_log_are_never_written_through_a_hard_link(tmp_path):
    run = RunDir(tmp_path / "run")
    run.makedirs()
    outside = tmp_path / "victim.txt"
    outside.write_bytes(b"x\n")
    os.link(outside, tmp_path / "run" / LOSS_LOG)
    with pytest.raises(UnsafeRunPath, match="hard link"):
        LossWriter(run, warn=lambda m: None)
    os.link(outside, tmp_path / "run" / "trainer.log")
    with pytest.raises(UnsafeRunPath, match="hard link"):
        run.open_log("trainer.log")
    assert outside.read_bytes() == b"x\n" and os.stat(outside).st_nlink == 3
    # A file of the run with one link is appended to as ever; a whole-file write replaces a link.
    run.append("data.jsonl", b'{"a": 1}\n')
    run.write_text(LOSS_LOG, "")
    assert outside.read_bytes() == b"x\n" and (tmp_path / "run" / "data.jsonl").read_bytes() == b'{"a": 1}\n'


# --- 10: a lying object store ---------------------------------------------------------------------------


class LyingStore(http.server.ThreadingHTTPServer):
    """Answers every GET 206 "bytes 0-99/100" (or, for a suffix range, the same lie) with a 300 MiB body,
    and counts what it managed to send."""

    BODY = 300 * MiB

    def __init__(self):
        self.sent = 0
        self.gets = 0
        super().__init__(("127.0.0.1", 0), LyingHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class LyingHandler(http.server.BaseHTTPRequestHandler):
    server: LyingStore

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.gets += 1
        self.send_response(206)
        self.send_header("Content-Range", "bytes 0-99/100")
        self.send_header("Content-Length", str(LyingStore.BODY))
        self.send_header("ETag", '"lie"')
        self.end_headers()
        chunk = b"\0" * MiB
        try:
            for _ in range(LyingStore.BODY // MiB):
                self.wfile.write(chunk)
                self.server.sent += len(chunk)
        except OSError:  # the reader hung up: what it refused is not sent
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def lying_store(monkeypatch):
    server = LyingStore()
    monkeypatch.setitem(fsspec.config.conf.setdefault("s3", {}), "endpoint_url", server.endpoint)
    monkeypatch.setitem(fsspec.config.conf["s3"], "key", "k")
    monkeypatch.setitem(fsspec.config.conf["s3"], "secret", "s")
    monkeypatch.setitem(fsspec.config.conf["s3"], "skip_instance_cache", True)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    yield server
    server.shutdown()
    server.server_close()


def test_a_lying_store_is_read_no_further_than_the_bound(lying_store):
    """read_bounded, read_tail and read_checkpoint each count the body as it arrives: the lie (100
    bytes announced, 300 MiB sent) is refused after at most the bound and a chunk, not read whole."""
    run = RunDir("s3://bucket/run")
    with pytest.raises(OSError, match=r"s3://bucket/run/run.yaml: the store sent more than the 100 bytes"):
        run.read_bounded("run.yaml")
    with pytest.raises(OSError, match=r"s3://bucket/run/.loss.json: the store sent more than the 4096 bytes"):
        run.read_tail(LOSS_LOG, 4096)
    with pytest.raises(Exception, match=r"step_000100.bin.*the store sent more than the 8 bytes"):
        run.read_checkpoint(100)
    assert lying_store.gets == 3
    # What the server pushed before the reader hung up is what the sockets' buffers took: far from the
    # 3 x 300 MiB the old reader took in (and held: 675 MiB peak RSS for one read).
    assert lying_store.sent < 3 * 64 * MiB, lying_store.sent


# --- 17: export's modes -------------------------------------------------------------------------------------


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


# --- 7: the loss log's mirror in a cache shared by two pid namespaces -------------------------------


def test_a_mirror_of_another_writer_with_our_pid_is_never_truncated(tmp_path, monkeypatch):
    """Two processes with one pid (two pid namespaces) sharing one cache folder: the mirror `NAME.<pid>`
    of the one that opened first is its own, held under its flock; the second opens its own beside it
    and never truncates the first's (opened with O_TRUNC, it lost the first's unpublished tail)."""
    import fcntl

    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path / "cache"))
    run = RunDir(f"memory://{tmp_path.name}/run")
    run.makedirs()
    theirs = run.cache_path(f"{LOSS_LOG}.{os.getpid()}")
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(b'{"step": 1, "unpublished": "theirs"}\n')
    with open(theirs, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # its writer lives (in its own pid namespace)
        writer = LossWriter(run, warn=lambda m: None)
        writer.log(1, 2.0, 1e-3, "a", 8, 0.0)
        writer.flush()
        assert theirs.read_bytes() == b'{"step": 1, "unpublished": "theirs"}\n'
        assert writer._file.path != theirs and writer._file.path.name == f"{LOSS_LOG}.{os.getpid()}.1"
        writer.close()
    assert theirs.exists() and not writer._file.path.exists()
    assert b'"loss":2.0' in run.read_bytes(LOSS_LOG)
