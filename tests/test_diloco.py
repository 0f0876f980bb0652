"""DiLoCo and Streaming DiLoCo against their degenerate cases and references: the outer loop's
arithmetic against a hand-written one, H = 1 with SGD against DDP on real gloo processes, quantisation,
bytes per step against the prediction, and kill -9 resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conftest import (
    FAST,
    TOL,
    assert_same_training,
    checkpoint_tensors,
    cli_env,
    read_metrics,
    run_cli,
    run_worker,
    train_run,
)
from dtlab.analysis.model import diloco_agreement_bytes, diloco_sync_bytes, param_shapes
from dtlab.config import DiLoCoOptions, load_config
from dtlab.models.llama import build_model
from dtlab.train.diloco import DiLoCo, fragment_of
from dtlab.train.outer_codec import QUANT_BLOCK, _dequantize, _quantize, payload_bytes


class Toy(nn.Module):
    """Parameters named like the model's: an embedding, four blocks, an output."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tok_embeddings = nn.Parameter(torch.randn(3, 2, generator=g))
        self.layers = nn.ParameterDict(
            {str(i): nn.Parameter(torch.randn(5, generator=g)) for i in range(4)}
        )
        self.output = nn.Parameter(torch.randn(2, 3, generator=g))


def _inner(model: nn.Module, step: int) -> None:
    """A deterministic stand-in for an inner optimizer step."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.sub_(
                0.01
                * (step + i)
                * torch.cos(torch.arange(p.numel(), dtype=torch.float32) + step).view_as(p)
            )


def _frag(name: str, fragments: int) -> int:
    return fragment_of(name, 4, fragments)


def _reference(
    steps: int, h: int, fragments: int, delay: int, lr: float, mu: float
) -> list[torch.Tensor]:
    """Streaming DiLoCo written out for one replica: fragment f sends at steps = ⌊(f+1)H/F⌋ mod H,
    lands ``delay`` steps later: θ_g ← θ_g - lr (Δ + μ buf) (Nesterov), θ ← θ_g + (θ_now - θ_sent)."""
    model = Toy()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    glob = [p.detach().clone() for p in params]
    buf = [torch.zeros_like(p) for p in params]
    offsets = [((f + 1) * h // fragments) % h for f in range(fragments)]
    inflight: dict[int, tuple[int, list[torch.Tensor]]] = {}
    for step in range(1, steps + 1):
        _inner(model, step)
        for f, (due, sent) in list(inflight.items()):
            if due != step:
                continue
            del inflight[f]
            with torch.no_grad():
                for i, n in enumerate(names):
                    if _frag(n, fragments) != f:
                        continue
                    delta = glob[i] - sent[i]
                    buf[i] = mu * buf[i] + delta
                    glob[i] = glob[i] - lr * (delta + mu * buf[i])
                    params[i].copy_(glob[i] + (params[i] - sent[i]))
        for f in range(fragments):
            if step % h == offsets[f]:
                inflight[f] = (step + delay, [p.detach().clone() for p in params])
                if delay == 0:  # lands at once: run the landing above for this step again
                    due, sent = inflight.pop(f)
                    with torch.no_grad():
                        for i, n in enumerate(names):
                            if _frag(n, fragments) == f:
                                delta = glob[i] - sent[i]
                                buf[i] = mu * buf[i] + delta
                                glob[i] = glob[i] - lr * (delta + mu * buf[i])
                                params[i].copy_(glob[i] + (params[i] - sent[i]))
    return [p.detach() for p in params]


@pytest.mark.parametrize(
    ("h", "fragments", "delay"), [(4, 1, 0), (1, 1, 0), (4, 2, 1), (6, 3, 2), (4, 4, 3)]
)
def test_the_outer_loop_is_the_written_out_algorithm(h: int, fragments: int, delay: int) -> None:
    """One replica (no process group): DiLoCo's schedule and arithmetic, fragment by fragment."""
    model = Toy()
    opts = DiLoCoOptions(
        inner_steps=h, fragments=fragments, delay=delay, outer_lr=0.7, outer_momentum=0.9
    )
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), opts, n_layers=4)
    steps = 3 * h + 2
    for step in range(1, steps + 1):
        _inner(model, step)
        diloco.after_step(step)
    want = _reference(steps, h, fragments, delay, 0.7, 0.9)
    for got, ref in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(got.detach(), ref, rtol=0, atol=1e-6)
    # And it did something: the weights are not where the inner steps alone would have left them.
    plain = Toy()
    for step in range(1, steps + 1):
        _inner(plain, step)
    assert any(
        not torch.allclose(a, b)
        for a, b in zip(model.parameters(), plain.parameters(), strict=True)
    )


