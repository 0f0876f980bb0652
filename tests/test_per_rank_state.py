"""Each rank's own state (DiLoCo's outer state and replica, compression residuals, PowerSGD's memories,
DeMo's momenta) where it is used: a checkpoint loads it into CPU templates, and it must land on the
rank's device (DiLoCo's outer state: in host memory, pinned with a GPU); DiLoCo saves views of its
live tensors, not copies; the plan predicts the outer state's host memory."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from conftest import FAST, read_metrics, run_cli
from dtlab.analysis.model import param_shapes, plan_step
from dtlab.config import DiLoCoOptions, load_config
from dtlab.models.llama import build_model
from dtlab.parallel.compression import (
    CompressionState,
    DCTState,
    PowerSGDGuard,
    QuantDCTState,
)
from dtlab.runtime.placement import placed
from dtlab.train.demo import DeMoState
from dtlab.train.diloco import DiLoCo, fragment_of, outer_state_pinned
from dtlab.train.outer_copies import STAGE_VALUES, copies_off_compute_stream, stage_values

META = torch.device("meta")
# Streaming DiLoCo with everything it keeps: momentum, error feedback, a sync in flight.
STREAMING = DiLoCoOptions(
    inner_steps=4,
    fragments=2,
    delay=1,
    quantize="int8",
    outer_lr=0.7,
    outer_momentum=0.9,
    replicas=None,
)


class Toy(nn.Module):
    """Parameters named like the model's: an embedding, four blocks, an output."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tok_embeddings = nn.Parameter(torch.randn(3, 2, generator=g).to(device))
        self.layers = nn.ParameterDict(
            {str(i): nn.Parameter(torch.randn(5, generator=g).to(device)) for i in range(4)}
        )
        self.output = nn.Parameter(torch.randn(2, 3, generator=g).to(device))


def _train(model: nn.Module, opt: torch.optim.Optimizer, diloco: DiLoCo, steps: range) -> None:
    """Inner AdamW steps on a deterministic loss, each followed by DiLoCo."""
    for step in steps:
        opt.zero_grad()
        loss = sum(((p - 0.1 * step) ** 2).sum() for p in model.parameters())
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        opt.step()
        diloco.after_step(step)


