"""Collective bus bandwidth among every GPU of this node (NCCL), or among local processes (gloo on
the CPU), through ``torch.distributed``: the figures nccl-tests prints, which a user compares with
the node's datasheet before sending a job to many of them.

    python -m dtlab.bench.collectives [--nproc N] [--device auto|cuda|cpu] [--sizes 1M,64M,1G]
                                      [--ops all_reduce,all_gather,reduce_scatter,all_to_all]
                                      [--iters 20] [--repeats 5] [--json OUT]

Each collective is checked first (every rank's result against the values known in advance), then
timed: ``--repeats`` times ``--iters`` calls back to back, the slowest rank's time, the median
repeat. ``size`` is the whole buffer (an all-gather's output, a reduce-scatter's input); ``algbw``
is size over time and ``busbw`` algbw times 2 (n - 1) / n for an all-reduce, (n - 1) / n for the
others (:mod:`dtlab.analysis.busbw`). Rank r runs on ``cuda:r`` of the GPUs this process sees
(``CUDA_VISIBLE_DEVICES`` respected). Exit code 1 when a collective's result was wrong.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import torch

from dtlab.analysis.busbw import OPS, measure
from dtlab.cliargs import output_file, positive_int, run_command
from dtlab.errors import DtlabError

# One value each, nccl-tests' defaults in spirit: a small buffer (latency), a mid one, a large one
# (the link's rate). On the CPU a large buffer only measures copies in memory: smaller sizes.
GPU_SIZES = "1M,64M,1G"
CPU_SIZES = "64K,1M,16M"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_sizes(text: str) -> list[int]:
    """``--sizes``: comma-separated byte counts, each an integer with an optional K, M or G (binary
    units): ``1M,64M,1G``. A mistake is a :class:`DtlabError` naming what is allowed."""
    sizes = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)([KMG]?)(i?B)?", part, re.IGNORECASE)
        if not m or int(m.group(1)) == 0:
            raise DtlabError(
                f"--sizes {text!r}: {part!r} is not a size; allowed: comma-separated byte "
                "counts, each a positive integer with an optional K, M or G (e.g. 1M,64M,1G)"
            )
        sizes.append(int(m.group(1)) * _UNITS[m.group(2).upper()])
    return list(dict.fromkeys(sizes))


def choose(device: str, nproc: int | None) -> tuple[str, int]:
    """(device type, ranks) of ``--device`` and ``--nproc``: auto is every GPU torch sees where it
    sees two or more, else 2 processes on the CPU; a GPU run needs a GPU per rank."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if gpus >= 2 else "cpu"
    if device not in ("cuda", "cpu"):
        raise DtlabError(f"--device {device!r}: allowed: auto, cuda or cpu")
    if device == "cuda":
        n = nproc or gpus
        if n < 2 or n > gpus:
            given = f"--nproc {nproc} on " if nproc else ""
            raise DtlabError(
                f"{given}--device cuda: this machine's torch sees {gpus} CUDA GPU(s); allowed: "
                "2 ranks or more, up to the GPUs it sees (one rank per GPU)"
            )
        return device, n
    n = nproc or 2
    if n < 2:
        raise DtlabError(f"--nproc {n}: allowed: 2 or more (a bus needs two ends)")
    return device, n


def _size(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]} {unit}iB"
    return f"{n} B"


def report(result: dict[str, Any]) -> str:
    """The results as a markdown table, nccl-tests' columns."""
    devices = result["devices"]
    where = ", ".join(devices) if devices[0] != "cpu" else f"{len(devices)} CPU processes"
    lines = [
        f"{result['backend']} collectives among {result['world']} ranks ({where}), float32; "
        "time per call: the slowest rank's, median of the repeats.",
        "",
        "| op | size | time us | algbw GB/s | busbw GB/s | result |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['op']} | {_size(r['size'])} | {r['seconds'] * 1e6:.1f} | {r['algbw_gbps']:.2f} "
            f"| {r['busbw_gbps']:.2f} | {'ok' if r['correct'] else 'WRONG'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dtlab.bench.collectives",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="ranks (default: every GPU torch sees, or 2 on the CPU)")  # fmt: skip
    p.add_argument("--device", default="auto", help="auto (default), cuda or cpu")
    p.add_argument("--sizes", default=None,
                   help=f"bytes of each buffer (default {GPU_SIZES} on GPUs, {CPU_SIZES} on the CPU)")  # fmt: skip
    p.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter",
                   help=f"comma-separated, of: {', '.join(OPS)} (default the first three)")  # fmt: skip
    p.add_argument("--iters", type=positive_int, default=20, help="calls timed back to back")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed runs (the median counts)")
    p.add_argument("--timeout", type=positive_int, default=300, help="seconds for everything")
    p.add_argument("--json", dest="json_out", help="also write the figures here")
    args = p.parse_args(argv)
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise DtlabError(
            f"--ops {args.ops!r}: {', '.join(unknown) or 'none given'} is not a collective; "
            f"allowed: {', '.join(OPS)}"
        )
    device, nproc = choose(args.device, args.nproc)
    sizes = parse_sizes(args.sizes or (GPU_SIZES if device == "cuda" else CPU_SIZES))
    json_out = output_file(args.json_out, "--json") if args.json_out else None
    try:
        result = measure(nproc, device, sizes, ops, args.iters, args.repeats, float(args.timeout))
    except RuntimeError as e:
        raise DtlabError(f"the collectives could not be measured: {e}") from None
    print(report(result), end="")
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2) + "\n")
    wrong = [f"{r['op']} at {_size(r['size'])}" for r in result["results"] if not r["correct"]]
    if wrong:  # a measurement that ran (exit code 1), not a mistake in the input (2)
        print(f"error: wrong results: {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
