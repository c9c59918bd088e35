"""Promises of the README and docs/design.md that no other test held the code to (issue 30): `andrea
status`'s REMOTE state and its line for a newer checkpoint that fails validation, `--abandon` refused
while a trainer runs, the CLI pivot's --max-steps check, branch names of at most 100 characters, `andrea
data prepare RUN`, an export that fails naming a parameter it cannot map, and one token-cache builder at
a time."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, _env, andrea, last_logged_step, library_run, start_trainer, wait_for
from corpus_files import document, jsonl_bytes
from test_retention import fabricated_run
from tiny import tiny_config

from andrea_core.checkpoint import checkpoint_name
from andrea_core.config import load_run_config
from andrea_core.data.policy import load_policy
from andrea_core.model.gpt import GPT
from andrea_core.ops.export import ExportError, gpt2_state_dict
from andrea_core.run.lock import read_lock
from andrea_core.run.pivot_journal import PIVOT_JSON
from andrea_core.run.rundir import RunDir


def refused(proc: subprocess.CompletedProcess, *named: str) -> str:
    """The one `andrea: error:` line of a refusal (exit 2), which must name each of `named`."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("andrea: error:")]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stdout, proc.stderr)
    for what in named:
        assert what in lines[0], (what, lines[0])
    return lines[0]


# --- andrea status -----------------------------------------------------------------------------------


