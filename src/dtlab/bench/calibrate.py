"""The plan's step time against measured steps on this machine: ``python -m dtlab.bench.calibrate``.

Each layout of a grid (data parallel, ZeRO-1, FSDP, HSDP, tensor and pipeline parallel, 2-D, with and
without activation checkpointing, at 2 to 8 processes) runs as ``dtlab bench`` times it (its own
processes, warm-up, then timed steps: the median counts), the whole grid ``--rounds`` times over in
turn (the median of its rounds counts), and ``dtlab plan --device this`` predicts the
same config on the same process count: this machine's model step measured once per thread count
(:mod:`dtlab.analysis.probe`) and its loopback's rate. With ``--links 1gbit`` the layouts also run on a
capped link (a network namespace of :mod:`dtlab.bench.link`), where the plan is given the link's rate:
the part of a step's communication that DDP's buckets hide there is what the overlap model predicts.

Prints one row per layout (measured, predicted, error), the mean absolute error with its worst case,
and how well the plan ranks the layouts a user chooses between (:func:`ranking`: Kendall's tau over
every pair of layouts of one model on one process count and link); ``--json OUT`` writes them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtlab.bench.calibrate_replan import median_prediction
from dtlab.cliargs import non_negative_int, output_file, positive_int, run_command
from dtlab.errors import DtlabError

if TYPE_CHECKING:
    from dtlab.bench.link import Link

BASE = [
    "model.preset=tiny",
    "data.source=synthetic",
    "data.seq_len=256",
    "train.global_batch_size=16",
    "train.activation_checkpointing=none",
    "train.precision=fp32",
]
# The `small` preset (97M parameters) at a batch whose step takes seconds, not minutes, on 2 cores.
SMALL_BASE = [
    "model.preset=small",
    "data.source=synthetic",
    "data.seq_len=256",
    "train.global_batch_size=4",
    "train.activation_checkpointing=none",
    "train.precision=fp32",
]
BASES = {"tiny": BASE, "small": SMALL_BASE}
# (name, processes, overrides): every layout dtlab runs, on 2 to 8 processes of this machine.
GRID: list[tuple[str, int, list[str]]] = [
    ("ddp", 2, ["parallel.strategy=ddp"]),
    ("ddp", 4, ["parallel.strategy=ddp"]),
    ("ddp", 8, ["parallel.strategy=ddp"]),
    ("ddp, 1 MiB buckets", 2, ["parallel.strategy=ddp", "parallel.bucket_mb=1"]),
    ("ddp, full AC", 2, ["parallel.strategy=ddp", "train.activation_checkpointing=full"]),
    ("zero-1", 2, ["parallel.strategy=ddp", "parallel.sharding=optimizer"]),
    ("zero-1", 4, ["parallel.strategy=ddp", "parallel.sharding=optimizer"]),
    ("fsdp", 2, ["parallel.strategy=fsdp"]),
    ("fsdp", 4, ["parallel.strategy=fsdp"]),
    ("fsdp", 8, ["parallel.strategy=fsdp"]),
    ("fsdp shard_grad_op", 2, ["parallel.strategy=fsdp", "parallel.sharding=shard_grad_op"]),
    ("hsdp 2x2", 4, ["parallel.strategy=hsdp", "parallel.replicate=2"]),
    ("tp 2", 2, ["parallel.strategy=single", "parallel.tp=2"]),
    (
        "tp 2 + sp",
        2,
        ["parallel.strategy=single", "parallel.tp=2", "parallel.sequence_parallel=true"],
    ),
    ("fsdp 2 x tp 2", 4, ["parallel.strategy=fsdp", "parallel.tp=2"]),
    ("pp 2 1f1b", 2, ["parallel.strategy=single", "parallel.pp=2"]),
    ("pp 2 gpipe", 2, ["parallel.strategy=single", "parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    ("ddp 2 x pp 2", 4, ["parallel.strategy=ddp", "parallel.pp=2"]),
]
# The same kinds of layout on the `small` preset, 2 processes: a model whose matmuls, not the
# wrappers' and collectives' fixed costs, make most of the step.
SMALL_GRID: list[tuple[str, int, list[str]]] = [
    ("small ddp", 2, ["parallel.strategy=ddp"]),
    ("small zero-1", 2, ["parallel.strategy=ddp", "parallel.sharding=optimizer"]),
    ("small fsdp", 2, ["parallel.strategy=fsdp"]),
    ("small fsdp, full AC", 2, ["parallel.strategy=fsdp", "train.activation_checkpointing=full"]),
    ("small tp 2", 2, ["parallel.strategy=single", "parallel.tp=2"]),
    ("small pp 2 1f1b", 2, ["parallel.strategy=single", "parallel.pp=2"]),
]
QUICK = ["ddp", "fsdp"]  # the names --quick runs, at their smallest process count
# Layouts run again on a capped link (where DDP's buckets can hide their all-reduce).
LINKED = ["ddp", "ddp, 1 MiB buckets", "fsdp"]


def measure(
    overrides: list[str], nproc: int, steps: int, warmup: int, prefix: list[str], peak: float
) -> dict[str, Any]:
    """One bench row of ``overrides`` on ``nproc`` processes (run under ``prefix``: a namespace;
    ``peak``: the GEMM FLOP/s its MFU is computed against)."""
    with tempfile.TemporaryDirectory(prefix="dtlab-calibrate-") as tmp:
        out = Path(tmp) / "row.json"
        args = [
            *prefix, sys.executable, "-m", "dtlab.bench.worker", "--out", str(out),
            "--nproc", str(nproc), "--warmup", str(warmup), "--peak-flops", repr(peak),
            "--peak-source", "measured fp32 GEMM once for the calibration", "--timing-only",
            "--set", *overrides,
            f"train.steps={steps}", "run.progress=none", f"run.dir={tmp}/run",
        ]  # fmt: skip
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise DtlabError(f"the run failed: {tail}")
        return dict(json.loads(out.read_text()))


def predict(overrides: list[str], nproc: int, device: Any) -> dict[str, float]:
    """The plan's step of ``overrides`` on ``nproc`` processes of ``device``."""
    from dtlab.analysis.plan import predict_step
    from dtlab.config import load_config

    row = predict_step(load_config(None, overrides), nproc, 1, device)
    return {
        "step_time_s": row.step_time_s,
        "compute_s": row.compute_s + row.recompute_s,
        "comm_s": row.comm_s,
        "exposed_s": row.comm_s if row.exposed_s is None else row.exposed_s,
    }


