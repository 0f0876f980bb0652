"""What a mixture-of-experts run shows of its routing (metrics, summary, routing.png, the imbalance
alert) and where its weights go: the Hugging Face export, ``model.init_from`` back from it, and
``dtlab generate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import dtlab
from conftest import run_cli, train_run
from dtlab.checkpoint.export import export_hf
from dtlab.checkpoint.init_from import load_init_state
from dtlab.checkpoint.manifest import write_manifest
from dtlab.config import AlertsConfig, ConfigError, config_warnings, load_config
from dtlab.errors import CheckpointError
from dtlab.metrics.alerts import AlertMonitor
from dtlab.metrics.trackers import _outputs
from dtlab.verify_state import export_run

# Two MoE blocks after one dense block, so that sums over the blocks are tested as sums.
MOE3 = ["model.preset=debug-moe", "model.n_layers=3"]
TOKENS = 8 * 64  # FAST's global batch x seq_len


def test_a_run_logs_loads_plots_them_and_alerts_on_imbalance(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # Any real routing is above 1.0001 (an exact 1 needs 1,024 slots split exactly evenly).
    m = train_run(run, *MOE3, "alerts.moe_imbalance=1.0001", "run.plot=true", steps=4)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    for r in m:
        # Each token counts top_k = 2 times in each of the 2 MoE blocks.
        assert sum(r["moe_load"]) == TOKENS * 2 * 2 and len(r["moe_load"]) == 4
        layers = r["moe_layer_load"]
        assert len(layers) == 2 and all(sum(row) == TOKENS * 2 for row in layers)
        assert r["moe_load"] == [a + b for a, b in zip(*layers, strict=True)]
        worst = max(max(row) / (TOKENS * 2 / 4) for row in layers)
        assert r["moe_imbalance"] == pytest.approx(worst)
        assert r["moe_bias"] > 0
    # It fires when crossed, and not again while the imbalance stays above the threshold.
    assert m[0]["alerts"] == ["moe_imbalance"]
    assert all("alerts" not in r for r in m[1:])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["alerts"] == {"moe_imbalance": 1}
    worst_record = max(m, key=lambda r: r["moe_imbalance"])
    assert summary["moe_worst_imbalance"] == worst_record["moe_imbalance"]
    assert summary["moe_worst_imbalance_step"] == worst_record["step"]
    assert summary["moe_final_imbalance"] == m[-1]["moe_imbalance"]
    png = run / "routing.png"
    assert summary["routing_plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # The trackers (MLflow, W&B) take it as an artifact with the loss curve and the summary.
    assert [p.name for p in _outputs(run)] == ["loss.png", "routing.png", "summary.json"]


def _monitor(**thresholds: float) -> AlertMonitor:
    return AlertMonitor(AlertsConfig(**thresholds), tokens_per_step=TOKENS)


def test_the_imbalance_alert_fires_above_its_threshold_and_never_when_off() -> None:
    def record(step: int, imbalance: float) -> dict[str, object]:
        return {"step": step, "loss": 2.0, "grad_norm": 1.0, "moe_imbalance": imbalance}

    off = _monitor()
    assert not off.config.enabled
    assert all(off.check(record(s, 4.0), 0.1, 0.01) == [] for s in range(1, 5))
    on = _monitor(moe_imbalance=1.5)
    assert on.check(record(1, 1.5), 0.1, 0.01) == []  # at the threshold: not above it
    fired = on.check(record(2, 2.25), 0.1, 0.01)
    assert [k for k, _ in fired] == ["moe_imbalance"]
    assert (
        "step 2: the most loaded expert has 2.25x the mean load (the worst MoE block's "
        "moe_imbalance), above alerts.moe_imbalance = 1.5" in fired[0][1]
    )
    assert on.check(record(3, 3.0), 0.1, 0.01) == []  # still above
    assert on.check(record(4, 1.2), 0.1, 0.01) == []
    assert [k for k, _ in on.check(record(5, 1.6), 0.1, 0.01)] == ["moe_imbalance"]
    # A dense step has no imbalance to judge.
    assert on.check({"step": 6, "loss": 2.0, "grad_norm": 1.0}, 0.1, 0.01) == []


def test_the_imbalance_alert_on_a_dense_model_is_said_to_be_unused() -> None:
    dense = load_config(None, ["model.preset=debug", "alerts.moe_imbalance=2"])
    assert any("alerts.moe_imbalance = 2 is set but model.moe.experts = 0" in w
               for w in config_warnings(dense))  # fmt: skip
    moe = load_config(None, ["model.preset=debug-moe", "alerts.moe_imbalance=2"])
    assert not any("moe_imbalance" in w for w in config_warnings(moe))
    with pytest.raises(ConfigError, match=r"alerts\.moe_imbalance = 0\.5"):
        load_config(None, ["model.preset=debug-moe", "alerts.moe_imbalance=0.5"])


# --- the Hugging Face export (Qwen2-MoE), model.init_from back from it, dtlab generate ----------
def make_moe_checkpoint(
    ckpt: Path, *overrides: str, bias: list[float] | None = None
) -> tuple[torch.nn.Module, dtlab.Config]:
    """A debug-moe model with random weights (far from their initial values, so that a misplaced
    or mis-scaled tensor shows in the logits) and MoE block 1's balancing ``bias``, saved the way a
    run saves it."""
    config = load_config(None, ["model.preset=debug-moe", *overrides])
    model = dtlab.build_model(config.model, device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((1.0 if p.ndim == 1 else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
        if bias is not None:
            model.state_dict()["layers.1.feed_forward.expert_bias"].copy_(torch.tensor(bias))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
    write_manifest(ckpt, step=5, config_hash="x", world_size=1)
    return model.eval(), config


MOE_CASES = {
    # debug-moe: a dense first block, then 4 experts (top 2, renormalised) beside a shared expert;
    # balance = bias, its bias still zero (Qwen2-MoE named: the default family of a bias-balanced
    # run is ERNIE 4.5 MoE, tests/test_hf_families.py).
    "dense-block-shared-expert": ["model.family=qwen2_moe"],
    "all-moe-no-shared-raw-gates": [
        "model.moe.dense_layers=0", "model.moe.shared_experts=0", "model.moe.top_k=3",
        "model.moe.renormalize=false", "model.moe.balance=aux", "model.tie_embeddings=true",
    ],
}  # fmt: skip


@pytest.mark.parametrize("overrides", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_hf_export_computes_dtlabs_logits_and_init_from_reads_it_back(
    tmp_path: Path, overrides: list[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    model, config = make_moe_checkpoint(tmp_path / "ckpt", *overrides)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2MoeForCausalLM"] and cfg["model_type"] == "qwen2_moe"
    moe = config.model.moe
    assert (cfg["num_experts"], cfg["num_experts_per_tok"]) == (moe.experts, moe.top_k)
    assert cfg["mlp_only_layers"] == list(range(moe.dense_layers))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).to(torch.float32).eval()
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.abs().max() > 1.0  # logits far from zero: a difference would show
    assert (ours - theirs).abs().max() < 1e-4
    # model.init_from reads the export back: the same tensors, so the same logits exactly.
    start = load_config(None, ["model.preset=debug-moe", *overrides, f"model.init_from={out}"])
    fresh = dtlab.build_model(start.model, device="cpu")
    fresh.load_state_dict(load_init_state(start), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(tokens), ours)


def test_what_qwen2_moe_cannot_compute_is_refused(tmp_path: Path) -> None:
    # A trained balancing bias changes which experts a token goes to.
    make_moe_checkpoint(tmp_path / "biased", "model.family=qwen2_moe", bias=[0.0, 0.1, 0.0, 0.0])
    with pytest.raises(
        CheckpointError,
        match=r"the balancing bias 'layers\.1\.feed_forward\.expert_bias' is not zero \(largest \|bias\| 0\.1",
    ):
        export_hf(tmp_path / "biased", tmp_path / "out")
    proc = run_cli(
        "export", str(tmp_path / "biased"), "--format", "hf", "--out", str(tmp_path / "o2")
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "Qwen2MoeForCausalLM's router has no such bias" in proc.stderr
    assert "--format safetensors exports it as dtlab computes it" in proc.stderr
    # Sigmoid scores are GLM-4.5 MoE's: a config that names a softmax family for them is refused.
    with pytest.raises(ConfigError, match=r"routes by a softmax \(model.moe.score = 'sigmoid'\)"):
        load_config(None, ["model.preset=debug-moe", "model.moe.score=sigmoid",
                           "model.family=qwen2_moe"])  # fmt: skip
    # A Qwen2-MoE whose shared expert is gated (as real ones are) or whose dense blocks are not the
    # first ones has no dtlab counterpart either.
    make_moe_checkpoint(tmp_path / "ok", "model.family=qwen2_moe")
    out = export_hf(tmp_path / "ok", tmp_path / "hf")
    # A run of another shape names every model.moe key that differs, and the fix.
    other = load_config(None, [
        "model.preset=debug-moe", "model.moe.experts=8", "model.moe.shared_experts=0",
        f"model.init_from={out}",
    ])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        load_init_state(other)
    assert "model.moe.experts = 8 but" in str(e.value) and "has num_experts 4" in str(e.value)
    assert "model.moe.shared_experts = 0 but" in str(e.value)
    assert "--set model.moe.experts=4 model.moe.shared_experts=1" in str(e.value)
    weights = load_file(str(out / "model.safetensors"))
    weights["model.layers.1.mlp.shared_expert_gate.weight"] += 0.5
    save_file(weights, str(out / "model.safetensors"))
    start = load_config(None, ["model.preset=debug-moe", f"model.init_from={out}"])
    with pytest.raises(
        CheckpointError, match=r"shared_expert_gate\.weight' is not zero .* no shared expert's gate"
    ):
        load_init_state(start)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [1]}))
    with pytest.raises(
        ConfigError, match=r"dense blocks \[1\]: dtlab.s dense blocks are the first"
    ):
        load_init_state(start)


def test_generate_on_an_moe_run_and_its_export(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_run(run, "model.preset=debug-moe", "model.moe.balance=aux", steps=2)
    proc = run_cli("export", str(run), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    texts = []
    for source in (run, tmp_path / "hf"):
        proc = run_cli("generate", str(source), "--prompt", "The ", "--max-new-tokens", "12",
                       "--temperature", "0")  # fmt: skip
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        texts.append(proc.stdout)
    # Greedy: the run's checkpoint and its Qwen2-MoE export choose the same tokens.
    assert texts[0] == texts[1] and len(texts[0].encode("utf-8", "surrogateescape")) > 0


def test_verify_exports_an_moe_run_to_hugging_face_when_a_family_computes_it(
    tmp_path: Path,
) -> None:
    # dtlab verify's export check exports as a user does: Hugging Face when the model's family
    # computes its routing (Qwen2-MoE without a bias, ERNIE 4.5 MoE with one, GLM-4.5 MoE's sigmoid
    # scores), dtlab's names when none does (a bias the named family has no place for).
    cases = {
        "aux": (["model.moe.balance=aux"], "qwen2_moe"),
        "bias": (["model.moe.balance=bias+aux"], "ernie4_5_moe"),
        "sigmoid": (["model.moe.score=sigmoid"], "glm4_moe"),
        "qwen2-bias": (["model.family=qwen2_moe"], None),
    }
    for name, (overrides, model_type) in cases.items():
        make_moe_checkpoint(tmp_path / name, *overrides)
        export_run(tmp_path / name, tmp_path / f"{name}-out")
        hf = tmp_path / f"{name}-out" / "config.json"
        if model_type is None:
            assert (tmp_path / f"{name}-out" / "config.yaml").is_file() and not hf.exists()
        else:
            assert json.loads(hf.read_text())["model_type"] == model_type
