"""Context parallelism's communication, measured: the ring against the all-to-alls, side by side.

    python -m dtlab.bench.cp_comm [--cp 2,4] [--methods ring,alltoall] [--seq 2048] [--dim 256]
        [--layers 4] [--heads 8] [--kv-heads 2] [--vocab 512] [--batch 1] [--warmup 2] [--steps 7]
        [--repeats 21] [--json PATH] [--set KEY=VALUE ...]

Each cp degree trains in ``cp`` processes of its own (gloo on the CPU, strategy ddp, cp = world), every
method in the same processes, one model per method, their steps interleaved, so that whatever slows
the machine slows both alike. Reported per (cp, method):

- **bytes**: the context-parallel group's collectives in one optimizer step (after the warm-up), counted
  by :class:`dtlab.metrics.comm.CommCounter` from the collectives the step issues (the ring's
  ``send/recv``, alltoall's ``all_to_all``; the whole buffer of each, as the counter counts), beside
  :func:`dtlab.analysis.model.plan_step`'s prediction for the same config and world, and their ratio.
  Any other collective of the step (DDP's gradient all-reduce) is not context parallelism's and is left
  out of both; the JSON keeps every one.
- **step**: the optimizer step's wall time, the slowest rank's, median (and range) over ``--steps``
  steps after ``--warmup``; no counter is active while steps are timed (it intercepts every operator).
- **attention**: one layer's context-parallel attention, forward and backward, on a rank's inputs of
  the model's shape (its micro-batch, heads, ``seq / cp`` tokens), timed three ways, each the slowest
  rank's, after a barrier, median over ``--repeats`` after ``--warmup``, the three interleaved:

  ``together``
      the method as training runs it (:func:`dtlab.parallel.context.ring_attention` or
      :func:`~dtlab.parallel.context.alltoall_attention`), communication and compute as they overlap.
  ``compute``
      the same function with its transport taken out and nothing else changed: the ring's passes
      hand each rank back the block it sent (the same shapes, the same (query, key) chunk pairs
      attended, as the pairs follow the ring's step, not the data); alltoall's all-to-alls copy the
      send buffer into the receive buffer (a copy of the size a collective writes, so that the
      attention runs on numbers rather than uninitialised memory).
  ``comm``
      the transport alone, nothing computed: the ring's point-to-point passes in the order and sizes
      its forward and backward issue them (``cp - 1`` passes of the key/value block each way, ``cp``
      of their float32 gradients, ``batch_isend_irecv`` on the same group, each waited), or
      alltoall's eight all-to-alls (q, k, v and the output, each way). The counter checks that it
      moves exactly the bytes ``together`` moves (``same bytes`` in the JSON).

  ``exposed``: together - compute, paired (the two calls of one repeat ran one after the other, so
  they share the machine's state), the median over repeats and its interquartile range: the time
  communication adds to the attention. ``hidden`` = (comm - exposed) / comm, clamped to [0, 1]
  (with medians: (comm + compute - together) / comm): the share of the transport's own time that
  overlapped the compute. The ring starts each pass before it computes on the block it holds, so
  its transport can hide behind the kernels; alltoall's all-to-alls stand between its computations
  (nothing to compute until the heads arrive), so its figure is ~0 by construction and noise
  around it. Where the range of ``exposed`` is wider than ``comm`` itself, the table marks
  ``hidden`` with a ``?``: the machine's noise is larger than what is measured.

On the CPU, gloo's transport is memory copies through the loopback by its own threads, on the same
cores as the compute: nothing is left over to hide it in when every core computes, and with more
ranks than cores (cp 4 on a 2-core machine) the ranks take turns. The figures say what this machine
does, not what a network beside idle cores would.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dtlab.cliargs import (
    int_list,
    non_negative_int,
    output_file,
    parse_config_args,
    positive_int,
    run_command,
    script_parser,
)
from dtlab.errors import DtlabError

__all__ = ["CP_KINDS", "cp_bytes", "main", "measure", "rows_for"]

# The collectives that are context parallelism's (its group's): the ring's and alltoall's.
CP_KINDS = ("send/recv", "all_to_all")
METHODS = ("ring", "alltoall")


def cp_bytes(by_name: dict[str, int]) -> dict[str, int]:
    """Context parallelism's collectives among ``by_name`` (a counter's or a plan's bytes), named
    without the ``cp`` prefix a group smaller than the world gives them."""
    out: dict[str, int] = {}
    for name, nbytes in by_name.items():
        kind = name.removeprefix("cp ")
        if kind in CP_KINDS:
            out[kind] = out.get(kind, 0) + int(nbytes)
    return out


def shape_overrides(
    seq: int,
    dim: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    batch: int,
    preset: str = "tiny",
) -> list[str]:
    """The config of the model a point trains (on ``preset``'s other fields: its ffn width)."""
    return [
        f"model.preset={preset}", f"model.dim={dim}", f"model.n_layers={layers}",
        f"model.n_heads={heads}", f"model.n_kv_heads={kv_heads}", f"model.vocab_size={vocab}",
        f"model.max_seq_len={seq}", "data.source=synthetic", f"data.seq_len={seq}",
        "data.prefetch=0", f"train.global_batch_size={batch}", "parallel.strategy=ddp",
    ]  # fmt: skip


# --- the worker: one rank of one cp degree, every method -------------------------------------------


def _slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (the step, or the call, ends with its slowest rank)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn: Callable[[], Any]) -> float:
    """``fn()``'s wall time on the slowest rank, every rank starting together."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def _counted(fn: Callable[[], Any], labels: dict[str, str]) -> dict[str, int]:
    """The bytes of each collective ``fn()`` issues on this rank, by (labelled) name."""
    from dtlab.metrics.comm import CommCounter

    with CommCounter(labels) as counter:
        fn()
    return dict(counter.bytes)


def _steps(
    trainings: dict[str, Any], d: Any, warmup: int, steps: int, labels: dict[str, str]
) -> Any:
    """Every method's training, steps interleaved (the order alternating): ``warmup`` steps, one
    step counted, then ``steps`` steps timed. Returns ({method: counted bytes}, {method: [s]})."""
    from dtlab.train.optimizer_step import train_step

    def step(method: str, k: int) -> None:
        tr, config = trainings[method]
        batch = tr.loader.build_step(k)
        train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, batch, config, d.device)

    methods = list(trainings)
    for k in range(warmup):
        for m in methods:
            step(m, k)
    counted = {m: _counted(functools.partial(step, m, warmup), labels) for m in methods}
    timed: dict[str, list[float]] = {m: [] for m in methods}
    for k in range(warmup + 1, warmup + 1 + steps):
        for m in methods if k % 2 else reversed(methods):
            timed[m].append(_timed(functools.partial(step, m, k)))
    return counted, timed


def _attention_inputs(config: Any, cp: int, seed: int) -> tuple[Any, ...]:
    """A rank's attention inputs at the model's shape: q [B, H, S / cp, D], k and v with the
    key/value heads, the output's gradient; the training's dtype."""
    import torch

    m, t = config.model, config.train
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision, torch.float32)
    micro = t.micro_batch_size or t.global_batch_size  # dp = 1: cp is the world
    head_dim, tokens = (
        m.args().head_dim,
        config.data.seq_len // cp,
    )  # model.head_dim or dim / n_heads
    g = torch.Generator().manual_seed(seed)

    def make(heads: int) -> torch.Tensor:
        return torch.randn(micro, heads, tokens, head_dim, generator=g).to(dtype)

    return make(m.n_heads), make(m.kv_heads), make(m.kv_heads), make(m.n_heads)


def _together(method: str, group: Any, inputs: tuple[Any, ...]) -> Callable[[], Any]:
    """One call of the method's attention, forward and backward (gradients of q, k and v)."""
    import torch

    from dtlab.parallel.context import alltoall_attention, ring_attention

    attention = ring_attention if method == "ring" else alltoall_attention
    q, k, v, dout = inputs

    def run() -> Any:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = attention(leaves[0], leaves[1], leaves[2], group=group)
        return torch.autograd.grad(out, leaves, dout)

    return run


