"""One config schema for everything dtlab runs.

Precedence: ``--set key=value`` > the YAML file > the defaults below. Every cross-field rule lives in
:meth:`Config._cross_checks` (rules that need only the config) or :func:`check_world` (rules that
also need the world size), so there is one place to read what is allowed. ``parallel.strategy`` maps
onto parallel degrees in :mod:`dtlab.dims`, which both ask.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import unicodedata
from collections.abc import Iterable
from itertools import islice
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dtlab.dims import DPWrapper, ParallelDims, strategies_with
from dtlab.errors import ConfigError
from dtlab.models.args import ModelArgs, llama_ffn_dim
from dtlab.models.presets import PRESETS

# Vocabulary size of each tokenizer; the model's vocab_size must cover it.
TOKENIZER_VOCAB = {"bytes": 256}
# Tokenizers named in data.tokenizer (anything else is a tokenizer.json path).
TOKENIZERS = ("bytes", "bpe")

# Integers are 64-bit wherever they end up (torch tensors, seeds, step counters).
INT64_MAX = 2**63 - 1
# A float stands for an integer only up to 2**53: above it, neighbouring integers share one float.
EXACT_FLOAT_INT = 2**53
# run.name becomes runs/<name>-<YYYYmmdd-HHMMSS>[-<n>]: 200 bytes leave room for the 16-byte timestamp
# and a suffix under NAME_MAX (255 bytes on Linux, macOS and Windows file systems).
RUN_NAME_MAX_BYTES = 200
NAME_MAX_BYTES = 255


def _bad(message: str) -> PydanticCustomError:
    # The message travels as context so that braces in it are never read as a template.
    return PydanticCustomError("dtlab_value", "{message}", {"message": message})


def _kind(value: Any) -> str:
    """What a YAML value is, in YAML's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def _allowed(annotation: Any, metadata: list[Any]) -> str:
    """What a field accepts, in words: 'an integer >= 1', 'true or false', ..."""
    args = get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return f"{_allowed(inner, metadata)}, or null"
    bounds = []
    for m in metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{op} {getattr(m, attr)}")
    bound = (" " + " and ".join(bounds)) if bounds else ""
    if annotation is int:
        return f"an integer{bound}"
    if annotation is float:
        return f"a finite number{bound}"
    if annotation is bool:
        return "true or false"
    if annotation is str:
        return (
            "a non-empty string"
            if any(isinstance(m, annotated_types.MinLen) for m in metadata)
            else "a string"
        )
    if get_origin(annotation) is list:
        return "a list of strings, e.g. [a.txt, data/]"
    if get_origin(annotation) is tuple:
        return f"a list of {len(args)} numbers, e.g. [0.9, 0.95]"
    return "see dtlab config --keys"


