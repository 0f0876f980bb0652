"""Counting the host synchronisations a piece of code would cost on a GPU, from the dispatcher.

A GPU runs ahead of the Python that queues its work until the host needs something from it: a value
read back (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``), or a blocking copy between host
and device memory, which waits for everything queued before it (a small ``torch.tensor(values)``
moved to the GPU is one). Each stalls the host until the GPU has caught up.

:class:`HostSyncCounter` counts them by kind while active, for tensors on the training ``device``:

- ``read``: a value of a device tensor read on the host (``aten._local_scalar_dense``, ``tolist``,
  and ``nonzero``, whose output's size is);
- ``copy``: a blocking copy between the host and the device (``non_blocking=True`` ones, which need
  no sync from pinned memory, are not counted);
- ``host data``: a tensor built from Python values (``torch.tensor(...)``, ``aten.lift_fresh``) on
  the device (on a GPU: a blocking copy), or on the CPU when the device is the CPU, where the same
  line on a GPU run would build it on the host for a copy to follow;
- ``host tensor``: a tensor made by a factory (``torch.zeros``, ``torch.full``, ...) called from
  Python without a device: on a GPU run it is made on the host, to be copied to the device or read.

On a CPU run every tensor is on the device, so the counts are what the same code would cost on a GPU
(a read of a tensor that a GPU run keeps on the host counts too: the CPU count is an upper bound);
on a GPU run they are the syncs themselves. Each event keeps the line of code (dtlab's, or its caller's) that caused it.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from dtlab.metrics.modes import EagerDispatchMode

__all__ = ["HostSyncCounter"]

_COPIES = ("_to_copy", "copy_")
_LIBRARIES = (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"])
# Factories that build from Python values: counted as ``host data`` at the dispatcher instead.
_FROM_VALUES = {torch.tensor, torch.as_tensor, torch.asarray}


class _DefaultDevice(TorchFunctionMode):
    """Counts factory calls without a device into its counter (``host tensor``)."""

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            func in _device_constructors()
            and func not in _FROM_VALUES
            and kwargs.get("device") is None
        ):
            self.counter._count("host tensor")
        if func is torch.Tensor.__setitem__ and isinstance(args[2], (int, float, bool)):
            # ``t[i] = 0.0`` makes the value on ``t``'s device (a scalar kernel argument), though on
            # the CPU it is lifted from a Python value like ``torch.tensor``: no host data.
            self.counter._scalar_setitem += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.counter._scalar_setitem -= 1
        return func(*args, **kwargs)


class HostSyncCounter(EagerDispatchMode):
    """Counts the host syncs (by kind: ``read``, ``copy``, ``host data``) on ``device`` while active;
    ``where`` keeps (kind, the line of dtlab's code that caused it) for each."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.counts: Counter[str] = Counter()
        self.where: list[tuple[str, str]] = []
        self._tolist: Any = None
        self._in_tolist = False
        self._scalar_setitem = 0
        # A scalar lifted (and where), counted unless the next op fills a mask with it.
        self._lifted: tuple[torch.Tensor, str] | None = None
        self._factories = _DefaultDevice(self)

    @property
    def total(self) -> int:
        """Every host sync counted."""
        return sum(self.counts.values())

    def __enter__(self) -> HostSyncCounter:
        # ``tolist`` reads a CPU tensor without the dispatcher (a device one's copy to the host is
        # dispatched): counted here, once, on every device.
        original = torch.Tensor.tolist
        counter = self

        def tolist(t: torch.Tensor) -> Any:
            # The same call back through the factories' function mode, or another thread's (the
            # patch is global; the modes see only the threads that hold them): not counted here.
            if counter._in_tolist or not any(
                m is counter for m in _get_current_dispatch_mode_stack()
            ):
                return original(t)
            if counter._on_device(t):
                counter._count("read")
            counter._in_tolist = True
            try:
                return original(t)
            finally:
                counter._in_tolist = False

        self._tolist = original
        torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
        self._factories.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._settle_lifted(None, ())
        super().__exit__(*exc)
        self._factories.__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]

    def _settle_lifted(self, name: str | None, args: Any) -> None:
        """Count the scalar lifted by the op before this one (``name``, on ``args``; None: the
        counter's end) as host data, unless this op fills a tensor with it: ``t[mask] = 0``
        issued where the factories' function mode does not see the ``__setitem__`` (inside
        DTensor's dispatch: torch's loss-parallel cross-entropy masks its targets so), the same
        scalar argument the mode's exemption lets pass."""
        pending, self._lifted = self._lifted, None
        if pending is None:
            return
        lifted, where = pending
        fills = name in ("masked_fill_", "masked_fill", "index_put_", "index_put")
        if not (fills and any(a is lifted for a in args)):
            self._count("host data", where)

    def _on_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == self.device.type

    def _count(self, kind: str, where: str | None = None) -> None:
        self.counts[kind] += 1
        self.where.append((kind, where or self._where()))

    @staticmethod
    def _where() -> str:
        """The innermost line outside torch and the standard library (dtlab's, a test's), other
        modes' handlers (CommCounter's) left out."""
        mine = [
            f
            for f in traceback.extract_stack()
            if not f.filename.startswith(_LIBRARIES)
            and not f.filename.endswith("metrics/syncs.py")
            and f.name not in ("__torch_dispatch__", "__torch_function__")
        ]
        return f"{mine[-1].filename}:{mine[-1].lineno}" if mine else "?"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._in_tolist:
            return out
        name = func.overloadpacket.__name__
        self._settle_lifted(name, args)
        if name == "_local_scalar_dense" and self._on_device(args[0]):
            self._count("read")
        elif name == "nonzero" and self._on_device(args[0]):
            self._count("read")  # its output's size is read back from the device
        elif (
            name in ("lift_fresh", "lift_fresh_copy")
            and self._on_device(out)
            and not self._scalar_setitem
        ):
            if out.dim() == 0:
                self._lifted = out, self._where()
            else:
                self._count("host data")
        elif name in _COPIES and not kwargs.get("non_blocking", len(args) > 2 and args[2]):
            src, dst = (args[0], out) if name == "_to_copy" else (args[1], args[0])
            if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor):
                kinds = {src.device.type, dst.device.type}
                if len(kinds) == 2 and "cpu" in kinds and self.device.type in kinds:
                    self._count("copy")
        return out