def test_one_fragment_without_delay_is_diloco() -> None:
    """Streaming's machinery with F = 1, τ = 0 is DiLoCo's whole-model sync, step for step."""
    a, b = Toy(), Toy()
    plain = DiLoCo(a, torch.optim.SGD(a.parameters(), lr=0.1), DiLoCoOptions(inner_steps=3), 4)
    streaming = DiLoCo(
        b,
        torch.optim.SGD(b.parameters(), lr=0.1),
        DiLoCoOptions(inner_steps=3, fragments=1, delay=0),
        4,
    )
    for step in range(1, 11):
        _inner(a, step)
        _inner(b, step)
        plain.after_step(step)
        streaming.after_step(step)
        assert plain.due(step) == streaming.due(step) == ([0] if step % 3 == 0 else [])
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize(("h", "fragments", "delay"), [(4, 2, 1), (6, 3, 2), (4, 1, 0)])
def test_eager_updates_over_two_replicas_are_the_written_out_algorithm(
    h: int, fragments: int, delay: int
) -> None:
    """Two gloo replicas whose inner steps differ: each continues from its own estimate of the outer
    step (its share plus the others' share of the last mean) and lands on the true one, as the
    algorithm written out for both replicas (tests/workers/eager_worker.py) does, to float32 noise."""
    run_worker("eager_worker.py", 2, str(h), str(fragments), str(delay))


def test_eager_without_delay_is_diloco(tmp_path: Path) -> None:
    """Eager updates with delay 0: the estimate is replaced before any step sees it, so the run is
    plain DiLoCo's, exactly: in process, and over two replicas with 2-bit outer gradients (where
    the estimate decodes the replica's own payload)."""
    a, b = Toy(), Toy()
    opts = DiLoCoOptions(inner_steps=3, outer_lr=0.7, outer_momentum=0.9)
    plain = DiLoCo(a, torch.optim.SGD(a.parameters(), lr=0.1), opts, 4)
    eager = DiLoCo(
        b, torch.optim.SGD(b.parameters(), lr=0.1), opts.model_copy(update={"eager": True}), 4
    )
    for step in range(1, 11):
        _inner(a, step)
        _inner(b, step)
        plain.after_step(step)
        eager.after_step(step)
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)
    assert any(o is not None for o in eager.others)  # the estimate's state was kept
    common = [*DILOCO, "parallel.diloco.inner_steps=3", "parallel.diloco.quantize=int2"]
    ref = train_run(tmp_path / "plain", *common, nproc=2)
    got = train_run(tmp_path / "eager", *common, "parallel.diloco.eager=true", nproc=2)
    assert [m["loss"] for m in got] == [m["loss"] for m in ref]
    # With a delay it is another method: the replicas go on from the estimate.
    delayed = [*common, "parallel.diloco.delay=1"]
    lagged = train_run(tmp_path / "delayed", *delayed, nproc=2)
    ahead = train_run(tmp_path / "delayed-eager", *delayed, "parallel.diloco.eager=true", nproc=2)
    assert [m["loss"] for m in ahead] != [m["loss"] for m in lagged]
    assert all(m["outer_sync_s"] >= 0 for m in ahead)


