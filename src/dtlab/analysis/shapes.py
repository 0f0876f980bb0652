"""The model's parameters as the plan sees them: each one's shape, how tensor parallelism and FSDP split
it, and what one pipeline rank holds of them, read from the model built on the meta device."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from dtlab.analysis.memo import memo
from dtlab.config import Config, ModelConfig
from dtlab.dims import ParallelDims, stage_ids, stage_layers


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    group: str  # "layers.N" for a transformer block, "root" for embeddings, final norm and output

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard_numel(self, shards: int) -> int:
        """Elements one rank holds when dim 0 is split in ``shards`` equal padded chunks (FSDP2)."""
        if shards == 1:
            return self.numel
        rows = self.shape[0]
        return -(-rows // shards) * (self.numel // rows)

    def shard_numel_at(self, shards: int, index: int) -> int:
        """Elements shard ``index`` really holds, without the padding of its chunk (the last
        shards of an uneven split hold fewer rows, or none): what its optimizer state mirrors."""
        if shards == 1:
            return self.numel
        chunk = math.ceil(self.shape[0] / shards)
        rows = max(0, min(chunk, self.shape[0] - index * chunk))
        return rows * (self.numel // self.shape[0])

    def padded_numel(self, shards: int) -> int:
        """Elements of the gathered buffer: dim 0 padded to a multiple of ``shards``."""
        return self.shard_numel(shards) * shards


def padded_by_group(shapes: list[ParamShape], shards: int) -> dict[str, int]:
    """Elements of each group's gathered buffers (:meth:`ParamShape.padded_numel` summed by
    group), once per list of shapes (shared: not to be changed)."""

    def compute() -> dict[str, int]:
        out: dict[str, int] = {}
        for s in shapes:
            out[s.group] = out.get(s.group, 0) + s.padded_numel(shards)
        return out

    return memo(shapes, ("padded_by_group", shards), compute)


def param_shapes(model_cfg: ModelConfig) -> list[ParamShape]:
    """Every parameter of the model, from the model itself built on the meta device."""
    from dtlab.models.llama import build_model

    model = build_model(model_cfg)  # meta: no memory
    out = []
    for name, p in model.named_parameters():
        group = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        out.append(ParamShape(name, tuple(p.shape), group))
    return out


# Tensor parallelism splits these matrices by their output features (dim 0; the embedding by its
# vocabulary rows), the rest (wo, w2) by their input features (dim 1); 1-D norms stay whole (the
# q/k norms' gains too: every rank's heads read all of one), the q/k/v biases split with their
# projections' output features.
_ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight")
_COLWISE_BIASES = ("attention.wq.bias", "attention.wk.bias", "attention.wv.bias")


def _tp_local(s: ParamShape, tp: int) -> ParamShape:
    if tp > 1 and s.name.endswith(_COLWISE_BIASES):
        return ParamShape(s.name, (s.shape[0] // tp,), s.group)
    if tp == 1 or len(s.shape) < 2:
        return s
    shape = list(s.shape)
    dim = 1 if s.name.endswith(_ROWWISE) else 0
    shape[dim] //= tp
    return ParamShape(s.name, tuple(shape), s.group)


@dataclass(frozen=True)
class RankPart:
    """What one pipeline rank holds: its pipeline stages (of ``n_stages``) and their blocks."""

    stages: list[int]
    n_stages: int
    n_layers: int

    @property
    def first(self) -> bool:
        return 0 in self.stages

    @property
    def last(self) -> bool:
        return self.n_stages - 1 in self.stages


# rank_shapes' results by (the shapes' identity, the split): the search asks for the same split of
# the same shapes thousands of times. Each entry keeps its shapes alive, so an identity is never
# reused while it is cached.
_RANK_SHAPES: dict[tuple[Any, ...], tuple[list[ParamShape], list[ParamShape], RankPart]] = {}


def rank_shapes(
    config: Config, dims: ParallelDims, shapes: list[ParamShape], pp_rank: int
) -> tuple[list[ParamShape], RankPart]:
    """What pipeline rank ``pp_rank`` holds of each parameter (its tensor-parallel part, before FSDP
    shards it), and its stages. The same split of the same shapes returns the same list (shared:
    not to be changed), so that figures over it are computed once (:mod:`dtlab.analysis.memo`)."""
    p = config.parallel
    key = (id(shapes), len(shapes), config.model.n_layers, config.model.tie_embeddings, dims.tp,
           dims.pp, p.stages_per_rank, p.pp_schedule if dims.pp_enabled else "",
           pp_rank)  # fmt: skip
    hit = _RANK_SHAPES.get(key)
    if hit is not None and hit[0] is shapes:
        return hit[1], hit[2]
    held, part = _rank_shapes(config, dims, shapes, pp_rank)
    if len(_RANK_SHAPES) > 4096:
        _RANK_SHAPES.clear()
    _RANK_SHAPES[key] = (shapes, held, part)
    return held, part


def _rank_shapes(
    config: Config, dims: ParallelDims, shapes: list[ParamShape], pp_rank: int
) -> tuple[list[ParamShape], RankPart]:
    n_layers, p = config.model.n_layers, config.parallel
    layers, part = set(range(n_layers)), RankPart([0], 1, n_layers)
    if dims.pp_enabled:
        n_stages = dims.pp * p.stages_per_rank
        ids = stage_ids(pp_rank, dims.pp, p.stages_per_rank, p.pp_schedule)
        split = stage_layers(n_layers, n_stages)
        layers = {i for sid in ids for i in split[sid]}
        part = RankPart(ids, n_stages, len(layers))

    # A tied model's last stage holds a copy of the embedding for its output projection.
    embeds = part.first or holds_tied_copy(config, part)

    def held(s: ParamShape) -> bool:
        if s.group != "root":
            return int(s.group.split(".")[1]) in layers
        return embeds if is_embedding(s) else part.last

    # An MoE block's feed-forward stays whole on every tensor-parallel rank (dtlab.analysis.moe).
    tp_split = [s if whole_under_tp(s.name) else _tp_local(s, dims.tp) for s in shapes]
    return [s for s in tp_split if held(s)], part


def holds_tied_copy(config: Config, part: RankPart) -> bool:
    """Whether a pipeline rank of ``part`` holds the last stage's copy of a tied embedding
    (:class:`dtlab.parallel.pipeline.TiedEmbedding`): the rank of the last stage, not of the first
    (the V schedules, which would place both on one rank, are refused with tied embeddings). The
    copy is a parameter of the rank's model, kept in its root (FSDP's root unit), whose gradient is
    sent to the first stage after backward and dropped; the optimizer does not step it, and the
    first stage sends its new value back after each step."""
    return config.model.tie_embeddings and part.last and not part.first


def stepped_shapes(shapes: list[ParamShape], copy: bool) -> list[ParamShape]:
    """The parameters of ``shapes`` (a rank's, :func:`rank_shapes`) the optimizer steps: all of
    them, but not the tied embedding's copy where the rank holds one (``copy``,
    :func:`holds_tied_copy`). The same list for the same shapes (shared: not to be changed)."""
    if not copy:
        return shapes
    return memo(shapes, ("stepped",), lambda: [s for s in shapes if not is_embedding(s)])


def is_embedding(s: ParamShape) -> bool:
    """Whether ``s`` is the token embedding (or a tied model's last stage's copy of it)."""
    return s.name.startswith("tok_embeddings")


def whole_under_tp(name: str) -> bool:
    """Whether parameter ``name`` belongs to an MoE block's feed-forward (router, routed and shared
    experts), which tensor parallelism leaves whole on every rank (:func:`dtlab.parallel.apply.
    apply_tp`: each rank computes it on the same tokens)."""
    return any(f".feed_forward.{part}." in name for part in ("router", "experts", "shared"))
