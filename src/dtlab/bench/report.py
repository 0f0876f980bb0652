"""The human side of ``dtlab bench``: PNG plots and report.md (tables and what they say)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20


def label(r: dict[str, Any]) -> str:
    s = r["strategy"] + (f"/{r['sharding']}" if r.get("sharding", "-") != "-" else "")
    extra = "" if r["compression"] == "none" else f" {r['compression']}"
    return f"{s} x{r['nproc']} {r['precision']}{extra}"


def plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [label(r) for r in rows]
    x = range(len(rows))
    paths = []

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4), dpi=100)
    ax.bar(x, [r["tokens_per_s"] for r in rows], color="#4477aa")
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_title("Throughput (median step)")
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4), dpi=100)
    bottom = [0.0] * len(rows)
    for key, color in (
        ("params_bytes", "#4477aa"),
        ("grads_bytes", "#66ccee"),
        ("optimizer_bytes", "#228833"),
        ("activation_bytes", "#ccbb44"),
    ):
        vals = [(r["state_bytes"][key] if key in r["state_bytes"] else r[key]) / MIB for r in rows]
        ax.bar(x, vals, bottom=bottom, label=key.removesuffix("_bytes"), color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("MiB per rank")
    ax.set_title("Memory per rank (measured)")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "memory.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4), dpi=100)
    w = 0.4
    ax.bar(
        [i - w / 2 for i in x],
        [r["comm_bytes_per_step"] / MIB for r in rows],
        w,
        label="measured",
        color="#4477aa",
    )
    ax.bar(
        [i + w / 2 for i in x],
        [r["comm_bytes_per_step_predicted"] / MIB for r in rows],
        w,
        label="predicted",
        color="#ee6677",
    )
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("MiB per step (one rank's collectives)")
    ax.set_title("Communication: measured vs predicted")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "communication.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for r, name in zip(rows, names, strict=True):
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name, lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("Loss curves")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "loss.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    if len({r["compression"] for r in rows}) > 1:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for r, name in zip(rows, names, strict=True):
            if r["nproc"] > 1:
                ax.plot(cumulative_bus_bytes(r), r["losses"], label=name, lw=1.2)
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent by one rank, cumulative (log)")
        ax.set_ylabel("loss")
        ax.set_title("Loss against communication")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out / "loss_vs_bytes.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


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


def _pct(a: float, b: float) -> str:
    return "-" if not b else f"{(a - b) / b:+.1%}"


def report_markdown(results: dict[str, Any], plot_paths: list[Path]) -> str:
    rows = results["rows"]
    lines = ["# dtlab bench report", ""]
    if rows:
        r0 = rows[0]
        lines += [
            f"Model: {r0['params'] / 1e6:.2f}M parameters, global batch {r0['global_batch_size']} x "
            f"{r0['seq_len']} tokens, {results['warmup']} warm-up + {results['steps']} timed steps per row, "
            f"device {r0['device']}. Times are medians (min-max) over the timed steps; tokens/s counts all ranks; "
            "MFU is against the peak named in the last column.",
            "",
            "| run | step s (min-max) | tokens/s | MFU | peak mem MiB | comm MiB/step (pred.) | comm s | CPU util | final loss | peak source |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            mfu = "unknown" if r["mfu"] is None else f"{r['mfu']:.1%}"
            comm_t = "-" if r["comm_time_s"] is None else f"{r['comm_time_s']:.3f}"
            lines.append(
                f"| {label(r)} | {r['step_time_s']:.3f} ({r['step_time_min_s']:.3f}-{r['step_time_max_s']:.3f}) "
                f"| {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_memory_bytes'] / MIB:,.0f} "
                f"| {r['comm_bytes_per_step'] / MIB:.2f} ({r['comm_bytes_per_step_predicted'] / MIB:.2f}) "
                f"| {comm_t} | {r['cpu_util']:.0%} | {r['loss_final']:.4f} | {r['peak_flops_source']} |"
            )
        lines += [
            "",
            "## Memory per rank (measured, with the prediction's error)",
            "",
            "| run | params MiB | grads MiB | optimizer MiB | activations MiB (pred. error) |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            s = r["state_bytes"]
            lines.append(
                f"| {label(r)} | {s['params_bytes'] / MIB:.2f} | {s['grads_bytes'] / MIB:.2f} "
                f"| {s['optimizer_bytes'] / MIB:.2f} | {r['activation_bytes'] / MIB:.2f} "
                f"({_pct(r['activation_bytes_predicted'], r['activation_bytes'])}) |"
            )
        lines += ["", "## Collectives per step (one rank; measured vs predicted bytes)", ""]
        lines += [
            "| run | collective | calls | measured MiB | predicted MiB |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            for name, c in r["comm_by_collective"].items():
                pred = r["comm_by_collective_predicted"].get(name)
                lines.append(
                    f"| {label(r)} | {name} | {c['count']} | {c['bytes'] / MIB:.3f} "
                    f"| {'-' if pred is None else f'{pred / MIB:.3f}'} |"
                )
        if len({r["compression"] for r in rows}) > 1:
            lines += compression_table(rows)
        lines += ["", "## What it says", "", *interpretation(rows)]
    if results["failed"]:
        lines += ["", "## Failed runs", ""] + [
            f"- {f['label']}: {f['error']}" for f in results["failed"]
        ]
    if plot_paths:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plot_paths]
    return "\n".join(lines) + "\n"


def interpretation(rows: list[dict[str, Any]]) -> list[str]:
    """A few sentences computed from the figures (not a template of claims)."""
    out = []
    fastest = max(rows, key=lambda r: r["tokens_per_s"])
    out.append(f"- Fastest: {label(fastest)} at {fastest['tokens_per_s']:,.0f} tokens/s.")
    single = next((r for r in rows if r["strategy"] == "single"), None)
    if single:
        for r in rows:
            if r is single or r["precision"] != single["precision"]:
                continue
            scale = r["tokens_per_s"] / single["tokens_per_s"]
            out.append(
                f"- {label(r)}: {scale:.2f}x the single-process throughput on {r['nproc']} processes "
                f"({scale / r['nproc']:.0%} scaling efficiency)."
            )
    lean = min(rows, key=lambda r: sum(r["state_bytes"].values()))
    out.append(
        f"- Least state per rank: {label(lean)} ({sum(lean['state_bytes'].values()) / MIB:.2f} MiB of "
        "parameters, gradients and optimizer state)."
    )
    errs = [
        abs(r["comm_bytes_per_step"] - r["comm_bytes_per_step_predicted"])
        / r["comm_bytes_per_step_predicted"]
        for r in rows
        if r["comm_bytes_per_step_predicted"]
    ]
    if errs:
        out.append(
            f"- Communication prediction: largest error {max(errs):.2%} over the distributed runs."
        )
    cpu_bound = [r for r in rows if r["device"] == "cpu"]
    if cpu_bound:
        out.append(
            "- On CPU, processes share the same cores: more processes split the threads rather than add "
            "compute, so scaling here measures overheads (communication, synchronisation), not speed-up."
        )
    return out


TAIL = 10  # steps the final loss is averaged over: one batch's loss is noisy


def final_loss(row: dict[str, Any]) -> float:
    """The mean loss of a run's last TAIL steps."""
    tail = row["losses"][-TAIL:]
    return float(sum(tail) / len(tail))


def compression_table(rows: list[dict[str, Any]]) -> list[str]:
    """Bytes and final loss of each compression against plain DDP with the same processes and precision."""
    lines = [
        "",
        "## Compression",
        "",
        f"| run | bytes sent / step / rank | less than plain | final loss (mean of last {TAIL} steps) | vs plain |",
        "|---|---|---|---|---|",
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
