"""Two gloo ranks, tensor parallel: the collectives torch issues in one micro-batch's forward and
backward (counted by torch's CommDebugMode) are the ones ``dtlab plan`` predicts, kind by kind (a whole step's collectives against the step-time model's waits:
tests/workers/waits_worker.py)."""

import os
import sys

import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from dtlab.analysis.model import plan_step
from dtlab.config import load_config
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.train.loop import build_training
from dtlab.train.optimizer_step import accumulate_gradients

SEQ, BATCH, DIM = 64, 8, 256
sp = sys.argv[1] == "sp"
cfg = load_config(overrides=[
    "model.preset=tiny", "data.source=synthetic", f"data.seq_len={SEQ}",
    f"train.global_batch_size={BATCH}", "parallel.tp=2", f"parallel.sequence_parallel={str(sp).lower()}",
])  # fmt: skip
d = init_distributed(cfg)
tr = build_training(cfg, d)
mode = CommDebugMode()
with mode:
    accumulate_gradients(tr.pm, tr.scaler, next(tr.loader), cfg, d.device)
measured = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
predicted = plan_step(cfg, dist.get_world_size()).comm_bytes
activation = BATCH * SEQ * DIM * 4  # the buffer of every activation collective (fp32)
loss_floats = (
    3 * BATCH * SEQ * 4
)  # the vocabulary-parallel loss: three all-reduces of a float per token
if sp:
    expected = {
        "all_gather_into_tensor": predicted["tp all_gather"] // activation,
        "reduce_scatter_tensor": predicted["tp reduce_scatter"] // activation,
        "all_reduce": 3,
    }
    # The norms' weight gradients (4 blocks x 2 + the final norm), all-reduced once per step, after
    # the micro-batches counted here (dtlab plan --check counts them in the whole step).
    norms = (2 * 4 + 1) * DIM * 4
    assert predicted["tp all_reduce"] == loss_floats + norms, predicted
else:
    expected = {"all_reduce": (predicted["tp all_reduce"] - loss_floats) // activation + 3}
assert measured == expected, (measured, expected, predicted)
tr.loader.close()
destroy_distributed()
os._exit(0)  # see dtlab.runtime.status.leave_worker
