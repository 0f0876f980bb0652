"""``dtlab plan`` of ``train.float8`` (:mod:`dtlab.analysis.float8_plan`) against the real code of
the same rank (``--check``: fake process group, fake tensors, torchao's Float8Linear emulated on the
CPU): the float8 layers' saved inputs and weights, their casts in the down projection's backward,
FSDP's float8 all-gathers (1 byte an element) and their scales."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import assert_state_is_planned, close, run_cli, run_worker
from dtlab.analysis.check import check_rank, measure_fake
from dtlab.analysis.float8_plan import float8_block_params, float8_layers, float8_scale_bytes
from dtlab.analysis.model import plan_step
from dtlab.config import load_config
from dtlab.dims import ParallelDims

pytest.importorskip("torchao.float8")

SHAPE = [
    "model.preset=debug", "data.seq_len=64", "train.global_batch_size=8", "train.precision=bf16",
    "train.float8.enabled=true",
]  # fmt: skip

_FULL, _SEL = "train.activation_checkpointing=full", "train.activation_checkpointing=selective"
_ROW = "train.float8.recipe=rowwise"
_PP = ["parallel.pp=2", "parallel.pp_microbatches=2"]

CHECKED: dict[str, tuple[int, list[str]]] = {
    "single": (1, ["parallel.strategy=ddp"]),
    "ddp:2": (2, ["parallel.strategy=ddp"]),
    "fsdp:2": (2, ["parallel.strategy=fsdp"]),
    "fsdp:2 shard_grad_op": (2, ["parallel.strategy=fsdp", "parallel.sharding=shard_grad_op"]),
    "hsdp:2x2": (4, ["parallel.strategy=hsdp", "parallel.replicate=2"]),
    "fsdp:2 accumulation": (2, ["parallel.strategy=fsdp", "train.micro_batch_size=1"]),
    "tp:2": (2, ["parallel.strategy=fsdp", "parallel.tp=2"]),
    "tp:2 sp": (2, ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "fsdp:2 x tp:2": (4, ["parallel.strategy=fsdp", "parallel.tp=2"]),
    "ddp:2 x tp:2": (4, ["parallel.strategy=ddp", "parallel.tp=2"]),
    # Wide, few tokens: the embedding's backward beside the first block's float32 gradients
    # waiting for their all-reduce (its float8 weights are copied in one byte an element).
    "ddp:2 x tp:2, wide": (4, ["parallel.strategy=ddp", "parallel.tp=2", "model.dim=128",
                               "model.ffn_dim=512", "model.n_layers=4", "model.vocab_size=4096",
                               "data.seq_len=16"]),
    "pp:2": (2, ["parallel.strategy=fsdp", *_PP]),
    "ddp x pp:2": (2, ["parallel.strategy=ddp", *_PP]),
    # Checkpointing: the down projection's casts become the step's peak.
    "single full AC": (1, ["parallel.strategy=ddp", _FULL]),
    "ddp:2 full AC": (2, ["parallel.strategy=ddp", _FULL]),
    "fsdp:2 full AC": (2, ["parallel.strategy=fsdp", _FULL]),
    "tp:2 full AC": (2, ["parallel.strategy=fsdp", "parallel.tp=2", _FULL]),
    "fsdp:2 x tp:2 full AC": (4, ["parallel.strategy=fsdp", "parallel.tp=2", _FULL]),
    "pp:2 full AC": (2, ["parallel.strategy=fsdp", *_PP, _FULL]),
    "ddp x pp:2 full AC": (2, ["parallel.strategy=ddp", *_PP, _FULL]),
    "single selective AC": (1, ["parallel.strategy=ddp", _SEL]),
    "fsdp:2 selective AC": (2, ["parallel.strategy=fsdp", _SEL]),
    "tp:2 sp selective AC": (2, ["parallel.strategy=fsdp", "parallel.tp=2",
                                 "parallel.sequence_parallel=true", _SEL]),
    "pp:2 selective AC": (2, ["parallel.strategy=fsdp", *_PP, _SEL]),
    # Rowwise scaling: FSDP gathers in bf16.
    "rowwise single": (1, ["parallel.strategy=ddp", _ROW]),
    "rowwise fsdp:2": (2, ["parallel.strategy=fsdp", _ROW]),
    "rowwise fsdp:2 full AC": (2, ["parallel.strategy=fsdp", _ROW, _FULL]),
    "rowwise tp:2": (2, ["parallel.strategy=fsdp", "parallel.tp=2", _ROW]),
    "rowwise pp:2": (2, ["parallel.strategy=fsdp", *_PP, _ROW]),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(CHECKED))
def test_the_plan_of_float8_is_the_checked_code(layout: str) -> None:
    """The peak within 3% of the checked code's, the state between steps to the byte (the float8
    weights' scales with the parameters) and the bytes sent exact (the scales' agreements DTensor
    issues inside its dispatch among them)."""
    nproc, overrides = CHECKED[layout]
    config = load_config(overrides=[*SHAPE, *overrides])
    pipelined = "pp:" in layout
    for rank in [0, nproc - 1] if pipelined else [nproc - 1]:
        _check(config, nproc, rank, layout in WHOLE)


# Where every component at the peak is within 3% too (the others: docs/planning.md).
WHOLE = {"ddp:2 x tp:2, wide"}


def _check(config: Any, nproc: int, rank: int, components: bool = False) -> None:
    measured = measure_fake(config, nproc, 1, rank, "cpu")
    r = check_rank(config, nproc, 1, rank, measured, "cpu")
    assert r.skipped is None
    assert close(r.peak["predicted"], r.peak["checked"], 0.03), (r.peak, r.components)
    for name, c in r.components.items() if components else ():
        assert close(c["predicted"], c["checked"]), (name, r.peak, r.components)
    assert_state_is_planned(config, nproc, rank, measured["components"])
    assert r.collectives["predicted"] == r.collectives["checked"], r.by_collective
    gathers = r.by_collective.get("all_gather")
    if gathers is not None:
        assert gathers["predicted"] == gathers["checked"] > 0


def _config(*overrides: str) -> Any:
    return load_config(overrides=[*SHAPE, *overrides])


def test_fsdp_gathers_the_float8_weights_at_one_byte_an_element() -> None:
    """FSDP full on 2 ranks: two gathers a step (forward, backward), each one byte an element less
    for the float8 layers' weights than bf16's; rowwise gathers in bf16; after each optimizer step
    the precomputed scales' amaxes all-reduced, a float32 a float8 layer."""
    bf16 = plan_step(_config("parallel.strategy=fsdp", "train.float8.enabled=false"), 2)
    f8 = plan_step(_config("parallel.strategy=fsdp"), 2)
    row = plan_step(_config("parallel.strategy=fsdp", _ROW), 2)
    m = _config().model
    assert float8_layers(m) == ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    numel = m.n_layers * float8_block_params(m)
    assert bf16.comm_bytes["all_gather"] - f8.comm_bytes["all_gather"] == 2 * numel
    assert row.comm_bytes["all_gather"] == bf16.comm_bytes["all_gather"]
    assert f8.comm_bytes["all_reduce"] == bf16.comm_bytes["all_reduce"] + 4 * 7 * m.n_layers
    assert row.comm_bytes["all_reduce"] == bf16.comm_bytes["all_reduce"]
    # Each float8-gathered weight holds its scale (a float32) beside its shard.
    assert f8.params_bytes - bf16.params_bytes == 4 * 7 * m.n_layers
    assert row.params_bytes == bf16.params_bytes