# (model, layout name, processes, the layout's overrides): one row of the grid to run
_Layout = tuple[str, str, int, list[str]]


def _grid(quick: bool, models: list[str] | None) -> list[_Layout]:
    """The layouts to run: tiny's grid (its two smallest under ``quick``), small's beside it, of
    ``models`` only."""
    grid = [("tiny", *g) for g in GRID]
    if quick:
        grid = [g for g in grid if g[1] in QUICK]
        grid = [g for g in grid if g[2] == min(n for _, name, n, _ in grid if name == g[1])]
    elif models is None or "small" in models:
        grid += [("small", *g) for g in SMALL_GRID]
    if models is not None:
        grid = [g for g in grid if g[0] in models]
    return grid


def _on_link(device: Any, rate: float, link: Link, nproc: int) -> Any:
    """``device`` on a capped link of ``rate`` bits/s: the namespace's loopback carries every
    rank's traffic, so each gets its share."""
    from dtlab.analysis.devices import WAIT_KEYS

    per_rank = rate / 8 / 1e9 / nproc
    rates = {
        k: v if k in WAIT_KEYS else min(v, per_rank)
        for k, v in (device.collective_gbps or {}).items()
    }
    return replace(
        device, intra_node_gbps=per_rank, inter_node_gbps=per_rank,
        collective_gbps=rates or None,
        intra_node_source=f"given: a link of {link.name}, measured {rate / 1e9:.3g} "
        f"Gbit/s, shared by {nproc} ranks",
    )  # fmt: skip


