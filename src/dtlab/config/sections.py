"""The config's sections: one pydantic model per YAML section, each field with its description."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from dtlab.config.options import (
    CompressionOptions,
    DemoOptions,
    DiLoCoOptions,
    FaultToleranceOptions,
    Float8Options,
)
from dtlab.config.suggest import suggest_value
from dtlab.config.values import (
    DEFAULT_SEQ_LEN,
    NAME_MAX_BYTES,
    RUN_NAME_MAX_BYTES,
    SINGLE_STAGE_SCHEDULES,
    TOKENIZERS,
    _bad,
    _Section,
    show,
)
from dtlab.models.args import ModelArgs, MoEArgs, RopeScaling, llama_ffn_dim
from dtlab.models.families import FAMILIES, Family, choose_family, family_refusal
from dtlab.models.presets import PRESETS


class MoEConfig(_Section):
    """A mixture-of-experts feed-forward in place of the dense one (experts: 0 = dense). Token-choice
    routing, dropless: every token goes to exactly its top_k experts."""

    experts: int = Field(0, ge=0, le=65536, description="Routed experts per MoE block; 0 = dense.")
    expert_dim: int | None = Field(
        None, ge=1, description="Each expert's SwiGLU hidden size; null = model.ffn_dim."
    )
    top_k: int = Field(2, ge=1, description="Experts each token is routed to (at most experts).")
    score: Literal["softmax", "sigmoid"] = Field(
        "softmax",
        description="The router's scores: softmax over the experts (Qwen3, Mixtral) or a sigmoid "
        "per expert (DeepSeek-V3; its top-k gates are always renormalised to sum to 1).",
    )
    renormalize: bool = Field(
        True,
        description="softmax: divide the top-k gates by their sum (Qwen3's norm_topk_prob); false "
        "keeps the raw probabilities.",
    )
    shared_experts: int = Field(
        0, ge=0, description="Always-on experts of expert_dim, added to the routed output."
    )
    dense_layers: int = Field(
        0, ge=0, description="The first this many blocks keep the dense feed-forward (ffn_dim)."
    )
    balance: Literal["bias", "aux", "bias+aux", "none"] = Field(
        "bias",
        description="Load balancing: bias = DeepSeek-V3's auxiliary-loss-free per-expert bias, added "
        "to the scores for the top-k selection only and moved by bias_rate x sign(mean load - load) "
        "after each optimizer step (a buffer, saved in checkpoints); aux = the switch-transformer "
        "loss experts x sum_e f_e P_e times aux_coef, added to the training loss; bias+aux: both.",
    )
    bias_rate: float = Field(
        1e-3, gt=0, le=1, description="balance bias: the bias's step after each optimizer step."
    )
    aux_coef: float = Field(
        1e-2, gt=0, le=100, description="balance aux: the auxiliary loss's weight in the loss."
    )

    def args(self, ffn_dim: int) -> MoEArgs | None:
        """The MoE's arguments (None when dense); ``ffn_dim`` is the default expert_dim."""
        if not self.experts:
            return None
        return MoEArgs(
            experts=self.experts,
            expert_dim=self.expert_dim or ffn_dim,
            top_k=self.top_k,
            score=self.score,
            renormalize=self.renormalize,
            shared_experts=self.shared_experts,
            dense_layers=self.dense_layers,
            bias_balance="bias" in self.balance,
            bias_rate=self.bias_rate,
            aux_coef=self.aux_coef if "aux" in self.balance else 0.0,
        )


class RopeScalingConfig(_Section):
    """Llama 3.1's long-context RoPE scaling (transformers' ``rope_type: llama3``)."""

    factor: float = Field(8.0, gt=0, description="What the long wavelengths are divided by.")
    low_freq_factor: float = Field(1.0, gt=0, description="original_max_seq_len / this: above it a "
                                   "wavelength is scaled by factor.")  # fmt: skip
    high_freq_factor: float = Field(4.0, gt=0, description="original_max_seq_len / this: below it a "
                                    "wavelength is kept; between the two, blended.")  # fmt: skip
    original_max_seq_len: int = Field(
        8192, ge=1, description="The context the model was first trained at."
    )

    def args(self) -> RopeScaling:
        return RopeScaling(
            self.factor, self.low_freq_factor, self.high_freq_factor, self.original_max_seq_len
        )


