"""Run under torchrun: measure the collectives of one optimizer step for several strategies and write
them, with dtlab's prediction, as JSON to argv[1] (rank 0). argv[2:] are "strategy:sharding:accum" items.
"""

import json
import sys

import torch
import torch.distributed as dist

from dtlab.analysis.model import plan_step
from dtlab.bench.sweep import compression_overrides
from dtlab.bench.worker import _replay_once, _replay_plan
from dtlab.config import load_config
from dtlab.metrics.comm import CommCounter
from dtlab.models import build_model
from dtlab.parallel import destroy_distributed, init_distributed, parallelize
from dtlab.runtime.status import leave_worker
from dtlab.train.optim import build_optimizer
from dtlab.train.optimizer_step import train_step
from dtlab.train.precision import LossScaler
from dtlab.train.schedules import build_scheduler

results = []
d = None
for item in sys.argv[2:]:
    strategy, sharding, accum, *rest = item.split(":")
    compression = rest[0] if rest else "none"
    world = int(__import__("os").environ["WORLD_SIZE"])
    overrides = [
        "model.preset=debug",
        # Odd sizes, so that FSDP pads dim 0 and the prediction has to know it.
        "model.vocab_size=259",
        "model.ffn_dim=190",
        "data.seq_len=16",
        f"parallel.strategy={strategy}",
        f"parallel.sharding={sharding}",
        f"train.global_batch_size={2 * world * int(accum)}",
        "train.micro_batch_size=2",
        *compression_overrides(compression),
        "parallel.compression_options.start_step=2",
    ]
    if strategy == "hsdp":
        overrides.append("parallel.replicate=2")
    cfg = load_config(overrides=overrides)
    d = init_distributed(cfg)
    pm = parallelize(build_model(cfg.model), cfg, d)
    opt = build_optimizer(pm.module, cfg.train)
    sched = build_scheduler(opt, cfg.train)
    batches = [
        (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))) for _ in range(int(accum))
    ]
    for _ in range(2):  # warm-up: lazy init; PowerSGD compresses from its start step (2) on
        train_step(pm, opt, sched, LossScaler(False), batches, cfg, d.device)
    counter = CommCounter()
    with counter:
        train_step(pm, opt, sched, LossScaler(False), batches, cfg, d.device)
    plan = plan_step(cfg, world)
    # The bench's replay of these collectives: on the groups they ran on, in an order every rank
    # shares (a replay that fails to match its peers' would hang here).
    replay = _replay_plan(counter)
    _replay_once(replay, d)
    results.append(
        {
            "item": item,
            "counts": dict(counter.counts),
            "bytes": dict(counter.bytes),
            "replay": [[name, dist.get_world_size(group), n] for name, group, n in replay],
            "predicted": plan.comm_bytes,
            "params": sum(p.numel() for p in build_model(cfg.model).parameters()),
        }
    )
if d is not None and d.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
