"""Muon (train.optimizer = muon): the step against a plain reference, the orthogonalisation, which
parameters it steps, the same training on a sharded layout as on one process (with the plan's bytes),
a resume, DiLoCo's inner optimizer, and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import FAST, assert_close_losses, run_cli, train_run
from dtlab import build_model, load_config
from dtlab.analysis.model import plan_step
from dtlab.config.checks import config_warnings
from dtlab.errors import ConfigError
from dtlab.train.muon import Muon, newton_schulz
from dtlab.train.optim import build_optimizer, optimizer_groups

MUON = ["train.optimizer=muon"]


def _reference_orthogonalise(g: torch.Tensor) -> torch.Tensor:
    """Newton-Schulz written out for one matrix: X <- a X + (b X X^T + c (X X^T)^2) X, five times, on
    the wide orientation, from X = G / ||G||_F."""
    x = g.t() if g.shape[0] > g.shape[1] else g
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        a_ = x @ x.t()
        x = 3.4445 * x - 4.7750 * (a_ @ x) + 2.0315 * (a_ @ a_ @ x)
    return x.t() if g.shape[0] > g.shape[1] else x


def test_step_matches_a_plain_reference() -> None:
    """Three steps on small matrices (tall, wide, a stack of two) and a vector: Muon with Nesterov
    momentum 0.95, the update scaled by 0.2 sqrt(max(rows, cols)) and decoupled weight decay; the
    vector by torch's AdamW."""
    torch.manual_seed(0)
    shapes = [(12, 5), (6, 9), (2, 4, 7)]
    weights = [torch.randn(s) for s in shapes]
    bias = torch.randn(9)
    lr, wd, mu = 0.02, 0.1, 0.95
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    vec = torch.nn.Parameter(bias.clone())
    opt = Muon(
        [
            {"params": params, "use_muon": True, "weight_decay": wd},
            {"params": [vec], "weight_decay": 0.0},
        ],
        lr=lr,
    )
    ref_vec = torch.nn.Parameter(bias.clone())
    adamw = torch.optim.AdamW([ref_vec], lr=lr, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    ref = [w.clone() for w in weights]
    bufs = [torch.zeros_like(w) for w in weights]
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        vgrad = torch.randn(9)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        vec.grad, ref_vec.grad = vgrad.clone(), vgrad.clone()
        opt.step()
        adamw.step()
        for i, g in enumerate(grads):
            bufs[i] = mu * bufs[i] + g
            u = g + mu * bufs[i]
            mats = u.reshape(-1, *u.shape[-2:])
            o = torch.stack([_reference_orthogonalise(m) for m in mats]).reshape(u.shape)
            scale = 0.2 * math.sqrt(max(u.shape[-2], u.shape[-1]))
            ref[i] = ref[i] * (1 - lr * wd) - lr * scale * o
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach(), r, atol=1e-6, rtol=0)
    torch.testing.assert_close(vec.detach(), ref_vec.detach(), atol=1e-6, rtol=0)
    # The state Muon keeps for a matrix is one momentum buffer, the reference's.
    for p, b in zip(params, bufs, strict=True):
        assert set(opt.state[p]) == {"momentum_buffer"}
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape", [(64, 16), (16, 48), (3, 8, 8), (32, 32)])
def test_newton_schulz_is_close_to_orthogonal(shape: tuple[int, ...]) -> None:
    """Every singular value lands in the quintic's band (about 0.7 to 1.2), also of a badly
    conditioned matrix (singular values 1 to 1e-2: five steps lift a relative 1e-2 into the band,
    not much less)."""
    torch.manual_seed(1)
    g = torch.randn(shape)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    k = min(shape[-2:])
    ill = u @ torch.diag_embed(torch.logspace(0, -2, k).expand(*shape[:-2], k)) @ vh
    for m in (g, ill):
        s = torch.linalg.svdvals(newton_schulz(m))
        assert s.min() > 0.65 and s.max() < 1.25, (s.min(), s.max())