class ModelConfig(_Section):
    """Shape of the Llama-style decoder. A preset fills every shape key; keys given explicitly win."""

    preset: str | None = Field(
        "tiny",
        description="Shape preset: " + ", ".join(PRESETS) + "; null to give every shape key.",
    )
    dim: int = Field(0, ge=1, description="Hidden size.")
    n_layers: int = Field(0, ge=1, description="Number of transformer blocks.")
    n_heads: int = Field(0, ge=1, description="Attention (query) heads.")
    n_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads (grouped-query attention); null = n_heads."
    )
    vocab_size: int = Field(0, ge=1, description="Vocabulary size; must cover the tokenizer's.")
    max_seq_len: int = Field(0, ge=1, description="Longest sequence the RoPE tables are built for.")
    ffn_dim: int | None = Field(
        None,
        ge=1,
        description="SwiGLU hidden size; null = Llama rule (8/3 dim, rounded up to 256).",
    )
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency.")
    rope_scaling: RopeScalingConfig | None = Field(
        None,
        description="Llama 3.1's long-context RoPE scaling of the frequencies (transformers' "
        "'llama3'); null = plain RoPE.",
    )
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: bool = Field(
        False, description="Share the input embedding with the output projection."
    )
    head_dim: int | None = Field(
        None,
        ge=2,
        description="Each attention head's size (even: RoPE rotates pairs); null = dim / n_heads. "
        "Qwen3's heads are wider (0.6B: 16 heads of 128 on a 1024 model).",
    )
    qkv_bias: bool = Field(
        False, description="Biases on the q, k and v projections (Qwen2, Qwen2.5, Qwen2-MoE)."
    )
    qk_norm: bool = Field(
        False,
        description="An RMSNorm over each head of q and k before RoPE (Qwen3, Qwen3-MoE).",
    )
    sliding_window: int | None = Field(
        None,
        ge=1,
        description="Each token attends to itself and the sliding_window - 1 tokens before it "
        "(Mistral 7B v0.1: 4096); null = the whole context.",
    )
    family: str | None = Field(
        None,
        description="The Hugging Face family `dtlab export --format hf` writes (and model.init_from "
        "read): " + ", ".join(FAMILIES) + "; null = the one whose class has exactly this model's "
        "options (llama; qwen3 with qk_norm, qwen2 with qkv_bias, mistral with a sliding window; "
        "a mixture of experts with sigmoid scores: glm4_moe, bias-balanced: ernie4_5_moe, else "
        "qwen3_moe or qwen2_moe).",
    )
    init_from: str | None = Field(
        None,
        min_length=1,
        description="Start from these weights instead of a random init (fine-tuning): a local Hugging "
        "Face directory of a supported family (config.json + model.safetensors or pytorch_model.bin, "
        "or their shards; see model.family) or a dtlab export directory (model.safetensors + "
        "config.yaml); its shape must match the keys above. A run that resumes from a checkpoint "
        "takes the checkpoint's weights instead.",
    )
    moe: MoEConfig = Field(default_factory=MoEConfig)  # type: ignore[arg-type]

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        preset = data.get("preset", "tiny")
        if preset is None:
            missing = [
                k
                for k in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len")
                if k not in data
            ]
            if missing:
                raise ValueError(
                    f"model.preset is null, so these keys are required: {', '.join(missing)}"
                )
            return data
        if not isinstance(preset, str) or preset not in PRESETS:
            meant = suggest_value(preset, list(PRESETS))
            raise ValueError(
                f"model.preset = {show(preset)} is not a preset"
                + (f" (did you mean {meant!r}?)" if meant else "")
                + f"; allowed: {', '.join(PRESETS)}, or null"
            )
        merged = {**PRESETS[preset], **data}
        # A preset's MoE keys are kept where the user gives only some of them (model.moe.top_k=1).
        if isinstance(PRESETS[preset].get("moe"), dict) and isinstance(data.get("moe"), dict):
            merged["moe"] = {**PRESETS[preset]["moe"], **data["moe"]}
        return merged

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_dim if self.ffn_dim is not None else llama_ffn_dim(self.dim)

    def args(self) -> ModelArgs:
        """The arguments the model is built from (every null resolved)."""
        return ModelArgs(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.kv_heads,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            ffn_dim=self.hidden_dim,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling.args() if self.rope_scaling is not None else None,
            norm_eps=self.norm_eps,
            tie_embeddings=self.tie_embeddings,
            moe=self.moe.args(self.hidden_dim),
            head_dim=self.head_dim or 0,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            sliding_window=self.sliding_window,
        )

    def hf_family(self) -> Family:
        """The Hugging Face family the model is written as (model.family, or the one chosen)."""
        args = self.args()
        return FAMILIES[self.family] if self.family else choose_family(args)

    @model_validator(mode="after")
    def _check_family(self) -> ModelConfig:
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(
                f"model.head_dim = {self.head_dim} is odd; RoPE rotates pairs of a head's "
                "dimensions (allowed: an even size, or null for dim / n_heads)"
            )
        if self.family is None:
            return self
        if self.family not in FAMILIES:
            meant = suggest_value(self.family, list(FAMILIES))
            raise ValueError(
                f"model.family = {show(self.family)} is not a family"
                + (f" (did you mean {meant!r}?)" if meant else "")
                + f"; allowed: {', '.join(FAMILIES)}, or null"
            )
        why = family_refusal(FAMILIES[self.family], self.args())
        if why:
            raise ValueError(f"{why}; allowed: another model.family, or null to choose one")
        return self


