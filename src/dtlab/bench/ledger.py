"""What does the ledger of collectives cost a training step? Measured side by side in one run.

    python -m dtlab.bench.ledger [--preset tiny] [--nproc 2] [--blocks 8] [--block-steps 5] [--set KEY=VALUE ...]

One DDP run on ``--nproc`` local gloo ranks trains blocks of steps with the ledger recording and publishing,
and blocks without it, alternately (ABBA order), so that both see the same machine load. A step is what the
loop does for one optimizer step: ``train_step``, whose one reduction carries the stop votes. Printed:
the median step time of each, their ratio, and what recording one entry costs the training thread.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dtlab.cliargs import int_from, parse_config_args, positive_int, run_command, script_parser
from dtlab.config import Config, load_config
from dtlab.parallel import ledger as ledger_module

if TYPE_CHECKING:
    from dtlab.parallel.dist import DistInfo
    from dtlab.train.loop import Training


def record_cost(n: int = 20000) -> float:
    """Microseconds the training thread spends recording one entry (begin and end of a collective)."""
    led = ledger_module.Ledger(0, 2)
    t = torch.zeros(())
    t0 = time.perf_counter()
    for _ in range(n):
        with led.record("train_step loss all_reduce", "all_reduce", t):
            pass
    return (time.perf_counter() - t0) / n * 1e6


def publish_cost(store: Any, n: int = 1000) -> float:
    """CPU microseconds of one publication (the newest entries as JSON, into the c10d store)."""
    led = ledger_module.Ledger(0, 2)
    for _ in range(ledger_module.PUBLISHED):
        with led.record("train_step loss all_reduce", "all_reduce", torch.zeros(())):
            pass
    channel = ledger_module.StoreChannel(store)
    c0 = time.process_time()
    for _ in range(n):
        channel.publish(0, json.dumps(led.snapshot()))
    return (time.process_time() - c0) / n * 1e6


def _config(args: argparse.Namespace) -> Config:
    return load_config(
        overrides=[f"model.preset={args.preset}", "parallel.strategy=ddp", *args.overrides]
    )


def worker(args: argparse.Namespace) -> None:
    """One rank: alternate blocks of steps with and without the ledger; rank 0 prints the figures."""
    from dtlab.parallel import destroy_distributed, init_distributed
    from dtlab.train.loop import build_training

    logging.getLogger("dtlab").disabled = True
    config = _config(args)
    d = init_distributed(config)
    tr = build_training(config, d)
    with tempfile.TemporaryDirectory() as tmp:
        led = ledger_module.start_ledger(d, Path(tmp), None, config.parallel.collective_timeout_s)
        assert led is not None, "the ledger is off (DTLAB_LEDGER)"
        blocks = _timed_blocks(args, config, d, tr, led)
    tr.loader.close()
    destroy_distributed()
    if d.is_main:
        _report(args, d.world_size, blocks)


# (ledger on, median wall time, median CPU time of this process) of a timed block's steps
_Block = tuple[bool, float, float]


def _timed_blocks(
    args: argparse.Namespace,
    config: Config,
    d: DistInfo,
    tr: Training,
    led: ledger_module.Ledger,
) -> list[_Block]:
    """Block 0 warms up; then the timed blocks in ABBA order: on, off, off, on, ..."""
    import torch.distributed as dist

    from dtlab.train.optimizer_step import train_step

    blocks: list[_Block] = []
    step = 0
    for b in range(args.blocks + 1):
        on = b == 0 or (b - 1) % 4 in (0, 3)
        ledger_module._active = led if on else None
        times, cpu = [], []
        for _ in range(args.block_steps):
            step += 1
            batch = next(tr.loader)
            dist.barrier()  # start every timed step together
            t0, c0 = time.perf_counter(), time.process_time()
            ledger_module.note_step(step)
            train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, batch, config, d.device)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        if b > 0:
            blocks.append((on, statistics.median(times), statistics.median(cpu)))
    ledger_module._active = led
    return blocks


def _report(args: argparse.Namespace, world: int, blocks: list[_Block]) -> None:
    import torch.distributed as dist

    print(
        f"{args.preset}, ddp x {world}, {len(blocks)} blocks of {args.block_steps} steps, "
        "alternating with and without the ledger (rank 0's figures):"
    )
    for k, what in ((1, "wall time"), (2, "CPU time (all threads of the process)")):
        # Each block against its neighbour of the other kind (ABBA pairs): drifts of the load cancel.
        ratios = [
            (a[k] if a[0] else b[k]) / (b[k] if a[0] else a[k])
            for a, b in zip(blocks[0::2], blocks[1::2], strict=False)
        ]
        with_l = statistics.median(x[k] for x in blocks if x[0])
        without = statistics.median(x[k] for x in blocks if not x[0])
        med = statistics.median(ratios)
        print(
            f"  step {what}: median {with_l * 1e3:.2f} ms with, {without * 1e3:.2f} ms without; "
            f"with / without per pair of blocks: median {med:.3f} (min {min(ratios):.3f}, "
            f"max {max(ratios):.3f}) -> {100 * (med - 1):+.1f}%"
        )
    publish = publish_cost(dist.TCPStore("127.0.0.1", 0, 1, is_master=True))
    print(
        f"  recording one entry: {record_cost():.1f} us in the training thread; one publication: "
        f"{publish:.0f} us of CPU in the publisher thread, at most every "
        f"{ledger_module.PUBLISH_S:g} s ({publish / ledger_module.PUBLISH_S / 1e4:.2f}% of a core)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = script_parser("dtlab.bench.ledger", __doc__, "tiny")
    p.add_argument("--nproc", type=positive_int, default=2)
    p.add_argument(
        "--blocks",
        type=int_from(2),
        default=8,
        help="timed blocks, half of them with the ledger (2 or more: one of each to compare)",
    )
    p.add_argument("--block-steps", type=positive_int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parse_config_args(p, argv)
    if args.worker:
        worker(args)
        return 0
    _config(args)  # a mistake is said once, here, not by every rank
    from dtlab.launcher import LaunchSpec, launch

    forwarded = [
        "--worker", "--preset", args.preset, "--blocks", str(args.blocks),
        "--block-steps", str(args.block_steps), *(["--set", *args.overrides] if args.overrides else []),
    ]  # fmt: skip
    return launch(LaunchSpec(args.nproc), forwarded, module="dtlab.bench.ledger")


if __name__ == "__main__":
    from dtlab.parallel.dist import is_worker_env
    from dtlab.runtime.status import leave_worker

    code = run_command(main)
    if is_worker_env():
        leave_worker(code)  # a rank that ran a process group: see there
    raise SystemExit(code)
