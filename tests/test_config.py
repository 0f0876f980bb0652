"""Config: YAML parsing, overrides, precedence and every validation rule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtlab.config import Config, check_world, describe_fields, load_config, parse_yaml
from dtlab.errors import ConfigError


def test_yaml_reads_exponent_floats_as_floats() -> None:
    assert parse_yaml("a: 1e-4\nb: 3E5\nc: -2.5e-3\nd: 12\ne: .5")["a"] == pytest.approx(1e-4)
    data = parse_yaml("a: 1e-4\nb: 3E5\nc: -2.5e-3\nd: 12\ne: .5\nf: 1.2.3")
    assert [type(data[k]) for k in "abcdef"] == [float, float, float, int, float, str]


def test_overrides_are_parsed_as_yaml() -> None:
    cfg = load_config(
        overrides=[
            "train.lr=1e-4",
            "model.tie_embeddings=true",
            "train.betas=[0.8, 0.9]",
            "train.steps=7",
        ]
    )
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.model.tie_embeddings is True
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.train.steps == 7


def test_precedence_set_over_file_over_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.5\n  steps: 3\n")
    cfg = load_config(path, ["train.lr=0.25"])
    assert cfg.train.lr == 0.25  # --set wins
    assert cfg.train.steps == 3  # the file wins over the default
    assert cfg.train.global_batch_size == Config().train.global_batch_size  # default


def test_preset_fills_shape_and_explicit_keys_win() -> None:
    cfg = load_config(overrides=["model.preset=llama3.1-8b", "model.n_layers=2"])
    assert (cfg.model.dim, cfg.model.n_kv_heads, cfg.model.vocab_size) == (4096, 8, 128256)
    assert cfg.model.n_layers == 2


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(overrides=["model.preset=debug", "train.lr=2e-4", "parallel.strategy=fsdp"])
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path) == cfg  # a run directory works as the path too


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.stpes=3"], "unknown key 'train.stpes'; valid keys in train: steps"),
        (["trian.steps=3"], "unknown key 'trian'"),
        (["train.lr=abc"], "train.lr = 'abc'"),
        (["train.steps=-1"], "train.steps = -1"),
        (["train.steps=0"], "train.steps = 0"),
        (["parallel.strategy=zero3"], "parallel.strategy = 'zero3'"),
        (["parallel.sharding=half"], "parallel.sharding = 'half'"),
        (["train.precision=fp8"], "train.precision = 'fp8'"),
        (["train.schedule=step"], "train.schedule = 'step'"),
        (["model.preset=gpt5"], "model.preset = 'gpt5' is not a preset; allowed: debug"),
        (["model.dim=100"], "model.dim = 100 must be divisible by model.n_heads = 8"),
        (["model.n_kv_heads=3"], "model.n_heads = 8 must be divisible by model.n_kv_heads = 3"),
        (["model.dim=264", "model.n_heads=24", "model.n_kv_heads=8"], "must be even for RoPE"),
        (["data.seq_len=4096"], "data.seq_len = 4096 exceeds model.max_seq_len = 256"),
        (["model.vocab_size=100"], "model.vocab_size = 100 is smaller than"),
        (
            ["train.global_batch_size=10", "train.micro_batch_size=4"],
            "train.global_batch_size = 10 is not divisible by train.micro_batch_size = 4",
        ),
        (["train.min_lr=1", "train.lr=0.1"], "train.min_lr = 1"),
        (["data.source=files"], "needs data.paths"),
        (["parallel.compression=dct"], "parallel.compression = 'dct'"),
        (["checkpoint.durable_every=5", "checkpoint.every=3"], "checkpoint.durable_every = 5"),
        (["parallel.strategy=fsdp", "parallel.compression=dct"], "allows: none, fp16, bf16"),
        (["parallel.compression=fp16"], "parallel.strategy = 'single' has none"),
        (
            [
                "parallel.strategy=ddp",
                "parallel.compression=dct",
                "parallel.compression_options.topk=80",
            ],
            "topk = 80 is larger than chunk_size = 64",
        ),
        (
            ["train.optimizer=demo", "parallel.strategy=fsdp"],
            "parallel.strategy = 'fsdp' is not allowed (allowed: single, ddp)",
        ),
        (
            ["train.optimizer=demo", "parallel.strategy=ddp", "parallel.compression=dct"],
            "parallel.compression = 'dct' is not allowed with it",
        ),
        (["train.optimizer=demo", "train.demo.topk=65"], "train.demo.topk = 65 is larger"),
        (["train.optimizer=adam"], "train.optimizer"),
        (
            ["parallel.compression_options.rnak=2"],
            "unknown key 'parallel.compression_options.rnak'",
        ),
        (["train"], "expected KEY=VALUE"),
        (["train.lr.x=1"], "train.lr = {'x': 1}"),
        (["train=5", "train.lr=1"], "train is not a section"),
    ],
)
def test_bad_values_name_the_key_and_value(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=overrides)
    assert needle in str(exc.value)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML \(line"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(scalar)


def test_world_checks() -> None:
    cfg = load_config(overrides=["train.global_batch_size=8"])
    with pytest.raises(ConfigError, match="'single' runs one process"):
        check_world(cfg, 2)
    ddp = load_config(
        overrides=["parallel.strategy=ddp", "train.global_batch_size=8", "train.micro_batch_size=2"]
    )
    assert check_world(ddp, 2) == 2  # 8 = 2 ranks x 2 accumulation steps x 2
    with pytest.raises(
        ConfigError,
        match=re.escape("not divisible by train.micro_batch_size = 2 x data-parallel degree 3"),
    ):
        check_world(ddp, 3)
    hsdp = load_config(overrides=["parallel.strategy=hsdp", "train.global_batch_size=12"])
    with pytest.raises(ConfigError, match=re.escape("needs parallel.replicate")):
        check_world(hsdp, 4)
    hsdp.parallel.replicate = 3
    with pytest.raises(
        ConfigError, match=re.escape("parallel.replicate = 3 does not divide the world size 4")
    ):
        check_world(hsdp, 4)


def test_every_key_is_described() -> None:
    rows = describe_fields()
    keys = {k for k, _, _ in rows}
    for key in [
        "model.preset",
        "data.source",
        "train.steps",
        "parallel.strategy",
        "checkpoint.async",
        "run.log_every",
    ]:
        assert key in keys
    assert all(desc for _, _, desc in rows)
