"""End-of-run outputs: peak memory, the summary table and the loss-curve PNG."""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any

import torch

from dtlab.metrics.comm_totals import NONE, PREDICTED
from dtlab.metrics.peaks import cuda_peaks


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: on GPU the bytes the CUDA allocator allocated to tensors at the
    run's peak (whatever the memory alert reset; the figure dtlab's predictions model), on CPU the
    peak resident set size."""
    if device.type == "cuda":
        return cuda_peaks(device).run()["allocated"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def peak_reserved_bytes(device: torch.device) -> int | None:
    """The CUDA allocator's reserved peak of the run (tensors plus its cache); None off a GPU."""
    return cuda_peaks(device).run()["reserved"] if device.type == "cuda" else None


def plot_loss(metrics: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Loss against optimizer step, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1.5, label="training")
    val = [m for m in metrics if m.get("val_loss") is not None]
    if val:
        ax.plot(
            [m["step"] for m in val], [m["val_loss"] for m in val], "o-", ms=3, lw=1.2,
            label="validation",
        )  # fmt: skip
        ax.legend()
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel("loss (mean over the global batch)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_routing(metrics: list[dict[str, Any]], path: Path, title: str) -> Path:
    """A mixture-of-experts run's routing, written as a PNG: each expert's share of the routed
    tokens per step (``moe_load``, summed over the MoE blocks, as a multiple of the mean: 1 = even)
    as a heatmap, and the imbalance (``moe_imbalance``, the worst block's max / mean) below it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import MaxNLocator

    routed = [m for m in metrics if m.get("moe_load")]
    steps = [m["step"] for m in routed]
    share = [
        [x * len(m["moe_load"]) / max(sum(m["moe_load"]), 1) for x in m["moe_load"]] for m in routed
    ]
    experts = len(share[0])
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7, 6), dpi=100, sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    # One column per logged step (a gap in the steps logged widens a column); white = the mean
    # load, red above it, blue below.
    norm = TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=max(2.0, max(max(row) for row in share)))
    edges = [s - 0.5 for s in steps] + [steps[-1] + 0.5]
    image = top.pcolormesh(
        edges, [e - 0.5 for e in range(experts + 1)], [list(c) for c in zip(*share, strict=True)],
        cmap="RdBu_r", norm=norm, shading="flat",
    )  # fmt: skip
    fig.colorbar(image, ax=top, label="load / mean load")
    top.set_ylabel("expert")
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_title(f"{title}: tokens per expert, summed over the MoE blocks")
    bottom.plot(steps, [m["moe_imbalance"] for m in routed], lw=1.5)
    bottom.axhline(1.0, color="grey", lw=0.8, ls="--")
    bottom.set_xlabel("optimizer step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylabel("imbalance (max / mean)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _peak_row(s: dict[str, Any]) -> str:
    """The summary's peak memory, saying which figure it is: on a GPU the bytes allocated to tensors
    and, beside them, what the allocator reserved; elsewhere the engine's own figure (the process's
    resident set on CPU)."""
    peak = f"{_human_bytes(s['peak_memory_bytes'])} per rank (max)"
    reserved = s.get("peak_memory_reserved_bytes")
    if reserved is None:
        return peak
    return f"{peak} allocated to tensors, {_human_bytes(reserved)} reserved by the CUDA allocator"


def _layout_row(s: dict[str, Any]) -> str:
    """The layout by its degrees (:func:`dtlab.dims.layout_name`), the processes it ran on and the
    precision, e.g. ``fsdp 1 x tp 2 on 2 processes (fp32)``."""
    world = s["world_size"]
    engine = "mlx " if s.get("engine") == "mlx" else ""
    processes = f"{world} process{'es' if world > 1 else ''}"
    f8 = s.get("float8")
    precision = s["precision"]
    if f8:
        how = "emulated" if f8["emulated"] else "native"
        precision += f"; {f8['layers']} linear layers in float8, {f8['recipe']}, {how}"
    return f"{engine}{s['layout']} on {processes} ({precision})"


def _sent_row(c: dict[str, Any]) -> str:
    """The summary's bytes sent (its ``communication``, :mod:`dtlab.metrics.comm_totals`) in one
    line, saying whether they were measured or predicted, e.g. ``1.2 GiB in all, 12.3 MiB a step
    (collective buffers; 0.9 GiB on the wire), cross-replica 0.4 GiB in 40 collectives; measured
    (run.comm_bytes)``."""
    if c["source"] == NONE:
        return str(c["why"])
    total, per = c["total"], c["per_step"]
    text = (
        f"{_human_bytes(total['comm_bytes'])} in all, {_human_bytes(per['comm_bytes'])} a step "
        f"(collective buffers; {_human_bytes(total['wire_bytes'])} on the wire)"
    )
    if total["cross_replica_bytes"] is None:
        text += ", cross-replica not predicted"
    else:
        text += f", cross-replica {_human_bytes(total['cross_replica_bytes'])}"
        if total["cross_replica_collectives"] is not None:
            text += f" in {total['cross_replica_collectives']:,.0f} collectives"
    if c["source"] == PREDICTED:
        return f"{text}; predicted by dtlab plan (not counted: run.comm_bytes is off)"
    counted, steps = c["steps_counted"], c["steps"]
    if counted < steps:
        return f"{text}; measured over {counted} of {steps} steps (the others uncounted)"
    if counted > steps:  # steps trained again after a rollback count each time
        return f"{text}; measured over {counted} steps taken for {steps} (rolled back ones again)"
    return f"{text}; measured (run.comm_bytes)"


def summary_table(s: dict[str, Any], extra: tuple[tuple[str, str], ...] = ()) -> str:
    """A short human-readable table of a run's summary; ``extra``: rows of the caller's, before
    the run directory."""

    def num(key: str, fmt: str) -> str:
        return "-" if s.get(key) is None else format(s[key], fmt)

    rows = [
        ("layout", _layout_row(s)),
        ("model", f"{s['params'] / 1e6:.2f}M params"),
        ("steps", f"{s['steps']} x {s['global_batch_size']} samples x {s['seq_len']} tokens"),
        ("loss", f"{num('initial_loss', '.4f')} -> {num('final_loss', '.4f')}"),
        *(
            [
                (
                    "validation",
                    f"loss {num('final_val_loss', '.4f')}, perplexity {num('final_val_ppl', '.2f')}",
                )
            ]
            if s.get("final_val_loss") is not None
            else []
        ),
        ("median step time", f"{num('median_step_time_s', '.3f')} s"),
        ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s (all ranks)"),
        ("peak memory", _peak_row(s)),
        ("wall time", f"{s['train_time_s']:.1f} s"),
    ]
    if s.get("communication"):
        group = (s.get("fault_tolerance") or {}).get("replica")  # a fault-tolerant group's summary
        who = "rank 0" if group is None else f"replica {group} rank 0"
        rows.append((f"sent ({who})", _sent_row(s["communication"])))
    if s.get("moe_final_imbalance") is not None:
        rows.append((
            "routing imbalance",
            f"{s['moe_final_imbalance']:.3f} at the end, worst {s['moe_worst_imbalance']:.3f} "
            f"(step {s['moe_worst_imbalance_step']}); 1 = even",
        ))  # fmt: skip
    if s.get("init_from"):
        rows.append(("started from", s["init_from"]))
    if s.get("resumed_from"):
        rows.append(("resumed from", s["resumed_from"]))
    if s.get("bad_steps"):
        rows.append(("bad steps", f"{s['bad_steps']} skipped, {s.get('rollbacks', 0)} rollbacks"))
    if s.get("checkpoint_failures"):
        rows.append(("checkpoint failures", str(s["checkpoint_failures"])))
    if s.get("durable_copy_failures"):
        rows.append(("durable copy failures", str(s["durable_copy_failures"])))
    if s.get("metrics_lost"):
        rows.append(("metrics not written", f"{s['metrics_lost']} records (see the error above)"))
    rows.extend(extra)
    if "run_dir" in s:
        rows.append(("run dir", s["run_dir"]))
    if "loss_plot" in s:
        rows.append(("loss curve", s["loss_plot"]))
    if "routing_plot" in s:
        rows.append(("routing", s["routing_plot"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
