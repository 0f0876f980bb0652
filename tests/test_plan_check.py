"""`dtlab plan --check`: the real code of a rank at full world size under the fake process group and
fake tensors, beside the analytic plan; and the check against real gloo runs of the same config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import close, planned_state, run_cli, run_worker
from dtlab.analysis.check import check_rank, measure_fake, parse_ranks
from dtlab.analysis.model import plan_step
from dtlab.analysis.shapes import param_shapes
from dtlab.config import load_config
from dtlab.dims import ParallelDims
from dtlab.errors import ConfigError

SMALL = ["model.preset=debug", "data.seq_len=64", "train.global_batch_size=8"]

# DiLoCo's layouts: replicas of one rank, of DDP and of FSDP; one fragment and streaming ones in
# flight through the step; plain, quantised and sparse outer gradients.
_DILOCO = ["parallel.diloco.inner_steps=4", "data.seq_len=16", "train.global_batch_size=2"]
_WIDE = [
    "train.precision=bf16", "model.dim=128", "model.ffn_dim=512", "model.n_layers=4",
    "model.vocab_size=4096", "data.seq_len=16",
]  # fmt: skip
_WIDE_CASTS = [
    "parallel.pp=2", "parallel.pp_schedule=1f1b", "train.precision=bf16", "model.dim=128",
    "model.ffn_dim=512", "model.n_layers=4", "model.vocab_size=4096", "data.seq_len=16",
    "train.global_batch_size=4",
]  # fmt: skip
DILOCO: dict[str, tuple[int, list[str]]] = {
    "diloco:2": (2, ["parallel.strategy=ddp", *_DILOCO]),
    "diloco:2 int8, 4 fragments, delay 2": (
        2, ["parallel.strategy=ddp", *_DILOCO, "model.n_layers=4", "parallel.diloco.fragments=4",
            "parallel.diloco.delay=2", "parallel.diloco.quantize=int8"]),
    "diloco:2 int8, 4 fragments, delay 2, eager": (
        2, ["parallel.strategy=ddp", *_DILOCO, "model.n_layers=4", "parallel.diloco.fragments=4",
            "parallel.diloco.delay=2", "parallel.diloco.quantize=int8", "parallel.diloco.eager=true",
            "parallel.diloco.outer_momentum=0.5"]),
    "diloco:2 x ddp:2 dense, 2 fragments, delay 1, eager": (
        4, ["parallel.strategy=ddp", "parallel.diloco.replicas=2", "parallel.diloco.inner_steps=4",
            "parallel.diloco.fragments=2", "parallel.diloco.delay=1", "parallel.diloco.eager=true"]),
    "diloco:2 sparse int2, momentum": (
        2, ["parallel.strategy=ddp", *_DILOCO, "parallel.diloco.topk=0.05",
            "parallel.diloco.quantize=int2", "parallel.diloco.outer_momentum=0.9"]),
    "diloco:2 x ddp:2, 2 fragments, delay 1": (
        4, ["parallel.strategy=ddp", "parallel.diloco.replicas=2", "parallel.diloco.inner_steps=4",
            "parallel.diloco.fragments=2", "parallel.diloco.delay=1"]),
    "diloco:2 x fsdp:2 int4 bf16": (
        4, ["parallel.strategy=fsdp", "parallel.diloco.replicas=2", "parallel.diloco.quantize=int4",
            "train.precision=bf16", *_DILOCO[:1], "train.global_batch_size=4"]),
    # Each replica's FSDP shards over its cp ranks: the outer state and syncs are the shards'.
    "diloco:2 x fsdp over cp:2": (
        4, ["parallel.strategy=fsdp", "parallel.diloco.replicas=2", "parallel.cp=2", *_DILOCO[:1],
            "data.seq_len=64", "train.global_batch_size=2"]),
}  # fmt: skip

# Layouts the check runs, on the debug model: (nproc, overrides).
CHECKED = {
    "single": (1, []),
    "zero-1:4": (4, ["parallel.strategy=ddp", "parallel.sharding=optimizer"]),
    "ddp:4": (4, ["parallel.strategy=ddp"]),
    "ddp:4 small buckets": (4, ["parallel.strategy=ddp", "parallel.bucket_mb=0.1"]),
    "fsdp:4": (4, ["parallel.strategy=fsdp"]),
    "fsdp:4 shard_grad_op": (4, ["parallel.strategy=fsdp", "parallel.sharding=shard_grad_op"]),
    "fsdp:4 no_shard": (4, ["parallel.strategy=fsdp", "parallel.sharding=no_shard"]),
    "hsdp:2x2": (4, ["parallel.strategy=hsdp", "parallel.replicate=2"]),
    # Each micro-batch's gradients reduce-scattered into the shards (HSDP's all-reduce once).
    "fsdp:2 accumulation": (2, ["parallel.strategy=fsdp", "train.micro_batch_size=1"]),
    "hsdp:2x2 accumulation": (4, ["parallel.strategy=hsdp", "parallel.replicate=2",
                                  "train.micro_batch_size=1"]),
    "tp:2": (2, ["parallel.tp=2"]),
    "tp:2 sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "fsdp:2xtp:2": (4, ["parallel.strategy=fsdp", "parallel.tp=2"]),
    # Checkpointed blocks recompute their forward, and with it some of tensor parallelism's collectives.
    "tp:2 full AC": (2, ["parallel.tp=2", "train.activation_checkpointing=full"]),
    "tp:2 sp selective AC": (2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                 "train.activation_checkpointing=selective"]),
    # Recomputation under autocast, on float32 and on FSDP's half-precision parameters.
    # FSDP's fp16 weights with a float32 residual stream (fp16's range would overflow it).
    "fsdp:2 fp16": (2, ["parallel.strategy=fsdp", "train.precision=fp16"]),
    # Half-precision norms' gradients all-reduced with each micro-batch FSDP reduce-scatters.
    "fsdp:2 x tp:2 sp bf16 accumulation": (4, ["parallel.strategy=fsdp", "parallel.tp=2",
                                               "parallel.sequence_parallel=true",
                                               "train.precision=bf16", "train.micro_batch_size=1"]),
    "fsdp:2 x tp:2 sp fp16 selective AC": (4, ["parallel.strategy=fsdp", "parallel.tp=2",
                                               "parallel.sequence_parallel=true",
                                               "train.precision=fp16",
                                               "train.activation_checkpointing=selective"]),
    "bf16 full AC": (1, ["train.precision=bf16", "train.activation_checkpointing=full"]),
    "bf16 selective AC": (1, ["train.precision=bf16", "train.activation_checkpointing=selective"]),
    "fsdp:2 bf16 selective AC": (2, ["parallel.strategy=fsdp", "train.precision=bf16",
                                     "train.activation_checkpointing=selective"]),
    "tp:2 sp bf16 full AC": (2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                 "train.precision=bf16", "train.activation_checkpointing=full"]),
    "pp:2 1f1b bf16 full AC": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b",
                                   "train.precision=bf16", "train.activation_checkpointing=full"]),
    # Deeper models: the block below the last one, whose reduce-scatter still holds its input.
    "fsdp:2 x tp:2 bf16 full AC, 8 blocks": (4, ["parallel.strategy=fsdp", "parallel.tp=2",
                                                 "train.precision=bf16", "model.n_layers=8",
                                                 "train.activation_checkpointing=full"]),
    "fsdp:2 bf16 selective AC, 4 blocks": (2, ["parallel.strategy=fsdp", "train.precision=bf16",
                                               "model.n_layers=4",
                                               "train.activation_checkpointing=selective"]),
    "pp:2 1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "pp:2 gpipe": (2, ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=4"]),
    "pp:2 1f1b bf16": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.precision=bf16"]),
    "pp:2 x fsdp:2": (4, ["parallel.pp=2", "parallel.strategy=fsdp"]),
    "pp:2 interleaved_1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                                  "model.n_layers=4", "parallel.pp_microbatches=4"]),
    "pp:2 looped_bfs": (2, ["parallel.pp=2", "parallel.pp_schedule=looped_bfs", "model.n_layers=4",
                            "parallel.pp_microbatches=4"]),
    # Multi-stage schedules with FSDP: each stage's gradients reduced after its own last backward
    # (torch's REDUCE_GRAD), its units resharded then, while the rank's other stage still runs.
    # Wide and few tokens (the gradients outweigh the activations, as at scale): the peak is a
    # stage's reduction, its float32 gradient copies beside the other stage's.
    "pp:2 interleaved x fsdp:2 shard_grad_op bf16, wide, 1 micro-batch": (
        4, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "model.n_layers=4",
            "parallel.pp_microbatches=1", "parallel.strategy=fsdp",
            "parallel.sharding=shard_grad_op", "train.precision=bf16", "model.dim=128",
            "model.ffn_dim=512", "data.seq_len=16", "train.global_batch_size=4"]),
    # Every unit is resharded after its own backward, under shard_grad_op too: the gathered
    # parameters of the blocks done are freed as their gradients are made (wide, few tokens: the
    # parameters outweigh the activations, as at scale).
    "fsdp:2 shard_grad_op bf16, wide": (
        2, ["parallel.strategy=fsdp", "parallel.sharding=shard_grad_op", "train.precision=bf16",
            "model.n_layers=4", "model.dim=128", "model.ffn_dim=512", "data.seq_len=16",
            "train.global_batch_size=2"]),
    # A large vocabulary and few tokens (the root unit outweighs a block, as for qwen3-30b-a3b or
    # llama3.2-1b at 1,024 tokens a rank): the root gathered beside its flat all-gather buffer at
    # forward's start and again for the output projection's backward, a tied model's embedding
    # gradient added to the output's, the root's float32 reduce-scatter input beside its
    # unsharded gradients at backward's end.
    "fsdp:4 large vocabulary": (4, ["parallel.strategy=fsdp", "model.vocab_size=8192",
                                    "data.seq_len=16", "train.global_batch_size=4",
                                    "model.tie_embeddings=false"]),
    "fsdp:2 bf16 full AC large vocabulary": (
        2, ["parallel.strategy=fsdp", "model.vocab_size=8192", "data.seq_len=16",
            "train.global_batch_size=2", "model.tie_embeddings=false", "train.precision=bf16",
            "train.activation_checkpointing=full"]),
    "hsdp:2x2 bf16 large vocabulary, tied": (
        4, ["parallel.strategy=hsdp", "parallel.replicate=2", "model.vocab_size=8192",
            "data.seq_len=16", "train.global_batch_size=4", "model.tie_embeddings=true",
            "train.precision=bf16"]),
    # Wide and few tokens under FSDP (a block's parameters outweigh its activations, as for a
    # large model at a small micro-batch): each block's parameters copied out of their flat
    # all-gather buffer, both alive (backward's peak, at the first block); in forward the
    # previous unit's buffer still alive beside them; a pipeline stage's attention norm's
    # backward, every weight gradient of its block made (the peak on both stages).
    "fsdp:4 bf16, wide, few tokens": (
        4, ["parallel.strategy=fsdp", "train.precision=bf16", "model.dim=128", "model.ffn_dim=512",
            "data.seq_len=16"]),
    "pp:2 x fsdp:2 bf16, wide, few tokens": (
        4, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "model.n_layers=4",
            "parallel.strategy=fsdp", "train.precision=bf16", "model.dim=128", "model.ffn_dim=512",
            "data.seq_len=16", "train.global_batch_size=4"]),
    # A first stage's embedding (a large vocabulary, untied): gathered at its backward's start
    # after a forward (its flat buffer alive at the last block's copy-out, or, a stage of one
    # block, prefetched by it), and again for the embedding's backward after a backward; the
    # stage's output still held by the schedule's loop after its last backward.
    "pp:2 x fsdp:2 large vocabulary": (
        4, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.strategy=fsdp",
            "model.vocab_size=8192", "model.tie_embeddings=false"]),
    "pp:2 x fsdp:2 bf16, vocabulary 4096": (
        4, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.strategy=fsdp",
            "model.vocab_size=4096", "model.tie_embeddings=false", "train.precision=bf16"]),
    "pp:2 x fsdp:2 vocabulary 4096": (
        4, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.strategy=fsdp",
            "model.vocab_size=4096", "model.tie_embeddings=false"]),
    "pp:2 x fsdp:2 vocabulary 4096, 4 blocks": (
        4, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.strategy=fsdp",
            "model.vocab_size=4096", "model.tie_embeddings=false", "model.n_layers=4"]),
    # A stage of one block on 4 shard ranks: its last block gathered for its backward, copied
    # out of the flat buffer, above the final norm's backward (the step's peak on the last rank).
    "pp:2 interleaved x fsdp:4 bf16": (
        8, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "model.n_layers=4",
            "parallel.pp_microbatches=4", "parallel.strategy=fsdp", "train.precision=bf16",
            "train.global_batch_size=16"]),
    # Pipelines under autocast on float32 weights, wide, few tokens and a large vocabulary (the
    # weights outweigh the activations, as for llama3.2-1b at 1,024 tokens a rank): a later
    # micro-batch's backward holds each cast weight's half-precision gradient to its end (the
    # casts' autograd nodes are the first micro-batch's: the engine runs them last), beside the
    # output projection's float32 gradient on the last stage and the embedding's on the first;
    # DDP beside the pipeline (FSDP2 replicating) holds the same.
    "pp:2 1f1b bf16, wide, vocabulary 4096": (2, _WIDE_CASTS),
    "ddp:2 x pp:2 1f1b bf16, wide, vocabulary 4096": (
        4, ["parallel.strategy=ddp", *_WIDE_CASTS, "train.global_batch_size=8"]),
    # The model outweighing its activations (wide, few tokens): DDP's accumulation into its
    # buckets, the output projection's weight gradient made beside the one it is added into (in
    # bf16 then cast to float32); ZeRO-1's reduce-scatter after backward (the step's peak) and
    # the shards' gradients the optimizer steps with.
    "ddp:2 bf16 accumulation, wide": (2, ["parallel.strategy=ddp", "train.micro_batch_size=2",
                                          *_WIDE]),
    "ddp:2 accumulation, wide": (2, ["parallel.strategy=ddp", "train.micro_batch_size=2",
                                     *_WIDE, "train.precision=fp32"]),
    # DDP beside tensor parallelism (FSDP2 replicating): no flat buffer when the root is gathered
    # for the output projection's backward, nothing prefetched; the first block's float32 copy
    # waiting for its all-reduce at the embedding's backward, beside the embedding's gradient
    # and its output's.
    "ddp:2 x tp:2 bf16, wide": (4, ["parallel.strategy=ddp", "parallel.tp=2", *_WIDE]),
    "zero-1:2 bf16, wide": (2, ["parallel.strategy=ddp", "parallel.sharding=optimizer", *_WIDE]),
    "zero-1:4 fp16 compression, wide": (
        4, ["parallel.strategy=ddp", "parallel.sharding=optimizer", "parallel.compression=fp16",
            *_WIDE]),
    # Sequence parallelism in a pipeline on unsharded weights: a first stage's peak inside its
    # last block's forward (the down projection's output over the whole sequence beside its
    # reduction's copy and shard), its receive buffer the residual gradient alone, not its
    # gathered copy; DDP beside it (FSDP2 replicating) holds the same in forward.
    "pp:2 x tp:2 sp bf16": (4, ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.tp=2",
                                "parallel.sequence_parallel=true", "train.precision=bf16"]),
    "ddp:2 x pp:2 x tp:2 sp bf16": (
        8, ["parallel.strategy=ddp", "parallel.pp=2", "parallel.pp_schedule=1f1b",
            "parallel.tp=2", "parallel.sequence_parallel=true", "train.precision=bf16"]),
    # Zero-bubble schedules: each backward split into an input half and a weight half, the
    # micro-batch's activations and the gradient of every weight's output kept from one to the other.
    "pp:2 zbv": (2, ["parallel.pp=2", "parallel.pp_schedule=zbv", "model.n_layers=4"]),
    "pp:2 zbv bf16": (2, ["parallel.pp=2", "parallel.pp_schedule=zbv", "model.n_layers=4",
                          "train.precision=bf16"]),
    # The last stage's input half frees its micro-batch's float32 log-softmax before the weight half.
    "pp:2 interleaved_zb": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_zb",
                                "model.n_layers=4", "parallel.pp_microbatches=4"]),
    "pp:2 dualpipev": (2, ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "model.n_layers=4",
                           "parallel.pp_microbatches=4"]),
    # DiLoCo: the buffers of the syncs in flight through the step, and the outer sync after it
    # (the peak where the batch is small: pseudo-gradients, their encoding, the mean, the update).
    **DILOCO,
    "pp:2 looped_bfs x fsdp:2 x tp:2 sp bf16": (
        8, ["parallel.pp=2", "parallel.pp_schedule=looped_bfs", "model.n_layers=4",
            "parallel.pp_microbatches=2", "parallel.strategy=fsdp", "parallel.tp=2",
            "parallel.sequence_parallel=true", "train.precision=bf16"]),
}  # fmt: skip


# Where the plan's activations are not yet the checked ones (docs/planning.md lists the differences).
# A pipeline's last stage under autocast with checkpointing: one float32 [tokens, dim] under (2%).
ACTIVATIONS_DIFFER = {("pp:2 1f1b bf16 full AC", 1)}  # (layout, rank)
# Where the plan's peak is not yet within 3% of the checked one (docs/planning.md): none.
PEAK_DIFFERS: set[tuple[str, int]] = set()
# Where a component at the peak is not (the peak is; docs/planning.md): by one residual-stream-
# sized tensor, which input gradients sent back the zero-bubble schedules' runtime still holds,
# and a float32 copy of a stage's input gradient under autocast; and where the step's largest
# point is another block's in the plan than in the check.
COMPONENTS_DIFFER: dict[tuple[str, int], set[str]] = {
    ("pp:2 zbv bf16", 1): {"temporaries"},
    ("pp:2 dualpipev", 1): {"temporaries"},
}


def _ranks(layout: str) -> list[int]:
    """The ranks a layout is checked on: a pipeline's first and last stage; one rank elsewhere."""
    nproc, overrides = CHECKED[layout]
    return [0, nproc - 1] if any(o.startswith("parallel.pp=") for o in overrides) else [nproc - 1]


