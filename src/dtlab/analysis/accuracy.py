"""How far the analytic plan is from the checked code: ``python -m dtlab.analysis.accuracy``.

Runs ``dtlab plan --check`` (:func:`dtlab.analysis.check.check_rank`) over a grid of layouts, presets
and world sizes and prints, per row, the step's peak error (predicted against checked) and each
component's at the checked peak, as a markdown table, the table docs/planning.md quotes. ``--json OUT`` keeps every figure; ``--quick`` runs the
small rows only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from dtlab.analysis.check import COMPONENTS, check_rank
from dtlab.config import load_config

BASE = ["train.precision=bf16", "train.global_batch_size={gbs}", "data.seq_len={seq}"]

# (preset, nproc, nnodes, layout label, overrides, seq_len, global batch, quick)
GRID: list[tuple[str, int, int, str, list[str], int, int, bool]] = [
    ("debug", 8, 1, "ddp", ["parallel.strategy=ddp"], 64, 16, True),
    ("debug", 8, 1, "zero-1", ["parallel.strategy=ddp", "parallel.sharding=optimizer"], 64, 16, True),
    ("debug", 8, 1, "fsdp full", ["parallel.strategy=fsdp"], 64, 16, True),
    ("debug", 8, 1, "fsdp shard_grad_op",
     ["parallel.strategy=fsdp", "parallel.sharding=shard_grad_op"], 64, 16, True),
    ("debug", 8, 1, "hsdp 2x4", ["parallel.strategy=hsdp", "parallel.replicate=2"], 64, 16, True),
    ("debug", 8, 1, "fsdp 4 x tp 2", ["parallel.strategy=fsdp", "parallel.tp=2"], 64, 16, True),
    ("debug", 8, 1, "fsdp 4 x tp 2 sp",
     ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.sequence_parallel=true"], 64, 16, True),
    ("debug", 8, 1, "fsdp 4 x pp 2 (1f1b)",
     ["parallel.strategy=fsdp", "parallel.pp=2", "parallel.pp_schedule=1f1b"], 64, 16, True),
    ("debug", 8, 1, "fsdp 4 x pp 2 (gpipe)",
     ["parallel.strategy=fsdp", "parallel.pp=2", "parallel.pp_schedule=gpipe",
      "parallel.pp_microbatches=4"], 64, 16, True),
    ("debug", 8, 1, "fsdp 4 x pp 2 (interleaved_1f1b), 4 blocks",
     ["model.n_layers=4", "parallel.strategy=fsdp", "parallel.pp=2",
      "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_microbatches=4"], 64, 16, True),
    ("debug", 8, 1, "fsdp 2 x tp 2 x pp 2 (1f1b)",
     ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=1f1b"],
     64, 16, True),
    ("debug", 8, 1, "fsdp 4 x pp 2 (1f1b), wide, 16 tokens a sequence",
     ["model.dim=128", "model.ffn_dim=512", "model.n_layers=4", "parallel.strategy=fsdp",
      "parallel.pp=2", "parallel.pp_schedule=1f1b"], 16, 16, True),
    ("debug", 8, 1, "ddp 4 x pp 2 (1f1b), wide, vocabulary 4,096, 16 tokens a sequence",
     ["model.dim=128", "model.ffn_dim=512", "model.n_layers=4", "model.vocab_size=4096",
      "parallel.strategy=ddp", "parallel.pp=2", "parallel.pp_schedule=1f1b"], 16, 16, True),
    ("debug", 8, 1, "diloco 8, int8, 2 fragments, delay 1",
     ["parallel.strategy=ddp", "parallel.diloco.inner_steps=8", "parallel.diloco.fragments=2",
      "parallel.diloco.delay=1", "parallel.diloco.quantize=int8"], 64, 16, True),
    ("debug", 8, 1, "diloco 2 x fsdp 4, sparse int2",
     ["parallel.strategy=fsdp", "parallel.diloco.inner_steps=8", "parallel.diloco.replicas=2",
      "parallel.diloco.topk=0.05", "parallel.diloco.quantize=int2"], 64, 16, True),
    ("llama3.2-1b", 8, 1, "fsdp full", ["parallel.strategy=fsdp"], 2048, 8, False),
    ("llama3.2-1b", 8, 1, "diloco 2 x fsdp 4, int4, 4 fragments, delay 2",
     ["parallel.strategy=fsdp", "parallel.diloco.inner_steps=100", "parallel.diloco.replicas=2",
      "parallel.diloco.fragments=4", "parallel.diloco.delay=2", "parallel.diloco.quantize=int4"],
     2048, 8, False),
    ("llama3.2-1b", 8, 1, "ddp", ["parallel.strategy=ddp"], 2048, 8, False),
    ("llama3.2-1b", 8, 1, "fsdp 2 x pp 4 (1f1b), untied",
     ["model.tie_embeddings=false", "parallel.strategy=fsdp", "parallel.pp=4",
      "parallel.pp_schedule=1f1b"], 2048, 8, False),
    ("llama3.2-1b", 8, 1, "fsdp 4 x pp 2 (gpipe), tied",
     ["parallel.strategy=fsdp", "parallel.pp=2", "parallel.pp_schedule=gpipe",
      "parallel.pp_microbatches=4"], 2048, 16, False),
    ("llama3.2-1b", 8, 1, "fsdp 4 x pp 2 (1f1b), fp32",
     ["train.precision=fp32", "parallel.strategy=fsdp", "parallel.pp=2",
      "parallel.pp_schedule=1f1b"], 2048, 16, False),
    ("llama3.2-1b", 8, 1, "ddp 4 x pp 2 (1f1b), 1,024 tokens a sequence",
     ["parallel.strategy=ddp", "parallel.pp=2", "parallel.pp_schedule=1f1b"], 1024, 8, False),
    ("llama3.2-1b", 8, 1, "zero-1", ["parallel.strategy=ddp", "parallel.sharding=optimizer"],
     2048, 8, False),
    ("llama3.2-1b", 8, 8, "hsdp 8x8", ["parallel.strategy=hsdp", "parallel.replicate=8"],
     2048, 64, False),
    ("llama3.1-8b", 8, 1, "fsdp full, 1,024 tokens a rank", ["parallel.strategy=fsdp"],
     1024, 8, False),
    ("llama3.1-8b", 8, 8, "fsdp 8 x tp 8", ["parallel.strategy=fsdp", "parallel.tp=8"],
     4096, 8, False),
    ("llama3.1-8b", 8, 8, "diloco 8 x fsdp 8 shard_grad_op, int4, full AC",
     ["parallel.strategy=fsdp", "parallel.sharding=shard_grad_op", "parallel.diloco.inner_steps=100",
      "parallel.diloco.replicas=8", "parallel.diloco.quantize=int4",
      "train.activation_checkpointing=full"], 8192, 64, False),
    ("llama3.1-8b", 8, 8, "fsdp 8 x tp 8, full AC",
     ["parallel.strategy=fsdp", "parallel.tp=8", "train.activation_checkpointing=full"],
     4096, 8, False),
    ("llama3.1-70b", 8, 128, "fsdp 128 x tp 8, full AC",
     ["parallel.strategy=fsdp", "parallel.tp=8", "train.activation_checkpointing=full"],
     8192, 128, False),
    ("llama3.1-70b", 8, 128, "fsdp 32 x tp 8 x pp 4 (1f1b), full AC",
     ["parallel.strategy=fsdp", "parallel.tp=8", "parallel.pp=4", "parallel.pp_schedule=1f1b",
      "train.activation_checkpointing=full"], 8192, 128, False),
]  # fmt: skip


def _err(p: int, c: int) -> str:
    """The plan's error against the check (see :func:`dtlab.analysis.check_report._error`)."""
    if p == c:
        return "exact"
    if c == 0:
        return "not held"
    return f"{(p - c) / c:+.1%}" if p else "missed"


