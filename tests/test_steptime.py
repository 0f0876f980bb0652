"""The plan's step-time model: what overlaps (DDP's buckets, FSDP's prefetch) on which devices, how a
layout's rank shares the model's work, and the measured CPU model of ``--device this``."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, cli_env, run_cli, run_worker
from dtlab.analysis.devices import PROFILES
from dtlab.analysis.model import param_shapes
from dtlab.analysis.plan import format_plan, predict_step, spans_nodes
from dtlab.analysis.probe import (
    ComputeProbe,
    compute_seconds,
    measure_probe,
    rank_share,
    rank_threads,
    sharing,
    time_slicing,
    wrapper_seconds,
)
from dtlab.analysis.step_wait import oversubscribed
from dtlab.analysis.steptime import (
    Link,
    collective_waits,
    ddp_buckets,
    ddp_exposed,
    exposed_comm,
    fsdp_exposed,
    wait_seconds,
)
from dtlab.config import load_config
from dtlab.dims import ParallelDims

GPU = Link(100.0)  # another engine moves the bytes: all of their time can hide
CPU = Link(1.0, cpu_gbps=1.0)  # the cores copy them: none can
CAPPED = Link(0.125, cpu_gbps=1.0)  # a 1 Gbit/s link the cores fill in an eighth of its time


def test_ddp_buckets_are_of_the_configured_size() -> None:
    assert ddp_buckets(60 * 2**20, 25) == [25 * 2**20, 25 * 2**20, 10 * 2**20]
    assert ddp_buckets(2**19, 25) == [2**19]


def test_the_collectives_a_step_issues_are_counted_as_the_bench_counts_them() -> None:
    # The counts dtlab bench measured on the tiny model (4 blocks): ddp 2 all-reduces (one bucket
    # and the step's reduction), fsdp 10 all-gathers, 5 reduce-scatters and 1 all-reduce, ZeRO-1
    # one all-to-all, one all-gather, one all-reduce; a pipeline rank of 2 micro-batches sends 2
    # and receives 2, with the step's reduction.
    sets = ["model.preset=tiny", "data.seq_len=256", "train.global_batch_size=16"]

    def count(extra: list[str], world: int) -> int:
        cfg = load_config(None, [*sets, *extra])
        dims = ParallelDims.from_config(cfg, world)
        m = 2 if dims.pp_enabled else 1
        return sum(collective_waits(cfg, dims, cfg.model.n_layers // dims.pp, m).values())

    assert count(["parallel.strategy=ddp"], 2) == 2
    # DDP's reducer issues its buckets during backward and waits once, whatever their number.
    assert count(["parallel.strategy=ddp", "parallel.bucket_mb=1"], 2) == 2
    assert count(["parallel.strategy=fsdp"], 4) == 16
    assert count(["parallel.strategy=hsdp", "parallel.replicate=2"], 4) == 21
    assert count(["parallel.strategy=ddp", "parallel.sharding=optimizer"], 2) == 3
    assert count(["parallel.strategy=single", "parallel.pp=2"], 2) == 5
    # Tensor parallelism: 7 all-reduces per block, the embedding's and the output's, and the
    # vocabulary-parallel loss's 3.
    assert count(["parallel.strategy=single", "parallel.tp=2"], 2) == 1 + 7 * 4 + 2 + 3
    # Sequence parallelism: 4 all-gathers and 4 reduce-scatters per block, one of each at the ends,
    # in forward and in backward, the loss's 3, and once a step the norms' gradients' all-reduce
    # (test_the_step_waits_for_the_collectives_a_real_step_issues counts a real step's).
    sp = ["parallel.strategy=single", "parallel.tp=2", "parallel.sequence_parallel=true"]
    assert count(sp, 2) == 1 + 2 * (4 * 4 + 2) + 3 + 1


_MOE = "model.preset=tiny-moe,model.dim=64,model.n_heads=4,model.n_kv_heads=2"


_TP = "parallel.strategy=single,parallel.tp=2"


@pytest.mark.parametrize(
    ("nproc", "layouts"),
    [
        pytest.param(
            2,
            [
                f"{_TP},train.micro_batch_size=8",
                f"{_TP},parallel.sequence_parallel=true,train.micro_batch_size=8",
                # Context parallelism: the ring's passes, the all-to-alls, DDP's average over the
                # cp ranks, and FSDP's shards over them reduced with each micro-batch.
                "parallel.strategy=ddp,parallel.cp=2",
                "parallel.strategy=ddp,parallel.cp=2,parallel.cp_method=alltoall",
                "parallel.strategy=fsdp,parallel.cp=2,train.micro_batch_size=4",
            ],
            id="tensor-context-two-ranks",
        ),
        pytest.param(
            2,
            [
                _TP,
                f"{_TP},parallel.sequence_parallel=true",
                # float8's scales agreed inside DTensor's dispatch: precomputed for FSDP's
                # float8 gathers, and rowwise ones a row.
                "parallel.strategy=fsdp,parallel.tp=2,train.precision=bf16,train.float8.enabled=true",
                f"{_TP},train.precision=bf16,train.float8.enabled=true,"
                "train.float8.recipe=rowwise,train.micro_batch_size=8",
                # Precomputed over FSDP's shards of the cp ranks.
                "parallel.strategy=fsdp,parallel.cp=2,train.precision=bf16,train.float8.enabled=true",
            ],
            id="tensor-float8-two-ranks",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            4,
            [
                "parallel.strategy=ddp,train.micro_batch_size=2",
                "parallel.strategy=ddp,parallel.sharding=optimizer",
                "parallel.strategy=fsdp,train.micro_batch_size=2",
                "parallel.strategy=hsdp,parallel.replicate=2",
                "parallel.strategy=fsdp,parallel.tp=2,parallel.sequence_parallel=true,"
                "train.activation_checkpointing=full",
                "parallel.strategy=fsdp,parallel.pp=2",
                "parallel.strategy=single,parallel.tp=2,parallel.pp=2",
            ],
            id="data-tensor-pipeline",
        ),
        pytest.param(
            4,
            [
                "parallel.strategy=ddp,parallel.tp=2,parallel.sequence_parallel=true",
                "parallel.strategy=fsdp,parallel.pp=2,parallel.sharding=shard_grad_op",
                "parallel.strategy=ddp,parallel.tp=2,train.activation_checkpointing=selective",
                "parallel.strategy=single,parallel.pp=4,parallel.pp_schedule=interleaved_1f1b,"
                "train.micro_batch_size=4,model.n_layers=8,model.tie_embeddings=true",
                "parallel.strategy=single,parallel.pp=2,parallel.tp=2,parallel.sequence_parallel=true,"
                "parallel.pp_schedule=zbv,train.micro_batch_size=4",
                f"{_MOE},parallel.strategy=ddp,parallel.ep=2,parallel.tp=2",
                f"{_MOE},parallel.strategy=ddp,parallel.ep=2,parallel.pp=2",
                # The norms' half-precision gradients reduced with each micro-batch FSDP reduces.
                "parallel.strategy=fsdp,parallel.tp=2,parallel.sequence_parallel=true,"
                "train.precision=bf16,train.micro_batch_size=2",
            ],
            id="schedules-recompute-experts",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_the_step_waits_for_the_collectives_a_real_step_issues(
    nproc: int, layouts: list[str]
) -> None:
    """Each layout's whole step (one micro-batch or several) on ``nproc`` gloo ranks, its
    collectives counted by torch's profiler on the rank that issues the most, against the waits the
    step-time model counts (a context-parallel rank fed its part of each sequence)."""
    run_worker("waits_worker.py", nproc, *layouts)


def test_one_bucket_waits_whole_and_many_hide_behind_backward() -> None:
    grads, backward = 12 * 2**20, 0.4
    comm = GPU.seconds(grads)
    # One 25 MiB bucket over 12 MiB: its all-reduce starts when backward ends.
    one = ddp_exposed(grads, 25, backward, comm, GPU)
    assert one == pytest.approx(comm, rel=1e-6)
    # 1 MiB buckets: each is reduced while backward makes the next; only the last one waits.
    many = ddp_exposed(grads, 1, backward, comm, GPU)
    assert many == pytest.approx(comm / 12, rel=1e-6)
    # Communication longer than backward: what backward cannot cover waits, whatever the buckets.
    slow = ddp_exposed(grads, 1, backward, 10 * backward, GPU)
    assert slow > 9 * backward


def test_on_a_cpu_nothing_hides_and_a_capped_link_hides_its_wait() -> None:
    grads, backward = 12 * 2**20, 0.4
    comm = CPU.seconds(grads)
    assert ddp_exposed(grads, 1, backward, comm, CPU) == pytest.approx(comm)
    # At 1 Gbit/s, 1 MiB buckets hide the link's wait but not the cores' copying (an eighth).
    capped = CAPPED.seconds(grads)
    exposed = ddp_exposed(grads, 1, backward, capped, CAPPED)
    assert capped / 8 <= exposed < capped / 2
    assert ddp_exposed(grads, 25, backward, capped, CAPPED) > 0.9 * capped
    # FSDP2 waits for its collectives on a CPU; on a GPU its prefetch hides all but the first unit.
    assert fsdp_exposed(1.0, 10.0, 5, CPU, "cpu") == 1.0
    assert fsdp_exposed(1.0, 10.0, 5, GPU, "cuda") == pytest.approx(0.2)
    assert fsdp_exposed(1.0, 0.4, 5, GPU, "cuda") == pytest.approx(1.0 - 0.4 * 4 / 5)


def test_the_plan_hides_ddp_and_fsdp_collectives_on_a_gpu_but_not_tp() -> None:
    h100 = PROFILES["h100"]
    sets = ["model.preset=llama3.1-8b", "data.seq_len=2048", "train.global_batch_size=32"]
    for strategy in ("ddp", "fsdp"):
        row = predict_step(load_config(None, [*sets, f"parallel.strategy={strategy}"]), 8, 1, h100)
        assert row.exposed_s is not None and 0 < row.exposed_s < row.comm_s
        assert row.step_time_s == pytest.approx(row.compute_s + row.recompute_s + row.exposed_s)
    tp = predict_step(
        load_config(None, [*sets, "parallel.strategy=single", "parallel.tp=8"]), 8, 1, h100
    )
    assert tp.exposed_s == pytest.approx(tp.comm_s) and tp.comm_s > 0


def test_a_rank_computes_its_stage_and_slice_and_steps_its_shard() -> None:
    sets = ["model.preset=debug", "data.seq_len=64"]
    shapes = param_shapes(load_config(None, sets).model)

    def share(extra: list[str], world: int) -> tuple[float, float]:
        cfg = load_config(None, [*sets, *extra])
        return rank_share(cfg, ParallelDims.from_config(cfg, world), shapes)

    assert share(["parallel.strategy=ddp"], 4) == (1.0, 1.0)
    flops, params = share(["parallel.strategy=fsdp"], 4)
    assert flops == 1.0 and params == pytest.approx(0.25, rel=0.05)  # padding of odd shapes
    assert share(["parallel.strategy=ddp", "parallel.sharding=optimizer"], 4)[1] == pytest.approx(
        0.25, rel=0.05
    )
    tp_flops, tp_params = share(["parallel.strategy=single", "parallel.tp=2"], 2)
    assert tp_flops == pytest.approx(0.5) and tp_params < 0.6
    # Two stages of the debug model's two blocks: the last holds the output projection too.
    pp_flops, _ = share(["parallel.strategy=single", "parallel.pp=2"], 2)
    assert 0.5 < pp_flops < 1.0


def test_ranks_sharing_the_cores_compute_slower() -> None:
    assert sharing(2, 1, 2) == 1.0 and sharing(8, 1, 2) == 4.0 and sharing(1, 2, 2) == 1.0
    probe = ComputeProbe(1, 2, 1e-4, 0.01, 1000, 64, "test")
    two = compute_seconds(probe, 2048, 1.0, 1.0, 2)
    assert two == pytest.approx(2048 * 1e-4 + 0.01)
    assert compute_seconds(probe, 2048, 1.0, 1.0, 8) == pytest.approx(4 * two)
    assert compute_seconds(probe, 2048, 0.5, 0.25, 2, bubble=0.5) == pytest.approx(
        2048 * 1e-4 + 0.0025
    )
    # Four ranks on two cores: a pipeline's bubble (a third) is filled by the other ranks' turns.
    assert compute_seconds(probe, 2048, 0.5, 0.25, 4, bubble=1 / 3) == pytest.approx(
        2 * (1024 * 1e-4 + 0.0025)
    )
    # A part of each pass that does not grow with its tokens: once per micro-batch, for the
    # rank's share of the model.
    passing = ComputeProbe(1, 2, 1e-4, 0.01, 1000, 64, "test", pass_seconds=0.05)
    assert compute_seconds(passing, 2048, 1.0, 1.0, 2) == pytest.approx(two + 0.05)
    assert compute_seconds(passing, 2048, 0.5, 0.25, 2, passes=4) == pytest.approx(
        1024 * 1e-4 + 0.5 * 4 * 0.05 + 0.0025
    )
    # Where the ranks outnumber the cores, what the time slicing was measured to cost beyond
    # their share; nothing where they fit the cores.
    sliced = ComputeProbe(1, 2, 1e-4, 0.01, 1000, 64, "test", slicing=1.1)
    assert compute_seconds(sliced, 2048, 1.0, 1.0, 8) == pytest.approx(4 * 1.1 * two)
    assert compute_seconds(sliced, 2048, 1.0, 1.0, 2) == pytest.approx(two)


def test_the_time_slicing_is_the_ranks_steps_at_once_over_their_share() -> None:
    cfg = load_config(None, ["model.preset=debug", "data.seq_len=64"])
    probe = ComputeProbe(1, 2, 1e-4, 0.01, 1000, 64, "test", pass_seconds=0.002)
    one = 2 * 64 * 1e-4 + 0.002 + 0.01  # a step of 2 samples alone
    # Eight ranks on two cores, each step 2 samples: four times the step alone at least.
    assert time_slicing(probe, cfg, 2, 8, [4 * one * 1.2, 4 * one * 1.1, 9.0]) == pytest.approx(1.2)
    # Quicker than their share is the measurements' noise; nothing measured, nothing added.
    assert time_slicing(probe, cfg, 2, 8, [one]) == 1.0
    assert time_slicing(probe, cfg, 2, 8, []) == 1.0


def test_each_layouts_measured_code_cost_counts_where_that_layout_runs() -> None:
    """FSDP's per unit and micro-batch, ZeRO-1's once a step, tensor parallelism's per block and
    micro-batch and per block and token; stretched by the cores' sharing; nothing for DDP."""
    sets = ["model.preset=debug", "data.seq_len=64", "train.global_batch_size=8"]
    probe = ComputeProbe(1, 2, 1e-4, 0.01, 1000, 64, "test")
    costs = {"fsdp_unit_s": 0.001, "zero_step_s": 0.1, "tp_block_s": 0.01, "tp_token_s": 1e-5}
    costs.update(sp_block_s=0.002, sp_token_s=-4e-6)  # sequence parallelism: slower, then faster

    def extra(layout: list[str], world: int) -> float:
        cfg = load_config(None, [*sets, *layout])
        return wrapper_seconds(cfg, ParallelDims.from_config(cfg, world), costs, world, probe)

    layers = load_config(None, sets).model.n_layers
    assert extra(["parallel.strategy=ddp"], 2) == 0.0
    assert extra(["parallel.strategy=ddp", "parallel.sharding=optimizer"], 2) == pytest.approx(0.1)
    # Four ranks on two cores: each rank's code takes twice as long.
    assert extra(["parallel.strategy=ddp", "parallel.sharding=optimizer"], 4) == pytest.approx(0.2)
    assert extra(["parallel.strategy=fsdp"], 2) == pytest.approx(0.001 * (layers + 1))
    two = extra(["parallel.strategy=fsdp", "train.micro_batch_size=2"], 2)
    assert two == pytest.approx(0.001 * (layers + 1) * 2)  # two micro-batches a step
    # One micro-batch of 8 x 64 tokens; then two of half as many: the per-token part is the same.
    tp = (0.01 + 1e-5 * 512) * layers
    assert extra(["parallel.strategy=single", "parallel.tp=2"], 2) == pytest.approx(tp)
    halves = extra(["parallel.strategy=single", "parallel.tp=2", "train.micro_batch_size=4"], 2)
    assert halves == pytest.approx(tp + 0.01 * layers)
    # Sequence parallelism adds its difference from plain TP: here it saves at 512 tokens.
    sp = ["parallel.strategy=single", "parallel.tp=2", "parallel.sequence_parallel=true"]
    assert extra(sp, 2) == pytest.approx(tp + (0.002 - 4e-6 * 512) * layers)
    assert extra(sp, 2) < extra(["parallel.strategy=single", "parallel.tp=2"], 2)
    # A difference larger than TP's whole cost leaves nothing, not a negative cost.
    costs.update(sp_block_s=-1.0)
    assert extra(sp, 2) == 0.0


