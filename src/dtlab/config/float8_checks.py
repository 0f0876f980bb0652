"""What ``train.float8`` goes with: torchao's Float8Linear in the blocks of a torch model whose other
layers train in bf16 (``train.precision = bf16``)."""

from __future__ import annotations

from dtlab.config.schema import CROSS_RULES, Config, refuse

__all__ = ["check_float8"]


def check_float8(c: Config) -> None:
    """Refuse what ``train.float8.enabled`` does not go with, naming the setting and why."""
    t = c.train
    if not t.float8.enabled:
        return
    refuse(
        {
            "train.precision": (
                t.precision != "bf16", repr(t.precision), "'bf16'",
                "float8 trains the blocks' linear layers; the rest (embeddings, norms, attention, "
                "the output projection) trains in bf16, as torchao's float8 recipes do",
            ),
            "train.engine": (
                t.engine != "torch", repr(t.engine), "'torch'",
                "float8 training is torchao's, a torch library",
            ),
        },
        "train.float8.enabled = true",
    )  # fmt: skip


CROSS_RULES.append(check_float8)
