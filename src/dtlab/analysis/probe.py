"""This machine's compute for one model, measured: the step-time model of ``dtlab plan --device this``.

A CPU's GEMM peak says little about a small model's step: its matmuls run below the peak, and its
element-wise ops, attention kernel and optimizer are memory- or overhead-bound. So on this machine the
plan times the model itself: real training steps (:func:`dtlab.train.loop.train_step`) of the config's
model on one process, with the threads each rank of the planned world gets. The optimizer's step is
timed apart (proportional to the parameters a rank steps); the rest of the step, per token, is
forward and backward (proportional to the tokens and the share of the model's FLOPs a rank computes).

:func:`compute_seconds` scales that to one rank of a layout: its tokens, its share of the model's
FLOPs (its pipeline stage, its tensor-parallel slice), its parameters, the pipeline's bubble, and the
cores it shares with the other ranks of the machine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtlab.analysis.devices import ComputeProbe, DeviceProfile, cpu_memory_gib, measure_group_gbps
from dtlab.analysis.probe_step import PROBE_TOKENS, probe_step, rank_step
from dtlab.analysis.step_wait import measure_step_wait, oversubscribed
from dtlab.config import Config

__all__ = [
    "PROBE_TOKENS",
    "compute_seconds",
    "rank_share",
    "rank_step",
    "with_probe",
    "wrapper_seconds",
]

PROBE_REPEATS = 5  # timed steps (the median counts, as dtlab bench reports a step), after a warm-up
# The probe builds the whole model on one process: larger ones are not probed (peak-based instead).
PROBE_MEMORY_FRACTION = 0.25


def rank_threads(nproc: int, cores: int | None = None) -> int:
    """Threads each of ``nproc`` CPU ranks on this machine computes on: ``$OMP_NUM_THREADS``, or the
    cores shared among them (the rule of :func:`dtlab.parallel.dist.init_distributed`)."""
    env = os.environ.get("OMP_NUM_THREADS")
    return int(env) if env else max(1, (cores or os.cpu_count() or 1) // nproc)


def sharing(nproc: int, threads: int, cores: int) -> float:
    """How much slower each rank computes because the machine's ranks share its cores: 1 while
    their threads fit the cores, else threads in all over cores (the OS time-slices them)."""
    return max(1.0, nproc * threads / cores)


def probe_sharing(probe: ComputeProbe, nproc: int) -> float:
    """:func:`sharing` of ``nproc`` ranks at ``probe``'s threads and cores, with what the time
    slicing itself was measured to cost them where they outnumber the cores (``probe.slicing``)."""
    share = sharing(nproc, probe.threads, probe.cores)
    return share * probe.slicing if share > 1 else share


def time_slicing(probe: ComputeProbe, config: Config, batch: int, nproc: int,
                 steps_s: list[float]) -> float:  # fmt: skip
    """``probe.slicing`` from ``steps_s``, the steps ``nproc`` ranks took all at once on ``batch``
    samples each (:func:`dtlab.analysis.step_wait.measure_step_wait`'s, without its collectives):
    their median over the probe's step of that batch times the cores' sharing, at least 1 (a
    shorter median is the two measurements' noise)."""
    from dataclasses import replace

    # The step as the plan takes it for these ranks, with no slicing of its own.
    expected = compute_seconds(replace(probe, slicing=1.0), batch * config.seq_len, 1.0, 1.0, nproc)
    if not steps_s or expected <= 0:
        return 1.0
    return max(1.0, statistics.median(steps_s) / expected)


def probe_refusal(config: Config, memory_bytes: float) -> str | None:
    """Why the model is too large to probe on this machine (None when it can be)."""
    from dtlab.analysis.model import param_shapes

    params = sum(s.numel for s in param_shapes(config.model))
    need = params * 16  # fp32 weights, gradients and AdamW's two moments
    if need > PROBE_MEMORY_FRACTION * memory_bytes:
        return (
            f"the model's state ({need / 2**30:.1f} GiB) is over {PROBE_MEMORY_FRACTION:.0%} of "
            "this machine's memory"
        )
    return None


def measure_probe(
    config: Config, threads: int, copies: int = 1, cores: int | None = None
) -> ComputeProbe:
    """Time ``config``'s model training on one process at ``threads`` threads (see the module).

    ``copies`` > 1: that many processes train it at once (each the same), as that many ranks of a
    job share the machine's memory bandwidth and caches; the slowest counts (a synchronous step waits
    for it). Forward and backward are timed on the probe's tokens and, where those are more than
    one sample, on one sample: a line through the two gives the part of a pass that does not grow
    with its tokens (on ``small`` about 0.18 s a pass, 14% of a 256-token micro-batch's)."""
    from dtlab.analysis.model import param_shapes

    seq = config.seq_len
    batch = max(1, PROBE_TOKENS // seq)
    batches = [batch, 1] if batch > 1 else [batch]
    if copies > 1:
        phases = _probe_copies(config, threads, copies, batches)
    else:
        phases = [_timed(probe_step(config, threads, b)) for b in batches]
    # The median, the statistic dtlab bench reports (a typical step, not the luckiest).
    total = statistics.median(r[0] for r in phases[0])
    optimizer = statistics.median(r[1] for r in phases[0])
    per_token, per_pass = (total - optimizer) / (batch * seq), 0.0
    if len(phases) > 1:
        one = statistics.median(r[0] - r[1] for r in phases[1])
        slope = (total - optimizer - one) / ((batch - 1) * seq)
        # (A negative part per pass is the two measurements' noise: the probe's tokens' figure
        # stands alone then.)
        if slope > 0 and one - slope * seq > 0:
            per_token, per_pass = slope, one - slope * seq
    return ComputeProbe(
        threads=threads,
        cores=cores or os.cpu_count() or 1,
        seconds_per_token=per_token,
        fixed_seconds=optimizer,
        params=sum(s.numel for s in param_shapes(config.model)),
        seq_len=seq,
        source=(
            f"measured: training steps of this model on {copies} process(es) at once, "
            f"{threads} thread(s) each, {' and '.join(f'{b * seq:,}' for b in batches)} tokens, "
            f"median of {PROBE_REPEATS}" + (", the slowest process" if copies > 1 else "")
        ),
        pass_seconds=per_pass,
    )


def _timed(step: Callable[[], tuple[float, float]]) -> list[tuple[float, float]]:
    """``PROBE_REPEATS`` runs of ``step`` after a warm-up."""
    step()
    return [step() for _ in range(PROBE_REPEATS)]


def _probe_copies(
    config: Config, threads: int, copies: int, batches: list[int]
) -> list[list[tuple[float, float]]]:
    """For each of ``batches`` (samples a step), the runs of the slowest of ``copies`` processes
    training ``config``'s model at once (each builds and warms up, then all start their timed steps
    together)."""
    with tempfile.TemporaryDirectory(prefix="dtlab-probe-") as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(config.model_dump_json(), encoding="utf-8")
        sizes = ",".join(str(b) for b in batches)
        # Their stderr to files: a pipe nobody reads until the end could fill and stall them.
        errs = [Path(tmp) / f"stderr-{i}" for i in range(copies)]
        argv = [sys.executable, "-m", "dtlab.analysis.probe", str(path), str(threads), sizes]
        procs = []
        for err_path in errs:
            with err_path.open("w", encoding="utf-8") as err_file:
                procs.append(
                    subprocess.Popen(
                        argv,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err_file,
                        text=True,
                    )
                )
        phases = []
        try:
            for _ in batches:
                for p, err_path in zip(procs, errs, strict=True):  # each says when it is ready
                    line = p.stdout.readline() if p.stdout else ""
                    if line.strip() != "ready":
                        raise _failed(p, err_path, line)
                for p in procs:
                    assert p.stdin is not None
                    p.stdin.write("go\n")
                    p.stdin.flush()
                results = [_runs(p, err) for p, err in zip(procs, errs, strict=True)]
                phases.append(max(results, key=lambda runs: statistics.median(r[0] for r in runs)))
            for p in procs:
                p.wait(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return phases


def _runs(proc: subprocess.Popen[str], err_path: Path) -> list[tuple[float, float]]:
    """The timed runs a probe process prints (RuntimeError, with its last stderr line, if it
    printed none)."""
    line = proc.stdout.readline() if proc.stdout else ""
    try:
        return [(float(a), float(b)) for a, b in json.loads(line)]
    except (ValueError, TypeError):
        raise _failed(proc, err_path, line) from None


def _failed(proc: subprocess.Popen[str], err_path: Path, line: str) -> RuntimeError:
    """A probe process that printed ``line`` where it should have said more, stopped: the error
    naming its last stderr line (or what it printed)."""
    proc.kill()
    proc.wait()
    err = err_path.read_text(encoding="utf-8").strip().splitlines()
    return RuntimeError(f"a probe process failed: {err[-1] if err else line!r}")


def _child(path: str, threads: int, sizes: str) -> None:
    """A probe process (:func:`_probe_copies`): for each of ``sizes`` (samples a step, comma
    separated) build, warm up, say ``ready``, wait for ``go``, time ``PROBE_REPEATS`` steps and print
    them as JSON."""
    from dtlab.config import Config as _Config

    config = _Config.model_validate_json(Path(path).read_text(encoding="utf-8"))
    for batch in (int(b) for b in sizes.split(",")):
        step = probe_step(config, threads, batch)
        step()
        print("ready", flush=True)
        sys.stdin.readline()
        print(json.dumps([step() for _ in range(PROBE_REPEATS)]), flush=True)
        del step  # its model, before the next size's is built


def compute_seconds(
    probe: ComputeProbe,
    tokens: float,
    flops_share: float,
    params_share: float,
    nproc: int,
    bubble: float = 0.0,
    passes: int = 1,
) -> float:
    """One rank's compute in a step (forward, backward and the fixed part), from ``probe``.

    ``tokens``: the tokens the rank's data-parallel group trains on; ``flops_share``: the rank's part
    of the model's FLOPs per token (its stage's layers, its tensor-parallel slice); ``params_share``:
    its part of the parameters it steps; ``bubble``: the pipeline's idle fraction; ``passes``: the
    forward and backward passes (micro-batches) it runs, each with the probe's part per pass.

    Ranks that share the cores take turns: a rank's step is its own work stretched by the sharing,
    or its own critical path with the bubble, whichever is longer (while a stage idles in the
    bubble, another rank computes on its core)."""
    work = (probe.seconds_per_token * tokens + probe.pass_seconds * passes) * flops_share
    fixed = probe.fixed_seconds * params_share
    shared = (work + fixed) * probe_sharing(probe, nproc)
    return max(shared, work / (1 - bubble) + fixed)


def rank_share(config: Config, dims: Any, shapes: list[Any]) -> tuple[float, float]:
    """(FLOPs share, parameters share) of the busiest rank of a layout: its pipeline stage's part of
    the model's FLOPs per token (its blocks, and the output projection on the last stage) and of its
    parameters the optimizer steps, each split by tensor parallelism, the parameters also by the
    data-parallel shards the optimizer steps (FSDP's, ZeRO-1's)."""
    from dtlab.analysis.activations import attention_widths, block_matmul_params
    from dtlab.analysis.model import flops_per_token, rank_shapes
    from dtlab.analysis.shapes import holds_tied_copy, stepped_shapes

    m = config.model
    block = 6.0 * block_matmul_params(m) + 12.0 * attention_widths(m)[0] * config.seq_len
    head = 6.0 * m.dim * m.vocab_size
    total = flops_per_token(m, config.seq_len)
    # no_shard's dp_shard is 1: it steps every parameter, as DDP does.
    shards = dims.dp if dims.shard_optimizer else dims.fsdp_shard
    flops, params = 0.0, 0.0
    everything = sum(s.numel for s in shapes)
    for pp_rank in range(dims.pp):
        held, part = rank_shapes(config, dims, shapes, pp_rank)
        flops = max(flops, part.n_layers * block + (head if part.last else 0.0))
        # (Not a tied model's last stage's copy of the embedding: the optimizer leaves it.)
        stepped = stepped_shapes(held, holds_tied_copy(config, part))
        params = max(params, sum(s.shard_numel(shards) for s in stepped))
    return flops / total / dims.tp, params / everything


def wrapper_seconds(
    config: Config, dims: Any, wrapper_s: dict[str, float], nproc: int, probe: ComputeProbe
) -> float:
    """What FSDP's, ZeRO-1's and tensor parallelism's code adds to one rank's step (measured
    per FSDP unit and micro-batch, per ZeRO-1 step, per block and micro-batch and its tokens, with
    sequence parallelism's difference where it runs: :mod:`dtlab.analysis.wrappers`), at the cores'
    sharing of ``nproc`` ranks."""
    from dtlab.analysis.steptime import step_microbatches

    layers = config.model.n_layers // dims.pp
    m = step_microbatches(config, dims)
    extra = 0.0
    if dims.fsdp_enabled and dims.fsdp_shard > 1:
        extra += wrapper_s.get("fsdp_unit_s", 0.0) * (layers + 1) * m
    if dims.shard_optimizer:
        extra += wrapper_s.get("zero_step_s", 0.0)
    if dims.tp_enabled:
        # Its fixed part, and the part that grows with the micro-batch's tokens.
        tokens = config.train.global_batch_size * config.seq_len / (dims.dp * m)
        per_block = wrapper_s.get("tp_block_s", 0.0) + wrapper_s.get("tp_token_s", 0.0) * tokens
        if config.parallel.sequence_parallel:
            # Sequence parallelism's difference (it splits the norms plain TP repeats: it saves).
            per_block += (
                wrapper_s.get("sp_block_s", 0.0) + wrapper_s.get("sp_token_s", 0.0) * tokens
            )
        extra += max(0.0, per_block) * layers * m
    return extra * probe_sharing(probe, nproc)


STEP_WAIT_BUDGET_S = 2.0  # the longest step the step's wait is measured on (12 steps are taken)


def _wait_batch(config: Config, probe: ComputeProbe, nproc: int) -> int:
    """Samples a rank trains in the step's wait's measurement: the probe's, fewer where ``nproc``
    ranks' step on them would take over ``STEP_WAIT_BUDGET_S`` (a larger model on many ranks), at
    least one."""
    per_sample = (
        probe.seconds_per_token * config.seq_len * sharing(nproc, probe.threads, probe.cores)
    )
    fit = int(STEP_WAIT_BUDGET_S // per_sample) if per_sample > 0 else PROBE_TOKENS
    return max(1, min(PROBE_TOKENS // config.seq_len, fit))


def with_probe(device: DeviceProfile, config: Any, nproc: int) -> tuple[DeviceProfile, str | None]:
    """``device`` (this machine) measured for ``config`` on ``nproc`` ranks: its step of the model
    at the threads each rank gets (:mod:`dtlab.analysis.probe`) and each collective among ``nproc``
    local processes (:func:`measure_group_gbps`); and None, or why the model was not probed (then
    the step's compute comes from the GEMM peak)."""
    from dataclasses import replace

    from dtlab.analysis.wrappers import measure_wrappers

    if device.kind != "cpu":
        # The probe and the group's collectives run on this machine's CPU and gloo: a GPU's step
        # comes from its measured GEMM peak instead.
        return device, "a GPU: the model's step is probed on the CPU only"
    if nproc > 1:
        nbytes, repeats = 4 * 2**20, 9
        try:
            rates = measure_group_gbps(nproc, nbytes, repeats, threads=rank_threads(nproc))
            device = replace(
                device,
                collective_gbps=rates,
                collective_source=f"measured: gloo among {nproc} local processes, "
                f"{nbytes // 2**20} MiB, median of {repeats}",
            )
        except (RuntimeError, OSError, subprocess.SubprocessError):
            pass  # the loopback figure stands for every collective
    why = probe_refusal(config, cpu_memory_gib() * 2**30)
    if why:
        return device, why
    threads = rank_threads(nproc)
    cores = os.cpu_count() or 1
    # As many at once as the ranks that compute at once (the cores they fill): they share the
    # memory bandwidth and the caches.
    probe = measure_probe(config, threads, max(1, min(nproc, cores // threads)), cores)
    fits = not probe_refusal(config, cpu_memory_gib() * 2**30 / nproc)
    if device.collective_gbps and oversubscribed(nproc, threads, cores) and fits:
        try:
            batch = _wait_batch(config, probe, nproc)
            wait = measure_step_wait(config, nproc, threads, batch, PROBE_REPEATS)
            device = replace(
                device, collective_gbps={**device.collective_gbps, "step_wait_s": wait.wait_s}
            )
            # The same ranks' steps without the collectives: the time slicing's own cost.
            slicing = time_slicing(probe, config, batch, nproc, wait.steps_s)
            probe = replace(probe, slicing=slicing)
        except (RuntimeError, OSError, subprocess.SubprocessError):
            pass  # the small matrices' wait (sync_s) stands, counted whole by the plan
    try:
        wrappers = measure_wrappers(config, nproc, threads)
    except (RuntimeError, OSError, subprocess.SubprocessError):
        wrappers = None  # the plan then counts the model's arithmetic alone
    return replace(device, probe=probe, wrapper_s=wrappers), None


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3])
