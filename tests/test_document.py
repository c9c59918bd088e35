"""andrea_core/document.py, the one checker of a document read from a run file: every fault names the
field and its value (escaped, bounded), a bool is never a number, a number is finite unless declared,
and the readers ported onto it (lock, pivot journal, target, forks, guard events) refuse what they did."""

from __future__ import annotations

import json
import math
import re

import pytest

from andrea_core.document import DocumentError, Field, check
from andrea_core.run.guard_events import EVENT_SCHEMA
from andrea_core.run.lineage import FORK_RECORD_SCHEMA
from andrea_core.run.pivot_journal import JOURNAL_SCHEMA
from andrea_core.run.target import LINE_SCHEMA
from andrea_core.untrusted import LIMIT

SCHEMA = {
    "n": Field((int,), low=1, high=10),
    "x": Field((int, float), required=False, null=True),
    "name": Field((str,), required=False, high=8, printable=True),
    "kind": Field((str,), required=False, choices=("a", "b")),
    "folder": Field((str,), required=False, pattern=re.compile(r"p_\d+"), says="is not a folder"),
    "words": Field((list,), required=False, high=2, items=Field((str,), kind="text")),
}


@pytest.mark.parametrize(
    "doc, error",
    [
        ([1], "not a JSON object"),
        ({}, "n is missing"),
        ({"n": None}, "n is null"),
        ({"n": True}, "n: expected int, got bool True"),
        ({"n": 2.0}, "n: expected int, got float 2.0"),
        ({"n": 11}, "n 11 is outside 1..10"),
        ({"n": 1, "x": math.nan}, "x nan is not finite"),
        ({"n": 1, "x": "1"}, "x: expected int/float or null, got str '1'"),
        ({"n": 1, "name": "a\x1b[2J"}, "name 'a\\x1b[2J': not printable text of at most 8 characters"),
        ({"n": 1, "name": "abcdefghi"}, "name 'abcdefghi': not printable text of at most 8 characters"),
        ({"n": 1, "kind": "c"}, "kind 'c' is not one of a, b"),
        ({"n": 1, "folder": "p_1\n"}, "folder 'p_1\\n' is not a folder"),
        ({"n": 1, "folder": 5}, "folder 5 is not a folder"),
        ({"n": 1, "words": ["a", 2]}, "words[1]: expected text, got int 2"),
        ({"n": 1, "words": ["a", "b", "c"]}, "words: 3 items, more than 2"),
    ],
)
def test_each_fault_names_the_field_and_its_value(doc, error):
    with pytest.raises(DocumentError) as e:
        check(doc, SCHEMA)
    assert str(e.value) == error


def test_a_well_formed_document_is_returned_as_it_is_with_fields_it_does_not_know():
    doc = {"n": 3, "x": None, "name": "ok", "kind": "b", "folder": "p_12", "words": ["w"], "new": {}}
    assert check(doc, SCHEMA) is doc


def test_a_field_declared_non_finite_takes_nan_and_infinities_and_a_real_guard_line_parses():
    """guard.jsonl records NaN and inf as a non-finite step's value (the run's own writer): a field
    declared `finite=False` takes them, a bounded one still refuses what lies outside its bounds."""
    from andrea_core.run.guard_events import _event

    free = {"v": Field((int, float), finite=False)}
    for v in (math.nan, math.inf, -math.inf, 1.5):
        assert check({"v": v}, free)["v"] is v
    bounded = {"v": Field((int, float), low=0, high=1, finite=False)}
    with pytest.raises(DocumentError, match="v -inf is outside 0..1"):
        check({"v": -math.inf}, bounded)
    line = (
        '{"format":1,"number":1,"action":"rollback","step":25,"spike_start":25,"kind":"non-finite-grad-norm",'
        '"value":NaN,"statistic":null,"threshold":null,"rolled_back_to":10,"level":0,"skip":15,'
        '"lr_scale":0.3,"cooldown":1000,"time":1796549490.539}'
    )
    e = _event(json.loads(line))
    assert math.isnan(e.value) and (e.rolled_back_to, e.skip, e.lr_scale, e.cooldown) == (10, 15, 0.3, 1000)


def test_a_shown_value_is_one_bounded_line_whatever_it_holds():
    with pytest.raises(DocumentError) as e:
        check({"n": 1, "kind": "\u202e" + "x" * 5000}, SCHEMA)
    message = str(e.value)
    assert "\u202e" not in message and "\\u202e" in message and "\n" not in message
    assert len(message) < LIMIT + 100 and "more characters" in message


