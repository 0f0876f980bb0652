"""FSDP and HSDP under ``train.precision`` bf16/fp16: parameters gathered and computed in half precision,
float32 master weights kept sharded, gradients reduced in float32 (unless compression says otherwise).

Real gloo processes throughout: the policy FSDP was given, what clipping, the optimizer and checkpoints
see, the all-gather bytes counted against the plan's, and the training against one bf16 process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import FAST, checkpoint_tensors, read_metrics, run_cli, run_worker, train_run
from dtlab.analysis.model import fsdp_half_params, plan_step
from dtlab.config import load_config
from dtlab.dims import ParallelDims
from dtlab.parallel.apply import fsdp_param_dtype, mixed_precision_policy
from dtlab.verify import HALF_PRECISION_TOLERANCES

CLIP = 0.5  # below every step's gradient norm in the verify runs: the clip acts on each step
SMALL = ["model.preset=debug", "data.source=synthetic", "data.seq_len=64",
         "train.global_batch_size=8"]  # fmt: skip


def test_the_policy_of_each_precision() -> None:
    bf16 = mixed_precision_policy(torch.bfloat16, None)
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    # The RoPE tables a block takes stay float32 (FSDP would cast every floating input).
    assert not bf16.cast_forward_inputs
    fp16 = mixed_precision_policy(torch.float16, None)
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float32)
    # Gradient compression names the reduction's dtype, under any precision.
    compressed = mixed_precision_policy(torch.bfloat16, torch.float16)
    assert (compressed.param_dtype, compressed.reduce_dtype) == (torch.bfloat16, torch.float16)
    fp32 = mixed_precision_policy(None, torch.bfloat16)
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, torch.bfloat16)
    assert mixed_precision_policy(None, None).param_dtype is None


@pytest.mark.parametrize(
    ("overrides", "dtype"),
    [
        (["parallel.strategy=fsdp", "train.precision=bf16"], torch.bfloat16),
        (["parallel.strategy=hsdp", "parallel.replicate=2", "train.precision=fp16"], torch.float16),
        (["parallel.strategy=fsdp", "parallel.tp=2", "train.precision=bf16"], torch.bfloat16),
        (["parallel.strategy=fsdp", "train.precision=fp32"], None),
        # DDP with tp is replicated by FSDP2 (no DTensor in DistributedDataParallel): it stays DDP,
        # float32 parameters under autocast.
        (["parallel.strategy=ddp", "parallel.tp=2", "train.precision=bf16"], None),
        (["parallel.strategy=ddp", "train.precision=bf16"], None),
    ],
)
def test_only_fsdp_and_hsdp_gather_half_precision(
    overrides: list[str], dtype: torch.dtype | None
) -> None:
    config = load_config(overrides=[*SMALL, *overrides])
    assert fsdp_param_dtype(config) == dtype
    dims = ParallelDims.from_config(config, 4)
    assert fsdp_half_params(config, dims) == (dtype is not None)


@pytest.fixture(scope="module")
def fsdp_step(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    out = tmp_path_factory.mktemp("fsdp-bf16") / "step.json"
    run_worker("fsdp_bf16_worker.py", 2, str(out))
    result: dict[str, dict[str, object]] = json.loads(out.read_text())
    return result


# train.precision (and compression) -> the mixed-precision policy of every FSDP unit.
POLICIES = {
    "fp32": "None None",
    "bf16": "torch.bfloat16 torch.float32",
    "fp16": "torch.float16 torch.float32",
    "bf16+bf16-compression": "torch.bfloat16 torch.bfloat16",
    "fp32+bf16-compression": "None torch.bfloat16",
}


def assert_float32_master_weights(r: dict[str, object], policy: str) -> None:
    """One case of fsdp_bf16_worker.py: the policy it was given, and float32 state everywhere."""
    assert r["policies"] == [policy], r  # every FSDP unit, the blocks and the root
    # What the optimizer updates, clips and keeps state for: float32 shards, in every case.
    for key in ("params", "grads", "optimizer"):
        assert r[key] == ["torch.float32 sharded"], (key, r)
    # Clipping acted on the whole model's float32 gradients: their norm over both ranks' shards is
    # the clip, and the norm reported is the (larger) one before clipping.
    assert r["clipped_norm"] == pytest.approx(0.01, rel=1e-5), r
    assert isinstance(r["grad_norm"], float) and r["grad_norm"] > 0.1, r


def test_the_residual_stream_is_half_precision_under_bf16_only(
    fsdp_step: dict[str, dict[str, object]],
) -> None:
    # bf16 has float32's range; fp16's residual adds overflow past 65,504 in large models, so under
    # fp16 the stream stays float32 (the embedding's output made so) while the weights are fp16.
    assert fsdp_step["bf16"]["stream"] == ["torch.bfloat16"]
    assert fsdp_step["fp16"]["stream"] == ["torch.float32"]
    assert fsdp_step["fp32"]["stream"] == ["torch.float32"]


@pytest.mark.parametrize(("case", "policy"), POLICIES.items())
def test_fsdp_keeps_float32_master_weights_and_gradients(
    fsdp_step: dict[str, dict[str, object]], case: str, policy: str
) -> None:
    assert_float32_master_weights(fsdp_step[case], policy)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp_keeps_float32_master_weights_on_cuda(tmp_path: Path) -> None:
    """FSDP under bf16/fp16 on CUDA over NCCL (one rank per GPU, two where there are two): every unit
    gathers in the half dtype and reduces in float32 (or the compression's dtype), and the parameters,
    the clipped gradients and AdamW's moments stay float32 shards."""
    out = tmp_path / "step.json"
    run_worker("fsdp_bf16_worker.py", min(2, torch.cuda.device_count()), str(out))
    result = json.loads(out.read_text())
    for case, policy in POLICIES.items():
        assert_float32_master_weights(result[case], policy)


def test_fsdp_bf16_checkpoint_stays_float32(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_run(run, "parallel.strategy=fsdp", "train.precision=bf16", "checkpoint.every=3", nproc=2,
              steps=3)  # fmt: skip
    tensors = checkpoint_tensors(run / "checkpoints" / "step-00000003")
    floating = {k: t.dtype for k, t in tensors.items() if t.is_floating_point()}
    model = [k for k in floating if "layers.0.attention.wq.weight" in k]
    assert model and len(model) >= 3, sorted(floating)  # the weight and its two AdamW moments
    assert set(floating.values()) == {torch.float32}, {
        k: v for k, v in floating.items() if v != torch.float32
    }


def bench_fp32_and_bf16(out: Path) -> dict[str, dict[str, Any]]:
    """``dtlab bench`` of fsdp on 2 ranks in fp32 and bf16: its rows by precision, after checking
    that the all-gathers counted from the collectives issued halve, to the plan's byte."""
    proc = run_cli(
        "bench", "--strategies", "fsdp", "--nproc", "2", "--precision", "fp32,bf16", "--steps", "2",
        "--warmup", "1", "--out", str(out), "--set", *SMALL, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["precision"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    fp32, bf16 = rows["fp32"]["comm_by_collective"], rows["bf16"]["comm_by_collective"]
    # The debug model's 131392 parameters, gathered for forward and again for backward.
    assert fp32["all_gather"]["bytes"] == 2 * 4 * 131392
    assert bf16["all_gather"] == {"count": fp32["all_gather"]["count"], "bytes": 2 * 2 * 131392}
    # Gradients are still reduce-scattered in float32.
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"]
    for precision, row in rows.items():
        plan = plan_step(load_config(overrides=[*SMALL, "parallel.strategy=fsdp",
                                                f"train.precision={precision}"]), 2)  # fmt: skip
        assert row["comm_by_collective"]["all_gather"]["bytes"] == plan.comm_bytes["all_gather"]
        assert row["comm_bytes_per_step"] == row["comm_bytes_per_step_predicted"], precision
        assert row["state_bytes"] == row["state_bytes_predicted"], precision
    return rows


def test_fsdp_bf16_all_gather_bytes_halve_as_the_plan_says(tmp_path: Path) -> None:
    """Counted from the collectives issued (the bench's dispatch-mode counter), to the byte."""
    rows = bench_fp32_and_bf16(tmp_path / "bench")
    for precision, row in rows.items():
        # What forward keeps: no weight copies, a bf16 residual stream (predicted to the byte).
        assert row["activation_bytes"] == row["activation_bytes_predicted"], precision
    assert rows["bf16"]["activation_bytes"] < rows["fp32"]["activation_bytes"]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fsdp_bf16_all_gather_bytes_halve_on_two_gpus(tmp_path: Path) -> None:
    """FSDP on 2 GPUs over NCCL: the all-gathers counted under bf16 move half of fp32's bytes, equal
    to the plan's to the byte; gradients are reduce-scattered in float32 in both."""
    rows = bench_fp32_and_bf16(tmp_path / "bench")
    assert {r["device"] for r in rows.values()} != {"cpu"}, rows


def test_plan_gathers_half_precision_parameters() -> None:
    def plan(*overrides: str) -> dict[str, int]:
        config = load_config(overrides=[*SMALL, "model.preset=tiny", *overrides])
        p = plan_step(config, 8)
        return {**p.comm_bytes, "gathered": p.gathered_bytes, "params": p.params_bytes}

    for strategy in (
        ["parallel.strategy=fsdp"],
        ["parallel.strategy=hsdp", "parallel.replicate=2"],
    ):
        fp32 = plan(*strategy)
        bf16 = plan(*strategy, "train.precision=bf16")
        fp16 = plan(*strategy, "train.precision=fp16")
        assert bf16["all_gather"] * 2 == fp32["all_gather"] == fp16["all_gather"] * 2
        assert bf16["gathered"] * 2 == fp32["gathered"]  # the unsharded parameters at the peak
        assert bf16["params"] == fp32["params"]  # the float32 shards
        assert bf16["reduce_scatter"] == fp32["reduce_scatter"]  # float32 gradients
        # Compression reduces in bf16 (half the bytes), and gathers in the training precision.
        both = plan(*strategy, "train.precision=bf16", "parallel.compression=bf16")
        assert both["reduce_scatter"] * 2 == fp32["reduce_scatter"]
        assert both["all_gather"] == bf16["all_gather"]
    # DDP and ZeRO-1 gather no parameters in the training precision: unchanged.
    for sharding in ("full", "optimizer"):
        ddp = [*SMALL, "parallel.strategy=ddp", f"parallel.sharding={sharding}"]
        fp32_plan = plan_step(load_config(overrides=ddp), 2).comm_bytes
        bf16_plan = plan_step(load_config(overrides=[*ddp, "train.precision=bf16"]), 2).comm_bytes
        assert fp32_plan == bf16_plan


def test_fsdp_bf16_trains_like_one_bf16_process(tmp_path: Path) -> None:
    """``dtlab verify`` under bf16: its default tolerances are bf16's (documented in
    dtlab.verify), and FSDP alone and composed with TP and with PP keep within them."""
    out = tmp_path / "out"
    layouts = "single,fsdp:2,fsdp:2xtp:2,fsdp:2xpp:2"
    proc = run_cli("verify", "--layouts", layouts, "--steps", "6", "--out", str(out), "--set", *FAST,
                   "train.precision=bf16", f"train.grad_clip={CLIP}", timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "verify.json").read_text())
    tol = HALF_PRECISION_TOLERANCES
    assert result["tolerances"] == {
        "loss": tol.loss,
        "grad_norm": tol.grad_norm,
        "param": tol.param,
    }
    assert [r["layout"] for r in result["rows"]] == layouts.split(",")[1:]
    for row in result["rows"]:
        assert row["ok"] and row["max_loss_diff"] <= tol.loss, row
        # bf16 rounding shows (parameters gathered and computed in bf16), but no more than that.
        assert row["max_loss_diff"] > 0, row
    # Clipping was active on the reference (the debug model's norm is 0.65 to 0.8 on these steps).
    ref = read_metrics(out / "0-single")
    assert all(m["grad_norm"] > CLIP and math.isfinite(m["loss"]) for m in ref), ref


def test_bf16_tolerances_still_catch_a_skipped_gradient_sync(tmp_path: Path) -> None:
    proc = run_cli("verify", "--layouts", "single,ddp:2", "--steps", "6", "--out",
                   str(tmp_path / "out"), "--set", *FAST, "train.precision=bf16",
                   env={"DTLAB_FAULTS": "skipsync@3"})  # fmt: skip
    assert proc.returncode == 1, proc.stderr + proc.stdout
    assert "(tolerances: loss 0.005, grad norm 0.01 relative, parameters 0.05)" in proc.stdout
    assert "ddp:2: the training first differs beyond tolerance at step 3" in proc.stdout


def test_fsdp_fp16_overflow_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    """fp16 takes the same policy as bf16: the loss scaler unscales FSDP's float32 gradient shards,
    and a step whose gradients overflow (a NaN loss at step 4) changes no float32 state and halves
    the scale."""
    run = tmp_path / "run"
    proc = run_cli(
        "train", "--nproc", "2", "--set", *FAST, "train.steps=6", f"run.dir={run}",
        "parallel.strategy=fsdp", "train.precision=fp16", "checkpoint.every=1", "checkpoint.keep=10",
        env={"DTLAB_FAULTS": "nan@4"},
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics if m["skipped"]] == [4], metrics
    scales = {m["step"]: m["loss_scale"] for m in metrics}
    assert scales[4] == scales[3] / 2 == scales[6], scales
    before, after = (checkpoint_tensors(run / "checkpoints" / f"step-{s:08d}") for s in (3, 4))
    floating = [k for k, t in before.items() if t.is_floating_point()]
    assert floating and all(before[k].dtype == torch.float32 for k in floating)
    for k in floating:
        assert torch.equal(before[k], after[k]), k
