"""What ``dtlab plan --check`` measures of a step's memory: torch's ``MemTracker``, which files every
tensor the step makes or holds under a kind, extended to keep the step's timeline (each moment's most
alive at once, by kind) and each kind's own peak; and the components read from its kinds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _RefType, _State


class _Peaks(MemTracker):
    """MemTracker that also keeps each kind's own peak, takes a snapshot when the optimizer steps,
    measures step after step (MemTracker refuses a root module's second forward otherwise), and
    keeps the step's timeline: for each moment of the step (each micro-batch's forward, backward and
    what follows it, the optimizer step), the most alive at once and what it was, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.kind_peak: dict[str, int] = {}
        self.at_step: dict[str, int] = {}
        self.kept = 0  # activations alive in backward: what forward kept, and recomputed blocks
        self.peak_total = 0
        # moment -> (total, by kind, the innermost module running then)
        self.timeline: dict[str, tuple[int, dict[str, int], str]] = {}
        self.micro = 0  # the micro-batch whose forward ran last
        self.backward_seen = False  # its backward has run
        self.reducing = False  # a pipeline stage's gradient reduction is running
        self.outer = False  # DiLoCo's outer sync is running (after the optimizer step)
        self.apart = False  # what is made now is not the device's memory (DiLoCo's host state)
        # FSDP gathering a unit: what it makes is filed as this kind, not as forward's activations.
        self.gathering: _RefType | None = None
        self.watched: set[int] = set()  # FSDP's parameter groups whose gathers are filed so

    def _track(self, reftype: _RefType, t: torch.Tensor) -> None:
        if self.apart:
            return
        # MemTracker files what is made outside forward and backward as activations; a pipeline
        # stage's gradient reduction runs there, and DiLoCo's outer sync, and both make
        # temporaries (copies to reduce, pseudo-gradients and the buffers of syncs in flight).
        # So is what the step makes between a micro-batch's backward and the next forward (the
        # expert shards' flat average, the clipping's norms).
        after = self.backward_seen and not self._mod_tracker.is_bw
        if (self.reducing or self.outer or after) and reftype is _MemRefType.ACT:
            reftype = _MemRefType.TEMP
        if self.gathering is not None and reftype is _MemRefType.ACT:
            reftype = self.gathering
        super()._track(reftype, t)

    @contextlib.contextmanager
    def outer_sync(self) -> Iterator[None]:
        """DiLoCo's outer sync runs inside: its moment, what it makes filed as temporaries."""
        self.outer = True
        try:
            yield
        finally:
            self.outer = False

    @contextlib.contextmanager
    def held_apart(self) -> Iterator[None]:
        """What is made inside is not filed (another memory's: DiLoCo's outer state, in host memory
        on a GPU)."""
        self.apart = True
        try:
            yield
        finally:
            self.apart = False

    def watch_reductions(self, stages: list[Any]) -> None:
        """File what pipeline ``stages``' gradient reductions (torch's ``REDUCE_GRAD``, FSDP's
        reduce-scatter after a stage's last backward) make as temporaries, and the gradient shards
        they leave as gradients."""
        for stage in stages:
            reduce = stage.perform_reduce_grad

            def watched(*args: Any, _reduce: Any = reduce, _stage: Any = stage) -> Any:
                self.reducing = True
                try:
                    return _reduce(*args)
                finally:
                    self.reducing = False
                    grads = [p.grad for p in _stage.submod.parameters() if p.grad is not None]
                    self.file_as_gradients(grads)

            stage.perform_reduce_grad = watched

    def watch_gathers(self, model: torch.nn.Module) -> None:
        """File what FSDP's all-gathers make in forward as backward's are filed: the flat buffer
        each gathers into (and copies out of) as a temporary, the unit's unsharded parameters as
        gathered parameters (buffers). MemTracker files both as activations, being made inside a
        module's forward; on the plan's side they are FSDP's buffers, not what forward keeps.
        After each gather the unit's parameters are filed as parameters, as a step after the first
        finds them (in a first step the root's output and norm, gathered at the root's forward,
        would count as activations until the output's forward)."""
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if not isinstance(m, FSDPModule):
                continue
            group = m._get_fsdp_state()._fsdp_param_group
            if group is None or id(group) in self.watched:
                continue
            self.watched.add(id(group))
            group.unshard = self._filed_as(group.unshard, _MemRefType.TEMP)  # type: ignore[method-assign]
            group.wait_for_unshard = self._filed_as(  # type: ignore[method-assign]
                group.wait_for_unshard, _MemRefType.PARAM, group
            )

    def _filed_as(self, fn: Any, kind: _RefType, group: Any = None) -> Any:
        """``fn`` with what it makes filed as ``kind``; with ``group`` (FSDP's parameter group
        gathered by ``fn``) its unsharded parameters filed as parameters after it, whatever they
        were filed as when first made (a unit used without a module call of its own, a tied
        embedding's copy read by the output projection, is refiled by nothing else)."""

        def filed(*args: Any, **kwargs: Any) -> Any:
            before, self.gathering = self.gathering, kind
            try:
                return fn(*args, **kwargs)
            finally:
                self.gathering = before
                for p in getattr(group, "fsdp_params", ()):
                    unsharded = getattr(p, "_unsharded_param", None)
                    if unsharded is not None and unsharded.untyped_storage().size():
                        self._update_and_maybe_create_winfos(unsharded, _MemRefType.PARAM)

        return filed

    def reset_peaks(self) -> None:
        self.kind_peak = self.current()
        self.at_step = {}
        self.kept = 0
        self.peak_total = self.kind_peak.get("Total", 0)
        self.timeline = {}
        self.micro = 0
        self.backward_seen = False

    def file_as_gradients(self, tensors: list[torch.Tensor]) -> None:
        """File the storages of ``tensors`` as gradients, whatever they were filed as before."""
        for t in tensors:
            self._update_and_maybe_create_winfos(t, _MemRefType.GRAD)

    def file_as_state(self, tensors: Any) -> None:
        """File the storages of ``tensors`` as optimizer state, whatever they were filed as."""
        for t in tensors:
            self._update_and_maybe_create_winfos(t, _MemRefType.OPT)

    def current(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for device, snap in self._curr_mem_snap.items():
            if device.type == "meta":  # no memory: a pipeline rank's frame over its stages
                continue
            for kind, n in snap.items():
                out[_kind(kind)] = out.get(_kind(kind), 0) + n
        return out

    def moment(self) -> str:
        """Where in the step this is: ``forward k``, ``backward k`` and ``after backward k`` (the
        clipping, the step's reduction) of micro-batch k, or ``optimizer``."""
        if self.outer:
            return "outer sync"
        if self._in_opt:
            return "optimizer"
        if self._mod_tracker.is_bw:
            self.backward_seen = True
            return f"backward {self.micro}"
        return f"{'after backward' if self.backward_seen else 'forward'} {self.micro}"

    def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        root = set(self._mod_tracker.parents) - {name} == {"Global"}
        if root and not self._mod_tracker.is_bw:  # a micro-batch's forward (a pipeline stage's)
            if module in self.memory_tracking:
                self.reset_mod_stats()
            self.micro += 1
            self.backward_seen = False
        super()._pre_fw_hook(module, inputs)

    # A module's statistics are reset at the next micro-batch's forward; under a pipeline schedule
    # an earlier micro-batch's (or another stage's) backward can come after it. Only the step's
    # peaks are read here, so a module without statistics is passed over.
    def _pre_bw_hook(self, module: Any, args: Any) -> None:
        if module in self.memory_tracking:
            super()._pre_bw_hook(module, args)

    def _post_bw_hook(self, module: Any, args: Any) -> None:
        if module in self.memory_tracking:
            super()._post_bw_hook(module, args)

    def _update_peak_stats(self, peak_state: _State) -> None:
        # Not MemTracker's own: it walks every module's statistics at every op (minutes for an
        # 80-block model); only the whole step's peaks are read here.
        now = self.current()
        total = now.get("Total", 0)
        self.peak_total = max(self.peak_total, total)
        for kind, n in now.items():
            if n > self.kind_peak.get(kind, 0):
                self.kind_peak[kind] = n
        if self._mod_tracker.is_bw:
            self.kept = max(self.kept, now.get("Activation", 0))
        moment = self.moment()
        if total > self.timeline.get(moment, (-1,))[0]:
            inner = max(self._mod_tracker.parents, key=len)
            self.timeline[moment] = (total, now, inner)


@contextlib.contextmanager
def split_backward(active: bool) -> Iterator[None]:
    """While ``active`` (a zero-bubble pipeline schedule: each backward split into an input half and
    a weight half), torch's module tracker marks a module's backward done at the first of its
    inputs' gradients instead of at the last. Its own rule counts the gradients to come with
    ``torch._C._will_engine_execute_node``, which refuses a stage's leaf input under
    ``torch.autograd.grad`` (the input half), and keeps each input's autograd node in the hook
    that waits for it: a cycle through the graph, which keeps every activation the weight half
    does not free alive after the step (measured: a real run grew by the step's activations at
    each step). The marks only name where in backward a moment is."""
    if not active:
        yield
        return
    from torch.distributed._tools import mod_tracker

    original = mod_tracker.register_multi_grad_hook

    def at_first(tensors: Any, fn: Any, *, mode: str = "all") -> Any:
        return original(tensors, fn, mode="any")

    mod_tracker.register_multi_grad_hook = at_first  # type: ignore[assignment]
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original


def _kind(kind: _RefType | str) -> str:
    return str(kind.value) if isinstance(kind, _RefType) else str(kind)


def _at_moment(kinds: dict[str, int], rest: dict[str, int]) -> dict[str, int]:
    """What was alive at one moment of the step (MemTracker's ``kinds`` then), as the components:
    the rank's own parameters and optimizer state (as held between steps, ``rest``), the
    gradients, the activations (everything forward made that is still alive, and a block
    recomputed), the temporaries (what backward and the optimizer made that is still alive), and
    the buffers (module buffers, and parameters gathered beyond the rank's own shards)."""
    params, optimizer = rest.get("Parameter", 0), rest.get("Optstate", 0)
    return {
        "params": min(params, kinds.get("Parameter", 0)),
        "grads": kinds.get("Gradient", 0),
        "optimizer": min(optimizer, kinds.get("Optstate", 0)),
        "activations": kinds.get("Activation", 0),
        "temporaries": kinds.get("Temp", 0) + max(0, kinds.get("Optstate", 0) - optimizer),
        "buffers": kinds.get("Buffer", 0) + max(0, kinds.get("Parameter", 0) - params),
    }


def _grad_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the gradients ``optimizer`` steps with (each storage once; a DTensor's local part)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            g = g.to_local() if isinstance(g, DTensor) else g
            st = g.untyped_storage()
            seen[st._cdata] = st.nbytes()  # the storage itself (a new Python object each call)
    return sum(seen.values())


def _whole_grads(dims: Any) -> bool:
    """Whether the rank holds its parameters' whole gradients through backward and only the
    optimizer steps with a share of them: ZeRO-1 (FSDP's whole gradients exist a unit at a time)."""
    return bool(dims.shard_optimizer and not dims.fsdp_enabled)


def _components(
    peak: dict[str, int],
    at_step: dict[str, int],
    rest: dict[str, int],
    kept: int,
    whole_grads: bool = False,
) -> dict[str, int]:
    """The components from MemTracker's kinds: each kind's peak in the step, what was held when the
    optimizer stepped (``at_step``), after the step (``rest``), and the activations alive in
    backward (``kept``: what forward kept for it, and blocks recomputed under checkpointing).
    ``whole_grads`` (ZeRO-1): the gradients are the whole ones backward held, as the plan counts
    them, not the share the optimizer steps with."""
    params, grads = rest.get("Parameter", 0), at_step.get("Gradient", 0)
    if whole_grads:
        grads = max(grads, peak.get("Gradient", 0))
    optimizer = rest.get("Optstate", 0)
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "activations": kept,
        # What backward and the optimizer make and free, and forward's own transients (the logits
        # beside their log-softmax at the loss) beyond what it keeps.
        "temporaries": peak.get("Temp", 0)
        + max(0, peak.get("Optstate", 0) - optimizer)
        + max(0, peak.get("Activation", 0) - kept)
        + max(0, peak.get("Gradient", 0) - grads),
        "buffers": peak.get("Buffer", 0) + max(0, peak.get("Parameter", 0) - params),
    }
