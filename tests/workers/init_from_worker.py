"""Run under torchrun: build the model as the training loop does (meta, parallelize, materialise),
load model.init_from into it, and save (rank 0) its logits on fixed tokens to argv[1].
argv[2:] are config overrides."""

import sys

import torch

from dtlab.checkpoint.init_from import apply_init_from
from dtlab.config import load_config
from dtlab.models import build_model
from dtlab.parallel import destroy_distributed, init_distributed, parallelize
from dtlab.runtime.status import leave_worker

cfg = load_config(overrides=sys.argv[2:])
d = init_distributed(cfg)
pm = parallelize(build_model(cfg.model), cfg, d)
apply_init_from(pm.model, cfg, d)
tokens = torch.arange(2 * 16).reshape(2, 16) % cfg.model.vocab_size
with torch.no_grad():
    logits = pm.module(tokens)
if d.rank == 0:
    torch.save(logits, sys.argv[1])
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
