"""`andrea`: the operator's command line (also `python -m andrea_core`).

Imports are made where they are needed: `andrea train` installs its signal handlers before anything
heavy is imported (torch takes a second or more), and the commands that never train never import torch.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import posixpath
import sys

from andrea_core import faults, signals
from andrea_core.poll import poll_until


def _hold_start_up_for_tests(flags: signals.TrainerSignals) -> None:
    """ANDREA_TEST_STARTUP_DELAY=<seconds>: with the handlers installed and nothing else done yet, say
    so and wait up to that long, or until a stop signal arrives. A test can then land a signal inside
    the start-up window for certain instead of racing the torch import. Unset: no effect."""
    delay = faults.startup_delay()
    if delay <= 0:
        return
    print("andrea: start-up held (ANDREA_TEST_STARTUP_DELAY): signal handlers installed", flush=True)
    poll_until(lambda: flags.stop is not None, delay, 0.01)


def cmd_train(args: argparse.Namespace) -> int:
    if args.nproc_per_node is not None and "LOCAL_RANK" not in os.environ:
        from andrea_core.train.launch import check_world_size

        # Every path to torchrun passes here (a CPU job's without importing torch).
        check_world_size(args.nproc_per_node, "--nproc-per-node", args.device)
    if args.nproc_per_node and args.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        # Become the torchrun agent (same pid: the operator's SIGTERM reaches it, and it every rank).
        from andrea_core.config import parse_settings
        from andrea_core.run.rundir import RunDir
        from andrea_core.train.launch import torchrun_argv
        from andrea_core.train.setup import train_config

        # Refused here, once, before torchrun starts any rank (each checks again: rank 0 as below).
        train_config(RunDir(args.run_dir), args.config, parse_settings(args.settings), args.policy)
        train_args = ["--run-dir", args.run_dir, "--device", args.device, "--pace", str(args.pace)]
        options = (("--config", args.config), ("--max-steps", args.max_steps), ("--policy", args.policy))
        for flag, value in options:
            train_args += [flag, str(value)] if value is not None else []
        for setting in args.settings:
            train_args += ["--set", setting]
        argv = torchrun_argv(args.nproc_per_node, train_args)
        os.execv(argv[0], argv)
    flags = signals.install()  # normally done already, before the first import (main)
    if os.environ.get("RANK", "0") == "0":
        # Opened now, not at the first record: a supervisor's temporary events file loses its name as
        # the trainer opens it (train/events.py), so a supervisor killed during start-up leaves none.
        from andrea_core.train.events import channel

        channel()
    _hold_start_up_for_tests(flags)
    from andrea_core.config import parse_settings
    from andrea_core.run.rundir import RunDir
    from andrea_core.train.setup import train_config

    if os.environ.get("RANK", "0") == "0":
        # --config with --set and --policy, each checked as a config file's value, and refused on a run
        # that exists where they would change it: before the lock, target.jsonl or any file is written.
        cfg = train_config(RunDir(args.run_dir), args.config, parse_settings(args.settings), args.policy)
    else:  # a rank > 0 checks what rank 0 created against the same config (prepare_run)
        from andrea_core.config import load_run_config

        given = parse_settings(args.settings) | ({"data.policy": args.policy} if args.policy else {})
        cfg = load_run_config(args.config) if args.config else None
        cfg = cfg and cfg.with_overrides(given, "andrea train --set")
    if flags.stop is None:
        # A pivot left half done refuses the trainer before it touches anything: no lock taken with
        # this command's arguments, no --max-steps appended to target.jsonl (the trainer checks again
        # under its lock, for a pivot that gets there meanwhile).
        from andrea_core.run.pivot_journal import require_no_half_pivot

        require_no_half_pivot(RunDir(args.run_dir))
        from andrea_core.train.trainer import Trainer  # torch: a second or more

    if flags.stop is not None:
        # Nothing trained yet, nothing to checkpoint: the stop is honoured before any work.
        print(f"andrea: {flags.stop} before the first step (during start-up): nothing to checkpoint, exiting")
        _emit_train_event("result", step=None, reason=flags.stop, checkpoint=None)
        return 0
    trainer = Trainer(
        args.run_dir,
        cfg,
        max_steps=args.max_steps,
        device=args.device,
        pace=args.pace,
        keep_signal_handlers=True,
        train_args=getattr(args, "train_args", None),
    )
    from andrea_core.train.distributed import exit_follower
    from andrea_core.train.guard import EXIT_DIVERGED, DivergedTooOften

    try:
        result = trainer.train()
    except DivergedTooOften as e:
        # The guard's bound: one line naming the steps, the events and what to try; a status of its own
        # that systemd's unit does not restart on (RestartPreventExitStatus).
        print(f"andrea: {e}", file=sys.stderr)
        if trainer.world.is_main:
            _emit_train_event("error", message=str(e))
        exit_follower(trainer.world, EXIT_DIVERGED)
        return EXIT_DIVERGED
    if trainer.world.is_main:  # the supervisor's record of how it ended (train/events.py)
        _emit_train_event("result", step=result.step, reason=result.reason, checkpoint=result.checkpoint)
    code = 0 if result.reason in ("completed", "already-complete", "SIGTERM", "SIGINT") else 1
    exit_follower(trainer.world, code)  # a rank > 0 ends here (under torchrun)
    return code


def _emit_train_event(event: str, **fields: object) -> None:
    """One structured record for the trainer's supervisor (train/events.py; stdlib, no torch)."""
    from andrea_core.train.events import emit

    emit(event, **fields)


