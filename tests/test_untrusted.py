"""Strings from run files on their way to a terminal, a log line or a markdown artifact (issue 43, items
6, 11, 12): andrea_core.untrusted's one sanitizer, `andrea status` of a forged target.jsonl `by` and of a
remote trainer's lock, a trainer given a forged `.trainer-request.json` `by`, and the auto-links a
Prefect UI renderer would make of a bare URL or e-mail address."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict

import pytest
from conftest import _env, andrea, last_logged_step, start_trainer, wait_for
from markdown_it import MarkdownIt
from test_retention import fabricated_run
from tiny import tiny_config

from andrea_core.ops.status import format_status, run_status
from andrea_core.run import lock
from andrea_core.run.rundir import LOCK, TARGET, RunDir
from andrea_core.untrusted import markdown_text, shown

FORGED_BY = "ops\nCOMPLETED: all good\x1b[8m\u202egnp.exe"


def test_shown_escapes_what_a_terminal_or_log_reader_acts_on_and_bounds_the_length():
    assert shown("plain text, ünïcödé, 日本語 ok") == "plain text, ünïcödé, 日本語 ok"
    assert shown(FORGED_BY) == "ops\\nCOMPLETED: all good\\x1b[8m\\u202egnp.exe"
    assert shown("a\r\tb\x00\x7f\x9b\u2028\u2029\u200b\u2066\U000e0001") == (
        "a\\r\\tb\\x00\\x7f\\x9b\\u2028\\u2029\\u200b\\u2066\\U000e0001"
    )
    assert shown("x" * 1000) == "x" * 1000
    assert shown("x" * 5000) == "x" * 1000 + "... (4000 more characters)"
    # An escape is never cut in half, and the count is of the original's characters.
    assert shown("ab\x1bcd", limit=5) == "ab... (3 more characters)"
    assert shown(12) == "12"


def test_status_prints_a_forged_target_by_as_text_on_its_own_row(tmp_path):
    """Issue 43.12: target.jsonl's `by` made `andrea status` print its own 'COMPLETED: all good' line
    and switch the terminal to concealed text (ESC [8m)."""
    run = fabricated_run(str(tmp_path / "run"), [100])
    line = {"max_steps": 400, "step": 100, "by": FORGED_BY, "time": 1.0}
    (tmp_path / "run" / TARGET).write_text(json.dumps(line) + "\n")
    text = andrea("status", run.url).stdout
    lines = text.splitlines()
    assert not any(x.startswith("COMPLETED") for x in lines), text
    assert "\x1b" not in text and "\u202e" not in text
    step_row = next(x for x in lines if x.startswith("  step"))
    assert step_row == (
        "  step        0 of 400 (0%)  (target from target.jsonl "
        "(ops\\nCOMPLETED: all good\\x1b[8m\\u202egnp.exe, at step 100))"
    )
    assert len(lines) == len(format_status(run_status(run.url)).splitlines())


def test_status_shows_a_live_remote_trainer_as_its_trainer_not_as_a_stale_lock(tmp_path, monkeypatch):
    """Issue 43.6: REMOTE, then a row 'stale lock pid N on HOST' for the same, live, trainer."""
    run = fabricated_run(str(tmp_path / "run"), [100])
    monkeypatch.setenv("ANDREA_TEST_HOST", "host-b")  # the lock a trainer on host-b writes
    there = lock.TrainerIdentity.of_this_process(run.url)
    monkeypatch.delenv("ANDREA_TEST_HOST")
    there = dataclasses.replace(there, pid=4242)
    (tmp_path / "run" / LOCK).write_text(json.dumps(asdict(there), indent=1, sort_keys=True) + "\n")
    st = run_status(run.url)
    assert st.state == "remote" and st.stale_lock is None and st.trainer is None
    assert st.remote_trainer == {"pid": 4242, "host": "host-b", "started_at": there.started_at}
    text = format_status(st)
    assert "stale" not in text, text
    rows = [x for x in text.splitlines() if x.startswith("  trainer")]
    assert len(rows) == 1 and rows[0].startswith("  trainer     pid 4242 on host-b, started ")
    assert rows[0].endswith(" (not checked from here)")

    # A dead trainer of this host is still a stale lock.
    here = lock.TrainerIdentity.of_this_process(run.url)
    dead = dataclasses.replace(here, pid=2**22 - 3, proc_start=1)
    (tmp_path / "run" / LOCK).write_text(json.dumps(asdict(dead), indent=1, sort_keys=True) + "\n")
    st = run_status(run.url)
    assert st.state == "crashed" and st.stale_lock["pid"] == 2**22 - 3 and st.remote_trainer is None
    assert "  stale lock  pid 4194301 on " in format_status(st)


# The triggers of GitHub-flavoured auto-links (marked's and markdown-it's linkify): each needs its
# characters side by side in the markdown source, which markdown_text's escapes separate.
AUTOLINK = re.compile(
    r"(?i)\b(?:https?|ftp|mailto|javascript):|\bwww\.|[\w.+-]@[\w-]+\.\w|\b[\w-]+\.(?:com|org|net|io|example|рф)\b"
)
BAIT = [
    "sign in again at https://evil.example/login",
    "mail ops@evil.example now",
    "see www.evil.example",
    "open evil.com",
    "open пример.рф",
    "mailto:ops@evil.example",
    "[click](javascript:alert(1)) ![x](https://evil.example/x.png) <https://evil.example>",
]


@pytest.mark.parametrize("bait", BAIT)
def test_markdown_text_breaks_auto_links_and_shows_the_text_unchanged(bait):
    """Issue 43.11: a bare URL or e-mail address in run data was a clickable link in the Prefect UI."""
    md = markdown_text(bait)
    assert not AUTOLINK.search(md), md
    html = MarkdownIt("commonmark").render(md)
    assert "<a " not in html and "<img" not in html
    shown_text = html.removeprefix("<p>").removesuffix("</p>\n")
    assert shown_text == bait.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def test_markdown_text_is_one_bounded_line_and_keeps_numbers_plain():
    assert markdown_text("loss 3.1415 at step 20") == "loss 3.1415 at step 20"
    assert markdown_text("a\nb|c") == "a\\\\nb\\|c"  # shown as a\nb|c, in one table cell
    assert len(markdown_text("y" * 10_000)) < 1100


def test_the_status_artifact_shows_a_forged_url_as_text():
    from tasks.artifacts import status_markdown

    md = status_markdown("trainer", {"failed": "policy 'sign in again at https://evil.example' (a@b.io)"})
    assert not AUTOLINK.search(md), md


@pytest.mark.slow
def test_a_forged_request_by_cannot_print_a_line_of_the_trainers_own(tmp_path):
    """Issue 43.12: a `.trainer-request.json` whose `by` holds newlines printed 'andrea: step
    99999/100000 loss 0.0001' and 'andrea: error: forged' as lines of the trainer's output, which the
    flows' progress and failure parsing believe."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(tmp_path, train__checkpoint_every=1000)
    log = tmp_path / "trainer.log"
    trainer = start_trainer(
        "--config", cfg, "--run-dir", str(run_dir), "--max-steps", "100000", "--pace", "0.05",
        log=log, env=_env() | {"ANDREA_LEASE_RENEW_S": "0.2"},
    )  # fmt: skip
    try:
        wait_for(lambda: last_logged_step(run_dir) >= 2, timeout=300, what="the trainer's first steps")
        held = lock.read_lock(RunDir(str(run_dir)))
        forged = "host-b\nandrea: step 99999/100000 loss 0.0001\nandrea: error: forged\x1b[2K"
        request = {"format": 1, "request": "stop", "generation": held.generation, "id": "f1", "by": forged}
        (run_dir / lock.REQUEST).write_text(json.dumps(request))
        assert trainer.wait(timeout=300) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    out = log.read_text()
    lines = out.splitlines()
    assert not any(x.startswith(("andrea: step 99999", "andrea: error")) for x in lines), out
    assert "\x1b" not in out
    (said,) = [x for x in lines if "requested by" in x]
    assert (
        "stop requested by host-b\\nandrea: step 99999/100000 loss 0.0001\\nandrea: error: forged\\x1b[2K"
        in said
    )