@pytest.mark.parametrize(
    ("vocab", "where"), [(256, "feed-forward"), (4096, "the embedding's backward")]
)
def test_ddp_beside_a_pipeline_first_stage_is_the_checked_code(vocab: int, where: str) -> None:
    """DDP beside a pipeline is FSDP2 replicating over shard groups of one rank: each shard is
    copied into its parameter without an all-gather (no flat buffer), each unit's float32
    gradients are made as its backward ends, and each reduction's float32 copy is its own output
    (the search's pick for llama3.1-70b on 1,024 GPUs at the default batch is such a layout). The
    first stage's peak and every component within 3%: in its last block's forward (was +5.4%), and
    with a wide vocabulary in the embedding's backward (its gradient in bf16 twice, beside every
    other float32 gradient). The last stage's peak is within 1% but its components are not
    (docs/planning.md)."""
    config = load_config(
        overrides=[*SMALL, "parallel.pp=2", "parallel.pp_schedule=gpipe",
                   "parallel.pp_microbatches=1", "parallel.strategy=ddp", "train.precision=bf16",
                   "data.seq_len=128", "train.global_batch_size=2", f"model.vocab_size={vocab}"]
    )  # fmt: skip
    r = check_rank(config, 4, 1, 0)
    assert r.skipped is None
    assert where in r.peak["predicted_at"]["where"], r.peak
    assert close(r.peak["predicted"], r.peak["checked"]), r.peak
    for name, c in r.components.items():
        assert close(c["predicted"], c["checked"]), (name, c)


@pytest.mark.parametrize("layout", list(CHECKED))
def test_the_plan_is_the_checked_code(layout: str) -> None:
    """The plan against the real code of the same rank, on every layout the check runs:

    - the step's peak, the most alive at once, within 3%, and what is alive then (every component,
      at the checked peak's moment) within 3%, no component predicted and not held or the reverse;
    - the state between steps (parameters, gradients the optimizer steps with, optimizer state,
      FSDP's gathered parameters and RoPE's tables at their own peak) to the byte, the most
      activations alive in backward within 1%;
    - the bytes sent per step to the byte (the loss-parallel cross-entropy's all-reduces, issued
      inside DTensor's dispatch, counted too)."""
    nproc, overrides = CHECKED[layout]
    config = load_config(overrides=[*SMALL, *overrides])
    dims = ParallelDims.from_config(config, nproc)
    for rank in _ranks(layout):
        measured = measure_fake(config, nproc, 1, rank)
        r = check_rank(config, nproc, 1, rank, measured)
        assert r.skipped is None
        peak = r.peak
        apart = COMPONENTS_DIFFER.get((layout, rank), set())
        ok = close(peak["predicted"], peak["checked"]) and all(
            close(c["predicted"], c["checked"]) for n, c in r.components.items() if n not in apart
        )
        assert ok == ((layout, rank) not in PEAK_DIFFERS), (rank, peak, r.components)
        if (layout, rank) in PEAK_DIFFERS:  # the documented miss, no larger
            assert close(peak["predicted"], peak["checked"], 0.04), (rank, peak)
        for name in apart:  # the documented split, no larger; and it is still there
            c = r.components[name]
            assert close(c["predicted"], c["checked"], 0.2), (name, c)
            assert not close(c["predicted"], c["checked"]), (name, c)
        at = dims.coordinates(rank)
        plan = plan_step(
            config, nproc, pp_rank=at["pp"] if dims.pp_enabled else None, shard_rank=at["dp_shard"]
        )
        own = measured["components"]
        assert own["params"] == plan.params_bytes > 0 and own["grads"] == plan.grads_bytes > 0
        assert own["optimizer"] == plan.optimizer_bytes > 0, (own, plan)
        assert own["buffers"] == plan.gathered_bytes + plan.buffers_bytes > 0, (own, plan)
        act = own["activations"]
        kept = abs(plan.activations_bytes - act) <= 0.01 * act
        assert act > 0 and kept == ((layout, rank) not in ACTIVATIONS_DIFFER), (act, plan)
        sent = r.collectives
        if nproc == 1:
            assert sent == {"predicted": 0, "checked": 0}
        else:
            assert sent["predicted"] == sent["checked"] > 0, r.by_collective
        if layout in DILOCO:
            # The outer sync's moment and the outer state in host memory to the byte (a few bytes
            # of scalars aside), and a cycle's syncs and agreements, a step's share, exactly.
            outer = next(m for m in r.timeline if m["moment"] == "outer sync")
            assert abs(outer["predicted"] - outer["checked"]) <= 64, outer
            assert measured["host"] == plan.host_bytes > 0, (measured["host"], plan.host_bytes)
            assert sent["predicted"] == sent["checked"], r.by_collective


@pytest.mark.parametrize(
    "layout", ["diloco:2 int8, 4 fragments, delay 2, eager", "diloco:2 x fsdp:2 int4 bf16"]
)
def test_a_gpus_outer_sync_holds_its_copies_staging_buffers_as_planned(layout: str) -> None:
    """On a GPU DiLoCo's copies to host memory pass through two staging buffers on the device
    (dtlab.train.outer_copies), the size of the rank's largest parameter (its local shard), for
    the outer sync's length: the check with the GPU's copies holds them at the outer sync's
    moment, as the plan for a GPU does (within the same 64 B as the CPU's), and the CPU's holds
    neither."""
    nproc, overrides = DILOCO[layout]
    config = load_config(overrides=[*SMALL, *overrides])
    rank = nproc - 1
    outer: dict[str, dict[str, Any]] = {}
    for target in ("cpu", "cuda"):
        r = check_rank(config, nproc, 1, rank, measure_fake(config, nproc, 1, rank, target), target)
        outer[target] = next(m for m in r.timeline if m["moment"] == "outer sync")
        assert abs(outer[target]["predicted"] - outer[target]["checked"]) <= 64, outer[target]
    dims = ParallelDims.from_config(config, nproc)
    largest = max(s.shard_numel(dims.fsdp_shard) for s in param_shapes(config.model))
    staging = 2 * 4 * largest
    for kind in ("predicted", "checked"):
        assert outer["cuda"][kind] - outer["cpu"][kind] == staging, (kind, outer)


def test_an_uneven_fsdp_split_is_planned_for_each_shard() -> None:
    """Rows that do not divide by the FSDP group leave the last shards fewer real rows (their
    storage is padded): parameters and gradients are the padded chunk on every rank, the optimizer
    state mirrors the real rows, less on the last rank than on the first."""
    config = load_config(
        overrides=[*SMALL, "model.vocab_size=301", "model.ffn_dim=90", "parallel.strategy=fsdp"]
    )
    optimizer = {}
    for rank in (0, 3):
        own = measure_fake(config, 4, 1, rank)["components"]
        plan = plan_step(config, 4, shard_rank=rank)
        assert own["params"] == plan.params_bytes > 0, (rank, own)
        assert own["grads"] == plan.grads_bytes > 0, (rank, own)
        assert own["optimizer"] == plan.optimizer_bytes > 0, (rank, own)
        optimizer[rank] = own["optimizer"]
    assert optimizer[3] < optimizer[0]


