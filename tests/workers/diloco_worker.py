"""Run under torchrun: the collectives of each DiLoCo step, counted from the dispatcher, next to the
bytes dtlab predicts for that step, and the bytes one rank puts on the wire as the engine's count
(run.comm_bytes) gives them next to the predicted ones; rank 0 writes them as JSON to argv[1].
argv[2:] are --set items."""

import json
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from dtlab.analysis.model import (
    bus_bytes,
    diloco_agreement_bytes,
    diloco_sync_bytes,
    param_shapes,
    plan_step,
)
from dtlab.config import load_config
from dtlab.metrics.comm import CommCounter
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.runtime.status import leave_worker
from dtlab.train.comm_groups import comm_labels
from dtlab.train.diloco import gathers
from dtlab.train.loop import TorchEngine

STEPS = 9
config = load_config(
    overrides=[
        "model.preset=debug", "data.source=synthetic", "data.seq_len=32", "train.global_batch_size=4",
        "parallel.strategy=ddp", *sys.argv[2:],
    ]
)  # fmt: skip
d = init_distributed(config)
# The engine's own step: the inner step, then the outer syncs and the replicas' agreement with them.
engine = TorchEngine(config, d, Path(tempfile.mkdtemp()))
tr = engine.tr
assert tr.diloco is not None
shapes = param_shapes(config.model)
syncs = diloco_sync_bytes(shapes, config, d.dims.diloco, d.dims.dp_shard)
# Every step's collectives but the outer syncs and the replicas' agreement that goes with them: within a
# replica of several ranks, the step's reduction and its DDP all-reduce or FSDP's gathers and
# reduce-scatters (one-rank replicas: nothing at all).
plan = plan_step(config, d.world_size, shapes)
base = sum(v for k, v in plan.comm_bytes.items() if not k.startswith("diloco"))
base_wire = sum(v for k, v in plan.comm_bus_bytes.items() if not k.startswith("diloco"))
outer = "all_gather" if gathers(config.parallel.diloco) else "all_reduce"
labels, sizes = comm_labels(d, tr.diloco)
measured, predicted, measured_wire, predicted_wire = [], [], [], []
by_kind: list[dict[str, int]] = []  # each step's bytes by collective and group label
for step in range(1, STEPS + 1):
    batch = next(tr.loader)
    with CommCounter(labels) as counter:
        engine.step(batch, step, 0, False)
    measured.append(sum(counter.bytes.values()))
    by_kind.append(dict(counter.bytes))
    due = [syncs[f] for f in tr.diloco.due(step)]
    agreement = diloco_agreement_bytes(d.dims.diloco) if due else 0
    predicted.append(base + sum(due) + agreement)
    groups = {k: sizes[k.split(" ")[0]] for k in counter.bytes if " " in k}
    measured_wire.append(round(bus_bytes(dict(counter.bytes), groups, d.world_size)))
    syncs_wire = sum(bus_bytes({outer: b}, {outer: d.dims.diloco}, d.world_size) for b in due)
    syncs_wire += bus_bytes({"all_gather": agreement}, {"all_gather": d.dims.diloco}, d.world_size)
    predicted_wire.append(round(base_wire + syncs_wire))
# Which group the replicas' agreement runs on: with syncs in flight (delay) one of its own, of the
# same ranks as the outer syncs' (on theirs it would queue behind the fragment in flight).
outer_ranks = dist.get_process_group_ranks(tr.diloco.group)
agreement_apart = (
    tr.diloco.agreement is not tr.diloco.group
    and dist.get_process_group_ranks(tr.diloco.agreement) == outer_ranks
)
tr.diloco.close()  # waits for what is still in flight, destroys its group
tr.loader.close()
if d.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(
            {
                "measured": measured, "predicted": predicted, "syncs": syncs,
                "measured_wire": measured_wire, "predicted_wire": predicted_wire,
                "by_kind": by_kind, "agreement_apart": agreement_apart, "sync_steps": [s for s in range(1, STEPS + 1) if tr.diloco.due(s)],
            },
            f,
        )  # fmt: skip
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
