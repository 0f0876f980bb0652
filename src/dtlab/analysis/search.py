"""``dtlab plan``'s search: every layout dtlab can run on this world, costed by the plan's own model.

The searched settings are the keys in ``SEARCHED`` that the config leaves open: not set in its file nor
by ``--set`` (:attr:`dtlab.config.Config.given`); a key the user gave is kept as given. Each candidate
is the user's config with the open keys chosen, validated by the config's own rules and
:func:`check_world`, and costed by :func:`dtlab.analysis.plan._row`: the row of a recommended layout is
the row ``dtlab plan`` gives that config with the printed ``--set`` line.

What keeps it fast (a 70B model on 64 ranks in about a second): the parameter shapes are read once;
a candidate's compute time (with its pipeline bubble and recompute) is known without its memory, and
bounds its step time from below, so candidates are costed fastest bound first and those whose bound
cannot reach the best rows are never costed; and per layout and activation checkpointing mode only the
largest micro-batch that fits is costed (a binary search: memory grows with the micro-batch, and a
larger one never communicates more). The bound leaves a candidate uncosted only when it exceeds both
the TOP-th fastest layout found so far and the tie with the fastest found so far; both only fall as
rows are found, and neither ever falls below its final value, so every row that is finally shown or
tied is costed (tests/test_plan_search.py compares the rows and the tie with an exhaustive costing).
Which of the tied rows is recommended: :mod:`dtlab.analysis.choose`.
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, get_args

from dtlab.analysis.choose import Choice, Found, choose
from dtlab.analysis.devices import DeviceProfile
from dtlab.analysis.fitrule import usable_fraction
from dtlab.analysis.float8_time import float8_bound_share
from dtlab.analysis.model import (
    ParamShape,
    flops_per_token,
    recompute_flops_per_token,
)
from dtlab.analysis.rates import achievable_flops, pipeline_bubble
from dtlab.analysis.roofline_plan import bound_flops, kernel_bound, kernels_time
from dtlab.config import Config, ConfigError, ParallelConfig, check_world, yaml_scalar
from dtlab.dims import (
    DPWrapper,
    ParallelDims,
    layout_name,
    needs_replica_groups,
)

# The keys the search may choose, when the config leaves them open.
SEARCHED = (
    "parallel.tp",
    "parallel.pp",
    "parallel.sequence_parallel",
    "parallel.strategy",
    "parallel.sharding",
    "parallel.replicate",
    "parallel.pp_schedule",
    "parallel.pp_microbatches",
    "parallel.ep",
    "train.micro_batch_size",
    "train.activation_checkpointing",
    "train.precision",
)
# Tried only where nothing fits without them (dtlab.analysis.plan's search with context parallelism).
CONTEXT_SEARCHED = ("parallel.cp", "parallel.cp_method")
# Precisions tried where train.precision is open, where the device's peak is known. fp16 is left out:
# the same speed and memory as bf16 in this model, with loss scaling, and refused with pipelines.
PRECISIONS = ("bf16", "fp32")
AC_MODES = ("none", "selective", "full")  # fastest first
TOP = 5  # rows shown


@dataclass
class SearchResult:
    rows: list[Found]  # the fastest that fit, one per layout, fastest first (or, when none fits,
    # the ones that come closest)
    open: list[str]
    fixed: list[str]
    layouts: int  # layouts considered (valid for this world)
    costed: int  # rows costed
    seconds: float
    tied: list[Found] = field(default_factory=list)  # within the tie margin of the fastest
    choice: Choice | None = None  # the recommended row of the tied ones, and why


def open_keys(config: Config) -> list[str]:
    """The searched keys the config leaves open (not in its file nor in ``--set``); ``parallel.ep``
    only for a mixture of experts (a dense model has no experts to split)."""
    moe = bool(config.model.moe.experts)
    return [k for k in SEARCHED if not config.is_given(k) and (moe or k != "parallel.ep")]


# The largest degree, replica-group count, micro-batch size or micro-batch count tried: the schema's
# bound on parallel.tp and parallel.pp, and far past any batch split that pays; it also keeps the search
# of a world of 2**40 ranks (which the CLI accepts) as short as that of 64.
LIMIT = 1024


def _divisors(n: int, limit: int = LIMIT) -> list[int]:
    """The divisors of ``n`` up to ``limit``, ascending."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def context_degrees(world: int) -> list[int]:
    """The context-parallel degrees above 1 a world of ``world`` ranks can split a sequence over
    (the config's rules then take those that split its sequence and, for alltoall, its heads)."""
    return [d for d in _divisors(world) if d > 1]


