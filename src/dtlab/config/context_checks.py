"""What context parallelism (``parallel.cp`` > 1) goes with today, and why the rest is refused: it is
built over DDP's ranks (each holds the whole model), FSDP's (sharding over the data x cp ranks) or
FSDP2's replication (whole parameters on every data x cp rank: ``ddp`` with tensor or pipeline
parallelism, sharding ``no_shard``), the gradients averaged over the data- and context-parallel ranks
together; the ring on the CPU's or a CUDA GPU's fused attention kernels. So it is inside each DiLoCo replica (its data x cp ranks; the outer syncs between
the ranks of the same data and cp coordinates) and each fault-tolerant replica group (its cp ranks,
or under HSDP its data x cp ranks)."""

from __future__ import annotations

from dtlab.config.schema import CROSS_RULES, Config, refuse
from dtlab.dims import DPWrapper

__all__ = ["check_context_parallel", "check_document_mask"]


# Why what context parallelism does not compose with yet is refused (one reason for them all).
_CP_WHY = (
    "context parallelism is built over DDP's, FSDP's and HSDP's ranks (with tensor and pipeline "
    "parallelism, also inside DiLoCo's replicas and fault-tolerant replica groups; a mixture of "
    "experts' experts split over the data x cp ranks, or not split), so far"
)


def check_context_parallel(c: Config) -> None:
    """Refuse what ``parallel.cp`` > 1 does not compose with yet, naming the setting and why."""
    p, m, t = c.parallel, c.model, c.train
    if p.cp == 1:
        return
    split = 2 * p.cp
    if c.seq_len % split:
        raise ValueError(
            f"data.seq_len = {c.seq_len} does not split into the {split} chunks parallel.cp = "
            f"{p.cp} cuts each sequence into (2 per rank); allowed: a multiple of {split}"
        )
    heads = m.n_heads // p.tp  # a tensor-parallel rank's
    if p.cp_method == "alltoall" and heads % p.cp:
        raise ValueError(
            f"parallel.cp_method = 'alltoall' gives each of the cp = {p.cp} ranks a share of the "
            f"{heads} attention heads a rank holds (model.n_heads = {m.n_heads} / parallel.tp = "
            f"{p.tp}); allowed: a cp dividing {heads}, or cp_method = 'ring'"
        )
    if m.sliding_window is not None and m.sliding_window < c.seq_len and p.cp_method == "ring":
        # The all-to-all attends the whole sequence on each rank and takes the window's mask; the
        # ring's blocks are cut by the causal (and document) mask alone.
        raise ValueError(
            f"model.sliding_window = {m.sliding_window} (shorter than data.seq_len = {c.seq_len}) "
            f"is not supported with parallel.cp = {p.cp} and parallel.cp_method = 'ring': the "
            "ring's attention is causal over the whole sequence, so far; allowed: "
            "parallel.cp_method = 'alltoall', a window of at least data.seq_len, null, or "
            "parallel.cp = 1"
        )
    refused: dict[str, tuple[bool, str, str, str]] = {k: (*v, _CP_WHY) for k, v in {
        "parallel.strategy": (
            DPWrapper.of(p.strategy) is DPWrapper.NONE, repr(p.strategy), "'ddp', 'fsdp', 'hsdp'",
        ),
        "parallel.sharding": (
            p.sharding == "optimizer", repr(p.sharding), "'full', 'shard_grad_op', 'no_shard'",
        ),
        "parallel.compression": (p.compression != "none", repr(p.compression), "'none'"),
        "train.engine": (t.engine != "torch", repr(t.engine), "'torch'"),
    }.items()}  # fmt: skip
    # A step is taken again only where the ranks meet nowhere before the gradient sync, and the
    # context-parallel ranks meet in every block's attention.
    refused["train.oom_retry"] = (
        t.oom_retry, "true", "false",
        "a rank out of memory inside forward would leave the others in the attention's passes",
    )  # fmt: skip
    refuse(refused, f"parallel.cp = {p.cp}")


def check_document_mask(c: Config) -> None:
    """Refuse what ``data.document_mask`` does not compose with yet: the mask is made from the
    tokens by the model's first pipeline stage, and MLX's attention takes the causal mask only."""
    if not c.data.document_mask:
        return
    p = c.parallel
    refuse(
        {
            "parallel.pp": (
                p.pp > 1, str(p.pp), "1",
                "the mask is made from the tokens where the embedding is (the first pipeline "
                "stage), and the later stages' attention gets none, so far",
            ),
            "train.engine": (
                c.train.engine != "torch", repr(c.train.engine), "'torch'",
                "the MLX engine's attention takes the causal mask only, so far",
            ),
        },
        "data.document_mask = true",
    )  # fmt: skip


CROSS_RULES.extend([check_context_parallel, check_document_mask])
