"""AdamW for the MLX engine, with torch.optim.AdamW's update rule, so that both engines train the same.

Weight decay on matrices only (as the torch engine's parameter groups do), the gradients scaled by the
clip coefficient inside the update, and bias correction counted in optimizer steps: a skipped step does
not count.
"""

from __future__ import annotations

import mlx.core as mx

from dtlab.config import TrainConfig
from dtlab.errors import CheckpointError

Params = dict[str, mx.array]


class AdamW:
    """The moments of every parameter and the step count; :meth:`update` returns the new parameters."""

    def __init__(self, params: Params, train: TrainConfig) -> None:
        self.names = sorted(params)
        self.betas = train.betas
        self.eps = float(train.eps)
        self.m: Params = {k: mx.zeros_like(v) for k, v in params.items()}
        self.v: Params = {k: mx.zeros_like(v) for k, v in params.items()}
        self.steps = 0  # bias correction's t
        self.decay = {k: train.weight_decay if v.ndim >= 2 else 0.0 for k, v in params.items()}
        self._update = mx.compile(self._adamw) if train.compile else self._adamw

    def update(self, params: Params, grads: Params, lr: float, coef: float) -> Params:
        """One step: the new parameters (``grads`` scaled by ``coef`` first); the moments are kept."""
        self.steps += 1
        b1, b2 = self.betas
        # One array for every scalar, so that a compiled update is traced once, not once per lr.
        hyper = mx.array([lr, coef, 1 - b1**self.steps, 1 - b2**self.steps])
        params, self.m, self.v = self._update(params, grads, self.m, self.v, hyper)
        mx.eval(params, self.m, self.v)
        return params

    def _adamw(
        self, params: Params, grads: Params, m: Params, v: Params, hyper: mx.array
    ) -> tuple[Params, Params, Params]:
        b1, b2 = self.betas
        lr, coef, bc1, bc2 = hyper[0], hyper[1], hyper[2], hyper[3]
        new_p, new_m, new_v = {}, {}, {}
        for k in self.names:
            g = grads[k] * coef
            mk = b1 * m[k] + (1 - b1) * g
            vk = b2 * v[k] + (1 - b2) * g * g
            p = params[k] * (1 - lr * self.decay[k]) if self.decay[k] else params[k]
            new_p[k] = p - (lr / bc1) * mk / (mx.sqrt(vk) / mx.sqrt(bc2) + self.eps)
            new_m[k], new_v[k] = mk, vk
        return new_p, new_m, new_v

    def arrays(self) -> Params:
        """The moments, named ``m.NAME`` and ``v.NAME`` (the checkpoint's optimizer file)."""
        return {f"m.{k}": self.m[k] for k in self.names} | {f"v.{k}": self.v[k] for k in self.names}

    def load(self, arrays: Params, steps: int, where: str) -> None:
        """The moments from :meth:`arrays`' form and the step count; ``where`` names the file."""
        want = {f"{s}.{k}" for s in ("m", "v") for k in self.names}
        if set(arrays) != want:
            raise CheckpointError(
                f"{where} does not fit the model (missing {sorted(want - set(arrays))[:3]}, "
                f"unexpected {sorted(set(arrays) - want)[:3]})"
            )
        self.m = {k: arrays[f"m.{k}"] for k in self.names}
        self.v = {k: arrays[f"v.{k}"] for k in self.names}
        self.steps = steps
        mx.eval(self.m, self.v)
