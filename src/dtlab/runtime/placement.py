"""Where a rank's own state lives: a copy of a tensor on a chosen device (or in pinned host memory).

Checkpoints load a rank's per-rank state (compression residuals, DeMo's momenta, DiLoCo's outer state)
into CPU templates; the layers that own that state place it with these before using it.
"""

from __future__ import annotations

import torch


def placed(
    t: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype | None = None,
    pin: bool = False,
) -> torch.Tensor:
    """A new tensor holding ``t``'s values on ``device`` (as ``dtype``, else ``t``'s own), in pinned
    host memory with ``pin`` (``device`` the CPU; pinning needs CUDA). It never shares storage with
    ``t``: a checkpoint loads a rank's own state into CPU templates, and the state must be where its
    hooks use it (the rank's GPU, or pinned host memory they copy from asynchronously), and its own."""
    dtype = dtype or t.dtype
    if pin:
        out = torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=True)
        return out.copy_(t)
    return t.to(device=device, dtype=dtype, copy=True)


def placed_state(
    state: dict[str, torch.Tensor], device: torch.device | None
) -> dict[str, torch.Tensor]:
    """:func:`placed` for every tensor of a flat per-rank state dict (``device`` None: each tensor's
    own)."""
    return {k: placed(v, device if device is not None else v.device) for k, v in state.items()}
