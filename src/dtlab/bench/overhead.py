"""How much does dtlab's loop cost over a minimal hand-written loop? Same model, same global batch and
micro-batches, same data, same optimizer, same threads, measured side by side in one run: one process,
and DDP on two gloo processes.

    python -m dtlab.bench.overhead [--preset tiny] [--steps 20] [--repeats 3] [--set KEY=VALUE ...]

Each repeat runs each pair (dtlab and the hand-written loop of ``dtlab.bench.handloop``), alternating
which goes first, so a noisy neighbour hits both. DDP x2 runs ``dtlab train --nproc 2`` against torch's
DDP started by the same launcher, with ``OMP_NUM_THREADS`` = cores / 2 for both. Two figures per loop:
``step``, the median step time (first step left out as warm-up), and ``loop``, the loop's wall time per
step after the first, with everything done between steps. The ratios are reported as the median over
repeats and their spread.

Separate runs drift apart on a shared machine (the same loop's step time moves by 10-20% from one run
to the next), so each repeat also takes dtlab's step and the hand-written one in turn in the same
processes (``dtlab.bench.handloop --interleaved``): ``step in turn`` is the median over steps of each
step's ratio; ``loop in turn`` multiplies it by what each loop adds between its steps, relative to its
own step time, as measured within each loop's own run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dtlab.bench.handloop import LoopTimes, hand_loop
from dtlab.cliargs import parse_config_args, positive_int, run_command, script_parser
from dtlab.config import Config, load_config
from dtlab.train.loop import train

DDP_NPROC = 2
MODES = ("single", f"ddp x{DDP_NPROC}")
LAYOUT = {MODES[0]: ("single", 1), MODES[1]: ("ddp", DDP_NPROC)}  # strategy, processes
FIGURES = ("step", "loop")
IN_TURN = ("step in turn", "loop in turn")


def _dtlab_times(run_dir: Path, threads: int) -> LoopTimes:
    """dtlab's figures from what its rank 0 wrote: the summary's median step time, and its loop time
    without the first step (from metrics.jsonl, which always logs step 1)."""
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    first = json.loads((run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert first["step"] == 1, first
    steps = int(summary["steps"])
    loop = (summary["train_time_s"] - first["step_time_s"]) / (steps - 1)
    return LoopTimes(summary["median_step_time_s"], loop, steps, threads)


def _bench_config(config: Config, run_dir: Path, strategy: str) -> Config:
    cfg = config.model_copy(deep=True)
    cfg.parallel.strategy = strategy  # type: ignore[assignment]
    cfg.run.dir, cfg.run.progress, cfg.run.plot = str(run_dir), "none", False
    return cfg


def dtlab_single(config: Config, tmp: Path) -> LoopTimes:
    """dtlab's own loop in this process, as users run it (logging, metrics, TensorBoard)."""
    run_dir = tmp / "dtlab-single"
    train(_bench_config(config, run_dir, "single"))
    return _dtlab_times(run_dir, torch.get_num_threads())


def hand_single(config: Config, tmp: Path) -> LoopTimes:
    """The hand-written loop in this process."""
    return hand_loop(config)


def ddp_threads() -> int:
    """Threads per DDP process: ``$OMP_NUM_THREADS``, or the cores shared among the processes."""
    from dtlab.bench.sweep import rank_threads

    return rank_threads(DDP_NPROC)


def _run(cmd: list[str], what: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(ddp_threads()), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"{what} failed (exit code {proc.returncode}):\n{tail}")


def dtlab_ddp(config: Config, tmp: Path) -> LoopTimes:
    """``dtlab train --nproc 2`` with DDP, exactly as users start it."""
    run_dir = tmp / "dtlab-ddp"
    path = tmp / "dtlab-ddp.yaml"
    path.write_text(_bench_config(config, run_dir, "ddp").to_yaml(), encoding="utf-8")
    _run(
        [sys.executable, "-m", "dtlab", "train", str(path), "--nproc", str(DDP_NPROC)],
        "dtlab train",
    )
    return _dtlab_times(run_dir, ddp_threads())


def hand_ddp(config: Config, tmp: Path) -> LoopTimes:
    """The hand-written DDP loop on two processes, started by the launcher ``dtlab train`` uses."""
    path, out = tmp / "hand-ddp.yaml", tmp / "hand-ddp.json"
    path.write_text(config.to_yaml(), encoding="utf-8")
    _run(
        [sys.executable, "-m", "dtlab.bench.handloop", str(path), "--out", str(out),
         "--nproc", str(DDP_NPROC)],
        "the hand-written DDP loop",
    )  # fmt: skip
    return LoopTimes(**json.loads(out.read_text(encoding="utf-8")))


def interleaved_ratio(config: Config, tmp: Path, strategy: str, nproc: int) -> float:
    """dtlab's step over the hand-written one, taken in turn in ``nproc`` processes
    (``dtlab.bench.handloop --interleaved``): the median over steps of each step's ratio."""
    path, out = tmp / "interleaved.yaml", tmp / "interleaved.json"
    path.write_text(_bench_config(config, tmp / "unused", strategy).to_yaml(), encoding="utf-8")
    _run(
        [sys.executable, "-m", "dtlab.bench.handloop", str(path), "--out", str(out),
         "--nproc", str(nproc), "--interleaved"],
        "the interleaved steps",
    )  # fmt: skip
    times = json.loads(out.read_text(encoding="utf-8"))
    return statistics.median(o / h for h, o in zip(times["hand"], times["dtlab"], strict=True))