def _pick(config: Config, key: str, options: list[Any]) -> list[Any]:
    """``options`` when ``key`` is open, else the config's own value."""
    if config.is_given(key):
        section, name = key.split(".")
        return [getattr(getattr(config, section), name)]
    return options


def _tp_options(config: Config, nproc: int) -> list[int]:
    """Tensor-parallel degrees within one node (``tp`` divides ``nproc``) that split the model
    (tied embeddings too: the vocabulary-split embedding computes the tied output's logits)."""
    m = config.model
    splits = (m.n_heads, m.kv_heads, m.hidden_dim, m.vocab_size)
    ok = [t for t in _divisors(nproc) if all(v % t == 0 for v in splits)]
    return _pick(config, "parallel.tp", ok)


def _data_parallel_options(config: Config, dp: int, model_parallel: bool) -> list[dict[str, Any]]:
    """How ``dp`` data-parallel ranks share the model: strategy, sharding and replica groups."""
    p = config.parallel
    strategies = _pick(
        config,
        "parallel.strategy",
        list(get_args(ParallelConfig.model_fields["strategy"].annotation)),
    )
    out: list[dict[str, Any]] = []
    for s in strategies:
        wrapper = DPWrapper.of(s)
        if dp == 1:
            # One data-parallel rank: nothing to share (the simplest way to say so, unless given).
            if wrapper is DPWrapper.NONE or config.is_given("parallel.strategy"):
                out.append({"parallel.strategy": s})
            continue
        if wrapper is DPWrapper.NONE:
            continue
        if wrapper is DPWrapper.DDP:
            # Plain DDP (sharding left as it is) and ZeRO-1, which shards plain DDP's optimizer only.
            shardings = [p.sharding] + ([] if model_parallel else ["optimizer"])
            for sharding in _pick(config, "parallel.sharding", shardings):
                out.append({"parallel.strategy": s, "parallel.sharding": sharding})
            continue
        if needs_replica_groups(s):
            for sharding in _pick(config, "parallel.sharding", ["full", "shard_grad_op"]):
                groups = [r for r in _divisors(dp) if 1 < r < dp]
                for r in _pick(config, "parallel.replicate", groups):
                    out.append(
                        {
                            "parallel.strategy": s,
                            "parallel.sharding": sharding,
                            "parallel.replicate": r,
                        }
                    )
            continue
        for sharding in _pick(config, "parallel.sharding", ["full", "shard_grad_op", "no_shard"]):
            out.append({"parallel.strategy": s, "parallel.sharding": sharding})
    return out


def _ep_options(config: Config, dp: int) -> list[int]:
    """Expert-parallel degrees for ``dp`` data-parallel ranks (under context parallelism, the data x
    cp ranks): those dividing both ``dp`` and the experts (expert parallelism borrows them); 1 for a
    dense model."""
    experts = config.model.moe.experts
    return _pick(
        config, "parallel.ep", [e for e in _divisors(dp) if experts % e == 0] if experts else [1]
    )


