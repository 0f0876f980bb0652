"""Run under torchrun: count the host syncs of the engine's steps (:class:`HostSyncCounter`) for one
layout (argv[3:] are --set items) and check them against argv[1], a JSON object of the expected
counts per step by kind, on every step or (argv[2] "after-first") on every step after the first.
Exits non-zero, naming the lines that caused them, on any other count."""

import json
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from dtlab.config import load_config
from dtlab.metrics.syncs import HostSyncCounter
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.runtime.status import leave_worker
from dtlab.train.loop import TorchEngine

expected = json.loads(sys.argv[1])
config = load_config(
    overrides=[
        "model.preset=debug", "data.source=synthetic", "data.seq_len=32", "train.global_batch_size=8",
        "train.grad_clip=0.05", "run.comm_bytes=true", *sys.argv[3:],
    ]
)  # fmt: skip
d = init_distributed(config)
engine = TorchEngine(config, d, Path(tempfile.mkdtemp()))
seen = []
for step in range(1, 4):  # DDP rebuilds its buckets after the first step: the second one differs
    batch = next(engine.tr.loader)
    counter = HostSyncCounter(d.device)
    with counter:
        engine.step(batch, step, 0, False)
    seen.append((step, dict(counter.counts), counter.where))
checked = seen[1:] if sys.argv[2] == "after-first" else seen
assert all(counts == expected for _, counts, _ in checked), (d.rank, seen)
engine.end()
engine.tr.loader.close()
dist.barrier()
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
