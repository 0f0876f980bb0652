"""The arguments the Llama model is built from: its shape, every derived size resolved.

The config's ``model`` section (:class:`dtlab.config.ModelConfig`) is what users write, with presets and
nulls; :meth:`ModelConfig.args` turns it into a :class:`ModelArgs`. The model and its format
conversions take these arguments only, so nothing under ``dtlab.models`` depends on the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["HasModelArgs", "MoEArgs", "ModelArgs", "llama_ffn_dim", "model_args"]


def llama_ffn_dim(dim: int, multiple: int = 256) -> int:
    """Llama's SwiGLU hidden size for hidden size ``dim``: 8/3 dim, rounded up to ``multiple``."""
    return multiple * ((int(8 * dim / 3) + multiple - 1) // multiple)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's long-context RoPE scaling ("llama3" in transformers): the rotary frequencies whose
    wavelength exceeds ``original_max_seq_len / low_freq_factor`` divided by ``factor``, those under
    ``original_max_seq_len / high_freq_factor`` kept, the ones between blended smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass(frozen=True)
class MoEArgs:
    """A mixture-of-experts feed-forward (:class:`dtlab.models.moe.MoE`) in place of the dense one."""

    experts: int  # routed experts
    expert_dim: int  # each expert's SwiGLU hidden size
    top_k: int  # routed experts per token
    score: str = "softmax"  # softmax | sigmoid: the router's scores of each token
    renormalize: bool = True  # the top-k gates divided by their sum (always with sigmoid)
    shared_experts: int = 0  # always-on experts of expert_dim, added to the routed output
    dense_layers: int = 0  # the first blocks keep the dense feed-forward
    bias_balance: bool = False  # DeepSeek-V3's per-expert selection bias, updated after each step
    bias_rate: float = 1e-3
    aux_coef: float = 0.0  # the switch-transformer auxiliary loss's weight; 0 = off


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
    rope_scaling: RopeScaling | None = None  # Llama 3.1's long-context scaling; None: plain RoPE
    moe: MoEArgs | None = (
        None  # mixture-of-experts feed-forward in blocks dense_layers..; None = dense
    )
    # Each attention head's size; 0 = dim // n_heads. Qwen3 has heads wider than dim / n_heads
    # (0.6B: 16 heads of 128 on a 1024 model), so the attention's width n_heads x head_dim is its own.
    head_dim: int = 0
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2 / Qwen2.5)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE (Qwen3, Qwen3-MoE)
    # Each token attends to itself and the window - 1 tokens before it (Mistral 7B v0.1); None: all.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not self.head_dim:  # frozen: set once, here, so every reader sees the resolved size
            object.__setattr__(self, "head_dim", self.dim // max(1, self.n_heads))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has the mixture-of-experts feed-forward."""
        return self.moe is not None and layer >= self.moe.dense_layers

    @property
    def attn_dim(self) -> int:
        """The width of the query heads together (n_heads x head_dim): the q and output projections'."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """The width of the key (or value) heads together (n_kv_heads x head_dim)."""
        return self.n_kv_heads * self.head_dim

    def windowed(self, seq_len: int) -> bool:
        """Whether the sliding window cuts attention at ``seq_len`` tokens (a window as long as
        the sequence changes nothing)."""
        return self.sliding_window is not None and seq_len > self.sliding_window


class HasModelArgs(Protocol):
    """Anything that gives the model's arguments (the config's ``model`` section does)."""

    def args(self) -> ModelArgs: ...


def model_args(source: ModelArgs | HasModelArgs) -> ModelArgs:
    """``source`` itself, or the arguments it gives (``config.model`` -> its :class:`ModelArgs`)."""
    return source if isinstance(source, ModelArgs) else source.args()