def test_the_wrappers_cost_leaves_out_the_fake_groups_collectives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fake group's collectives copy their inputs into their outputs, a copy a real
    collective's measured time holds: the step is timed without the time spent inside them."""
    import torch.distributed as dist

    import dtlab.analysis.wrappers as wrappers

    clock = [0.0]
    monkeypatch.setattr(wrappers.time, "perf_counter", lambda: clock[0])

    def collective(*args: object, **kwargs: object) -> None:  # a quarter second inside it
        clock[0] += 0.25

    monkeypatch.setattr(dist, "all_to_all_single", collective)

    def step() -> None:  # a second of its own, and two collectives
        clock[0] += 0.5
        dist.all_to_all_single(None, None)
        clock[0] += 0.5
        dist.all_to_all_single(None, None)

    with wrappers._collectives_timed() as spent:
        assert wrappers._less(step, spent) == pytest.approx(1.0)
        assert wrappers._less(step, spent) == pytest.approx(1.0)
    assert dist.all_to_all_single is collective  # put back
    assert wrappers._seconds(step) == pytest.approx(1.5)


def test_the_probe_times_the_model_and_its_optimizer_apart() -> None:
    # (ZeRO-1's config: its sharding is refused by the one process the probe runs, unless dropped.)
    overrides = ["parallel.strategy=ddp", "parallel.sharding=optimizer"]
    cfg = load_config(None, ["model.preset=debug", "data.seq_len=64", *overrides])
    threads = torch.get_num_threads()
    probe = measure_probe(cfg, 1)
    assert torch.get_num_threads() == threads  # the probe's threads are put back
    assert probe.threads == 1 and probe.cores == (os.cpu_count() or 1)
    assert probe.seconds_per_token > 0 and probe.fixed_seconds > 0
    # A step of 2,048 tokens takes seconds at most on any CPU, and more than its optimizer alone.
    assert probe.seconds_per_token * 2048 < 10 and probe.fixed_seconds < 1
    assert "2,048 and 64 tokens, median of 5" in probe.source
    assert probe.pass_seconds >= 0


