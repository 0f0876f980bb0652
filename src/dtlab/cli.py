"""The ``dtlab`` command line. Thin: parse, load the config, call one function per command."""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from dtlab.cliargs import config_choices, parse_config_args, run_command
from dtlab.cliparser import DEVICE_KEYS, build_parser
from dtlab.errors import ConfigError, DtlabError

_Job = TypeVar("_Job")

if TYPE_CHECKING:
    from dtlab.config import Config

__all__ = ["DEVICE_KEYS", "build_parser", "main", "parse_args"]


BENCH_COMPRESSIONS = ("dct-quant", "demo")


@dataclass
class _BenchAxes:
    """The comma-separated lists of ``dtlab bench``, checked."""

    strategies: list[str]
    nprocs: list[int]
    compressions: list[str]
    precisions: list[str]
    engines: list[str]


def _split(text: str, flag: str, allowed: Sequence[str]) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or any(x not in allowed for x in items):
        raise DtlabError(f"--{flag} {text!r}: allowed: {', '.join(allowed)}")
    return items


def _bench_axes(args: argparse.Namespace, config: Config) -> _BenchAxes:
    """Check each list against the config schema's values, before any run starts."""
    try:
        nprocs = [int(x) for x in args.nproc.split(",") if x.strip()]
    except ValueError:
        nprocs = []
    if not nprocs or any(n < 1 for n in nprocs):
        raise DtlabError(f"--nproc {args.nproc!r}: expected comma-separated integers >= 1")
    compressions = (*config_choices("parallel.compression"), *BENCH_COMPRESSIONS)
    return _BenchAxes(
        strategies=_split(args.strategies, "strategies", config_choices("parallel.strategy")),
        nprocs=nprocs,
        compressions=_split(args.compression, "compression", compressions),
        precisions=_split(
            args.precision or config.train.precision, "precision", config_choices("train.precision")
        ),
        engines=_split(args.engine, "engine", config_choices("train.engine")),
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from dtlab.bench.sweep import combinations, plan_combinations, run_sweep, runnable
    from dtlab.config import load_config

    config = load_config(args.config, args.overrides)  # fail here on a bad config, not in every run
    axes = _bench_axes(args, config)
    if axes.engines != ["torch"]:
        return _bench_engines(args, axes, config)
    model_parallel = config.parallel.tp * config.parallel.pp
    combos = combinations(
        axes.strategies, axes.nprocs, axes.compressions, axes.precisions, model_parallel
    )
    _, notes = plan_combinations(
        axes.strategies, axes.nprocs, axes.compressions, axes.precisions, model_parallel
    )
    # Every run is one dtlab train runs, judged before any runs; the others are said, with why.
    combos, refused = runnable(args.config, args.overrides, combos)
    notes += refused
    for note in notes:
        print(f"note: {note}", flush=True)
    out = Path(args.out)
    results = run_sweep(
        args.config, args.overrides, combos, args.steps, args.warmup, out, args.profile, notes
    )
    print(
        f"\n{len(results['rows'])} run(s) measured, {len(results['failed'])} failed: {out / 'report.md'}"
    )
    return 1 if results["failed"] and not results["rows"] else 0


def _bench_engines(args: argparse.Namespace, axes: _BenchAxes, config: Config) -> int:
    """``dtlab bench --engine torch,mlx``: the same config on each engine, every layout both run
    (single, ddp, fsdp, the config's tensor parallelism); the others are said, with why."""
    from dtlab.bench.engines import check_engines, run_engines
    from dtlab.bench.sweep import combinations, runnable

    check_engines(axes.engines)
    if axes.compressions != ["none"]:
        raise DtlabError(
            f"--compression {args.compression!r} with --engine {args.engine!r}: engines are compared "
            "without compression (allowed: none)"
        )
    model_parallel = config.parallel.tp * config.parallel.pp
    combos = combinations(axes.strategies, axes.nprocs, ["none"], axes.precisions, model_parallel)
    # A run is measured on every engine or on none: the rows are compared side by side.
    notes: list[str] = []
    for engine in axes.engines:
        combos, refused = runnable(args.config, [*args.overrides, f"train.engine={engine}"], combos)
        notes += [f"{note} (train.engine = {engine})" for note in refused]
    for note in notes:
        print(f"note: {note}", flush=True)
    out = Path(args.out)
    results = run_engines(
        args.config, args.overrides, axes.engines, [(s, n, p) for s, n, _, p in combos],
        args.steps, args.warmup, out,
    )  # fmt: skip
    print(
        f"\n{len(results['engine_rows'])} run(s) measured, {len(results['failed'])} failed: {out / 'report.md'}"
    )
    return 1 if results["failed"] and not results["engine_rows"] else 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from dtlab.analysis.devices import PROFILES, this_device
    from dtlab.analysis.plan import DEFAULT_DEVICE, format_plan, plan
    from dtlab.analysis.probe import with_probe
    from dtlab.config import check_batch_split, load_config

    engine = [f"train.engine={args.engine}"] if args.engine else []
    config = load_config(args.config, [*args.overrides, *engine])
    # The batch must split over the data-parallel ranks whatever the strategy: say so, not "nothing
    # fits" (tensor and pipeline parallelism, when set, take their ranks first).
    p = config.parallel
    world = args.nproc * args.nnodes
    if args.device_memory is not None and not 0 < args.device_memory < float("inf"):
        raise DtlabError(
            f"--device-memory {args.device_memory}: allowed: a finite number > 0 (GiB)"
        )
    if config.train.engine == "mlx":
        return _plan_mlx(args, config, world)
    if all(config.is_given(f"parallel.{k}") for k in ("tp", "pp", "cp")):
        # Otherwise the plan searches degrees that split it (context parallelism where nothing
        # fits without), and says so when none does.
        split = p.tp * p.pp * p.cp
        check_batch_split(config, world // split if world % split == 0 else world)
    if args.device is None:
        device = PROFILES[DEFAULT_DEVICE]
    elif args.device == "this":
        device = this_device(config.train.precision)
        # What the plan refuses (a batch that no layout of the world splits) it refuses on the
        # unmeasured device too: before a minute of measuring, not after.
        plan(config, args.nproc, args.nnodes, device, args.device_memory, False)
        device, _ = with_probe(device, config, args.nproc)
    elif args.device in PROFILES:
        device = PROFILES[args.device]
    else:
        raise DtlabError(
            f"--device {args.device!r} is not known; allowed: {', '.join(DEVICE_KEYS)}, this"
        )
    if args.step_model != device.step_model:
        import dataclasses

        device = dataclasses.replace(device, step_model=args.step_model)
    result = plan(
        config,
        args.nproc,
        args.nnodes,
        device,
        args.device_memory,
        args.device is None,
        (args.config, list(args.overrides)),
    )
    if args.ranks is not None and not args.check:
        raise DtlabError("--ranks chooses the ranks of --check; add --check")
    if args.check:
        from dtlab.analysis.check import check, choose_config, format_check, parse_ranks

        ranks = parse_ranks(args.ranks, world)
        target, layout = choose_config(args.config, list(args.overrides), config, result, world)
        result["check"] = {
            "layout": layout,
            **check(target, args.nproc, args.nnodes, ranks, device.kind),
        }
    text = json.dumps(result, indent=2) if args.json else format_plan(result)
    if args.check and not args.json:
        text += "\n" + format_check(result["check"])
    print(text)
    return 0


def _plan_mlx(args: argparse.Namespace, config: Config, world: int) -> int:
    """``dtlab plan --engine mlx``: every MLX layout's memory per rank (dtlab.analysis.mlx_memory)."""
    import json

    from dtlab.analysis.mlx_memory import format_mlx_plan, mlx_plan

    if args.check or args.ranks is not None or args.device is not None:
        flag = "--check" if args.check else "--ranks" if args.ranks is not None else "--device"
        raise DtlabError(
            f"{flag} with --engine mlx: the MLX plan gives each layout's memory per rank (allowed: "
            "--nproc, --nnodes, --device-memory GIB, --json)"
        )
    result = mlx_plan(config, world, args.device_memory)
    print(json.dumps(result, indent=2) if args.json else format_mlx_plan(result))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from dtlab.config import describe_fields, load_config

    if args.keys:
        from dtlab.models.families import FAMILIES

        for key, default, desc in describe_fields():
            print(f"{key:<44} {default:<14} {desc}")
        # Each family: what model.init_from reads and `dtlab export --format hf` writes as it.
        for f in FAMILIES.values():
            print(f"{'model.family=' + f.name:<44} {f.hf_class:<14} {f.summary}")
        return 0
    print(load_config(args.config, args.overrides).to_yaml(), end="")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from dtlab.config import check_world, load_config

    if args.profile:
        args.overrides = [*args.overrides, "run.profile=true"]
    if args.engine:
        args.overrides = [*args.overrides, f"train.engine={args.engine}"]
    config = load_config(args.config, args.overrides)
    from dtlab.metrics.trackers import check_trackers

    check_trackers(config)  # a tracker's missing package: before a run directory or process exists
    if config.train.engine == "mlx":
        return _train_mlx(args, config)
    from dtlab.checkpoint.init_from import check_before_launch
    from dtlab.parallel.dist import is_worker_env

    world = args.nproc * args.nnodes
    if is_worker_env():  # torchrun (or dtlab's launcher) started this process
        return _train_here(config)
    check_world(config, world)  # once, here, before any process starts
    if config.parallel.fault_tolerance.enabled:
        return _train_fault_tolerant(args, config)
    if world == 1:
        check_before_launch(config, None)
        return _train_here(config)
    from dtlab.launcher import LaunchSpec, failure_grace_s, launch
    from dtlab.parallel.devices import check_node_gpus
    from dtlab.train.rundir import check_free

    # One GPU per process, before any starts.
    check_node_gpus(config.train.device, config.parallel.backend, args.nproc)
    run_dir, worker_args = _prepare_launch(args, config)
    check_free(run_dir)  # a run already training there: say so before starting any process
    check_before_launch(config, run_dir)
    spec = LaunchSpec(
        args.nproc,
        args.nnodes,
        args.node_rank,
        args.master_addr,
        args.master_port,
        args.max_restarts,
        failure_grace_s(config.parallel.collective_timeout_s),
    )
    return launch(spec, worker_args, run_dir)


def _train_fault_tolerant(args: argparse.Namespace, config: Config) -> int:
    """``parallel.fault_tolerance``: the lighthouse and one elastic agent per replica group."""
    from dtlab.checkpoint.init_from import check_before_launch
    from dtlab.fault_tolerance import launch_replicas
    from dtlab.launcher import LaunchSpec
    from dtlab.train.rundir import check_free

    run_dir, worker_args = _prepare_launch(args, config)
    check_free(run_dir)
    check_before_launch(config, run_dir)
    spec = LaunchSpec(args.nproc, args.nnodes, args.node_rank, max_restarts=args.max_restarts)
    return launch_replicas(spec, config, worker_args, run_dir)


def _train_mlx(args: argparse.Namespace, config: Config) -> int:
    """``train.engine: mlx``: train here (one process, or one rank mlx.launch started), or launch ranks."""
    from dtlab.config import check_world
    from dtlab.mlx import require_mlx
    from dtlab.mlx.launch import is_mlx_worker, launch_mlx

    require_mlx()
    if args.nnodes > 1:
        raise DtlabError(
            f"--nnodes {args.nnodes} with train.engine = 'mlx': start the ranks of several machines with "
            "mlx.launch --hostfile (see docs/mlx.md); --nproc starts ranks on this machine"
        )
    if is_mlx_worker():
        return _train_here(config)
    check_world(config, args.nproc)
    if args.nproc == 1:
        return _train_here(config)
    _, worker_args = _prepare_launch(args, config)
    return launch_mlx(args.nproc, config.parallel.backend, worker_args)


def _prepare_launch(args: argparse.Namespace, config: Config) -> tuple[Path, list[str]]:
    """Before either engine launches its workers: check the data once, fix the run directory, and say
    what each worker runs. Returns (run directory, the worker's ``dtlab`` arguments)."""
    from dtlab.data import build_source
    from dtlab.train.rundir import default_run_dir

    build_source(config)  # fail on bad data here, once, instead of in every worker after the launch
    overrides = list(args.overrides)
    # Resolve the run directory once, so that every worker (and every restart) uses the same one.
    run_dir = Path(config.run.dir) if config.run.dir else default_run_dir(config)
    if config.run.dir is None:
        overrides.append(f"run.dir={run_dir}")
    worker_args = [
        "train",
        *([args.config] if args.config else []),
        *(["--set", *overrides] if overrides else []),
    ]
    return run_dir, worker_args


def cmd_launch(args: argparse.Namespace) -> int:
    from dtlab.config import check_world, load_config
    from dtlab.deploy import JobShape, launch_checkpointing
    from dtlab.parallel.devices import check_job_gpus

    config = load_config(args.config, args.overrides)
    check_world(config, args.nodes * args.nproc_per_node)
    check_job_gpus(
        config.train.device, config.parallel.backend, args.nproc_per_node, args.gpus_per_node
    )
    shape = JobShape(
        args.nodes, args.nproc_per_node, args.gpus_per_node, args.device, args.save_bandwidth_gbps,
        args.scheduler,
    )  # fmt: skip
    config, note = launch_checkpointing(config, args.no_checkpoint, shape)
    if note:
        print(note, file=sys.stderr)
    if args.scheduler == "slurm":
        return _launch_slurm(args, config)
    return _launch_k8s(args, config)


def _job_from_flags(cls: type[_Job], args: argparse.Namespace, **given: object) -> _Job:
    """A scheduler job's description from the flags of the same names (``--nproc-per-node`` is
    ``nproc_per_node``), with ``given`` for the fields whose flag is named otherwise."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]  # a dataclass, by the callers
    flags = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return cls(**(flags | given))


def _launch_slurm(args: argparse.Namespace, config: Config) -> int:
    from dtlab.deploy import SlurmJob, slug, submit, write_slurm
    from dtlab.deploy_site import site_from_args

    site = site_from_args(args)
    job = _job_from_flags(
        SlurmJob, args, port=args.master_port, settings=site, fallback_python=sys.executable,
        partition=site.partition, account=site.account, time=site.time,
    )  # fmt: skip
    out = Path(args.out or f"{slug(config.run.name)}.sbatch")
    script, resolved = write_slurm(config, job, out)
    print(f"wrote {script}\nwrote {resolved}", file=sys.stderr)
    if args.submit:
        print(submit(script))
    else:
        print(f"submit with: sbatch {script}", file=sys.stderr)
    return 0


def _launch_k8s(args: argparse.Namespace, config: Config) -> int:
    from dtlab.deploy import K8sJob
    from dtlab.deploy_k8s import k8s_job_name, write_k8s
    from dtlab.deploy_k8s_pod import unmounted_paths

    k8s = _job_from_flags(
        K8sJob, args, node_selector=tuple(args.node_selector), tolerations=tuple(args.tolerations),
        resources=tuple(args.resources), volumes=tuple(args.volumes),
    )  # fmt: skip
    name = args.name or k8s_job_name(config.run.name, args.nodes, args.api)
    path = write_k8s(config, k8s, Path(args.out or f"{name}.yaml"), name)
    for line in unmounted_paths(config, k8s):
        print(f"warning: {line}", file=sys.stderr)
    print(f"wrote {path}\napply with: kubectl apply -f {path}", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dtlab.config import check_world, load_config
    from dtlab.verify import (
        Tolerances,
        default_tolerances,
        parse_checks,
        parse_layouts,
        table,
        verify,
    )

    tols = {"--loss-tol": args.loss_tol, "--grad-tol": args.grad_tol, "--param-tol": args.param_tol}
    for flag, value in tols.items():
        if value is not None and not 0 <= value < float("inf"):
            raise DtlabError(f"{flag} {value}: allowed: a finite number >= 0")
    if args.engine:
        args.overrides = [*args.overrides, f"train.engine={args.engine}"]
    layouts = parse_layouts(args.layouts)
    checks = parse_checks(args.checks)
    # A bad config is said once, before any layout runs; its precision sets the default tolerances.
    base = default_tolerances(load_config(args.config, args.overrides).train.precision)
    tol = Tolerances(
        base.loss if args.loss_tol is None else args.loss_tol,
        base.grad_norm if args.grad_tol is None else args.grad_tol,
        base.param if args.param_tol is None else args.param_tol,
    )
    for layout in layouts:  # and a layout its config or world cannot run, before any trains
        try:
            check_world(
                load_config(args.config, [*args.overrides, *layout.overrides]), layout.nproc
            )
        except DtlabError as e:
            raise ConfigError(f"layout {layout.name}: {e}") from None
    result = verify(
        layouts, args.config, args.overrides, args.steps, Path(args.out),
        tol, checks=checks,
    )  # fmt: skip
    print(table(result))
    compared = len(result.rows) + sum(len(s.checks) for s in result.state)
    where = Path(args.out) / "verify.json"
    if result.ok:
        print(f"verified: every comparison within tolerance ({compared}); details in {where}")
    else:
        print(f"NOT verified: a layout or check differs (above); details in {where}")
    return 0 if result.ok else 1


def cmd_export(args: argparse.Namespace) -> int:
    from dtlab.checkpoint.export import export_checkpoint, weights_position
    from dtlab.config import show

    def warn(message: str) -> None:
        print(f"warning: {message}", file=sys.stderr, flush=True)

    for flag, path in (("RUN_DIR_OR_CHECKPOINT", args.source), ("--out", args.out)):
        if "\0" in path:
            raise DtlabError(f"{flag} {show(path)}: a path cannot hold a NUL character")
    try:
        ckpt, out = export_checkpoint(args.source, args.out, args.fmt, force=args.force, warn=warn)
    except OSError as e:  # a path the OS refuses: too long, no permission, a file where a dir goes
        raise DtlabError(
            f"export {show(args.source)} to {show(args.out)}: {e.strerror or e}"
        ) from None
    position = weights_position(ckpt)[0]
    print(f"exported checkpoint '{ckpt}' ({position}) as {args.fmt}", file=sys.stderr)
    print(out)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from dtlab.generate import check_options, load_generator

    if not args.prompt:
        raise DtlabError("--prompt '': allowed: a non-empty text")
    # Options out of range fail before the model is read.
    check_options(
        args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, flags=True
    )

    def warn(message: str) -> None:
        print(f"warning: {message}", file=sys.stderr, flush=True)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()  # token by token, also into a pipe

    gen = load_generator(args.source, args.device, warn=warn)
    position = f" ({gen.position})" if gen.position else ""
    print(f"generating with '{gen.source}'{position}", file=sys.stderr, flush=True)
    if isinstance(sys.stdout, io.TextIOWrapper):
        # A terminal whose encoding lacks a generated character shows '?' rather than failing.
        sys.stdout.reconfigure(errors="replace")
    try:
        gen.generate(
            args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
            stop_at_separator=not args.ignore_separator, on_text=write,
        )  # fmt: skip
        # End the line on a terminal; a pipe gets exactly the generated text.
        if sys.stdout.isatty():
            sys.stdout.write("\n")
    except BrokenPipeError:
        # The reader stopped reading (`| head -c 20`): that is all it wanted. Point stdout at
        # /dev/null so that the flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _train_here(config: Config) -> int:
    """Train in this process (alone, or as one worker of a launched world); rank 0 prints the summary."""
    from dtlab.metrics.ft_summary import RUN_SUMMARY_ENV
    from dtlab.metrics.report import summary_table

    if config.train.engine == "mlx":
        from dtlab.mlx.train import train_mlx as train
    else:
        from dtlab.train.loop import train
    summary = train(config)
    # Only rank 0 wrote the run directory; a replica group's leaves the end summary to the run's.
    if "run_dir" in summary and not os.environ.get(RUN_SUMMARY_ENV):
        print(f"\ndtlab run finished\n{summary_table(summary)}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dtlab`` console script; returns the exit code."""
    from dtlab.mlx.launch import STATUS_ENV, record_exit

    if not os.environ.get(STATUS_ENV):
        return _main(argv)
    code = 1  # an exception that escapes is a failure
    try:
        code = _main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    finally:
        record_exit(code)  # a rank started by launch_mlx tells the launcher how it ended
    return code


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line; a CONFIG typed after the ``--set`` list is CONFIG (see
    :func:`dtlab.cliargs.take_config_from_set`)."""
    return parse_config_args(build_parser(), argv)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    handlers = {
        "train": cmd_train,
        "config": cmd_config,
        "plan": cmd_plan,
        "bench": cmd_bench,
        "export": cmd_export,
        "launch": cmd_launch,
        "verify": cmd_verify,
        "generate": cmd_generate,
    }
    return run_command(lambda: handlers[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
