"""A layout's compute time on a GPU from its kernels (:mod:`dtlab.analysis.roofline`), as the plan
counts compute: one rank's forward and backward of its micro-batches, its optimizer step, and what
activation checkpointing runs again.

The kernels are counted on the whole model; a rank's share of them is its share of the model's
FLOPs (its pipeline stage's blocks and head, split by tensor parallelism: :func:`rank_share`) and of
the parameters its optimizer steps. The host dispatches every op of its stage whatever tensor
parallelism splits, so its time is the stage's share before the split. A pipeline rank idles in its
bubble on top (``idle``)."""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.analysis.compiled_memory import blocks_measured
from dtlab.analysis.devices import DeviceProfile
from dtlab.analysis.probe import rank_share
from dtlab.analysis.rates import achievable_flops
from dtlab.analysis.roofline import (
    ATTENTION_FRACTION,
    GEMM_FRACTION,
    roofline_seconds,
    step_census,
    supported,
)
from dtlab.analysis.roofline_compiled import compiled_census
from dtlab.analysis.shapes import ParamShape
from dtlab.analysis.steptime import step_microbatches
from dtlab.config import Config
from dtlab.dims import ParallelDims

__all__ = ["KERNELS_CHECKED", "bound_flops", "kernel_bound", "kernel_seconds", "kernels_time"]

# What the kernels' model has been checked against (docs/planning.md, "The kernels' model").
KERNELS_CHECKED = (
    "compute checked against 24 single-GPU steps of llama3.2-1b and -3b on an H200 (bf16, eager and "
    "compiled, 1-8 samples, each checkpointing mode): mean absolute error 2.0%, worst -9.8%; "
    "communication and layouts of several GPUs not checked against a GPU"
)


def kernels_time(config: Config, device: DeviceProfile) -> bool:
    """Whether the kernels' roofline can time ``config`` on ``device``: a GPU with a known peak at
    the config's precision and memory bandwidth, a config :func:`supported` takes."""
    return (
        device.kind == "cuda"
        and bool(device.peak_tflops.get(config.train.precision))
        and bool(device.memory_gbps)
        and supported(config) is None
        # A compiled step's census compiles its blocks, which resets torch.compile's caches.
        and (not config.train.compile or blocks_measured())
    )


def kernel_seconds(
    config: Config,
    dims: ParallelDims,
    device: DeviceProfile,
    shapes: list[ParamShape],
    idle: float,
) -> tuple[float, float]:
    """(compute, recompute) seconds of one rank's step on ``device``: its kernels' roofline without
    activation checkpointing, and what the config's checkpointing adds to it."""
    rank = _Rank.of(config, dims, device, shapes, step_microbatches(config, dims))
    compute = rank.seconds("none", idle)
    ac = config.train.activation_checkpointing
    return compute, max(0.0, rank.seconds(ac, idle) - compute) if ac != "none" else 0.0


def kernel_bound(
    config: Config,
    dims: ParallelDims,
    device: DeviceProfile,
    shapes: list[ParamShape],
    idle: float,
) -> float:
    """A lower bound of :func:`kernel_seconds`'s compute and recompute for ``config`` at any of its
    micro-batch sizes: the device's kernels alone, in the fewest micro-batches (one without a
    pipeline; each micro-batch adds the weights' casts and the kernels' gaps)."""
    passes = step_microbatches(config, dims) if dims.pp_enabled else 1
    rank = _Rank.of(config, dims, device, shapes, passes)
    return rank.seconds(config.train.activation_checkpointing, idle, host=False)


@dataclass(frozen=True)
class _Rank:
    """One rank's share of a step's kernels: its FLOPs' and parameters' shares, its micro-batches."""

    config: Config
    device: DeviceProfile
    flops_share: float
    params: float
    passes: int
    samples: float
    tp: int

    @classmethod
    def of(
        cls,
        config: Config,
        dims: ParallelDims,
        device: DeviceProfile,
        shapes: list[ParamShape],
        passes: int,
    ) -> _Rank:
        flops_share, params_share = rank_share(config, dims, shapes)
        samples = config.train.global_batch_size / dims.dp / passes
        params = sum(s.numel for s in shapes) * params_share
        return cls(config, device, flops_share, params, passes, samples, dims.tp)

    def seconds(self, ac: str, idle: float, host: bool = True) -> float:
        """The rank's step at checkpointing ``ac`` (``host``: the host's dispatch counted)."""
        c, d = self.config, self.device
        census = (compiled_census if c.train.compile else step_census)(
            c.model, c.train.precision, ac, c.seq_len
        )
        t = roofline_seconds(
            census, c.model, c.seq_len, self.samples, self.passes, self.params,
            d.peak_tflops[c.train.precision], d.memory_gbps or 0.0,
        )  # fmt: skip
        device = (t.device_s - t.optimizer_s) * self.flops_share + t.optimizer_s
        # The host dispatches its stage's whole share, whatever tensor parallelism splits.
        busiest = max(device, t.host_s * self.flops_share * self.tp) if host else device
        return busiest / (1 - idle)


def bound_flops(device: DeviceProfile, precision: str) -> float:
    """The FLOP/s no step of a layout on ``device`` beats, for the search's lower bounds of step
    times: with ``--step-model kernels`` a GPU's GEMM or attention rate, whichever is faster (every
    other kernel only adds time), else the plan's achievable rate."""
    rate = achievable_flops(device, precision)
    if device.step_model != "kernels" or device.kind != "cuda" or rate != rate:
        return rate
    fastest = max(GEMM_FRACTION, *ATTENTION_FRACTION.values())
    return device.peak_tflops[precision] * 1e12 * fastest
