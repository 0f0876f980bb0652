"""What a collective costs a step beyond its bytes where a job's ranks outnumber this machine's
cores, measured as the model's steps meet it: ``dtlab plan --device this``.

Where each rank has a core of its own, a collective waits for the slowest rank of its group to
arrive (:func:`dtlab.analysis.devices.measure_group_gbps`'s ``sync_s``, ranks multiplying one small
matrix between collectives). Where the ranks outnumber the cores, a rank that blocks gives its core
to another, and the collective completes when every rank of the job has had its turn to reach it:
the wait is the scheduler's, whatever the collective's group, and each rank resumes with the caches
refilled from its own state, which small matrices do not show. So here every rank trains the
config's model (its step as :mod:`dtlab.analysis.probe` takes it), all at once in a gloo group,
each step ending as a job's does (the ranks meet), in turn with the same step with a one-float
all-reduce after each block's forward and each block's backward: the median difference per
all-reduce is the wait (``step_wait_s``), which the plan counts for every collective of a step.
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dtlab.analysis.probe_step import probe_step
from dtlab.config import Config

__all__ = ["StepWait", "measure_step_wait", "oversubscribed"]


@dataclass(frozen=True)
class StepWait:
    """What :func:`measure_step_wait` measured on rank 0."""

    wait_s: float  # the median wait per collective inside a step, at least 0
    collectives: int  # the all-reduces a step with them issued (each block's forward and backward)
    steps_s: list[float]  # the steps without them, each to the ranks' meeting at its end


def oversubscribed(nproc: int, threads: int, cores: int) -> bool:
    """Whether ``nproc`` ranks of ``threads`` threads each outnumber ``cores`` (then a blocked
    rank's core goes to another rank, and the ranks take turns)."""
    return nproc * threads > cores


def measure_step_wait(
    config: Config, nproc: int, threads: int, batch: int, pairs: int, timeout_s: float = 600.0
) -> StepWait:
    """The wait per collective among ``nproc`` local processes training ``config``'s model on
    ``batch`` samples at ``threads`` threads each (see the module): the median over ``pairs`` of a
    step with the collectives less the step without, per collective, on rank 0. Raises
    ``RuntimeError`` when a process fails or the measurement runs past ``timeout_s``."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, nproc + 1, True, timeout=timeout, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="dtlab-stepwait-") as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(config.model_dump_json(), encoding="utf-8")
        shared = [str(store.port), str(nproc), str(threads), str(batch), str(pairs)]
        # Each rank's stderr to a file: read only if it fails, never a pipe left to fill.
        errs = [Path(tmp) / f"rank{r}.err" for r in range(nproc)]
        procs = []
        for r in range(nproc):
            with errs[r].open("w") as err:
                args = [str(path), str(r), *shared, str(int(timeout_s))]
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", __name__, *args],
                        stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                        stderr=err,
                        text=True,
                    )
                )
        try:
            _await_ranks(procs, errs, timeout_s)
            out = procs[0].stdout.read() if procs[0].stdout else ""
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                if p.stdout:
                    p.stdout.close()
    data = json.loads(out.strip().splitlines()[-1])
    steps = [float(t) for t in data["steps_s"]]
    return StepWait(max(0.0, float(data["wait_s"])), int(data["collectives"]), steps)


def _await_ranks(procs: list[subprocess.Popen[str]], errs: list[Path], timeout_s: float) -> None:
    """Wait for every rank to exit; a RuntimeError naming the first that failed as soon as one does
    (the others would wait for it in the group until their own timeout), or when they run past
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            r = failed[0]
            tail = errs[r].read_text(encoding="utf-8", errors="replace").strip().splitlines()
            raise RuntimeError(
                f"a process measuring the step's wait exited with {codes[r]}"
                + (f": {tail[-1]}" if tail else "")
            )
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"measuring the step's wait ran past {timeout_s:.0f} s")
        time.sleep(0.05)


def _child(path: str, rank: int, port: int, world: int, threads: int, batch: int, pairs: int,
           timeout: int) -> None:  # fmt: skip
    """One rank of :func:`measure_step_wait`: join the group, take the pairs of steps, and (rank 0)
    print what :class:`StepWait` holds as JSON."""
    import torch.distributed as dist
    from torch import nn

    from dtlab.models.llama import Block

    config = Config.model_validate_json(Path(path).read_text(encoding="utf-8"))
    t = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=t)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=t)
    step = probe_step(config, threads, batch)
    on, calls, one = [False], [0], torch.ones(1)

    def collective(module: nn.Module, *_: object) -> None:
        if on[0] and isinstance(module, Block):
            dist.all_reduce(one)
            calls[0] += 1

    # Global hooks (the step builds its model inside): each block's forward and backward.
    hooks = [
        nn.modules.module.register_module_forward_hook(collective),
        nn.modules.module.register_module_full_backward_hook(collective),
    ]

    def timed(flag: bool) -> float:
        on[0], calls[0] = flag, 0
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()  # the ranks meet, as at a job's step's end
        return time.perf_counter() - t0

    timed(False), timed(True)  # warm-up
    steps, waits, issued = [], [], 0
    for i in range(pairs):
        # Each first every other time: the machine's drift falls on both alike.
        order = (False, True) if i % 2 == 0 else (True, False)
        pair = {flag: (timed(flag), calls[0]) for flag in order}
        steps.append(pair[False][0])
        issued = pair[True][1]
        waits.append((pair[True][0] - pair[False][0]) / issued)
    for h in hooks:
        h.remove()
    dist.destroy_process_group()
    if rank == 0:
        out = {"wait_s": statistics.median(waits), "collectives": issued, "steps_s": steps}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    from dtlab.runtime.status import leave_worker

    _child(sys.argv[1], *(int(a) for a in sys.argv[2:9]))
    # Without the interpreter's teardown: destroying gloo's objects there can abort a rank that
    # finished ("terminate called without an active exception"), failing a good measurement.
    leave_worker(0)