def test_float8_layers_keep_no_weight_copy_on_float32_parameters() -> None:
    """One process (float32 parameters under autocast): the float8 layers save their float32
    weights, not autocast's bf16 copy, so a GPU's plan keeps 2 bytes a float8 parameter less; on
    FSDP's bf16 parameters nothing changes."""
    m = _config().model
    numel = m.n_layers * float8_block_params(m)
    single = ["parallel.strategy=ddp", "train.float8.enabled=false"]
    bf16 = plan_step(_config(*single), 1, device_type="cuda")
    f8 = plan_step(_config(*single[:1]), 1, device_type="cuda")
    assert bf16.activations_bytes - f8.activations_bytes == 2 * numel
    fsdp = ["parallel.strategy=fsdp", "train.float8.enabled=false"]
    bf16_fsdp = plan_step(_config(*fsdp), 2, device_type="cuda")
    f8_fsdp = plan_step(_config(*fsdp[:1]), 2, device_type="cuda")
    assert bf16_fsdp.activations_bytes == f8_fsdp.activations_bytes


def test_layers_whose_widths_are_not_multiples_of_16_stay_in_bf16() -> None:
    """A feed-forward width of 200 (not a multiple of 16): the attention's layers train in float8,
    the feed-forward's do not, as dtlab.parallel.float8 converts them."""
    m = _config("model.ffn_dim=200").model
    assert float8_layers(m) == ["wq", "wk", "wv", "wo"]
    assert float8_layers(m, moe_block=True) == ["wq", "wk", "wv", "wo"]


