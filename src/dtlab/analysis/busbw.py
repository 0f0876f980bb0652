"""Collective bus bandwidth among every GPU of a node (NCCL), or among local processes (gloo), measured
through ``torch.distributed`` as nccl-tests reports it.

For each collective and buffer size: ``world`` processes, one per device, run the collective once and
check its result (every rank's values known in advance), then ``repeats`` times ``iters`` back to
back (the device synchronised before and after); a repeat's time is the slowest rank's, and the
figure is the median repeat's time per collective. As in nccl-tests:

- ``size`` is the bytes of the collective's whole buffer: the tensor of an all-reduce or all-to-all,
  the gathered output of an all-gather, the input of a reduce-scatter;
- ``algbw = size / time``;
- ``busbw = algbw x 2 (n - 1) / n`` for an all-reduce, ``algbw x (n - 1) / n`` for an all-gather,
  reduce-scatter or all-to-all: what each rank's link carries in a ring, comparable across ``n`` and
  with the link's own rate (an all-reduce's busbw is what ``dtlab plan`` calls a node's link).

Rank ``r`` uses ``cuda:r`` of the devices this process sees (a user's ``CUDA_VISIBLE_DEVICES`` is
respected) with NCCL, or the CPU with gloo; every rank reports the device it used.

    python -m dtlab.analysis.busbw WORKER_ARGS   # one rank (started by :func:`measure`)
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtlab.runtime.nvidia import smi

__all__ = [
    "BUS_FACTOR",
    "OPS",
    "Result",
    "backend_for",
    "buffer_numel",
    "bus_factor",
    "gpus_of",
    "measure",
    "placement_problem",
    "rank_device",
]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# busbw / algbw for ``n`` ranks (nccl-tests' PERFORMANCE.md): a ring all-reduce moves each byte
# 2 (n - 1) / n times over a rank's link, the others (n - 1) / n times.
BUS_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
RESULT_PREFIX = "busbw-result "


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw of collective ``op`` among ``world`` ranks."""
    return BUS_FACTOR[op] * (world - 1) / world


def backend_for(device_type: str) -> str:
    """The process group backend of a measurement on ``device_type``: NCCL between GPUs, gloo on the
    CPU."""
    if device_type == "cuda":
        return "nccl"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"device type {device_type!r}: allowed: cuda, cpu")


