"""The model families' options on every parallel layout: q/k/v biases, per-head q/k norms and heads
wider than dim / n_heads (Qwen2, Qwen3), a sliding window (Mistral) and a mixture of experts with
q/k norms (Qwen3-MoE) train as one process does, step by step with clipping active (``dtlab
verify``, one reference run per model); and ``dtlab verify`` with ``model.init_from`` starts every
layout, the reference among them, from those weights."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import CLIP, FAST, read_metrics, run_cli, train_run, verify_layouts
from dtlab.config import load_config
from dtlab.errors import ConfigError, DtlabError
from dtlab.verify import check_started_from

# Qwen2's biases and Qwen3's norms on heads of 32 (the debug preset: dim 64, 4 heads, 2 kv heads,
# so the attention is 128 wide, twice the model's).
QWEN = ("model.qkv_bias=true", "model.qk_norm=true", "model.head_dim=32")
WINDOW = ("model.sliding_window=16",)  # data.seq_len 64: each token sees 16 of up to 64
STEPS = 4


def _verify(tmp_path: Path, layouts: str, *overrides: str) -> dict[str, Any]:
    """:func:`verify_layouts` of FAST + ``overrides``, into ``tmp_path / "verify"``."""
    return verify_layouts(tmp_path / "verify", layouts, *overrides, steps=STEPS)


def test_qkv_bias_qk_norm_and_wide_heads_train_as_one_process_on_every_layout(
    tmp_path: Path,
) -> None:
    # Tensor parallelism splits the biases with their rows and sums the q/k norm gains' gradients
    # over the ranks (each rank's heads give a part of them); the other layouts hold them whole.
    # (ddp, fsdp, pp and fsdp x tp: the slow test below.)
    _verify(tmp_path, "single,tp:2,sp:2,cp:2,cp:2:alltoall", *QWEN)


def test_qk_norms_keep_bf16_queries_for_the_ring(tmp_path: Path) -> None:
    # Under bf16 autocast the q/k norms' float32 gains must not widen the heads to float32: the
    # ring's blocks would then meet float32 queries and bf16 accumulators (it failed so).
    metrics = train_run(
        tmp_path / "run", *QWEN, "train.precision=bf16", "parallel.strategy=ddp", "parallel.cp=2",
        nproc=2, steps=2,
    )  # fmt: skip
    assert [m["step"] for m in metrics] == [1, 2]


def test_a_sliding_window_trains_as_one_process_on_every_layout(tmp_path: Path) -> None:
    # Each pipeline stage's attention makes the window's mask from its sequence length (whole again
    # after sequence parallelism's gather); context parallelism's all-to-all attends its whole
    # sequence within the window.
    result = _verify(tmp_path, "single,sp:2,pp:2xsp:2,cp:2:alltoall", *WINDOW)
    # The window is active: without it the same run trains otherwise.
    causal = train_run(tmp_path / "causal", f"train.grad_clip={CLIP}", steps=STEPS)
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(causal, result["reference"], strict=True))
    assert diff > 1e-3, diff


def test_a_sliding_window_within_documents_under_alltoall(tmp_path: Path) -> None:
    # The all-to-all's whole-sequence mask: the same document and the window, as one process's.
    _verify(tmp_path, "single,cp:2:alltoall", *WINDOW, "data.document_mask=true")


def test_the_ring_refuses_a_window_that_cuts_the_sequence() -> None:
    ring = [*FAST, *WINDOW, "parallel.strategy=ddp", "parallel.cp=2"]
    message = (
        "model.sliding_window = 16 (shorter than data.seq_len = 64) is not supported with "
        "parallel.cp = 2 and parallel.cp_method = 'ring': the ring's attention is causal over the "
        "whole sequence, so far; allowed: parallel.cp_method = 'alltoall'"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=ring)
    load_config(overrides=[*ring, "parallel.cp_method=alltoall"])
    load_config(overrides=[*ring, "model.sliding_window=64"])  # as long as the sequence: causal


def test_a_mixture_of_experts_with_qk_norm_trains_as_one_process(tmp_path: Path) -> None:
    _verify(tmp_path, "single,ep:2", "model.preset=debug-moe", "model.qk_norm=true")


@pytest.mark.slow
def test_every_option_at_once_on_the_data_parallel_and_4_process_layouts(tmp_path: Path) -> None:
    # FSDP2 sums the q/k norm gains' partial gradients over tp before its reduce-scatter.
    _verify(
        tmp_path, "single,ddp:2,fsdp:2,pp:2,fsdp:2xtp:2,fsdp:2xsp:2,tp:2xcp:2:alltoall",
        *QWEN, *WINDOW,
    )  # fmt: skip


@pytest.mark.slow
def test_a_mixture_of_experts_with_qk_norm_under_tp_and_fsdp_x_ep(tmp_path: Path) -> None:
    _verify(tmp_path, "single,tp:2,fsdp:2xep:2", "model.preset=debug-moe", "model.qk_norm=true")


# --- dtlab verify with model.init_from -------------------------------------------------------------
QWEN3 = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, vocab_size=256, intermediate_size=96, max_position_embeddings=128,
    rms_norm_eps=1e-6,
)  # fmt: skip
INIT_TRAIN = (
    "data.source=synthetic", "data.seq_len=32", "train.global_batch_size=4", "train.lr=3e-3",
    "train.warmup_steps=1", f"train.grad_clip={CLIP}",
)  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A small Qwen3ForCausalLM with random weights (moved off their initial values: norm gains
    too), saved by transformers; and the model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("qwen3") / "hf"
    model.save_pretrained(str(path))
    return path, model


def _qwen3_model(path: Path) -> list[str]:
    return [
        "model.preset=null", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
        "model.n_kv_heads=2", "model.head_dim=32", "model.qk_norm=true", "model.vocab_size=256",
        "model.ffn_dim=96", "model.max_seq_len=128", "model.norm_eps=1e-6", "model.family=qwen3",
        f"model.init_from={path}",
    ]  # fmt: skip


def test_verify_starts_every_layout_from_init_from(
    tmp_path: Path, qwen3_dir: tuple[Path, Any]
) -> None:
    path, hf = qwen3_dir
    model = _qwen3_model(path)
    out = tmp_path / "verify"
    proc = run_cli("verify", "--layouts", "single,sp:2,fsdp:2", "--steps", "3", "--out", str(out),
                   "--set", *INIT_TRAIN, *model)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"every layout from {path}" in proc.stdout
    result = json.loads((out / "verify.json").read_text())
    assert result["ok"] and result["init_from"] == str(path)
    # Step 1 is transformers' own loss of the saved model on the same batch, on every layout.
    from dtlab.data import build_source
    from dtlab.data.loader import BatchLayout, BatchLoader

    config = load_config(None, [*INIT_TRAIN, *model])
    loader = BatchLoader(build_source(config), BatchLayout(4, 0, 1, 4), prefetch=0)
    [(inputs, targets)] = loader.build_step(0)
    with torch.no_grad():
        logits = hf(inputs).logits
    expected = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    firsts = [read_metrics(d)[0]["loss"] for d in sorted(out.glob("[0-9]-*"))]
    assert len(firsts) == 3 and firsts == pytest.approx([expected] * 3, rel=1e-6), firsts


def test_verify_checks_init_from_before_any_layout_trains(
    tmp_path: Path, qwen3_dir: tuple[Path, Any]
) -> None:
    out = tmp_path / "verify"
    proc = run_cli("verify", "--layouts", "single,ddp:2", "--out", str(out), "--set",
                   *INIT_TRAIN, *_qwen3_model(qwen3_dir[0]), "model.n_layers=3")  # fmt: skip
    assert proc.returncode != 0
    assert "model.n_layers = 3 but" in proc.stderr and "num_hidden_layers 2" in proc.stderr
    assert not list(out.glob("*")), "a layout trained"


def test_a_run_that_did_not_start_from_the_source_is_named(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"init_from": None}))
    with pytest.raises(DtlabError, match=r"layout tp:2 started from its own initialisation, not "
                       r"from model.init_from = /src"):  # fmt: skip
        check_started_from("tp:2", tmp_path, "/src")
    check_started_from("tp:2", tmp_path, None)
