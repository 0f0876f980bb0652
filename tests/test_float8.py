"""train.float8: the blocks' linear layers trained in float8 through torchao (emulated on this CPU),
the rest in bf16. Every layout equal to one process within bf16's tolerances, checkpoints exact and
interchangeable with bf16's, and FSDP's all-gather of the float8 weights half of bf16's bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import FAST, read_metrics, run_cli, train_run
from dtlab.config import load_config
from dtlab.errors import ConfigError
from dtlab.models.llama import build_model
from dtlab.parallel.float8 import (
    FLOAT8_LINEARS,
    apply_float8,
    emulated,
    float8_linears,
    float8_tp_comm,
    import_float8,
)

F8 = ["train.precision=bf16", "train.float8.enabled=true"]


def _model(*overrides: str) -> torch.nn.Module:
    config = load_config(None, [*FAST, *overrides])
    return build_model(config.model, device="cpu")


def test_the_blocks_linear_layers_and_only_they_train_in_float8() -> None:
    """Attention's q/k/v/o and the dense feed-forward's w1/w2/w3 of every block become Float8Linear;
    the embeddings, norms and output projection do not, and the parameters keep their names (a
    float8 model's state dict is the plain model's)."""
    plain = _model()
    model = _model()
    swapped = apply_float8(model, "tensorwise", emulate=True, all_gather=False)
    layers = len(plain.layers)
    assert sorted(swapped) == sorted(
        f"layers.{i}.{name}" for i in range(layers) for name in FLOAT8_LINEARS
    )
    assert len(float8_linears(model)) == 7 * layers
    assert type(model.output).__name__ == "Linear"  # the logits stay in bf16
    assert list(model.state_dict()) == list(plain.state_dict())


def test_a_mixture_of_experts_keeps_its_router_and_experts_out_of_float8() -> None:
    """In an MoE block only attention's projections train in float8: the router's scores choose the
    experts, and the experts are one batched weight, not linear layers torchao converts."""
    model = _model("model.moe.experts=4", "model.moe.top_k=2")
    swapped = apply_float8(model, "rowwise", emulate=True, all_gather=False)
    assert swapped and all(".attention." in name for name in swapped), swapped
    assert not any("router" in name or "feed_forward" in name for name in swapped)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["train.float8.enabled=true"],
            "train.precision = 'fp32' is not supported with train.float8",
        ),
        (
            ["train.float8.enabled=true", "train.precision=fp16"],
            "train.precision = 'fp16' is not supported with train.float8.enabled = true (allowed: 'bf16')",
        ),
        (
            [*F8, "train.engine=mlx"],
            "train.engine = 'mlx' is not supported with train.float8.enabled = true",
        ),
        ([*F8, "train.float8.recipe=blockwise"], "train.float8.recipe"),
    ],
)
def test_what_float8_does_not_go_with_is_refused(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, overrides)
    assert needle in str(e.value), str(e.value)


def test_the_device_decisions_a_gpu_run_makes() -> None:
    """Read on a CPU: tensor parallelism moves float8 activations only with tensorwise scales on
    NCCL (gloo cannot send a float8 tensor: "Invalid scalar type"); the GEMMs are emulated on a CPU
    whatever ``auto`` finds, always with ``on``, never with ``off``."""
    assert float8_tp_comm("tensorwise", "nccl")
    assert not float8_tp_comm("tensorwise", "gloo") and not float8_tp_comm("rowwise", "nccl")
    cpu = torch.device("cpu")
    assert emulated("auto", cpu) and emulated("on", cpu) and not emulated("off", cpu)


def test_without_torchao_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # an import of it raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'dtlab\[float8\]'"):
        import_float8()


def test_torchaos_import_says_nothing(tmp_path: Path) -> None:
    """A float8 run's console has no warning of torchao's CUDA extensions a CPU build lacks."""
    proc = run_cli(
        "train", "--set", *FAST, *F8, "train.steps=1", f"run.dir={tmp_path / 'run'}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "register_constant" not in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["float8"] == {
        "recipe": "tensorwise", "emulated": True, "layers": 14, "all_gather": False,
    }  # fmt: skip
    assert "14 linear layers in float8, tensorwise, emulated" in proc.stdout + proc.stderr


def _verify(tmp_path: Path, layouts: str, *extra: str) -> dict[str, Any]:
    """dtlab verify of FAST in float8 (``extra``: more arguments; a ``--set`` among them last). It
    trains every layout in one micro-batch size (a tensorwise scale is the amax of the tensor it
    casts: the layouts compare the same casts only when each micro-batch holds the same samples)."""
    sets = list(extra[extra.index("--set") + 1 :]) if "--set" in extra else []
    flags = list(extra[: extra.index("--set")]) if "--set" in extra else list(extra)
    proc = run_cli(
        "verify", "--layouts", layouts, "--steps", "6", "--out", str(tmp_path / "v"), *flags,
        "--set", *FAST, *F8, *sets,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads((tmp_path / "v" / "verify.json").read_text())
    assert result["ok"]
    result["stdout"] = proc.stdout + proc.stderr
    return result


@pytest.mark.parametrize(
    "layouts",
    [
        "single,fsdp:2,sp:2",
        pytest.param("single,ddp:2,tp:2,pp:2,hsdp:4,fsdp:2xtp:2", marks=pytest.mark.slow),
    ],
)
def test_float8_layouts_equal_one_process(tmp_path: Path, layouts: str) -> None:
    """Every layout in float8 within the tolerances dtlab verify gives bf16 layouts (loss 5e-3,
    parameters 5e-2; measured: loss within 9e-4, parameters 1.4e-2, as bf16's own layouts); each
    layout's resume exact, a resume on one process and the exports within the same tolerances."""
    result = _verify(tmp_path, layouts, "--checks", "all")
    assert result["tolerances"]["loss"] == 5e-3, result["tolerances"]  # bf16's, not looser
    # A batch of 8 on at most 2 (hsdp:4: 4) data-parallel ranks: micro-batches of 4 (2) samples.
    micro = 2 if "hsdp:4" in layouts else 4
    assert f"micro-batches of {micro} sample(s)" in result["stdout"], result["stdout"][:500]
    checks = [c for layout in result["state"] for c in layout["checks"]]
    resumes = [c for c in checks if c["check"] == "resume"]
    assert len(resumes) == len(layouts.split(","))
    assert all(c["max_loss_diff"] == 0 and c["max_param_diff"] == 0 for c in resumes), resumes
    assert all(c["ok"] for c in checks) and any(c["check"] == "export" for c in checks)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layouts", "extra"),
    [
        ("single,zero:2,cp:2,cp:2:alltoall", ["train.activation_checkpointing=selective"]),
        # DiLoCo with H = 1, outer SGD at lr 1: the same training as plain SGD (see dtlab verify).
        ("single,diloco:2", ["train.optimizer=sgd", "train.grad_clip=0"]),
        ("single,fsdp:2", ["train.compile=true", "train.float8.recipe=rowwise"]),
        ("single,ep:2,fsdp:2xep:2", ["model.preset=debug-moe"]),
        # Fault-tolerant groups (torchft), and bf16 gradient compression with oom_retry and alerts on.
        ("single,ddp:2,ft:2", []),
        ("single,ddp:2", ["train.oom_retry=true", "alerts.loss_spike=3"]),
    ],
)
def test_float8_composes_with_the_other_features(
    tmp_path: Path, layouts: str, extra: list[str]
) -> None:
    """Float8 under ZeRO-1, context parallelism (ring and alltoall), DiLoCo, fault-tolerant replica
    groups, oom_retry and alerts, activation
    checkpointing, torch.compile, the rowwise recipe and expert parallelism: each layout equal to
    one process within bf16's tolerances."""
    _verify(tmp_path, layouts, "--set", *extra)


