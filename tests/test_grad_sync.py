"""Gradient accumulation synchronises once per optimizer step, not once per micro-batch; FSDP
reduce-scatters each micro-batch's gradients into its shards (the whole gradients never accumulate)
and HSDP all-reduces the shards across replica groups once.

The collectives are counted from the dispatcher in real gloo processes (no mock of torch.distributed).
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_worker


def test_gradients_sync_once_per_step(tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    run_worker("grad_sync_worker.py", 4, str(out))
    counts = json.loads(out.read_text())
    ddp1, ddp4 = counts["ddp"]["1"], counts["ddp"]["4"]
    # The bucketed all-reduce of the gradients, plus the step's one small reduction.
    assert ddp1["all_reduce"] >= 1
    assert ddp4["all_reduce"] == ddp1["all_reduce"], counts
    fsdp1, fsdp4 = counts["fsdp"]["1"], counts["fsdp"]["4"]
    # One reduce-scatter per FSDP unit and micro-batch, into the shards...
    assert fsdp1["reduce_scatter"] >= 3
    assert fsdp4["reduce_scatter"] == 4 * fsdp1["reduce_scatter"], counts
    # ...as parameters are gathered again for every micro-batch's forward and backward.
    assert fsdp4["all_gather"] == 4 * fsdp1["all_gather"], counts
    # Beside the gradient sync, FSDP issues one all-reduce per step: the step's reduction, which
    # carries the loss, the overflow flag, the stop votes and the sharded gradients' norm together.
    assert fsdp1["all_reduce"] == 1 and fsdp4["all_reduce"] == 1, counts
    # HSDP: the shards' all-reduce across the replica groups (one per unit) once per step.
    hsdp1, hsdp4 = counts["hsdp"]["1"], counts["hsdp"]["4"]
    assert hsdp4["reduce_scatter"] == 4 * hsdp1["reduce_scatter"] > 0, counts
    assert hsdp4["all_reduce"] == hsdp1["all_reduce"] == fsdp1["reduce_scatter"] + 1, counts
    # Shard groups of one rank (no_shard): the gradients are whole anyway, synchronised once.
    whole1, whole4 = counts["fsdp no_shard"]["1"], counts["fsdp no_shard"]["4"]
    assert whole4 == whole1 and "reduce_scatter" not in whole4, counts
