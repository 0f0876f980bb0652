"""Two gloo ranks agree on a step's values in its one reduction: the loss, DeMo's gradient norm (each
rank's own), the non-finite flag and the stop signal; each rank's input given, the agreed result checked."""

import math
import signal

import torch
import torch.distributed as dist

from dtlab.config import load_config
from dtlab.metrics.comm import CommCounter
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.runtime.status import leave_worker
from dtlab.train.step import reduce_step

# dtlab's own set-up and teardown, as a run does: with a bare init_process_group/destroy_process_group
# the ranks of this short worker aborted at interpreter exit in a few percent of launches (gloo threads).
init_distributed(load_config(overrides=["parallel.strategy=ddp"]))
rank = dist.get_rank()


def agree(loss: float, grad: float, stop: int = 0, found: float = 0.0):  # type: ignore[no-untyped-def]
    counter = CommCounter()
    with counter:
        r = reduce_step(torch.tensor(loss), torch.tensor(found), stop, [torch.tensor([grad])], True)
    assert dict(counter.counts) == {"all_reduce": 1}, (
        counter.counts
    )  # one collective, whatever it carries
    return r


# The mean loss; the RMS of the ranks' norms, the same on every rank (not the largest one's).
r = agree([2.0, 3.0][rank], [3.0, 4.0][rank])
assert r.loss == 2.5 and r.stop is None and not r.flagged, r
assert math.isclose(r.norm, math.sqrt((9 + 16) / 2), rel_tol=1e-6), r.norm
# One rank's norm is NaN: every rank calls the step flagged, whatever order a MAX would see them in.
for nan_rank in (0, 1):
    assert agree(1.0, float("nan") if rank == nan_rank else 1.0).flagged, (rank, nan_rank)
# One rank's overflow (fp16) flags the step on both.
assert agree(1.0, 1.0, found=float(rank == 1)).flagged
# A stop signal caught by one rank, or by both (their signal numbers must not add up to another).
assert agree(1.0, 1.0, stop=signal.SIGTERM if rank == 1 else 0).stop == "SIGTERM"
assert agree(1.0, 1.0, stop=signal.SIGTERM).stop == "SIGTERM"
assert agree(1.0, 1.0, stop=[signal.SIGUSR1, signal.SIGINT][rank]).stop == "SIGUSR1"
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
