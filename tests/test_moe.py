"""The mixture-of-experts feed-forward: routing, dispatch and combine against a naive reference,
load balancing (bias and auxiliary loss), training, layouts, checkpoints, and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from conftest import FAST, checkpoint_tensors, run_cli, train_run
from dtlab.config import ConfigError, load_config
from dtlab.models.args import MoEArgs
from dtlab.models.llama import FeedForward, build_model
from dtlab.models.moe import MoE, aux_loss, moe_layers
from dtlab.train.routing import moe_aux_loss, routing_step

MOE = ["model.preset=debug-moe"]


def make_moe(seed: int = 0, dim: int = 16, shared: bool = True, **kw: Any) -> MoE:
    """An MoE layer with random weights (the shared expert's included) from ``seed``."""
    args = MoEArgs(**{"experts": 4, "expert_dim": 24, "top_k": 2, **kw})
    torch.manual_seed(seed)
    moe = MoE(dim, args, FeedForward(dim, args.expert_dim) if shared else None)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
        moe.init_buffers()
    return moe


def naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, masked to each token's top-k and weighted by its gates."""
    a = moe.args
    h = x.reshape(-1, x.shape[-1])
    logits = F.linear(h, moe.router.weight)
    scores = logits.softmax(-1) if a.score == "softmax" else logits.sigmoid()
    select = scores if moe.expert_bias is None else scores + moe.expert_bias
    mask = torch.zeros_like(scores).scatter(1, select.topk(a.top_k, -1).indices, 1.0)
    gates = scores * mask
    if a.renormalize or a.score == "sigmoid":
        gates = gates / gates.sum(-1, keepdim=True)
    w = moe.experts
    out = sum(
        gates[:, e : e + 1] * F.linear(F.silu(F.linear(h, w.w1[e])) * F.linear(h, w.w3[e]), w.w2[e])
        for e in range(a.experts)
    )
    assert isinstance(out, torch.Tensor)
    if moe.shared is not None:
        out = out + moe.shared(h)
    return out.view(x.shape)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"score": "sigmoid", "bias_balance": True},
        {"renormalize": False, "top_k": 3},
        {"top_k": 1, "shared": False},
    ],
)
def test_moe_equals_the_naive_masked_reference(kw: dict[str, Any]) -> None:
    moe = make_moe(**kw)
    if moe.expert_bias is not None:  # a bias that changes some tokens' choice
        moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(3, 10, 16, requires_grad=True)
    out = moe(x)
    ref_x = x.detach().clone().requires_grad_()
    ref = naive(moe, ref_x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *moe.parameters()], g)
    ref_grads = torch.autograd.grad(ref, [ref_x, *moe.parameters()], g)
    for name, a, b in zip(
        ["x"] + [n for n, _ in moe.named_parameters()], grads, ref_grads, strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # Deterministic: the same input gives the same bits.
    assert torch.equal(moe(x), out)


def test_every_token_goes_to_exactly_top_k_experts() -> None:
    from dtlab.models.moe import route

    moe = make_moe(experts=8, top_k=3, score="sigmoid", bias_balance=True)
    moe.expert_bias.copy_(torch.linspace(-0.5, 0.5, 8))  # type: ignore[union-attr]
    x = torch.randn(5, 7, 16)
    scores = F.linear(x.reshape(-1, 16), moe.router.weight).sigmoid()
    ids, gates = route(scores, 3, moe.expert_bias, renormalize=True)
    assert all(len(set(row)) == 3 for row in ids.tolist())  # three distinct experts each
    torch.testing.assert_close(gates.sum(-1), torch.ones(35))
    moe(x)  # a training forward counts the routed tokens: every token, top_k times
    assert moe.tokens_per_expert.sum().item() == 35 * 3
    assert moe.tokens_per_expert.tolist() == torch.bincount(ids.flatten(), minlength=8).tolist()


def test_an_overridden_routing_sends_the_chosen_experts_gated_by_the_scores() -> None:
    """routing_override chooses the experts (here expert 3 and 1 for every token) in place of the
    scores' top k; the output is the naive reference's for those experts with the scores' gates, the
    router still gets a gradient, and leaving the context routes by the scores again."""
    from dtlab.models.moe import routing_override

    moe = make_moe(experts=4, top_k=2)
    x = torch.randn(3, 5, 16)

    def choose(tokens: int, args: MoEArgs, device: torch.device) -> torch.Tensor:
        return torch.tensor([[3, 1]], device=device).expand(tokens, args.top_k)

    with routing_override(choose):
        out = moe(x)
    assert moe.tokens_per_expert.tolist() == [0, 15, 0, 15]
    h = x.reshape(-1, 16)
    scores = F.linear(h, moe.router.weight).softmax(-1)[:, [3, 1]]
    gates = scores / scores.sum(-1, keepdim=True)
    e = moe.experts
    ref = sum(
        gates[:, [j]] * F.linear(F.silu(F.linear(h, e.w1[i])) * F.linear(h, e.w3[i]), e.w2[i])
        for j, i in enumerate((3, 1))
    )
    assert moe.shared is not None
    torch.testing.assert_close(out.reshape(-1, 16), ref + moe.shared(h))
    out.sum().backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    moe.reset_routing()
    moe(x)
    assert moe.tokens_per_expert.tolist() != [0, 15, 0, 15]


def _skewed(bias_balance: bool) -> tuple[MoE, torch.Tensor]:
    """A router that sends nearly every token to expert 0 (top-1 of 4): the others' scores differ
    from token to token (random rows), expert 0's is far above them."""
    moe = make_moe(experts=4, top_k=1, dim=8, bias_balance=bias_balance, bias_rate=0.003)
    with torch.no_grad():
        moe.router.weight[0, 0] = 3.0
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
    x[:, 0] = x[:, 0].abs() + 1.0
    return moe, x


def imbalance(loads: torch.Tensor) -> float:
    return (loads.max() / loads.mean()).item()


def test_the_bias_update_evens_a_skewed_load() -> None:
    moe, x = _skewed(bias_balance=True)
    moe(x)
    before = imbalance(moe.tokens_per_expert)
    assert before > 3.9  # max/mean is 4 when every token picks one expert
    moe.reset_routing()
    seen = []
    for _ in range(300):
        moe(x)
        m = routing_step(moe)  # no process group: this process's loads
        assert moe.tokens_per_expert.sum() == 0  # read and reset
        seen.append(m["moe_imbalance"])
    # Sign steps of a fixed size end in a small oscillation around the balance, never back near 4.
    assert max(seen[-50:]) < 1.6, (before, seen[::10])
    assert m["moe_bias"] > 0.3
    # The bias chooses, the scores gate: the gate weights are still the raw softmax probabilities.
    bias = moe.expert_bias
    assert bias is not None and bias[0] < 0 < bias[1:].min()
    # Without the bias nothing moves.
    plain, _ = _skewed(bias_balance=False)
    for _ in range(20):
        plain(x)
        routing_step(plain)
    plain(x)
    assert imbalance(plain.tokens_per_expert) > 3.5


def test_aux_loss_against_a_hand_computation() -> None:
    # Both tokens pick expert 0: f = (1, 0), P = (0.65, 0.35), loss = 2 * (1 * 0.65) = 1.3.
    scores = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    assert aux_loss(scores, torch.tensor([2, 0]), 1).item() == pytest.approx(1.3)
    # One token each: f = (0.5, 0.5), P = (0.55, 0.45): 2 * (0.275 + 0.225) = 1, the balanced value.
    scores = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    assert aux_loss(scores, torch.tensor([1, 1]), 1).item() == pytest.approx(1.0)
    # Through the layer: aux_coef times the same formula, differentiable in the router only
    # through P (f counts tokens).
    moe = make_moe(aux_coef=0.5)
    x = torch.randn(40, 16)
    moe(x)
    logits = F.linear(x, moe.router.weight).softmax(-1)
    counts = torch.bincount(logits.topk(2, -1).indices.flatten(), minlength=4)
    hand = 4 * ((counts / 80) * logits.mean(0)).sum()
    taken = moe_aux_loss(moe)
    assert taken is not None and taken.item() == pytest.approx(0.5 * hand.item(), rel=1e-5)
    assert moe_aux_loss(moe) is None  # taken once
    taken.backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


def test_moe_parameters_follow_the_seeded_initial_values() -> None:
    config = load_config(None, MOE)
    model = build_model(config.model, "cpu")
    names = [n for n, _ in model.named_parameters()]
    assert (
        "layers.1.feed_forward.experts.w1" in names and "layers.0.feed_forward.w1.weight" in names
    )
    for name, p in model.named_parameters():
        assert torch.equal(p, model.initial_value(name, p.shape)), name
    # Residual output projections of experts are scaled as the dense ones are.
    w2 = dict(model.named_parameters())["layers.1.feed_forward.experts.w2"]
    assert w2.std().item() == pytest.approx(0.02 / 2, rel=0.1)
    assert "layers.1.feed_forward.expert_bias" in model.state_dict()
    assert len(moe_layers(model)) == 1  # dense_layers = 1 of 2
    no_bias = build_model(load_config(None, [*MOE, "model.moe.balance=aux"]).model)
    assert not any("expert_bias" in k for k in no_bias.state_dict())


def test_a_preset_keeps_its_moe_keys_beside_the_given_ones() -> None:
    moe = load_config(None, [*MOE, "model.moe.top_k=1"]).model.moe
    assert (moe.experts, moe.top_k, moe.expert_dim, moe.shared_experts) == (4, 1, 64, 1)
    assert load_config(None, ["model.preset=debug"]).model.args().moe is None


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "parallel.tp=2 parallel.sequence_parallel=true",
            "parallel.sequence_parallel = true is not supported with model.moe.experts = 4",
        ),
        ("train.engine=mlx", "train.engine = 'mlx' is not supported with model.moe.experts = 4"),
        (
            "parallel.pp=2 model.moe.balance=aux",
            "parallel.pp = 2 is not supported with model.moe.experts = 4",
        ),
        ("parallel.diloco.inner_steps=2", "parallel.diloco.inner_steps = 2 is not supported"),
        ("model.moe.top_k=5", "model.moe.top_k = 5 is more than model.moe.experts = 4"),
        ("model.moe.dense_layers=2", "model.moe.dense_layers = 2 leaves no MoE block"),
        ("model.moe.score=relu", "model.moe.score = 'relu'"),
        ("model.moe.balance=both", "model.moe.balance = 'both'"),
    ],
)
def test_what_does_not_compose_is_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, [*MOE, "parallel.strategy=ddp", *override.split()])


