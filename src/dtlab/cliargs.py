"""Command-line pieces shared by ``dtlab`` and the benchmark scripts: CONFIG and ``--set`` declared once,
and the choices of a flag read from the config schema, so that neither can drift from the config."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args, get_origin

from dtlab.errors import DtlabError, Preempted
from dtlab.runtime.status import worker_rank

CONFIG_HELP = "YAML config file or run directory (default: the built-in default)"
SET_HELP = "override a config key, e.g. --set train.lr=1e-4"


INT_FLAG_MAX = 2**31 - 1


def int_from(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` to :data:`INT_FLAG_MAX`; anything else is argparse's
    usage error naming the value and the range (exit 2), before anything runs."""
    allowed = f"an integer from {low} to {INT_FLAG_MAX}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if not low <= value <= INT_FLAG_MAX:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {value}")
        return value

    parse.__name__ = f"int_from_{low}"
    return parse


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer of 1 or more."""
    return int_from(1)(text)


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer of 0 or more."""
    return int_from(0)(text)


def _number(text: str, positive: bool) -> float:
    allowed = "a finite number above 0" if positive else "a finite number of 0 or more"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number above 0 (a duration, a rate)."""
    return _number(text, positive=True)


def non_negative_float(text: str) -> float:
    """An argparse ``type``: a finite number of 0 or more."""
    return _number(text, positive=False)


def int_list(text: str, flag: str, low: int = 1, high: int = INT_FLAG_MAX) -> list[int]:
    """A comma-separated list of integers from ``low`` to ``high`` (``"2,4"``), in the order given,
    each once: a mistake is a :class:`DtlabError` naming ``flag``, the value and what is allowed."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or not low <= min(values) <= max(values) <= high:
        allowed = f"{low} or more" if high == INT_FLAG_MAX else f"from {low} to {high}"
        raise DtlabError(f"{flag} {text!r}: allowed: comma-separated integers, each {allowed}")
    return list(dict.fromkeys(values))


def _unwritable_dir(out: Path) -> str | None:
    """Why the directory ``out`` cannot be made (with its parents) and written into; None: made."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot be created: {e.strerror}"
    if not os.access(out, os.W_OK | os.X_OK):
        return "cannot be written to (permission denied)"
    return None


def output_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` made (with its parents) for a script to write into, before any of its work: a
    :class:`DtlabError` naming ``flag`` where it cannot be (a file there, no permission)."""
    out = Path(path)
    why = _unwritable_dir(out)
    if why:
        raise DtlabError(f"{flag} '{out}' {why}")
    return out


