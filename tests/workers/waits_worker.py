"""Gloo ranks (as many as launched), each layout in turn: the collectives a whole step issues (counted by torch's
profiler: every one gloo runs, on the rank that issues the most) are the ones the step-time model
counts a wait for (:func:`dtlab.analysis.steptime.collective_waits`). A pass of context
parallelism's ring sends and receives its tensors together and waits for them together: its sends
and receives are one wait."""

import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from dtlab.analysis.probe_step import rank_step
from dtlab.analysis.steptime import collective_waits, step_microbatches
from dtlab.config import load_config
from dtlab.dims import ParallelDims
from dtlab.parallel import context, destroy_distributed, init_distributed

BASE = [
    "model.preset=tiny", "data.source=synthetic", "data.seq_len=32", "train.global_batch_size=16",
    "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
]  # fmt: skip
layouts = [layout.split(",") for layout in sys.argv[1:]]
d = init_distributed(load_config(None, [*BASE, *layouts[0]]))
# The ring's passes, and the point-to-point operations they issued (counted, then run as they are).
passes = [0, 0]
start = context._Ring.start


def counted_start(self, tensors, backwards=False):  # type: ignore[no-untyped-def]
    passes[0] += 1
    passes[1] += 2 * len(tensors)  # a send and a receive of each
    return start(self, tensors, backwards)


context._Ring.start = counted_start  # type: ignore[method-assign]
failures = []
for layout in layouts:
    cfg = load_config(None, [*BASE, *layout])
    here = replace(d, dims=ParallelDims.from_config(cfg, d.world_size))
    step = rank_step(cfg, here)
    step()
    step()  # DDP rebuilds its buckets once, at its second step (two broadcasts)
    passes[:] = [0, 0]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = sum(e.name.startswith("c10d::") for e in prof.events())
    issued = torch.tensor(ops - passes[1] + passes[0])
    dist.all_reduce(issued, op=dist.ReduceOp.MAX)
    layers = cfg.model.n_layers // here.dims.pp
    waits = collective_waits(cfg, here.dims, layers, step_microbatches(cfg, here.dims))
    if int(issued) != sum(waits.values()):
        failures.append(f"{layout}: {int(issued)} issued, {waits} counted")
assert not failures, "\n".join(failures)
destroy_distributed()
os._exit(0)  # see dtlab.runtime.status.leave_worker
