"""Cross-field rules kept apart from the schema: pipeline, ZeRO-1, OOM retry, DiLoCo, TP, MLX, and the
rules that also need the world size."""

from __future__ import annotations

from typing import Any

from dtlab.config.schema import CROSS_RULES, Config, refuse
from dtlab.config.sections import ModelConfig, ParallelConfig
from dtlab.config.values import SINGLE_STAGE_SCHEDULES, show
from dtlab.dims import DPWrapper, ParallelDims, needs_replica_groups, strategies_with
from dtlab.errors import ConfigError

V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank, placed in a V
ZERO_BUBBLE_SCHEDULES = (
    "interleaved_zb",
    "zbv",
    "dualpipev",
)  # backward split into input and weight


def _check_pp(c: Config) -> None:
    """What pipeline parallelism needs of the model and the rest of the config."""
    m, p, t = c.model, c.parallel, c.train
    if p.pp == 1:
        return
    v = p.stages_per_rank
    if p.pp_schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        raise ValueError(
            f"parallel.pp_schedule = {p.pp_schedule!r} runs one stage per rank; "
            f"parallel.pp_stages_per_rank = {v} (allowed: 1, or a schedule for several: "
            "interleaved_1f1b, looped_bfs, interleaved_zb)"
        )
    if p.pp_schedule in V_SCHEDULES and v != 2:
        raise ValueError(
            f"parallel.pp_schedule = {p.pp_schedule!r} places two stages per rank in a V; "
            f"parallel.pp_stages_per_rank = {v} (allowed: 2)"
        )
    if p.pp_schedule in ZERO_BUBBLE_SCHEDULES and DPWrapper.of(p.strategy) is not DPWrapper.NONE:
        # Their split backward (input gradients first, weight gradients later) leaves FSDP's gradient
        # reduction with partial weight gradients: measured, the training differs from one process's.
        raise ValueError(
            f"parallel.pp_schedule = {p.pp_schedule!r} (zero bubble) is not supported with data "
            f"parallelism (parallel.strategy = {p.strategy!r}); allowed with it: gpipe, 1f1b, "
            "interleaved_1f1b, looped_bfs; or parallel.strategy = 'single'"
        )
    if p.pp_schedule in ZERO_BUBBLE_SCHEDULES and t.activation_checkpointing != "none":
        # Measured on the debug model (`dtlab plan --check`, and a real gloo run the same): the
        # weight half recomputes a checkpointed block once per weight of it (9 times a block) and
        # holds every recomputation at once, 13.0 MB against 8.8 MB without checkpointing; under
        # selective checkpointing the second recomputation fails in torch's checkpoint.
        raise ValueError(
            f"parallel.pp_schedule = {p.pp_schedule!r} (zero bubble) is not supported with "
            f"train.activation_checkpointing = {t.activation_checkpointing!r}: its weight-gradient "
            "half recomputes each checkpointed block once per weight and holds every "
            "recomputation at once (more memory than no checkpointing; selective fails); allowed: "
            "activation_checkpointing 'none', or a schedule with whole backwards (gpipe, 1f1b, "
            "interleaved_1f1b, looped_bfs)"
        )
    if p.pp * v > m.n_layers:
        raise ValueError(
            f"parallel.pp = {p.pp} x {v} stages per rank = {p.pp * v} stages, but model.n_layers = "
            f"{m.n_layers}: each stage needs at least one block"
        )
    if m.tie_embeddings and p.pp_schedule in V_SCHEDULES:
        raise ValueError(
            f"model.tie_embeddings = true is not supported with parallel.pp_schedule = "
            f"{p.pp_schedule!r}: a V places the first and the last stage on one rank, and the "
            "last stage's copy of the tied embedding is kept equal to the embedding across two "
            "ranks only (allowed: gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zb; or "
            "model.tie_embeddings = false)"
        )
    refused: dict[str, tuple[bool, str, str]] = {
        "train.precision": (t.precision == "fp16", "'fp16'", "fp32, bf16"),
        "train.optimizer": (t.optimizer == "demo", "'demo'", "adamw, sgd, muon"),
        "parallel.compression": (p.compression != "none", repr(p.compression), "none"),
        "train.engine": (t.engine == "mlx", "'mlx'", "torch"),
    }
    for key, (bad, shown, allowed) in refused.items():
        if bad:
            raise ValueError(
                f"{key} = {shown} is not supported with parallel.pp = {p.pp} (allowed: {allowed})"
            )


