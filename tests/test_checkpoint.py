"""The step_NNNNNN.bin contract: layout, validation verdicts, and refusal of bad files."""

from __future__ import annotations

import os
import shutil
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TINY, andrea

from andrea_core.checkpoint import (
    CheckpointError,
    checkpoint_name,
    decode,
    encode,
    encode_header,
    step_from_name,
)
from andrea_core.config import load_run_config
from andrea_core.run.loss_log import read_history
from andrea_core.run.retention import apply_retention
from andrea_core.run.rundir import RunDir
from andrea_core.train.trainer import Trainer
from tests.tiny import tiny_config

# The hand-made vectors live in the project (copied from the shared test data, which ANDREA_SHARED may
# still point at instead), so that they run in a bare clone too.
VECTORS = (
    Path(os.environ["ANDREA_SHARED"]) / "testdata" / "checkpoints"
    if os.environ.get("ANDREA_SHARED")
    else REPO / "tests" / "data" / "checkpoints"
)


def test_checkpoint_layout_is_header_then_weights_m_v(tmp_path):
    n_steps = 37  # off the 100-step grid: the last step is always checkpointed
    trainer = Trainer(str(tmp_path / "run"), load_run_config(TINY), max_steps=n_steps)
    trainer.train()
    n = sum(p.numel() for p in trainer.model.parameters())
    raw = (tmp_path / "run" / "step_000037.bin").read_bytes()

    assert len(raw) == 8 + 12 * n + 8
    step, n_params = struct.unpack("<ii", raw[:8])  # the test's own reading, not the project's reader
    assert (step, n_params) == (n_steps, n)
    assert struct.unpack("<3sBI", raw[-8:]) == (b"ANC", 1, zlib.crc32(raw[:-8]))  # the trailer
    floats = np.frombuffer(raw, dtype="<f4", offset=8, count=3 * n)
    params = list(trainer.model.parameters())
    weights = torch.cat([p.detach().reshape(-1) for p in params]).numpy()
    m = torch.cat([trainer.optimizer.state[p]["exp_avg"].reshape(-1) for p in params]).numpy()
    v = torch.cat([trainer.optimizer.state[p]["exp_avg_sq"].reshape(-1) for p in params]).numpy()
    assert floats[:n].tobytes() == weights.astype("<f4").tobytes()
    assert floats[n : 2 * n].tobytes() == m.astype("<f4").tobytes()
    assert floats[2 * n :].tobytes() == v.astype("<f4").tobytes()
    assert all(float(trainer.optimizer.state[p]["step"]) == n_steps for p in params)


def test_parameter_order_is_the_design_order():
    from andrea_core.model.gpt import GPT

    cfg = load_run_config(TINY).model
    names = [name for name, _ in GPT(cfg).named_parameters()]
    assert names[:2] == ["tok_emb.weight", "pos_emb.weight"]
    assert names[2:6] == [
        "blocks.0.ln_1.weight",
        "blocks.0.ln_1.bias",
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.proj.weight",
    ]
    assert names[-3:] == ["ln_f.weight", "ln_f.bias", "head.weight"]


