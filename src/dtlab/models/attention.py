"""Which scaled-dot-product-attention kernel the model's attention runs on, chosen on purpose.

torch 2.13's ``F.scaled_dot_product_attention`` picks the first kernel whose constraints the call
meets (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp; order flash, memory-efficient, math, with
cuDNN first on Hopper/Blackwell when torch prefers it):

- flash (and cuDNN) take fp16/bf16 only (flash on sm80 and newer) and run grouped-query attention
  (fewer key/value heads than query heads, ``enable_gqa=True``) without copying the key/value heads;
- the memory-efficient kernel takes fp32 too (bf16 on sm80 and newer) but has no grouped-query path
  (``check_batch_size_and_num_heads_dense<false>``): given grouped heads it declines;
- math, the fallback, stores the whole B x H x T x T softmax for backward.

So grouped-query attention in fp32 on a GPU would fall to math. Instead the key/value heads are
expanded to the query heads (``repeat_interleave``, exactly what ``enable_gqa`` computes) and the
memory-efficient kernel runs: O(T) memory for a copy of k and v per group. On CPU torch's fused CPU
kernel (``_scaled_dot_product_flash_attention_for_cpu``) takes every float dtype and grouped heads,
so nothing is expanded there.

Nothing here imports the config: the choice is a function of the tensors' device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "KERNELS",
    "AttentionKernel",
    "attend",
    "choose_kernel",
    "cuda_capability",
    "describe_attention",
]

# flash: a fused kernel that takes grouped key/value heads as they are (CUDA flash or cuDNN, torch's
# CPU flash kernel); efficient: the memory-efficient kernel, on key/value heads expanded to the query
# heads; math: the unfused fallback, which keeps the B x H x T x T softmax for backward.
KERNELS = ("flash", "efficient", "math")
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionKernel:
    """The kernel attention runs on and whether the key/value heads are expanded to make it run."""

    name: str  # one of KERNELS
    expand_kv: bool
    why: str

    def describe(self) -> str:
        expanded = ", key/value heads expanded to the query heads" if self.expand_kv else ""
        return f"{self.name}{expanded} ({self.why})"


def choose_kernel(
    device_type: str,
    dtype: torch.dtype,
    gqa: bool,
    capability: tuple[int, int] | None = None,
    masked: bool = False,
) -> AttentionKernel:
    """The attention kernel for tensors of ``dtype`` on a ``device_type`` device, with grouped
    key/value heads (``gqa``) or not; ``capability``: the CUDA device's (major, minor), sm80 assumed
    when None (every GPU in dtlab's device table is sm80 or newer). ``masked``: an explicit mask
    (generation's cached keys), which flash does not take; training's causal attention has none."""
    if device_type == "cpu":
        return AttentionKernel(
            "flash", False, "torch's fused CPU kernel: every dtype, grouped heads"
        )
    if device_type != "cuda":  # meta, mps, ...: torch's own choice, not modelled
        return AttentionKernel("math", False, f"no fused kernel modelled on {device_type}")
    sm80 = (capability or (8, 0)) >= (8, 0)
    if dtype in HALF and sm80 and not masked:
        return AttentionKernel("flash", False, f"{_name(dtype)}: flash/cuDNN take grouped heads")
    if dtype in (torch.float32, torch.float16) or (dtype == torch.bfloat16 and sm80):
        why = f"{_name(dtype)}: " + (
            "flash and cuDNN need fp16/bf16"
            if dtype == torch.float32
            else "flash takes no mask"
            if masked and sm80
            else "no flash before sm80"
        )
        if gqa:  # the memory-efficient kernel has no grouped-query path: give it full heads
            why += "; the memory-efficient kernel has no grouped-query path"
        return AttentionKernel("efficient", gqa, why)
    return AttentionKernel("math", False, f"{_name(dtype)} on sm{_sm(capability)}: no fused kernel")


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def _sm(capability: tuple[int, int] | None) -> str:
    major, minor = capability or (8, 0)
    return f"{major}{minor}"


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of CUDA ``device``; None for any other device, or where torch has no CUDA
    (:func:`choose_kernel` then assumes sm80). (torch.compile folds
    ``get_device_properties`` to a constant, so this is free inside a compiled block.)"""
    if device.type != "cuda" or not torch.cuda.is_available():
        # (A CUDA tensor where torch has no CUDA is a fake one, as dtlab plan --check makes.)
        return None
    props = torch.cuda.get_device_properties(device)
    return props.major, props.minor


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of q [B, Hq, T, D] over k, v [B, Hkv, S, D] (Hkv divides Hq),
    on the kernel :func:`choose_kernel` picks for q's device and dtype."""
    gqa = k.shape[1] != q.shape[1]
    capability = cuda_capability(q.device)
    kernel = choose_kernel(q.device.type, q.dtype, gqa, capability, attn_mask is not None)
    return run_kernel(kernel, q, k, v, is_causal, attn_mask)


def run_kernel(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attend` on the ``kernel`` :func:`choose_kernel` picked: key and value heads expanded
    where it needs them, then torch's fused attention."""
    gqa = k.shape[1] != q.shape[1]
    if kernel.expand_kv:
        # Query head h reads key/value head h // group, as enable_gqa does.
        group = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=gqa
    )


def describe_attention(device: torch.device, dtype: torch.dtype, gqa: bool) -> str:
    """The start-of-run line that says which attention kernel runs on ``device`` and, in fp32 on a
    GPU, whether matmuls use TF32 (dtlab leaves it off: fp32 means fp32, the precision its fp32 MFU
    peak assumes; bf16 is the way to the tensor cores)."""
    kernel = choose_kernel(device.type, dtype, gqa, cuda_capability(device))
    line = f"attention kernel: {kernel.describe()}"
    if device.type == "cuda" and dtype == torch.float32:
        tf32 = torch.backends.cuda.matmul.allow_tf32
        line += "; fp32 matmuls: " + (
            "TF32 on (set outside dtlab: MFU is against the plain fp32 peak)"
            if tf32
            else "full fp32, TF32 off (train.precision=bf16 runs on the tensor cores)"
        )
    return line