def pipeline_microbatches(config: Config, dp: int) -> int:
    """Pipeline micro-batches per step on each of ``dp`` data-parallel ranks (``parallel.pp`` > 1);
    a ConfigError when they do not split the rank's share of the batch."""
    p, t = config.parallel, config.train
    share = t.global_batch_size // dp
    if p.pp_microbatches is not None:
        n, key = p.pp_microbatches, f"parallel.pp_microbatches = {p.pp_microbatches}"
    elif t.micro_batch_size is not None:
        n, key = share // t.micro_batch_size, f"train.micro_batch_size = {t.micro_batch_size}"
    else:
        n, key = p.pp, f"parallel.pp = {p.pp} (the default micro-batch count)"
    if n < 1 or share % n:
        raise ConfigError(
            f"{key}: {n} pipeline micro-batches do not split each data-parallel rank's {share} "
            f"samples (train.global_batch_size = {t.global_batch_size} over {dp} ranks); use "
            "parallel.pp_microbatches that divides it"
        )
    return n


def schedule_refusal(schedule: str, pp: int, n_stages: int, n_microbatches: int) -> str | None:
    """Why ``torch.distributed.pipelining``'s ``schedule`` refuses ``n_microbatches`` micro-batches
    over ``pp`` ranks holding ``n_stages`` stages in all, or None when it runs them.

    These are the checks torch's schedule constructors make (torch 2.13; tests/test_plan_search.py
    compares this function with the constructors themselves over a grid of counts), stated here so
    that :func:`check_world` refuses a config before any process starts, and ``dtlab plan``'s search,
    which runs :func:`check_world` on every candidate, never offers one the trainer refuses.
    """
    if schedule in ("1f1b", "dualpipev") and n_microbatches < n_stages:
        # 1F1B's warm-up runs one forward per stage ahead of the first backward.
        return (
            f"{schedule} needs at least as many micro-batches as stages: {n_microbatches} "
            f"micro-batches for {n_stages} stages"
        )
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        # Micro-batches go round the pp ranks in rounds of equal size (torch's "flex" interleaving).
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            return (
                f"{schedule} runs the micro-batches in rounds of equal size, max(1, micro-batches // "
                f"pp) = {rounds} rounds here, and {n_microbatches} micro-batches are not a multiple "
                f"of {rounds}"
            )
    return None


def check_pipeline_schedule(config: Config, dp: int) -> None:
    """That the pipeline schedule runs this config's micro-batch count (:func:`schedule_refusal`),
    on ``dp`` data-parallel ranks; a ConfigError naming the counts that would run."""
    p, t = config.parallel, config.train
    n = pipeline_microbatches(config, dp)
    n_stages = p.pp * p.stages_per_rank
    why = schedule_refusal(p.pp_schedule, p.pp, n_stages, n)
    if why is None:
        return
    share = t.global_batch_size // dp
    counts = [
        m for m in range(1, share + 1)
        if share % m == 0 and schedule_refusal(p.pp_schedule, p.pp, n_stages, m) is None
    ]  # fmt: skip
    allowed = (
        f"parallel.pp_microbatches {_or(counts[-4:])} (dividing each data-parallel rank's {share} "
        "samples)"
        if counts
        else f"a larger train.global_batch_size than {t.global_batch_size}"
    )
    raise ConfigError(
        f"parallel.pp_schedule = {p.pp_schedule!r} with {n} pipeline micro-batches on parallel.pp "
        f"= {p.pp}: {why}; allowed: {allowed}, or another parallel.pp_schedule (gpipe and looped_bfs "
        "take any count)"
    )


def _plain_data_parallel(c: Config) -> dict[str, tuple[bool, str, str]]:
    """What ZeRO-1 and OOM retry both refuse, as key -> (refused, value shown, allowed): anything but
    the torch engine's plain data parallelism with a gradient all-reduce (DeMo and DiLoCo exchange
    something else; tensor and pipeline parallelism meet inside forward and backward)."""
    p, t = c.parallel, c.train
    return {
        "train.optimizer": (t.optimizer == "demo", "'demo'", "adamw, sgd, muon"),
        "parallel.diloco.inner_steps": (p.diloco.inner_steps > 0, str(p.diloco.inner_steps), "0"),
        "parallel.tp": (p.tp > 1, str(p.tp), "1"),
        "parallel.pp": (p.pp > 1, str(p.pp), "1"),
        "train.engine": (t.engine == "mlx", "'mlx'", "torch"),
    }