def test_fsdp_all_gathers_the_float8_weights_at_half_of_bf16s_bytes(tmp_path: Path) -> None:
    """Counted at the dispatcher: FSDP's all-gathers of a float8 run send the float8 layers'
    weights in one byte each where a bf16 run sends two (two gathers a step: forward and backward),
    the rest alike but the weights' precomputed scales, agreed once before each step's forward (a
    float32 a float8 layer, all-reduced inside DTensor's dispatch), every step."""
    runs = {}
    for f8 in ("false", "true"):
        runs[f8] = train_run(
            tmp_path / f8, "parallel.strategy=fsdp", "train.precision=bf16",
            f"train.float8.enabled={f8}", "run.comm_bytes=true", nproc=2, steps=3,
        )  # fmt: skip
    model = _model()
    f8_numel = sum(
        p.numel()
        for n, p in model.named_parameters()
        if any(n.endswith(f".{layer}.weight") for layer in FLOAT8_LINEARS)
    )
    layers = sum(
        any(n.endswith(f".{layer}.weight") for layer in FLOAT8_LINEARS)
        for n, _ in model.named_parameters()
    )
    for bf16, f8 in zip(runs["false"], runs["true"], strict=True):
        # Each rank sends its half of the weights: whole buffers are the gathered ones.
        saved = 2 * f8_numel * (2 - 1) - 4 * layers
        assert bf16["comm_bytes"] - f8["comm_bytes"] == saved, (bf16, f8)
    summary = json.loads((tmp_path / "true" / "summary.json").read_text())
    assert summary["float8"]["all_gather"] is True


