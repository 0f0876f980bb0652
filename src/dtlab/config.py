"""One config schema for everything dtlab runs.

Precedence: ``--set key=value`` > the YAML file > the defaults below. Every cross-field rule lives in
:meth:`Config._cross_checks` (rules that need only the config) or :func:`check_world` (rules that
also need the world size), so there is one place to read what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dtlab.errors import ConfigError
from dtlab.models.presets import PRESETS

# Vocabulary size of each tokenizer; the model's vocab_size must cover it.
TOKENIZER_VOCAB = {"bytes": 256}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


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
        if preset not in PRESETS:
            raise ValueError(
                f"model.preset = {preset!r} is not a preset; allowed: {', '.join(PRESETS)}"
            )
        return {**PRESETS[preset], **data}

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        multiple = 256
        return multiple * ((int(8 * self.dim / 3) + multiple - 1) // multiple)


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
    text_key: str = Field("text", description="Field that holds the text in jsonl/parquet records.")
    seq_len: int | None = Field(
        None, ge=1, description="Tokens per training sample; null = model.max_seq_len."
    )
    tokenizer: Literal["bytes"] = Field(
        "bytes", description="bytes: UTF-8 bytes, vocabulary 256 (byte 0 separates documents)."
    )
    prefetch: int = Field(
        2,
        ge=0,
        description="Optimizer steps of batches prepared ahead in a background thread; 0 = inline.",
    )


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
    optimizer: Literal["adamw", "demo"] = Field(
        "adamw",
        description="adamw; demo: DeMo (arXiv 2411.19870), each rank keeps its own momentum and sends "
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


class ParallelConfig(_Section):
    """How the model and the batch are spread over processes."""

    strategy: Literal["single", "ddp", "fsdp", "hsdp"] = Field(
        "single", description="single process, DDP, FSDP2, or hybrid-sharded FSDP2."
    )
    sharding: Literal["full", "shard_grad_op", "no_shard"] = Field(
        "full",
        description="fsdp/hsdp: full (ZeRO-3), shard_grad_op (ZeRO-2), no_shard (replicated).",
    )
    replicate: int | None = Field(
        None,
        ge=1,
        description="hsdp: number of replica groups; the shard group size is world / replicate.",
    )
    compression: Literal["none", "fp16", "bf16", "powersgd", "dct"] = Field(
        "none",
        description="Gradient compression: fp16/bf16 reduce in half precision (ddp, fsdp, hsdp); "
        "powersgd and dct compress DDP's gradient buckets.",
    )
    compression_options: CompressionOptions = Field(default_factory=CompressionOptions)  # type: ignore[arg-type]
    backend: Literal["auto", "gloo", "nccl", "ring", "mpi"] = Field(
        "auto",
        description="auto: nccl on CUDA, gloo on CPU; engine mlx: ring (auto) or mpi.",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
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
        description="auto: the newest complete checkpoint of this run (local or durable tier); never; "
        "or the path of a checkpoint or of a run directory.",
    )
    durable_dir: str | None = Field(
        None,
        description="Durable tier: a path or fsspec URL that also receives checkpoints; null = off.",
    )
    durable_every: int = Field(
        0,
        ge=0,
        description="Copy every N-th step's checkpoint to the durable tier (a multiple of every); "
        "0 = each one. The final checkpoint is always copied.",
    )


class RunConfig(_Section):
    """Where a run writes and how it reports."""

    dir: str | None = Field(None, description="Run directory; null = runs/<name>-<timestamp>.")
    name: str = Field("dtlab", min_length=1, description="Run name.")
    log_every: int = Field(
        10, ge=1, description="Log metrics every N steps (the last step is always logged)."
    )
    progress: Literal["auto", "bar", "lines", "none"] = Field(
        "auto", description="auto: a bar on a terminal, plain lines otherwise."
    )
    tensorboard: bool = Field(
        True, description="Write TensorBoard event files to <run dir>/tensorboard."
    )
    plot: bool = Field(True, description="Write <run dir>/loss.png at the end.")
    profile: bool = Field(
        False,
        description="Record a torch.profiler trace of steps 3-4 (Chrome trace / TensorBoard) and, on CUDA, "
        "a memory snapshot, under <run dir>/profile.",
    )


class Config(_Section):
    """The whole configuration of a run."""

    model: ModelConfig = Field(default_factory=ModelConfig)  # type: ignore[arg-type]
    data: DataConfig = Field(default_factory=DataConfig)  # type: ignore[arg-type]
    train: TrainConfig = Field(default_factory=TrainConfig)  # type: ignore[arg-type]
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)  # type: ignore[arg-type]
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)  # type: ignore[arg-type]
    run: RunConfig = Field(default_factory=RunConfig)  # type: ignore[arg-type]

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
        if m.vocab_size < TOKENIZER_VOCAB[d.tokenizer]:
            raise ValueError(
                f"model.vocab_size = {m.vocab_size} is smaller than the {d.tokenizer!r} tokenizer's {TOKENIZER_VOCAB[d.tokenizer]}"
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
        if p.compression != "none" and p.strategy == "single":
            raise ValueError(
                f"parallel.compression = {p.compression!r} compresses communication; "
                "parallel.strategy = 'single' has none (allowed: none)"
            )
        if p.compression in ("powersgd", "dct") and p.strategy != "ddp":
            raise ValueError(
                f"parallel.compression = {p.compression!r} compresses DDP's gradient buckets; "
                f"parallel.strategy = {p.strategy!r} allows: none, fp16, bf16"
            )
        if t.optimizer == "demo":
            if p.strategy not in ("single", "ddp"):
                raise ValueError(
                    f"train.optimizer = 'demo' replaces DDP's gradient all-reduce; parallel.strategy = "
                    f"{p.strategy!r} is not allowed (allowed: single, ddp)"
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
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _check_mlx(c: Config) -> None:
    """What the MLX engine does not do (yet): say so instead of silently training something else."""
    t, p = c.train, c.parallel
    allowed = {
        "parallel.strategy": (p.strategy, ("single", "ddp")),
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


def check_world(config: Config, world_size: int) -> int:
    """Checks that need the world size; returns the gradient accumulation steps."""
    p, t = config.parallel, config.train
    if p.strategy == "single" and world_size > 1:
        raise ConfigError(
            f"parallel.strategy = 'single' runs one process, but {world_size} were started; use ddp, fsdp or hsdp"
        )
    if p.strategy == "hsdp":
        if p.replicate is None:
            raise ConfigError(
                "parallel.strategy = 'hsdp' needs parallel.replicate (the number of replica groups, e.g. the number of nodes)"
            )
        if world_size % p.replicate:
            raise ConfigError(
                f"parallel.replicate = {p.replicate} does not divide the world size {world_size}"
            )
    if t.global_batch_size < world_size:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is smaller than the data-parallel degree "
            f"{world_size}; every rank needs at least one sample; allowed: a multiple of {world_size}"
        )
    micro = t.micro_batch_size or t.global_batch_size // world_size
    if t.global_batch_size % (micro * world_size):
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by train.micro_batch_size = {micro} "
            f"x data-parallel degree {world_size}; allowed: a multiple of {micro * world_size}"
        )
    return t.global_batch_size // (micro * world_size)


# --- YAML --------------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where ``1e-4`` is a string; we read floats the YAML 1.2 way."""


