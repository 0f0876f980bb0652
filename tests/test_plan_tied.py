"""``dtlab plan`` of tied embeddings (``model.tie_embeddings``) under tensor and pipeline parallelism,
against the real code of the same rank (``--check``: fake process group, fake tensors): the
vocabulary-split embedding's tied output under tensor parallelism (the output's gradient of the
embedding held until the lookup's backward); under a pipeline the last stage's copy of the
embedding (a parameter without optimizer state, its gradient alive until it is sent to the first
stage) and the two transfers between the pipeline's ends; and the search offering tensor
parallelism to a tied model."""

from __future__ import annotations

import pytest

from conftest import close, planned_state
from dtlab.analysis.check import check_rank, measure_fake
from dtlab.analysis.devices import PROFILES
from dtlab.analysis.model import plan_step
from dtlab.analysis.plan import plan, predict_step
from dtlab.config import Config, load_config
from dtlab.dims import ParallelDims

SMALL = ["model.preset=debug", "data.seq_len=64", "train.global_batch_size=8"]
TIED = "model.tie_embeddings=true"
# The debug model's embedding: 256 rows of 64, in float32.
EMBEDDING = 256 * 64 * 4

# (processes, overrides, the ranks checked: a pipeline's first and last stage)
LAYOUTS: dict[str, tuple[int, list[str], list[int]]] = {
    "tp:2": (2, ["parallel.tp=2"], [1]),
    "tp:2 sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], [1]),
    # Checkpointed: the peak in a block's backward, after the tied output's, whose gradient of the
    # embedding's rows autograd holds until the lookup's backward adds its own.
    "tp:2 sp bf16 full AC": (
        2, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.precision=bf16",
            "train.activation_checkpointing=full"], [1],
    ),
    "fsdp:2 full AC": (2, ["parallel.strategy=fsdp", "train.activation_checkpointing=full"], [1]),
    "pp:2": (2, ["parallel.pp=2"], [0, 1]),
    "fsdp:2 x pp:2": (4, ["parallel.pp=2", "parallel.strategy=fsdp"], [0, 3]),
}  # fmt: skip


def _config(*overrides: str) -> Config:
    return load_config(overrides=[*SMALL, *overrides])


