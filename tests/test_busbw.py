"""Collective bus bandwidth (dtlab.analysis.busbw, python -m dtlab.bench.collectives): every collective
checked against the values each rank must receive, the nccl-tests figures, on real gloo processes;
the device and backend each rank takes; the plan's link of a GPU node; the gpu-check's check."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import PYTHON, cli_env
from dtlab.analysis import busbw
from dtlab.analysis.busbw import (
    OPS,
    buffer_numel,
    bus_factor,
    gpus_of,
    measure,
    placement_problem,
)
from dtlab.analysis.devices import PROFILES, gpu_links, node_link
from dtlab.bench.collectives import choose, parse_sizes
from dtlab.errors import DtlabError

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def _simulated(op: str, world: int, numel: int) -> list[torch.Tensor]:
    """What each rank receives from ``op`` when rank q sends ``busbw._input(op, q, ...)``, worked out
    here from the collective's definition (not from the module's own expectation)."""
    cpu = torch.device("cpu")
    ins = [busbw._input(op, q, world, numel, cpu) for q in range(world)]
    if op == "all_reduce":
        return [sum(ins, torch.zeros(numel))] * world
    if op == "all_gather":
        return [torch.cat(ins)] * world
    if op == "reduce_scatter":
        return list(sum(ins, torch.zeros(numel)).chunk(world))
    blocks = [
        x.chunk(world) for x in ins
    ]  # all_to_all: rank r gets block r of every rank, in order
    return [torch.cat([blocks[q][r] for q in range(world)]) for r in range(world)]


@pytest.mark.parametrize("op", OPS)
def test_the_expected_results_are_the_collectives_definitions(op: str) -> None:
    world, numel = 3, buffer_numel(96, 3)
    for rank, want in enumerate(_simulated(op, world, numel)):
        assert torch.equal(busbw._expected(op, rank, world, numel), want), (op, rank)
    # Every rank's values differ from the others', so a rank's data sent to the wrong place shows.
    ins = [busbw._input(op, q, world, numel, torch.device("cpu")) for q in range(world)]
    assert len({tuple(x.tolist()) for x in ins}) == world


def test_every_collective_on_gloo_is_right_and_its_bus_bandwidth_is_nccl_tests() -> None:
    """3 real gloo processes, every collective at two sizes (one not a multiple of the ranks)."""
    result = measure(3, "cpu", [65_536, 100_001], OPS, iters=2, repeats=2, timeout_s=120)
    assert result["backend"] == "gloo" and result["world"] == 3
    assert result["devices"] == ["cpu"] * 3 and result["placement"] == [None] * 3
    rows = result["results"]
    assert [(r["op"], r["size"]) for r in rows] == [
        (op, size)
        for op in OPS
        for size in (65_532, 99_996)  # whole float32 parts per rank
    ]
    for r in rows:
        assert r["correct"], r
        assert r["seconds"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["size"] / r["seconds"] / 1e9)
        factor = (2 if r["op"] == "all_reduce" else 1) * 2 / 3
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)


def test_each_ranks_gpus_are_read_from_the_drivers_list_of_contexts() -> None:
    listing = (
        "4242, GPU-aaaa-1111\n4243, GPU-bbbb-2222\n4242, GPU-cccc-3333\n14242, GPU-dddd-4444\n"
        "4242, GPU-aaaa-1111\n"
    )
    assert gpus_of(4242, listing) == ["GPU-aaaa-1111", "GPU-cccc-3333"]
    assert gpus_of(4243, listing) == ["GPU-bbbb-2222"] and gpus_of(1, listing) == []
    one_each: list[dict[str, Any] | None] = [
        {"gpus": ["GPU-a"]}, {"gpus": ["GPU-b"]}, {"unchecked": "no nvidia-smi"}, None,
    ]  # fmt: skip
    assert placement_problem(one_each) is None
    # A context on GPU 0 from rank 1 (a thread that never set its device, say), or a shared GPU.
    assert placement_problem([{"gpus": ["GPU-a"]}, {"gpus": ["GPU-a", "GPU-b"]}]) == (
        "rank 1 holds CUDA contexts on 2 GPUs: GPU-a, GPU-b"
    )
    assert placement_problem([{"gpus": ["GPU-a"]}, {"gpus": ["GPU-a"]}]) == (
        "ranks 0 and 1 share the GPU GPU-a"
    )


def test_the_bus_factor_and_the_buffer() -> None:
    assert bus_factor("all_reduce", 8) == 1.75 and bus_factor("all_gather", 8) == 0.875
    assert bus_factor("reduce_scatter", 2) == 0.5 and bus_factor("all_to_all", 4) == 0.75
    assert (
        buffer_numel(2**20, 8) == 2**18 and buffer_numel(100, 3) == 24 and buffer_numel(1, 4) == 4
    )


def test_each_rank_takes_its_own_gpu_with_nccl_and_the_cpu_with_gloo() -> None:
    assert busbw.rank_device("cuda", 3) == torch.device("cuda", 3)
    assert busbw.rank_device("cpu", 3) == torch.device("cpu")
    assert busbw.backend_for("cuda") == "nccl" and busbw.backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="'xpu': allowed: cuda, cpu"):
        busbw.backend_for("xpu")
    with pytest.raises(ValueError, match="world 1: a bus bandwidth needs at least 2 ranks"):
        measure(1, "cpu", [1024])
    with pytest.raises(ValueError, match=r"ops \['bcast'\]: allowed"):
        measure(2, "cpu", [1024], ("bcast",))
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="CUDA GPU"):
            measure(2, "cuda", [1024])


def test_a_rank_that_fails_is_named_with_its_last_line(tmp_path: Path) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    spec = {
        "port": store.port, "world": 2, "device_type": "cpu", "backend": "no-such-backend",
        "sizes": [1024], "ops": ["all_reduce"], "iters": 1, "repeats": 1, "timeout_s": 30,
    }  # fmt: skip
    with pytest.raises(
        RuntimeError, match=r"rank \d of the bus bandwidth measurement exited with 1: "
    ):
        busbw._run_ranks(spec, 2, 30.0, tmp_path)


def test_the_cli_prints_the_table_and_refuses_bad_arguments(tmp_path: Path) -> None:
    out = tmp_path / "busbw.json"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PYTHON, "-m", "dtlab.bench.collectives", *args], capture_output=True, text=True,
            cwd=ROOT, env=cli_env(NO_GPU), timeout=300,
        )  # fmt: skip

    proc = run("--sizes", "64K", "--ops", "all_reduce,all_to_all", "--iters", "2", "--repeats",
               "1", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "gloo collectives among 2 ranks (2 CPU processes)" in proc.stdout
    assert "| all_reduce | 64 KiB |" in proc.stdout and "| all_to_all | 64 KiB |" in proc.stdout
    saved = json.loads(out.read_text())
    assert [r["op"] for r in saved["results"]] == ["all_reduce", "all_to_all"]
    assert all(r["correct"] for r in saved["results"])
    for args, said in [
        (["--sizes", "0"], "--sizes '0': '0' is not a size"),
        (["--ops", "all_reduce,bcast"], "--ops 'all_reduce,bcast': bcast is not a collective"),
        (["--device", "cuda"], "--device cuda: this machine's torch sees 0 CUDA GPU(s)"),
        (["--nproc", "1"], "--nproc 1: allowed: 2 or more"),
        (["--json", str(tmp_path)], "is a directory"),
    ]:
        proc = run(*args)
        assert proc.returncode == 2 and said in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_sizes_and_the_default_ranks() -> None:
    assert parse_sizes("64K,1M,1G,100,1M") == [65_536, 2**20, 2**30, 100]
    assert parse_sizes("2MiB") == [2 * 2**20]
    with pytest.raises(DtlabError, match=r"'1\.5M' is not a size"):
        parse_sizes("1.5M")
    if not torch.cuda.is_available():
        assert choose("auto", None) == ("cpu", 2) and choose("cpu", 4) == ("cpu", 4)
    with pytest.raises(DtlabError, match="--device 'tpu': allowed: auto, cuda or cpu"):
        choose("tpu", None)


def test_a_gpu_nodes_link_is_measured_with_two_devices_and_looked_up_with_one() -> None:
    """The plan's decision for a GPU node, read with gloo processes standing in for the GPUs: one
    device, the card's datasheet link; two or more, their all-reduce's bus bandwidth, measured."""
    h100 = PROFILES["h100"]
    intra, source, inter, inter_source = gpu_links("NVIDIA H100 80GB HBM3", 1)
    assert (intra, inter) == (h100.intra_node_gbps, h100.inter_node_gbps)
    assert source.startswith("looked up: the NVIDIA H100 80GB HBM3's")
    intra, source, _, _ = gpu_links("Some New GPU", 1)
    assert intra == h100.intra_node_gbps and source.startswith("assumed: an H100's")
    assert node_link(1, "cpu") is None
    intra, source, inter, inter_source = gpu_links("NVIDIA H100 80GB HBM3", 2, "cpu", 2**20)
    assert source.startswith("measured: gloo all-reduce bus bandwidth of 1 MiB among this node's 2")
    assert 0 < intra != h100.intra_node_gbps
    assert inter == h100.inter_node_gbps and inter_source.startswith("looked up")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_collectives_across_the_gpus_are_right_each_rank_on_its_own_gpu() -> None:
    """Every collective over NCCL among all the GPUs torch sees, each result right, rank r on
    cuda:r."""
    n = torch.cuda.device_count()
    result = measure(n, "cuda", [2**20], OPS, iters=5, repeats=2)
    assert result["backend"] == "nccl"
    assert result["devices"] == [f"cuda:{r}" for r in range(n)]
    assert all(r["correct"] and r["busbw_gbps"] > 0 for r in result["results"])
    assert placement_problem(result["placement"]) is None, result["placement"]
