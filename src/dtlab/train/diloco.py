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

Degenerate cases (tested): H = 1, an inner plain-SGD step, outer SGD with lr 1 and no momentum is DDP with
that SGD; one fragment without delay is DiLoCo; ``quantize: none`` sends the exact float32 values.

Every replica's weights, inner optimizer state, the outer state and syncs in flight are each rank's own:
:meth:`DiLoCo.state_dict` carries them into every checkpoint under per-rank names, so a killed run
resumes exactly. What a checkpoint calls the model (``model.*``, which export, generate and
``model.init_from`` read) is θ_global, each fragment's at its last sync (:class:`GlobalModelState`):
the same on every rank, whichever rank's files are read.

Between outer syncs no collective crosses replicas: a step's loss, gradient norm, flags and stop votes
are agreed within the replica (:func:`replica_group`), and the replicas agree on what concerns the whole
run (the mean loss, a stop signal, skipped steps) with each sync, in one small all-gather
(:meth:`DiLoCo.agree`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from dtlab.config import DiLoCoOptions
from dtlab.dims import ParallelDims
from dtlab.errors import CheckpointError
from dtlab.parallel.ledger import recorded

__all__ = [
    "QUANT_BLOCK",
    "DiLoCo",
    "GlobalModelState",
    "fragment_of",
    "outer_group",
    "replica_group",
    "sync_bytes",
]

QUANT_BLOCK = 64  # values per float32 scale of a quantised outer gradient
BITS = {"int8": 8, "int4": 4, "int2": 2}


def fragment_of(name: str, n_layers: int, fragments: int) -> int:
    """The fragment parameter ``name`` belongs to: blocks in contiguous groups (block i in fragment
    ⌊i F / L⌋), the embedding with the first blocks, the final norm and output with the last."""
    if name.startswith("layers."):
        return int(name.split(".")[1]) * fragments // n_layers
    return 0 if name.startswith("tok_embeddings") else fragments - 1


def payload_bytes(numel: int, quantize: str) -> int:
    """Bytes one replica sends for an outer gradient of ``numel`` values."""
    if quantize == "none":
        return 4 * numel
    blocks = math.ceil(numel / QUANT_BLOCK)
    return blocks * (QUANT_BLOCK * BITS[quantize] // 8 + 4)


def sync_bytes(numel: int, quantize: str, world: int) -> int:
    """Bytes of the collective that syncs ``numel`` values, as the collective counter counts them (the
    whole buffer: the all-reduced tensor, or the all-gather's output)."""
    if quantize == "none":
        return 4 * numel
    return world * payload_bytes(numel, quantize)


def _quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantisation per block of QUANT_BLOCK values: (the payload, the dequantised
    values). The payload is uint8: the codes (two per byte at 4 bits), then the float32 scales."""
    n = x.numel()
    blocks = math.ceil(n / QUANT_BLOCK)
    padded = torch.zeros(blocks * QUANT_BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = x
    rows = padded.view(blocks, QUANT_BLOCK)
    qmax = 2 ** (bits - 1) - 1
    scale = rows.abs().amax(dim=1, keepdim=True) / qmax
    codes = torch.where(scale > 0, rows / scale, torch.zeros_like(rows)).round().clamp(-qmax, qmax)
    values = (codes * scale).flatten()[:n]
    c = (codes + qmax).to(torch.uint8)  # 0 .. 2 qmax, in `bits` bits
    per = 8 // bits  # codes per byte, the first in the lowest bits
    packed = c[:, 0::per].clone()
    for j in range(1, per):
        packed |= c[:, j::per] << (bits * j)
    payload = torch.cat([packed.flatten(), scale.flatten().view(torch.uint8)])
    return payload, values


def _dequantize(payload: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The values a payload of :func:`_quantize` carries (``n`` of them)."""
    blocks = math.ceil(n / QUANT_BLOCK)
    code_bytes = blocks * QUANT_BLOCK * bits // 8
    packed = payload[:code_bytes].view(blocks, -1)
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    c = torch.stack(parts, dim=2).view(blocks, QUANT_BLOCK)
    qmax = 2 ** (bits - 1) - 1
    scale = payload[code_bytes:].clone().view(torch.float32).view(blocks, 1)
    return ((c.float() - qmax) * scale).flatten()[:n]


def outer_group(dims: ParallelDims, device_type: str) -> Any:
    """The process group of this rank and its peers in the other replicas (the ranks along the mesh's
    ``diloco`` dimension), made for DiLoCo alone: its syncs, in the background with a delay, never
    share a group with the step's collectives. None without a process group. Every rank must call it."""
    if not dims.diloco_enabled:
        return None
    ranks = dims.mesh(device_type).mesh
    peers = ranks.movedim(dims.mesh_dims.index("diloco"), -1).reshape(-1, dims.diloco).tolist()
    group, _ = dist.new_subgroups_by_enumeration(peers)
    return group


def replica_group(dims: ParallelDims, device_type: str) -> tuple[Any, int]:
    """(process group, size) of this rank's DiLoCo replica: the ranks that agree on a step's figures
    between outer syncs, made for that alone. (None, 1) for a replica of one rank (nothing to agree
    with) or without a process group. Every rank must call it."""
    if not dims.diloco_enabled or dims.diloco_inner == 1:
        return None, 1
    replicas = dims.mesh(device_type).mesh.reshape(dims.diloco, -1).tolist()
    group, _ = dist.new_subgroups_by_enumeration(replicas)
    return group, dims.diloco_inner


@dataclass
class _Sync:
    """A fragment's sync in flight: sent after step ``sent``, applied after step ``due``."""

    fragment: int
    sent: int
    due: int
    snapshot: list[torch.Tensor]  # the fragment's replica weights when it was sent
    buffer: torch.Tensor  # what the collective fills (the sum, or every replica's payload)
    work: Any = None  # the collective's handle while it runs

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
    ) -> None:
        self.o, self.optimizer, self.group = options, optimizer, group
        self.world = dist.get_world_size(group) if dist.is_initialized() and group else 1
        # This rank's replica (process group, size): its steps' agreement between syncs.
        self.replica = replica
        self._params = [p for _, p in model.named_parameters()]
        self.names = [n for n, _ in model.named_parameters()]
        frags = [fragment_of(n, n_layers, options.fragments) for n in self.names]
        self.fragments = [
            [i for i, f in enumerate(frags) if f == k] for k in range(options.fragments)
        ]
        h, n = options.inner_steps, options.fragments
        self.offsets = [((k + 1) * h // n) % h for k in range(n)]
        # θ_global: the weights every replica agreed on at the fragment's last sync (float32).
        self.global_ = [p.detach().float().clone() for p in self.params]
        self.momentum: list[torch.Tensor | None] = [None] * len(self.params)
        self.error: list[torch.Tensor | None] = [None] * len(self.params)
        self.pending: list[_Sync] = []
        # Each fragment's last sync to land: the inner step after which it was sent (0: none yet,
        # θ_global is the initial weights). The checkpoint's model is θ_global as of these steps.
        self.synced_after = [0] * options.fragments

    @property
    def params(self) -> list[torch.Tensor]:
        """The replica's weights as this rank holds them: the local shard of a sharded parameter
        (a view: writing it writes the parameter)."""
        with torch.no_grad():
            return [p.to_local() if isinstance(p, DTensor) else p for p in self._params]

    def reset(self) -> None:
        """θ_global = the replica's weights now (after weights were loaded into a fresh run)."""
        self.global_ = [p.detach().float().clone() for p in self.params]

    # --- the schedule ----------------------------------------------------------------------------
    def due(self, step: int) -> list[int]:
        """The fragments whose sync is sent after inner step ``step`` (1-based)."""
        h = self.o.inner_steps
        return [k for k, off in enumerate(self.offsets) if step % h == off]

    def after_step(self, step: int) -> None:
        """After inner step ``step``: land the syncs due now, then send the fragments due now."""
        for sync in [s for s in self.pending if s.due == step]:
            self._land(sync)
            self.pending.remove(sync)
        for k in self.due(step):
            sync = self._send(k, step)
            if self.o.delay == 0:
                self._land(sync)
            else:
                self.pending.append(sync)

    # --- one fragment's sync ---------------------------------------------------------------------
    def _send(self, k: int, step: int) -> _Sync:
        idx = self.fragments[k]
        params = self.params
        snapshot = [params[i].detach().float().clone() for i in idx]
        delta = torch.cat(
            [(self.global_[i] - s).flatten() for i, s in zip(idx, snapshot, strict=True)]
        )
        if self.o.quantize == "none":
            buffer = delta
            work = self._collective(dist.all_reduce, buffer)
        else:
            bits = BITS[self.o.quantize]
            error = self._flat_error(idx, delta)
            target = delta + error
            payload, sent = _quantize(target, bits)
            self._store_error(idx, target - sent)  # what rounding lost goes into the next sync
            buffer = torch.empty(
                self.world * payload.numel(), dtype=torch.uint8, device=delta.device
            )
            work = self._collective(dist.all_gather_into_tensor, buffer, payload)
        return _Sync(k, step, step + self.o.delay, snapshot, buffer, work)

    def _collective(self, fn: Any, *args: torch.Tensor) -> Any:
        if self.world == 1:
            if len(args) == 2:  # an all-gather of one rank: its own payload
                args[0].copy_(args[1])
            return None
        return fn(*args, group=self.group, async_op=self.o.delay > 0)

    def _mean(self, sync: _Sync, numel: int) -> torch.Tensor:
        """The replicas' mean outer gradient, the same on every rank."""
        if self.o.quantize == "none":
            return sync.buffer / self.world
        bits = BITS[self.o.quantize]
        parts = sync.buffer.view(self.world, -1)
        total = _dequantize(parts[0], numel, bits)
        for r in range(1, self.world):  # in rank order: every rank sums alike
            total += _dequantize(parts[r], numel, bits)
        return total / self.world

    def _land(self, sync: _Sync) -> None:
        """The outer step of the fragment, then the replica continues from the new θ_global plus what
        it learnt since the send."""
        sync.wait()
        idx = self.fragments[sync.fragment]
        mean = self._mean(sync, sum(self.global_[i].numel() for i in idx))
        lr, mu = self.o.outer_lr, self.o.outer_momentum
        offset, params = 0, self.params
        with torch.no_grad():
            for i, snap in zip(idx, sync.snapshot, strict=True):
                g = mean[offset : offset + snap.numel()].view_as(snap)
                offset += snap.numel()
                if mu > 0:
                    buf = self.momentum[i]
                    buf = g.clone() if buf is None else buf.mul_(mu).add_(g)
                    self.momentum[i] = buf
                    g = g.add(buf, alpha=mu)  # Nesterov
                self.global_[i].sub_(g, alpha=lr)
                p = params[i]
                p.copy_(self.global_[i] + (p.detach().float() - snap))
        self.synced_after[sync.fragment] = sync.sent

    # --- what the replicas agree on ----------------------------------------------------------------
    def agree(self, values: list[float]) -> torch.Tensor:
        """Every replica's ``values`` (the same on each rank of a replica), one row per replica in
        replica order, on every rank: a small all-gather along the outer group, issued with an outer
        sync (the only time replicas talk)."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.global_[0].device)
        if self.world == 1:
            return mine.reshape(1, -1).cpu()
        out = torch.empty(self.world * mine.numel(), dtype=mine.dtype, device=mine.device)
        with recorded("diloco agreement", "all_gather", mine):
            dist.all_gather_into_tensor(out, mine, group=self.group)
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

    def _flat_error(self, idx: list[int], like: torch.Tensor) -> torch.Tensor:
        parts = [
            e.flatten()
            if (e := self.error[i]) is not None
            else torch.zeros(self.global_[i].numel())
            for i in idx
        ]
        return torch.cat(parts).to(like.device)

    def _store_error(self, idx: list[int], flat: torch.Tensor) -> None:
        offset = 0
        for i in idx:
            n = self.global_[i].numel()
            self.error[i] = flat[offset : offset + n].view_as(self.global_[i]).clone()
            offset += n

    # --- state (each rank's own) -----------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This replica's weights and inner optimizer state, θ_global, the outer momentum, the error
        feedback and the syncs in flight (waited for: their results are saved, not the sends)."""
        out: dict[str, torch.Tensor] = {}
        for i, p in enumerate(self.params):
            out[f"replica.{i}"] = p.detach().clone()
            out[f"global.{i}"] = self.global_[i]
            if (m := self.momentum[i]) is not None:
                out[f"momentum.{i}"] = m
            if (e := self.error[i]) is not None:
                out[f"error.{i}"] = e
        for k, v in _optimizer_tensors(self.optimizer).items():
            out[f"inner.{k}"] = v
        out["synced_after"] = torch.tensor(self.synced_after)
        for j, sync in enumerate(self.pending):
            sync.wait()
            out[f"pending.{j}.meta"] = torch.tensor([sync.fragment, sync.sent, sync.due])
            out[f"pending.{j}.buffer"] = sync.buffer
            for n, s in enumerate(sync.snapshot):
                out[f"pending.{j}.snapshot.{n}"] = s
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.shape != state[f"replica.{i}"].shape:
                    raise CheckpointError(
                        f"DiLoCo state of {self.names[i]}: saved as {tuple(state[f'replica.{i}'].shape)} "
                        f"on this rank, held here as {tuple(p.shape)}: resume on the layout that saved it"
                    )
                p.copy_(state[f"replica.{i}"])
                self.global_[i] = state[f"global.{i}"].clone()
                self.momentum[i] = _get(state, f"momentum.{i}")
                self.error[i] = _get(state, f"error.{i}")
        _load_optimizer_tensors(
            self.optimizer, {k[6:]: v for k, v in state.items() if k.startswith("inner.")}
        )
        if "synced_after" in state:  # saved since the checkpoint's model is θ_global
            self.synced_after = [int(s) for s in state["synced_after"].tolist()]
        self.pending = []
        j = 0
        while f"pending.{j}.meta" in state:
            k, sent, due = (int(x) for x in state[f"pending.{j}.meta"].tolist())
            snaps = [
                state[f"pending.{j}.snapshot.{n}"].clone() for n in range(len(self.fragments[k]))
            ]
            self.pending.append(_Sync(k, sent, due, snaps, state[f"pending.{j}.buffer"].clone()))
            j += 1

    def close(self) -> None:
        """Let the syncs in flight finish (all ranks sent them; on a failed run they fail at once) and
        destroy DiLoCo's own process group, as the object that made it: a group left to the
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

            for group in (self.group, self.replica[0]):
                if group is not None:
                    release_group(group)
        self.group, self.replica = None, (None, 1)

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
        sd: dict[str, Any] = dict(get_model_state_dict(self.module))
        for name, g in zip(self.diloco.names, self.diloco.global_, strict=True):
            held = sd[name]
            assert isinstance(held, torch.Tensor)
            value = g.to(held.dtype)
            if isinstance(held, DTensor):  # this rank's shard of θ_global, placed as the parameter
                value = DTensor.from_local(
                    value, held.device_mesh, held.placements, run_check=False,
                    shape=held.shape, stride=held.stride(),
                )  # fmt: skip
            sd[name] = value
        # JSON beside the tensors (state.json): which syncs the model is made of.
        return {**sd, "diloco_synced_after": list(self.diloco.synced_after)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(
            self.module, {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        )


def _get(state: dict[str, torch.Tensor], key: str) -> torch.Tensor | None:
    return state[key].clone() if key in state else None


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The inner optimizer's per-parameter state as flat ``<param index>.<name>`` tensors (this rank's
    shard of a sharded one)."""
    return {
        f"{i}.{name}": (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
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
