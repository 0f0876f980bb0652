"""``dtlab verify``: prove that parallel layouts train the same as each other, step by step.

Each layout of ``--layouts`` trains the same config on the same global batch for ``--steps`` steps in
processes of its own (``dtlab train``, as a user runs it); the first layout is the reference. For each
of the others: the largest difference of the loss on any step, of the gradient norm (relative), and of
any parameter after the last step (from the layouts' final checkpoints, read whole). A layout is
within tolerance when all three are. For one that is not: the first step whose loss differs by more
than the tolerance (or whose gradient norm does), and the parameter, by its plain name, that differs
most at the end.

Layout syntax: layouts separated by commas; a layout is dimensions joined by ``x``, each ``NAME:DEGREE``:

    single                  one process (also the default when a layout names no data parallelism)
    ddp:N  fsdp:N  hsdp:N   data parallel over N ranks (hsdp: two replica groups)
    zero:N                  DDP over N ranks with ZeRO-1 (parallel.sharding = optimizer)
    diloco:N[:H]            N DiLoCo replicas of one rank, syncing every H steps (default 1); with
                            cp:M each replica is DDP over M ranks (diloco:2xcp:2: 4 processes)
    ft:N                    DDP over N fault-tolerant replica groups (parallel.fault_tolerance on
                            torchft; with tp or cp, each group its TP x CP ranks): every group
                            compared
    tp:N   sp:N             tensor parallel over N ranks (sp: with sequence parallelism)
    pp:N[:SCHEDULE]         pipeline parallel over N ranks (schedule: parallel.pp_schedule's values)
    ep:N                    expert parallel (an MoE model's experts) over N of the data-parallel
                            ranks (with cp, of the data x cp ranks): it adds no process, N must
                            divide the data-parallel degree (times cp's); alone it means ddp:N
                            (ep:2xcp:2: ddp 2 x cp 2, the experts over each cp group's 2 ranks)
    cp:N[:METHOD]           context parallel: each sequence split over N ranks (METHOD ring or
                            alltoall); without a data dimension over DDP, also with tp or pp
                            (tp:2xcp:2 is ddp 1 x cp 2 x tp 2: FSDP2 replicating over the cp ranks)

e.g. ``single,ddp:2,fsdp:2xtp:2,pp:2:interleaved_1f1b,fsdp:2xpp:2,ep:2,fsdp:4xep:2``. Processes: the
product of the degrees other than ep.

A DiLoCo layout is the same training as DDP only in its degenerate case: H = 1, plain SGD inside
(``train.optimizer=sgd``), the outer step at lr 1 without momentum (``parallel.diloco.outer_lr=1
parallel.diloco.outer_momentum=0``), no clipping (``train.grad_clip=0``: each replica clips by its own
norm). Its gradient norm is its replica's own, so it is not compared.

``--checks resume,export`` adds, for every layout, the checks of :mod:`dtlab.verify_state`: a resume
from the middle step on the same layout and on the first one, and the exported model.

``model.init_from`` (a dtlab export or a Hugging Face directory): every layout, the reference among
them, starts from those weights, so their first steps' losses are equal too. The source is checked
against the config once, before any layout trains, and each run's summary must name it as the
weights it started from (a layout that did not start from them would compare nothing of them).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from dtlab.dims import DPWrapper, needs_replica_groups, strategies_with
from dtlab.errors import ConfigError, DtlabError
from dtlab.verify_state import (
    CHECKS,
    StateCheck,
    compare_exports,
    export_run,
)

if TYPE_CHECKING:
    from dtlab.config import Config

_DIM = re.compile(r"^(?P<name>[a-z]+)(?::(?P<degree>\d+))?(?::(?P<option>[a-z0-9_]+))?$")
_DATA = tuple(strategies_with(*DPWrapper))  # parallel.strategy's names
# DDP with ZeRO-1; DiLoCo replicas of one DDP rank (or its cp ranks); DDP over fault-tolerant
# replica groups
_EXTRA_DATA = ("zero", "diloco", "ft")
_NAMES = (*_DATA, *_EXTRA_DATA, "cp", "tp", "sp", "pp", "ep")


FT_ON = "parallel.fault_tolerance.enabled=true"


@dataclass(frozen=True)
class Layout:
    """One layout to train: its name as written, its process count and its config overrides."""

    name: str
    nproc: int
    overrides: tuple[str, ...]
    # DiLoCo set for every layout by the config or --set (:func:`with_base_config`), not by the
    # layout's own overrides.
    base_diloco: bool = False

    @property
    def diloco(self) -> bool:
        """DiLoCo replicas: each replica's gradient norm is its own, and its checkpoint resumes on its
        own layout only."""
        return self.base_diloco or any(
            o.startswith("parallel.diloco.inner_steps=") for o in self.overrides
        )

    @property
    def ft(self) -> bool:
        """Fault-tolerant replica groups: each trains in its own run directory (``replica-<i>``)."""
        return FT_ON in self.overrides


def parse_layouts(text: str) -> list[Layout]:
    """The layouts of ``--layouts`` (see the module's doc); a ConfigError names the part not understood."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if len(items) < 2:
        raise ConfigError(
            f"--layouts {text!r}: give at least two layouts separated by commas, the first is the "
            "reference (e.g. single,ddp:2,tp:2)"
        )
    layouts = [_parse_layout(item) for item in items]
    names = [x.name for x in layouts]
    if len(set(names)) != len(names):
        raise ConfigError(f"--layouts {text!r} names a layout twice")
    return layouts


@dataclass
class _LayoutParts:
    """A layout as its dimensions are read: the data-parallel strategy and degree, the degrees of
    tensor, pipeline and expert parallelism, the overrides so far and the kinds of parallelism given
    (each at most once)."""

    strategy: str = field(default_factory=lambda: strategies_with(DPWrapper.NONE)[0])
    dp: int = 1
    degrees: dict[str, int] = field(default_factory=lambda: {"cp": 1, "tp": 1, "pp": 1, "ep": 1})
    overrides: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)


