"""The whole config: its sections and the cross-field rules that need only the config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    PrivateAttr,
    model_validator,
)

from dtlab.config.sections import (
    AlertsConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from dtlab.config.values import DEFAULT_SEQ_LEN, TOKENIZER_VOCAB, _Section
from dtlab.config.yamlio import dump_yaml
from dtlab.dims import DPWrapper, strategies_with

# The larger cross-field rules, each a function of the whole config, in the order they apply. The
# module that holds them (dtlab.config.checks) adds them when it is imported (the dtlab.config
# package imports it before anything can reach this module), so that it may name Config without
# this module importing it back.
CROSS_RULES: list[Callable[[Config], None]] = []


def refuse(table: dict[str, tuple[bool, str, str, str]], setting: str) -> None:
    """The first refused key of ``table`` (key: refused, the value as written, what is allowed,
    why) as an error naming ``setting``, the setting it does not go with."""
    for key, (bad, shown, allowed, why) in table.items():
        if bad:
            raise ValueError(
                f"{key} = {shown} is not supported with {setting} (allowed: {allowed}): {why}"
            )


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
    # The dotted keys the config file or --set gave (load_config fills it in); every other key took its
    # default. Not a setting: a copy keeps it, equality and config.yaml ignore it.
    _given: frozenset[str] = PrivateAttr(default_factory=frozenset)

    def __eq__(self, other: object) -> bool:
        # The settings alone: a config loaded from a run's resolved config.yaml (every key given) equals
        # the one it was resolved from.
        return type(other) is type(self) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # mutable, as every pydantic model that is not frozen

    @property
    def given(self) -> frozenset[str]:
        """Dotted keys (``train.precision``) set in the config file or by ``--set``; every other key
        is the default, which ``dtlab plan`` may choose for itself."""
        return self._given

    def is_given(self, key: str) -> bool:
        """Whether ``key`` (dotted), or a key above it given a value, was set in the file or by
        ``--set``."""
        parts = key.split(".")
        return any(".".join(parts[: i + 1]) in self._given for i in range(len(parts)))

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        _check_heads(self.model)
        _tokenizer_of_init_from(self.model, self.data)
        _check_sequence_and_vocab(self.model, self.data)
        _check_data(self)
        _check_train(self.train)
        _check_data_parallel(self.train, self.parallel)
        if not CROSS_RULES:  # a config checked without its rules would be quietly wrong
            raise RuntimeError("dtlab.config.checks was not imported: its rules are not registered")
        for rule in CROSS_RULES:
            rule(self)
        _check_compression_options(self.parallel)
        _check_checkpoint(self.checkpoint)
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


def _check_heads(m: ModelConfig) -> None:
    """The attention heads split model.dim evenly (unless model.head_dim gives their size), into an
    even head dim (RoPE rotates pairs), and the query heads share the key/value heads evenly."""
    if m.head_dim is None and m.dim % m.n_heads:
        raise ValueError(
            f"model.dim = {m.dim} must be divisible by model.n_heads = {m.n_heads} (or give "
            "model.head_dim, each head's size)"
        )
    if m.head_dim is None and (m.dim // m.n_heads) % 2:
        raise ValueError(
            f"head dim model.dim / model.n_heads = {m.dim // m.n_heads} must be even for RoPE"
        )
    if m.n_heads % m.kv_heads:
        raise ValueError(
            f"model.n_heads = {m.n_heads} must be divisible by model.n_kv_heads = {m.kv_heads}"
        )


def _tokenizer_of_init_from(m: ModelConfig, d: DataConfig) -> None:
    """Fill in data.tokenizer where it is not given: a run that starts from a directory holding a
    tokenizer.json (a Hugging Face model, a dtlab export) trains with the tokenizer its weights
    learned; synthetic data has no text to tokenize. Written into the config, so that config.yaml,
    the workers and a resume read the same tokenizer."""
    if m.init_from is None or "tokenizer" in d.model_fields_set or d.source == "synthetic":
        return
    if (Path(m.init_from).expanduser() / "tokenizer.json").is_file():
        d.tokenizer = m.init_from


def _check_sequence_and_vocab(m: ModelConfig, d: DataConfig) -> None:
    """Fill in data.seq_len (the default, within the model's), then check that the model covers the
    sequences and every token id the tokenizer makes."""
    if d.seq_len is None:
        d.seq_len = min(DEFAULT_SEQ_LEN, m.max_seq_len)
    if d.seq_len > m.max_seq_len:
        raise ValueError(f"data.seq_len = {d.seq_len} exceeds model.max_seq_len = {m.max_seq_len}")
    if d.tokenizer in TOKENIZER_VOCAB and m.vocab_size < TOKENIZER_VOCAB[d.tokenizer]:
        raise ValueError(
            f"model.vocab_size = {m.vocab_size} is smaller than the {d.tokenizer!r} tokenizer's {TOKENIZER_VOCAB[d.tokenizer]}"
        )
    if d.tokenizer_vocab_size is not None and d.tokenizer_vocab_size > m.vocab_size:
        raise ValueError(
            f"data.tokenizer_vocab_size = {d.tokenizer_vocab_size} is larger than model.vocab_size "
            f"= {m.vocab_size}: the model must cover every token id"
        )


def _check_data(c: Config) -> None:
    """One validation split at most (and one when eval.every asks for it), and a source that goes
    with the tokenizer, streaming and paths."""
    d = c.data
    if d.val_fraction and d.val_paths:
        raise ValueError(
            "data.val_fraction and data.val_paths both name a validation split; set one of them"
        )
    if c.eval.every and not (d.val_fraction or d.val_paths):
        raise ValueError(
            f"eval.every = {c.eval.every} needs a validation split: data.val_fraction > 0 or "
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
        raise ValueError("data.source = 'files' needs data.paths (a list of files or directories)")


def _check_train(t: TrainConfig) -> None:
    """The batch splits into micro-batches, the learning rate decays downwards, and Adam's betas
    are each in [0, 1)."""
    if t.micro_batch_size is not None and t.global_batch_size % t.micro_batch_size:
        raise ValueError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by train.micro_batch_size = {t.micro_batch_size}"
        )
    if t.min_lr > t.lr:
        raise ValueError(f"train.min_lr = {t.min_lr} is larger than train.lr = {t.lr}")
    if not all(0 <= b < 1 for b in t.betas):
        raise ValueError(f"train.betas = {list(t.betas)} must each be in [0, 1)")


def _check_data_parallel(t: TrainConfig, p: ParallelConfig) -> None:
    """Gradient compression, and the DeMo optimizer (which compresses its own), only with a
    data-parallel wrapper that has the communication they replace."""
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
    if t.optimizer != "demo":
        return
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


def _check_compression_options(p: ParallelConfig) -> None:
    """DCT compression's chunks: a multiple of 8 with packed quantized codes, no fewer values than
    the top-k it keeps of each."""
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


def _check_checkpoint(c: CheckpointConfig) -> None:
    """Every durable copy is of a periodic checkpoint: durable_every is a multiple of every."""
    if c.durable_every and c.every and c.durable_every % c.every:
        raise ValueError(
            f"checkpoint.durable_every = {c.durable_every} is not a multiple of checkpoint.every = {c.every}"
        )