def test_train_reports_routing_and_its_loss_falls(tmp_path: Path) -> None:
    m = train_run(tmp_path / "run", *MOE, "model.moe.balance=bias+aux", steps=12)
    assert m[-1]["loss"] < m[0]["loss"] - 0.3, [r["loss"] for r in m]
    tokens = 8 * 64  # global batch x seq_len, each routed to top_k = 2 experts in 1 MoE block
    for r in m:
        assert sum(r["moe_load"]) == tokens * 2 and len(r["moe_load"]) == 4
        assert r["moe_imbalance"] == pytest.approx(max(r["moe_load"]) / (tokens * 2 / 4))
        assert 0.9 < r["moe_aux_loss"] < 4  # 1 when even, at most experts
    # The bias moves by bias_rate = 1e-3 per step, in every expert that is off the mean.
    assert m[0]["moe_bias"] == pytest.approx(1e-3)
    assert all(0 < r["moe_bias"] <= r["step"] * 1e-3 + 1e-7 for r in m)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_counts_each_token_once(tmp_path: Path, mode: str) -> None:
    # A recomputed block neither counts its tokens again nor saves other tensors than its forward.
    common = [*MOE, "model.moe.balance=bias+aux"]
    plain = train_run(tmp_path / "plain", *common, steps=3)
    ac = train_run(tmp_path / mode, *common, f"train.activation_checkpointing={mode}", steps=3)
    for key in ("loss", "moe_load", "moe_aux_loss", "moe_bias"):
        assert [r[key] for r in ac] == [r[key] for r in plain], key


