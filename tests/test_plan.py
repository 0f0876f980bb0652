"""``dtlab plan``: its advice, its step time with activation checkpointing, its header and its choice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import dtlab
from conftest import FAST, run_cli, run_worker
from dtlab.analysis.devices import PROFILES
from dtlab.analysis.model import (
    elementwise_flops_per_token,
    plan_step,
    recompute_flops_per_token,
)
from dtlab.analysis.plan import format_plan, format_tflops, plan
from dtlab.config import TrainConfig, load_config
from dtlab.models.llama import build_model
from dtlab.parallel.apply import apply_ac

DEBUG = ["model.preset=debug", "data.seq_len=64"]


def run_plan(*overrides: str, nproc: int = 2, memory_gib: float | None = None) -> dict[str, Any]:
    return plan(load_config(overrides=[*DEBUG, *overrides]), nproc, 1, PROFILES["h100"], memory_gib)


# The layout given in full: the plan's search chooses none of it (it would find what fits).
PINNED = [
    "parallel.strategy=ddp",
    "parallel.sharding=full",
    "parallel.tp=1",
    "parallel.pp=1",
    "train.micro_batch_size=8",
]


def test_each_strategy_row_is_its_own_layout_whatever_the_config_sets() -> None:
    """A config of ZeRO-1: its sharding is its row's, not DDP's (DDP's row holds the whole optimizer
    state and all-reduces; ZeRO-1's half of it, reduce-scattered and all-gathered)."""
    rows = {
        r["label"]: r
        for r in run_plan("parallel.strategy=ddp", "parallel.sharding=optimizer")["strategies"]
    }
    ddp, zero = rows["ddp"], rows["ddp zero-1"]
    assert set(ddp["comm"]["bytes_per_step"]) == {"all_reduce"}
    assert {"reduce_scatter", "all_gather"} <= set(zero["comm"]["bytes_per_step"])
    full, half = ddp["per_rank"]["optimizer_bytes"], zero["per_rank"]["optimizer_bytes"]
    assert full == pytest.approx(2 * half, rel=0.01)
    assert rows == {
        r["label"]: r
        for r in run_plan("parallel.strategy=ddp", "parallel.sharding=full")["strategies"]
    }


def test_advice_skips_what_is_already_set() -> None:
    # 4 MiB per rank: nothing fits, so the plan advises.
    bare = run_plan(
        *PINNED, "train.precision=fp32", "train.activation_checkpointing=none", memory_gib=0.004
    )
    assert bare["recommendation"].startswith("nothing fits")
    assert "train.activation_checkpointing=full" in bare["recommendation"]
    assert "train.precision=bf16" in bare["recommendation"]
    # 3 MiB: FSDP under bf16 gathers half the bytes, and its 3.5 MiB would fit 4 MiB.
    set_ = run_plan(
        *PINNED, "train.precision=bf16", "train.activation_checkpointing=full", memory_gib=0.003
    )
    assert set_["recommendation"].startswith("nothing fits")
    assert "activation_checkpointing" not in set_["recommendation"]
    assert "precision" not in set_["recommendation"]
    assert "micro_batch_size" in set_["recommendation"] and "--nproc" in set_["recommendation"]


def test_activation_checkpointing_adds_its_recompute_to_the_step_time() -> None:
    steps = {}
    for ac in ("none", "selective", "full"):
        rows = run_plan(f"train.activation_checkpointing={ac}")["strategies"]
        steps[ac] = {r["label"]: r for r in rows}
    for label, none in steps["none"].items():
        full, selective = steps["full"][label], steps["selective"][label]
        assert none["recompute_time_s"] == 0
        assert full["compute_time_s"] == none["compute_time_s"]
        assert none["step_time_s"] < selective["step_time_s"] < full["step_time_s"]
        # A full recompute is nearly one more forward: about a third of forward + backward.
        ratio = full["recompute_time_s"] / full["compute_time_s"]
        assert 0.15 < ratio < 1 / 3, ratio


@pytest.mark.parametrize(
    "options", [[], ["model.head_dim=32", "model.qk_norm=true", "model.qkv_bias=true"]]
)
def test_full_recompute_flops_against_counted_matmuls(options: list[str]) -> None:
    """The extra matmul FLOPs torch's counter sees with ``full`` checkpointing, plus the recomputed
    attention scores by hand (the counter does not see CPU attention kernels), are the predicted
    recompute less its element-wise ops; also with Qwen's options (heads wider than dim / n_heads,
    q/k norms, q/k/v biases)."""
    cfg = load_config(overrides=[*DEBUG, *options])
    batch, seq = 2, 64
    counted = {}
    for ac in ("none", "full"):
        model = build_model(cfg.model, "cpu")
        apply_ac(model, ac)
        tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq))
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        counted[ac] = counter.get_total_flops()
    width = cfg.model.n_heads * (cfg.model.head_dim or cfg.model.dim // cfg.model.n_heads)
    attention = 4 * batch * seq * seq * width * cfg.model.n_layers
    predicted = recompute_flops_per_token(cfg.model, seq, "full") - elementwise_flops_per_token(
        cfg.model
    )
    assert counted["full"] > counted["none"]
    assert counted["full"] - counted["none"] + attention == pytest.approx(
        predicted * batch * seq, abs=cfg.model.n_layers * cfg.model.dim * batch * seq
    )


@pytest.mark.parametrize(
    ("peak", "shown"), [(0.20688964109557004, "0.207"), (1.2345, "1.23"), (989.4, "989.4")]
)
def test_the_header_formats_the_peak(peak: float, shown: str) -> None:
    assert format_tflops(peak) == shown
    result = run_plan()
    result["device"]["peak_tflops"] = peak
    header = format_plan(result).splitlines()
    assert any(f"peak     {shown} TFLOP/s" in line for line in header)
    assert str(peak) not in "\n".join(header) or str(peak) == shown


def test_the_default_device_is_labelled_as_assumed() -> None:
    default = run_cli("plan", "--set", *DEBUG)
    assert default.returncode == 0, default.stderr
    assert "assumed: the default profile h100; pass --device" in default.stdout
    given = run_cli("plan", "--device", "h100", "--set", *DEBUG)
    assert given.returncode == 0, given.stderr
    assert "default profile" not in given.stdout and "H100" in given.stdout


def _rank_params(overrides: list[str], world: int) -> int:
    from dtlab.analysis.model import plan_step

    return plan_step(load_config(overrides=["model.preset=tiny", *overrides]), world).params_bytes


def test_plan_splits_the_model_over_tensor_and_pipeline_ranks() -> None:
    """Tensor parallelism halves every matrix (the norms stay whole); pipeline parallelism holds a
    stage's blocks, and the plan reports the rank that needs the most: here, under GPipe (every
    stage holds every micro-batch), the last stage of the tiny model (2 of 4 blocks + final norm +
    output + the logits; the first has the embedding, of the output's size, and no norm)."""
    model = build_model(load_config(overrides=["model.preset=tiny"]).model)
    total = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    assert _rank_params([], 1) == 4 * total
    assert _rank_params(["parallel.tp=2"], 2) == 4 * ((total - norms) // 2 + norms)
    last = sum(
        p.numel() for n, p in model.named_parameters()
        if n.startswith(("layers.2.", "layers.3.", "norm.", "output."))
    )  # fmt: skip
    assert _rank_params(["parallel.pp=2", "parallel.pp_schedule=gpipe"], 2) == 4 * last


def test_plan_counts_tensor_and_pipeline_traffic() -> None:
    """TP: 7 activation all-reduces per block and micro-batch (2 forward, 5 backward), +1 for the
    embedding and +1 for the output, + the vocabulary-parallel loss's 3 floats per token; with SP 4
    all-gathers and 4 reduce-scatters per block, +1 of each at the ends. PP (1F1B): the first stage
    sends each micro-batch's activations. (The counts are what CommDebugMode sees in a step.)"""
    from dtlab.analysis.model import plan_step

    base = ["model.preset=tiny", "data.seq_len=64", "train.global_batch_size=8"]
    tokens, dim = 8 * 64, 256
    tp = plan_step(load_config(overrides=[*base, "parallel.tp=2"]), 2).comm_bytes
    assert tp["tp all_reduce"] == (7 * 4 + 2) * tokens * dim * 4 + 3 * tokens * 4
    sp = plan_step(
        load_config(overrides=[*base, "parallel.tp=2", "parallel.sequence_parallel=true"]), 2
    ).comm_bytes
    assert sp["tp all_gather"] == sp["tp reduce_scatter"] == (4 * 4 + 2) * tokens * dim * 4
    pp = plan_step(
        load_config(overrides=[*base, "parallel.pp=2", "parallel.pp_microbatches=4"]), 2
    ).comm_bytes
    assert pp["send/recv"] == 4 * (tokens // 4) * dim * 4  # 4 micro-batches of 2 samples


def test_plan_command_runs_a_three_dimensional_layout() -> None:
    proc = run_cli("plan", "--nproc", "8", "--set", "model.preset=tiny", "parallel.tp=2",
                   "parallel.pp=2", "parallel.sequence_parallel=true", "train.global_batch_size=16")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "fsdp full tp2 pp2 1f1b" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_plan_predicts_the_collectives_tensor_parallelism_issues(layout: str) -> None:
    """Measured by torch's CommDebugMode in a real two-rank step, predicted by the plan."""
    run_worker("tp_comm_worker.py", 2, layout)


@pytest.mark.parametrize("optimizer", get_args(TrainConfig.model_fields["optimizer"].annotation))
def test_plan_predicts_every_optimizers_state_as_measured(tmp_path: Path, optimizer: str) -> None:
    """The plan's optimizer bytes are what the run holds (summary.json), for each train.optimizer:
    AdamW's two moments, DeMo's chunk-padded momentum, nothing for dtlab's momentum-free SGD."""
    overrides = [*FAST, "train.steps=1", f"train.optimizer={optimizer}", f"run.dir={tmp_path}"]
    measured = dtlab.train(None, overrides)["optimizer_state_bytes"]
    predicted = plan_step(load_config(overrides=overrides), 1).optimizer_bytes
    assert predicted == measured, (optimizer, predicted, measured)
    if optimizer != "sgd":
        assert measured > 0


def test_the_plan_of_this_device_on_a_gpu_node_is_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where torch sees a GPU, --device this measures it (the device the ranks would train on), not
    # the CPU; its profile plans as a GPU's (45% of the measured peak, the GPU's fit rule), and the
    # CPU's probe of the model's step is not taken for it.
    from dataclasses import replace

    from dtlab.analysis import devices
    from dtlab.analysis.probe import with_probe
    from dtlab.config import load_config

    measured = replace(devices.PROFILES["h100"], key="this", device_type="cuda")
    monkeypatch.setattr(devices, "this_gpu", lambda precision: measured)
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: True)
    assert devices.this_device("bf16") is measured and measured.kind == "cuda"
    config = load_config(overrides=["model.preset=debug"])
    assert with_probe(measured, config, 2) == (
        measured,
        "a GPU: the model's step is probed on the CPU only",
    )
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    assert devices.this_device("fp32").kind == "cpu"
    assert devices.known_profile("NVIDIA H100 80GB HBM3") is devices.PROFILES["h100"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_plan_device_this_measures_the_gpu() -> None:
    """``dtlab plan --device this`` on a GPU node: the device is the GPU (its name, its memory as torch
    reports it, a GEMM measured on it), planned as a GPU (the 45% rate, not a CPU probe)."""
    proc = run_cli("plan", "--device", "this", "--json", "--set", "model.preset=debug")
    assert proc.returncode == 0, proc.stderr
    device = json.loads(proc.stdout)["device"]
    name = torch.cuda.get_device_name(0)
    assert name in device["name"], device
    assert (
        abs(device["memory_gib"] - torch.cuda.get_device_properties(0).total_memory / 2**30) < 0.01
    )
    assert device["source"].startswith("measured: fp32 GEMM 8192^3 on cuda:0"), device
