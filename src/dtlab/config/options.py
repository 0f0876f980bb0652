"""The config's option groups: the sub-sections of train and parallel (train.demo, train.float8,
parallel.compression_options, parallel.diloco, parallel.fault_tolerance), each field with its
description."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dtlab.config.values import _Section


class DemoOptions(_Section):
    """Options of train.optimizer = demo (decoupled momentum: compressed momentum, sign step)."""

    chunk_size: int = Field(
        64,
        ge=2,
        le=65536,
        description="Length of the chunks each parameter's momentum is cut into.",
    )
    topk: int = Field(
        8, ge=1, description="DCT coefficients of each chunk sent per step (the largest)."
    )
    decay: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="How much of the momentum not yet sent is kept from one step to the next.",
    )


class Float8Options(_Section):
    """train.float8: the blocks' linear layers trained in float8 through torchao, the rest in bf16."""

    enabled: bool = Field(
        False,
        description="Train the blocks' linear layers (attention q/k/v/o, the dense feed-forward's "
        "w1/w2/w3) in float8 through torchao's Float8Linear, the rest (embeddings, norms, attention, "
        "the output projection, a router and MoE experts) as train.precision = bf16 does; needs "
        "train.precision = bf16 and pip install 'dtlab[float8]'.",
    )
    recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise",
        description="Scaling: tensorwise (one scale a tensor; FSDP can all-gather the weights in "
        "float8) or rowwise (a scale a row; more accurate, all-gathers in bf16).",
    )
    all_gather: bool = Field(
        True,
        description="Under FSDP, all-gather the weights in float8 (half of bf16's bytes), with their "
        "scales computed once after each optimizer step (tensorwise only).",
    )
    emulate: Literal["auto", "on", "off"] = Field(
        "auto",
        description="auto: emulated (float8 casts, GEMMs in higher precision) where the device has no "
        "float8 GEMM (CPU; GPUs before compute capability 8.9), else native; on: always emulated.",
    )


class CompressionOptions(_Section):
    """Options of parallel.compression = powersgd / dct."""

    rank: int = Field(4, ge=1, description="powersgd: rank of the low-rank approximation.")
    start_step: int = Field(
        10, ge=2, description="powersgd: plain all-reduce for the first N steps, then compress."
    )
    warm_start: bool = Field(
        True, description="powersgd: reuse last step's Q as the starting point."
    )
    chunk_size: int = Field(
        64, ge=2, description="dct: length of the chunks the bucket is cut into."
    )
    topk: int = Field(
        4, ge=1, description="dct: DCT coefficients sent per chunk (largest magnitudes)."
    )
    error_feedback: bool = Field(
        True,
        description="powersgd/dct: keep what was not sent and add it to the next step's gradient.",
    )
    coding: Literal["topk", "quant"] = Field(
        "topk",
        description="dct: topk sends the topk largest coefficients of each chunk as (index, value) "
        "pairs; quant sends every coefficient in `bits` bits with one bf16 step per chunk, with EF21 "
        "error feedback (each rank tracks its gradient and sends the quantised change).",
    )
    bits: int = Field(3, ge=2, le=4, description="dct coding quant: bits per coefficient.")


