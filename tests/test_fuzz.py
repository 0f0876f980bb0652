"""Fuzzing the config loader and the CLI with hypothesis.

Every input either loads or fails with a DtlabError (ConfigError, ...) whose message names the key or
the file; nothing raises anything else, and the CLI never prints a traceback. A config that loads
survives the trip through its own ``config.yaml``.

The normal run tries 2,500 inputs in well under a minute, the same ones on every machine (hypothesis
derandomized, as its CI profile does anyway); ``DTLAB_FUZZ_EXAMPLES=N`` sets the number of examples of
every test here and draws them at random (e.g. 5000 for a long run). ``-s`` prints how many inputs
each tried. An input that runs past EXAMPLE_SECONDS fails at once, naming itself, instead of hanging
the suite while hypothesis replays it to shrink it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import signal
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from dtlab.cli import DEVICE_KEYS, main
from dtlab.config import Config, config_from_dict, dump_yaml, load_config, parse_yaml
from dtlab.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("DTLAB_FUZZ_EXAMPLES", "0"))
TRIED: Counter[str] = Counter()
EXAMPLE_SECONDS = 60  # each input takes milliseconds; a minute is a hang (a loop over 2**31 steps)


def fuzz(default: int) -> Any:
    """hypothesis settings: ``default`` examples unless DTLAB_FUZZ_EXAMPLES says otherwise."""
    return settings(
        max_examples=EXAMPLES or default,
        derandomize=not EXAMPLES,  # the suite sees the same inputs here as in CI
        deadline=None,  # a shared 2-core machine: timing says nothing
        database=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,  # one scratch directory serves every example
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


class ExampleHung(BaseException):
    """Not an Exception: hypothesis lets it through rather than replaying the input to shrink it."""


def bounded(test: Callable[..., None]) -> Callable[..., None]:
    """Fail an example that runs past EXAMPLE_SECONDS, with the input in the message."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        def hung(_sig: int, _frame: object) -> None:
            raise ExampleHung(f"over {EXAMPLE_SECONDS} s on {kwargs!r}")

        # pytest-timeout's alarm (the whole test's) is held back while the example runs, then resumed.
        outer, _ = signal.getitimer(signal.ITIMER_REAL)
        start = time.monotonic()
        previous = signal.signal(signal.SIGALRM, hung)
        signal.setitimer(signal.ITIMER_REAL, min(outer or EXAMPLE_SECONDS, EXAMPLE_SECONDS))
        try:
            test(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer:
                left = max(outer - (time.monotonic() - start), 0.001)
                signal.setitimer(signal.ITIMER_REAL, left)

    return run


def teardown_module() -> None:
    tried = {k: v for k, v in TRIED.items() if not k.startswith("(")}
    print("\nfuzz inputs tried:", tried, "total", sum(tried.values()))
    print("outcomes:", {k: v for k, v in TRIED.items() if k.startswith("(")})


# --- what the config looks like -------------------------------------------------------------------


def _leaves() -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, f in cls.model_fields.items():
            key = f"{prefix}{f.alias or name}"
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                walk(f.annotation, key + ".")
            else:
                out[key] = f.annotation

    walk(Config, "")
    return out


LEAVES = _leaves()
KEYS = sorted(LEAVES)
SECTIONS = sorted({k.split(".")[0] for k in KEYS} | {k.rsplit(".", 1)[0] for k in KEYS})
KEY_PARTS = sorted({p for k in KEYS for p in k.split(".")})
ODD_STRINGS = [
    "", " ", "true", "True", "yes", "no", "on", "off", "y", "null", "~", "1e-400", "1e400", ".inf",
    "-.inf", ".nan", "010", "0x1F", "0o17", "0b11", "1:30", "2024-01-01", "1_000", "=", "<<", "---",
    "...", "auto", "never", "ddp", "fsdp", "hsdp", "single", "powersgd", "dct", "bf16", "fp16",
    "cosine", "wsd", "debug", "tiny", "llama3.1-8b", "../escape", "a/b", "/abs", ".", "..", "a\\b",
    "x" * 300, "é" * 150, "\x00", "a\nb", "\ud800", "runs", "/tmp", "&a", "*a", "!!int", "{", "[",
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-5, max_value=300),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.floats(min_value=-10, max_value=10),
    st.text(max_size=20),
    st.sampled_from(ODD_STRINGS),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEY_PARTS) | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _typed(annotation: Any, valid: bool = False) -> st.SearchStrategy[Any]:
    """Values of a field's own type, so that the fuzzer gets past the type checks into the cross-field
    rules and the round trip; ``valid``: also inside the usual bounds, so that most configs load."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if type(None) in get_args(annotation):
        return st.none() | _typed(args[0], valid)
    if annotation is int:
        if valid:
            return st.integers(min_value=2, max_value=64)
        return st.integers(min_value=-2, max_value=600) | st.sampled_from([2**53, 2**63 - 1, 2**63])
    if annotation is float:
        if valid:
            return st.floats(min_value=1e-6, max_value=0.5)
        return st.floats(min_value=-1, max_value=2) | st.floats(allow_nan=False)
    if annotation is bool:
        return st.booleans()
    if annotation is str:
        if valid:
            return st.text("abcXYZ019 -_.é'\":#", min_size=1, max_size=12)
        return st.text(max_size=12) | st.sampled_from(ODD_STRINGS)
    if get_origin(annotation) is list:
        return st.lists(st.text(min_size=int(valid), max_size=8), max_size=3)
    if get_origin(annotation) is tuple:
        if valid:
            return st.lists(st.floats(min_value=0, max_value=0.99), min_size=2, max_size=2)
        return st.lists(st.floats(min_value=-0.5, max_value=1.5), min_size=1, max_size=3)
    if get_origin(annotation) in (Union, types.UnionType):  # e.g. bool | Literal["auto"]
        return st.one_of(*(_typed(a, valid) for a in args))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        # A section that may be null (model.rope_scaling): some of its fields, each of its type.
        fields = {name: _typed(f.annotation, valid) for name, f in annotation.model_fields.items()}
        return st.fixed_dictionaries({}, optional=fields)
    return st.sampled_from(get_args(annotation))  # a Literal: its choices


# Keys whose valid values rarely contradict another key: a config made of them mostly loads.
CALM_KEYS = [
    k
    for k in KEYS
    if k.split(".")[0] in ("train", "run", "checkpoint", "data")
    and k not in ("train.optimizer", "train.engine", "train.min_lr", "train.lr", "data.source")
    and not k.startswith(("train.demo.", "data.seq_len", "checkpoint.durable_every"))
]


keys = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(SECTIONS),
    st.builds(lambda k, s: k + s, st.sampled_from(KEYS), st.sampled_from(["x", ".x", "_", "."])),
    st.lists(st.sampled_from(KEY_PARTS) | st.text(max_size=6), min_size=1, max_size=4).map(
        ".".join
    ),
)


@st.composite
def config_dicts(draw: st.DrawFn) -> Any:
    """Nested config data: known keys with values of their type or of any type, and junk; or, half
    of the time, keys and values that mostly make a valid config."""
    if draw(st.integers(0, 19)) == 0:
        return draw(values)  # the top level need not be a mapping
    calm = draw(st.booleans())
    data: dict[str, Any] = {}
    for _ in range(draw(st.integers(0, 10))):
        key = draw(st.sampled_from(CALM_KEYS) if calm else keys)
        typed = key in LEAVES and (calm or draw(st.booleans()))
        value = draw(_typed(LEAVES[key], valid=calm) if typed else values)
        node: Any = data
        *path, last = key.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value
    return data


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...")


set_strings = st.one_of(
    st.text(max_size=40),
    st.builds(lambda k, v: f"{k}={v}", keys, st.text(max_size=20)),
    st.builds(lambda k, v: f"{k}={_flow(v)}", keys, values),
    st.builds(
        lambda k, v: f"{k}={_flow(v)}",
        st.sampled_from(KEYS),
        st.sampled_from(KEYS).flatmap(lambda k: _typed(LEAVES[k])),
    ),
    st.sampled_from(KEYS).flatmap(lambda k: _typed(LEAVES[k]).map(lambda v: f"{k}={_flow(v)}")),
)
calm_set_strings = st.sampled_from(CALM_KEYS).flatmap(
    lambda k: _typed(LEAVES[k], valid=True).map(lambda v: f"{k}={_flow(v)}")
)
YAML_TOKENS = [
    ":", ": ", " ", "  ", "\n", "\n  ", "- ", "[", "]", "{", "}", ", ", "&a ", "*a", "!!str ",
    "!!int ", "!!float ", "!!bool ", "!!null ", "!!timestamp ", "!!binary ", "!!set ", "!!omap ",
    "!!python/object:os.system ", "!local ", "<<: ", "---\n", "...\n", "%YAML 1.2\n", "%TAG ! x\n",
    "# c\n", "'", '"', "\\", "|\n", ">\n", "? ", "\t", "\x00", "\ufeff", "model", "train", "steps",
    "lr", "preset", "run", "name", "dir", "1e-4", "1e-400", "1e400", "true", "yes", "null", "~",
    "0x", "10", "-1", ".inf", ".nan", "2024-01-01", "9" * 30,
]  # fmt: skip
yaml_texts = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(YAML_TOKENS) | st.text(max_size=4), max_size=40).map("".join),
)


# --- properties -------------------------------------------------------------------------------------

KEY_NAME = re.compile(r"\b(" + "|".join(re.escape(s) for s in SECTIONS) + r")\b")


def _names_key_or_file(message: str, source: str | None = None) -> bool:
    return (
        bool(KEY_NAME.search(message))
        or "--set" in message
        or (source is not None and source in message)
    )


def _round_trips(cfg: Config, tmp: Path) -> None:
    """A config that loads is written and read back to the same config, by dtlab and by plain YAML."""
    path = tmp / "resolved.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg
    assert config_from_dict(yaml.safe_load(cfg.to_yaml())) == cfg


def _load(path: Path | None, overrides: list[str]) -> Config | None:
    try:
        cfg = load_config(path, overrides)
        TRIED["(of which loaded and round-tripped)"] += 1
        return cfg
    except ConfigError as e:
        message = str(e)
        assert message and _names_key_or_file(message, str(path) if path else None), message
        return None


@fuzz(600)
@given(text=yaml_texts)
@bounded
def test_fuzz_yaml_text(tmp_path: Path, text: str) -> None:
    TRIED["yaml text"] += 1
    try:
        parse_yaml(text, "fuzz.yaml")
    except ConfigError as e:
        assert str(e).startswith("fuzz.yaml"), str(e)
    path = tmp_path / "fuzz.yaml"
    try:
        path.write_text(text, encoding="utf-8")
    except UnicodeEncodeError:  # a lone surrogate: not text a file can hold
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
    cfg = _load(path, [])
    if cfg is not None:
        _round_trips(cfg, tmp_path)


@fuzz(500)
@given(data=config_dicts(), how=st.sampled_from(["safe_dump", "dump_yaml", "json", "flow"]))
@bounded
def test_fuzz_config_files(tmp_path: Path, data: Any, how: str) -> None:
    TRIED["config file"] += 1
    if how == "json":
        text = json.dumps(data, allow_nan=True)
    elif how == "dump_yaml":
        text = dump_yaml(data)
    else:
        text = yaml.safe_dump(data, default_flow_style=how == "flow", allow_unicode=True)
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    cfg = _load(path, [])
    if cfg is not None:
        _round_trips(cfg, tmp_path)


@fuzz(500)
@given(overrides=st.lists(set_strings, max_size=6) | st.lists(calm_set_strings, max_size=6))
@bounded
def test_fuzz_set_overrides(tmp_path: Path, overrides: list[str]) -> None:
    TRIED["--set list"] += 1
    cfg = _load(None, overrides)
    if cfg is not None:
        _round_trips(cfg, tmp_path)


@fuzz(400)
@given(data=config_dicts())
@bounded
def test_fuzz_python_api(data: Any) -> None:
    TRIED["config_from_dict"] += 1
    try:
        config_from_dict(data)
    except ConfigError as e:
        assert _names_key_or_file(str(e), "config"), str(e)


# --- the CLI, in this process --------------------------------------------------------------------

EXISTING_CONFIGS = [str(p) for p in sorted((ROOT / "configs").glob("*.yaml"))]
# Valid values are drawn as often as bad ones (hypothesis picks a branch of one_of evenly), so that
# inputs get past argparse and the config checks into the code behind them.
paths = st.one_of(
    st.sampled_from(EXISTING_CONFIGS),
    st.sampled_from(["junk.yaml", "missing.yaml", ".", "..", "dir", "/", "/proc/nope/x.yaml"]),
    st.sampled_from(["x" * 300, "d/" * 2100, "\x00.yaml", "é" * 200, "dir/config.yaml"]),
    st.text(max_size=12),
)
ints = st.one_of(
    st.sampled_from(["1", "2", "4", "8"]),
    st.integers(min_value=-3, max_value=20).map(str),
    st.sampled_from(["0", "-1", "1e3", "2.5", "nan", "", "x", str(2**31), str(2**64), "9" * 40]),
)
floats = st.one_of(
    st.sampled_from(["1", "80", "0.5", "1e-3"]),
    st.floats().map(repr),
    st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e-400", "1e400", "x"]),
)
words = st.text(max_size=10)
outs = st.one_of(
    st.sampled_from(["out", "out/x.sbatch", "job.yaml", "a/b/c.yaml", "job"]),
    st.sampled_from(["/proc/nope/job", "x" * 300, "d/" * 2100 + "x", "\x00x", "é" * 200]),
    st.sampled_from(["dir", "dir/", "junk.yaml/x", "/proc/self/status", "/", ".", ""]),
)
valid_sets = st.sampled_from(
    ["parallel.strategy=ddp", "train.global_batch_size=64", "model.preset=debug",
     "parallel.strategy=fsdp", "parallel.strategy=hsdp", "parallel.replicate=2", "run.name=x y",
     "model.preset=llama3.1-8b", "data.seq_len=128", "train.micro_batch_size=2"]
)  # fmt: skip
set_lists = st.one_of(
    st.lists(valid_sets, min_size=1, max_size=4), st.lists(set_strings, max_size=4)
)

FLAGS: dict[str, list[tuple[str, st.SearchStrategy[str] | None]]] = {
    "train": [
        ("--nproc", ints), ("--nnodes", ints), ("--node-rank", ints), ("--master-addr", words),
        ("--master-port", ints), ("--max-restarts", ints), ("--engine", words | st.just("mlx")),
        ("--profile", None),
    ],
    "config": [("--keys", None)],
    "plan": [
        ("--nproc", ints), ("--nnodes", ints), ("--json", None), ("--device-memory", floats),
        ("--device", st.sampled_from(DEVICE_KEYS) | words.filter(lambda w: w != "this")),
    ],
    "export": [("--format", st.sampled_from(["hf", "safetensors"]) | words), ("--out", outs),
               ("--force", None)],
    "launch slurm": [
        ("--nodes", ints), ("--nproc-per-node", ints), ("--gpus-per-node", ints),
        ("--partition", words | st.just("gpu")),
        ("--time", words | st.sampled_from(["1:00:00", "1-00", "1h"])),
        ("--account", words | st.just("acct")), ("--cpus-per-task", ints), ("--signal-seconds", ints),
        ("--python", words), ("--master-port", ints), ("--out", outs),
    ],
    "launch k8s": [
        ("--nodes", ints), ("--nproc-per-node", ints), ("--gpus-per-node", ints),
        ("--image", words | st.just("dtlab:cpu")), ("--name", words | st.just("job")),
        ("--namespace", words | st.just("ml")), ("--pvc", words | st.just("runs")),
        ("--storage", words | st.just("1Gi")), ("--cpu", words | st.just("2")),
        ("--memory", words | st.just("8Gi")), ("--max-restarts", ints), ("--out", outs),
    ],
}  # fmt: skip
# Appended last to every `train`: an invalid value, so that validation fails before anything starts.
NO_TRAINING = ["--set", "train.steps=0"]


@st.composite
def argvs(draw: st.DrawFn) -> list[str]:
    command = draw(st.sampled_from([*FLAGS, "random"]))
    if (
        command == "random"
    ):  # any words; the guard keeps a `train` or `bench` among them from running
        tokens = words | st.sampled_from(["train", "bench", "config", "plan", "--set", "-h", "--"])
        return ["random", *draw(st.lists(tokens, max_size=8)), *NO_TRAINING]
    pieces: list[list[str]] = []
    if command == "export":
        pieces.append([draw(paths)])
    elif draw(st.booleans()):
        pieces.append([draw(paths)])  # CONFIG
    if command != "export" and draw(st.booleans()):
        pieces.append(["--set", *draw(set_lists)])
    for flag, value in draw(st.lists(st.sampled_from(FLAGS[command]), max_size=4)):
        pieces.append([flag] if value is None else [flag, draw(value)])
    if draw(st.integers(0, 9)) == 0:
        pieces.append([draw(words)])  # a stray word
    order = draw(st.permutations(range(len(pieces))))
    argv = [*command.split(), *(w for i in order for w in pieces[i])]
    return [*argv, *NO_TRAINING] if command == "train" else argv


@contextlib.contextmanager
def _chdir(path: Path) -> Iterator[None]:
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A working directory with the files and directories the argument strategies name."""
    (tmp_path / "dir" / "checkpoints" / "step-00000001").mkdir(parents=True)
    (tmp_path / "dir" / "config.yaml").write_text("train: [\n")
    (tmp_path / "dir" / "checkpoints" / "step-00000001" / "manifest.json").write_text("{")
    (tmp_path / "junk.yaml").write_text("model: {dim: 3}\ntrain: true\n")
    return tmp_path


