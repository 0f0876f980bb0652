"""Fair baselines of the low-communication bench: every method's loss is compared with DDP trained
with the same ``train.*`` settings (optimizer, learning rate, schedule, ...), on the same seed and
link, and every compressing DiLoCo method with its dense twin (the same DiLoCo, outer gradients sent
whole).

:func:`plan` derives, from the methods asked for and the user's ``--set``, every run the bench needs:
each method's DDP twin (an existing method such as ``ddp`` or ``ddp-muon`` where one resolves to the
same config, else a synthesized ``ddp[train.optimizer=muon,train.lr=8e-3]``) and its dense twin
(``<method>-dense``, or an existing method of the same config). :func:`loss_cost` is the only way the
bench turns two runs into a loss ratio: it refuses two runs whose ``train.*`` settings, seed or link
differ. :func:`loss_curves_plot` draws every method's training loss over the run and its gap to its
own baseline.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtlab.config import load_config
from dtlab.errors import DtlabError

# Optimizers that are their own communication (they replace the gradient all-reduce): no DDP runs
# them, so their baseline is DDP with the common run's optimizer, and the pairing lets the optimizer
# and its own keys differ (only those).
COMM_OPTIMIZERS = {"demo": "train.demo."}
# Compared separately (the seed), or the same in every run of a bench (the steps).
_NOT_SETTINGS = {"train.seed", "train.steps"}
# DiLoCo's keys that do nothing once the outer gradient is sent whole.
_DENSE_IRRELEVANT = ("chunk", "error_decay")
DENSE = ["parallel.diloco.quantize=none", "parallel.diloco.topk=0"]


@dataclass(frozen=True)
class Planned:
    """One run of the bench: its overrides (the user's ``--set`` included), the method it is
    measured against (``baseline``: DDP with the same train settings), its dense twin
    (``dense``: None when it is not DiLoCo) and its resolved ``train.*`` settings."""

    name: str
    overrides: list[str]
    baseline: str
    dense: str | None
    train: dict[str, Any] = field(default_factory=dict)


def _flat(prefix: str, d: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(f"{prefix}{k}.", v)
        else:
            yield f"{prefix}{k}", list(v) if isinstance(v, tuple) else v


def train_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The ``train.*`` settings of a resolved config (``model_dump()``), flat (``train.demo.topk``),
    less the seed and the steps."""
    return {k: v for k, v in _flat("train.", config["train"]) if k not in _NOT_SETTINGS}


def dir_name(method: str) -> str:
    """``method`` as a file name (a synthesized baseline's brackets, commas and ``=`` replaced)."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", method)


class _Resolver:
    """Resolved configs of override lists on top of ``common``, cached; a list the config refuses
    is None (a known method that the user's ``--set`` does not fit is no candidate)."""

    def __init__(self, common: list[str]) -> None:
        self.common = common
        self.cache: dict[tuple[str, ...], dict[str, Any] | None] = {}

    def __call__(self, overrides: list[str]) -> dict[str, Any] | None:
        key = tuple(overrides)
        if key not in self.cache:
            try:
                config = load_config(overrides=[*self.common, *overrides]).model_dump()
            except DtlabError:
                config = None
            if config is not None:
                config["run"].pop("dir", None)
                d = config["parallel"]["diloco"]
                if d["quantize"] == "none" and not d["topk"]:
                    for k in _DENSE_IRRELEVANT:  # no effect on a dense sync: not a difference
                        d.pop(k)
            self.cache[key] = config
        return self.cache[key]

    def need(self, overrides: list[str], method: str) -> dict[str, Any]:
        """The resolved config of ``method``'s run; a DtlabError naming it where the config
        refuses it."""
        config = self(overrides)
        if config is None:
            load_config(overrides=[*self.common, *overrides])  # raises the config's own error
            raise DtlabError(f"{method}: the config refuses {overrides}")  # pragma: no cover
        return config


def _train_overrides(overrides: list[str]) -> list[str]:
    """The ``train.*`` overrides of a method (the last of each key), less the seed and steps, and
    less the optimizer where it is its own communication (DeMo)."""
    last: dict[str, str] = {}
    for o in overrides:
        key = o.split("=", 1)[0]
        if key.startswith("train.") and key not in _NOT_SETTINGS:
            last.pop(key, None)
            last[key] = o
    optimizer = last.get("train.optimizer", "=").split("=", 1)[1]
    if optimizer in COMM_OPTIMIZERS:
        own = COMM_OPTIMIZERS[optimizer]
        last = {k: o for k, o in last.items() if k != "train.optimizer" and not k.startswith(own)}
    return list(last.values())


def _match(
    resolve: _Resolver, config: dict[str, Any], candidates: dict[str, list[str]]
) -> str | None:
    """The first of ``candidates`` (names and their runs' overrides) that resolves to ``config``."""
    return next((m for m, o in candidates.items() if resolve(o) == config), None)


def _is_diloco(config: dict[str, Any]) -> bool:
    return bool(config["parallel"]["diloco"]["inner_steps"])


def _compresses(config: dict[str, Any]) -> bool:
    d = config["parallel"]["diloco"]
    return _is_diloco(config) and (d["quantize"] != "none" or bool(d["topk"]))


def fit_fragments(overrides: list[str], blocks: int) -> list[str]:
    """``overrides`` with a Streaming DiLoCo fragment count above the model's ``blocks`` lowered to
    ``blocks`` (one block a fragment, the most a model has): a streaming method defined with one
    fragment per block of ``tiny`` runs on a shallower shape in the same invocation as methods
    without fragments, each fragment still synced once per H steps (the same bytes a step)."""
    key = "parallel.diloco.fragments="
    return [
        f"{key}{blocks}" if o.startswith(key) and int(o[len(key) :]) > blocks else o
        for o in overrides
    ]


def plan(
    methods: list[str], known: dict[str, list[str]], user: list[str], common: list[str]
) -> dict[str, Planned]:
    """Every run the bench makes for ``methods`` (names of ``known``) with the user's overrides
    ``user`` on top of ``common``: plain DDP (``known``'s ``ddp``, the bytes' reference) first, then
    each method after its DDP twin and its dense twin, each once. A method's DDP twin is the
    ``train.*`` overrides of the method (with ``user`` on top) and nothing else; a compressing DiLoCo
    method's dense twin is the method with ``parallel.diloco.quantize=none`` and ``topk=0``. A twin
    takes the name of a known method that resolves to the same config, else a name of its own.
    A known method's fragments are fitted to the model's blocks (:func:`fit_fragments`)."""
    resolve = _Resolver(common)
    blocks = resolve.need(list(user), "the common run")["model"]["n_layers"]
    known = {m: fit_fragments(o, blocks) for m, o in known.items()}
    out: dict[str, Planned] = {}

    def twin(config: dict[str, Any], name: str, own: list[str], tail: tuple[str, ...]) -> str:
        """The run of ``config``: a known or planned method of the same config, else ``name``,
        the run of ``own`` and ``tail`` (planned now)."""
        runs = {m: [*o, *user] for m, o in known.items()}
        runs.update((n, p.overrides) for n, p in out.items())
        same = _match(resolve, config, runs)
        if same is None:
            add(name, own, tail)
        elif same not in out and same in known:
            add(same, known[same])
        return same or name

    def add(name: str, own: list[str], tail: tuple[str, ...] = ()) -> None:
        """Plan ``name``, the run of ``own`` with ``user`` and then ``tail`` on top, after its
        twins."""
        if name in out:
            return
        overrides = [*own, *user, *tail]
        config = resolve.need(overrides, name)
        ddp = _train_overrides(own)
        ddp_config = resolve.need([*ddp, *user], f"the DDP twin of {name}")
        baseline = name  # plain DDP is its own
        if config != ddp_config:
            baseline = twin(ddp_config, f"ddp[{','.join(ddp)}]", ddp, ())
        dense: str | None = name if _is_diloco(config) else None
        if _compresses(config):
            dense_config = resolve.need([*overrides, *DENSE], f"{name}-dense")
            dense = twin(dense_config, f"{name}-dense", own, (*tail, *DENSE))
        out[name] = Planned(name, overrides, baseline, dense, train_settings(config))

    add("ddp", known["ddp"])
    for m in methods:
        add(m, known[m])
    return out


def check_pair(row: dict[str, Any], base: dict[str, Any]) -> None:
    """Refuse (DtlabError naming both methods and what differs) a loss ratio of ``row`` over
    ``base`` when their ``train.*`` settings, seed or link differ; a method whose optimizer is its
    own communication (DeMo) may differ from its baseline in the optimizer and its own keys only."""
    a, b = row.get("train_settings", {}), base.get("train_settings", {})
    optimizer = a.get("train.optimizer")
    own = COMM_OPTIMIZERS.get(optimizer) if optimizer != b.get("train.optimizer") else None
    diff = [
        f"{k} {a.get(k)!r} against {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and not (own and (k == "train.optimizer" or k.startswith(own)))
    ]
    for key in ("seed", "link"):
        if row.get(key) != base.get(key):
            diff.append(f"{key} {row.get(key)!r} against {base.get(key)!r}")
    if diff:
        raise DtlabError(
            f"no loss ratio of {row['method']} over {base['method']}: their runs differ in "
            f"{'; '.join(diff)} (a loss is compared only with a run of the same train settings, "
            "seed and link)"
        )


def loss_cost(row: dict[str, Any], base: dict[str, Any]) -> float | None:
    """``row``'s final validation loss over ``base``'s, less 1 (None where either has none), after
    :func:`check_pair`."""
    check_pair(row, base)
    if row.get("final_val_loss") is None or not base.get("final_val_loss"):
        return None
    return float(row["final_val_loss"] / base["final_val_loss"] - 1)


def _find(
    rows: list[dict[str, Any]], r: dict[str, Any], method: str | None
) -> dict[str, Any] | None:
    """The run of ``method`` with ``r``'s seed and link."""
    return next(
        (
            x
            for x in rows
            if x["method"] == method and x.get("seed") == r.get("seed") and x["link"] == r["link"]
        ),
        None,
    )


def fill_costs(rows: list[dict[str, Any]]) -> None:
    """Each row's ``loss_cost`` over its ``baseline``'s run and ``dense_loss_cost`` over its
    ``dense_method``'s (same seed and link), with those runs' final validation losses; a row
    without such a run gets neither."""
    for r in rows:
        base = _find(rows, r, r.get("baseline"))
        if base is not None:
            r["baseline_final_val_loss"] = base["final_val_loss"]
            cost = loss_cost(r, base)
            if cost is not None:
                r["loss_cost"] = cost
        dense = _find(rows, r, r.get("dense_method"))
        if dense is not None:
            r["dense_final_val_loss"] = dense["final_val_loss"]
            cost = loss_cost(r, dense)
            if cost is not None:
                r["dense_loss_cost"] = cost


def _stats(values: list[float], name: str) -> dict[str, float | None]:
    return {
        f"mean_{name}": statistics.fmean(values) if values else None,
        f"min_{name}": min(values) if values else None,
        f"max_{name}": max(values) if values else None,
    }


def cost_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over one method's runs (its seeds on one link): its baseline and dense twin, the mean, lowest
    and highest of both costs, whether it is within 2% of DDP (its mean loss cost is) and within 1%
    of dense DiLoCo (its mean dense cost is), and its mean bytes reduction against plain DDP."""
    costs = [r["loss_cost"] for r in runs if r.get("loss_cost") is not None]
    dense = [r["dense_loss_cost"] for r in runs if r.get("dense_loss_cost") is not None]
    reduction = [r["bytes_reduction"] for r in runs if r.get("bytes_reduction") is not None]
    out: dict[str, Any] = {
        "baseline": runs[0].get("baseline"),
        "dense_method": runs[0].get("dense_method"),
        **_stats(costs, "loss_cost"),
        **_stats(dense, "dense_loss_cost"),
        "mean_bytes_reduction": statistics.fmean(reduction) if reduction else None,
    }
    out["within_2_percent_of_ddp"] = bool(costs) and out["mean_loss_cost"] <= 0.02
    out["within_1_percent_of_dense"] = bool(dense) and out["mean_dense_loss_cost"] <= 0.01
    return out


def _smoothed(losses: list[float], n: int) -> list[float]:
    return [statistics.fmean(losses[max(0, i + 1 - n) : i + 1]) for i in range(len(losses))]


def mean_curve(runs: list[dict[str, Any]], smooth: int) -> list[float]:
    """The mean over ``runs`` (seeds) of each one's smoothed training loss, step by step (as long
    as the shortest run)."""
    curves = [_smoothed(r["losses"], smooth) for r in runs]
    n = min(len(c) for c in curves)
    return [statistics.fmean(c[i] for c in curves) for i in range(n)]


def gap_curve(rows: list[dict[str, Any]], method: str, smooth: int) -> list[float] | None:
    """``method``'s mean smoothed training loss over its baseline's (the same seeds, each pair
    checked by :func:`check_pair`), less 1, in percent, step by step; None for a method that is its
    own baseline or whose baseline did not run."""
    runs = [r for r in rows if r["method"] == method]
    baseline = runs[0].get("baseline")
    if baseline in (None, method):
        return None
    bases = [_find(rows, r, baseline) for r in runs]
    if any(b is None for b in bases):
        return None
    for r, b in zip(runs, bases, strict=True):
        check_pair(r, b)  # type: ignore[arg-type]
    mine, theirs = mean_curve(runs, smooth), mean_curve(bases, smooth)  # type: ignore[arg-type]
    return [100 * (x / y - 1) for x, y in zip(mine, theirs, strict=False)]


def curve_styles(rows: list[dict[str, Any]]) -> dict[str, tuple[int | None, str, str]]:
    """How each method of ``rows`` is drawn among many: (its colour's index, or None for a
    baseline, drawn in greys; its line style; its label). A compressing method has a colour of its
    own; its dense twin the same colour dashed, so that each pair reads as one; a baseline (a method
    that is its own) solid grey."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    first = {m: next(r for r in rows if r["method"] == m) for m in methods}
    twin_of: dict[str, str] = {}
    for m in methods:
        dense = first[m].get("dense_method")
        if dense and dense != m:
            twin_of.setdefault(dense, m)
    styles: dict[str, tuple[int | None, str, str]] = {}
    colours = 0
    for m in methods:
        if first[m].get("baseline") == m:
            styles[m] = (None, "-", m)
        elif m not in twin_of:
            styles[m] = (colours, "-", m)
            colours += 1
    for m in methods:
        if m not in styles:
            colour = styles.get(twin_of[m], (None, "", ""))[0]
            styles[m] = (colour, "--", f"{m} (dense twin of {twin_of[m]})")
    return styles


def loss_curves_plot(rows: list[dict[str, Any]], path: Path, smooth: int) -> Path:
    """Every method's training loss over the whole run (``smooth``-step moving average, mean over
    the seeds, first link) and, below, its gap to its own baseline in percent, to ``path``; each
    dense twin dashed in its method's colour (:func:`curve_styles`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = rows[0]["link"]
    sub = [r for r in rows if r["link"] == first]
    styles = curve_styles(sub)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 8), dpi=100, sharex=True)
    colors = plt.get_cmap("tab10")
    greys = iter(["black", "dimgray", "darkgray"] * len(styles))
    ceiling = 0.0
    for method, (index, dash, label) in styles.items():
        color = next(greys) if index is None else colors(index % 10)
        curve = mean_curve([r for r in sub if r["method"] == method], smooth)
        top.plot(range(1, len(curve) + 1), curve, color=color, ls=dash, lw=1, label=label)
        ceiling = max(ceiling, curve[len(curve) // 40])
        gap = gap_curve(sub, method, smooth)
        if gap is not None:
            bottom.plot(range(1, len(gap) + 1), gap, color=color, ls=dash, lw=1, label=label)
    seeds = len(dict.fromkeys(r.get("seed") for r in sub))
    top.set_ylabel(
        f"training loss ({smooth}-step mean" + (f", mean of {seeds} seeds)" if seeds > 1 else ")")
    )
    top.set_title(f"loss over the run (link {first})")
    # The first fortieth of the run (the loss falling from ln(vocabulary)) off the top, so that
    # the rest, where the methods differ by a few percent, fills the panel.
    top.set_ylim(top=ceiling * 1.05)
    top.legend(fontsize=7, ncol=2)
    bottom.axhline(0, color="black", lw=0.8)
    bottom.set_ylabel("gap to its baseline (%)")
    bottom.set_xlabel("step")
    bottom.set_title("over DDP with the same train settings (smoothed loss ratio, less 1)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# What the report's loss columns mean.
FAIR_NOTE = (
    "Loss cost: the final validation loss over that of the method's baseline, less 1: DDP with the "
    "same train settings (optimizer, learning rate, ...), same seed and link (DeMo, whose optimizer "
    "is its communication: DDP with the common run's optimizer). Dense loss cost: over the method's "
    "dense twin (the same DiLoCo, outer gradients sent whole). x DDP: plain DDP's bytes over the "
    "method's (bytes do not depend on the optimizer)."
)
# The report's loss columns: one seed, and the mean (min to max) over several.
COST_COLUMNS = "baseline | loss cost | dense | dense loss cost"
SEEDS_COST_COLUMNS = (
    "baseline | loss cost | within 2% of DDP | dense | dense loss cost | within 1% of dense"
)


def _pct(values: list[float], spread: bool) -> str:
    if not values:
        return "-"
    v = [100 * x for x in values]
    mean = f"{statistics.fmean(v):+.2f}%"
    return f"{mean} ({min(v):+.2f}% to {max(v):+.2f}%)" if spread else mean


def cost_cells(runs: list[dict[str, Any]], seeds: bool) -> str:
    """One method's cells under :data:`COST_COLUMNS` (or :data:`SEEDS_COST_COLUMNS` with
    ``seeds``: each cost's mean, lowest and highest over the runs, and the verdicts)."""
    s = cost_summary(runs)
    costs = [r["loss_cost"] for r in runs if r.get("loss_cost") is not None]
    dense = [r["dense_loss_cost"] for r in runs if r.get("dense_loss_cost") is not None]
    cells = [s["baseline"] or "-", _pct(costs, seeds), s["dense_method"] or "-", _pct(dense, seeds)]
    if seeds:
        cells.insert(2, "yes" if s["within_2_percent_of_ddp"] else "no")
        cells.append("yes" if s["within_1_percent_of_dense"] else ("no" if dense else "-"))
    return " | ".join(cells)
