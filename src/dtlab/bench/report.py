"""The human side of ``dtlab bench``: PNG plots and report.md (tables and what they say)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtlab.dims import DPWrapper

MIB = 2**20

# The part of a run's measured peak that the per-rank breakdown does not account for: on CPU the peak
# RSS also holds the Python interpreter, torch's libraries and the allocator's cached blocks; on CUDA
# the allocator's workspaces, communication buffers and temporaries.
UNMODELLED = "not modelled (runtime, allocator, buffers)"
MEMORY_PARTS = (
    ("params_bytes", "params", "#4477aa"),
    ("grads_bytes", "grads", "#66ccee"),
    ("optimizer_bytes", "optimizer", "#228833"),
    ("activation_bytes", "activations", "#ccbb44"),
)
# Two loss curves closer than this fraction of the plotted loss range everywhere draw as one line.
COINCIDE = 0.005
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "v", "D", "x")
PEAK_NOTE = "peak RSS on CPU (the whole process), the CUDA allocator's peak on GPU"
TAIL = 10  # steps the final loss is averaged over: one batch's loss is noisy


def label(r: dict[str, Any]) -> str:
    """A row's name: its layout as a run names it (:func:`dtlab.dims.layout_name`, e.g. ``fsdp 1 x tp
    2``), the precision and the compression."""
    extra = "" if r["compression"] == "none" else f" {r['compression']}"
    return f"{r['layout']} {r['precision']}{extra}"


def memory_segments(rows: list[dict[str, Any]]) -> list[tuple[str, list[float]]]:
    """The stacked segments of ``memory.png`` in MiB per rank, bottom to top: the measured parts, then
    what of the measured peak they leave unexplained (peak - their sum; 0 when the parts, which need
    not all be live at once, add up to more than the peak)."""
    segments = []
    for key, name, _ in MEMORY_PARTS:
        segments.append(
            (
                name,
                [
                    # None: not measured (a pipeline's activations), left to the unmodelled rest.
                    ((r["state_bytes"][key] if key in r["state_bytes"] else r[key]) or 0) / MIB
                    for r in rows
                ],
            )
        )
    modelled = [sum(vals) for vals in zip(*(v for _, v in segments), strict=True)]
    peaks = [r["peak_memory_bytes"] / MIB for r in rows]
    segments.append((UNMODELLED, [max(0.0, p - m) for p, m in zip(peaks, modelled, strict=True)]))
    return segments


def coinciding(curves: dict[str, list[float]]) -> list[list[str]]:
    """Groups (of two or more names) of curves that would draw as one line: the same number of points,
    each within ``COINCIDE`` of the loss range of all curves."""
    values = [v for c in curves.values() for v in c]
    if not values:
        return []
    tol = COINCIDE * (max(values) - min(values)) or 1e-12 * max(abs(v) for v in values)
    groups: list[list[str]] = []
    for name, c in curves.items():
        for g in groups:
            ref = curves[g[0]]
            if len(ref) == len(c) and all(abs(a - b) <= tol for a, b in zip(ref, c, strict=True)):
                g.append(name)
                break
        else:
            groups.append([name])
    return [g for g in groups if len(g) > 1]


def coincide_note(groups: list[list[str]]) -> str:
    """'' or what the title adds about curves drawn on top of each other: '(ddp, fsdp coincide)'."""
    return "".join(f" ({', '.join(g)} coincide)" for g in groups)


def plot_loss_curves(ax: Any, curves: dict[str, list[float]], title: str) -> list[list[str]]:
    """Each curve against its optimizer step, in its own line style and marker so that curves on top
    of each other still all show; the title names those that coincide. Returns those groups."""
    from matplotlib.ticker import MaxNLocator

    for i, (name, losses) in enumerate(curves.items()):
        ax.plot(
            range(1, len(losses) + 1),
            losses,
            label=name,
            lw=1.2,
            ls=LINE_STYLES[i % len(LINE_STYLES)],
            marker=MARKERS[i % len(MARKERS)],
            markevery=max(1, len(losses) // 10),
            ms=4,
            fillstyle="none",
        )
    groups = coinciding(curves)
    if groups:
        ax.set_title(title + coincide_note(groups), fontsize=9)  # a longer title
    else:
        ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return groups


def format_mfu(mfu: float | None, source: str = "measured") -> str:
    """MFU as a percentage; one above 100% says what that means rather than standing as a figure."""
    if mfu is None:
        return "unknown"
    if mfu <= 1:
        return f"{mfu:.1%}"
    if source.startswith("measured"):
        return f"{mfu:.1%} (exceeds the measured peak: the peak measurement is low)"
    return f"{mfu:.1%} (exceeds the {source} peak: check the FLOP count and the device)"


def tail_steps(losses: list[float]) -> int:
    """How many steps ``final_loss`` averages: the last ``TAIL``, or all of a shorter run."""
    return min(TAIL, len(losses))


def tail_phrase(counts: list[int]) -> str:
    """'the mean of the last 5 steps' for the steps the final losses really averaged."""
    n = sorted(set(counts))
    if n == [1]:
        return "the loss of the last step"
    if len(n) == 1:
        return f"the mean of the last {n[0]} steps"
    return f"the mean of the last {n[-1]} steps ({', '.join(map(str, n[:-1]))} in shorter runs)"


def plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """throughput.png, memory.png, communication.png, loss.png (and loss_vs_bytes.png when the runs
    compare compressions) under ``out``; every bar carries its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [label(r) for r in rows]
    width = max(6, 1.2 * len(rows))
    figures = [
        ("throughput.png", (width, 4), _throughput_plot),
        ("overlap.png", (width, 4), _overlap_plot),
        ("memory.png", (width + 2.5, 4), _memory_plot),
        ("communication.png", (width, 4), _communication_plot),
        ("loss.png", (7, 4), _loss_plot),
    ]
    if len({r["compression"] for r in rows}) > 1:
        figures.append(("loss_vs_bytes.png", (7, 4), _loss_vs_bytes_plot))
    paths = []
    for name, size, draw in figures:
        fig, ax = plt.subplots(figsize=size, dpi=100)
        draw(ax, rows, names)
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def _throughput_plot(ax: Any, rows: list[dict[str, Any]], names: list[str]) -> None:
    x = range(len(rows))
    bars = ax.bar(x, [r["tokens_per_s"] for r in rows], color="#4477aa")
    ax.bar_label(bars, [f"{r['tokens_per_s']:,.0f}" for r in rows], fontsize=7)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_title("Throughput (median step)")
    ax.margins(y=0.12)  # room for the labels above the bars


