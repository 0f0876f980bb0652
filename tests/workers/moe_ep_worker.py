"""Run under torchrun on 2 processes: one MoE layer split over an EP group of 2 ranks against the
same layer whole on each rank. The ranks route different numbers of tokens (7 and 13), expert 0 is
favoured and expert 3 (rank 1's) receives no token (selection biases); each rank writes, to
argv[1]/<rank>.json, the largest differences of the output, the input's, router's and shared
expert's gradients, and its expert shards' gradients against the whole layer's summed over both
ranks, and the rows it sent and received."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dtlab.models.args import MoEArgs
from dtlab.models.llama import FeedForward
from dtlab.models.moe import MoE
from dtlab.parallel.expert import apply_ep
from dtlab.runtime.status import leave_worker


def layer() -> MoE:
    """The same layer on every rank: random weights, biases that favour expert 0 and starve 3."""
    args = MoEArgs(experts=4, expert_dim=24, top_k=2, shared_experts=1, bias_balance=True)
    torch.manual_seed(0)
    moe = MoE(16, args, FeedForward(16, 24))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
        moe.init_buffers()
        assert moe.expert_bias is not None
        moe.expert_bias.copy_(torch.tensor([0.3, 0.0, 0.0, -100.0]))
    return moe


def run(moe: MoE, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The layer's output and the gradients of (output * w).sum(): the input's and the weights'."""
    x = x.clone().requires_grad_(True)
    out = moe(x)
    (out * w).sum().backward()
    grads = {"x": x.grad}
    for name, p in moe.named_parameters():
        g = p.grad
        grads[name] = g.to_local() if isinstance(g, DTensor) else g
    return out.detach(), grads


dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
n = (7, 13)[rank]
torch.manual_seed(100 + rank)
x = torch.randn(1, n, 16)
w = torch.randn(1, n, 16)

ref, ref_grads = run(layer(), x, w)
# The whole layer's expert gradients summed over the ranks: what each shard must hold.
for name in ("experts.w1", "experts.w2", "experts.w3"):
    dist.all_reduce(ref_grads[name])

split = layer()
apply_ep(split, mesh["ep"])
rows = {}
import dtlab.parallel.expert as expert  # noqa: E402

dispatch = expert.dispatch


def counted(x: torch.Tensor, counts: list[int], group: object, reads: object):  # type: ignore[no-untyped-def]
    got, local_counts, on_device, routing = dispatch(x, counts, group, reads)
    assert on_device.tolist() == local_counts, (on_device, local_counts)
    rows.update(sent=routing.sent, received=routing.received, local=local_counts)
    return got, local_counts, on_device, routing


expert.dispatch = counted
out, grads = run(split, x, w)

diffs = {"out": (out - ref).abs().max().item()}
for name, g in grads.items():
    want = ref_grads[name]
    if name.startswith("experts."):
        want = want[2 * rank : 2 * rank + 2]  # this rank's experts: 0-1 or 2-3
    diffs[name] = (g - want).abs().max().item()
local = split.experts.w1.to_local().shape[0]
Path(sys.argv[1], f"{rank}.json").write_text(
    json.dumps({"diffs": diffs, "rows": rows, "local": local})
)
dist.destroy_process_group()
leave_worker(0)
