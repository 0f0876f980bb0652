"""The training loops anyone would write by hand, for ``dtlab.bench.overhead`` to hold dtlab's loop against.

    python -m dtlab.bench.handloop CONFIG.yaml --out TIMES.json [--nproc N]

Plain torch, nothing else: the model, AdamW with one parameter group (torch's fused implementation,
as dtlab's), cross-entropy, gradient clipping, and with ``--nproc`` > 1 torch's DDP (started through
the same launcher as ``dtlab train``). The batches are dtlab's - the same samples, split into the
same micro-batches per rank - and are all prepared before the clock starts: the hand loop pays nothing
for data but the copy to the rank's GPU, which dtlab's step makes too. On a GPU every step is timed
to the end of its kernels (:mod:`dtlab.bench.timing`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dtlab.bench.timing import synchronize, timed
from dtlab.cliargs import positive_int, run_command
from dtlab.config import Config, load_config
from dtlab.data import BatchLayout, BatchLoader, build_source
from dtlab.data.loader import MicroBatch
from dtlab.models.llama import build_model
from dtlab.parallel.apply import NO_BUFFER_SYNC
from dtlab.parallel.dist import resolve_device


@dataclass
class LoopTimes:
    """What one run of a loop measured (rank 0's clock).

    ``step_s``: the median step time, the first step left out as warm-up. ``loop_s``: the loop's wall
    time per step over the steps after the first, with everything it does between steps (for dtlab
    also the end of the run: closing the data thread and the sinks).
    """

    step_s: float
    loop_s: float
    steps: int
    threads: int

    @classmethod
    def from_steps(cls, times: list[float], wall: float, threads: int) -> LoopTimes:
        """From every step's time and the wall time of the whole loop (at least two steps)."""
        return cls(statistics.median(times[1:]), (wall - times[0]) / (len(times) - 1), len(times), threads)  # fmt: skip


def micro_batch_size(config: Config, world: int) -> int:
    """Samples per micro-batch on each of ``world`` ranks: ``train.micro_batch_size``, or the rank's
    whole share of the global batch (no accumulation)."""
    t = config.train
    return t.micro_batch_size or t.global_batch_size // world


def batches(config: Config, rank: int, world: int) -> list[list[MicroBatch]]:
    """Every step's micro-batches of this rank, built before any timing."""
    t = config.train
    layout = BatchLayout(t.global_batch_size, rank, world, micro_batch_size(config, world))
    loader = BatchLoader(build_source(config), layout, prefetch=0)
    return [next(loader) for _ in range(t.steps)]


class HandStep:
    """The hand-written step: the model on ``device`` (this rank's: under DDP when ``world`` > 1, on
    the process group's backend, NCCL for a GPU), AdamW, and one optimizer step over a rank's
    micro-batches."""

    def __init__(self, config: Config, world: int = 1, device: torch.device | None = None) -> None:
        t = self.t = config.train
        device = self.device = device if device is not None else torch.device("cpu")
        torch.manual_seed(t.seed)
        model = build_model(config.model, device)
        # The RoPE tables are constants: no careful DDP loop broadcasts them before every forward.
        ids = [device.index] if device.type == "cuda" else None
        self.ddp = (
            DistributedDataParallel(model, device_ids=ids, **NO_BUFFER_SYNC) if world > 1 else None
        )
        self.net: nn.Module = model if self.ddp is None else self.ddp
        # The same AdamW implementation as dtlab's (fused): what is measured is the loop around it.
        self.opt = torch.optim.AdamW(
            self.net.parameters(), lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay,
            fused=True,
        )  # fmt: skip

    def __call__(self, micro_batches: list[MicroBatch]) -> float:
        """One optimizer step; returns this rank's last micro-batch loss (its ``.item()`` is the
        step's one host sync, as a loop that prints its loss has)."""
        accum = len(micro_batches)
        for i, (inputs, targets) in enumerate(micro_batches):
            inputs, targets = inputs.to(self.device), targets.to(self.device)  # (as dtlab's step)
            # Gradients are all-reduced in the last micro-batch's backward only.
            with self.ddp.no_sync() if self.ddp is not None and i < accum - 1 else nullcontext():
                logits = self.net(inputs)
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / accum
                loss.backward()
        if self.t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.t.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.item())