def _check_text(value: str, allowed: str) -> str:
    if "\0" in value:
        raise _bad(f"a NUL character is not allowed; allowed: {allowed} without NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"not valid Unicode text; allowed: {allowed}") from None
    return value


def _coerce(value: Any, annotation: Any, allowed: str) -> Any:
    """Check the kind of ``value`` against a field's type: a bool is not a number, a number is not a
    bool or a string, a float is an integer only when it is a whole number. Returns the value to keep."""
    args = get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, allowed)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise _bad(f"{_kind(value)} is not a boolean; allowed: {allowed}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad(f"{_kind(value)} is not an integer; allowed: {allowed}")
        if isinstance(value, float):
            if not math.isfinite(value) or not value.is_integer():
                raise _bad(f"not a whole number; allowed: {allowed}")
            if abs(value) > EXACT_FLOAT_INT:
                raise _bad(
                    f"a float beyond 2**53 does not hold every integer; allowed: {allowed}, "
                    "written with digits only"
                )
            value = int(value)
        if abs(value) > INT64_MAX:
            raise _bad(f"outside the 64-bit range (-2**63 < value < 2**63); allowed: {allowed}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad(f"{_kind(value)} is not a number; allowed: {allowed}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise _bad(f"not a finite number; allowed: {allowed}")
        return number
    if annotation is str:
        if not isinstance(value, str):
            scalar = isinstance(value, bool | int | float)
            hint = f' (in quotes it stays text: "{show(value)}")' if scalar else ""
            raise _bad(f"{_kind(value)} is not a string; allowed: {allowed}{hint}")
        return _check_text(value, allowed)
    if get_origin(annotation) is list:
        if not isinstance(value, list):
            raise _bad(f"{_kind(value)} is not a list; allowed: {allowed}")
        return [_item(i, x, args[0], allowed) for i, x in enumerate(value)]
    if get_origin(annotation) is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            what = f"{len(value)} items" if isinstance(value, list | tuple) else _kind(value)
            raise _bad(f"{what}; allowed: {allowed}")
        return tuple(
            _item(i, x, t, allowed) for i, (x, t) in enumerate(zip(value, args, strict=True))
        )
    return value


def _item(index: int, value: Any, annotation: Any, allowed: str) -> Any:
    try:
        return _coerce(value, annotation, allowed)
    except PydanticCustomError as e:
        raise _bad(f"item {index}: {e.context['message'] if e.context else e}") from None


def show(value: Any, depth: int = 0) -> str:
    """A short YAML-like rendering of a value for error messages (bounded for any input)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 256 else f"<a {value.bit_length()}-bit integer>"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 60 else repr(value[:57]) + "..."
    if depth >= 2:
        return "..."
    if isinstance(value, list | tuple):
        items = [show(x, depth + 1) for x in value[:6]]
        return "[" + ", ".join(items) + (", ..." if len(value) > 6 else "") + "]"
    if isinstance(value, dict):
        pairs = [f"{show(k, depth + 1)}: {show(v, depth + 1)}" for k, v in islice(value.items(), 6)]
        return "{" + ", ".join(pairs) + (", ..." if len(value) > 6 else "") + "}"
    return f"<{type(value).__name__}>"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_kinds(cls, value: Any, info: ValidationInfo) -> Any:
        # Pydantic's lax mode reads true as 1, 1 as true, "5" as 5 and 1e-400 (= 0.0) as the integer 0;
        # a config that says something else than the user meant must fail instead.
        assert info.field_name is not None
        field = cls.model_fields[info.field_name]
        return _coerce(value, field.annotation, _allowed(field.annotation, field.metadata))


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
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: bool = Field(
        False, description="Share the input embedding with the output projection."
    )
    init_from: str | None = Field(
        None,
        min_length=1,
        description="Start from these weights instead of a random init (fine-tuning): a local Hugging "
        "Face Llama directory (config.json + model.safetensors or pytorch_model.bin, or their shards) "
        "or a dtlab export directory (model.safetensors + config.yaml); its shape must match the keys "
        "above. A run that resumes from a checkpoint takes the checkpoint's weights instead.",
    )

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
            raise ValueError(
                f"model.preset = {show(preset)} is not a preset; allowed: {', '.join(PRESETS)}, "
                "or null"
            )
        return {**PRESETS[preset], **data}

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
            norm_eps=self.norm_eps,
            tie_embeddings=self.tie_embeddings,
        )


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
    seq_len: int | None = Field(
        None, ge=1, description="Tokens per training sample; null = model.max_seq_len."
    )
    tokenizer: str = Field(
        "bytes",
        min_length=1,
        description="bytes: UTF-8 bytes, vocabulary 256 (byte 0 separates documents); bpe: a byte-level "
        "BPE trained locally on the configured corpus (cached); or the path of a tokenizer.json "
        "(or of a directory holding one, e.g. a run directory or an export).",
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
        "allocator's peak in the step; CPU and MLX: the process's resident memory, of the machine's).",
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
    window: int = Field(
        50, ge=2, description="Steps the medians and the non-finite count are taken over."
    )
    action: Literal["warn", "stop"] = Field(
        "warn",
        description="warn: log and count; stop: also save a checkpoint and end the run with an error "
        "that names the alert.",
    )

    @property
    def enabled(self) -> bool:
        """Some threshold is set."""
        return any(
            v is not None
            for v in (
                self.memory_fraction, self.throughput_drop, self.loss_spike,
                self.grad_norm_spike, self.nonfinite,
            )
        )  # fmt: skip


class DemoOptions(_Section):
    """Options of train.optimizer = demo (decoupled momentum: compressed momentum, sign step)."""

    chunk_size: int = Field(
        64,
        ge=2,
        le=65536,
        description="Length of the chunks each parameter's momentum is cut into.",
    )
    topk: int = Field(
        8, ge=1, description="DCT coefficients of each chunk sent per step (the largest)."
    )
    decay: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="How much of the momentum not yet sent is kept from one step to the next.",
    )


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
    optimizer: Literal["adamw", "demo", "sgd"] = Field(
        "adamw",
        description="adamw; sgd: plain SGD (no momentum; weight decay added to the gradient); demo: DeMo (arXiv 2411.19870), each rank keeps its own momentum and sends "
        "only its top-k DCT coefficients per chunk; the step is the sign of their average (no "
        "gradient all-reduce). single or ddp only.",
    )
    demo: DemoOptions = Field(default_factory=DemoOptions)  # type: ignore[arg-type]
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    seed: int = Field(0, ge=0, description="Seed of the weights and of the data order.")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast dtype; fp16 adds dynamic loss scaling."
    )
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


class CompressionOptions(_Section):
    """Options of parallel.compression = powersgd / dct."""

    rank: int = Field(4, ge=1, description="powersgd: rank of the low-rank approximation.")
    start_step: int = Field(
        10, ge=2, description="powersgd: plain all-reduce for the first N steps, then compress."
    )
    warm_start: bool = Field(
        True, description="powersgd: reuse last step's Q as the starting point."
    )
    chunk_size: int = Field(
        64, ge=2, description="dct: length of the chunks the bucket is cut into."
    )
    topk: int = Field(
        4, ge=1, description="dct: DCT coefficients sent per chunk (largest magnitudes)."
    )
    error_feedback: bool = Field(
        True,
        description="powersgd/dct: keep what was not sent and add it to the next step's gradient.",
    )
    coding: Literal["topk", "quant"] = Field(
        "topk",
        description="dct: topk sends the topk largest coefficients of each chunk as (index, value) "
        "pairs; quant sends every coefficient in `bits` bits with one bf16 step per chunk, with EF21 "
        "error feedback (each rank tracks its gradient and sends the quantised change).",
    )
    bits: int = Field(3, ge=2, le=4, description="dct coding quant: bits per coefficient.")


class DiLoCoOptions(_Section):
    """DiLoCo: each replica trains alone for inner_steps, then the replicas average their pseudo-
    gradients (the change since the last sync) and an outer Nesterov step updates the shared weights;
    Streaming DiLoCo syncs fragments of the model at staggered steps, overlapped with the next ones."""

    inner_steps: int = Field(
        0, ge=0, description="H: inner optimizer steps between syncs of each fragment; 0 = off."
    )
    outer_lr: float = Field(0.7, gt=0, description="Outer learning rate (1 = take the average).")
    outer_momentum: float = Field(
        0.9, ge=0, lt=1, description="Outer Nesterov momentum; 0 = plain outer SGD."
    )
    replicas: int | None = Field(
        None,
        ge=1,
        description="Replica groups DiLoCo averages over, each of world / replicas contiguous "
        "data-parallel ranks laid out by parallel.strategy (ddp, fsdp or hsdp inside a replica); "
        "null = one per data-parallel rank.",
    )
    fragments: int = Field(
        1,
        ge=1,
        description="Streaming DiLoCo: the blocks in this many contiguous fragments, each synced at "
        "its own step of the H-step cycle; 1 = the whole model at once.",
    )
    delay: int = Field(
        0,
        ge=0,
        description="Streaming DiLoCo: inner steps the outer all-reduce of a fragment overlaps with; "
        "its result is applied that many steps later (0 = at once). Less than inner_steps.",
    )
    quantize: Literal["none", "int8", "int4", "int2"] = Field(
        "none",
        description="Outer gradients sent in 8, 4 or 2 bits per value (symmetric: int2 is ternary, "
        "-s, 0, s; one float32 scale per 64 values), with error feedback (what rounding lost is added "
        "to the next sync).",
    )


class ParallelConfig(_Section):
    """How the model and the batch are spread over processes."""

    strategy: Literal["single", "ddp", "fsdp", "hsdp"] = Field(
        "single", description="single process, DDP, FSDP2, or hybrid-sharded FSDP2."
    )
    sharding: Literal["full", "shard_grad_op", "no_shard", "optimizer"] = Field(
        "full",
        description="fsdp/hsdp: full (ZeRO-3), shard_grad_op (ZeRO-2), no_shard (replicated); "
        "ddp: optimizer (ZeRO-1: each rank keeps and steps the optimizer state of its share of the "
        "parameters, then broadcasts them; gradients all-reduced as DDP does).",
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
        "buckets start communicating earlier in backward, larger ones issue fewer collectives.",
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

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages on each pipeline rank (``pp_stages_per_rank`` resolved)."""
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 1 if self.pp_schedule in SINGLE_STAGE_SCHEDULES else 2

    backend: Literal["auto", "gloo", "nccl", "ring", "mpi"] = Field(
        "auto",
        description="auto: nccl on CUDA, gloo on CPU; engine mlx: ring (auto) or mpi.",
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
    keep: int = Field(3, ge=1, description="Checkpoints kept.")
    async_: bool = Field(False, alias="async", description="Write in the background.")
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
        description="MLflow tracking URI (a file store path or sqlite:///...); null = a file store "
        "in <run dir>/mlruns.",
    )
    plot: bool = Field(True, description="Write <run dir>/loss.png at the end.")
    comm_bytes: bool = Field(
        False,
        description="Count every collective of each step from the dispatcher into metrics.jsonl: "
        "comm_bytes (whole buffers) and wire_bytes (what one rank sends, ring algorithms over the "
        "world); for measurements (dtlab.bench.lowcomm).",
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


class Config(_Section):
    """The whole configuration of a run."""

    model: ModelConfig = Field(default_factory=ModelConfig)  # type: ignore[arg-type]
    data: DataConfig = Field(default_factory=DataConfig)  # type: ignore[arg-type]
    eval: EvalConfig = Field(default_factory=EvalConfig)  # type: ignore[arg-type]
    train: TrainConfig = Field(default_factory=TrainConfig)  # type: ignore[arg-type]
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)  # type: ignore[arg-type]
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)  # type: ignore[arg-type]
    run: RunConfig = Field(default_factory=RunConfig)  # type: ignore[arg-type]
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        m, d, t, p = self.model, self.data, self.train, self.parallel
        if m.dim % m.n_heads:
            raise ValueError(
                f"model.dim = {m.dim} must be divisible by model.n_heads = {m.n_heads}"
            )
        if (m.dim // m.n_heads) % 2:
            raise ValueError(
                f"head dim model.dim / model.n_heads = {m.dim // m.n_heads} must be even for RoPE"
            )
        if m.n_heads % m.kv_heads:
            raise ValueError(
                f"model.n_heads = {m.n_heads} must be divisible by model.n_kv_heads = {m.kv_heads}"
            )
        if d.seq_len is None:
            d.seq_len = m.max_seq_len
        if d.seq_len > m.max_seq_len:
            raise ValueError(
                f"data.seq_len = {d.seq_len} exceeds model.max_seq_len = {m.max_seq_len}"
            )
        if d.tokenizer in TOKENIZER_VOCAB and m.vocab_size < TOKENIZER_VOCAB[d.tokenizer]:
            raise ValueError(
                f"model.vocab_size = {m.vocab_size} is smaller than the {d.tokenizer!r} tokenizer's {TOKENIZER_VOCAB[d.tokenizer]}"
            )
        if d.tokenizer_vocab_size is not None and d.tokenizer_vocab_size > m.vocab_size:
            raise ValueError(
                f"data.tokenizer_vocab_size = {d.tokenizer_vocab_size} is larger than model.vocab_size "
                f"= {m.vocab_size}: the model must cover every token id"
            )
        if d.val_fraction and d.val_paths:
            raise ValueError(
                "data.val_fraction and data.val_paths both name a validation split; set one of them"
            )
        if self.eval.every and not (d.val_fraction or d.val_paths):
            raise ValueError(
                f"eval.every = {self.eval.every} needs a validation split: data.val_fraction > 0 or "
                "data.val_paths"
            )
        if d.source == "synthetic" and d.tokenizer != "bytes":
            raise ValueError(
                f"data.tokenizer = {d.tokenizer!r} tokenizes a corpus; data.source = 'synthetic' "
                "generates token ids (allowed with it: bytes)"
            )
        if d.streaming and d.source == "synthetic":
            raise ValueError(
                "data.streaming = true reads a corpus; data.source = 'synthetic' has none "
                "(allowed with it: false)"
            )
        if d.source == "files" and not d.paths:
            raise ValueError(
                "data.source = 'files' needs data.paths (a list of files or directories)"
            )
        if t.micro_batch_size is not None and t.global_batch_size % t.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size = {t.global_batch_size} is not divisible by train.micro_batch_size = {t.micro_batch_size}"
            )
        if t.min_lr > t.lr:
            raise ValueError(f"train.min_lr = {t.min_lr} is larger than train.lr = {t.lr}")
        if not all(0 <= b < 1 for b in t.betas):
            raise ValueError(f"train.betas = {list(t.betas)} must each be in [0, 1)")
        wrapper = DPWrapper.of(p.strategy)
        if p.compression != "none" and wrapper is DPWrapper.NONE:
            raise ValueError(
                f"parallel.compression = {p.compression!r} compresses communication; "
                f"parallel.strategy = {p.strategy!r} has none (allowed: none)"
            )
        if p.compression in ("powersgd", "dct") and wrapper is not DPWrapper.DDP:
            raise ValueError(
                f"parallel.compression = {p.compression!r} compresses DDP's gradient buckets; "
                f"parallel.strategy = {p.strategy!r} allows: none, fp16, bf16"
            )
        if t.optimizer == "demo":
            if wrapper is DPWrapper.FSDP:
                raise ValueError(
                    f"train.optimizer = 'demo' replaces DDP's gradient all-reduce; parallel.strategy = "
                    f"{p.strategy!r} is not allowed (allowed: "
                    f"{', '.join(strategies_with(DPWrapper.NONE, DPWrapper.DDP))})"
                )
            if p.compression != "none":
                raise ValueError(
                    f"train.optimizer = 'demo' compresses its own momentum; parallel.compression = "
                    f"{p.compression!r} is not allowed with it (allowed: none)"
                )
            if t.demo.topk > t.demo.chunk_size:
                raise ValueError(
                    f"train.demo.topk = {t.demo.topk} is larger than train.demo.chunk_size = {t.demo.chunk_size}"
                )
        _check_zero1(self)
        _check_oom_retry(self)
        _check_diloco(self)
        _check_tp(self)
        _check_pp(self)
        if t.engine == "mlx":
            _check_mlx(self)
        elif p.backend in ("ring", "mpi"):
            raise ValueError(
                f"parallel.backend = {p.backend!r} is an MLX backend; train.engine = 'torch' "
                "allows: auto, gloo, nccl"
            )
        o = p.compression_options
        if p.compression == "dct" and o.coding == "quant" and o.chunk_size % 8:
            raise ValueError(
                f"parallel.compression_options.chunk_size = {o.chunk_size} must be a multiple of 8 "
                "with coding = 'quant' (codes are packed 8 at a time)"
            )
        if p.compression == "dct" and o.coding == "topk" and o.topk > o.chunk_size:
            raise ValueError(
                f"parallel.compression_options.topk = {o.topk} is larger than chunk_size = {o.chunk_size}"
            )
        c = self.checkpoint
        if c.durable_every and c.every and c.durable_every % c.every:
            raise ValueError(
                f"checkpoint.durable_every = {c.durable_every} is not a multiple of checkpoint.every = {c.every}"
            )
        return self

    @property
    def seq_len(self) -> int:
        assert self.data.seq_len is not None  # filled in by _cross_checks
        return self.data.seq_len

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved config as plain data (what ``config.yaml`` holds)."""
        return self.model_dump(mode="json", by_alias=True)

    def to_yaml(self) -> str:
        return dump_yaml(self.to_dict())


SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage per rank
V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank, placed in a V
ZERO_BUBBLE_SCHEDULES = (
    "interleaved_zb",
    "zbv",
    "dualpipev",
)  # backward split into input and weight


def _check_pp(c: Config) -> None:
    """What pipeline parallelism needs of the model and the rest of the config."""
    m, p, t = c.model, c.parallel, c.train
    if p.pp == 1:
        return
    v = p.stages_per_rank
    if p.pp_schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        raise ValueError(
            f"parallel.pp_schedule = {p.pp_schedule!r} runs one stage per rank; "
            f"parallel.pp_stages_per_rank = {v} (allowed: 1, or a schedule for several: "
            "interleaved_1f1b, looped_bfs, interleaved_zb)"
        )
    if p.pp_schedule in V_SCHEDULES and v != 2:
        raise ValueError(
            f"parallel.pp_schedule = {p.pp_schedule!r} places two stages per rank in a V; "
            f"parallel.pp_stages_per_rank = {v} (allowed: 2)"
        )
    if p.pp_schedule in ZERO_BUBBLE_SCHEDULES and DPWrapper.of(p.strategy) is not DPWrapper.NONE:
        # Their split backward (input gradients first, weight gradients later) leaves FSDP's gradient
        # reduction with partial weight gradients: measured, the training differs from one process's.
        raise ValueError(
            f"parallel.pp_schedule = {p.pp_schedule!r} (zero bubble) is not supported with data "
            f"parallelism (parallel.strategy = {p.strategy!r}); allowed with it: gpipe, 1f1b, "
            "interleaved_1f1b, looped_bfs; or parallel.strategy = 'single'"
        )
    if p.pp * v > m.n_layers:
        raise ValueError(
            f"parallel.pp = {p.pp} x {v} stages per rank = {p.pp * v} stages, but model.n_layers = "
            f"{m.n_layers}: each stage needs at least one block"
        )
    refused: dict[str, tuple[bool, str, str]] = {
        "model.tie_embeddings": (m.tie_embeddings, "true", "false"),
        "train.precision": (t.precision == "fp16", "'fp16'", "fp32, bf16"),
        "train.optimizer": (t.optimizer == "demo", "'demo'", "adamw"),
        "parallel.compression": (p.compression != "none", repr(p.compression), "none"),
        "train.engine": (t.engine == "mlx", "'mlx'", "torch"),
    }
    for key, (bad, shown, allowed) in refused.items():
        if bad:
            raise ValueError(
                f"{key} = {shown} is not supported with parallel.pp = {p.pp} (allowed: {allowed})"
            )


def pipeline_microbatches(config: Config, dp: int) -> int:
    """Pipeline micro-batches per step on each of ``dp`` data-parallel ranks (``parallel.pp`` > 1);
    a ConfigError when they do not split the rank's share of the batch."""
    p, t = config.parallel, config.train
    share = t.global_batch_size // dp
    if p.pp_microbatches is not None:
        n, key = p.pp_microbatches, f"parallel.pp_microbatches = {p.pp_microbatches}"
    elif t.micro_batch_size is not None:
        n, key = share // t.micro_batch_size, f"train.micro_batch_size = {t.micro_batch_size}"
    else:
        n, key = p.pp, f"parallel.pp = {p.pp} (the default micro-batch count)"
    if n < 1 or share % n:
        raise ConfigError(
            f"{key}: {n} pipeline micro-batches do not split each data-parallel rank's {share} "
            f"samples (train.global_batch_size = {t.global_batch_size} over {dp} ranks); use "
            "parallel.pp_microbatches that divides it"
        )
    return n


def _plain_data_parallel(c: Config) -> dict[str, tuple[bool, str, str]]:
    """What ZeRO-1 and OOM retry both refuse, as key -> (refused, value shown, allowed): anything but
    the torch engine's plain data parallelism with a gradient all-reduce (DeMo and DiLoCo exchange
    something else; tensor and pipeline parallelism meet inside forward and backward)."""
    p, t = c.parallel, c.train
    return {
        "train.optimizer": (t.optimizer == "demo", "'demo'", "adamw, sgd"),
        "parallel.diloco.inner_steps": (p.diloco.inner_steps > 0, str(p.diloco.inner_steps), "0"),
        "parallel.tp": (p.tp > 1, str(p.tp), "1"),
        "parallel.pp": (p.pp > 1, str(p.pp), "1"),
        "train.engine": (t.engine == "mlx", "'mlx'", "torch"),
    }


def _check_zero1(c: Config) -> None:
    """ZeRO-1 (parallel.sharding = 'optimizer') shards DDP's optimizer state, and only that."""
    p = c.parallel
    if p.sharding != "optimizer":
        return
    wrapper = DPWrapper.of(p.strategy)
    if wrapper is DPWrapper.FSDP:
        raise ValueError(
            f"parallel.sharding = 'optimizer' (ZeRO-1) shards DDP's optimizer state; parallel.strategy "
            f"= {p.strategy!r} allows: full, shard_grad_op, no_shard (or use parallel.strategy = 'ddp')"
        )
    refused: dict[str, tuple[bool, str, str]] = {
        **_plain_data_parallel(c),
    }
    for key, (bad, shown, allowed) in refused.items():
        if bad:
            raise ValueError(
                f"{key} = {shown} is not supported with parallel.sharding = 'optimizer' (ZeRO-1 "
                f"over DDP's ranks; allowed: {allowed})"
            )


def _check_oom_retry(c: Config) -> None:
    """OOM retry agrees on the step before the gradient sync: layouts whose only collectives in
    forward and backward are that sync (one process, DDP)."""
    p, t = c.parallel, c.train
    if not t.oom_retry:
        return
    refused: dict[str, tuple[bool, str, str]] = {
        "parallel.strategy": (
            DPWrapper.of(p.strategy) is DPWrapper.FSDP,
            repr(p.strategy),
            "single, ddp",
        ),
        "parallel.compression": (
            p.compression not in ("none", "fp16", "bf16"),
            repr(p.compression),
            "none, fp16, bf16",
        ),
        **_plain_data_parallel(c),
    }
    for key, (bad, shown, allowed) in refused.items():
        if bad:
            raise ValueError(
                f"train.oom_retry = true with {key} = {shown}: a step is taken again only where the "
                "ranks meet nowhere before the gradient sync (a rank out of memory in FSDP's "
                f"all-gathers or a pipeline would leave the others waiting); allowed: {allowed}"
            )


def _check_diloco(c: Config) -> None:
    """DiLoCo's rules: replicas of data-parallel ranks that train alone between syncs (how many ranks
    a replica has, and that the strategy can lay them out, is checked with the world size)."""
    o, p, t = c.parallel.diloco, c.parallel, c.train
    if not o.inner_steps:
        return
    for key, value, off in (
        ("parallel.compression", p.compression, "none"),
        ("train.optimizer", t.optimizer, None),
        ("train.engine", t.engine, "torch"),
    ):
        if key == "train.optimizer" and value == "demo":
            raise ValueError(
                "parallel.diloco replaces the gradient all-reduce, and so does train.optimizer = 'demo' "
                "(allowed with DiLoCo: adamw, sgd)"
            )
        if off is not None and value != off:
            raise ValueError(
                f"parallel.diloco.inner_steps = {o.inner_steps} with {key} = {value!r}: "
                f"allowed with DiLoCo: {off}"
            )
    if p.tp > 1 or p.pp > 1:
        raise ValueError(
            f"parallel.diloco with parallel.tp = {p.tp}, parallel.pp = {p.pp}: DiLoCo runs over "
            "data-parallel replicas only (allowed: tp = pp = 1)"
        )
    if o.fragments > c.model.n_layers:
        raise ValueError(
            f"parallel.diloco.fragments = {o.fragments} is more than the model's "
            f"{c.model.n_layers} layers (each fragment holds at least one block)"
        )
    if o.fragments > o.inner_steps:
        raise ValueError(
            f"parallel.diloco.fragments = {o.fragments} is more than inner_steps = {o.inner_steps}: "
            "each fragment syncs at its own step of the H-step cycle"
        )
    if o.delay >= o.inner_steps:
        raise ValueError(
            f"parallel.diloco.delay = {o.delay} must be less than inner_steps = {o.inner_steps}: a "
            "fragment's sync must land before its next one starts"
        )


def _check_tp(c: Config) -> None:
    """What tensor parallelism needs of the model and the rest of the config."""
    m, p, t = c.model, c.parallel, c.train
    tp = p.tp
    if tp == 1:
        if p.sequence_parallel:
            raise ValueError(
                "parallel.sequence_parallel = true splits the sequence over the tensor-parallel ranks; "
                "it needs parallel.tp > 1 (got 1)"
            )
        return
    splits = {
        "model.n_heads": m.n_heads,
        "model.n_kv_heads": m.kv_heads,
        "model.ffn_dim": m.hidden_dim,
        "model.vocab_size": m.vocab_size,
    }
    if p.sequence_parallel:
        splits["data.seq_len"] = c.seq_len
    for key, value in splits.items():
        if value % tp:
            fits = [k for k in range(1, value + 1) if value % k == 0 and k <= 64]
            raise ValueError(
                f"{key} = {value} is not divisible by parallel.tp = {tp}: each tensor-parallel rank "
                f"takes an equal part (tp values that divide it: {', '.join(map(str, fits[-6:]))})"
            )
    # key: (refused, the value as written, what is allowed)
    refused: dict[str, tuple[bool, str, str]] = {
        "model.tie_embeddings": (m.tie_embeddings, "true", "false"),
        "parallel.compression": (
            p.compression in ("powersgd", "dct"),
            repr(p.compression),
            "none, fp16, bf16",
        ),
        "train.optimizer": (t.optimizer == "demo", "'demo'", "adamw"),
        "train.engine": (t.engine == "mlx", "'mlx'", "torch"),
        # Measured: the compiled split blocks fail in backward (torch 2.13, CPU).
        "train.compile": (t.compile, "true", "false"),
    }
    for key, (bad, shown, allowed) in refused.items():
        if bad:
            raise ValueError(
                f"{key} = {shown} is not supported with parallel.tp = {tp} (allowed: {allowed})"
            )


def _check_mlx(c: Config) -> None:
    """What the MLX engine does not do (yet): say so instead of silently training something else."""
    t, p = c.train, c.parallel
    if DPWrapper.of(p.strategy) is DPWrapper.FSDP:  # the engine all-reduces whole gradients
        raise ValueError(
            f"parallel.strategy = {p.strategy!r} is not supported with train.engine = 'mlx' "
            f"(allowed: {', '.join(strategies_with(DPWrapper.NONE, DPWrapper.DDP))})"
        )
    allowed = {
        "parallel.compression": (p.compression, ("none",)),
        "parallel.backend": (p.backend, ("auto", "ring", "mpi")),
        "train.optimizer": (t.optimizer, ("adamw",)),
        "train.precision": (t.precision, ("fp32", "bf16")),
        "train.activation_checkpointing": (t.activation_checkpointing, ("none", "full")),
        "train.device": (t.device, ("auto", "cpu")),
    }
    for key, (value, ok) in allowed.items():
        if value not in ok:
            raise ValueError(
                f"{key} = {value!r} is not supported with train.engine = 'mlx' "
                f"(allowed: {', '.join(ok)})"
            )
    if c.model.init_from is not None:
        raise ValueError(
            f"model.init_from = {c.model.init_from!r} is not supported with train.engine = 'mlx' "
            "(allowed: null); train.engine = 'torch' starts from it"
        )


def config_warnings(config: Config) -> list[str]:
    """Settings that are allowed but probably not meant: said once at the start of a run."""
    t, d = config.train, config.data
    out = []
    if t.warmup_steps >= t.steps:
        out.append(
            f"train.warmup_steps = {t.warmup_steps} >= train.steps = {t.steps}: the whole run is "
            f"warm-up, and the learning rate never reaches train.lr = {t.lr:g}"
        )
    if d.paths and d.source != "files":
        out.append(
            f"data.paths is set but data.source = {d.source!r}: the paths are not read "
            "(data.source=files trains on them)"
        )
    return out


def check_world(config: Config, world_size: int) -> int:
    """Checks that need the world size: the parallel degrees (:meth:`ParallelDims.from_config`) and the
    batch split over the data-parallel ranks; returns the gradient accumulation steps.

    Run once, in the process that launches, before any worker starts; a worker builds its degrees once
    (``init_distributed``).
    """
    dims = ParallelDims.from_config(config, world_size)
    accum = check_batch_split(config, dims.dp)
    if dims.pp_enabled:
        pipeline_microbatches(config, dims.dp)
    return accum


def check_batch_split(config: Config, world_size: int) -> int:
    """That the global batch splits over ``world_size`` data-parallel ranks (and into micro-batches of
    ``train.micro_batch_size`` when it is set); returns the accumulation steps. The error says what
    would work: process counts, global batch sizes (and micro-batch sizes)."""
    t = config.train
    g, micro = t.global_batch_size, t.micro_batch_size
    unit = (micro or 1) * world_size  # what the global batch must be a multiple of
    if g % unit == 0:
        return 1 if micro is None else g // unit  # without micro_batch_size: no accumulation
    worlds = [n for n in range(1, g + 1) if g % ((micro or 1) * n) == 0]
    near = sorted(worlds, key=lambda n: (abs(n - world_size), n))[:4]
    lower, upper = g // unit * unit, (g // unit + 1) * unit
    sizes = " or ".join(str(x) for x in (lower, upper) if x > 0)
    if micro is None:
        msg = f"train.global_batch_size = {g} samples cannot be split over {world_size} ranks"
    else:
        msg = (
            f"train.global_batch_size = {g} samples cannot be split into micro-batches of "
            f"train.micro_batch_size = {micro} on {world_size} ranks ({g} is not a multiple of "
            f"{micro} x {world_size})"
        )
    hint = f"use {_or(sorted(near))} processes, or train.global_batch_size {sizes}"
    if micro is not None:
        micros = [m for m in range(1, g // world_size + 1) if g % (m * world_size) == 0]
        if micros:
            hint += f", or train.micro_batch_size {_or(micros[-3:])}"
    raise ConfigError(f"{msg}: {hint}")


def _or(items: list[int]) -> str:
    text = [str(x) for x in items]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " or " + text[-1]


# --- YAML --------------------------------------------------------------------------------------
# Plain scalars are read by YAML 1.2's core schema, not PyYAML's YAML 1.1: `1e-4` is a float (1.1: a
# string), only true/false are booleans (1.1: also yes/no/on/off, so `run.name=no` became false), `010`
# is ten (1.1: octal eight), and `1:30` and `2024-01-01` are strings (1.1: 90 and a date). Underscores
# between digits are kept (`10_000`).
_BOOL = r"^(?:true|True|TRUE|false|False|FALSE)$"
_INT = r"^(?:[-+]?[0-9][0-9_]*|0o[0-7][0-7_]*|0x[0-9a-fA-F][0-9a-fA-F_]*)$"
_FLOAT = (
    r"^(?:[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_NULL = r"^(?:~|null|Null|NULL|)$"


class ValueRangeError(yaml.constructor.ConstructorError):
    """A number YAML can write but a 64-bit value cannot hold (1e-400, 1e400, 2**64)."""


class _Loader(yaml.SafeLoader):
    """YAML 1.2 core scalars, numbers checked for range, duplicate keys refused."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # PyYAML keeps the last of two equal keys: a second `train:` section would silently replace
        # the first one. Keys that a merge (`<<: *base`) brings in may be overridden; written ones not.
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found the key {show(key)} twice (first on line {first.start_mark.line + 1})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-untyped-call]


def _scalar(loader: _Loader, node: yaml.Node) -> str:
    return str(loader.construct_scalar(node))  # type: ignore[arg-type]


def _construct_int(loader: _Loader, node: yaml.Node) -> int:
    text = _scalar(loader, node)
    digits = text.replace("_", "")
    sign = -1 if digits.startswith("-") else 1
    digits = digits.lstrip("+-")
    base = {"0x": 16, "0o": 8}.get(digits[:2], 10)
    if base != 10:
        digits = digits[2:]
    try:
        # The length check keeps int() away from its 4300-digit limit (a ValueError of its own).
        value = sign * int(digits, base) if len(digits) <= 64 else None
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{show(text)} is not an integer", node.start_mark
        ) from None
    if value is None or not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ValueRangeError(
            None,
            None,
            f"{show(text)} is outside the 64-bit integer range; allowed: -2**63 to 2**63 - 1",
            node.start_mark,
        )
    return value


def _construct_float(loader: _Loader, node: yaml.Node) -> float:
    text = _scalar(loader, node)
    plain = text.replace("_", "").lower()
    if plain.lstrip("+-") in (".inf", ".nan"):
        value = math.nan if "nan" in plain else math.inf
        return -value if plain.startswith("-") else value
    try:
        value = float(plain)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{show(text)} is not a number", node.start_mark
        ) from None
    # float() rounds 1e400 to inf and 1e-400 to 0 without a word; a config must not.
    if math.isinf(value):
        raise ValueRangeError(
            None,
            None,
            f"{show(text)} is too large for a 64-bit float; allowed: magnitudes up to about 1.8e308",
            node.start_mark,
        )
    if value == 0 and any(c in "123456789" for c in plain.split("e")[0]):
        raise ValueRangeError(
            None,
            None,
            f"{show(text)} is too small for a 64-bit float (it would be read as 0); allowed: 0, "
            "or magnitudes from about 5e-324",
            node.start_mark,
        )
    return value


def _construct_bool(loader: _Loader, node: yaml.Node) -> bool:
    text = _scalar(loader, node)
    if text.lower() not in ("true", "false"):
        raise yaml.constructor.ConstructorError(
            None, None, f"{show(text)} is not a boolean; allowed: true, false", node.start_mark
        )
    return text.lower() == "true"


def _construct_timestamp(loader: _Loader, node: yaml.Node) -> Any:
    # Only an explicit `!!timestamp` gets here; PyYAML's constructor fails on a malformed one with an
    # AttributeError.
    try:
        return loader.construct_yaml_timestamp(node)  # type: ignore[arg-type]
    except (AttributeError, ValueError, TypeError):
        raise yaml.constructor.ConstructorError(
            None, None, f"{show(_scalar(loader, node))} is not a timestamp", node.start_mark
        ) from None


_Loader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
    ("bool", _BOOL, "tTfF"),
    ("int", _INT, "-+0123456789"),
    ("float", _FLOAT, "-+0123456789."),
    ("null", _NULL, ["~", "n", "N", ""]),
    ("merge", r"^(?:<<)$", "<"),
):
    _Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_Loader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", _construct_timestamp)


class _Dumper(yaml.SafeDumper):
    """Quotes every string that _Loader or a plain YAML 1.1 reader would take for something else
    (`1e3`, `no`, `010`), so a written config.yaml reads back the same with either."""


_Dumper.yaml_implicit_resolvers = {
    first: list(yaml.SafeDumper.yaml_implicit_resolvers.get(first, []))
    + list(_Loader.yaml_implicit_resolvers.get(first, []))
    for first in {*yaml.SafeDumper.yaml_implicit_resolvers, *_Loader.yaml_implicit_resolvers}
}


def dump_yaml(data: Any) -> str:
    """YAML text that :func:`parse_yaml` (and ``yaml.safe_load``) read back as ``data``."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text (YAML 1.2 core scalars); errors name the source, line and what is allowed."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" (line {mark.line + 1}, column {mark.column + 1})"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if isinstance(e, ValueRangeError):
            where = where if "\n" in text.strip() else ""  # a --set value is one line
            raise ConfigError(f"{source}{where}: {problem}") from None
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, OverflowError) as e:
        # PyYAML's constructors for explicitly tagged scalars (`!!timestamp x`) fail this way.
        raise ConfigError(
            f"{source}: not valid YAML: a tagged value cannot be read ({type(e).__name__}: {e})"
        ) from None


def _read_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        if p.is_dir():
            p = p / "config.yaml"
            if not p.is_file():
                found = sorted(str(f) for f in Path(path).glob("*.y*ml"))[:6]
                raise ConfigError(
                    f"{str(path)!r} is a directory without a config.yaml (not a run directory); "
                    "give a YAML file"
                    + (f", e.g. {', '.join(found)}" if found else "")
                    + ", or a run directory"
                )
        if not p.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist (or is not a file)")
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e}") from None
    data = parse_yaml(text, str(p))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p}: the top level must be a mapping of sections (model, data, train, ...), got {type(data).__name__}"
        )
    return data


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one ``a.b=c`` override in place; the value is parsed as YAML."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {show(override)}: expected KEY=VALUE, e.g. train.lr=1e-4")
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"--set {show(override)}: {show(where)[1:-1]} is not a section")
        node = child
    node[parts[-1]] = parse_yaml(raw, f"--set {show(key)[1:-1]}") if raw.strip() else None