def test_groups_muon_for_block_matrices_adamw_for_the_rest() -> None:
    config = load_config(overrides=["model.preset=debug-moe", *MUON])
    model = build_model(config.model, device="cpu")
    muon, adam_decayed, adam_rest, experts = optimizer_groups(model, "muon")
    assert set(adam_decayed) == {"tok_embeddings.weight", "output.weight"}
    assert all(n.endswith("norm.weight") for n in adam_rest) and len(adam_rest) == 5
    assert experts == [f"layers.1.feed_forward.experts.w{i}" for i in (1, 2, 3)]
    assert "layers.0.attention.wq.weight" in muon and "layers.1.feed_forward.router.weight" in muon
    assert "layers.0.feed_forward.w2.weight" in muon
    assert all(
        p.ndim == 2 and n.startswith("layers.") for n, p in model.named_parameters() if n in muon
    )
    optimizer = build_optimizer(model, config.train, experts=True)
    assert isinstance(optimizer, Muon)
    flags = [g["use_muon"] for g in optimizer.param_groups]
    assert flags == [True, False, False, True]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1, 0.0, 0.1]
    # State allocated up front: one buffer per Muon matrix, AdamW's three tensors for the others.
    for group in optimizer.param_groups:
        for p in group["params"]:
            keys = {"momentum_buffer"} if group["use_muon"] else {"step", "exp_avg", "exp_avg_sq"}
            assert set(optimizer.state[p]) == keys
    # A dense model has no experts' group; the AdamW-only optimizer keeps its two.
    dense = build_model(load_config(overrides=["model.preset=debug"]).model)
    assert len(optimizer_groups(dense, "muon")) == 3 and len(optimizer_groups(dense)) == 2


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Muon under FSDP over 2 ranks (its matrices gathered whole each step), checkpointing at step 4."""
    run_dir = tmp_path_factory.mktemp("muon") / "fsdp"
    overrides = [*MUON, "parallel.strategy=fsdp", "run.comm_bytes=true", "checkpoint.every=4"]
    return run_dir, train_run(run_dir, *overrides, nproc=2, steps=8)


def test_fsdp_trains_as_one_process_and_moves_the_planned_bytes(
    fsdp_run: tuple[Path, list[dict[str, Any]]], single_reference: Any
) -> None:
    run_dir, run = fsdp_run
    ref = single_reference(*MUON, steps=8)
    assert_close_losses(run, ref)
    # Each step's collectives, counted, are the plan's to the byte: FSDP's, the step's reduction,
    # and Muon's all-gather of every block matrix's update; so is the optimizer state each rank holds.
    config = load_config(overrides=[*FAST, *MUON, "parallel.strategy=fsdp"])
    plan = plan_step(config, 2)
    adamw = plan_step(load_config(overrides=[*FAST, "parallel.strategy=fsdp"]), 2)
    matrices = sum(
        p.numel()
        for n, p in build_model(config.model).named_parameters()
        if n.startswith("layers.") and p.ndim == 2
    )
    assert plan.comm_bytes["all_gather"] - adamw.comm_bytes["all_gather"] == matrices * 4
    assert {m["comm_bytes"] for m in run} == {sum(plan.comm_bytes.values())}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["optimizer_state_bytes"] == plan.optimizer_bytes < adamw.optimizer_bytes


def test_resume_from_an_fsdp_checkpoint_on_one_process(
    fsdp_run: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The sharded momentum buffers and AdamW moments of step 4 load into one process (DCP reshards)
    and steps 5-8 train as the uninterrupted run did."""
    run_dir, run = fsdp_run
    ckpt = run_dir / "checkpoints" / "step-00000004"
    assert ckpt.is_dir()
    resumed = train_run(tmp_path / "resumed", *MUON, f"checkpoint.resume={ckpt}", steps=8)
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    for m, r in zip(resumed, run[4:], strict=True):
        assert m["loss"] == pytest.approx(r["loss"], abs=1e-5), m["step"]


def test_resume_with_another_optimizer_is_refused(
    fsdp_run: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    ckpt = fsdp_run[0] / "checkpoints" / "step-00000004"
    args = ["--set", *FAST, "train.steps=8", f"run.dir={tmp_path / 'adamw'}"]
    proc = run_cli("train", *args, f"checkpoint.resume={ckpt}")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        f"checkpoint '{ckpt}' was saved with train.optimizer = 'muon', whose state train.optimizer "
        "= 'adamw' cannot take over (allowed: muon)"
    ) in proc.stderr


def test_diloco_with_muon_inside(tmp_path: Path) -> None:
    """Two DiLoCo replicas of one rank each, Muon as the inner optimizer, syncing every 2 steps: it
    trains."""
    overrides = [*MUON, "parallel.strategy=ddp", "parallel.diloco.inner_steps=2"]
    run = train_run(tmp_path / "diloco", *overrides, nproc=2, steps=6)
    assert [m["step"] for m in run] == list(range(1, 7))
    assert all(math.isfinite(m["loss"]) for m in run)
    # The outer step is the replicas' average (the default): the loss falls by about 0.2 in 6 steps.
    assert run[-1]["loss"] < run[0]["loss"] - 0.15


def test_refusals_and_warnings() -> None:
    with pytest.raises(ConfigError, match=r"train.optimizer = 'muon' is not supported with "
                       r"train.engine = 'mlx' \(allowed: adamw\)"):  # fmt: skip
        load_config(overrides=[*MUON, "train.engine=mlx"])
    with pytest.raises(ConfigError, match=r"allowed with DiLoCo: adamw, sgd, muon"):
        load_config(overrides=["train.optimizer=demo", "parallel.diloco.inner_steps=2"])
    warned = config_warnings(load_config(overrides=[*MUON, "train.demo.topk=4"]))
    assert warned == [
        "train.demo.topk is set but train.optimizer = 'muon': the train.demo keys are DeMo's and not "
        "used (train.optimizer=demo uses them)"
    ]
    with pytest.raises(
        ValueError, match=r"Muon steps matrices; this group holds tensors of shapes \[\(3,\)\]"
    ):
        Muon([{"params": [torch.nn.Parameter(torch.ones(3))], "use_muon": True}], lr=0.1)
