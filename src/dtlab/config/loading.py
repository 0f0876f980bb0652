"""Loading a config: files, ``--set`` overrides, validation errors in the user's words, the key list."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from dtlab.config.schema import Config
from dtlab.config.suggest import (
    key_note,
    literal_choices,
    suggest_key,
    suggest_section,
    suggest_value,
)
from dtlab.config.values import show
from dtlab.config.yamlio import _Dumper, parse_yaml
from dtlab.errors import ConfigError


def _read_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        if p.is_dir():
            p = p / "config.yaml"
            if not p.is_file():
                found = sorted(str(f) for f in Path(path).glob("*.y*ml"))[:6]
                raise ConfigError(
                    f"{str(path)!r} is a directory without a config.yaml (not a run directory); "
                    "give a YAML file"
                    + (f", e.g. {', '.join(found)}" if found else "")
                    + ", or a run directory"
                )
        if not p.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist (or is not a file)")
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e}") from None
    data = parse_yaml(text, str(p))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p}: the top level must be a mapping of sections (model, data, train, ...), got {type(data).__name__}"
        )
    return data


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one ``a.b=c`` override in place; the value is parsed as YAML."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {show(override)}: expected KEY=VALUE, e.g. train.lr=1e-4")
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"--set {show(override)}: {show(where)[1:-1]} is not a section")
        node = child
    node[parts[-1]] = parse_yaml(raw, f"--set {show(key)[1:-1]}") if raw.strip() else None


def _sections() -> dict[str, list[str]]:
    """Each section's keys (as written in YAML)."""
    out = {}
    for name, field in Config.model_fields.items():
        cls = field.annotation
        assert isinstance(cls, type) and issubclass(cls, BaseModel)
        out[field.alias or name] = [f.alias or n for n, f in cls.model_fields.items()]
    return out


def _key_hint(section: str, key: str, valid: list[str], error: Any) -> str:
    """`` (did you mean ...?)`` for the unknown ``key`` of ``section`` ('' for the top level), or ''."""
    if not section:
        meant = suggest_section(key, error.get("input"), _sections())
        if meant:
            return f" (did you mean {', '.join(meant)}?)"
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.7)
        return f" (did you mean {close[0]}?)" if close else ""
    dotted = f"{section}.{key}"
    found = suggest_key(dotted, [f"{section}.{v}" for v in valid])
    if found is None:
        return ""
    note = key_note(dotted)
    return f" (did you mean {found}?{f' {note}' if note else ''})"


