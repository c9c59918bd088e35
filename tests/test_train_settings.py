"""`andrea train --set key=value` and `--policy NAME|PATH` for a new run, and the train flow's `settings`
and `policy` parameters (issue 46.1): checked as `andrea fork --set` and a config file check the same
value, before anything is written; frozen into run.yaml and used by the trainer; refused on a run that
exists where they would change it, naming the setting and the command that would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from prefect_ephemeral import ephemeral_prefect  # noqa: F401

from andrea_core.command import restart_args, train_argv, train_options
from andrea_core.config import CONFIG_DIR, ConfigError, load_run_config, parse_settings
from andrea_core.data.policy import load_policy
from andrea_core.run.loss_log import read_history
from andrea_core.run.record import read_run
from andrea_core.run.rundir import RunDir
from andrea_core.train.optim import lr_at
from tests.conftest import TINY, andrea


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def my_policy(folder: Path) -> Path:
    """A policy outside configs/: the stdlib arm under a name of the user's."""
    path = folder / "policies" / "mine.yaml"
    path.parent.mkdir()
    text = (
        (CONFIG_DIR / "policies" / "stdlib-only.yaml").read_text().replace("name: stdlib-only", "name: mine")
    )
    path.write_text(text)
    return path


def test_a_new_run_from_set_and_policy_trains_with_them_and_a_resume_refuses_a_change(tmp_path):
    policy, run = my_policy(tmp_path), tmp_path / "run"
    sets = ["train.lr=2e-2", "train.warmup_steps=0", "train.max_steps=4", "train.checkpoint_every=2"]
    args = ["--config", TINY, "--run-dir", str(run), "--device", "cpu", "--policy", str(policy)]
    andrea("train", *args, *[w for s in [*sets, "train.num_threads=1"] for w in ("--set", s)])
    cfg = read_run(RunDir(str(run))).config
    assert (cfg.train.lr, cfg.train.warmup_steps, cfg.train.max_steps) == (0.02, 0, 4)
    assert (cfg.train.checkpoint_every, cfg.train.num_threads, cfg.data.policy) == (2, 1, str(policy))
    assert cfg == load_run_config(TINY).with_overrides(
        {**parse_settings([*sets, "train.num_threads=1"]), "data.policy": str(policy)}
    )
    assert (run / "policy.yaml").read_text() == load_policy(str(policy))[1]
    # The trainer trained with them: its lr each step is lr 2e-2's schedule with no warm-up, its data
    # the policy's arm, its checkpoints every 2 steps.
    history = read_history(RunDir(str(run)))
    assert [e.lr for e in history] == [lr_at(s, cfg.train) for s in (1, 2, 3, 4)]
    assert history[0].lr > 0.0199 and {e.arm for e in history} == {"stdlib-code"}
    assert sorted(p.name for p in run.glob("step_*.bin")) == ["step_000002.bin", "step_000004.bin"]
    # The lock records a restart's options, not the new run's settings (command.restart_args).
    recorded = json.loads((run / ".trainer.json").read_text())["train_args"]
    assert recorded == ["--config", TINY, "--run-dir", str(run), "--device", "cpu"]

    before = snapshot(run)
    refusals = {
        ("--set", "train.lr=0.03"): f"--set train.lr=0.03 would change a run that exists (run.yaml is "
        f"frozen); to train with that, fork it: andrea fork {run} --branch NAME --set train.lr=0.03",
        ("--policy", "stdlib-only"): "--policy stdlib-only would change a run that exists (run.yaml is "
        f"frozen); to train with another policy, pivot it: andrea pivot {run} --policy stdlib-only",
        ("--set", "train.max_steps=9"): "--set train.max_steps=9 would change a run that exists (run.yaml "
        f"is frozen); to train with that, give it a new target: andrea train --run-dir {run} --max-steps 9",
        ("--set", "train.lr=0.03", "--set", "train.seed=7"): "--set train.lr=0.03 --set train.seed=7 "
        "would change a run that exists (run.yaml is frozen); to train with that, fork it: andrea fork "
        f"{run} --branch NAME --set train.lr=0.03 --set train.seed=7",
    }
    for given, message in refusals.items():
        proc = andrea("train", "--run-dir", str(run), "--device", "cpu", *given, check=False)
        assert (proc.returncode, proc.stderr) == (2, f"andrea: error: {run}: {message}\n")
        assert snapshot(run) == before, f"{given} touched the run"
    # The values it has already are no change: a unit repeating its creation command resumes.
    proc = andrea("train", *args, *[w for s in sets for w in ("--set", s)], "--set", "train.num_threads=1")
    assert "already at step 4 >= max_steps 4; nothing to do" in proc.stdout
    # The same bad setting, through fork's --set, is refused by the same check.
    proc = andrea("fork", str(run), "--branch", "b", "--set", "train.lrr=1", "--replicates", "1", check=False)
    assert (proc.returncode, proc.stderr) == (2, "andrea: error: branch 'b': train.lrr: unknown field\n")


