"""Command-line front ends. `train.py` and `eval.py` only call into here.

User mistakes (bad config, bad arguments) end with exit code 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from transformer.config import Config, ConfigError
from transformer.errors import EXIT_FAILED, EXIT_PREEMPTED, EXIT_USAGE

if TYPE_CHECKING:  # imported when a sweep file is run, not for every train.py
    from transformer.sweep import Sweep


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + error
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def train_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="train.py", description="Train a Transformer (decoder, encoder or encoder-decoder) from a YAML config."
    )
    p.add_argument("config", nargs="?", default=None, help="YAML config (default: configs/default.yaml)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, values parsed as YAML")
    p.add_argument("--workdir", default=None, help="run directory (default: runs/<config>-<time>)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and model summary, then exit")
    p.add_argument(
        "--preflight", action="store_true", help="compile the train step, print its memory and FLOPs per device, exit"
    )
    p.add_argument("--topology", default=None, help="with --preflight: compile for a TPU slice, e.g. v5e-16, v5p-128")
    p.add_argument(
        "--profile", default=None, metavar="START:STOP", help="write a jax.profiler trace of steps START..STOP-1"
    )
    p.add_argument(
        "--coord-check",
        action="store_true",
        help="train a few steps at several widths and say which activations grow with width (µP's check)",
    )
    p.add_argument("--coord-widths", default=None, metavar="W,W,...", help="with --coord-check: the widths (d_model)")
    p.add_argument(
        "--coord-depths",
        default=None,
        metavar="L,L,...",
        help="with --coord-check: check across these depths (n_layers) instead of widths (depth scaling's check)",
    )
    p.add_argument("--coord-steps", type=int, default=None, metavar="N", help="with --coord-check: steps at each size")
    p.add_argument(
        "--grad-profile",
        action="store_true",
        help="one backward pass at init: each layer's gradient norm per parameter (Xiong et al.'s measurement)",
    )
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="sweeps: run N members at once")
    p.add_argument("--print-commands", action="store_true", help="sweeps: print each member's command, run none")
    p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0, for several hosts")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    from transformer.sweep import add_arguments

    add_arguments(p)  # claims, --shared, --launcher local|ray|slurm and their options
    return p


def _distributed(args) -> None:
    """Join a multi-process run: explicitly from the flags, or from a cluster environment JAX knows."""
    import jax

    if args.coordinator is None and args.num_processes is None:
        return
    if args.coordinator == "auto":  # a cluster JAX detects (SLURM, Open MPI, TPU pods) says who is who
        jax.distributed.initialize()
        return
    if args.coordinator is None or args.num_processes is None or args.process_id is None:
        _fail("train.py", "--coordinator, --num-processes and --process-id go together")
    platforms = jax.config.jax_platforms  # type: ignore[attr-defined]  # a flag, not in jax's stubs
    if platforms in (None, "", "cpu") or "cpu" in str(platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id)


def train_main(argv: list[str] | None = None) -> int:
    args = train_parser().parse_intermixed_args(argv)
    from transformer.accelerator import apply_xla_gpu_flags

    apply_xla_gpu_flags()  # before JAX starts its backend: XLA reads its flags once
    # A first positional with '=' is an override, not a file: `train.py model.window=64` works too.
    if args.config is not None and "=" in args.config and not _is_file(args.config):
        args.overrides.insert(0, args.config)
        args.config = None
    from transformer.sweep import load_sweep

    if args.profile is not None:  # quoted: YAML reads an unquoted 5:10 as the base-60 number 310
        args.overrides.append(f"logging.profile='{args.profile}'")
    try:
        sweep = load_sweep(args.config, args.overrides)
        if sweep is None:  # with model.init_from: the architecture from its config.json
            from transformer.io import load_run_config

            cfg = load_run_config(args.config, args.overrides)
        else:
            cfg = None
    except ConfigError as e:
        _fail("train.py", f"config: {e}")
    if sweep is not None:
        return _sweep_main(args, sweep)
    assert cfg is not None
    if args.parallel != 1 or args.print_commands or args.launcher != "local":
        _fail(
            "train.py", "--parallel, --print-commands and --launcher are for sweep files (a config with a sweep: block)"
        )
    _check_launch_arguments(args, None)
    if args.topology is not None and not args.preflight:
        _fail("train.py", "--topology goes with --preflight (it compiles for a TPU slice, it cannot run there)")
    if args.preflight:
        return _preflight_main([("", cfg)], args.topology)
    if args.grad_profile:
        return _grad_profile_main(args, [("", cfg)])
    if args.coord_check:
        from transformer.config_loader import load_raw

        return _coord_check_main(args, [("", load_raw(args.config, args.overrides), cfg)])
    if args.dry_run:
        return _dry_run(cfg)
    _distributed(args)
    workdir = Path(args.workdir) if args.workdir else _default_workdir(args.config)
    if args.claim:  # a member run by a scheduler, a Ray task or a SLURM array task: claimed first
        from transformer.sweep import claimed

        return claimed(cfg, workdir, args.stale_after, lambda: _train_job(cfg, workdir))
    return _train_job(cfg, workdir)


def _check_launch_arguments(args: argparse.Namespace, sweep: Sweep | None) -> None:
    from transformer.sweep import SweepError, check_arguments

    try:
        problem = check_arguments(args, sweep)
    except SweepError as e:
        _fail("train.py", f"config: {e}")
    if problem is not None:
        _fail("train.py", problem)


def _preflight_main(configs: list[tuple[str, Config]], topology: str | None) -> int:
    """`--preflight`: each config's compiled memory and FLOPs; EXIT_USAGE and a line for each that is
    impossible or does not fit (a sweep's members are all tried)."""
    from transformer.train import OutOfMemory, run_preflight

    code = 0
    for name, cfg in configs:
        prefix = f"{name}: " if name else ""
        try:
            run_preflight(cfg, topology, log=lambda text, p=prefix: print(p + text.replace("\n", "\n" + p)))
        except ConfigError as e:
            print(f"train.py: error: {prefix}config: {e}", file=sys.stderr)
            code = EXIT_USAGE
        except OutOfMemory as e:
            print(f"train.py: error: {prefix}{e}", file=sys.stderr)
            code = EXIT_USAGE
    return code


def _coord_sizes(args: argparse.Namespace) -> tuple[str, list[int], int]:
    """(the axis --coord-check varies, its sizes, the steps at each), from --coord-widths or
    --coord-depths and --coord-steps."""
    from transformer.train import COORD_STEPS, COORD_WIDTHS

    if args.coord_widths is not None and args.coord_depths is not None:
        _fail("train.py", "--coord-widths and --coord-depths: a check varies one of them, give one")
    flag, text = (
        ("--coord-depths", args.coord_depths)
        if args.coord_depths is not None
        else ("--coord-widths", args.coord_widths)
    )
    try:
        sizes = [int(w) for w in text.split(",")] if text else list(COORD_WIDTHS)
    except ValueError:
        _fail("train.py", f"{flag}: {text!r} is not a comma-separated list of sizes")
    if len(sizes) < 2 or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        _fail("train.py", f"{flag}: give two or more different positive sizes, got {text}")
    steps = COORD_STEPS if args.coord_steps is None else args.coord_steps
    if steps < 1:
        _fail("train.py", f"--coord-steps: must be >= 1, got {steps}")
    return ("n_layers" if flag == "--coord-depths" else "d_model"), sorted(sizes), steps


def _coord_check_main(args: argparse.Namespace, checks: list[tuple[str, dict, Config]], sweep: bool = False) -> int:
    """`--coord-check`: the figure and one line per quantity of each (name, raw config, config; of
    a sweep's members each distinct model once), in --workdir (default
    runs/coord-check-<config>-<time>; a sweep's members each in their own folder). A member whose
    check cannot be built is one line; the others are checked (exit 2)."""
    from transformer.data import DataError
    from transformer.train import distinct_models, run_coord_check, write_coord_check

    axis, sizes, steps = _coord_sizes(args)
    checks = distinct_models(checks, axis) if sweep else checks
    name = Path(args.config).stem if args.config else "default"
    out = Path(args.workdir) if args.workdir else Path("runs") / f"coord-check-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    code = 0
    for member, raw, cfg in checks:
        prefix = f"{member}: " if member else ""
        try:
            check = run_coord_check(raw, cfg, sizes, steps, log=lambda text, p=prefix: print(p + text), axis=axis)
        except ConfigError as e:
            if not member:
                _fail("train.py", f"--coord-check: {e}")
            print(f"train.py: error: {prefix}--coord-check: {e}", file=sys.stderr)
            code = EXIT_USAGE
            continue
        except DataError as e:
            _fail("train.py", f"data: {e}")
        for line in check.lines():
            print(prefix + line)
        print(prefix + "wrote " + ", ".join(str(p) for p in write_coord_check(check, out / member if member else out)))
    return code


def _grad_profile_main(args: argparse.Namespace, configs: list[tuple[str, Config]]) -> int:
    """`--grad-profile`: each (name, config)'s table, lines and figure in --workdir (default
    runs/grad-profile-<config>-<time>; a sweep's members each in their own folder, and their summary
    over placements and depths beside them)."""
    from transformer.data import DataError
    from transformer.report import summarize_gradients, write_gradient_summary
    from transformer.train import grad_profile, write_profile

    if args.coord_check:
        _fail("train.py", "--grad-profile and --coord-check: one check at a time")
    name = Path(args.config).stem if args.config else "default"
    out = Path(args.workdir) if args.workdir else Path("runs") / f"grad-profile-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    profiles = []
    for member, cfg in configs:
        prefix = f"{member}: " if member else ""
        try:
            profile = grad_profile(cfg)
        except DataError as e:
            _fail("train.py", f"data: {e}")
        profiles.append((cfg, profile))
        for line in (profile.table() if not member else []) + profile.lines():
            print(prefix + line)
        print(prefix + "wrote " + ", ".join(str(p) for p in write_profile(profile, out / member if member else out)))
    summary = summarize_gradients(profiles) if len(profiles) > 1 else None
    if summary is not None:
        for line in summary.lines():
            print(line)
        print("wrote " + ", ".join(str(p) for p in write_gradient_summary(summary, profiles, out)))
    return 0


def _is_file(text: str) -> bool:
    """Whether `text` names a file; False also for what cannot be a path (longer than the file
    system allows: an override is often longer than 255 bytes)."""
    try:
        return Path(text).is_file()
    except OSError:
        return False


def _check_eval_tasks(cfg: Config):
    """train.eval_tasks: lm-eval installed and a model it scores, checked before any work; the loop's
    evaluator (None without tasks). A task that cannot be loaded is refused when training starts."""
    if not cfg.train.eval_tasks:
        return None
    from transformer.eval import evaluate, harness

    try:
        harness.require_lm_eval()
        harness.check_model(cfg)
    except harness.TaskError as e:
        _fail("train.py", f"config: train.eval_tasks: {e}")
    return evaluate.loop_tasks


def _train_job(cfg: Config, workdir: Path) -> int:
    """Run the job; each way it can end becomes its exit code and at most one line on stderr."""
    from transformer.data import DataError
    from transformer.eval import harness
    from transformer.io import CheckpointError
    from transformer.rundir import Busy
    from transformer.train import MonitorStop, OutOfMemory, Preempted, run

    downstream = _check_eval_tasks(cfg)
    try:
        run(cfg, workdir, downstream=downstream)
    except Busy as e:  # another train.py writes this run directory
        _fail("train.py", str(e))
    except ConfigError as e:
        _fail("train.py", f"config: {e}")
    except DataError as e:
        _fail("train.py", f"data: {e}")
    except harness.TaskError as e:
        _fail("train.py", f"config: train.eval_tasks: {e}")
    except CheckpointError as e:
        print(f"train.py: error: checkpoint: {e}", file=sys.stderr)
        return EXIT_FAILED
    except MonitorStop as e:
        print(f"train.py: error: monitor: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OutOfMemory as e:  # the figures and the knobs, not XLA's traceback
        print(f"train.py: error: {e}", file=sys.stderr)
        return e.exit_code
    except Preempted as e:
        where = f"the newest checkpoint is step {e.step}" if e.step is not None else "no checkpoint could be written"
        print(f"train.py: preempted: {where}; run the same command to resume", file=sys.stderr)
        return EXIT_PREEMPTED
    return 0


def _sweep_main(args: argparse.Namespace, sweep: Sweep) -> int:
    from transformer.rundir import Busy
    from transformer.sweep import SweepError, print_commands, run_sweep

    if args.parallel < 1:
        _fail("train.py", f"--parallel must be >= 1, got {args.parallel}")
    if args.coordinator is not None or args.num_processes is not None:
        _fail("train.py", "a sweep runs each member as its own process; hand --print-commands to your scheduler")
    _check_launch_arguments(args, sweep)
    if args.dry_run:
        return _sweep_dry_run(sweep)
    if args.preflight:
        code = _preflight_main([(m.name, m.config) for m in sweep.members], args.topology)
        _print_ladder(sweep)
        return code
    if args.grad_profile:
        return _grad_profile_main(args, [(m.name, m.config) for m in sweep.members])
    if args.coord_check:
        return _coord_check_main(args, [(m.name, m.raw, m.config) for m in sweep.members], sweep=True)
    workdir = Path(args.workdir) if args.workdir else Path("runs") / Path(args.config).stem
    try:
        if args.print_commands:
            try:
                print_commands(sweep, workdir)
            except BrokenPipeError:  # `--print-commands | head`: the reader has all it wanted
                import os

                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        if args.launcher != "local":
            from transformer.sweep import launch

            outcome = launch(args, sweep, workdir)
            if outcome is None:  # submitted to a scheduler, not waited for
                return 0
        else:
            outcome = run_sweep(sweep, workdir, args.parallel, shared=args.shared, stale_after=args.stale_after)
    except SweepError as e:
        _fail("train.py", f"config: {e}")
    except Busy as e:  # another sweep runs in this directory
        _fail("train.py", str(e))
    if not outcome.interrupted:  # an interrupted sweep is compared once a rerun has finished it
        _write_sweep_report(workdir)
    closing = outcome.closing_line()
    if closing is not None:
        print(closing)
    return outcome.exit_code


def _write_sweep_report(workdir: Path) -> None:
    from transformer.report import write_report
    from transformer.rundir import Busy
    from transformer.sweep import relative

    try:
        report = write_report(workdir)
    except Busy as e:  # a link planted where the report goes: the members' runs are safe
        _fail("train.py", f"report: {e}")
    except ConfigError as e:  # the members' runs are safe; only the comparison cannot be read
        _fail("train.py", f"report: a run's config: {e}")
    print(f"report: {relative(report)}")


def _dry_run(cfg: Config) -> int:
    """The resolved config and the model summary; refused as the run would refuse it."""
    from transformer.accelerator import resolve
    from transformer.train import check_credentials

    try:
        check_credentials(cfg)
    except ConfigError as e:
        _fail("train.py", f"config: {e}")
    _check_eval_tasks(cfg)
    from transformer.data import row_lengths
    from transformer.model import summary_text

    print(cfg.to_yaml().rstrip())
    print()
    T, S = row_lengths(cfg.data)  # an encoder-decoder's: target T, input S
    m = resolve(cfg).model  # the compute dtype auto picks here sizes the KV cache
    print(summary_text(m, T) if S is None else summary_text(m, S, T))
    return 0


def _sweep_dry_run(sweep: Sweep) -> int:
    """Print each member's values, seed and size; run nothing."""
    from transformer.model import count_params

    for m in sweep.members:
        values = ", ".join(f"{k}={v}" for k, v in {**m.labels, **m.values}.items())
        print(f"{m.name}: {values or 'base config'}; seed {m.seed}; {count_params(m.config.model):,} parameters")
    print(f"{len(sweep.members)} members")
    _print_ladder(sweep)
    return 0


def _print_ladder(sweep: Sweep) -> None:
    """A ladder's rungs and its total compute (nothing for another sweep)."""
    if sweep.ladder is not None:
        from collections import Counter

        from transformer.sweep import ladder_lines

        print("\n".join(ladder_lines(sweep.ladder, Counter(m.labels["rung"] for m in sweep.members))))


def _default_workdir(config: str | None) -> Path:
    """runs/<config>-<time>, claimed by creating it: two runs started in the same second get their
    own directories (-2, -3, ...) rather than one refusing the other's lock. The processes of one
    multi-process run must agree on the name without talking, so they take the plain one."""
    import jax

    name = Path(config).stem if config else "default"
    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if jax.process_count() > 1:
        return base
    for n in itertools.count(1):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def eval_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="eval.py", description="Evaluate a run's checkpoint, or sample text from it.")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. data.source=files:other/*.txt")
    p.add_argument("--workdir", default=None, help="the run directory")
    p.add_argument(
        "--hf", default=None, metavar="PATH", help="evaluate a Hugging Face model directory instead of a run"
    )
    p.add_argument(
        "--export-hf", default=None, metavar="OUT", help="write the run's checkpoint as a Hugging Face model directory"
    )
    p.add_argument(
        "--compare", default=None, metavar="DIR", help="write DIR/report.md and report.html comparing the runs in DIR"
    )
    p.add_argument(
        "--by",
        default=None,
        metavar="KEY",
        help="with --compare: compare this varied key instead of the sweep's own (into DIR/report-by-KEY.*)",
    )
    p.add_argument("--step", type=int, default=None, help="a kept checkpoint step (default: the latest)")
    p.add_argument("--split", choices=("val", "train"), default="val")
    p.add_argument("--batches", type=int, default=None, help="evaluate at most this many batches")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--generate", action="append", default=[], metavar="PROMPT", help="sample a continuation (repeatable)"
    )
    p.add_argument("--prompts", default=None, help="a file of prompts, one per line")
    p.add_argument(
        "--fill-mask",
        action="append",
        default=[],
        metavar="TEXT",
        help="an encoder's predictions at each <mask> of TEXT (repeatable; --top-k of them, default 5)",
    )
    _task_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    return p


def _task_arguments(p: argparse.ArgumentParser) -> None:
    """eval.py's lm-eval flags (the evals extra)."""
    p.add_argument("--tasks", default=None, metavar="NAMES", help="lm-eval tasks, comma-separated (e.g. hellaswag)")
    p.add_argument("--limit", type=int, default=None, help="with --tasks: at most this many items per task")
    p.add_argument(
        "--include-path",
        action="append",
        default=[],
        metavar="DIR",
        help="with --tasks: a directory of lm-eval task YAMLs (repeatable)",
    )


def _compare_main(directory: Path, by: str | None) -> int:
    from transformer import rundir
    from transformer.report import write_report
    from transformer.sweep import MANIFEST

    if not directory.is_dir():
        _fail("eval.py", f"--compare: {directory} is not a directory")
    if not (directory / MANIFEST).is_file() and not any(directory.glob(f"*/{rundir.CONFIG}")):
        _fail("eval.py", f"--compare: {directory} holds no sweep ({MANIFEST}) and no runs (*/{rundir.CONFIG})")
    try:
        path = write_report(directory, by=by)
    except rundir.Busy as e:  # a link planted where the report goes
        _fail("eval.py", f"--compare: {e}")
    except ConfigError as e:
        _fail("eval.py", f"--compare: {e}" if e.key == "--by" else f"--compare: a run's config: {e}")
    print(f"wrote {path} and {path.with_suffix('.html')}")
    return 0


def eval_main(argv: list[str] | None = None) -> int:
    args = eval_parser().parse_intermixed_args(argv)
    if args.by is not None and args.compare is None:
        _fail("eval.py", "--by goes with --compare DIR (it picks the key the report compares)")
    if args.compare is not None:
        return _compare_main(Path(args.compare), args.by)
    if (args.workdir is None) == (args.hf is None):
        _fail("eval.py", "give --workdir DIR (a run), --hf PATH (a Hugging Face model) or --compare DIR (runs)")
    if args.export_hf is not None and args.workdir is None:
        _fail("eval.py", "--export-hf writes a run's checkpoint: give --workdir DIR")
    if args.hf is not None and args.step is not None:
        _fail("eval.py", "--step picks a run's checkpoint; a Hugging Face model (--hf) has one set of weights")
    prompts = _prompts(args)
    _check_eval_args(args)
    if args.export_hf is not None or args.hf is not None:  # OUT and the checkpoint before anything is read
        _check_hf_arguments(args)

    from transformer.data import DataError
    from transformer.io import CheckpointError

    try:
        if args.export_hf is not None:
            return _export_main(args)
        if args.fill_mask:
            return _fill_mask_main(args)
        if prompts:
            return _sample_main(args, prompts)
        if args.tasks is not None:
            return _tasks_main(args)
        return _evaluate_main(args)
    except ConfigError as e:
        _fail("eval.py", str(e))
    except DataError as e:
        _fail("eval.py", f"data: {e}")
    except CheckpointError as e:
        _fail("eval.py", f"checkpoint: {e}")


def _check_hf_arguments(args: argparse.Namespace) -> None:
    """--export-hf OUT: a place a model directory can be written; --hf PATH: its config.json, weights'
    headers and tokenizer sound, and a note when PATH brings no tokenizer of its own."""
    from transformer.eval import note, pretrained
    from transformer.io import hf

    try:
        if args.export_hf is not None:
            hf.check_export_dir(Path(args.export_hf))
        if args.hf is not None:
            line = hf.tokenizer_note(pretrained.pretrained_config(Path(args.hf), args.overrides))
            if line is not None:
                note(line)
    except ConfigError as e:
        _fail("eval.py", str(e))


def _prompts(args: argparse.Namespace) -> list[str]:
    """The --generate prompts, then the lines of --prompts FILE."""
    prompts = list(args.generate)
    if args.prompts is not None:
        try:
            prompts += [line for line in Path(args.prompts).read_text("utf-8").splitlines() if line.strip()]
        except OSError as e:
            _fail("eval.py", f"--prompts: cannot read {args.prompts}: {e.strerror}")
        except UnicodeDecodeError as e:
            _fail("eval.py", f"--prompts: {args.prompts} is not UTF-8 text (byte {e.start}); save it as UTF-8")
    return prompts


def _check_eval_args(args: argparse.Namespace) -> None:
    checks = [
        (args.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
        (args.temperature >= 0, "--temperature must be >= 0"),
        (args.top_k is None or args.top_k >= 1, "--top-k must be >= 1"),
        (args.top_p is None or 0 < args.top_p <= 1, "--top-p must be in (0, 1]"),
        (args.batches is None or args.batches >= 1, "--batches must be >= 1"),
        (args.limit is None or args.limit >= 1, "--limit must be >= 1"),
        (
            args.tasks is not None or (args.limit is None and not args.include_path),
            "--limit and --include-path go with --tasks",
        ),
    ]
    # JAX holds these as 32-bit integers (the seed, the scan length, k)
    for flag in ("seed", "max_new_tokens", "top_k"):
        value = getattr(args, flag)
        ok = value is None or -(2**31) <= value < 2**31
        checks.append((ok, f"--{flag.replace('_', '-')} must fit a 32-bit integer, got {value}"))
    for ok, message in checks:
        if not ok:
            _fail("eval.py", message)


def _check_sampling(args: argparse.Namespace, cfg: Config, n_prompts: int) -> None:
    """The sampling flags against the model: k within its vocabulary, the KV cache within memory."""
    from transformer.accelerator import resolve
    from transformer.limits import check_generation_memory

    model = resolve(cfg).model  # the KV cache in the dtype this machine computes in
    if args.top_k is not None and args.top_k > model.vocab_size:
        _fail("eval.py", f"--top-k {args.top_k} is larger than the run's vocabulary of {model.vocab_size} tokens")
    check_generation_memory(model, n_prompts, args.max_new_tokens)


def _export_main(args: argparse.Namespace) -> int:
    from transformer.eval import export_hf, note

    print(export_hf(Path(args.workdir), args.step, Path(args.export_hf), note))
    return 0


def _fill_mask_main(args: argparse.Namespace) -> int:
    from transformer.eval import evaluate, pretrained

    if args.hf is not None:
        results = pretrained.fill_mask_pretrained(Path(args.hf), args.fill_mask, args.top_k or 5, args.overrides)
    else:
        results = evaluate.fill_masks(Path(args.workdir), args.fill_mask, args.top_k or 5, args.step)
    if args.json:
        print(json.dumps(results))
        return 0
    for r in results:
        print(r["filled"])
        for i, top in enumerate(r["top"]):
            print(f"  <mask> {i}: " + "  ".join(repr(t) for t in top))
    return 0


def _sample_main(args: argparse.Namespace, prompts: list[str]) -> int:
    from transformer.eval import SamplingConfig, evaluate, pretrained

    cfg = (
        evaluate.run_config(Path(args.workdir), [])
        if args.hf is None
        else pretrained.pretrained_config(Path(args.hf), args.overrides)
    )
    _check_sampling(args, cfg, len(prompts))
    sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    if args.hf is None:
        texts = evaluate.sample_run(Path(args.workdir), prompts, sampling, args.step)
    else:
        texts = pretrained.sample_pretrained(Path(args.hf), prompts, sampling, args.overrides)
    if args.json:
        print(json.dumps([{"prompt": p, "completion": t} for p, t in zip(prompts, texts)]))
    else:
        # a pair's output answers its input; a continuation goes on from the prompt
        joint = " -> " if cfg.model.arch == "encoder_decoder" or cfg.data.objective == "prefix" else ""
        for prompt, text in zip(prompts, texts):
            print(prompt + joint + text)
            print("-" * 40)
    return 0


def _tasks_main(args: argparse.Namespace) -> int:
    """`--tasks`: each lm-eval task's metrics, a line each (or one JSON object)."""
    from transformer.eval import evaluate, harness, pretrained

    names = [n.strip() for n in args.tasks.split(",") if n.strip()]
    if not names:
        _fail("eval.py", "--tasks: name at least one task (e.g. --tasks stdlib_next_line)")
    include = [Path(p) for p in args.include_path]
    for directory in include:
        if not directory.is_dir():
            _fail("eval.py", f"--include-path: {directory} is not a directory")
    try:
        if args.hf is None:
            result = evaluate.evaluate_tasks(Path(args.workdir), names, args.limit, include, args.step)
        else:
            result = pretrained.tasks_pretrained(Path(args.hf), names, args.limit, include, args.overrides)
    except harness.TaskError as e:
        _fail("eval.py", f"--tasks: {e}")
    if args.json:
        print(json.dumps(result))
        return 0
    for task, metrics in result["tasks"].items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        print(f"step {result['step']} {task}: {shown}")
    return 0


def _evaluate_main(args: argparse.Namespace) -> int:
    from transformer.eval import evaluate, pretrained

    if args.hf is None:
        result = evaluate.evaluate_run(Path(args.workdir), args.step, args.overrides, args.split, args.batches)
    else:
        result = pretrained.evaluate_pretrained(Path(args.hf), args.overrides, args.split, args.batches)
    if args.json:
        print(json.dumps(result))
    else:
        bpb = "" if result["bits_per_byte"] is None else f", bits per byte {result['bits_per_byte']:.4f}"
        print(
            f"step {result['step']} on {result['source']} ({result['split']}, {result['tokens']:,} tokens): "
            f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f}, accuracy {result['accuracy']:.4f}{bpb}"
        )
        for name, own in result.get("sources", {}).items():  # a mixture: the weighted total above, then each source
            print(
                f"  {name} ({own['source']}, weight {own['weight']:.3g}, {own['tokens']:,} tokens): "
                f"loss {own['loss']:.4f}, bits per byte {own['bits_per_byte']:.4f}"
            )
    return 0