def _row(
    label: str,
    layout: _Layout,
    link: Link,
    got: list[dict[str, Any]],
    wants: list[dict[str, float]],
) -> dict[str, Any]:
    """A measured layout's row from its rounds' runs ``got`` and predictions ``wants`` (one per
    round whose inputs were measured, see :class:`_Calibration`): the median of the rounds'
    medians, the range of every timed step, each round's median, the median prediction and the
    error."""
    model, _, nproc, _ = layout
    rounds = [g["step_time_s"] for g in got]
    measured = statistics.median(rounds)
    want = median_prediction(wants)
    err = want["step_time_s"] / measured - 1
    return {
        "layout": label,
        "model": model,
        "nproc": nproc,
        "link": link.name,
        "measured_s": measured,
        "measured_min_s": min(g["step_time_min_s"] for g in got),
        "measured_max_s": max(g["step_time_max_s"] for g in got),
        "measured_rounds_s": rounds,
        "predicted": want,
        "predicted_rounds_s": [w["step_time_s"] for w in wants],
        "error": err,
    }


@dataclass
class _Calibration:
    """What the runs share: this machine, its GEMM peak, the grid's settings, and the probed device
    of each (model, processes, round).

    ``probe_each_round``: the inputs (the model's step, the collectives, their waits, the wrappers)
    measured again in each round, at the round's first row of that model and process count, and
    each round's rows predicted from its own: a machine whose speed drifts by 10% over the grid's
    minutes then moves the predictions with the measurements, so that the error is the model's,
    not the drift's. Otherwise measured once, in the first round."""

    base: Any
    peak: float
    steps: int
    warmup: int
    sets: list[str] | None
    rounds: int = 1
    probe_each_round: bool = True
    devices: dict[tuple[str, int, int], Any] = field(default_factory=dict)

    def device(self, model: str, nproc: int, common: list[str], round_: int) -> Any:
        """The probed device of ``model`` on ``nproc`` processes in round ``round_`` (from 0): at
        the threads each rank gets."""
        from dtlab.analysis.probe import with_probe
        from dtlab.config import load_config

        key = (model, nproc, round_ if self.probe_each_round else 0)
        if key not in self.devices:
            self.devices[key], why = with_probe(self.base, load_config(None, common), nproc)
            if why:
                raise DtlabError(f"the model cannot be probed: {why}")
        return self.devices[key]


def _run_link(
    cal: _Calibration, link: Link, grid: list[_Layout], rows: list[dict[str, Any]]
) -> None:
    """Measure and predict the grid's layouts on ``link`` (those of ``LINKED`` on a capped one),
    adding their rows to ``rows``: the grid run ``cal.rounds`` times over, in turn (every other
    round in reverse), so that the machine's drift over the minutes the grid takes (a shared
    machine's speed moves by 5-15%) falls on every layout alike rather than on the ones measured
    last."""
    from dtlab.bench.link import link_namespace, measure_link

    with link_namespace(link) as prefix:
        rate = measure_link(prefix) if link.rate_bps else None
        todo = [g for g in grid if not rate or g[1] in LINKED]
        runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(todo))}
        failed: dict[int, str] = {}
        wants: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(todo))}
        for r in range(cal.rounds):
            order = list(range(len(todo)))
            for i in order if r % 2 == 0 else order[::-1]:
                model, _, nproc, extra = todo[i]
                if i in failed:
                    continue
                common = [*BASES[model], *(cal.sets or [])]
                overrides = [*common, *extra]
                if cal.probe_each_round or not wants[i]:
                    device = cal.device(model, nproc, common, r)
                    if rate:
                        device = _on_link(device, rate, link, nproc)
                    wants[i].append(predict(overrides, nproc, device))
                label = _label(todo[i], link, rate)
                print(f"{label}, round {r + 1} of {cal.rounds} ...", flush=True)
                try:
                    got = measure(overrides, nproc, cal.steps, cal.warmup, prefix, cal.peak)
                except DtlabError as e:
                    print(f"  failed: {e}", flush=True)
                    failed[i] = str(e)
                    continue
                runs[i].append(got)
                want = wants[i][-1]
                print(
                    f"  measured {got['step_time_s']:.3f} s, predicted {want['step_time_s']:.3f} s "
                    f"({want['step_time_s'] / got['step_time_s'] - 1:+.1%}; compute "
                    f"{want['compute_s']:.3f} s, communication {want['comm_s']:.3f} s of which "
                    f"exposed {want['exposed_s']:.3f} s)",
                    flush=True,
                )
        for i, layout in enumerate(todo):
            label = _label(layout, link, rate)
            if i in failed:
                rows.append({"layout": label, "error": failed[i]})
            else:
                rows.append(_row(label, layout, link, runs[i], wants[i]))