def _pipeline_options(config: Config, pp: int, share: int) -> list[dict[str, Any]]:
    """Schedules and micro-batch counts for ``pp`` pipeline ranks, each data-parallel rank taking
    ``share`` samples; stages split the blocks evenly."""
    if pp == 1:
        return [{}]
    p = config.parallel
    schedules = _pick(
        config,
        "parallel.pp_schedule",
        list(get_args(ParallelConfig.model_fields["pp_schedule"].annotation)),
    )
    if config.is_given("parallel.pp_microbatches") or config.is_given("train.micro_batch_size"):
        counts: list[int | None] = [p.pp_microbatches]  # as given (or from the micro-batch size)
    else:
        counts = list(_divisors(share))
    out = []
    for schedule in schedules:
        stages = pp * p.model_copy(update={"pp_schedule": schedule}).stages_per_rank
        if config.model.n_layers % stages:
            continue
        for m in counts:
            out.append({"parallel.pp_schedule": schedule, "parallel.pp_microbatches": m})
    return out


def apply_values(config: Config, values: dict[str, Any]) -> Config:
    """``config`` with the dotted keys of ``values`` set (no validation: :func:`_valid` checks)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    update = {s: getattr(config, s).model_copy(update=v) for s, v in sections.items()}
    return config.model_copy(update=update)


def _valid(config: Config, world: int) -> bool:
    """Whether dtlab runs ``config`` on ``world`` ranks: the config's own cross-field rules and
    :func:`check_world` (torch's pipeline schedule rules among them), the functions ``dtlab train``
    runs before it starts."""
    try:
        # The schema's cross-field rules on a copy made without validation (a few µs; a whole
        # model_validate is 300 times that, and the search makes thousands of copies).
        config._cross_checks()  # type: ignore[operator]
        check_world(config, world)
    except (ValueError, ConfigError):
        return False
    return True


def layouts(
    config: Config,
    nproc: int,
    nnodes: int,
    precisions: list[str],
    context: tuple[list[int], tuple[str, ...]] | None = None,
) -> Iterator[dict[str, Any]]:
    """Every combination of the open keys but the micro-batch size and activation checkpointing
    (chosen per layout by :func:`search`), as dotted key -> value; not yet validated.
    ``context``: context-parallel degrees to try and the methods to try them with (the config's
    own otherwise)."""
    world = nproc * nnodes
    m = config.model
    cps, methods = context or ([config.parallel.cp], (config.parallel.cp_method,))
    for tp in _tp_options(config, nproc):
        stages = _divisors(math.gcd(world // tp, m.n_layers)) if world % tp == 0 else []
        for pp in _pick(config, "parallel.pp", stages):
            if world % (tp * pp) or (pp > 1 and m.n_layers % pp):
                continue
            for cp in cps:
                if world % (tp * pp * cp):
                    continue
                for method in methods:
                    extra = {"parallel.cp": cp, "parallel.cp_method": method} if context else {}
                    for values in _model_parallel_layouts(config, world, tp, pp, cp, precisions):
                        yield {**values, **extra}


def _model_parallel_layouts(
    config: Config, world: int, tp: int, pp: int, cp: int, precisions: list[str]
) -> Iterator[dict[str, Any]]:
    """:func:`layouts` at tensor, pipeline and context parallel degrees ``tp``, ``pp``, ``cp``."""
    g = config.train.global_batch_size
    dp = world // (tp * pp * cp)
    if g % dp:
        return
    sp_options = [True, False] if tp > 1 and config.seq_len % tp == 0 else [False]
    for sp in _pick(config, "parallel.sequence_parallel", sp_options):
        # (FSDP shards over the data x cp ranks: with cp, even one data rank shares the model.)
        for data in _data_parallel_options(config, dp * cp, tp * pp > 1):
            for pipe in _pipeline_options(config, pp, g // dp):
                for ep in _ep_options(config, dp * cp):  # (with cp: the data x cp ranks)
                    for precision in precisions:
                        yield {
                            "parallel.tp": tp,
                            "parallel.pp": pp,
                            "parallel.sequence_parallel": sp,
                            **data,
                            **pipe,
                            "parallel.ep": ep,
                            "train.precision": precision,
                        }


def _micro_options(config: Config, dims: ParallelDims) -> list[int | None]:
    """Micro-batch sizes to try, largest first: null (no accumulation) and the divisors of each
    data-parallel rank's share below it; under pipeline parallelism the micro-batch count decides."""
    if config.is_given("train.micro_batch_size") or dims.pp_enabled:
        return [config.train.micro_batch_size]
    share = config.train.global_batch_size // dims.dp
    return [None, *reversed([d for d in _divisors(share) if d < share])]


def search(
    config: Config,
    nproc: int,
    nnodes: int,
    device: DeviceProfile,
    memory: float,
    shapes: list[ParamShape],
    cost: Any,
    tie_margin: float,
    context: tuple[list[int], tuple[str, ...]] | None = None,
) -> SearchResult:
    """The fastest layouts that fit, one row per layout (its fastest micro-batch size and activation
    checkpointing that fit). ``cost(label, cfg, rate)`` is the plan's row of a config.
    ``context``: the context-parallel degrees to try and their methods (:func:`layouts`)."""

    start = time.perf_counter()
    opened = open_keys(config)
    precisions = _pick(
        config,
        "train.precision",
        [p for p in PRECISIONS if device.peak_tflops.get(p)] or [config.train.precision],
    )
    acs = _pick(config, "train.activation_checkpointing", list(AC_MODES))
    queue, n_layouts = _queue(config, nproc, nnodes, device, precisions, acs, shapes, context)
    progress = _Progress(cost, device, tie_margin, acs[-1])
    for bound, _, values, cfg, dims in queue:
        if not progress.worth(bound):
            break  # sorted by bound: nothing after this is worth costing either
        progress.visit(values, cfg, dims)
    rows, tied = progress.shown()
    usable = memory * usable_fraction(device.kind)
    return SearchResult(
        rows[:TOP] if progress.best else rows,
        opened,
        [k for k in SEARCHED if k not in opened and config.is_given(k)],
        n_layouts,
        progress.costed,
        time.perf_counter() - start,
        tied,
        choose(tied, usable, tie_margin) if tied else None,
    )


# A candidate: the lower bound of its step time, its place in the queue, its values (with its
# activation checkpointing), its config and its dims.
_Candidate = tuple[float, int, dict[str, Any], Config, ParallelDims]


def _queue(
    config: Config,
    nproc: int,
    nnodes: int,
    device: DeviceProfile,
    precisions: list[str],
    acs: list[str],
    shapes: list[ParamShape],
    context: tuple[list[int], tuple[str, ...]] | None = None,
) -> tuple[list[_Candidate], int]:
    """Every valid layout at each activation checkpointing mode in ``acs``, fastest bound first (its
    compute time with its pipeline bubble and recompute: a lower bound of its step time), and how
    many layouts are valid."""
    world = nproc * nnodes
    tokens_per_rank = config.train.global_batch_size * config.seq_len / world
    fwd_bwd = flops_per_token(config.model, config.seq_len)
    extra = {ac: recompute_flops_per_token(config.model, config.seq_len, ac) for ac in acs}
    queue: list[_Candidate] = []
    n_layouts = 0
    for values in layouts(config, nproc, nnodes, precisions, context):
        cfg = apply_values(config, values)
        if not _valid(cfg, world):
            continue
        n_layouts += 1
        dims = ParallelDims.from_config(cfg, world)
        rate = bound_flops(device, cfg.train.precision)
        # train.float8: its layers' FLOPs at best at the float8 rate (a lower bound still).
        fast = float8_bound_share(cfg, device, rate) * fwd_bwd
        busy = 1 - pipeline_bubble(cfg, dims)
        kernels = device.step_model == "kernels"
        for ac in acs:
            bound = (fwd_bwd - fast + extra[ac]) * tokens_per_rank / rate / busy
            trial = apply_values(cfg, {"train.activation_checkpointing": ac}) if kernels else cfg
            if kernels and kernels_time(trial, device):
                # The kernels' own lower bound: their device time in the fewest micro-batches.
                bound = kernel_bound(trial, dims, device, shapes, 1 - busy)
            if bound != bound:  # an unknown peak: no bound, cost it
                bound = 0.0
            queue.append(
                (bound, len(queue), {**values, "train.activation_checkpointing": ac}, cfg, dims)
            )
    queue.sort(key=lambda q: (q[0], q[1]))
    return queue, n_layouts


@dataclass
class _Progress:
    """The search's progress through its queue: the rows found, those that do not fit, the rows
    costed, and the times that bound what is still worth costing."""

    cost: Any  # cost(label, cfg, rate): the plan's row of a config
    device: DeviceProfile
    tie_margin: float
    lightest_ac: str  # the activation checkpointing that keeps the least of those tried
    best: dict[str, Found] = field(default_factory=dict)  # layout key -> its fastest row that fits
    # Rows that do not fit, least memory first (when nothing fits).
    closest: list[Found] = field(default_factory=list)
    # The TOP-th fastest of the layouts' best rows so far (inf until TOP layouts fit), recomputed from
    # ``best`` whenever a row enters it: a layout's own faster row replaces its slower one there, so
    # no stale time can stand in for a layout's, and it only falls as rows are found. A row whose
    # bound is above both it and the tie with the fastest can be neither shown nor recommended.
    top_time: float = math.inf
    fastest: float = math.inf
    costed: int = 0
    # Layouts that fit without accumulation: a slower AC mode cannot win.
    done: set[str] = field(default_factory=set)
    # Layout -> whether it fits at its lightest (while nothing fits).
    probed: dict[str, bool] = field(default_factory=dict)

    def worth(self, bound: float) -> bool:
        """Whether a candidate whose step takes at least ``bound`` may still be shown or tied."""
        return bound <= self.top_time or bound <= self.fastest * (1 + self.tie_margin)

    def visit(self, values: dict[str, Any], cfg: Config, dims: ParallelDims) -> None:
        """Cost one candidate (a layout at one checkpointing mode) at the largest micro-batch that
        fits, and keep its row if it is its layout's fastest."""
        key = _key(values, "train.activation_checkpointing")
        if key in self.done:
            return
        ac = values["train.activation_checkpointing"]
        micros = _micro_options(cfg, dims)
        if not self.best and not self._fits_lightest(key, values, cfg, dims, micros):
            return
        cfg = apply_values(cfg, {"train.activation_checkpointing": ac})
        fit = self._largest_fit(key, values, cfg, dims, micros)
        if fit is not None:
            self._keep(values, fit)

    def _cost(self, dims: ParallelDims, trial: Config) -> tuple[str, Any]:
        """The label of ``trial``'s layout and the plan's row of it, counted as costed."""
        label = layout_name(dims, trial.parallel)
        row = self.cost(label, trial, achievable_flops(self.device, trial.train.precision))
        self.costed += 1
        return label, row

    def _fits_lightest(
        self,
        key: str,
        values: dict[str, Any],
        cfg: Config,
        dims: ParallelDims,
        micros: list[int | None],
    ) -> bool:
        """While nothing fits (a model too large for the world): whether the layout fits at all, at
        its lightest (full recompute, the smallest micro-batch), probed once; if not, none of its
        settings does, and it is not costed again. (Each precision is probed on its own: bf16 can
        hold more than fp32, its weight copies under autocast on top of the same float32 state.)"""
        if key not in self.probed:
            light = {
                "train.activation_checkpointing": self.lightest_ac,
                "train.micro_batch_size": micros[-1],
            }
            trial = apply_values(cfg, light)
            label, row = self._cost(dims, trial)
            self.probed[key] = row.fits
            if not row.fits:
                self.closest.append(Found({**values, **light}, trial, row, label))
        return self.probed[key]

    def _largest_fit(
        self,
        key: str,
        values: dict[str, Any],
        cfg: Config,
        dims: ParallelDims,
        micros: list[int | None],
    ) -> Found | None:
        """The row of the largest micro-batch that fits (None if none does): memory grows with it.
        The largest first (it usually fits, or nothing does), then a binary search over the others;
        the rows that do not fit are kept as the closest."""
        lo, hi, fit = 0, len(micros) - 1, None
        first = True
        while lo <= hi:
            mid = lo if first else (lo + hi) // 2
            trial = apply_values(cfg, {"train.micro_batch_size": micros[mid]})
            label, row = self._cost(dims, trial)
            found = Found({**values, "train.micro_batch_size": micros[mid]}, trial, row, label)
            if row.fits:
                fit, hi = found, mid - 1
                if first and self._orders_ac(values["train.activation_checkpointing"]):
                    self.done.add(key)  # the fewest collectives and no recompute beyond this mode's
            else:
                self.closest.append(found)
                lo = mid + 1
            first = False
        return fit

    def _orders_ac(self, ac: str) -> bool:
        """Whether every checkpointing mode after ``ac`` is slower than it on the same layout and
        micro-batches. It is on FLOPs (recompute only adds them). With the kernels' model only
        after ``none``: selective checkpointing's host-bound policy can make it slower than full
        recompute (dtlab.analysis.roofline)."""
        return self.device.step_model != "kernels" or ac == "none"

    def _keep(self, values: dict[str, Any], fit: Found) -> None:
        """One row per layout: its fastest precision, micro-batching and checkpointing that fit."""
        layout = _key(
            values, "train.activation_checkpointing", "parallel.pp_microbatches", "train.precision"
        )
        if layout not in self.best or fit.step_time_s < self.best[layout].step_time_s:
            self.best[layout] = fit
            self.fastest = min(self.fastest, fit.step_time_s)
            if len(self.best) >= TOP:
                self.top_time = sorted(f.step_time_s for f in self.best.values())[TOP - 1]

    def shown(self) -> tuple[list[Found], list[Found]]:
        """The rows found, fastest first, and those tied with the fastest; when nothing fits, the
        TOP layouts that come closest (least memory first, one row each) and no tie."""
        rows = sorted(self.best.values(), key=lambda f: (f.step_time_s, f.row.step.total_bytes))
        if rows:
            margin = 1 + self.tie_margin
            return rows, [f for f in rows if f.step_time_s <= rows[0].step_time_s * margin]
        self.closest.sort(key=lambda f: f.row.step.total_bytes)
        shown, seen = [], set()
        for f in self.closest:
            if f.label not in seen:
                shown.append(f)
                seen.add(f.label)
        return shown[:TOP], []


def _key(values: dict[str, Any], *leave_out: str) -> str:
    return repr(sorted((k, v) for k, v in values.items() if k not in leave_out))


def recommended(result: SearchResult) -> Found | None:
    """The row the plan recommends (:func:`dtlab.analysis.choose.choose`); None when none fits."""
    return result.choice.pick if result.choice else None


def overrides(config: Config, found: Found) -> dict[str, Any]:
    """The open keys whose chosen value differs from the config's: what ``--set`` must add."""
    out = {}
    for key, value in found.values.items():
        section, name = key.split(".")
        if (
            key in (*SEARCHED, *CONTEXT_SEARCHED)
            and not config.is_given(key)
            and getattr(getattr(config, section), name) != value
        ):
            out[key] = value
    return out


def set_args(values: dict[str, Any]) -> list[str]:
    """``--set`` arguments for ``values``, each ``key=value`` in YAML."""
    return [f"{k}={yaml_scalar(v)}" for k, v in values.items()]


def command(path: str | None, nproc: int, nnodes: int, given: list[str], extra: list[str]) -> str:
    """The ``dtlab train`` line that runs the config at ``path`` with the user's own ``--set``
    overrides (``given``) and ``extra``."""
    words = ["dtlab", "train", *([path] if path else []), "--nproc", str(nproc)]
    if nnodes > 1:
        words += ["--nnodes", str(nnodes)]
    if given or extra:
        words += ["--set", *given, *extra]
    return " ".join(shlex.quote(w) for w in words)
