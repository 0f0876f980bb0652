"""Hang forensics, as the torch engine uses them: one ledger of collectives per process.

Every rank records the collectives dtlab issues in a ledger (:mod:`dtlab.parallel.forensics.record`)
that a background thread publishes to the process group's store. When a collective fails or times out,
the rank that sees it reads what the others published and says who is behind, or where the ranks'
collectives differ (:mod:`dtlab.parallel.forensics.diagnosis`), and every rank that is still alive dumps
its whole ledger, with torch's flight recorder (:mod:`dtlab.parallel.forensics.flight`), to
``<run dir>/ledger/rank<R>.json``.

On gloo a collective fails in the call that issued it. On NCCL the call returns once the collective is
queued, and a dead or hung peer makes it wait on the GPU with no error: the ledger marks completion with
CUDA events and times out what never completes, the process groups are aborted rather than destroyed (a
destroy waits on kernels that will never finish), and the step's reduction carries its element count,
which NCCL does not compare across ranks.

Call sites record into the ledger without it being passed around, like a logger. Nothing here makes a
store round trip or a host sync in the training thread (only the ``skipcoll`` and ``badshape`` faults
publish before the step's reduction, so that a rank gloo aborts has said what it issued).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist

from dtlab.errors import CollectiveError
from dtlab.parallel.forensics.channels import Channel, FileChannel, StoreChannel
from dtlab.parallel.forensics.diagnosis import diagnose
from dtlab.parallel.forensics.flight import flight_recorder
from dtlab.parallel.forensics.record import (
    ACK_S,
    LEDGER_ENV,
    LEDGER_SIZE,
    POLL_S,
    PUBLISH_S,
    PUBLISHED,
    SETTLE_S,
    Completion,
    Entry,
    Ledger,
    cuda_completion,
    shapes_text,
)

if TYPE_CHECKING:
    from dtlab.runtime.faults import Faults


class RankPlace(Protocol):
    """Where a rank sits, as the ledger needs it (:class:`dtlab.parallel.dist.DistInfo` is one)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def backend(self) -> str | None: ...


__all__ = [
    "ACK_S", "LEDGER_ENV", "LEDGER_SIZE", "POLL_S", "PUBLISHED", "PUBLISH_S", "SETTLE_S", "Channel",
    "Completion", "Entry", "FileChannel", "Ledger", "StoreChannel", "all_reduce",
    "collective_failure", "collectives_failed", "completion_for", "counts_unchecked", "diagnose",
    "is_collective_failure", "ledger_enabled", "note_failure", "note_step", "publish_ledger",
    "raise_if_failed", "recorded", "shapes_text", "start_ledger", "stop_ledger",
    "watcher_device_for",
]  # fmt: skip

# How long a rank whose collective timed out gives its training thread to end once the process groups
# are aborted, before it says the error itself and exits.
ABORT_GRACE_S = 10.0

# Like a logger, the ledger is per process; call sites record into it without it being passed around.
_active: Ledger | None = None
_failed: CollectiveError | None = None  # this process's collectives failed (note_failure)
_count_check = (
    False  # whether the step's reduction carries its element count (see counts_unchecked)
)

# What gloo and NCCL say when a collective fails or times out (NCCL's errors are also DistErrors).
_FAILURE = re.compile(
    r"gloo|nccl|Timed out waiting|Connection (reset|closed) by peer", re.IGNORECASE
)


def completion_for(device: torch.device) -> Callable[[], Completion] | None:
    """How the ledger learns that a collective on ``device`` completed: a CUDA event recorded after it
    (NCCL's calls return once the collective is queued); None for the CPU, where gloo's calls return
    when it has completed."""
    return cuda_completion if device.type == "cuda" else None