@fuzz(500)
@given(argv=argvs())
@bounded
def test_fuzz_cli(scratch: Path, capfd: pytest.CaptureFixture[str], argv: list[str]) -> None:
    TRIED["cli " + " ".join(argv[:2] if argv[0] == "launch" else argv[:1])] += 1
    if argv[0] == "random":
        argv = argv[1:]
    assert argv[-2:] == NO_TRAINING or not {"train", "bench"} & set(argv)
    capfd.readouterr()
    out, err = io.StringIO(), io.StringIO()
    with _chdir(scratch), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: usage errors, --help, --version
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    captured = capfd.readouterr()
    TRIED[f"(cli exit {'0' if code == 0 else 'non-zero'})"] += 1
    stderr = err.getvalue() + captured.err
    assert isinstance(code, int)
    assert "Traceback" not in stderr, f"dtlab {argv}:\n{stderr}"
    if code != 0:  # a failure is never silent
        assert stderr.strip(), f"dtlab {argv} exited {code} without a message"
    assert not (scratch / "runs").exists()  # nothing trained (`train -h` exits 0 without training)


def test_config_after_set_is_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dtlab train --set train.steps=3 configs/ddp.yaml`: argparse's --set swallowed the path and it
    failed as a bad override; the one word without '=' is CONFIG."""
    config = str(ROOT / "configs" / "debug.yaml")
    assert main(["config", "--set", "train.steps=3", config]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["model"]["preset"] == "debug" and shown["train"]["steps"] == 3
    for argv, needle in (
        (["config", config, "--set", "train.steps=3", "other.yaml"], "CONFIG is already"),
        (["config", "--set", "train.steps=3", "a.yaml", "b.yaml"], "only one CONFIG"),
        (["config", "--set", "train"], "--set 'train': expected KEY=VALUE"),  # no file: a typo
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--nnodes", str(2**64)], "expected an integer from 1 to 2147483647"),
        (["launch", "slurm", "--out", "/proc/nope/job"], "cannot write the job file there"),
        (["launch", "k8s", "--image", "x", "--out", "/proc/nope/j.yaml"], "cannot write the job"),
        (["launch", "slurm", "--out", "x" * 300], "File name too long"),
        (["export", "x" * 300, "--format", "hf", "--out", "o"], "File name too long"),
        (["export", "a\0b", "--format", "hf", "--out", "o"], "cannot hold a NUL character"),
        (["config", "x" * 300], "cannot be read"),
        (["plan", "--device-memory", "nan"], "allowed: a finite number > 0"),
        (["plan", "--device-memory", "inf"], "allowed: a finite number > 0"),
    ],
)
def test_cli_inputs_found_by_fuzzing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    """Each raised an exception out of main() (a traceback), or, for nan, planned with no memory."""
    with _chdir(tmp_path):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
    assert "Traceback" not in err
