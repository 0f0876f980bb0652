"""Claims the docs make about what dtlab can do, checked against the code: a capability table's
strategies are the ones the config accepts, a family table's classes are the ones the code writes,
and no page says that nothing was measured on a GPU beside the page that quotes the measurements."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtlab.config import check_world, load_config
from dtlab.errors import ConfigError
from dtlab.models.families import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STRATEGIES = ("single", "ddp", "fsdp", "hsdp")

# compression.md's table: the method, and the settings that turn it on.
METHODS = {
    "`fp16`, `bf16`": ["parallel.compression=bf16"],
    "`powersgd`": ["parallel.compression=powersgd"],
    "`dct`": ["parallel.compression=dct"],
    "`parallel.diloco`": ["parallel.diloco.inner_steps=2", "parallel.diloco.replicas=2"],
    "`train.optimizer: demo`": ["train.optimizer=demo"],
}


def _accepts(strategy: str, overrides: list[str]) -> bool:
    """Whether a 4-process run of ``strategy`` with ``overrides`` is a valid config."""
    extra = ["parallel.replicate=2"] if strategy == "hsdp" else []
    world = 1 if strategy == "single" else 4
    try:
        config = load_config(None, [f"parallel.strategy={strategy}", *extra, *overrides])
        check_world(config, world)
    except (ConfigError, ValueError):
        return False
    return True


def _claimed(cell: str) -> set[str]:
    """The strategies a table cell names (what follows in parentheses is a remark)."""
    words = re.split(r"[,\s]+", cell.split("(")[0])
    return {w for w in words if w in STRATEGIES}


@pytest.mark.parametrize("method", METHODS)
def test_compression_tables_strategies_are_what_the_config_accepts(method: str) -> None:
    text = (ROOT / "docs" / "compression.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith(f"| {method} |"))
    claimed = _claimed(row.split("|")[2])
    accepted = {s for s in STRATEGIES if _accepts(s, METHODS[method])}
    assert claimed == accepted, f"docs/compression.md says {method} runs on {claimed}: {accepted}"


def test_the_families_table_names_the_classes_the_code_writes() -> None:
    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `(\w+)` \| `(\w+)` \|", text, flags=re.MULTILINE)
    }
    assert rows == {f.name: f.hf_class for f in FAMILIES.values()}


def test_no_page_says_no_gpu_was_measured_beside_the_gpu_reports() -> None:
    reports = (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8")
    measured = re.search(r"\| train \| passed", reports) is not None
    stale = [
        str(doc.relative_to(ROOT))
        for doc in DOCS
        if re.search(r"no GPU figures have\s+been measured", doc.read_text(encoding="utf-8"), re.I)
    ]
    assert not (measured and stale), f"{stale} say no GPU figure was measured; docs/gpu.md has some"
