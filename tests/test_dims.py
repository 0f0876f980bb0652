"""Parallel degrees: ``parallel.strategy`` maps onto them in one place (``dtlab.dims``), with the errors of
a world that cannot run it, and the meshes they build are the ones the model ends up on."""

from __future__ import annotations

import ast
import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest

import dtlab
from conftest import FAST, run_worker
from dtlab.config import ParallelConfig, check_world, load_config
from dtlab.dims import DPWrapper, ParallelDims, strategies_with
from dtlab.errors import ConfigError

NONE, DDP, FSDP = DPWrapper.NONE, DPWrapper.DDP, DPWrapper.FSDP
HYBRID = ("dp_replicate", "dp_shard")
SRC = Path(__file__).resolve().parent.parent / "src" / "dtlab"


def dims_of(world: int, *overrides: str) -> ParallelDims:
    return ParallelDims.from_config(load_config(overrides=list(overrides)), world)


@pytest.mark.parametrize(
    ("overrides", "world", "replicate", "shard", "wrapper", "mesh_dims"),
    [
        ([], 1, 1, 1, NONE, ()),
        (["parallel.strategy=ddp"], 1, 1, 1, DDP, ("dp_replicate",)),
        (["parallel.strategy=ddp"], 3, 3, 1, DDP, ("dp_replicate",)),
        # DDP has no sharding: the key is ignored.
        (["parallel.strategy=ddp", "parallel.sharding=no_shard"], 2, 2, 1, DDP, ("dp_replicate",)),
        (["parallel.strategy=fsdp"], 1, 1, 1, FSDP, ("dp_shard",)),
        (["parallel.strategy=fsdp"], 4, 1, 4, FSDP, ("dp_shard",)),
        (
            ["parallel.strategy=fsdp", "parallel.sharding=shard_grad_op"],
            3,
            1,
            3,
            FSDP,
            ("dp_shard",),
        ),
        # fsdp ignores replicate: only hsdp has replica groups.
        (["parallel.strategy=fsdp", "parallel.replicate=2"], 4, 1, 4, FSDP, ("dp_shard",)),
        # no_shard: FSDP on a (world, 1) mesh; on one rank a shard dimension of one, where FSDP2
        # sends nothing (a replica dimension of one would all-reduce every gradient to itself).
        (["parallel.strategy=fsdp", "parallel.sharding=no_shard"], 1, 1, 1, FSDP, ("dp_shard",)),
        (["parallel.strategy=fsdp", "parallel.sharding=no_shard"], 4, 4, 1, FSDP, HYBRID),
        (["parallel.strategy=hsdp", "parallel.replicate=2"], 4, 2, 2, FSDP, HYBRID),
        (["parallel.strategy=hsdp", "parallel.replicate=2"], 6, 2, 3, FSDP, HYBRID),
        (["parallel.strategy=hsdp", "parallel.replicate=3"], 6, 3, 2, FSDP, HYBRID),
        # One replica group still has a replicate dimension (of size 1).
        (["parallel.strategy=hsdp", "parallel.replicate=1"], 4, 1, 4, FSDP, HYBRID),
        (["parallel.strategy=hsdp", "parallel.replicate=4"], 4, 4, 1, FSDP, HYBRID),
        (
            ["parallel.strategy=hsdp", "parallel.replicate=2", "parallel.sharding=no_shard"],
            4,
            4,
            1,
            FSDP,
            HYBRID,
        ),
    ],
)
def test_strategy_maps_onto_degrees(
    overrides: list[str],
    world: int,
    replicate: int,
    shard: int,
    wrapper: DPWrapper,
    mesh_dims: tuple[str, ...],
) -> None:
    dims = dims_of(world, *overrides)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == (replicate, shard, 1, 1)
    assert (dims.wrapper, dims.mesh_dims) == (wrapper, mesh_dims)
    assert dims.world_size == dims.dp == world
    assert dims.mesh_shape == tuple(
        {"dp_replicate": replicate, "dp_shard": shard}[n] for n in mesh_dims
    )
    assert dims.replicate_enabled == (replicate > 1)
    assert dims.shard_enabled == (shard > 1)
    assert dims.dp_enabled == (world > 1)


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "hsdp"])
@pytest.mark.parametrize("sharding", ["full", "shard_grad_op", "no_shard"])
@pytest.mark.parametrize("world", [1, 2, 4, 6])
def test_every_layout_answers_like_its_strategy(strategy: str, sharding: str, world: int) -> None:
    """The questions the code asks instead of comparing names, against the names' documented meaning."""
    overrides = [
        f"parallel.strategy={strategy}",
        f"parallel.sharding={sharding}",
        "parallel.replicate=2",
    ]
    if (strategy == "single" and world > 1) or (strategy == "hsdp" and world % 2):
        with pytest.raises(ConfigError):
            dims_of(world, *overrides)
        return
    dims = dims_of(world, *overrides)
    assert dims.world_size == world
    assert dims.distributed == (strategy != "single")  # ddp/fsdp make a process group even alone
    assert dims.ddp_enabled == (strategy == "ddp")
    assert dims.fsdp_enabled == (strategy in ("fsdp", "hsdp"))
    assert dims.shard_enabled == (
        strategy in ("fsdp", "hsdp")
        and sharding != "no_shard"
        and world > (2 if strategy == "hsdp" else 1)
    )