WRAPPER_KINDS = {"sharded", "zero", "tensor", "tensor_many", "sequence", "sequence_many"}


@pytest.mark.parametrize(
    ("overrides", "measured"),
    [
        (["parallel.strategy=ddp", "parallel.sharding=optimizer"], WRAPPER_KINDS),
        (["parallel.strategy=ddp", "parallel.fault_tolerance.enabled=true"], WRAPPER_KINDS),
        (["parallel.strategy=hsdp", "parallel.replicate=2"], WRAPPER_KINDS),
        (["parallel.strategy=fsdp", "parallel.cp=2", "parallel.tp=2"], WRAPPER_KINDS),
        (["parallel.strategy=ddp", "parallel.diloco.inner_steps=4"], WRAPPER_KINDS),
        (["parallel.strategy=ddp", "parallel.compression=powersgd"], WRAPPER_KINDS),
        (["parallel.strategy=single", "parallel.pp=2"], WRAPPER_KINDS),
        # What the model or the training refuses is not measured (the plan never lays it out so).
        (["model.preset=debug-moe", "parallel.strategy=fsdp", "parallel.ep=2"],
         WRAPPER_KINDS - {"sequence", "sequence_many"}),
        (["parallel.strategy=ddp", "train.compile=true"], {"sharded", "zero"}),
        (["data.seq_len=63"], WRAPPER_KINDS - {"sequence", "sequence_many"}),
    ],
)  # fmt: skip
def test_the_probes_measure_the_model_of_any_layout(
    overrides: list[str], measured: set[str]
) -> None:
    """The probes run a config's model in their own layouts (one process, FSDP, ZeRO-1, tensor
    and sequence parallelism): the config's own layout is dropped whole, since its settings (ZeRO-1's
    sharding, fault tolerance, context parallelism) are refused with another."""
    from dtlab.analysis import probe_step, wrappers

    cfg = load_config(None, ["model.preset=debug", "data.seq_len=64", *overrides])
    single = probe_step._single(cfg, 2)
    assert single.parallel == type(cfg.parallel).model_validate({"strategy": "single"})
    assert single.model == cfg.model and single.train.global_batch_size == 2
    assert single.train.activation_checkpointing == "none"
    assert {k for k in WRAPPER_KINDS if wrappers._runs(cfg, k, 2)} == measured
    for kind in measured:
        layout = wrappers._layout(cfg, kind, 2)
        assert layout.model == cfg.model
        assert layout.parallel.cp == 1 and not layout.parallel.fault_tolerance.enabled
        assert layout.parallel.sequence_parallel == kind.startswith("sequence")


