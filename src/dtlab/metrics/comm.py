"""Counting the collectives a piece of code really issues, from the dispatcher (no analytic guess).

Each collective is also told apart by whether it crosses replicas: whether its process group holds
ranks of more than one replica (a data-parallel rank of plain DDP or FSDP, a DiLoCo replica), the
collectives a slow link between sites pays for, one round trip each. For the benchmarks, such a
collective can be delayed by a simulated round-trip time (:data:`RTT_ENV`, :func:`bench_rtt_s`).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from dtlab.errors import DtlabError

# A bench-only knob (dtlab.bench.lowcomm's links with a latency): milliseconds every rank sleeps before
# it issues each collective that crosses replicas, so that the collective completes one simulated round
# trip later on every rank. Read by the collective counter, so it acts only while one counts
# (run.comm_bytes; set it, and the run counts).
RTT_ENV = "DTLAB_BENCH_RTT_MS"


def bench_rtt_s(environ: dict[str, str] | None = None) -> float:
    """The simulated round-trip time :data:`RTT_ENV` asks for, in seconds (0: unset); a DtlabError
    naming the value when it is not a number of milliseconds from 0 to 10,000."""
    raw = (os.environ if environ is None else environ).get(RTT_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not 0 <= ms <= 10_000:
        raise DtlabError(f"{RTT_ENV}={raw!r}: allowed a number of milliseconds from 0 to 10000")
    return ms / 1000


# Dispatcher op names (c10d and functional collectives) -> the collective they are.
_NAMES = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather": "all_gather",
    "allgather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send": "send/recv",
    "isend": "send/recv",
}


# Dispatched but not collectives of their own: a functional collective's autograd wrapper, and a
# pipeline's receive (its send counts the bytes).
_NOT_COUNTED = (
    "barrier", "monitored_barrier", "wrap_tensor_autograd", "recv", "recv_any_source", "irecv",
)  # fmt: skip

# torch.distributed functions -> (collective, index of the argument whose bytes count).
_PY_API = {
    "all_reduce": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "all_gather": ("all_gather", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "broadcast": ("broadcast", 0),
}


class CommCounter(TorchDispatchMode):
    """Counts the collectives issued on this rank while active, with the bytes each one moves.

    Works for DDP's reducer, FSDP2's all-gathers and reduce-scatters, DTensor redistributions and
    plain ``torch.distributed`` calls, because all of them go through the dispatcher's ``c10d`` (or
    functional collective) operators. Bytes follow one convention: the size of the whole buffer the
    collective operates on (the all-reduced tensor, the all-gather's output, the reduce-scatter's input),
    which is what ``dtlab.analysis`` predicts. A collective on a group of one rank moves nothing
    and is not counted (DDP's all-reduce in a fault-tolerant replica group of one rank).

    ``crossing``: the names of process groups that span replicas whatever ``replica_of`` says
    (torchft's group across fault-tolerant replica groups, each its own world). ``ignored``: the
    names of process groups whose collectives are not counted (an async checkpoint's, whose
    background thread may issue them while a step is counted).
    """

    def __init__(
        self,
        labels: dict[str, str] | None = None,
        replica_of: Sequence[int] | None = None,
        rtt_s: float = 0.0,
        crossing: Collection[str] = (),
        ignored: Collection[str] = (),
    ) -> None:
        super().__init__()
        # Process group name -> the dimension its collectives are counted under ("tp all_reduce"),
        # so that a tensor-parallel all-reduce is told apart from a data-parallel one.
        self.labels = labels or {}
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        # The same bytes by (collective, name of the process group it ran on; None: not known, the
        # default group), for a replay on the groups the step used.
        self.by_group: Counter[tuple[str, str | None]] = Counter()
        # Global rank -> its replica (None: not told apart), and what crossed replicas: calls, bytes.
        self.replica_of = list(replica_of) if replica_of is not None else None
        self.rtt_s = rtt_s
        self.crossing = set(crossing)
        self.ignored = set(ignored)
        self.cross_calls = 0
        self.cross_bytes = 0
        self._crosses: dict[str | None, bool] = {}
        self._patched: dict[str, Any] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile compiles as usual while this mode is active (it is off while the compiler
        traces) and the compiled code's collectives, called through the dispatcher, are counted
        as they run: counting leaves ``train.compile`` on. What the compiler fuses away is
        never a collective."""
        return True

    def __enter__(self) -> CommCounter:
        # A dispatch mode sees only the threads whose dispatch mode stack holds it: the thread that
        # entered it, and threads that inherit its thread-local state, as the autograd engine's
        # device threads do (where a CUDA backward runs DDP's communication hooks). Collectives
        # issued elsewhere, from future callbacks on the backend's threads (PowerSGD's second
        # all-reduce, the low-precision hook's), are counted at the Python API instead; each
        # collective is counted in exactly one of the two places (:meth:`_seen_by_dispatch`).
        for fn, (name, arg) in _PY_API.items():
            original = getattr(dist, fn, None)
            if original is None:  # torch before 2.12 has no all_gather_single, ...
                continue
            self._patched[fn] = original
            setattr(dist, fn, self._wrap(original, name, arg))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for fn, original in self._patched.items():
            setattr(dist, fn, original)
        self._patched.clear()

    def _wrap(self, original: Any, name: str, arg: int) -> Any:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            name_of = str(group.group_name) if group is not None else None
            if (
                not self._seen_by_dispatch()
                and dist.get_world_size(group) > 1
                and name_of not in self.ignored
            ):
                nbytes = sum(t.numel() * t.element_size() for t in _tensors(args[arg]))
                self.counts[name] += 1
                self.bytes[name] += nbytes
                self.by_group[(name, None)] += nbytes
                self._cross(name_of, nbytes)
            return original(*args, **kwargs)

        return counted

    def _seen_by_dispatch(self) -> bool:
        """Whether a collective issued on this thread now reaches :meth:`__torch_dispatch__`: this
        mode is on the thread's dispatch mode stack (its own, or one the thread inherited)."""
        return any(mode is self for mode in _get_current_dispatch_mode_stack())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace not in ("c10d", "_c10d_functional"):
            if any(issubclass(t, _dtensor_type()) for t in types):
                # DTensor's own dispatch may issue collectives inside an operator (the
                # vocabulary-parallel loss's all-reduces, a partial value's reduction an operator
                # needs). Run here, with this mode off, they would go uncounted: deferred to
                # DTensor instead, with this mode still on, they reach it as they run.
                return NotImplemented
            return func(*args, **(kwargs or {}))
        op = func.overloadpacket.__name__.strip("_")
        if op in _NOT_COUNTED or op.startswith("wait"):
            return func(*args, **(kwargs or {}))
        group, size = _group_of(func.namespace, args)
        if size == 1 or group in self.ignored:  # nothing leaves the rank; not counted here
            return func(*args, **(kwargs or {}))
        crosses = self._crosses_replicas(group)
        if crosses and self.rtt_s > 0:
            time.sleep(self.rtt_s)  # the simulated round trip, before the collective starts
        out = func(*args, **(kwargs or {}))
        name = _NAMES.get(op, op)
        label = self.labels.get(group or "")
        if label:
            name = f"{label} {name}"
        nbytes = _payload(name.split(" ")[-1], func.namespace, args, out)
        self.counts[name] += 1
        self.bytes[name] += nbytes
        self.by_group[(name, group)] += nbytes
        if crosses:
            self.cross_calls += 1
            self.cross_bytes += nbytes
        return out

    def _cross(self, group: str | None, nbytes: int) -> None:
        """Count (and delay, with a simulated round trip) a collective counted at the Python API.
        The delay comes after the call was decided on, before it is issued, like the dispatcher's."""
        if self._crosses_replicas(group):
            if self.rtt_s > 0:
                time.sleep(self.rtt_s)
            self.cross_calls += 1
            self.cross_bytes += nbytes

    def _crosses_replicas(self, group: str | None) -> bool:
        """Whether a collective on process group ``group`` (None: the default group, every rank)
        spans ranks of more than one replica; False when replicas are not told apart."""
        if group in self.crossing:
            return True
        if self.replica_of is None:
            return False
        if group not in self._crosses:
            ranks = range(len(self.replica_of)) if group is None else _group_ranks(group)
            if ranks is None:  # a group not registered by name: counted as the world's
                ranks = range(len(self.replica_of))
            self._crosses[group] = len({self.replica_of[r] for r in ranks}) > 1
        return self._crosses[group]

    def reset(self) -> None:
        self.counts.clear()
        self.bytes.clear()
        self.by_group.clear()
        self.cross_calls = self.cross_bytes = 0


@functools.cache
def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _group_ranks(name: str) -> list[int] | None:
    """The global ranks of the process group named ``name``; None if no group has that name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(name)  # type: ignore[arg-type]
    except (KeyError, RuntimeError, ValueError):
        return None
    return list(dist.get_process_group_ranks(group))


def _group_of(namespace: str, args: Any) -> tuple[str | None, int | None]:
    """The name and size of the process group a dispatched collective runs on: a functional
    collective's last argument, or the c10d operator's ProcessGroup (None where not known)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if namespace == "_c10d_functional":
        name = args[-1] if args and isinstance(args[-1], str) else None
        try:
            size = _resolve_process_group(name).size() if name is not None else None  # type: ignore[arg-type]
        except (KeyError, RuntimeError, ValueError):
            size = None
        return name, size
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                group = dist.ProcessGroup.unbox(a)
            except (RuntimeError, AttributeError):
                return None, None
            try:
                return str(group.group_name), group.size()
            except (RuntimeError, ValueError):
                return None, group.size()
    return None, None


def _payload(name: str, namespace: str, args: Any, out: Any) -> int:
    if namespace == "_c10d_functional":
        # Functional ops return their output: the gathered buffer, or the reduced shard.
        src = out if name == "all_gather" else args[0]
    elif name == "reduce_scatter":
        src = args[1]  # (output, input, ...): the full input buffer
    else:
        src = args[0]  # all_reduce / broadcast: the tensors; all_gather: the full outputs
    return sum(t.numel() * t.element_size() for t in _tensors(src))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []
