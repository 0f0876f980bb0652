"""Autocast and dynamic loss scaling for fp16 that is correct when gradients are sharded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtlab.analysis.devices import measure_matmul_tflops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast to bf16/fp16 for the forward pass; nothing for fp32. Parameters and optimizer state
    stay fp32 in every case."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def gemm_gflops(dtype: torch.dtype, size: int = 256, repeats: int = 3) -> float:
    """GFLOP/s of the fastest of ``repeats`` size^3 CPU matmuls at ``dtype`` (after one warm-up)."""
    return 1e3 * measure_matmul_tflops(dtype, torch.device("cpu"), size, repeats, best=True)


def half_precision_advice(precision: str, fp32_gflops: float, half_gflops: float) -> str | None:
    """A warning when a half-precision run's matmuls are slower than fp32 on this CPU, else None.

    CPUs without native bf16/fp16 arithmetic (e.g. AVX2 only: no AVX512-BF16, AMX or ARM bf16)
    run half-precision matmuls through a slow conversion path, tens to thousands of times slower
    than fp32; autocast then makes every step slower, not faster.
    """
    if precision == "fp32" or half_gflops >= fp32_gflops:
        return None
    return (
        f"train.precision = {precision!r} is slower than fp32 on this CPU: a matmul runs at "
        f"{half_gflops:,.1f} GFLOP/s in {precision}, {fp32_gflops:,.1f} GFLOP/s in fp32 "
        f"({fp32_gflops / max(half_gflops, 1e-9):,.0f}x slower: no fast {precision} matmul on this "
        "CPU); train.precision=fp32 trains faster here"
    )


def check_cpu_half_precision(
    precision: str, rate: Callable[[torch.dtype], float] = gemm_gflops
) -> str | None:
    """The advice for ``precision`` from ``rate`` (GFLOP/s of a matmul at a dtype; by default a small
    matmul measured on this CPU) in fp32 and in ``precision``. Nothing is measured for fp32."""
    if precision == "fp32":
        return None
    return half_precision_advice(precision, rate(torch.float32), rate(DTYPES[precision]))


class LossScaler:
    """Dynamic loss scaling for fp16.

    ``torch.amp.GradScaler`` checks for inf/NaN in the gradients this rank holds. Under FSDP each rank
    holds only a shard, so one rank could step while another skips; here each rank's overflow flag is
    summed over all ranks in the step's reduction (:func:`dtlab.train.loop.reduce_step`), so all of
    them skip or step together.
    """

    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 200,
    ) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = (
            growth_factor,
            backoff_factor,
            growth_interval,
        )
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(
        self, parameters: Iterable[nn.Parameter], device: torch.device | None = None
    ) -> torch.Tensor:
        """Divide the gradients by the scale; returns this rank's overflow flag (1.0 when a gradient
        it holds is inf/NaN) as a tensor on ``device`` (the gradients'), for the step's reduction to
        agree on over all ranks. Made there, not moved there: a copy to a GPU would sync the host."""
        found = torch.zeros((), device=device)
        if not self.enabled:
            return found
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in parameters
            if p.grad is not None
        ]
        # One fused call per device and dtype (GradScaler's op: scale, and flag a non-finite value),
        # not three kernels per parameter.
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (where, _), same in groups.items():
            flag = torch.zeros(1, device=where)
            inv = torch.full((1,), 1.0 / self.scale, device=where)
            torch._amp_foreach_non_finite_check_and_unscale_(same, flag, inv)
            found = torch.maximum(found, flag.reshape(()).to(found.device))
        return found

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps."""
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
