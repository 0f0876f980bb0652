"""The context-parallel ring's blocks as a CUDA GPU runs them, for ``dtlab plan --check`` of a GPU on a
host without one: the real ring (:mod:`dtlab.parallel.context`) picks the kernel a GPU would
(:func:`dtlab.parallel.context.ring_kernel`: flash in fp16/bf16, the memory-efficient kernel in fp32
or for a block a document boundary cuts), and each kernel call makes, on fake tensors, what that
kernel allocates on the GPU: its outputs in its layout and the workspace it holds while it runs.

What each kernel allocates, from PyTorch's sources (``aten/src/ATen/native/transformers/cuda``:
``attention.cu``, ``attention_backward.cu``, ``flash_attn/flash_api.cpp``, ``mem_eff_attention``):

- flash forward: the output [B, T, H, D] (returned as a [B, H, T, D] view) and the log-sum-exp
  [B, H, T] float32, and its random state (three uint64 on the GPU). Not counted: the split-KV
  accumulators it adds while it runs when batch x heads x query blocks of 64 are fewer than
  1.6 x the GPU's multiprocessors (short chunks and few heads; a chunk of 2,048 tokens with 8
  heads of one sample is past it), a transient of the forward, not the backward's peak.
- flash backward: the output gradient made contiguous in [B, T, H, D] (a chunk of it is not), the
  output likewise where it is not, the three gradients [B, T, H, D] in the inputs' dtype, the
  softmax's row sums [B, H, T rounded up to 128] and the query gradient's accumulator
  [B, T rounded up to 128, H, D rounded up to 32 (64 past 128)], both float32, freed as it returns.
- memory-efficient forward: the output [B, T, H, D] and the log-sum-exp [B, H, T rounded up to 32]
  float32 (its random state is on the host).
- memory-efficient backward (float32): the output gradient made contiguous, the three gradients,
  the rows' ``delta`` [B, H, T] float32 (made through a float32 product of the output and its
  gradient and that product's row sums, alive together for a moment), then the query gradient's
  accumulators (:func:`dtlab.analysis.attention_workspace.efficient_workspace_bytes`).

Nothing numeric is computed: the check's tensors are fake, and only their sizes, layouts and
lifetimes are measured.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dtlab.analysis.attention_workspace import (
    efficient_workspace_bytes,
    flash_backward_rows,
    round_up,
)
from dtlab.parallel.context import EFFICIENT_LSE_ROWS, _tokens_major, ring_kernel

__all__ = ["ring_as_on"]


def _gradients(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three gradients a kernel's backward returns, each laid out [B, T, H, D] as its input's
    shape and dtype (:func:`dtlab.parallel.context._tokens_major`)."""
    dq, dk, dv = (_tokens_major(x.shape, x.dtype, x.device) for x in (q, k, v))
    return dq, dk, dv


def _no_memory() -> torch.Tensor:
    """A kernel's random state, where it takes no device memory worth counting (a few bytes)."""
    return torch.empty((), dtype=torch.int64, device="meta")


def _cpu_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    """The output [B, T, H, D] (as a [B, H, T, D] view) and log-sum-exp [B, H, T] of the CPU's fused
    kernel, whose output and log-sum-exp a GPU's kernels make alike: called as an op, so that
    selective checkpointing's policy keeps them as it keeps a GPU kernel's."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )[:2]
    return out, lse, _no_memory(), _no_memory()


def _flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, ...]:
    return _cpu_kernel(q, k, v, None, causal, scale)


def _flash_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    tq: int,
    tk: int,
    causal: bool,
    state: tuple[torch.Tensor, ...],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, t, d = q.shape
    copies = [dout.transpose(1, 2).contiguous(), out.transpose(1, 2).contiguous()]
    grads = _gradients(q, k, v)
    rows, width = flash_backward_rows(t, d)
    workspace = [
        q.new_empty((b, h, rows), dtype=torch.float32),  # the softmax's row sums
        q.new_empty((b, rows, h, width), dtype=torch.float32),  # the query gradient's accumulator
    ]
    del copies, workspace
    return grads


def _efficient_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    out, lse, *state = _cpu_kernel(q, k, v, bias, causal, scale)
    rows = round_up(q.shape[2], EFFICIENT_LSE_ROWS)
    if rows != q.shape[2]:  # the kernel's log-sum-exp, its rows padded as it pads them
        lse = torch.cat([lse, lse.new_empty((*lse.shape[:-1], rows - q.shape[2]))], dim=-1)
    return out, lse, *state


def _efficient_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    state: tuple[torch.Tensor, ...],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, t, d = q.shape
    contiguous = dout.transpose(1, 2).contiguous()
    grads = _gradients(q, k, v)
    product = q.new_empty((b, t, h, d), dtype=torch.float32)
    sums = q.new_empty((b, t, h), dtype=torch.float32)
    delta = q.new_empty((b, h, t), dtype=torch.float32)
    del product, sums
    workspace = q.new_empty(efficient_workspace_bytes(b, h, t, d), dtype=torch.uint8)
    del contiguous, delta, workspace
    return grads


@contextmanager
def ring_as_on(device_type: str) -> Iterator[None]:
    """The ring's blocks on a ``device_type`` device's kernels, with what those kernels allocate
    there (see the module's docstring); on a CPU, the ring as it runs."""
    if device_type != "cuda":
        yield
        return
    import dtlab.parallel.context as context

    emulated = {
        "_kernel_of": lambda q, masked: ring_kernel("cuda", q.dtype, masked),
        "_flash_forward": _flash_forward,
        "_flash_backward": _flash_backward,
        "_efficient_forward": _efficient_forward,
        "_efficient_backward": _efficient_backward,
    }
    original = {name: getattr(context, name) for name in emulated}
    for name, function in emulated.items():
        setattr(context, name, function)
    try:
        yield
    finally:
        for name, function in original.items():
            setattr(context, name, function)
