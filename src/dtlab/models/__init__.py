"""Model definitions (no distributed code here)."""

from dtlab.models.llama import Transformer, build_model, count_params
from dtlab.models.presets import PRESETS

__all__ = ["PRESETS", "Transformer", "build_model", "count_params"]
