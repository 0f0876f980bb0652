"""The analytic model against measurement: collectives counted in real gloo processes, state bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from conftest import run_cli, run_worker
from dtlab.analysis.devices import PROFILES, loopback_link
from dtlab.analysis.model import flops_per_token, plan_step
from dtlab.analysis.plan import format_plan, plan
from dtlab.config import load_config
from dtlab.models.llama import build_model


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
    # DDP, fp32: the gradients are all-reduced once, 4 bytes per parameter, plus the step's one small
    # reduction: the loss, the overflow flag and one vote per stop signal (5 floats, 20 bytes).
    assert two["ddp:full:1"]["bytes"]["all_reduce"] == 4 * params + 20
    # Compression hooks really fire: fewer bytes than plain DDP (and exactly as predicted, below).
    plain = two["ddp:full:1"]["bytes"]["all_reduce"]
    assert two["ddp:full:1:fp16"]["bytes"]["all_reduce"] == (plain - 20) // 2 + 20
    assert sum(two["ddp:full:1:powersgd"]["bytes"].values()) < plain / 5
    assert two["ddp:full:1:dct"]["bytes"]["all_gather"] < plain / 3
    # DeMo: no gradient all-reduce at all (only the step's reduction, which carries the squared norm
    # of each rank's own gradients too: 6 floats), packed pairs gathered.
    assert two["ddp:full:1:demo"]["bytes"]["all_reduce"] == 24
    assert two["ddp:full:1:demo"]["bytes"]["all_gather"] < plain / 3  # both ranks' pairs
    four = measure(tmp_path, 4, "hsdp:full:1", "fsdp:full:1", "hsdp:full:1:fp16")
    # The bench replays each collective on the group it ran on, with the bytes it moved there: HSDP
    # 2 x 2 gathers and reduce-scatters within a replica (2 ranks) and all-reduces the gradients
    # across the 2 replicas; only the step's reduction spans all 4 (a replay over the whole world
    # moved half as much again per rank).
    hsdp = four["hsdp:full:1"]
    assert sorted((name, size) for name, size, _ in hsdp["replay"]) == [
        ("all_gather", 2), ("all_reduce", 2), ("all_reduce", 4), ("reduce_scatter", 2),
    ], hsdp["replay"]  # fmt: skip
    for r in (*two.values(), *four.values()):
        replayed: dict[str, int] = {}
        for name, _, n in r["replay"]:
            replayed[name] = replayed.get(name, 0) + n
        assert replayed == {k: v for k, v in r["bytes"].items() if k in replayed}, r["item"]
    for item, r in {**two, **four}.items():
        for collective, predicted in r["predicted"].items():
            measured = r["bytes"][collective]
            # The model's collectives exactly, the step's reduction included.
            assert measured == predicted, (item, collective, measured, predicted)
        assert set(r["bytes"]) <= set(r["predicted"]) | {"all_reduce", "broadcast"}, (item, r)


# The debug preset by hand: (dim 0, other elements) of each parameter, in model order.
DEBUG_BLOCK = [
    (64, 1),
    (64, 64),
    (32, 64),
    (32, 64),
    (64, 64),
    (64, 1),
    (192, 64),
    (64, 192),
    (192, 64),
]
DEBUG_SHAPES = [
    (256, 64),
    *DEBUG_BLOCK,
    *DEBUG_BLOCK,
    (64, 1),
    (256, 64),
]  # + embedding, norm, output


@pytest.mark.parametrize(
    "strategy, world, held",
    [
        ("ddp", 2, 131392),  # every element of the debug model
        ("ddp", 3, 131392),
        ("fsdp", 2, 65696),  # every dim 0 is even: exactly half
        (
            "fsdp",
            3,
            44398,
        ),  # dim 0 padded to a multiple of 3: ceil(dim0 / 3) x rest, summed by hand
    ],
)
def test_state_bytes_of_the_debug_model(strategy: str, world: int, held: int) -> None:
    assert sum(a * b for a, b in DEBUG_SHAPES) == 131392
    cfg = load_config(overrides=["model.preset=debug", f"parallel.strategy={strategy}"])
    plan = plan_step(cfg, world)
    # fp32 AdamW: 4 (param) + 4 (grad) + 8 (two moments) bytes per held element, 4 per tensor (step).
    assert (plan.params_bytes, plan.grads_bytes) == (4 * held, 4 * held)
    assert plan.optimizer_bytes == 8 * held + 4 * len(DEBUG_SHAPES)


# The model families' options on the debug model (dim 64, 4 heads, 2 kv heads): Qwen3's heads of 32
# (attention 128 wide) with q/k norms, Qwen2's q/k/v biases, Mistral's window shorter than the sequence.
FAMILIES = {
    "llama": [],
    "qwen3": ["model.head_dim=32", "model.qk_norm=true"],
    "qwen2": ["model.qkv_bias=true"],
    "mistral": ["model.sliding_window=16"],
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flops_per_token_against_counted_matmuls(family: str) -> None:
    """The matmul FLOPs torch's FLOP counter sees in a forward and backward of the debug model (and
    of each family's options: the biases' matmuls count as plain ones), plus the attention scores
    by hand over the query width n_heads x head_dim (the counter does not know CPU attention
    kernels)."""
    cfg = load_config(overrides=["model.preset=debug", "data.seq_len=64", *FAMILIES[family]])
    model = build_model(cfg.model, "cpu")
    batch, seq = 2, 64
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert set(counter.get_flop_counts()["Global"]) <= {torch.ops.aten.mm, torch.ops.aten.addmm}
    # Q K^T and A V: 2 x 2 x T x T x the query width per sequence and layer forward, twice that
    # backward.
    width = cfg.model.n_heads * (cfg.model.head_dim or cfg.model.dim // cfg.model.n_heads)
    attention = 3 * 4 * batch * seq * seq * width * cfg.model.n_layers
    assert flops_per_token(cfg.model, seq) * batch * seq == counter.get_total_flops() + attention


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
    assert n == 6_738_415_616  # Llama 2 7B as published
    rows = {r["label"]: r for r in plan["strategies"]}
    ddp, fsdp = rows["ddp"]["per_rank"], rows["fsdp full"]["per_rank"]
    n_tensors = 32 * 9 + 3
    state = lambda r: r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] - 4 * n_tensors  # noqa: E731
    assert state(ddp) == 16 * n
    assert state(fsdp) == pytest.approx(16 * n / 8, rel=1e-4)
    assert rows["ddp"]["comm"]["bytes_per_step"] == {
        "all_reduce": 4 * n + 20
    }  # + the step's reduction
    assert plan["recommendation"]


def test_plan_bad_device_is_a_clear_error() -> None:
    proc = run_cli("plan", "--device", "tpu9000")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--device 'tpu9000' is not known" in proc.stderr


def test_fault8_plan_this_device_says_what_is_measured_and_what_is_assumed() -> None:
    args = ["--device", "this", "--nproc", "2", "--nnodes", "2", "--set", "model.preset=debug"]
    proc = run_cli("plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    dev = result["device"]
    # The link within this machine is a gloo all-reduce between two local processes, measured now.
    assert dev["intra_node_source"].startswith("measured: gloo all-reduce"), dev
    assert dev["intra_node_gbps"] > 0
    assert dev["source"].startswith("measured: fp32 GEMM") and dev["peak_tflops"] > 0
    assert dev["memory_source"].startswith("looked up: physical memory")
    # Across nodes nothing can be measured from here: it says so.
    assert dev["inter_node_source"].startswith("assumed"), dev
    table = format_plan(result)
    assert "(measured: gloo all-reduce of 4 MiB between 2 local processes" in table
    assert "(assumed: the same as within this machine)" in table
    # The model's own step, measured on this machine at the threads each of 2 ranks gets (2 at once:
    # the ranks of a node share its memory bandwidth).
    probe = dev["probe"]
    assert probe["source"].startswith("measured: training steps of this model on 2 process(es)")
    assert probe["threads"] == max(1, (os.cpu_count() or 1) // 2) and probe["seconds_per_token"] > 0
    assert "step time: compute: this model's step measured on one process" in table
    # A looked-up device says so, and its network figure is an assumption.
    h100 = plan(load_config(overrides=["model.preset=debug"]), 8, 1, PROFILES["h100"], None)
    assert h100["device"]["source"].startswith("looked up")
    assert h100["device"]["inter_node_source"].startswith("assumed")


def test_fault8_a_link_that_cannot_be_measured_is_labelled_assumed() -> None:
    gbps, source = loopback_link(python="/bin/false")  # the second process dies at once
    assert gbps > 0 and source.startswith("assumed: could not be measured"), source
    assert "exited with 1" in source
