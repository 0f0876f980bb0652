"""Run under torchrun: which norm each rank clips its gradients by, over a few real steps of the
engine (argv[2:] are --set items: DeMo, or DiLoCo replicas). Each call of clipping is recorded with the
norm it was given and the norm of the gradients it was given (this rank's own, before clipping);
rank 0 writes every rank's records as JSON to argv[1]."""

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from dtlab.config import load_config
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.runtime.status import leave_worker
from dtlab.train.loop import TorchEngine

config = load_config(
    overrides=[
        "model.preset=debug", "data.source=synthetic", "data.seq_len=32", "train.global_batch_size=4",
        "train.grad_clip=0.05", *sys.argv[2:],
    ]
)  # fmt: skip
records: list[dict[str, float]] = []
clip = torch.nn.utils.clip_grads_with_norm_


def recording(params, max_norm, total_norm, foreach=None):  # type: ignore[no-untyped-def]
    grads = [p.grad for p in params if p.grad is not None]
    own = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    records.append({"given": float(total_norm), "own": float(own)})
    return clip(params, max_norm, total_norm, foreach=foreach)


torch.nn.utils.clip_grads_with_norm_ = recording
d = init_distributed(config)
engine = TorchEngine(config, d, Path(tempfile.mkdtemp()))
logged = []
for step in range(1, 4):
    m = engine.step(next(engine.tr.loader), step, 0, False)
    logged.append(m["grad_norm"])
engine.end()
engine.tr.loader.close()
out: list = [None] * dist.get_world_size()
dist.all_gather_object(out, {"clipped": records, "logged": logged})
if d.rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(out))
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