def _format_validation_error(
    err: ValidationError, source: str, overridden: dict[str, str] | None = None
) -> str:
    """One message for all of ``err``'s errors, each blamed on where its value came from: the
    ``--set`` that gave it (``overridden``: dotted key -> the override as typed), else ``source``."""
    overridden = overridden or {}
    lines: list[tuple[str, str]] = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        given = next(
            (
                ov
                for k, ov in overridden.items()
                # the key itself, a key inside a mapping it set, or a section it introduced
                if loc and (loc == k or loc.startswith(k + ".") or k.startswith(loc + "."))
            ),
            None,
        )
        where = f"--set {show(given)}" if given is not None else source
        if e["type"] == "extra_forbidden":
            section_cls: type[BaseModel] = Config
            for part in e["loc"][:-1]:
                field = section_cls.model_fields.get(str(part))
                ann = field.annotation if field is not None else None
                if isinstance(ann, type) and issubclass(ann, BaseModel):
                    section_cls = ann
            valid = [f.alias or n for n, f in section_cls.model_fields.items()]
            section = ".".join(str(x) for x in e["loc"][:-1])
            text = f"unknown key {show(loc)}"
            close = difflib.get_close_matches(str(e["loc"][-1]), valid, n=1, cutoff=0.7)
            if close:
                text += f" (did you mean {section + '.' if section else ''}{close[0]}?)"
            text += f"; valid keys in {section or 'the top level'}: {', '.join(valid)}"
        elif e["type"] in ("value_error", "assertion_error"):
            msg = str(e["msg"]).removeprefix("Value error, ")
            text = msg if not loc or msg.startswith(loc) else f"{loc}: {msg}"
        else:
            msg = e["msg"]
            if e["type"] in ("model_type", "model_attributes_type", "dict_type"):
                msg = "not a section; allowed: a mapping of its keys (`dtlab config --keys` lists them)"
            text = f"{loc or 'the config'} = {show(e.get('input'))}: {msg}"
            if given is not None and isinstance(e.get("input"), (dict, list)):
                # YAML read "a: b" as a mapping and "[a]" as a list: the text needs quotes.
                key, _, raw = given.partition("=")
                text += (
                    f" (--set values are YAML, and {show(raw)} reads as a "
                    f"{'mapping' if isinstance(e.get('input'), dict) else 'list'}; to pass it as "
                    f"text, quote it: --set '{key}=\"{raw}\"')"
                )
        lines.append((where, text))
    if len({w for w, _ in lines}) == 1:
        return f"{lines[0][0]}: " + "; ".join(t for _, t in lines)
    return "; ".join(f"{w}: {t}" for w, t in lines)


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load and validate a config: defaults, then the YAML file at ``path``, then ``overrides``.

    ``overrides`` are ``"key=value"`` strings, exactly what ``dtlab train --set`` takes. ``path`` may be
    a run directory (its ``config.yaml`` is read). Raises :class:`ConfigError` with a message that
    names the key, the value received and what is allowed.
    """
    data = _read_file(path) if path is not None else {}
    overridden: dict[str, str] = {}
    for ov in overrides:
        apply_override(data, ov)
        overridden[ov.partition("=")[0].strip()] = ov  # a later --set of the key wins, here too
    return config_from_dict(data, str(path) if path is not None else "config", overridden)


def config_from_dict(
    data: dict[str, Any], source: str = "config", overridden: dict[str, str] | None = None
) -> Config:
    """Validate plain data as a :class:`Config`; errors name ``source`` (or the ``--set`` in
    ``overridden`` that gave the value)."""
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source, overridden)) from None


def yaml_scalar(value: Any) -> str:
    """``value`` as it is written in a YAML config (``tiny``, ``false``, ``null``, ``[0.9, 0.95]``)."""
    text = yaml.dump(value, Dumper=_Dumper, default_flow_style=True, width=1000)
    return text.removesuffix("\n...\n").strip()


def describe_fields() -> list[tuple[str, str, str]]:
    """(key, default, description) for every config key, for docs and ``--help``."""
    rows = []
    defaults = Config().to_dict()
    for section, field in Config.model_fields.items():
        cls = field.annotation
        assert isinstance(cls, type) and issubclass(cls, BaseModel)
        for name, f in cls.model_fields.items():
            key = f.alias or name
            sub = f.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):  # a nested group of options
                for sub_name, sf in sub.model_fields.items():
                    rows.append(
                        (
                            f"{section}.{key}.{sub_name}",
                            yaml_scalar(defaults[section][key][sub_name]),
                            sf.description or "",
                        )
                    )
                continue
            rows.append(
                (f"{section}.{key}", yaml_scalar(defaults[section][key]), f.description or "")
            )
    return rows
