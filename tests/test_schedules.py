"""Learning-rate schedules and the fp16 loss scaler."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dtlab.config import TrainConfig
from dtlab.train.precision import LossScaler
from dtlab.train.schedules import build_scheduler, lr_at


def cfg(**kw: object) -> TrainConfig:
    base = dict(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_warmup_is_linear_and_reaches_peak(schedule: str) -> None:
    t = cfg(schedule=schedule)
    assert [lr_at(s, t) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr_at(10, t) <= 1.0
    assert max(lr_at(s, t) for s in range(100)) == pytest.approx(1.0)


def test_decays_end_at_min_lr() -> None:
    for schedule in ("cosine", "linear", "wsd"):
        assert lr_at(99, cfg(schedule=schedule)) == pytest.approx(0.1), schedule
    assert lr_at(99, cfg(schedule="constant")) == 1.0


def test_cosine_midpoint_and_monotonic() -> None:
    t = cfg(schedule="cosine")
    lrs = [lr_at(s, t) for s in range(10, 100)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    mid = 10 + 45 - 1  # progress = 0.5
    assert lr_at(mid, t) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_wsd_is_stable_then_decays() -> None:
    t = cfg(schedule="wsd", wsd_decay_fraction=0.2)
    assert all(lr_at(s, t) == 1.0 for s in range(10, 80))
    assert lr_at(80, t) < 1.0 and lr_at(90, t) < lr_at(80, t)


def test_scheduler_drives_optimizer_and_has_state() -> None:
    t = cfg(schedule="linear")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    sched = build_scheduler(opt, t)
    for _ in range(15):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(15, t))
    state = sched.state_dict()
    assert state["last_epoch"] == 15


def test_loss_scaler_backs_off_on_overflow_and_grows() -> None:
    scaler = LossScaler(True, init_scale=1024.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1024.0, 2048.0, 4096.0])
    assert scaler.unscale_([p]).item() == 0.0
    torch.testing.assert_close(p.grad, torch.tensor([1.0, 2.0, 4.0]))
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 2048.0
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert scaler.unscale_([p]).item() == 1.0
    scaler.update(True)
    assert scaler.scale == 1024.0
    restored = LossScaler(True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale == 1024.0


def test_disabled_scaler_is_identity() -> None:
    scaler = LossScaler(False)
    loss = torch.tensor(3.0)
    assert scaler.scale_loss(loss) is loss
    assert scaler.unscale_([]).item() == 0.0


def test_loss_scaler_unscales_in_a_fixed_number_of_kernels_however_many_parameters() -> None:
    # One fused call per device and dtype (GradScaler's), not a multiply, a check and a max per
    # parameter: the ops dispatched do not grow with the parameters.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    def unscale(n: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> list[str]:
        params = [
            torch.nn.Parameter(torch.ones(4, dtype=dtypes[i % len(dtypes)])) for i in range(n)
        ]
        for p in params:
            p.grad = torch.full_like(p, 8.0)
        params[-1].grad[0] = float("nan")
        scaler = LossScaler(True, init_scale=8.0)
        with Count() as count:
            found = scaler.unscale_(params)
        assert found.item() == 1.0
        assert all(float(p.grad[-1]) == 1.0 for p in params)
        return count.ops

    few, many = unscale(3), unscale(30)
    assert len(few) == len(many), (few, many)
    assert sum("_amp_foreach_non_finite_check_and_unscale_" in op for op in many) == 1
    # Two dtypes: one call each.
    mixed = unscale(30, (torch.float32, torch.float16))
    assert sum("_amp_foreach_non_finite_check_and_unscale_" in op for op in mixed) == 2