def test_fragments_split_the_blocks_in_order() -> None:
    names = [
        "tok_embeddings.weight",
        *(f"layers.{i}.w" for i in range(6)),
        "norm.weight",
        "output.weight",
    ]
    assert [fragment_of(n, 6, 3) for n in names] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert {fragment_of(n, 6, 1) for n in names} == {0}


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantisation_is_bounded_and_error_feedback_catches_up(bits: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=g) * torch.linspace(0.01, 3, 1000)
    payload, sent = _quantize(x, bits)
    assert payload.numel() == payload_bytes(1000, f"int{bits}")
    assert torch.equal(_dequantize(payload, 1000, bits), sent)
    qmax = 2 ** (bits - 1) - 1
    blocks = torch.nn.functional.pad(x, (0, 24)).view(-1, QUANT_BLOCK).abs().amax(dim=1)
    bound = (blocks / qmax / 2).repeat_interleave(QUANT_BLOCK)[:1000]
    assert torch.all((sent - x).abs() <= bound + 1e-6)
    # Values on the grid pass exactly.
    codes = torch.randint(-qmax, qmax + 1, (4, QUANT_BLOCK), generator=g).float()
    codes[:, 0] = qmax  # each block's largest value sets its scale: 0.25 exactly
    grid = (codes * 0.25).flatten()
    assert torch.equal(_dequantize(_quantize(grid, bits)[0], grid.numel(), bits), grid)
    # Error feedback: what K syncs of the same value sent adds up to K times it, within one step.
    error, total = torch.zeros(1000), torch.zeros(1000)
    for _ in range(50):
        target = x + error
        _, out = _quantize(target, bits)
        error, total = target - out, total + out
    assert torch.all((total - 50 * x).abs() <= bound * 2 + 1e-4)


DILOCO = ["parallel.strategy=ddp", "train.grad_clip=0"]


def test_h1_inner_sgd_outer_sgd_lr1_is_ddp(tmp_path: Path) -> None:
    """The outer step of H = 1 with outer SGD at lr 1 and no momentum averages one inner SGD step
    of each replica: DDP's step with the averaged gradient, to float32 noise."""
    common = [*DILOCO, "train.optimizer=sgd", "train.lr=0.1"]
    ddp = train_run(tmp_path / "ddp", *common, nproc=2)
    outer = [
        "parallel.diloco.inner_steps=1",
        "parallel.diloco.outer_lr=1",
        "parallel.diloco.outer_momentum=0",
    ]
    diloco = train_run(tmp_path / "diloco", *common, *outer, nproc=2)
    assert [m["step"] for m in diloco] == [m["step"] for m in ddp]
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(diloco, ddp, strict=True))
    assert worst < TOL, worst
    assert diloco[-1]["loss"] < diloco[0]["loss"] - 0.02  # it trains
    # Unquantised means exact floats: the same run with quantisation set to none explicitly.
    none = train_run(tmp_path / "none", *common, *outer, "parallel.diloco.quantize=none", nproc=2)
    assert [m["loss"] for m in none] == [m["loss"] for m in diloco]


def _per_step_bytes(tmp_path: Path, nproc: int, *overrides: str) -> dict[str, Any]:
    out = tmp_path / "bytes.json"
    run_worker("diloco_worker.py", nproc, str(out), *overrides)
    return json.loads(out.read_text())


STREAMING = [
    "parallel.diloco.inner_steps=4", "parallel.diloco.fragments=2", "parallel.diloco.delay=1",
]  # fmt: skip