@contextlib.contextmanager
def _without_transport(method: str) -> Iterator[None]:
    """The method's attention with its transport taken out (see the module's docstring): the
    ring's passes give each rank back its own block, the all-to-alls copy send into receive."""
    import torch.distributed as dist

    from dtlab.parallel import context

    if method == "ring":
        original = context._Ring.start

        def start(self: Any, tensors: list[Any], backwards: bool = False) -> tuple[list, list]:
            return [], list(tensors)

        context._Ring.start = start  # type: ignore[method-assign]
        try:
            yield
        finally:
            context._Ring.start = original  # type: ignore[method-assign]
        return
    a2a = dist.all_to_all_single

    def copy(output: Any, input: Any, *args: Any, **kwargs: Any) -> None:
        output.copy_(input)

    dist.all_to_all_single = copy  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.all_to_all_single = a2a


def _ring_passes(group: Any, inputs: tuple[Any, ...]) -> Callable[[], None]:
    """The ring's transport alone: its forward's and backward's passes, in their order and sizes
    (:class:`dtlab.parallel.context._RingAttention`), nothing computed."""
    import torch

    from dtlab.parallel.context import _Ring, _wait

    q, k, v, _ = inputs
    if k.shape[1] != q.shape[1]:  # the blocks that travel carry every head
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32

    def run() -> None:
        ring = _Ring(group)
        kv = [k, v]
        for _ in range(ring.cp - 1):  # forward: the block passed on cp - 1 times
            requests, kv = ring.start(kv)
            _wait(requests)
        kb, vb = k, v
        dkb, dvb = torch.zeros(k.shape, dtype=wide), torch.zeros(v.shape, dtype=wide)
        for step in range(ring.cp):  # backward: the block ahead, and its gradients cp times
            ahead = ring.start([kb, vb]) if step < ring.cp - 1 else None
            requests, (dkb, dvb) = ring.start([dkb, dvb])
            _wait(requests)
            if ahead is not None:
                _wait(ahead[0])
                kb, vb = ahead[1]

    return run


