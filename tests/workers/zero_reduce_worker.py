"""Run under torchrun (gloo): ZeRO-1's two reduce-scatters, NCCL's ``reduce_scatter_tensor`` (which
gloo also runs, as an all-reduce) and gloo's all-to-all plus a local sum, hand every rank the same
rows of the averaged gradients. Exits non-zero on a difference."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dtlab.parallel.zero import OptimizerShards, reduce_method

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
assert reduce_method(dist.get_backend()) == "all_to_all"
shapes = [(5, 3), (8,), (3, 4), (1, 7)]  # rows fewer than ranks, uneven rows
got = {}
for method in ("all_to_all", "reduce_scatter"):
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    shards = OptimizerShards([(f"p{i}", p) for i, p in enumerate(params)], mesh)
    shards.method = method
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(100 * rank + i)
        p.grad = torch.randn(p.shape, generator=g)
    shards.reduce_scatter()
    got[method] = [s.grad.to_local().clone() for s in shards.shards]
for i, (a, b) in enumerate(zip(got["all_to_all"], got["reduce_scatter"], strict=True)):
    assert torch.allclose(a, b, atol=1e-6), f"rank {rank} p{i}: {a} != {b}"
    # The average of the ranks' gradients, this rank's rows.
    whole = (
        sum(
            torch.randn(shapes[i], generator=torch.Generator().manual_seed(100 * r + i))
            for r in range(world)
        )
        / world
    )
    start = shards.pieces[i].start
    assert torch.allclose(b, whole[start : start + b.shape[0]], atol=1e-6), f"rank {rank} p{i}"
dist.destroy_process_group()