@pytest.mark.parametrize(
    ("quantize", "delay"), [("none", 1), ("int8", 1), ("int4", 1), ("int2", 1), ("int2", 0)]
)
def test_bytes_per_step_are_predicted_to_the_byte(
    tmp_path: Path, quantize: str, delay: int
) -> None:
    result = _per_step_bytes(
        tmp_path, 2, *STREAMING, f"parallel.diloco.quantize={quantize}",
        f"parallel.diloco.delay={delay}",
    )  # fmt: skip
    assert result["measured"] == result["predicted"], result
    # With a delay the agreement has a group of its own, of the outer syncs' ranks (on theirs it
    # would wait for the fragment in flight); without, nothing is in flight: it shares theirs.
    assert result["agreement_apart"] == (delay > 0), result
    assert result["measured_wire"] == result["predicted_wire"], result
    syncs = [b for b in result["measured"] if b > result["measured"][0]]
    assert len(syncs) >= 4  # the fragments' syncs are in there
    # Between syncs, replicas of one rank talk to nobody: not a byte (loss, norm, clipping, stop
    # votes and alerts are each replica's own until the next sync).
    between = [b for s, b in enumerate(result["measured"], 1) if s not in result["sync_steps"]]
    assert between and all(b == 0 for b in between), result


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bytes_inside_and_between_replicas_are_predicted_to_the_byte(
    tmp_path: Path, strategy: str
) -> None:
    """Two replicas of two ranks: every step the replica's own DDP all-reduce or FSDP gathers and
    reduce-scatters, and the outer syncs of each rank's part of the model with its peer's."""
    result = _per_step_bytes(
        tmp_path, 4, *STREAMING, "parallel.diloco.quantize=int4", "parallel.diloco.replicas=2",
        f"parallel.strategy={strategy}",
    )  # fmt: skip
    assert result["measured"] == result["predicted"], result
    assert result["measured_wire"] == result["predicted_wire"], result
    first = result["measured"][0]  # a step without an outer sync: the replica's own collectives
    assert first > 1000
    # Between syncs, every collective stays inside the replica: its step reduction ("replica"), its
    # DDP all-reduce or FSDP's collectives; none along the replicas ("diloco") or over the world.
    inside = ("replica", "dp_replicate", "dp_shard")
    for step, kinds in enumerate(result["by_kind"], 1):
        if step not in result["sync_steps"]:
            assert kinds and all(k.split(" ")[0] in inside for k in kinds), (step, kinds)
    cycle = sum(b - first for b in result["measured"][:4])  # both fragments' syncs, measured
    config = load_config(
        overrides=["model.preset=debug", *STREAMING, "parallel.diloco.quantize=int4"]
    )
    whole = sum(diloco_sync_bytes(param_shapes(config.model), config, 2))
    whole += 2 * diloco_agreement_bytes(2)  # the replicas' agreement with each of the two syncs
    if strategy == "ddp":  # every rank of a replica syncs the whole model with its peer
        assert cycle == whole
    else:  # each rank syncs its shard with its peer's: about half
        assert 0.45 * whole < cycle < 0.55 * whole


@pytest.mark.parametrize(
    "outer",
    [
        ["parallel.diloco.inner_steps=4"],
        [
            "parallel.diloco.inner_steps=4",
            "parallel.diloco.fragments=2",
            "parallel.diloco.delay=1",
            "parallel.diloco.quantize=int4",
        ],
        [
            "parallel.diloco.inner_steps=4",
            "parallel.diloco.fragments=2",
            "parallel.diloco.delay=1",
            "parallel.diloco.topk=0.05",
            "parallel.diloco.chunk=256",
            "parallel.diloco.quantize=int2",
            "parallel.diloco.error_decay=0.95",
        ],
        # Eager updates: the others' share of the last mean and a sync's own share are saved.
        [
            "parallel.diloco.inner_steps=4",
            "parallel.diloco.fragments=2",
            "parallel.diloco.delay=1",
            "parallel.diloco.quantize=int2",
            "parallel.diloco.eager=true",
        ],
        # Blocks wrapped for activation checkpointing: the checkpoint keys are the plain model's.
        ["parallel.diloco.inner_steps=4", "train.activation_checkpointing=selective"],
    ],
    ids=[
        "diloco",
        "streaming-int4",
        "streaming-sparse",
        "streaming-eager",
        "diloco-checkpointed-blocks",
    ],
)
def test_kill_9_resumes_exactly(tmp_path: Path, outer: list[str]) -> None:
    """Killed after step 8, resumed from step 6's checkpoint (a streaming sync in flight there):
    the losses of the run that was never killed."""
    common = [*DILOCO, *outer, "checkpoint.every=3"]
    ref = train_run(tmp_path / "ref", *common, nproc=2)
    run_dir = tmp_path / "run"
    args = [
        "train",
        "--nproc",
        "2",
        "--set",
        *FAST,
        "train.steps=12",
        f"run.dir={run_dir}",
        *common,
    ]
    proc = run_cli(*args, env={**cli_env(), "DTLAB_FAULTS": "kill@8:r1"})
    assert proc.returncode != 0
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(step 6)" in proc.stderr
    got = read_metrics(run_dir)
    assert [m["step"] for m in got] == [m["step"] for m in ref]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in ref], abs=1e-6)
    # A replica's state is its own: another world size is refused, not silently mixed.
    proc = run_cli(
        "train", "--nproc", "1", "--set", *FAST, "train.steps=14", f"run.dir={run_dir}", *common
    )
    assert proc.returncode != 0 and "saved by 2 DiLoCo replicas" in proc.stderr


