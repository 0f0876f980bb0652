"""A GPU's step time from the step's own kernels: each one at the rate its kind reaches on the device.

The plan's older GPU estimate took a step's FLOPs at 45% of the device's peak. That misses what
decides a step's time besides its GEMMs: eager PyTorch runs every element-wise op (norms, RoPE,
SwiGLU, autocast's casts, the loss's float32 log-softmax over the vocabulary) as a kernel of its
own, bound by the device's memory, and at small micro-batches the host's dispatch of those kernels
is slower than the device runs them. On an H200 (``python -m dtlab.bench.gputruth``,
docs/data/gputruth-h200.json) the element-wise kernels took a third of an eager step of
``llama3.2-1b`` and one micro-batch of 2,048 tokens was bound by the host, not the GPU.

:func:`step_census` counts what one micro-batch's forward and backward dispatch, on fake tensors of
the model as training builds it (its activation checkpointing applied, autocast as
``train.precision`` runs it): every GEMM's FLOPs, attention's calls, the bytes every other kernel
reads and writes, and the aten ops dispatched. :func:`roofline_seconds` prices them on a device:

- GEMMs at ``GEMM_FRACTION`` of the device's dense peak (measured on an H200: the median of the
  1B and 3B models' GEMM shapes, 610-782 TFLOP/s against a 989.4 datasheet peak);
- attention at ``attention_fraction`` of the peak, the FLOPs the plan counts for it (12 x the
  query width x the sequence a token, causal or not: measured flash attention on the H200, by head
  dimension);
- every other kernel at its bytes over ``MEMORY_FRACTION`` of the device's memory bandwidth (the
  H200's measured device-to-device copy over its datasheet), and the optimizer's fused AdamW
  step (28 bytes a parameter: parameter, gradient, two moments read; parameter and moments
  written) at ``OPTIMIZER_FRACTION`` of it;
- ``KERNEL_S`` more on the device for each kernel (the gap between two kernels run back to back);
- the host: ``HOST_OP_S`` for every aten op dispatched (and ``SAC_OP_S`` more for each op that
  selective checkpointing's policy sees), the step taking the longer of the host's and the device's
  times (the device runs behind the host, asynchronously).

Each fraction is a measurement of one H200 (driver 580.159.04, torch 2.11.0+cu130) and is taken as
the same fraction of any other GPU's datasheet figures. The host's two per-op costs and the gap
between kernels were each fitted to one run of that H200's grid (``llama3.2-1b``: one sample with
no checkpointing and with selective, 8 samples with none); the other runs were not used to set
any figure (docs/planning.md, "The plan against real runs on a GPU").

Dense models only (an MoE's routing reads token counts back, which fake tensors cannot give), without
float8 layers, masked attention or context parallelism: :func:`supported` says which. A compiled step (``train.compile``)
is counted by :mod:`dtlab.analysis.roofline_compiled`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtlab.analysis.activations import attention_widths
from dtlab.config import Config, ModelConfig
from dtlab.models.args import ModelArgs

__all__ = [
    "ATTENTION_FRACTION",
    "GEMM_FRACTION",
    "HOST_OP_S",
    "KERNEL_S",
    "MEMORY_FRACTION",
    "OPTIMIZER_FRACTION",
    "SAC_OP_S",
    "Census",
    "RooflineTime",
    "attention_fraction",
    "roofline_seconds",
    "step_census",
    "supported",
]

# Measured on one H200 (docs/data/gputruth-h200.json), each as a fraction of its datasheet figure
# (989.4 TFLOP/s bf16 dense, 4,800 GB/s):
# the median of 30 bf16 GEMMs at the 1B and 3B models' shapes (m = 2,048 to 16,384 tokens):
# 674.4 TFLOP/s (the 8192^3 GEMM: 789.0).
GEMM_FRACTION = 674.4 / 989.4
# A 2 GiB device-to-device copy: 4,261.9 GB/s (read and write counted).
MEMORY_FRACTION = 4261.9 / 4800
# torch's fused AdamW over 1,235,814,400 float32 parameters: 12.30 ms, 28 bytes a parameter.
OPTIMIZER_FRACTION = 28 * 1_235_814_400 / 12.295e-3 / 4800e9
_ADAMW_BYTES = (
    28  # a float32 parameter's step: parameter, gradient and two moments read, three written
)
# Flash attention's forward and backward at 8 samples of 2,048 tokens, against the 12 x query width
# x sequence FLOPs a token the plan counts: head dimension 64 (llama3.2-1b, 32 heads) 541 TFLOP/s,
# 128 (llama3.2-3b, 24 heads) 692 TFLOP/s.
ATTENTION_FRACTION = {64: 541.4 / 989.4, 128: 692.2 / 989.4}
# The device's time between two kernels it runs back to back (the next one's launch and ramp, the
# last one's tail), fitted to the H200's one eager run of the most kernels' work not bound by the
# host (llama3.2-1b, 8 samples, no checkpointing: 343.3 ms measured, 332.5 ms of kernels' work
# modelled without it, 2,374 kernels).
KERNEL_S = (343.3e-3 - 332.5e-3) / 2374
# The host's time per aten op dispatched in an eager step, and more per op selective
# checkpointing's policy sees: fitted to the H200 host's 1B runs of one sample (77.6 ms with no
# checkpointing; 222.5 ms selective), where the device's part is under the host's.
HOST_OP_S = 77.6e-3 / 4233  # 4,233 ops dispatched
SAC_OP_S = (222.5e-3 - 6761 * HOST_OP_S) / 4992  # 6,761 ops, 4,992 seen by the policy

_GEMMS = ("mm", "addmm", "bmm")
_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def attention_fraction(head_dim: int) -> float:
    """The fraction of a device's peak its flash attention reaches at ``head_dim``: the H200's
    measured figure for the nearest head dimension measured (64, 128)."""
    nearest = min(ATTENTION_FRACTION, key=lambda d: (abs(d - head_dim), d))
    return ATTENTION_FRACTION[nearest]


def supported(config: Config) -> str | None:
    """Why the roofline cannot time ``config``'s step (None: it can)."""
    if config.model.moe.experts:
        return "an MoE's routing is data-dependent"
    if config.train.float8.enabled:
        return "float8 layers are timed by dtlab.analysis.float8_time"
    if config.data.document_mask or config.model.sliding_window:
        return "masked attention runs another kernel"
    if config.parallel.cp > 1:
        return "context parallelism's attention (a ring of blocks or all-to-alls) is not counted"
    return None