def overlap_cell(r: dict[str, Any], fmt: str, missing: str) -> str:
    """A row's overlap as ``fmt`` formats the fraction; "disturbed" where a baseline took longer
    than the step (see ``overlap_disturbed``); ``missing`` where there is none."""
    if r.get("overlap_disturbed"):
        return "disturbed"
    return missing if r.get("overlap_fraction") is None else fmt.format(r["overlap_fraction"])


def _overlap_plot(ax: Any, rows: list[dict[str, Any]], names: list[str]) -> None:
    """Each run's step next to its compute-only step and its collectives replayed alone, labelled
    with the share of the communication that hid behind computation."""
    x = range(len(rows))
    w = 0.27
    for offset, key, name, color in (
        (-w, "step_time_s", "step", "#4477aa"),
        (0.0, "compute_time_s", "compute only", "#228833"),
        (w, "comm_time_s", "collectives alone", "#ee6677"),
    ):
        vals = [r.get(key) or 0.0 for r in rows]
        bars = ax.bar([i + offset for i in x], vals, w, label=name, color=color)
        if key == "step_time_s":
            ax.bar_label(bars, [overlap_cell(r, "{:.0%} hidden", "") for r in rows], fontsize=7)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("seconds (median)")
    ax.set_title("Overlap: step vs compute only and collectives alone", fontsize=10)
    ax.margins(y=0.15)
    ax.legend(fontsize=7)