def test_kill_9_resumes_exactly_with_sharded_replicas(tmp_path: Path) -> None:
    """2 replicas of 2 FSDP ranks, killed after step 8 with a sync in flight at step 6's checkpoint:
    each rank's shard of its replica's weights, moments and outer state comes back; the layout is
    the checkpoint's own."""
    common = [
        *REPLICATED, "parallel.diloco.quantize=int4", "parallel.diloco.replicas=2",
        "parallel.strategy=fsdp", "checkpoint.every=3",
    ]  # fmt: skip
    ref = train_run(tmp_path / "ref", *common, nproc=4)
    run_dir = tmp_path / "run"
    args = [
        "train",
        "--nproc",
        "4",
        "--set",
        *FAST,
        "train.steps=12",
        f"run.dir={run_dir}",
        *common,
    ]
    proc = run_cli(*args, env={**cli_env(), "DTLAB_FAULTS": "kill@8:r1"})
    assert proc.returncode != 0
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(step 6)" in proc.stderr
    got = read_metrics(run_dir)
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in ref], abs=1e-6)
    proc = run_cli(*args[:-1], "parallel.diloco.replicas=1", "train.steps=14")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert (
        "saved by 2 DiLoCo replicas of 2 ranks (sharded over 2) on 4 processes" in proc.stderr
        and "this run: 1 DiLoCo replica of 4 ranks (sharded over 4)" in proc.stderr
    ), proc.stderr[-2000:]


def test_a_resume_between_syncs_reports_the_steps_a_replica_skipped_before_it(
    tmp_path: Path,
) -> None:
    """Replica 1 skips step 2 (not finite); the checkpoint of step 3 falls between the syncs of
    steps 0 and 4; killed at step 5 and resumed from it, the run's step-4 sync still reports that
    skipped step, as the uninterrupted run's does."""
    common = [*DILOCO, "parallel.diloco.inner_steps=4", "checkpoint.every=3"]
    faults = "nan@2:r1"
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    args = ["train", "--nproc", "2", "--set", *FAST, "train.steps=8", *common]
    ref = run_cli(*args, f"run.dir={ref_dir}", env={**cli_env(), "DTLAB_FAULTS": faults})
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = run_cli(
        *args, f"run.dir={run_dir}", env={**cli_env(), "DTLAB_FAULTS": f"{faults},kill@5:r1"}
    )
    assert killed.returncode != 0
    resumed = run_cli(*args, f"run.dir={run_dir}")
    assert resumed.returncode == 0 and "(step 3)" in resumed.stderr, resumed.stderr[-3000:]
    synced = {m["step"]: m for m in read_metrics(ref_dir)}[4]
    assert synced.get("bad_steps") == 1, synced  # the uninterrupted run reports it
    got = {m["step"]: m for m in read_metrics(run_dir)}[4]
    assert got.get("bad_steps") == synced["bad_steps"], got
    assert got["loss"] == pytest.approx(synced["loss"], abs=1e-6)


