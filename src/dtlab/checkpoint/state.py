"""What a checkpoint holds: every stateful part of training, split into tensors and JSON.

Tensors (model parameters, optimizer moments) go through ``torch.distributed.checkpoint`` under the
keys ``model.<fqn>`` and ``optim.state.<fqn>.<name>``, with fully qualified names of the plain model, so
a checkpoint saved under one strategy and world size loads under any other (DCP reshards). Everything
else (counters, data position, scheduler, loss scaler, optimizer hyper-parameters) is JSON, so loading
a checkpoint never unpickles anything.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


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


@dataclass
class TrainingParts:
    """The model and optimizer (tensors) and the named JSON-stateful parts of one run."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    others: dict[str, Stateful] = field(default_factory=dict)
    # Gradient compression state (error feedback residuals, PowerSGD memories): each rank's own, saved
    # under "comm.rank<R>.<name>" and restored only on the same world size.
    comm: Any = None
    rank: int = 0

    @property
    def comm_prefix(self) -> str:
        return f"comm.rank{self.rank}."

    def tensor_state(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """``({"model": ..., "optim": {"state": ...}, "comm.rank<R>.*": ...}, optimizer param_groups)``."""
        msd, osd = get_state_dict(self.module, self.optimizer)
        groups: list[dict[str, Any]] = osd["param_groups"]  # type: ignore[assignment]
        out: dict[str, Any] = {"model": msd, "optim": {"state": osd["state"]}}
        if self.comm is not None:
            out |= {self.comm_prefix + k: v for k, v in self.comm.state_dict().items()}
        return out, groups

    def json_state(self, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            **{name: part.state_dict() for name, part in self.others.items()},
            "optim_param_groups": param_groups,
        }

    def load(self, tensors: dict[str, Any], state: dict[str, Any]) -> None:
        """Load what ``dcp.load`` filled into ``tensors`` and the JSON ``state`` into every part."""
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=tensors["model"],
            optim_state_dict={
                "state": tensors["optim"]["state"],
                "param_groups": state["optim_param_groups"],
            },
        )
        for name, part in self.others.items():
            part.load_state_dict(state[name])
        if self.comm is not None:
            n = len(self.comm_prefix)
            self.comm.load_state_dict(
                {k[n:]: v for k, v in tensors.items() if k.startswith(self.comm_prefix)}
            )


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
