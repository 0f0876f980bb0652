"""Pipeline parallelism: the model split into stages by blocks, run by a ``torch.distributed.pipelining``
schedule.

With ``pp`` pipeline ranks and ``v`` stages per rank there are ``pp * v`` stages; the blocks are dealt
out in order, as evenly as they go (earlier stages take one more when they do not divide). The first
stage also holds the embedding, the last the final norm, the output and the loss. Rank ``r`` holds
stages ``r, r + pp, ...`` (looped schedules), or ``r`` and ``2 pp - 1 - r`` (the V schedules, which
keep the first and last stage on rank 0).

Each stage is a :class:`~dtlab.models.llama.Transformer` that kept only its parts
(:meth:`~dtlab.models.llama.Transformer.keep_only`), so every parameter keeps the whole model's name:
checkpoints from every stage together are a whole-model checkpoint, and load into any other layout.
A rank's stages are gathered into one model for its state and parameters (:func:`rank_model`); the
schedule runs the stages.

Tied embeddings: the last stage's output reads the embedding, which the first stage holds. The last
stage holds a copy of it under the same name, that :class:`TiedEmbedding` keeps equal to it: the
copy's gradient is added to the embedding's after backward, only the embedding is stepped, and its
new value is sent back to the copy after the update.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor

from dtlab.config.checks import schedule_refusal
from dtlab.dims import stage_layers
from dtlab.errors import ConfigError
from dtlab.models.args import ModelArgs
from dtlab.models.llama import Transformer, build_model

SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def split_model(args: ModelArgs, ids: list[int], n_stages: int) -> list[Transformer]:
    """One meta-device model per stage in ``ids``, each keeping only its blocks (and the embedding,
    norm and output where they belong)."""
    layers = stage_layers(args.n_layers, n_stages)
    stages = []
    for sid in ids:
        stage = build_model(args)
        stage.keep_only(layers[sid], first=sid == 0, last=sid == n_stages - 1)
        stages.append(stage)
    return stages


def rank_model(args: ModelArgs, stages: list[Transformer]) -> Transformer:
    """One model over this rank's stages (their modules, shared, under the whole model's names): what
    the optimizer and the checkpoint see. It is never called; the stages are."""
    model = build_model(args)  # meta: only a frame for the stages' modules
    layers = sorted(int(k) for stage in stages for k in stage.layers)
    first = any(s.embeds for s in stages)
    model.keep_only(layers, first=first, last=any(s.norm is not None for s in stages))
    for stage in stages:
        for k, block in stage.layers.items():
            model.layers[k] = block
        # The embedding, or on a rank without the first stage a tied model's copy of it.
        if stage.tok_embeddings is not None and (stage.embeds or not first):
            model.tok_embeddings = stage.tok_embeddings
        if stage.norm is not None:
            model.norm, model.output = stage.norm, stage.output
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (DTensor) parameter or gradient: what the peer rank holds of it too."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class TiedEmbedding:
    """A tied model's embedding, held by the first stage, and its copy, held by the last stage for
    its output, on two pipeline ranks: ``first`` says which this rank holds (``weight``), ``peer``
    is the other's rank in the pipeline group ``group``. Both ranks' stages are split alike (the
    same data-parallel and tensor-parallel shards), so each sends its local part.

    The embedding is the parameter: its gradient is the sum of both uses (the copy's gradient is
    added to it after backward, and the copy's dropped), the optimizer steps it alone (the gradient
    norm counts it once; no optimizer state is kept for the copy) and its new value is sent to the
    copy after each update. The copy keeps the embedding's name, so a checkpoint holds the one
    tensor (both ranks save the same values under it) and loads into both."""

    weight: torch.Tensor  # the parameter
    first: bool
    group: dist.ProcessGroup
    peer: int
    # What the optimizer steps of this rank's model: all of it on the first stage's rank; on the
    # last stage's, a module over its other parts (under the same names), without the copy.
    stepped: nn.Module

    @torch.no_grad()
    def reduce_gradient(self) -> None:
        """Add the copy's gradient to the embedding's (after the data-parallel reduction)."""
        grad = self.weight.grad
        if grad is None:
            raise RuntimeError("the tied embedding has no gradient after backward")
        local = _local(grad)
        if self.first:
            received = torch.empty_like(local)
            dist.recv(received, group=self.group, group_src=self.peer)
            local.add_(received)
        else:
            dist.send(local.contiguous(), group=self.group, group_dst=self.peer)
            self.weight.grad = None  # stepped on the first stage only

    @torch.no_grad()
    def share_weight(self) -> None:
        """Set the copy to the embedding's value (after an optimizer step)."""
        local = _local(self.weight)
        if self.first:
            dist.send(local.contiguous(), group=self.group, group_dst=self.peer)
        else:
            received = torch.empty_like(local)
            dist.recv(received, group=self.group, group_src=self.peer)
            local.copy_(received)