def watcher_device_for(device: torch.device) -> Callable[[], None] | None:
    """What the ledger's watcher thread runs first: on CUDA, make ``device`` its current device (a new
    thread's is device 0, where its event queries would open a context of their own); None on the CPU.
    Called in the training thread, whose current device is this rank's, so that ``cuda`` without an
    index means that one."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return functools.partial(torch.cuda.set_device, torch.device("cuda", index))


def counts_unchecked(backend: str | None) -> bool:
    """Whether ``backend`` reduces tensors of different element counts without an error. NCCL does (it
    reads past the shorter one, or waits for elements never sent); gloo refuses them."""
    return backend == "nccl"


def ledger_enabled(env: Mapping[str, str]) -> bool:
    """Whether the ledger runs (``DTLAB_LEDGER`` is not ``0``/``off``/``false``/``no``)."""
    return env.get(LEDGER_ENV, "1").lower() not in ("0", "off", "false", "no")


def start_ledger(
    d: RankPlace, run_dir: Path, faults: Faults | None = None, timeout_s: float | None = None
) -> Ledger | None:
    """Start this rank's ledger (distributed torch runs; ``DTLAB_LEDGER=0`` turns it off)."""
    global _active, _count_check
    stop_ledger()
    if d.backend is None or not dist.is_initialized():
        return None
    if not ledger_enabled(os.environ):
        return None
    from torch.distributed.distributed_c10d import _get_default_group, _get_default_store

    # A connection of its own: the publisher never waits behind the process group's store traffic.
    channel = StoreChannel(cast(Any, _get_default_store()).clone())
    if faults is not None and publish_ledger not in faults.before_kill:
        faults.before_kill.append(publish_ledger)  # what it did last is known to the others
    _active = Ledger(
        d.rank, d.world_size, channel, run_dir / "ledger",
        torch_seq=cast(Any, _get_default_group())._get_sequence_number_for_group,
        flight_recorder=functools.partial(flight_recorder, backend=d.backend),
        faults=faults, timeout_s=timeout_s, completion=completion_for(d.device),
        on_failure=_abandon, on_watch=watcher_device_for(d.device),
    )  # fmt: skip
    _count_check = counts_unchecked(d.backend)
    return _active


def stop_ledger() -> None:
    """Stop recording (the process group is going away)."""
    global _active
    if _active is not None:
        _active.close()
        _active = None


def publish_ledger() -> None:
    """Publish this rank's newest ledger entries now (the ``kill`` fault does, before it strikes)."""
    if _active is not None:
        _active.publish_now()


def note_step(step: int) -> None:
    """The optimizer step under way, for the entries that follow."""
    if _active is not None:
        _active.step = step


@contextlib.contextmanager
def recorded(name: str, op: str = "", *tensors: torch.Tensor) -> Iterator[Entry | None]:
    """Record the collectives of the block as one entry named ``name`` (nothing without a ledger or
    name); yields the entry (or None)."""
    led = _active
    if led is None or not name:
        yield None
        return
    entry = led.begin(name, op, tensors)
    try:
        yield entry
    except BaseException as e:
        if is_collective_failure(e):  # the entry stays open: it names the collective that failed
            _keep_reporting()
        elif led.failure is None:  # (after a reported failure, torch's groups may be aborted)
            # Not a collective's failure (an out-of-memory error that is retried, a bad input): closed,
            # so that it is never taken for a collective this rank waits in.
            led.end(entry, queued=False)
        raise
    led.end(entry)


def _expected_count(
    op: dist.ReduceOp.RedOpType, n: int, dtype: torch.dtype, group: Any
) -> float | None:
    """What the element counts the ranks append to a reduction combine to when every rank sent ``n``;
    None where the check does not apply (an op that does not preserve it, a dtype that cannot hold the
    count exactly)."""
    if dtype.is_floating_point and dtype not in (torch.float32, torch.float64):
        return None
    if op == dist.ReduceOp.SUM:
        return float(n * dist.get_world_size(group))
    if op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.AVG):
        return float(n)
    return None


