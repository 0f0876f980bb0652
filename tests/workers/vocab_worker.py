"""Two gloo ranks split an embedding over its vocabulary (dtlab.parallel.vocab.VocabParallel): the
output is one process's, replicated or split over the sequence; the weight's gradient is one
process's rows of it, held in a storage of the rank's rows only (not a view of the whole
vocabulary's, as torch's RowwiseParallel leaves it)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from dtlab.config import load_config
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.parallel.vocab import VocabParallel
from dtlab.runtime.status import leave_worker

init_distributed(load_config(overrides=["parallel.strategy=ddp"]))
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))

for vocab in (12, 11):  # even, and uneven (the last rank holds fewer rows)
    for layout in (Replicate(), Shard(1)):
        torch.manual_seed(0)
        whole = nn.Embedding(vocab, 4)
        tokens = torch.randint(0, vocab, (2, 6))
        tokens[0, : vocab // 2] = torch.arange(vocab // 2) * 2  # both ranks' rows looked up
        grad_out = torch.randn(2, 6, 4)
        expected = whole(tokens)
        expected.backward(grad_out)

        split = nn.Embedding(vocab, 4)
        split.load_state_dict(whole.state_dict())
        parallelize_module(split, mesh, VocabParallel(layout))
        weight = split.weight
        assert isinstance(weight, DTensor) and weight.placements == (Shard(0),), weight
        out = split(tokens)
        assert not isinstance(out, DTensor)
        want = expected if layout == Replicate() else expected.chunk(world, dim=1)[rank]
        torch.testing.assert_close(out, want.detach(), rtol=0, atol=0)
        out.backward(grad_out if layout == Replicate() else grad_out.chunk(world, dim=1)[rank])

        grad = weight.grad
        assert isinstance(grad, DTensor) and grad.placements == (Shard(0),), grad
        local = grad.to_local()
        rows = whole.weight.grad.chunk(world, dim=0)[rank]
        torch.testing.assert_close(local, rows, rtol=1e-6, atol=1e-6)
        held = local.untyped_storage().nbytes()
        assert held == rows.numel() * 4, (vocab, rank, held, rows.shape)

destroy_distributed()
leave_worker(0)