@pytest.mark.parametrize(
    ("world", "overrides", "message"),
    [
        (
            2,
            [],
            "parallel.strategy = 'single' runs one process, but 2 were asked for; use --set "
            "parallel.strategy=ddp (or fsdp, hsdp) for several, or --nproc 1",
        ),
        (
            4,
            ["parallel.strategy=hsdp"],
            "parallel.strategy = 'hsdp' needs parallel.replicate (the number of replica groups, e.g. "
            "the number of nodes)",
        ),
        (
            6,
            ["parallel.strategy=hsdp", "parallel.replicate=4"],
            "parallel.replicate = 4 does not divide the world size 6",
        ),
        (  # the replicate checks hold for no_shard too, though its mesh does not use replicate
            6,
            ["parallel.strategy=hsdp", "parallel.replicate=4", "parallel.sharding=no_shard"],
            "parallel.replicate = 4 does not divide the world size 6",
        ),
    ],
)
def test_a_world_that_cannot_run_it_is_a_config_error(
    world: int, overrides: list[str], message: str
) -> None:
    cfg = load_config(overrides=overrides)
    with pytest.raises(ConfigError) as direct:
        ParallelDims.from_config(cfg, world)
    assert str(direct.value) == message
    with pytest.raises(ConfigError) as checked:  # the launching process's check says the same
        check_world(cfg, world)
    assert str(checked.value) == message


def test_min_world_size() -> None:
    assert ParallelDims.min_world_size(load_config()) == 1
    assert ParallelDims.min_world_size(load_config(overrides=["parallel.strategy=ddp"])) == 1
    assert ParallelDims.min_world_size(load_config(overrides=["parallel.strategy=hsdp"])) == 1
    hsdp3 = load_config(overrides=["parallel.strategy=hsdp", "parallel.replicate=3"])
    assert ParallelDims.min_world_size(hsdp3) == 3
    ParallelDims.from_config(hsdp3, 3)  # and it runs there


def test_the_table_covers_the_schema() -> None:
    schema = get_args(ParallelConfig.model_fields["strategy"].annotation)
    assert [DPWrapper.of(s) for s in schema] == [NONE, DDP, FSDP, FSDP]
    assert strategies_with(NONE, DDP) == ["single", "ddp"]
    assert strategies_with(FSDP) == ["fsdp", "hsdp"]
    with pytest.raises(
        ValueError, match=r"'zero' is not a strategy \(allowed: single, ddp, fsdp, hsdp\)"
    ):
        DPWrapper.of("zero")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp_shard": 0, "wrapper": FSDP, "mesh_dims": ("dp_shard",)}, "at least 1"),
        (
            {"dp_shard": 2, "wrapper": FSDP, "mesh_dims": ("dp_replicate",)},
            r"\['dp_shard'\] are above 1",
        ),
        ({"dp_shard": 2, "wrapper": FSDP, "mesh_dims": ("dp_shard", "dp_shard")}, "distinct"),
        ({"dp_shard": 2, "wrapper": FSDP, "mesh_dims": ("data",)}, "distinct names"),
        ({"dp_replicate": 2}, "not dimensions"),  # wrapper none: one process
        ({"wrapper": DDP}, "only a run without a process group"),
        (
            {"dp_shard": 2, "wrapper": DDP, "mesh_dims": ("dp_shard",)},
            "DDP replicates whole parameters",
        ),
    ],
)
def test_inconsistent_degrees_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_one_process_without_a_group_has_no_mesh() -> None:
    dims = ParallelDims()
    assert dims == dims_of(1) and not dims.distributed and dims.mesh_shape == ()
    with pytest.raises(RuntimeError, match="no device mesh"):
        dims.build_mesh("cpu")
    with pytest.raises(ValueError, match="at least 1"):
        dims_of(0)