class DataConfig(_Section):
    """Where training samples come from. Sample i depends only on (train.seed, source, i)."""

    source: Literal["synthetic", "stdlib", "files"] = Field(
        "stdlib",
        description="synthetic: seeded Markov-chain tokens; stdlib: the Python standard library's source; files: data.paths.",
    )
    paths: list[str] = Field(
        default_factory=list,
        description="For source=files: text (.txt, .md, ...), .jsonl or .parquet files or directories.",
    )

    text_key: str = Field(
        "text", min_length=1, description="Field that holds the text in jsonl/parquet records."
    )
    document_mask: bool = Field(
        False,
        description="Attention stays within each document of a window (documents end at the "
        "separator, token 0), as though each were trained alone; off: the whole window, causally.",
    )
    seq_len: int | None = Field(
        None,
        ge=1,
        description=f"Tokens per training sample; null = {DEFAULT_SEQ_LEN}, or model.max_seq_len "
        "where that is shorter.",
    )
    tokenizer: str = Field(
        "bytes",
        min_length=1,
        description="bytes: UTF-8 bytes, vocabulary 256 (byte 0 separates documents); bpe: a byte-level "
        "BPE trained locally on the configured corpus (cached); or the path of a tokenizer.json "
        "(or of a directory holding one, e.g. a run directory or an export). Not given: "
        "model.init_from's tokenizer where its directory holds a tokenizer.json and data.source is "
        "not synthetic (a Hugging Face tokenizer separates documents with its eos token), else "
        "bytes.",
    )
    tokenizer_vocab_size: int | None = Field(
        None,
        ge=260,
        le=1 << 20,
        description="Vocabulary size of a trained bpe tokenizer; null = model.vocab_size.",
    )
    val_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Fraction of the corpus's samples held out for validation (disjoint from training "
        "by construction); 0 = none. Changes the training samples, not eval.every.",
    )
    val_paths: list[str] = Field(
        default_factory=list,
        description="Validation files or directories (text, jsonl, parquet), instead of val_fraction.",
    )
    streaming: bool = Field(
        False,
        description="Read data.paths (or the stdlib corpus) without loading it: tokenized once into a "
        "memory-mapped token file under data.cache_dir; each rank reads only its samples.",
    )
    cache_dir: str | None = Field(
        None,
        min_length=1,
        description="Where trained tokenizers and streaming token files are cached; null = "
        "$DTLAB_CACHE, else $XDG_CACHE_HOME/dtlab, else ~/.cache/dtlab.",
    )
    prefetch: int = Field(
        2,
        ge=0,
        description="Optimizer steps of batches prepared ahead in a background thread; 0 = inline.",
    )

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_kind(cls, value: str) -> str:
        if value in TOKENIZERS:
            return value
        path = Path(value).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise _bad(
                f"{show(value)} is neither a tokenizer nor an existing tokenizer.json (or a directory "
                f"holding one); allowed: {', '.join(TOKENIZERS)}, or such a path"
            )
        return value

    @field_validator("paths", "val_paths")
    @classmethod
    def _paths_not_empty(cls, paths: list[str]) -> list[str]:
        for i, path in enumerate(paths):
            if not path:
                raise _bad(f"item {i} is an empty string; allowed: paths of files or directories")
        return paths


