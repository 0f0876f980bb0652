"""The ``dtlab`` command line. Thin: parse, load the config, call one function per command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dtlab import __version__
from dtlab.errors import DtlabError, Preempted

if TYPE_CHECKING:
    from dtlab.config import Config

TRAIN_EPILOG = """\
examples:
  dtlab train                                   # built-in default: tiny model, stdlib corpus, 1 process
  dtlab train configs/ddp.yaml --nproc 2        # DDP on 2 local processes
  dtlab train --nproc 2 --set parallel.strategy=fsdp train.lr=3e-4
  torchrun --nproc-per-node 2 -m dtlab train configs/fsdp.yaml   # under torchrun: runs as a worker

--set KEY=VALUE overrides one config key (repeatable; values are YAML: 1e-4 is a float,
true a bool, [a, b] a list). Precedence: --set > CONFIG > defaults. `dtlab config --keys` lists every key.
"""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


# Kept here so that --help needs no torch import; dtlab.analysis.devices.PROFILES has the same keys.
DEVICE_KEYS = ("h100", "h200", "a100-80gb", "a100-40gb", "l4", "rtx4090")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtlab",
        description="Distributed Training Lab: train a Llama-style model with single, DDP, FSDP or HSDP and see what each costs.",
    )
    parser.add_argument("--version", action="version", version=f"dtlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    t = sub.add_parser(
        "train",
        help="train a model",
        description="Train a model as configured.",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG",
        help="YAML config file or run directory (default: the built-in default)",
    )
    t.add_argument(
        "--nproc",
        type=_positive,
        default=1,
        help="processes on this node (default 1); >1 starts them through torch's elastic launcher",
    )
    t.add_argument("--nnodes", type=_positive, default=1, help="number of nodes (default 1)")
    t.add_argument(
        "--node-rank", type=_non_negative, default=0, help="this node's rank (multi-node)"
    )
    t.add_argument(
        "--master-addr", default=None, help="rendezvous host (multi-node; default localhost)"
    )
    t.add_argument(
        "--master-port",
        type=_positive,
        default=None,
        help="rendezvous port (multi-node; default 29500)",
    )
    t.add_argument(
        "--max-restarts",
        type=_non_negative,
        default=0,
        help="restart the worker group up to K times after a failure",
    )
    t.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.lr=1e-4",
    )

    c = sub.add_parser(
        "config",
        help="print the resolved config, or every key",
        description="Print the resolved config as YAML (CONFIG, then --set), or with --keys every key with its default.",
    )
    c.add_argument("config", nargs="?", metavar="CONFIG")
    c.add_argument(
        "--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE"
    )
    c.add_argument(
        "--keys", action="store_true", help="list every key with its default and meaning"
    )

    pl = sub.add_parser(
        "plan",
        help="predict memory, communication and step time of each strategy",
        description="Predict, without allocating the model, the per-rank memory (parameters, gradients, "
        "optimizer, activations), the bytes each collective moves per step, and an estimated step time "
        "of every data-parallel strategy; say which fit and recommend one.",
    )
    pl.add_argument("config", nargs="?", metavar="CONFIG")
    pl.add_argument("--nproc", type=_positive, default=1, help="processes (GPUs) per node")
    pl.add_argument("--nnodes", type=_positive, default=1, help="number of nodes")
    pl.add_argument(
        "--device",
        default="h100",
        help="device profile: " + ", ".join(DEVICE_KEYS) + ", or 'this' (this machine, measured)",
    )
    pl.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="override the device memory",
    )
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.add_argument(
        "--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE"
    )
    return parser


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from dtlab.analysis.devices import PROFILES, this_machine
    from dtlab.analysis.plan import format_plan, plan
    from dtlab.config import load_config

    config = load_config(args.config, args.overrides)
    if args.device == "this":
        device = this_machine(config.train.precision)
    elif args.device in PROFILES:
        device = PROFILES[args.device]
    else:
        raise DtlabError(
            f"--device {args.device!r} is not known; allowed: {', '.join(DEVICE_KEYS)}, this"
        )
    if args.device_memory is not None and args.device_memory <= 0:
        raise DtlabError(f"--device-memory {args.device_memory} must be > 0 (GiB)")
    result = plan(config, args.nproc, args.nnodes, device, args.device_memory)
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from dtlab.config import describe_fields, load_config

    if args.keys:
        for key, default, desc in describe_fields():
            print(f"{key:<36} {default:<14} {desc}")
        return 0
    print(load_config(args.config, args.overrides).to_yaml(), end="")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from dtlab.config import check_world, load_config
    from dtlab.parallel.dist import is_worker_env

    config = load_config(args.config, args.overrides)
    world = args.nproc * args.nnodes
    if is_worker_env() or world == 1:
        if not is_worker_env():
            check_world(config, world)
        return _train_here(config)

    # Fail on bad data here, once, instead of in every worker after the launch.
    from dtlab.data import build_source

    build_source(config)
    overrides = list(args.overrides)
    if config.run.dir is None:
        # Resolve the run directory once, so that every worker (and every restart) uses the same one.
        from dtlab.train.loop import default_run_dir

        overrides.append(f"run.dir={default_run_dir(config)}")
    from dtlab.launcher import LaunchSpec, launch

    spec = LaunchSpec(
        args.nproc,
        args.nnodes,
        args.node_rank,
        args.master_addr,
        args.master_port,
        args.max_restarts,
    )
    worker_args = [
        "train",
        *([args.config] if args.config else []),
        *(["--set", *overrides] if overrides else []),
    ]
    return launch(spec, worker_args)


def _train_here(config: Config) -> int:
    """Train in this process (alone, or as one worker of a launched world); rank 0 prints the summary."""
    from dtlab.metrics.report import summary_table
    from dtlab.train.loop import train

    summary = train(config)
    if "run_dir" in summary:  # only rank 0 wrote the run directory
        print(f"\ndtlab run finished\n{summary_table(summary)}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dtlab`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    handlers = {"train": cmd_train, "config": cmd_config, "plan": cmd_plan}
    try:
        return handlers[args.command](args)
    except Preempted as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"preempted: {e}", file=sys.stderr)
        return e.exit_code
    except DtlabError as e:
        rank = os.environ.get("RANK")
        tag = (
            f"[rank{rank}] "
            if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1"
            else ""
        )
        print(f"{tag}error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
