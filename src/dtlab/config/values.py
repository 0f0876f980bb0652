"""The config's building blocks: constants, strict value coercion and the section base class."""

from __future__ import annotations

import math
import types
from itertools import islice
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

# Vocabulary size of each tokenizer; the model's vocab_size must cover it.
TOKENIZER_VOCAB = {"bytes": 256}
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage per rank (parallel.pp_schedule)
# Tokenizers named in data.tokenizer (anything else is a tokenizer.json path).
TOKENIZERS = ("bytes", "bpe")

# Integers are 64-bit wherever they end up (torch tensors, seeds, step counters).
INT64_MAX = 2**63 - 1
# A float stands for an integer only up to 2**53: above it, neighbouring integers share one float.
EXACT_FLOAT_INT = 2**53
# run.name becomes runs/<name>-<YYYYmmdd-HHMMSS>[-<n>]: 200 bytes leave room for the 16-byte timestamp
# and a suffix under NAME_MAX (255 bytes on Linux, macOS and Windows file systems).
RUN_NAME_MAX_BYTES = 200
NAME_MAX_BYTES = 255
# Tokens per training sample when data.seq_len is not given: the pre-training length of GPT-3, Llama 1
# and torchtitan's default, short enough that a first plan of a Llama preset fits (their whole
# context, 4096 to 131,072 tokens, is a long-context stage one asks for). A model whose context is
# shorter (the small presets) trains at its own max_seq_len.
DEFAULT_SEQ_LEN = 2048


def _bad(message: str) -> PydanticCustomError:
    # The message travels as context so that braces in it are never read as a template.
    return PydanticCustomError("dtlab_value", "{message}", {"message": message})


def _kind(value: Any) -> str:
    """What a YAML value is, in YAML's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def _bool_or_words(annotation: Any) -> tuple[str, ...]:
    """The words a ``bool | Literal[...]`` field takes besides true and false (else none)."""
    args = get_args(annotation)
    if get_origin(annotation) not in (Union, types.UnionType) or bool not in args:
        return ()
    literals = [a for a in args if get_origin(a) is Literal]
    if len(args) != 2 or not literals:
        return ()
    return tuple(str(w) for w in get_args(literals[0]))


def _allowed(annotation: Any, metadata: list[Any]) -> str:
    """What a field accepts, in words: 'an integer >= 1', 'true or false', ..."""
    if words := _bool_or_words(annotation):
        return "true, false or " + " or ".join(repr(w) for w in words)
    args = get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return f"{_allowed(inner, metadata)}, or null"
    bounds = []
    for m in metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{op} {getattr(m, attr)}")
    bound = (" " + " and ".join(bounds)) if bounds else ""
    if annotation is int:
        return f"an integer{bound}"
    if annotation is float:
        return f"a finite number{bound}"
    if annotation is bool:
        return "true or false"
    if annotation is str:
        return (
            "a non-empty string"
            if any(isinstance(m, annotated_types.MinLen) for m in metadata)
            else "a string"
        )
    if get_origin(annotation) is list:
        return "a list of strings, e.g. [a.txt, data/]"
    if get_origin(annotation) is tuple:
        return f"a list of {len(args)} numbers, e.g. [0.9, 0.95]"
    return "see dtlab config --keys"


def _check_text(value: str, allowed: str) -> str:
    if "\0" in value:
        raise _bad(f"a NUL character is not allowed; allowed: {allowed} without NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"not valid Unicode text; allowed: {allowed}") from None
    return value


def _coerce(value: Any, annotation: Any, allowed: str) -> Any:
    """Check the kind of ``value`` against a field's type: a bool is not a number, a number is not a
    bool or a string, a float is an integer only when it is a whole number. Returns the value to keep."""
    if words := _bool_or_words(annotation):  # true, false or one of the words, nothing else
        if isinstance(value, bool) or (isinstance(value, str) and value in words):
            return value
        either = " nor ".join(repr(w) for w in words)
        raise _bad(f"neither a boolean nor {either}; allowed: {allowed}")
    args = get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, allowed)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise _bad(f"{_kind(value)} is not a boolean; allowed: {allowed}")
    if annotation is int:
        return _coerce_int(value, allowed)
    if annotation is float:
        return _coerce_float(value, allowed)
    if annotation is str:
        return _coerce_str(value, allowed)
    if get_origin(annotation) is list:
        if not isinstance(value, list):
            raise _bad(f"{_kind(value)} is not a list; allowed: {allowed}")
        return [_item(i, x, args[0], allowed) for i, x in enumerate(value)]
    if get_origin(annotation) is tuple:
        return _coerce_tuple(value, args, allowed)
    return value


def _coerce_int(value: Any, allowed: str) -> int:
    """An integer field's value: an int, or a float that is a whole number that a float holds
    exactly; within 64 bits either way."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{_kind(value)} is not an integer; allowed: {allowed}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise _bad(f"not a whole number; allowed: {allowed}")
        if abs(value) > EXACT_FLOAT_INT:
            raise _bad(
                f"a float beyond 2**53 does not hold every integer; allowed: {allowed}, "
                "written with digits only"
            )
        value = int(value)
    if abs(value) > INT64_MAX:
        raise _bad(f"outside the 64-bit range (-2**63 < value < 2**63); allowed: {allowed}")
    return value