def rank_device(device_type: str, rank: int) -> torch.device:
    """The device rank ``rank`` measures on: ``cuda:rank`` of the visible GPUs (one GPU per rank),
    or the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def buffer_numel(size: int, world: int) -> int:
    """float32 values of a collective's whole buffer for ``size`` bytes: the largest multiple of
    ``world`` (every rank's part the same) not over ``size``, at least ``world``."""
    return max(world, size // 4 // world * world)


@dataclass(frozen=True)
class Result:
    """One collective at one size: seconds per call (the median repeat's, slowest rank) and the
    bandwidths in GB/s (1e9 bytes)."""

    op: str
    size: int  # bytes of the whole buffer (nccl-tests' "size")
    seconds: float
    algbw: float
    busbw: float
    correct: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op, "size": self.size, "seconds": self.seconds, "algbw_gbps": self.algbw,
            "busbw_gbps": self.busbw, "correct": self.correct,
        }  # fmt: skip


def measure(
    world: int,
    device_type: str,
    sizes: list[int],
    ops: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter"),
    iters: int = 20,
    repeats: int = 5,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Bus bandwidth of each of ``ops`` at each of ``sizes`` (bytes) among ``world`` processes, one
    per device (``device_type`` cuda: NCCL; cpu: gloo). Returns ``{"world", "backend", "devices"
    (each rank's device), "results" (:meth:`Result.as_dict` each, by op then size), "placement"
    (on GPUs each rank's CUDA contexts as the driver lists them, :func:`placement_problem`; None
    on the CPU)}``. Raises
    ``RuntimeError`` naming the rank that failed, or the timeout."""
    if world < 2:
        raise ValueError(f"world {world}: a bus bandwidth needs at least 2 ranks")
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise ValueError(f"ops {list(ops)}: allowed: {', '.join(OPS)}")
    backend = backend_for(device_type)
    if device_type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(
            f"world {world}: this process sees {torch.cuda.device_count()} CUDA GPU(s) "
            "(one per rank)"
        )
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    # The rendezvous only: port 0, the OS picks a free one; the ranks are all children.
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
    spec = {
        "port": store.port, "world": world, "device_type": device_type, "backend": backend,
        "sizes": sizes, "ops": list(ops), "iters": iters, "repeats": repeats,
        "timeout_s": timeout_s,
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="dtlab-busbw-") as tmp:
        outputs = _run_ranks(spec, world, timeout_s, Path(tmp))
    reports = [_result_line(out) for out, _ in outputs]
    return {
        "world": world,
        "backend": backend,
        "devices": [rep["device"] for rep in reports],
        "results": reports[0]["results"],
        "placement": [rep.get("placement") for rep in reports],
    }


def _run_ranks(
    spec: dict[str, Any], world: int, timeout_s: float, tmp: Path
) -> list[tuple[str, str]]:
    """Run the ``world`` ranks to their end: (stdout, stderr) of each. The first rank to fail
    stops the others (a rank that died leaves the rest waiting for it); a RuntimeError names it,
    or the timeout."""
    procs, logs = [], []
    for r in range(world):
        out, err = tmp / f"{r}.out", tmp / f"{r}.err"
        with out.open("w") as o, err.open("w") as e:  # files: no pipe fills while ranks run
            cmd = [sys.executable, "-m", "dtlab.analysis.busbw", json.dumps({**spec, "rank": r})]
            procs.append(subprocess.Popen(cmd, stdout=o, stderr=e, text=True))
        logs.append((out, err))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        failed = [r for r, p in enumerate(procs) if p.poll() is not None and p.returncode]
        if failed:
            r = failed[0]
            lines = [x for x in logs[r][1].read_text().splitlines() if x.strip()]
            raise RuntimeError(
                f"rank {r} of the bus bandwidth measurement exited with {procs[r].returncode}"
                + (f": {lines[-1]}" if lines else "")
            )
        late = [r for r, p in enumerate(procs) if p.poll() is None]
        if late:
            raise RuntimeError(
                f"the bus bandwidth measurement among {world} ranks ran past {timeout_s:.0f} s "
                f"(rank {late[0]} had not finished)"
            )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(out.read_text(), err.read_text()) for out, err in logs]


def gpus_of(pid: int, listing: str) -> list[str]:
    """The GPUs (UUIDs) on which process ``pid`` holds a CUDA context, from the lines of
    ``nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader``."""
    held = set()
    for line in listing.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0] == str(pid):
            held.add(parts[1])
    return sorted(held)


def _placement() -> dict[str, Any]:
    """This process's CUDA contexts as the driver lists them (``{"gpus": [UUID, ...]}``), or why
    they could not be read (``{"unchecked": reason}``): no nvidia-smi, or a container whose
    process IDs the driver does not see."""
    proc = smi("--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader", timeout=30)
    if isinstance(proc, str):
        return {"unchecked": proc}
    if proc.returncode != 0:
        return {
            "unchecked": f"nvidia-smi exited with {proc.returncode}: {proc.stderr.strip()[-200:]}"
        }
    gpus = gpus_of(os.getpid(), proc.stdout)
    if not gpus:
        return {"unchecked": "nvidia-smi lists no context of this process (another PID namespace)"}
    return {"gpus": gpus}


def placement_problem(placement: list[dict[str, Any] | None]) -> str | None:
    """What is wrong with the ranks' CUDA contexts (each rank's :func:`_placement`): a rank on
    more than one GPU (a context opened on a GPU it was not given), or two ranks on one; None
    where each rank holds one GPU of its own, or where it could not be read."""
    read = [(r, p["gpus"]) for r, p in enumerate(placement) if p and "gpus" in p]
    for r, gpus in read:
        if len(gpus) > 1:
            return f"rank {r} holds CUDA contexts on {len(gpus)} GPUs: {', '.join(gpus)}"
    owners: dict[str, int] = {}
    for r, gpus in read:
        for gpu in gpus:
            if gpu in owners:
                return f"ranks {owners[gpu]} and {r} share the GPU {gpu}"
            owners[gpu] = r
    return None


def _result_line(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            out: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
            return out
    raise RuntimeError(f"a rank printed no result: {stdout.strip()[-300:]!r}")


# ---------------------------------------------------------------- one rank


def _expected(op: str, rank: int, world: int, numel: int) -> torch.Tensor:
    """What ``op`` leaves in rank ``rank``'s output when rank ``q`` sends :func:`_input`'s values."""
    part = numel // world
    if op == "all_reduce":
        return torch.full((numel,), world * (world + 1) / 2)
    if op == "reduce_scatter":
        return torch.full((part,), world * (world + 1) / 2)
    if op == "all_gather":  # rank q's part holds q
        return torch.arange(world, dtype=torch.float32).repeat_interleave(part)
    # all_to_all: block j of rank q's input holds q * world + j; rank r receives block r of each q.
    return (torch.arange(world, dtype=torch.float32) * world + rank).repeat_interleave(part)


def _input(op: str, rank: int, world: int, numel: int, device: torch.device) -> torch.Tensor:
    part = numel // world
    if op == "all_gather":
        return torch.full((part,), float(rank), device=device)
    if op == "all_to_all":
        return (
            torch.arange(world, dtype=torch.float32, device=device) + rank * world
        ).repeat_interleave(part)
    return torch.full((numel,), float(rank + 1), device=device)


def _call(op: str, out: torch.Tensor, inp: torch.Tensor) -> None:
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(out)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, inp)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, inp)
    else:
        dist.all_to_all_single(out, inp)


def _buffers(
    op: str, rank: int, world: int, numel: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, input) of ``op`` on a whole buffer of ``numel`` values (an all-reduce's are one)."""
    inp = _input(op, rank, world, numel, device)
    if op == "all_reduce":
        return inp, inp
    out_numel = numel // world if op == "reduce_scatter" else numel
    return torch.empty(out_numel, device=device), inp


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    rank, world = int(spec["rank"]), int(spec["world"])
    device = rank_device(spec["device_type"], rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # the ranks share this machine's cores (gloo: its own threads send)
    timeout = datetime.timedelta(seconds=float(spec["timeout_s"]))
    store = dist.TCPStore("127.0.0.1", int(spec["port"]), world, False, timeout=timeout)
    dist.init_process_group(
        spec["backend"], store=store, rank=rank, world_size=world, timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )  # fmt: skip
    results = []
    try:
        for op in spec["ops"]:
            for size in spec["sizes"]:
                results.append(_time_one(op, int(size), rank, world, device, spec).as_dict())
        # Where this process holds CUDA contexts, read while it holds them (its collectives ran).
        placed = _placement() if device.type == "cuda" else None
    finally:
        dist.destroy_process_group()
    return {"device": str(device), "results": results, "placement": placed}


def _time_one(
    op: str, size: int, rank: int, world: int, device: torch.device, spec: dict[str, Any]
) -> Result:
    import torch.distributed as dist

    numel = buffer_numel(size, world)
    out, inp = _buffers(op, rank, world, numel, device)
    _call(op, out, inp)
    _sync(device)
    mine = bool(torch.equal(out.cpu(), _expected(op, rank, world, numel)))
    ok = torch.tensor([0.0 if mine else 1.0], device=device)
    dist.all_reduce(ok)  # every rank's verdict: a wrong result anywhere is wrong
    correct = float(ok.item()) == 0.0
    if op == "all_reduce":
        out.zero_()  # sums of zeros stay zeros: no overflow over the timed calls
    _call(op, out, inp)  # warm-up at this size
    times = []
    for _ in range(int(spec["repeats"])):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(int(spec["iters"])):
            _call(op, out, inp)
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
        times.append(float(elapsed.item()) / int(spec["iters"]))
    seconds = statistics.median(times)
    nbytes = numel * 4
    algbw = nbytes / seconds / 1e9
    return Result(op, nbytes, seconds, algbw, algbw * bus_factor(op, world), correct)


def main() -> None:
    spec = json.loads(sys.argv[1])
    report = _run_rank(spec)
    print(RESULT_PREFIX + json.dumps(report), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
