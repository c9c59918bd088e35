"""Every file a trainer or the CLI reads from a run directory, fuzzed (issue 12, item 4).

One small trained run is built once (andrea-tiny, 20 steps, checkpoint_every 10, a BPE tokenizer, one
audit fork, one rollback of the divergence guard, so that every kind of file exists). Each example
copies it, corrupts one file (a truncation, bit flips, garbage, or a known attack: deeply nested JSON,
a huge n_params in a checkpoint header, non-UTF-8 bytes, NaN/Infinity, values of the wrong type, YAML
tags and alias bombs), then

  (a) resumes it in-process through the CLI's own entry point (`andrea train --max-steps 21`), and
  (b) runs the CLI's readers in-process: inspect, loss, audit, lineage, gc --dry-run, status.

Every outcome must be a correct resume (step 21 checkpointed and logged) or exit status 2 with one
`andrea: error:` line naming the corrupted file; never a traceback, a hang, a deletion, or a piece of
evidence overwritten (a file changes only as the contract lets it: .loss.json grows by appending, a
sidecar the resume accepted is rewritten, a refused file is moved intact into refused/ or archive/).

ANDREA_FUZZ_EXAMPLES sets the number of generated examples (default 30, besides the 13 explicit ones that
found defects; about a minute on a loaded 2-core machine). Generation is derandomized, so a run is
reproducible. A few seeded cases also go through a real trainer process (marked slow).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from andrea_core import cli, signals
from andrea_core.ops.fork import BranchSpec, fork
from andrea_core.run.lock import TrainerIdentity
from andrea_core.run.loss_log import read_history
from andrea_core.run.record import read_run
from andrea_core.run.rundir import RunDir
from tests.conftest import andrea
from tests.tiny import tiny_config

EXAMPLES = int(os.environ.get("ANDREA_FUZZ_EXAMPLES") or 30)
RESUME_AT = 20  # the base run's newest checkpoint; each example resumes it to RESUME_AT + 1
HANG_S = 120  # one example (a resume and six CLI readers) takes about a second

JSON_FILES = [".state.json", ".samples.json", "tokenizer.json", ".trainer.json", "pivot.json"]
JSONL_FILES = [".loss.json", "forks.jsonl", "data.jsonl", "guard.jsonl", "target.jsonl", "segments.jsonl"]
YAML_FILES = ["run.yaml", "policy.yaml"]
BIN_FILES = ["step_000020.bin", "step_000010.bin"]
# TensorBoard's event file of the base's second segment (after the rollback), renamed from its
# wall-clock name so that a case names it: a view that nothing of ours reads back, never a reason to refuse.
EVENTS_FILE = "tensorboard/events.out.tfevents.0000000000.andrea.segment0002"
FILES = BIN_FILES + JSON_FILES + JSONL_FILES + YAML_FILES + [EVENTS_FILE]

GENERIC_KINDS = ["truncate", "bitflip", "garbage", "splice", "non-utf8"]
KINDS = {
    **{f: [*GENERIC_KINDS, "huge-header", "header-step"] for f in BIN_FILES},
    **{f: [*GENERIC_KINDS, "nested", "nan-inf", "wrong-type", "huge-number"] for f in JSON_FILES},
    **{f: [*GENERIC_KINDS, "nested", "nan-inf", "wrong-type", "huge-number"] for f in JSONL_FILES},
    **{f: [*GENERIC_KINDS, "nested", "nan-inf", "wrong-type", "yaml-tag", "alias-bomb"] for f in YAML_FILES},
    EVENTS_FILE: GENERIC_KINDS,
}
KINDS["run.yaml"].append("other-model")  # valid YAML, a valid config, a model the checkpoints do not fit
CASES = [(f, k) for f in FILES for k in KINDS[f]]

# A resume may rewrite these (a state or audit it accepted; a stale lock it took over) ...
REWRITTEN_BY_A_RESUME = {".state.json", ".samples.json", ".trainer.json"}
# ... and none of these can change what step 21 trains: an accepted one must give the reference bytes.
NEUTRAL_TO_TRAINING = {
    "step_000010.bin",
    ".samples.json",
    ".trainer.json",
    "forks.jsonl",
    "data.jsonl",
    "pivot.json",
    "target.jsonl",  # the resume's --max-steps 21 is the target, whatever the file held
    "segments.jsonl",  # the resume check's record: what is compared, never what is trained
    EVENTS_FILE,  # a new segment's file is written; this one is left as it is
}
# a resume only appends to these
APPENDED_TO = (".loss.json", "data.jsonl", "guard.jsonl", "target.jsonl", "segments.jsonl")

TALLY: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def fuzz_tally():
    """Not a check: what the fuzz tests ran, printed (pytest -s) and written to ANDREA_FUZZ_REPORT
    once the module's tests are done, whichever of them ran and in whatever order."""
    yield
    if not TALLY:
        return
    report = os.environ.get("ANDREA_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps(dict(sorted(TALLY.items())), indent=1) + "\n")
    print("\nfuzz tally:", json.dumps(dict(sorted(TALLY.items())), indent=1), file=sys.stderr)


# --- the base run, built once -----------------------------------------------------------------------


def _stale_lock(url: str) -> bytes:
    """The lock a trainer killed with SIGKILL leaves: this host and boot, a process that is gone."""
    me = TrainerIdentity.of_this_process(url)
    dead = dataclasses.replace(me, pid=2**22 + 7, proc_start=1, started_at=me.started_at - 60)
    return (json.dumps(asdict(dead), indent=1, sort_keys=True) + "\n").encode()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_base(tmp_path_factory.mktemp("fuzz-base"))


def build_base(root: Path) -> Path:
    """A trained run (steps 1..20, checkpoints 10 and 20, BPE tokenizer, a fork at 10, a pivot journal
    of a pivot that has taken its checkpoint and not yet stopped the trainer) and the bytes of an
    uncorrupted resume's step_000021.bin, to compare accepted corruptions against."""
    cfg = tiny_config(
        root,
        train__checkpoint_every=10,
        train__max_steps=RESUME_AT // 2,  # the target is --max-steps', in target.jsonl
        train__log_every=10,
        data__tokenizer="bpe",
        model__vocab_size=320,
        train__guard__rollback_margin=2,
    )
    # The batch at data position 13 makes a NaN gradient: the guard rolls back to checkpoint 10 (the
    # newest at least rollback_margin 2 before it), retrains 11 on its own data and skips on from 12:
    # guard.jsonl holds one event.
    os.environ["ANDREA_TEST_GUARD_NAN_AT"] = "13"
    try:
        argv = ["train", "--config", cfg, "--run-dir", str(root / "run"), "--max-steps", str(RESUME_AT)]
        assert _cli(*argv, "--device", "cpu")[0] == 0
    finally:
        del os.environ["ANDREA_TEST_GUARD_NAN_AT"]
    assert b'"rolled_back_to":10' in (root / "run" / "guard.jsonl").read_bytes()
    assert json.loads((root / "run" / "target.jsonl").read_bytes())["max_steps"] == RESUME_AT
    events = sorted((root / "run" / "tensorboard").iterdir())  # segment 1, then the rollback's 2
    assert [p.name.rsplit(".", 1)[1] for p in events] == ["segment0001", "segment0002"]
    events[1].rename(root / "run" / EVENTS_FILE)
    fork(str(root / "run"), [BranchSpec("a", {"train.lr": 1e-3})], step=10)
    # What `andrea pivot` leaves when it dies after its checkpoint (docs/design.md, the pivot journal):
    # read at every trainer start, which may resume (the pivot had not stopped it yet).
    now = time.time()
    journal = {"format": 1, "policy": "polish", "policy_hash": "0" * 16, "boundary": RESUME_AT,
               "not_before": None, "step": "checkpointed", "started_at": now, "updated_at": now}  # fmt: skip
    (root / "run" / "pivot.json").write_text(json.dumps(journal, indent=1) + "\n")
    ref = Path(tempfile.mkdtemp(prefix="fuzz-ref-"))
    try:
        run = _copy(root, ref)
        assert _resume(run)[0] == 0
        (root / "reference_step_000021.bin").write_bytes((run / "step_000021.bin").read_bytes())
    finally:
        shutil.rmtree(ref)
    return root


def _copy(base: Path, where: Path) -> Path:
    shutil.copytree(base / "run", where / "run", symlinks=True)
    return where / "run"


def _cli(*argv: str) -> tuple[int, str, str]:
    """`andrea ARGV` in this process: exit status, stdout, stderr. Anything it raises propagates."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(argv))
    finally:
        signals.uninstall()  # `andrea train` keeps its handlers (it is a process of its own normally)
    return rc, out.getvalue(), err.getvalue()


def _resume(run: Path) -> tuple[int, str, str]:
    return _cli("train", "--run-dir", str(run), "--max-steps", str(RESUME_AT + 1), "--device", "cpu")


# --- corruptions ------------------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _walk_replace(doc, rng: random.Random, make):
    """`doc` with one value somewhere inside it (chosen by rng) replaced by make(old)."""
    paths = []

    def visit(node, path):
        paths.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                visit(v, (*path, k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                visit(v, (*path, i))

    visit(doc, ())
    path = rng.choice(paths[1:] or paths)
    if not path:
        return make(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = make(node[path[-1]])
    return doc


def _other_type(old, rng: random.Random):
    choices = [None, True, "x", [], {}, [1, "a"], {"step": "ten"}, 0, -1, 3.5, 2**70]
    return rng.choice([c for c in choices if type(c) is not type(old)] or choices)


def _non_finite(old, rng: random.Random):
    return rng.choice([float("nan"), float("inf"), float("-inf")])


def _huge(old, rng: random.Random):
    return rng.choice([10**400, -(10**400), 2**63, 2**64 + 1, 1e308 * 10])


def _mutate_structured(name: str, data: bytes, kind: str, rng: random.Random) -> bytes:
    make = {"nan-inf": _non_finite, "wrong-type": _other_type, "huge-number": _huge}[kind]
    mk = lambda old: make(old, rng)  # noqa: E731
    if name in YAML_FILES:
        doc = _walk_replace(yaml.safe_load(data), rng, mk)
        return yaml.safe_dump(doc, sort_keys=False).encode()
    if name in JSONL_FILES:
        lines = data.decode().splitlines()
        i = rng.randrange(len(lines))
        lines[i] = json.dumps(_walk_replace(json.loads(lines[i]), rng, mk))
        return ("\n".join(lines) + "\n").encode()
    return json.dumps(_walk_replace(json.loads(data), rng, mk), indent=1).encode()


def corrupt(name: str, data: bytes, kind: str, rng: random.Random) -> bytes:
    """`data` (the file `name`'s bytes) corrupted the way `kind` says, with draws from `rng`."""
    n = len(data)
    if kind == "truncate":
        return data[: rng.randrange(n)] if n else b""
    if kind == "bitflip":
        out = bytearray(data)
        # Checkpoints: half the flips land in the header, where a flip means something to the reader.
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(8) if name in BIN_FILES and rng.random() < 0.5 else rng.randrange(n)
            out[i] ^= 1 << rng.randrange(8)
        return bytes(out)
    if kind == "garbage":
        return rng.randbytes(rng.choice([0, 1, 7, 8, 64, 4096]))
    if kind == "splice":
        i = rng.randrange(n)
        return data[:i] + rng.randbytes(rng.randint(1, 64)) + data[i + rng.randint(0, 64) :]
    if kind == "non-utf8":
        i = rng.randrange(n)
        return data[:i] + rng.choice([b"\xff\xfe", b"\x80", b"\xc3\x28", b"\xed\xa0\x80", b"\x00"]) + data[i:]
    if kind == "huge-header":
        # A header promising far more floats than the file has (or a negative count).
        step, _ = struct.unpack_from("<ii", data)
        return struct.pack("<ii", step, rng.choice([2**31 - 1, 2**30, -1, 0, 1])) + data[8:]
    if kind == "header-step":
        _, count = struct.unpack_from("<ii", data)
        return struct.pack("<ii", rng.choice([-1, 0, 10, 21, 2**31 - 1]), count) + data[8:]
    if kind == "nested":
        depth = rng.choice([1000, 100_000])
        if name in JSONL_FILES:
            return data + _nested(depth) + b"\n"
        if name in YAML_FILES:
            return b"name: " + _nested(depth) + b"\n"
        return _nested(depth)
    if kind == "yaml-tag":
        tag = rng.choice(
            [
                b"!!python/object/apply:os.system ['touch /tmp/andrea-fuzz-pwned']",
                b"!!python/object/new:subprocess.Popen [['true']]",
                b"!!python/name:os.system",
                b"!!binary AAAA",
                b"!!set {a, b}",
            ]
        )
        lines = data.split(b"\n")
        i = rng.randrange(len(lines))
        key = lines[i].split(b":")[0] if b":" in lines[i] else b"name"
        lines[i] = key + b": " + tag
        return b"\n".join(lines)
    if kind == "alias-bomb":
        # Nine levels of nine references: 387 million strings if anything expands it.
        bomb = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
        bomb += [f"a{j}: &a{j} [{', '.join([f'*a{j - 1}'] * 9)}]" for j in range(1, 9)]
        return data + b"\n" + "\n".join(bomb).encode() + b"\n"
    if kind == "other-model":
        doc = yaml.safe_load(data)
        field, value = rng.choice([("n_embd", 32), ("n_layer", 1), ("block_size", 32), ("n_head", 4)])
        doc["model"][field] = value
        return yaml.safe_dump(doc, sort_keys=False).encode()
    return _mutate_structured(name, data, kind, rng)


# --- what every outcome must satisfy ----------------------------------------------------------------


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _check_refusal(rc: int, err: str, name: str, what: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("andrea: error:")]
    assert rc == 2 and len(lines) == 1, f"{what}: exit {rc}, expected one error line; stderr:\n{err}"
    assert name in lines[0], f"{what}: the error does not name {name}: {lines[0]}"


def _check_evidence(before: dict[str, bytes], run: Path, name: str, resumed: bool) -> None:
    """Nothing deleted, nothing overwritten except as the contract allows."""
    after = _files(run)
    aside = {k: v for k, v in after.items() if k.startswith(("refused/", "archive/"))}
    for f, data in before.items():
        if f not in after:
            if f == ".trainer.json" and resumed:
                continue  # a stale lock, taken over by the resume and released at its exit
            assert data in aside.values(), f"{f} (corrupted: {name}) is gone and was not set aside intact"
        elif f in APPENDED_TO:
            assert after[f].startswith(data), f"{f} was rewritten, not appended to"
        elif f == ".trainer.json" and f != name:
            continue  # the lock itself: every trainer start rewrites it (a lease keeps a released one)
        elif after[f] != data and data not in aside.values():
            assert resumed and f in REWRITTEN_BY_A_RESUME | {"step_000021.bin"}, (
                f"{f} (corrupted: {name}) was overwritten"
            )


def _check_resumed(run: Path, base: Path, name: str) -> None:
    ckpt = RunDir(str(run)).read_checkpoint(RESUME_AT + 1)  # raises naming the file if not valid
    assert ckpt.step == RESUME_AT + 1
    assert read_history(RunDir(str(run)))[-1].step == RESUME_AT + 1
    if name in NEUTRAL_TO_TRAINING:
        assert (run / "step_000021.bin").read_bytes() == (base / "reference_step_000021.bin").read_bytes()


def _on_alarm(signum, frame):
    raise Hang(f"no outcome within {HANG_S}s")


class Hang(BaseException):
    """Raised by the alarm in the middle of whatever hangs: not an Exception, so nothing catches it."""


def run_case(base: Path, name: str, kind: str, seed: int, readers: bool = True) -> str:
    """Corrupt `name` of a copy of the base run, resume it and read it; returns the outcome."""
    where = Path(tempfile.mkdtemp(prefix="fuzz-"))
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(HANG_S)
    try:
        run = _copy(base, where)
        if name == ".trainer.json":
            (run / name).write_bytes(_stale_lock(str(run)))
        original = (run / name).read_bytes()
        bad = corrupt(name, original, kind, random.Random(seed))
        (run / name).write_bytes(bad)
        before = _files(run)

        rc, _, err = _resume(run)
        resumed = rc == 0
        if resumed:
            _check_resumed(run, base, name)
        else:
            _check_refusal(rc, err, name, f"andrea train after {kind} of {name}")
        _check_evidence(before, run, name, resumed)
        outcome = "resumed" if resumed else "refused"

        if readers:
            # On the corrupted run as the resume left it (set aside, or resumed past it) and on a fresh
            # copy with the corruption in place, for the readers an operator runs before any resume.
            fresh = _copy(base, where / "fresh")
            if name == ".trainer.json":
                (fresh / name).write_bytes(bad)
            (fresh / name).write_bytes(bad)
            before_fresh = _files(fresh)
            for target in (run, fresh):
                step_file = name if name in BIN_FILES else "step_000020.bin"
                for argv in (
                    ["inspect", str(target / step_file)],
                    ["loss", str(target)],
                    ["audit", str(target)],
                    ["lineage", str(target)],
                    ["gc", "--dry-run", str(target)],
                    ["status", str(target)],
                ):
                    rc, out, err = _cli(*argv)
                    what = f"andrea {argv[0]} after {kind} of {name}"
                    if rc == 1 and argv[0] in ("inspect", "loss", "audit"):
                        named = out if argv[0] == "inspect" else err
                        assert "INVALID" in named or "no " in named, f"{what}: exit 1 with {out}{err}"
                    elif rc != 0:
                        _check_refusal(rc, err, name, what)
                    TALLY[f"cli {argv[0]} exit {rc}"] += 1
            assert _files(fresh) == before_fresh, f"a reader changed the run after {kind} of {name}"
        return outcome
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        shutil.rmtree(where, ignore_errors=True)


# --- the tests --------------------------------------------------------------------------------------


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    # The seed is opaque to Hypothesis: shrinking it only reruns resumes. A failure prints its case.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=st.sampled_from(CASES), seed=st.integers(0, 2**32 - 1))
# The inputs that found defects (each a traceback before its fix), always run first.
@example(case=(".state.json", "nested"), seed=0)  # RecursionError from json.loads
@example(case=(".samples.json", "nested"), seed=0)  # RecursionError from json.loads
@example(case=(".state.json", "nan-inf"), seed=0)  # OverflowError: int(inf) in the state check
@example(case=(".loss.json", "nan-inf"), seed=164)  # OverflowError: int(inf) in parse_entries
@example(case=(".loss.json", "huge-number"), seed=1)  # OverflowError in `andrea status`' throughput
@example(case=(".loss.json", "huge-number"), seed=2)  # OverflowError in `andrea status`' percent
@example(case=("forks.jsonl", "non-utf8"), seed=0)  # UnicodeEncodeError: a lone surrogate in a URL
@example(case=("run.yaml", "bitflip"), seed=0)  # UnicodeDecodeError reading run.yaml
@example(case=("run.yaml", "nested"), seed=0)  # RecursionError from yaml.safe_load
@example(case=("policy.yaml", "nested"), seed=1)  # RecursionError from yaml.safe_load
@example(case=("run.yaml", "other-model"), seed=1)  # CheckpointError traceback from `andrea train`
@example(case=(".samples.json", "nan-inf"), seed=6)  # TypeError in `andrea audit`'s table
@example(case=("run.yaml", "wrong-type"), seed=5)  # AttributeError: run.yaml's environment not a mapping
@example(case=("data.jsonl", "wrong-type"), seed=0)  # TypeError/KeyError reading data.jsonl (issue 25.6)
@example(case=("data.jsonl", "truncate"), seed=3)  # the next start's line glued onto a torn one
# guard.jsonl (issue 27), whatever the draw: a torn line, and a value of the wrong type in an event.
@example(case=("guard.jsonl", "truncate"), seed=0)
@example(case=("guard.jsonl", "wrong-type"), seed=0)
@example(case=("run.yaml", "wrong-type"), seed=4335)  # parent_step 2**70: an error not naming run.yaml
# target.jsonl and TensorBoard's events (issue 26), whatever the draw: a torn or mistyped target line,
# garbage in an event file.
@example(case=("target.jsonl", "truncate"), seed=0)
@example(case=("target.jsonl", "wrong-type"), seed=0)
@example(case=(EVENTS_FILE, "garbage"), seed=0)
@example(case=(EVENTS_FILE, "truncate"), seed=0)
# segments.jsonl (issue 46.4), whatever the draw: a value of the wrong type, nesting, a torn line.
@example(case=("segments.jsonl", "wrong-type"), seed=0)
@example(case=("segments.jsonl", "nested"), seed=0)
@example(case=("segments.jsonl", "truncate"), seed=0)
def test_every_corrupted_run_file_resumes_or_is_refused_by_name(base, case, seed):
    name, kind = case
    outcome = run_case(base, name, kind, seed)
    TALLY[f"{name} {kind} {outcome}"] += 1
    TALLY[f"kind {kind}"] += 1
    TALLY[f"outcome {outcome}"] += 1
    TALLY["cases"] += 1
    event(f"{name} {kind}: {outcome}")


@pytest.mark.slow
@pytest.mark.parametrize("case", random.Random(12).sample(CASES, 3), ids=lambda c: f"{c[0]}-{c[1]}")
def test_a_real_trainer_process_resumes_or_refuses_by_name(base, case, tmp_path):
    """A seeded sample of the same corruptions through a real `andrea train` process."""
    name, kind = case
    run = _copy(base, tmp_path)
    if name == ".trainer.json":
        (run / name).write_bytes(_stale_lock(str(run)))
    bad = corrupt(name, (run / name).read_bytes(), kind, random.Random(7))
    (run / name).write_bytes(bad)
    before = _files(run)
    proc = andrea(
        "train", "--run-dir", str(run), "--max-steps", str(RESUME_AT + 1), "--device", "cpu", check=False
    )
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    if proc.returncode == 0:
        _check_resumed(run, base, name)
    else:
        _check_refusal(proc.returncode, proc.stderr, name, f"andrea train after {kind} of {name}")
    _check_evidence(before, run, name, proc.returncode == 0)


def test_a_run_yaml_read_again_is_parsed_anew_when_it_changed_and_never_shared(base, tmp_path):
    """config.load_yaml reuses the parse of a text it has seen (the readers above read run.yaml a dozen
    times a command): keyed by the text itself, so a run.yaml changed by one byte between two reads, in
    place, under the same name, is read as it is now; a reader that changes what it got changes
    nobody else's; and a bad run.yaml is refused at every read, naming it, never served from an earlier
    good one."""
    run = RunDir(str(_copy(base, tmp_path)))
    first = read_run(run)
    lineage = dict(first.lineage)
    assert lineage and lineage.get("parent") is None, lineage
    first.lineage["parent"] = "forged by a caller"
    assert read_run(run).lineage == lineage  # the caller's change stayed the caller's
    text = run.read_text("run.yaml")
    assert "  lr: 0.003\n" in text
    run.write_text("run.yaml", text.replace("  lr: 0.003\n", "  lr: 0.004\n"))
    assert (first.config.train.lr, read_run(run).config.train.lr) == (0.003, 0.004)
    run.write_text("run.yaml", text + "\x00")
    for reader in ("lineage", "status"):  # the second read's refusal is the kept verdict, naming its file
        rc, _, err = _cli(reader, run.url)
        _check_refusal(rc, err, f"{run.url}/run.yaml", f"{reader} of a run.yaml with a NUL")
        assert "not valid YAML at character" in err, err
    run.write_text("run.yaml", text)
    assert read_run(run).config.train.lr == 0.003
