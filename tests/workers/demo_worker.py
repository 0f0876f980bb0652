"""Run under torchrun: three DeMo steps on two small parameters with each rank's own gradients; rank 0
writes the parameters and its momenta to argv[1]."""

import sys

import torch
import torch.distributed as dist

from dtlab.config import load_config
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.runtime.status import leave_worker
from dtlab.train.demo import DeMo

# dtlab's own set-up and teardown, as a run does: with a bare init_process_group/destroy_process_group
# the ranks of this short worker aborted at interpreter exit in a few percent of launches (gloo threads).
init_distributed(load_config(overrides=["parallel.strategy=ddp"]))
rank = dist.get_rank()
torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(7, 9))  # 63 elements: a partial last chunk
b = torch.nn.Parameter(torch.randn(5))  # shorter than one chunk
opt = DeMo(
    [{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
    lr=0.01, chunk_size=16, topk=3, decay=0.9,
)  # fmt: skip
for step in range(3):
    gen = torch.Generator().manual_seed(100 * rank + step)
    w.grad = torch.randn(w.shape, generator=gen)
    b.grad = torch.randn(b.shape, generator=gen)
    opt.step()
if rank == 0:
    torch.save({"w": w.detach(), "b": b.detach(), "momenta": opt.local.state_dict()}, sys.argv[1])
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