@pytest.mark.parametrize(
    ("pass_s", "expected"), [(0.5, (1e-3, 0.5)), (-0.05, ((2048e-3 - 0.05) / 2048, 0.0))]
)
def test_the_probe_splits_a_pass_into_its_tokens_part_and_its_fixed_part(
    monkeypatch: pytest.MonkeyPatch, pass_s: float, expected: tuple[float, float]
) -> None:
    """Steps timed at the probe's tokens and at one sample: the line through the two; where its
    fixed part comes out negative (noise), the probe's tokens' figure alone."""
    import dtlab.analysis.probe as probe_mod

    cfg = load_config(None, ["model.preset=debug", "data.seq_len=64"])

    def fake_step(config: object, threads: int, batch: int):  # the step's (total, optimizer)
        return lambda: (pass_s + 1e-3 * batch * 64 + 0.2, 0.2)

    monkeypatch.setattr(probe_mod, "probe_step", fake_step)
    probe = measure_probe(cfg, 1)
    assert probe.fixed_seconds == pytest.approx(0.2)
    assert (probe.seconds_per_token, probe.pass_seconds) == pytest.approx(expected)
    # The probe's own step is predicted as measured, either way.
    assert compute_seconds(probe, 2048, 1.0, 1.0, 2) == pytest.approx(pass_s + 2.048 + 0.2)


