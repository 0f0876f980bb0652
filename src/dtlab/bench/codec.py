"""The compressed outer sync's codec: encoding one replica's outer gradient and decoding the
replicas' mean, per low-communication method, in this process.

    python -m dtlab.bench.codec [--methods streaming-int1,sparseloco] [--values 770624]
                                [--replicas 2,4] [--repeats 20] [--threads 1] [--device cpu]
                                [--json OUT]

Each method is the low-communication bench's (:data:`dtlab.bench.lowcomm.METHODS`: the same
``parallel.diloco`` settings) that sends a compressed payload. A fragment of ``--values`` random
float32 values (default: a quarter of ``tiny``'s 3.08M parameters, its 4 fragments' mean size) is
encoded as the sender does it (:func:`dtlab.train.outer_codec.encode`, the error feedback left in
place) and the mean of R replicas' payloads decoded as every replica does it
(:func:`dtlab.train.outer_codec.mean_of`). The methods take turns; the median milliseconds over
``--repeats`` turns (one more first, left out as warm-up), every method measured in one run. On
the CPU this is the outer sync's time on the training thread of a replica on the host, beside the
collective's wait (which the overlap bench measures); ``--device cuda`` times the same codec as a
GPU's kernels (the device synchronised around each timed call).

Under glibc the bench first keeps freed memory in the process (``mallopt``: no trimming, no
``mmap`` for large blocks): by default glibc hands a large freed block back to the system and the
next allocation of that size faults its pages in again, which made one method's figures move by 2x
to 3x with the methods measured before it. The figures are the codec's own work; a trainer's
allocations around it decide how many page faults it also pays.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from dtlab.bench.lowcomm import COMMON, METHODS
from dtlab.bench.timing import timed
from dtlab.cliargs import int_list, output_file, positive_int, run_command
from dtlab.config import DiLoCoOptions, load_config
from dtlab.errors import DtlabError
from dtlab.train.outer_codec import encode, mean_of, outer_payload_bytes

DEFAULT_METHODS = "streaming-int1,streaming-int2,streaming-int4,sparseloco,sparseloco-paper"


def codec_methods() -> list[str]:
    """The low-communication bench's methods whose outer gradient is compressed."""
    return [m for m in METHODS if _compressed(options_of(m))]


def options_of(method: str) -> DiLoCoOptions:
    """``method``'s DiLoCo settings, as the low-communication bench trains it."""
    return load_config(overrides=[*COMMON, *METHODS[method]]).parallel.diloco


def _compressed(o: DiLoCoOptions) -> bool:
    return o.inner_steps > 0 and (o.quantize != "none" or o.topk > 0)


def codec_device(text: str) -> torch.device:
    """``--device``: cpu, or cuda where torch sees a GPU (a :class:`DtlabError` naming what is
    allowed otherwise)."""
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda":
        if not torch.cuda.is_available():
            raise DtlabError(f"--device {text}: torch sees no CUDA GPU here; allowed: cpu")
        return torch.device("cuda", torch.cuda.current_device())
    raise DtlabError(f"--device {text!r}: allowed: cpu or cuda")


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory in the process (no trimming, no ``mmap`` for large blocks);
    False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold, most = -1, -3, 1 << 30
    return bool(mallopt(m_trim_threshold, most)) and bool(mallopt(m_mmap_threshold, most))


def _encode_from(target: torch.Tensor, grad: torch.Tensor, o: DiLoCoOptions) -> torch.Tensor:
    return encode(target.copy_(grad), o)


def _ms(fn: Callable[[], object], device: torch.device) -> float:
    with timed(device) as t:  # a GPU's queued kernels waited for, before and after
        fn()
    return t.seconds * 1e3


def measure(
    methods: list[str],
    values: int,
    replicas: list[int],
    repeats: int,
    device: torch.device | None = None,
) -> list[dict[str, Any]]:
    """One row a method: its payload bytes and median encode and mean-of-R-payloads milliseconds
    for a fragment of ``values`` values. The methods take turns, one encode and one mean of each R
    a turn, over ``repeats`` turns after one left out as warm-up: the allocator's state and the
    machine's load fall on every method alike. On ``device`` (the codec runs where the replica's
    weights are: a GPU's kernels, or the host's cores)."""
    device = device or torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(values, generator=g).to(device) for _ in range(max(replicas))]
    target = torch.empty(values, device=device)
    jobs: list[tuple[str, Callable[[], object]]] = []
    rows = []
    for method in methods:
        o = options_of(method)
        size = outer_payload_bytes(values, o)
        row: dict[str, Any] = {
            "method": method,
            "values": values,
            "payload_bytes": size,
            "bits_per_value": 8 * size / values,
        }
        rows.append(row)
        # The error feedback left in ``target`` is put back to the gradient before each encode.
        jobs.append(("encode_ms", partial(_encode_from, target, grads[0], o)))
        payloads = torch.stack([encode(x.clone(), o) for x in grads])
        for r in replicas:
            jobs.append((f"mean_of_{r}_ms", partial(mean_of, payloads[:r], values, o)))
    per_method = len(jobs) // len(methods)
    times: list[list[float]] = [[] for _ in jobs]
    for turn in range(repeats + 1):
        for j, (_, fn) in enumerate(jobs):
            ms = _ms(fn, device)
            if turn:
                times[j].append(ms)
    for j, (key, _) in enumerate(jobs):
        rows[j // per_method][key] = statistics.median(times[j])
    return rows


def report(
    rows: list[dict[str, Any]], replicas: list[int], threads: int, kept: bool, device: str = "cpu"
) -> str:
    """The rows as a markdown table."""
    head = ["method", "bits/value", "payload KiB", "encode ms"]
    head += [f"mean of {r} ms" for r in replicas]
    where = f"the host, {threads} thread(s)" if device == "cpu" else device
    title = (
        f"Outer codec on {where}, {rows[0]['values']:,} values a fragment; median over the repeats"
    )
    if device == "cpu":
        freed = "kept in the process (glibc)" if kept else "as the C library does by default"
        title += f"; freed memory {freed}"
    lines = [
        title + ".",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [r["method"], f"{r['bits_per_value']:.3f}", f"{r['payload_bytes'] / 1024:.1f}"]
        cells += [f"{r['encode_ms']:.2f}"] + [f"{r[f'mean_of_{n}_ms']:.2f}" for n in replicas]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dtlab.bench.codec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--methods", default=DEFAULT_METHODS, help=f"comma-separated (default {DEFAULT_METHODS})"
    )
    p.add_argument("--values", type=positive_int, default=3_082_496 // 4, help="values a fragment")
    p.add_argument("--replicas", default="2,4", help="comma-separated replica counts (default 2,4)")
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where the codec runs: cpu (default) or cuda (a GPU's kernels)",
    )
    p.add_argument("--json", dest="json_out", help="also write the rows here")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    allowed = codec_methods()
    unknown = [m for m in methods if m not in allowed]
    if unknown or not methods:
        raise DtlabError(
            f"--methods {args.methods!r}: {', '.join(unknown) or 'none given'} not a compressed "
            f"method; allowed: {', '.join(allowed)}"
        )
    replicas = int_list(args.replicas, "--replicas")
    device = codec_device(args.device)
    json_out = output_file(args.json_out, "--json") if args.json_out else None
    torch.set_num_threads(args.threads)
    kept = keep_freed_memory()
    rows = measure(methods, args.values, replicas, args.repeats, device)
    for row in rows:
        row["device"] = str(device)
    print(report(rows, replicas, args.threads, kept, device.type), end="")
    if json_out is not None:
        json_out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