def _field_annotation(loc: tuple[int | str, ...]) -> Any:
    """The type of the field at ``loc`` (list indices skipped), or None where there is none."""
    cls: type[BaseModel] = Config
    annotation: Any = None
    for part in loc:
        if isinstance(part, int):
            continue
        if annotation is not None:  # a part below a plain field
            return None
        field = next((f for n, f in cls.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            return None
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            cls = field.annotation
        else:
            annotation = field.annotation
    return annotation


def _value_hint(loc: tuple[int | str, ...], value: Any) -> str:
    """`` (did you mean 'fsdp'?)`` for a value outside a field's fixed set of words, or ''."""
    allowed = literal_choices(_field_annotation(loc))
    if value in allowed:
        return ""
    meant = suggest_value(value, allowed)
    return f" (did you mean {meant!r}?)" if meant is not None else ""


def _format_validation_error(
    err: ValidationError, source: str, overridden: dict[str, str] | None = None
) -> str:
    """One message for all of ``err``'s errors, each blamed on where its value came from: the
    ``--set`` that gave it (``overridden``: dotted key -> the override as typed), else ``source``."""
    overridden = overridden or {}
    lines: list[tuple[str, str]] = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        given = next(
            (
                ov
                for k, ov in overridden.items()
                # the key itself, a key inside a mapping it set, or a section it introduced
                if loc and (loc == k or loc.startswith(k + ".") or k.startswith(loc + "."))
            ),
            None,
        )
        where = f"--set {show(given)}" if given is not None else source
        if e["type"] == "extra_forbidden":
            section_cls: type[BaseModel] = Config
            for part in e["loc"][:-1]:
                field = section_cls.model_fields.get(str(part))
                ann = field.annotation if field is not None else None
                if isinstance(ann, type) and issubclass(ann, BaseModel):
                    section_cls = ann
            valid = [f.alias or n for n, f in section_cls.model_fields.items()]
            section = ".".join(str(x) for x in e["loc"][:-1])
            text = f"unknown key {show(loc)}" + _key_hint(section, str(e["loc"][-1]), valid, e)
            text += f"; valid keys in {section or 'the top level'}: {', '.join(valid)}"
        elif e["type"] in ("value_error", "assertion_error"):
            msg = str(e["msg"]).removeprefix("Value error, ")
            text = msg if not loc or msg.startswith(loc) else f"{loc}: {msg}"
        else:
            msg = e["msg"]
            if e["type"] in ("model_type", "model_attributes_type", "dict_type"):
                msg = "not a section; allowed: a mapping of its keys (`dtlab config --keys` lists them)"
            text = f"{loc or 'the config'} = {show(e.get('input'))}: {msg}"
            text += _value_hint(e["loc"], e.get("input"))
            if given is not None and isinstance(e.get("input"), (dict, list)):
                # YAML read "a: b" as a mapping and "[a]" as a list: the text needs quotes.
                key, _, raw = given.partition("=")
                text += (
                    f" (--set values are YAML, and {show(raw)} reads as a "
                    f"{'mapping' if isinstance(e.get('input'), dict) else 'list'}; to pass it as "
                    f"text, quote it: --set '{key}=\"{raw}\"')"
                )
        lines.append((where, text))
    if len({w for w, _ in lines}) == 1:
        return f"{lines[0][0]}: " + "; ".join(t for _, t in lines)
    return "; ".join(f"{w}: {t}" for w, t in lines)


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load and validate a config: defaults, then the YAML file at ``path``, then ``overrides``.

    ``overrides`` are ``"key=value"`` strings, exactly what ``dtlab train --set`` takes. ``path`` may be
    a run directory (its ``config.yaml`` is read). Raises :class:`ConfigError` with a message that
    names the key, the value received and what is allowed.
    """
    data = _read_file(path) if path is not None else {}
    overridden: dict[str, str] = {}
    for ov in overrides:
        apply_override(data, ov)
        overridden[ov.partition("=")[0].strip()] = ov  # a later --set of the key wins, here too
    return config_from_dict(data, str(path) if path is not None else "config", overridden)


def config_from_dict(
    data: dict[str, Any], source: str = "config", overridden: dict[str, str] | None = None
) -> Config:
    """Validate plain data as a :class:`Config`; errors name ``source`` (or the ``--set`` in
    ``overridden`` that gave the value)."""
    try:
        config = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source, overridden)) from None
    config._given = frozenset(_dotted_keys(data))
    return config


def _dotted_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """The keys of nested mappings that hold a value, dotted (``{"train": {"lr": 1}}``: ``train.lr``)."""
    out = []
    for k, v in data.items():
        if isinstance(v, dict):  # a section (an empty one gives nothing)
            out += _dotted_keys(v, f"{prefix}{k}.")
        else:
            out.append(prefix + str(k))
    return out


def yaml_scalar(value: Any) -> str:
    """``value`` as it is written in a YAML config (``tiny``, ``false``, ``null``, ``[0.9, 0.95]``)."""
    text = yaml.dump(value, Dumper=_Dumper, default_flow_style=True, width=1000)
    return text.removesuffix("\n...\n").strip()


def describe_fields() -> list[tuple[str, str, str]]:
    """(key, default, description) for every config key, for docs and ``--help``."""
    rows = []
    defaults = Config().to_dict()
    # Filled in from another key when null: the default is null, and the description says how.
    defaults["data"]["seq_len"] = None
    for section, field in Config.model_fields.items():
        cls = field.annotation
        assert isinstance(cls, type) and issubclass(cls, BaseModel)
        for name, f in cls.model_fields.items():
            key = f.alias or name
            sub = f.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):  # a nested group of options
                for sub_name, sf in sub.model_fields.items():
                    rows.append(
                        (
                            f"{section}.{key}.{sub_name}",
                            yaml_scalar(defaults[section][key][sub_name]),
                            sf.description or "",
                        )
                    )
                continue
            rows.append(
                (f"{section}.{key}", yaml_scalar(defaults[section][key]), f.description or "")
            )
    return rows