def _check_zero1(c: Config) -> None:
    """ZeRO-1 (parallel.sharding = 'optimizer') shards DDP's optimizer state, and only that."""
    p = c.parallel
    if p.sharding != "optimizer":
        return
    wrapper = DPWrapper.of(p.strategy)
    if wrapper is DPWrapper.FSDP:
        raise ValueError(
            f"parallel.sharding = 'optimizer' (ZeRO-1) shards DDP's optimizer state; parallel.strategy "
            f"= {p.strategy!r} allows: full, shard_grad_op, no_shard (or use parallel.strategy = 'ddp')"
        )
    if wrapper is DPWrapper.NONE:
        # One process (or only model-parallel ranks) holds the whole optimizer state: nothing to shard.
        raise ValueError(
            f"parallel.sharding = 'optimizer' (ZeRO-1) shards DDP's optimizer state over its ranks; "
            f"parallel.strategy = {p.strategy!r} has none (allowed: parallel.strategy = 'ddp', or "
            "leave parallel.sharding unset)"
        )
    refused: dict[str, tuple[bool, str, str]] = {
        **_plain_data_parallel(c),
        # Its gradients are reduce-scattered, not all-reduced through DDP's communication hooks.
        "parallel.compression": (
            p.compression in ("powersgd", "dct"),
            repr(p.compression),
            "none, fp16, bf16",
        ),
    }
    for key, (bad, shown, allowed) in refused.items():
        if bad:
            raise ValueError(
                f"{key} = {shown} is not supported with parallel.sharding = 'optimizer' (ZeRO-1 "
                f"over DDP's ranks; allowed: {allowed})"
            )


def _check_oom_retry(c: Config) -> None:
    """OOM retry agrees on the step before the gradient sync: layouts whose only collectives in
    forward and backward are that sync (one process, DDP)."""
    p, t = c.parallel, c.train
    if not t.oom_retry:
        return
    refused: dict[str, tuple[bool, str, str]] = {
        "parallel.strategy": (
            DPWrapper.of(p.strategy) is DPWrapper.FSDP,
            repr(p.strategy),
            "single, ddp",
        ),
        "parallel.compression": (
            p.compression not in ("none", "fp16", "bf16"),
            repr(p.compression),
            "none, fp16, bf16",
        ),
        **_plain_data_parallel(c),
    }
    for key, (bad, shown, allowed) in refused.items():
        if bad:
            raise ValueError(
                f"train.oom_retry = true with {key} = {shown}: a step is taken again only where the "
                "ranks meet nowhere before the gradient sync (a rank out of memory in FSDP's "
                f"all-gathers or a pipeline would leave the others waiting); allowed: {allowed}"
            )


def _check_diloco(c: Config) -> None:
    """DiLoCo's rules: replicas of data-parallel ranks that train alone between syncs (how many ranks
    a replica has, and that the strategy can lay them out, is checked with the world size)."""
    o, p, t = c.parallel.diloco, c.parallel, c.train
    if not o.inner_steps:
        return
    for key, value, off in (
        ("parallel.compression", p.compression, "none"),
        ("train.optimizer", t.optimizer, None),
        ("train.engine", t.engine, "torch"),
    ):
        if key == "train.optimizer" and value == "demo":
            raise ValueError(
                "parallel.diloco replaces the gradient all-reduce, and so does train.optimizer = 'demo' "
                "(allowed with DiLoCo: adamw, sgd, muon)"
            )
        if off is not None and value != off:
            raise ValueError(
                f"parallel.diloco.inner_steps = {o.inner_steps} with {key} = {value!r}: "
                f"allowed with DiLoCo: {off}"
            )
    if p.tp > 1 or p.pp > 1:
        raise ValueError(
            f"parallel.diloco with parallel.tp = {p.tp}, parallel.pp = {p.pp}: DiLoCo runs over "
            "data-parallel replicas only (allowed: tp = pp = 1)"
        )
    if o.fragments > c.model.n_layers:
        raise ValueError(
            f"parallel.diloco.fragments = {o.fragments} is more than the model's "
            f"{c.model.n_layers} layers (each fragment holds at least one block)"
        )
    if o.fragments > o.inner_steps:
        raise ValueError(
            f"parallel.diloco.fragments = {o.fragments} is more than inner_steps = {o.inner_steps}: "
            "each fragment syncs at its own step of the H-step cycle"
        )
    if o.delay >= o.inner_steps:
        raise ValueError(
            f"parallel.diloco.delay = {o.delay} must be less than inner_steps = {o.inner_steps}: a "
            "fragment's sync must land before its next one starts"
        )
    if o.quantize == "int1" and not o.topk:
        raise ValueError(
            "parallel.diloco.quantize = 'int1' sends signs only, which needs a sparse outer gradient "
            "(parallel.diloco.topk > 0); allowed without topk: none, int8, int4, int2"
        )


