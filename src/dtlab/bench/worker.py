"""One benchmark row: train a few steps of one configuration and measure everything a step costs.

    python -m dtlab.bench.worker [CONFIG] --out ROW.json [--nproc N] [--warmup W] [--profile DIR] [--set ...]

With ``--nproc`` > 1 it starts itself in N processes through torch's elastic launcher (like ``dtlab
train``). Rank 0 writes one JSON object: timings (median/min/max over the timed steps), throughput over
all ranks, MFU against a GEMM peak measured on these ranks at the run's precision, per-rank state
bytes (gradients as held after a backward), the bytes forward keeps for backward (storages still
allocated when it returns, so what checkpointing keeps is seen), the collectives of one step (counted
from the dispatcher) next to dtlab's prediction, peak memory, CPU utilisation and the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtlab.analysis.devices import CPU_PEAK_REPEATS, lookup_cuda, measure_matmul_tflops
from dtlab.analysis.model import (
    activation_bytes,
    bus_bytes,
    flops_per_token,
    param_shapes,
    plan_step,
)
from dtlab.bench.memory import gradient_bytes, kept_activation_bytes
from dtlab.config import Config, load_config
from dtlab.errors import DtlabError
from dtlab.metrics.comm import CommCounter
from dtlab.metrics.logging import setup_logging
from dtlab.metrics.profiling import StepProfiler
from dtlab.metrics.report import peak_memory_bytes
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.parallel.dist import DistInfo, is_worker_env, reduce_scalar
from dtlab.train.loop import Training, build_training, forward_loss, train_step

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def state_bytes(tr: Training, config: Config, device: torch.device) -> dict[str, int]:
    """What this rank holds: its parameters, the optimizer state, and the gradients as they are held
    right after a backward (measured: one more micro-batch's forward and backward, with gradient sync,
    then the gradients are dropped again)."""
    module = tr.pm.module
    opt = sum(
        _local_bytes(v)
        for s in tr.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    inputs, targets = tr.loader.build_step(0)[0]
    loss = forward_loss(
        module, inputs.to(device), targets.to(device), config.train.precision, device
    )
    loss.backward()
    grads = gradient_bytes(module)
    tr.optimizer.zero_grad(set_to_none=True)
    return {
        "params_bytes": sum(_local_bytes(p) for p in module.parameters()),
        "grads_bytes": grads,
        "optimizer_bytes": opt,
    }


def measured_activation_bytes(tr: Training, config: Config, device: torch.device) -> int:
    """Bytes one micro-batch's forward leaves allocated for backward (``dtlab.bench.memory``: every
    storage the forward's operators allocated that is still alive when it returns; parameters,
    buffers and the batch excluded). Sees what activation checkpointing keeps."""
    inputs, targets = tr.loader.build_step(0)[0]
    inputs, targets = inputs.to(device), targets.to(device)
    module = tr.pm.module
    return kept_activation_bytes(
        module, lambda: forward_loss(module, inputs, targets, config.train.precision, device)
    )


def peak_flops(config: Config, d: DistInfo) -> tuple[float | None, str, float]:
    """The peak FLOP/s of all ranks together, where it comes from (never a silent default), and the
    measured GEMM rate of all ranks together.

    CPU: every rank measures a GEMM at the same time on its own threads (the sum is what the ranks can do
    together on this machine's shared cores), and that is the peak. CUDA: the datasheet peak of the
    exact device name (unknown if the name is not in the table), with the measured GEMM beside it.
    """
    precision = config.train.precision
    if dist.is_initialized():
        dist.barrier()
    cuda = d.device.type == "cuda"
    size = 8192 if cuda else 1024
    # On CPU this is the peak: the fastest of 20 runs (a median let one slow spell on a shared
    # machine halve the peak and show an MFU over 100%).
    measured = reduce_scalar(
        measure_matmul_tflops(
            _DTYPES[precision],
            d.device,
            size=size,
            repeats=5 if cuda else CPU_PEAK_REPEATS,
            best=not cuda,
        )
        * 1e12
    )
    if cuda:
        name = torch.cuda.get_device_name(d.device)
        profile = lookup_cuda(name)
        if profile is None or precision not in profile.peak_tflops:
            return None, f"unknown: {name!r} is not in dtlab's device table", measured
        return profile.peak_tflops[precision] * 1e12 * d.world_size, f"{name} datasheet", measured
    threads = torch.get_num_threads()
    return (
        measured,
        f"measured {precision} GEMM, {d.world_size} rank(s) x {threads} thread(s)",
        measured,
    )


def bench(config: Config, warmup: int, profile_dir: Path | None) -> dict[str, Any] | None:
    d = init_distributed(config)
    try:
        return _bench(config, d, warmup, profile_dir)
    finally:
        destroy_distributed()


def _bench(
    config: Config, d: DistInfo, warmup: int, profile_dir: Path | None
) -> dict[str, Any] | None:
    setup_logging(d.rank, d.world_size)
    tr = build_training(config, d)
    t = config.train
    peak, peak_source, gemm = peak_flops(config, d)
    act = measured_activation_bytes(tr, config, d.device)

    def step() -> dict[str, Any]:
        return train_step(
            tr.pm, tr.optimizer, tr.scheduler, tr.scaler, next(tr.loader), config, d.device
        )

    losses = []
    for _ in range(warmup):
        losses.append(step()["loss"])
    times = []
    cpu0, wall0 = os.times(), time.perf_counter()
    profiler = StepProfiler(profile_dir, d.rank, d.device) if profile_dir else None
    for _ in range(t.steps):
        t0 = time.perf_counter()
        losses.append(step()["loss"])
        times.append(time.perf_counter() - t0)
        if profiler is not None:
            profiler.step()
    if profiler is not None:
        profiler.close()
    cpu1, wall1 = os.times(), time.perf_counter()
    cpu_util = ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / (wall1 - wall0)
    counter = CommCounter()
    with counter:  # one more step, counted (the counter's own overhead stays out of the timings)
        losses.append(step()["loss"])
    comm_time = _replay_collectives(counter, d)
    states = state_bytes(tr, config, d.device)
    tr.loader.close()

    step_time = statistics.median(times)
    tokens = t.global_batch_size * config.seq_len
    tokens_per_s = tokens / step_time
    flops = flops_per_token(config.model, config.seq_len)
    predicted = plan_step(config, d.world_size)
    cores = os.cpu_count() or 1
    row = {
        "strategy": config.parallel.strategy,
        "sharding": config.parallel.sharding if d.dims.fsdp_enabled else "-",
        "nproc": d.world_size,
        "compression": compression_name(config),
        "precision": t.precision,
        "activation_checkpointing": t.activation_checkpointing,
        "device": torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu",
        "params": sum(s.numel for s in param_shapes(config.model)),
        "global_batch_size": t.global_batch_size,
        "seq_len": config.seq_len,
        "steps_timed": t.steps,
        "step_time_s": step_time,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "tokens_per_s": tokens_per_s,
        "samples_per_s": t.global_batch_size / step_time,
        "flops_per_token": flops,
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "mfu": flops * tokens_per_s / peak if peak else None,
        "gemm_flops_measured": gemm,
        "peak_memory_bytes": int(reduce_scalar(peak_memory_bytes(d.device), "max")),
        "state_bytes": states,
        "state_bytes_predicted": {
            "params_bytes": predicted.params_bytes,
            "grads_bytes": predicted.grads_bytes,
            "optimizer_bytes": predicted.optimizer_bytes,
        },
        "activation_bytes": act,
        "activation_bytes_predicted": activation_bytes(
            config.model,
            tr.micro * config.seq_len,
            t.precision,
            t.activation_checkpointing,
        ),
        "comm_bytes_per_step": sum(counter.bytes.values()),
        "comm_bytes_per_step_predicted": sum(predicted.comm_bytes.values()),
        # What one rank sends (ring algorithms): the figure to compare an all-gather with an all-reduce.
        "comm_bus_bytes_per_step": bus_bytes(
            dict(counter.bytes), predicted.comm_groups, d.world_size
        ),
        "comm_bus_bytes_per_step_predicted": sum(predicted.comm_bus_bytes.values()),
        "comm_bus_bytes_uncompressed": sum(
            plan_step(uncompressed(config), d.world_size).comm_bus_bytes.values()
        ),
        "compression_start_step": config.parallel.compression_options.start_step,
        "comm_by_collective": {
            k: {"count": counter.counts[k], "bytes": counter.bytes[k]}
            for k in sorted(counter.counts)
        },
        "comm_by_collective_predicted": dict(predicted.comm_bytes),
        "comm_time_s": comm_time,
        "cpu_util": cpu_util / cores,
        "loss_initial": losses[0],
        "loss_final": losses[-1],
        "losses": losses,
    }
    return row if d.is_main else None


def compression_name(config: Config) -> str:
    """The ``--compression`` name of a run's config (the inverse of ``compression_overrides``)."""
    p = config.parallel
    if config.train.optimizer == "demo":
        return "demo"
    if p.compression == "dct" and p.compression_options.coding == "quant":
        return "dct-quant"
    return p.compression


def uncompressed(config: Config) -> Config:
    out = config.model_copy(deep=True)
    out.parallel.compression = "none"
    out.train.optimizer = "adamw"
    return out


def _replay_collectives(counter: CommCounter, d: DistInfo) -> float | None:
    """Time of the step's collectives replayed alone (same kind and bytes, on all ranks), in seconds.

    Inside the step they overlap with compute and hide in its timings; replayed back to back they give
    the communication cost the step had to absorb.
    """
    if not dist.is_initialized() or d.world_size == 1 or not counter.bytes:
        return None
    world = d.world_size
    elapsed = 0.0
    for name, nbytes in counter.bytes.items():
        n = max(1, nbytes // 4)
        buf = torch.zeros(n, device=d.device)
        dist.barrier()
        t0 = time.perf_counter()
        if name == "all_reduce":
            dist.all_reduce(buf)
        elif name == "all_gather":
            shard = torch.zeros(max(1, n // world), device=d.device)
            dist.all_gather_into_tensor(torch.zeros(shard.numel() * world, device=d.device), shard)
        elif name == "reduce_scatter":
            m = max(1, n // world)
            dist.reduce_scatter_tensor(
                torch.zeros(m, device=d.device), torch.zeros(m * world, device=d.device)
            )
        elif name == "broadcast":
            dist.broadcast(buf, src=0)
        else:
            continue
        elapsed += time.perf_counter() - t0
    return reduce_scalar(elapsed, "max")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.bench.worker", description=__doc__)
    p.add_argument("config", nargs="?")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", type=Path, default=None)
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[])
    args = p.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        if args.nproc > 1 and not is_worker_env():
            from dtlab.config import check_world
            from dtlab.launcher import LaunchSpec, launch

            check_world(config, args.nproc)
            return launch(
                LaunchSpec(args.nproc),
                sys.argv[1:] if argv is None else argv,
                module="dtlab.bench.worker",
            )
        row = bench(config, args.warmup, args.profile)
    except DtlabError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if row is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