def _alltoall_passes(group: Any, inputs: tuple[Any, ...]) -> Callable[[], None]:
    """alltoall's transport alone: q, k, v and the output swapped in forward, their gradients in
    backward (:func:`dtlab.parallel.context.alltoall_attention`), nothing computed."""
    import torch
    import torch.distributed as dist

    q, k, v, _ = inputs
    cp = dist.get_world_size(group)
    if k.shape[1] % cp:  # expanded to the query heads before the swap
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    buffers = [x.contiguous() for x in (q, k, v, q)] * 2  # the output has the query's shape

    def run() -> None:
        for send in buffers:
            dist.all_to_all_single(torch.empty_like(send), send, group=group)

    return run


def _attention(
    methods: list[str], group: Any, config: Any, warmup: int, repeats: int
) -> dict[str, Any]:
    """Each method's attention timed together, compute alone and transport alone (see the
    module's docstring), interleaved, with the bytes ``together`` and ``comm`` move."""
    import torch.distributed as dist

    cp = dist.get_world_size(group)
    inputs = _attention_inputs(config, cp, seed=dist.get_rank(group))
    labels = {str(group.group_name): "cp"}
    runs: dict[str, dict[str, Callable[[], Any]]] = {}
    for m in methods:
        together = _together(m, group, inputs)

        def compute(m: str = m, together: Callable[[], Any] = together) -> None:
            with _without_transport(m):
                together()

        passes = (_ring_passes if m == "ring" else _alltoall_passes)(group, inputs)
        runs[m] = {"together": together, "compute": compute, "comm": passes}
    times: dict[str, dict[str, list[float]]] = {m: {k: [] for k in runs[m]} for m in methods}
    for r in range(warmup + repeats):
        for m in methods if r % 2 else reversed(methods):
            # together and compute swap places every other repeat; comm comes last
            for kind in (
                ("together", "compute", "comm") if r % 2 else ("compute", "together", "comm")
            ):
                seconds = _timed(runs[m][kind])
                if r >= warmup:
                    times[m][kind].append(seconds)
    return {
        m: {
            "seconds": times[m],
            "together_bytes": _counted(runs[m]["together"], labels),
            "comm_bytes": _counted(runs[m]["comm"], labels),
        }
        for m in methods
    }


def _worker(
    overrides: list[str], methods: list[str], counts: tuple[int, int, int], out: Path
) -> None:
    """One rank of one cp degree: every method's training and attention measured (``counts``:
    warm-up, timed steps, attention repeats); rank 0 writes the figures to ``out``."""
    from dtlab.config import load_config
    from dtlab.parallel import destroy_distributed, init_distributed
    from dtlab.runtime.status import leave_worker
    from dtlab.train.loop import build_training

    warmup, steps, repeats = counts
    configs = {m: load_config(overrides=[*overrides, f"parallel.cp_method={m}"]) for m in methods}
    d = init_distributed(configs[methods[0]])
    trainings = {m: (build_training(configs[m], d), configs[m]) for m in methods}
    group = d.dims.mesh(d.device.type, "cp").get_group()
    labels = {str(group.group_name): "cp"}
    counted, step_s = _steps(trainings, d, warmup, steps, labels)
    attention = _attention(methods, group, configs[methods[0]], warmup, repeats)
    if d.rank == 0:
        figures = {"counted": counted, "step_s": step_s, "attention": attention}
        out.write_text(json.dumps(figures), encoding="utf-8")
    for tr, _ in trainings.values():
        tr.loader.close()
    destroy_distributed()
    leave_worker(0)