def _setup(device: str = "cpu") -> tuple[Toy, torch.optim.Optimizer, DiLoCo]:
    model = Toy(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt, DiLoCo(model, opt, STREAMING, n_layers=4)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _outer_tensors(d: DiLoCo) -> list[torch.Tensor]:
    held = [
        *d.global_, *d.momentum, *d.error, *d.others,
        *(s for p in d.pending for s in p.snapshot), *(s for p in d.pending for s in p.own or []),
    ]  # fmt: skip
    return [t for t in held if t is not None]


def test_the_outer_state_is_pinned_only_for_a_replica_on_a_cuda_device() -> None:
    assert outer_state_pinned(torch.device("cuda", 1))
    assert not outer_state_pinned(torch.device("cpu"))
    assert not outer_state_pinned(META)


def test_the_outer_states_copies_leave_the_compute_stream_only_on_a_gpu() -> None:
    """Which stream copies the outer state back to host memory: a side stream for a replica on a
    CUDA device, none on the CPU (updated in place: nothing is copied); and how large the two
    staging buffers they pass through are: the rank's largest parameter, up to STAGE_VALUES."""
    assert copies_off_compute_stream(torch.device("cuda", 3))
    assert not copies_off_compute_stream(torch.device("cpu"))
    assert not copies_off_compute_stream(META)
    _, _, diloco = _setup()
    assert diloco.copies is None
    assert stage_values([6, 5, 5]) == 6
    assert stage_values([3, STAGE_VALUES + 1]) == STAGE_VALUES
    assert stage_values([]) == 1


def test_diloco_saves_views_of_its_live_state() -> None:
    """Every tensor of the state dict is the live one (no copy at a save): the replica's weights,
    the inner optimizer's moments, θ_global, momentum, error feedback and the sync in flight."""
    model, opt, diloco = _setup()
    _train(model, opt, diloco, range(1, 6))  # fragment 1 was sent after step 4, lands after 5
    _train(model, opt, diloco, range(6, 7))  # fragment 0 sent after step 6: in flight
    assert diloco.pending and all(m is not None for m in diloco.momentum)
    sd = diloco.state_dict()
    params = list(model.parameters())
    for i, p in enumerate(params):
        assert _shares(sd[f"replica.{i}"], p)
        assert sd[f"global.{i}"] is diloco.global_[i]
        assert sd[f"momentum.{i}"] is diloco.momentum[i]
        assert sd[f"error.{i}"] is diloco.error[i]
        for name in ("exp_avg", "exp_avg_sq"):
            assert _shares(sd[f"inner.{i}.{name}"], opt.state[p][name])
    sync = diloco.pending[0]
    assert sd["pending.0.buffer"] is sync.buffer
    assert all(sd[f"pending.0.snapshot.{n}"] is s for n, s in enumerate(sync.snapshot))
    # The outer state is in host memory (on the CPU, plain: nothing to pin for).
    assert all(t.device.type == "cpu" and not t.is_pinned() for t in _outer_tensors(diloco))


def _to_templates(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a checkpoint hands to load_state_dict: CPU tensors of their own; the outer state's here
    in float64, as another dtype than the live float32."""
    out = {}
    for k, v in sd.items():
        outer = k.split(".")[0] in ("global", "momentum", "error") or ".snapshot." in k
        out[k] = v.detach().to("cpu", torch.float64 if outer else v.dtype, copy=True)
    return out


def test_a_loaded_diloco_state_goes_where_the_live_state_lives_and_resumes_exactly() -> None:
    """Loaded from CPU templates of other dtypes: the outer state in float32 host memory, tensors of
    its own; the sync in flight's buffer on the replica's device (here the meta device, standing for
    a GPU); the replica's weights in its parameters. On the CPU, the resumed replica then trains
    exactly as the uninterrupted one."""
    model, opt, diloco = _setup()
    _train(model, opt, diloco, range(1, 7))
    saved = _to_templates(diloco.state_dict())

    other = _setup()
    other[2].device = META  # where a sync's collective ran
    other[2].load_state_dict(saved)
    assert other[2].pending[0].buffer.device == META
    assert other[2].pending[0].buffer.dtype == torch.uint8  # int8 payloads
    for t in _outer_tensors(other[2]):
        assert t.device.type == "cpu" and t.dtype == torch.float32
        assert not any(_shares(t, s) for s in saved.values())

    resumed = _setup()
    resumed[2].load_state_dict(saved)
    for a, b in zip(resumed[0].parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    _train(model, opt, diloco, range(7, 15))
    _train(*resumed, range(7, 15))
    for a, b in zip(resumed[0].parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert any(
        not torch.equal(a, b) for a, b in zip(model.parameters(), Toy().parameters(), strict=True)
    )


@pytest.mark.parametrize("quant", [False, True])
def test_dct_state_loads_onto_the_device_of_its_buckets(quant: bool) -> None:
    state: DCTState | QuantDCTState
    if quant:
        state = QuantDCTState(chunk_size=8, bits=4, error_feedback=True)
        saved = {"own.0": torch.randn(2, 8), "mean.0": torch.randn(2, 8)}
    else:
        state = DCTState(chunk_size=8, topk=2, error_feedback=True)
        saved = {"residual.0": torch.randn(16), "residual.3": torch.randn(5)}
    comp = CompressionState("dct", state, device=META)
    comp.load_state_dict(saved)
    loaded = comp.state_dict()
    assert loaded.keys() == saved.keys()
    assert all(t.device == META and t.shape == saved[k].shape for k, t in loaded.items())
    # Without a device (a state made by hand), each tensor stays where it was, as a copy.
    state.load_state_dict(saved)
    for k, t in state.state_dict().items():
        assert t.device.type == "cpu" and torch.equal(t, saved[k]) and not _shares(t, saved[k])


def test_powersgd_memories_load_onto_the_device_of_its_buckets() -> None:
    guard = PowerSGDGuard(powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1))
    comp = CompressionState("powersgd", guard, device=META)
    saved = {
        "error.0": torch.randn(12),
        "p.0": torch.randn(4, 1),
        "q.0": torch.randn(3, 1),
        "iter": torch.tensor(7),
    }
    comp.load_state_dict(saved)
    s = guard.state
    assert s.iter == 7
    for d in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
        assert list(d) == [0] and d[0].device == META


def test_demo_momenta_load_onto_their_parameters_devices() -> None:
    state = DeMoState([META, torch.device("cpu")])
    saved = {"momentum.0": torch.randn(8, dtype=torch.float64), "momentum.1": torch.randn(8)}
    state.load_state_dict(saved)
    assert state.momenta[0].device == META and state.momenta[0].dtype == torch.float32
    assert state.momenta[1].device.type == "cpu"
    assert torch.equal(state.momenta[1], saved["momentum.1"])
    assert not _shares(state.momenta[1], saved["momentum.1"])


def test_placed_pins_only_when_asked() -> None:
    t = torch.arange(4.0)
    out = placed(t, torch.device("cpu"), torch.float64)
    assert out.dtype == torch.float64 and not _shares(out, t) and torch.equal(out, t.double())
    assert placed(t, META).device == META


def _host_peak(diloco: DiLoCo, steps: int) -> int:
    """The most host memory the outer state held (bytes), at any sync's landing or step's end."""
    peak = 0

    def held(extra: list[torch.Tensor]) -> int:
        tensors = {id(t): t for t in [*_outer_tensors(diloco), *extra]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    land = diloco._land

    def measured_land(sync: Any) -> None:
        nonlocal peak
        peak = max(peak, held([*sync.snapshot, *(sync.own or [])]))
        land(sync)
        peak = max(peak, held([]))

    diloco._land = measured_land  # type: ignore[method-assign]
    for step in range(1, steps + 1):
        diloco.after_step(step)
        peak = max(peak, held([]))
    return peak


# Streaming with a delay longer than the fragments' spacing: both fragments in flight at once.
OVERLAPPING = [
    "parallel.diloco.inner_steps=6", "parallel.diloco.fragments=2", "parallel.diloco.delay=4",
    "parallel.diloco.quantize=int4",
]  # fmt: skip


@pytest.mark.parametrize(
    "outer",
    [
        ["parallel.diloco.inner_steps=4", "parallel.diloco.outer_momentum=0.9"],
        ["parallel.diloco.inner_steps=4"],
        OVERLAPPING,
        [*OVERLAPPING, "parallel.diloco.eager=true", "parallel.diloco.outer_momentum=0.5"],
        ["parallel.diloco.inner_steps=4", "parallel.diloco.eager=true"],
    ],
    ids=["diloco", "no-momentum", "streaming-int4", "streaming-int4-eager", "eager-no-delay"],
)
def test_the_plan_predicts_the_outer_state_in_host_memory(outer: list[str]) -> None:
    """To the byte, against the outer state a DiLoCo of the debug model holds; in host memory: the
    device's peak is the plain step's, unless a sync is in flight through the step (its buffer on
    the device; what the device holds is checked in test_plan_check)."""
    config = load_config(overrides=["model.preset=debug", *outer])
    plain = load_config(overrides=["model.preset=debug"])
    plan = plan_step(config, 1)
    model = build_model(config.model, device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, opt, config.parallel.diloco, config.model.n_layers)
    assert plan.host_bytes == _host_peak(diloco, 2 * config.parallel.diloco.inner_steps)
    assert plan_step(plain, 1).host_bytes == 0
    in_flight = plan.total_bytes - plan_step(plain, 1).total_bytes
    assert in_flight > 0 if config.parallel.diloco.delay else in_flight == 0
    assert plan.as_dict()["per_rank"]["host_bytes"] == plan.host_bytes


def test_the_plan_shows_what_a_nodes_ranks_keep_in_host_memory_together() -> None:
    """8 one-rank DiLoCo replicas of llama3.2-1b on a node: each rank's outer state, and the
    node's 8 together (against the node's memory where the plan knows it: this machine's)."""
    from dtlab.analysis.devices import PROFILES
    from dtlab.analysis.plan import plan
    from dtlab.analysis.plan_format import _node_host_line, format_bytes, format_plan

    config = load_config(overrides=[
        "model.preset=llama3.2-1b", "parallel.strategy=ddp", "parallel.diloco.inner_steps=30",
        "parallel.diloco.replicas=8",
    ])  # fmt: skip
    p = plan(config, 8, 1, PROFILES["h100"], None)
    assert p["host_memory_gib"] is None  # a named profile: the node's own memory is not in it
    per_rank = max(r["per_rank"]["host_bytes"] for r in p["strategies"] if "error" not in r)
    assert per_rank > 2**33  # θ_global and the outer momentum of 1.2B parameters, float32
    text = format_plan(p)
    assert (
        f"per node, its 8 ranks together: {format_bytes(8 * per_rank)} (the node's own memory is "
        "not in the device profile: compare it there)"
    ) in text
    assert _node_host_line(8, 2**30, 16.0) == (
        "per node, its 8 ranks together: 8.0 GiB, of this machine's 16.0 GiB of host memory: 50%"
    )
    assert _node_host_line(8, 4 * 2**30, 16.0).endswith(": MORE THAN THE NODE HAS")
    plain = plan(load_config(overrides=["model.preset=debug"]), 2, 1, PROFILES["h100"], None)
    assert "per node" not in format_plan(plain)


def _in_flight_by_walking(config: Any) -> int:
    """The most fragment elements whose sync is in flight after any inner step, step by step."""
    o = config.parallel.diloco
    frags = [0] * o.fragments
    for s in param_shapes(config.model):
        frags[fragment_of(s.name, config.model.n_layers, o.fragments)] += s.numel
    h = o.inner_steps
    offsets = [((k + 1) * h // o.fragments) % h for k in range(o.fragments)]
    return max(
        sum(n for n, off in zip(frags, offsets, strict=True) if (s - off) % h < max(o.delay, 1))
        for s in range(h)
    )


@pytest.mark.parametrize(
    ("inner_steps", "fragments", "delay"),
    [(6, 2, 4), (7, 3, 0), (12, 4, 5), (10, 4, 9), (5, 4, 1), (9, 2, 8), (13, 3, 6), (4, 4, 3)],
)
def test_the_peak_in_flight_is_found_at_the_offsets(
    inner_steps: int, fragments: int, delay: int
) -> None:
    """The plan looks at each fragment's offset only (`dtlab plan` walked every inner step, and hung
    on inner_steps = 2**31 - 1): the same peak as a walk over every step."""
    outer = [f"parallel.diloco.inner_steps={inner_steps}", f"parallel.diloco.fragments={fragments}",
             f"parallel.diloco.delay={delay}", "parallel.diloco.outer_momentum=0"]  # fmt: skip
    config = load_config(overrides=["model.preset=tiny", *outer])
    held = sum(s.numel for s in param_shapes(config.model))
    assert plan_step(config, 1).host_bytes == 4 * (held + _in_flight_by_walking(config))


def test_the_plan_of_a_huge_inner_steps_is_immediate() -> None:
    """2**31 - 1 inner steps in 4 fragments, delayed by nearly a period: all four overlap."""
    h = 2**31 - 1
    config = load_config(
        overrides=["model.preset=tiny", f"parallel.diloco.inner_steps={h}",
                   "parallel.diloco.fragments=4", f"parallel.diloco.delay={h - 1}",
                   "parallel.diloco.outer_momentum=0.9"]
    )  # fmt: skip
    held = sum(s.numel for s in param_shapes(config.model))
    assert plan_step(config, 1).host_bytes == 4 * (2 * held + held)  # θ_global, momentum, in flight


# --- on a GPU ------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_outer_state_is_in_pinned_host_memory_and_trains_as_on_the_cpu() -> None:
    """A replica on the GPU: θ_global, momentum, error feedback and snapshots in pinned host memory,
    the sync in flight's buffer on the GPU, the state dict views of the live tensors; the weights
    follow the CPU run's (the same arithmetic, on the GPU, to float32 noise)."""
    cpu = _setup()
    gpu = _setup("cuda")
    _train(*cpu, range(1, 7))
    _train(*gpu, range(1, 7))
    model, _, diloco = gpu
    assert diloco.pending and diloco.pending[0].buffer.device.type == "cuda"
    outer = _outer_tensors(diloco)
    assert len(outer) > len(diloco.global_)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in outer)
    sd = diloco.state_dict()
    for i, p in enumerate(model.parameters()):
        assert _shares(sd[f"replica.{i}"], p) and sd[f"global.{i}"] is diloco.global_[i]
    for a, b in zip(gpu[0].parameters(), cpu[0].parameters(), strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)
    # A load from CPU templates (a resume) keeps it so, and the next steps run.
    diloco.load_state_dict(_to_templates(sd))
    assert all(t.is_pinned() for t in _outer_tensors(diloco))
    assert diloco.pending[0].buffer.device.type == "cuda"
    _train(*gpu, range(7, 13))
    _train(*cpu, range(7, 13))
    for a, b in zip(gpu[0].parameters(), cpu[0].parameters(), strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)


SIDE_STREAM_OPTIONS = {
    "int8, 2 fragments, delay 1": STREAMING,
    "dense, delay 0": DiLoCoOptions(inner_steps=3, outer_lr=0.7, outer_momentum=0.9, replicas=None),
    "int4, 4 fragments, delay 2, eager": DiLoCoOptions(
        inner_steps=4, fragments=4, delay=2, quantize="int4", eager=True, outer_lr=0.7,
        outer_momentum=0.9, replicas=None,
    ),
}  # fmt: skip


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", list(SIDE_STREAM_OPTIONS))
@pytest.mark.parametrize("busy", ["compute", "copies"])
def test_on_a_gpu_the_outer_states_copies_run_on_a_side_stream_and_race_nothing(
    options: str, busy: str
) -> None:
    """DiLoCo's copies back to host memory on their own stream, with one stream kept busy before
    every outer sync (a long kernel queued on it): the compute stream (a copy issued before the
    kernels that wrote its source had run would read stale values) or the copies' stream (a read
    of the outer state, or a staging buffer written again, before the copies had landed). Either
    way the weights and the outer state follow the CPU run's, where nothing is copied."""
    opts = SIDE_STREAM_OPTIONS[options]
    runs = {}
    for device in ("cpu", "cuda"):
        model = Toy(device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        diloco = DiLoCo(model, opt, opts, n_layers=4)
        for step in range(1, 4 * opts.inner_steps + 2):
            opt.zero_grad()
            loss = sum(((p - 0.1 * step) ** 2).sum() for p in model.parameters())
            assert isinstance(loss, torch.Tensor)
            loss.backward()
            opt.step()
            if device == "cuda":
                assert diloco.copies is not None
                assert diloco.copies.stream != torch.cuda.current_stream()
                if busy == "compute":
                    torch.cuda._sleep(20_000_000)
                else:
                    with torch.cuda.stream(diloco.copies.stream):
                        torch.cuda._sleep(20_000_000)
            diloco.after_step(step)
        diloco.host_ready()
        runs[device] = (model, diloco)
    (cpu, cpu_outer), (gpu, gpu_outer) = runs["cpu"], runs["cuda"]
    for a, b in zip(gpu.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-4, atol=1e-4)
    for a, b in zip(_outer_tensors(gpu_outer), _outer_tensors(cpu_outer), strict=True):
        assert a.is_pinned()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


GPU_METHODS = {
    "diloco-2-fragments": [
        "parallel.strategy=ddp", "parallel.diloco.inner_steps=4", "parallel.diloco.fragments=2",
    ],
    "streaming-int4": [
        "parallel.strategy=ddp", "parallel.diloco.inner_steps=4", "parallel.diloco.fragments=2",
        "parallel.diloco.delay=1", "parallel.diloco.quantize=int4",
    ],
    "powersgd": ["parallel.strategy=ddp", "parallel.compression=powersgd"],
    "dct": ["parallel.strategy=ddp", "parallel.compression=dct"],
    "dct-quant": [
        "parallel.strategy=ddp", "parallel.compression=dct",
        "parallel.compression_options.coding=quant",
    ],
    "demo": ["parallel.strategy=ddp", "train.optimizer=demo"],
}  # fmt: skip


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", list(GPU_METHODS))
def test_a_one_gpu_run_resumes_and_rolls_back_with_each_method(tmp_path: Path, method: str) -> None:
    """1 GPU: killed after step 7 and resumed from step 6's checkpoint, the run ends as the one never
    killed; and bad steps in a row roll it back to its last checkpoint, whose state loads onto the
    GPU and trains on (the per-rank state of each method: loaded into CPU templates, used on the
    GPU)."""
    opts = [
        *FAST, *GPU_METHODS[method], "train.device=cuda", "train.steps=10", "checkpoint.every=3",
        "parallel.compression_options.start_step=2",
    ]  # fmt: skip

    def train(run: Path, env: dict[str, str] | None = None) -> Any:
        return run_cli("train", "--set", *opts, f"run.dir={run}", env=env)

    ref = train(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = train(tmp_path / "run", {"DTLAB_FAULTS": "kill@7"})
    assert killed.returncode == -signal.SIGKILL
    resumed = train(tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step-00000006" in resumed.stderr
    want = [m["loss"] for m in read_metrics(tmp_path / "ref")]
    got = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert got == pytest.approx(want, abs=1e-5)
    # DiLoCo judges a replica's bad steps at its syncs (after steps 8 and 10 here): four in a row
    # are seen at step 10, which rolls back to step 9's checkpoint; the others roll back at step 9.
    diloco = any(o.startswith("parallel.diloco.") for o in GPU_METHODS[method])
    nan, back = ("nan@7-10", "step-00000009") if diloco else ("nan@7-9", "step-00000006")
    rolled = train(tmp_path / "rollback", {"DTLAB_FAULTS": nan})
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    assert "rolled back to" in rolled.stderr and back in rolled.stderr, rolled.stderr[-3000:]
