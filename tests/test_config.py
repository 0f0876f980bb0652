"""Config: YAML parsing, overrides, precedence and every validation rule."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from dtlab.config import (
    RUN_NAME_MAX_BYTES,
    Config,
    check_world,
    describe_fields,
    load_config,
    parse_yaml,
)
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
        (
            ["train.stpes=3"],
            "unknown key 'train.stpes' (did you mean train.steps?); valid keys in train: steps",
        ),
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


def test_paths_the_os_refuses_are_config_errors(tmp_path: Path) -> None:
    """Found by fuzzing: a 300-character CONFIG path raised OSError (File name too long)."""
    with pytest.raises(ConfigError, match=r"config file 'x{50}.* cannot be read: .*too long"):
        load_config("x" * 300)
    with pytest.raises(ConfigError, match=r"is a directory without a config\.yaml"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("a\0b.yaml")


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
        match=re.escape(
            "8 samples cannot be split into micro-batches of train.micro_batch_size = 2 on 3 ranks"
        ),
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


# --- strict kinds: a bool is not a number, a number is not a bool --------------------------------


def _leaf_fields() -> list[tuple[str, Any]]:
    """(dotted key, annotation) of every config key, nested option groups included."""
    leaves: list[tuple[str, Any]] = []

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, f in cls.model_fields.items():
            key = f"{prefix}{f.alias or name}"
            ann = f.annotation
            inner = _base(ann)  # an optional section (model.rope_scaling) is walked too
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                walk(inner, key + ".")
            else:
                leaves.append((key, ann))

    walk(Config, "")
    return leaves


def _base(ann: Any) -> Any:
    """``int | None`` -> int."""
    args = [a for a in get_args(ann) if a is not type(None)]
    return args[0] if get_origin(ann) in (Union, UnionType) and len(args) == 1 else ann


LEAVES = _leaf_fields()
INT_KEYS = [k for k, a in LEAVES if _base(a) is int]
FLOAT_KEYS = [k for k, a in LEAVES if _base(a) is float]
BOOL_KEYS = [k for k, a in LEAVES if _base(a) is bool]
STR_KEYS = [k for k, a in LEAVES if _base(a) is str]


def test_every_field_has_a_kind_checked_here() -> None:
    """A key of a kind the tests below do not cover (say a dict) must get its own tests first."""
    covered = {*INT_KEYS, *FLOAT_KEYS, *BOOL_KEYS, *STR_KEYS}
    others = {k: a for k, a in LEAVES if k not in covered}
    literals = {k for k, a in others.items() if get_origin(_base(a)) is Literal}
    assert set(others) - literals == {
        "train.betas", "data.paths", "data.val_paths", "run.trackers", "checkpoint.async"
    }  # fmt: skip
    assert {"model.rope_theta", "train.warmup_steps", "checkpoint.durable_every"} <= covered


@pytest.mark.parametrize("key", INT_KEYS + FLOAT_KEYS)
@pytest.mark.parametrize("value", ["true", "false"])
def test_fault10_a_boolean_is_not_a_number(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[f"{key}={value}"])
    msg = str(exc.value)
    assert f"{key} = {value}: a boolean is not " in msg and "allowed: " in msg, msg


@pytest.mark.parametrize("key", BOOL_KEYS)
@pytest.mark.parametrize("value", ["1", "0", "1.0", "yes", "on", "'true'"])
def test_fault10_a_number_or_a_string_is_not_a_boolean(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[f"{key}={value}"])
    assert f"{key} = " in str(exc.value) and "allowed: true or false" in str(exc.value)


@pytest.mark.parametrize("value", ["1", "0", "yes", "'true'", "Auto", "[auto]"])
def test_checkpoint_async_takes_a_boolean_or_auto_and_nothing_else(value: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[f"checkpoint.async={value}"])
    msg = str(exc.value)
    assert "checkpoint.async = " in msg and "allowed: true, false or 'auto'" in msg, msg
    for given, kept in (("true", True), ("false", False), ("auto", "auto")):
        assert load_config(overrides=[f"checkpoint.async={given}"]).checkpoint.async_ == kept


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", ["2.5", "1e-300", "'5'", ".inf", ".nan", "[1]"])
def test_fault10_integer_keys_take_whole_numbers_only(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[f"{key}={value}"])
    assert f"{key} = " in str(exc.value) and "allowed: an integer" in str(exc.value)


@pytest.mark.parametrize("key", INT_KEYS + FLOAT_KEYS)
@pytest.mark.parametrize("value", ["1e-400", "-1e-400", "1e400", "99999999999999999999"])
def test_numbers_a_64_bit_value_cannot_hold_are_errors(key: str, value: str) -> None:
    """1e-400 would be read as 0 and 1e400 as inf without a word; 2**64 overflows torch's integers."""
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[f"{key}={value}"])
    assert f"--set {key}: '{value}' is " in str(exc.value) and "allowed: " in str(exc.value)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "'1e-3'"])