def hand_loop(
    config: Config, rank: int = 0, world: int = 1, device: torch.device | None = None
) -> LoopTimes:
    """Train ``train.steps`` steps by hand on rank ``rank`` of ``world`` (DDP when ``world`` > 1) on
    ``device`` (the one dtlab's run would take, by default)."""
    device = device if device is not None else resolve_device(config, 0)
    step = HandStep(config, world, device)
    data = batches(config, rank, world)
    times = []
    synchronize(device)
    start = time.perf_counter()
    for micro_batches in data:
        with timed(device) as t:
            step(micro_batches)
        times.append(t.seconds)
    wall = time.perf_counter() - start
    return LoopTimes.from_steps(times, wall, torch.get_num_threads())


def _worker(config: Config, out: Path) -> None:
    """One rank of the hand-written DDP loop (on this rank's GPU with NCCL where dtlab would take
    one, else gloo on CPU); rank 0 writes the times."""
    device = resolve_device(config, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        times = hand_loop(config, rank, world, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps(asdict(times)) + "\n", encoding="utf-8")


def interleaved(config: Config) -> dict[str, list[float]]:
    """dtlab's step (:func:`dtlab.train.loop.train_step` on its own parallel model, optimizer and
    schedule) and the hand-written step, taken in turn on the same micro-batches in the same processes:
    whatever slows the machine slows both alike. The order alternates every step (ABBA), so neither
    always runs on the other's warm caches. Returns this rank's step times, ``{"hand": [...],
    "dtlab": [...]}``, the first step of each left out."""
    from dtlab.parallel import init_distributed
    from dtlab.train.loop import build_training
    from dtlab.train.optimizer_step import train_step

    d = init_distributed(config)
    tr = build_training(config, d)
    tr.loader.close()  # the batches below are built ahead, as the hand loop's are
    hand = HandStep(config, d.world_size, d.device)  # the rank's device, on dtlab's process group
    times: dict[str, list[float]] = {"hand": [], "dtlab": []}

    def ours(mb: list[MicroBatch]) -> None:
        train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, mb, config, d.device)

    runs: list[tuple[str, Any]] = [("hand", hand), ("dtlab", ours)]
    for i, mb in enumerate(batches(config, d.dims.dp_rank(d.rank), d.dims.dp)):
        for name, fn in runs if i % 2 == 0 else runs[::-1]:
            with timed(d.device) as t:
                fn(mb)
            if i > 0:
                times[name].append(t.seconds)
    return times


def _interleaved_worker(config: Config, out: Path) -> None:
    from dtlab.parallel import destroy_distributed

    try:
        times = interleaved(config)
    finally:
        destroy_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(times) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.bench.handloop", description=__doc__)
    p.add_argument("config")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--nproc", type=positive_int, default=1)
    p.add_argument(
        "--interleaved", action="store_true",
        help="take dtlab's step and the hand-written one in turn in the same processes; "
        "writes both step times",
    )  # fmt: skip
    args = p.parse_args(argv)
    config = load_config(args.config)
    from dtlab.parallel.dist import is_worker_env

    if args.nproc > 1 and not is_worker_env():
        from dtlab.launcher import LaunchSpec, launch

        return launch(
            LaunchSpec(args.nproc),
            sys.argv[1:] if argv is None else argv,
            module="dtlab.bench.handloop",
        )
    if args.interleaved:
        _interleaved_worker(config, args.out)
    elif is_worker_env():
        _worker(config, args.out)
    else:
        args.out.write_text(json.dumps(asdict(hand_loop(config))) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    from dtlab.parallel.dist import is_worker_env
    from dtlab.runtime.status import leave_worker

    code = run_command(main)
    if is_worker_env():
        leave_worker(code)  # a rank that ran a process group: see there
    raise SystemExit(code)
