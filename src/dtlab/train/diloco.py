"""DiLoCo and Streaming DiLoCo: data-parallel replicas that talk every H steps instead of every step.

DiLoCo (Douillard et al., arXiv 2311.08105): each replica trains alone with the inner optimizer; every
``inner_steps`` (H) steps the replicas average their *pseudo-gradients*, the change of their weights since
the last sync (Δ = θ_global - θ_replica), and an outer optimizer (SGD with Nesterov momentum) steps the
shared weights θ_global by that average; every replica then continues from θ_global.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512): the blocks are cut into ``fragments`` contiguous
groups, each synced at its own step of the H-step cycle (fragment f at steps ≡ ⌊(f+1)H/F⌋ mod H), so that
the traffic of a cycle is spread over it; with ``delay`` τ the all-reduce of a fragment runs in the
background while the replica takes τ more inner steps, and its result lands then, on top of the progress
those steps made (θ ← θ_global + (θ_now - θ_at_send)). Outer gradients may travel in 8 or 4 bits per value
(one float32 scale per 64 values) with error feedback: what rounding lost is added to the next sync.

Eager updates (Kale, Douillard and Donchev, arXiv 2502.12996; ``eager``): while a fragment's sync is in
flight the replica does not go on from its own weights alone but from an estimate of the outer step,
taken at once: the mean outer gradient estimated as this replica's own share of it (Δ_r / n, as sent)
plus the other replicas' share of the fragment's last sync (their part of that mean, one sync late).
When the sync lands the estimate is replaced by the true step, keeping what the steps since learnt
(θ ← θ_global + (θ_now - θ_at_estimate)); with delay 0 the estimate is replaced before any step sees
it, which is the plain outer step (tested).

Degenerate cases (tested): H = 1, an inner plain-SGD step, outer SGD with lr 1 and no momentum is DDP with
that SGD; one fragment without delay is DiLoCo; eager without delay is DiLoCo; ``quantize: none`` sends
the exact float32 values.

Every replica's weights, inner optimizer state, the outer state and syncs in flight are each rank's own:
:meth:`DiLoCo.state_dict` carries them into every checkpoint under per-rank names, so a killed run
resumes exactly. What a checkpoint calls the model (``model.*``, which export, generate and
``model.init_from`` read) is θ_global, each fragment's at its last sync (:class:`GlobalModelState`):
the same on every rank, whichever rank's files are read.

The outer state (θ_global, the outer momentum, the error feedback, the snapshots of syncs in flight:
up to 16 bytes per parameter) is touched only once per fragment and cycle, so it lives in host memory,
pinned when the replica is on a GPU (:func:`outer_state_pinned`): the GPU keeps its memory for
training. An outer step brings a parameter's outer state to the GPU, updates it there, and copies it
back asynchronously (:meth:`DiLoCo._land`), on a stream of its own
(:class:`dtlab.train.outer_copies.HostCopies`): the next kernels, the next inner step's included, do
not wait for the copies back to host memory.

Between outer syncs no collective crosses replicas: a step's loss, gradient norm, flags and stop votes
are agreed within the replica (:func:`replica_group`), and the replicas agree on what concerns the whole
run (the mean loss, a stop signal, skipped steps) with each sync, in one small all-gather
(:meth:`DiLoCo.agree`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from dtlab.config import DiLoCoOptions
from dtlab.dims import ParallelDims
from dtlab.errors import CheckpointError
from dtlab.parallel.apply import plain_name
from dtlab.parallel.dist import all_gather_flat
from dtlab.parallel.ledger import recorded
from dtlab.runtime.placement import placed
from dtlab.train.outer_codec import encode, mean_of, outer_payload_bytes
from dtlab.train.outer_copies import HostCopies, copies_off_compute_stream, stage_values

__all__ = [
    "DiLoCo",
    "GlobalModelState",
    "fragment_of",
    "fragment_offsets",
    "gathers",
    "outer_group",
    "outer_payload_bytes",
    "outer_peers",
    "outer_state_pinned",
    "replica_group",
    "replica_members",
    "sync_bytes",
]


def fragment_of(name: str, n_layers: int, fragments: int) -> int:
    """The fragment parameter ``name`` belongs to: blocks in contiguous groups (block i in fragment
    ⌊i F / L⌋), the embedding with the first blocks, the final norm and output with the last."""
    if name.startswith("layers."):
        return int(name.split(".")[1]) * fragments // n_layers
    return 0 if name.startswith("tok_embeddings") else fragments - 1


def fragment_offsets(options: DiLoCoOptions) -> list[int]:
    """Each fragment's place in the H-step cycle: fragment k's sync is sent after the steps
    ≡ ⌊(k+1)H/F⌋ (mod H)."""
    h, n = options.inner_steps, options.fragments
    return [((k + 1) * h // n) % h for k in range(n)]


def sync_bytes(numel: int, options: DiLoCoOptions, world: int) -> int:
    """Bytes of the collective that syncs ``numel`` values, as the collective counter counts them (the
    whole buffer: the all-reduced tensor, or the all-gather's output)."""
    if not gathers(options):
        return 4 * numel
    return world * outer_payload_bytes(numel, options)


def gathers(options: DiLoCoOptions) -> bool:
    """Whether the outer sync all-gathers payloads (quantised or sparse) rather than all-reducing
    float32 sums."""
    return options.quantize != "none" or options.topk > 0


def outer_state_pinned(device: torch.device) -> bool:
    """Whether DiLoCo's outer state, always in host memory, is pinned for a replica on ``device``:
    on a CUDA device, so that copies to and from it run asynchronously at full bandwidth; nowhere
    else (on the CPU there is nothing to copy, and pinning needs CUDA)."""
    return device.type == "cuda"


def outer_peers(dims: ParallelDims, ranks: torch.Tensor | None = None) -> list[list[int]]:
    """The ranks of each outer sync group: those along the mesh's ``diloco`` dimension, one per
    replica, at the same coordinates on every other dimension (the same data-parallel and cp
    ranks of their replicas: the same parameters, or the same FSDP shard). ``ranks``: the mesh's
    global ranks (by default ``init_device_mesh``'s row-major layout of the world)."""
    if ranks is None:
        ranks = torch.arange(dims.world_size).view(dims.mesh_shape)
    return ranks.movedim(dims.mesh_dims.index("diloco"), -1).reshape(-1, dims.diloco).tolist()


def replica_members(dims: ParallelDims, ranks: torch.Tensor | None = None) -> list[list[int]]:
    """The ranks of each DiLoCo replica (:attr:`ParallelDims.replica_ranks` each: its data-parallel
    ranks and their cp ranks), in replica order; ``ranks`` as for :func:`outer_peers`."""
    if ranks is None:
        ranks = torch.arange(dims.world_size).view(dims.mesh_shape)
    # "diloco" is the mesh's outermost dimension (DiLoCo runs without pipeline stages).
    return ranks.reshape(dims.diloco, -1).tolist()


def outer_group(dims: ParallelDims, device_type: str) -> Any:
    """The process group of this rank and its peers in the other replicas (:func:`outer_peers`),
    made for DiLoCo alone: its syncs, in the background with a delay, never share a group with the
    step's collectives. None without a process group. Every rank must call it."""
    if not dims.diloco_enabled:
        return None
    group, _ = dist.new_subgroups_by_enumeration(outer_peers(dims, dims.mesh(device_type).mesh))
    return group


def agreement_group(dims: ParallelDims, device_type: str, options: DiLoCoOptions) -> Any:
    """A second group of this rank and its outer peers for the replicas' agreement when syncs run in
    the background (``delay`` > 0): on the outer group itself the agreement's few bytes would queue
    behind the fragment in flight (gloo's pair sockets and NCCL's stream run a group's collectives
    in order), and the training thread would wait for the transfer it overlaps. None otherwise
    (the agreement then shares the outer group: nothing is in flight at a send). Every rank must
    call it."""
    return outer_group(dims, device_type) if options.delay > 0 else None


def replica_group(dims: ParallelDims, device_type: str) -> tuple[Any, int]:
    """(process group, size) of this rank's DiLoCo replica: the ranks that agree on a step's figures
    between outer syncs, made for that alone (:func:`replica_members`). (None, 1) for a replica of
    one rank (nothing to agree with) or without a process group. Every rank must call it."""
    if not dims.diloco_enabled or dims.replica_ranks == 1:
        return None, 1
    replicas = replica_members(dims, dims.mesh(device_type).mesh)
    group, _ = dist.new_subgroups_by_enumeration(replicas)
    return group, dims.replica_ranks


@dataclass
class _Sync:
    """A fragment's sync in flight: sent after step ``sent``, applied after step ``due``."""

    fragment: int
    sent: int
    due: int
    snapshot: list[torch.Tensor]  # the fragment's replica weights when it was sent (host memory)
    buffer: torch.Tensor  # what the collective fills, on the replica's device (sum or payloads)
    work: Any = None  # the collective's handle while it runs
    # Eager updates: this replica's share of the mean it sent (Δ_r / n as the others decode it),
    # per parameter, float32 in host memory; None without eager.
    own: list[torch.Tensor] | None = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class DiLoCo:
    """The outer loop of DiLoCo over this rank's replica ``model`` (its plain module: names as the
    model's) and inner ``optimizer``. Call :meth:`after_step` after every inner optimizer step.

    ``group`` holds this rank and the ranks that hold the same part of the model in the other replicas
    (:func:`outer_group`; None: one process, no process group). A replica sharded over its ranks (FSDP) syncs
    each rank's shards with theirs: the pseudo-gradients of the rank's local tensors."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        options: DiLoCoOptions,
        n_layers: int,
        group: Any = None,
        replica: tuple[Any, int] = (None, 1),
        agreement: Any = None,
    ) -> None:
        self.o, self.optimizer, self.group = options, optimizer, group
        # The replicas' agreement's group (:func:`agreement_group`; None: the outer group).
        self.agreement = agreement if agreement is not None else group
        self.world = dist.get_world_size(group) if dist.is_initialized() and group else 1
        # This rank's replica (process group, size): its steps' agreement between syncs.
        self.replica = replica
        self._params = [p for _, p in model.named_parameters()]
        # The plain model's names (a checkpoint's keys), whatever wraps the blocks (activation checkpointing).
        self.names = [plain_name(n) for n, _ in model.named_parameters()]
        frags = [fragment_of(n, n_layers, options.fragments) for n in self.names]
        self.fragments = [
            [i for i, f in enumerate(frags) if f == k] for k in range(options.fragments)
        ]
        self.offsets = fragment_offsets(options)
        # Where the replica computes (its weights, the collectives' buffers), and whether the outer
        # state's host memory is pinned (a replica on a GPU).
        params = self.params
        self.device = params[0].device if params else torch.device("cpu")
        self.pin = outer_state_pinned(self.device)
        # On a GPU, the copies into the outer state run on a side stream through two staging
        # buffers of this many values each (None: on the CPU, nothing is copied).
        self.stage_values = stage_values([p.numel() for p in params])
        self.copies = (
            HostCopies(self.device, self.stage_values)
            if copies_off_compute_stream(self.device)
            else None
        )
        # θ_global: the weights every replica agreed on at the fragment's last sync (float32).
        with self._outer_op():
            self.global_ = [self._host(p.detach().float()) for p in params]
        self.momentum: list[torch.Tensor | None] = [None] * len(self.params)
        self.error: list[torch.Tensor | None] = [None] * len(self.params)
        # Eager updates: the other replicas' share of each parameter's mean outer gradient at its
        # fragment's last sync (host memory; None before the first lands: counted as zero).
        self.others: list[torch.Tensor | None] = [None] * len(self.params)
        self.pending: list[_Sync] = []
        # Each fragment's last sync to land: the inner step after which it was sent (0: none yet,
        # θ_global is the initial weights). The checkpoint's model is θ_global as of these steps.
        self.synced_after = [0] * options.fragments
        # The steps this replica skipped (not finite) since the last outer sync, and in a row up to
        # now: what its part of the next sync's agreement reports. Saved: a resume between syncs
        # reports them as the uninterrupted run does.
        self.skipped = 0
        self.streak = 0

    @property
    def params(self) -> list[torch.Tensor]:
        """The replica's weights as this rank holds them: the local shard of a sharded parameter
        (a view: writing it writes the parameter)."""
        with torch.no_grad():
            return [p.to_local() if isinstance(p, DTensor) else p for p in self._params]

    def reset(self) -> None:
        """θ_global = the replica's weights now (after weights were loaded into a fresh run)."""
        with self._outer_op():
            self.global_ = [self._host(p.detach().float()) for p in self.params]

    # --- where the outer state lives -------------------------------------------------------------
    def _host(self, t: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """``t`` in the outer state's host memory, a tensor of its own (``copy=False``: ``t`` itself
        when it is there already). From a GPU into pinned memory the copy is asynchronous, on the
        copies' side stream: the CPU reads it only after :meth:`host_ready`, the GPU after
        :meth:`_dev`'s wait for it."""
        if self.copies is None:
            return t.to("cpu", copy=copy)
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        self.copies.copy(out, t)
        return out

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        """Outer state ``t`` on the replica's device to compute with: ``t`` itself on the CPU (so an
        in-place update there is the update), else an asynchronous copy from pinned memory, after
        the last copy into ``t`` has landed."""
        if self.copies is not None:
            self.copies.before_read(t)
        return t.to(self.device, non_blocking=True)

    def _put(self, host: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value`` (computed by :meth:`_dev`'s copy) back into the outer state ``host``."""
        if value is host:
            return
        if self.copies is None:
            host.copy_(value)
        else:
            self.copies.copy(host, value)

    def _outer_op(self) -> AbstractContextManager[Any]:
        """Around one outer operation (a step's sends and landings): on a GPU, the side stream's
        staging buffers for its length."""
        return self.copies.staged() if self.copies is not None else nullcontext()

    def host_ready(self) -> None:
        """Wait for the copies into the outer state issued so far (before the CPU reads it: a save)."""
        if self.copies is not None:
            self.copies.synchronize()

    # --- the schedule ----------------------------------------------------------------------------
    def due(self, step: int) -> list[int]:
        """The fragments whose sync is sent after inner step ``step`` (1-based)."""
        h = self.o.inner_steps
        return [k for k, off in enumerate(self.offsets) if step % h == off]

    def after_step(self, step: int) -> None:
        """After inner step ``step``: land the syncs due now, then send the fragments due now."""
        # Each sync is let go as it lands: its buffer is freed before the next lands or is sent.
        landing = [s for s in self.pending if s.due == step]
        due = self.due(step)
        if not landing and not due:
            return
        self.pending = [s for s in self.pending if s.due != step]
        with self._outer_op():
            while landing:
                self._land(landing.pop(0))
            for k in due:
                if self.o.delay == 0:
                    self._land(self._send(k, step))
                else:
                    self.pending.append(self._send(k, step))

    # --- one fragment's sync ---------------------------------------------------------------------
    def _send(self, k: int, step: int) -> _Sync:
        """Send fragment ``k``'s sync after inner step ``step`` (its collective issued)."""
        with self._outer_op():  # a fault-tolerant sync calls it alone
            return self._sending(k, step)

    def _sending(self, k: int, step: int) -> _Sync:
        # The pseudo-gradient is computed on the replica's device, parameter by parameter, from its
        # weights and a copy of θ_global brought from the host: the GPU does the arithmetic, and the
        # collective's buffer must be there anyway (NCCL). The snapshot goes to the host. It is
        # written into one flat buffer a parameter at a time, the error feedback added in place,
        # and encoded a slice at a time: the device holds the fragment's float32 values once.
        idx = self.fragments[k]
        params = self.params
        with torch.no_grad():
            # θ_at_send, what the landing keeps the progress since (eager: the estimate, below).
            snapshot = [] if self.o.eager else [self._host(params[i].detach().float()) for i in idx]
            delta = self._flat(idx, lambda i: self._dev(self.global_[i]) - params[i].float())
        if not gathers(self.o):
            own = self._split(idx, delta / self.world) if self.o.eager else None
            buffer = delta
            work = self._collective(dist.all_reduce, buffer)
        else:
            # This sync's pseudo-gradient plus what was not sent before, decayed.
            target = self._add_error(idx, delta)
            del delta
            # What was not sent stays in ``target``, for the next sync.
            payload = encode(target, self.o)
            self._store_error(idx, target)
            del target
            own = None
            if self.o.eager:  # what the others decode of this replica's payload, over n
                numel = sum(self.global_[i].numel() for i in idx)
                own = self._split(idx, self.mean_of(payload.view(1, -1), numel).div_(self.world))
            buffer = torch.empty(
                self.world * payload.numel(), dtype=torch.uint8, device=payload.device
            )
            work = self._collective(all_gather_flat, buffer, payload)
        if own is not None:
            snapshot = self._estimate(idx, own)
        return _Sync(k, step, step + self.o.delay, snapshot, buffer, work, own)

    def _split(self, idx: list[int], flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (parameters ``idx``, one after another) as each parameter's tensor in host memory."""
        out, offset = [], 0
        for i in idx:
            n = self.global_[i].numel()
            out.append(self._host(flat[offset : offset + n].view_as(self.global_[i])))
            offset += n
        return out

    def _estimate(self, idx: list[int], own: list[torch.Tensor]) -> list[torch.Tensor]:
        """Eager updates: the replica's weights of parameters ``idx`` set at once to θ_global after the
        outer step on the estimated mean (``own``, this replica's share, plus the others' share of the
        last sync), with the outer momentum as it stands (not updated: the true step does that when the
        sync lands). Returns the weights so set (host memory): what the landing keeps the progress
        since."""
        lr, mu = self.o.outer_lr, self.o.outer_momentum
        params, out = self.params, []
        with torch.no_grad():
            for i, mine in zip(idx, own, strict=True):
                g = self._dev(mine).clone()
                if (others := self.others[i]) is not None:
                    g.add_(self._dev(others))
                if mu > 0:
                    held = self.momentum[i]
                    buf = g.clone() if held is None else self._dev(held).mul(mu).add_(g)
                    g.add_(buf, alpha=mu)  # Nesterov
                    del buf
                p = params[i]
                p.copy_(self._dev(self.global_[i]).sub(g, alpha=lr))
                # What the parameter holds now (its dtype's rounding of the estimate).
                out.append(self._host(p.detach().float()))
        return out

    def _collective(self, fn: Any, *args: torch.Tensor) -> Any:
        if self.world == 1:
            if len(args) == 2:  # an all-gather of one rank: its own payload
                args[0].copy_(args[1])
            return None
        return fn(*args, group=self.group, async_op=self.o.delay > 0)

    def _mean(self, sync: _Sync, numel: int) -> torch.Tensor:
        """The replicas' mean outer gradient, the same on every rank."""
        if not gathers(self.o):
            return sync.buffer.div_(self.world)  # the sum is not read again
        return self.mean_of(sync.buffer.view(self.world, -1), numel)

    def mean_of(self, parts: torch.Tensor | list[torch.Tensor], numel: int) -> torch.Tensor:
        """The mean of the replicas' payloads ``parts`` (:func:`dtlab.train.outer_codec.mean_of`)."""
        return mean_of(parts, numel, self.o)

    def _land(self, sync: _Sync, mean: torch.Tensor | None = None) -> None:
        """Apply ``sync``'s outer step (``mean``: the replicas' mean, where already taken)."""
        with self._outer_op():  # a fault-tolerant sync calls it alone
            self._landing(sync, mean)

    def _landing(self, sync: _Sync, mean: torch.Tensor | None = None) -> None:
        """The outer step of the fragment, then the replica continues from the new θ_global plus what
        it learnt since the send. ``mean``: the replicas' mean outer gradient where another path
        computed it (fault-tolerant replica groups: :mod:`dtlab.train.diloco_ft`)."""
        sync.wait()
        idx = self.fragments[sync.fragment]
        if mean is None:
            mean = self._mean(sync, sum(self.global_[i].numel() for i in idx))
        lr, mu = self.o.outer_lr, self.o.outer_momentum
        offset, params = 0, self.params
        # On the replica's device, one parameter at a time (its outer state copied over from the
        # host and back, asynchronously: the GPU holds one parameter's outer state at a time).
        with torch.no_grad():
            for n, (i, snap) in enumerate(zip(idx, sync.snapshot, strict=True)):
                g = mean[offset : offset + snap.numel()].view_as(snap)
                if sync.own is not None:  # eager: the others' share of this mean, for the next sync
                    mine = self._dev(sync.own[n])
                    self._keep_others(i, g - mine)
                    del mine
                offset += snap.numel()
                if mu > 0:
                    held = self.momentum[i]
                    if held is None:
                        buf = g.clone()
                        self.momentum[i] = self._host(buf, copy=False)
                    else:
                        buf = self._dev(held).mul_(mu).add_(g)
                        self._put(held, buf)
                    g = g.add(buf, alpha=mu)  # Nesterov
                    del buf
                glob = self._dev(self.global_[i]).sub_(g, alpha=lr)
                del g
                self._put(self.global_[i], glob)
                p = params[i]
                # θ_global + (θ_now - θ_at_send), in the snapshot's copy (the same floats: p - s is
                # -s + p, and the sum commutes); the snapshot is not read again.
                learnt = self._dev(snap).neg_().add_(p.float())
                p.copy_(learnt.add_(glob))
                # Two of one parameter's copies on the device at a time, none left for the next.
                del glob, learnt
        self.synced_after[sync.fragment] = sync.sent
        sync.snapshot, sync.own = [], None  # landed: its host memory is free before the next send

    def _keep_others(self, i: int, value: torch.Tensor) -> None:
        """Eager updates: parameter ``i``'s others' share ``value``, into the host tensor it had."""
        if (held := self.others[i]) is None:
            self.others[i] = self._host(value, copy=False)
        else:
            self._put(held, value)

    # --- what the replicas agree on ----------------------------------------------------------------
    def agree(self, values: list[float]) -> torch.Tensor:
        """Every replica's ``values`` (the same on each rank of a replica), one row per replica in
        replica order, on every rank: a small all-gather along the outer group, issued with an outer
        sync (the only time replicas talk), before the sync's own payload, on a group of its own
        while syncs are in flight (:func:`agreement_group`)."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world == 1:
            return mine.reshape(1, -1).cpu()
        out = torch.empty(self.world * mine.numel(), dtype=mine.dtype, device=mine.device)
        with recorded("diloco agreement", "all_gather", mine):
            all_gather_flat(out, mine, group=self.agreement)
        return out.view(self.world, -1).cpu()

    def model_state(self, module: nn.Module) -> GlobalModelState:
        """The model part of this run's checkpoints: θ_global in ``module``'s state dict format."""
        return GlobalModelState(module, self)

    def describe_model(self) -> str:
        """Which model a checkpoint of this run holds, e.g. 'the global model of the outer syncs sent
        after step 8 (fragment 0) and 6 (fragment 1)'."""
        steps = self.synced_after
        if not any(steps):
            return "the initial weights (no outer sync has landed yet)"
        if len(steps) == 1:
            return f"the global model of the outer sync after step {steps[0]}"
        parts = ", ".join(f"{s} (fragment {k})" for k, s in enumerate(steps))
        return f"the global model of each fragment's last outer sync, after steps {parts}"

    def _flat(self, idx: list[int], value: Any) -> torch.Tensor:
        """The float32 ``value(i)`` of parameters ``idx`` one after another in one flat tensor on the
        replica's device, each written in place (no list of parts beside their concatenation)."""
        out = torch.empty(sum(self.global_[i].numel() for i in idx), device=self.device)
        offset = 0
        for i in idx:
            n = self.global_[i].numel()
            out[offset : offset + n].view_as(self.global_[i]).copy_(value(i))
            offset += n
        return out

    def _add_error(self, idx: list[int], flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (parameters ``idx``, one after another) plus their error feedback times the
        decay, in place, a parameter at a time (none before the first sync)."""
        offset = 0
        for i in idx:
            n = self.global_[i].numel()
            if (e := self.error[i]) is not None:
                flat[offset : offset + n].view_as(e).add_(self._dev(e).mul(self.o.error_decay))
            offset += n
        return flat

    def _store_error(self, idx: list[int], flat: torch.Tensor) -> None:
        """Parameters ``idx``'s error feedback from ``flat``, into the host tensors it had (a new one
        where it had none: the first sync)."""
        offset = 0
        for i in idx:
            n = self.global_[i].numel()
            part = flat[offset : offset + n].view_as(self.global_[i])
            if (e := self.error[i]) is None:
                self.error[i] = self._host(part)
            else:
                self._put(e, part)
            offset += n

    # --- state (each rank's own) -----------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This replica's weights and inner optimizer state, θ_global, the outer momentum, the error
        feedback and the syncs in flight (waited for: their results are saved, not the sends).

        Every tensor is the live one (a view, never a copy): the checkpoint copies them anyway (a sync
        save writes them before training goes on, an async one stages a copy before the next update)."""
        for sync in self.pending:
            sync.wait()
        self.host_ready()
        out: dict[str, torch.Tensor] = {}
        for i, p in enumerate(self.params):
            out[f"replica.{i}"] = p.detach()
            out[f"global.{i}"] = self.global_[i]
            if (m := self.momentum[i]) is not None:
                out[f"momentum.{i}"] = m
            if (e := self.error[i]) is not None:
                out[f"error.{i}"] = e
            if (o := self.others[i]) is not None:
                out[f"others.{i}"] = o
        for k, v in _optimizer_tensors(self.optimizer).items():
            out[f"inner.{k}"] = v
        out["synced_after"] = torch.tensor(self.synced_after)
        out["skipped"] = torch.tensor([self.skipped, self.streak])
        for j, sync in enumerate(self.pending):
            out[f"pending.{j}.meta"] = torch.tensor([sync.fragment, sync.sent, sync.due])
            out[f"pending.{j}.buffer"] = sync.buffer
            for n, s in enumerate(sync.snapshot):
                out[f"pending.{j}.snapshot.{n}"] = s
            for n, s in enumerate(sync.own or []):
                out[f"pending.{j}.own.{n}"] = s
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load this rank's state (a checkpoint reads it into CPU templates, of the saved dtypes): the
        replica's weights into its parameters, the outer state into host memory (float32, pinned with
        a GPU), a sync in flight's buffer onto the replica's device, where its collective ran."""
        self.host_ready()  # no copy into the state being replaced is still running
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.shape != state[f"replica.{i}"].shape:
                    raise CheckpointError(
                        f"DiLoCo state of {self.names[i]}: saved as {tuple(state[f'replica.{i}'].shape)} "
                        f"on this rank, held here as {tuple(p.shape)}: resume on the layout that saved it"
                    )
                p.copy_(state[f"replica.{i}"])
                self.global_[i] = self._outer(state[f"global.{i}"])
                self.momentum[i] = self._outer(state.get(f"momentum.{i}"))
                self.error[i] = self._outer(state.get(f"error.{i}"))
                self.others[i] = self._outer(state.get(f"others.{i}"))
        _load_optimizer_tensors(
            self.optimizer, {k[6:]: v for k, v in state.items() if k.startswith("inner.")}
        )
        if "synced_after" in state:  # saved since the checkpoint's model is θ_global
            self.synced_after = [int(s) for s in state["synced_after"].tolist()]
        if "skipped" in state:  # saved since the skipped steps between syncs are
            self.skipped, self.streak = (int(x) for x in state["skipped"].tolist())
        self.pending = []
        j = 0
        while f"pending.{j}.meta" in state:
            k, sent, due = (int(x) for x in state[f"pending.{j}.meta"].tolist())
            snaps = [
                self._outer(state[f"pending.{j}.snapshot.{n}"])
                for n in range(len(self.fragments[k]))
            ]
            kind = torch.uint8 if gathers(self.o) else torch.float32  # payloads or sum
            buffer = placed(state[f"pending.{j}.buffer"], self.device, kind)
            own = None
            if f"pending.{j}.own.0" in state:  # eager updates: the replica's share of the sync
                own = [self._outer(state[f"pending.{j}.own.{n}"]) for n in range(len(snaps))]
            self.pending.append(_Sync(k, sent, due, snaps, buffer, own=own))
            j += 1

    @overload
    def _outer(self, t: torch.Tensor) -> torch.Tensor: ...
    @overload
    def _outer(self, t: None) -> None: ...
    def _outer(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A loaded outer-state tensor as the outer state keeps it: float32, in host memory (pinned
        for a replica on a GPU), a tensor of its own."""
        if t is None:
            return None
        return placed(t, torch.device("cpu"), torch.float32, pin=self.pin)

    def close(self) -> None:
        """Let the syncs in flight finish (all ranks sent them; on a failed run they fail at once) and
        destroy DiLoCo's own process groups, as the object that made it: a group left to the
        interpreter's exit tears down its threads at the worst time."""
        for sync in self.pending:
            try:
                sync.wait()
            except Exception:  # a peer is gone: the run is failing already
                sync.work = None
        self.pending = []
        if dist.is_initialized():
            # Destroyed, or aborted on NCCL when the run is failing (a destroy would wait for kernels
            # that wait on a dead peer).
            from dtlab.parallel.dist import release_group

            agreement = self.agreement if self.agreement is not self.group else None
            for group in (self.group, self.replica[0], agreement):
                if group is not None:
                    release_group(group)
        self.group, self.replica, self.agreement = None, (None, 1), None

    # What the engine's step asks of every per-rank state (DiLoCo has nothing to commit or roll back:
    # it acts after the inner step, on the weights the step left).
    def set_scale(self, scale: float) -> None:
        pass

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass


class GlobalModelState:
    """The model of a DiLoCo run's checkpoint: θ_global (each fragment's at its last sync) under the
    model's parameter names, as the DiLoCo papers evaluate it. Every replica holds the same θ_global,
    so DCP's choice of one rank's copy of a duplicated name cannot mix replicas. The replicas' own
    weights since the sync are each rank's (:meth:`DiLoCo.state_dict`); loading this part writes
    θ_global into the parameters, which a resume then overwrites with the replica's own."""

    def __init__(self, module: nn.Module, diloco: DiLoCo) -> None:
        self.module, self.diloco = module, diloco

    def state_dict(self) -> dict[str, Any]:
        """θ_global as it is (host memory, no copy where the parameters are float32)."""
        self.diloco.host_ready()
        sd: dict[str, Any] = dict(get_model_state_dict(self.module))
        for name, g in zip(self.diloco.names, self.diloco.global_, strict=True):
            held = sd[name]
            assert isinstance(held, torch.Tensor)
            value = g.to(held.dtype)
            if isinstance(held, DTensor):
                # This rank's shard of θ_global under the parameter's spec (mesh, placements, global
                # shape), left in host memory: DTensor.from_local would copy it to the mesh's device.
                value = DTensor(value, held._spec, requires_grad=False)  # type: ignore[call-arg]
            sd[name] = value
        # JSON beside the tensors (state.json): which syncs the model is made of.
        return {**sd, "diloco_synced_after": list(self.diloco.synced_after)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tensors: dict[str, Any] = {}
        for k, v in state.items():
            if isinstance(v, DTensor) and v.to_local().device.type != v.device_mesh.device_type:
                # Read into host memory (the templates of state_dict): the parameter's shard, on
                # the mesh's device, as the parameters' own load expects it.
                v = DTensor.from_local(
                    v.to_local(), v.device_mesh, v.placements, run_check=False,
                    shape=v.shape, stride=v.stride(),
                )  # fmt: skip
            if isinstance(v, torch.Tensor):
                tensors[k] = v
        set_model_state_dict(self.module, tensors)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The inner optimizer's per-parameter state as flat ``<param index>.<name>`` tensors (this rank's
    shard of a sharded one)."""
    return {
        f"{i}.{name}": (v.to_local() if isinstance(v, DTensor) else v).detach()
        for i, s in optimizer.state_dict()["state"].items()
        for name, v in s.items()
        if isinstance(v, torch.Tensor)
    }


def _load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, flat: dict[str, torch.Tensor]
) -> None:
    sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]  # state_dict's numbering
    state: dict[int, dict[str, Any]] = {}
    for key, v in flat.items():
        i, name = key.split(".", 1)
        p = params[int(i)]
        if isinstance(p, DTensor) and v.shape == p.to_local().shape and v.dim() > 0:
            # A sharded parameter's moments are sharded like it (the step counter is not).
            v = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        state.setdefault(int(i), {})[name] = v.clone()
    sd["state"] = state
    optimizer.load_state_dict(sd)