def run(quick: bool) -> list[dict[str, Any]]:
    """Check rank 0 of every row of the grid, and of a pipeline also the last rank (the last
    stage: the output, the logits); returns the rows with their figures."""
    rows = []
    for preset, nproc, nnodes, label, extra, seq, gbs, small in GRID:
        if quick and not small:
            continue
        base = [b.format(gbs=gbs, seq=seq) for b in BASE]
        config = load_config(overrides=[f"model.preset={preset}", *base, *extra])
        world = nproc * nnodes
        pipeline = config.parallel.pp > 1
        for rank in (0, world - 1) if pipeline else (0,):
            started = time.perf_counter()
            r = check_rank(config, nproc, nnodes, rank)
            named = f"{label}, rank {rank}" if pipeline else label
            rows.append(_row(preset, world, named, extra, seq, gbs, started, r.as_dict()))
            print(f"  {preset} x {world} {named}: {rows[-1]['seconds']} s", file=sys.stderr)
    return rows


def _row(
    preset: str,
    world: int,
    label: str,
    extra: list[str],
    seq: int,
    gbs: int,
    started: float,
    checked: dict[str, Any],
) -> dict[str, Any]:
    return {
        "preset": preset,
        "world": world,
        "layout": label,
        "overrides": extra,
        "seq_len": seq,
        "global_batch_size": gbs,
        "seconds": round(time.perf_counter() - started, 1),
        **checked,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: the peak's error first (and the moment the check has it), then what is
    alive then, component by component, the bytes sent per step and the check's seconds."""
    from dtlab.analysis.plan import format_bytes

    head = ["preset", "ranks", "layout", "peak", "checked peak at", *COMPONENTS, "sent/step",
            "check s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(
                f"| {r['preset']} | {r['world']} | {r['layout']} | not checked: {r['skipped']} |"
            )
            continue
        c, peak = r["components"], r["peak"]
        at = peak["checked_at"]
        cells = [r["preset"], str(r["world"]), r["layout"]]
        cells.append(_err(peak["predicted"], peak["checked"]))
        cells.append(f"{at['moment']}: {at['where']} ({format_bytes(peak['checked'])})")
        cells += [_err(c[n]["predicted"], c[n]["checked"]) for n in COMPONENTS]
        cells.append(_err(r["collectives"]["predicted"], r["collectives"]["checked"]))
        cells.append(f"{r['seconds']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.analysis.accuracy", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the debug-model rows only (~1 min)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write every figure")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