class _Dim(NamedTuple):
    """One ``NAME:DEGREE[:OPTION]`` of a layout; ``kind``: data, cp, tp (sp too), pp or ep."""

    part: str
    name: str
    degree: int
    option: str | None
    kind: str


def _parse_layout(item: str) -> Layout:
    """One layout of ``--layouts``: its dimensions in turn, then the process count and overrides."""
    parts = _LayoutParts()
    for part in item.split("x"):
        dim = _parse_dim(part, item, parts.seen)
        if dim.kind == "data":
            _add_data(parts, dim, item)
        else:
            _add_model_parallel(parts, dim)
    return _finish_layout(parts, item)


def _parse_dim(part: str, item: str, seen: set[str]) -> _Dim:
    """``part`` of layout ``item`` read and checked: a known name, a kind of parallelism not given
    before (added to ``seen``), a degree of at least 1 and an option only where one is taken."""
    m = _DIM.match(part)
    if not m or m["name"] not in _NAMES:
        raise ConfigError(
            f"--layouts: {part!r} in {item!r} is not NAME:DEGREE with NAME one of "
            f"{', '.join(_NAMES)} (e.g. fsdp:2xtp:2, pp:2:gpipe)"
        )
    name, option = m["name"], m["option"]
    degree = int(m["degree"]) if m["degree"] else 1
    kind = "data" if name in (*_DATA, *_EXTRA_DATA) else ("tp" if name == "sp" else name)
    if kind in seen:
        raise ConfigError(f"--layouts: {item!r} gives {kind} parallelism twice")
    seen.add(kind)
    alone = name in _DATA and DPWrapper.of(name) is DPWrapper.NONE  # one process
    if degree < 1 or (alone and m["degree"] and degree != 1):
        raise ConfigError(f"--layouts: {part!r} in {item!r}: the degree must be at least 1")
    if option is not None and name not in ("pp", "diloco", "cp"):
        raise ConfigError(
            f"--layouts: {part!r} in {item!r}: only pp (its schedule), diloco (its H) and cp (its "
            "method: ring or alltoall) take an option"
        )
    return _Dim(part, name, degree, option, kind)