def _label(layout: _Layout, link: Link | None = None, rate: float | None = None) -> str:
    """A row's label: its layout and process count, and a capped link's name (``rate`` given)."""
    _, name, nproc, _ = layout
    return f"{name} ({nproc})" + (f" at {link.name}" if link and rate else "")


def _inputs(cal: _Calibration, round_: int) -> dict[str, dict[str, Any]]:
    """What round ``round_``'s predictions used, by ``"model x processes"``: the probed step, the
    collectives' rates and waits, the wrappers' costs."""
    devices = {(m, n): d for (m, n, r), d in cal.devices.items() if r == round_}
    return {
        "probes": {f"{m} x {n}": d.probe.as_dict() for (m, n), d in devices.items() if d.probe},
        "collectives": {f"{m} x {n}": d.collective_gbps for (m, n), d in devices.items()},
        "wrappers": {f"{m} x {n}": d.wrapper_s for (m, n), d in devices.items()},
    }


def _summary(cal: _Calibration, rows: list[dict[str, Any]], grid: list[_Layout]) -> dict[str, Any]:
    """The rows with their summary: the errors, the ranking, and what the predictions used."""
    errors: list[float] = [abs(r["error"]) for r in rows if isinstance(r["error"], float)]
    worst = max((r for r in rows if isinstance(r["error"], float)), key=lambda r: abs(r["error"]))
    base = cal.base
    return {
        "rows": rows,
        "rounds": cal.rounds,
        "steps": cal.steps,
        "ranking": ranking(rows),
        "mean_abs_error": statistics.fmean(errors) if errors else None,
        "worst": {"layout": worst["layout"], "error": worst["error"]} if errors else None,
        "cores": os.cpu_count(),
        # The first round's inputs; and, measured in each round, every round's.
        **_inputs(cal, 0),
        "inputs_rounds": (
            [_inputs(cal, r) for r in range(cal.rounds)] if cal.probe_each_round else None
        ),
        "loopback_gbps": base.intra_node_gbps,
        "peak_tflops": base.peak_tflops,
        "base": {m: [*BASES[m], *(cal.sets or [])] for m in sorted({g[0] for g in grid})},
    }


