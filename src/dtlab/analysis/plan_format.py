"""``dtlab plan``'s output for a terminal: the plan and its search as tables, and the number formats
they use."""

from __future__ import annotations

from typing import Any


def format_tflops(x: float) -> str:
    """A peak for people: 989.4, 66.9, 1.23, 0.207 (1 to 3 decimals, 3 significant below 1)."""
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps a figure >= 1: 25.1 GiB, 512.0 MiB, 6.0 KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    """A duration with 3 significant digits: 6.78 s, 5.12 ms, 40.1 µs; '?' when unknown (NaN)."""
    if s != s:
        return "?"
    if s == 0:
        return "0 s"
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= size:
            return f"{_sig3(s / size)} {unit}"
    return f"{_sig3(s / 1e-9)} ns"


def format_count(n: float, unit: str = "") -> str:
    """A count with a decimal prefix and 3 significant digits: 6.74B params, 46.1 GFLOP, 131K."""
    prefixes = (("T", 1e12), ("G" if unit else "B", 1e9), ("M", 1e6), ("K", 1e3))
    for prefix, size in prefixes:
        if n >= size:
            return f"{_sig3(n / size)}{' ' if unit else ''}{prefix}{unit}"
    return f"{_sig3(n)}{' ' if unit else ''}{unit}"


def _sig3(v: float) -> str:
    # 3 significant digits without an exponent (999.7 would otherwise print as 1e+03).
    return f"{v:.3g}" if v < 999.5 else f"{v:.0f}"


def format_plan(p: dict[str, Any]) -> str:
    """The plan as a table for a terminal."""
    head = _head(p)
    lines = [
        *_model_lines(p),
        *_device_lines(p["device"], head),
        *_step_lines(p["assumptions"], head),
        *_float8_lines(p.get("float8")),
        "",
        *_strategy_lines(p),
        *_host_lines(p),
    ]
    if "search" in p:
        lines += ["", *format_search(p["search"])]
    lines += ["", f"recommendation: {p['recommendation']}"]
    rec = p.get("search", {}).get("recommended")
    if rec:
        lines.append(f"run it: {rec['command']}")
    return "\n".join(lines)


def _head(p: dict[str, Any]) -> dict[str, Any]:
    """The header's precision and checkpointing: the recommended row's (or the config's own)."""
    return p.get("header") or {
        "of": "as given",
        "precision": p["precision"],
        "activation_checkpointing": p["activation_checkpointing"],
        "recompute": p["assumptions"]["recompute"],
        "recompute_flops_per_token": p["model"]["recompute_flops_per_token"],
    }


def _whose(head: dict[str, Any]) -> str:
    """What the header's figures are said to be of: the recommended row's, or nothing said."""
    return " (recommended)" if head["of"] == "recommended" else ""


def _model_lines(p: dict[str, Any]) -> list[str]:
    """The model, the world and the batch, each shape with where it comes from."""
    model = p["model"]
    src = p.get("shape_sources", {})

    def where(key: str) -> str:
        return f" ({src[key]})" if key in src else ""

    # A mixture of experts runs a token through its active parameters only (FLOPs count those).
    active = f" ({format_count(model['active_params'])} active)" if "active_params" in model else ""
    return [
        f"model {model['preset'] or 'custom'}{where('model')}: {format_count(model['params'])} "
        f"params{active}, {format_count(model['flops_per_token'], 'FLOP')}/token | {p['world_size']} ranks "
        f"({p['nnodes']} node(s) x {p['nproc']})",
        f"global batch {p['global_batch_size']}{where('train.global_batch_size')} x seq_len "
        f"{p['seq_len']}{where('data.seq_len')}",
    ]


def _device_lines(dev: dict[str, Any], head: dict[str, Any]) -> list[str]:
    """The device's figures, each with its source (the peak of the header's precision), and what
    was measured on this machine."""
    peak = dev["peak_tflops"]  # of the header's precision
    name = dev["name"]
    if dev.get("assumed"):
        name += f" (assumed: the default profile {dev['key']}; pass --device KEY or --device this)"
    return [
        f"device {name}:",
        f"  peak     {format_tflops(peak) if peak else 'unknown'} TFLOP/s {head['precision']}"
        f"{_whose(head)} ({dev['source']})",
        f"  memory   {dev['memory_gib']:.3g} GiB ({dev['memory_source']})",
        f"  in node  {dev['intra_node_gbps']:.3g} GB/s per rank ({dev['intra_node_source']})",
        f"  across   {dev['inter_node_gbps']:.3g} GB/s per rank ({dev['inter_node_source']})",
        *_measured_lines(dev),
    ]


