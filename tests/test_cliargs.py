"""The command line built from the config: CONFIG and --set on every command that reads a config, choices
read from the schema, and a CONFIG typed after the --set list."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from conftest import FAST, cli_env, run_cli
from dtlab.cli import _prepare_launch, build_parser, main, parse_args
from dtlab.cliargs import config_choices
from dtlab.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
DEBUG_YAML = str(ROOT / "configs" / "debug.yaml")


def _commands(
    parser: argparse.ArgumentParser, prefix: str = ""
) -> dict[str, argparse.ArgumentParser]:
    """Every command and sub-command of ``parser`` by its words, e.g. ``"launch slurm"``."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"{prefix}{name}"] = sub
                found.update(_commands(sub, f"{prefix}{name} "))
    return found


def _literal_keys() -> dict[str, Any]:
    """Every config key whose type is a Literal, with its annotation, walked from the schema."""
    keys = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            key = f"{prefix}{field.alias or name}"
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{key}.")
            elif get_origin(annotation) is Literal:
                keys[key] = annotation

    walk(Config, "")
    return keys


def test_every_command_that_reads_a_config_takes_set() -> None:
    commands = _commands(build_parser())
    with_config, with_set = set(), set()
    for words, sub in commands.items():
        dests = {a.dest: a for a in sub._actions}
        if "config" in dests and not dests["config"].option_strings:
            with_config.add(words)
        if "overrides" in dests and dests["overrides"].option_strings == ["--set"]:
            with_set.add(words)
    assert with_config == with_set
    # Every command but export and generate (which read a checkpoint, not a config) and the `launch`
    # group.
    assert with_config == set(commands) - {"export", "generate", "launch"}


def test_config_choices_are_the_schema_literals() -> None:
    keys = _literal_keys()
    assert "parallel.strategy" in keys and "train.engine" in keys
    for key, annotation in keys.items():
        assert config_choices(key) == get_args(annotation), key


def test_train_engine_choices_come_from_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    engine = next(a for a in _commands(build_parser())["train"]._actions if a.dest == "engine")
    allowed = get_args(Config.model_fields["train"].annotation.model_fields["engine"].annotation)
    assert tuple(engine.choices) == allowed
    for value in allowed:
        assert parse_args(["train", "--engine", value]).engine == value
    with pytest.raises(SystemExit) as exc:
        parse_args(["train", "--engine", "jax"])
    assert exc.value.code == 2
    assert ", ".join(repr(v) for v in allowed) in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "key"),
    [
        ("--strategies", "parallel.strategy"),
        ("--precision", "train.precision"),
        ("--engine", "train.engine"),
        ("--compression", "parallel.compression"),
    ],
)
def test_bench_lists_are_checked_against_the_schema(
    capsys: pytest.CaptureFixture[str], flag: str, key: str
) -> None:
    code = main(["bench", flag, "bogus", "--set", "model.preset=debug"])
    err = capsys.readouterr().err
    assert code == 2 and f"error: {flag} 'bogus': allowed: " in err, err
    allowed = err.split("allowed: ", 1)[1].strip().split(", ")
    assert set(allowed) >= set(get_args(_literal_keys()[key]))
    if key != "parallel.compression":  # which adds bench-only names (dct-quant, demo)
        assert tuple(allowed) == get_args(_literal_keys()[key])


def test_building_the_parser_imports_neither_config_nor_torch() -> None:
    """`dtlab --help` stays quick: the schema's choices are read when a value is checked."""
    code = (
        "import sys; from dtlab.cli import build_parser; build_parser().format_help(); "
        "print([m for m in ('torch', 'pydantic', 'dtlab.config') if m in sys.modules])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_train_with_config_after_set(tmp_path: Path) -> None:
    """What users type: `dtlab train --set train.steps=2 configs/debug.yaml`."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", "--set", "train.steps=2", f"run.dir={run_dir}", DEBUG_YAML, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["run"]["name"] == "debug"  # from the file (the default name is another)
    assert config["train"]["steps"] == 2  # from --set, over the file's 20
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


def test_launched_workers_get_the_config_given_after_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = parse_args(["train", "--nproc", "2", "--set", "train.steps=3", DEBUG_YAML])
    assert args.config == DEBUG_YAML and args.overrides == ["train.steps=3"]
    run_dir, worker_args = _prepare_launch(args, load_config(args.config, args.overrides))
    assert worker_args == ["train", DEBUG_YAML, "--set", "train.steps=3", f"run.dir={run_dir}"]
    worker = parse_args(worker_args)
    config = load_config(worker.config, worker.overrides)
    assert (config.run.name, config.train.steps, config.run.dir) == ("debug", 3, str(run_dir))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--set", "train.steps=2", "nope.yaml"], "config file 'nope.yaml' (given after --set) does not exist"),
        (["plan", "--set", "train.steps=2", "configs/nope.yml"], "config file 'configs/nope.yml'"),
        (["train", "--set", "train.steps=2", "steps"], "--set 'steps': expected KEY=VALUE"),
        (["bench", DEBUG_YAML, "--set", "train.steps=2", DEBUG_YAML], "CONFIG is already"),
    ],
)  # fmt: skip
def test_a_bad_word_after_set_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    argv: list[str], needle: str,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("module", ["overhead", "checkpoint", "ledger"])
def test_bench_scripts_refuse_a_word_that_is_not_an_override(
    capsys: pytest.CaptureFixture[str], module: str
) -> None:
    """The benchmark scripts take no CONFIG: a word without '=' after --set is a usage error."""
    script = __import__(f"dtlab.bench.{module}", fromlist=["main"])
    with pytest.raises(SystemExit) as exc:
        script.main(["--set", *FAST, "configs/debug.yaml"])
    assert exc.value.code == 2
    assert "--set 'configs/debug.yaml': expected KEY=VALUE" in capsys.readouterr().err


def test_plan_device_keys_are_the_profiles() -> None:
    """`dtlab plan --device` lists its keys without importing torch: they are the profile table's."""
    from dtlab.analysis.devices import PROFILES
    from dtlab.cli import DEVICE_KEYS

    assert tuple(PROFILES) == DEVICE_KEYS
