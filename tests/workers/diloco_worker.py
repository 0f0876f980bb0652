"""Run under torchrun: the collectives of each DiLoCo step, counted from the dispatcher, next to the
bytes dtlab predicts for that step; rank 0 writes both as JSON to argv[1]. argv[2:] are --set items."""

import json
import sys

from dtlab.analysis.model import diloco_sync_bytes, param_shapes, step_reduction_bytes
from dtlab.config import load_config
from dtlab.metrics.comm import CommCounter
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.train.loop import build_training, train_step

STEPS = 9
config = load_config(
    overrides=[
        "model.preset=debug", "data.source=synthetic", "data.seq_len=32", "train.global_batch_size=4",
        "parallel.strategy=ddp", *sys.argv[2:],
    ]
)  # fmt: skip
d = init_distributed(config)
tr = build_training(config, d)
assert tr.diloco is not None
syncs = diloco_sync_bytes(param_shapes(config.model), config, d.world_size)
base = step_reduction_bytes(config, d.dims)
measured, predicted = [], []
for step in range(1, STEPS + 1):
    batch = next(tr.loader)
    with CommCounter() as counter:
        train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, batch, config, d.device)
        tr.diloco.after_step(step)
    measured.append(sum(counter.bytes.values()))
    predicted.append(base + sum(syncs[f] for f in tr.diloco.due(step)))
tr.diloco.state_dict()  # waits for what is still in flight
tr.loader.close()
if d.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"measured": measured, "predicted": predicted, "syncs": syncs}, f)
destroy_distributed()
