"""Model definitions (no distributed code here)."""

from dtlab.models.args import ModelArgs
from dtlab.models.llama import Transformer, build_model, count_params
from dtlab.models.presets import PRESETS

__all__ = ["PRESETS", "ModelArgs", "Transformer", "build_model", "count_params"]
