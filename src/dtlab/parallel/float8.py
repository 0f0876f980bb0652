"""Float8 training (``train.float8``) through torchao: the blocks' linear layers become torchao's
``Float8Linear`` before any parallelism is applied, the rest of the model trains in bf16.

Which layers: attention's q, k, v and o projections and the dense feed-forward's w1, w2 and w3, whose
in and out features are multiples of 16 (what float8 GEMMs take). Not the embeddings, the norms, the
output projection (the logits' precision matters most, as torchtitan keeps it), a mixture of
experts' router (its scores choose the experts) nor its experts (dtlab's experts are one batched
weight per block, not ``nn.Linear``s; torchao's float8 MoE training is a separate API): those train
as ``train.precision = bf16`` does.

Where the device has no float8 GEMM (a CPU; GPUs before compute capability 8.9) the layers are
emulated (``emulate``: the float8 casts and scales as on a GPU, the GEMMs in higher precision), which
proves the numbers and says nothing about speed.

Under FSDP with the tensorwise recipe the weights are all-gathered in float8 (half of bf16's bytes),
their scales computed for every layer at once after each optimizer step (:func:`precompute_scales`).
Under tensor parallelism, torchao's float8 styles move the activations in float8 on NCCL; gloo cannot
send float8 tensors ("Invalid scalar type"), so on gloo the layers cast after the plain styles' bf16
communication (:func:`float8_tp_comm`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from dtlab.errors import ConfigError

__all__ = [
    "FLOAT8_LINEARS",
    "apply_float8",
    "emulated",
    "float8_linears",
    "float8_summary",
    "float8_tp_comm",
    "import_float8",
    "precompute_scales",
    "uses_float8_all_gather",
]

# The linear layers of a block that train in float8 (their names within the block).
FLOAT8_LINEARS = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)
FLOAT8_ALIGN = 16  # float8 GEMMs (torch._scaled_mm) take dimensions that are multiples of 16
_SM89 = (8, 9)  # the first compute capability with float8 tensor cores (Ada, Hopper and later)


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao's import logs a warning for each of its CUDA extensions a CPU build cannot load, and
    torch a deprecation for an enum torchao registers: neither concerns a user, so neither prints."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def import_float8() -> Any:
    """``torchao.float8``, or a clear error naming the extra that installs it."""
    try:
        with _quiet_import():
            import torchao.float8 as float8
    except ImportError as e:
        raise ConfigError(
            f"train.float8.enabled = true needs torchao ({e}); install it with: "
            "pip install 'dtlab[float8]'"
        ) from None
    return float8


def emulated(option: str, device: torch.device) -> bool:
    """Whether the float8 GEMMs are emulated: ``on``; ``off`` never; ``auto`` where the device has
    none (any CPU; a GPU before compute capability 8.9)."""
    if option != "auto":
        return option == "on"
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) < _SM89


def _wanted(module: nn.Module, fqn: str) -> bool:
    """A block's dense linear layer of float8-sized dimensions."""
    if not isinstance(module, nn.Linear) or not fqn.startswith("layers."):
        return False
    if not any(fqn.endswith("." + name) for name in FLOAT8_LINEARS):
        return False
    return module.in_features % FLOAT8_ALIGN == 0 and module.out_features % FLOAT8_ALIGN == 0


def apply_float8(model: nn.Module, recipe: str, emulate: bool, all_gather: bool) -> list[str]:
    """Swap the blocks' linear layers of ``model`` (meta or materialised) for ``Float8Linear``s of
    ``recipe``; ``all_gather``: FSDP all-gathers their weights in float8 (tensorwise only). Returns
    the names of the layers swapped; their parameters keep their names, so checkpoints and exports
    are those of the same model without float8."""
    float8 = import_float8()
    if recipe == "tensorwise":
        config = float8.Float8LinearConfig(
            enable_fsdp_float8_all_gather=all_gather, emulate=emulate
        )
    else:
        config = dataclasses.replace(
            float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate
        )
    swapped: list[str] = []

    def keep(module: nn.Module, fqn: str) -> bool:
        if _wanted(module, fqn):
            swapped.append(fqn)
            return True
        return False

    float8.convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return swapped


def float8_linears(model: nn.Module) -> list[nn.Module]:
    """The model's ``Float8Linear`` layers (none without ``train.float8``)."""
    return [m for m in model.modules() if type(m).__name__ == "Float8Linear"]


def uses_float8_all_gather(model: nn.Module) -> bool:
    """Whether FSDP all-gathers some of the model's weights in float8 (their scales are then
    precomputed after each optimizer step)."""
    return any(
        bool(cast(Any, m).config.enable_fsdp_float8_all_gather) for m in float8_linears(model)
    )


def precompute_scales(model: nn.Module) -> None:
    """After the optimizer step: every float8-all-gathered weight's scale, in one reduction for all
    of them (instead of one amax per weight in the next forward's all-gathers)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def float8_tp_comm(recipe: str, backend: str) -> bool:
    """Whether tensor parallelism moves the float8 layers' activations in float8 (torchao's float8
    styles: tensorwise scaling, on NCCL) or in bf16 before the layers cast them (gloo cannot send a
    float8 tensor; rowwise scales are not made for it)."""
    return recipe == "tensorwise" and backend == "nccl"


def float8_summary(options: Any, pm: Any, device: torch.device) -> dict[str, Any]:
    """What summary.json says of a float8 run (``options``: train.float8; ``pm``: the parallel
    model): the recipe, whether the GEMMs were emulated, how many of this rank's layers trained in
    float8, and whether FSDP all-gathered their weights in float8."""
    return {
        "recipe": options.recipe,
        "emulated": emulated(options.emulate, device),
        "layers": len(float8_linears(pm.model)),
        "all_gather": bool(pm.float8_scales),
    }
