"""``dtlab plan --check``'s command-line side: which ranks and which config it checks, and its report."""

from __future__ import annotations

import json
from typing import Any

from dtlab.analysis.check_fake import unsupported
from dtlab.config import Config
from dtlab.errors import ConfigError


def _error(predicted: float, checked: float) -> str:
    """The plan's error against the check: ``exact``, a signed percentage, or, where one side is
    0 and the other not, ``missed`` (held, not predicted) or ``not held`` (predicted, not held)."""
    if predicted == checked:
        return "exact"
    if checked == 0:
        return "not held"
    if predicted == 0:
        return "missed"
    return f"{(predicted - checked) / checked:+.1%}"


# What the check runs attention as, by the target device's kind.
_KERNELS = {
    "cuda": " (attention with a GPU's kernels' memory: flash, or memory-efficient on expanded heads;"
    " the context-parallel ring's blocks with what those kernels hold beside them)"
}


def format_check(result: dict[str, Any]) -> str:
    """The check, per rank: what is alive at the step's peak, by component, predicted beside
    checked, the peak itself and the moment each side has it, and the bytes sent per step."""
    from dtlab.analysis.plan import format_bytes

    lines = [
        "",
        f"check of {result.get('layout', 'the config as given')}: the real code of "
        f"{len(result['ranks'])} rank(s) at full world size, fake process group and fake tensors on "
        f"the CPU{_KERNELS.get(result.get('device', 'cpu'), '')}, in {result['seconds']:.1f} s",
    ]
    for r in result["ranks"]:
        if "skipped" in r:
            lines.append(f"  rank {r['rank']}: not checked: {r['skipped']}")
            continue
        peak = r["peak"]
        at = peak["checked_at"]
        lines.append(f"  rank {r['rank']}, at its checked peak ({at['moment']}, {at['where']})")
        lines.append(f"    {'':<13}{'predicted':>12}{'checked':>12}{'error':>10}")
        for name, v in r["components"].items():
            p, c = v["predicted"], v["checked"]
            lines.append(
                f"    {name:<13}{format_bytes(p):>12}{format_bytes(c):>12}{_error(p, c):>10}"
            )
        p, c = peak["predicted"], peak["checked"]
        lines.append(
            f"    {'peak':<13}{format_bytes(p):>12}{format_bytes(c):>12}{_error(p, c):>10}"
        )
        if "note" in r:
            lines.append(f"    note: {r['note']}")
        mine = peak["predicted_at"]
        if mine["moment"] != at["moment"]:
            lines.append(f"    (the plan's peak comes at {mine['moment']}: {mine['where']})")
        p, c = r["collectives"]["predicted"], r["collectives"]["checked"]
        lines.append(
            f"    {'sent/step':<13}{format_bytes(p):>12}{format_bytes(c):>12}{_error(p, c):>10}"
        )
        if "host" in r:  # DiLoCo's outer state, in host memory
            p, c = r["host"]["predicted"], r["host"]["checked"]
            lines.append(
                f"    {'host memory':<13}{format_bytes(p):>12}{format_bytes(c):>12}{_error(p, c):>10}"
            )
    lines.append(
        "  peak: the most alive at once in the step, as the plan predicts it (the largest moment "
        "of its timeline) and as the check measured it; the components are what is alive at the "
        "checked peak, and the plan's figures at the same moment. missed: held, not predicted; "
        "not held: predicted, not held."
        + (
            " host memory: DiLoCo's outer state (θ_global, the outer momentum, the error feedback, "
            "the snapshots of syncs in flight) at its most, apart from the device's."
            if any("host" in r for r in result["ranks"])
            else ""
        )
    )
    return "\n".join(lines)


def choose_config(
    path: str | None, overrides: list[str], config: Config, plan: dict[str, Any], world: int
) -> tuple[Config, str]:
    """The config ``--check`` runs and what it is: the layout the plan recommends (its settings over
    ``overrides``), or, when the plan recommends none or the check cannot run it, the config as given."""
    from dtlab.config import load_config

    recommended = (plan.get("search") or {}).get("recommended")
    if recommended:
        extra = [f"{k}={json.dumps(v)}" for k, v in recommended.get("settings", {}).items()]
        target = load_config(path, [*overrides, *extra])
        label = recommended.get("label", "the recommended layout")
        reason = unsupported(target, world)
        if reason is None:
            return target, f"the recommended layout, {label}"
        return config, f"the config as given (the recommended {label} is not checked: {reason})"
    return config, "the config as given"


def default_ranks(world: int) -> list[int]:
    """The ranks checked when none are named: the first and the last (with pipeline parallelism,
    one of the first stage and one of the last: the pipeline is the mesh's outermost dimension)."""
    return sorted({0, world - 1})


def parse_ranks(text: str | None, world: int) -> list[int]:
    """``--ranks 0,7`` as a list; every rank must be in the world."""
    if text is None:
        return default_ranks(world)
    ranks: list[int] = []
    for part in text.split(","):
        try:
            r = int(part)
        except ValueError:
            raise ConfigError(
                f"--ranks {text!r}: {part.strip()!r} is not a rank; allowed: comma-separated "
                f"integers from 0 to {world - 1}"
            ) from None
        if not 0 <= r < world:
            raise ConfigError(f"--ranks {text!r}: rank {r} is not in a world of {world}")
        if r not in ranks:
            ranks.append(r)
    return ranks
