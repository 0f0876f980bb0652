"""``dtlab plan``: per-strategy memory, communication and step time, predicted without allocating the model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dtlab.analysis import moe
from dtlab.analysis.choose import Found, reason
from dtlab.analysis.devices import DeviceProfile, cpu_memory_gib
from dtlab.analysis.fitrule import explain, usable_fraction
from dtlab.analysis.float8_time import float8_time
from dtlab.analysis.latency import cross_replica_collectives
from dtlab.analysis.model import (
    ParamShape,
    StepPlan,
    flops_per_token,
    param_shapes,
    plan_step,
    recompute_flops_per_token,
)
from dtlab.analysis.plan_format import (  # noqa: F401  (the plan's formats, imported from here too)
    format_bytes,
    format_count,
    format_plan,
    format_search,
    format_seconds,
    format_tflops,
)
from dtlab.analysis.probe import compute_seconds, rank_share, wrapper_seconds
from dtlab.analysis.rates import ACHIEVABLE_FRACTION, achievable_flops, pipeline_bubble
from dtlab.analysis.roofline_plan import KERNELS_CHECKED, kernels_time
from dtlab.analysis.roofline_plan import kernel_seconds as _kernel_seconds
from dtlab.analysis.search import (
    SearchResult,
    command,
    context_degrees,
    overrides,
    recommended,
    search,
    set_args,
)
from dtlab.analysis.step_wait import oversubscribed
from dtlab.analysis.steptime import (
    Link,
    calibration_note,
    collective_waits,
    exposed_comm,
    step_microbatches,
    wait_seconds,
)
from dtlab.config import Config, check_batch_split, check_world
from dtlab.dims import ParallelDims, layout_name
from dtlab.errors import ConfigError

DEFAULT_DEVICE = "h100"  # the profile ``dtlab plan`` assumes without --device (and says so)
# The share of a GPU's memory a predicted peak may take and still fit: measured, with its source
# (dtlab.analysis.fitrule; a CPU device has its own, usable_fraction("cpu")).
HEADROOM = usable_fraction("cuda")
# Estimated step times this close to the fastest are a tie: the estimate is coarser than that. The
# search's tied layouts are told apart by their memory margin, their exposed communication, then
# simplicity (dtlab.analysis.choose).
TIE_MARGIN = 0.10
RECOMPUTE = {
    "none": "none (no activation checkpointing)",
    "full": "one more forward of every block in backward, but for its last matmul (w2), whose output "
    "backward does not need",
    "selective": "the blocks' element-wise ops again in backward (RMSNorm, RoPE, SiLU, gate, residual "
    "adds), counted as FLOPs at the matmul rate: a lower bound, as these ops are memory-bound",
}


@dataclass
class PlanRow:
    label: str
    step: StepPlan
    compute_s: float  # forward and backward, once
    recompute_s: float  # what activation checkpointing runs again in backward
    comm_s: float  # every collective, alone
    fits: bool
    error: str | None = None
    exposed_s: float | None = None  # of comm_s, what the step waits for (None: all of it)
    # Collectives across replicas per step: the round trips a link between sites costs (None: not
    # predicted for this layout; dtlab.analysis.latency).
    round_trips: float | None = None

    @property
    def step_time_s(self) -> float:
        """Compute, recompute and the communication the step does not hide
        (:mod:`dtlab.analysis.steptime`)."""
        exposed = self.comm_s if self.exposed_s is None else self.exposed_s
        return self.compute_s + self.recompute_s + exposed

    def as_dict(self) -> dict[str, Any]:
        d = self.step.as_dict()
        d["label"] = self.label
        d["comm"]["time_s"] = self.comm_s
        d["comm"]["exposed_s"] = self.comm_s if self.exposed_s is None else self.exposed_s
        d["comm"]["cross_replica_collectives_per_step"] = self.round_trips
        d["compute_time_s"] = self.compute_s
        d["recompute_time_s"] = self.recompute_s
        d["step_time_s"] = self.step_time_s
        d["fits"] = self.fits
        if self.error:
            d["error"] = self.error
        return d


def candidates(config: Config, world: int, nnodes: int) -> list[tuple[str, Config]]:
    """The strategies worth comparing for this world: each as a label and a config."""
    out = []
    p = config.parallel
    model_parallel = p.tp * p.pp
    # The strategies share the data-parallel ranks: those that tensor and pipeline parallelism leave.
    suffix = (f" tp{p.tp}" if p.tp > 1 else "") + (f" pp{p.pp} {p.pp_schedule}" if p.pp > 1 else "")
    if model_parallel > 1 and world % model_parallel == 0:
        world = world // model_parallel
        nnodes = nnodes if world % nnodes == 0 else 1
    # Each row sets its sharding: the config's own (ZeRO-1's "optimizer") belongs to its row only.
    options: list[tuple[str, dict[str, Any]]] = [
        ("single", {"strategy": "single", "sharding": "full"})
    ]
    if world > 1:
        options = [
            ("ddp", {"strategy": "ddp", "sharding": "full"}),
            *(
                [("ddp zero-1", {"strategy": "ddp", "sharding": "optimizer"})]
                if model_parallel == 1
                else []
            ),
            ("fsdp full", {"strategy": "fsdp", "sharding": "full"}),
            ("fsdp shard_grad_op", {"strategy": "fsdp", "sharding": "shard_grad_op"}),
            ("fsdp no_shard", {"strategy": "fsdp", "sharding": "no_shard"}),
        ]
        replicate = nnodes if nnodes > 1 else (2 if world % 2 == 0 and world >= 4 else 0)
        if replicate:
            options.append(
                (
                    f"hsdp {replicate}x{world // replicate}",
                    {"strategy": "hsdp", "sharding": "full", "replicate": replicate},
                )
            )
    for label, values in options:
        cfg = config.model_copy(deep=True)
        for k, v in values.items():
            setattr(cfg.parallel, k, v)
        out.append((label + suffix, cfg))
    return out


def advice(
    config: Config,
    world: int,
    rows: list[dict[str, Any]],
    usable_bytes: float,
    searched: tuple[str, ...] = (),
) -> str:
    """What to change when no strategy fits: only settings that are not already in use, nor tried by
    the search (``searched``: the keys it chose freely)."""
    t = config.train
    tips = []
    if t.activation_checkpointing != "full" and "train.activation_checkpointing" not in searched:
        tips.append("activation checkpointing (train.activation_checkpointing=full)")
    if t.precision == "fp32" and "train.precision" not in searched:
        tips.append("bf16 (train.precision=bf16: half-size activations)")
    micro = t.micro_batch_size or max(1, t.global_batch_size // world)
    tips.append(
        "a shorter sequence (data.seq_len)"
        if micro == 1 or "train.micro_batch_size" in searched
        else "a smaller micro-batch (train.micro_batch_size) or a shorter sequence (data.seq_len)"
    )
    tips.append("more ranks (--nproc, --nnodes: FSDP shards the state over them)")
    states = [
        r["per_rank"]["params_bytes"]
        + r["per_rank"]["grads_bytes"]
        + r["per_rank"]["optimizer_bytes"]
        for r in rows
        if "error" not in r
    ]
    if states and min(states) > usable_bytes:
        return (
            f"nothing fits: the parameters, gradients and optimizer state alone need at least "
            f"{format_bytes(min(states))} per rank, more than the {format_bytes(usable_bytes)} usable; "
            "only more ranks (--nproc, --nnodes) with FSDP shrink them"
        )
    return "nothing fits: try " + ", ".join(tips[:-1]) + " or " + tips[-1]


def plan(
    config: Config,
    nproc: int,
    nnodes: int,
    device: DeviceProfile,
    memory_gib: float | None,
    device_assumed: bool = False,
    source: tuple[str | None, list[str]] = (None, []),
) -> dict[str, Any]:
    """The plan as a JSON-ready dict: one row per data-parallel strategy at the config's own settings
    (``strategies``), the search over every layout the config leaves open (``search``), and the
    recommendation: the search's fastest layout that fits, with the ``dtlab train`` line that runs it.

    ``device_assumed``: the profile was not asked for (the CLI's default); the output says so.
    ``source``: the config file and the ``--set`` overrides it came from, for the printed command.
    """
    world = nproc * nnodes
    memory = (memory_gib if memory_gib is not None else device.memory_gib) * 2**30
    precision = config.train.precision
    ac = config.train.activation_checkpointing
    rate = achievable_flops(device, precision)
    costing = _Costing(nproc, nnodes, device, param_shapes(config.model), memory)
    rows = _strategy_rows(config, costing, rate)  # the strategies at the config's own settings
    found = search(config, nproc, nnodes, device, memory, costing.shapes, costing.row, TIE_MARGIN)
    found = _with_context_parallel(config, found, nproc, nnodes, device, memory, costing)
    if not found.layouts:
        _why_nothing_runs(config, world)
    searched = _search_dict(config, found, costing, rate, source)
    best = searched["recommended"]
    header = _header(config, best)
    peak = device.peak_tflops.get(header["precision"])
    float8 = _float8_figures(config, best, world, device)
    return {
        **({"float8": float8} if float8 else {}),
        "model": _model_figures(config, costing.shapes),
        "world_size": world,
        "nproc": nproc,
        "nnodes": nnodes,
        "device": _device_figures(device, device_assumed, memory, memory_gib is not None, peak),
        # The node's host memory where it is this machine (what its ranks' host bytes are held to).
        "host_memory_gib": cpu_memory_gib() if device.key == "this" else None,
        "assumptions": _assumptions(
            device, ac, bool(config.model.moe and config.model.moe.experts)
        ),
        "precision": precision,
        "activation_checkpointing": ac,
        "header": header,
        "global_batch_size": config.train.global_batch_size,
        "seq_len": config.seq_len,
        "shape_sources": shape_sources(config),
        "strategies": rows,
        "search": searched,
        "recommendation": _recommendation(found, best) + _starved_pipeline(found, world)
        if best
        else advice(
            config,
            world,
            rows + searched["rows"],
            memory * usable_fraction(device.kind),
            tuple(found.open),
        ),
    }


def _with_context_parallel(
    config: Config,
    found: SearchResult,
    nproc: int,
    nnodes: int,
    device: DeviceProfile,
    memory: float,
    costing: _Costing,
) -> SearchResult:
    """The search again with context parallelism where nothing fits without it and the config
    leaves ``parallel.cp`` open: each sequence split over every degree of the world the config's
    rules take (the sequence's chunks, alltoall's heads: :func:`search`'s validation), by both
    methods, the ring and ``alltoall``; ``found`` where that finds no more."""
    if recommended(found) is not None or config.is_given("parallel.cp"):
        return found
    if config.train.engine != "torch" or config.parallel.diloco.inner_steps:
        return found
    degrees = context_degrees(nproc * nnodes)
    if not degrees:
        return found
    with_cp = search(
        config, nproc, nnodes, device, memory, costing.shapes, costing.row, TIE_MARGIN,
        (degrees, ("ring", "alltoall")),
    )  # fmt: skip
    if recommended(with_cp) is None:
        return found
    with_cp.open.append("parallel.cp")
    return with_cp


def _strategy_rows(config: Config, costing: _Costing, rate: float) -> list[dict[str, Any]]:
    """The rows of the strategies worth comparing (:func:`candidates`) at the config's own
    settings, each costed, or why this world cannot run it."""
    world = costing.nproc * costing.nnodes
    rows: list[dict[str, Any]] = []
    for label, cfg in candidates(config, world, costing.nnodes):
        try:
            check_world(cfg, world)
        except ConfigError as e:
            rows.append({"label": label, "error": str(e)})
            continue
        rows.append(costing.row(label, cfg, rate).as_dict())
    return rows


def _assumptions(device: DeviceProfile, ac: str, moe: bool = False) -> dict[str, Any]:
    """What the plan assumes (it prints them as such): the share of the peak a step reaches, the
    fit rule, how its step time is made, what recompute costs, the tie margin."""
    kind = device.kind
    return {
        "achievable_fraction_of_peak": ACHIEVABLE_FRACTION[kind],
        "usable_memory_fraction": usable_fraction(kind),
        "fit_rule": explain(kind),
        "step_time": step_time_basis(device, moe),
        "recompute": RECOMPUTE[ac],
        "tie_margin": TIE_MARGIN,
    }


def _float8_figures(
    config: Config, best: dict[str, Any] | None, world: int, device: DeviceProfile
) -> dict[str, Any] | None:
    """The float8 layers' part of the recommended layout's step (the config's own where nothing
    is recommended): :func:`dtlab.analysis.float8_time.float8_time`; None without float8."""
    if not config.train.float8.enabled:
        return None
    from dtlab.analysis.search import apply_values

    cfg = apply_values(config, best["settings"]) if best else config
    try:
        dims = ParallelDims.from_config(cfg, world)
    except ConfigError:
        return None
    f8 = float8_time(cfg, dims, device)
    if f8 is None:
        return None
    return {"recipe": cfg.train.float8.recipe, **f8.as_dict()}


def _why_nothing_runs(config: Config, world: int) -> None:
    """A ConfigError for a search that found nothing this world can run: the config's own layout
    says why (first the batch's split, which decides most of them)."""
    p = config.parallel
    split = p.tp * p.pp * p.cp  # the ranks each data-parallel rank's samples go to
    check_batch_split(config, world // split if world % split == 0 else world)
    check_world(config, world)
    raise ConfigError(f"no layout of this config runs on {world} ranks")


def _model_figures(config: Config, shapes: list[ParamShape]) -> dict[str, Any]:
    """The plan's ``model``: parameters (and an MoE's active ones), FLOPs per token."""
    m, seq = config.model, config.seq_len
    return {
        "params": sum(s.numel for s in shapes),
        # A mixture of experts: what one token's forward runs through (dtlab.analysis.moe).
        **({"active_params": moe.param_counts(shapes, m).active} if m.moe.experts else {}),
        "preset": m.preset,
        "flops_per_token": flops_per_token(m, seq),
        "recompute_flops_per_token": recompute_flops_per_token(
            m, seq, config.train.activation_checkpointing
        ),
    }


def _header(config: Config, best: dict[str, Any] | None) -> dict[str, Any]:
    """The header's figures: those of the recommended row (its precision's peak, its recompute),
    or the config's own where nothing is recommended (the strategies' table keeps the config's)."""
    precision = best["precision"] if best else config.train.precision
    ac = best["activation_checkpointing"] if best else config.train.activation_checkpointing
    return {
        "of": "recommended" if best else "as given",
        "precision": precision,  # device.peak_tflops is this precision's
        "activation_checkpointing": ac,
        "recompute": RECOMPUTE[ac],
        "recompute_flops_per_token": recompute_flops_per_token(config.model, config.seq_len, ac),
    }


def shape_sources(config: Config) -> dict[str, str]:
    """Where the figures of the plan's header come from: ``set`` (the file or ``--set``), the preset,
    or the default (and what the default is)."""
    preset = config.model.preset
    shape = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim",
             "max_seq_len", "qkv_bias", "qk_norm", "sliding_window")  # fmt: skip
    given = [k for k in shape if config.is_given(f"model.{k}")]
    out = {
        "model": (
            ("preset" if preset else "default")
            + (f", {', '.join(given)} set" if given and preset else " shape set" if given else "")
        )
    }
    out["data.seq_len"] = (
        "set"
        if config.is_given("data.seq_len")
        else "data.seq_len default: 2048, or model.max_seq_len where that is shorter"
    )
    out["train.global_batch_size"] = (
        "set" if config.is_given("train.global_batch_size") else "train.global_batch_size default"
    )
    return out


def _search_dict(
    config: Config,
    found: SearchResult,
    costing: _Costing,
    rate: float,
    source: tuple[str | None, list[str]],
) -> dict[str, Any]:
    """The search's part of the plan: its rows, the config's own layout as given, the recommended one
    with the ``--set`` overrides and the ``dtlab train`` line that run it."""
    given = _as_given(config, costing, rate)
    rec = _recommended_dict(config, found, costing, source)
    return {
        "open": found.open,
        "fixed": found.fixed,
        "layouts": found.layouts,
        "costed": found.costed,
        "seconds": found.seconds,
        "rows": [_found_dict(config, f) for f in found.rows],
        "as_given": given,
        "recommended": rec,
    }


def _found_dict(config: Config, f: Found) -> dict[str, Any]:
    """A searched row as the plan gives it: its figures, settings, overrides of ``config`` and the
    micro-batching, checkpointing and precision it runs with."""
    d: dict[str, Any] = f.row.as_dict()
    t, p = f.config.train, f.config.parallel
    d["settings"] = {k: v for k, v in f.values.items()}
    d["overrides"] = overrides(config, f)
    d["micro_batch_size"] = t.micro_batch_size
    d["pp_microbatches"] = p.pp_microbatches
    d["activation_checkpointing"] = t.activation_checkpointing
    d["precision"] = t.precision
    if t.float8.enabled:  # the layout's precision column: bf16 with float8 layers
        d["float8"] = t.float8.recipe
    return d


def _as_given(config: Config, costing: _Costing, rate: float) -> dict[str, Any]:
    """The config's own layout as a row of the search's table, or why this world cannot run it."""
    world = costing.nproc * costing.nnodes
    try:
        check_world(config, world)
        dims = ParallelDims.from_config(config, world)
        given: dict[str, Any] = costing.row(
            layout_name(dims, config.parallel), config, rate
        ).as_dict()
        given.update(
            micro_batch_size=config.train.micro_batch_size,
            pp_microbatches=config.parallel.pp_microbatches,
            activation_checkpointing=config.train.activation_checkpointing,
            precision=config.train.precision,
        )
        if config.train.float8.enabled:
            given["float8"] = config.train.float8.recipe
    except ConfigError as e:
        given = {"label": "as given", "error": str(e)}
    return given


def _recommended_dict(
    config: Config, found: SearchResult, costing: _Costing, source: tuple[str | None, list[str]]
) -> dict[str, Any] | None:
    """The recommended row with the ``--set`` overrides and the ``dtlab train`` line that run it,
    and what decided it; None when none fits."""
    best = recommended(found)
    if best is None or found.choice is None:
        return None
    extra = set_args(overrides(config, best))
    other = found.choice.other
    return {
        **_found_dict(config, best),
        "set": extra,
        "command": command(source[0], costing.nproc, costing.nnodes, list(source[1]), extra),
        # What set the compared row (the fastest, or the runner-up) aside (choose.CRITERIA),
        # and how many layouts were tied with the fastest (itself included).
        "decided_by": found.choice.decided_by,
        "compared_with": other.label if other is not None else None,
        "tied": len(found.tied),
    }


def _recommendation(found: SearchResult, best: dict[str, Any]) -> str:
    """The search's choice in words: its layout, figures and why it won (dtlab.analysis.choose):
    against the fastest, or, when it is the fastest, against the runner-up of the tie."""
    figures = (
        f"{format_bytes(best['per_rank']['total_bytes'])} per rank, "
        f"{format_seconds(best['step_time_s'])} per step"
    )
    name = f"{best['label']}, {_settings(best)}"
    choice = found.choice
    assert choice is not None  # a recommended row comes from a choice
    fastest, other = choice.fastest, choice.other
    if choice.pick is fastest:
        text = f"{name}: the fastest estimated step of the layouts that fit ({figures})"
        if other is None:
            return text
        n = len(choice.tied) - 1
        return (
            f"{text}; {n} other{'s' if n > 1 else ''} within {TIE_MARGIN:.0%} of it (closer than "
            f"this estimate can tell apart); against the runner-up, {other.label} at "
            f"{format_seconds(other.step_time_s)}, {reason(choice)}"
        )
    return (
        f"{name} ({figures}): within {TIE_MARGIN:.0%} of the fastest, {fastest.label} at "
        f"{format_seconds(fastest.step_time_s)} (closer than this estimate can tell apart); "
        f"against it, {reason(choice)}"
    )


def _starved_pipeline(found: SearchResult, world: int) -> str:
    """When the recommended layout's pipeline has fewer micro-batches than stages (the global batch
    leaves each replica too few samples), how much of the step it idles and the global batch that
    gives every stage a micro-batch; empty otherwise."""
    from dtlab.config import pipeline_microbatches

    if found.choice is None:
        return ""
    config = found.choice.pick.config
    dims = ParallelDims.from_config(config, world)
    if not dims.pp_enabled:
        return ""
    m = pipeline_microbatches(config, dims.dp)
    if m >= dims.pp:
        return ""
    enough = config.train.global_batch_size * dims.pp // m
    return (
        f"; its pipeline idles {pipeline_bubble(config, dims):.0%} of the step, {m} micro-batch"
        f"{'es' if m > 1 else ''} for {dims.pp} stages (the global batch of "
        f"{config.train.global_batch_size} over {dims.dp} data-parallel replicas): "
        f"train.global_batch_size {enough} or more gives every stage one"
    )


def _settings(r: dict[str, Any]) -> str:
    """A searched row's settings beside its layout: precision, checkpointing, micro-batches."""
    precision = r["precision"] + (f" with float8 {r['float8']} layers" if r.get("float8") else "")
    parts = [precision, f"checkpointing {r['activation_checkpointing']}"]
    if r.get("pp_microbatches"):
        m = r["pp_microbatches"]
        parts.append(f"{m} pipeline micro-batch{'es' if m != 1 else ''}")
    elif r.get("micro_batch_size"):
        parts.append(f"micro-batch {r['micro_batch_size']}")
    return ", ".join(parts)


def predict_step(config: Config, nproc: int, nnodes: int, device: DeviceProfile) -> PlanRow:
    """The plan's row for ``config`` as it is (its own strategy, not the candidates): memory, and
    compute, recompute and communication time of one step. A ConfigError when the world cannot run it."""
    world = nproc * nnodes
    check_world(config, world)
    rate = achievable_flops(device, config.train.precision)
    memory = device.memory_gib * 2**30
    label = config.parallel.strategy
    return _row(label, config, nproc, nnodes, device, rate, param_shapes(config.model), memory)


def _row(
    label: str,
    cfg: Config,
    nproc: int,
    nnodes: int,
    device: DeviceProfile,
    rate: float,
    shapes: list[ParamShape],
    memory: float,
) -> PlanRow:
    """One candidate's row (its world already checked): memory, and compute, recompute and
    communication time at ``rate`` FLOP/s and the device's link bandwidths."""
    return _Costing(nproc, nnodes, device, shapes, memory).row(label, cfg, rate)


@dataclass(frozen=True)
class _Costing:
    """What a candidate's row is costed on besides its config: the world's nodes and processes per
    node, the device, the model's parameter shapes (read once) and the memory a row must fit."""

    nproc: int
    nnodes: int
    device: DeviceProfile
    shapes: list[ParamShape]
    memory: float

    def row(self, label: str, cfg: Config, rate: float) -> PlanRow:
        """One candidate's row (its world already checked): memory, and compute, recompute and
        communication time at ``rate`` FLOP/s and the device's link bandwidths."""
        world = self.nproc * self.nnodes
        dims = ParallelDims.from_config(cfg, world)
        # The devices' kind decides the attention kernel, and so part of the activations.
        step = plan_step(cfg, world, self.shapes, device_type=self.device.kind)
        compute, recompute = self._compute_seconds(cfg, dims, rate)
        times = self._comm_seconds(step, dims)
        exposed = self._exposed_seconds(cfg, dims, times, compute, recompute)
        usable = self.memory * usable_fraction(self.device.kind)
        comm = sum(times.values())
        return PlanRow(
            label, step, compute, recompute, comm, step.total_bytes <= usable, exposed_s=exposed,
            round_trips=cross_replica_collectives(cfg, world, self.shapes),
        )  # fmt: skip

    def _compute_seconds(self, cfg: Config, dims: ParallelDims, rate: float) -> tuple[float, float]:
        """Forward and backward once, and what activation checkpointing runs again, per step: from
        this machine's measured step of the model where the device has one, else at ``rate``."""
        device, nproc = self.device, self.nproc
        tokens_per_rank = cfg.train.global_batch_size * cfg.seq_len / (nproc * self.nnodes)
        # Tensor and pipeline parallelism split the model's FLOPs over their ranks as data
        # parallelism splits the batch: per rank, the same share of the step's work. A pipeline rank
        # also idles in the bubble: (p - 1) / (m + p - 1) of its time under 1F1B (the figure also
        # taken, as an upper bound, for the schedules without a closed form here).
        idle = pipeline_bubble(cfg, dims)
        ac = cfg.train.activation_checkpointing
        again = recompute_flops_per_token(cfg.model, cfg.seq_len, ac) / flops_per_token(
            cfg.model, cfg.seq_len
        )
        if device.probe is None and device.step_model == "kernels" and kernels_time(cfg, device):
            return _kernel_seconds(cfg, dims, device, self.shapes, idle)
        if device.probe is None:
            compute = flops_per_token(cfg.model, cfg.seq_len) * tokens_per_rank / rate
            # train.float8: its layers' GEMMs at the float8 rate where that is faster, the casts.
            f8 = float8_time(cfg, dims, device)
            compute = (compute - (f8.saved_s if f8 else 0.0)) / (1 - idle)
            return compute, compute * again
        # This machine, the model's own step measured on it.
        flops_share, params_share = rank_share(cfg, dims, self.shapes)
        tokens = cfg.train.global_batch_size * cfg.seq_len / dims.dp
        passes = step_microbatches(cfg, dims)
        compute = compute_seconds(
            device.probe, tokens, flops_share, params_share, nproc, idle, passes
        )
        fixed = compute_seconds(device.probe, 0, 0, params_share, nproc)
        recompute = (compute - fixed) * again
        compute += wrapper_seconds(cfg, dims, device.wrapper_s or {}, nproc, device.probe)
        return compute, recompute

    def _comm_seconds(self, step: StepPlan, dims: ParallelDims) -> dict[str, float]:
        """Each collective's time alone: its bus bytes at the rate of the link it crosses (across
        nodes the network's) or this machine's measured rate for its kind."""
        device = self.device
        times = {}
        for collective, bus in step.comm_bus_bytes.items():
            group = step.comm_groups[collective]
            across = self.nnodes > 1 and spans_nodes(collective, group, dims, self.nproc)
            gbps = device.inter_node_gbps if across else device.intra_node_gbps
            if device.collective_gbps and not across:
                # This machine's rate for the kind ("tp all_gather" is an all-gather; a pipeline's
                # sends go as an all-reduce's ring steps do).
                kind = collective.split()[-1]
                gbps = device.collective_gbps.get(kind, device.collective_gbps["all_reduce"])
            times[collective] = bus / (gbps * 1e9)
        return times

    def _exposed_seconds(
        self,
        cfg: Config,
        dims: ParallelDims,
        times: dict[str, float],
        compute: float,
        recompute: float,
    ) -> float:
        """Of the collectives' ``times``, what the step waits for (:mod:`dtlab.analysis.steptime`),
        with this machine's measured wait per collective where it has one."""
        device = self.device
        link = Link(device.intra_node_gbps, device.copy_gbps or math.inf)
        layers = cfg.model.n_layers // dims.pp
        exposed = exposed_comm(cfg, dims, times, compute, recompute, link, device.kind, layers)
        groups = device.collective_gbps or {}
        # Where the ranks outnumber the cores, the wait as the model's steps meet it (a blocked
        # rank's turn on a core, whatever the collective's group: dtlab.analysis.step_wait), or
        # where that could not be measured the small matrices' wait, each counted whole; else the
        # wait beside small matrices, for the slowest of the group to arrive.
        probe = device.probe
        crowded = probe is not None and oversubscribed(self.nproc, probe.threads, probe.cores)
        scheduled = "step_wait_s" in groups or crowded
        sync = groups.get("step_wait_s", groups.get("sync_s", 0.0))
        if sync and dims.distributed:
            # This machine's measured wait per collective among ranks that compute (their arrival
            # and their threads' turn on the shared cores), for each collective of the step.
            waits = collective_waits(cfg, dims, layers, step_microbatches(cfg, dims))
            exposed += wait_seconds(waits, sync, self.nproc, whole=scheduled)
        return exposed


def spans_nodes(collective: str, group: int, dims: ParallelDims, nproc: int) -> bool:
    """Whether a ``collective`` over groups of ``group`` ranks reaches beyond one node of ``nproc``
    (then the network limits it). The mesh lays its dimensions out row-major in the order of
    :data:`dtlab.dims.DIM_NAMES` (the pipeline outermost, then DiLoCo's replicas, the replicate,
    shard and cp dimensions, tensor parallelism innermost): a group's ranks span its outermost
    dimension's degree times every degree inside it. So a data-parallel group under tensor
    parallelism spans ``group x tp`` ranks; HSDP's replicas (one rank of each shard group) a whole
    DiLoCo replica's data x cp x tp ranks; DiLoCo's outer sync (one rank of each replica) and a
    pipeline's neighbouring stages whole replicas and stages apart."""
    if collective.startswith("tp "):
        span = group
    elif collective == "send/recv":  # neighbouring stages: a stage's ranks apart
        span = group * (dims.world_size // dims.pp)
    elif collective.startswith("diloco "):  # one rank of each replica: a replica's ranks apart
        span = group * (dims.world_size // (dims.pp * dims.diloco))
    elif dims.fsdp_replicate > 1 and collective == "all_reduce":
        # HSDP's replicate group (with the cp ranks where they replicate): the outermost data
        # dimension, everything of the replica inside it.
        span = dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp
    elif collective.startswith("ep_dp "):  # one rank of each EP group of ``ep`` consecutive ones
        span = group * dims.ep * dims.tp
    else:
        span = group * dims.tp
    return span > nproc


def step_time_basis(device: DeviceProfile, moe: bool = False) -> str:
    """How the plan's step time is made on ``device`` (printed with the plan); ``moe``: the model
    routes to experts, whose rate on a GPU nothing has measured."""
    hides = (
        "none of it hides: the ranks' cores copy the bytes (dtlab.analysis.steptime)"
        if device.copy_gbps is not None
        else "what hides: DDP's bucket all-reduces behind backward, FSDP's prefetched collectives "
        "behind compute; tensor-parallel, pipeline and ZeRO-1 collectives do not"
    )
    if device.probe is not None:
        compute = (
            "compute: this model's step measured on one process, scaled to each layout's tokens, "
            "share of the FLOPs and parameters, pipeline bubble and the cores its ranks share"
        )
    elif device.step_model == "kernels" and device.kind == "cuda":
        compute = (
            "compute (--step-model kernels): each kernel of the step at its kind's rate (GEMMs, "
            "attention, memory-bound ops, the optimizer: fractions of the datasheet measured on an "
            "H200) or the host's dispatch where slower, compiled blocks as inductor fuses them; an MoE or "
            "float8 step, masked attention or context parallelism "
            f"at {ACHIEVABLE_FRACTION[device.kind]:.0%} of the peak; plus the pipeline "
            "bubble"
        )
    else:
        unmeasured = (
            " (a dense model's assumed rate: this model's experts, a loop of small matmuls with a "
            "host read of their counts per block, are unmeasured on GPUs and likely slower)"
            if moe and device.kind == "cuda"
            else ""
        )
        compute = (
            f"compute at {ACHIEVABLE_FRACTION[device.kind]:.0%} of the peak{unmeasured}, plus "
            "recompute and the pipeline bubble"
        )
    checked = calibration_note(device.probe is not None)
    if device.step_model == "kernels" and device.kind == "cuda" and device.probe is None:
        checked = KERNELS_CHECKED
    return f"{compute}; communication at the link rates, {hides}; {checked}"


def _device_figures(
    device: DeviceProfile, assumed: bool, memory: float, memory_given: bool, peak: float | None
) -> dict[str, Any]:
    """The device's figures, each with where it comes from: measured, looked up, given or assumed."""
    return {
        "key": device.key,
        "assumed": assumed,
        "name": device.name,
        "memory_gib": memory / 2**30,
        "memory_source": "given: --device-memory" if memory_given else device.memory_source,
        "peak_tflops": peak,
        "source": device.source,
        "intra_node_gbps": device.intra_node_gbps,
        "intra_node_source": device.intra_node_source,
        "inter_node_gbps": device.inter_node_gbps,
        "inter_node_source": device.inter_node_source,
        "probe": device.probe.as_dict() if device.probe else None,
        "collective_gbps": device.collective_gbps,
        "wrapper_s": device.wrapper_s,
        "collective_source": device.collective_source or None,
    }
