"""Run under torchrun: the optimizer state of one layout (argv[1:] are --set items) exists right
after the training is built, holds the plan's bytes, has the form the optimizer's first step gives a
lazily initialised copy (DTensors of the same placements for sharded parameters), and trains the
same bits as that copy over a few steps. Exits non-zero on the first difference."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtlab.analysis.model import plan_step
from dtlab.config import load_config
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.runtime.status import leave_worker
from dtlab.train.loop import build_training
from dtlab.train.optim import state_bytes
from dtlab.train.optimizer_step import train_step

config = load_config(
    overrides=[
        "model.preset=debug", "data.source=synthetic", "data.seq_len=32", "train.global_batch_size=8",
        "train.grad_clip=0.05", *sys.argv[1:],
    ]
)  # fmt: skip
d = init_distributed(config)
eager, lazy = build_training(config, d), build_training(config, d)
held = state_bytes(eager.optimizer)
predicted = plan_step(config, d.world_size).optimizer_bytes
assert held == predicted, f"rank {d.rank}: {held} bytes of optimizer state, the plan {predicted}"
assert all(eager.optimizer.state[p] for g in eager.optimizer.param_groups for p in g["params"])
lazy.optimizer.state.clear()  # as torch leaves it: created by the first step()


def form(t: torch.Tensor) -> tuple[object, ...]:
    placements = tuple(t.placements) if isinstance(t, DTensor) else None
    local = t.to_local() if isinstance(t, DTensor) else t
    return (type(t), placements, t.dtype, t.device, tuple(t.shape), local.stride())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


for step in range(3):
    batch = eager.loader.build_step(step)
    m = [
        train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, batch, config, d.device)
        for tr in (eager, lazy)
    ]
    assert m[0]["loss"] == m[1]["loss"] and m[0]["grad_norm"] == m[1]["grad_norm"], (step, m)
    pairs = zip(eager.pm.optimized.parameters(), lazy.pm.optimized.parameters(), strict=True)
    for a, b in pairs:
        assert torch.equal(bits(a), bits(b)), f"step {step + 1}: parameters differ"
        sa, sb = eager.optimizer.state[a], lazy.optimizer.state[b]
        assert sa.keys() == sb.keys(), (sa.keys(), sb.keys())
        for k in sa:
            assert form(sa[k]) == form(sb[k]), (k, form(sa[k]), form(sb[k]))
            assert torch.equal(bits(sa[k]), bits(sb[k])), f"step {step + 1}: {k} differs"
for tr in (eager, lazy):
    tr.loader.close()
dist.barrier()
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