def test_the_model_lands_on_the_mesh_of_its_degrees(tmp_path: Path) -> None:
    """Four gloo processes parallelize the debug model under each layout; what the model reports
    (its wrapper, its parameters' mesh and placements) is what the degrees say."""
    out = tmp_path / "meshes.json"
    run_worker("mesh_worker.py", 4, str(out))
    got = json.loads(out.read_text())
    assert got.pop("ddp") == {"wrapper": "ddp", "dtensor": False}

    def sharded(shape: list[int], names: list[str]) -> dict:
        placements = ["shard"] if len(shape) == 1 else ["replicate", "shard"]
        ranks = (
            [0, 1, 2, 3]
            if len(shape) == 1
            else [list(range(r * shape[1], (r + 1) * shape[1])) for r in range(shape[0])]
        )
        return {"wrapper": "fsdp", "dtensor": True, "mesh_shape": shape, "mesh_dims": names,
                "mesh_ranks": ranks, "placements": placements, "same_mesh": True}  # fmt: skip

    assert got == {
        "fsdp-full": sharded([4], ["dp_shard"]),
        "fsdp-shard_grad_op": sharded([4], ["dp_shard"]),
        "fsdp-no_shard": sharded([4, 1], list(HYBRID)),
        "hsdp-1": sharded([1, 4], list(HYBRID)),
        "hsdp-2": sharded([2, 2], list(HYBRID)),
        "hsdp-4": sharded([4, 1], list(HYBRID)),
        "hsdp-2-no_shard": sharded([4, 1], list(HYBRID)),
    }


def _frames(frame: Any) -> Iterator[Any]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def test_a_worker_builds_its_degrees_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that a launcher started (here: this process, as rank 0 of a world of one) checks its
    degrees once, in init_distributed, and everything after asks them."""
    calls: list[int] = []
    build = ParallelDims.from_config.__func__  # type: ignore[attr-defined]

    def counted(cls: type[ParallelDims], config: object, world_size: int) -> ParallelDims:
        # The plan's prediction of the bytes sent (summary.json, without run.comm_bytes) models
        # the layout on its own, as `dtlab plan` does: not the run asking its degrees again.
        planning = any(
            f.f_globals.get("__name__", "").startswith("dtlab.analysis")
            for f in _frames(sys._getframe(1))
        )
        if not planning:
            calls.append(world_size)
        return build(cls, config, world_size)

    monkeypatch.setattr(ParallelDims, "from_config", classmethod(counted))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    summary = dtlab.train(
        None, [*FAST, "parallel.strategy=fsdp", "train.steps=2", f"run.dir={tmp_path / 'run'}"]
    )
    assert summary["steps"] == 2 and summary["strategy"] == "fsdp"
    assert calls == [1]


# --- no strategy names compared outside dtlab.dims ------------------------------------------------
STRATEGIES = set(get_args(ParallelConfig.model_fields["strategy"].annotation))


def strategy_comparisons(path: Path) -> list[str]:
    """Comparisons in ``path`` with a strategy name as an operand (``== "ddp"``, ``in ("fsdp", "hsdp")``)
    or in a tuple of allowed values (``"parallel.strategy": (p.strategy, ("single", "ddp"))``)."""

    def names(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in STRATEGIES
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(names(e) for e in node.elts)

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        operands = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Tuple):  # a (value, allowed) pair of a table
            operands = [e for e in node.elts if isinstance(e, (ast.Tuple, ast.List, ast.Set))]
        if any(names(o) for o in operands):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_comparisons(tmp_path: Path) -> None:
    code = tmp_path / "x.py"
    code.write_text(
        'a = s == "ddp"\nb = s in ("fsdp", "hsdp")\nc = {"k": (s, ("single", "ddp"))}\n'
        'd = s == "full"\ne = ("fsdp full", 2)\n'
    )
    found = strategy_comparisons(code)
    assert [f.split(":")[1] for f in found] == ["1", "2", "3"], found


@pytest.mark.parametrize(
    "path",
    [p.relative_to(SRC).as_posix() for p in sorted(SRC.rglob("*.py")) if p.name != "dims.py"],
)
def test_no_strategy_names_compared_outside_dims(path: str) -> None:
    assert strategy_comparisons(SRC / path) == []
