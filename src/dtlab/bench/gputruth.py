"""``python -m dtlab.bench.gputruth``: real trainings on this machine's GPU measured against
``dtlab plan`` (peak memory and step time), and float8 beside bf16.

Two halves, so that the GPU's time goes to the GPU's work alone:

- ``measure`` (on a GPU): this card's rates (bf16 and float8 GEMMs at 8192^3 and at the models'
  own shapes, flash attention, the fused AdamW step, a device copy), the CUDA context's memory, then
  each run of a grid through :func:`dtlab.train` in turn in this one process (the allocator emptied
  and its peaks restarted between runs, dynamo's caches reset): its allocated and reserved peaks,
  the device memory outside the allocator, its median step time and its losses. The JSON is
  rewritten after every run, so a run cut short by its budget leaves what it measured.
- ``compare`` (anywhere): each measured run predicted by ``dtlab plan`` for the card, the peak
  beside ``max_memory_allocated``, and the step time by both of the plan's models: the FLOPs model
  with the measured GEMM peak, and the kernels' model (``--step-model kernels``), as a table.
  docs/data/gputruth-h200.json holds one H200's ``measure``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtlab.runtime.nvidia import query_gpu

__all__ = ["GRIDS", "Run", "grid", "main", "run_overrides"]

GIB = 2**30
SEQ = 2048
QUIET = ["run.tensorboard=false", "run.plot=false", "run.progress=none", "run.trackers=[]"]


class Run(dict[str, Any]):
    """One training of the grid: model preset, micro-batch (one process: the global batch),
    activation checkpointing, compile, float8, steps."""

    @property
    def name(self) -> str:
        f8 = "-fp8" if self["float8"] else ""
        comp = "-compile" if self["compile"] else ""
        return f"{self['model']}-mb{self['mb']}-{self['ac']}{comp}{f8}"


def _run(
    model: str,
    mb: int,
    ac: str,
    compile: bool,
    float8: bool = False,
    steps: int = 8,
    seq: int = SEQ,
) -> Run:
    return Run(model=model, mb=mb, ac=ac, compile=compile, float8=float8, steps=steps, seq=seq)


def _grid_full() -> list[Run]:
    runs: list[Run] = []
    # the memory grid, eager: every micro-batch and checkpointing mode of the 1B model
    runs += [
        _run("llama3.2-1b", mb, ac, False)
        for ac in ("none", "selective", "full")
        for mb in (1, 2, 4, 8)
    ]
    # float8 beside bf16 (compiled, the same steps: the loss after them compared)
    runs += [_run("llama3.2-1b", 4, "none", True, f8, steps=30) for f8 in (False, True)]
    runs += [_run("llama3.2-3b", mb, ac, False) for ac in ("none", "full") for mb in (1, 4)]
    runs += [_run("llama3.2-3b", 4, "none", True, f8, steps=30) for f8 in (False, True)]
    # compiled, the ends of the micro-batch range
    runs += [_run("llama3.2-1b", mb, ac, True) for ac in ("none", "full") for mb in (1, 8)]
    runs += [_run("llama3.2-1b", 4, "selective", True), _run("llama3.2-3b", 1, "full", True)]
    return runs


def _grid_smoke() -> list[Run]:
    """The debug model eagerly and compiled under full checkpointing: the harness, not a GPU."""
    return [
        _run("debug", 2, "none", False, steps=4, seq=64),
        _run("debug", 2, "full", True, steps=4, seq=64),
    ]


GRIDS: dict[str, Callable[[], list[Run]]] = {"full": _grid_full, "smoke": _grid_smoke}


def grid(name: str) -> list[Run]:
    """The runs of grid ``name`` (``full``: llama3.2-1b and -3b; ``smoke``: the debug model)."""
    if name not in GRIDS:
        raise SystemExit(f"--grid {name!r}: allowed: {', '.join(GRIDS)}")
    return GRIDS[name]()


def run_overrides(run: Run) -> list[str]:
    """The ``--set`` overrides of one run (what ``dtlab plan`` is given too)."""
    return [
        f"model.preset={run['model']}", "train.precision=bf16", "data.source=synthetic",
        f"data.seq_len={run['seq']}", f"train.global_batch_size={run['mb']}",
        f"train.micro_batch_size={run['mb']}", f"train.activation_checkpointing={run['ac']}",
        f"train.compile={'true' if run['compile'] else 'false'}",
        f"train.float8.enabled={'true' if run['float8'] else 'false'}",
        f"train.steps={run['steps']}", "train.warmup_steps=5", "eval.every=0",
        "checkpoint.final=false", "run.log_every=1",
    ]  # fmt: skip


# ---------------------------------------------------------------- on the GPU


def _timed(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
    """Seconds per call of ``fn`` on the current CUDA device (``iters`` calls timed together)."""
    import torch

    from dtlab.bench.timing import timed

    for _ in range(warmup):
        fn()
    with timed(torch.device("cuda", torch.cuda.current_device())) as t:
        for _ in range(iters):
            fn()
    return t.seconds / iters


def _gemm_tflops(m: int, n: int, k: int, dtype: str) -> float | None:
    """TFLOP/s of an [m, k] x [k, n] product in bf16 or float8 (torch._scaled_mm, tensorwise)."""
    import torch

    dev = torch.device("cuda")
    if dtype == "bf16":
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        t = _timed(lambda: a @ b)
    else:
        try:
            a8 = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
            b8 = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t()  # column-major
            one = torch.ones((), device=dev)
            t = _timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
        except (RuntimeError, AttributeError):
            return None
    return 2 * m * n * k / t / 1e12


def _attention_s(batch: int, heads: int, kv_heads: int, head_dim: int, seq: int) -> float:
    """Seconds of causal SDPA forward and backward in bf16 (the model's attention call)."""
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    q = torch.randn(
        batch, heads, seq, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True
    )
    k = torch.randn(
        batch, kv_heads, seq, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True
    )
    v = torch.randn_like(k, requires_grad=True)
    g = torch.randn_like(q)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
        out.backward(g)

    return _timed(step, iters=10)


def _rates(models: list[str]) -> dict[str, Any]:
    """This card's rates that a step is made of, measured now."""
    import torch

    from dtlab.train.api import resolve_config

    rates: dict[str, Any] = {
        "bf16_gemm_tflops": _gemm_tflops(8192, 8192, 8192, "bf16"),
        "fp8_gemm_tflops": _gemm_tflops(8192, 8192, 8192, "fp8"),
    }
    rates["copy_gbps"] = _copy_gbps()
    shapes, attention = [], []
    for model in models:
        m = resolve_config(None, [f"model.preset={model}"]).model
        hd = m.dim // m.n_heads
        kv = m.n_kv_heads or m.n_heads
        ffn = m.ffn_dim or 4 * m.dim
        for tokens in (2048, 8192, 16384):
            for what, (n, k) in {
                "qkv": ((m.n_heads + 2 * kv) * hd, m.dim), "o": (m.dim, m.n_heads * hd),
                "gate_up": (2 * ffn, m.dim), "down": (m.dim, ffn), "output": (m.vocab_size, m.dim),
            }.items():  # fmt: skip
                for dtype in ("bf16", "fp8"):
                    tf = _gemm_tflops(tokens, n, k, dtype)
                    shapes.append({"model": model, "gemm": what, "m": tokens, "n": n, "k": k,
                                   "dtype": dtype, "tflops": tf})  # fmt: skip
        for mb in (1, 4, 8):
            s = _attention_s(mb, m.n_heads, kv, hd, SEQ)
            attention.append({"model": model, "mb": mb, "seq": SEQ, "fwd_bwd_s": s})
        torch.cuda.empty_cache()
    rates["gemms"], rates["attention"] = shapes, attention
    rates["adamw"] = [_adamw(model) for model in models[:1]]
    return rates


def _copy_gbps(nbytes: int = 2 * GIB) -> float:
    """GB/s of a device-to-device copy, bytes read and written counted (what a memory-bound pass
    such as the optimizer's runs at)."""
    import torch

    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * nbytes / _timed(lambda: y.copy_(x), iters=10) / 1e9


def _adamw(model: str) -> dict[str, Any]:
    """Seconds of one fused AdamW step over ``model``'s parameters (float32, as dtlab trains)."""
    import torch

    from dtlab.models.llama import build_model
    from dtlab.train.api import resolve_config

    cfg = resolve_config(None, [f"model.preset={model}"])
    shapes = [p.shape for p in build_model(cfg.model, "meta").parameters()]
    params = [torch.zeros(s, device="cuda", requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    t = _timed(opt.step, iters=5, warmup=2)
    n = sum(p.numel() for p in params)
    del opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return {"model": model, "params": n, "fused_step_s": t}


def _device_used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _one(run: Run, root: Path) -> dict[str, Any]:
    """Train ``run`` in this process and read the allocator's figures."""
    import torch

    from dtlab.analysis.model import flops_per_token
    from dtlab.metrics.peaks import cuda_peaks
    from dtlab.train.api import resolve_config, train

    cuda = torch.cuda.is_available()
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        cuda_peaks(torch.device("cuda", 0)).restart()
    sets = [*run_overrides(run), *QUIET, f"run.dir={root / run.name}", f"run.name={run.name}"]
    t0 = time.perf_counter()
    summary = train(None, sets)
    wall = time.perf_counter() - t0
    used = _device_used() if cuda else None
    reserved_now = int(torch.cuda.memory_reserved()) if cuda else None
    metrics = root / run.name / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    steps = [s for s in steps if "loss" in s and "step_time_s" in s]
    cfg = resolve_config(None, run_overrides(run))
    return {
        "peak_allocated_bytes": summary.get("peak_memory_bytes"),
        "peak_reserved_bytes": summary.get("peak_memory_reserved_bytes"),
        "device_used_end_bytes": used,
        "reserved_end_bytes": reserved_now,
        "median_step_time_s": summary.get("median_step_time_s"),
        "tokens_per_s": summary.get("tokens_per_s"),
        "flops_per_token": flops_per_token(cfg.model, cfg.seq_len),
        "losses": [s["loss"] for s in steps],
        "step_times_s": [s["step_time_s"] for s in steps],
        "final_loss": summary.get("final_loss"),
        "wall_s": wall,
    }


def _cuda_machine(baseline: str | None) -> dict[str, Any]:
    """The card, its driver and versions, and the device memory taken with this process's CUDA
    context made (the context, and whatever the device held before it: ``baseline_used_mib``)."""
    import torch

    torch.cuda.init()
    torch.ones(1, device="cuda")
    context = _device_used() - int(torch.cuda.memory_reserved())
    props = torch.cuda.get_device_properties(0)
    return {
        "machine": {
            "device": props.name, "total_memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "driver": query_gpu("driver_version", units=False), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "baseline_used_mib": float(baseline) if baseline else None,
            "context_and_baseline_bytes": context,
        },
        "runs": [],
    }  # fmt: skip


def measure(args: argparse.Namespace) -> int:
    """The ``measure`` half: on this machine's GPU, every run of the grid until the budget ends."""
    deadline = time.monotonic() + args.budget_s
    # MiB the device holds before this process's context.
    baseline = query_gpu("memory.used", units=False)
    import torch

    runs = grid(args.grid)[args.start :]
    if not torch.cuda.is_available():
        if args.grid != "smoke":
            print(f"--grid {args.grid}: needs a CUDA GPU (off one: --grid smoke, a CPU smoke of the "
                  "harness)", file=sys.stderr)  # fmt: skip
            return 2
        out: dict[str, Any] = {"machine": {"device": "cpu", "torch": torch.__version__}, "runs": []}
        args.no_rates = True
    else:
        out = _cuda_machine(baseline)
    path = Path(args.json)

    def save() -> None:
        path.write_text(json.dumps(out, indent=1), encoding="utf-8")

    if not args.no_rates:
        t0 = time.perf_counter()
        out["rates"] = _rates(sorted({r["model"] for r in runs}))
        out["rates"]["wall_s"] = time.perf_counter() - t0
        print(
            f"rates: {json.dumps({k: v for k, v in out['rates'].items() if not isinstance(v, list)})}",
            flush=True,
        )
    save()
    root = Path(tempfile.mkdtemp(prefix="gputruth-"))
    for run in runs:
        if time.monotonic() > deadline:
            out["runs"].append({"name": run.name, **run, "ok": False, "error": "budget ended"})
            continue
        row: dict[str, Any] = {"name": run.name, **run}
        try:
            row.update(_one(run, root), ok=True)
        except Exception as e:  # a run that fails is recorded and the next one runs
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        out["runs"].append(row)
        save()
        peak = row.get("peak_allocated_bytes")
        print(
            f"{run.name}: "
            + (f"peak {peak / GIB:.2f} GiB, step {row['median_step_time_s'] * 1e3:.1f} ms, "
               f"loss {row['final_loss']:.4f}, {row['wall_s']:.0f} s" if row["ok"] and peak
               else row.get("error", "?")),
            flush=True,
        )  # fmt: skip
        shutil.rmtree(root / run.name, ignore_errors=True)
    return 0


# ---------------------------------------------------------------- anywhere: against the plan


def _plan(run: Run, device: str) -> dict[str, Any]:
    """``dtlab plan --json --nproc 1 --device DEVICE`` of ``run``, in this process (the compiled
    blocks' measurements shared between runs), and its step time by the kernels' model
    (``--step-model kernels``: the config as given, no search)."""
    import dataclasses

    from dtlab.analysis.devices import PROFILES
    from dtlab.analysis.plan import plan, predict_step
    from dtlab.errors import DtlabError
    from dtlab.train.api import resolve_config

    config = resolve_config(None, run_overrides(run))
    kernels = dataclasses.replace(PROFILES[device], step_model="kernels")
    try:
        result = plan(config, 1, 1, PROFILES[device], None)
        kernels_s = predict_step(config, 1, 1, kernels).step_time_s
    except DtlabError as e:
        return {"error": str(e)}
    row = {x["strategy"]: x for x in result["strategies"]}["single"]
    return {"per_rank": row["per_rank"], "step_time_s": row["step_time_s"],
            "compute_time_s": row["compute_time_s"], "recompute_time_s": row["recompute_time_s"],
            "peak_tflops": result["device"].get("peak_tflops"),
            "kernels_step_time_s": kernels_s}  # fmt: skip


def compare(args: argparse.Namespace) -> int:
    """The ``compare`` half: each measured run beside the plan's prediction for it."""
    from dtlab.analysis.devices import PROFILES

    if args.device not in PROFILES:
        raise SystemExit(f"--device {args.device!r}: allowed: {', '.join(PROFILES)}")
    data = json.loads(Path(args.json).read_text(encoding="utf-8"))
    measured_peak = (data.get("rates") or {}).get("bf16_gemm_tflops")
    rows = []
    print(f"{'run':34} {'alloc GiB':>9} {'plan GiB':>9} {'err':>7} {'resv GiB':>9} "
          f"{'step ms':>8} {'flops ms':>8} {'err':>7} {'kernels':>8} {'err':>7}")  # fmt: skip
    for r in data["runs"]:
        if not r.get("ok"):
            print(f"{r['name']:34} {r.get('error', '')[:80]}")
            continue
        run = Run({k: r[k] for k in ("model", "mb", "ac", "compile", "float8", "steps", "seq")})
        plan = _plan(run, args.device)
        if "error" in plan:
            print(f"{r['name']:34} plan: {plan['error']}")
            continue
        pred = plan["per_rank"]["total_bytes"]
        scale = (
            plan["peak_tflops"] / measured_peak if measured_peak and plan["peak_tflops"] else 1.0
        )
        pred_s = plan["step_time_s"] * scale
        # The kernels' model: its rates are fractions of the datasheet measured on an H200 (not
        # scaled again by the measured peak).
        kernels_s = plan["kernels_step_time_s"]
        alloc, step = r["peak_allocated_bytes"], r["median_step_time_s"]
        rows.append({**r, "plan": plan, "plan_step_s_measured_peak": pred_s,
                     "plan_step_s_kernels": kernels_s})  # fmt: skip
        print(f"{r['name']:34} {alloc / GIB:9.2f} {pred / GIB:9.2f} {pred / alloc - 1:+7.1%} "
              f"{(r['peak_reserved_bytes'] or 0) / GIB:9.2f} {step * 1e3:8.1f} {pred_s * 1e3:8.1f} "
              f"{pred_s / step - 1:+7.1%} {kernels_s * 1e3:8.1f} {kernels_s / step - 1:+7.1%}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({**data, "compared": rows}, indent=1), "utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line (``measure`` on a GPU, ``compare`` anywhere)."""
    ap = argparse.ArgumentParser(
        prog="python -m dtlab.bench.gputruth", description=__doc__.split("\n\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="real runs on this machine's GPU")
    m.add_argument("--grid", default="full", help="full (llama3.2-1b and -3b) or smoke (debug)")
    m.add_argument(
        "--json", required=True, help="where to write the figures (rewritten after each run)"
    )
    m.add_argument(
        "--budget-s", type=float, default=330.0, help="start no run after this many seconds"
    )
    m.add_argument(
        "--start", type=int, default=0, help="skip the grid's first N runs (measured before)"
    )
    m.add_argument("--no-rates", action="store_true", help="skip the card's rates")
    c = sub.add_parser("compare", help="the measured runs beside dtlab plan's predictions")
    c.add_argument("--json", required=True, help="what measure wrote")
    c.add_argument("--device", default="h200", help="the plan's device profile (the card measured)")
    c.add_argument("--out", help="write the runs with their predictions here")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return measure(args) if args.cmd == "measure" else compare(args)


if __name__ == "__main__":
    raise SystemExit(main())