@dataclass(frozen=True)
class Census:
    """What one micro-batch's forward and backward dispatch, as linear functions of its tokens:
    ``*_token`` per token, ``*_pass`` per micro-batch whatever its tokens (weight casts, the
    optimizer aside)."""

    gemm_flops_token: float
    gemm_flops_pass: float
    bytes_token: float  # read and written by kernels other than GEMMs and attention
    bytes_pass: float
    attention_calls: int  # attention's forward calls (a recomputed block's twice)
    ops: int  # aten ops dispatched (the host's work), views included
    kernels: int  # of them, those that launch a kernel on the device
    sac_ops: int  # of them, those selective checkpointing's policy sees


class _Count(TorchDispatchMode):
    """Counts the kernels of what runs under it: GEMM FLOPs, attention calls, other kernels' bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.gemm = 0.0
        self.bytes = 0.0
        self.attention = 0
        self.ops = 0
        self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace != "aten":
            return out
        self.ops += 1
        if name in _GEMMS:
            a, b = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
            self.gemm += 2.0 * a.numel() * b.shape[-1]
            self.kernels += 1
        elif name in _ATTENTION_OPS:
            self.attention += 1
            self.kernels += 1
        elif name.endswith("attention_backward") or name.endswith("_attention_for_cpu_backward"):
            self.kernels += 1  # priced with its forward
        elif not func.is_view:
            tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if tensors:  # a kernel: its inputs read, its outputs written
                ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                self.bytes += sum(t.numel() * t.element_size() for t in ins + tensors)
                self.kernels += 1
        return out


@functools.lru_cache(maxsize=64)
def _trace(args: ModelArgs, tokens: int, precision: str, ac: str) -> tuple[float, ...]:
    """(GEMM FLOPs, bytes, attention calls, ops) of one sample of ``tokens`` through a
    fake model of ``args``: forward, the loss, backward."""
    from dtlab.models.llama import Transformer
    from dtlab.parallel.apply import apply_ac
    from dtlab.train.loss import cross_entropy

    mode = FakeTensorMode()
    with mode:
        model = Transformer(args)
        apply_ac(model, ac)
        x = torch.zeros(1, tokens, dtype=torch.long)
    dtype = _AUTOCAST[precision]
    count = _Count()
    with mode, count:
        if dtype is None:
            logits = model(x)
        else:
            with torch.autocast("cpu", dtype=dtype):
                logits = model(x)
        cross_entropy(logits, x).backward()
    return (count.gemm, count.bytes, count.attention, count.ops, count.kernels)


SHORT, LONG = 64, 128  # the counts are linear in the tokens: any two lengths do


def base_args(model_cfg: ModelConfig, seq_len: int) -> ModelArgs:
    """A one-block model of ``model_cfg``'s shape (its RoPE tables long enough for ``seq_len``)."""
    return dataclasses.replace(
        model_cfg.args(), n_layers=1, max_seq_len=max(LONG, seq_len), rope_scaling=None,
        moe=None, sliding_window=None,
    )  # fmt: skip


def census_parts(
    model_cfg: ModelConfig, precision: str, ac: str, seq_len: int
) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """(a block's, the rest's) counts (GEMM FLOPs, bytes, attention calls, ops) at ``SHORT`` and
    ``LONG`` tokens: a block's the two-block model's less the one-block model's, the rest (the
    embedding, the final norm, the head and the loss) what is left of the one-block model's."""
    if precision not in _AUTOCAST:
        raise ValueError(f"precision {precision!r}: one of {sorted(_AUTOCAST)}")
    one = base_args(model_cfg, seq_len)
    two = dataclasses.replace(one, n_layers=2)
    block, rest = {}, {}
    for t in (SHORT, LONG):
        a, b = _trace(one, t, precision, ac), _trace(two, t, precision, ac)
        block[t] = [y - x for x, y in zip(a, b, strict=True)]
        rest[t] = [x - d for x, d in zip(a, block[t], strict=True)]
    return block, rest