def format_inspect(report: dict) -> str:
    verdict = "VALID" if report["valid"] else f"INVALID: {report['problem']}"
    lines = [
        f"{report['file']}: {verdict}",
        f"  step {report['step']}  n_params {report['n_params']}  {report['bytes']:,} bytes",
    ]
    if report.get("checksum"):
        lines.append(f"  checksum: {report['checksum']}")
    for region, st in (report.get("regions") or {}).items():
        fmt = lambda v: "n/a" if v is None else f"{v:.6g}"  # noqa: E731
        lines.append(
            f"  {region:<8} min {fmt(st['min']):>12}  max {fmt(st['max']):>12}  "
            f"mean {fmt(st['mean']):>12}  non-finite {st['non_finite']}"
        )
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    from andrea_core.bounded import read_bounded
    from andrea_core.checkpoint import HEADER, region_stats, size_problem
    from andrea_core.config import ConfigError
    from andrea_core.run.rundir import url_to_fs

    fs, path = url_to_fs(args.file, "andrea inspect")
    if fs.isdir(path):
        raise ConfigError(
            f"{args.file}: a directory (a run directory?), not a checkpoint file: "
            f"inspect takes one, e.g. {args.file.rstrip('/')}/step_000100.bin"
        )
    name = posixpath.basename(args.file.rstrip("/"))
    size = fs.size(path)
    with fs.open(path, "rb") as f:
        header = f.read(HEADER.size)
        step, n = HEADER.unpack(header) if len(header) == HEADER.size else (None, None)
        if n is not None and n > 0 and size_problem(size, n):
            # Refused from its header: a 3 GB file claiming n = 1 is never read whole.
            report = {"file": name, "bytes": size, "step": step, "n_params": n, "valid": False}
            report["problem"], report["checksum"] = size_problem(size, n), None
        else:
            data = header + read_bounded(f, max(size - len(header), 0), args.file)
            report = region_stats(data, name)
    print(json.dumps(report, indent=1) if args.json else format_inspect(report))
    return 0 if report["valid"] else 1