# --- step time: the float8 peak where the device has one, the casts, and where float8 gains nothing


def _compute(device: str, preset: str, *overrides: str) -> tuple[float, dict[str, Any] | None]:
    """The plan's compute seconds of DDP on 8 ranks of ``device`` (its strategies' row), and its
    float8 figures."""
    from dtlab.analysis.devices import PROFILES
    from dtlab.analysis.plan import plan

    config = load_config(overrides=[f"model.preset={preset}", "train.precision=bf16",
                                    "parallel.strategy=ddp", *overrides])  # fmt: skip
    p = plan(config, 8, 1, PROFILES[device], None)
    (ddp,) = [r for r in p["strategies"] if r["label"] == "ddp"]
    return ddp["compute_time_s"], p.get("float8")


def test_float8_peaks_are_the_datasheets_dense_figures() -> None:
    """Half the datasheets' "with sparsity" float8 figures, each with its source, twice the bf16
    dense peak on each; none for the A100s (no float8 tensor cores)."""
    from dtlab.analysis.devices import PROFILES

    fp8 = {k: p for k, p in PROFILES.items() if "fp8" in p.peak_tflops}
    assert sorted(fp8) == ["h100", "h200", "l4", "rtx4090"]
    assert PROFILES["h100"].peak_tflops["fp8"] == PROFILES["h200"].peak_tflops["fp8"] == 1978.9
    for p in fp8.values():
        assert "datasheet" in p.fp8_source or "whitepaper" in p.fp8_source
        assert abs(p.peak_tflops["fp8"] / p.peak_tflops["bf16"] - 2) < 0.01
        assert p.memory_gbps


def test_float8_speeds_the_gemms_of_a_large_model_on_an_h100() -> None:
    """llama3.2-1b on 8 H100: the float8 layers' GEMMs at the float8 peak (half their bf16 time,
    none memory-bound), the casts added, the step's compute shorter by what the plan says."""
    bf16, _ = _compute("h100", "llama3.2-1b")
    f8_s, f8 = _compute("h100", "llama3.2-1b", "train.float8.enabled=true")
    assert f8 is not None and not f8["emulated"] and not f8["memory_bound"]
    assert f8["gemm_float8_s"] == pytest.approx(f8["gemm_bf16_s"] / 2, rel=1e-3)
    assert 0 < f8["casts_s"] < f8["gemm_bf16_s"] - f8["gemm_float8_s"]
    assert bf16 - f8_s == pytest.approx(f8["saved_s"], rel=1e-6)
    assert 1.1 < bf16 / f8_s < 2


def test_float8_gains_nothing_on_small_matrices_nor_where_it_is_emulated() -> None:
    """The debug model's GEMMs are memory-bound in float8 on an H100 (kept at their bf16 time, the
    casts on top); an A100 has no float8 GEMM: emulated, slower by the casts; so is
    train.float8.emulate = on on an H100."""
    bf16, _ = _compute("h100", "debug")
    f8_s, f8 = _compute("h100", "debug", "train.float8.enabled=true")
    assert f8 is not None and len(f8["memory_bound"]) == 7
    assert f8["gemm_float8_s"] == f8["gemm_bf16_s"] and f8_s > bf16
    a100, _ = _compute("a100-80gb", "llama3.2-1b")
    a100_f8, f8 = _compute("a100-80gb", "llama3.2-1b", "train.float8.enabled=true")
    assert f8 is not None and f8["emulated"] and "no float8 GEMM" in f8["why"]
    assert a100_f8 - a100 == pytest.approx(f8["casts_s"], rel=1e-6)
    h100, _ = _compute("h100", "llama3.2-1b")
    on, f8 = _compute("h100", "llama3.2-1b", "train.float8.enabled=true", "train.float8.emulate=on")
    assert f8 is not None and f8["emulated"] and on > h100


