"""The arguments the Llama model is built from: its shape, every derived size resolved.

The config's ``model`` section (:class:`dtlab.config.ModelConfig`) is what users write, with presets and
nulls; :meth:`ModelConfig.args` turns it into a :class:`ModelArgs`. The model and its format
conversions take these arguments only, so nothing under ``dtlab.models`` depends on the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["HasModelArgs", "ModelArgs", "llama_ffn_dim", "model_args"]


def llama_ffn_dim(dim: int, multiple: int = 256) -> int:
    """Llama's SwiGLU hidden size for hidden size ``dim``: 8/3 dim, rounded up to ``multiple``."""
    return multiple * ((int(8 * dim / 3) + multiple - 1) // multiple)


@dataclass(frozen=True)
class ModelArgs:
    """Shape of the Llama-style decoder (:class:`dtlab.models.llama.Transformer`)."""

    dim: int  # hidden size
    n_layers: int
    n_heads: int  # attention (query) heads
    n_kv_heads: int  # key/value heads; fewer than n_heads is grouped-query attention
    vocab_size: int
    max_seq_len: int  # longest sequence the RoPE tables are built for
    ffn_dim: int  # SwiGLU hidden size
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # the output projection reads the input embedding

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class HasModelArgs(Protocol):
    """Anything that gives the model's arguments (the config's ``model`` section does)."""

    def args(self) -> ModelArgs: ...


def model_args(source: ModelArgs | HasModelArgs) -> ModelArgs:
    """``source`` itself, or the arguments it gives (``config.model`` -> its :class:`ModelArgs`)."""
    return source if isinstance(source, ModelArgs) else source.args()
