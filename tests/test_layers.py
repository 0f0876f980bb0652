"""Layers point down: a module imports only from its own layer or the layers below it.

The table is the architecture (docs/architecture.md draws it); a new import that points up a layer
fails here, with the file, the line and the layers named.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dtlab"

# Bottom to top. A module belongs to the longest prefix listed.
LAYERS: list[tuple[str, ...]] = [
    ("dtlab.errors", "dtlab.runtime", "dtlab.fsutil", "dtlab.metrics.logging"),
    ("dtlab.models", "dtlab.dims"),
    ("dtlab.config", "dtlab.cliargs"),
    ("dtlab.data", "dtlab.metrics", "dtlab.analysis.devices"),
    ("dtlab.parallel",),
    ("dtlab.checkpoint",),
    ("dtlab.train", "dtlab.analysis"),
    ("dtlab.mlx",),
    (
        "dtlab.bench",
        "dtlab.launcher",
        "dtlab.fault_tolerance",
        "dtlab.deploy",
        "dtlab.deploy_k8s",
        "dtlab.train.api",
        "dtlab.verify",
        "dtlab.verify_state",
    ),
    ("dtlab.cli", "dtlab.__main__", "dtlab"),
]


def layer_of(module: str) -> int:
    best, rank = "", -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    assert rank >= 0, f"{module} is in no layer: add it to LAYERS"
    return rank


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "dtlab":
                # `from dtlab import __version__` reads the package's version, nothing above it.
                names = [a.name for a in node.names if a.name != "__version__"]
                out += [(node.lineno, f"dtlab.{n}") for n in names]
            elif node.module.startswith("dtlab."):
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("dtlab.")]
    return out


def test_imports_point_down() -> None:
    up = []
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 40
    for path in files:
        me = module_name(path)
        if me in ("dtlab", "dtlab.__main__", "dtlab.cli", "dtlab.train"):
            # The top (the command line) and the packages' lazy façades: `dtlab.train(...)` calls
            # dtlab.train.api only when called, like `dtlab.Config` imports the config on first use.
            continue
        for line, target in imports(path):
            if layer_of(target) > layer_of(me):
                up.append(
                    f"{path.relative_to(SRC.parent)}:{line} imports {target} "
                    f"(layer {layer_of(target)} above {me}'s {layer_of(me)})"
                )
    assert not up, "imports that point up a layer:\n" + "\n".join(up)


def test_the_table_places_a_module_by_its_longest_prefix() -> None:
    assert layer_of("dtlab.train.api") > layer_of("dtlab.mlx.train") > layer_of("dtlab.train.loop")
    assert layer_of("dtlab.analysis.devices") < layer_of("dtlab.parallel.apply")
    assert layer_of("dtlab.runtime.faults") == 0