def test_status_says_remote_for_a_lock_of_another_host_and_names_a_newer_checkpoint_that_fails(tmp_path):
    run = fabricated_run(str(tmp_path / "run"), [100, 200])
    (tmp_path / "run" / checkpoint_name(300)).write_bytes(b"torn by a lost upload")
    holder = subprocess.Popen(
        [sys.executable, "-c", "from andrea_core.run import lock; from andrea_core.run.rundir import RunDir; "
         f"import time; lock.Lease.take(RunDir({run.url!r})); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
        env=_env() | {"ANDREA_TEST_HOST": "host-b", "ANDREA_LEASE_RENEW_S": "1", "ANDREA_LEASE_TTL_S": "30"},
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        (st,) = json.loads(andrea("status", run.url, "--json").stdout)
        assert st["state"] == "remote" and st["trainer"] is None
        assert (
            f"locked by trainer pid {holder.pid} on host host-b, which cannot be checked from here"
            in (st["summary"])
        )
        assert st["newest_checkpoint"] == 200
        (why,) = st["refused_checkpoints"]
        assert checkpoint_name(300) in why
        text = andrea("status", run.url).stdout
        assert text.startswith(f"{run.url}: REMOTE: locked by trainer pid {holder.pid} on host host-b")
        assert f"  checkpoint  {checkpoint_name(200)} (newest valid)\n" in text
        assert f"  REFUSED     {why}\n" in text
        assert read_lock(run).host == "host-b"  # status only looked
    finally:
        holder.kill()
        holder.wait()


# --- the CLI pivot and fork: refusals ----------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """andrea-tiny trained to step 20 (checkpoints 10 and 20): the library's (conftest.library_run),
    this module's copy."""
    run = tmp_path_factory.mktemp("promises") / "run"
    return library_run(tmp_path_factory, run, 20, train__checkpoint_every=10)


def tree(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_cli_pivot_refuses_a_max_steps_not_beyond_the_run_before_touching_it(trained):
    before = tree(trained)
    for max_steps in ("20", "5"):
        proc = andrea("pivot", str(trained), "--policy", "tiny-mix", "--max-steps", max_steps, check=False)
        refused(proc, f"max_steps {max_steps} is not beyond", "step 20", "pass a larger max_steps")
    assert tree(trained) == before


@pytest.mark.slow
def test_abandon_is_refused_while_a_trainer_runs_and_the_journal_kept(trained, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    trainer = start_trainer("--run-dir", str(run), "--max-steps", "100000", "--pace", "0.1")
    try:
        wait_for(lambda: last_logged_step(run) > 20, timeout=300, what="the trainer's first step")
        # The pivot has installed its policy and restarted the trainer: past the point --abandon undoes.
        now = time.time()
        journal = {"format": 1, "policy": "tiny-mix", "policy_hash": load_policy("tiny-mix")[0].hash,
                   "boundary": 20, "not_before": None, "step": "installed", "started_at": now,
                   "updated_at": now}  # fmt: skip
        (run / PIVOT_JSON).write_text(json.dumps(journal))
        before = tree(run)
        proc = andrea("pivot", str(run), "--abandon", check=False)
        refused(proc, f"trainer pid {trainer.pid} is running", "'installed'", "stop it before abandoning")
        assert (run / PIVOT_JSON).read_bytes() == before[PIVOT_JSON] and trainer.poll() is None
    finally:
        trainer.kill()
        trainer.wait()


def test_branch_names_are_at_most_100_characters(trained, tmp_path):
    before = tree(trained)
    proc = andrea("fork", str(trained), "--branch", "b" * 101, check=False)
    refused(proc, "b" * 101)
    assert tree(trained) == before
    out = andrea("fork", str(trained), "--branch", "b" * 100).stdout
    name, url = out.strip().splitlines()[-1].split(": ", 1)
    assert name == "b" * 100 and RunDir(url).exists("run.yaml")


# --- andrea data prepare RUN ----------------------------------------------------------------------


def test_data_prepare_of_a_run_builds_the_caches_its_trainer_then_reuses(tmp_path):
    cfg = tiny_config(tmp_path, data__policy="tiny-mix", data__tokenizer="bpe", model__vocab_size=300)
    run = tmp_path / "run"
    andrea("train", "--config", cfg, "--run-dir", str(run), "--max-steps", "1")  # the session's caches
    # Another machine, with no caches yet: prepare builds them, for the run's own tokenizer.
    cache = tmp_path / "cache"
    env = _env() | {"ANDREA_CACHE_DIR": str(cache)}
    prepared = andrea("data", "prepare", str(run), "--json", env=env)
    rows = json.loads(prepared.stdout)
    assert sorted(r["arm"] for r in rows) == sorted(a.name for a in load_policy("tiny-mix")[0].arms)
    built = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    assert len([p for p in built if p.suffix == ".u16"]) == len(rows), built  # one per arm, for its BPE
    resumed = andrea("train", "--run-dir", str(run), "--max-steps", "2", env=env)
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == built  # reused as built
    assert "resuming" in resumed.stdout
    proc = andrea("data", "prepare", str(run), "--config", cfg, check=False, env=env)
    refused(proc, f"{run} is a run", "drop --config")


# --- export --------------------------------------------------------------------------------------------


def test_export_fails_naming_a_parameter_missing_from_its_rename_table():
    model = GPT(load_run_config("andrea-tiny").model)
    named = dict(model.named_parameters())
    assert set(gpt2_state_dict(named))  # every parameter of today's model has its GPT-2 name
    named["blocks.0.attn.rotary.inv_freq"] = torch.zeros(4)  # a parameter a later model might add
    with pytest.raises(
        ExportError, match=r"parameter blocks\.0\.attn\.rotary\.inv_freq has no GPT-2 counterpart"
    ):
        gpt2_state_dict(named)


# --- the token cache: one builder at a time ----------------------------------------------------------

BUILDER = """
import sys
from andrea_core.config import load_run_config, load_yaml
from andrea_core.data.pipeline import DataPipeline
from andrea_core.data.policy import parse_policy
arm = '{name: posts, kind: jsonl, paths: ["%s"]}' % sys.argv[1]
policy = parse_policy(load_yaml(f"name: one\\narms:\\n  - {arm}\\n", "policy"), "policy")
lines = []
data = DataPipeline(load_run_config("andrea-tiny"), policy, lines.append)
built = sum("building its token cache" in line for line in lines)
print(data.arms["posts"].info["cache"], built, len(data.arms["posts"].train), flush=True)
"""


def test_processes_building_one_corpus_cache_at_once_build_it_once(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "posts.jsonl").write_bytes(jsonl_bytes([document(i, 200) for i in range(300)]))
    env = _env() | {"ANDREA_CACHE_DIR": str(tmp_path / "cache"), "ANDREA_SHARD_TOKENS": "3000"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(root)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
        )  # fmt: skip
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=600)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert len({(o[0], o[2]) for o in outs}) == 1, outs  # one cache, the same tokens, for all three
    # One of them built it; the others waited on its lock and read its work (or came after it).
    assert sorted(int(o[1]) > 0 for o in outs) == [False, False, True], outs
