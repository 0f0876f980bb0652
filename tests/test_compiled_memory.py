"""What one transformer block keeps for backward, measured on fake tensors: compiled (what inductor's
partitioner saves) against eager, and the eager measurement against dtlab's activation model."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dtlab.analysis.activations import activation_bytes
from dtlab.analysis.compiled_memory import _eager_bytes, compiled_block_saved, eager_block_saved
from dtlab.config import ModelConfig
from dtlab.train.api import resolve_config

FP32 = 4


def _model(preset: str = "debug") -> ModelConfig:
    return resolve_config(None, [f"model.preset={preset}"]).model


# Compiled in bf16 only, what compiled runs train in: each compile takes a second or two.
def test_a_compiled_block_keeps_less_than_an_eager_one() -> None:
    m = _model()
    compiled, eager = compiled_block_saved(m, "bf16", "none"), eager_block_saved(m, "bf16", "none")
    # The partitioner recomputes the element-wise ops (norms, RoPE, SiLU) eager keeps outputs of.
    assert 0 < compiled[0] < eager[0]
    # Per block: autocast's half-precision weight copies, which compiled keeps no more of.
    assert 0 < compiled[1] <= eager[1]


@pytest.mark.parametrize(
    ("measure", "precision"),
    [(compiled_block_saved, "bf16"), (eager_block_saved, "fp32"), (eager_block_saved, "bf16")],
)
def test_full_checkpointing_keeps_only_the_block_input(measure, precision: str) -> None:
    m = _model()
    # The residual stream is float32 under autocast too (float32 parameters).
    assert measure(m, precision, "full") == (m.dim * FP32, 0.0)


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_eager_measurement_is_the_activation_model(precision: str, ac: str) -> None:
    # The model's bytes of one block alone (no final norm, output or loss) at two token counts: per
    # token and per block (autocast's weight copies), less the 8 bytes of the loss's two scalars
    # that activation_bytes counts in every case. Both sides count the same tensors in whole bytes
    # and the fit over 2^k tokens is exact, so they agree to the byte.
    m = _model()
    one = m.model_copy(update={"n_layers": 1})
    small, large = (activation_bytes(one, t, precision, ac, final_part=False) for t in (64, 128))
    per_token = (large - small) / 64
    per_block = small - 64 * per_token - 2 * FP32
    assert eager_block_saved(m, precision, ac) == pytest.approx((per_token, per_block), abs=0.5)


class _Doubled(torch.nn.Module):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * 2  # keeps nothing


class _Squared(torch.nn.Module):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * x  # keeps x


@pytest.mark.parametrize(("block", "kept"), [(_Doubled(), 0), (_Squared(), 1)])
def test_the_eager_measurement_counts_the_input_only_if_kept(block, kept: int) -> None:
    # Every dtlab block keeps its input; these show the measurement would see one that does not.
    mode = FakeTensorMode()
    with mode:
        table = torch.empty(4)
    row = 8 * 16 * FP32
    assert _eager_bytes(block, (1, 8, 16), table, table, nullcontext(), mode) == kept * row


def test_selective_checkpointing_keeps_between_full_and_none_compiled() -> None:
    m = _model()
    none, selective, full = (
        compiled_block_saved(m, "bf16", ac)[0] for ac in ("none", "selective", "full")
    )
    assert full < selective < none


def test_unknown_precision_or_checkpointing_is_refused() -> None:
    with pytest.raises(ValueError):
        compiled_block_saved(_model(), "fp8", "none")
    with pytest.raises(ValueError):
        eager_block_saved(_model(), "bf16", "everything")
    with pytest.raises(ValueError):
        eager_block_saved(_model(), "bf16", "none", "blockwise")
    with pytest.raises(ValueError):
        eager_block_saved(_model(), "bf16", "none", "tensorwise", "tpu")
    with pytest.raises(ValueError):  # float8 layers train under bf16 autocast
        eager_block_saved(_model(), "fp32", "none", "tensorwise")


def test_the_plan_of_a_compiled_step_keeps_what_the_compiled_blocks_keep() -> None:
    """``dtlab plan`` of a compiled step: forward keeps the eager figure less the measured
    saving of every block, and the compiled loss holds one logits-sized gradient beside the
    logits in its backward (no float32 [tokens, vocab]); where the measurement does not hold
    (a document mask, float8) the saving is 0 and the plan keeps the eager figure."""
    from dtlab.analysis.activations import activation_bytes
    from dtlab.analysis.compiled_memory import compiled_kept_saving
    from dtlab.analysis.model import plan_step
    from dtlab.analysis.timeline import LossShape
    from dtlab.config import load_config
    from dtlab.dims import ParallelDims

    base = ["model.preset=debug", "data.seq_len=64", "train.global_batch_size=4",
            "train.precision=bf16", "parallel.strategy=single"]  # fmt: skip
    eager, compiled = (
        load_config(overrides=[*base, f"train.compile={c}"]) for c in ("false", "true")
    )
    dims = ParallelDims.from_config(compiled, 1)
    saving = compiled_kept_saving(compiled, dims, compiled.model, 4 * 64, 1, False)
    assert saving > 0
    e, c = plan_step(eager, 1), plan_step(compiled, 1)
    assert e.timeline is not None and c.timeline is not None
    # The loss's forward moment holds what forward kept: the blocks' saving and the compiled
    # loss's own difference (its logits in bf16, not a float32 log-softmax) apart.
    loss = LossShape(256, compiled.model.vocab_size, True, False, compiled=True)
    assert loss.forward_extra() == 0
    assert loss.backward_extra() == 2 * 256 * compiled.model.vocab_size
    assert c.total_bytes < e.total_bytes
    # What forward keeps: the eager figure less the blocks' measured saving and the loss's own.
    no_blocks = compiled.model.model_copy(update={"n_layers": 0})
    loss_saving = activation_bytes(no_blocks, 256, "bf16", "none") - activation_bytes(
        no_blocks, 256, "bf16", "none", compiled_loss=True
    )
    assert e.activations_bytes - c.activations_bytes == saving + loss_saving
    docs = load_config(overrides=[*base, "train.compile=true", "data.document_mask=true"])
    assert compiled_kept_saving(docs, dims, docs.model, 256, 1, False) == 0
    # Float8 blocks: measured as converted (here as a CPU trains them).
    f8 = load_config(overrides=[*base, "train.compile=true", "train.float8.enabled=true"])
    f8_saving = compiled_kept_saving(
        f8, ParallelDims.from_config(f8, 1), f8.model, 256, 1, False, device_type="cpu"
    )
    eager_f8 = eager_block_saved(f8.model, "bf16", "none", "tensorwise", "cpu")
    compiled_f8 = compiled_block_saved(f8.model, "bf16", "none", "tensorwise", "cpu")
    per_block = (eager_f8[0] - compiled_f8[0]) * 256 + eager_f8[1] - compiled_f8[1]
    assert f8_saving == round(per_block) * f8.model.n_layers > 0


def _plan_float8_block(m: ModelConfig, ac: str, device_type: str) -> tuple[float, float]:
    """The plan's eager float8 block (tensorwise): the activation model's one block less what float8
    layers keep less (:func:`float8_kept_saving`), per token and per block, as above."""
    from dtlab.analysis.float8_plan import float8_kept_saving
    from dtlab.config import load_config

    config = load_config(
        overrides=[f"model.preset={m.preset}", "train.precision=bf16", "train.float8.enabled=true"]
    )
    one = config.model.model_copy(update={"n_layers": 1})

    def kept(t: int) -> int:
        act = activation_bytes(one, t, "bf16", ac, final_part=False)
        return act - sum(float8_kept_saving(config, one, t, ac, 1, False, device_type))

    per_token = (kept(128) - kept(64)) / 64
    return per_token, kept(64) - 64 * per_token - 2 * FP32


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_compiled_float8_block_keeps_at_most_the_eager_one(device_type: str) -> None:
    # Float8 layers as dtlab converts them, emulated (cpu) or through torch._scaled_mm's fake
    # kernel (cuda). The eager block is the plan's eager float8 block on either device: on a CPU
    # the norms' readers share its float32 output, on a GPU each casts its own bf16 copy.
    m = _model()
    eager = eager_block_saved(m, "bf16", "none", "tensorwise", device_type)
    assert eager == pytest.approx(_plan_float8_block(m, "none", device_type), abs=0.5)
    compiled = compiled_block_saved(m, "bf16", "none", "tensorwise", device_type)
    assert 0 < compiled[0] <= eager[0]
    # Per block: the scales (float32 scalars) alone; no weight copy either way.
    assert compiled[1] <= 64
    assert eager[1] == 0


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("preset", ["debug", "llama3.2-1b"])
def test_the_eager_float8_measurement_is_the_plans(preset: str, ac: str, device_type: str) -> None:
    m = _model(preset)
    eager = eager_block_saved(m, "bf16", ac, "tensorwise", device_type)
    assert eager == pytest.approx(_plan_float8_block(m, ac, device_type), abs=0.5)


def test_the_plan_read_for_its_bytes_leaves_torch_compile_alone() -> None:
    """At a run's end the summary reads the plan's bytes (``planned_step_comm``): no compiled block
    is measured then, so a compiled function of the process keeps its compiled code (measuring
    resets torch.compile's caches process-wide); the plan's memory still measures it."""
    from dtlab.analysis.compiled_memory import blocks_not_measured, compiled_kept_saving
    from dtlab.analysis.run_comm import planned_step_comm
    from dtlab.config import load_config
    from dtlab.dims import ParallelDims

    config = load_config(
        overrides=["model.preset=debug", "data.seq_len=64", "train.global_batch_size=4",
                   "train.precision=bf16", "train.compile=true", "parallel.strategy=single"]
    )  # fmt: skip
    from dtlab.analysis import compiled_memory

    compiled_memory._measure.cache_clear()  # nothing measured before: the plan would measure
    torch._dynamo.reset()
    calls = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        calls.append(1)
        return gm.forward

    double = torch.compile(lambda x: x * 2, backend=backend)
    double(torch.ones(3))
    assert isinstance(planned_step_comm(config, 1, "cpu"), dict)
    double(torch.ones(3))
    assert calls == [1]  # compiled once: its code survived the plan
    dims = ParallelDims.from_config(config, 1)
    with blocks_not_measured():
        assert compiled_kept_saving(config, dims, config.model, 256, 1, False) == 0
    assert compiled_kept_saving(config, dims, config.model, 256, 1, False) > 0