def test_layouts_train_as_one_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("verify", "--layouts", "single,ddp:2,fsdp:2,zero:2", "--steps", "3",
                   "--out", str(out), "--set", *FAST, *MOE, "model.moe.balance=bias+aux",
                   "model.moe.bias_rate=0.05", "train.micro_batch_size=2",
                   "train.grad_clip=0.1", "--checks", "export")  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result = json.loads((out / "verify.json").read_text())
    rows = result["rows"]
    assert [r["layout"] for r in rows] == ["ddp:2", "fsdp:2", "zero:2"]
    for row in rows:
        assert row["max_loss_diff"] <= 1e-5 and row["max_param_diff"] <= 1e-5, row
    # Each layout's export (Hugging Face's ERNIE 4.5 MoE: the family whose router has the selection
    # bias) holds the reference's tensors, the balancing bias among them (after an odd number of
    # steps of +-rate, no element is 0).
    exports = [c for s in result["state"] for c in s["checks"]]
    assert len(exports) == 4 and all(c["ok"] for c in exports), exports
    from safetensors.torch import load_file

    tensors = load_file(str(out / "0-single-export" / "model.safetensors"))
    assert tensors["model.layers.1.mlp.moe_statics.e_score_correction_bias"].abs().min() > 0


def test_a_checkpoint_resumes_exactly_with_its_bias(tmp_path: Path) -> None:
    # A constant learning rate, so that a run of 3 steps resumed to 4 trains as one run of 4. At
    # initialisation the router's scores are close: the bias (bias_rate per step) picks the experts,
    # so a resume that lost it would route step 4's tokens differently.
    common = [*MOE, "train.schedule=constant", "train.warmup_steps=0", "model.moe.bias_rate=0.02"]
    whole = train_run(tmp_path / "whole", *common, steps=4)
    run = tmp_path / "run"
    train_run(run, *common, steps=3)
    resumed = train_run(run, *common, "checkpoint.resume=auto", steps=4)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    assert [r["moe_load"] for r in resumed] == [r["moe_load"] for r in whole]
    key = "model.layers.1.feed_forward.expert_bias"
    saved = checkpoint_tensors(run / "checkpoints" / "step-00000003")
    assert saved[key].abs().max() > 0.01
    final = checkpoint_tensors(run / "checkpoints" / "step-00000004")
    assert torch.equal(
        final[key], checkpoint_tensors(tmp_path / "whole/checkpoints/step-00000004")[key]
    )