REPLICATED = ["parallel.strategy=ddp", *STREAMING, "train.grad_clip=0.5"]


@pytest.mark.parametrize(
    ("strategy", "quantize"),
    # With FSDP inside, each rank quantises its own shards: other blocks of 64 values than a whole
    # replica's, so int4 is not the same rounding there; unquantised, it is the same training.
    [("ddp", "int4"), ("fsdp", "none")],
)
def test_replicas_of_two_ranks_train_like_replicas_of_one(
    tmp_path: Path, strategy: str, quantize: str
) -> None:
    """Streaming DiLoCo (Nesterov, clipping active) over 2 replicas of 2 DDP or FSDP ranks each (4
    processes) is the training of 2 one-rank replicas: a replica reads the samples of one rank of 2,
    averages its ranks' gradients (DDP) or shards its weights, moments and outer state over them
    (FSDP), and syncs with the other replica."""
    common = [*REPLICATED, f"parallel.diloco.quantize={quantize}"]
    two = train_run(tmp_path / "two", *common, nproc=2)
    four = train_run(
        tmp_path / strategy, *common, "parallel.diloco.replicas=2",
        f"parallel.strategy={strategy}", nproc=4,
    )  # fmt: skip
    assert_same_training(four, two)
    assert max(m["grad_norm"] for m in four) > 0.5  # clipping was active


def test_one_replica_of_every_rank_with_outer_lr_1_is_ddp(tmp_path: Path) -> None:
    """One replica: the outer step at lr 1 without momentum sets the weights to the replica's own, so
    the training is DDP's over all ranks."""
    ddp = train_run(tmp_path / "ddp", "parallel.strategy=ddp", nproc=2)
    one = train_run(
        tmp_path / "one", "parallel.strategy=ddp", "parallel.diloco.inner_steps=4",
        "parallel.diloco.replicas=1", "parallel.diloco.outer_lr=1",
        "parallel.diloco.outer_momentum=0", nproc=2,
    )  # fmt: skip
    assert_same_training(one, ddp)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("parallel.diloco.inner_steps=-1", "greater than or equal to 0"),
        ("parallel.diloco.fragments=5", "fragments = 5 is more than the model's 2 layers"),
        ("parallel.diloco.delay=4", "delay = 4 must be less than inner_steps = 4"),
    ],
)
def test_bad_settings_are_named(override: str, message: str) -> None:
    from dtlab.errors import ConfigError

    base = ["model.preset=debug", "parallel.strategy=ddp", "parallel.diloco.inner_steps=4"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(overrides=[*base, override])


@pytest.mark.parametrize(
    ("world", "overrides", "message"),
    [
        (
            4,
            ["parallel.diloco.replicas=3"],
            "parallel.diloco.replicas = 3 does not divide the 4 data-parallel ranks (allowed: 1, 2, "
            "4, or null: one per rank)",
        ),
        (
            2,
            ["parallel.strategy=fsdp"],
            "parallel.diloco.replicas = 2 with 2 data-parallel ranks leaves one rank per replica, "
            "which parallel.strategy = 'fsdp' has nothing to shard over",
        ),
        (
            4,
            ["parallel.strategy=hsdp", "parallel.replicate=2", "parallel.diloco.replicas=4"],
            "parallel.diloco.replicas = 4 with 4 data-parallel ranks leaves one rank per replica",
        ),
    ],
)
def test_replica_layouts_a_world_cannot_run_are_named(
    world: int, overrides: list[str], message: str
) -> None:
    from dtlab.config import check_world
    from dtlab.errors import ConfigError

    config = load_config(
        overrides=["parallel.strategy=ddp", "parallel.diloco.inner_steps=4", *overrides]
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_world(config, world)


def test_a_replica_count_that_does_not_divide_is_refused_before_launch(tmp_path: Path) -> None:
    proc = run_cli(
        "train", "--nproc", "2", "--set", *FAST, *DILOCO, "parallel.diloco.inner_steps=4",
        "parallel.diloco.replicas=3", f"run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "parallel.diloco.replicas = 3 does not divide the 2 data-parallel ranks" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.diloco.inner_steps=4", "train.optimizer=adamw"],
        ["train.optimizer=demo"],
    ],
    ids=["diloco", "demo"],
)
def test_each_replica_clips_by_its_own_gradient_norm(tmp_path: Path, overrides: list[str]) -> None:
    """DiLoCo's replicas and DeMo's ranks each clip their own gradients by their own norm, as the
    algorithms do, not by a norm agreed across ranks; a DiLoCo step logs its replica's own norm."""
    out = tmp_path / "clip.json"
    run_worker("clip_worker.py", 2, str(out), "parallel.strategy=ddp", *overrides)
    ranks = json.loads(out.read_text())
    for rank in ranks:
        assert len(rank["clipped"]) == 3
        for r in rank["clipped"]:
            assert r["given"] == pytest.approx(r["own"], rel=1e-5), rank
            assert r["own"] > 0.05  # clipping is active
    # The ranks' gradients differ, so a shared norm could not pass for both.
    own = [[r["own"] for r in rank["clipped"]] for rank in ranks]
    assert all(abs(a - b) > 1e-3 * a for a, b in zip(*own, strict=True)), own
    if "train.optimizer=adamw" in overrides:
        for rank, norms in zip(ranks, own, strict=True):
            assert rank["logged"] == pytest.approx(norms, rel=1e-5)