class EvalConfig(_Section):
    """Validation during training: the loss on held-out samples (data.val_fraction or data.val_paths)."""

    every: int = Field(
        0, ge=0, description="Evaluate every N optimizer steps and at the last; 0 = off."
    )
    batches: int = Field(
        4,
        ge=1,
        description="Validation batches of train.global_batch_size samples each evaluation: the "
        "same samples every time.",
    )


class AlertsConfig(_Section):
    """Thresholds that raise an alert: a warning with the figure and the threshold, counted in
    metrics.jsonl ("alerts") and the summary, and with action = stop the end of the run (after a
    checkpoint). Each threshold is off while null. The ranks agree on every figure, so they all
    decide alike."""

    memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="A rank's memory use above this fraction of its device's memory (CUDA: the "
        "allocator's reserved peak in the step plus what the device holds outside it: the CUDA "
        "context, NCCL, other processes; CPU and MLX: the process's resident memory, of the "
        "machine's).",
    )
    throughput_drop: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="A step's tokens/s (the slowest rank's) below this fraction of the median of the "
        "last `window` steps.",
    )
    loss_spike: float | None = Field(
        None,
        gt=1,
        description="A step's loss above this factor times the median loss of the last `window` steps.",
    )
    grad_norm_spike: float | None = Field(
        None,
        gt=1,
        description="A step's gradient norm above this factor times the median of the last `window` "
        "steps.",
    )
    nonfinite: int | None = Field(
        None,
        ge=1,
        description="This many steps with a non-finite loss or gradient within the last `window` steps.",
    )
    moe_imbalance: float | None = Field(
        None,
        ge=1,
        description="Mixture of experts: a step's routing imbalance (moe_imbalance, the most loaded "
        "expert's tokens over the mean, in the worst MoE block; 1 = even) above this.",
    )
    window: int = Field(
        50, ge=2, description="Steps the medians and the non-finite count are taken over."
    )
    action: Literal["warn", "stop"] = Field(
        "warn",
        description="warn: log and count; stop: also save the state after the step aside "
        "(checkpoints/alert-step-N, for inspection) and end the run with an error that names the "
        "alert; the same command resumes from the last checkpoint from before it.",
    )

    @property
    def enabled(self) -> bool:
        """Some threshold is set."""
        return any(
            v is not None
            for v in (
                self.memory_fraction, self.throughput_drop, self.loss_spike,
                self.grad_norm_spike, self.nonfinite, self.moe_imbalance,
            )
        )  # fmt: skip


