"""Model shape presets. Small ones are trained here; the shapes of published models (Llama, Qwen,
Mistral, their MoE siblings) are for planning and for fine-tuning from their weights
(``model.init_from``), each with the options and Hugging Face family of its checkpoint."""

from typing import Any

# ffn_dim is the SwiGLU hidden size as published for each model.
# Llama 3.1's long-context RoPE scaling, as its config.json gives it (rope_type "llama3").
LLAMA31_ROPE = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192
)

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
    "llama3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, max_seq_len=131072, ffn_dim=14336, rope_theta=500000.0, norm_eps=1e-5, rope_scaling=LLAMA31_ROPE),
    "llama3.1-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, max_seq_len=131072, ffn_dim=28672, rope_theta=500000.0, norm_eps=1e-5, rope_scaling=LLAMA31_ROPE),
    "llama3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, max_seq_len=131072, ffn_dim=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True),
    "llama3.2-3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, max_seq_len=131072, ffn_dim=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True),
    # Mixture of experts (model.moe): debug-moe's first block is dense, the second routes each token to 2 of 4
    # experts of 64 beside one shared expert; tiny-moe likewise with 8 experts over 3 MoE blocks.
    "debug-moe": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=128, ffn_dim=192, moe=dict(experts=4, top_k=2, expert_dim=64, shared_experts=1, dense_layers=1)),
    "tiny-moe": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256, max_seq_len=256, ffn_dim=704, moe=dict(experts=8, top_k=2, expert_dim=256, shared_experts=1, dense_layers=1)),
    # Qwen2.5 (Qwen2ForCausalLM): biases on q, k, v; the small ones tie their embeddings.
    "qwen2.5-0.5b": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, vocab_size=151936, max_seq_len=32768, ffn_dim=4864, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True, family="qwen2"),
    "qwen2.5-1.5b": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, vocab_size=151936, max_seq_len=32768, ffn_dim=8960, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True, family="qwen2"),
    "qwen2.5-7b": dict(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064, max_seq_len=32768, ffn_dim=18944, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, family="qwen2"),
    # Qwen3 dense (Qwen3ForCausalLM): per-head q/k RMSNorm; heads of 128 wider than dim / n_heads.
    "qwen3-0.6b": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, vocab_size=151936, max_seq_len=40960, ffn_dim=3072, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, qk_norm=True, family="qwen3"),
    "qwen3-8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=151936, max_seq_len=40960, ffn_dim=12288, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, family="qwen3"),
    # Mistral 7B v0.3 (full attention) and v0.1 (a sliding window of 4096).
    "mistral-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32768, max_seq_len=32768, ffn_dim=14336, rope_theta=1000000.0, norm_eps=1e-5, family="mistral"),
    "mistral-7b-v0.1": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, max_seq_len=32768, ffn_dim=14336, rope_theta=10000.0, norm_eps=1e-5, sliding_window=4096, family="mistral"),
    # Qwen3-30B-A3B (Qwen3MoeForCausalLM): 128 experts of 768, top-8 softmax gates renormalised
    # (norm_topk_prob), auxiliary loss 0.001, q/k norms, 32 query heads of 128 on a 2048 model.
    "qwen3-30b-a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936, max_seq_len=40960, ffn_dim=6144, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, family="qwen3_moe", moe=dict(experts=128, top_k=8, expert_dim=768, score="softmax", renormalize=True, balance="aux", aux_coef=0.001)),
    # ERNIE-4.5-21B-A3B (Ernie4_5_MoeForCausalLM): a dense first block, then 64 experts of 1536, top 6,
    # beside 2 shared experts; softmax gates renormalised, routed with a selection bias (dtlab's bias
    # balancing); tied embeddings.
    "ernie-4.5-21b-a3b": dict(dim=2560, n_layers=28, n_heads=20, n_kv_heads=4, vocab_size=103424, max_seq_len=131072, ffn_dim=12288, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True, family="ernie4_5_moe", moe=dict(experts=64, top_k=6, expert_dim=1536, shared_experts=2, dense_layers=1, score="softmax", renormalize=True, balance="bias")),
    # gpt-oss-20b-like: 32 experts of 2880, top-4 (softmax over the chosen 4 = renormalised softmax). Not
    # expressible: its 64 query heads of 64 (4096 wide on a 2880 model: dim / 64 = 45 is odd, so this has 48
    # heads of 60), attention sinks, the sliding window on every other block, biases in attention and
    # experts, the clamped SwiGLU (alpha 1.702, +1 on the linear half) and YaRN's RoPE scaling.
    "gpt-oss-20b": dict(dim=2880, n_layers=24, n_heads=48, n_kv_heads=8, vocab_size=201088, max_seq_len=131072, ffn_dim=2880, rope_theta=150000.0, norm_eps=1e-5, moe=dict(experts=32, top_k=4, expert_dim=2880, score="softmax", renormalize=True, balance="aux")),
    # DeepSeek-V3-671B-like: 3 dense blocks of 18432, then 256 routed experts of 2048 + 1 shared, top-8
    # sigmoid gates renormalised, auxiliary-loss-free bias balancing. Not expressible: multi-head latent
    # attention (low-rank compressed keys/values and queries, decoupled RoPE; here plain attention with 128
    # heads, the closest), group-limited routing, the routed scaling factor 2.5, multi-token prediction
    # and YaRN's RoPE scaling.
    "deepseek-v3-671b": dict(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280, max_seq_len=163840, ffn_dim=18432, rope_theta=10000.0, norm_eps=1e-6, moe=dict(experts=256, top_k=8, expert_dim=2048, shared_experts=1, dense_layers=3, score="sigmoid", balance="bias", bias_rate=0.001)),
}  # fmt: skip