def _sends(config: Config, nproc: int, rank: int) -> int:
    """The plan's point-to-point bytes of ``rank``'s pipeline stage (0 without a pipeline)."""
    dims = ParallelDims.from_config(config, nproc)
    at = dims.coordinates(rank)
    step = plan_step(config, nproc, pp_rank=at["pp"], shard_rank=at["dp_shard"])
    return step.comm_bytes.get("send/recv", 0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_tied_layout_is_planned_as_the_checked_code(layout: str) -> None:
    """Each checked rank's peak and every component alive then within 3% of the checked code's,
    the state between steps to the byte (a pipeline's last stage holds the embedding's copy
    without optimizer state; its gradient, dropped once sent, is not stepped: kept only where
    FSDP's reduced gradients share one storage), the activations within 1%, and the bytes sent
    exact (the loss-parallel cross-entropy's all-reduces, issued inside DTensor's dispatch, too).
    A pipeline's ends each send one of the embedding's two transfers: its copy's gradient from
    the last stage, its new value from the first, each the rank's own shard of it."""
    nproc, overrides, ranks = LAYOUTS[layout]
    config = _config(TIED, *overrides)
    dims = ParallelDims.from_config(config, nproc)
    for rank in ranks:
        measured = measure_fake(config, nproc, 1, rank)
        r = check_rank(config, nproc, 1, rank, measured)
        assert r.skipped is None
        assert close(r.peak["predicted"], r.peak["checked"], 0.03), (rank, r.peak, r.components)
        for name, c in r.components.items():
            assert close(c["predicted"], c["checked"], 0.03), (rank, name, c)
        at = dims.coordinates(rank)
        pp_rank = at["pp"] if dims.pp_enabled else None
        step = plan_step(config, nproc, pp_rank=pp_rank, shard_rank=at["dp_shard"])
        own = measured["components"]
        for name, planned in planned_state(step).items():
            assert own[name] == planned > 0, (rank, name, own[name], planned)
        act = own["activations"]
        assert abs(step.activations_bytes - act) <= 0.01 * act, (rank, step.activations_bytes, act)
        sent = [sum(c[k] for c in r.by_collective.values()) for k in ("predicted", "checked")]
        assert sent[0] == sent[1], (rank, r.by_collective)
        if dims.pp_enabled:
            # The untied model's sends (its activations and their gradients), and the embedding.
            untied = _sends(_config(*overrides), nproc, rank)
            share = EMBEDDING // dims.fsdp_shard
            assert r.by_collective["send/recv"]["checked"] == untied + share, (
                rank,
                r.by_collective,
            )


def test_the_last_stage_holds_the_copy_without_optimizer_state() -> None:
    """The debug model's tied last stage holds as many parameters as the untied one (the copy for
    the output projection) and optimizer state for all of them but the copy; its gradient is alive
    through backward (the peak's gradients are the untied stage's) and dropped before the
    optimizer steps."""
    tied, untied = (_config(*t, "parallel.pp=2") for t in ([TIED], []))
    t, u = (plan_step(c, 2, pp_rank=1) for c in (tied, untied))
    assert t.params_bytes == u.params_bytes
    assert u.optimizer_bytes - t.optimizer_bytes == 2 * EMBEDDING + 4  # AdamW's moments, step
    assert u.grads_bytes - t.grads_bytes == EMBEDDING
    assert t.timeline is not None and u.timeline is not None
    assert t.timeline.peak.grads == u.timeline.peak.grads


def test_the_first_stage_receives_the_copys_gradient_beside_every_gradient() -> None:
    """A wide vocabulary and few tokens: after backward the first stage receives the copy's
    gradient into a buffer of the embedding's size, beside every gradient of the stage; that moment
    is the checked one within 0.1%. The step's peak is the second micro-batch's embedding's
    backward, its float32 gradient made beside every gradient (added into the embedding's own
    after), within 0.1% too."""
    config = _config(
        TIED, "parallel.pp=2", "model.vocab_size=8192", "data.seq_len=16",
        "train.global_batch_size=2",
    )  # fmt: skip
    r = check_rank(config, 2, 1, 0)
    assert r.skipped is None
    after = next(m for m in r.timeline if m["moment"] == "after backward 2")
    assert close(after["predicted"], after["checked"], 0.001), after
    assert r.peak["predicted_at"] == {"moment": "backward 2", "where": "the embedding's backward"}
    assert close(r.peak["predicted"], r.peak["checked"], 0.001), r.peak


def test_the_embeddings_transfers_are_exposed_in_the_step_time() -> None:
    """On H100s (NVLink) a tied pipeline's step waits for its embedding's transfer as for the
    stages' sends: its exposed communication is the untied model's and the embedding's bytes at
    the link's rate (the same compute: the tied output is the same matmul)."""
    h100 = PROFILES["h100"]
    rows = [predict_step(_config(*t, "parallel.pp=2"), 2, 1, h100) for t in ([TIED], [])]
    assert rows[0].compute_s == rows[1].compute_s
    assert rows[0].exposed_s is not None and rows[1].exposed_s is not None
    extra = rows[0].exposed_s - rows[1].exposed_s
    assert extra == pytest.approx(EMBEDDING / (h100.intra_node_gbps * 1e9), rel=1e-9)


def test_the_search_offers_tensor_parallelism_to_a_tied_model() -> None:
    """llama3.2-1b (tied) on two H100s with one sample a step: no data parallelism splits it, so
    the ranks split the model, and tensor parallelism (both ranks busy) beats a two-stage
    pipeline, idle half the step; the search costs both (tied pipelines are searched too)."""
    config = load_config(
        overrides=["model.preset=llama3.2-1b", "train.global_batch_size=1", "data.seq_len=2048"]
    )
    assert config.model.tie_embeddings
    s = plan(config, 2, 1, PROFILES["h100"], None)["search"]
    rec = s["recommended"]
    assert rec is not None and rec["fits"]
    assert rec["settings"]["parallel.tp"] == 2 and "parallel.tp=2" in rec["set"], rec
    pipelines = [r for r in s["rows"] if r["settings"]["parallel.pp"] == 2]
    assert pipelines and all(r["step_time_s"] > rec["step_time_s"] for r in pipelines)


@pytest.mark.parametrize("tied", [True, False])
def test_the_embeddings_backward_holds_the_tables_gradients_beside_the_others(tied: bool) -> None:
    """On a rank holding the whole model, the embedding's backward is a moment of the step: every
    other gradient made, and the lookup's gradient of the whole table made anew beside, for a
    tied model, the output projection's gradient of the same table (autograd adds the two). With
    one sample under checkpointing this is the step's peak (an H200 measured `llama3.2-1b` there:
    docs/planning.md); untied, the lookup's gradient is the table's own."""
    overrides = ["model.preset=debug", "data.seq_len=16", "train.global_batch_size=1",
                 "train.activation_checkpointing=full", "parallel.strategy=single",
                 f"model.tie_embeddings={'true' if tied else 'false'}"]  # fmt: skip
    config = load_config(overrides=overrides)
    p = plan_step(config, 1)
    assert p.timeline is not None
    at = [m for m in p.timeline.as_list() if m.where == "the embedding's backward"]
    assert len(at) == 1, [m.where for m in p.timeline.as_list()]
    table = 4 * config.model.vocab_size * config.model.dim  # a float32 [vocab, dim]
    row = 4 * 16 * config.model.dim  # the residual stream's gradient, float32
    assert at[0].temporaries == (2 if tied else 1) * table + row
    assert at[0].grads == p.grads_bytes - table  # every gradient but the table's