def test_layouts_the_check_cannot_run_say_why() -> None:
    for overrides, needle in (
        (["parallel.strategy=ddp", "parallel.compression=fp16"],
         "DDP with parallel.compression = 'fp16' is not checked"),
        (["parallel.strategy=ddp", "train.optimizer=demo"], "'demo' is not checked"),
    ):  # fmt: skip
        config = load_config(overrides=[*SMALL, *overrides])
        assert needle in (check_rank(config, 2, 1, 0).skipped or "")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_each_pipeline_stage_is_checked_with_its_own_plan(schedule: str) -> None:
    """The first and the last stage of a pipeline hold different parts (the embedding; the output
    and the logits of every micro-batch) and, under 1F1B, different micro-batches in flight: each
    checked rank's state is its own stage's plan to the byte, its peak and what is alive then within
    3%, and what it sends (its activations forward or its gradients back) the plan's."""
    config = load_config(
        overrides=[*SMALL, "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                   "parallel.pp_microbatches=4"]
    )  # fmt: skip
    first, last = (check_rank(config, 2, 1, r) for r in (0, 1))
    for r in (first, last):
        assert r.skipped is None
        for name in ("params", "optimizer"):
            assert r.components[name]["predicted"] == r.components[name]["checked"] > 0, name
        for name, c in r.components.items():
            assert close(c["predicted"], c["checked"]), (name, c)
        assert close(r.peak["predicted"], r.peak["checked"]), r.peak
        sends = r.by_collective["send/recv"]
        assert sends["predicted"] == sends["checked"] > 0, sends
    assert first.components["params"]["checked"] != last.components["params"]["checked"]
    assert first.peak["checked"] != last.peak["checked"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_last_stage_holds_each_micro_batchs_logits_once(schedule: str) -> None:
    """Every moment of a pipeline's last stage within 1% of the check, with a vocabulary wide
    enough that a micro-batch's logits are a fifth of its first forward: each forward's logits
    counted once (at its loss), kept to its micro-batch's backward and no longer."""
    config = load_config(
        overrides=[*SMALL, "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                   "parallel.pp_microbatches=4", "model.vocab_size=4096"]
    )  # fmt: skip
    last = check_rank(config, 2, 1, 1)
    assert last.skipped is None
    for moment in last.timeline:
        assert close(moment["predicted"], moment["checked"], 0.01), moment


# Forward under FSDP where a block's parameters outweigh its activations (wide, few tokens):
# (processes, rank, overrides). Flat FSDP fully sharded and shard_grad_op, float32, with tensor
# parallelism, and a pipeline's first and last stage.
WIDE = ["train.precision=bf16", "model.dim=128", "model.ffn_dim=256", "data.seq_len=32"]
_PP_WIDE = ["parallel.strategy=fsdp", "parallel.pp=2", "parallel.pp_schedule=1f1b",
            "model.n_layers=4", "parallel.pp_microbatches=4"]  # fmt: skip
FORWARD_GATHERS = {
    "fsdp:4": (4, 3, ["parallel.strategy=fsdp"]),
    "fsdp:4 shard_grad_op": (4, 3, ["parallel.strategy=fsdp", "parallel.sharding=shard_grad_op"]),
    "fsdp:4 fp32, 3 blocks": (4, 3, ["parallel.strategy=fsdp", "train.precision=fp32",
                                     "model.n_layers=3"]),
    "fsdp:2 x tp:2": (4, 3, ["parallel.strategy=fsdp", "parallel.tp=2"]),
    "pp:2 x fsdp:2, first stage": (4, 0, [*_PP_WIDE, "train.global_batch_size=8"]),
    "pp:2 x fsdp:2, last stage": (4, 3, [*_PP_WIDE, "train.global_batch_size=8"]),
    "pp:2 x fsdp:2 fp32, last stage": (4, 3, [*_PP_WIDE, "train.global_batch_size=8",
                                              "train.precision=fp32"]),
    "pp:3 x fsdp:2, middle stage": (6, 2, ["parallel.strategy=fsdp", "parallel.pp=3",
                                           "parallel.pp_schedule=1f1b", "model.n_layers=6",
                                           "parallel.pp_microbatches=6",
                                           "train.global_batch_size=12"]),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(FORWARD_GATHERS))
def test_forward_under_fsdp_holds_what_the_checked_code_holds(layout: str) -> None:
    """Each moment of forward within 1% of the checked code's, where a block's parameters
    outweigh what it keeps: the block's parameters copied out of its flat all-gather buffer while
    the previous unit's is still alive (torch frees that after the copy-out), the last block's
    flat buffer alive to the end of forward, the root gathered until the output projection's end;
    a pipeline stage's forward after its backward with every unit still gathered and nothing
    gathered again. The flat FSDP rows were up to 16% under before, the pipeline's up to 14%."""
    nproc, rank, extra = FORWARD_GATHERS[layout]
    config = load_config(overrides=[*SMALL, *WIDE, *extra])
    r = check_rank(config, nproc, 1, rank)
    assert r.skipped is None
    forwards = [m for m in r.timeline if m["moment"].startswith("forward")]
    assert len(forwards) == config.parallel.pp_microbatches if config.parallel.pp > 1 else 1
    for moment in forwards:
        assert close(moment["predicted"], moment["checked"], 0.01), moment


def test_the_check_refuses_a_torch_whose_internals_it_was_not_tested_on() -> None:
    from dtlab.analysis.check_fake import TESTED_TORCH, torch_refusal

    assert torch_refusal(f"{TESTED_TORCH[-1]}.0+cpu") is None
    refusal = torch_refusal("2.99.0")
    assert refusal is not None and "torch 2.99.0" in refusal and TESTED_TORCH[-1] in refusal


def test_a_compiled_step_is_checked_eagerly_and_says_so() -> None:
    """Fake tensors do not go through torch.compile: the check runs the eager step against the plan
    of the eager step (within 3%), and its note gives the compiled plan's peak beside it."""
    config = load_config(overrides=[*SMALL, "train.compile=true"])
    r = check_rank(config, 1, 1, 0)
    assert r.skipped is None and r.note is not None and "checked eagerly" in r.note
    assert close(r.peak["predicted"], r.peak["checked"]), r.peak
    eager = load_config(overrides=SMALL)
    assert (
        r.peak["predicted"] == plan_step(eager, 1).total_bytes != plan_step(config, 1).total_bytes
    )


def test_a_fault_tolerant_layout_says_what_the_check_leaves_out() -> None:
    """Fault tolerance's cross-group average runs through torchft, which the check does not run:
    the check says so beside its figures instead of looking complete."""
    config = load_config(
        overrides=[*SMALL, "parallel.strategy=ddp", "parallel.fault_tolerance.enabled=true"]
    )
    r = check_rank(config, 2, 1, 0)
    assert r.skipped is None and r.note is not None
    assert "parallel.fault_tolerance: checked as one replica group" in r.note, r.note
    assert "is planned as a moment of its own, not checked" in r.as_dict()["note"]
    # The plan's moment: torchft's flat copy of every gradient beside the gradients themselves.
    plan = plan_step(config, 1)
    assert plan.timeline is not None
    average = plan.timeline.moments["replica groups' average"]
    assert average.temporaries == average.grads == plan.grads_bytes > 0
    plain = load_config(overrides=[*SMALL, "parallel.strategy=ddp"])
    timeline = plan_step(plain, 1).timeline
    assert timeline is not None
    assert "replica groups' average" not in timeline.moments


def test_ranks_are_parsed_and_refused_with_what_is_allowed() -> None:
    assert parse_ranks(None, 8) == [0, 7]
    assert parse_ranks(None, 1) == [0]
    assert parse_ranks("3,1,3", 8) == [3, 1]
    for text, needle in (("8", "rank 8 is not in a world of 8"), ("a", "'a' is not a rank")):
        with pytest.raises(ConfigError, match=needle):
            parse_ranks(text, 8)


def test_cli_check_json_carries_predicted_and_checked_per_component() -> None:
    proc = run_cli(
        "plan", "--nproc", "4", "--check", "--ranks", "0,3", "--json",
        "--set", *SMALL, "parallel.strategy=fsdp",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    check = json.loads(proc.stdout)["check"]
    assert check["seconds"] > 0 and [r["rank"] for r in check["ranks"]] == [0, 3]
    for r in check["ranks"]:
        assert set(r["components"]) == {
            "params", "grads", "optimizer", "activations", "temporaries", "buffers"
        }  # fmt: skip
        assert all(set(v) == {"predicted", "checked"} for v in r["components"].values())
        assert all(isinstance(n, int) for v in r["components"].values() for n in v.values())
        assert set(r["collectives"]) == {"predicted", "checked"}
        assert r["peak"]["predicted"] > 0 and r["peak"]["checked"] > 0
        assert r["peak"]["checked_at"]["moment"].startswith(("forward", "backward", "after", "opt"))
        assert r["timeline"] and all(m["predicted"] is not None for m in r["timeline"])
    text = run_cli("plan", "--nproc", "4", "--check", "--set", *SMALL, "parallel.strategy=fsdp")
    assert text.returncode == 0 and "rank 3" in text.stdout and "sent/step" in text.stdout


def test_check_runs_the_recommended_layout_or_says_why_not() -> None:
    """--check verifies the layout the search recommends, a pipeline too; one it cannot run (DDP
    with a compression hook) is named with the reason, and the config as given is checked instead
    (here refused too, for the same reason)."""
    fixed = ["parallel.pp=1", "parallel.tp=1", "parallel.strategy=fsdp"]
    proc = run_cli("plan", "--nproc", "4", "--check", "--json", "--set", *SMALL, *fixed)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    label = result["search"]["recommended"]["label"]
    assert result["check"]["layout"] == f"the recommended layout, {label}"
    assert "skipped" not in result["check"]["ranks"][0]
    piped = run_cli("plan", "--nproc", "4", "--check", "--json", "--set", *SMALL, "parallel.pp=2",
                    "parallel.strategy=fsdp")  # fmt: skip
    assert piped.returncode == 0, piped.stderr
    result = json.loads(piped.stdout)
    label = result["search"]["recommended"]["label"]
    assert "pp 2" in label and result["check"]["layout"] == f"the recommended layout, {label}"
    assert all("skipped" not in r for r in result["check"]["ranks"])
    compressed = run_cli("plan", "--nproc", "2", "--check", "--json", "--set", *SMALL,
                         "parallel.strategy=ddp", "parallel.compression=fp16")  # fmt: skip
    assert compressed.returncode == 0, compressed.stderr
    check = json.loads(compressed.stdout)["check"]
    assert check["layout"].startswith("the config as given (the recommended")
    assert "'fp16' is not checked" in check["layout"]


def test_cli_refuses_ranks_outside_the_world_and_ranks_without_check() -> None:
    bad = run_cli("plan", "--nproc", "2", "--check", "--ranks", "2", "--set", *SMALL)
    assert bad.returncode != 0 and "rank 2 is not in a world of 2" in bad.stderr
    assert "Traceback" not in bad.stderr
    alone = run_cli("plan", "--nproc", "2", "--ranks", "1", "--set", *SMALL)
    assert alone.returncode != 0 and "add --check" in alone.stderr


# --- the check against real runs -----------------------------------------------------------------

REAL = {
    "ddp:2": (2, ["parallel.strategy=ddp"]),
    "fsdp:2": (2, ["parallel.strategy=fsdp"]),
    "fsdp:2 no_shard": (2, ["parallel.strategy=fsdp", "parallel.sharding=no_shard"]),
    "zero-1:2": (2, ["parallel.strategy=ddp", "parallel.sharding=optimizer"]),
    "tp:2": (2, ["parallel.tp=2"]),
    "hsdp:2x2": (4, ["parallel.strategy=hsdp", "parallel.replicate=2"]),
    "fsdp:2xtp:2": (4, ["parallel.strategy=fsdp", "parallel.tp=2"]),
    "pp:2 1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "pp:2 gpipe": (
        2,
        ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=4"],
    ),
    # The shards accumulate across micro-batches (the whole unsharded gradients do not).
    "fsdp:2 accumulation": (2, ["parallel.strategy=fsdp", "train.micro_batch_size=1"]),
    "tp:2 sp bf16": (
        2,
        ["parallel.tp=2", "parallel.sequence_parallel=true", "train.precision=bf16"],
    ),
    # A zero-bubble schedule's split backward: torch's module tracker marks each module's backward
    # done at its first input's gradient (check_tracker.split_backward), in both runs alike.
    "pp:2 zbv": (2, ["parallel.pp=2", "parallel.pp_schedule=zbv", "model.n_layers=4"]),
    # DiLoCo's outer state held apart (host memory on a GPU) and its outer sync run after the
    # step, a sync in flight through it, on real values: the same memory and bytes.
    "diloco:2 int8, 2 fragments, delay 1": (
        2,
        [
            "parallel.strategy=ddp",
            "parallel.diloco.inner_steps=4",
            "parallel.diloco.fragments=2",
            "parallel.diloco.delay=1",
            "parallel.diloco.quantize=int8",
            "data.seq_len=16",
            "train.global_batch_size=2",
        ],
    ),
    # Context parallelism's ring where its backward is the step's peak (a long sequence, a narrow
    # feed-forward, full checkpointing): one chunk pair's gradients at a time; with a document
    # mask, the blocks the documents cut take their part of it (the real run's documents are its
    # own random data's, ending at every token 0; the check's end every three quarters of a chunk).
    **{
        f"cp:2 ring full AC{name}": (
            2,
            [
                "parallel.strategy=ddp",
                "parallel.cp=2",
                "train.activation_checkpointing=full",
                "model.dim=128",
                "model.n_heads=8",
                "model.n_kv_heads=2",
                "model.ffn_dim=64",
                "model.max_seq_len=1024",
                "data.seq_len=1024",
                "train.global_batch_size=2",
                *mask,
            ],
        )
        for name, mask in (("", []), (", document mask", ["data.document_mask=true"]))
    },
    # A large vocabulary and few tokens: the root's float32 reduce-scatter input beside its
    # unsharded gradients at backward's end, its flat all-gather buffer beside it in forward.
    "fsdp:2 bf16 large vocabulary": (
        2,
        [
            "parallel.strategy=fsdp",
            "train.precision=bf16",
            "model.vocab_size=8192",
            "model.tie_embeddings=false",
            "data.seq_len=16",
            "train.global_batch_size=2",
        ],
    ),
    # Each stage's gradients reduced after its own last backward, between the other's backwards.
    "pp:2 interleaved x fsdp:2 bf16": (
        4,
        [
            "parallel.pp=2",
            "parallel.pp_schedule=interleaved_1f1b",
            "model.n_layers=4",
            "parallel.pp_microbatches=2",
            "parallel.strategy=fsdp",
            "train.precision=bf16",
        ],
    ),
}


# Where a real gloo run holds more than the check at the peak (docs/planning.md): after a stage's
# gradient reduction a real run keeps a residual-stream-sized tensor per stage reduced (its size
# follows the tokens and the model's width, not the vocabulary; 32 KiB here) that the fake process
# group's run has freed: the peak's temporaries within 4%, the peak within 1%.
REAL_DIFFERS: dict[str, dict[str, float]] = {
    "pp:2 interleaved x fsdp:2 bf16": {"temporaries": 0.04}
}
# gloo's reduce-scatter all-reduces a copy of its input, made when its work is waited and held
# while the work is (measured); NCCL's, which the check's fake group stands for, reduces in place.
# Where the root's reduce-scatter is the step's peak, a real gloo rank holds that copy more:
# the root's float32 elements (embedding, output, final norm) once.
GLOO_COPY = {"fsdp:2 bf16 large vocabulary": 4 * (2 * 8192 * 64 + 64)}
# On real tensors the autograd engine sometimes runs the next block's pre-backward hooks (FSDP's
# copy-out of the block below) before it frees the last tensors the block above saved, in some
# micro-batches of some runs and not others (measured: 2,506,344 or 2,556,008 B on either rank of
# the same config, with this code and before it): the peak within 2.5% there, not 1%.
REORDERED = {"fsdp:2 accumulation": 0.025}


@pytest.mark.parametrize("layout", list(REAL))
def test_a_checked_rank_holds_and_sends_what_a_real_rank_does(tmp_path: Path, layout: str) -> None:
    """The same config run for real (gloo processes, real tensors) and checked (fake group, fake
    tensors), both measured with MemTracker: the state and buffers to the byte, activations within
    2%, the step's peak and what is alive then (every component) within 1%, and every collective's
    bytes equal, on every rank. (Before DTensor's sharding propagation ran apart from the check's
    fake mode, tensor parallelism's fake peak counted whole-vocabulary shadows of the loss.)"""
    nproc, extra = REAL[layout]
    overrides = [*SMALL, *extra]
    run_worker("check_worker.py", nproc, str(tmp_path), *overrides)
    config = load_config(overrides=overrides)
    for rank in range(nproc):
        real: dict[str, Any] = json.loads((tmp_path / f"rank{rank}.json").read_text())
        fake = measure_fake(config, nproc, 1, rank)
        for name in ("params", "grads", "optimizer", "buffers"):
            assert real["components"][name] == fake["components"][name], (rank, name)
        r, f = real["components"]["activations"], fake["components"]["activations"]
        assert abs(r - f) <= 0.02 * r, (rank, r, f)
        real_peak = max(real["timeline"].values(), key=lambda m: m["total"])
        fake_peak = max(fake["timeline"].values(), key=lambda m: m["total"])
        copy = GLOO_COPY.get(layout, 0)
        within = REORDERED.get(layout, 0.01)
        assert close(fake_peak["total"] + copy, real_peak["total"], within), (rank, real_peak)
        # (Where the engine's order decides the moment, what is alive then is that order's.)
        for name, n in real_peak["components"].items() if layout not in REORDERED else ():
            within = REAL_DIFFERS.get(layout, {}).get(name, 0.01)
            held = fake_peak["components"][name] + (copy if name == "temporaries" else 0)
            assert close(held, n, within), (rank, name, real_peak, fake_peak)
        assert fake["collectives"] == real["collectives"]
        assert fake["host"] == real["host"]  # DiLoCo's outer state (0 without)
        if config.parallel.pp > 1:
            # Through the optimizer step a pipeline rank holds the schedule's receive buffers
            # (and sent gradients) as the plan does, and no micro-batch's logits: returned by
            # the schedule, the last stage's would all be alive to the next step.
            at = ParallelDims.from_config(config, nproc).coordinates(rank)
            plan = plan_step(config, nproc, pp_rank=at["pp"], shard_rank=at["dp_shard"])
            moment = plan.timeline.at("optimizer")
            assert moment is not None
            held = real["timeline"]["optimizer"]["components"]
            assert close(moment.activations, held["activations"], 0.01), (rank, held, moment)
            assert close(moment.total, real["timeline"]["optimizer"]["total"], 0.01), rank


def test_a_later_micro_batchs_backward_holds_the_cast_weights_gradients_to_its_end(
    tmp_path: Path,
) -> None:
    """A pipeline's one autocast region casts each weight at the stage's first forward; every
    later micro-batch's graph reuses that cast, whose autograd node is older than all of its own,
    so its backward casts the weights' half-precision gradients to float32 only at its end: all
    of them alive together then (the last stage's peak, the output projection's float32 gradient
    beside them) and at the first stage's embedding's backward. Real gloo processes hold, in the
    second micro-batch's backward, what the plan predicts within 1% (it was 9-10% under)."""
    nproc, extra = CHECKED["pp:2 1f1b bf16, wide, vocabulary 4096"]
    overrides = [*SMALL, *extra]
    run_worker("check_worker.py", nproc, str(tmp_path), *overrides)
    config = load_config(overrides=overrides)
    wheres = ["the embedding's backward", "the cast weights' gradients cast to float32"]
    for rank, where in enumerate(wheres):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())["timeline"]["backward 2"]
        plan = plan_step(config, nproc, pp_rank=rank).timeline
        assert plan.peak.name == "backward 2" and plan.peak.where == where, plan.peak
        assert close(plan.peak.total, real["total"], 0.01), (rank, plan.peak, real)
        assert close(plan.peak.temporaries, real["components"]["temporaries"], 0.01), rank


def test_a_real_fsdp_forward_holds_the_previous_units_buffer_as_it_copies_out(
    tmp_path: Path,
) -> None:
    """The buffer the check finds alive beside a block's copy-out in forward (the previous unit's
    all-gather buffer, which torch frees after the copy-out) is a real rank's too: gloo processes
    with real tensors hold at forward's peak what the fake group's check holds and the plan
    predicts, each within 1% (forward is gloo's and NCCL's alike: no reduce-scatter in it)."""
    nproc, extra = CHECKED["fsdp:4 bf16, wide, few tokens"]
    overrides, rank = [*SMALL, *extra], nproc - 1
    run_worker("check_worker.py", nproc, str(tmp_path), *overrides)
    real = json.loads((tmp_path / f"rank{rank}.json").read_text())["timeline"]["forward 1"]
    config = load_config(overrides=overrides)
    checked = measure_fake(config, nproc, 1, rank)["timeline"]["forward 1"]
    plan = plan_step(config, nproc, shard_rank=rank).timeline.at("forward 1")
    assert plan is not None and plan.where == "block 1's all-gather", plan
    assert close(checked["total"], real["total"], 0.01), (checked, real)
    assert close(plan.total, real["total"], 0.01), (plan, real)


# Layouts the check cannot run (DDP's compression hooks wait on a result the fake group's work
# does not carry): run for real and measured as the check measures, against the plan.
UNCHECKED_REAL = {
    "ddp:2 bf16 compression": (2, ["parallel.strategy=ddp", "parallel.compression=bf16"]),
    "ddp:2 fp16 compression, bf16": (
        2,
        ["parallel.strategy=ddp", "parallel.compression=fp16", "train.precision=bf16"],
    ),
    # Hooks that keep state from step to step (the optimizer's component, as the plan counts it):
    # PowerSGD's error feedback and P and Q (from its start step on), the DCT's residuals or EF21
    # estimates and its basis.
    "ddp:2 powersgd, small buckets": (
        2,
        [
            "parallel.strategy=ddp",
            "parallel.compression=powersgd",
            "parallel.compression_options.start_step=2",
            "parallel.bucket_mb=0.1",
        ],
    ),
    # Few tokens: the hook's work on the model's one bucket is the step's peak.
    "ddp:2 powersgd, its work the peak": (
        2,
        [
            "parallel.strategy=ddp",
            "parallel.compression=powersgd",
            "parallel.compression_options.start_step=2",
            "data.seq_len=16",
            "train.global_batch_size=2",
        ],
    ),
    # Without warm_start the hook makes P and Q anew each step and keeps none.
    "ddp:2 powersgd, no warm start": (
        2,
        [
            "parallel.strategy=ddp",
            "parallel.compression=powersgd",
            "parallel.compression_options.start_step=2",
            "parallel.compression_options.warm_start=false",
        ],
    ),
    "ddp:2 dct": (2, ["parallel.strategy=ddp", "parallel.compression=dct"]),
    "ddp:2 dct quant": (
        2,
        [
            "parallel.strategy=ddp",
            "parallel.compression=dct",
            "parallel.compression_options.coding=quant",
        ],
    ),
}


@pytest.mark.parametrize("layout", list(UNCHECKED_REAL))
def test_a_layout_the_check_cannot_run_is_planned_as_a_real_run_measures(
    tmp_path: Path, layout: str
) -> None:
    """DDP with a compression hook, run for real on gloo and measured with MemTracker as the check
    measures (its fourth step, PowerSGD's second compressed one): every rank's state between steps
    to the byte (the hook's with the optimizer's), and the largest rank's peak and what is alive
    then within 3% of the plan's (the quantised DCT's at its work on the model's one bucket, every
    rank's coefficients decoded one after another)."""
    nproc, extra = UNCHECKED_REAL[layout]
    overrides = [*SMALL, *extra]
    config = load_config(overrides=overrides)
    assert check_rank(config, nproc, 1, 0).skipped  # the check refuses it
    run_worker("check_worker.py", nproc, str(tmp_path), "--steps=4", *overrides)
    plan = plan_step(config, nproc, device_type="cpu")
    peaks = []
    for rank in range(nproc):
        real: dict[str, Any] = json.loads((tmp_path / f"rank{rank}.json").read_text())
        own = real["components"]
        for name, planned in planned_state(plan).items():
            assert own[name] == planned > 0, (rank, name, own[name], planned)
        peaks.append(max(real["timeline"].values(), key=lambda m: m["total"]))
    # The plan's is the largest rank's (the quantised DCT's ranks add their own payload's decoding
    # to their estimate at their own turn: the first rank holds it the longest).
    peak = max(peaks, key=lambda m: m["total"])
    at = plan.timeline.peak
    if "powersgd" in layout and at.where == "DDP's communication hook on its bucket":
        # torch's hook makes its new error in its all-reduces' last callback: on the training
        # thread when they are done by the time it is attached, else on gloo's, where MemTracker
        # (a dispatch mode of the training thread) does not see it. The memory is held either way.
        error = plan.grads_bytes  # the bucket's size: every float32 gradient
        unseen = peak["components"]["temporaries"] + error
        if close(unseen, at.temporaries, 0.03) and not close(unseen - error, at.temporaries, 0.03):
            peak = {**peak, "total": peak["total"] + error}
            peak["components"] = {**peak["components"], "temporaries": unseen}
    assert close(plan.total_bytes, peak["total"], 0.03), (plan.total_bytes, peaks)
    # The rank's window of token ids (int64, its samples x (seq + 1)), alive through the step and
    # not planned, shows among a few tokens' activations.
    window = 8 * config.train.global_batch_size // nproc * (config.seq_len + 1)
    for name, n in peak["components"].items():
        planned = getattr(at, name)
        assert close(planned, n, 0.03) or abs(planned - n) <= window, (name, n, at)


@pytest.mark.slow
def test_one_rank_of_a_70b_model_on_1024_ranks_is_checked() -> None:
    """llama3.1-70b, FSDP 128 x TP 8 over 128 nodes of 8, bf16, full checkpointing, 8,192 tokens:
    rank 0's real code runs (its 1/1,024 of the model, fake), its state is the plan's to the byte,
    its peak and what is alive then within 3%. (Its time and memory are figures in
    docs/planning.md, not asserted here.)"""
    config = load_config(
        overrides=[
            "model.preset=llama3.1-70b", "parallel.strategy=fsdp", "parallel.tp=8",
            "train.precision=bf16", "train.activation_checkpointing=full", "data.seq_len=8192",
            "train.global_batch_size=128",
        ]
    )  # fmt: skip
    measured = measure_fake(config, 8, 128, 0)
    r = check_rank(config, 8, 128, 0, measured)
    assert r.skipped is None
    plan = plan_step(config, 1024, shard_rank=0)
    own = measured["components"]
    assert own["params"] == plan.params_bytes and own["grads"] == plan.grads_bytes
    assert own["optimizer"] == plan.optimizer_bytes
    assert own["params"] * 1024 >= 4 * 70e9 * 0.95  # ~1/1,024 of 70B float32
    # The peak comes in the norm's backward of the block below the last (its float32 [tokens,
    # dim] temporaries, the last block's reduce-scatter input beside them).
    assert close(r.peak["predicted"], r.peak["checked"]), r.peak
    for name, c in r.components.items():
        assert close(c["predicted"], c["checked"]), (name, c)
    sent = r.collectives
    assert sent["checked"] > 0 and abs(sent["predicted"] - sent["checked"]) <= 0.1 * sent["checked"]