def test_plan_this_device_prints_its_measured_collectives_and_step(tmp_path) -> None:
    args = ["--device", "this", "--nproc", "2", "--set", "model.preset=debug", "data.seq_len=64"]
    proc = run_cli("plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    dev = result["device"]
    rates = dev["collective_gbps"]
    # The step's wait only where the 2 ranks' threads outnumber the cores (dtlab.analysis.step_wait).
    crowded = oversubscribed(2, rank_threads(2), os.cpu_count() or 1)
    kinds = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert set(rates) == kinds | {"sync_s"} | ({"step_wait_s"} if crowded else set())
    assert all(0 < v < math.inf for k, v in rates.items() if k in kinds)
    # What a collective costs beyond its bytes: 0 where the measurement saw none (it is clamped).
    assert 0 <= rates["sync_s"] < 1
    assert dev["collective_source"].startswith("measured: gloo among 2 local processes")
    # What FSDP's, ZeRO-1's and tensor parallelism's code adds, measured under the fake group.
    costs = dev["wrapper_s"]
    tp_keys = {"tp_block_s", "tp_token_s", "sp_block_s", "sp_token_s"}
    assert set(costs) == {"fsdp_unit_s", "zero_step_s"} | tp_keys
    # Sequence parallelism's are differences from plain TP's (it may save): any sign.
    assert all(0 <= v < 1 for k, v in costs.items() if not k.startswith("sp_"))
    assert all(abs(costs[k]) < 1 for k in ("sp_block_s", "sp_token_s"))
    text = format_plan(result)
    assert "  groups   all_reduce" in text and "  step     " in text and "  wrappers " in text
    assert dev["probe"]["pass_seconds"] >= 0 and "per pass (micro-batch)" in text


def test_calibration_measures_and_predicts_each_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cal.json"
    proc = subprocess.run(
        [PYTHON, "-m", "dtlab.bench.calibrate", "--quick", "--steps", "2", "--warmup", "1",
         "--rounds", "2", "--json", str(out), "--set", "model.preset=debug", "data.seq_len=64"],
        capture_output=True, text=True, env=cli_env(None), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["layout"] for r in rows] == ["ddp (2)", "fsdp (2)"]
    for r in rows:
        assert r["measured_s"] > 0 and r["predicted"]["step_time_s"] > 0
        assert r["error"] == pytest.approx(r["predicted"]["step_time_s"] / r["measured_s"] - 1)
        # Two rounds, each its own run: the row's step is the median of their medians.
        assert len(r["measured_rounds_s"]) == 2 and result["rounds"] == 2
        assert r["measured_s"] == pytest.approx(statistics.median(r["measured_rounds_s"]))
        assert r["measured_min_s"] <= min(r["measured_rounds_s"])
        # The inputs measured again in each round: each round's rows predicted from its own.
        assert len(r["predicted_rounds_s"]) == 2
        assert r["predicted"]["step_time_s"] == pytest.approx(
            statistics.median(r["predicted_rounds_s"])
        )
    assert len(result["inputs_rounds"]) == 2
    assert [set(i["probes"]) for i in result["inputs_rounds"]] == [{"tiny x 2"}] * 2
    assert result["probes"] == result["inputs_rounds"][0]["probes"]
    assert result["mean_abs_error"] == pytest.approx(sum(abs(r["error"]) for r in rows) / 2)
    assert result["worst"]["layout"] in {r["layout"] for r in rows}
    assert "mean absolute error" in proc.stdout
    # One pair of layouts on 2 processes: the plan orders it one way or the other.
    assert result["ranking"]["pairs"] == 1 and result["ranking"]["tau"] in (-1.0, 1.0)
    assert "Kendall's tau" in proc.stdout

    # Predicted again from the inputs the calibration recorded (nothing measured): the same plan
    # on the same inputs gives each row's prediction to the bit, and the errors follow.
    from dtlab.bench import calibrate

    capped = {**rows[0], "layout": "ddp (2) at 1gbit", "link": "1gbit"}
    again = calibrate.replanned({**result, "rows": [*rows, capped]})
    assert [r["layout"] for r in again["rows"]] == ["ddp (2)", "fsdp (2)"]  # capped: left out
    for r, was in zip(again["rows"], rows, strict=True):
        assert r["predicted"] == was["predicted"] and r["error"] == was["error"]
    assert again["ranking"] == result["ranking"] and again["replanned"]
    for bad, why in [("{", "cannot read it"), ('{"rows": []}', "not a calibration's --json")]:
        (tmp_path / "bad.json").write_text(bad)
        assert calibrate.main(["--replan", str(tmp_path / "bad.json")]) == 2
        assert why in capsys.readouterr().err


def _row(layout: str, nproc: int, measured: float, predicted: float, spread: float = 0.01) -> dict:
    return {
        "layout": layout, "model": "tiny", "nproc": nproc, "link": "none", "error": 0.0,
        "measured_s": measured, "measured_min_s": measured - spread,
        "measured_max_s": measured + spread, "predicted": {"step_time_s": predicted},
    }  # fmt: skip


def test_the_ranking_counts_pairs_within_one_job_and_the_noise_as_ties() -> None:
    from dtlab.bench.calibrate import ranking

    same = [_row("a", 2, 1.0, 0.5), _row("b", 2, 2.0, 0.9), _row("c", 2, 3.0, 1.4)]
    assert ranking(same)["tau"] == pytest.approx(1.0) and ranking(same)["discordant"] == []
    flipped = [_row("a", 2, 1.0, 1.4), _row("b", 2, 2.0, 0.9), _row("c", 2, 3.0, 0.5)]
    assert ranking(flipped)["tau"] == pytest.approx(-1.0)
    # A pair on another process count is another job: not compared.
    assert ranking([*same, _row("d", 4, 0.1, 9.0)])["pairs"] == 3
    # b and c's steps overlap: the measurement cannot order them, so the flip is a tie there.
    close = [_row("a", 2, 1.0, 0.5), _row("b", 2, 2.0, 1.5, 0.3), _row("c", 2, 2.2, 1.4, 0.3)]
    r = ranking(close)
    assert r["tau"] == pytest.approx(1 / 3)  # (2 concordant - 1 discordant) / 3 pairs
    assert r["tau_beyond_noise"] == pytest.approx(2 / math.sqrt(3 * 2))  # tau-b: one tie
    assert [d["layouts"] for d in r["discordant"]] == [["b", "c"]]
    assert not r["discordant"][0]["beyond_noise"]
    # The plan tells apart a-b (0.5 against 1.5) and a-c, not b-c (1.5 against 1.4: within its
    # tie margin); both measured in its order.
    assert (r["apart"], r["apart_agree"]) == (2, 2)
    assert (ranking(flipped)["apart"], ranking(flipped)["apart_agree"]) == (3, 0)


def test_over_rounds_a_pair_is_ordered_when_every_round_orders_it_alike() -> None:
    from dtlab.bench.calibrate import ranking

    def rounds(layout: str, each: list[float], predicted: float) -> dict:
        # Wide step ranges that overlap: with rounds, they no longer decide the ties.
        row = _row(layout, 2, sorted(each)[1], predicted, spread=1.0)
        return {**row, "measured_rounds_s": each}

    # a is faster than b in every round; b and c swap places from one round to the next.
    rows = [
        rounds("a", [1.0, 1.1, 1.2], 0.5),
        rounds("b", [2.0, 2.4, 2.1], 1.5),
        rounds("c", [2.1, 2.2, 2.3], 1.4),
    ]
    r = ranking(rows)
    # The medians: a < b (2.1) < c (2.2), the plan c before b: one pair of three flipped.
    assert r["tau"] == pytest.approx(1 / 3)
    # b-c is a tie of the measurement (rounds 1 and 3 against round 2); a-b and a-c are ordered
    # although every timed step's range overlaps (spread 1.0).
    assert r["tau_beyond_noise"] == pytest.approx(2 / math.sqrt(3 * 2))
    assert [d["layouts"] for d in r["discordant"]] == [["b", "c"]]
    assert not r["discordant"][0]["beyond_noise"]
    # With every round agreeing the flip is beyond the noise.
    rows[2]["measured_rounds_s"] = [2.1, 2.5, 2.2]
    r = ranking(rows)
    assert r["discordant"][0]["beyond_noise"]
    assert r["tau_beyond_noise"] == pytest.approx(1 / 3)


def test_a_group_strided_by_tensor_parallelism_crosses_nodes() -> None:
    # fsdp 8 x tp 4 on 4 nodes of 8: a tensor-parallel group sits in a node, but each FSDP group
    # takes one rank of every tensor-parallel group: 8 ranks 4 apart, over all 4 nodes.
    sets = ["model.preset=llama3.1-70b", "data.seq_len=4096", "train.global_batch_size=64"]
    cfg = load_config(None, [*sets, "parallel.strategy=fsdp", "parallel.tp=4"])
    dims = ParallelDims.from_config(cfg, 32)
    assert spans_nodes("all_gather", 8, dims, 8) and spans_nodes("reduce_scatter", 8, dims, 8)
    assert not spans_nodes("tp all_reduce", 4, dims, 8)
    # Its FSDP traffic at the network's rate: slower than the same bytes at NVLink's.
    row = predict_step(cfg, 8, 4, PROFILES["h100"])
    step = row.step
    dp = sum(step.comm_bus_bytes[k] for k in ("all_gather", "reduce_scatter"))
    assert row.comm_s > dp / (PROFILES["h100"].inter_node_gbps * 1e9)
    # A pipeline's neighbouring stages of 8-rank slices on nodes of 8 are on different nodes.
    pp = load_config(None, [*sets, "parallel.strategy=fsdp", "parallel.tp=8", "parallel.pp=2"])
    assert spans_nodes("send/recv", 2, ParallelDims.from_config(pp, 16), 8)


def _crosses(dims: ParallelDims, names: tuple[str, ...], nproc: int) -> bool:
    """Whether any group along the mesh dimensions ``names`` (flattened) has ranks on two nodes of
    ``nproc``: the ranks as ``init_device_mesh`` lays them out, row-major over ``mesh_dims``
    (whose dimensions above 1 keep the order of every dimension's, ``degrees``)."""
    names_all = list(dims.degrees)
    ranks = torch.arange(dims.world_size).view(*dims.degrees.values())
    axes = [names_all.index(n) for n in names]
    size = math.prod(dims.degrees[n] for n in names)
    groups = ranks.movedim(axes, list(range(-len(axes), 0))).reshape(-1, size).tolist()
    return any(len({r // nproc for r in g}) > 1 for g in groups)


ACROSS_BASE = ["model.preset=llama3.2-1b", "data.seq_len=4096", "train.global_batch_size=64"]
# (layout's --set, world, ranks a node): the plan's every collective against the mesh's groups.
ACROSS = [
    (["parallel.strategy=fsdp", "parallel.diloco.replicas=2", "parallel.diloco.inner_steps=10"], 16, 8),
    (["parallel.strategy=ddp", "parallel.diloco.replicas=4", "parallel.diloco.inner_steps=10"], 16, 8),
    (["parallel.strategy=hsdp", "parallel.replicate=2", "parallel.cp=2"], 16, 8),
    (["parallel.strategy=fsdp", "parallel.pp=2", "parallel.cp=2"], 8, 4),
    (["parallel.strategy=fsdp", "parallel.cp=2", "parallel.tp=2"], 8, 4),
    (["parallel.strategy=fsdp", "parallel.tp=4"], 32, 8),
    (["parallel.strategy=ddp", "parallel.pp=2", "parallel.tp=2"], 8, 4),
]  # fmt: skip


@pytest.mark.parametrize(("sets", "world", "nproc"), ACROSS, ids=[" ".join(a[0]) for a in ACROSS])
def test_a_collective_crosses_nodes_where_the_meshs_groups_do(
    sets: list[str], world: int, nproc: int
) -> None:
    """Every collective of the step is judged across nodes exactly where a group of the mesh the
    trainer builds has ranks on two nodes: DiLoCo's outer sync (one rank of each replica, the
    trainer's own ``outer_peers``), HSDP's replicas and a pipeline's stages under cp, FSDP over the
    data x cp ranks, tensor parallelism's groups."""
    from dtlab.train.diloco import outer_peers

    cfg = load_config(None, [*ACROSS_BASE, *sets])
    dims = ParallelDims.from_config(cfg, world)
    step = predict_step(cfg, nproc, world // nproc, PROFILES["h100"]).step
    # The groups each collective runs over in the trainer (FSDP's mesh: its shards over the data x
    # cp ranks, its replicas; DDP's average inside a DiLoCo replica; the pipeline's stages).
    along: dict[str, tuple[str, ...]] = {
        "send/recv": ("pp",),
        "dp_replicate all_reduce": ("dp_replicate", "cp"),
    }
    if dims.fsdp_enabled:
        fsdp = ("dp_shard", "cp") if dims.fsdp_shard > dims.dp_shard else ("dp_shard",)
        along.update(all_gather=fsdp, reduce_scatter=fsdp)
        along["all_reduce"] = ("dp_replicate", "cp") if dims.cp_replicates else ("dp_replicate",)
    judged = 0
    for collective, group in step.comm_groups.items():
        if group == dims.world_size:  # the whole world's (the step's reduction, on the way)
            crosses = dims.world_size > nproc
        elif collective.startswith("diloco "):
            peers = outer_peers(dims)
            crosses = any(len({r // nproc for r in g}) > 1 for g in peers)
        elif collective.split()[0] in ("tp", "cp"):
            crosses = _crosses(dims, (collective.split()[0],), nproc)
        elif collective in along:
            crosses = _crosses(dims, along[collective], nproc)
        else:
            continue  # the step's reduction over the replica: a few bytes
        assert spans_nodes(collective, group, dims, nproc) == crosses, collective
        judged += 1
    assert judged >= 2, step.comm_groups


def test_diloco_replicas_on_two_nodes_sync_at_the_networks_rate() -> None:
    # diloco 2 x fsdp 8 on 2 nodes of 8: each replica a node, the outer sync between them; on one
    # node of 16 the same collectives, every one inside the node. Only the sync's time differs.
    cfg = load_config(None, [*ACROSS_BASE, *ACROSS[0][0]])
    h100 = PROFILES["h100"]
    two, one = predict_step(cfg, 8, 2, h100), predict_step(cfg, 16, 1, h100)
    bus = two.step.comm_bus_bytes["diloco all_reduce"]
    slower = bus / (h100.inter_node_gbps * 1e9) - bus / (h100.intra_node_gbps * 1e9)
    assert slower > 0 and two.comm_s - one.comm_s == pytest.approx(slower, rel=1e-3)


def test_a_smaller_group_waits_for_fewer_ranks() -> None:
    # The wait is measured among all 4 processes: a group of 4 waits it whole, a pair a third of it.
    assert wait_seconds({4: 10}, 0.01, 4) == pytest.approx(0.1)
    assert wait_seconds({2: 30}, 0.01, 4) == pytest.approx(0.1)
    assert wait_seconds({8: 1}, 0.01, 4) == pytest.approx(0.01)  # no more than measured
    assert wait_seconds({2: 5}, 0.01, 1) == 0.0
    cfg = load_config(None, ["model.preset=tiny", "parallel.strategy=fsdp", "parallel.tp=2"])
    waits = collective_waits(cfg, ParallelDims.from_config(cfg, 4), 4, 1)
    assert waits == {4: 1, 2: 15 + 33}  # the step's reduction; FSDP's pairs and TP's pairs


@pytest.mark.parametrize("compression", ["powersgd", "dct"])
def test_a_stateful_hook_runs_on_one_bucket_at_backwards_end_and_nothing_hides(
    compression: str,
) -> None:
    """Under PowerSGD or the DCT, DDP keeps its first bucket layout (the hook's state follows it),
    which torch builds as one bucket of every gradient: the hook runs once backward is done, so
    its collectives wait whole, where plain DDP's and fp16's buckets hide behind backward. The
    layout itself: DDP built on the debug model with 0.1 MiB buckets holds one bucket until its
    first rebuild, which the hook's state forbids."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtlab.analysis.hook_memory import hook_buckets
    from dtlab.models.llama import build_model

    base = ["model.preset=debug", "parallel.strategy=ddp", "parallel.bucket_mb=0.1"]
    link = Link(450.0)
    waits = {}
    for kind in ("none", "fp16", compression):
        config = load_config(overrides=[*base, f"parallel.compression={kind}"])
        dims = ParallelDims.from_config(config, 2)
        waits[kind] = exposed_comm(config, dims, {"all_reduce": 1e-3}, 1.0, 0.0, link, "cuda", 2)
    assert waits["none"] < 1e-3 and waits["fp16"] < 1e-3
    assert waits[compression] == pytest.approx(1e-3)
    config = load_config(overrides=base)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        ddp = DistributedDataParallel(
            build_model(config.model).to_empty(device="cpu"), bucket_cap_mb=0.1
        )
        built = [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    finally:
        dist.destroy_process_group()
    assert built == hook_buckets(param_shapes(config.model)) and len(built) == 1


def test_plan_this_device_refuses_a_batch_no_layout_splits_before_measuring(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """16 samples over 3 ranks: the plan's refusal, not a minute of probing first."""
    import dtlab.analysis.probe as probe_mod
    from dtlab.cli import main

    def probed(*_: object) -> None:
        raise AssertionError("the machine was measured before the refusal")

    monkeypatch.setattr(probe_mod, "with_probe", probed)
    sets = ["model.preset=debug", "data.seq_len=64", "train.global_batch_size=16"]
    assert main(["plan", "--device", "this", "--nproc", "3", "--set", *sets]) == 2
    assert "cannot be split over 3 ranks" in capsys.readouterr().err
