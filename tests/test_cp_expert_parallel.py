"""Expert parallelism with context parallelism (``parallel.ep`` with ``parallel.cp``): the experts borrow
the data x cp ranks (a cp rank routes its own tokens of the same sequences: for the experts, one more
data rank), in EP groups of consecutive (data-parallel, cp) ranks, their shards' gradients averaged
over the data x cp ranks as every other gradient is. Trained against one process, clipping active."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import FAST, assert_same_training, checkpoint_tensors, run_cli, train_run
from dtlab.config import ConfigError, check_world, load_config
from dtlab.dims import ParallelDims, layout_name
from dtlab.verify import parse_layouts

MOE = ("model.preset=debug-moe",)
# debug-moe's gradient norm stays between 0.65 and 0.8: every step clips, so expert gradients averaged
# over the wrong ranks change the update, not only the reported norm.
CLIP = ("train.grad_clip=0.3",)


def _dims(nproc: int, *overrides: str) -> ParallelDims:
    config = load_config(overrides=[*FAST, *MOE, *overrides])
    dims = ParallelDims.from_config(config, nproc)
    # The name a run gives the layout: data parallelism, then cp, ep and tp.
    assert layout_name(dims, config.parallel).split(" x ")[-2 if dims.tp_enabled else -1] == (
        f"ep {dims.ep}"
    )
    return dims


def _cp_groups(dims: ParallelDims) -> list[list[int]]:
    """The ranks that split the same sequences (the same coordinates but cp's), from the world's
    layout."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(dims.world_size):
        c = dims.coordinates(r)
        groups.setdefault(tuple(v for k, v in c.items() if k != "cp"), []).append(r)
    return sorted(groups.values())


def test_ep_groups_are_consecutive_data_x_cp_ranks() -> None:
    # ddp 2 x cp 2, ep 2: each EP group is a cp group (the ranks holding one sample's halves), and
    # the ranks holding the same experts are the two data-parallel ranks' copies.
    dims = _dims(4, "parallel.strategy=ddp", "parallel.cp=2", "parallel.ep=2")
    assert (dims.ep_span, dims.ep_dp) == (4, 2)
    assert dims.expert_groups("ep") == _cp_groups(dims) == [[0, 1], [2, 3]]
    assert dims.expert_groups("ep_dp") == [[0, 2], [1, 3]]
    assert [dims.ep_rank(r) for r in range(4)] == [0, 1, 0, 1]
    # ep 4: one group over both data-parallel ranks and both cp ranks; no experts' all-reduce.
    dims = _dims(4, "parallel.strategy=fsdp", "parallel.cp=2", "parallel.ep=4")
    assert dims.expert_groups("ep") == [[0, 1, 2, 3]] and dims.ep_dp == 1
    # ddp 4 x cp 2, ep 4: a group spans two data-parallel ranks' cp groups.
    dims = _dims(8, "parallel.strategy=ddp", "parallel.cp=2", "parallel.ep=4")
    assert dims.expert_groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.expert_groups("ep_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # cp 4 on one data-parallel rank, ep 2: two EP groups inside the cp group.
    dims = _dims(4, "parallel.strategy=ddp", "parallel.cp=4", "parallel.ep=2")
    assert dims.expert_groups("ep") == [[0, 1], [2, 3]] and _cp_groups(dims) == [[0, 1, 2, 3]]
    # With tensor parallelism: the EP groups form among the ranks of the same tp coordinate.
    dims = _dims(4, "parallel.strategy=fsdp", "parallel.cp=2", "parallel.tp=2", "parallel.ep=2")
    assert dims.expert_groups("ep") == [[0, 2], [1, 3]] and dims.ep_dp == 1


def test_ep_must_divide_the_data_x_cp_ranks() -> None:
    config = load_config(overrides=[*FAST, *MOE, "parallel.strategy=ddp", "parallel.cp=2",
                                    "parallel.ep=4"])  # fmt: skip
    message = (
        "parallel.ep = 4 does not divide the 2 data x cp ranks (2 processes / (parallel.tp = 1 x "
        "parallel.pp = 1) = 1 data-parallel x parallel.cp = 2)"
    )
    with pytest.raises(
        ConfigError, match=r"parallel\.ep = 4 does not divide the 2 data x cp"
    ) as err:
        check_world(config, 2)
    assert message in str(err.value) and "allowed here: 1, 2" in str(err.value)
    check_world(config, 4)
    accepted = load_config(overrides=[*FAST, *MOE, "parallel.strategy=fsdp", "parallel.cp=2",
                                      "parallel.ep=2"])  # fmt: skip
    check_world(accepted, 2)  # the EP group is the cp group
    # Said before any process starts: no traceback.
    proc = run_cli("train", "--nproc", "2", "--set", *FAST, *MOE, "parallel.strategy=ddp",
                   "parallel.cp=2", "parallel.ep=4")  # fmt: skip
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr
    # dtlab verify's layouts: ep alone borrows DDP's ranks (ep:2xcp:2 is ddp 2 x cp 2).
    layouts = parse_layouts("single,ep:2xcp:2,ep:2xcp:2:alltoall,ddp:1xcp:2xep:2")
    assert [x.nproc for x in layouts] == [1, 4, 4, 2]
    assert layouts[2].overrides == (
        "parallel.strategy=ddp", "parallel.ep=2", "parallel.cp=2", "parallel.cp_method=alltoall",
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"ep:4 must divide the 2 data x cp ranks.*fsdp:2xcp:2xep:4"
    ):
        parse_layouts("single,fsdp:1xcp:2xep:4")


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """One process's run of the MoE model with clipping, and its run directory."""
    run = tmp_path_factory.mktemp("moe-single") / "run"
    return train_run(run, *MOE, *CLIP), run


@pytest.mark.parametrize(
    ("layout", "nproc", "name"),
    [
        # dp 2 x cp 2: each EP group a cp group, the experts' copies all-reduced over the data
        # ranks; two micro-batches per rank.
        (["parallel.strategy=ddp", "train.micro_batch_size=2"], 4, "ddp 2 x cp 2 (ring) x ep 2"),
        # dp 1 x cp 2: the EP group is the cp group, FSDP shards the rest over it.
        (["parallel.strategy=fsdp", "parallel.cp_method=alltoall"], 2,
         "fsdp 1 x cp 2 (alltoall) x ep 2"),
        # Tensor parallelism inside: each tp rank's EP group its cp ranks of the same tp coordinate.
        (["parallel.strategy=fsdp", "parallel.tp=2"], 4, "fsdp 1 x cp 2 (ring) x ep 2 x tp 2"),
    ],
    ids=["ddp2xcp2xep2-accumulation", "fsdp1xcp2xep2-alltoall", "fsdp1xcp2xtp2xep2"],
)  # fmt: skip
def test_expert_and_context_parallel_training_equals_one_process(
    tmp_path: Path,
    moe_reference: tuple[list[dict[str, Any]], Path],
    layout: list[str],
    nproc: int,
    name: str,
) -> None:
    reference, reference_dir = moe_reference
    run_dir = tmp_path / "run"
    run = train_run(run_dir, *MOE, *CLIP, "parallel.cp=2", "parallel.ep=2", *layout, nproc=nproc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["layout"], summary["ep"], summary["cp"]) == (name, 2, 2)  # really split
    assert all(m["grad_norm"] > 0.3 for m in run)  # every step clipped
    assert_same_training(run, reference)
    # Every rank's tokens counted once: the experts' loads are one process's, and so is the bias
    # they move.
    assert [m["moe_load"] for m in run] == [m["moe_load"] for m in reference]
    assert [m["moe_bias"] for m in run] == pytest.approx([m["moe_bias"] for m in reference])
    # The parameters after the last step, the experts whole in the checkpoint.
    got = checkpoint_tensors(run_dir / "checkpoints" / "step-00000012")
    want = checkpoint_tensors(reference_dir / "checkpoints" / "step-00000012")
    params = [k for k in want if k.startswith("model.")]
    assert got["model.layers.1.feed_forward.experts.w1"].shape == (4, 64, 64)
    worst = max((got[k] - want[k]).abs().max().item() for k in params)
    assert worst < 1e-4, worst