def test_float_keys_take_finite_numbers_only(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[f"{key}={value}"])
    assert f"{key} = " in str(exc.value) and "allowed: a finite number" in str(exc.value)


def test_whole_floats_are_integers_and_integers_are_floats() -> None:
    """Decided: 3.0 and 1e6 are accepted where an integer is expected (they are whole numbers);
    the field then holds an int. An integer is accepted where a float is expected."""
    cfg = load_config(overrides=["train.steps=3.0", "train.global_batch_size=1.6e1", "train.lr=1"])
    assert cfg.train.steps == 3 and type(cfg.train.steps) is int
    assert cfg.train.global_batch_size == 16 and type(cfg.train.global_batch_size) is int
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert load_config(overrides=["train.steps=1e6"]).train.steps == 1_000_000
    with pytest.raises(ConfigError, match=r"train.seed = 1e\+20: a float beyond 2\*\*53"):
        load_config(overrides=["train.seed=1e20"])  # 1e20 as a float is not exactly 10**20


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("model.rope_theta=true", "model.rope_theta = true: a boolean is not a number"),
        ("train.warmup_steps=1e-400", "it would be read as 0"),
        ("checkpoint.durable_every=true", "checkpoint.durable_every = true: a boolean"),
        ("train.betas=[true, 0.5]", "train.betas = [true, 0.5]: item 0: a boolean is not a number"),
        ("train.betas=[0.9]", "train.betas = [0.9]: 1 items; allowed: a list of 2 numbers"),
        ("data.paths=[1, a]", "data.paths = [1, 'a']: item 0: a number is not a string"),
        ("data.paths=['']", "item 0 is an empty string"),
        ("data.text_key=''", "data.text_key = ''"),
        ("run.name=2024", 'run.name = 2024: a number is not a string; allowed: a non-empty string (in quotes it stays text: "2024")'),
        ("run.dir=''", "run.dir = ''"),
        ("checkpoint.durable_dir=''", "checkpoint.durable_dir = ''"),
        ("parallel.collective_timeout_s=1e12", "parallel.collective_timeout_s = 1000000000000.0"),
        ("model.preset=[a]", "model.preset = ['a'] is not a preset; allowed: debug"),
        ("model.preset=[]", "model.preset = [] is not a preset"),  # fuzzing: TypeError unhashable
        ("model.preset={}", "model.preset = {} is not a preset"),
        ("train=[1]", "train = [1]: not a section"),
    ],
)  # fmt: skip
def test_kind_errors_name_key_value_and_what_is_allowed(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[override])
    assert needle in str(exc.value), str(exc.value)


# --- YAML 1.2 scalars -----------------------------------------------------------------------------


def test_yaml_scalars_follow_yaml_1_2() -> None:
    data = parse_yaml(
        "a: no\nb: yes\nc: 'on'\nd: 010\ne: 1:30\nf: 2024-01-01\ng: 0x10\nh: 0o17\ni: 10_000\n"
        "j: True\nk: ~\nl: =\nm: 1.\n"
    )
    assert data == {
        "a": "no", "b": "yes", "c": "on", "d": 10, "e": "1:30", "f": "2024-01-01", "g": 16,
        "h": 15, "i": 10_000, "j": True, "k": None, "l": "=", "m": 1.0,
    }  # fmt: skip
    assert load_config(overrides=["run.name=no"]).run.name == "no"