def _measured_lines(dev: dict[str, Any]) -> list[str]:
    """This machine's measured collectives, wrappers and step, those the profile has."""
    from dtlab.analysis.devices import WAIT_KEYS

    lines = []
    groups = dev.get("collective_gbps")
    if groups:
        rates = ", ".join(f"{k} {v:.3g}" for k, v in groups.items() if k not in WAIT_KEYS)
        waits = f"{format_seconds(groups.get('sync_s', 0))} per collective beside compute"
        if "step_wait_s" in groups:
            waits += (
                f", {format_seconds(groups['step_wait_s'])} beside the model's steps on more "
                "ranks than cores"
            )
        lines.append(f"  groups   {rates} GB/s per rank, {waits} ({dev['collective_source']})")
    if dev.get("wrapper_s"):
        lines.append(
            "  wrappers "
            + ", ".join(f"{k} {format_seconds(v)}" for k, v in dev["wrapper_s"].items())
            + " (measured: a rank's step under the fake process group less the plain step; "
            "FSDP's per unit and micro-batch, ZeRO-1's per step, tensor parallelism's per block "
            "and micro-batch and per block and token, sequence parallelism's difference from it)"
        )
    if dev.get("probe"):
        lines.append(
            f"  step     {format_seconds(dev['probe']['seconds_per_token'] * 1e3)} per 1,000 "
            f"tokens of forward and backward and "
            f"{format_seconds(dev['probe'].get('pass_seconds', 0.0))} per pass (micro-batch), "
            f"{format_seconds(dev['probe']['fixed_seconds'])} per optimizer step "
            f"({dev['probe']['source']})"
        )
        slicing = dev["probe"].get("slicing", 1.0)
        if slicing > 1:
            lines.append(
                f"  sharing  the ranks outnumber the cores: their steps all at once took "
                f"{slicing:.2f}x their share of the cores' time (measured with the step's wait)"
            )
    return lines


def _step_lines(a: dict[str, Any], head: dict[str, Any]) -> list[str]:
    """How the step time is made, the fit rule, and the header's checkpointing and its recompute."""
    recompute = (
        f" (+{format_count(head['recompute_flops_per_token'], 'FLOP')}/token)"
        if head["recompute_flops_per_token"]
        else ""
    )
    return [
        f"step time: {a['step_time']}",
        *([a["fit_rule"]] if "fit_rule" in a else []),
        f"activation checkpointing {head['activation_checkpointing']}{_whose(head)}: recompute = "
        f"{head['recompute']}" + recompute,
    ]


def _float8_lines(f8: dict[str, Any] | None) -> list[str]:
    """What the plan predicts for the float8 layers (train.float8) of the header's layout: their
    GEMMs in bf16 and in float8, the casts, the shapes float8 does not speed up, or that the device
    emulates them."""
    if not f8:
        return []
    head = f"float8 ({f8['recipe']}): {f8['layers']} layers a rank"
    if f8["emulated"]:
        casts = f", the casts {format_seconds(f8['casts_s'])} more" if f8["casts_s"] else ""
        return [
            f"{head}, emulated ({f8['why']}): no faster than bf16, their GEMMs "
            f"{format_seconds(f8['gemm_bf16_s'])} a step as in bf16{casts}"
        ]
    lines = [
        f"{head}: GEMMs {format_seconds(f8['gemm_bf16_s'])} in bf16 -> "
        f"{format_seconds(f8['gemm_float8_s'])} in float8 at {format_tflops(f8['peak_tflops'])} "
        f"TFLOP/s fp8 ({f8['why']}); the casts {format_seconds(f8['casts_s'])} "
        f"(memory-bound passes at {f8['memory_gbps']:.4g} GB/s); step "
        f"{'-' if f8['saved_s'] >= 0 else '+'}{format_seconds(abs(f8['saved_s']))}"
    ]
    if f8["memory_bound"]:
        lines.append(
            "  no faster in float8 (memory-bound, kept at their bf16 time): "
            + ", ".join(f8["memory_bound"])
        )
    return lines


def _strategy_lines(p: dict[str, Any]) -> list[str]:
    """The data-parallel strategies' table at the config's own settings; one line when every
    strategy fails alike (e.g. the batch's split)."""
    strategies = p["strategies"]
    w = max([20] + [len(r["label"]) + 1 for r in strategies])  # the label column
    errors = {r.get("error") for r in strategies}
    if len(strategies) > 1 and len(errors) == 1 and None not in errors:
        return [f"the data-parallel strategies at the config's own settings: {min(errors)}"]
    return [
        f"the data-parallel strategies at the config's own settings ({p['precision']}"
        f"{' with float8 ' + p['float8']['recipe'] + ' layers' if p.get('float8') else ''}, "
        f"checkpointing {p['activation_checkpointing']}):",
        f"{'strategy':<{w}}"
        + "".join(f"{h:>11}" for h in ("params", "grads", "optim", "activ", "total"))
        + f"  {'fits':<4}"
        + "".join(f"{h:>11}" for h in ("comm/step", "comm", "compute", "recompute", "step")),
        *(_strategy_row(r, w) for r in strategies),
    ]