def _add_data(parts: _LayoutParts, dim: _Dim, item: str) -> None:
    """The data-parallel dimension: a strategy and its degree, and the overrides of DiLoCo,
    fault-tolerant groups, ZeRO-1 or HSDP's two replica groups."""
    name, degree, part = dim.name, dim.degree, dim.part
    if name == "diloco":
        h = dim.option or "1"
        if not h.isdigit() or int(h) < 1:
            raise ConfigError(
                f"--layouts: {part!r} in {item!r}: diloco's option is H, the inner steps "
                "between syncs (an integer >= 1, e.g. diloco:2:4)"
            )
        parts.strategy, parts.dp = "ddp", degree
        parts.overrides.append(f"parallel.diloco.inner_steps={h}")
    elif name == "ft":
        parts.strategy, parts.dp = "ddp", degree
        parts.overrides.append(FT_ON)
    elif name == "zero":
        parts.strategy, parts.dp = "ddp", degree
        parts.overrides.append("parallel.sharding=optimizer")
    else:
        parts.strategy, parts.dp = name, degree
        if needs_replica_groups(name):
            if degree % 2:
                raise ConfigError(
                    f"--layouts: {part!r}: hsdp runs two replica groups, so its degree must be even"
                )
            parts.overrides.append("parallel.replicate=2")


def _add_model_parallel(parts: _LayoutParts, dim: _Dim) -> None:
    """A tensor (or sequence), pipeline or expert dimension: its degree, and its schedule for pp."""
    parts.degrees[dim.kind] = dim.degree
    parts.overrides.append(f"parallel.{dim.kind}={dim.degree}")
    if dim.name == "sp":
        parts.overrides.append("parallel.sequence_parallel=true")
    if dim.option is not None:
        key = "cp_method" if dim.kind == "cp" else "pp_schedule"
        parts.overrides.append(f"parallel.{key}={dim.option}")


def _finish_layout(parts: _LayoutParts, item: str) -> Layout:
    """The layout of ``parts``: expert parallelism's data-parallel ranks (DDP's when no data
    parallelism was given), which it must divide (with cp, the data x cp ranks), and the strategy as
    the first override."""
    ep = parts.degrees["ep"]
    if ep > 1 and "data" not in parts.seen:  # expert parallelism borrows data-parallel ranks: ddp's
        parts.strategy, parts.dp = "ddp", ep
    if parts.degrees["cp"] > 1 and "data" not in parts.seen:
        # Context parallelism runs over DDP (with tensor or pipeline parallelism, FSDP2 replicating
        # over the cp ranks): its ranks average their gradients, where tp:N alone runs single.
        parts.strategy = "ddp"
    strategy, dp, cp = parts.strategy, parts.dp, parts.degrees["cp"]
    if (dp * cp) % ep:
        ranks, fits = f"the data-parallel degree {dp}", f"{strategy}:{2 * ep}xep:{ep}"
        if cp > 1:
            ranks = f"the {dp * cp} data x cp ranks"
            fits = f"{strategy}:{ep // math.gcd(ep, cp)}xcp:{cp}xep:{ep}"
        raise ConfigError(
            f"--layouts: {item!r}: ep:{ep} must divide {ranks} (expert parallelism borrows its "
            f"ranks from data and context parallelism, e.g. {fits})"
        )
    parts.overrides.insert(0, f"parallel.strategy={strategy}")
    degrees = parts.degrees
    return Layout(item, dp * degrees["cp"] * degrees["tp"] * degrees["pp"], tuple(parts.overrides))


@dataclass
class Comparison:
    """One layout against the reference."""

    layout: str
    nproc: int
    steps: int
    max_loss_diff: float
    max_grad_norm_rel_diff: float | None  # None: not compared (a DiLoCo replica's own norm)
    max_param_diff: float
    worst_param: str
    first_divergent_step: int | None  # the first step whose loss or gradient norm differs beyond it
    ok: bool


@dataclass
class Tolerances:
    """What ``verify`` accepts as the same training (float32 reduction-order noise is far below).
    The resume and export checks use the same figures."""

    loss: float = 1e-4  # absolute, on every step
    grad_norm: float = 1e-3  # relative, on every step
    param: float = 1e-4  # absolute, any element after the last step


