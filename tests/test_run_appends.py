"""Every JSON Lines file of a run (.loss.json, forks.jsonl, data.jsonl, any later one) is appended to by
one mechanism (RunDir.append / open_append) that ends a torn last line before it appends (issue 23.4):
a crash mid-append never makes the next record unreadable."""

from __future__ import annotations

import json

import pytest
from conftest import andrea
from test_retention import fabricated_run

from andrea_core.run.lineage import fork_records
from andrea_core.run.loss_log import json_lines
from andrea_core.run.rundir import FORKS, RunDir

TORN = b'{"step": 200, "branches": ["x"], "na'


def test_a_fork_after_a_torn_forks_jsonl_line_is_recorded_and_protects_its_fork_point(tmp_path):
    url = str(tmp_path / "run")
    run = fabricated_run(url, [100, 200, 300, 400, 500])
    (tmp_path / "run" / FORKS).write_bytes(TORN)
    andrea("fork", url, "--step", "100", "--branch", "a", "--replicates", "1")
    data = (tmp_path / "run" / FORKS).read_bytes()
    assert data.startswith(TORN + b"\n"), "the torn line is ended, never rewritten"
    records = fork_records(run)
    assert [(r["step"], r["names"]) for r in records] == [(100, ["a"])]
    lineage = json.loads(andrea("lineage", url, "--json").stdout)
    assert [f["step"] for p in lineage["phases"] for f in p["forks"]] == [100]
    dry = andrea("gc", url, "--dry-run", "--keep-last", "2").stdout
    assert "step_000100.bin  keep          fork point (a)" in dry, dry
    again = andrea(
        "fork", url, "--step", "100", "--branch", "a", "--replicates", "1"
    )  # a rerun finds its line: no error
    assert again.returncode == 0 and len(fork_records(run)) == 1


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("name", [FORKS, "data.jsonl", ".loss.json", "later.jsonl"])
def test_every_append_ends_a_torn_line_first(where, name, tmp_path, request):
    url = str(tmp_path / "run") if where == "local" else f"{request.getfixturevalue('s3_bucket')}/run"
    run = RunDir(url)
    run.makedirs()
    run.write_atomic(name, b'{"a": 1}\n' + TORN)
    run.append(name, b'{"b": 2}\n', durable=True)
    run.append(name, b'{"c": 3}\n', durable=True)
    data = run.read_bytes(name)
    assert data == b'{"a": 1}\n' + TORN + b'\n{"b": 2}\n{"c": 3}\n'
    parsed, bad = json_lines(data)
    assert [v for _, v in parsed] == [{"a": 1}, {"b": 2}, {"c": 3}] and bad == [2]
    # A file that ends whole, or is empty or absent, gets no extra newline.
    run.write_atomic("whole.jsonl", b'{"a": 1}\n')
    run.append("whole.jsonl", b'{"b": 2}\n')
    run.append("new.jsonl", b'{"b": 2}\n')
    assert run.read_bytes("whole.jsonl") == b'{"a": 1}\n{"b": 2}\n'
    assert json.loads(run.read_bytes("new.jsonl")) == {"b": 2}
