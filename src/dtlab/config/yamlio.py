"""YAML as the config reads and writes it (YAML 1.2 core scalars, ranges checked)."""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from dtlab.config.values import INT64_MAX, show
from dtlab.errors import ConfigError

# --- YAML --------------------------------------------------------------------------------------
# Plain scalars are read by YAML 1.2's core schema, not PyYAML's YAML 1.1: `1e-4` is a float (1.1: a
# string), only true/false are booleans (1.1: also yes/no/on/off, so `run.name=no` became false), `010`
# is ten (1.1: octal eight), and `1:30` and `2024-01-01` are strings (1.1: 90 and a date). Underscores
# between digits are kept (`10_000`).
_BOOL = r"^(?:true|True|TRUE|false|False|FALSE)$"
_INT = r"^(?:[-+]?[0-9][0-9_]*|0o[0-7][0-7_]*|0x[0-9a-fA-F][0-9a-fA-F_]*)$"
_FLOAT = (
    r"^(?:[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_NULL = r"^(?:~|null|Null|NULL|)$"


class ValueRangeError(yaml.constructor.ConstructorError):
    """A number YAML can write but a 64-bit value cannot hold (1e-400, 1e400, 2**64)."""


class _Loader(yaml.SafeLoader):
    """YAML 1.2 core scalars, numbers checked for range, duplicate keys refused."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # PyYAML keeps the last of two equal keys: a second `train:` section would silently replace
        # the first one. Keys that a merge (`<<: *base`) brings in may be overridden; written ones not.
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found the key {show(key)} twice (first on line {first.start_mark.line + 1})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-untyped-call]


def _scalar(loader: _Loader, node: yaml.Node) -> str:
    return str(loader.construct_scalar(node))  # type: ignore[arg-type]


def _construct_int(loader: _Loader, node: yaml.Node) -> int:
    text = _scalar(loader, node)
    digits = text.replace("_", "")
    sign = -1 if digits.startswith("-") else 1
    digits = digits.lstrip("+-")
    base = {"0x": 16, "0o": 8}.get(digits[:2], 10)
    if base != 10:
        digits = digits[2:]
    try:
        # The length check keeps int() away from its 4300-digit limit (a ValueError of its own).
        value = sign * int(digits, base) if len(digits) <= 64 else None
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{show(text)} is not an integer", node.start_mark
        ) from None
    if value is None or not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ValueRangeError(
            None,
            None,
            f"{show(text)} is outside the 64-bit integer range; allowed: -2**63 to 2**63 - 1",
            node.start_mark,
        )
    return value


def _construct_float(loader: _Loader, node: yaml.Node) -> float:
    text = _scalar(loader, node)
    plain = text.replace("_", "").lower()
    if plain.lstrip("+-") in (".inf", ".nan"):
        value = math.nan if "nan" in plain else math.inf
        return -value if plain.startswith("-") else value
    try:
        value = float(plain)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"{show(text)} is not a number", node.start_mark
        ) from None
    # float() rounds 1e400 to inf and 1e-400 to 0 without a word; a config must not.
    if math.isinf(value):
        raise ValueRangeError(
            None,
            None,
            f"{show(text)} is too large for a 64-bit float; allowed: magnitudes up to about 1.8e308",
            node.start_mark,
        )
    if value == 0 and any(c in "123456789" for c in plain.split("e")[0]):
        raise ValueRangeError(
            None,
            None,
            f"{show(text)} is too small for a 64-bit float (it would be read as 0); allowed: 0, "
            "or magnitudes from about 5e-324",
            node.start_mark,
        )
    return value


def _construct_bool(loader: _Loader, node: yaml.Node) -> bool:
    text = _scalar(loader, node)
    if text.lower() not in ("true", "false"):
        raise yaml.constructor.ConstructorError(
            None, None, f"{show(text)} is not a boolean; allowed: true, false", node.start_mark
        )
    return text.lower() == "true"


def _construct_timestamp(loader: _Loader, node: yaml.Node) -> Any:
    # Only an explicit `!!timestamp` gets here; PyYAML's constructor fails on a malformed one with an
    # AttributeError.
    try:
        return loader.construct_yaml_timestamp(node)  # type: ignore[arg-type]
    except (AttributeError, ValueError, TypeError):
        raise yaml.constructor.ConstructorError(
            None, None, f"{show(_scalar(loader, node))} is not a timestamp", node.start_mark
        ) from None


_Loader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
    ("bool", _BOOL, "tTfF"),
    ("int", _INT, "-+0123456789"),
    ("float", _FLOAT, "-+0123456789."),
    ("null", _NULL, ["~", "n", "N", ""]),
    ("merge", r"^(?:<<)$", "<"),
):
    _Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_Loader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", _construct_timestamp)


class _Dumper(yaml.SafeDumper):
    """Quotes every string that _Loader or a plain YAML 1.1 reader would take for something else
    (`1e3`, `no`, `010`), so a written config.yaml reads back the same with either."""


_Dumper.yaml_implicit_resolvers = {
    first: list(yaml.SafeDumper.yaml_implicit_resolvers.get(first, []))
    + list(_Loader.yaml_implicit_resolvers.get(first, []))
    for first in {*yaml.SafeDumper.yaml_implicit_resolvers, *_Loader.yaml_implicit_resolvers}
}


def dump_yaml(data: Any) -> str:
    """YAML text that :func:`parse_yaml` (and ``yaml.safe_load``) read back as ``data``."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text (YAML 1.2 core scalars); errors name the source, line and what is allowed."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" (line {mark.line + 1}, column {mark.column + 1})"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if isinstance(e, ValueRangeError):
            where = where if "\n" in text.strip() else ""  # a --set value is one line
            raise ConfigError(f"{source}{where}: {problem}") from None
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, OverflowError) as e:
        # PyYAML's constructors for explicitly tagged scalars (`!!timestamp x`) fail this way.
        raise ConfigError(
            f"{source}: not valid YAML: a tagged value cannot be read ({type(e).__name__}: {e})"
        ) from None
