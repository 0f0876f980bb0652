"""docs/choosing.md quotes ``dtlab plan``: every quoted command still prints what the doc shows."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dtlab.cli import main as cli_main

DOC = Path(__file__).resolve().parents[1] / "docs" / "choosing.md"
# A fenced block that starts with the command it quotes.
BLOCK = re.compile(r"^```\n\$ dtlab plan (?P<args>[^\n]*)\n(?P<out>.*?)^```$", re.M | re.S)


def _blocks() -> list[tuple[str, list[str]]]:
    return [(m["args"], m["out"].rstrip("\n").split("\n")) for m in BLOCK.finditer(DOC.read_text())]


def quoted_lines_match(quoted: list[str], printed: list[str]) -> str | None:
    """Why ``quoted`` is not ``printed`` with some lines left out (``...`` marks where), or None.

    Lines between two ``...`` markers (or the ends) must be consecutive lines of ``printed``, in order;
    the first quoted line is the first printed one, and the last quoted line (unless ``...``) the last.
    """
    pos = 0
    skip = False
    for line in quoted:
        if line == "...":
            skip = True
            continue
        if skip:
            try:
                pos = printed.index(line, pos)
            except ValueError:
                return f"not printed (after line {pos}): {line!r}"
        elif pos >= len(printed) or printed[pos] != line:
            return f"quoted {line!r}, printed {printed[pos] if pos < len(printed) else None!r}"
        pos += 1
        skip = False
    if not skip and pos != len(printed):
        return f"printed more than quoted: {printed[pos]!r}"
    return None


def test_choosing_quotes_plans() -> None:
    blocks = _blocks()
    assert len(blocks) >= 5  # the doc's cases, each a block the test below checks
    assert all(out[0].startswith("model ") for _, out in blocks)


@pytest.mark.parametrize("args", [a for a, _ in _blocks()])
def test_choosing_plan_figures_are_current(args: str, capsys: pytest.CaptureFixture[str]) -> None:
    quoted = dict(_blocks())[args]
    assert cli_main(["plan", *shlex.split(args)]) == 0
    printed = capsys.readouterr().out.rstrip("\n").split("\n")
    problem = quoted_lines_match(quoted, printed)
    assert problem is None, f"docs/choosing.md, `dtlab plan {args}`: {problem}; update the doc"


@pytest.mark.parametrize(
    ("quoted", "problem"),
    [
        (["a", "b", "c"], None),
        (["a", "...", "c"], None),
        (["a", "..."], None),
        (["a", "b"], "printed more than quoted: 'c'"),
        (["a", "x", "c"], "quoted 'x', printed 'b'"),
        (["a", "...", "x"], "not printed (after line 1): 'x'"),
        (["b", "c"], "quoted 'b', printed 'a'"),
    ],
)
def test_quoted_lines_match(quoted: list[str], problem: str | None) -> None:
    """The comparison catches a changed, an added and a missing line."""
    assert quoted_lines_match(quoted, ["a", "b", "c"]) == problem
