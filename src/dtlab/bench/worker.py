"""One benchmark row: train a few steps of one configuration and measure everything a step costs.

    python -m dtlab.bench.worker [CONFIG] --out ROW.json [--nproc N] [--warmup W] [--profile DIR] [--set ...]

With ``--nproc`` > 1 it starts itself in N processes through torch's elastic launcher (like ``dtlab
train``). Rank 0 writes one JSON object: timings (median/min/max over the timed steps), throughput over
all ranks, MFU against a GEMM peak measured on these ranks at the run's precision (or the bench's one
peak, ``--peak-flops``), per-rank state bytes (gradients as held after a backward), the bytes forward
keeps for backward (storages still allocated when it returns, so what checkpointing keeps is seen), the
collectives of one step (counted from the dispatcher; DiLoCo's averaged over a whole outer period) next
to dtlab's prediction, peak memory, CPU utilisation and the losses.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtlab.analysis import moe
from dtlab.analysis.activations import masked_attention, query_precision
from dtlab.analysis.devices import (
    CPU_PEAK_REPEATS,
    cpu_gemm_size,
    lookup_cuda,
    measure_matmul_tflops,
)
from dtlab.analysis.model import (
    StepPlan,
    TPSplit,
    activation_bytes,
    attention_kernel,
    bus_bytes,
    flops_per_token,
    fsdp_half_params,
    kernel_bytes,
    param_shapes,
    plan_step,
)
from dtlab.bench.memory import gradient_bytes, kept_activation_bytes
from dtlab.bench.timing import timed
from dtlab.cliargs import (
    add_config_args,
    non_negative_int,
    parse_config_args,
    positive_float,
    positive_int,
    run_command,
)
from dtlab.config import Config, load_config
from dtlab.dims import layout_name
from dtlab.errors import DtlabError
from dtlab.metrics.comm import CommCounter
from dtlab.metrics.logging import setup_logging
from dtlab.metrics.peaks import cuda_peaks
from dtlab.metrics.profiling import StepProfiler
from dtlab.metrics.report import peak_memory_bytes, peak_reserved_bytes
from dtlab.models.args import model_args
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.parallel.dist import (
    DistInfo,
    all_gather_flat,
    is_worker_env,
    reduce_scalar,
    reduce_scatter_flat,
)
from dtlab.parallel.float8 import emulated
from dtlab.runtime.faults import Faults
from dtlab.runtime.signals import StopSignals
from dtlab.train.loop import TorchEngine, Training, resolve_run_dir
from dtlab.train.optimizer_step import accumulate_gradients, forward_loss
from dtlab.train.run import run

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
    # A whole step's forward and backward, as training runs it (every layout: a pipeline's schedule,
    # tensor parallelism's loss). ZeRO-1 holds whole gradients until its reduce-scatter after
    # backward leaves each rank its rows: measured before it, at their peak.
    zero = tr.pm.zero is not None
    accumulate_gradients(tr.pm, tr.scaler, tr.loader.build_step(0), config, device, skip_sync=zero)
    grads = gradient_bytes(module)
    tr.optimizer.zero_grad(set_to_none=True)
    module.zero_grad(set_to_none=True)
    return {
        "params_bytes": sum(_local_bytes(p) for p in module.parameters()),
        "grads_bytes": grads,
        "optimizer_bytes": opt,
    }


def measured_activation_bytes(tr: Training, config: Config, device: torch.device) -> int | None:
    """Bytes one micro-batch's forward leaves allocated for backward (``dtlab.bench.memory``: every
    storage the forward's operators allocated that is still alive when it returns; parameters,
    buffers and the batch excluded). Sees what activation checkpointing keeps. None under pipeline
    parallelism, whose schedule runs forward and backward together."""
    if tr.pm.pipeline is not None:
        return None
    inputs, targets = tr.loader.build_step(0)[0]
    inputs, targets = inputs.to(device), targets.to(device)
    module = tr.pm.module

    def forward() -> torch.Tensor:
        with tr.pm.loss_context():
            return forward_loss(
                module, inputs, targets, config.train.precision, device, config.train.compile
            )

    return kept_activation_bytes(module, forward)


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
    size = 8192 if cuda else cpu_gemm_size(_DTYPES[precision])
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
        f"measured {precision} GEMM {size}^3, {d.world_size} rank(s) x {threads} thread(s)",
        measured,
    )


def bench(
    config: Config,
    warmup: int,
    profile_dir: Path | None,
    given_peak: tuple[float, str] | None = None,
    timing_only: bool = False,
) -> dict[str, Any] | None:
    """One row (on rank 0; None on the others). ``given_peak``: the (FLOP/s, source) MFU is computed
    against, measured once for the whole bench; without it the ranks measure their own.
    ``timing_only``: the layout and the timed steps alone (no activation measurement, counted
    step, replay of the collectives or compute-only pass: a calibration's repeated rows)."""
    d = init_distributed(config)
    try:
        return _bench(config, d, warmup, profile_dir, given_peak, timing_only)
    finally:
        destroy_distributed()


class TimingSink:
    """Every step's metrics, with the wall and CPU time of this process when the step was recorded."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.clock: list[tuple[float, float]] = []  # (wall, CPU time of the process)

    def log(self, metrics: dict[str, Any]) -> None:
        self.records.append(metrics)
        cpu = os.times()
        self.clock.append((time.perf_counter(), cpu.user + cpu.system))

    def close(self) -> None:
        return None


def counted_steps(config: Config) -> int:
    """Steps whose collectives are counted, after the timed ones: one, or DiLoCo's whole outer period
    (H steps, in which every fragment syncs once, wherever the period starts), so that bytes per step
    are the period's average rather than one step's, which may hold every sync or none."""
    return config.parallel.diloco.inner_steps or 1


class BenchEngine(TorchEngine):
    """The torch engine, with the collectives of the counted steps counted and the timed steps
    profiled."""

    def __init__(
        self,
        config: Config,
        d: DistInfo,
        run_dir: Path,
        timed: range,
        profile_dir: Path | None,
        counted: int,
    ) -> None:
        super().__init__(config, d, run_dir)
        self.timed, self.profile_dir = timed, profile_dir
        self.counted = range(timed.stop, timed.stop + counted)
        self.group_ranks: dict[str, list[int]] = {}  # see _note_groups
        # Tensor and pipeline parallelism's collectives are counted under their dimension's name.
        dims = d.dims
        # A dimension over the whole world is the default group, which the step's reduction uses too:
        # its collectives keep their plain names (and the prediction's are merged to match).
        world = dist.group.WORLD
        labels = {
            str(group.group_name): name
            for name in ("tp",)
            if dims.degrees[name] > 1
            and (group := dims.mesh(d.device.type, name).get_group()) is not world
            and group.size() < d.world_size
        }
        if (
            dims.ep_enabled and dims.ep_dp > 1
        ):  # the expert shards' all-reduce, as the plan names it
            labels[str(dims.expert_mesh(d.device.type, "ep_dp").get_group().group_name)] = "ep_dp"
        # DiLoCo's outer group and the groups inside its replicas keep train's names; expert
        # parallelism's over the whole world is the default group, whose collectives keep theirs.
        kept = {k: v for k, v in self.comm_labels.items() if v != "ep" or dims.ep < d.world_size}
        self.counter = CommCounter({**kept, **labels})

    def step(
        self, batch: list[Any], step: int, stop_signal: int, inject_nan: bool
    ) -> dict[str, Any]:
        if step == self.timed.start and self.profile_dir is not None:
            self.profiler = StepProfiler(self.profile_dir, self.d.rank, self.d.device)
        if step in self.counted:
            if self.profiler is not None:  # the profiler covers the timed steps only
                self.profiler.close()
                self.profiler = None
            # Steps after the timed ones, counted (the counter's overhead stays out of the timings);
            # the counter adds up over them.
            with self.counter:
                m = super().step(batch, step, stop_signal, inject_nan)
            self._note_groups()
            return m
        return super().step(batch, step, stop_signal, inject_nan)

    def _note_groups(self) -> None:
        """The ranks of every process group a counted collective ran on, while the groups live: a
        group the run owns (DiLoCo's) is destroyed when the run ends, before the replay."""
        from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

        for _, name in self.counter.by_group:
            if name is not None and name not in self.group_ranks:
                group = _resolve_process_group(GroupName(name))
                self.group_ranks[name] = sorted(dist.get_process_group_ranks(group))


def _bench(
    config: Config,
    d: DistInfo,
    warmup: int,
    profile_dir: Path | None,
    given_peak: tuple[float, str] | None = None,
    timing_only: bool = False,
) -> dict[str, Any] | None:
    setup_logging(d.rank, d.world_size)
    logging.getLogger("dtlab").setLevel(
        logging.ERROR
    )  # the row is the output; the run's lines are not
    steps = range(warmup + 1, warmup + config.train.steps + 1)  # the timed steps
    counted = 0 if timing_only else counted_steps(config)
    run_config = _run_config(config, d, steps, counted)
    run_dir, lock = resolve_run_dir(run_config, d)
    engine = BenchEngine(run_config, d, run_dir, steps, profile_dir, counted)
    peak = peak_flops(config, d) if given_peak is None else (*given_peak, given_peak[0])
    act = None if timing_only else measured_activation_bytes(engine.tr, config, d.device)
    if d.device.type == "cuda":
        # The GEMM probe (8192 x 8192 matrices) and the activation measurement are not training: their
        # blocks go back to the device and the peaks start with the run.
        torch.cuda.empty_cache()
        cuda_peaks(d.device).restart()
    timing = TimingSink()
    signals = StopSignals()
    try:
        run(run_config, engine, run_dir, Faults(), signals, extra_sinks=[timing])
    finally:
        signals.close()
        if lock is not None:
            lock.release()
        if d.is_main:
            shutil.rmtree(run_dir, ignore_errors=True)
    if timing_only:
        row = {**_layout_figures(config, d), **_speed_figures(config, timing, steps, *peak)}
        return row if d.is_main else None
    # The training's peaks, read before the replay's buffers and the compute-only model exist.
    memory = _memory_figures(config, d, engine.tr, act)
    period = counted
    comm_time = _replay_collectives(engine.counter, d, period, engine.group_ranks)
    compute_time = _compute_only(config, d, engine.tr) if comm_time is not None else None
    losses = [m["loss"] for m in timing.records]
    speed = _speed_figures(config, timing, steps, *peak)
    row = {
        **_layout_figures(config, d),
        **speed,
        **memory,
        **_comm_figures(config, d, engine.counter, comm_time, period),
        **_overlap_figures(speed["step_time_s"], compute_time, comm_time),
        "cpu_util": _cpu_util(timing, steps) / (os.cpu_count() or 1),
        "loss_initial": losses[0],
        "loss_final": losses[-1],
        "losses": losses,
    }
    return row if d.is_main else None


def _run_config(config: Config, d: DistInfo, timed: range, counted: int) -> Config:
    """The config the benchmark trains: the warm-up steps, the timed ones and ``counted`` more
    (:func:`counted_steps`), in a temporary run directory, without checkpoints, plots or progress."""
    cfg = config.model_copy(deep=True)
    cfg.train.steps = timed.stop + counted - 1
    cfg.run.dir = d.decide(lambda: tempfile.mkdtemp(prefix="dtlab-bench-"))
    cfg.run.progress, cfg.run.log_every = "none", 1
    cfg.run.plot = cfg.run.tensorboard = cfg.run.profile = False
    cfg.run.trackers = []  # a measurement is not an experiment: no tracker runs
    cfg.checkpoint.every, cfg.checkpoint.final, cfg.checkpoint.resume = 0, False, "never"
    return cfg


def _layout_figures(config: Config, d: DistInfo) -> dict[str, Any]:
    t = config.train
    return {
        "strategy": config.parallel.strategy,
        "layout": layout_name(d.dims, config.parallel),  # the row's name in the report
        "tp": d.dims.tp,
        "pp": d.dims.pp,
        "ep": d.dims.ep,
        "pp_schedule": config.parallel.pp_schedule if d.dims.pp_enabled else None,
        "sharding": config.parallel.sharding
        if d.dims.fsdp_enabled or d.dims.shard_optimizer
        else "-",
        "nproc": d.world_size,
        "compression": compression_name(config),
        "precision": t.precision,
        # train.float8: the recipe, and whether its GEMMs were emulated (no float8 GEMM here).
        "float8": {"recipe": t.float8.recipe, "emulated": emulated(t.float8.emulate, d.device)}
        if t.float8.enabled
        else None,
        "activation_checkpointing": t.activation_checkpointing,
        "device": torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu",
        "params": sum(s.numel for s in param_shapes(config.model)),
        # A mixture of experts: the parameters one token runs through, which its FLOPs count.
        "active_params": moe.param_counts(param_shapes(config.model), config.model).active,
        "global_batch_size": t.global_batch_size,
        "seq_len": config.seq_len,
    }


def _speed_figures(
    config: Config,
    timing: TimingSink,
    timed: range,
    peak: float | None,
    peak_source: str,
    gemm: float,
) -> dict[str, Any]:
    """Step time over the timed steps, throughput, and MFU against ``peak`` FLOP/s."""
    t = config.train
    times = [m["step_time_s"] for m in timing.records[timed.start - 1 : timed.stop - 1]]
    step_time = statistics.median(times)
    tokens_per_s = t.global_batch_size * config.seq_len / step_time
    flops = flops_per_token(config.model, config.seq_len)
    return {
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
    }


def _memory_figures(config: Config, d: DistInfo, tr: Training, act: int | None) -> dict[str, Any]:
    """Peak memory (the largest rank's: a collective) of the tensors and, on a GPU, reserved by the
    allocator (the tensors plus its cache); state and activation bytes, next to predicted: the
    activations with what the attention kernel that runs here keeps (:func:`kernel_bytes`)."""
    t = config.train
    predicted = plan_step(config, d.world_size, pp_rank=0, device_type=d.device.type)
    split = TPSplit(d.dims.tp, config.parallel.sequence_parallel)
    # The kernel training runs: the queries' precision (query_precision) and whether a document
    # mask or a sliding window makes attention take a mask (flash takes none on a GPU).
    precision = query_precision(config, d.dims)
    kernel = attention_kernel(config.model, precision, d.device.type, masked_attention(config))
    tokens = tr.micro * config.seq_len
    extra = kernel_bytes(
        config.model, tokens, config.seq_len, t.precision, t.activation_checkpointing, kernel, split
    )
    reserved = peak_reserved_bytes(d.device)
    return {
        "peak_memory_bytes": int(reduce_scalar(peak_memory_bytes(d.device), "max")),
        "peak_memory_reserved_bytes": None
        if reserved is None
        else int(reduce_scalar(reserved, "max")),
        "state_bytes": state_bytes(tr, config, d.device),
        "state_bytes_predicted": {
            "params_bytes": predicted.params_bytes,
            "grads_bytes": predicted.grads_bytes,
            "optimizer_bytes": predicted.optimizer_bytes,
        },
        "attention_kernel": kernel,
        "activation_bytes": act,
        # Measured under a dispatch mode, where compiled code runs eagerly (dtlab.metrics.modes):
        # predicted for the eager loss, which is what the measurement sees.
        "activation_bytes_predicted": None
        if act is None
        else activation_bytes(
            config.model,
            tokens,
            t.precision,
            t.activation_checkpointing,
            split,
            half_params=fsdp_half_params(config, d.dims),
        )
        + extra
        + moe.ep_activation_bytes(config, d.dims, tokens),  # expert parallelism's rows
        "activation_kernel_bytes": extra,
    }


def _as_counted(plan: StepPlan, d: DistInfo) -> StepPlan:
    """The plan's collectives under the names the counter gives them: tensor parallelism over the
    whole world runs on the default group, so its collectives are counted with the others there;
    so does expert parallelism over the whole world."""
    degrees = {"tp": d.dims.tp, "ep": d.dims.ep}
    whole = [f"{k} " for k, n in degrees.items() if n == d.world_size]
    if not whole:
        return plan
    comm: dict[str, int] = {}
    groups: dict[str, int] = {}
    for key, value in plan.comm_bytes.items():
        name = key
        for prefix in whole:
            name = name.removeprefix(prefix)
        comm[name] = comm.get(name, 0) + value
        groups[name] = max(groups.get(name, 0), plan.comm_groups[key])
    merged = StepPlan(**{**plan.__dict__, "comm_bytes": comm, "comm_groups": groups})
    merged.comm_bus_bytes = {k: v for k, v in plan.comm_bus_bytes.items()}
    return merged


def _per_step(value: int, period: int) -> float:
    """A count over ``period`` counted steps, per step (the whole number itself over one step)."""
    return value if period == 1 else value / period


def _comm_figures(
    config: Config, d: DistInfo, counter: CommCounter, comm_time: float | None, period: int = 1
) -> dict[str, Any]:
    """The counted steps' collectives per step (over ``period`` steps: their average), next to
    predicted (and uncompressed)."""
    predicted = _as_counted(plan_step(config, d.world_size, pp_rank=0), d)
    per_step = {k: _per_step(v, period) for k, v in counter.bytes.items()}
    return {
        "comm_counted_steps": period,
        "comm_bytes_per_step": sum(per_step.values()),
        "comm_bytes_per_step_predicted": sum(predicted.comm_bytes.values()),
        # What one rank sends (ring algorithms): the figure to compare an all-gather with an all-reduce.
        "comm_bus_bytes_per_step": _per_step(1, period)
        * bus_bytes(dict(counter.bytes), predicted.comm_groups, d.world_size),
        "comm_bus_bytes_per_step_predicted": sum(predicted.comm_bus_bytes.values()),
        "comm_bus_bytes_uncompressed": sum(
            plan_step(uncompressed(config), d.world_size, pp_rank=0).comm_bus_bytes.values()
        ),
        "compression_start_step": config.parallel.compression_options.start_step,
        "comm_by_collective": {
            k: {"count": _per_step(counter.counts[k], period), "bytes": per_step[k]}
            for k in sorted(counter.counts)
        },
        "comm_by_collective_predicted": dict(predicted.comm_bytes),
        "comm_time_s": comm_time,
        **_all_to_all_figures(
            config, d, sum(v for k, v in per_step.items() if k.endswith("all_to_all")), predicted
        ),
    }


def _all_to_all_figures(
    config: Config, d: DistInfo, counted: float, predicted: StepPlan
) -> dict[str, Any]:
    """Expert parallelism's all-to-all bytes per step: this rank's, their mean over the ranks (a
    collective: every rank calls this), and the plan's for an even router. A rank's bytes follow the
    rows the router sent it; the mean over the ranks does not (the rows received sum to the rows
    sent), so it is the figure the prediction is to the byte."""
    if not d.dims.ep_enabled:
        return {}
    mean = torch.tensor([counted], dtype=torch.float64)
    if dist.is_initialized() and d.world_size > 1:
        mean = mean.to(d.device)
        dist.all_reduce(mean)
        mean = mean.cpu() / d.world_size
    return {
        "all_to_all_bytes_per_step": counted,
        "all_to_all_bytes_per_step_mean": mean.item(),
        "all_to_all_bytes_per_step_predicted": sum(
            v for k, v in predicted.comm_bytes.items() if k.endswith("all_to_all")
        ),
    }


def _cpu_util(timing: TimingSink, timed: range) -> float:
    """CPU time over wall time, from the end of the last warm-up step (the first step, without one) to
    the end of the last timed one: cores' worth of CPU this process used."""
    (wall0, cpu0), (wall1, cpu1) = (
        timing.clock[max(timed.start - 2, 0)],
        timing.clock[timed.stop - 2],
    )
    return (cpu1 - cpu0) / (wall1 - wall0)


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


REPLAYED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
REPLAYS = 3  # timed replays of the step's collectives (the median counts), after one untimed


class _GroupGone(Exception):
    """A counted collective's process group is gone and no live group stands for it."""


def _replay_group(name: str | None, group_ranks: dict[str, list[int]]) -> Any:
    """The live process group to replay on for the counted group ``name``: the group itself, or,
    for one the run destroyed (DiLoCo's), the default group when it spanned every rank."""
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    if name is None:
        return dist.group.WORLD
    try:
        return _resolve_process_group(GroupName(name))
    except RuntimeError:
        if group_ranks.get(name) == list(range(dist.get_world_size())):
            return dist.group.WORLD
        raise _GroupGone(name) from None


def _replay_plan(
    counter: CommCounter, period: int = 1, group_ranks: dict[str, list[int]] | None = None
) -> list[tuple[str, Any, int]]:
    """(collective, process group, bytes per step over the ``period`` counted steps) of the counted
    steps, one entry per kind and group, in an order every rank shares: by kind, then the largest
    groups first, then by the stride of the group's ranks (a mesh dimension's groups all share one),
    so that peers meet in the same entry. ``_GroupGone`` when a group is gone (every rank alike: the
    groups of one kind have one size on every rank)."""
    merged: dict[tuple[str, Any], int] = {}
    for (counted, group_name), nbytes in counter.by_group.items():
        name = counted.split(" ")[-1]  # a labelled group's ("diloco all_reduce") is still a kind
        if name in REPLAYED:
            group = _replay_group(group_name, group_ranks or {})
            merged[(name, group)] = merged.get((name, group), 0) + nbytes

    def order(item: tuple[tuple[str, Any], int]) -> tuple[str, int, int, str]:
        (name, group), _ = item
        ranks = sorted(dist.get_process_group_ranks(group))
        stride = ranks[1] - ranks[0] if len(ranks) > 1 else 0
        return name, -len(ranks), stride, str(group.group_name)

    return [(name, group, n // period) for (name, group), n in sorted(merged.items(), key=order)]


def _replay_once(plan: list[tuple[str, Any, int]], d: DistInfo) -> float:
    """Seconds this rank spent in one replay of ``plan``, each collective started by all at once."""
    elapsed = 0.0
    for name, group, nbytes in plan:
        n, size = max(1, nbytes // 4), dist.get_world_size(group)
        part = max(1, n // size)  # an all-gather's input, a reduce-scatter's output
        buf = torch.zeros(n, device=d.device)
        big, small = torch.zeros(part * size, device=d.device), torch.zeros(part, device=d.device)
        source = big.clone() if name == "all_to_all" else None
        dist.barrier()
        # NCCL returns once the collective is queued: the device is waited for around it.
        with timed(d.device) as t:
            if name == "all_reduce":
                dist.all_reduce(buf, group=group)
            elif name == "all_gather":
                all_gather_flat(big, small, group=group)
            elif name == "reduce_scatter":
                reduce_scatter_flat(small, big, group=group)
            elif source is not None:  # all_to_all: ZeRO-1's reduce-scatter
                dist.all_to_all_single(big, source, group=group)
            else:
                dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
        elapsed += t.seconds
    return elapsed


def _replay_collectives(
    counter: CommCounter,
    d: DistInfo,
    period: int = 1,
    group_ranks: dict[str, list[int]] | None = None,
) -> float | None:
    """Time of the step's collectives replayed alone, in seconds: each kind on the process group it
    ran on in the step (HSDP's all-gathers within a replica, its all-reduce across replicas), with
    the bytes it moved there, back to back; one untimed replay, then the median of ``REPLAYS``, the
    slowest rank's.

    Inside the step they overlap with compute and hide in its timings; replayed back to back they give
    the communication cost the step had to absorb.
    """
    if not dist.is_initialized() or d.world_size == 1 or not counter.bytes:
        return None
    if d.dims.tp_enabled or d.dims.pp_enabled:
        # Pipeline ranks issue different collectives (and tensor parallelism's live inside the
        # computation): no replay of one rank's list stands for the others'.
        return None
    try:
        plan = _replay_plan(counter, period, group_ranks)
    except _GroupGone:  # a group the run destroyed, over some of the ranks: nothing to replay on
        return None
    if not plan:
        return None
    # Expert parallelism's all-to-all bytes follow the rows the router sent each rank: every rank
    # replays the largest (the slowest rank's, which the others wait for), or sizes would not match.
    sizes = torch.tensor([n for _, _, n in plan], dtype=torch.int64, device=d.device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    plan = [(k, g, n) for (k, g, _), n in zip(plan, sizes.tolist(), strict=True)]
    times = [_replay_once(plan, d) for _ in range(REPLAYS + 1)]
    return reduce_scalar(statistics.median(times[1:]), "max")


COMPUTE_REPEATS = 5  # compute-only steps timed (the median counts), after one untimed


def compute_model(config: Config, device: torch.device) -> torch.nn.Module:
    """A model that computes what ``config``'s does, block for block, holding one block's weights:
    every layer is the same :class:`Block` (the blocks all have one shape), with the embedding, final
    norm and output of the real model, and its activation checkpointing and compilation.

    The forward and backward run the same matmuls on the same activations as the real model's (every
    layer keeps its own activations); the gradients of the shared block add up over the layers, an
    element-wise add per layer that a model of separate blocks does not do. What it does not need is
    a second whole copy of the weights beside the live model's: under FSDP that copy would not fit
    where the sharded model does."""
    from dtlab.models.llama import build_model
    from dtlab.parallel.apply import apply_ac, apply_compile

    layers = model_args(config.model).n_layers
    model = build_model(config.model.model_copy(update={"n_layers": 1}))  # on the meta device
    block = model.layers["0"]
    for i in range(1, layers):
        model.layers[str(i)] = block
    model.to_empty(device=device)
    model.init_weights()
    apply_ac(model, config.train.activation_checkpointing)
    if config.train.compile:
        apply_compile(model)
    return model


def _compute_only(config: Config, d: DistInfo, tr: Training) -> float | None:
    """The step without a collective, timed on every rank at once (the longest median counts): this
    rank's forward and backward over its micro-batches on the model's computation alone
    (:func:`compute_model`: no wrapper, the same activation checkpointing), and a fused AdamW step over
    as many elements as the rank's optimizer holds (all of them under DDP, its shard under FSDP)."""
    if not dist.is_initialized() or d.dims.tp_enabled or d.dims.pp_enabled:
        return None
    t = config.train
    model = compute_model(config, d.device)
    held = sum(
        _local_bytes(p) // p.element_size() for g in tr.optimizer.param_groups for p in g["params"]
    )
    flat = torch.nn.Parameter(torch.zeros(max(held, 1), device=d.device))
    flat.grad = torch.zeros_like(flat)
    optimizer = torch.optim.AdamW([flat], fused=d.device.type in ("cpu", "cuda"))
    micro_batches = [(x.to(d.device), y.to(d.device)) for x, y in tr.loader.build_step(0)]
    times = []
    for _ in range(COMPUTE_REPEATS + 1):
        dist.barrier()
        with timed(d.device) as clock:
            for x, y in micro_batches:
                loss = forward_loss(model, x, y, t.precision, d.device, t.compile)
                (loss / len(micro_batches)).backward()
            optimizer.step()
            model.zero_grad(set_to_none=True)
        times.append(clock.seconds)
    return reduce_scalar(statistics.median(times[1:]), "max")


def _overlap_figures(
    step_time: float, compute_time: float | None, comm_time: float | None
) -> dict[str, Any]:
    """How much of the step's communication hid behind its computation: the compute-only step plus
    the collectives replayed alone, less the real step, as a fraction of the collectives' time (0:
    none hidden, or communication slowed the computation down; 1: all of it).

    Each part alone is a baseline only while it is no longer than the whole step it was taken from;
    a part that took longer was disturbed (another load on the machine, or a replay that is not what
    the step did): then no fraction, and ``overlap_disturbed`` says which part and by how much."""
    overlap, disturbed = None, None
    if compute_time is not None and comm_time:
        longer = [
            f"the {what} ({t:.3f} s)"
            for what, t in (("compute-only step", compute_time), ("collectives alone", comm_time))
            if t > step_time
        ]
        if longer:
            disturbed = (
                f"{' and '.join(longer)} took longer than the whole step ({step_time:.3f} s): "
                "not a baseline, no overlap computed"
            )
        else:
            overlap = max(0.0, (compute_time + comm_time - step_time) / comm_time)
    return {
        "compute_time_s": compute_time,
        "overlap_fraction": overlap,
        "overlap_disturbed": disturbed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.bench.worker", description=__doc__)
    add_config_args(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--nproc", type=positive_int, default=1)
    p.add_argument("--warmup", type=non_negative_int, default=2)
    p.add_argument("--profile", type=Path, default=None)
    p.add_argument(
        "--peak-flops", type=positive_float, default=None, help="the bench's peak (FLOP/s)"
    )
    p.add_argument("--peak-source", default="measured", help="where --peak-flops comes from")
    p.add_argument(
        "--timing-only", action="store_true", help="time the steps only (no memory or bytes)"
    )
    args = parse_config_args(p, argv)
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
        given = None if args.peak_flops is None else (args.peak_flops, args.peak_source)
        row = bench(config, args.warmup, args.profile, given, args.timing_only)
    except DtlabError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if row is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    code = run_command(main)
    if is_worker_env():
        from dtlab.runtime.status import leave_worker

        leave_worker(code)  # see there: the interpreter's teardown can abort a finished worker
    raise SystemExit(code)
