"""What a checkpoint holds: named stateful parts (anything with ``state_dict``/``load_state_dict``),
each state dict split into tensors and JSON.

Tensors (model parameters, optimizer moments) go through ``torch.distributed.checkpoint`` under the
keys ``model.<fqn>`` and ``optim.state.<fqn>.<name>``, with fully qualified names of the plain model, so
a checkpoint saved under one strategy and world size loads under any other (DCP reshards). Everything
else (counters, data position, scheduler, loss scaler, optimizer param groups) is JSON, so loading a
checkpoint never unpickles anything.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch.distributed.checkpoint.state_dict import (  # the private two: see StagedOptimizerState
    _get_fqns,
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Health:
    """Counts of optimizer steps skipped because the loss or the gradients were not finite."""

    bad_steps: int = 0  # in total
    bad_in_a_row: int = 0
    rollbacks: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "bad_steps": self.bad_steps,
            "bad_in_a_row": self.bad_in_a_row,
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bad_steps = int(state["bad_steps"])
        self.bad_in_a_row = int(state["bad_in_a_row"])
        self.rollbacks = int(state["rollbacks"])


class ModelState:
    """The model's parameters as one stateful part: full state dict keys of the plain model, whatever
    wraps it (DDP, FSDP's DTensor shards)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state)


class OptimizerState:
    """The optimizer as one stateful part: its per-parameter state (tensors) keyed by the plain
    model's parameter names, and its param groups (JSON)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        return dict(get_optimizer_state_dict(self.module, self.optimizer))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # An optimizer without per-parameter state (plain SGD) saves no tensors, so its "state" comes
        # back missing, and torch would read what is left as a flattened state dict.
        state = {"state": {}, **state}
        set_optimizer_state_dict(self.module, self.optimizer, cast(Any, state))


class StagedOptimizerState:
    """The optimizer of a pipeline rank (or of a ZeRO-1 rank) as one stateful part, in
    :class:`OptimizerState`'s format.

    Each rank holds the state of its stages' parameters only (ZeRO-1: of the parameters it owns),
    keyed by the whole model's names, so the
    ranks' parts together are a whole-model optimizer state that any layout loads. The param groups
    list every parameter of the whole model (``group_names``), as a one-process run's would.
    (``get_optimizer_state_dict`` is not used: it loses the state of all but one of several FSDP roots
    on one rank, which is what a rank with several stages has.)
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        group_names: list[list[str]],
    ) -> None:
        self.module, self.optimizer, self.group_names = module, optimizer, group_names

    def _params(self) -> dict[str, torch.nn.Parameter]:
        """The parameters the optimizer holds, by the whole model's names."""
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        out = {}
        for name, p in self.module.named_parameters():
            if id(p) in held:
                (fqn,) = _get_fqns(self.module, name)
                out[fqn] = p
        return out

    def state_dict(self) -> dict[str, Any]:
        _init_optim_state(self.optimizer)  # the tensors must exist for DCP to load into them
        state = {name: dict(self.optimizer.state[p]) for name, p in self._params().items()}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
            for g, names in zip(self.optimizer.param_groups, self.group_names, strict=True)
        ]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, p in self._params().items():
            mine = self.optimizer.state[p]
            for k, v in state["state"][name].items():
                held = mine.get(k)
                if isinstance(held, torch.Tensor) and held is not v:
                    held.copy_(v)  # DCP loads in place; a tensor given otherwise is copied
                elif not isinstance(held, torch.Tensor):
                    mine[k] = v
        for g, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})


def split_tensors(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``tree`` as (its tensors, everything else), both nested as in ``tree``; dicts left empty by the
    split are dropped. Tensors go through DCP, the rest is JSON."""
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            t, r = split_tensors(v)
            if t:
                tensors[k] = t
            if r:
                rest[k] = r
        elif isinstance(v, torch.Tensor):
            tensors[k] = plain_tensor(v)
        else:
            rest[k] = v
    return tensors, rest


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor (or a DTensor of one) over the same storage: a weight that torchao's
    float8 all-gather wraps (``WeightWithDynamicFloat8CastTensor``, and the optimizer moments made
    like it) is a tensor subclass, which DCP would pickle whole, and a checkpoint is never
    unpickled; its value is the plain tensor it holds, so saving and loading in place are those of
    the same model without float8."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = t._local_tensor
        inner = plain_tensor(local)
        if inner is local:
            return t
        return DTensor.from_local(
            inner, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    data = t.data if isinstance(t, torch.nn.Parameter) else t
    wrapped = getattr(data, "_tensor", None)
    if type(data) is not torch.Tensor and isinstance(wrapped, torch.Tensor):
        return wrapped
    return t


def merge_tensors(tensors: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_tensors`."""
    out = dict(rest)
    for k, v in tensors.items():
        out[k] = merge_tensors(v, rest.get(k, {})) if isinstance(v, dict) else v
    return out


def rng_state() -> dict[str, Any]:
    """This rank's random number generator states, as JSON."""

    def enc(t: torch.Tensor) -> str:
        return base64.b64encode(t.cpu().numpy().tobytes()).decode()

    out: dict[str, Any] = {"torch": enc(torch.get_rng_state()), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [enc(s) for s in torch.cuda.get_rng_state_all()]
    return out


def load_rng_state(state: dict[str, Any]) -> None:
    def dec(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    torch.set_rng_state(dec(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(dec(s), i)