def tied_embedding(
    model: Transformer, pp_rank: int, pp: int, mesh: DeviceMesh
) -> TiedEmbedding | None:
    """The :class:`TiedEmbedding` of this rank's ``model`` (:func:`rank_model`) at pipeline rank
    ``pp_rank`` of ``pp`` on the pipeline dimension ``mesh``; None where the model is not tied or
    the rank holds neither the first stage nor the last. The first stage is on pipeline rank 0 and
    the last on rank ``pp - 1`` (the V schedules, which place both on rank 0, are refused with tied
    embeddings by the config's checks)."""
    if not model.args.tie_embeddings or pp_rank not in (0, pp - 1):
        return None
    if model.tok_embeddings is None:
        raise RuntimeError(f"pipeline rank {pp_rank} of a tied model holds no embedding")
    first = pp_rank == 0
    stepped: nn.Module = model
    if not first:
        stepped = nn.Module()
        for name, child in model.named_children():
            if name != "tok_embeddings":
                stepped.add_module(name, child)
    weight = model.tok_embeddings.weight
    return TiedEmbedding(weight, first, mesh.get_group(), pp - 1 if first else 0, stepped)


def _no_outputs(schedule: _PipelineSchedule) -> dict[str, Any]:
    """The keyword that tells ``schedule`` not to return the last stage's outputs, where its torch
    has it (older ones pass unknown keywords to the model). Returned, the logits of every
    micro-batch would stay alive to the next step, through the optimizer step: ~2 GB each for an
    8B model at 8,192 tokens in bf16. Unreturned, each is freed at its micro-batch's backward."""
    return {"return_outputs": False} if _takes_return_outputs(type(schedule)) else {}


@functools.cache
def _takes_return_outputs(kind: type[_PipelineSchedule]) -> bool:
    """Whether schedule class ``kind``'s ``step`` has ``return_outputs`` (read once per class, not
    at every step)."""
    return "return_outputs" in inspect.signature(kind.step).parameters


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them over a step's micro-batches."""

    schedule: _PipelineSchedule
    stages: list[PipelineStage]  # this rank's, in the schedule's order
    first: bool  # holds stage 0 (feeds the inputs)
    last: bool  # holds the last stage (computes the loss)
    n_microbatches: int
    inject_nan: bool = False  # the loss of the running step becomes NaN (fault injection)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's mean cross-entropy (float32), as every other layout computes it."""
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return loss * float("nan") if self.inject_nan else loss

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's batch; returns the mean loss over its micro-batches on
        the rank with the last stage (0 elsewhere). The schedule divides the gradients by the
        micro-batch count, so they are those of that mean."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        target = targets if self.last else None
        self.schedule.step(*args, target=target, losses=losses, **_no_outputs(self.schedule))
        if not self.last:
            return torch.zeros((), device=inputs.device)
        # Tensor parallel: each loss is a replicated DTensor, the same on every rank of the group.
        local = [x.detach().to_local() if isinstance(x, DTensor) else x.detach() for x in losses]  # type: ignore[attr-defined]
        return torch.stack(local).mean()

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only of this rank's batch: the mean loss over its micro-batches on the rank with
        the last stage (0 elsewhere)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.first else ()
        target = targets if self.last else None
        self.schedule.eval(*args, target=target, losses=losses, **_no_outputs(self.schedule))
        if not self.last:
            return torch.zeros((), device=inputs.device)
        local = [x.detach().to_local() if isinstance(x, DTensor) else x.detach() for x in losses]  # type: ignore[attr-defined]
        return torch.stack(local).mean()


StageIO = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


def stage_io(
    args: ModelArgs,
    sid: int,
    n_stages: int,
    microbatch: int,
    seq_len: int,
    stream_dtype: torch.dtype,
    logits_dtype: torch.dtype,
    seq_shard: int = 1,
    vocab_shard: int = 1,
) -> StageIO:
    """Stage ``sid``'s inputs and outputs for one micro-batch of ``microbatch`` sequences, as meta
    tensors (shapes and dtypes): the tokens [B, T] (int64) into the first stage, the residual
    stream [B, T / seq_shard, dim] in ``stream_dtype`` between stages (a sequence shard under
    sequence parallelism), the logits [B, T, vocab / vocab_shard] out of the last.

    Given to each :class:`PipelineStage`, they spare the first step its shape inference, a message
    from each stage to the next (and back) before any micro-batch runs. The last stage's logits
    are never sent (only their number matters to the schedule)."""
    meta = torch.device("meta")
    # requires_grad: a stage sends its input's gradient back, and receives its output's.
    stream = torch.empty(
        microbatch, seq_len // seq_shard, args.dim, dtype=stream_dtype, device=meta,
        requires_grad=True,
    )  # fmt: skip
    if sid == 0:
        inputs = torch.empty(microbatch, seq_len, dtype=torch.int64, device=meta)
    else:
        inputs = stream
    if sid == n_stages - 1:
        vocab = args.vocab_size // vocab_shard
        outputs = torch.empty(
            microbatch, seq_len, vocab, dtype=logits_dtype, device=meta, requires_grad=True
        )
    else:
        outputs = stream
    return (inputs,), (outputs,)


