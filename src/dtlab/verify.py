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
    tp:N   sp:N             tensor parallel over N ranks (sp: with sequence parallelism)
    pp:N[:SCHEDULE]         pipeline parallel over N ranks (schedule: parallel.pp_schedule's values)

e.g. ``single,ddp:2,fsdp:2xtp:2,pp:2:interleaved_1f1b,fsdp:2xpp:2``. Processes: the product of the
degrees.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dtlab.dims import DPWrapper, needs_replica_groups, strategies_with
from dtlab.errors import ConfigError, DtlabError

_DIM = re.compile(r"^(?P<name>[a-z]+)(?::(?P<degree>\d+))?(?::(?P<option>[a-z0-9_]+))?$")
_DATA = tuple(strategies_with(*DPWrapper))  # parallel.strategy's names
_NAMES = (*_DATA, "tp", "sp", "pp")


@dataclass(frozen=True)
class Layout:
    """One layout to train: its name as written, its process count and its config overrides."""

    name: str
    nproc: int
    overrides: tuple[str, ...]


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


def _parse_layout(item: str) -> Layout:
    strategy, dp = strategies_with(DPWrapper.NONE)[0], 1
    overrides: list[str] = []
    seen: set[str] = set()
    degrees = {"tp": 1, "pp": 1}
    for part in item.split("x"):
        m = _DIM.match(part)
        if not m or m["name"] not in _NAMES:
            raise ConfigError(
                f"--layouts: {part!r} in {item!r} is not NAME:DEGREE with NAME one of "
                f"{', '.join(_NAMES)} (e.g. fsdp:2xtp:2, pp:2:gpipe)"
            )
        name, option = m["name"], m["option"]
        degree = int(m["degree"]) if m["degree"] else 1
        kind = "data" if name in _DATA else ("tp" if name == "sp" else name)
        if kind in seen:
            raise ConfigError(f"--layouts: {item!r} gives {kind} parallelism twice")
        seen.add(kind)
        alone = kind == "data" and DPWrapper.of(name) is DPWrapper.NONE  # one process
        if degree < 1 or (alone and m["degree"] and degree != 1):
            raise ConfigError(f"--layouts: {part!r} in {item!r}: the degree must be at least 1")
        if option is not None and name != "pp":
            raise ConfigError(
                f"--layouts: {part!r} in {item!r}: only pp takes an option (its schedule)"
            )
        if kind == "data":
            strategy, dp = name, degree
            if needs_replica_groups(name):
                if degree % 2:
                    raise ConfigError(
                        f"--layouts: {part!r}: hsdp runs two replica groups, so its degree must be even"
                    )
                overrides.append("parallel.replicate=2")
        else:
            degrees[kind] = degree
            overrides.append(f"parallel.{kind}={degree}")
            if name == "sp":
                overrides.append("parallel.sequence_parallel=true")
            if option is not None:
                overrides.append(f"parallel.pp_schedule={option}")
    overrides.insert(0, f"parallel.strategy={strategy}")
    return Layout(item, dp * degrees["tp"] * degrees["pp"], tuple(overrides))


@dataclass
class Comparison:
    """One layout against the reference."""

    layout: str
    nproc: int
    steps: int
    max_loss_diff: float
    max_grad_norm_rel_diff: float
    max_param_diff: float
    worst_param: str
    first_divergent_step: int | None  # the first step whose loss or gradient norm differs beyond it
    ok: bool


@dataclass
class Tolerances:
    """What ``verify`` accepts as the same training (float32 reduction-order noise is far below)."""

    loss: float = 1e-4  # absolute, on every step
    grad_norm: float = 1e-3  # relative, on every step
    param: float = 1e-4  # absolute, any element after the last step


@dataclass
class Verification:
    """Every layout's comparison with the reference layout."""

    reference: str
    steps: int
    tolerances: Tolerances
    rows: list[Comparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)


def train_layout(
    layout: Layout, config: str | None, overrides: list[str], steps: int, run_dir: Path
) -> None:
    """Train ``layout`` for ``steps`` steps into ``run_dir`` (which must not exist) with ``dtlab train``,
    checkpointing the last step; a DtlabError with the output's tail when it fails."""
    cmd = [
        sys.executable, "-m", "dtlab", "train", *([config] if config else []),
        "--nproc", str(layout.nproc), "--set", *overrides, *layout.overrides,
        f"train.steps={steps}", f"run.dir={run_dir}", "run.log_every=1", f"checkpoint.every={steps}",
        "checkpoint.keep=1", "checkpoint.resume=never", "run.progress=none", "run.plot=false",
        "run.tensorboard=false", "run.trackers=[]",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
        raise DtlabError(
            f"layout {layout.name} failed to train (exit code {proc.returncode}):\n{tail}"
        )


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [m for m in map(json.loads, lines) if "loss" in m]


def compare_runs(
    name: str, nproc: int, ref_dir: Path, run_dir: Path, tol: Tolerances
) -> Comparison:
    """``run_dir``'s training against ``ref_dir``'s: losses and gradient norms per step, parameters at
    the end."""
    from dtlab.checkpoint.export import find_checkpoint, load_model_state

    ref, run = _metrics(ref_dir), _metrics(run_dir)
    if [m["step"] for m in ref] != [m["step"] for m in run]:
        raise DtlabError(f"layout {name} logged other steps than the reference")
    loss_diffs = [_diff(m["loss"], r["loss"]) for m, r in zip(run, ref, strict=True)]
    grad_diffs = [
        _diff(m["grad_norm"], r["grad_norm"]) / max(abs(r["grad_norm"] or 0.0), 1e-12)
        for m, r in zip(run, ref, strict=True)
    ]
    first = next(
        (
            m["step"]
            for m, dl, dg in zip(run, loss_diffs, grad_diffs, strict=True)
            if dl > tol.loss or dg > tol.grad_norm
        ),
        None,
    )
    ref_state = load_model_state(find_checkpoint(ref_dir, warn=lambda _: None))
    state = load_model_state(find_checkpoint(run_dir, warn=lambda _: None))
    worst, worst_name = 0.0, "-"
    for key, value in ref_state.items():
        d = float((state[key].float() - value.float()).abs().max()) if key in state else math.inf
        if not d <= worst:  # NaN counts as the worst
            worst, worst_name = d, key
    max_loss, max_grad = max(loss_diffs), max(grad_diffs)
    ok = max_loss <= tol.loss and max_grad <= tol.grad_norm and worst <= tol.param
    return Comparison(
        name, nproc, len(run), max_loss, max_grad, worst, worst_name, first, ok
    )  # fmt: skip


def _diff(a: float | None, b: float | None) -> float:
    """|a - b|, with a missing (non-finite) value on one side only as an infinite difference."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    return abs(a - b)


def verify(
    layouts: list[Layout],
    config: str | None,
    overrides: list[str],
    steps: int,
    out: Path,
    tol: Tolerances | None = None,
    report: Any = print,
) -> Verification:
    """Train every layout into ``out/<n>-<layout>`` and compare each with the first."""
    tol = tol or Tolerances()
    out.mkdir(parents=True, exist_ok=True)
    dirs = []
    for i, layout in enumerate(layouts):
        run_dir = out / f"{i}-{re.sub(r'[^a-z0-9_]+', '-', layout.name)}"
        if run_dir.exists():
            raise ConfigError(
                f"{run_dir} exists: verify trains every layout from scratch; give --out a new "
                "directory (or delete it)"
            )
        report(f"training {layout.name} ({layout.nproc} process{'es' if layout.nproc > 1 else ''})")
        train_layout(layout, config, overrides, steps, run_dir)
        dirs.append(run_dir)
    result = Verification(layouts[0].name, steps, tol)
    for layout, run_dir in zip(layouts[1:], dirs[1:], strict=True):
        result.rows.append(compare_runs(layout.name, layout.nproc, dirs[0], run_dir, tol))
    (out / "verify.json").write_text(
        json.dumps({**asdict(result), "ok": result.ok}, indent=2) + "\n", encoding="utf-8"
    )
    return result


def table(result: Verification) -> str:
    """The comparison as a text table, then one line per layout beyond tolerance."""
    t = result.tolerances
    lines = [
        f"against {result.reference}, {result.steps} steps (tolerances: loss {t.loss:g}, grad norm "
        f"{t.grad_norm:g} relative, parameters {t.param:g})",
        f"{'layout':<28} {'procs':>5} {'max |loss diff|':>16} {'max grad-norm diff':>19} "
        f"{'max |param diff|':>17}  result",
    ]
    for r in result.rows:
        lines.append(
            f"{r.layout:<28} {r.nproc:>5} {r.max_loss_diff:>16.3e} {r.max_grad_norm_rel_diff:>19.3e} "
            f"{r.max_param_diff:>17.3e}  {'ok' if r.ok else 'DIFFERS'}"
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
    return "\n".join(lines)