def test_the_checkpoint_model_is_the_global_model_whichever_rank_saved_it(tmp_path: Path) -> None:
    """Streaming DiLoCo ending between syncs (fragment 1 last synced at step 4 of 6): the replicas'
    weights differ, and what the checkpoint calls the model is θ_global, each fragment's at its last
    sync, identical to every rank's own θ_global; the run says which model that is, and a run
    without DiLoCo refuses to resume it."""
    run_dir = tmp_path / "run"
    common = [
        *DILOCO, "parallel.diloco.inner_steps=4", "parallel.diloco.fragments=2",
        "checkpoint.every=6", f"run.dir={run_dir}",
    ]  # fmt: skip
    proc = run_cli("train", "--nproc", "2", "--set", *FAST, "train.steps=6", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "model.* in its checkpoints, what export, generate and model.init_from read) is the global "
        "model of each fragment's last outer sync, after steps 6 (fragment 0), 4 (fragment 1)"
    ) in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["diloco_model_synced_after"] == [6, 4]
    tensors = checkpoint_tensors(run_dir / "checkpoints" / "step-00000006")
    config = load_config(overrides=[*FAST, *common])
    names = [n for n, _ in build_model(config.model).named_parameters()]
    replicas_differ = False
    for i, name in enumerate(names):
        model = tensors[f"model.{name}"]
        for rank in (0, 1):
            assert torch.equal(model, tensors[f"comm.rank{rank}.global.{i}"]), (name, rank)
        own = [tensors[f"comm.rank{rank}.replica.{i}"] for rank in (0, 1)]
        replicas_differ |= not torch.equal(own[0], own[1])
        if name.startswith("layers.1."):  # fragment 1: both replicas trained on since step 4
            assert not torch.equal(own[0], model), name
    assert replicas_differ
    # Export reads that model, and says which it is.
    proc = run_cli(
        "export", str(run_dir), "--out", str(tmp_path / "export"), "--format", "safetensors"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DiLoCo's global model of the outer syncs after steps 6, 4" in proc.stderr, proc.stderr
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert all(torch.equal(exported[n], tensors[f"model.{n}"]) for n in names)
    proc = run_cli(
        "train", "--nproc", "2", "--set", *FAST, "train.steps=8", *DILOCO, f"run.dir={run_dir}"
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "was saved by a DiLoCo run (parallel.diloco.inner_steps = 4)" in proc.stderr, (
        proc.stderr[-2000:]
    )