def _check_fault_tolerance(c: Config) -> None:
    """parallel.fault_tolerance: torchft replica groups over plain data parallelism. Each DDP rank is
    one replica group, and each of HSDP's replicate groups (FSDP2 over its shard group's ranks); the
    gradient average across the groups goes through torchft instead of DDP's hooks or HSDP's
    replicate all-reduce. A DDP group may be tensor-parallel inside (its tp ranks); what shares a
    model otherwise inside a group (TP under HSDP, PP, EP) or exchanges something else (DeMo,
    compression) is not built on it yet; DiLoCo has its own rules."""
    p = c.parallel
    if not p.fault_tolerance.enabled:
        return
    setting = "parallel.fault_tolerance.enabled = true"
    hsdp = needs_replica_groups(p.strategy)
    allowed = ", ".join([*strategies_with(DPWrapper.DDP), "hsdp"])
    table: dict[str, tuple[bool, str, str, str]] = {
        "parallel.strategy": (
            DPWrapper.of(p.strategy) is not DPWrapper.DDP and not hsdp, repr(p.strategy), allowed,
            "the replica groups are DDP's ranks or HSDP's replicate groups (parallel.replicate); "
            "fsdp shards over every rank, leaving no group whose loss the others survive",
        ),
        "parallel.sharding": (
            p.sharding == "optimizer" or (hsdp and p.sharding == "no_shard"), repr(p.sharding),
            "full, shard_grad_op" if hsdp else "full",
            "each HSDP replica group shards the model over its own ranks (no_shard leaves it one "
            "rank: use parallel.strategy = 'ddp')" if hsdp else
            "ZeRO-1 shards the optimizer state over the ranks a replica group would lose",
        ),
        "parallel.compression": (
            p.compression != "none", repr(p.compression), "none",
            "the gradient average goes through torchft, not DDP's communication hooks",
        ),
        **{
            key: (bad, shown, ok, "fault tolerance averages plain gradients over replica groups")
            for key, (bad, shown, ok) in _plain_data_parallel(c).items()
            if key != "parallel.diloco.inner_steps"  # DiLoCo: its own rules, below
            # DDP's groups may be tensor-parallel inside (each group its TP ranks' world)
            and not (key == "parallel.tp" and not hsdp and not p.diloco.inner_steps)
        },
        "parallel.ep": (p.ep > 1, str(p.ep), "1", "expert parallelism spans replica groups"),
    }  # fmt: skip
    refuse(table, setting)
    _check_fault_tolerant_diloco(c, setting)
    if p.fault_tolerance.lighthouse is not None and not p.fault_tolerance.lighthouse.startswith(
        ("http://", "https://")
    ):
        raise ValueError(
            f"parallel.fault_tolerance.lighthouse = {p.fault_tolerance.lighthouse!r} is not an "
            "address: expected http://HOST:PORT (or null: dtlab train starts one on 127.0.0.1)"
        )


def _check_fault_tolerant_diloco(c: Config, setting: str) -> None:
    """DiLoCo over fault-tolerant replica groups (dtlab.train.diloco_ft): each replica one group of
    one rank, one sync of the whole model per cycle (one fragment, no delay) through torchft, dense,
    quantised or sparse (parallel.diloco.replicas against the process count: :func:`check_world`)."""
    p = c.parallel
    o = p.diloco
    if not o.inner_steps:
        return
    table: dict[str, tuple[bool, str, str, str]] = {
        "parallel.strategy": (
            DPWrapper.of(p.strategy) is not DPWrapper.DDP, repr(p.strategy),
            ", ".join(strategies_with(DPWrapper.DDP)),
            "each DiLoCo replica is one replica group of one rank",
        ),
        "parallel.diloco.fragments": (
            o.fragments != 1, str(o.fragments), "1",
            "Streaming DiLoCo's fragments would each need a quorum and a commit of their own",
        ),
        "parallel.diloco.delay": (
            o.delay != 0, str(o.delay), "0",
            "a sync in flight across a quorum change cannot be committed or undone cleanly",
        ),
        "parallel.diloco.eager": (
            o.eager, "true", "false",
            "its estimate is of a sync in flight, which a quorum change cannot commit or undo",
        ),
    }  # fmt: skip
    refuse(table, f"{setting} and parallel.diloco.inner_steps = {o.inner_steps}")


