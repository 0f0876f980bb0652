"""The Llama-style model: shapes, causality, GQA, RoPE, presets, meta-device build and init."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dtlab.models
from dtlab.config import ModelConfig
from dtlab.models import PRESETS, build_model, count_params
from dtlab.models.args import llama_ffn_dim
from dtlab.models.hf_adapter import from_hf, from_hf_shapes, to_hf
from dtlab.models.llama import apply_rope, rope_tables


def debug_model(**kw: object) -> torch.nn.Module:
    return build_model(ModelConfig(preset="debug", **kw), device="cpu")  # type: ignore[arg-type]


def test_forward_shape() -> None:
    model = debug_model()
    tokens = torch.randint(0, 256, (3, 17))
    assert model(tokens).shape == (3, 17, 256)


def test_attention_is_causal() -> None:
    model = debug_model()
    a = torch.randint(0, 256, (2, 20))
    b = a.clone()
    b[:, 10:] = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :10], lb[:, :10])
    assert (la[:, 10:] - lb[:, 10:]).abs().max() > 1e-4


def test_gqa_equals_repeated_kv_heads() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16)
    k, v = torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    gqa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    full = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    torch.testing.assert_close(gqa, full)


def test_rope_scores_depend_on_relative_position_only() -> None:
    cos, sin = rope_tables(16, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i: int, j: int) -> torch.Tensor:
        qi = apply_rope(q, cos[i : i + 1], sin[i : i + 1])
        kj = apply_rope(k, cos[j : j + 1], sin[j : j + 1])
        return (qi * kj).sum()

    torch.testing.assert_close(score(5, 2), score(40, 37))
    assert not torch.allclose(score(5, 2), score(5, 4))


@pytest.mark.parametrize(
    ("preset", "published"),
    [("llama2-7b", 6.74e9), ("llama2-13b", 13.0e9), ("llama2-70b", 69.0e9), ("llama3.1-8b", 8.03e9),
     ("llama3.1-70b", 70.6e9), ("llama3.2-1b", 1.24e9), ("llama3.2-3b", 3.21e9), ("small", 1.0e8)],
)  # fmt: skip
def test_preset_parameter_counts(preset: str, published: float) -> None:
    model = build_model(ModelConfig(preset=preset))  # meta: nothing allocated
    assert next(model.parameters()).is_meta
    assert count_params(model) == pytest.approx(published, rel=0.03)


def test_debug_preset_is_small() -> None:
    assert count_params(debug_model()) < 1_000_000
    assert set(PRESETS) >= {"debug", "tiny", "small"}


def test_init_is_deterministic_and_really_runs() -> None:
    a, b = debug_model(), debug_model()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb)
        assert torch.isfinite(pa).all(), name
    assert a.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))


def test_meta_build_then_materialize_equals_eager_init() -> None:
    from dtlab.parallel import materialize

    cfg = ModelConfig(preset="debug")
    meta = build_model(cfg)
    materialize(meta, torch.device("cpu"), seed=0)
    eager = build_model(cfg, "cpu")
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(meta(tokens), eager(tokens))


def test_tied_embeddings_share_the_matrix() -> None:
    tied = debug_model(tie_embeddings=True)
    untied = debug_model()
    assert count_params(untied) - count_params(tied) == 256 * 64
    tokens = torch.randint(0, 256, (1, 8))
    F.cross_entropy(tied(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert tied.tok_embeddings.weight.grad is not None


def test_sequence_longer_than_max_is_rejected() -> None:
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        debug_model()(torch.zeros(1, 129, dtype=torch.long))


# --- the model's own arguments and format conversion -----------------------------------------
def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, wherever the import is (functions, TYPE_CHECKING blocks)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_models_do_not_import_the_config() -> None:
    """The config builds the model's arguments; the model never reaches up to the config."""
    files = sorted((Path(dtlab.models.__file__).parent).rglob("*.py"))
    assert len(files) >= 4  # __init__, args, llama, presets, ...
    offenders = {
        str(f.name): sorted(m for m in _imported_modules(f) if m.startswith("dtlab.config"))
        for f in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_model_args_resolve_the_config_nulls() -> None:
    m = ModelConfig(preset=None, dim=256, n_layers=1, n_heads=4, vocab_size=256, max_seq_len=16)
    args = m.args()
    assert (args.n_kv_heads, args.ffn_dim, args.head_dim) == (4, 768, 64)  # 8/3 * 256 -> 768
    assert (args.n_kv_heads, args.ffn_dim) == (m.kv_heads, m.hidden_dim)
    assert llama_ffn_dim(4096) == 11008  # Llama 2 7B's published size
    # The model built from the arguments is the one built from the config section.
    shapes = {k: v.shape for k, v in build_model(args).state_dict().items()}
    assert shapes == {k: v.shape for k, v in build_model(m).state_dict().items()}
    assert shapes["layers.0.feed_forward.w1.weight"] == (768, 256)


@pytest.mark.parametrize(
    "kw",
    [{}, {"tie_embeddings": True, "n_kv_heads": 1}, {"n_kv_heads": 4}],
    ids=["gqa", "tied-mqa", "mha"],
)
def test_hf_adapter_round_trip_is_exact(kw: dict[str, object]) -> None:
    args = ModelConfig(preset="debug", **kw).args()  # type: ignore[arg-type]
    model = build_model(args, "cpu")
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    hf = to_hf(state, args)
    assert "model.layers.1.self_attn.q_proj.weight" in hf
    assert ("lm_head.weight" in hf) is not args.tie_embeddings
    # The q/k rows really move (a round trip through two identities would pass too).
    wq = state["layers.0.attention.wq.weight"]
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], wq)
    back = from_hf(hf, args)
    assert list(back) == list(state)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    shapes = from_hf_shapes({k: tuple(v.shape) for k, v in hf.items()}, args)
    assert shapes == {k: tuple(v.shape) for k, v in state.items()}
    # What the model derives is dropped: rotary frequencies older files kept, a tied lm_head copy.
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    if args.tie_embeddings:
        extra["lm_head.weight"] = hf["model.embed_tokens.weight"]
    assert list(from_hf({**hf, **extra}, args)) == list(state)
