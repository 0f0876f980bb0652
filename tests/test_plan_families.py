"""``dtlab plan`` of the model families' options (``model.head_dim``, ``qkv_bias``, ``qk_norm``,
``sliding_window``) against the real code of the same rank (``--check``: fake process group, fake
tensors): attention n_heads x head_dim wide, the q/k norms' kept inputs and gains, the biases split
with their projections, a window's mask made once a forward; and the plan on the published shapes."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import close, planned_state
from dtlab.analysis.activations import attention_widths, block_matmul_params
from dtlab.analysis.check import check_rank, measure_fake
from dtlab.analysis.devices import PROFILES
from dtlab.analysis.model import flops_per_token, plan_step
from dtlab.analysis.plan import plan
from dtlab.config import Config, load_config
from dtlab.dims import ParallelDims
from dtlab.models.llama import build_model, count_params

SMALL = ["model.preset=debug", "data.seq_len=64", "train.global_batch_size=8"]

# On the debug model (dim 64, 4 heads, 2 kv heads, 2 blocks, 64 tokens a sequence).
FAMILIES = {
    # Qwen3: 4 heads of 32 (attention 128 wide on a 64-wide model), per-head q/k norms.
    "qwen3": ["model.head_dim=32", "model.qk_norm=true"],
    # Qwen2: biases on q, k and v (split with their rows by tensor parallelism).
    "qwen2": ["model.qkv_bias=true"],
    # Mistral: each token sees itself and the 15 before it: an additive [64, 64] mask.
    "mistral": ["model.sliding_window=16"],
}
LAYOUTS = {
    "single": (1, []),
    "tp:2": (2, ["parallel.tp=2"]),
    "fsdp:2": (2, ["parallel.strategy=fsdp"]),
}
# Checked with a GPU's attention kernels as well: a window's mask takes flash away (the
# memory-efficient kernel on expanded key/value heads); so do Qwen3's q/k norms under autocast,
# whose float32 gains make the queries float32.
ON_A_GPU = {("qwen3", "single", "bf16"), ("mistral", "single", "bf16"), ("mistral", "tp:2", "bf16")}


def _config(*overrides: str) -> Config:
    return load_config(overrides=[*SMALL, *overrides])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_plan_of_a_family_is_the_checked_code(family: str, layout: str, precision: str) -> None:
    """The step's peak and every component alive then within 3% of the checked code's, the
    activations within 1%, the state between steps to the byte (the biases' tensor-parallel
    shards, the q/k gains whole on every rank), and the bytes sent exact (tensor parallelism's
    q/k gains' all-reduce and the loss-parallel cross-entropy's, issued inside DTensor's dispatch,
    among them)."""
    nproc, overrides = LAYOUTS[layout]
    config = _config(*FAMILIES[family], *overrides, f"train.precision={precision}")
    for target in ["cpu", "cuda"] if (family, layout, precision) in ON_A_GPU else ["cpu"]:
        _check(config, nproc, target)


def _check(config: Config, nproc: int, target: str) -> None:
    rank = nproc - 1
    measured = measure_fake(config, nproc, 1, rank, target)
    r = check_rank(config, nproc, 1, rank, measured, target)
    assert r.skipped is None
    assert close(r.peak["predicted"], r.peak["checked"], 0.03), (target, r.peak, r.components)
    for name, c in r.components.items():
        assert close(c["predicted"], c["checked"], 0.03), (target, name, c)
    dims = ParallelDims.from_config(config, nproc)
    plan = plan_step(
        config, nproc, device_type=target, shard_rank=dims.coordinates(rank)["dp_shard"]
    )
    own = measured["components"]
    for name, planned in planned_state(plan).items():
        assert own[name] == planned > 0, (target, name, own[name], planned)
    act = own["activations"]
    assert abs(plan.activations_bytes - act) <= 0.01 * act, (target, plan.activations_bytes, act)
    sent = [sum(c[k] for c in r.by_collective.values()) for k in ("predicted", "checked")]
    assert sent[0] == sent[1], r.by_collective


# Context parallelism on an attention-heavy shape (dim 128, 8 heads of 32 where dim / n_heads is 16,
# 2 kv heads, 512 tokens): the ring's blocks and alltoall's swaps n_heads x head_dim wide; alltoall
# within a window of 128 (the ring refuses a window); Qwen3's float32 queries under autocast
# swapped as they are.
CP_SHAPE = [
    "model.preset=debug", "model.dim=128", "model.n_heads=8", "model.n_kv_heads=2",
    "model.max_seq_len=512", "data.seq_len=512", "train.global_batch_size=4",
    "parallel.strategy=ddp", "parallel.cp=2",
]  # fmt: skip
ALLTOALL = "parallel.cp_method=alltoall"
CP_LAYOUTS: dict[str, tuple[list[str], list[str]]] = {
    "qwen3 ring": (FAMILIES["qwen3"], ["cpu"]),
    "qwen3 alltoall bf16": (
        [*FAMILIES["qwen3"], ALLTOALL, "train.precision=bf16"],
        ["cpu", "cuda"],
    ),
    "qwen2 alltoall bf16": ([*FAMILIES["qwen2"], ALLTOALL, "train.precision=bf16"], ["cpu"]),
    "mistral alltoall": (["model.sliding_window=128", ALLTOALL], ["cpu"]),
    "mistral alltoall bf16": (
        ["model.sliding_window=128", ALLTOALL, "train.precision=bf16"],
        ["cuda"],
    ),
}


@pytest.mark.parametrize("layout", list(CP_LAYOUTS))
def test_context_parallelism_of_a_family_is_the_checked_code(layout: str) -> None:
    """cp 2 with the families' options: the peak within 3% of the checked code's, the state to the
    byte and the ring's passes or alltoall's swaps exact."""
    options, targets = CP_LAYOUTS[layout]
    config = load_config(overrides=[*CP_SHAPE, *options])
    for target in targets:
        measured = measure_fake(config, 2, 1, 1, target)
        r = check_rank(config, 2, 1, 1, measured, target)
        assert r.skipped is None
        assert close(r.peak["predicted"], r.peak["checked"], 0.03), (target, r.peak)
        plan = plan_step(config, 2, device_type=target)
        for name, planned in planned_state(plan).items():
            assert measured["components"][name] == planned > 0, (target, name)
        assert all(c["predicted"] == c["checked"] for c in r.by_collective.values()), (
            r.by_collective
        )
        assert {"send/recv", "all_to_all"} & set(r.by_collective)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_sliding_window_adds_one_mask_a_forward(precision: str) -> None:
    """A window shorter than the sequence: the checked code holds one [T, T] mask in the queries'
    dtype more than causal attention does (made once a forward, read by every layer), and so does
    the plan; a window as long as the sequence is causal attention (no mask, the same plan)."""
    given = f"train.precision={precision}"
    plain, windowed = _config(given), _config(given, "model.sliding_window=16")
    mask = 64 * 64 * (4 if precision == "fp32" else 2)
    checked = [measure_fake(c, 1, 1, 0)["components"]["activations"] for c in (plain, windowed)]
    assert checked[1] - checked[0] == mask
    planned = [plan_step(c, 1).activations_bytes for c in (plain, windowed)]
    assert planned[1] - planned[0] == mask
    whole = _config(given, "model.sliding_window=64")
    assert plan_step(whole, 1).total_bytes == plan_step(plain, 1).total_bytes


# Published shapes (src/dtlab/models/presets.py) with each family's options.
PRESETS = [
    "qwen2.5-0.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b", "mistral-7b", "mistral-7b-v0.1",
    "qwen3-30b-a3b", "ernie-4.5-21b-a3b",
]  # fmt: skip


@pytest.mark.parametrize("preset", PRESETS)
def test_a_published_shape_is_planned_from_its_real_widths(preset: str) -> None:
    """The plan's figures of each preset against its model built on the meta device: parameters
    exact, the attention's matrices (n_heads x head_dim wide, which need not be dim), a dense
    block's matmul weights, the buffers (RoPE's tables head_dim / 2 wide, an MoE's routing state)
    and the FLOPs per token of a dense model's matmuls; and a rank of a layout that splits it is planned."""
    config = load_config(
        overrides=[f"model.preset={preset}", "data.seq_len=8192", "train.global_batch_size=16",
                   "train.precision=bf16", "train.activation_checkpointing=full"]
    )  # fmt: skip
    m = config.model
    model = build_model(m)  # meta: nothing allocated
    block: dict[str, Any] = dict(model.layers["0"].named_parameters())
    attention = sum(block[f"attention.w{x}.weight"].numel() for x in "qkvo")
    q, kv = attention_widths(m)
    assert attention == 2 * m.dim * q + 2 * m.dim * kv
    if not m.moe.experts:
        assert block_matmul_params(m) == sum(p.numel() for p in block.values() if p.dim() == 2)
        output = m.dim * m.vocab_size
        matmul = m.n_layers * block_matmul_params(m) + output
        assert flops_per_token(m, 8192) == 6.0 * matmul + 12.0 * m.n_layers * q * 8192
    one = plan_step(config, 1)
    assert one.params_bytes == 4 * count_params(model)
    assert one.buffers_bytes == sum(b.numel() * b.element_size() for b in model.buffers())
    fsdp = plan_step(load_config(overrides=[*_given(config), "parallel.strategy=fsdp"]), 64)
    assert 0 < fsdp.total_bytes < one.total_bytes


def _given(config: Config) -> list[str]:
    m = config.model
    return [f"model.preset={m.preset}", "data.seq_len=8192", "train.global_batch_size=64",
            "train.precision=bf16", "train.activation_checkpointing=full"]  # fmt: skip


def test_the_search_recommends_a_layout_for_a_windowed_and_a_qwen3_shape() -> None:
    """`dtlab plan`'s search runs on the published shapes with the new options: Mistral 7B v0.1
    at twice its window (its mask counted) and Qwen3-0.6B (its heads twice dim / n_heads wide)."""
    for preset, params in (("mistral-7b-v0.1", 7_241_732_096), ("qwen3-0.6b", 596_049_920)):
        config = load_config(
            overrides=[f"model.preset={preset}", "data.seq_len=8192", "train.global_batch_size=32"]
        )
        result = plan(config, 8, 1, PROFILES["h100"], None)
        assert result["model"]["params"] == params
        assert result["search"]["recommended"] is not None, result["recommendation"]