def build_pipeline(
    stages: list[nn.Module],
    ids: list[int],
    n_stages: int,
    schedule: str,
    n_microbatches: int,
    mesh: DeviceMesh,
    device: torch.device,
    shapes: list[StageIO] | None = None,
) -> Pipeline:
    """The schedule over this rank's (wrapped) stage modules ``stages``, numbered ``ids``, on the
    pipeline dimension ``mesh``. ``shapes``: each stage's inputs and outputs (:func:`stage_io`),
    where known; without them the stages learn them from each other at the first step."""
    group = mesh.get_group()
    io: list[StageIO | tuple[None, None]] = list(shapes) if shapes else [(None, None)] * len(ids)
    pipeline_stages = [
        PipelineStage(
            module, sid, n_stages, device, input_args=inputs, output_args=outputs, group=group
        )
        for module, sid, (inputs, outputs) in zip(stages, ids, io, strict=True)
    ]
    cls: Any = SCHEDULES[schedule]
    pipeline = Pipeline(
        schedule=None,  # type: ignore[arg-type]  # set below: the schedule calls back into it
        stages=pipeline_stages,
        first=0 in ids,
        last=n_stages - 1 in ids,
        n_microbatches=n_microbatches,
    )
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = pipeline.loss
    # check_world refused these in the launching process; a worker that torchrun started did not
    # run it, and gets the same words here rather than torch's.
    why = schedule_refusal(schedule, mesh.size(), n_stages, n_microbatches)
    if why is not None:
        raise ConfigError(
            f"parallel.pp_schedule = {schedule!r} with {n_microbatches} pipeline micro-batches: "
            f"{why} (parallel.pp_microbatches sets the micro-batches)"
        )
    try:
        if schedule in ("gpipe", "1f1b"):
            pipeline.schedule = cls(pipeline_stages[0], n_microbatches, loss_fn=loss_fn)
        else:
            pipeline.schedule = cls(pipeline_stages, n_microbatches, loss_fn=loss_fn)
    except ValueError as e:  # a rule of the schedule's that schedule_refusal does not state
        raise ConfigError(
            f"parallel.pp_schedule = {schedule!r} with {n_microbatches} micro-batches and {n_stages} "
            f"stages: {e} (parallel.pp_microbatches sets the micro-batches)"
        ) from None
    return pipeline


@dataclass
class Block:
    """One piece of work a stage did: ``kind`` F (forward), B (full backward), I (input gradients
    only, the zero-bubble schedules' first half of a backward) or W (weight gradients), on
    micro-batch ``microbatch``, from ``start`` to ``end`` (``time.perf_counter`` seconds)."""

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


def record_timeline(pipeline: Pipeline, sync: Callable[[], None] = lambda: None) -> list[Block]:
    """Time every forward, backward and weight-gradient computation of this rank's stages from now on,
    into the returned list (the schedule calls the stages' methods; sends and receives are outside
    them, so the gaps between blocks are the rank's idle time).

    ``sync`` waits for the device, before a block's clock starts and before it stops: on a GPU a
    stage's method returns once its kernels are queued, so without it a block would time their
    launch (``dtlab.bench.pipeline`` passes the device's synchronisation)."""
    blocks: list[Block] = []
    methods = {
        "F": "forward_one_chunk",
        "B": "backward_one_chunk",
        "W": "backward_weight_one_chunk",
    }
    for stage in pipeline.stages:
        for kind, name in methods.items():
            original = getattr(stage, name)

            def timed(
                mb: int,
                *args: Any,
                _f: Any = original,
                _k: str = kind,
                _s: int = stage.stage_index,
                **kwargs: Any,
            ) -> Any:
                # A backward that leaves the weight gradients for later is the zero-bubble
                # schedules' input-gradient half.
                full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                k = "I" if _k == "B" and not full else _k
                sync()
                t0 = time.perf_counter()
                try:
                    return _f(mb, *args, **kwargs)
                finally:
                    sync()
                    blocks.append(Block(k, _s, mb, t0, time.perf_counter()))

            setattr(stage, name, timed)
    return blocks
