"""The training sequence length has one default (data.seq_len null: 2048, or the model's context where
that is shorter), ``dtlab config --keys`` shows it as it is, and the config knows which keys were given."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli
from dtlab.config import ConfigError, load_config
from dtlab.config.values import DEFAULT_SEQ_LEN
from dtlab.models.presets import PRESETS


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_trains_on_the_default_or_its_whole_shorter_context(preset: str) -> None:
    config = load_config(overrides=[f"model.preset={preset}"])
    context = PRESETS[preset]["max_seq_len"]
    assert config.seq_len == min(DEFAULT_SEQ_LEN, context)
    if context > DEFAULT_SEQ_LEN:  # the Llama presets: not their 4096 or 131,072 tokens
        assert config.seq_len == 2048 < context


def test_a_given_seq_len_is_kept_and_still_bounded_by_the_context() -> None:
    long = load_config(overrides=["model.preset=llama3.2-1b", "data.seq_len=8192"])
    assert long.seq_len == 8192 and long.is_given("data.seq_len")
    with pytest.raises(ConfigError, match=r"data\.seq_len = 2048 exceeds model\.max_seq_len = 128"):
        load_config(overrides=["model.preset=debug", "data.seq_len=2048"])


def test_the_config_knows_which_keys_were_given(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  precision: bf16\nparallel:\n  diloco: {inner_steps: 0}\nrun: {}\n")
    config = load_config(path, ["model.preset=debug", "train.lr=1e-4"])
    given = {"train.precision", "parallel.diloco.inner_steps", "model.preset", "train.lr"}
    assert config.given == given
    assert config.is_given("train.precision") and config.is_given("parallel.diloco.inner_steps")
    assert not config.is_given("parallel.diloco.outer_lr") and not config.is_given("run.dir")
    assert not config.is_given("data.seq_len") and not config.is_given("train.micro_batch_size")
    # Copies keep it; equality ignores it: a resolved config.yaml (every key given) equals its source.
    assert config.model_copy(deep=True).given == config.given
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(config.to_yaml())
    again = load_config(resolved)
    assert again == config and again.is_given("data.seq_len")


def test_config_keys_shows_the_default_the_config_applies() -> None:
    proc = run_cli("config", "--keys")
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("data.seq_len ")]
    assert line.split()[1] == "null", line  # not the default preset's 256
    assert f"null = {DEFAULT_SEQ_LEN}, or model.max_seq_len where that is shorter" in line
    shown = run_cli("config", "--set", "model.preset=llama3.2-1b")
    assert shown.returncode == 0, shown.stderr
    assert "seq_len: 2048" in shown.stdout and "max_seq_len: 131072" in shown.stdout