def _coerce_float(value: Any, allowed: str) -> float:
    """A float field's value: any finite number but a bool (an integer too large for a float is
    not finite)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{_kind(value)} is not a number; allowed: {allowed}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _bad(f"not a finite number; allowed: {allowed}")
    return number


def _coerce_str(value: Any, allowed: str) -> str:
    """A string field's value: text only; a scalar that YAML read as another kind is told how to
    quote it."""
    if not isinstance(value, str):
        scalar = isinstance(value, bool | int | float)
        hint = f' (in quotes it stays text: "{show(value)}")' if scalar else ""
        raise _bad(f"{_kind(value)} is not a string; allowed: {allowed}{hint}")
    return _check_text(value, allowed)


def _coerce_tuple(value: Any, args: tuple[Any, ...], allowed: str) -> tuple[Any, ...]:
    """A fixed-length field's value: a list (or tuple) of as many items as ``args``, each of its
    type."""
    if not isinstance(value, list | tuple) or len(value) != len(args):
        what = f"{len(value)} items" if isinstance(value, list | tuple) else _kind(value)
        raise _bad(f"{what}; allowed: {allowed}")
    return tuple(_item(i, x, t, allowed) for i, (x, t) in enumerate(zip(value, args, strict=True)))


def _item(index: int, value: Any, annotation: Any, allowed: str) -> Any:
    try:
        return _coerce(value, annotation, allowed)
    except PydanticCustomError as e:
        raise _bad(f"item {index}: {e.context['message'] if e.context else e}") from None


def show(value: Any, depth: int = 0) -> str:
    """A short YAML-like rendering of a value for error messages (bounded for any input)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 256 else f"<a {value.bit_length()}-bit integer>"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 60 else repr(value[:57]) + "..."
    if depth >= 2:
        return "..."
    if isinstance(value, list | tuple):
        items = [show(x, depth + 1) for x in value[:6]]
        return "[" + ", ".join(items) + (", ..." if len(value) > 6 else "") + "]"
    if isinstance(value, dict):
        pairs = [f"{show(k, depth + 1)}: {show(v, depth + 1)}" for k, v in islice(value.items(), 6)]
        return "{" + ", ".join(pairs) + (", ..." if len(value) > 6 else "") + "}"
    return f"<{type(value).__name__}>"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_kinds(cls, value: Any, info: ValidationInfo) -> Any:
        # Pydantic's lax mode reads true as 1, 1 as true, "5" as 5 and 1e-400 (= 0.0) as the integer 0;
        # a config that says something else than the user meant must fail instead.
        assert info.field_name is not None
        field = cls.model_fields[info.field_name]
        return _coerce(value, field.annotation, _allowed(field.annotation, field.metadata))