def compose(
    block: dict[int, list[float]], rest: dict[int, list[float]], n_layers: int, sac_ops: int = 0
) -> Census:
    """The census of ``n_layers`` blocks and the rest, from their counts at ``SHORT`` and ``LONG``."""
    whole = {
        t: [r + n_layers * b for r, b in zip(rest[t], block[t], strict=True)] for t in (SHORT, LONG)
    }
    s, w = whole[SHORT], whole[LONG]
    slope = [(y - x) / (LONG - SHORT) for x, y in zip(s, w, strict=True)]
    return Census(
        gemm_flops_token=slope[0],
        gemm_flops_pass=w[0] - slope[0] * LONG,
        bytes_token=slope[1],
        bytes_pass=w[1] - slope[1] * LONG,
        attention_calls=round(w[2]),
        ops=round(w[3]),
        kernels=round(w[4]),
        sac_ops=sac_ops,
    )


def step_census(model_cfg: ModelConfig, precision: str, ac: str, seq_len: int) -> Census:
    """The census of one eager micro-batch of ``model_cfg`` under ``precision`` (autocast on float32
    parameters for bf16/fp16, as single-process, DDP and FSDP's float32 training run) and activation
    checkpointing ``ac``, at ``seq_len`` tokens a sample.

    Traced on fake tensors (no memory, no device) as one- and two-block models at two sequence
    lengths (:func:`census_parts`); each count is linear in the tokens (attention's quadratic part
    is priced from its calls, not its bytes). About a second; memoised."""
    block, rest = census_parts(model_cfg, precision, ac, seq_len)
    sac = 0
    if ac == "selective":
        # The policy sees each op of a block's forward, and again as backward recomputes it: twice
        # the ops a full checkpoint's recompute adds.
        full = step_census(model_cfg, precision, "full", seq_len)
        none = step_census(model_cfg, precision, "none", seq_len)
        sac = 2 * (full.ops - none.ops)
    return compose(block, rest, model_cfg.args().n_layers, sac)


@dataclass(frozen=True)
class RooflineTime:
    """A step's time on a device from its kernels (seconds): the device's parts and the host's."""

    gemm_s: float
    attention_s: float
    memory_s: float  # the other kernels' bytes
    gaps_s: float  # between the kernels
    optimizer_s: float
    host_s: float

    @property
    def device_s(self) -> float:
        """The device's kernels and the gaps between them."""
        return self.gemm_s + self.attention_s + self.memory_s + self.gaps_s + self.optimizer_s

    @property
    def step_s(self) -> float:
        """The longer of the host's dispatch and the device's kernels."""
        return max(self.device_s, self.host_s)


def roofline_seconds(
    c: Census,
    model_cfg: ModelConfig,
    seq_len: int,
    micro_batch: float,
    micro_batches: int,
    params: float,
    peak_tflops: float,
    memory_gbps: float,
) -> RooflineTime:
    """The roofline time of a step of ``micro_batches`` micro-batches (each as census ``c`` counts
    it) of ``micro_batch`` samples of ``seq_len`` tokens and one optimizer step over ``params``
    float32 parameters, on a device of ``peak_tflops`` (dense, at the census's precision) and
    ``memory_gbps`` (its datasheet figures: the module's fractions of them are what its kernels
    reach)."""
    tokens = micro_batch * seq_len
    gemm_rate = peak_tflops * 1e12 * GEMM_FRACTION
    bandwidth = memory_gbps * 1e9 * MEMORY_FRACTION
    args = model_cfg.args()
    q_width = attention_widths(model_cfg)[0]
    attention_rate = peak_tflops * 1e12 * attention_fraction(q_width // args.n_heads)
    # A forward call with its backward: 12 x query width x sequence FLOPs a token (the plan's
    # count); a recomputed forward (a full checkpoint's second one) a third of that.
    per_call = 12.0 * q_width * seq_len * tokens
    recomputed = max(0, c.attention_calls - args.n_layers)
    attention = (c.attention_calls - recomputed * 2 / 3) * per_call / attention_rate
    per_pass_gemm = (c.gemm_flops_token * tokens + c.gemm_flops_pass) / gemm_rate
    per_pass_bytes = (c.bytes_token * tokens + c.bytes_pass) / bandwidth
    optimizer = _ADAMW_BYTES * params / (memory_gbps * 1e9 * OPTIMIZER_FRACTION)
    host = micro_batches * (c.ops * HOST_OP_S + c.sac_ops * SAC_OP_S)
    return RooflineTime(
        gemm_s=micro_batches * per_pass_gemm,
        attention_s=micro_batches * attention,
        memory_s=micro_batches * per_pass_bytes,
        gaps_s=micro_batches * c.kernels * KERNEL_S,
        optimizer_s=optimizer,
        host_s=host,
    )
