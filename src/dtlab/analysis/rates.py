"""The rates the plan's step time is made of: the FLOP/s a step reaches on a device, and the idle
fraction of a pipeline rank's step (used by the plan and by its search)."""

from __future__ import annotations

from dtlab.analysis.devices import DeviceProfile
from dtlab.analysis.model import predicted_bubble
from dtlab.config import Config
from dtlab.dims import ParallelDims

__all__ = ["ACHIEVABLE_FRACTION", "achievable_flops", "pipeline_bubble"]

# Assumptions of the estimate (the plan prints them as such). What fraction of a device's peak a
# well-tuned training step reaches on a GPU; the CPU profile is already a measured GEMM rate.
ACHIEVABLE_FRACTION = {"cuda": 0.45, "cpu": 1.0}


def achievable_flops(device: DeviceProfile, precision: str) -> float:
    """FLOP/s a training step reaches on ``device`` at ``precision``: ``ACHIEVABLE_FRACTION`` of its
    peak; NaN when the peak is unknown."""
    peak = device.peak_tflops.get(precision)
    kind = device.kind
    return peak * 1e12 * ACHIEVABLE_FRACTION[kind] if peak else float("nan")


def pipeline_bubble(config: Config, dims: ParallelDims) -> float:
    """The idle fraction of a pipeline rank's step the plan assumes (0 without pipeline parallelism)."""
    if not dims.pp_enabled:
        return 0.0
    from dtlab.config import pipeline_microbatches

    p = config.parallel
    m = pipeline_microbatches(config, dims.dp)
    bubble = predicted_bubble(p.pp_schedule, dims.pp, m, p.stages_per_rank)
    return bubble if bubble is not None else (dims.pp - 1) / (m + dims.pp - 1)