def test_duplicate_keys_are_errors(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys: a second `train:` section dropped the first one."""
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 5\nmodel:\n  preset: debug\ntrain:\n  lr: 0.01\n")
    with pytest.raises(
        ConfigError,
        match=r"dup.yaml: not valid YAML \(line 5, column 1\): found the key 'train' twice \(first on line 1\)",
    ):
        load_config(path)
    # Keys a merge brings in may be overridden.
    merged = parse_yaml("base: &b {steps: 1, lr: 0.1}\ntrain:\n  <<: *b\n  steps: 2\n")
    assert merged["train"] == {"steps": 2, "lr": 0.1}


@pytest.mark.parametrize(
    "text",
    # Found by fuzzing: PyYAML's own constructors raised IndexError, ValueError, KeyError and
    # AttributeError for these (empty or malformed tagged scalars), and RecursionError for deep nesting.
    [
        "!!int",
        "!!float",
        "!!bool",
        "!!timestamp",
        "!!int ;",
        "!!float A",
        "!!int :0",
        "!!timestamp x",
        "!!bool maybe",
        "!!float abc",
        "!!int 1.5",
        "!!omap 5",
        "[" * 5000,
    ],
)
def test_unreadable_yaml_values_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match=r"--set train.lr: not valid YAML"):
        load_config(overrides=[f"train.lr={text}"])


@pytest.mark.parametrize(
    "name", ["no", "1e3", "010", "2024-01-01", "1:30", "true", "null", "0x1F", "=", "ünï côdé"]
)
def test_strings_that_look_like_other_values_round_trip(tmp_path: Path, name: str) -> None:
    cfg = load_config(overrides=[f"run.name={json.dumps(name)}"])
    assert cfg.run.name == name
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path) == cfg
    assert yaml.safe_load(cfg.to_yaml())["run"]["name"] == name  # plain YAML 1.1 readers too


# --- run.name -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("../escape", "contains '/'"),
        ("/abs", "contains '/'"),
        ("a/b", "contains '/'"),
        ("a\\\\b", "contains '\\\\'"),
        (".", "not a directory name of its own"),
        ("..", "not a directory name of its own"),
        ("a\\0b", "a NUL character is not allowed"),
        ("a\\nb", "contains '\\n'"),
        ("x" * (RUN_NAME_MAX_BYTES + 1), f"{RUN_NAME_MAX_BYTES + 1} bytes long"),
        ("x" * 260, "260 bytes long"),
        ("é" * 101, "202 bytes long"),
    ],
)
def test_fault10_run_name_is_one_short_path_component(name: str, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[f'run.name="{name}"'])
    msg = str(exc.value)
    # The value came from --set, so the message names that override rather than a config file.
    assert msg.startswith("--set 'run.name=") and ": run.name = " in msg and needle in msg, msg
    assert "NUL" in msg or f"at most {RUN_NAME_MAX_BYTES} bytes" in msg


def test_longest_run_name_makes_a_legal_run_directory(tmp_path: Path) -> None:
    """The limit is what makes runs/<name>-<timestamp>[-<n>] fit the file system's NAME_MAX."""
    name = "é" * (RUN_NAME_MAX_BYTES // 2)
    cfg = load_config(overrides=[f"run.name={name}"])
    stamped = tmp_path / "runs" / f"{cfg.run.name}-20250101-120000-999"
    stamped.mkdir(parents=True)  # raised OSError (File name too long) for a 260-byte name
    assert stamped.is_dir()
    with pytest.raises(OSError):  # the file system's limit is real: one byte of margin less fails
        (tmp_path / ("x" * 256)).mkdir()


def test_run_dir_components_fit_the_file_system() -> None:
    with pytest.raises(
        ConfigError, match=r"run.dir = .*the path component 'xxx.* is 256 bytes long"
    ):
        load_config(overrides=[f"run.dir=/tmp/{'x' * 256}/run"])
    assert (
        load_config(overrides=["run.dir=/tmp/a/../b"]).run.dir == "/tmp/a/../b"
    )  # an explicit path