BAD = [
    (["--set", "train.lrr=1"], "andrea train --set: train.lrr: unknown field"),
    (["--set", "train.lr=abc"], "andrea train --set: train.lr: expected float, got str 'abc'"),
    (["--set", "train.batch_size=1.5"], "andrea train --set: train.batch_size: expected int, got float 1.5"),
    (["--set", "train.lr=-1"], "andrea train --set: train.lr lr must be > 0 and min_lr >= 0"),
    (["--set", "train.lr=.inf"], "andrea train --set: train.lr inf is not finite"),
    (["--set", "nosuch.x=1"], "andrea train --set: nosuch.x: no such section 'nosuch'"),
    (
        ["--set", "train.guard=1"],
        "andrea train --set: train.guard: is a section, not a field; override "
        "its fields one by one (train.guard.FIELD=VALUE)",
    ),  # fmt: skip
    (["--set", "train.lr"], "--set 'train.lr': expected key=value, e.g. train.lr=3e-4"),
    (["--set", "train.lr=1", "--set", "train.lr=2"], "--set: train.lr is given twice"),
    (
        ["--policy", "stdlib-only", "--set", "data.policy=tiny-mix"],
        "--policy and --set data.policy: give the policy once",
    ),  # fmt: skip
    (
        ["--policy", "{tmp}/missing.yaml"],
        "config '{tmp}/missing.yaml' not found (a path, or one of: default, polish, stdlib-only, tiny-mix)",
    ),  # fmt: skip
    (["--policy", "{tmp}/empty.yaml"], "{tmp}/empty.yaml: arms: must list at least one arm"),
]


@pytest.mark.parametrize(("given", "message"), BAD, ids=[" ".join(g) for g, _ in BAD])
def test_a_bad_setting_or_policy_is_refused_before_anything_is_written(tmp_path, given, message):
    (tmp_path / "empty.yaml").write_text("name: empty\nmixer: uniform\narms: []\n")
    given, message = (
        [g.replace("{tmp}", str(tmp_path)) for g in given],
        message.replace("{tmp}", str(tmp_path)),
    )
    before = snapshot(tmp_path)
    proc = andrea("train", "--config", TINY, "--run-dir", str(tmp_path / "run"), *given, check=False)
    assert (proc.returncode, proc.stderr) == (2, f"andrea: error: {message}\n")
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


def test_a_setting_is_checked_as_the_same_value_in_a_config_file(tmp_path):
    """The message after its source is the one a config file with that value gets."""
    raw = yaml.safe_load(Path(TINY).read_text())
    for key, value in (("lr", "abc"), ("batch_size", 1.5), ("lr", -1), ("warmup_steps", -3)):
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump({**raw, "train": {**raw["train"], key: value}}))
        with pytest.raises(ConfigError) as from_file:
            load_run_config(str(path))
        with pytest.raises(ConfigError) as from_set:
            load_run_config(TINY).with_overrides(
                parse_settings([f"train.{key}={value}"]), "andrea train --set"
            )
        assert str(from_set.value).removeprefix("andrea train --set: ") == str(from_file.value).removeprefix(
            f"{path}: "
        )


def test_settings_go_through_the_command_line_and_back_unchanged():
    """The flow's settings (JSON values) become --set words that parse back to the same values; the
    lock's record of a command line leaves them out (a restart resumes), and so does train_options."""
    settings = {"train.lr": 1e-05, "train.seed": 7, "data.tokenizer": "bpe", "train.compile": True,
                "train.sample_every": None, "train.audit_prompts": ["def ", "a: b"]}  # fmt: skip
    argv = train_argv("/runs/x", config="andrea-tiny", settings=settings, policy="p.yaml", python="py")
    words = argv[argv.index("--config") + 2 :]
    texts = [words[i + 1] for i in range(0, 2 * len(settings), 2)]
    assert words[: 2 * len(settings) : 2] == ["--set"] * len(settings) and words[-2:] == [
        "--policy",
        "p.yaml",
    ]
    assert parse_settings(texts) == settings
    assert parse_settings(["train.lr=1e-3"]) == {"train.lr": 0.001}  # YAML 1.1's string, the number meant
    args = argv[argv.index("train") + 1 :]
    assert restart_args(args) == ["--run-dir", "/runs/x", "--device", "auto", "--config", "andrea-tiny"]
    assert restart_args(["--set=train.lr=1", "--policy=p", "--max-steps", "9"]) == ["--max-steps", "9"]
    assert train_options(args)["device"] == "auto"  # --set and --policy are known and skipped
    many = [f"train.seed={i}" for i in range(300)]
    for bad, why in (({"": 1}, "every key must be"), (3, "expected key=value texts or a mapping"),
                     (["x" * 5000], "at most 4096"), (many, "more than 256")):  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            parse_settings(bad, "settings")


@pytest.mark.slow
@pytest.mark.usefixtures("ephemeral_prefect")
def test_the_train_flow_takes_settings_and_policy_through_the_same_check(tmp_path):
    from flows.train import train

    policy, run = my_policy(tmp_path), tmp_path / "run"
    state = train(str(run), TINY, device="cpu", settings=["train.lr=abc"], return_state=True)
    assert state.is_failed() and not run.exists()
    assert "andrea train --set: train.lr: expected float, got str 'abc'" in str(state.message)
    settings = {"train.lr": 0.02, "train.max_steps": 2, "train.checkpoint_every": 2, "train.num_threads": 1}
    state = train(str(run), TINY, device="cpu", settings=settings, policy=str(policy), return_state=True)
    assert state.is_completed(), state.message
    cfg = read_run(RunDir(str(run))).config
    assert (cfg.train.lr, cfg.train.max_steps, cfg.data.policy) == (0.02, 2, str(policy))
    assert [e.lr for e in read_history(RunDir(str(run)))] == [lr_at(s, cfg.train) for s in (1, 2)]
    # A resume through the flow that would change a setting fails before any trainer starts.
    before = snapshot(run)
    state = train(str(run), device="cpu", settings={"train.lr": 0.5}, return_state=True)
    assert state.is_failed() and "fork it: andrea fork" in str(state.message) and snapshot(run) == before
    shutil.rmtree(run)