def cmd_loss(args: argparse.Namespace) -> int:
    from andrea_core.run.loss_log import ema, read_history
    from andrea_core.run.rundir import RunDir

    run = RunDir(args.run_dir)
    history = read_history(run)
    if not history:
        print(f"{run.url}: no loss history yet", file=sys.stderr)
        return 1
    last = history[-1]
    summary = {
        "run": run.url,
        "steps": len(history),
        "last_step": last.step,
        "last_loss": last.loss,
        "ema_loss": ema([e.loss for e in history]),
        "segments": len({e.segment for e in history}),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{run.url}: step {last.step}  loss {last.loss:.4f}  EMA {summary['ema_loss']:.4f}  "
            f"({summary['steps']} steps over {summary['segments']} segment(s))"
        )
    if args.plot:
        from andrea_core.ops.loss_view import loss_view, plot_view
        from andrea_core.run.rundir import open_url

        png = plot_view(loss_view(run))
        with open_url(args.plot, "wb", "andrea loss --plot") as f:
            f.write(png)
        print(f"plot written to {args.plot}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from andrea_core.config import ConfigError
    from andrea_core.run import lock
    from andrea_core.run.record import read_run, run_n_params
    from andrea_core.run.retention import apply_retention, format_plan
    from andrea_core.run.rundir import RunDir

    run = RunDir(args.run_dir)
    if not run.exists("run.yaml"):
        raise ConfigError(f"{run.url}: not a run directory (no run.yaml)")
    record = read_run(run)
    overrides = {
        f"retention.{k}": v for k, v in (("keep_last", args.keep_last), ("keep_every", args.keep_every))
    }
    cfg = record.config.with_overrides({k: v for k, v in overrides.items() if v is not None}, "andrea gc")
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    if args.dry_run:
        plan = apply_retention(run, cfg.retention, run_n_params(record), log, dry_run=True)
    else:
        me = lock.acquire(run, log=log)  # a trainer applies retention itself; none may start meanwhile
        try:
            run.discard_incomplete_writes(log)
            plan = apply_retention(run, cfg.retention, run_n_params(record), log)
        finally:
            lock.release(run, me)
    print(f"{run.url}:")
    print(format_plan(plan, args.dry_run))
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    from andrea_core.run.lineage import format_lineage, read_lineage

    lineage = read_lineage(args.run_dir)
    print(json.dumps(lineage.to_dict(), indent=1) if args.json else format_lineage(lineage))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from andrea_core.run.rundir import RunDir
    from andrea_core.run.samples import format_audit, read_audits

    run = RunDir(args.run_dir)
    audits = read_audits(run)
    if args.step is not None:
        audits = [a for a in audits if a["step"] == args.step]
    if not audits:
        which = f"at step {args.step}" if args.step is not None else "yet"
        print(f"{run.url}: no sample audit {which}", file=sys.stderr)
        return 1
    try:
        text = json.dumps(audits[-1], indent=1) if args.json else format_audit(audits[-1])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        from andrea_core.config import ConfigError
        from andrea_core.run.rundir import SAMPLES

        return _refuse(ConfigError(f"{run.path(SAMPLES)}: a malformed audit ({type(e).__name__}: {e})"))
    print(text)
    return 0


# --- commands over a run's checkpoints: no training, torch only where the model runs ----------------


def _refuse(e: Exception) -> int:
    """Bad input to a command (unknown run, missing step, a checkpoint that fails validation): one line
    that names it, exit status 2, nothing touched."""
    print(f"andrea: error: {e}", file=sys.stderr)
    return 2


def _warn(msg: str) -> None:
    print(f"andrea: warning: {msg}", file=sys.stderr)


def cmd_status(args: argparse.Namespace) -> int:
    from andrea_core.checkpoint import CheckpointError
    from andrea_core.ops.status import format_status, run_status

    try:
        statuses = [run_status(url) for url in args.run_dirs]
    except CheckpointError as e:
        return _refuse(e)
    if args.json:
        print(json.dumps([st.to_dict() for st in statuses], indent=1))
    else:
        print("\n\n".join(format_status(st) for st in statuses))
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from andrea_core.checkpoint import CheckpointError
    from andrea_core.ops.sample import sample

    try:
        result = sample(
            args.run_dir,
            args.prompt,
            step=args.step,
            tokens=args.tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            device=args.device,
            warn=_warn,
        )
    except CheckpointError as e:
        return _refuse(e)
    if args.json:
        print(json.dumps(result.__dict__, indent=1))
    else:
        print(f"# {result.settings_line()}", file=sys.stderr)
        print(result.prompt + result.completion)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from andrea_core.checkpoint import CheckpointError
    from andrea_core.ops.export import ExportError, export_checkpoint, format_export

    try:
        result = export_checkpoint(args.run_dir, args.out_dir, args.step, args.dtype, warn=_warn)
    except (CheckpointError, ExportError) as e:
        return _refuse(e)
    print(format_export(result))
    return 0


def cmd_pivot(args: argparse.Namespace) -> int:
    from andrea_core.checkpoint import CheckpointError
    from andrea_core.ops import pivot
    from andrea_core.ops.pivot import check_pivot
    from andrea_core.ops.supervise import SupervisionError
    from andrea_core.run.rundir import RunDir

    run = RunDir(args.run_dir)
    log = lambda msg: print(f"andrea: {msg}", flush=True)  # noqa: E731
    try:
        if args.abandon:
            if args.policy or args.request_id:
                raise ValueError("--abandon takes no --policy or --request-id")
            pivot.abandon(run, log)
            return 0
        if not args.policy:
            raise ValueError("--policy is required (the policy to pivot to), or --abandon")
        # Every check before anything is touched: a bad policy never half-pivots a run.
        checked = check_pivot(
            run,
            args.policy,
            max_steps=args.max_steps,
            device=args.device,
            restart=args.restart,
            warn=_warn,
            request_id=args.request_id,
        )
        result = pivot.run_pivot(
            run,
            checked,
            at=args.at,
            restart=pivot.detached_restart(log) if args.restart else None,
            timeout_s=args.timeout,
            log=log,
        )
    except (CheckpointError, ValueError) as e:
        return _refuse(e)
    except SupervisionError as e:
        print(f"andrea: error: {e}", file=sys.stderr)
        return 1
    line = f"pivoted {run.url} at step {result['boundary']} to policy {result['policy']!r}"
    if result.get("already"):
        since = result["trained_since"]
        trained = f"{since} steps trained since" if since else "nothing trained since"
        line += f" already ({trained}): nothing done"
        if "trainer" in result:
            line += f"; trainer pid {result['trainer']['pid']} on {result['trainer']['host']} holds the run"
    elif "resumed" in result:
        resumed = result["resumed"]
        line += f"; resumed at step {resumed['first_step']}, trainer pid {resumed['pid']}"
        if "host" in resumed:  # started there, not by this pivot: its output is that host's
            line += f" on {resumed['host']} (cannot be checked from here)"
        if "started" in resumed:  # another took the run first: the one started here is refused or waits
            started = resumed["started"]
            if started["ended"]:
                line += f"; the one this pivot started found the run taken: {started['ended']}"
            else:
                line += f"; the one this pivot started, pid {started['pid']}, waits for the run "
                line += f"(output in {pivot.trainer_log_path(run)})"
        elif "host" not in resumed:
            line += f" (output in {pivot.trainer_log_path(run)})"
    else:
        line += "; trainer left stopped"
    print(line)
    return 0


class _BranchAction(argparse.Action):
    """--branch NAME starts a branch; each --set key=value after it belongs to that branch."""

    def __call__(self, parser, namespace, value, option_string=None):
        branches = getattr(namespace, "branches", None) or []
        if option_string == "--branch":
            branches.append({"name": value, "overrides": {}})
        else:
            if not branches:
                parser.error(f"--set {value}: name its branch first (--branch NAME --set {value})")
            from andrea_core.config import ConfigError, parse_setting

            try:
                key, parsed = parse_setting(value)
            except ConfigError as e:
                parser.error(str(e))
            branches[-1]["overrides"][key] = parsed
        namespace.branches = branches


def cmd_fork(args: argparse.Namespace) -> int:
    from andrea_core.checkpoint import CheckpointError
    from andrea_core.ops.fork import DEFAULT_REPLICATES, BranchSpec, fork

    replicates = DEFAULT_REPLICATES if args.replicates is None else args.replicates
    if not args.branches:
        return _refuse(ValueError("fork: name one or more branches (--branch NAME [--set key=value ...])"))
    specs = [BranchSpec(b["name"], b["overrides"]) for b in args.branches]
    try:
        urls = fork(
            args.run_dir, specs, args.step, log=lambda msg: print(msg, file=sys.stderr), replicates=replicates
        )
    except CheckpointError as e:
        return _refuse(e)
    # One line a branch (its replicate 0: the folder to name to `andrea compare`), its replicates after.
    for i, spec in enumerate(specs):
        runs = urls[i * replicates : (i + 1) * replicates]
        print(f"{spec.name}: {runs[0]}")
        for r, url in enumerate(runs[1:], 1):
            print(f"  replicate {r}: {url}", file=sys.stderr)
    if replicates > 1:
        print(
            f"train every run (each branch's {replicates} replicates) the same steps, then "
            "`andrea compare` the branches' folders: their replicates are found beside them",
            file=sys.stderr,
        )
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from andrea_core.checkpoint import CheckpointError
    from andrea_core.ops.compare import (
        DEFAULT_VAL_SEQUENCES,
        compare_branches,
        default_report_dir,
        forked_from,
        write_report,
    )

    val_sequences = DEFAULT_VAL_SEQUENCES if args.val_sequences is None else args.val_sequences
    try:
        parent, step = forked_from(args.branch_dirs)
        comparison = compare_branches(parent, args.branch_dirs, step, val_sequences=val_sequences, warn=_warn)
    except CheckpointError as e:
        return _refuse(e)
    paths = write_report(comparison, args.out or default_report_dir(parent, step))
    summary = comparison.to_dict()
    if args.json:
        print(json.dumps({**summary, **paths}, indent=1, default=str))
    else:
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        c = comparison
        print(f"{c.verdict}\nmargin {fmt(c.margin)}, noise {fmt(c.noise)} (training {fmt(c.noise_training)}, "
              f"held-out {fmt(c.noise_held_out)}) at step {c.step}")  # fmt: skip
        print(f"report {paths['report']}, plot {paths['plot']}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from andrea_core.data.prepare import format_stats, prepare, resolve_target

    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    target = resolve_target(args.target, args.config)
    rows = prepare(target, log)  # stats builds what is missing too: its numbers are the caches'
    print(json.dumps(rows, indent=1) if args.json else format_stats(target, rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="andrea", description="Train and audit ANDREA GPT runs.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="create or resume a run and train it")
    t.add_argument("--config", help="config name under configs/ or a YAML path (new runs)")
    t.add_argument("--run-dir", required=True, help="run directory: a path or fsspec URL")
    t.add_argument("--max-steps", type=int, help="train up to this step (default: the config's)")
    t.add_argument(
        "--set",
        action="append",
        dest="settings",
        default=[],
        metavar="KEY=VALUE",
        help="a run-config setting of a new run, e.g. train.lr=1e-3 (repeatable; checked as in a config "
        "file; a run that exists is forked to change one)",
    )
    t.add_argument("--policy", help="a new run's data policy: a name under configs/policies/ or a YAML path")
    t.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default auto)")
    t.add_argument("--pace", type=float, default=0.0, help="minimum seconds per step (demos, tests)")
    t.add_argument(
        "--nproc-per-node",
        type=int,
        help="data-parallel ranks on this machine: runs torchrun (--standalone) for you; batch_size "
        "stays the global batch (multi-node: run torchrun -m andrea_core train yourself)",
    )
    t.set_defaults(fn=cmd_train)

    i = sub.add_parser("inspect", help="check a checkpoint file and summarise its regions")
    i.add_argument("file", help="a step_NNNNNN.bin path or URL")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(fn=cmd_inspect)

    lo = sub.add_parser("loss", help="summarise a run's canonical loss history")
    lo.add_argument("run_dir")
    lo.add_argument("--plot", help="write a PNG plot of the loss curve here")
    lo.add_argument("--json", action="store_true")
    lo.set_defaults(fn=cmd_loss)

    g = sub.add_parser("gc", help="delete the checkpoints the run's retention releases")
    g.add_argument("run_dir")
    g.add_argument("--dry-run", action="store_true", help="only show what would be deleted")
    g.add_argument("--keep-last", type=int, help="override the run's retention.keep_last")
    g.add_argument("--keep-every", type=int, help="override the run's retention.keep_every")
    g.set_defaults(fn=cmd_gc)

    li = sub.add_parser("lineage", help="print the tree of a run's phases (pivots) and forks")
    li.add_argument("run_dir")
    li.add_argument("--json", action="store_true")
    li.set_defaults(fn=cmd_lineage)

    au = sub.add_parser("audit", help="show a run's newest sample audit as a table")
    au.add_argument("run_dir")
    au.add_argument("--step", type=int, help="the audit of this step instead of the newest")
    au.add_argument("--json", action="store_true")
    au.set_defaults(fn=cmd_audit)

    st = sub.add_parser(
        "status", help="where runs stand: trainer, step, speed, ETA, checkpoints, phase, audit"
    )
    st.add_argument("run_dirs", nargs="+", metavar="run_dir")
    st.add_argument("--json", action="store_true", help="a JSON list, one object per run")
    st.set_defaults(fn=cmd_status)

    sa = sub.add_parser("sample", help="generate text from a run's checkpoint")
    sa.add_argument("run_dir")
    sa.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest valid)")
    sa.add_argument("--prompt", required=True, help="the text to continue")
    sa.add_argument("--tokens", type=int, default=200, help="new tokens to generate (default 200)")
    sa.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (default 0.8)")
    sa.add_argument("--top-k", type=int, help="sample only from the k likeliest tokens")
    sa.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    sa.add_argument("--device", default="cpu", help="auto, cpu or cuda[:N] (default cpu)")
    sa.add_argument("--json", action="store_true")
    sa.set_defaults(fn=cmd_sample)

    ex = sub.add_parser("export", help="write a checkpoint as a Hugging Face GPT2LMHeadModel folder")
    ex.add_argument("run_dir")
    ex.add_argument("out_dir", help="a new (or empty) folder: model.safetensors, config.json, tokenizer.json")
    ex.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest valid)")
    ex.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ex.set_defaults(fn=cmd_export)

    pv = sub.add_parser("pivot", help="change a run's data policy mid-run (the six pivot steps)")
    pv.add_argument("run_dir")
    pv.add_argument("--policy", help="policy name under configs/policies/ or a YAML path")
    pv.add_argument(
        "--at",
        choices=("boundary", "now"),
        default="boundary",
        help="the next checkpoint on the grid (default), or one written now (SIGUSR1)",
    )
    pv.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start the resumed trainer detached, output to RUN/trainer.log (default); "
        "--no-restart leaves it stopped (systemd starts it)",
    )
    pv.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for each step (1800)")
    pv.add_argument(
        "--max-steps",
        type=int,
        help="the resumed trainer trains to this step (default: the stopped trainer's --max-steps)",
    )
    pv.add_argument(
        "--device",
        help="the resumed trainer's device (default: the stopped trainer's, as its lock recorded it)",
    )
    pv.add_argument(
        "--request-id",
        help="this request's id (A-Z a-z 0-9 . _ : -, up to 64): a rerun with it finds the pivot done; "
        "another id pivots again, to the policy in force too (default: none; a pivot to the policy in "
        "force is then done already)",
    )
    pv.add_argument(
        "--abandon", action="store_true", help="undo a pivot that stopped part-way: restore the old phase"
    )
    pv.set_defaults(fn=cmd_pivot)

    fo = sub.add_parser("fork", help="copy a checkpoint into branch runs with their own config overrides")
    fo.add_argument("run_dir")
    fo.add_argument("--step", type=int, help="the checkpoint to fork (default: the newest valid)")
    fo.add_argument("--branch", action=_BranchAction, dest="branches", metavar="NAME", help="a branch")
    fo.add_argument(
        "--set",
        action=_BranchAction,
        dest="branches",
        metavar="KEY=VALUE",
        help="a run-config override of the branch named before it (value: a YAML scalar)",
    )
    fo.add_argument(
        "--replicates",
        type=int,
        help="runs a branch, identical but for their data order: the verdict's training noise "
        "(default: ops/fork.DEFAULT_REPLICATES, 3; with 1 no winner can be named)",
    )
    fo.set_defaults(fn=cmd_fork, branches=[])

    co = sub.add_parser("compare", help="score fork branches on the same held-out data: the verdict")
    co.add_argument("branch_dirs", nargs="+", metavar="branch_dir")
    co.add_argument("--out", help="report folder (default: beside the parent, <run>-fork<step>-report)")
    co.add_argument(
        "--val-sequences",
        type=int,
        help="held-out sequences per arm (default: ops/compare.DEFAULT_VAL_SEQUENCES, 256)",
    )
    co.add_argument("--json", action="store_true")
    co.set_defaults(fn=cmd_compare)

    da = sub.add_parser("data", help="build token caches ahead of a run; per-arm statistics")
    da_sub = da.add_subparsers(dest="data_command", required=True)
    for name, what in (("prepare", "build every arm's token cache now"), ("stats", "per-arm statistics")):
        d = da_sub.add_parser(name, help=what)
        d.add_argument("target", metavar="POLICY_OR_RUN", help="a run directory, or a policy (with --config)")
        d.add_argument("--config", help="the run config for a policy (tokenizer, model, length)")
        d.add_argument("--json", action="store_true")
        d.set_defaults(fn=cmd_data)
    return p


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """build_parser's parser, built once a process (~20 ms each: an in-process caller such as the
    Prefect tasks or the fuzz test calls main many times); parse_args keeps nothing in it."""
    return build_parser()