def all_reduce(
    name: str,
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    *,
    faultable: bool = False,
    group: Any = None,
) -> torch.Tensor:
    """``dist.all_reduce(tensor, op, group)`` in place, recorded as ``name``; returns ``tensor``.

    ``faultable``: the step's one reduction, which the ``skipcoll`` and ``badshape`` faults act on
    (``DTLAB_FAULTS``). On a backend that does not compare the ranks' element counts (NCCL), it carries
    its own count in one more element, checked once it has run, before this rank's next collective.
    ``group``: the process group (None: every rank).
    """
    led = _active
    fault = led.faults.collective_fault(led.step) if faultable and led and led.faults else None
    if fault == "skip":
        return tensor  # this rank never issues it
    payload = tensor.reshape(-1)
    if fault == "badshape":
        payload = torch.cat([payload, payload.new_zeros(1)])
    expected = None
    if faultable and led is not None and _count_check:
        expected = _expected_count(op, payload.numel(), payload.dtype, group)
    sent = payload if fault == "badshape" else tensor
    if expected is not None:
        sent = torch.cat([payload, payload.new_full((1,), payload.numel())])
    with recorded(name, "all_reduce", payload if fault == "badshape" else tensor) as entry:
        faults = led.faults if led is not None and faultable else None
        if led is not None and faults is not None and faults.collective_fault_anywhere(led.step):
            # Gloo aborts a rank that receives more than it posted before any thread can publish: at a
            # step where a rank's reduction is faulted, publish up to this entry first, so that the
            # others can say what this rank waited in.
            led.publish_now()
        dist.all_reduce(sent, op=op, group=group)
        if expected is not None and entry is not None and led is not None:
            # Copied in stream order, before the entry's completion event: read once that has passed.
            led.expect_count(entry, sent[-1:].to("cpu", non_blocking=True), expected)
    if sent is not tensor:
        tensor.copy_(sent[: tensor.numel()].view_as(tensor))
    return tensor


def abort_distributed() -> None:
    """Abort every process group of this process (NCCL: its kernels end at once, without the peers)."""
    if dist.is_available() and dist.is_initialized():
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()


def note_failure(error: CollectiveError) -> None:
    """Say, process-wide, that this process's collectives failed: from now on no value a collective
    returned may change the training's state (see :func:`raise_if_failed`)."""
    global _failed
    if _failed is None:
        _failed = error


def collectives_failed() -> CollectiveError | None:
    """The failure :func:`note_failure` recorded, or None. Not ``dist.is_initialized()``: after an
    abort torch reports no process group, which would make a rank act as a single process."""
    return _failed


def raise_if_failed() -> None:
    """Raise the recorded failure, if any: called after a host sync and before the state changes,
    since an aborted NCCL collective returns (partial sums) without raising."""
    if _failed is not None:
        raise _failed


def _abandon(error: CollectiveError) -> None:
    """The watcher's end of a collective that timed out (``error`` is reported and dumped): note the
    failure, then abort the process groups, which ends NCCL's waiting kernels and so the training
    thread's wait (its next check raises ``error``: the values it read are partial); if that thread
    has not ended ABORT_GRACE_S later, say ``error`` here and exit."""
    note_failure(error)  # before the abort: the training thread's wait may end with it
    with contextlib.suppress(Exception):
        abort_distributed()
    time.sleep(ABORT_GRACE_S)
    several = os.environ.get("WORLD_SIZE", "1") != "1"
    rank = f"[rank{os.environ.get('RANK', '0')}] " if several else ""
    print(f"{rank}error: {error}", file=sys.stderr, flush=True)
    os._exit(error.exit_code)


def _cause(exc: BaseException) -> str:
    """The failure in one line, without gloo's source paths and advice."""
    if isinstance(exc, CollectiveError):
        return str(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].rstrip(". ")


def _says_collective_failed(exc: BaseException) -> bool:
    if isinstance(exc, (CollectiveError, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and bool(_FAILURE.search(str(exc)))


def _failed_collective(exc: BaseException) -> BaseException | None:
    """``exc``, or the exception it was raised from, that says a collective failed; None if none does.
    (The pipeline schedules re-raise a failed send or receive as a RuntimeError of their own.)"""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if _says_collective_failed(link):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says a collective failed or timed out (rather than a bug or a bad input)."""
    return _failed_collective(exc) is not None


def _keep_reporting() -> None:
    """Ignore stop signals from now on: this process reports a failed collective, then exits.

    A launcher sends SIGTERM to every rank once one has exited; it must not cut the report short.
    """
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(s, signal.SIG_IGN)


def collective_failure(exc: BaseException) -> CollectiveError | None:
    """For a collective failure while the ledger runs: the error to show (who is behind); else None.

    Once this rank has reported a failure (a timeout its watcher saw, a count check), whatever then
    ended the training thread shows that report.
    """
    led = _active
    if led is None:
        return None
    if led.failure is not None:
        _keep_reporting()
        return led.failure
    failed = _failed_collective(exc)
    if failed is None:
        return None
    _keep_reporting()
    cause = f"a collective failed on rank {led.rank}: {_cause(failed)}"
    if led.timeout_s is not None and "timed out" in cause.lower():
        cause += f" (parallel.collective_timeout_s = {led.timeout_s:g})"
    return led.fail(cause)
