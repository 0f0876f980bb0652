"""Run under torchrun (gloo): context-parallel attention over the ranks equals one process's causal
attention of the whole sequence, its output and the gradients of the queries, keys and values, each
rank's zigzag part of them. argv[1]: the dtype (float64 or float32); argv[2]: the method (ring or
alltoall); argv[3]: the key/value heads (grouped-query attention below the 4 query heads); argv[4] (optional):
the device, cpu (gloo, the default) or cuda (NCCL, one GPU a rank: the ring's blocks on the GPU's
kernels; bfloat16 allowed). Exits non-zero on a difference."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.parallel.context import (
    alltoall_attention,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)

device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cpu")
if device.type == "cuda":
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank, cp = dist.get_rank(), dist.get_world_size()
dtype = getattr(torch, sys.argv[1])
attention = {"ring": ring_attention, "alltoall": alltoall_attention}[sys.argv[2]]
# A GPU's kernels sum in another order than one process's attention; bf16 keeps 8 bits.
tol = {torch.float64: 1e-10, torch.float32: 2e-5 if device.type == "cpu" else 1e-4}.get(dtype, 5e-2)
B, H, KV, S, D = 2, 4, int(sys.argv[3]), 8 * cp, 16
g = torch.Generator().manual_seed(0)
q, dout = (torch.randn(B, H, S, D, generator=g, dtype=dtype).to(device) for _ in range(2))
k, v = (torch.randn(B, KV, S, D, generator=g, dtype=dtype).to(device) for _ in range(2))
# One process, the whole sequence.
whole = [t.clone().requires_grad_() for t in (q, k, v)]
ref = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=KV != H)
ref.backward(dout)
# This rank's zigzag part, through the ring.
mine = [shard_sequence(t, cp, rank, dim=2).detach().requires_grad_() for t in (q, k, v)]
out = attention(*mine, dist.group.WORLD)
out.backward(shard_sequence(dout, cp, rank, dim=2))
checks = {"out": (out, ref)}
checks.update({f"d{n}": (m.grad, w.grad) for n, m, w in zip("qkv", mine, whole, strict=True)})
for name, (got, want) in checks.items():
    want = shard_sequence(want, cp, rank, dim=2)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"rank {rank}: {name} differs by {err}"
# The parts make the whole again.
parts = [torch.empty_like(out) for _ in range(cp)]
dist.all_gather(parts, out.detach().contiguous())
assert torch.allclose(unshard_sequence(parts, dim=2).float(), ref.detach().float(), atol=tol)
dist.destroy_process_group()