def test_checkpoints_move_between_bf16_and_float8(tmp_path: Path) -> None:
    """A bf16 run's checkpoint resumes in float8 and a float8 run's in bf16 (the parameters have the
    same names and values): each continues within float8's noise of the run it came from."""
    runs = {}
    for name, f8 in (("bf16", "false"), ("float8", "true")):
        runs[name] = train_run(
            tmp_path / name, "train.precision=bf16", f"train.float8.enabled={f8}",
            "checkpoint.every=3", steps=6,
        )  # fmt: skip
    for source, f8 in (("bf16", "true"), ("float8", "false")):
        ckpt = tmp_path / source / "checkpoints" / "step-00000003"
        resumed = train_run(
            tmp_path / f"{source}-then", "train.precision=bf16", f"train.float8.enabled={f8}",
            f"checkpoint.resume={ckpt}", steps=6,
        )  # fmt: skip
        assert [m["step"] for m in resumed] == [4, 5, 6]
        for a, b in zip(resumed, runs[source][3:], strict=True):
            assert abs(a["loss"] - b["loss"]) < 2e-3, (source, a["loss"], b["loss"])
    # Measured: a float8 run is within float8's noise of bf16's over these steps.
    final = [m["loss"] for m in read_metrics(tmp_path / "float8")][-1]
    assert abs(final - runs["bf16"][-1]["loss"]) < 5e-3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_float8_on_a_gpu_is_native_where_the_gpu_has_float8_gemms(tmp_path: Path) -> None:
    """On a GPU of compute capability 8.9 or later the float8 layers run torch's float8 GEMMs (not
    emulated), and a few steps train as bf16's do; before 8.9 they are emulated, and say so."""
    native = torch.cuda.get_device_capability() >= (8, 9)
    runs = {}
    for f8 in ("false", "true"):
        proc = run_cli(
            "train", "--set", *FAST, "train.device=cuda", "train.precision=bf16",
            f"train.float8.enabled={f8}", "train.steps=6", f"run.dir={tmp_path / f8}", timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[f8] = read_metrics(tmp_path / f8)
    summary = json.loads((tmp_path / "true" / "summary.json").read_text())
    assert summary["float8"]["emulated"] is (not native)
    assert abs(runs["true"][-1]["loss"] - runs["false"][-1]["loss"]) < 5e-3
