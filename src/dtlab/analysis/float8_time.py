"""What ``train.float8`` does to a step's compute time in ``dtlab plan``: where the float8 GEMMs are
faster than bf16's and where they are not.

Each float8 layer (:func:`dtlab.analysis.float8_plan.float8_layers`) runs three GEMMs a micro-batch
(forward, the input's gradient, the weight's), each ``2 T k n`` FLOPs for ``T`` tokens, ``k`` in and
``n`` out features (split by tensor parallelism). The plan's bf16 step counts them at the device's
achievable bf16 rate; with float8 each takes the longer of

- its FLOPs at the same fraction of the device's float8 peak (its profile's ``peak_tflops["fp8"]``,
  the datasheet's dense figure, :mod:`dtlab.analysis.devices`), and
- its bytes (float8 operands, a bf16 output) at the device's memory bandwidth (its profile's
  ``memory_gbps``): a GEMM too small to be compute-bound gains nothing, and keeps its bf16 time.

The casts torchao runs in eager mode are memory-bound passes: each of a layer's input, weight and
output gradient is cast twice a micro-batch (an amax read, a read and a float8 write: 5 bytes an
element of a bf16 tensor), at the memory bandwidth. Where the device has no float8 GEMM (no float8
peak: an A100, a CPU) or ``train.float8.emulate = on``, the GEMMs run in higher precision: no
speed-up, the casts on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtlab.analysis.devices import DeviceProfile
from dtlab.analysis.float8_plan import float8_block_params, float8_layers, layer_shapes
from dtlab.analysis.moe import moe_blocks
from dtlab.analysis.rates import ACHIEVABLE_FRACTION, achievable_flops
from dtlab.config import Config
from dtlab.dims import ParallelDims

__all__ = ["Float8Time", "float8_bound_share", "float8_time"]

CAST_BYTES = 5  # an amax read (2 bytes), a read (2) and a float8 write (1) per bf16 element
CASTS = 2  # each of input, weight and output gradient is cast twice a micro-batch (tensorwise)
GEMMS = 3  # forward, the input's gradient, the weight's


@dataclass
class Float8Time:
    """One rank's float8 layers in a step: their GEMMs' seconds in bf16 and in float8, the casts',
    and which GEMM shapes gain nothing (memory-bound in float8)."""

    emulated: bool
    why: str  # why emulated, or the float8 peak's source
    layers: int  # float8 layers on the rank
    bf16_s: float = 0.0  # their GEMMs at the achievable bf16 rate, as the bf16 step counts them
    float8_s: float = 0.0  # the same GEMMs in float8 (each no slower than in bf16)
    casts_s: float = 0.0
    memory_bound: list[str] = field(default_factory=list)  # "w2 [T x k x n]" gaining nothing
    peak_tflops: float | None = None
    memory_gbps: float | None = None

    @property
    def saved_s(self) -> float:
        """Seconds the step is shorter by (negative: longer: the casts, emulated or small GEMMs)."""
        return self.bf16_s - self.float8_s - self.casts_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "emulated": self.emulated,
            "why": self.why,
            "layers": self.layers,
            "gemm_bf16_s": self.bf16_s,
            "gemm_float8_s": self.float8_s,
            "casts_s": self.casts_s,
            "saved_s": self.saved_s,
            "memory_bound": list(self.memory_bound),
            "peak_tflops": self.peak_tflops,
            "memory_gbps": self.memory_gbps,
        }


def float8_time(config: Config, dims: ParallelDims, device: DeviceProfile) -> Float8Time | None:
    """The float8 layers' part of one rank's step on ``device`` (see the module); None without
    ``train.float8`` or where the bf16 rate is unknown."""
    f8 = config.train.float8
    if not f8.enabled:
        return None
    rate = achievable_flops(device, config.train.precision)
    if rate != rate:
        return None
    m = config.model
    blocks = (m.n_layers - moe_blocks(m)) // dims.pp, moe_blocks(m) // dims.pp
    micro = config.train.micro_batch_size or max(1, config.train.global_batch_size // dims.dp)
    accum = max(1, config.train.global_batch_size // (micro * dims.dp))
    tokens = micro * config.seq_len // dims.cp
    shapes = layer_shapes(m)
    names = [(n, blocks[0]) for n in float8_layers(m)]
    names += [(n, blocks[1]) for n in float8_layers(m, True) if blocks[1]]
    layers = sum(b for _, b in names)
    bw = device.memory_gbps
    fp8 = device.peak_tflops.get("fp8")
    emulated = f8.emulate == "on" or not fp8 or device.kind != "cuda"
    why = (
        "train.float8.emulate = on"
        if f8.emulate == "on"
        else f"{device.name} has no float8 GEMM"
        if not fp8 or device.kind != "cuda"
        else device.fp8_source
    )
    out = Float8Time(emulated, why, layers, peak_tflops=fp8, memory_gbps=bw)
    fp8_rate = (fp8 or 0.0) * 1e12 * ACHIEVABLE_FRACTION[device.kind]
    for name, n_blocks in names:
        out_f, in_f = shapes[name]
        k, n = (in_f, out_f // dims.tp) if name not in ("wo", "w2") else (in_f // dims.tp, out_f)
        flops = 2.0 * tokens * k * n
        bf16 = flops / rate
        times = GEMMS * n_blocks * accum
        out.bf16_s += bf16 * times
        casts = CASTS * CAST_BYTES * (tokens * k + k * n + tokens * n)
        if bw is not None:
            out.casts_s += casts / (bw * 1e9) * n_blocks * accum
        if emulated:
            out.float8_s += bf16 * times
            continue
        memory = ((tokens * k + k * n) + 2 * tokens * n) / (bw * 1e9) if bw else 0.0
        fast = max(flops / fp8_rate, memory)
        shape = f"{name} [{tokens} x {k} x {n}]"
        if fast >= bf16 and shape not in out.memory_bound:
            out.memory_bound.append(shape)
        out.float8_s += min(fast, bf16) * times
    return out


def float8_bound_share(config: Config, device: DeviceProfile, rate: float) -> float:
    """Of a step's forward and backward FLOPs (:func:`dtlab.analysis.model.flops_per_token`), the
    share the search's lower bound may count as free: the float8 layers' GEMMs at best run at the
    float8 rate, ``1 - rate / fp8 rate`` of their bf16 time saved (0 without float8, without a
    float8 peak, or where ``train.float8.emulate = on``)."""
    f8 = config.train.float8
    fp8 = device.peak_tflops.get("fp8")
    if not f8.enabled or not fp8 or f8.emulate == "on" or device.kind != "cuda" or rate != rate:
        return 0.0
    from dtlab.analysis.model import flops_per_token

    m = config.model
    dense, routed = m.n_layers - moe_blocks(m), moe_blocks(m)
    gemm = 6.0 * (dense * float8_block_params(m) + routed * float8_block_params(m, True))
    saved = 1 - rate / (fp8 * 1e12 * ACHIEVABLE_FRACTION[device.kind])
    return max(0.0, gemm * saved / flops_per_token(m, config.seq_len))