def test_a_skipped_step_does_not_move_the_bias(tmp_path: Path) -> None:
    # After step 1 every bias is +-1e-3; a step taken moves each by 1e-3 again (to 0 or +-2e-3), so
    # a largest |bias| of exactly 1e-3 after step 2 says step 2 (a NaN loss, skipped) moved nothing.
    args = ["train", "--set", *FAST, *MOE, "train.steps=3", f"run.dir={tmp_path / 'run'}"]
    proc = run_cli(*args, env={"DTLAB_FAULTS": "nan@2"})
    assert proc.returncode == 0, proc.stderr
    m = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert m[1].get("bad") and m[0]["moe_bias"] == pytest.approx(1e-3)
    assert m[1]["moe_bias"] == pytest.approx(1e-3)
    assert m[2]["moe_bias"] != pytest.approx(1e-3)


def test_moe_keys_on_a_dense_model_are_said_to_be_unused() -> None:
    from dtlab.config import config_warnings

    dense = load_config(None, ["model.preset=debug", "model.moe.top_k=4"])
    (warning,) = [w for w in config_warnings(dense) if "model.moe" in w]
    assert "model.moe.top_k is set but model.moe.experts = 0" in warning
    assert not [w for w in config_warnings(load_config(None, MOE)) if "model.moe" in w]