def test_encode_parts_streams_views_of_the_buffer_and_checksums_them_once(monkeypatch):
    """The writer's pieces (header, floats, trailer) are the file's bytes in order; the floats are views
    of the caller's buffer, not a copy, and each is checksummed once, before it is handed out."""
    import andrea_core.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "CHUNK", 4096)  # several pieces from a small buffer
    flat = np.arange(3 * 5000, dtype="<f4")
    seen = []
    real_crc32 = zlib.crc32
    monkeypatch.setattr(checkpoint.zlib, "crc32", lambda b, c=0: seen.append(len(b)) or real_crc32(b, c))
    views = list(checkpoint.encode_parts(7, flat))
    assert len(views) == 1 + -(-60000 // 4096) + 1  # the header, 15 pieces of the floats, the trailer
    assert all(np.shares_memory(np.frombuffer(v, dtype=np.uint8), flat) for v in views[1:-1])
    data = b"".join(views)
    assert data == struct.pack("<ii", 7, 5000) + flat.tobytes() + struct.pack(
        "<3sBI", b"ANC", 1, real_crc32(data[:-8])
    )
    assert sum(seen) == 8 + 60000  # every byte before the trailer, read once


def test_encode_decode_round_trip_is_exact():
    rng = np.random.default_rng(0)
    flat = rng.standard_normal(3 * 1000).astype(np.float32)
    flat[2000:] = np.abs(flat[2000:])  # v is non-negative
    data = encode(1234, flat)
    ckpt = decode(data, checkpoint_name(1234), expected_n_params=1000)
    assert (ckpt.step, ckpt.n_params) == (1234, 1000)
    assert ckpt.flat.tobytes() == flat.tobytes()
    assert ckpt.checksum == zlib.crc32(data[:-8]) == struct.unpack("<I", data[-4:])[0]
    assert step_from_name("step_1234567.bin") == 1234567 and step_from_name("step_12.bin") is None


# --- the hand-made vectors (tests/data/checkpoints/README.md) ----------------------------------

EXPECTED = {
    "step_000042.bin": None,
    "truncated/step_000042.bin": "124 bytes where 8 + 12*10 = 128 are required",
    "name-mismatch/step_000043.bin": "header step 42 disagrees with the name's 43",
    "nan-weights/step_000042.bin": "non-finite value in weights at index 3",
    "negative-count/step_000042.bin": "n_params is -5",
    "trailing-bytes/step_000042.bin": "132 bytes where 8 + 12*10 = 128 are required",
}


@pytest.fixture(scope="module")
def vectors() -> Path:
    assert VECTORS.is_dir(), f"checkpoint test vectors missing at {VECTORS}"
    listed = (VECTORS / "README.md").read_text()
    for rel in EXPECTED:
        assert f"`{rel}`" in listed, f"{rel} is no longer described in the vectors' README"
    return VECTORS


@pytest.mark.parametrize("rel", list(EXPECTED))
def test_reader_verdicts_on_shared_vectors(vectors, rel):
    data = (vectors / rel).read_bytes()
    problem = EXPECTED[rel]
    if problem is None:
        ckpt = decode(data, Path(rel).name)
        i = np.arange(10)
        assert (ckpt.step, ckpt.n_params) == (42, 10)
        np.testing.assert_array_equal(ckpt.weights, (i * 0.5 - 2).astype(np.float32))
        # The README gives m and v as formulas; the file's float32 rounding of them may differ by 1 ulp.
        np.testing.assert_array_max_ulp(ckpt.m, np.linspace(-1e-3, 1e-3, 10).astype(np.float32), 1)
        np.testing.assert_array_max_ulp(ckpt.v, ((i + 1) * 1e-6).astype(np.float32), 1)
    else:
        with pytest.raises(CheckpointError) as err:
            decode(data, Path(rel).name)
        assert problem in str(err.value) and Path(rel).name in str(err.value)


@pytest.mark.parametrize("rel", list(EXPECTED))
def test_inspect_agrees_with_reader_on_shared_vectors(vectors, rel):
    import json

    proc = andrea("inspect", str(vectors / rel), check=False)
    first_line = proc.stdout.splitlines()[0]
    report = json.loads(andrea("inspect", "--json", str(vectors / rel), check=False).stdout)
    if EXPECTED[rel] is None:
        assert proc.returncode == 0 and first_line == "step_000042.bin: VALID"
        assert report["valid"] and report["regions"]["weights"]["min"] == -2.0
        assert report["regions"]["weights"]["max"] == 2.5 and report["regions"]["v"]["non_finite"] == 0
    else:
        assert proc.returncode == 1
        assert first_line.startswith(f"{Path(rel).name}: INVALID: ") and EXPECTED[rel] in first_line
        assert not report["valid"] and EXPECTED[rel] in report["problem"]
    if rel == "nan-weights/step_000042.bin":
        assert report["regions"]["weights"]["non_finite"] == 1


# --- the checksummed form: vectors made here from the format line alone (struct and zlib, not the
# project's encode), from the shared valid vector; proposed for ../shared/testdata/checkpoints ---------


def _trailer(body: bytes, magic: bytes = b"ANC", version: int = 1) -> bytes:
    return struct.pack("<3sBI", magic, version, zlib.crc32(body))  # [char[3]][uint8][uint32 CRC-32]


def _flipped(body: bytes, byte: int, bit: int = 4) -> bytes:
    data = bytearray(body)
    data[byte] ^= 1 << bit
    return bytes(data)


V1 = {  # name: (bytes from the legacy valid vector, the problem or None)
    "valid": (lambda b: b + _trailer(b), None),
    "legacy": (lambda b: b, None),
    "flipped-weight": (lambda b: _flipped(b, 8 + 4 * 5) + _trailer(b), "checksum does not match"),
    "flipped-v": (lambda b: _flipped(b, 8 + 80 + 4 * 9, 0) + _trailer(b), "checksum does not match"),
    "flipped-trailer": (lambda b: b + _flipped(_trailer(b), 6), "checksum does not match"),
    "torn-trailer-1": (lambda b: (b + _trailer(b))[:-1], "135 bytes where 8 + 12*10 = 128 are required"),
    "torn-trailer-7": (lambda b: (b + _trailer(b))[:-7], "129 bytes where 8 + 12*10 = 128 are required"),
    "other-magic": (lambda b: b + _trailer(b, b"ANK"), "are not a checksum trailer"),
    "version-2": (lambda b: b + _trailer(b, version=2), "checksum trailer version 2"),
}


@pytest.fixture(scope="module")
def v1_vectors(vectors, tmp_path_factory) -> Path:
    legacy = (vectors / "step_000042.bin").read_bytes()
    root = tmp_path_factory.mktemp("v1-vectors")
    for name, (make, _) in V1.items():
        (root / name).mkdir()
        (root / name / "step_000042.bin").write_bytes(make(legacy))
    return root


@pytest.mark.parametrize("case", list(V1))
def test_checksummed_form_verdicts_of_reader_validator_inspect_and_soak(v1_vectors, case):
    """Each of the four readers of the format gives each vector one verdict: decode, RunDir's bounded
    read, `andrea inspect` (exit code, first line, the checksum line) and the soak's own reader."""
    import json

    sys.path.insert(0, str(REPO / "bench"))
    from soak import spec_problem

    path = v1_vectors / case / "step_000042.bin"
    data, problem = path.read_bytes(), V1[case][1]
    if problem is None:
        ckpt = decode(data, path.name, expected_n_params=10)
        assert ckpt.weights.tolist() == [i * 0.5 - 2 for i in range(10)]
        assert ckpt.checksum == (None if case == "legacy" else zlib.crc32(data[:128]))
        assert RunDir(str(path.parent)).read_checkpoint(42, 10).flat.tobytes() == data[8:128]
        assert spec_problem(data, path.name) is None
    else:
        reads = {
            path.name: lambda: decode(data, path.name),
            str(path): lambda: RunDir(str(path.parent)).read_checkpoint(42),
        }
        for where, read in reads.items():
            with pytest.raises(CheckpointError) as err:
                read()
            assert str(err.value).startswith(f"{where}: ") and problem in str(err.value)
        assert spec_problem(data, path.name) is not None

    proc = andrea("inspect", str(path), check=False)
    report = json.loads(andrea("inspect", "--json", str(path), check=False).stdout)
    lines = proc.stdout.splitlines()
    if problem is None:
        assert proc.returncode == 0 and lines[0] == "step_000042.bin: VALID" and report["valid"]
        want = (
            "none (the legacy form" if case == "legacy" else f"CRC-32 {zlib.crc32(data[:128]):08x}, matches"
        )
        assert lines[2].startswith(f"  checksum: {want}") and report["checksum"].startswith(want)
    else:
        assert (
            proc.returncode == 1 and lines[0].startswith("step_000042.bin: INVALID: ") and problem in lines[0]
        )
        assert not report["valid"] and problem in report["problem"]
        if "required" not in problem:  # the size fits a form: the trailer's status is shown
            assert lines[2] == f"  checksum: {report['checksum']}" and report["checksum"] in report["problem"]


# --- bad files in a real run: refused by name and problem, previous one used, nothing deleted ---


def _corrupt(kind: str, path: Path) -> None:
    raw = bytearray(path.read_bytes())
    if kind == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif kind == "header-step":
        path.write_bytes(struct.pack("<i", 299) + raw[4:])
    elif kind == "other-n-params":
        n = (len(raw) - 8) // 12 - 7
        path.write_bytes(struct.pack("<ii", 300, n) + bytes(raw[8 : 8 + 12 * n]))
    elif kind == "random-bytes":
        path.write_bytes(np.random.default_rng(1).bytes(len(raw)))
    elif kind == "bit-flip":  # one bit of the middle weight: finite, the same size, another model
        n = struct.unpack_from("<i", raw, 4)[0]
        raw[8 + 4 * (n // 2)] ^= 0x10
        path.write_bytes(raw)
    elif kind == "torn-trailer":  # cut inside the checksum trailer
        path.write_bytes(raw[:-3])


PROBLEMS = {
    "truncated": "are required",
    "header-step": "header step 299 disagrees with the name's 300",
    "other-n-params": "does not match the model's",
    "random-bytes": "",  # whatever random bytes break first; asserted to be refused below
    "bit-flip": "checksum does not match",
    "torn-trailer": "are required (",
}


@pytest.fixture(scope="module")
def trained_run(tiny_reference) -> Path:
    return tiny_reference  # copied by each test before it corrupts anything


@pytest.mark.parametrize("kind", list(PROBLEMS))
def test_bad_newest_checkpoint_is_refused_and_resume_falls_back(trained_run, tmp_path, kind):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = run / "step_000300.bin"
    _corrupt(kind, newest)
    bad_bytes = newest.read_bytes()
    n_params = (len((run / "step_000200.bin").read_bytes()) - 8) // 12

    with pytest.raises(CheckpointError) as err:
        RunDir(str(run)).read_checkpoint(300, n_params)
    assert "step_000300.bin" in str(err.value) and PROBLEMS[kind] in str(err.value)
    assert RunDir(str(run)).newest_valid_checkpoint(n_params).step == 200

    proc = andrea("train", "--run-dir", str(run), "--max-steps", "250", "--device", "cpu")
    assert "refusing checkpoint" in proc.stdout and "step_000300.bin" in proc.stdout
    assert "resuming" in proc.stdout and "from step_000200.bin" in proc.stdout
    # Nothing deleted: the refused file is set aside byte for byte, the older ones untouched.
    kept = list((run / "refused").glob("step_000300.bin.*"))
    assert len(kept) == 1 and kept[0].read_bytes() == bad_bytes
    for step in (100, 200):
        name = checkpoint_name(step)
        assert (run / name).read_bytes() == (trained_run / name).read_bytes()
    # The resumed steps 201..250 are the uninterrupted run's, bit for bit (the CPU at the same threads).
    resumed = [(e.step, e.loss, e.lr, e.arm) for e in read_history(RunDir(str(run))) if e.step > 200]
    straight = [(e.step, e.loss, e.lr, e.arm) for e in read_history(RunDir(str(trained_run)))]
    assert resumed == [e for e in straight if 200 < e[0] <= 250]
    assert RunDir(str(run)).read_checkpoint(250, n_params).step == 250


# --- issue 14.8 (review): one canonical name per step -------------------------------------------------------


def test_canonical_names_only():
    assert step_from_name("step_000350.bin") == 350
    assert step_from_name("step_1234567.bin") == 1234567  # more digits only when the step needs them
    assert step_from_name("step_0000350.bin") is None
    assert step_from_name("step_0001234567.bin") is None


def test_a_non_canonical_checkpoint_name_is_ignored_with_a_warning_and_left_alone(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path, train__checkpoint_every=10)
    andrea("train", "--config", config, "--run-dir", str(run_dir), "--max-steps", "20")
    good = (run_dir / checkpoint_name(20)).read_bytes()
    stray = run_dir / "step_0000030.bin"  # 7 digits for step 30: not the name the trainer writes
    stray.write_bytes(encode_header(30, int.from_bytes(good[4:8], "little")) + good[8:])
    run = RunDir(str(run_dir))
    assert run.checkpoint_steps() == [10, 20]
    warnings: list[str] = []
    assert run.checkpoint_steps(warn=warnings.append) == [10, 20]
    assert warnings and "step_0000030.bin" in warnings[0] and "not a canonical checkpoint name" in warnings[0]

    proc = andrea("train", "--run-dir", str(run_dir), "--max-steps", "25", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resuming {run.url} from step_000020.bin" in proc.stdout
    assert "ignoring" in proc.stdout and "step_0000030.bin" in proc.stdout
    assert stray.read_bytes()[:4] == (30).to_bytes(4, "little")  # never moved, never deleted
    assert not (run_dir / "refused").exists()
    plan = apply_retention(run, load_run_config(tiny_config(tmp_path)).retention, None, lambda m: None)
    assert 30 not in plan.delete and stray.exists()


def test_a_legacy_checkpoint_without_a_checksum_is_still_resumed_from(trained_run, tmp_path):
    """A checkpoint written before the trailer (8 + 12n bytes) is valid, unchecked, and said to be so
    by the reader, `andrea inspect` and the trainer; the checkpoints after it carry the trailer."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = run / "step_000300.bin"
    checked = newest.read_bytes()
    newest.write_bytes(checked[:-8])  # the legacy form of the same state
    n_params = (len(checked) - 16) // 12

    ckpt = RunDir(str(run)).read_checkpoint(300, n_params)
    assert ckpt.checksum is None and ckpt.flat.tobytes() == checked[8:-8]
    proc = andrea("inspect", str(newest))
    assert (
        proc.stdout.splitlines()[2]
        == "  checksum: none (the legacy form, 8 + 12n bytes: written before checksums)"
    )

    proc = andrea("train", "--run-dir", str(run), "--max-steps", "320", "--device", "cpu")
    assert "from step_000300.bin (the legacy form: it has no checksum)" in proc.stdout
    assert "refusing" not in proc.stdout and newest.read_bytes() == checked[:-8]
    written = (run / "step_000320.bin").read_bytes()
    assert len(written) == 8 + 12 * n_params + 8
    assert struct.unpack("<3sBI", written[-8:]) == (b"ANC", 1, zlib.crc32(written[:-8]))
