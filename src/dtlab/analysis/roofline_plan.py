"""A layout's compute time on a GPU from its kernels (:mod:`dtlab.analysis.roofline`), as the plan
counts compute: one rank's forward and backward of its micro-batches, its optimizer step, and what
activation checkpointing runs again.

The kernels are counted on the whole model; a rank's share of them is its share of the model's
FLOPs (its pipeline stage's blocks and head, split by tensor parallelism: :func:`rank_share`) and of
the parameters its optimizer steps. The host dispatches every op of its stage whatever tensor
parallelism splits, so its time is the stage's share before the split. A pipeline rank idles in its
bubble on top (``idle``)."""

from __future__ import annotations

from dtlab.analysis.compiled_memory import blocks_measured
from dtlab.analysis.devices import DeviceProfile
from dtlab.analysis.probe import rank_share
from dtlab.analysis.rates import achievable_flops
from dtlab.analysis.roofline import (
    ATTENTION_FRACTION,
    GEMM_FRACTION,
    RooflineTime,
    roofline_seconds,
    step_census,
    supported,
)
from dtlab.analysis.roofline_compiled import compiled_census
from dtlab.analysis.shapes import ParamShape
from dtlab.analysis.steptime import step_microbatches
from dtlab.config import Config
from dtlab.dims import ParallelDims

__all__ = ["bound_flops", "kernel_seconds", "kernels_time"]


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
    flops_share, params_share = rank_share(config, dims, shapes)
    passes = step_microbatches(config, dims)
    samples = config.train.global_batch_size / dims.dp / passes
    params = sum(s.numel for s in shapes) * params_share
    peak = device.peak_tflops[config.train.precision]
    bandwidth = device.memory_gbps or 0.0  # kernels_time: known

    def seconds(ac: str) -> float:
        census = (compiled_census if config.train.compile else step_census)(
            config.model, config.train.precision, ac, config.seq_len
        )
        t = roofline_seconds(
            census, config.model, config.seq_len, samples, passes, params, peak, bandwidth
        )
        return _rank_seconds(t, flops_share, dims.tp) / (1 - idle)

    compute = seconds("none")
    ac = config.train.activation_checkpointing
    return compute, max(0.0, seconds(ac) - compute) if ac != "none" else 0.0


def _rank_seconds(t: RooflineTime, flops_share: float, tp: int) -> float:
    """The whole model's roofline ``t`` as one rank's: the device's kernels at its share of the
    FLOPs (the optimizer's already at its parameters), the host's at its stage's share."""
    device = (t.device_s - t.optimizer_s) * flops_share + t.optimizer_s
    return max(device, t.host_s * flops_share * tp)


def bound_flops(device: DeviceProfile, precision: str) -> float:
    """The FLOP/s no step of a layout on ``device`` beats, for the search's lower bounds of step
    times: with ``--step-model kernels`` a GPU's GEMM or attention rate, whichever is faster (every
    other kernel only adds time), else the plan's achievable rate."""
    rate = achievable_flops(device, precision)
    if device.step_model != "kernels" or device.kind != "cuda" or rate != rate:
        return rate
    fastest = max(GEMM_FRACTION, *ATTENTION_FRACTION.values())
    return device.peak_tflops[precision] * 1e12 * fastest
