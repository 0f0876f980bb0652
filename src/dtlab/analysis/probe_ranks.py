"""The probe where a job's ranks outnumber this machine's cores: every rank trains at once, in step.

Where each rank has a core of its own, :mod:`dtlab.analysis.probe` times as many copies of the
model's step at once as there are cores to fill, and a collective's cost beyond its bytes is the wait
for the slowest rank of its group (:func:`dtlab.analysis.devices.measure_group_gbps`'s ``sync_s``,
ranks multiplying one small matrix between collectives). Where the ranks outnumber the cores, a rank
that blocks gives its core to another, and a synchronous step ends when the last rank has had its
turns: on 4 ranks of 2 cores the copies' step, scaled by the sharing, came 7% under the same steps
taken by 4 ranks that meet at each step's end, and 8 ranks 19%; and a collective inside the step
waits for the scheduler, not only for a straggler. So here all ``nproc`` ranks train the config's
model at once, each on the probe's tokens, in a gloo group, every step ending as a job's does (the
ranks meet); and in turn with those steps, the same step with a one-float all-reduce after each
block's forward and each block's backward: the median difference per all-reduce is the wait a
collective costs inside a step (``step_wait_s``).
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dtlab.analysis.probe_step import probe_step
from dtlab.config import Config

__all__ = ["RankRuns", "measure_ranks", "oversubscribed"]

# (the plain steps' runs, (seconds, optimizer seconds) each; the wait per collective)
RankRuns = tuple[list[tuple[float, float]], float]


def oversubscribed(nproc: int, threads: int, cores: int) -> bool:
    """Whether ``nproc`` ranks of ``threads`` threads each outnumber ``cores`` (then a blocked
    rank's core goes to another rank, and the ranks take turns)."""
    return nproc * threads > cores


def measure_ranks(
    config: Config, nproc: int, threads: int, batch: int, repeats: int, timeout_s: float = 600.0
) -> RankRuns:
    """``nproc`` local processes training ``config``'s model on ``batch`` samples at ``threads``
    threads each, in step (see the module): rank 0's ``repeats`` plain steps (each to the ranks'
    meeting at its end) and the median wait per collective of as many pairs. Raises
    ``RuntimeError`` when a process fails or the measurement runs past ``timeout_s``."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, nproc + 1, True, timeout=timeout, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="dtlab-ranks-") as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(config.model_dump_json(), encoding="utf-8")
        shared = [str(store.port), str(nproc), str(threads), str(batch), str(repeats)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", __name__, str(path), str(r), *shared, str(int(timeout_s))],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(nproc)
        ]
        try:
            outs = [p.communicate(timeout=timeout_s) for p in procs]
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"the probe's ranks ran past {timeout_s:.0f} s") from e
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            tail = err.strip().splitlines()
            raise RuntimeError(
                f"a rank of the probe exited with {p.returncode}"
                + (f": {tail[-1]}" if tail else "")
            )
    data = json.loads(outs[0][0].strip().splitlines()[-1])
    return [(float(a), float(b)) for a, b in data["runs"]], max(0.0, float(data["wait_s"]))


def _child(path: str, rank: int, port: int, world: int, threads: int, batch: int, repeats: int,
           timeout: int) -> None:  # fmt: skip
    """One rank of :func:`measure_ranks`: join the group, take the steps, and (rank 0) print the
    plain steps' runs and the wait per collective as JSON."""
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

    def timed(flag: bool) -> tuple[float, float]:
        on[0], calls[0] = flag, 0
        dist.barrier()
        t0 = time.perf_counter()
        _, optimizer = step()
        dist.barrier()  # the ranks meet, as at a job's step's end
        return time.perf_counter() - t0, optimizer

    timed(False), timed(True)  # warm-up
    runs, waits = [], []
    for i in range(repeats):
        # Each first every other time: the machine's drift falls on both alike.
        order = (False, True) if i % 2 == 0 else (True, False)
        pair = {flag: (timed(flag), calls[0]) for flag in order}
        runs.append(pair[False][0])
        waits.append((pair[True][0][0] - pair[False][0][0]) / pair[True][1])
    for h in hooks:
        h.remove()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"runs": runs, "wait_s": statistics.median(waits)}), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1], *(int(a) for a in sys.argv[2:9]))
