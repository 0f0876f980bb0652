"""dtlab: a Distributed Training Lab for PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from dtlab.config import Config, load_config
    from dtlab.models.llama import build_model

__all__ = ["Config", "__version__", "build_model", "load_config", "train"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `dtlab --help` does not pay for importing torch.
    if name in ("Config", "load_config"):
        from dtlab import config

        return getattr(config, name)
    if name == "build_model":
        from dtlab.models.llama import build_model

        return build_model
    if name == "train":
        # The package dtlab.train, which is callable: dtlab.train(config) -> summary.
        import importlib

        return importlib.import_module("dtlab.train")
    raise AttributeError(f"module 'dtlab' has no attribute {name!r}")
