"""The optimizer state is allocated when training is built, as the first step would allocate it."""

from __future__ import annotations

from typing import Any, get_args

import pytest
import torch
from torch import nn

from conftest import run_worker
from dtlab.analysis.model import plan_step
from dtlab.config import TrainConfig, load_config
from dtlab.parallel import DistInfo
from dtlab.train.loop import Training, build_training
from dtlab.train.optim import init_state, state_bytes
from dtlab.train.optimizer_step import accumulate_gradients, train_step

OPTIMIZERS = get_args(TrainConfig.model_fields["optimizer"].annotation)
BASE = [
    "model.preset=debug",
    "data.source=synthetic",
    "data.seq_len=32",
    "train.global_batch_size=4",
]
CPU = DistInfo(0, 1, 0, 1, torch.device("cpu"), None)


def _training(*overrides: str) -> tuple[Training, Any]:
    config = load_config(overrides=[*BASE, *overrides])
    return build_training(config, CPU), config


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_state_exists_after_build_with_the_plans_bytes(optimizer: str) -> None:
    tr, config = _training(f"train.optimizer={optimizer}")
    tr.loader.close()
    held = state_bytes(tr.optimizer)
    assert held == plan_step(config, 1).optimizer_bytes
    if optimizer != "sgd":  # momentum-free SGD has no state at all
        assert held > 0


def _form(state: dict[str, Any]) -> dict[str, tuple[object, ...]]:
    return {
        k: (type(v), v.dtype, v.device, tuple(v.shape), v.stride(), v.requires_grad)
        for k, v in state.items()
    }


OPTIONS = [{"fused": True}, {"foreach": True}, {"foreach": False}, {"fused": True, "amsgrad": True}]
OPTION_IDS = ["fused", "foreach", "forloop", "amsgrad"]


def _compare_with_lazy(options: dict[str, bool], device: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 3)).to(device)
    copy = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 3)).to(device)
    copy.load_state_dict(model.state_dict())
    eager = torch.optim.AdamW(model.parameters(), lr=0.1, **options)
    lazy = torch.optim.AdamW(copy.parameters(), lr=0.1, **options)
    init_state(eager)
    assert all(len(eager.state[p]) > 0 for p in model.parameters()) and not lazy.state
    x = torch.randn(5, 8, device=device)
    for _ in range(2):
        for m, opt in ((model, eager), (copy, lazy)):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        for p, q in zip(model.parameters(), copy.parameters(), strict=True):
            assert _form(eager.state[p]) == _form(lazy.state[q])
            assert all(torch.equal(eager.state[p][k], lazy.state[q][k]) for k in eager.state[p])
            assert torch.equal(p, q)


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_adamw_state_is_what_its_first_step_creates(options: dict[str, bool]) -> None:
    """Every tensor torch's lazy initialisation makes (step counter, moments, amsgrad's maximum),
    in its dtype, device, shape and strides, and the steps after it compute the same bits."""
    _compare_with_lazy(options, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_cuda_adamw_state_is_what_its_first_step_creates(options: dict[str, bool]) -> None:
    """On CUDA the step counter's place differs by implementation (on the GPU when fused, on the
    host otherwise): made where torch's first step makes it."""
    _compare_with_lazy(options, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_first_step_allocates_no_optimizer_state() -> None:
    """The GPU memory held after the first step (gradients dropped) is what was held before it."""
    config = load_config(overrides=BASE)
    cuda = torch.device("cuda", 0)
    tr = build_training(config, DistInfo(0, 1, 0, 1, cuda, None))
    batch = tr.loader.build_step(0)
    tr.loader.close()
    assert state_bytes(tr.optimizer) == plan_step(config, 1).optimizer_bytes
    # A forward and backward first: cuBLAS's workspaces are allocated by the first matrix products.
    accumulate_gradients(tr.pm, tr.scaler, batch, config, cuda)
    tr.optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(cuda)
    train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, batch, config, cuda)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(cuda) == before


def test_a_loaded_state_is_kept() -> None:
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(3)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    init_state(opt)
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items())
    assert float(opt.state[p]["step"]) == 1.0


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_training_is_bit_identical_to_a_lazily_initialised_optimizer(optimizer: str) -> None:
    """Four steps, with clipping active, of the state made up front and of the same optimizer whose
    state its first step creates (torch's own way): the same loss, norm, parameters and state."""
    clip = ["train.grad_clip=0.05"]
    (eager, config), (lazy, _) = (_training(f"train.optimizer={optimizer}", *clip) for _ in "ab")
    if optimizer == "demo":  # DeMo's momenta, which its first step created before
        lazy.optimizer.local.momenta.clear()  # type: ignore[attr-defined]
    else:
        lazy.optimizer.state.clear()
    cpu = torch.device("cpu")
    made = [t.data_ptr() for t in _state_tensors(eager.optimizer)]
    for step in range(4):
        batch = eager.loader.build_step(step)
        a, b = (
            train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, batch, config, cpu)
            for tr in (eager, lazy)
        )
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), step
        assert a["grad_norm"] > 0.05  # clipping is active
    for p, q in zip(eager.model.parameters(), lazy.model.parameters(), strict=True):
        assert torch.equal(p, q)
        s, t = eager.optimizer.state[p], lazy.optimizer.state[q]
        assert s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s)
    # The steps allocated no state of their own: the tensors made at build are the ones trained.
    assert [t.data_ptr() for t in _state_tensors(eager.optimizer)] == made
    for tr in (eager, lazy):
        tr.loader.close()


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    local = getattr(optimizer, "local", None)  # DeMo's momenta
    held = [v for s in optimizer.state.values() for v in s.values()]
    return held + (list(local.momenta.values()) if local is not None else [])


@pytest.mark.parametrize(
    "layout",
    [["parallel.strategy=fsdp"], ["parallel.strategy=ddp", "parallel.sharding=optimizer"]],
    ids=["fsdp", "zero1"],
)
def test_sharded_state_exists_after_build_as_dtensors_like_the_first_steps(
    layout: list[str],
) -> None:
    """FSDP's and ZeRO-1's state on two gloo ranks: each rank's share of the plan's bytes right after
    build, DTensors placed as the lazily created ones, and three steps trained to the same bits."""
    run_worker("optim_state_worker.py", 2, *layout)