# --- the launcher ----------------------------------------------------------------------------------


def measure(
    overrides: list[str], cp: int, methods: list[str], counts: tuple[int, int, int] = (2, 7, 21)
) -> dict[str, Any]:
    """Run one cp degree in ``cp`` fresh processes, every one of ``methods`` (``counts``: warm-up,
    timed steps, attention repeats); returns the worker's raw figures."""
    warmup, steps, repeats = counts
    with tempfile.TemporaryDirectory(prefix="dtlab-cp-comm-") as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(cp), "-m", "dtlab.bench.cp_comm", "--worker", str(out), "--methods",
            ",".join(methods), "--warmup", str(warmup), "--steps", str(steps), "--repeats",
            str(repeats), "--set", *overrides, f"parallel.cp={cp}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = " | ".join(proc.stderr.strip().splitlines()[-4:])
            raise DtlabError(
                f"cp {cp}: the measurement failed (exit code {proc.returncode}): {tail}"
            )
        figures: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return figures


def _clamped(x: float) -> float:
    return min(1.0, max(0.0, x))


def _quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (the value itself when there is one)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def rows_for(overrides: list[str], cp: int, figures: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method from a cp degree's raw figures: the bytes beside the plan's, the
    medians, exposed and hidden communication (see the module's docstring)."""
    from dtlab.analysis.model import plan_step
    from dtlab.config import load_config

    rows = []
    for method, counted in figures["counted"].items():
        config = load_config(
            overrides=[*overrides, f"parallel.cp={cp}", f"parallel.cp_method={method}"]
        )
        planned = dict(plan_step(config, cp).comm_bytes)
        measured, predicted = cp_bytes(counted), cp_bytes(planned)
        a = figures["attention"][method]
        med = {k: statistics.median(v) for k, v in a["seconds"].items()}
        paired = [
            t - c for t, c in zip(a["seconds"]["together"], a["seconds"]["compute"], strict=True)
        ]
        exposed, (low, high) = statistics.median(paired), _quartiles(paired)
        comm = med["comm"]
        steps = figures["step_s"][method]
        rows.append({
            "cp": cp, "method": method, "seq": config.data.seq_len,
            "cp_bytes_measured": measured, "cp_bytes_predicted": predicted,
            "ratio": sum(measured.values()) / sum(predicted.values()) if predicted else None,
            "same_kinds": set(measured) == set(predicted),
            "step_s": statistics.median(steps), "step_s_min": min(steps), "step_s_max": max(steps),
            "attention_ms": {k: v * 1e3 for k, v in med.items()},
            "exposed_ms": exposed * 1e3, "exposed_iqr_ms": [low * 1e3, high * 1e3],
            "hidden": _clamped((comm - exposed) / comm) if comm > 0 else None,
            "noisy": high - low > comm,
            "same_bytes": cp_bytes(a["together_bytes"]) == cp_bytes(a["comm_bytes"]),
            "attention_cp_bytes": cp_bytes(a["together_bytes"]),
            "all_measured": counted, "all_predicted": planned, "raw_seconds": a["seconds"],
            "steps_s": steps, "oversubscribed": cp > (os.cpu_count() or 1),
        })  # fmt: skip
    return rows


def _mib(by_kind: dict[str, int]) -> str:
    return " + ".join(f"{v / 2**20:.2f}" for v in by_kind.values()) or "0"


def format_row(r: dict[str, Any]) -> str:
    """A row of the printed table."""
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.6f}"
    if not r["same_kinds"]:
        ratio += f" (measured {sorted(r['cp_bytes_measured'])}, planned {sorted(r['cp_bytes_predicted'])})"
    a = r["attention_ms"]
    hidden = "-" if r["hidden"] is None else f"{r['hidden']:.0%}" + ("?" if r["noisy"] else "")
    low, high = r["exposed_iqr_ms"]
    exposed = f"{r['exposed_ms']:.1f} [{low:.0f},{high:.0f}]"
    steps = f"{r['step_s']:.3f} ({r['step_s_min']:.3f}-{r['step_s_max']:.3f})"
    return (
        f"{r['cp']:>3}{'*' if r['oversubscribed'] else ' '} {r['method']:<9}"
        f"{_mib(r['cp_bytes_measured']):>11} {_mib(r['cp_bytes_predicted']):>11} {ratio:>9} "
        f"{steps:>21} {a['together']:>9.1f} {a['compute']:>8.1f} {a['comm']:>7.1f} "
        f"{exposed:>17} {hidden:>7}"
    )


HEADER = (
    f"{'cp':>4} {'method':<9}{'cp MiB':>11} {'planned':>11} {'ratio':>9} {'step s (min-max)':>21} "
    f"{'attn ms':>9} {'compute':>8} {'comm':>7} {'exposed [IQR]':>17} {'hidden':>7}"
)


def _methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods) or len(set(methods)) < len(methods):
        raise DtlabError(f"--methods {text!r}: allowed: distinct names among {', '.join(METHODS)}")
    return methods