def output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` checked as a file a script writes at its end, before any of its work (its directory
    made): a :class:`DtlabError` naming ``flag`` where it could not be written then, so that no
    result is lost to a mistyped path."""
    out = Path(path)
    if out.is_dir():
        raise DtlabError(f"{flag} '{out}' is a directory; allowed: a file's path")
    why = _unwritable_dir(out.parent)
    if why:
        raise DtlabError(f"{flag} '{out}': its directory '{out.parent}' {why}")
    if out.exists() and not os.access(out, os.W_OK):
        raise DtlabError(f"{flag} '{out}' cannot be written to (permission denied)")
    return out


def add_config_args(parser: argparse.ArgumentParser, *, config: bool = True) -> None:
    """Add the CONFIG positional (unless ``config`` is False) and ``--set KEY=VALUE ...`` (repeatable).

    Parse with :func:`parse_config_args`, which finds a CONFIG typed after the ``--set`` list."""
    if config:
        parser.add_argument("config", nargs="?", metavar="CONFIG", help=CONFIG_HELP)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help=SET_HELP,
    )


def script_parser(module: str, doc: str | None, preset: str) -> argparse.ArgumentParser:
    """The parser of a benchmark script ``python -m module``: its docstring as the help text, ``--preset``
    (default ``preset``) and ``--set``; the script adds its own flags."""
    p = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default=preset, help=f"model preset (default {preset})")
    add_config_args(p, config=False)
    return p


def parse_config_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """``parser.parse_args(argv)``, then :func:`take_config_from_set`; a mistake exits with usage (2)."""
    args = parser.parse_args(argv)
    take_config_from_set(args, parser.error)
    return args


def take_config_from_set(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> None:
    """Move a CONFIG that ``--set`` swallowed back to ``args.config``, or call ``error``.

    ``--set`` takes every following word, so in ``dtlab train --set train.steps=3 configs/ddp.yaml`` it
    takes CONFIG too. A word without ``=`` is never an override: one such word that names a file or
    directory is CONFIG when the command takes one and CONFIG was not given before ``--set``."""
    overrides: list[str] = getattr(args, "overrides", None) or []
    words = [word for word in overrides if "=" not in word]
    if not words:
        return
    given = ", ".join(repr(word) for word in words)
    if not hasattr(args, "config"):  # a command without CONFIG (the benchmark scripts)
        error(f"--set {given}: expected KEY=VALUE, e.g. train.lr=1e-4")
    if args.config is not None:
        error(
            f"--set takes KEY=VALUE words; {given} is not one, and CONFIG is already {args.config!r}"
        )
    if len(words) > 1:
        error(
            f"--set takes KEY=VALUE words; {given} are not, and only one CONFIG may follow the --set list"
        )
    word = words[0]
    if not os.path.exists(word):
        if word.endswith((".yaml", ".yml")):  # meant as CONFIG: say so, not "expected KEY=VALUE"
            error(f"config file {word!r} (given after --set) does not exist")
        error(
            f"--set {word!r}: expected KEY=VALUE, e.g. train.lr=1e-4 (nor is there a file {word!r} "
            "to read as CONFIG)"
        )
    args.config = word
    args.overrides = [w for w in overrides if w != word]


@cache
def config_choices(key: str) -> tuple[str, ...]:
    """The values a ``Literal`` config key allows, e.g. ``config_choices("parallel.strategy")``."""
    from dtlab.config import Config  # here: building a parser imports neither the config nor torch

    annotation: Any = Config
    for part in key.split("."):
        fields = annotation.model_fields
        name = next((n for n, f in fields.items() if part in (n, f.alias)), None)
        if name is None:
            raise KeyError(f"no config key {key!r}")
        annotation = fields[name].annotation
    if get_origin(annotation) is not Literal:
        raise TypeError(f"config key {key!r} is not a choice of values: {annotation!r}")
    return tuple(str(value) for value in get_args(annotation))


class SchemaChoices:
    """A config key's values as argparse ``choices``, read from the schema when first needed: a parser
    that offers them is built without importing the config (and torch), so ``dtlab --help`` is quick."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __iter__(self) -> Iterator[str]:
        return iter(config_choices(self.key))

    def __contains__(self, value: object) -> bool:
        return value in config_choices(self.key)


def run_command(body: Callable[[], int]) -> int:
    """Run a command (``dtlab``'s or a benchmark script's) and return its exit code. A ``DtlabError``
    (a mistake in the input, a refused checkpoint, a failed collective) is one line on stderr, prefixed
    ``[rankN]`` in a world of several processes, and its exit code: never a traceback."""
    from dtlab.runtime.messages import leave_message

    # Under dtlab's launcher a worker leaves its last word to the launcher, which says each once.
    try:
        return body()
    except Preempted as e:
        # RANK under torch's launchers; MLX's name the rank otherwise (MLX_RANK, ...).
        this_rank = os.environ.get("RANK") or str(worker_rank())
        if this_rank == "0" and not leave_message("preempted", str(e)):
            print(f"preempted: {e}", file=sys.stderr)
        return e.exit_code
    except DtlabError as e:
        if not leave_message("error", str(e)):
            rank = os.environ.get("RANK")
            several = rank is not None and os.environ.get("WORLD_SIZE", "1") != "1"
            print(f"{f'[rank{rank}] ' if several else ''}error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        # Ctrl-C pressed twice during training (the first one saves and stops), or once before it began.
        print("aborted by Ctrl-C: stopped at once, without saving", file=sys.stderr)
        return 130
