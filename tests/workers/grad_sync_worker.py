"""Run under torchrun: count the collectives of one optimizer step with 1 and with 4 micro-batches.

Writes {layout: {accum: {collective: count}}} as JSON to the path in argv[1] (rank 0); on 4
processes, HSDP 2x2 too.
"""

import json
import sys

import torch

from dtlab.config import load_config
from dtlab.metrics.comm import CommCounter
from dtlab.models import build_model
from dtlab.parallel import destroy_distributed, init_distributed, parallelize
from dtlab.runtime.status import leave_worker
from dtlab.train.optim import build_optimizer
from dtlab.train.optimizer_step import train_step
from dtlab.train.precision import LossScaler
from dtlab.train.schedules import build_scheduler

LAYOUTS = {
    "ddp": ["parallel.strategy=ddp"],
    "fsdp": ["parallel.strategy=fsdp"],
    "fsdp no_shard": ["parallel.strategy=fsdp", "parallel.sharding=no_shard"],
    "hsdp": ["parallel.strategy=hsdp", "parallel.replicate=2"],
}
world = int(__import__("os").environ["WORLD_SIZE"])
results: dict = {}
for layout, extra in LAYOUTS.items():
    if layout == "hsdp" and world < 4:
        continue
    cfg = load_config(overrides=["model.preset=debug", "data.seq_len=16", *extra])
    d = init_distributed(cfg)
    pm = parallelize(build_model(cfg.model), cfg, d)
    opt = build_optimizer(pm.module, cfg.train)
    sched = build_scheduler(opt, cfg.train)
    for accum in (1, 4):
        batches = [
            (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))) for _ in range(accum)
        ]
        counter = CommCounter()
        with counter:
            train_step(pm, opt, sched, LossScaler(False), batches, cfg, d.device)
        results.setdefault(layout, {})[accum] = dict(counter.counts)
if d.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