class TrainConfig(_Section):
    """Optimisation: steps, batch, AdamW, schedule, precision, memory savers."""

    steps: int = Field(200, ge=1, description="Optimizer steps.")
    global_batch_size: int = Field(
        16, ge=1, description="Samples per optimizer step, over all data-parallel ranks."
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per forward/backward on one rank; null = no gradient accumulation.",
    )
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    min_lr: float = Field(1e-4, ge=0, description="Learning rate at the end of the decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps from 0 to lr.")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="Decay after warm-up; wsd = warm-up, stable, decay."
    )
    wsd_decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd: fraction of the steps spent in the final linear decay."
    )
    grad_clip: float = Field(
        1.0,
        ge=0,
        description="Max global gradient norm; 0 = no clipping (the norm is still reported).",
    )
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (not applied to norms).")
    max_bad_steps: int = Field(
        3,
        ge=1,
        description="A step whose loss or gradients are not finite is skipped; after this many in a row "
        "the run rolls back to the last checkpoint, or stops if there is none.",
    )
    optimizer: Literal["adamw", "demo", "sgd", "muon"] = Field(
        "adamw",
        description="adamw; sgd: plain SGD (no momentum; weight decay added to the gradient); demo: DeMo (arXiv 2411.19870), each rank keeps its own momentum and sends "
        "only its top-k DCT coefficients per chunk; the step is the sign of their average (no "
        "gradient all-reduce). single or ddp only; muon: Muon (Nesterov momentum 0.95, 5 "
        "Newton-Schulz steps, the update scaled to AdamW's RMS; measured, it trains best at a "
        "higher lr than AdamW's) on the transformer blocks' matrices, AdamW on the embedding, "
        "output and 1-D parameters; sharded matrices are gathered whole for it each step.",
    )
    demo: DemoOptions = Field(default_factory=DemoOptions)  # type: ignore[arg-type]
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    seed: int = Field(0, ge=0, description="Seed of the weights and of the data order.")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast dtype; fp16 adds dynamic loss scaling."
    )
    float8: Float8Options = Field(default_factory=Float8Options)  # type: ignore[arg-type]
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="full: recompute each block; selective: keep matmul and attention outputs, recompute the rest.",
    )
    compile: bool = Field(
        False, description="torch.compile each transformer block (mlx: mx.compile the step)."
    )
    engine: Literal["torch", "mlx"] = Field(
        "torch",
        description="torch; mlx: the same model and training on Apple's MLX (single or ddp, "
        "pip install 'dtlab[mlx]').",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda when available, else cpu."
    )
    oom_retry: bool = Field(
        False,
        description="A step that runs out of memory on any rank is taken again on every rank with "
        "micro-batches half the size (more accumulation steps, the same global batch: the same "
        "training), down to one sample; the smaller size is kept. single and ddp; the gradient sync "
        "then waits for the ranks' agreement after backward instead of overlapping it.",
    )


