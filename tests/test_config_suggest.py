""" "Did you mean" for config keys and values: misspellings, other trainers' names, and the fix works."""

from __future__ import annotations

import pytest

from dtlab.config import load_config
from dtlab.config.loading import describe_fields
from dtlab.config.suggest import KEY_SYNONYMS, SECTION_SYNONYMS, VALUE_SYNONYMS
from dtlab.errors import ConfigError

KEYS = {key for key, _, _ in describe_fields()}


def _message(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return str(info.value)


@pytest.mark.parametrize(
    ("given", "hint", "fix"),
    [
        ("parallel.strategy=fdsp", "(did you mean 'fsdp'?)", "parallel.strategy=fsdp"),
        ("parallel.strategy=FSDP", "(did you mean 'fsdp'?)", "parallel.strategy=fsdp"),
        ("parallel.sharding=FULL_SHARD", "(did you mean 'full'?)", "parallel.sharding=full"),
        ("train.precision=bf16-mixed", "(did you mean 'bf16'?)", "train.precision=bf16"),
        ("train.precision=bfloat16", "(did you mean 'bf16'?)", "train.precision=bf16"),
        ("train.schedule=cosin", "(did you mean 'cosine'?)", "train.schedule=cosine"),
        ("train.optimizer=Adam", "(did you mean 'adamw'?)", "train.optimizer=adamw"),
        ("checkpoint.async=aut", "(did you mean 'auto'?)", "checkpoint.async=auto"),
        (
            "run.trackers=[tensorbord]",
            "(did you mean 'tensorboard'?)",
            "run.trackers=[tensorboard]",
        ),
        ("model.preset=llama3-8b", "(did you mean 'llama3.1-8b'?)", "model.preset=llama3.1-8b"),
        ("model.preset=Llama-3.2-1B", "(did you mean 'llama3.2-1b'?)", "model.preset=llama3.2-1b"),
    ],
)
def test_values_outside_a_fixed_set_suggest_the_one_meant(given: str, hint: str, fix: str) -> None:
    message = _message(given)
    assert hint in message, message
    load_config(None, [fix])  # the value suggested is allowed


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("train.learning_rate=1e-3", "train.lr"),
        ("train.lerning_rate=1e-3", "train.lr"),  # a misspelt synonym
        ("train.batch_size=8", "train.global_batch_size"),
        ("train.max_steps=8", "train.steps"),
        ("train.epochs=8", "train.steps"),
        ("train.gradient_checkpointing=full", "train.activation_checkpointing"),
        ("train.max_grad_norm=1.0", "train.grad_clip"),
        ("train.seq_len=64", "data.seq_len"),
        ("model.name=debug", "model.preset"),
        ("model.hidden_size=64", "model.dim"),
        ("model.num_hidden_layers=2", "model.n_layers"),
        ("parallel.tensor_parallel_degree=1", "parallel.tp"),
        ("checkpoint.interval=5", "checkpoint.every"),
        ("train.stpes=8", "train.steps"),  # a plain misspelling, as before
    ],
)
def test_other_trainers_key_names_suggest_dtlabs(given: str, meant: str) -> None:
    key, _, value = given.partition("=")
    message = _message(given)
    assert f"unknown key '{key}' (did you mean {meant}?" in message, message
    load_config(None, [f"{meant}={value}"])  # following the suggestion loads


def test_epochs_say_what_dtlab_counts_instead() -> None:
    assert "dtlab counts optimizer steps" in _message("train.epochs=3")


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("optimizer={lr: 1.0e-3, name: adamw}", ["train.lr for optimizer.lr", "train.optimizer for optimizer.name"]),
        ("training={steps: 3, local_batch_size: 2}", ["train.steps for training.steps", "train.micro_batch_size for training.local_batch_size"]),
    ],
)  # fmt: skip
def test_other_trainers_sections_suggest_dtlabs_keys(given: str, meant: list[str]) -> None:
    message = _message(given)
    assert f"did you mean {', '.join(meant)}?" in message, message


def test_no_suggestion_for_a_value_like_nothing_allowed() -> None:
    message = _message("parallel.strategy=xyz")
    assert "did you mean" not in message
    assert "'single', 'ddp', 'fsdp' or 'hsdp'" in message


def test_the_tables_point_at_real_keys_and_values() -> None:
    """A table entry whose target was renamed (or whose name became a real key) would mislead."""
    assert not set(KEY_SYNONYMS) & KEYS
    assert set(KEY_SYNONYMS.values()) <= KEYS
    sections = {key.split(".")[0] for key in KEYS}
    assert set(SECTION_SYNONYMS.values()) <= sections
    assert not set(SECTION_SYNONYMS) & sections
    from dtlab.config.loading import _field_annotation
    from dtlab.config.suggest import literal_choices

    words = {w for key in KEYS for w in literal_choices(_field_annotation(tuple(key.split("."))))}
    assert set(VALUE_SYNONYMS.values()) <= words