def _check_tp(c: Config) -> None:
    """What tensor parallelism needs of the model and the rest of the config."""
    m, p, t = c.model, c.parallel, c.train
    tp = p.tp
    if tp == 1:
        if p.sequence_parallel:
            raise ValueError(
                "parallel.sequence_parallel = true splits the sequence over the tensor-parallel ranks; "
                "it needs parallel.tp > 1 (got 1)"
            )
        return
    splits = {
        "model.n_heads": m.n_heads,
        "model.n_kv_heads": m.kv_heads,
        "model.ffn_dim": m.hidden_dim,
        "model.vocab_size": m.vocab_size,
    }
    if p.sequence_parallel:
        splits["data.seq_len"] = c.seq_len
    for key, value in splits.items():
        if value % tp:
            fits = [k for k in range(1, value + 1) if value % k == 0 and k <= 64]
            raise ValueError(
                f"{key} = {value} is not divisible by parallel.tp = {tp}: each tensor-parallel rank "
                f"takes an equal part (tp values that divide it: {', '.join(map(str, fits[-6:]))})"
            )
    # key: (refused, the value as written, what is allowed)
    refused: dict[str, tuple[bool, str, str]] = {
        "parallel.compression": (
            p.compression in ("powersgd", "dct"),
            repr(p.compression),
            "none, fp16, bf16",
        ),
        "train.optimizer": (t.optimizer == "demo", "'demo'", "adamw, sgd, muon"),
        # Measured: the compiled split blocks fail in backward (torch 2.13, CPU).
        "train.compile": (t.compile, "true", "false"),
    }
    for key, (bad, shown, allowed) in refused.items():
        if bad:
            raise ValueError(
                f"{key} = {shown} is not supported with parallel.tp = {tp} (allowed: {allowed})"
            )


def _check_mlx(c: Config) -> None:
    """What the MLX engine does not do (yet): say so instead of silently training something else."""
    t, p = c.train, c.parallel
    # FSDP through MLX's fully_shard (dtlab.mlx.fsdp): every parameter's rows over every rank.
    fsdp = DPWrapper.of(p.strategy) is DPWrapper.FSDP
    if fsdp and (needs_replica_groups(p.strategy) or p.sharding != "full"):
        raise ValueError(
            f"parallel.strategy = {p.strategy!r} with parallel.sharding = {p.sharding!r} is not "
            "supported with train.engine = 'mlx' (allowed: fsdp with sharding full, "
            f"{', '.join(strategies_with(DPWrapper.NONE, DPWrapper.DDP))})"
        )
    allowed = {
        "parallel.compression": (p.compression, ("none",)),
        "parallel.backend": (p.backend, ("auto", "ring", "mpi", "jaccl")),
        "train.optimizer": (t.optimizer, ("adamw",)),
        "train.precision": (t.precision, ("fp32", "bf16")),
        "train.activation_checkpointing": (t.activation_checkpointing, ("none", "full")),
        "train.device": (t.device, ("auto", "cpu")),
    }
    for key, (value, ok) in allowed.items():
        if value not in ok:
            raise ValueError(
                f"{key} = {value!r} is not supported with train.engine = 'mlx' "
                f"(allowed: {', '.join(ok)})"
            )
    if p.tp > 1 or fsdp:  # dtlab.mlx.tensor and .fsdp: eager MLX, without recomputation
        tp_refused = {
            "parallel.sequence_parallel": (p.sequence_parallel, "true", "false"),
            "train.activation_checkpointing": (
                t.activation_checkpointing != "none", repr(t.activation_checkpointing), "'none'"
            ),
        }  # fmt: skip
        for name, (on, shown, fine) in tp_refused.items():
            if on:
                raise ValueError(
                    f"{name} = {shown} is not supported with train.engine = 'mlx' and "
                    f"{'parallel.strategy = fsdp' if fsdp else f'parallel.tp = {p.tp}'} "
                    f"(allowed: {fine}); train.engine = 'torch' has it"
                )
    if c.model.init_from is not None:
        raise ValueError(
            f"model.init_from = {c.model.init_from!r} is not supported with train.engine = 'mlx' "
            "(allowed: null); train.engine = 'torch' starts from it"
        )
    m = c.model
    features: dict[str, tuple[bool, str]] = {
        "model.head_dim": (m.head_dim is not None and m.head_dim * m.n_heads != m.dim, "null"),
        "model.qkv_bias": (m.qkv_bias, "false"),
        "model.qk_norm": (m.qk_norm, "false"),
        "model.sliding_window": (m.sliding_window is not None, "null"),
    }
    for key, (refused, keep) in features.items():
        if refused:
            raise ValueError(
                f"{key} = {show(getattr(m, key[6:]))} is not supported with train.engine = 'mlx' "
                f"(allowed: {keep}); train.engine = 'torch' has it"
            )
    if c.model.rope_scaling is not None:  # the MLX model's RoPE is plain
        raise ValueError(
            "model.rope_scaling (Llama 3.1's long-context scaling) is not supported with "
            "train.engine = 'mlx' (allowed: null); train.engine = 'torch' applies it"
        )


