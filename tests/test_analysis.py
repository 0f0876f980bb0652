"""The analytic model against measurement: collectives counted in real gloo processes, state bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import run_worker
from dtlab.analysis.model import param_shapes, plan_step
from dtlab.config import load_config


def measure(tmp_path: Path, nproc: int, *items: str) -> dict[str, dict[str, Any]]:
    out = tmp_path / f"comm-{nproc}.json"
    run_worker("comm_worker.py", nproc, str(out), *items, timeout=600)
    return {r["item"]: r for r in json.loads(out.read_text())}


def test_measured_collective_bytes_match_the_prediction(tmp_path: Path) -> None:
    two = measure(
        tmp_path,
        2,
        "ddp:full:1",
        "fsdp:full:1",
        "fsdp:shard_grad_op:1",
        "fsdp:full:3",
        "fsdp:no_shard:1",
        "ddp:full:1:fp16",
        "ddp:full:1:powersgd",
        "ddp:full:1:dct",
        "ddp:full:1:demo",
        "fsdp:full:1:bf16",
    )
    params = two["ddp:full:1"]["params"]
    # DDP, fp32: the gradients are all-reduced once, 4 bytes per parameter (+ 4 for the reported loss).
    assert two["ddp:full:1"]["bytes"]["all_reduce"] == 4 * params + 4
    # Compression hooks really fire: fewer bytes than plain DDP (and exactly as predicted, below).
    plain = two["ddp:full:1"]["bytes"]["all_reduce"]
    assert two["ddp:full:1:fp16"]["bytes"]["all_reduce"] == (plain - 4) // 2 + 4
    assert sum(two["ddp:full:1:powersgd"]["bytes"].values()) < plain / 5
    assert two["ddp:full:1:dct"]["bytes"]["all_gather"] < plain / 3
    # DeMo: no gradient all-reduce at all (only the loss and the agreed norm), packed pairs gathered.
    assert two["ddp:full:1:demo"]["bytes"]["all_reduce"] == 8
    assert two["ddp:full:1:demo"]["bytes"]["all_gather"] < plain / 3  # both ranks' pairs
    four = measure(tmp_path, 4, "hsdp:full:1", "fsdp:full:1", "hsdp:full:1:fp16")
    for item, r in {**two, **four}.items():
        for collective, predicted in r["predicted"].items():
            measured = r["bytes"][collective]
            # The model's collectives exactly; the only extra is the scalar loss all-reduce (4 bytes).
            assert abs(measured - predicted) <= 8, (item, collective, measured, predicted)
        assert set(r["bytes"]) <= set(r["predicted"]) | {"all_reduce", "broadcast"}, (item, r)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_state_bytes_per_parameter(world: int) -> None:
    cfg = load_config(overrides=["model.preset=tiny", "parallel.strategy=ddp"])
    shapes = param_shapes(cfg.model)
    n = sum(s.numel for s in shapes)
    ddp = plan_step(cfg, world, shapes)
    # fp32 AdamW: 4 (param) + 4 (grad) + 8 (two moments) = 16 bytes per parameter (+ a step counter per tensor).
    assert ddp.state_bytes - 4 * len(shapes) == 16 * n
    fsdp = plan_step(
        load_config(overrides=["model.preset=tiny", "parallel.strategy=fsdp"]), world, shapes
    )
    per_rank = (fsdp.state_bytes - 4 * len(shapes)) / 16
    assert (
        n / world <= per_rank <= n / world * 1.01
    )  # 16/N bytes per parameter, up to dim-0 padding


def test_plan_llama2_7b_on_8_ranks_without_allocating(tmp_path: Path) -> None:
    code = (
        "import json, resource, sys; from dtlab.cli import main; "
        "rc = main(['plan', '--nproc', '8', '--json', '--set', 'model.preset=llama2-7b', "
        "'data.seq_len=4096', 'train.global_batch_size=64']); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    peak_kib = int(proc.stderr.strip().splitlines()[-1])
    assert (
        peak_kib < 2 * 2**20
    )  # < 2 GiB, while the fp32 weights alone are 25 GiB: nothing was allocated
    plan = json.loads(proc.stdout)
    n = plan["model"]["params"]
    assert 6.7e9 < n < 6.8e9
    rows = {r["label"]: r for r in plan["strategies"]}
    ddp, fsdp = rows["ddp"]["per_rank"], rows["fsdp full"]["per_rank"]
    n_tensors = 32 * 9 + 3
    state = lambda r: r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] - 4 * n_tensors  # noqa: E731
    assert state(ddp) == 16 * n
    assert state(fsdp) == pytest.approx(16 * n / 8, rel=1e-4)
    assert rows["ddp"]["comm"]["bytes_per_step"] == {"all_reduce": 4 * n}
    assert plan["recommendation"]


def test_plan_bad_device_is_a_clear_error() -> None:
    from conftest import run_cli

    proc = run_cli("plan", "--device", "tpu9000")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--device 'tpu9000' is not known" in proc.stderr