def _parser() -> argparse.ArgumentParser:
    p = script_parser("dtlab.bench.cp_comm", __doc__, "tiny")
    p.add_argument("--cp", default="2,4", help="context-parallel degrees, each its processes (2,4)")
    p.add_argument("--methods", default=",".join(METHODS), help="ring,alltoall")
    for flag, default, what in (
        ("--seq", 2048, "sequence length"), ("--dim", 256, "model.dim"),
        ("--layers", 4, "model.n_layers"), ("--heads", 8, "model.n_heads"),
        ("--kv-heads", 2, "model.n_kv_heads"), ("--vocab", 512, "model.vocab_size"),
        ("--batch", 1, "sequences a step (train.global_batch_size)"),
        ("--warmup", 2, "steps, and attention calls, before the timed ones"),
        ("--steps", 7, "optimizer steps timed"), ("--repeats", 21, "attention calls timed"),
    ):  # fmt: skip
        kind = non_negative_int if flag == "--warmup" else positive_int
        p.add_argument(flag, type=kind, default=default, help=f"{what} (default {default})")
    p.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Measure every cp degree and print the table (``--json``: every figure to a file); with
    ``--worker``, one rank of one degree."""
    args = parse_config_args(_parser(), argv)
    methods = _methods(args.methods)
    if args.worker is not None:
        _worker(args.overrides, methods, (args.warmup, args.steps, args.repeats), args.worker)
        return 0
    cps = int_list(args.cp, "--cp", 2)
    if args.json is not None:
        output_file(args.json, "--json")
    shape = (args.seq, args.dim, args.layers, args.heads, args.kv_heads, args.vocab, args.batch)
    overrides = [*shape_overrides(*shape, preset=args.preset), *args.overrides]
    _validate(overrides, cps, methods)
    counts = (args.warmup, args.steps, args.repeats)
    cores = os.cpu_count() or 1
    print(f"seq {args.seq}, {args.batch} sequence(s) a step, gloo on {cores} CPU cores; "
          "bytes per optimizer step, attention per layer call (forward + backward)")  # fmt: skip
    print(HEADER)
    rows: list[dict[str, Any]] = []
    started, load = time.perf_counter(), os.getloadavg()[0]
    for cp in cps:
        new = rows_for(overrides, cp, measure(overrides, cp, methods, counts))
        rows += new
        for r in new:
            print(format_row(r), flush=True)
    print(
        "attn ms: one layer's attention, forward + backward, as it trains; compute: without its\n"
        "transport; comm: the transport alone (medians over --repeats). exposed: attn - compute,\n"
        "paired by repeat, median [quartiles]; hidden = (comm - exposed) / comm in [0, 1], '?'\n"
        "where the quartiles of exposed lie further apart than comm"
    )
    if any(r["oversubscribed"] for r in rows):
        print(f"* more processes than this machine's {cores} cores: they share them in turn")
    # Other work on the machine shows in the timings: say how busy it was.
    print(f"wall time {time.perf_counter() - started:.0f} s; load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        print(f"figures: {args.json}")
    return 0


def _validate(overrides: list[str], cps: list[int], methods: list[str]) -> None:
    """Every (cp, method) checked as training checks it before any process starts (ConfigError)."""
    from dtlab.analysis.model import plan_step
    from dtlab.config import load_config

    for cp in cps:
        for m in methods:
            config = load_config(
                overrides=[*overrides, f"parallel.cp={cp}", f"parallel.cp_method={m}"]
            )
            plan_step(config, cp)


if __name__ == "__main__":
    raise SystemExit(run_command(main))