def main(argv: list[str] | None = None) -> int:
    trainer_process = argv is None and sys.argv[1:2] == ["train"]
    if trainer_process:
        # This process is a trainer: before anything else (and before torch), hold the trainer signals,
        # take a nonce (andrea_core.signals) and install the handlers that turn a signal into a flag.
        signals.become_trainer_process()
    raw = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(raw)
    # A fresh copy of each list (--set's default is the parser's own): nothing a command does to its
    # arguments reaches the next call's.
    vars(args).update({k: list(v) for k, v in vars(args).items() if isinstance(v, list)})
    if args.command == "train":  # its options, as given: recorded in the lock for a pivot's restart
        from andrea_core.command import restart_args

        args.train_args = restart_args(raw[raw.index("train") + 1 :])
    try:
        status = args.fn(args)
        sys.stdout.flush()  # here, not at exit: a reader gone (`| head`) is handled below
        return status
    except BrokenPipeError:
        return _reader_gone()
    except Exception as e:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            # A full disk or quota (the chaos soak's tmpfs, filled for good): one line, not a traceback,
            # and exit 1, a failure to retry once there is room (systemd's Restart=on-failure starts it
            # again). Every run file is written whole or not at all: nothing it wrote is half there.
            print(f"andrea: error: {e}: free space there, then run the command again", file=sys.stderr)
            _train_error(args, f"{e}: free space there, then run the command again")
            return 1
        if isinstance(e, OSError) and e.errno == errno.EIO:
            # The disk failed a read or a write (the power-cut soak's eio-read): the same, one line, exit 1.
            hint = "the disk failed; check it, then run the command again"
            print(f"andrea: error: {e}: {hint}", file=sys.stderr)
            return 1
        if not isinstance(e, _operator_errors()):
            _train_error(args, f"{type(e).__name__}: {e}")
            raise
        print(f"andrea: error: {e}", file=sys.stderr)
        _train_error(args, str(e))
        return 2
    finally:
        if trainer_process:
            signals.settle()  # its status is decided: a late stop must not turn it into death by signal


def _train_error(args: argparse.Namespace, message: str) -> None:
    """The error a trainer (rank 0) exits with, as its supervisor's record (train/events.py)."""
    if args.command == "train" and os.environ.get("RANK", "0") == "0":
        _emit_train_event("error", message=message)


def _reader_gone() -> int:
    """The reader of our output closed it (`andrea status RUN | head`): stop quietly, as CLI tools do
    (no traceback), with the status of a process ended by SIGPIPE. What is left in stdout's buffer goes
    to /dev/null, so that the flush at exit does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13  # SIGPIPE


def _operator_errors() -> tuple[type[Exception], ...]:
    """What a command reports as a plain error (exit 2) rather than a traceback."""
    from andrea_core.checkpoint import CheckpointError  # `andrea train` with every checkpoint refused
    from andrea_core.config import ConfigError
    from andrea_core.data.corpora import CorpusError
    from andrea_core.data.policy import SourceUnavailable
    from andrea_core.run.lock import LockError

    return (ConfigError, LockError, FileNotFoundError, SourceUnavailable, CorpusError, CheckpointError)