def test_the_search_keeps_float8_as_the_config_gives_it() -> None:
    """train.float8 is the user's choice: every searched row of a float8 config trains in float8
    (its layout line says bf16+fp8), no row of a bf16 config does."""
    from dtlab.analysis.devices import PROFILES
    from dtlab.analysis.plan import plan
    from dtlab.analysis.plan_format import format_plan

    base = ["model.preset=llama3.2-1b", "train.precision=bf16", "parallel.strategy=fsdp"]
    f8 = plan(
        load_config(overrides=[*base, "train.float8.enabled=true"]), 8, 1, PROFILES["h100"], None
    )
    plain = plan(load_config(overrides=base), 8, 1, PROFILES["h100"], None)
    assert f8["search"]["rows"] and all(
        r.get("float8") == "tensorwise" for r in f8["search"]["rows"]
    )
    assert not any(r.get("float8") for r in plain["search"]["rows"]) and "float8" not in plain
    text = format_plan(f8)
    assert "bf16+fp8" in text and "float8 (tensorwise): 112 layers a rank" in text
    assert "with float8 tensorwise layers" in f8["recommendation"]
    assert "fp8" not in format_plan(plain)


def test_the_cli_plans_and_checks_a_float8_layout() -> None:
    """``dtlab plan --check`` of an FSDP float8 layout on H100s: the layout line says bf16+fp8, the
    float8 layers' GEMMs are named memory-bound on the debug model, and the check runs."""
    proc = run_cli(
        "plan", "--check", "--device", "h100", "--nproc", "2", "--set", *SHAPE,
        "parallel.strategy=fsdp", "parallel.sharding=full", "parallel.tp=1", "parallel.pp=1",
        "train.activation_checkpointing=full",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "float8 (tensorwise): 14 layers a rank" in out
    (given,) = [line for line in out.splitlines() if line.startswith("as given: ")]
    assert "bf16+fp8" in given
    assert "no faster in float8 (memory-bound" in out
    assert "check of the recommended layout" in out and "sent/step" in out


# Run for real (gloo processes, real tensors, the float8 layers emulated) and checked alike.
REAL = {
    "fsdp:2 full AC": (2, ["parallel.strategy=fsdp", _FULL]),
    "ddp:2": (2, ["parallel.strategy=ddp"]),
}


@pytest.mark.parametrize("layout", list(REAL))
def test_a_checked_float8_rank_holds_and_sends_what_a_real_rank_does(
    tmp_path: Path, layout: str
) -> None:
    """The same float8 config run for real and checked, both measured with MemTracker (the real
    run at its third step, each step's scales made before its first forward): the
    state to the byte (but one more set of the scales in the real run's buffers), the step's peak
    and what is alive then within 1%, every collective's bytes equal, on every rank."""
    nproc, extra = REAL[layout]
    overrides = [*SHAPE, *extra]
    run_worker("check_worker.py", nproc, str(tmp_path), *overrides)
    config = load_config(overrides=overrides)
    for rank in range(nproc):
        real: dict[str, Any] = json.loads((tmp_path / f"rank{rank}.json").read_text())
        fake = measure_fake(config, nproc, 1, rank)
        own, held = real["components"], fake["components"]
        for name in ("params", "grads", "optimizer"):
            assert own[name] == held[name], (rank, name)
        # A real run's third step holds one more set of the float8 weights' scales than the
        # check's one step (a float32 a float8 layer), among its buffers.
        scales = float8_scale_bytes(config, ParallelDims.from_config(config, nproc), config.model)
        assert own["buffers"] - held["buffers"] == scales, (rank, own, held)
        real_peak = max(real["timeline"].values(), key=lambda m: m["total"])
        fake_peak = max(fake["timeline"].values(), key=lambda m: m["total"])
        assert close(fake_peak["total"], real_peak["total"], 0.01), (rank, real_peak, fake_peak)
        for name, n in real_peak["components"].items():
            assert close(fake_peak["components"][name], n, 0.01), (rank, name, real_peak)
        assert fake["collectives"] == real["collectives"]
