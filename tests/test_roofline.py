"""The kernels' step model (``dtlab plan --step-model kernels``, dtlab.analysis.roofline): what it
counts of a real step's kernels, how the plan and its search use it, and its figures against the
H200 runs in docs/data/gputruth-h200.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dtlab.analysis.activations import attention_widths, block_matmul_params
from dtlab.analysis.devices import PROFILES
from dtlab.analysis.plan import plan, predict_step
from dtlab.analysis.roofline import roofline_seconds, step_census, supported
from dtlab.analysis.roofline_plan import KERNELS_CHECKED, bound_flops
from dtlab.bench.gputruth import Run, run_overrides
from dtlab.config import ModelConfig
from dtlab.train.api import resolve_config

DATA = Path(__file__).resolve().parents[1] / "docs" / "data" / "gputruth-h200.json"
KERNELS = dataclasses.replace(PROFILES["h200"], step_model="kernels")


@pytest.mark.parametrize("preset", ["debug", "tiny"])
def test_the_census_counts_every_gemm_of_forward_and_backward(preset: str) -> None:
    """Every matmul of the step is a GEMM the census prices: 6 FLOPs a token for each weight of the
    blocks and the head (forward, input gradient, weight gradient); full checkpointing runs each
    block's forward GEMMs again (2 more a weight) but the down projection's (torch's checkpoint
    stops recomputing once it has what backward saved, and nothing saves w2's output), and its
    attention twice."""
    m = ModelConfig(preset=preset)
    head = 6.0 * m.dim * m.vocab_size
    blocks = m.n_layers * block_matmul_params(m)
    none = step_census(m, "bf16", "none", 256)
    full = step_census(m, "bf16", "full", 256)
    assert none.gemm_flops_token == pytest.approx(6.0 * blocks + head, rel=1e-9)
    w2 = m.n_layers * m.hidden_dim * m.dim
    assert full.gemm_flops_token == pytest.approx(8.0 * blocks - 2.0 * w2 + head, rel=1e-9)
    assert none.attention_calls == m.n_layers and full.attention_calls == 2 * m.n_layers
    assert full.ops > none.ops and none.sac_ops == 0
    # Every GEMM and attention call (forward and backward) is a kernel; views launch none.
    gemms = 3 * (7 * m.n_layers + 1)  # each linear layer's forward and two gradients, the head's
    assert gemms + 2 * m.n_layers < none.kernels < none.ops
    # Selective checkpointing keeps the matmuls' outputs: no GEMM again, its policy sees the ops.
    selective = step_census(m, "bf16", "selective", 256)
    assert selective.gemm_flops_token == pytest.approx(none.gemm_flops_token, rel=1e-9)
    assert selective.sac_ops == 2 * (full.ops - none.ops)


def test_the_memory_bound_bytes_grow_with_the_tokens_and_bf16_casts_weights() -> None:
    """The other kernels' bytes: linear in the tokens, and under bf16 autocast a per-pass part
    (each weight cast to bf16: at least 6 bytes a block weight read and written) fp32 has less of."""
    m = ModelConfig(preset="tiny")
    bf16, fp32 = step_census(m, "bf16", "none", 256), step_census(m, "fp32", "none", 256)
    assert bf16.bytes_token > 0 and fp32.bytes_token > 0
    weights = m.n_layers * block_matmul_params(m)
    assert bf16.bytes_pass - fp32.bytes_pass >= 6 * weights
    t1 = roofline_seconds(step_census(m, "bf16", "none", 256), m, 256, 1, 1, 1e6, 989.4, 4800)
    t4 = roofline_seconds(step_census(m, "bf16", "none", 256), m, 256, 4, 1, 1e6, 989.4, 4800)
    assert t4.gemm_s > 3 * t1.gemm_s and t4.memory_s > t1.memory_s
    assert t4.host_s == t1.host_s  # the same ops dispatched, whatever their size
    assert t4.gaps_s == t1.gaps_s > 0  # and the same kernels
    assert t1.step_s == max(t1.device_s, t1.host_s)


def test_what_the_kernels_model_cannot_time_is_said_and_keeps_the_flops_model() -> None:
    moe = resolve_config(None, ["model.preset=debug-moe"])
    float8 = resolve_config(
        None, ["model.preset=debug", "train.precision=bf16", "train.float8.enabled=true"]
    )
    assert "MoE" in (supported(moe) or "") and "float8" in (supported(float8) or "")
    cp = resolve_config(None, ["model.preset=debug", "parallel.strategy=ddp", "parallel.cp=2"])
    assert "context parallelism" in (supported(cp) or "")
    assert supported(resolve_config(None, ["model.preset=debug"])) is None
    for cfg in (moe, float8):
        flops = plan(cfg, 1, 1, PROFILES["h200"], None)["strategies"][0]["step_time_s"]
        kernels = plan(cfg, 1, 1, KERNELS, None)["strategies"][0]["step_time_s"]
        assert kernels == flops


def test_the_searchs_bound_stays_under_every_row_it_costs() -> None:
    """The search skips a candidate whose bound is above what it already holds: with the kernels'
    model its bound is the FLOPs at the fastest kernel's rate, so no costed row comes in under it."""
    cfg = resolve_config(
        None, ["model.preset=llama3.2-1b", "data.seq_len=2048", "train.global_batch_size=16"]
    )
    result = plan(cfg, 8, 1, KERNELS, None)
    from dtlab.analysis.model import flops_per_token

    fastest = bound_flops(KERNELS, "bf16")
    assert fastest > 0.45 * 989.4e12
    rows = result["search"]["rows"]
    assert rows
    for row in rows:
        if row.get("precision") != "bf16":
            continue
        tokens = 16 * 2048 / 8
        assert row["step_time_s"] >= flops_per_token(cfg.model, 2048) * tokens / fastest * 0.999


def test_the_kernels_model_is_within_10_percent_of_the_h200s_runs() -> None:
    """Against the measured runs (one H200, docs/data/gputruth-h200.json): every run the kernels'
    model times (eager and compiled; not float8) within 10% (three of the 24 set the host's per-op
    costs and the gap between kernels), and closer than the FLOPs model on average."""
    data = json.loads(DATA.read_text(encoding="utf-8"))
    errors, flops_errors = [], []
    for r in data["runs"]:
        if r["float8"]:
            continue
        run = Run({k: r[k] for k in ("model", "mb", "ac", "compile", "float8", "steps", "seq")})
        cfg = resolve_config(None, run_overrides(run))
        kernels = predict_step(cfg, 1, 1, KERNELS).step_time_s
        flops = predict_step(cfg, 1, 1, PROFILES["h200"]).step_time_s
        measured = r["median_step_time_s"]
        errors.append(kernels / measured - 1)
        flops_errors.append(flops / measured - 1)
    assert len(errors) == 24
    assert max(abs(e) for e in errors) < 0.10
    mean = sum(abs(e) for e in errors) / len(errors)
    # What the plan's header says of the model is these runs' figures.
    worst = max(errors, key=abs)
    assert f"mean absolute error {mean:.1%}, worst {worst:+.1%}" in KERNELS_CHECKED
    assert mean < 0.04 < 0.2 < sum(abs(e) for e in flops_errors) / len(flops_errors)


def test_plan_step_model_flag_names_the_kernels_model(capsys: pytest.CaptureFixture[str]) -> None:
    from dtlab.cli import main

    args = ["plan", "--device", "h200", "--set", "model.preset=debug", "train.precision=bf16"]
    assert main([*args, "--step-model", "kernels"]) == 0
    out = capsys.readouterr().out
    assert "--step-model kernels" in out and "checked against 24 single-GPU steps" in out
    assert main(args) == 0  # the FLOPs model's header says it is unchecked on a GPU
    assert "not calibrated against a GPU's measured steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args, "--step-model", "roofline"])
    assert "invalid choice" in capsys.readouterr().err


def test_attention_is_priced_at_the_plans_count_of_its_flops() -> None:
    """A full checkpoint's recomputed attention is a forward: a third of a forward-and-backward."""
    m = ModelConfig(preset="debug")
    none = roofline_seconds(step_census(m, "bf16", "none", 256), m, 256, 2, 1, 1e6, 989.4, 4800)
    full = roofline_seconds(step_census(m, "bf16", "full", 256), m, 256, 2, 1, 1e6, 989.4, 4800)
    assert full.attention_s == pytest.approx(none.attention_s * (1 + 1 / 3), rel=1e-9)
    q = attention_widths(m)[0]
    assert none.attention_s > 0 and q > 0


def test_a_compiled_step_calls_the_same_gemms_and_attention_and_fuses_the_rest() -> None:
    """Compiled, the blocks' and the loss's GEMMs and attention calls are the eager step's (full
    checkpointing's recomputed forward too); the other kernels' bytes fall (fused), the weights'
    casts (the per-pass bytes) stay, and the host dispatches fewer ops."""
    from dtlab.analysis.roofline_compiled import compiled_census

    m = ModelConfig(preset="debug")
    for ac in ("none", "full"):
        eager, compiled = step_census(m, "bf16", ac, 256), compiled_census(m, "bf16", ac, 256)
        assert compiled.gemm_flops_token == pytest.approx(eager.gemm_flops_token, rel=1e-9)
        assert compiled.attention_calls == eager.attention_calls
        assert compiled.bytes_token < 0.5 * eager.bytes_token
        assert compiled.ops < 0.5 * eager.ops and compiled.sac_ops == 0


def test_the_plan_times_a_compiled_step_by_its_fused_kernels_unless_it_must_not_compile() -> None:
    from dtlab.analysis.compiled_memory import blocks_not_measured

    overrides = ["model.preset=tiny", "train.precision=bf16", "train.global_batch_size=8"]
    eager = resolve_config(None, overrides)
    compiled = resolve_config(None, [*overrides, "train.compile=true"])

    def step(cfg: object) -> float:
        return plan(cfg, 1, 1, KERNELS, None)["strategies"][0]["step_time_s"]

    assert step(compiled) < step(eager)
    with blocks_not_measured():  # a training process's plan: no compile of its own, the FLOPs model
        flops = plan(compiled, 1, 1, PROFILES["h200"], None)["strategies"][0]["step_time_s"]
        assert step(compiled) == flops