_Loader.yaml_implicit_resolvers = {
    k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text with YAML 1.2 floats; errors name the source and line."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" (line {mark.line + 1}, column {mark.column + 1})"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None


def _read_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.yaml"
    if not p.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
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
        raise ConfigError(f"--set {override!r}: expected KEY=VALUE, e.g. train.lr=1e-4")
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = parse_yaml(raw, f"--set {key}") if raw.strip() else None


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            section_cls: type[BaseModel] = Config
            for part in e["loc"][:-1]:
                ann = section_cls.model_fields[str(part)].annotation
                section_cls = (
                    ann if isinstance(ann, type) and issubclass(ann, BaseModel) else section_cls
                )
            valid = [f.alias or n for n, f in section_cls.model_fields.items()]
            where = ".".join(str(x) for x in e["loc"][:-1]) or "the top level"
            lines.append(f"unknown key {loc!r}; valid keys in {where}: {', '.join(valid)}")
        elif e["type"] in ("value_error", "assertion_error"):
            msg = str(e["msg"]).removeprefix("Value error, ")
            lines.append(msg if not loc or msg.startswith(loc) else f"{loc}: {msg}")
        else:
            lines.append(f"{loc} = {e.get('input')!r}: {e['msg']}")
    return f"{source}: " + "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load and validate a config: defaults, then the YAML file at ``path``, then ``overrides``.

    ``overrides`` are ``"key=value"`` strings, exactly what ``dtlab train --set`` takes. ``path`` may be
    a run directory (its ``config.yaml`` is read). Raises :class:`ConfigError` with a message that
    names the key, the value received and what is allowed.
    """
    data = _read_file(path) if path is not None else {}
    for ov in overrides:
        apply_override(data, ov)
    return config_from_dict(data, str(path) if path is not None else "config")


def config_from_dict(data: dict[str, Any], source: str = "config") -> Config:
    """Validate plain data as a :class:`Config`."""
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


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
                            repr(defaults[section][key][sub_name]),
                            sf.description or "",
                        )
                    )
                continue
            rows.append((f"{section}.{key}", repr(defaults[section][key]), f.description or ""))
    return rows