def _check_moe(c: Config) -> None:
    """What a mixture-of-experts model needs, and what does not compose with it yet."""
    m, p = c.model, c.parallel
    if p.ep > 1 and not m.moe.experts:
        raise ValueError(
            f"parallel.ep = {p.ep} splits a mixture of experts' experts over ranks, but "
            "model.moe.experts = 0 (a dense model); allowed: parallel.ep = 1, or an MoE model "
            "(e.g. model.preset = 'debug-moe')"
        )
    if not m.moe.experts:
        return
    _check_experts(m, p)
    refuse(_moe_refusals(c), f"model.moe.experts = {m.moe.experts}")
    if p.ep != 1:
        refuse(_expert_parallel_refusals(c), f"parallel.ep = {p.ep}")


def _check_experts(m: ModelConfig, p: ParallelConfig) -> None:
    """The experts split evenly over the expert-parallel ranks, each token's top-k are among them,
    and at least one block is an MoE block."""
    moe = m.moe
    if moe.experts % p.ep:
        fits = [str(k) for k in range(1, moe.experts + 1) if moe.experts % k == 0]
        raise ValueError(
            f"parallel.ep = {p.ep} does not divide model.moe.experts = {moe.experts}: each "
            f"expert-parallel rank holds an equal share (allowed: {', '.join(fits[:8])})"
        )
    if moe.top_k > moe.experts:
        raise ValueError(
            f"model.moe.top_k = {moe.top_k} is more than model.moe.experts = {moe.experts} "
            f"(allowed: 1 to {moe.experts})"
        )
    if moe.dense_layers >= m.n_layers:
        raise ValueError(
            f"model.moe.dense_layers = {moe.dense_layers} leaves no MoE block of model.n_layers = "
            f"{m.n_layers} (allowed: 0 to {m.n_layers - 1}, or model.moe.experts = 0 for dense)"
        )


def _moe_refusals(c: Config) -> dict[str, tuple[bool, str, str, str]]:
    """What does not go with any MoE model (a table for :func:`refuse`)."""
    p, t, moe = c.parallel, c.train, c.model.moe
    # key: (refused, the value as written, what is allowed, why)
    return {
        "parallel.sequence_parallel": (
            p.sequence_parallel, "true", "false",
            "tensor parallelism keeps an MoE block whole, on the whole sequence",
        ),
        "parallel.pp": (
            p.pp > 1 and "aux" in moe.balance, str(p.pp), "1, or model.moe.balance 'bias' or 'none'",
            f"model.moe.balance = {moe.balance!r}: the auxiliary loss of a stage's blocks does not "
            "reach the pipeline's loss",
        ),
        "parallel.diloco.inner_steps": (
            p.diloco.inner_steps > 0, str(p.diloco.inner_steps), "0",
            "the balancing bias is updated from every rank's loads, not a replica's",
        ),
        "train.engine": (
            t.engine == "mlx", "'mlx'", "torch", "the MLX model has no MoE feed-forward",
        ),
    }  # fmt: skip