class DiLoCoOptions(_Section):
    """DiLoCo: each replica trains alone for inner_steps, then the replicas average their pseudo-
    gradients (the change since the last sync) and an outer Nesterov step updates the shared weights;
    Streaming DiLoCo syncs fragments of the model at staggered steps, overlapped with the next ones."""

    inner_steps: int = Field(
        0, ge=0, description="H: inner optimizer steps between syncs of each fragment; 0 = off."
    )
    # The replicas' plain average by default: on two shapes over 3 seeds it held where the DiLoCo
    # paper's (0.7, 0.9) cost up to 25% (docs/compression.md); that setting suits H in the hundreds.
    outer_lr: float = Field(1.0, gt=0, description="Outer learning rate (1 = take the average).")
    outer_momentum: float = Field(
        0.0, ge=0, lt=1, description="Outer Nesterov momentum; 0 = plain outer SGD."
    )
    replicas: int | None = Field(
        None,
        ge=1,
        description="Replica groups DiLoCo averages over, each of world / replicas contiguous "
        "data-parallel ranks laid out by parallel.strategy (ddp, fsdp or hsdp inside a replica); "
        "null = one per data-parallel rank.",
    )
    fragments: int = Field(
        1,
        ge=1,
        description="Streaming DiLoCo: the blocks in this many contiguous fragments, each synced at "
        "its own step of the H-step cycle; 1 = the whole model at once.",
    )
    delay: int = Field(
        0,
        ge=0,
        description="Streaming DiLoCo: inner steps the outer all-reduce of a fragment overlaps with; "
        "its result is applied that many steps later (0 = at once). Less than inner_steps.",
    )
    eager: bool = Field(
        False,
        description="With delay: the replica continues at once from an estimate of the outer step, "
        "its own pseudo-gradient's share of the mean plus the other replicas' share of the "
        "fragment's last sync (eager updates), replaced by the true step when the sync lands; "
        "with delay 0 it is the plain outer step.",
    )
    quantize: Literal["none", "int8", "int4", "int2", "int1"] = Field(
        "none",
        description="Outer gradients sent in 8, 4 or 2 bits per value (symmetric: int2 is ternary, "
        "-s, 0, s; one float32 scale per 64 values), with error feedback (what rounding lost is added "
        "to the next sync). With topk: the sent values' bits (sign and magnitude, one float32 scale "
        "per chunk); int1 (the sign, times the chunk's mean magnitude) only with topk.",
    )
    topk: float = Field(
        0.0,
        ge=0,
        le=1,
        description="SparseLoCo: the fraction of each chunk's outer-gradient values sent (the "
        "largest in magnitude, with their indices), the rest kept in the error feedback; "
        "0 = every value (dense).",
    )
    chunk: int = Field(
        4096,
        ge=2,
        le=1 << 24,
        description="SparseLoCo: values per chunk the top-k is taken in (indices of "
        "ceil(log2 chunk) bits).",
    )
    error_decay: float = Field(
        1.0,
        gt=0,
        le=1,
        description="beta of the error feedback of quantised or sparse outer gradients: "
        "e = beta e + delta before each send (SparseLoCo's stand-in for outer momentum; 1 = "
        "plain error feedback).",
    )


class FaultToleranceOptions(_Section):
    """Fault-tolerant replica groups on torchft: each data-parallel replica group is its own world,
    restarted alone by its own elastic agent; a lighthouse forms a quorum of the live groups at every
    step, the gradient average is over the groups that took part, and a group that comes back
    recovers the model and optimizer state from a live peer (docs/fault-tolerance.md)."""

    enabled: bool = Field(
        False,
        description="Fault-tolerant replica groups (ddp: one per data-parallel rank, with its tp "
        "ranks; hsdp: one per replicate group).",
    )
    min_replicas: int = Field(
        1,
        ge=1,
        description="Replica groups a step needs to commit (and the lighthouse to form a quorum).",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        le=86400,
        description="A collective, commit vote or recovery across replica groups that takes longer "
        "fails the step there; a hung group is dropped after it (and the step taken again).",
    )
    quorum_timeout_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        description="How long a replica group waits for a quorum (at the first step: for every "
        "group to start) before it fails.",
    )
    quorum_deadline_s: float | None = Field(
        600.0,
        gt=0,
        le=604800,
        description="A replica group that has not been in a quorum for this long (since its start or "
        "its last quorum: the lighthouse unreachable, too few groups live for min_replicas) stops "
        "with an error that says so, and the others carry on; null = it waits for ever.",
    )
    heartbeat_timeout_s: float = Field(
        2.0,
        gt=0,
        le=3600,
        description="The lighthouse counts a replica group silent this long as gone.",
    )
    lighthouse: str | None = Field(
        None,
        description="The lighthouse's address (http://HOST:PORT) for groups started elsewhere; null = "
        "dtlab train starts one on 127.0.0.1 (dtlab launch: one per job).",
    )
    max_restarts: int = Field(
        10,
        ge=0,
        description="Restarts of each replica group by its own elastic agent (the others train on).",
    )
    warm_restart: bool = Field(
        True,
        description="dtlab train: start the groups' ranks, and a killed group's new ones, from a fork "
        "server that has imported torch and dtlab once (seconds sooner back) instead of fresh "
        "interpreters (Linux; not in a Slurm job).",
    )