def _strategy_row(r: dict[str, Any], w: int) -> str:
    """One strategy's row (``w``: the label column's width): its memory per rank, whether it fits,
    its communication and times; or why it cannot run."""
    if "error" in r:
        return f"{r['label']:<{w}} {r['error']}"
    pr = r["per_rank"]
    comm = sum(r["comm"]["bytes_per_step"].values())
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "total_bytes")
    times = (r["comm"]["time_s"], r["compute_time_s"], r["recompute_time_s"], r["step_time_s"])
    return (
        f"{r['label']:<{w}}"
        + "".join(f"{format_bytes(pr[k]):>11}" for k in keys)
        + f"  {'yes' if r['fits'] else 'NO':<4}{format_bytes(comm):>11}"
        + "".join(f"{format_seconds(t):>11}" for t in times)
    )


def _host_lines(p: dict[str, Any]) -> list[str]:
    """Host memory per rank, beside the device's (not in the table's totals): DiLoCo's outer state and
    an async checkpoint's staging, the most a strategy keeps of each; and what a node's ranks keep
    of it together, against the node's memory where it is known (``--device this``); nothing
    without them."""
    rows = [r["per_rank"] for r in p["strategies"] if "error" not in r]
    host = max((r.get("host_bytes", 0) for r in rows), default=0)
    staging = max((r.get("staging_bytes", 0) for r in rows), default=0)
    lines = []
    if host:
        lines.append(
            f"host memory per rank, beside the device's: DiLoCo's outer state, up to "
            f"{format_bytes(host)} (pinned on a GPU, where torch reserves each tensor's block "
            "rounded up to a power of two)"
        )
    if staging:
        lines.append(
            f"host memory per rank for async checkpoints (checkpoint.async): up to "
            f"{format_bytes(staging)} staged (pinned on a GPU), each rank its share of what the "
            "ranks write"
        )
    if lines:
        lines.append(_node_host_line(p["nproc"], host + staging, p.get("host_memory_gib")))
    return ["", *lines] if lines else []


def _node_host_line(nproc: int, per_rank: int, node_gib: float | None) -> str:
    """What a node's ``nproc`` ranks keep in host memory together, against the node's memory
    (``node_gib``: this machine's, measured; None where the device profile does not say)."""
    node = nproc * per_rank
    said = f"per node, its {nproc} rank{'s' * (nproc > 1)} together: {format_bytes(node)}"
    if node_gib is None:
        return f"{said} (the node's own memory is not in the device profile: compare it there)"
    share = node / (node_gib * 2**30)
    verdict = "MORE THAN THE NODE HAS" if share > 1 else f"{share:.0%}"
    return f"{said}, of this machine's {node_gib:.1f} GiB of host memory: {verdict}"


def format_search(s: dict[str, Any]) -> list[str]:
    """The search's table: the fastest layouts that fit, the recommended one (``*``; added below them
    when a tie made a simpler, slower one the choice), and the config's own layout as given."""
    fixed = f"; kept as given: {', '.join(s['fixed'])}" if s["fixed"] else ""
    rows, rec, given = s["rows"], s["recommended"], s["as_given"]
    fit = rows and rows[0].get("fits")
    lines = [
        f"searched {s['layouts']} layouts in {s['seconds']:.2f} s ({s['costed']} rows costed)",
        f"open: {', '.join(s['open']) or 'nothing'}{fixed}",
        "the fastest that fit (* = recommended):" if fit else "none fits; the closest:",
    ]
    shown = [*rows, *([rec] if rec and all(r["settings"] != rec["settings"] for r in rows) else [])]

    def name(r: dict[str, Any]) -> str:
        if r is given:
            return "as given" + ("" if "error" in r else f": {r['label']}")
        return ("* " if rec and r["settings"] == rec["settings"] else "  ") + r["label"]

    w = max([26] + [len(name(r)) + 1 for r in [*shown, given]])
    lines.append(
        f"{'layout':<{w}}{'precision':<10}{'ac':<10}{'micro':>6}"
        + "".join(f"{h:>11}" for h in ("memory", "comm/step", "comm", "compute", "step"))
    )
    for r in [*shown, given]:
        if "error" in r:
            lines.append(f"{name(r):<{w}}{r['error']}")
            continue
        micro = (
            f"m{r['pp_microbatches']}" if r.get("pp_microbatches") else r["micro_batch_size"] or "-"
        )
        comm = sum(r["comm"]["bytes_per_step"].values())
        lines.append(
            f"{name(r):<{w}}{_precision(r):<10}{r['activation_checkpointing']:<10}{micro!s:>6}"
            + f"{format_bytes(r['per_rank']['total_bytes']) + ('' if r['fits'] else '!'):>11}"
            + f"{format_bytes(comm):>11}"
            + "".join(
                f"{format_seconds(t):>11}"
                for t in (
                    r["comm"]["time_s"],
                    r["compute_time_s"] + r["recompute_time_s"],
                    r["step_time_s"],
                )
            )
        )
    lines.append(
        "(memory per rank, ! = does not fit; micro: samples per micro-batch, m = pipeline micro-"
    )
    lines.append("batches per step, - = no accumulation; compute includes recompute)")
    return lines


def _precision(r: dict[str, Any]) -> str:
    """A row's precision column: bf16+fp8 where its blocks' linear layers train in float8."""
    return r["precision"] + ("+fp8" if r.get("float8") else "")