def _expert_parallel_refusals(c: Config) -> dict[str, tuple[bool, str, str, str]]:
    """What does not go with experts split over ranks (parallel.ep > 1); a table for
    :func:`refuse`."""
    p, t = c.parallel, c.train
    # key: (refused, the value as written, what is allowed, why)
    return {
        "parallel.sharding": (
            p.sharding == "optimizer", "'optimizer'", "full, shard_grad_op, no_shard",
            "ZeRO-1 shards whole parameters by rows, not the expert-parallel shards",
        ),
        "parallel.compression": (
            p.compression != "none", repr(p.compression), "none",
            "the expert shards' gradients are averaged outside DDP's and FSDP's reduction",
        ),
        "train.optimizer": (
            t.optimizer == "demo", "'demo'", "adamw, sgd, muon",
            "DeMo replaces the gradient all-reduce the expert shards need",
        ),
        "train.oom_retry": (
            t.oom_retry, "true", "false",
            "a rank out of memory inside forward would leave the others in the experts' all-to-all",
        ),
    }  # fmt: skip


def config_warnings(config: Config) -> list[str]:
    """Settings that are allowed but probably not meant: said once at the start of a run."""
    t, d = config.train, config.data
    out = []
    # Warm-up step k (1-based) trains at lr x k / warmup_steps (dtlab.train.schedules.lr_at): with as
    # many warm-up steps as steps, the last one reaches train.lr; only more never do.
    if t.warmup_steps > t.steps:
        out.append(
            f"train.warmup_steps = {t.warmup_steps} > train.steps = {t.steps}: the whole run is "
            f"warm-up, and the learning rate never reaches train.lr = {t.lr:g} (the last step's is "
            f"{t.lr * t.steps / t.warmup_steps:.3g})"
        )
    p, moe = config.parallel, config.model.moe
    # (section, its keys' prefix, the key that turns it on, whether it is on, how to turn it on)
    features: list[tuple[Any, str, str | None, bool, str]] = [
        (moe, "model.moe", "experts", bool(moe.experts),
         "model.moe.experts = 0: the model is dense and the model.moe keys are not used "
         "(model.moe.experts > 0 makes it a mixture of experts)"),
        (t.demo, "train.demo", None, t.optimizer == "demo",
         f"train.optimizer = {t.optimizer!r}: the train.demo keys are DeMo's and not used "
         "(train.optimizer=demo uses them)"),
        (p.diloco, "parallel.diloco", "inner_steps", p.diloco.inner_steps > 0,
         "parallel.diloco.inner_steps = 0: DiLoCo is off and the parallel.diloco keys are not "
         "used (parallel.diloco.inner_steps > 0 turns it on)"),
        (p.compression_options, "parallel.compression_options", None,
         p.compression in ("powersgd", "dct"),
         f"parallel.compression = {p.compression!r}: the parallel.compression_options keys are "
         "powersgd's and dct's and not used"),
        (p.fault_tolerance, "parallel.fault_tolerance", "enabled", p.fault_tolerance.enabled,
         "parallel.fault_tolerance.enabled = false: the parallel.fault_tolerance keys are not "
         "used (parallel.fault_tolerance.enabled=true uses them)"),
        (t.float8, "train.float8", "enabled", t.float8.enabled,
         "train.float8.enabled = false: the train.float8 keys are not used "
         "(train.float8.enabled=true uses them)"),
    ]  # fmt: skip
    for section, prefix, switch, on, why in features:
        if not on and (key := _set_key(config, section, prefix, switch)) is not None:
            out.append(f"{prefix}.{key} is set but {why}")
    if p.cp == 1 and _set_key(config, p, "parallel", None, keys=("cp_method",)):
        out.append(
            f"parallel.cp_method = {p.cp_method!r} is set but parallel.cp = 1: no sequence is "
            "split, so no context-parallel attention runs (parallel.cp > 1 uses it)"
        )
    if config.alerts.moe_imbalance is not None and not moe.experts:
        out.append(
            f"alerts.moe_imbalance = {config.alerts.moe_imbalance:g} is set but model.moe.experts "
            "= 0: a dense model routes nothing, so the alert never fires"
        )
    if d.paths and d.source != "files":
        out.append(
            f"data.paths is set but data.source = {d.source!r}: the paths are not read "
            "(data.source=files trains on them)"
        )
    return out