def run(
    quick: bool,
    links: list[str],
    steps: int,
    warmup: int,
    sets: list[str] | None = None,
    models: list[str] | None = None,
    rounds: int = 1,
    probe_each_round: bool = True,
) -> dict[str, Any]:
    """Measure and predict the grid (each layout's settings after its model's base and ``sets``;
    ``models``: of ``BASES``, all by default, tiny's two rows under ``quick``; ``rounds``: times
    the grid is run over, see :func:`_run_link`; ``probe_each_round``: see :class:`_Calibration`);
    returns the rows and the summary."""
    from dtlab.analysis.devices import this_machine
    from dtlab.bench.link import parse_links

    grid = _grid(quick, models)
    base = this_machine("fp32")
    cal = _Calibration(
        base, base.peak_tflops["fp32"] * 1e12, steps, warmup, sets, rounds, probe_each_round
    )
    rows: list[dict[str, Any]] = []
    for link in parse_links(",".join(links)):
        _run_link(cal, link, grid, rows)
    return _summary(cal, rows, grid)


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def _apart(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether the measurement orders rows ``a`` and ``b``: every round the same way where both ran
    in two rounds or more (each round's two runs minutes apart at most, the grid's drift shared),
    else their timed steps' ranges apart."""
    ra, rb = a.get("measured_rounds_s") or [], b.get("measured_rounds_s") or []
    if len(ra) >= 2 and len(ra) == len(rb):
        return {_sign(y - x) for x, y in zip(ra, rb, strict=True)} in ({1}, {-1})
    return b["measured_min_s"] > a["measured_max_s"] or a["measured_min_s"] > b["measured_max_s"]


def ranking(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How well the predicted step times order the layouts a user chooses between: Kendall's tau-b
    over every pair of measured rows of one model on one process count and link (pairs across
    those compare different jobs, and count nothing).

    ``tau``: ordered by the medians alone. ``tau_beyond_noise``: a pair the measurement cannot
    order is a tie of the measurement, as tau-b counts ties: measured over several rounds, a pair
    that not every round orders the same way (:func:`_apart`); in one round, a pair whose timed
    steps' ranges (min-max) overlap. ``apart``: the pairs the plan tells apart, predicted further
    apart than its tie margin (:data:`dtlab.analysis.plan.TIE_MARGIN`: closer than that the search
    calls them a tie, and its recommendation does not rest on their order), and ``apart_agree``:
    of those, the pairs the medians order the same way. ``discordant``: the pairs the plan orders the other way,
    each with both medians."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        if isinstance(r.get("error"), float):
            groups.setdefault((r.get("model"), r["nproc"], r["link"]), []).append(r)

    # Every pair of rows of one group, once.
    pairs = [(a, b) for g in groups.values() for i, a in enumerate(g) for b in g[i + 1 :]]

    def tau(noise: bool) -> tuple[float | None, list[tuple[str, str]]]:
        conc = disc = pred_ties = meas_ties = 0
        wrong: list[tuple[str, str]] = []
        for a, b in pairs:
            p = _sign(b["predicted"]["step_time_s"] - a["predicted"]["step_time_s"])
            m = _sign(b["measured_s"] - a["measured_s"])
            if noise and not _apart(a, b):
                m = 0
            pred_ties += p == 0
            meas_ties += m == 0
            if p * m > 0:
                conc += 1
            elif p * m < 0:
                disc += 1
                wrong.append((a["layout"], b["layout"]))
        denom = math.sqrt((len(pairs) - pred_ties) * (len(pairs) - meas_ties))
        return ((conc - disc) / denom if denom else None), wrong

    from dtlab.analysis.plan import TIE_MARGIN

    apart = agree = 0
    for a, b in pairs:
        pa, pb = a["predicted"]["step_time_s"], b["predicted"]["step_time_s"]
        if max(pa, pb) > min(pa, pb) * (1 + TIE_MARGIN):
            apart += 1
            agree += (pb - pa) * (b["measured_s"] - a["measured_s"]) > 0
    strict, wrong = tau(False)
    noisy, wrong_noisy = tau(True)
    by_name = {r["layout"]: r for g in groups.values() for r in g}

    def pair(a: str, b: str) -> dict[str, Any]:
        return {
            "layouts": [a, b],
            "measured_s": [by_name[a]["measured_s"], by_name[b]["measured_s"]],
            "predicted_s": [
                by_name[a]["predicted"]["step_time_s"],
                by_name[b]["predicted"]["step_time_s"],
            ],
            "beyond_noise": (a, b) in wrong_noisy,
        }

    return {
        "pairs": len(pairs),
        "tau": strict,
        "tau_beyond_noise": noisy,
        "tie_margin": TIE_MARGIN,
        "apart": apart,
        "apart_agree": agree,
        "discordant": [pair(a, b) for a, b in wrong],
    }


def format_table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table, and the summary line."""
    rounds = max((len(r.get("measured_rounds_s") or []) for r in result["rows"]), default=1)
    spread = "each round's median" if rounds > 1 else "min-max"
    lines = (
        [
            "Predicted again by today's plan on the inputs the calibration recorded (--replan: "
            "its measured steps unchanged, nothing measured now).",
            "",
        ]
        if result.get("replanned")
        else []
    )
    lines += [
        f"| layout | measured s ({spread}) | predicted s | compute s | comm s (exposed) | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if not isinstance(r["error"], float):
            lines.append(f"| {r['layout']} | failed: {r['error']} | | | | |")
            continue
        p = r["predicted"]
        each = r.get("measured_rounds_s") or []
        seen = (
            ", ".join(f"{x:.3f}" for x in each)
            if rounds > 1
            else f"{r['measured_min_s']:.3f}-{r['measured_max_s']:.3f}"
        )
        lines.append(
            f"| {r['layout']} | {r['measured_s']:.3f} ({seen}) | {p['step_time_s']:.3f} | "
            f"{p['compute_s']:.3f} | {p['comm_s']:.3f} ({p['exposed_s']:.3f}) | {r['error']:+.1%} |"
        )
    if result["mean_abs_error"] is not None:
        w = result["worst"]
        lines.append("")
        lines.append(
            f"mean absolute error {result['mean_abs_error']:.1%} over {len(result['rows'])} "
            f"layouts; worst {w['layout']}: {w['error']:+.1%}"
        )
    rank = result.get("ranking") or {}
    if rank.get("tau") is not None:
        noisy = rank["tau_beyond_noise"]
        lines.append(
            f"ranking: Kendall's tau {rank['tau']:.2f} over {rank['pairs']} pairs of layouts of one "
            f"model, process count and link ("
            + (f"{noisy:.2f}" if noisy is not None else "-")
            + (
                " with pairs not every round orders alike counted as ties)"
                if rounds > 1
                else " with pairs whose timed steps overlap counted as ties)"
            )
        )
        lines.append(
            f"  of the {rank['apart']} pairs the plan predicts more than its tie margin "
            f"({rank['tie_margin']:.0%}) apart, {rank['apart_agree']} measured in the same order"
        )
        for d in rank["discordant"]:
            (a, b), (ma, mb), (pa, pb) = d["layouts"], d["measured_s"], d["predicted_s"]
            lines.append(
                f"  ordered the other way: {a} measured {ma:.3f} s, predicted {pa:.3f} s; {b} "
                f"measured {mb:.3f} s, predicted {pb:.3f} s"
                + ("" if d["beyond_noise"] else " (within the measurement's noise)")
            )
    return "\n".join(lines)


def replanned(result: dict[str, Any]) -> dict[str, Any]:
    """An earlier calibration's ``result`` predicted again by today's plan on the inputs it
    recorded (:func:`dtlab.bench.calibrate_replan.replan` over this grid)."""
    from dtlab.bench.calibrate_replan import replan

    layouts = {_label(g): (g[0], g[2], g[3]) for g in _grid(False, None)}
    return replan(result, layouts, predict, ranking)


def _read_json(path: str) -> dict[str, Any]:
    """A calibration's --json, or a DtlabError naming the file and why it cannot be read."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DtlabError(f"--replan {path}: cannot read it ({e})") from None
    if not isinstance(data, dict):
        raise DtlabError(f"--replan {path}: not a calibration's --json (not an object)")
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dtlab.bench.calibrate", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="ddp and fsdp on 2 processes only")
    ap.add_argument(
        "--models",
        default=",".join(BASES),
        help=f"comma-separated, of {', '.join(BASES)} (default: all)",
    )
    ap.add_argument(
        "--links", default="none", help="comma-separated: none and/or capped rates, e.g. none,1gbit"
    )
    ap.add_argument(
        "--steps", type=positive_int, default=3, help="timed steps per layout and round (default 3)"
    )
    ap.add_argument(
        "--warmup", type=non_negative_int, default=2, help="untimed steps first (default 2)"
    )
    ap.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="times the grid is run over, in turn (default 3; the median of the rounds counts)",
    )
    ap.add_argument(
        "--probe-once",
        action="store_true",
        help="measure the plan's inputs (the model's step, the collectives, the wrappers) in the "
        "first round only (default: again in each round, each round's rows predicted from its own)",
    )
    ap.add_argument("--json", metavar="OUT", help="also write the rows and summary here")
    ap.add_argument(
        "--replan",
        metavar="FILE",
        help="measure nothing: predict an earlier calibration's rows (its --json) again with "
        "today's plan on the inputs it recorded",
    )
    ap.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="settings on top of the grid's base",
    )
    args = ap.parse_args(argv)
    try:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        if not models or any(m not in BASES for m in models):
            raise DtlabError(f"--models {args.models!r}: expected a comma-separated list of "
                             f"{', '.join(BASES)}")  # fmt: skip
        if args.json:
            output_file(args.json, "--json")  # before the hour of measuring, not after
        if args.replan:
            result = replanned(_read_json(args.replan))
        else:
            result = run(
                args.quick, args.links.split(","), args.steps, args.warmup, args.set, models,
                args.rounds, not args.probe_once,
            )  # fmt: skip
    except DtlabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))  # a DtlabError anywhere: one line, never a traceback
