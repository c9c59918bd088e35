"""The `audit-fork` flow in Prefect's ephemeral mode, as the review ran it (issue 15.4, 15.5 and its
unchecked parameters): an audit in which every branch fails ends Failed naming each branch's error; a
rerun after a failure finishes what is missing; steps and val_sequences are checked before any write."""

from __future__ import annotations

import pytest
from prefect_ephemeral import ephemeral_prefect  # noqa: F401
from test_pivot_checks import half_policy
from test_retention import fabricated_run

from andrea_core.config import ConfigError
from andrea_core.run.rundir import FORKS, LOSS_LOG, RunDir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ephemeral_prefect")]


def test_an_audit_whose_every_branch_fails_ends_failed_naming_each_error(tmp_path, monkeypatch):
    """Every branch's trainer fails (the guard stops each at its divergence, exit 3: a poisoned batch at
    data position 101): the flow ends Failed naming each branch and its error."""
    from flows.audit_fork import audit_fork

    parent = fabricated_run(str(tmp_path / "parent"), [100])
    monkeypatch.setenv("ANDREA_TEST_GUARD_NAN_AT", "101")  # the branches' trainers inherit it
    branches = [
        {"name": "a", "overrides": {"train.lr": 1e-3}},
        {"name": "b", "overrides": {"train.lr": 2e-3}},
    ]
    state = audit_fork(
        parent.url, branches, steps=3, device="cpu", gpu_slot=None, val_sequences=4, replicates=1,
        return_state=True,
    )  # fmt: skip
    assert state.is_failed(), state.message
    assert state.message.startswith("no branch could be evaluated: a: ")
    for name in ("a", "b"):
        branch = f"{parent.url}-fork100-{name}"
        assert f"{name}: {branch}: trainer failed (exit 3): " in state.message
    assert state.message.count("diverged at step 101 under train.lr=") == 2


def test_a_branch_policy_without_data_here_is_refused_before_anything_is_written(tmp_path):
    """A branch under a policy of its own is a new run of it: an arm with no data on this machine is
    refused at the fork, naming the branch, as a pivot refuses it; the parent gains no fork line and no
    branch folder is made (before: each branch's trainer failed, exit 2, after the copy)."""
    from flows.audit_fork import audit_fork

    parent = fabricated_run(str(tmp_path / "parent"), [100])
    policy = half_policy(tmp_path)
    branches = [
        {"name": "a", "overrides": {"data.policy": policy}},
        {"name": "b", "overrides": {"train.lr": 1e-3}},
    ]
    state = audit_fork(
        parent.url, branches, steps=3, device="cpu", gpu_slot=None, val_sequences=4, return_state=True
    )
    assert state.is_failed()
    assert (
        "ConfigError: policy 'half': arm 'gone' is unavailable (arm 'gone' (prose): no source files found on "
        "this machine): branch 'a' is refused before anything is touched"
    ) in state.message
    assert not parent.exists(FORKS) and not (tmp_path / "parent-fork100-a").exists()


def test_a_rerun_after_a_failed_report_writes_the_report_without_retraining(tmp_path):
    from flows.audit_fork import audit_fork

    parent = fabricated_run(str(tmp_path / "parent"), [100])
    obstacle = tmp_path / "a-file"
    obstacle.write_text("the report folder cannot be made under a file")
    branches = [{"name": "a"}, {"name": "b", "overrides": {"train.lr": 1e-4}}]
    # One run a branch: the rerun's promise is per branch folder (replicates are the verdict's, test_fork's).
    common = {"steps": 3, "device": "cpu", "gpu_slot": None, "val_sequences": 4, "replicates": 1}
    first = audit_fork(parent.url, branches, report_dir=str(obstacle / "report"), return_state=True, **common)
    assert first.is_failed()
    urls = [f"{parent.url}-fork100-{b['name']}" for b in branches]
    logs = {u: RunDir(u).read_bytes(LOSS_LOG) for u in urls}
    assert all(RunDir(u).checkpoint_steps() == [100, 103] for u in urls)

    good = tmp_path / "reports" / "audit"
    second = audit_fork(parent.url, branches, report_dir=str(good), return_state=True, **common)
    assert second.is_completed(), second.message
    assert "already audited" not in second.message and f"Report {good}/report.md" in second.message
    assert (good / "report.md").read_text().startswith(f"# Audit fork of `{parent.url}` at step 100")
    assert {u: RunDir(u).read_bytes(LOSS_LOG) for u in urls} == logs, "the branches were not retrained"
    assert len(parent.read_text(FORKS).splitlines()) == 1

    third = audit_fork(parent.url, branches, report_dir=str(good), return_state=True, **common)
    assert third.is_completed() and "was already audited" in third.message


@pytest.mark.parametrize(
    "bad,error",
    [
        ({"steps": 0}, r"steps: expected a whole number >= 1, got 0"),
        ({"val_sequences": 0}, r"val_sequences: expected a whole number 1\.\.4096, got 0"),
        ({"report_dir": "/tmp/x/../../etc"}, r"report_dir: '/tmp/x/\.\./\.\./etc' may not contain '\.\.'"),
        (
            {"branches": [{"name": "a"}, {"name": "b", "overrides": {"data.val_fraction": 0.01}}]},
            r"branch 'b': data\.val_fraction 0\.01 \(the parent's is 0\.05\)",
        ),
    ],
)
def test_bad_parameters_are_refused_before_anything_is_written(tmp_path, bad, error):
    from flows.audit_fork import audit_fork

    parent = fabricated_run(str(tmp_path / "runs" / "parent"), [100])
    before = sorted(p.name for p in (tmp_path / "runs").iterdir())
    params = {"branches": [{"name": "a"}, {"name": "b"}], "device": "cpu", "gpu_slot": None, **bad}
    with pytest.raises(ConfigError, match=error):
        audit_fork(parent.url, **params)
    assert not parent.exists(FORKS) and sorted(p.name for p in (tmp_path / "runs").iterdir()) == before


@pytest.mark.parametrize(
    "bad_branch,error",
    [
        (
            {"name": "b", "overide": {"train.lr": 1e-4}},
            r"\n - branches\.1\.overide: Extra inputs are not permitted",
        ),
        (
            {"name": "q/../../escaped"},
            r"\n - branches\.1\.name: Value error, branch: name 'q/\.\./\.\./escaped' is not",
        ),
        (
            {"name": "b", "overrides": [1e-4]},
            r"\n - branches\.1\.overrides: Input should be a valid dictionary",
        ),
    ],
)
def test_a_misspelled_branch_key_or_a_bad_name_is_refused_before_the_flow_starts(tmp_path, bad_branch, error):
    """A direct call is validated against tasks.fork.Branch as a deployment run is at submission
    (test_prefect_flows.py): the flow's body never runs, so nothing is written."""
    from prefect.exceptions import ParameterTypeError

    from flows.audit_fork import audit_fork

    parent = fabricated_run(str(tmp_path / "runs" / "parent"), [100])
    before = {p: p.read_bytes() for p in sorted((tmp_path / "runs").rglob("*")) if p.is_file()}
    with pytest.raises(ParameterTypeError, match=error):
        audit_fork(parent.url, [{"name": "a"}, bad_branch], steps=3, device="cpu", gpu_slot=None)
    assert {p: p.read_bytes() for p in sorted((tmp_path / "runs").rglob("*")) if p.is_file()} == before
    assert not parent.exists(FORKS)