def _set_key(
    config: Config,
    section: Any,
    prefix: str,
    switch: str | None,
    keys: tuple[str, ...] | None = None,
) -> str | None:
    """The first key of ``section`` (under ``prefix``; ``switch``, the key that turns it on, left
    out) that the config gives a value other than its default. A run directory's config.yaml gives
    every key, most at their defaults: those say nothing the user meant."""
    fields = type(section).model_fields
    for k in keys or fields:
        if k == switch or not config.is_given(f"{prefix}.{k}"):
            continue
        if getattr(section, k) != fields[k].get_default(call_default_factory=True):
            return k
    return None


def check_world(config: Config, world_size: int) -> int:
    """Checks that need the world size: the parallel degrees (:meth:`ParallelDims.from_config`) and the
    batch split over the data-parallel ranks; returns the gradient accumulation steps.

    Run once, in the process that launches, before any worker starts; a worker builds its degrees once
    (``init_distributed``).
    """
    p = config.parallel
    groups = world_size // p.cp  # a group of one rank, or of its cp ranks
    one_each = p.diloco.replicas in (None, groups)
    if p.fault_tolerance.enabled and p.diloco.inner_steps and not one_each:
        ranks = f"its {p.cp} cp ranks" if p.cp > 1 else "one rank"
        raise ConfigError(
            f"parallel.diloco.replicas = {p.diloco.replicas} with parallel.fault_tolerance on "
            f"{world_size} processes: each DiLoCo replica is one fault-tolerant replica group of "
            f"{ranks} (allowed: null or {groups})"
        )
    dims = ParallelDims.from_config(config, world_size)
    accum = check_batch_split(config, dims.dp)
    if dims.pp_enabled:
        check_pipeline_schedule(config, dims.dp)
    return accum


def check_batch_split(config: Config, world_size: int) -> int:
    """That the global batch splits over ``world_size`` data-parallel ranks (and into micro-batches of
    ``train.micro_batch_size`` when it is set); returns the accumulation steps. The error says what
    would work: process counts, global batch sizes (and micro-batch sizes)."""
    t = config.train
    g, micro = t.global_batch_size, t.micro_batch_size
    unit = (micro or 1) * world_size  # what the global batch must be a multiple of
    if g % unit == 0:
        return 1 if micro is None else g // unit  # without micro_batch_size: no accumulation
    worlds = [n for n in range(1, g + 1) if g % ((micro or 1) * n) == 0]
    near = sorted(worlds, key=lambda n: (abs(n - world_size), n))[:4]
    lower, upper = g // unit * unit, (g // unit + 1) * unit
    sizes = " or ".join(str(x) for x in (lower, upper) if x > 0)
    if micro is None:
        msg = f"train.global_batch_size = {g} samples cannot be split over {world_size} ranks"
    else:
        msg = (
            f"train.global_batch_size = {g} samples cannot be split into micro-batches of "
            f"train.micro_batch_size = {micro} on {world_size} ranks ({g} is not a multiple of "
            f"{micro} x {world_size})"
        )
    hint = f"use {_or(sorted(near))} processes, or train.global_batch_size {sizes}"
    if micro is not None:
        micros = [m for m in range(1, g // world_size + 1) if g % (m * world_size) == 0]
        if micros:
            hint += f", or train.micro_batch_size {_or(micros[-3:])}"
    raise ConfigError(f"{msg}: {hint}")


def _or(items: list[int]) -> str:
    text = [str(x) for x in items]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " or " + text[-1]


def _check_engine(c: Config) -> None:
    """The MLX engine's rules, and the MLX backends refused to the torch engine."""
    p = c.parallel
    if c.train.engine == "mlx":
        _check_mlx(c)
    elif p.backend in ("ring", "mpi", "jaccl"):
        raise ValueError(
            f"parallel.backend = {p.backend!r} is an MLX backend; train.engine = 'torch' "
            "allows: auto, gloo, nccl"
        )


# The schema applies them, in this order, after its own rules (dtlab.config.schema.CROSS_RULES).
CROSS_RULES.extend(
    [
        _check_zero1, _check_oom_retry, _check_diloco, _check_fault_tolerance, _check_tp,
        _check_pp, _check_moe, _check_engine,
    ]
)  # fmt: skip