def _memory_plot(ax: Any, rows: list[dict[str, Any]], names: list[str]) -> None:
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    colors = [c for _, _, c in MEMORY_PARTS] + ["#bbbbbb"]
    for (name, vals), color in zip(memory_segments(rows), colors, strict=True):
        top = ax.bar(
            x,
            vals,
            bottom=bottom,
            label=name,
            color=color,
            hatch="//" if name == UNMODELLED else None,
        )
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    # The top of each stack is the measured peak (or the parts' sum, where that is more).
    peaks = [f"peak {r['peak_memory_bytes'] / MIB:,.0f}" for r in rows]
    ax.bar_label(top, peaks, fontsize=7)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("MiB per rank")
    ax.set_title("Memory per rank (measured): its parts and the rest of the peak", fontsize=10)
    ax.margins(y=0.12)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside: the bars are tall


def _communication_plot(ax: Any, rows: list[dict[str, Any]], names: list[str]) -> None:
    x = range(len(rows))
    w = 0.4
    for offset, key, name, color in (
        (-w / 2, "comm_bytes_per_step", "measured", "#4477aa"),
        (w / 2, "comm_bytes_per_step_predicted", "predicted", "#ee6677"),
    ):
        vals = [r[key] / MIB for r in rows]
        bars = ax.bar([i + offset for i in x], vals, w, label=name, color=color)
        ax.bar_label(bars, [f"{v:.2f}" for v in vals], fontsize=6)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("MiB per step (one rank's collectives)")
    ax.set_title("Communication: measured vs predicted")
    ax.margins(y=0.12)
    ax.legend()


def _loss_plot(ax: Any, rows: list[dict[str, Any]], names: list[str]) -> None:
    plot_loss_curves(ax, loss_curves(rows), "Loss curves")
    ax.set_ylabel("loss")


