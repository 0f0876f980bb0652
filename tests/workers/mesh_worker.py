"""Run under torchrun: parallelize the debug model under each data-parallel layout this world can run,
and record how it came out, read from the model itself: the wrapper, and for sharded parameters their
DTensor mesh (shape, dimension names) and placements.

Writes {layout: {...}} as JSON to the path in argv[1] (rank 0).
"""

import json
import sys

from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dtlab.config import load_config
from dtlab.models import build_model
from dtlab.parallel import destroy_distributed, init_distributed, parallelize
from dtlab.runtime.status import leave_worker

LAYOUTS = {
    "ddp": ["parallel.strategy=ddp"],
    "fsdp-full": ["parallel.strategy=fsdp", "parallel.sharding=full"],
    "fsdp-shard_grad_op": ["parallel.strategy=fsdp", "parallel.sharding=shard_grad_op"],
    "fsdp-no_shard": ["parallel.strategy=fsdp", "parallel.sharding=no_shard"],
    "hsdp-1": ["parallel.strategy=hsdp", "parallel.replicate=1"],
    "hsdp-2": ["parallel.strategy=hsdp", "parallel.replicate=2"],
    "hsdp-4": ["parallel.strategy=hsdp", "parallel.replicate=4"],
    "hsdp-2-no_shard": [
        "parallel.strategy=hsdp",
        "parallel.replicate=2",
        "parallel.sharding=no_shard",
    ],
}

results: dict = {}
d = None
for name, overrides in LAYOUTS.items():
    cfg = load_config(overrides=["model.preset=debug", "data.seq_len=16", *overrides])
    d = init_distributed(cfg)
    pm = parallelize(build_model(cfg.model), cfg, d)
    param = next(pm.module.parameters())
    row = {
        "wrapper": "ddp"
        if isinstance(pm.module, DistributedDataParallel)
        else "fsdp"
        if isinstance(pm.module, FSDPModule)
        else "none",
        "dtensor": isinstance(param, DTensor),
    }
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        row["mesh_shape"] = list(mesh.shape)
        row["mesh_dims"] = list(mesh.mesh_dim_names or ())
        row["mesh_ranks"] = mesh.mesh.tolist()
        row["placements"] = [
            "shard" if p.is_shard() else "replicate" if p.is_replicate() else str(p)
            for p in param.placements
        ]
        # The degrees' mesh is the one the parameters live on (built once: asking again builds nothing).
        row["same_mesh"] = d.dims.build_mesh(d.device.type) == mesh
    results[name] = row
if d is not None and d.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
