""" "Did you mean" for config mistakes: misspelt keys and values, and the names other trainers use.

Someone who knows torchtitan, Lightning or Hugging Face's Trainer types the names they know
(``train.learning_rate``, ``optimizer.lr``, ``model.name``); a spelling match cannot find ``train.lr``
from those, so a short table maps the common ones. Values of a fixed set (``parallel.strategy``,
``train.precision``, ...) get the same help: a near spelling (``fdsp``), another case (``FSDP``) or
another trainer's word for it (``bf16-mixed``, ``FULL_SHARD``).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args, get_origin

# Other trainers' names for dtlab's keys (full dotted keys, as they would be typed in a dtlab config).
KEY_SYNONYMS: dict[str, str] = {
    "train.learning_rate": "train.lr",
    "train.batch_size": "train.global_batch_size",
    "train.train_batch_size": "train.global_batch_size",
    "train.local_batch_size": "train.micro_batch_size",
    "train.per_device_train_batch_size": "train.micro_batch_size",
    "train.gradient_accumulation_steps": "train.micro_batch_size",
    "train.accumulate_grad_batches": "train.micro_batch_size",
    "train.max_steps": "train.steps",
    "train.num_steps": "train.steps",
    "train.total_steps": "train.steps",
    "train.training_steps": "train.steps",
    "train.epochs": "train.steps",
    "train.max_epochs": "train.steps",
    "train.num_train_epochs": "train.steps",
    "train.warmup": "train.warmup_steps",
    "train.lr_warmup_steps": "train.warmup_steps",
    "train.min_learning_rate": "train.min_lr",
    "train.lr_scheduler": "train.schedule",
    "train.lr_scheduler_type": "train.schedule",
    "train.scheduler": "train.schedule",
    "train.max_norm": "train.grad_clip",
    "train.max_grad_norm": "train.grad_clip",
    "train.gradient_clip_val": "train.grad_clip",
    "train.clip_grad_norm": "train.grad_clip",
    "train.mixed_precision": "train.precision",
    "train.dtype": "train.precision",
    "train.gradient_checkpointing": "train.activation_checkpointing",
    "train.torch_compile": "train.compile",
    "train.seq_len": "data.seq_len",
    "train.max_seq_len": "data.seq_len",
    "train.block_size": "data.seq_len",
    "data.seq_length": "data.seq_len",
    "data.max_seq_length": "data.seq_len",
    "data.block_size": "data.seq_len",
    "data.dataset": "data.source",
    "data.dataset_name": "data.source",
    "data.data_files": "data.paths",
    "data.files": "data.paths",
    "model.name": "model.preset",
    "model.model_name": "model.preset",
    "model.flavor": "model.preset",
    "model.hidden_size": "model.dim",
    "model.d_model": "model.dim",
    "model.n_embd": "model.dim",
    "model.num_layers": "model.n_layers",
    "model.num_hidden_layers": "model.n_layers",
    "model.n_layer": "model.n_layers",
    "model.num_attention_heads": "model.n_heads",
    "model.n_head": "model.n_heads",
    "model.num_key_value_heads": "model.n_kv_heads",
    "model.intermediate_size": "model.ffn_dim",
    "model.max_position_embeddings": "model.max_seq_len",
    "optimizer.lr": "train.lr",
    "optimizer.learning_rate": "train.lr",
    "optimizer.name": "train.optimizer",
    "optimizer.weight_decay": "train.weight_decay",
    "optimizer.eps": "train.eps",
    "optimizer.betas": "train.betas",
    "lr_scheduler.warmup_steps": "train.warmup_steps",
    "training.local_batch_size": "train.micro_batch_size",
    "training.seq_len": "data.seq_len",
    "training.max_norm": "train.grad_clip",
    "parallel.tp_size": "parallel.tp",
    "parallel.tensor_parallel_size": "parallel.tp",
    "parallel.tensor_parallel_degree": "parallel.tp",
    "parallel.pp_size": "parallel.pp",
    "parallel.pipeline_parallel_size": "parallel.pp",
    "parallel.pipeline_parallel_degree": "parallel.pp",
    "checkpoint.interval": "checkpoint.every",
    "checkpoint.save_steps": "checkpoint.every",
    "checkpoint.every_n_train_steps": "checkpoint.every",
    "checkpoint.save_total_limit": "checkpoint.keep",
    "checkpoint.keep_latest_k": "checkpoint.keep",
    "checkpoint.resume_from_checkpoint": "checkpoint.resume",
    "checkpoint.folder": "run.dir",
    "checkpoint.dir": "run.dir",
    "run.output_dir": "run.dir",
    "run.log_freq": "run.log_every",
    "run.logging_steps": "run.log_every",
    "run.run_name": "run.name",
    "eval.eval_steps": "eval.every",
    "eval.interval": "eval.every",
    "eval.val_check_interval": "eval.every",
}

# Other trainers' section names (torchtitan's ``training``, ``parallelism``, ``optimizer``, ...): a key
# that is valid in the dtlab section is suggested there.
SECTION_SYNONYMS: dict[str, str] = {
    "training": "train",
    "trainer": "train",
    "optimizer": "train",
    "optim": "train",
    "lr_scheduler": "train",
    "parallelism": "parallel",
    "distributed": "parallel",
    "checkpointing": "checkpoint",
    "dataset": "data",
    "evaluation": "eval",
    "validation": "eval",
    "logging": "run",
    "job": "run",
    "metrics": "run",
}

# What a key means when its synonym is not the same quantity: said beside the suggestion.
KEY_NOTES: dict[str, str] = {
    "train.epochs": "dtlab counts optimizer steps, each of train.global_batch_size samples",
    "train.max_epochs": "dtlab counts optimizer steps, each of train.global_batch_size samples",
    "train.num_train_epochs": "dtlab counts optimizer steps, each of train.global_batch_size samples",
    "train.gradient_accumulation_steps": (
        "accumulation = train.global_batch_size / (micro_batch_size x data-parallel ranks)"
    ),
    "train.accumulate_grad_batches": (
        "accumulation = train.global_batch_size / (micro_batch_size x data-parallel ranks)"
    ),
    "checkpoint.folder": "checkpoints go to <run.dir>/checkpoints",
    "checkpoint.dir": "checkpoints go to <run.dir>/checkpoints",
}

# Other trainers' words for values of dtlab's fixed sets (compared in lower case).
VALUE_SYNONYMS: dict[str, str] = {
    "bfloat16": "bf16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "32": "fp32",
    "32-true": "fp32",
    "fsdp2": "fsdp",
    "hybrid_shard": "hsdp",
    "full_shard": "full",
    "adam": "adamw",
    "cosine_with_warmup": "cosine",
    "warmup_stable_decay": "wsd",
}


def suggest_key(dotted: str, valid: Sequence[str]) -> str | None:
    """The key meant by the unknown ``dotted`` (``section.key``), or None: a synonym from the table,
    a key of the same name in the section another trainer calls by another name, or a near spelling
    among ``valid`` (the section's keys, written as ``section.key``)."""
    if dotted in KEY_SYNONYMS:
        return KEY_SYNONYMS[dotted]
    # A misspelt synonym (train.lerning_rate) is as likely as a misspelt key.
    section = dotted.rpartition(".")[0]
    names = [*valid, *(k for k in KEY_SYNONYMS if k.rpartition(".")[0] == section)]
    close = difflib.get_close_matches(dotted, names, n=1, cutoff=0.7)
    return KEY_SYNONYMS.get(close[0], close[0]) if close else None


def suggest_section(section: str, value: Any, sections: Mapping[str, Sequence[str]]) -> list[str]:
    """For an unknown top-level ``section`` given as a mapping ``value``: the dtlab key meant by each
    of its keys, e.g. ``train.lr for optimizer.lr``. ``sections``: dtlab's sections and keys."""
    if not isinstance(value, dict):
        return []
    found = []
    for key in value:
        dotted = f"{section}.{key}"
        target = SECTION_SYNONYMS.get(section)
        if dotted in KEY_SYNONYMS:
            found.append(f"{KEY_SYNONYMS[dotted]} for {dotted}")
        elif target is not None and str(key) in sections.get(target, ()):
            found.append(f"{target}.{key} for {dotted}")
    return found


def key_note(dotted: str) -> str:
    """What to know about ``dotted``'s suggestion when it is not the same quantity ('' if it is)."""
    return KEY_NOTES.get(dotted, "")


def suggest_value(value: Any, allowed: Sequence[str]) -> str | None:
    """The allowed value meant by ``value`` (another case, another trainer's word, a near spelling)."""
    if not isinstance(value, str | int) or isinstance(value, bool) or not allowed:
        return None
    text = str(value).strip().lower()
    by_lower = {a.lower(): a for a in allowed}
    if text in by_lower:
        return by_lower[text]
    if VALUE_SYNONYMS.get(text) in allowed:
        return VALUE_SYNONYMS[text]
    close = difflib.get_close_matches(text, list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def literal_choices(annotation: Any) -> list[str]:
    """The words a field's type allows (its ``Literal`` values, also inside a union or a list)."""
    if get_origin(annotation) is Literal:
        return [str(a) for a in get_args(annotation) if isinstance(a, str)]
    return [w for arg in get_args(annotation) for w in literal_choices(arg)]