# bf16/fp16: layouts round differently, not only sum in another order. bf16 keeps 8 significant bits
# (a relative rounding of 2^-9 = 2e-3 per value); autocast rounds every matmul's output, and FSDP also
# gathers the weights in bf16 and keeps the residual stream in bf16 (docs/parallelism.md, "Precision
# under FSDP"). Measured on the debug model over 20 clipped steps against one bf16 process: the loss
# differs by up to 1.5e-4 (ddp:2) and 1.2e-3 (fsdp:2, hsdp:4, fsdp:2xtp:2, fsdp:2xpp:2), the gradient
# norm by 1.9e-3 relative, a parameter by 1.2e-2. Each tolerance is about 4x that; a skipped gradient
# sync moves the loss by 1.5e-2 and the norm by 0.27 (caught). The parameters, which drift apart with
# the steps, catch less than the step-wise figures do.
HALF_PRECISION_TOLERANCES = Tolerances(loss=5e-3, grad_norm=1e-2, param=5e-2)


def default_tolerances(precision: str) -> Tolerances:
    """What ``verify`` accepts by default for a config of ``train.precision`` ``precision``."""
    return HALF_PRECISION_TOLERANCES if precision in ("bf16", "fp16") else Tolerances()


@dataclass
class LayoutChecks:
    """A layout's resume and export checks (``--checks``)."""

    layout: str
    checks: list[StateCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


@dataclass
class Verification:
    """Every layout's comparison with the reference layout, and each layout's resume and export
    checks when asked for."""

    reference: str
    steps: int
    tolerances: Tolerances
    rows: list[Comparison] = field(default_factory=list)
    checks: tuple[str, ...] = ("loss",)
    middle: int | None = None  # the step the resume checks start from
    state: list[LayoutChecks] = field(default_factory=list)
    init_from: str | None = None  # model.init_from: the weights every layout started from

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) and all(s.ok for s in self.state)


def parse_checks(text: str) -> tuple[str, ...]:
    """``--checks``: comma-separated names of :data:`dtlab.verify_state.CHECKS` (``all``: every one);
    the loss is always compared."""
    names = [c.strip() for c in text.split(",") if c.strip()]
    if names == ["all"]:
        return CHECKS
    unknown = [c for c in names if c not in CHECKS]
    if unknown or not names:
        raise ConfigError(
            f"--checks {text!r}: allowed: a comma-separated list of {', '.join(CHECKS)}, or all"
        )
    return tuple(c for c in CHECKS if c == "loss" or c in names)