def _loss_vs_bytes_plot(ax: Any, rows: list[dict[str, Any]], names: list[str]) -> None:
    for r, name in zip(rows, names, strict=True):
        if r["nproc"] > 1:
            ax.plot(cumulative_bus_bytes(r), r["losses"], label=name, lw=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent by one rank, cumulative (log)")
    ax.set_ylabel("loss")
    ax.set_title("Loss against communication")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def loss_curves(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each run's losses under its label (a repeated label gets its position: two curves, two names)."""
    curves: dict[str, list[float]] = {}
    for i, r in enumerate(rows):
        name = label(r)
        curves[name if name not in curves else f"{name} ({i + 1})"] = r["losses"]
    return curves


def cumulative_bus_bytes(r: dict[str, Any]) -> list[float]:
    """Bytes one rank has sent after each step of the run.

    Every step sends what the counted step sent, except PowerSGD's first ``start_step - 1`` steps,
    which all-reduce uncompressed (``comm_bus_bytes_uncompressed``, the plain DDP figure).
    """
    per_step, plain = r["comm_bus_bytes_per_step"], r.get("comm_bus_bytes_uncompressed", 0)
    start = r.get("compression_start_step", 1) if r["compression"] == "powersgd" else 1
    out, total = [], 0.0
    for step in range(1, len(r["losses"]) + 1):
        total += plain if step < start else per_step
        out.append(total)
    return out


def scaling_baseline(r: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row ``r``'s scaling is judged against: the bench's ``single`` run (no data parallelism)
    at ``r``'s precision; None without one."""
    return next(
        (
            b
            for b in rows
            if DPWrapper.of(b["strategy"]) is DPWrapper.NONE and b["precision"] == r["precision"]
        ),
        None,
    )


def scaling(r: dict[str, Any], base: dict[str, Any] | None) -> tuple[float, float] | None:
    """``r``'s throughput as a multiple of ``base``'s and that multiple per added process (the
    scaling efficiency); None where there is nothing to compare (no baseline, no more processes)."""
    if base is None or r is base or r["nproc"] <= base["nproc"] or not base["tokens_per_s"]:
        return None
    speedup = r["tokens_per_s"] / base["tokens_per_s"]
    return speedup, speedup / (r["nproc"] / base["nproc"])


DISTURBED = (
    "outside what is physically possible: other load on a shared machine disturbed the "
    "measurement (rerun where the machine is quiet)"
)


# A process alone on its cores keeps its threads busy (the debug model's single run used 76-91% of its
# 2 threads on a quiet 2-core machine, 49-51% while other work ran): under this share, load took them.
STARVED_CPU_USE = 0.6
# How far past cores / the baseline's threads a speed-up may go before no measurement explains it: the
# baseline's threads need not all be busy (Python, small kernels), so a little more than the ratio.
SPEEDUP_MARGIN = 1.5


def cpu_capacity(r: dict[str, Any]) -> tuple[int, int] | None:
    """A CPU row's (threads per rank, cores of the machine), as the bench recorded them; None on a GPU
    (where ``cpu_util`` says nothing of the compute) or for rows that do not carry them."""
    if r["device"] != "cpu" or not r.get("cpu_threads") or not r.get("cpu_cores"):
        return None
    return int(r["cpu_threads"]), int(r["cpu_cores"])


def starved(r: dict[str, Any]) -> str | None:
    """A flag when a one-process CPU row used well under what its threads could (STARVED_CPU_USE):
    other load took the cores. Only one process: ranks that wait for their peers' collectives idle
    their cores without any other load."""
    capacity = cpu_capacity(r)
    if capacity is None or r["nproc"] != 1:
        return None
    threads, cores = capacity
    use = r["cpu_util"] * cores / threads  # cpu_util is cores' worth over the machine's cores
    if use >= STARVED_CPU_USE:
        return None
    return f"CPU use {use:.0%} of its {threads} thread(s): other load took the cores"


def _own_disturbances(r: dict[str, Any]) -> list[str]:
    """The flags of a row's own figures, whatever it is compared with."""
    flags = []
    cpu = starved(r)
    if cpu is not None:
        flags.append(cpu)
    step = r["step_time_s"]
    for key, what in (
        ("compute_time_s", "compute-only step"),
        ("comm_time_s", "collectives alone"),
    ):
        part = r.get(key)
        if part is not None and part > step:
            flags.append(f"{what} {part:.3f} s longer than the step {step:.3f} s")
    return flags


def scaling_disturbances(r: dict[str, Any], base: dict[str, Any] | None) -> list[str]:
    """The flags of ``r``'s scaling against ``base``: an efficiency over 100% (more processes on the
    same cores cannot do more than their share), on CPU a speed-up past what the cores can give a
    baseline on its threads (times SPEEDUP_MARGIN), and a baseline whose own figures are disturbed
    (every ratio to it is then as disturbed). Empty where there is no scaling figure."""
    scaled = scaling(r, base)
    if scaled is None or base is None:
        return []
    speedup, efficiency = scaled
    flags = []
    if efficiency > 1:
        flags.append(f"scaling efficiency {efficiency:.0%} (over 100%)")
    capacity = cpu_capacity(base)
    if capacity is not None:
        threads, cores = capacity
        bound = cores / threads * SPEEDUP_MARGIN
        if speedup > bound:
            flags.append(
                f"speed-up {speedup:.2f}x physically impossible: {cores} core(s) give a baseline on "
                f"{threads} thread(s) at most {cores / threads:.2f}x ({bound:.2f}x with a "
                f"{SPEEDUP_MARGIN}x margin)"
            )
    base_flags = _own_disturbances(base)
    if base_flags:
        flags.append(f"against a disturbed baseline: {label(base)} ({'; '.join(base_flags)})")
    return flags


def disturbances(r: dict[str, Any], base: dict[str, Any] | None) -> list[str]:
    """The figures of a row that no undisturbed measurement can give, each as a short flag: on CPU a
    one-process row that used well under its threads' share of the cores (other load took them), a
    compute-only step or a replay of the step's collectives that took longer than the whole step
    they are parts of, and its scaling against ``base`` (:func:`scaling_disturbances`). The one
    judge behind the console, the report, the table and the CSV."""
    return _own_disturbances(r) + scaling_disturbances(r, base)


def _pct(a: float, b: float) -> str:
    return "-" if not b else f"{(a - b) / b:+.1%}"


def report_markdown(results: dict[str, Any], plot_paths: list[Path]) -> str:
    rows = results["rows"]
    lines = ["# dtlab bench report", ""]
    if rows:
        lines += _peaks_lines(results)
        lines += _runs_table(results)
        lines += _memory_table(rows)
        lines += _collectives_table(rows)
        if len({r["compression"] for r in rows}) > 1:
            lines += compression_table(rows)
        lines += ["", "## What it says", "", *interpretation(rows)]
    if results.get("notes"):
        lines += ["", "## Not run as listed", ""] + [f"- {n}" for n in results["notes"]]
    if results["failed"]:
        lines += ["", "## Failed runs", ""] + [
            f"- {f['label']}: {f['error']}" for f in results["failed"]
        ]
    if plot_paths:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plot_paths]
    return "\n".join(lines) + "\n"


def _table_head(*columns: str) -> list[str]:
    """A Markdown table's header row and its separator."""
    return [_table_row(*columns), "|" + "---|" * len(columns)]


def _table_row(*cells: str) -> str:
    """One Markdown table row."""
    return "| " + " | ".join(cells) + " |"


def _peaks_lines(results: dict[str, Any]) -> list[str]:
    """The bench's one peak per precision and the spread of the GEMM runs that measured it."""
    peaks = results.get("peaks") or {}
    if not peaks:
        # On a GPU every row's peak is the datasheet figure of the exact device, times its GPUs.
        sources = sorted({r["peak_flops_source"] for r in results["rows"] if r["device"] != "cpu"})
        return (
            [f"Peak FLOP/s, the same for every row: {', '.join(sources)} (per GPU).", ""]
            if sources
            else []
        )
    lines = ["Peak FLOP/s, measured once for the whole bench:", ""]
    for precision, p in peaks.items():
        spread = peak_spread_flag(p)
        lines.append(
            f"- {precision}: {p['flops'] / 1e9:,.1f} GFLOP/s, the fastest of {len(p['runs'])} GEMM "
            f"runs before the first row on {p['threads']} thread(s); min-median-max "
            f"{p['min'] / 1e9:,.1f}-{p['median'] / 1e9:,.1f}-{p['max'] / 1e9:,.1f} GFLOP/s (every "
            "row's MFU is against it)" + (f"; disturbed: {spread}" if spread else "")
        )
    return [*lines, ""]


# Back-to-back runs of one GEMM on an idle machine differ by a few percent; more is other load.
PEAK_SPREAD_LIMIT = 1.2


def peak_spread_flag(peak: dict[str, Any]) -> str | None:
    """A flag when the GEMM runs that measured the bench's peak differ by more than
    PEAK_SPREAD_LIMIT (fastest over slowest): other load took the cores while it was measured, and
    every row's MFU, a fraction of that peak, is uncertain by as much."""
    if not peak.get("min") or peak["max"] / peak["min"] <= PEAK_SPREAD_LIMIT:
        return None
    return (
        f"its GEMM runs differ by {peak['max'] / peak['min'] - 1:.0%} (fastest over slowest), other "
        "load on a shared machine; every MFU here is uncertain by as much"
    )


def _runs_table(results: dict[str, Any]) -> list[str]:
    rows = results["rows"]
    r0 = rows[0]
    lines = [
        f"Model: {r0['params'] / 1e6:.2f}M parameters, global batch {r0['global_batch_size']} x "
        f"{r0['seq_len']} tokens, {results['warmup']} warm-up + {results['steps']} timed steps per row, "
        f"device {r0['device']}. Times are medians (min-max) over the timed steps; tokens/s counts all ranks; "
        "MFU is against the peak named in the last column.",
        "",
        *_table_head(
            "run", "step s (min-max)", "tokens/s", "MFU", "peak mem MiB", "comm MiB/step (pred.)",
            "comm s", "compute s", "overlap", "CPU util", "final loss", "peak source", "disturbed",
        ),
    ]  # fmt: skip
    flagged = []
    for r in rows:
        flags = disturbances(r, scaling_baseline(r, rows))
        if flags:
            flagged.append(f"- {label(r)}: {'; '.join(flags)}")
        mfu = format_mfu(r["mfu"], r["peak_flops_source"])
        comm_t = "-" if r["comm_time_s"] is None else f"{r['comm_time_s']:.3f}"
        compute_t = "-" if r.get("compute_time_s") is None else f"{r['compute_time_s']:.3f}"
        overlap = overlap_cell(r, "{:.0%}", "-")
        step = f"{r['step_time_s']:.3f} ({r['step_time_min_s']:.3f}-{r['step_time_max_s']:.3f})"
        comm = (
            f"{r['comm_bytes_per_step'] / MIB:.2f} ({r['comm_bytes_per_step_predicted'] / MIB:.2f})"
        )
        lines.append(
            _table_row(
                label(r), step, f"{r['tokens_per_s']:,.0f}", mfu,
                f"{r['peak_memory_bytes'] / MIB:,.0f}", comm, comm_t, compute_t, overlap,
                f"{r['cpu_util']:.0%}",
                f"{r['loss_final']:.4f}", r["peak_flops_source"],
                f"disturbed: {'; '.join(flags)}" if flags else "-",
            )
        )  # fmt: skip
    if flagged:
        lines += ["", f"Disturbed figures, {DISTURBED}:", *flagged]
    disturbed = [r for r in rows if r.get("overlap_disturbed")]
    if disturbed:
        lines += ["", "Overlap not computed (a part alone took longer than the whole step):"]
        lines += [f"- {label(r)}: {r['overlap_disturbed']}" for r in disturbed]
    return lines


def _memory_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## Memory per rank (measured, with the prediction's error)",
        "",
        f"The peak is {PEAK_NOTE}; `{UNMODELLED}` is the peak less the four parts.",
        "",
        *_table_head(
            "run", "params MiB", "grads MiB", "optimizer MiB", "activations MiB (pred. error)",
            f"{UNMODELLED} MiB", "peak MiB",
        ),
    ]  # fmt: skip
    rest = dict(memory_segments(rows))[UNMODELLED]
    for r, other in zip(rows, rest, strict=True):
        s = r["state_bytes"]
        act = (
            "- (not measured under a pipeline)"
            if r["activation_bytes"] is None
            else f"{r['activation_bytes'] / MIB:.2f} "
            f"({_pct(r['activation_bytes_predicted'], r['activation_bytes'])})"
        )
        state = [s[k] / MIB for k in ("params_bytes", "grads_bytes", "optimizer_bytes")]
        lines.append(
            _table_row(
                label(r), *(f"{b:.2f}" for b in state), act, f"{other:,.2f}",
                f"{r['peak_memory_bytes'] / MIB:,.0f}",
            )
        )  # fmt: skip
    return lines


def _collectives_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## Collectives per step (one rank; measured vs predicted bytes)", ""]
    lines += _table_head("run", "collective", "calls", "measured MiB", "predicted MiB")
    for r in rows:
        for name, c in r["comm_by_collective"].items():
            pred = r["comm_by_collective_predicted"].get(name)
            lines.append(
                f"| {label(r)} | {name} | {c['count']} | {c['bytes'] / MIB:.3f} "
                f"| {'-' if pred is None else f'{pred / MIB:.3f}'} |"
            )
    return lines


def interpretation(rows: list[dict[str, Any]]) -> list[str]:
    """A few sentences computed from the figures (not a template of claims)."""
    out = []
    fastest = max(rows, key=lambda r: r["tokens_per_s"])
    out.append(f"- Fastest: {label(fastest)} at {fastest['tokens_per_s']:,.0f} tokens/s.")
    out += _scaling_sentences(rows)
    lean = min(rows, key=lambda r: sum(r["state_bytes"].values()))
    out.append(
        f"- Least state per rank: {label(lean)} ({sum(lean['state_bytes'].values()) / MIB:.2f} MiB of "
        "parameters, gradients and optimizer state)."
    )
    out += _comm_error_sentences(rows)
    for r in rows:
        if r["mfu"] is not None and r["mfu"] > 1:
            out.append(f"- {label(r)}: MFU {format_mfu(r['mfu'], r['peak_flops_source'])}.")
    out.append(_unmodelled_sentence(rows))
    for group in coinciding(loss_curves(rows)):
        out.append(
            f"- The loss curves of {', '.join(group)} coincide (loss.png draws each in its own "
            "line style)."
        )
    cpu_bound = [r for r in rows if r["device"] == "cpu"]
    if cpu_bound:
        out.append(
            "- On CPU, processes share the same cores: more processes split the threads rather than add "
            "compute, so scaling here measures overheads (communication, synchronisation), not speed-up."
        )
    return out


def _scaling_sentences(rows: list[dict[str, Any]]) -> list[str]:
    """Each scaled run's speed-up and efficiency over its baseline, and what disturbed it."""
    out = []
    for r in rows:
        scaled = scaling(r, scaling_baseline(r, rows))
        if scaled is None:
            continue
        speedup, efficiency = scaled
        flags = scaling_disturbances(r, scaling_baseline(r, rows))
        others = [f for f in flags if not f.startswith("scaling efficiency")]
        judged = "."
        if flags:
            judged = (
                ": "
                + ("not physically possible, a" if efficiency > 1 else "a")
                + " measurement disturbed by other load on a shared machine"
                + (f" ({'; '.join(others)})" if others else "")
                + "."
            )
        out.append(
            f"- {label(r)}: {speedup:.2f}x the single-process throughput on {r['nproc']} processes "
            f"({efficiency:.0%} scaling efficiency){judged}"
        )
    return out


def _comm_error_sentences(rows: list[dict[str, Any]]) -> list[str]:
    """The largest error of the predicted bytes per step over the runs that predict any (none
    without such a run)."""
    errs = [
        abs(r["comm_bytes_per_step"] - r["comm_bytes_per_step_predicted"])
        / r["comm_bytes_per_step_predicted"]
        for r in rows
        if r["comm_bytes_per_step_predicted"]
    ]
    if not errs:
        return []
    return [f"- Communication prediction: largest error {max(errs):.2%} over the distributed runs."]


def _unmodelled_sentence(rows: list[dict[str, Any]]) -> str:
    """The range of the memory no model accounts for, in MiB per rank and as a share of the peak."""
    rest = dict(memory_segments(rows))[UNMODELLED]
    share = [o * MIB / (r["peak_memory_bytes"] or 1) for o, r in zip(rest, rows, strict=True)]
    return (
        f"- Not modelled (runtime, allocator, buffers): {min(rest):,.0f}-{max(rest):,.0f} MiB per rank, "
        f"{min(share):.0%}-{max(share):.0%} of the peak; the grey segment of memory.png."
    )


def final_loss(row: dict[str, Any]) -> float:
    """The mean loss of a run's last ``TAIL`` steps (all of them in a shorter run)."""
    tail = row["losses"][-tail_steps(row["losses"]) :]
    return float(sum(tail) / len(tail))


def compression_table(rows: list[dict[str, Any]]) -> list[str]:
    """Bytes and final loss of each compression against plain DDP with the same processes and precision."""
    tail = tail_phrase([tail_steps(r["losses"]) for r in rows if r["nproc"] > 1])
    lines = [
        "",
        "## Compression",
        "",
        *_table_head(
            "run", "bytes sent / step / rank", "less than plain", f"final loss ({tail})", "vs plain"
        ),
    ]
    for r in rows:
        if r["nproc"] == 1:
            continue
        base = next(
            (b for b in rows if b["compression"] == "none" and b["strategy"] == r["strategy"]
             and b["nproc"] == r["nproc"] and b["precision"] == r["precision"]),
            None,
        )  # fmt: skip
        ratio = (
            f"{base['comm_bus_bytes_per_step'] / r['comm_bus_bytes_per_step']:.1f}x"
            if base
            else "-"
        )
        dloss = f"{(final_loss(r) - final_loss(base)) / final_loss(base):+.2%}" if base else "-"
        lines.append(
            f"| {label(r)} | {r['comm_bus_bytes_per_step'] / MIB:.3f} MiB | {ratio} "
            f"| {final_loss(r):.4f} | {dloss} |"
        )
    return lines