def test_the_ported_readers_schemas_refuse_what_their_hand_checks_refused():
    with pytest.raises(DocumentError, match=r"^step 'flying' is not a pivot step$"):
        check({"step": "flying"}, JOURNAL_SCHEMA)
    with pytest.raises(DocumentError, match=r"^boundary True is not a step$"):
        check({"step": "archived", "boundary": True}, JOURNAL_SCHEMA)
    with pytest.raises(DocumentError, match=r"^policy: expected text or null, got int 5$"):
        check({"step": "intent", "policy": 5}, JOURNAL_SCHEMA)
    assert check({"max_steps": 10, "step": 0, "by": "me"}, LINE_SCHEMA)
    for bad in ({"max_steps": 0, "step": 0, "by": "me"}, {"max_steps": 10, "step": 0, "by": "x" * 201}):
        with pytest.raises(DocumentError):
            check(bad, LINE_SCHEMA)
    assert check({"step": 4, "branches": ["file:///b"], "time": 1.5}, FORK_RECORD_SCHEMA)
    with pytest.raises(DocumentError, match=r"^branches\[0\] '\\udc80' is not allowed$"):
        check({"step": 4, "branches": ["\udc80"]}, FORK_RECORD_SCHEMA)
    with pytest.raises(DocumentError, match=r"^number -1 is not a count$"):
        check({"number": -1}, EVENT_SCHEMA)


def test_a_closed_document_refuses_unknown_keys_nested_by_dotted_name_and_converts_what_it_declares():
    """Configs (run.yaml, a policy) are checked closed: a typo is refused naming the key and where it
    sits; a nested document's faults carry its dotted name; `convert` writes its result back."""
    inner = {"lr": Field((float,), convert=lambda v: float(v) if type(v) is int else v, kind="float")}
    schema = {"n": Field((int,)), "train": Field((dict,), kind="a mapping", fields=inner)}
    with pytest.raises(DocumentError, match=r"^train: unknown field\(s\) lrr \(allowed: lr\)$"):
        check({"n": 1, "train": {"lr": 1.0, "lrr": 2}}, schema, closed=True)
    with pytest.raises(DocumentError, match=r"^unknown field\(s\) \\x1b\[2J \(allowed: n, train\)$"):
        check({"n": 1, "\x1b[2J": 0, "train": {"lr": 1.0}}, schema, closed=True)
    assert check({"n": 1, "new": 0, "train": {"lr": 1, "x": 0}}, schema)["train"] == {"lr": 1.0, "x": 0}
    with pytest.raises(DocumentError, match=r"^train\.lr: expected float, got str 'abc'$"):
        check({"n": 1, "train": {"lr": "abc"}}, schema)
    with pytest.raises(DocumentError, match=r"^train\.lr inf is not finite$"):
        check({"n": 1, "train": {"lr": math.inf}}, schema)
    with pytest.raises(DocumentError, match=r"^train: expected a mapping, got list \[1\]$"):
        check({"n": 1, "train": [1]}, schema)


def test_the_pivot_journals_owner_is_checked_before_it_names_a_process_to_wait_for(tmp_path):
    """ops/pivot.owner_alive: a live owner recorded as our writer writes it is found alive; a forged
    or damaged owner (a pid as text, a bool, escapes, a field missing) names no process, and one that
    has exited is gone. The driver's own journal fields are refused by name (DRIVER_SCHEMA)."""
    import subprocess

    from andrea_core.ops.pivot import DRIVER_SCHEMA, owner_alive
    from andrea_core.run.lock import _boot_id, _host, _pid_namespace, process_start_ticks

    child = subprocess.Popen(["sleep", "60"])
    try:
        owner = {
            "pid": child.pid,
            "host": _host(),
            "boot_id": _boot_id(),
            "proc_start": process_start_ticks(child.pid),
            "pid_ns": _pid_namespace(),
        }
        assert owner_alive({"owner": owner}) == child.pid
        for forged in ({"pid": str(child.pid)}, {"pid": True}, {"host": "h\x1b[2J"}, {"proc_start": -1}):
            assert owner_alive({"owner": owner | forged}) is None, forged
        assert owner_alive({"owner": {k: v for k, v in owner.items() if k != "boot_id"}}) is None
        assert owner_alive({"owner": [owner]}) is None and owner_alive({}) is None
    finally:
        child.kill()
        child.wait()
    assert owner_alive({"owner": owner}) is None
    with pytest.raises(DocumentError, match=r"^stopped_pid -3 is not a whole number$"):
        check({"stopped_pid": -3}, DRIVER_SCHEMA)
    with pytest.raises(DocumentError, match=r"^loss_before\.size is missing$"):
        check({"loss_before": {"sha256": "ab"}}, DRIVER_SCHEMA)
    with pytest.raises(DocumentError, match=r"^owner: expected an object or null, got list \[\]$"):
        check({"owner": []}, DRIVER_SCHEMA)
