"""Run under torchrun on 2 processes: the gradient bytes each rank holds after one backward, for DDP
(gradients as bucket views, dtlab's setting), DDP with separate buckets, and FSDP; rank 0 writes them
as JSON to argv[1]."""

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from dtlab.bench.memory import gradient_bytes
from dtlab.config import load_config
from dtlab.models import build_model
from dtlab.parallel import destroy_distributed, init_distributed, parallelize
from dtlab.runtime.status import leave_worker

result = {}
d = None
inputs = torch.randint(0, 256, (2, 16))
for name in ("ddp", "ddp_separate_buckets", "fsdp"):
    strategy = "fsdp" if name == "fsdp" else "ddp"
    cfg = load_config(
        overrides=["model.preset=debug", "data.seq_len=16", f"parallel.strategy={strategy}"]
    )
    d = init_distributed(cfg)
    if name == "ddp_separate_buckets":
        module = DistributedDataParallel(
            build_model(cfg.model, "cpu"), gradient_as_bucket_view=False
        )
    else:
        module = parallelize(build_model(cfg.model), cfg, d).module
    logits = module(inputs)
    F.cross_entropy(logits.flatten(0, 1), inputs.flatten()).backward()
    result[name] = gradient_bytes(module)
result["params"] = sum(p.numel() for p in build_model(cfg.model).parameters())
if d is not None and d.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
