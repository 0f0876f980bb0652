"""Run under torchrun (gloo): context-parallel attention within documents over the ranks equals one
process's attention with the document mask (causal, each token within its own document), its output
and the gradients of the queries, keys and values, each rank's zigzag part of them, in float64.
argv[1]: the method (ring or alltoall). Exits non-zero on a difference.

The windows (2 of them, of 8 cp tokens: chunks of 4) have several documents each: boundaries inside
chunks, chunks wholly inside one document, (query chunk, key chunk) blocks no query attends, and
blocks where some queries attend no key."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.models.sequence import document_ids, document_mask
from dtlab.parallel.context import (
    CAUSAL,
    FULL,
    NONE,
    _block,
    _pair,
    alltoall_attention,
    gather_sequence,
    ring_attention,
    shard_sequence,
)

dist.init_process_group("gloo")
rank, cp = dist.get_rank(), dist.get_world_size()
attention = {"ring": ring_attention, "alltoall": alltoall_attention}[sys.argv[1]]
dtype, tol = torch.float64, 1e-10
B, H, KV, S, D = 2, 4, 2, 8 * cp, 16
g = torch.Generator().manual_seed(0)
tokens = torch.randint(1, 50, (B, S), generator=g)
# Separators (token 0) end the documents: window 0 has 4 (5 with cp 4) documents, one of a single
# token; window 1 has 2 (3, the last ending with the window).
tokens[0, [1, 4, 5, *([21] if cp == 4 else [])]] = 0
tokens[1, [5, *([13, 31] if cp == 4 else [])]] = 0
documents = document_ids(tokens, 0)
# The model's forward gathers its tokens over the group: each rank gets the whole windows back.
assert torch.equal(gather_sequence(shard_sequence(tokens, cp, rank), dist.group.WORLD), tokens)

# The blocks the ring meets: skipped, as without a mask, and masked with rows that attend nothing.
docs = documents.chunk(2 * cp, dim=1)
blocks = [(i, j, *_block(i, j, docs)) for i in range(2 * cp) for j in range(i + 1)]
assert any(kind == NONE for *_, kind, _ in blocks), blocks
assert any(_pair(i, j) == FULL and kind == FULL and m is None for i, j, kind, m in blocks)
assert any(kind == CAUSAL and m is None for *_, kind, m in blocks)
assert any(m is not None and not m.any(-1).all() for *_, m in blocks)

q, dout = (torch.randn(B, H, S, D, generator=g, dtype=dtype) for _ in range(2))
k, v = (torch.randn(B, KV, S, D, generator=g, dtype=dtype) for _ in range(2))
# One process, the whole windows, the whole mask.
whole = [t.clone().requires_grad_() for t in (q, k, v)]
mask = document_mask(tokens, 0)
ref = F.scaled_dot_product_attention(*whole, attn_mask=mask, enable_gqa=True)
ref.backward(dout)
causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
assert (causal - ref).abs().max() > 0.1  # the mask matters here
# This rank's zigzag part, across the group, with the whole windows' documents.
mine = [shard_sequence(t, cp, rank, dim=2).detach().requires_grad_() for t in (q, k, v)]
out = attention(*mine, dist.group.WORLD, documents=documents)
out.backward(shard_sequence(dout, cp, rank, dim=2))
checks = {"out": (out, ref)}
checks.update({f"d{n}": (m.grad, w.grad) for n, m, w in zip("qkv", mine, whole, strict=True)})
worst = 0.0
for name, (got, want) in checks.items():
    want = shard_sequence(want, cp, rank, dim=2)
    assert got is not None and torch.isfinite(got).all(), f"rank {rank}: {name} is not finite"
    err = (got - want).abs().max().item()
    worst = max(worst, err)
    assert err <= tol, f"rank {rank}: {name} differs by {err}"
print(f"rank {rank}: cp {cp} {sys.argv[1]}: max difference {worst:.3g}")
dist.destroy_process_group()
