"""Two gloo ranks agree on DeMo's gradient norm: each rank's own norm given, the agreed one checked."""

import math

import torch
import torch.distributed as dist

from dtlab.config import load_config
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.train.optim import agree_local_norm

# dtlab's own set-up and teardown, as a run does: with a bare init_process_group/destroy_process_group
# the ranks of this short worker aborted at interpreter exit in a few percent of launches (gloo threads).
init_distributed(load_config(overrides=["parallel.strategy=ddp"]))
rank = dist.get_rank()
# The RMS of the ranks' norms, the same on every rank (not the largest one's).
norm, bad = agree_local_norm(torch.tensor([3.0, 4.0][rank]))
assert not bad and math.isclose(norm.item(), math.sqrt((9 + 16) / 2), rel_tol=1e-6), norm
# One rank's norm is NaN: every rank calls the step bad, whatever order a MAX would see them in.
for nan_rank in (0, 1):
    mine = float("nan") if rank == nan_rank else 1.0
    norm, bad = agree_local_norm(torch.tensor(mine))
    assert bad, (rank, nan_rank)
destroy_distributed()