Runner = Callable[[Config, Path], LoopTimes]
PAIRS: dict[str, tuple[Runner, Runner]] = {
    MODES[0]: (hand_single, dtlab_single),
    MODES[1]: (hand_ddp, dtlab_ddp),
}


def compare(config: Config, repeats: int, report: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every pair ``repeats`` times, interleaved; returns each repeat's times and the ratios.

    ``{mode: {"repeats": [{"hand": {...}, "dtlab": {...}}, ...], "hand": {figure: median s},
    "dtlab": {figure: median s}, "ratio": {figure: {"median", "min", "max"}}}}``, dtlab / hand.
    """
    rows: dict[str, list[dict[str, LoopTimes]]] = {mode: [] for mode in PAIRS}
    paired: dict[str, list[float]] = {mode: [] for mode in PAIRS}
    for r in range(repeats):
        for mode, (hand, ours) in PAIRS.items():
            order = [("hand", hand), ("dtlab", ours)]
            if r % 2:
                order.reverse()
            res: dict[str, LoopTimes] = {}
            for name, fn in order:
                with tempfile.TemporaryDirectory(prefix="dtlab-overhead-") as tmp:
                    res[name] = fn(config, Path(tmp))
            rows[mode].append(res)
            with tempfile.TemporaryDirectory(prefix="dtlab-overhead-") as tmp:
                paired[mode].append(interleaved_ratio(config, Path(tmp), *LAYOUT[mode]))
            h, d = res["hand"], res["dtlab"]
            report(
                f"  repeat {r + 1} {mode:<8} hand {h.step_s * 1e3:7.1f} ms/step   dtlab "
                f"{d.step_s * 1e3:7.1f} ms/step   ratio {d.step_s / h.step_s:.3f}   "
                f"(loop {h.loop_s * 1e3:.1f} vs {d.loop_s * 1e3:.1f} ms/step, ratio {d.loop_s / h.loop_s:.3f}; "
                f"steps in turn {paired[mode][-1]:.3f})"
            )
    out: dict[str, Any] = {}
    for mode, results in rows.items():
        figures: dict[str, Any] = {
            "repeats": [{k: asdict(v) for k, v in x.items()} for x in results]
        }
        for who in ("hand", "dtlab"):
            figures[who] = {
                f: statistics.median(getattr(x[who], f"{f}_s") for x in results) for f in FIGURES
            }
        figures["ratio"] = {}
        for f in FIGURES:
            ratios = [getattr(x["dtlab"], f"{f}_s") / getattr(x["hand"], f"{f}_s") for x in results]
            figures["ratio"][f] = {
                "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)
            }  # fmt: skip
        # The loop in turn: the step ratio in turn, times what each loop adds between steps relative to
        # its own step (both measured within one run, so the machine's drift between runs cancels).
        around = [
            (x["dtlab"].loop_s / x["dtlab"].step_s) / (x["hand"].loop_s / x["hand"].step_s)
            for x in results
        ]
        for name, values in (
            ("step in turn", paired[mode]),
            ("loop in turn", [p * a for p, a in zip(paired[mode], around, strict=True)]),
        ):
            figures["ratio"][name] = {
                "median": statistics.median(values), "min": min(values), "max": max(values)
            }  # fmt: skip
        out[mode] = figures
    return out


def main(argv: list[str] | None = None) -> int:
    p = script_parser("dtlab.bench.overhead", __doc__, "tiny")
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--repeats", type=positive_int, default=3)
    args = parse_config_args(p, argv)
    if args.steps < 2 or args.repeats < 1:
        p.error(
            f"--steps {args.steps} --repeats {args.repeats}: need at least 2 steps (the first is "
            "left out as warm-up) and 1 repeat"
        )
    config = load_config(
        overrides=[
            f"model.preset={args.preset}",
            "data.seq_len=64",
            "train.micro_batch_size=4",
            f"train.steps={args.steps}",
            "parallel.strategy=single",
            *args.overrides,
        ]
    )
    import logging

    logging.getLogger("dtlab").disabled = True
    t = config.train
    print(
        f"model {args.preset}, global batch {t.global_batch_size} x {config.seq_len} tokens in "
        f"micro-batches of {t.micro_batch_size or 'all'}, {t.steps} steps, {args.repeats} repeats, "
        f"precision {t.precision}; threads: {torch.get_num_threads()} single, {ddp_threads()} per "
        f"DDP process; {os.cpu_count()} cores"
    )
    results = compare(config, args.repeats)
    print(
        f"medians over {args.repeats} repeats (ratio: dtlab / hand-written, min-max over repeats):"
    )
    for mode, res in results.items():
        for f in FIGURES:
            r = res["ratio"][f]
            print(
                f"  {mode:<8} {f:<4}  hand {res['hand'][f] * 1e3:7.1f} ms/step   dtlab "
                f"{res['dtlab'][f] * 1e3:7.1f} ms/step   ratio {r['median']:.3f} "
                f"({r['min']:.3f}-{r['max']:.3f}) -> overhead {100 * (r['median'] - 1):+.1f}%"
            )
        for f in IN_TURN:
            r = res["ratio"][f]
            print(
                f"  {mode:<8} {f:<12}  ratio {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) "
                f"-> overhead {100 * (r['median'] - 1):+.1f}%"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
