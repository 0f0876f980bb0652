"""dtlab's dispatch modes leave torch.compile intact: a compiled module first called under one
(activations measured, collectives or host syncs counted before training) still compiles after."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dtlab.bench.memory import ForwardAllocations
from dtlab.metrics.comm import CommCounter
from dtlab.metrics.syncs import HostSyncCounter


class _Plain(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


MODES: dict[str, Callable[[], TorchDispatchMode]] = {
    "plain torch mode": _Plain,
    "ForwardAllocations": ForwardAllocations,
    "CommCounter": CommCounter,
    "HostSyncCounter": lambda: HostSyncCounter("cpu"),
}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).sin()


@pytest.mark.parametrize("mode", list(MODES))
def test_a_compiled_block_first_run_under_a_mode_compiles_after_it(mode: str) -> None:
    graphs: list[object] = []

    def backend(gm: torch.fx.GraphModule, example: object) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    block = _Block()
    block.compile(backend=backend)
    x = torch.randn(4, 8)
    with MODES[mode]():
        under = block(x)
    block(x)
    torch.testing.assert_close(under, block(x))
    if mode == "plain torch mode":
        # The reason for dtlab's modes: torch skips the frame for good.
        assert graphs == []
    else:
        assert len(graphs) == 1, mode


def test_collectives_in_compiled_code_are_counted_with_compile_on() -> None:
    """run.comm_bytes leaves train.compile on: under the collective counter a compiled function
    compiles (while the mode is active) and the collective its compiled code runs is counted, to
    the byte (torch's fake process group of 2 ranks: the collective runs nowhere)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore

    graphs: list[object] = []

    def backend(gm: torch.fx.GraphModule, example: object) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        group = dist.group.WORLD
        assert group is not None

        @torch.compile(backend=backend)
        def step(x: torch.Tensor) -> torch.Tensor:
            return funcol.all_reduce(x.sin(), "sum", group).cos()

        with CommCounter() as counter:
            step(torch.randn(16))
            step(torch.randn(16))
        assert len(graphs) == 1  # compiled under the mode, once
        assert counter.counts["all_reduce"] == 2 and counter.bytes["all_reduce"] == 2 * 16 * 4
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
