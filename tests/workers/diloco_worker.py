"""Run under torchrun: the collectives of each DiLoCo step, counted from the dispatcher, next to the
bytes dtlab predicts for that step, and the bytes one rank puts on the wire as the engine's count
(run.comm_bytes) gives them next to the predicted ones; rank 0 writes them as JSON to argv[1].
argv[2:] are --set items."""

import json
import sys

from dtlab.analysis.model import bus_bytes, diloco_sync_bytes, param_shapes, plan_step
from dtlab.config import load_config
from dtlab.metrics.comm import CommCounter
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.train.loop import build_training, comm_labels, train_step

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
shapes = param_shapes(config.model)
syncs = diloco_sync_bytes(shapes, config, d.dims.diloco, d.dims.dp_shard)
# Every step's collectives but the outer syncs: the step's reduction, and within a replica of several
# ranks its DDP all-reduce or FSDP's gathers and reduce-scatters.
plan = plan_step(config, d.world_size, shapes)
base = sum(v for k, v in plan.comm_bytes.items() if not k.startswith("diloco"))
base_wire = sum(v for k, v in plan.comm_bus_bytes.items() if not k.startswith("diloco"))
outer = "all_reduce" if config.parallel.diloco.quantize == "none" else "all_gather"
labels, sizes = comm_labels(d, tr.diloco)
measured, predicted, measured_wire, predicted_wire = [], [], [], []
for step in range(1, STEPS + 1):
    batch = next(tr.loader)
    with CommCounter(labels) as counter:
        train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, batch, config, d.device)
        tr.diloco.after_step(step)
    measured.append(sum(counter.bytes.values()))
    due = [syncs[f] for f in tr.diloco.due(step)]
    predicted.append(base + sum(due))
    groups = {k: sizes[k.split(" ")[0]] for k in counter.bytes if " " in k}
    measured_wire.append(round(bus_bytes(dict(counter.bytes), groups, d.world_size)))
    syncs_wire = sum(bus_bytes({outer: b}, {outer: d.dims.diloco}, d.world_size) for b in due)
    predicted_wire.append(round(base_wire + syncs_wire))
tr.diloco.close()  # waits for what is still in flight, destroys its group
tr.loader.close()
if d.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(
            {
                "measured": measured, "predicted": predicted, "syncs": syncs,
                "measured_wire": measured_wire, "predicted_wire": predicted_wire,
            },
            f,
        )  # fmt: skip
destroy_distributed()
