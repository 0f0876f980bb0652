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
    ("dtlab.data", "dtlab.metrics", "dtlab.analysis.devices", "dtlab.analysis.busbw"),
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
        "dtlab.deploy_k8s_pod",
        "dtlab.deploy_trainer",
        "dtlab.deploy_site",
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


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The dtlab modules ``path`` imports, wherever the import stands (top, a function, a
    TYPE_CHECKING block): ``from pkg import module`` is the module's, not its package's."""
    out = set()
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            subs = [f"{base}.{a.name}" for a in node.names]
            names = [n for n in subs if n in modules] or [base]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("dtlab") and name != me:
                out.add(name)
    return out


def test_no_module_imports_one_that_imports_it_back() -> None:
    """No import circle, however long, and however the imports stand: every module can be read
    with only what lies below it."""
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    graph = {m: _module_imports(p, set(files)) for m, p in files.items()}
    circles, index, low, stack, on = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "modules that import each other, through each circle:\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )
