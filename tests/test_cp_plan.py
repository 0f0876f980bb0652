"""``dtlab plan`` of context parallelism (:mod:`dtlab.analysis.context_plan`) against the real code of
the same rank (``--check``: fake process group, fake tensors): each rank holding ``1 / cp`` of every
sequence, the attention's own memory (the ring's accumulators and blocks in flight in its backward,
the output's copy, the expanded key/value heads) and its bytes (the ring's point-to-point passes,
alltoall's all-to-alls)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import FAST, assert_state_is_planned, run_cli
from dtlab.analysis.check import check_rank, measure_fake
from dtlab.analysis.model import plan_step
from dtlab.config import load_config

# Attention-heavy for its size (a short vocabulary, grouped key/value heads), so that the
# attention's own figures, not the loss's, decide the peak.
SHAPE = [
    "model.preset=debug", "model.dim=128", "model.n_layers=2", "model.n_heads=8",
    "model.n_kv_heads=2", "model.vocab_size=256", "model.max_seq_len=512", "data.seq_len=512",
    "train.global_batch_size=4",
]  # fmt: skip

CHECKED: dict[str, tuple[int, list[str]]] = {
    "ring fp32": (2, ["parallel.strategy=ddp", "parallel.cp=2"]),
    "alltoall fp32": (2, ["parallel.strategy=ddp", "parallel.cp=2", "parallel.cp_method=alltoall"]),
    "ring bf16 full AC": (2, ["parallel.strategy=ddp", "parallel.cp=2", "train.precision=bf16",
                              "train.activation_checkpointing=full"]),
    "ring fp32 selective AC": (2, ["parallel.strategy=ddp", "parallel.cp=2",
                                   "train.activation_checkpointing=selective"]),
    "alltoall bf16 full AC": (2, ["parallel.strategy=ddp", "parallel.cp=2", "train.precision=bf16",
                                  "parallel.cp_method=alltoall", "train.activation_checkpointing=full"]),
    "cp:4 ring full AC": (4, ["parallel.strategy=ddp", "parallel.cp=4",
                              "train.activation_checkpointing=full"]),
    "fsdp:2 x cp:2 ring bf16 full AC": (4, ["parallel.strategy=fsdp", "parallel.cp=2",
                                           "train.precision=bf16", "train.activation_checkpointing=full"]),
    "fsdp:2 x cp:2 alltoall": (4, ["parallel.strategy=fsdp", "parallel.cp=2",
                                   "parallel.cp_method=alltoall"]),
    # Tensor parallelism inside: each tp rank's heads go round the ring (sequence parallel).
    "fsdp:1 x cp:2 x tp:2 sp ring bf16 full AC": (
        4, ["parallel.strategy=fsdp", "parallel.cp=2", "parallel.tp=2",
            "parallel.sequence_parallel=true", "train.precision=bf16",
            "train.activation_checkpointing=full"]),
    # DDP beside tensor parallelism, and FSDP's no_shard: FSDP2 replicating over the data x cp ranks.
    "ddp:1 x cp:2 x tp:2 ring": (4, ["parallel.strategy=ddp", "parallel.cp=2", "parallel.tp=2"]),
    "fsdp:2 no_shard x cp:2 ring": (4, ["parallel.strategy=fsdp", "parallel.sharding=no_shard",
                                        "parallel.cp=2"]),
    # Pipeline stages of sequence parts: the ring's backward inside each stage's schedule.
    "fsdp:1 x cp:2 x pp:2 ring bf16 full AC": (
        4, ["parallel.strategy=fsdp", "parallel.cp=2", "parallel.pp=2", "parallel.pp_microbatches=2",
            "train.precision=bf16", "train.activation_checkpointing=full"]),
    "fsdp:1 x cp:2 x pp:2 alltoall": (
        4, ["parallel.strategy=fsdp", "parallel.cp=2", "parallel.pp=2", "parallel.pp_microbatches=2",
            "parallel.cp_method=alltoall"]),
    # Document masks: the boolean mask and its additive copy, shared by the layers (alltoall
    # attends with the whole one); the ring makes each block's part of it in turn, for the blocks
    # a document boundary cuts (the check's documents cut every rank's: _documents_given).
    "alltoall fp32, document mask": (2, ["parallel.strategy=ddp", "parallel.cp=2",
                                         "parallel.cp_method=alltoall", "data.document_mask=true"]),
    "ring fp32, document mask": (2, ["parallel.strategy=ddp", "parallel.cp=2",
                                     "data.document_mask=true"]),
    "cp:4 ring bf16, document mask": (4, ["parallel.strategy=ddp", "parallel.cp=4",
                                          "train.precision=bf16", "data.document_mask=true"]),
    # Selective checkpointing keeps the blocks' partial outputs: on a GPU a cut block's in float32
    # (the memory-efficient kernel's, in float32 under a mask).
    "ring bf16 selective AC, document mask": (
        2, ["parallel.strategy=ddp", "parallel.cp=2", "train.precision=bf16",
            "train.activation_checkpointing=selective", "data.document_mask=true"]),
    "fsdp:2 x cp:2 ring full AC, document mask": (
        4, ["parallel.strategy=fsdp", "parallel.cp=2", "train.activation_checkpointing=full",
            "data.document_mask=true"]),
    # A mixture of experts, its experts split over the data x cp ranks (EP groups of 2).
    "ep:2 x ddp:2 x cp:2 ring (MoE)": (4, ["model.preset=debug-moe", "parallel.strategy=ddp",
                                           "parallel.cp=2", "parallel.ep=2"]),
    # DiLoCo replicas, each its data x cp ranks (DDP over them, the outer sync between replicas).
    "diloco:2 x cp:2 ring": (4, ["parallel.strategy=ddp", "parallel.cp=2",
                                 "parallel.diloco.inner_steps=2", "parallel.diloco.replicas=2"]),
}  # fmt: skip

# Checked with a GPU's attention kernels' memory (the check's target "cuda"): alltoall attends a
# whole sequence on the kernel the model picks (fp32 with grouped heads: memory-efficient on
# expanded heads; bf16: flash); the ring's blocks on flash (bf16) or the memory-efficient kernel
# (fp32, and a block a document boundary cuts).
ON_A_GPU = {
    "alltoall fp32", "alltoall bf16 full AC", "alltoall fp32, document mask", "ring fp32",
    "ring bf16 full AC", "cp:4 ring full AC", "fsdp:2 x cp:2 ring bf16 full AC",
    "fsdp:1 x cp:2 x pp:2 ring bf16 full AC", "fsdp:2 x cp:2 ring full AC, document mask",
    "ring bf16 selective AC, document mask",
}  # fmt: skip


# Where the peak is not yet within 3% (docs/long-context.md): none.
PEAK_WITHIN: dict[str, float] = {}


def _close(predicted: int, checked: int, within: float) -> bool:
    return abs(predicted - checked) <= within * checked


@pytest.mark.parametrize("layout", list(CHECKED))
def test_the_plan_of_context_parallelism_is_the_checked_code(layout: str) -> None:
    """The step's peak within 3% of the checked code's, the state between steps to the byte (FSDP
    sharding over the data x cp ranks), and the bytes sent per step (the ring's passes or the
    all-to-alls, with DDP's or FSDP's collectives) exact."""
    nproc, overrides = CHECKED[layout]
    config = load_config(overrides=[*SHAPE, *overrides])
    pipelined = any(o.startswith("parallel.pp=") for o in overrides)
    for rank in [0, nproc - 1] if pipelined else [nproc - 1]:
        _check(layout, config, nproc, rank, "cpu")
    if layout in ON_A_GPU:
        for rank in [0, nproc - 1] if pipelined else [nproc - 1]:
            _check(layout, config, nproc, rank, "cuda")


def _check(layout: str, config: Any, nproc: int, rank: int, target: str) -> None:
    measured = measure_fake(config, nproc, 1, rank, target)
    r = check_rank(config, nproc, 1, rank, measured, target)
    assert r.skipped is None
    within = PEAK_WITHIN.get(layout, 0.03)
    assert _close(r.peak["predicted"], r.peak["checked"], within), (r.peak, r.components)
    if layout in PEAK_WITHIN:  # the documented miss is an over-estimate, and still there
        assert r.peak["checked"] < r.peak["predicted"]
        assert not _close(r.peak["predicted"], r.peak["checked"], 0.03)
    assert_state_is_planned(config, nproc, rank, measured["components"])
    sent = r.collectives
    assert sent["checked"] > 0 and abs(sent["predicted"] - sent["checked"]) <= 64, r.by_collective
    cp = {k: v for k, v in r.by_collective.items() if "to_all" in k or "send/recv" in k}
    assert cp and all(v["predicted"] == v["checked"] > 0 for v in cp.values()), cp
    method = "all_to_all" if "alltoall" in layout else "send/recv"
    assert any(k.endswith(method) for k in cp), cp


def test_a_rank_of_cp_holds_a_share_of_the_sequence_and_the_ring_costs_its_blocks() -> None:
    """cp 2 plans each rank's activations at about half of one process's at the same sequence,
    and the ring's bytes as its blocks' passes: 2 (cp - 1) + cp key/value blocks a layer."""
    one = load_config(overrides=[*SHAPE, "parallel.strategy=ddp"])
    two = load_config(overrides=[*SHAPE, "parallel.strategy=ddp", "parallel.cp=2"])
    whole, half = plan_step(one, 1), plan_step(two, 2)
    assert 0.45 < half.activations_bytes / whole.activations_bytes < 0.6
    m = two.model
    tokens = 4 * 512 // 2  # a rank's part of the batch
    block = 2 * tokens * m.dim * 4  # keys and values expanded to every head, float32
    assert half.comm_bytes["send/recv"] == m.n_layers * (2 * block + 2 * block)


def test_the_cli_plans_and_checks_a_context_parallel_layout() -> None:
    proc = run_cli(
        "plan", "--check", "--device", "this", "--nproc", "2", "--set", *FAST,
        "parallel.strategy=ddp", "parallel.cp=2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "cp 2 (ring)" in proc.stdout and "sent/step" in proc.stdout


def test_the_search_splits_the_sequence_when_nothing_fits_without() -> None:
    """llama3.1-8b at 131,072 tokens on 8 x 8 H100 without tensor or pipeline parallelism: no
    layout fits with whole sequences (cp given as 1), and with cp left open the search tries the
    context-parallel degrees by both methods (alltoall's fewer bytes win here) and recommends one
    that fits, with the line that runs it."""
    from dtlab.analysis.devices import PROFILES
    from dtlab.analysis.plan import plan

    given = [
        "model.preset=llama3.1-8b", "data.seq_len=131072", "model.max_seq_len=131072",
        "parallel.tp=1", "parallel.pp=1", "train.global_batch_size=64",
    ]  # fmt: skip
    whole = plan(load_config(overrides=[*given, "parallel.cp=1"]), 8, 8, PROFILES["h100"], None)
    assert whole["search"]["recommended"] is None
    assert whole["recommendation"].startswith("nothing fits")
    split = plan(load_config(overrides=given), 8, 8, PROFILES["h100"], None)
    best = split["search"]["recommended"]
    assert best is not None and best["settings"]["parallel.cp"] > 1, best
    assert best["settings"]["parallel.cp_method"] == "alltoall"
    assert "parallel.cp=" in split["search"]["recommended"]["command"]
    assert "parallel.cp" in split["search"]["open"]


def test_the_ring_is_planned_for_a_gpu_on_its_kernels() -> None:
    """On a GPU the ring's blocks run on flash (bf16) or the memory-efficient kernel (fp32): the
    plan counts what each holds beside a chunk pair's gradients, more than the CPU's kernel."""
    from dtlab.analysis.context_plan import ring_pair_bytes

    proc = run_cli(
        "plan", "--nproc", "2", "--device", "h100", "--set", *FAST, "parallel.strategy=ddp",
        "parallel.cp=2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "cp 2 (ring)" in proc.stdout
    for precision in ("fp32", "bf16"):
        config = load_config(
            overrides=[
                *SHAPE,
                "parallel.strategy=ddp",
                "parallel.cp=2",
                f"train.precision={precision}",
            ]
        )
        cpu, gpu = (ring_pair_bytes(config, 1024, 1, device) for device in ("cpu", "cuda"))
        assert gpu > cpu > 0, (precision, cpu, gpu)


def test_on_a_gpu_the_search_takes_the_ring_where_alltoall_cannot_split_the_heads() -> None:
    """qwen2.5-7b (28 heads) at 131,072 tokens on 8 x 8 H100: alltoall splits the heads by at most
    4 there, and nothing fits at 4; the search tries the ring on the GPU's kernels too and
    recommends it at a degree that fits."""
    from dtlab.analysis.devices import PROFILES
    from dtlab.analysis.plan import plan

    given = [
        "model.preset=qwen2.5-7b", "data.seq_len=131072", "model.max_seq_len=131072",
        "parallel.tp=1", "parallel.pp=1", "train.global_batch_size=64",
    ]  # fmt: skip
    at_four = [*given, "parallel.strategy=fsdp", "parallel.cp=4", "parallel.cp_method=alltoall"]
    assert (
        plan(load_config(overrides=at_four), 8, 8, PROFILES["h100"], None)["search"]["recommended"]
        is None
    )
    best = plan(load_config(overrides=given), 8, 8, PROFILES["h100"], None)["search"]["recommended"]
    assert best is not None and best["fits"], best
    assert best["settings"]["parallel.cp"] > 4 and best["settings"]["parallel.cp_method"] == "ring"


# Where the ring's backward is the step's peak: long sequences, a narrow feed-forward, full
# checkpointing.
RING_PEAK = [
    *SHAPE, "model.max_seq_len=2048", "data.seq_len=2048", "model.ffn_dim=64",
    "train.global_batch_size=2", "parallel.strategy=ddp", "parallel.cp=2",
    "train.activation_checkpointing=full",
]  # fmt: skip


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.precision=fp32"],  # the memory-efficient kernel
        ["train.precision=bf16"],  # flash
        ["train.precision=bf16", "train.global_batch_size=1"],  # flash on one sample's chunks
        ["train.precision=bf16", "data.document_mask=true"],  # cut blocks: efficient, in float32
    ],
    ids=["fp32", "bf16", "bf16 one sample", "bf16 document mask"],
)
def test_the_rings_backward_on_a_gpus_kernels_is_planned_as_the_checked_code(
    overrides: list[str],
) -> None:
    """The ring's blocks as a GPU runs them (dtlab.analysis.check_ring: each kernel's outputs in
    its layout and the workspace it holds, from PyTorch's sources), checked where the ring's
    backward is the peak: within 1% of the plan, and above the same step on the CPU's kernel."""
    config = load_config(overrides=[*RING_PEAK, *overrides])
    peaks = {}
    for target in ("cpu", "cuda"):
        r = check_rank(config, 2, 1, 1, measure_fake(config, 2, 1, 1, target), target)
        assert r.skipped is None
        assert "attention" in r.peak["checked_at"]["where"], r.peak  # the ring's backward
        assert _close(r.peak["predicted"], r.peak["checked"], 0.01), (target, r.peak)
        peaks[target] = r.peak["checked"]
    assert peaks["cuda"] > peaks["cpu"], peaks


@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_document_mask_is_planned_as_the_checked_code(precision: str, target: str) -> None:
    """Without context parallelism: the mask once a forward (boolean and additive, shared by every
    layer), and on a GPU the kernel a mask selects (memory-efficient: flash takes none); the peak
    within 1%."""
    config = load_config(
        overrides=[*SHAPE, "parallel.strategy=ddp", "data.document_mask=true",
                   f"train.precision={precision}"]
    )  # fmt: skip
    r = check_rank(config, 2, 1, 1, measure_fake(config, 2, 1, 1, target), target)
    assert r.skipped is None
    assert _close(r.peak["predicted"], r.peak["checked"], 0.01), r.peak
    without = load_config(
        overrides=[*SHAPE, "parallel.strategy=ddp", f"train.precision={precision}"]
    )
    grown = plan_step(config, 2, device_type=target).activations_bytes
    grown -= plan_step(without, 2, device_type=target).activations_bytes
    samples, seq = 2, 512  # a rank's micro-batch
    assert grown >= samples * seq * seq * (1 + (2 if precision == "bf16" else 4))


def test_on_a_gpu_selective_checkpointing_keeps_a_cut_blocks_partial_outputs_in_float32() -> None:
    """Under a document mask a GPU runs the ring's cut blocks on the memory-efficient kernel in
    float32, and selective checkpointing's policy keeps that kernel's outputs: the plan counts them
    in float32 (in bf16 it was 1.7% under the check here, 3.4% on a smaller model), within 1%."""
    overrides = CHECKED["ring bf16 selective AC, document mask"][1]
    config = load_config(overrides=[*SHAPE, *overrides])
    r = check_rank(config, 2, 1, 1, measure_fake(config, 2, 1, 1, "cuda"), "cuda")
    assert r.skipped is None
    assert _close(r.peak["predicted"], r.peak["checked"], 0.01), r.peak


def test_the_ring_with_a_document_mask_is_checked_on_documents_that_cut_its_blocks() -> None:
    """The ring reads which of its blocks it attends, whole or in part, from the tokens' documents,
    which the check's fake tokens do not hold: the check gives it documents that end inside every
    chunk, and a block a boundary cuts makes its part of the mask (boolean and additive) for its
    attention. Where the ring's backward is the step's peak (long sequences, a narrow feed-forward,
    full checkpointing) it holds one block's, which the plan counts: a tenth of the peak here,
    within 3% with it and not without it; and without the mask the same peak is the plan's less
    that part."""
    from dtlab.analysis.context_plan import ring_block_mask_bytes

    shape = RING_PEAK
    peaks = {}
    for masked in (False, True):
        config = load_config(overrides=[*shape, f"data.document_mask={str(masked).lower()}"])
        r = check_rank(config, 2, 1, 1, measure_fake(config, 2, 1, 1))
        assert r.skipped is None
        assert "attention" in r.peak["checked_at"]["where"], r.peak  # the ring's backward
        assert _close(r.peak["predicted"], r.peak["checked"], 0.03), r.peak
        peaks[masked] = r.peak
    mask = ring_block_mask_bytes(config, 2 * 1024)  # the rank's 2 samples of 1,024 tokens
    assert mask == 2 * 512 * 512 * (1 + 4) > 0.05 * peaks[True]["checked"]
    assert not _close(peaks[True]["predicted"] - mask, peaks[True]["checked"], 0.03)
    documents = 2 * 2048 * 8  # the whole sequences' documents (int64), kept through the step
    # (Without the mask the ring's backward peaks as its gradients pass on; with it, as a cut
    # block's pair attends: more by up to the block's mask.)
    assert documents < peaks[True]["predicted"] - peaks[False]["predicted"] <= mask + documents
