"""A training step syncs the host with the device once: the read of the figures its ranks agreed on.

Counted on the CPU by :class:`dtlab.metrics.syncs.HostSyncCounter` (what the same code would cost on a
GPU) and, where CUDA is, by the counter on the GPU and by CUDA's own sync debug mode. Before this was
made so, a step cost three on one process (its overflow flag made on the host, its stop votes built
from Python values and copied, the read) and four under FSDP and ZeRO-1 (the shards' copy counts
copied too).
"""

from __future__ import annotations

import json
import threading
import warnings

import pytest
import torch

from conftest import run_worker
from dtlab.config import load_config
from dtlab.metrics.syncs import HostSyncCounter
from dtlab.parallel import DistInfo
from dtlab.train.loop import build_training
from dtlab.train.optimizer_step import train_step

BASE = [
    "model.preset=debug",
    "data.source=synthetic",
    "data.seq_len=32",
    "train.global_batch_size=4",
]
# The one sync of a step: reading back the agreed loss, norm, flags and stop votes (reduce_step).
ONE = {"read": 1}


def test_the_counter_sees_each_kind_of_sync() -> None:
    t = torch.ones(3, device="cpu")
    counter = HostSyncCounter("cpu")
    with counter:
        t.sum().item()
        float(t[0])
        t.tolist()
        torch.tensor([1.0, 2.0])  # host data
        torch.tensor(5.0)  # host data (a scalar, which no fill takes)
        torch.zeros(2)  # host tensor: no device given
        # None of these: made on the device, scalars passed as kernel arguments.
        torch.zeros(2, device="cpu")
        t[0] = 2.0
        t[1].fill_(3.0)
        torch.full((2,), 1.0, device="cpu")
        # A mask filled with a scalar where the factories' function mode does not see the
        # assignment (inside DTensor's dispatch: torch's loss-parallel cross-entropy).
        with torch._C.DisableTorchFunction():
            t[t > 2.5] = 0.0
        # Another thread's read (a loader's, a checkpoint writer's) is not this code's.
        other = threading.Thread(target=t.tolist)
        other.start()
        other.join()
    assert dict(counter.counts) == {"read": 3, "host data": 2, "host tensor": 1}
    # Each where this test caused it.
    assert {where.rsplit(":", 1)[0] for _, where in counter.where} == {__file__}


def _steps(device: torch.device, *overrides: str, steps: int = 3) -> list[HostSyncCounter]:
    config = load_config(overrides=[*BASE, "train.grad_clip=0.05", *overrides])
    tr = build_training(config, DistInfo(0, 1, 0, 1, device, None))
    counters = []
    for k in range(steps):
        batch = tr.loader.build_step(k)
        counter = HostSyncCounter(device)
        with counter:
            train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, batch, config, device)
        counters.append(counter)
    tr.loader.close()
    return counters


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_one_process_step_syncs_once(precision: str) -> None:
    for c in _steps(torch.device("cpu"), f"train.precision={precision}"):
        assert dict(c.counts) == ONE, c.where


@pytest.mark.parametrize(
    "layout, expected, steps",
    [
        (["parallel.strategy=fsdp", "train.precision=fp16"], ONE, "all"),
        (["parallel.strategy=ddp", "parallel.sharding=optimizer"], ONE, "all"),
        # The out-of-memory agreement is read before any gradient is synchronised: one more.
        (["parallel.strategy=ddp", "train.oom_retry=true"], {"read": 2}, "all"),
        (["parallel.tp=2"], ONE, "all"),
        # torch's pipeline stages exchange their shapes once, in the first step.
        (["parallel.pp=2", "parallel.pp_microbatches=2"], ONE, "after-first"),
    ],
    ids=["fsdp-fp16", "zero1", "ddp-oom-retry", "tp", "pp"],
)
def test_two_rank_engine_step_syncs_once(
    layout: list[str], expected: dict[str, int], steps: str
) -> None:
    run_worker("host_sync_worker.py", 2, json.dumps(expected), steps, *layout)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_cuda_step_syncs_once(precision: str) -> None:
    """On a GPU: the counter sees one read per step, and CUDA's sync debug mode one synchronising
    operation per step after the first (which may hold libraries' one-time work)."""
    cuda = torch.device("cuda", 0)
    for c in _steps(cuda, f"train.precision={precision}"):
        assert dict(c.counts) == ONE, c.where
    config = load_config(overrides=[*BASE, "train.grad_clip=0.05", f"train.precision={precision}"])
    tr = build_training(config, DistInfo(0, 1, 0, 1, cuda, None))
    syncs = []
    for k in range(3):
        batch = tr.loader.build_step(k)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, batch, config, cuda)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchronizing" in str(w.message) for w in caught))
    tr.loader.close()
    assert syncs[1:] == [1, 1], syncs


# debug-moe with 4 blocks: a dense one, then 3 MoE blocks.
MOE = ["model.preset=debug-moe", "model.n_layers=4"]
# The step's read, one read of each MoE block's counts (the experts' splits must be numbers), and
# one of the step's routing figures (loads, imbalance, auxiliary loss, bias).
MOE_STEP = {"read": 1 + 3 + 1}


def test_an_moe_step_reads_each_blocks_counts_once_and_its_routing_figures_once() -> None:
    for c in _steps(torch.device("cpu"), *MOE):
        assert dict(c.counts) == MOE_STEP, c.where


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_recomputed_moe_block_reads_its_counts_once(mode: str) -> None:
    # Its recomputation in backward takes what its forward read (ForwardReads): no second read
    # per block (before: 1 + 3 x 2 + 1).
    for c in _steps(torch.device("cpu"), *MOE, f"train.activation_checkpointing={mode}"):
        assert dict(c.counts) == MOE_STEP, c.where


def test_an_moe_step_on_the_grouped_kernel_reads_no_counts() -> None:
    # In bf16 the experts run on torch's grouped kernel, whose offsets are made from the counts
    # on the device: the step's read and its routing figures' read, none per block.
    for c in _steps(torch.device("cpu"), *MOE, "train.precision=bf16"):
        assert dict(c.counts) == {"read": 1 + 1}, c.where


def test_expert_parallelism_reads_what_each_block_sends_and_receives_in_one_sync() -> None:
    # The counts cross to the experts' ranks on the device; what is sent and received is read
    # together: no more reads than without expert parallelism (before: two per block, and a
    # blocking copy of the counts to the device).
    run_worker(
        "host_sync_worker.py", 2, json.dumps(MOE_STEP), "all", *MOE, "parallel.strategy=ddp",
        "parallel.ep=2",
    )  # fmt: skip


def test_expert_parallelism_under_checkpointing_reads_each_block_once() -> None:
    # The recomputation sends no counts and reads none: it takes the splits its forward read
    # (before: a second counts' all-to-all and read per block, 1 + 3 x 2 + 1).
    run_worker(
        "host_sync_worker.py", 2, json.dumps(MOE_STEP), "all", *MOE, "parallel.strategy=ddp",
        "parallel.ep=2", "train.activation_checkpointing=full",
    )  # fmt: skip


def test_expert_parallelism_on_the_grouped_kernel_reads_nothing_more() -> None:
    # The grouped kernel's offsets from the counts expert parallelism read: a copy to the device
    # of numbers already on the host, no read (the same step's reads as the loop's).
    run_worker(
        "host_sync_worker.py", 2, json.dumps(MOE_STEP), "all", *MOE, "parallel.strategy=ddp",
        "parallel.ep=2", "train.precision=bf16",
    )  # fmt: skip