def middle_step(steps: int) -> int:
    """The step the resume checks resume from: the middle of the run."""
    return max(1, steps // 2)


def train_layout(
    layout: Layout,
    config: str | None,
    overrides: list[str],
    steps: int,
    run_dir: Path,
    middle: int | None = None,
    resume: Path | None = None,
    what: str | None = None,
) -> None:
    """Train ``layout`` for ``steps`` steps into ``run_dir`` (which must not exist) with ``dtlab train``,
    checkpointing the last step (and step ``middle``, for the resume checks), from scratch or from
    checkpoint ``resume`` (another run's); a DtlabError saying ``what`` failed (default: the layout's
    training), with the output's tail, when it fails."""
    every = middle if middle is not None else steps
    cmd = [
        sys.executable, "-m", "dtlab", "train", *([config] if config else []),
        "--nproc", str(layout.nproc), "--set", *overrides, *layout.overrides,
        f"train.steps={steps}", f"run.dir={run_dir}", "run.log_every=1", f"checkpoint.every={every}",
        f"checkpoint.keep={steps // every + 1}", f"checkpoint.resume={resume or 'never'}",
        "run.progress=none", "run.plot=false", "run.tensorboard=false", "run.trackers=[]",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
        failed = what or f"layout {layout.name} failed to train"
        raise DtlabError(f"{failed} (exit code {proc.returncode}):\n{tail}")


def _metrics(run_dir: Path, after: int | None = None) -> list[dict[str, Any]]:
    """The step records of ``run_dir``'s metrics.jsonl, as logged; ``after`` a step: the last record of
    each later step (a rollback logs a step again), in order."""
    from dtlab.train.rundir import logged_steps

    records = [m for m in logged_steps(run_dir) if "loss" in m]
    if after is None:
        return records
    from dtlab.train.run import loss_curve

    return [m for m in loss_curve(records) if m["step"] > after]


@dataclass
class _Diffs:
    loss: list[float]
    grad: list[float] | None
    first: int | None


def _trajectory(
    run: list[dict[str, Any]],
    ref: list[dict[str, Any]],
    tol: Tolerances,
    grad_norm: bool,
    name: str,
) -> _Diffs:
    """Loss and gradient-norm differences of ``run`` against ``ref``, step by step."""
    if [m["step"] for m in ref] != [m["step"] for m in run]:
        raise DtlabError(f"{name} logged other steps than the run it is compared with")
    loss = [_diff(m["loss"], r["loss"]) for m, r in zip(run, ref, strict=True)]
    grad = (
        [
            _diff(m["grad_norm"], r["grad_norm"]) / max(abs(r["grad_norm"] or 0.0), 1e-12)
            for m, r in zip(run, ref, strict=True)
        ]
        if grad_norm
        else None
    )
    first = next(
        (
            m["step"]
            for k, m in enumerate(run)
            if loss[k] > tol.loss or (grad is not None and grad[k] > tol.grad_norm)
        ),
        None,
    )
    return _Diffs(loss, grad, first)


def _param_diff(ref_dir: Path, run_dir: Path) -> tuple[float, str]:
    """The largest element difference of the final checkpoints' parameters, and its parameter."""
    from dtlab.checkpoint.export import find_checkpoint, load_model_state

    ref_state = load_model_state(find_checkpoint(ref_dir, warn=lambda _: None))
    state = load_model_state(find_checkpoint(run_dir, warn=lambda _: None))
    worst, worst_name = 0.0, "-"
    for key, value in ref_state.items():
        d = float((state[key].float() - value.float()).abs().max()) if key in state else math.inf
        if not d <= worst:  # NaN counts as the worst
            worst, worst_name = d, key
    return worst, worst_name


def compare_runs(
    name: str, nproc: int, ref_dir: Path, run_dir: Path, tol: Tolerances, grad_norm: bool = True
) -> Comparison:
    """``run_dir``'s training against ``ref_dir``'s: losses and gradient norms per step (not the
    norms with ``grad_norm`` False), parameters at the end."""
    run = _metrics(run_dir)
    d = _trajectory(run, _metrics(ref_dir), tol, grad_norm, f"layout {name}")
    worst, worst_name = _param_diff(ref_dir, run_dir)
    max_loss = max(d.loss)
    max_grad = max(d.grad) if d.grad is not None else None
    ok = (
        max_loss <= tol.loss
        and (max_grad is None or max_grad <= tol.grad_norm)
        and worst <= tol.param
    )
    return Comparison(
        name, nproc, len(run), max_loss, max_grad, worst, worst_name, d.first, ok
    )  # fmt: skip


def _diff(a: float | None, b: float | None) -> float:
    """|a - b|, with a missing (non-finite) value on one side only as an infinite difference."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    return abs(a - b)


def init_source(config: str | None, overrides: list[str]) -> str | None:
    """``model.init_from`` of the config the layouts train, checked against it (shape keys, tensor
    names and shapes, from the file headers) before any layout trains: a ConfigError or
    CheckpointError naming the source and what differs. None where the config has none."""
    from dtlab.checkpoint.init_from import check_init_from
    from dtlab.config import load_config

    cfg = load_config(config, overrides)
    if cfg.model.init_from is None:
        return None
    return str(check_init_from(cfg, warn=False).path)


def check_started_from(name: str, run_dir: Path, source: str | None) -> None:
    """A DtlabError unless ``run_dir``'s summary names ``source`` as the weights the run started
    from (None: that it started from none)."""
    path = run_dir / "summary.json"
    try:
        started = json.loads(path.read_text(encoding="utf-8")).get("init_from")
    except (OSError, ValueError) as e:
        raise DtlabError(f"layout {name}: its summary {path} cannot be read: {e}") from None
    if started != source:
        raise DtlabError(
            f"layout {name} started from {started or 'its own initialisation'}, not from "
            f"model.init_from = {source or 'null'}: its training is not comparable with the others'"
        )


def _float8_micro_batches(
    layouts: list[Layout], config: str | None, overrides: list[str], report: Any
) -> list[str]:
    """``overrides``, with train.float8 and no train.micro_batch_size given: one micro-batch size for
    every layout, the largest that divides each layout's per-rank batch. A tensorwise float8 scale is
    the amax of the tensor it casts, so two layouts cast alike only when their micro-batches hold the
    same samples; by default one process's micro-batch is the whole batch and a data-parallel
    rank's its share, and the layouts would differ by their casts, not by their parallelism."""
    from dtlab.config import load_config
    from dtlab.dims import ParallelDims

    # Each layout's own config: the overrides alone may not load (compression without a layout).
    configs = [load_config(config, [*overrides, *layout.overrides]) for layout in layouts]
    t = configs[0].train
    if not t.float8.enabled or t.micro_batch_size is not None:
        return overrides
    batches = [
        c.train.global_batch_size // ParallelDims.from_config(c, layout.nproc).dp
        for c, layout in zip(configs, layouts, strict=True)
    ]
    micro = math.gcd(*batches)
    report(
        f"train.float8: every layout trains in micro-batches of {micro} sample(s) (set "
        "train.micro_batch_size to choose): a tensorwise scale is its micro-batch's amax"
    )
    return [*overrides, f"train.micro_batch_size={micro}"]


def _dir_name(i: int, layout: Layout) -> str:
    return f"{i}-{re.sub(r'[^a-z0-9_]+', '-', layout.name)}"


def with_base_config(layouts: list[Layout], base: Config) -> list[Layout]:
    """``layouts`` as they train on top of ``base`` (the config and ``--set``): where ``base`` sets
    DiLoCo, every layout is a DiLoCo layout, as a ``diloco:N`` layout is (its replicas keep their
    own state and gradient norms)."""
    if base.parallel.diloco.inner_steps <= 0:
        return layouts
    return [replace(layout, base_diloco=True) for layout in layouts]


def verify(
    layouts: list[Layout],
    config: str | None,
    overrides: list[str],
    steps: int,
    out: Path,
    tol: Tolerances | None = None,
    report: Any = print,
    checks: tuple[str, ...] = ("loss",),
) -> Verification:
    """Train every layout into ``out/<n>-<layout>`` and compare each with the first; with ``resume``
    or ``export`` in ``checks``, check each layout's resume and export paths too."""
    tol = tol or Tolerances()
    if layouts[0].ft:
        raise ConfigError(
            f"--layouts: the reference {layouts[0].name!r} is fault-tolerant; put a layout of one "
            "world first (e.g. single or ddp:N), the ft layouts after it"
        )
    if any(x.ft for x in layouts) and ("resume" in checks or "export" in checks):
        raise ConfigError(
            "--checks resume/export with an ft layout: not built (each replica group resumes from "
            "its own run directory); check the ft layouts with --checks loss"
        )
    source = init_source(config, overrides)  # a wrong source: said before any layout trains
    if source is not None:
        report(f"every layout starts from the weights of {source} (model.init_from)")
    overrides = _float8_micro_batches(layouts, config, overrides, report)
    from dtlab.config import load_config

    base = load_config(config, overrides)
    layouts = with_base_config(layouts, base)
    out.mkdir(parents=True, exist_ok=True)
    middle = middle_step(steps) if "resume" in checks else None
    dirs = []
    for i, layout in enumerate(layouts):
        run_dir = out / _dir_name(i, layout)
        if run_dir.exists():
            raise ConfigError(
                f"{run_dir} exists: verify trains every layout from scratch; give --out a new "
                "directory (or delete it)"
            )
        report(f"training {layout.name} ({layout.nproc} process{'es' if layout.nproc > 1 else ''})")
        train_layout(layout, config, overrides, steps, run_dir, middle)
        dirs.append(run_dir)
    result = Verification(
        layouts[0].name, steps, tol, checks=checks, middle=middle, init_from=source
    )
    ref = layouts[0]
    check_started_from(ref.name, dirs[0], source)
    for layout, run_dir in zip(layouts[1:], dirs[1:], strict=True):
        grad_norm = not (layout.diloco or ref.diloco)
        # Fault-tolerant groups: each group's own run (its metrics, its final weights) compared.
        groups = sorted(run_dir.glob("replica-*"), key=lambda g: int(g.name.split("-")[1]))
        for name, where in (
            [(f"{layout.name} group {g.name.split('-')[1]}", g) for g in groups]
            if layout.ft
            else [(layout.name, run_dir)]
        ):
            check_started_from(name, where, source)
            result.rows.append(compare_runs(name, layout.nproc, dirs[0], where, tol, grad_norm))
    if "resume" in checks or "export" in checks:
        engine = base.train.engine
        ctx = _StateContext(config, overrides, steps, out, tol, report, layouts[0], dirs[0], engine)
        for i, (layout, run_dir) in enumerate(zip(layouts, dirs, strict=True)):
            result.state.append(_state_checks(i, layout, run_dir, ctx, checks))
    (out / "verify.json").write_text(
        json.dumps({**asdict(result), "ok": result.ok}, indent=2) + "\n", encoding="utf-8"
    )
    return result


@dataclass(frozen=True)
class _StateContext:
    """What every layout's resume and export checks share: how the layouts train (the config, its
    overrides, the steps), where they write (``out``), the tolerances, where progress is reported,
    and the reference layout with its run directory."""

    config: str | None
    overrides: list[str]
    steps: int
    out: Path
    tol: Tolerances
    report: Any
    ref: Layout
    ref_dir: Path
    engine: str


class _Target(NamedTuple):
    """Where a resume check resumes a layout's checkpoint: on ``layout`` (with ``overrides`` after
    the run's: the other engine), whose uninterrupted run in ``expected_dir`` the resumed one must
    equal; ``what``: the check's name."""

    layout: Layout
    expected_dir: Path
    what: str
    overrides: tuple[str, ...] = ()


def _state_checks(
    i: int, layout: Layout, run_dir: Path, ctx: _StateContext, checks: tuple[str, ...]
) -> LayoutChecks:
    """Layout ``i``'s resume checks (from its middle checkpoint: on itself, and on the reference's
    layout) and its export check (against the reference's export)."""
    from dtlab.checkpoint.store import step_name

    got = LayoutChecks(layout.name)
    base = ctx.out / _dir_name(i, layout)
    if "resume" in checks:
        ckpt = run_dir / "checkpoints" / step_name(middle_step(ctx.steps))
        targets = [_Target(layout, run_dir, "resume")]
        if i > 0:
            targets.append(_Target(ctx.ref, ctx.ref_dir, f"resume on {ctx.ref.name}"))
        if ctx.engine == "mlx":
            # An MLX checkpoint resumes on the torch engine too: on the reference's layout, it must
            # continue as the reference's own run (the engines train the same, to float32 noise).
            targets.append(
                _Target(
                    ctx.ref, ctx.ref_dir, f"resume on torch {ctx.ref.name}", ("train.engine=torch",)
                )
            )
        for target in targets:
            got.checks.append(_resume_check(ctx, layout, base, ckpt, target))
    if "export" in checks:
        got.checks.append(_export_check(ctx, i, layout, run_dir, base))
    return got


def _resume_check(
    ctx: _StateContext, layout: Layout, base: Path, ckpt: Path, target: _Target
) -> StateCheck:
    """``layout``'s checkpoint ``ckpt`` resumed on ``target.layout`` and trained to the end, beside
    ``base``, then compared with that layout's uninterrupted run (not run for a DiLoCo checkpoint on
    another layout)."""
    what = target.what
    if target.layout is not layout and layout.diloco:
        return StateCheck(
            what, None, None, 0.0, "-", True,
            "not run: a DiLoCo checkpoint holds each replica's own state and resumes only "
            "on its own layout",
        )  # fmt: skip
    middle = middle_step(ctx.steps)
    resumed = Path(f"{base}-{what.replace(' ', '-').replace(':', '-')}")
    ctx.report(f"{layout.name}: {what} from step {middle}")
    train_layout(
        target.layout, ctx.config, [*ctx.overrides, *target.overrides], ctx.steps, resumed,
        resume=ckpt, what=f"{layout.name}: {what} from {ckpt} failed",
    )  # fmt: skip
    grad_norm = not (target.layout.diloco or layout.diloco)
    return _resumed_against(ctx, resumed, target, grad_norm, f"{layout.name} ({what})")


def _resumed_against(
    ctx: _StateContext, resumed: Path, target: _Target, grad_norm: bool, name: str
) -> StateCheck:
    """The resumed run's steps after the middle, and its final parameters, against the target's
    uninterrupted run (``name``: the run, as errors name it)."""
    middle = middle_step(ctx.steps)
    tol = ctx.tol
    run = _metrics(resumed, after=middle)
    expected = _metrics(target.expected_dir, after=middle)
    d = _trajectory(run, expected, tol, grad_norm, name)
    worst, worst_name = _param_diff(target.expected_dir, resumed)
    max_loss = max(d.loss) if d.loss else 0.0
    max_grad = max(d.grad) if d.grad else None
    ok = (
        max_loss <= tol.loss
        and (max_grad is None or max_grad <= tol.grad_norm)
        and worst <= tol.param
    )
    note = "" if d.first is None else f"first differs at step {d.first}"
    return StateCheck(target.what, max_loss, max_grad, worst, worst_name, ok, note)


def _export_check(
    ctx: _StateContext, i: int, layout: Layout, run_dir: Path, base: Path
) -> StateCheck:
    """Layout ``i``'s final checkpoint exported beside ``base`` and compared with the reference's
    export (the reference's own: the one the others are compared with)."""
    exported = Path(f"{base}-export")
    ctx.report(f"{layout.name}: export")
    export_run(run_dir, exported)
    ref_export = ctx.out / f"{_dir_name(0, ctx.ref)}-export"
    worst, worst_name, note = compare_exports(ref_export, exported)
    return StateCheck(
        "export" if i else "export (the reference)", None, None, worst, worst_name,
        worst <= ctx.tol.param, note,
    )  # fmt: skip


def _num(x: float | None, width: int) -> str:
    return f"{'n/a':>{width}}" if x is None else f"{x:>{width}.3e}"


def table(result: Verification) -> str:
    """The comparison as a text table, then one line per layout beyond tolerance; with resume and
    export checks, a second table of them."""
    t = result.tolerances
    start = f", every layout from {result.init_from}" if result.init_from else ""
    lines = [
        f"against {result.reference}, {result.steps} steps{start} (tolerances: loss {t.loss:g}, "
        f"grad norm {t.grad_norm:g} relative, parameters {t.param:g})",
        f"{'layout':<28} {'procs':>5} {'max |loss diff|':>16} {'max grad-norm diff':>19} "
        f"{'max |param diff|':>17}  result",
    ]
    for r in result.rows:
        lines.append(
            f"{r.layout:<28} {r.nproc:>5} {r.max_loss_diff:>16.3e} "
            f"{_num(r.max_grad_norm_rel_diff, 19)} {r.max_param_diff:>17.3e}  "
            f"{'ok' if r.ok else 'DIFFERS'}"
        )
    for r in result.rows:
        if not r.ok:
            step = (
                f"the training first differs beyond tolerance at step {r.first_divergent_step}"
                if r.first_divergent_step is not None
                else "the losses and gradient norms agree"
            )
            lines.append(
                f"{r.layout}: {step}; the parameter that differs most at the end is "
                f"{r.worst_param} (by {r.max_param_diff:.3e})"
            )
    if result.state:
        lines += [
            "",
            f"checkpoint, resume (from step {result.middle}) and export, each against what it must "
            "equal (a resume: the uninterrupted run of the layout it resumes on; an export: the "
            f"reference's, {result.reference})",
            f"{'layout':<28} {'check':<24} {'max |loss diff|':>16} {'max grad-norm diff':>19} "
            f"{'max |param diff|':>17}  result",
        ]
        for s in result.state:
            for c in s.checks:
                verdict = "ok" if c.ok else "DIFFERS"
                if c.note.startswith("not run"):
                    verdict = "-"
                lines.append(
                    f"{s.layout:<28} {c.check:<24} {_num(c.max_loss_diff, 16)} "
                    f"{_num(c.max_grad_norm_rel_diff, 19)} {c.max_param_diff:>17.3e}  {verdict}"
                )
        for s in result.state:
            for c in s.checks:
                if not c.ok or c.note:
                    where = f"; the tensor that differs most is {c.worst_param}" if not c.ok else ""
                    lines.append(f"{s.layout} {c.check}: {c.note or 'differs'}{where}")
    return "\n".join(lines)