class ParallelConfig(_Section):
    """How the model and the batch are spread over processes."""

    strategy: Literal["single", "ddp", "fsdp", "hsdp"] = Field(
        "single", description="single process, DDP, FSDP2, or hybrid-sharded FSDP2."
    )
    sharding: Literal["full", "shard_grad_op", "no_shard", "optimizer"] = Field(
        "full",
        description="fsdp/hsdp: full (ZeRO-3), shard_grad_op (ZeRO-2), no_shard (replicated); "
        "ddp: optimizer (ZeRO-1: gradients reduce-scattered, each rank keeps and steps the "
        "optimizer state of its rows of every parameter, the updated rows all-gathered).",
    )
    replicate: int | None = Field(
        None,
        ge=1,
        description="hsdp: number of replica groups; the shard group size is world / replicate.",
    )
    bucket_mb: float = Field(
        25.0,
        gt=0,
        le=4096,
        description="ddp: MiB of gradients per all-reduce bucket (DDP's bucket_cap_mb): smaller "
        "buckets start communicating earlier in backward, larger ones issue fewer collectives. "
        "Unused with compression powersgd or dct (one bucket: their state follows DDP's first "
        "layout, kept for the whole run).",
    )
    fsdp_prefetch: int = Field(
        0,
        ge=0,
        le=64,
        description="fsdp/hsdp: blocks whose parameters each block's forward and backward explicitly "
        "prefetch (all-gather ahead of their use); 0 = FSDP2's implicit prefetch of the next one.",
    )
    tp: int = Field(
        1,
        ge=1,
        le=1024,
        description="Tensor-parallel degree: each block's attention heads and feed-forward columns, "
        "and the vocabulary, split over this many ranks; the strategy spreads the batch over the "
        "world / tp others.",
    )
    pp: int = Field(
        1,
        ge=1,
        le=1024,
        description="Pipeline-parallel degree: the blocks split into stages over this many ranks "
        "(the embedding in the first stage, the norm, output and loss in the last).",
    )
    ep: int = Field(
        1,
        ge=1,
        le=1024,
        description="Expert-parallel degree (mixture of experts): each MoE block's routed experts "
        "split over this many of the data-parallel ranks, tokens sent to their experts' ranks by "
        "all-to-all; must divide the data-parallel degree and model.moe.experts.",
    )
    pp_schedule: Literal[
        "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"
    ] = Field(
        "1f1b",
        description="Pipeline schedule (torch.distributed.pipelining): gpipe and 1f1b run one stage "
        "per rank; interleaved_1f1b, looped_bfs and interleaved_zb (zero bubble) several "
        "(pp_stages_per_rank); zbv and dualpipev two per rank in a V.",
    )
    pp_microbatches: int | None = Field(
        None,
        ge=1,
        description="Pipeline micro-batches per step on each data-parallel rank; null = the "
        "accumulation steps (train.micro_batch_size) if set, else pp. Must divide the rank's batch.",
    )
    pp_stages_per_rank: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Stages each pipeline rank holds; null = 1 for gpipe/1f1b, 2 for the others.",
    )
    cp: int = Field(
        1,
        ge=1,
        le=1024,
        description="Context-parallel degree: each sequence split over this many ranks (two chunks "
        "each, an early and a late one), attention computed across them as cp_method says.",
    )
    cp_method: Literal["ring", "alltoall"] = Field(
        "ring",
        description="cp > 1: ring (key/value blocks passed round the ranks, partial outputs merged by "
        "their log-sum-exps) or alltoall (sequence swapped for heads before attention and back; the "
        "heads must divide by cp).",
    )
    sequence_parallel: bool = Field(
        False,
        description="With tp > 1: norms and residual adds on sequence shards, all-gather and "
        "reduce-scatter at the tensor-parallel boundaries instead of all-reduce.",
    )
    compression: Literal["none", "fp16", "bf16", "powersgd", "dct"] = Field(
        "none",
        description="Gradient compression: fp16/bf16 reduce in half precision (ddp, fsdp, hsdp); "
        "powersgd and dct compress DDP's gradient buckets.",
    )
    compression_options: CompressionOptions = Field(default_factory=CompressionOptions)  # type: ignore[arg-type]
    diloco: DiLoCoOptions = Field(default_factory=DiLoCoOptions)  # type: ignore[arg-type]
    fault_tolerance: FaultToleranceOptions = Field(default_factory=FaultToleranceOptions)  # type: ignore[arg-type]

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages on each pipeline rank (``pp_stages_per_rank`` resolved)."""
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 1 if self.pp_schedule in SINGLE_STAGE_SCHEDULES else 2

    backend: Literal["auto", "gloo", "nccl", "ring", "mpi", "jaccl"] = Field(
        "auto",
        description="auto: nccl on CUDA, gloo on CPU; engine mlx: ring (auto), mpi, or jaccl (RDMA "
        "over Thunderbolt between Macs, ranks started by mlx.launch --backend jaccl).",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        le=365 * 86400,
        description="A collective that takes longer fails the run naming the rank (a dead peer or a "
        "hung ring) instead of hanging it.",
    )


class CheckpointConfig(_Section):
    """Checkpointing of the whole training state."""

    every: int = Field(0, ge=0, description="Save every N optimizer steps; 0 = off.")
    final: bool = Field(
        True,
        description="Save a checkpoint after the last step (the weights generate and export read); "
        "false: only every's saves and a stop's.",
    )
    keep: int = Field(3, ge=1, description="Checkpoints kept.")
    async_: bool | Literal["auto"] = Field(
        False,
        alias="async",
        description="Write in the background (true), in the foreground (false), or auto: the first "
        "five saves take turns (sync, async, async, sync, async), then whichever kind cost training "
        "less time (blocked + slower steps) is kept, said in the log.",
    )
    resume: str = Field(
        "auto",
        min_length=1,
        description="auto: the newest complete checkpoint of this run (local or durable tier); never: "
        "a new run (in a run.dir that holds none); or the path of a checkpoint or of a run directory.",
    )
    durable_dir: str | None = Field(
        None,
        min_length=1,
        description="Durable tier: a path or fsspec URL that also receives checkpoints, each run in "
        "<durable_dir>/<run dir name>/; null = off.",
    )
    durable_every: int = Field(
        0,
        ge=0,
        description="Copy every N-th step's checkpoint to the durable tier (a multiple of every); "
        "0 = each one. The final checkpoint is always copied.",
    )


Tracker = Literal["tensorboard", "mlflow", "wandb"]


def _default_trackers() -> list[Tracker]:
    return ["tensorboard"]


class RunConfig(_Section):
    """Where a run writes and how it reports."""

    dir: str | None = Field(
        None, min_length=1, description="Run directory; null = runs/<name>-<timestamp>."
    )
    name: str = Field(
        "dtlab",
        min_length=1,
        description=f"Run name: one directory name (no '/' or '\\', not '.' or '..', no control "
        f"characters), at most {RUN_NAME_MAX_BYTES} bytes in UTF-8.",
    )
    log_every: int = Field(
        10, ge=1, description="Log metrics every N steps (the last step is always logged)."
    )
    progress: Literal["auto", "bar", "lines", "none"] = Field(
        "auto", description="auto: a bar on a terminal, plain lines otherwise."
    )
    tensorboard: bool = Field(
        True,
        description="Write TensorBoard event files to <run dir>/tensorboard when run.trackers lists "
        "tensorboard (false turns it off whatever the list says).",
    )
    trackers: list[Tracker] = Field(
        default_factory=_default_trackers,
        description="Experiment trackers that receive params, metrics and artifacts (rank 0): "
        "tensorboard, mlflow (pip install 'dtlab[mlflow]'), wandb (offline; 'dtlab[wandb]').",
    )
    mlflow_uri: str | None = Field(
        None,
        min_length=1,
        description="MLflow tracking URI (sqlite:///..., a file store path, or a server); null = a "
        "SQLite database <run dir>/mlflow.db (a run directory that already has mlruns/ keeps it).",
    )
    plot: bool = Field(True, description="Write <run dir>/loss.png at the end.")
    comm_bytes: bool = Field(
        False,
        description="Count every collective of each step from the dispatcher into metrics.jsonl: "
        "comm_bytes (whole buffers) and wire_bytes (what one rank sends, ring algorithms over the "
        "world), and of those the ones that cross replicas (data-parallel, DiLoCo or "
        "fault-tolerant replica groups): cross_replica_bytes and cross_replica_collectives; the "
        "step's alerts count with it, its validation and checkpoint save apart (eval_*, "
        "checkpoint_*); train.compile stays on; for measurements "
        "(dtlab.bench.lowcomm).",
    )
    profile: bool = Field(
        False,
        description="Record a torch.profiler trace of steps 3-4 (Chrome trace / TensorBoard) and, on CUDA, "
        "a memory snapshot, under <run dir>/profile.",
    )

    @field_validator("name")
    @classmethod
    def _name_is_one_component(cls, name: str) -> str:
        # The name becomes a directory under runs/: it must stay one path component there, and short
        # enough that runs/<name>-<timestamp> is a legal file name.
        allowed = (
            f"one directory name: no '/' or '\\', not '.' or '..', no control characters, at most "
            f"{RUN_NAME_MAX_BYTES} bytes"
        )
        if name in (".", ".."):
            raise _bad(f"not a directory name of its own; allowed: {allowed}")
        bad = sorted({c for c in name if c in "/\\" or unicodedata.category(c) == "Cc"})
        if bad:
            raise _bad(f"contains {', '.join(map(repr, bad))}; allowed: {allowed}")
        size = len(name.encode("utf-8"))
        if size > RUN_NAME_MAX_BYTES:
            raise _bad(f"{size} bytes long; allowed: {allowed}")
        return name

    @field_validator("dir")
    @classmethod
    def _dir_fits_the_file_system(cls, path: str | None) -> str | None:
        if path is None:
            return None
        for part in path.split("/"):
            if len(part.encode("utf-8")) > NAME_MAX_BYTES:
                raise _bad(
                    f"the path component {show(part)} is {len(part.encode())} bytes long; allowed: "
                    f"components of at most {NAME_MAX_BYTES} bytes"
                )
        return path
