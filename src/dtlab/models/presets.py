"""Model shape presets. Small ones are trained here; the Llama shapes are for planning."""

from typing import Any

# ffn_dim is the SwiGLU hidden size as published for each model.
PRESETS: dict[str, dict[str, Any]] = {
    # Well under 1M parameters: for tests.
    "debug": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=128, ffn_dim=192),
    # 3.08M parameters: the default, trains in minutes on a laptop CPU.
    "tiny": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, max_seq_len=256, ffn_dim=704),
    # ~100M parameters.
    "small": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=256, max_seq_len=1024, ffn_dim=2816),
    "llama2-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, max_seq_len=4096, ffn_dim=11008, rope_theta=10000.0, norm_eps=1e-5),
    "llama2-13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, max_seq_len=4096, ffn_dim=13824, rope_theta=10000.0, norm_eps=1e-5),
    "llama2-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000, max_seq_len=4096, ffn_dim=28672, rope_theta=10000.0, norm_eps=1e-5),
    "llama3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, max_seq_len=131072, ffn_dim=14336, rope_theta=500000.0, norm_eps=1e-5),
    "llama3.1-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, max_seq_len=131072, ffn_dim=28672, rope_theta=500000.0, norm_eps=1e-5),
    "llama3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, max_seq_len=131072, ffn_dim=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True),
    "llama3.2-3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, max_seq_len=131072, ffn_dim=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True),
}  # fmt: skip
