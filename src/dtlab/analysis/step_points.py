"""The points of a step on a rank without pipeline parallelism (:func:`step_timeline`): each
micro-batch's forward and backward, FSDP's gathers and reductions, the wrappers' work after
backward and the optimizer step, each point's figures from the shapes of
:mod:`dtlab.analysis.timeline` (its moments, a block's shape, what the rank holds)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dtlab.analysis.activations import FP32
from dtlab.analysis.timeline import (
    BlockKind,
    BlockShape,
    FsdpUnits,
    LossShape,
    Moment,
    RankState,
    Timeline,
)

__all__ = ["step_timeline"]


def step_timeline(
    state: RankState,
    accum: int,
    kept: int,
    loss_part: int,
    recompute: tuple[int, int],
    bottom_kept: int,
    block: BlockShape,
    n_blocks: int,
    loss: LossShape | None,
    grads_persist: bool,
    fsdp: FsdpUnits | None,
    after_backward: int = 0,
    unbucketed: tuple[int, int] = (0, 0),
    blocks: list[BlockKind] | None = None,
    held_after: int = 0,
    to_step_end: int = 0,
    last_hook: int = 0,
    stepped_grads: int | None = None,
) -> Timeline:
    """The step's moments on a rank without pipeline parallelism.

    ``kept``: what one micro-batch's forward keeps for backward; ``loss_part``: the part of it the
    loss, final norm and output keep (freed first in backward); ``recompute``: what recomputing a
    block adds under checkpointing at the recomputation's end, and of it what is freed before the
    feed-forward's backward; ``bottom_kept``: what is left of ``kept`` when the first
    block's backward starts (its own and the embedding's); ``n_blocks``: the rank's blocks;
    ``grads_persist``: the gradients live from step to step (DDP's buckets); ``after_backward``:
    what the step makes after backward (ZeRO-1's reduce-scatter buffers); ``unbucketed``: (bytes
    a block, blocks) of gradients outside DDP's buckets, made by the last blocks' backward at each
    step (the experts' under expert parallelism, reduced over their own group); ``blocks``: each
    block's own figures where they differ (by default ``n_blocks`` alike: ``block``,
    ``bottom_kept``, ``recompute`` and FSDP's block unit); ``held_after``: what forward made that
    the model holds past backward, to the next forward (the attention's masks); ``to_step_end``:
    what the last micro-batch's backward makes and the step keeps to its end (a DDP hook's new
    state beside the old, until the step commits); ``last_hook``: what DDP's communication hook
    holds as it works on its bucket at backward's end (the embedding's gradient as backward made
    it still beside the bucket); ``stepped_grads``: the gradients the optimizer steps with where
    they are not those backward made (ZeRO-1's shards')."""
    t = Timeline()
    s = state
    if blocks is None:
        if fsdp is not None:
            kind = BlockKind(block, bottom_kept, recompute, fsdp.block, fsdp.block_shard,
                             last_grad=fsdp.block_last)  # fmt: skip
        else:
            kind = BlockKind(block, bottom_kept, recompute)
        blocks = [kind] * n_blocks
    blocks = blocks or [BlockKind(block, bottom_kept, recompute)]  # a rank without blocks
    base = {"params": s.params, "optimizer": s.optimizer}
    for k in range(1, accum + 1):
        last = k == accum
        mb = _MicroBatch(t, base, s.buffers, k, kept, loss_part, blocks, loss)
        if fsdp is not None:
            _fsdp_micro_batch(mb, s, last, fsdp)
        else:
            _replicated_micro_batch(mb, s, grads_persist, unbucketed)
            if last and last_hook:
                # Forward's own are freed by then but the step's scalars (the loss's).
                mb.add("DDP's communication hook on its bucket",
                       grads=s.grads + s.embed_grads, activations=held_after + 12,
                       temporaries=last_hook,
                       buffers=s.buffers)  # fmt: skip
        t.add(
            Moment(
                f"after backward {k}", "the gradients' sync and clipping", **base, grads=s.grads,
                activations=held_after,
                temporaries=after_backward + to_step_end if last else 0, buffers=s.buffers,
            )
        )  # fmt: skip
    t.add(
        Moment(
            "optimizer", "the optimizer step", **base,
            grads=s.grads if stepped_grads is None else stepped_grads, activations=held_after,
            temporaries=to_step_end, buffers=s.buffers,
        )
    )  # fmt: skip
    return t


@dataclass(frozen=True)
class _MicroBatch:
    """Micro-batch ``k`` of a step as its moments go into ``t``: ``base`` the rank's own
    parameters and optimizer state, ``buffers`` its module buffers, ``kept`` what its forward
    keeps for backward (``loss_part`` of it the loss's, final norm's and output's), ``blocks``
    the rank's blocks, ``loss`` what the loss makes over the vocabulary (None: no loss here)."""

    t: Timeline
    base: dict[str, int]
    buffers: int
    k: int
    kept: int
    loss_part: int
    blocks: list[BlockKind]
    loss: LossShape | None

    def left_by_blocks(self) -> int:
        """What forward kept that is alive once every block's backward is done: forward's own are
        freed but the micro-batch's tokens (int64, one more than it trains on) and the step's
        scalars."""
        tokens = 8 * (self.loss.tokens + 1) + 12 if self.loss is not None else 0
        return max(tokens, self.kept - self.loss_part - sum(b.kept for b in self.blocks))

    def add(self, where: str, phase: str = "backward", **parts: int) -> None:
        """Record a point of micro-batch k's ``phase`` (``where`` it is) with its ``parts``."""
        self.t.add(Moment(f"{phase} {self.k}", where, **self.base, **parts))


def _replicated_micro_batch(
    mb: _MicroBatch, s: RankState, grads_persist: bool, unbucketed: tuple[int, int]
) -> None:
    """Micro-batch k where every rank holds the whole model (DDP, or one process): the gradients
    alive as it starts are DDP's buckets always, otherwise those of the micro-batches before it;
    the first micro-batch makes them block by block."""
    blocks = mb.blocks
    whole = grads_persist or mb.k > 1
    per, outside = unbucketed if grads_persist and mb.k == 1 else (0, 0)
    earlier = s.grads - per * outside if whole else 0

    def at_block(j: int) -> tuple[int, int, int]:
        # The blocks above j made their gradients (and the output's came first).
        above = len(blocks) - 1 - j
        made = s.head_grads + sum(b.shape.grads for b in blocks[j + 1 :]) + blocks[j].shape.w2_grad
        return (earlier + per * min(outside, above) if whole else made), s.tied_grad, 0

    final = (earlier if whole else s.head_grads), s.tied_grad, 0
    outputs = []
    if whole and mb.loss is not None and blocks:
        # The output projection's weight gradient made anew beside the one it is added into
        # (DDP's bucket, or the micro-batches' before). Under autocast on float32 weights it is
        # made in the compute dtype, then cast to float32: the two alive together once the
        # projection's backward has freed the logits' gradient and its weight copy (measured by
        # `dtlab plan --check`).
        shape, loss = blocks[-1].shape, mb.loss
        compute, tokens, weight = shape.compute, loss.tokens, loss.vocab * shape.dim
        freed, made = loss.at_output(shape.dim, compute, compute if shape.copy else FP32)
        outputs.append(("the output projection's backward", freed, made, 0))
        if shape.copy:
            cast = (compute + FP32) * weight + compute * tokens * shape.dim
            outputs.append(("the output projection's weight gradient cast to float32",
                            freed + compute * weight, cast, 0))  # fmt: skip
    _micro_batch(mb, (earlier, 0, 0), at_block, outputs=outputs, final=final, grows=not whole)
    if blocks:
        _replicated_embedding_backward(mb, s, earlier if whole else s.grads - s.embed_grads)


def _replicated_embedding_backward(mb: _MicroBatch, s: RankState, grads: int) -> None:
    """The embedding's backward on a rank holding the whole model, every block's backward done
    (``grads`` the gradients held then): the lookup's gradient of the whole table made anew in
    float32, beside the output projection's gradient of the same table where the two are tied
    (autograd adds the two before the table's gradient takes them). Where the tokens of a
    micro-batch are few and the vocabulary large this is the step's peak: `llama3.2-1b` with one
    sample of 2,048 tokens under checkpointing, 19.51 GiB allocated on an H200, of which the two
    tables' gradients 1.96 GiB."""
    # Beside what forward left, the residual stream's gradient.
    into = mb.blocks[0].shape.stream_row
    mb.add("the embedding's backward", grads=grads, activations=mb.left_by_blocks(),
           temporaries=s.tied_grad + s.embed_grads + into, buffers=mb.buffers)  # fmt: skip


def _micro_batch(
    mb: _MicroBatch,
    at_loss: tuple[int, int, int],
    at_block: Callable[[int], tuple[int, int, int]],
    outputs: list[tuple[str, int, int, int]] | None = None,
    final: tuple[int, int, int] | None = None,
    grows: bool = True,
) -> None:
    """Micro-batch k's forward and backward points into ``t``. ``at_loss``: (gradients,
    temporaries, gathered parameters) the wrappers hold at the loss; ``at_block(j)``: the same at
    block j's feed-forward backward; ``final``: the same at the final norm's backward; ``grows``:
    a block's backward makes its gradients anew (not into DDP's buckets or the gradients of the
    micro-batches before). Blocks are
    looked at where backward's figures change their course: the last (nothing of it reduced yet),
    the one below it, the second and the first (the blocks between follow a straight line from
    one to the other)."""
    _loss_points(mb, at_loss, outputs or [])
    if final is not None and mb.loss is not None and mb.blocks:
        # The final norm's backward, after the output projection's: the loss's and the output's
        # activations freed but the norm's float32 input (a model with a short vocabulary and
        # long sequences peaks here without checkpointing, measured by `dtlab plan --check`).
        g, tmp, gath = final
        block = mb.blocks[-1].shape
        below = mb.kept - mb.loss_part + block.final_norm_kept
        for where, unmade, activations, own in block.final_points(below):
            mb.add(where, grads=g - unmade, activations=activations, temporaries=tmp + own,
                   buffers=mb.buffers + gath)  # fmt: skip
    for j in _block_points(mb.blocks):
        _block_backward(mb, j, at_block(j), grows)


def _loss_points(
    mb: _MicroBatch, at_loss: tuple[int, int, int], outputs: list[tuple[str, int, int, int]]
) -> None:
    """The forward's end (at the loss, or the last block without one), the loss's backward and
    the output projection's backward's ``outputs``: (where, what the loss kept and is freed by
    then, what backward made then, what is gathered)."""
    loss, kept, buffers = mb.loss, mb.kept, mb.buffers
    fwd = kept + (loss.forward_extra() if loss else 0)
    where = "the loss" if loss else "the last block"
    grads, temps, gathered = at_loss
    mb.add(where, "forward", grads=grads, activations=fwd, temporaries=temps,
           buffers=buffers + gathered)  # fmt: skip
    if loss is None:
        return
    mb.add(
        "the loss's backward (its gradients over the vocabulary)", grads=grads,
        activations=kept - loss.freed_before_backward(),
        temporaries=temps + loss.backward_extra(), buffers=buffers + gathered,
    )  # fmt: skip
    for name, freed, made, gathering in outputs:
        mb.add(
            name, grads=grads, activations=kept - freed, temporaries=temps + made,
            buffers=buffers + gathered + gathering,
        )  # fmt: skip


def _block_points(blocks: list[BlockKind]) -> list[int]:
    """The blocks whose backward is looked at, from the last down: the last, the one below it, the
    second and the first, and where the blocks differ (a mixture of experts' dense and MoE
    blocks), each kind's last."""
    n_blocks = len(blocks)
    points = {n_blocks - 1, max(0, n_blocks - 2), min(1, n_blocks - 1), 0}
    points |= {j for j in range(n_blocks - 1) if blocks[j] != blocks[j + 1]}
    return sorted(points, reverse=True)


def _block_backward(
    mb: _MicroBatch, j: int, held: tuple[int, int, int], grows: bool = True
) -> None:
    """Block j's backward points: its recomputation's end (a checkpointed block), its
    feed-forward's backward and its feed-forward norm's; ``held``: (gradients, temporaries,
    gathered parameters) the wrappers hold then."""
    block = mb.blocks[j].shape
    again, gone = mb.blocks[j].recompute
    # What forward kept of the blocks above j is freed by their backward.
    alive = mb.kept - mb.loss_part - sum(b.kept for b in mb.blocks[j + 1 :])
    g, tmp, gath = held
    buffers = mb.buffers + gath
    name = f"block {j}" + (" (the last)" if j == len(mb.blocks) - 1 else "")
    if again:
        # A checkpointed block at the end of its recomputation, before its backward.
        mb.add(
            f"{name} recomputed", grads=g - block.w2_grad, activations=alive + again,
            temporaries=tmp + block.incoming, buffers=buffers,
        )  # fmt: skip
    if block.float8_temps:
        mb.add(
            f"{name}'s down projection's float8 casts", grads=g - block.w2_grad,
            activations=alive + again - gone, temporaries=tmp + block.float8_temps,
            buffers=buffers,
        )  # fmt: skip
    mb.add(
        f"{name}'s feed-forward backward", grads=g,
        activations=alive + again - gone - block.freed, temporaries=tmp + block.temps,
        buffers=buffers,
    )  # fmt: skip
    made = 2 * block.w2_grad + block.dim * block.grad_element + block.routed_grads
    norm_grads = g + (made if grows else 0)
    at_norm = alive + again - gone - block.norm_freed  # (the feed-forward's freed by then)
    mb.add(
        f"{name}'s feed-forward norm's backward", grads=norm_grads, activations=at_norm,
        temporaries=tmp + block.norm_temps, buffers=buffers,
    )  # fmt: skip
    if not again and not block.attention_temps:
        # The attention norm's backward: every weight gradient of the block made, what the block
        # kept freed but the norm's float32 input, backward's own as at the feed-forward norm's
        # (a step's peak where the attention's weights outweigh what it keeps: wide, few tokens).
        mb.add(
            f"{name}'s attention norm's backward",
            grads=g + (block.grads - block.w2_grad + block.routed_grads if grows else 0),
            activations=alive - mb.blocks[j].kept + block.final_norm_kept,
            temporaries=tmp + block.norm_temps, buffers=buffers,
        )  # fmt: skip
    if block.routed_temps:
        mb.add(
            f"{name}'s routed experts' backward", grads=g - block.w2_grad,
            activations=alive + again - gone - block.routed_freed,
            temporaries=tmp + (block.routed_temps if grows else block.routed_added),
            buffers=buffers,
        )  # fmt: skip
    if block.ffn_input_temps:
        mb.add(
            f"{name}'s feed-forward input's gradient", grads=norm_grads,
            activations=at_norm + block.ffn_input_kept,
            temporaries=tmp + block.ffn_input_temps, buffers=buffers,
        )  # fmt: skip
    if block.qkv_input_temps:
        mb.add(
            f"{name}'s attention input's gradient", grads=norm_grads + block.qkv_grads,
            activations=alive - mb.blocks[j].kept + block.qkv_input_kept,
            temporaries=tmp + block.qkv_input_temps, buffers=buffers,
        )  # fmt: skip
    if block.attention_temps:
        mb.add(
            f"{name}'s attention backward", grads=norm_grads + block.attention_grads,
            activations=at_norm - block.attention_freed, temporaries=tmp + block.attention_temps,
            buffers=buffers,
        )  # fmt: skip


def _fsdp_micro_batch(mb: _MicroBatch, s: RankState, last: bool, fsdp: FsdpUnits) -> None:
    """Micro-batch k under FSDP: the root is gathered for its backward to the end of it (with its
    output's and final norm's unsharded gradients, reduce-scattered with the embedding's at the
    end); each block is gathered for its backward, the next one prefetched
    while it runs (an all-gather buffer of backward's); each block's gradients are unsharded until
    its reduce-scatter, then accumulate in the shards. Under HSDP the shards of earlier micro-batches
    wait in FSDP's buffers until the last micro-batch's all-reduce."""
    # Resharded after forward (full): nothing stays gathered at the loss; the root and each block
    # are gathered again for their backward. Otherwise every unit stays gathered until its own
    # backward is done.
    blocks, k, loss = mb.blocks, mb.k, mb.loss
    n_blocks, block = len(blocks), blocks[-1].shape
    gathered_fwd = 0 if fsdp.reshard else fsdp.root + sum(b.unit for b in blocks)
    held = s.grads if k > 1 else 0  # the shards of the micro-batches before
    shards, partial = (0, held) if fsdp.hsdp else (held, 0)
    into_grads = (k == 1 and not fsdp.hsdp) or (fsdp.hsdp and last)  # the shards, as gradients

    def at_block(j: int) -> tuple[int, int, int]:
        above = n_blocks - 1 - j  # blocks whose backward is done
        done = sum(b.unit_shard for b in blocks[j + 1 :])  # reduced and handed over
        grads = shards + s.head_grads + blocks[j].shape.w2_grad + (done if into_grads else 0)
        grads += sum(b.outside for b in blocks[j + 1 :]) if k == 1 else 0
        temps = partial + s.tied_grad + (done if fsdp.hsdp and k == 1 and not last else 0)
        # A block's reduce-scatter holds its input (its gradients in float32) until the next
        # block's is issued; its output, the shard, is the parameter's gradient at once. Over a
        # shard group of one rank resharded after forward (DDP beside tensor parallelism: FSDP2
        # replicating) the same float32 copy waits for its all-reduce (measured by `dtlab plan
        # --check`).
        if above and (fsdp.scatters or fsdp.reshard):
            temps += _reduce_input(blocks[j + 1], fsdp, block.grad_element)
        if fsdp.prefetches and j > 0:
            temps += blocks[j - 1].unit  # the block below, prefetched
        # Every unit is resharded after its own backward (FSDP2's default, whatever the sharding
        # after forward): under shard_grad_op the blocks above j are freed by then.
        gathered_bw = fsdp.root + (
            blocks[j].unit if fsdp.reshard else sum(b.unit for b in blocks[: j + 1])
        )
        return grads, temps, gathered_bw

    output = None
    if loss is not None and fsdp.reshard:
        # The output's backward gathers the root and prefetches the last block (an all-gather
        # buffer of backward's until that block's backward; over shard groups of one rank,
        # nothing prefetched).
        freed, made_out = loss.at_output(block.dim, block.compute, block.grad_element)
        ahead = blocks[-1].unit if fsdp.prefetches else 0
        output = (freed, made_out + ahead, fsdp.root)
    if loss is not None and fsdp.root:
        # Forward's start: the root gathered, FSDP's flat all-gather buffer of it alive until the
        # next unit's all-gather is copied out, the first block's buffer and its parameters
        # (measured by `dtlab plan --check`; with a large vocabulary the forward's largest point).
        first = blocks[0].unit
        mb.add("the first block's all-gather, the root gathered", "forward", grads=shards,
               activations=loss.tokens * block.dim * FP32, temporaries=partial + fsdp.root + first,
               buffers=mb.buffers + fsdp.root + first)  # fmt: skip
    if fsdp.scatters:
        _gathers_in_forward(mb, fsdp, shards, partial)
    if loss is not None and fsdp.root:
        # The output projection's end, before the root is resharded: the root gathered, the last
        # block's flat all-gather buffer still alive (torch frees a buffer at the next unit's
        # copy-out; none comes after it in forward), the logits made, the loss not yet run.
        cells = loss.tokens * loss.vocab
        logits = cells * (2 if loss.half else FP32)
        made = mb.kept - FP32 * cells + logits - loss.freed_before_backward()
        flat = blocks[-1].unit if blocks and fsdp.scatters else 0
        gathered = gathered_fwd or fsdp.root + blocks[-1].unit
        mb.add("the output projection's end, the root gathered", "forward", grads=shards,
               activations=made, temporaries=partial + flat,
               buffers=mb.buffers + (gathered_fwd or fsdp.root))  # fmt: skip
        if blocks:
            # Inside the last block, at its feed-forward's end: the block gathered beside the
            # root, its flat buffer alive, its transients and its output (the loss's part holds
            # it; measured by `dtlab plan --check`).
            transient = block.forward_transients(loss.tokens) + block.stream_row
            mb.add("the last block's feed-forward", "forward", grads=shards,
                   activations=mb.kept - mb.loss_part + transient, temporaries=partial + flat,
                   buffers=mb.buffers + gathered)  # fmt: skip
    if output is not None and loss is not None:
        # The root gathered again for the output projection's backward, its flat all-gather
        # buffer beside it (none over a shard group of one rank: each shard is copied into its
        # parameter), before the projection's gradients are made.
        logits_grad = loss.tokens * loss.vocab * (2 if loss.half else FP32)
        root_flat = fsdp.root if fsdp.scatters else 0
        mb.add("the root gathered for the output projection's backward", grads=shards,
               activations=mb.kept - output[0], temporaries=partial + logits_grad + root_flat,
               buffers=mb.buffers + fsdp.root)  # fmt: skip
    # At the final norm's backward the root is gathered, the last block prefetched or every block
    # still gathered (not resharded after forward), no block's gradients made yet.
    final = (
        shards + s.head_grads,
        partial + s.tied_grad + (blocks[-1].unit if fsdp.prefetches else 0),
        fsdp.root + (0 if fsdp.reshard else sum(b.unit for b in blocks)),
    )
    outputs = [("the output projection's backward", *output)] if output is not None else []
    _micro_batch(mb, (shards, partial, gathered_fwd), at_block, outputs, final)
    if fsdp.prefetches:
        # Each block gathered for its backward: its parameters copied out of the all-gather buffer
        # its successor prefetched, both alive, the residual gradient come in, nothing of the
        # block freed and the block below not yet prefetched (a step's peak where a block's
        # parameters outweigh its activations: wide models, few tokens a rank).
        for j in _block_points(blocks):
            g, tmp, gathered = at_block(j)
            shape = blocks[j].shape
            ahead = blocks[j - 1].unit if j > 0 else 0
            alive = mb.kept - mb.loss_part - sum(b.kept for b in blocks[j + 1 :])
            name = f"block {j}" + (" (the last)" if j == n_blocks - 1 else "")
            mb.add(f"{name} copied out of its all-gather buffer", grads=g - shape.w2_grad,
                   activations=alive,
                   temporaries=tmp - ahead + blocks[j].unit + shape.incoming,
                   buffers=mb.buffers + gathered)  # fmt: skip
    if fsdp.scatters or fsdp.reshard:
        _blocks_reduce_inputs(mb, fsdp, at_block)
    if fsdp.root and loss is not None:
        done = sum(b.unit_shard for b in blocks)
        grads = shards + (done if into_grads else 0)
        grads += sum(b.outside for b in blocks) if k == 1 else 0
        temps = partial + (done if fsdp.hsdp and k == 1 and not last else 0)
        _root_backward(mb, s, fsdp, grads, temps, block.grad_element)


def _blocks_reduce_inputs(
    mb: _MicroBatch, fsdp: FsdpUnits, at_block: Callable[[int], tuple[int, int, int]]
) -> None:
    """Each block's post-backward: the block resharded, its gradients, every one made in the dtype
    it gathers in, copied into FSDP's float32 buffer to reduce-scatter beside their unsharded
    copies, the block below prefetched; the block above's buffer is dropped first (FSDP2 keeps one
    reduce-scatter input in flight: ``reduce_scatter_max_input_buffers``); what the block kept
    freed but the attention norm's float32 input. Then the reduce-scatter's output (the shard)
    beside its input, the unsharded copies freed but the block's last parameter's (torch's
    ``foreach_reduce`` still names it in a loop's variable): over 2 ranks the larger. A step's
    peak where a block's weights outweigh its activations: a mixture of many experts, measured by
    `dtlab plan --check`."""
    blocks = mb.blocks
    n_blocks = len(blocks)
    for j in _block_points(blocks):
        g, tmp, gathered = at_block(j)
        shape = blocks[j].shape
        element = shape.grad_element
        alive = mb.kept - mb.loss_part - sum(b.kept for b in blocks[j:])
        above = _reduce_input(blocks[j + 1], fsdp, element) if j < n_blocks - 1 else 0
        name = f"block {j}" + (" (the last)" if j == n_blocks - 1 else "")
        where = f"{name}'s gradients copied into FSDP's float32 buffer to reduce-scatter"
        into = _reduce_input(blocks[j], fsdp, element)
        mb.add(where, grads=g - shape.w2_grad + blocks[j].unit,
               activations=alive + shape.final_norm_kept, temporaries=tmp - above + into,
               buffers=mb.buffers + gathered - blocks[j].unit)  # fmt: skip
        if fsdp.scatters:
            mb.add(f"{where} (its output)", grads=g - shape.w2_grad + blocks[j].last_grad,
                   activations=alive + shape.final_norm_kept,
                   temporaries=tmp - above + into + into // fsdp.shard,
                   buffers=mb.buffers + gathered - blocks[j].unit)  # fmt: skip


def _gathers_in_forward(mb: _MicroBatch, fsdp: FsdpUnits, shards: int, partial: int) -> None:
    """Micro-batch k's forward as FSDP gathers each block after the first: the block's parameters
    copied out of its flat all-gather buffer while the previous unit's buffer is still alive (torch
    frees it after the copy-out, not before), beside the root and, where blocks are not resharded
    after forward, every block gathered so far; what forward kept of the blocks before it and the
    block's input (measured by `dtlab plan --check`)."""
    blocks = mb.blocks
    for j in range(1, len(blocks)):
        before = blocks[j - 1].unit
        gathered = blocks[j].unit if fsdp.reshard else sum(b.unit for b in blocks[: j + 1])
        kept = mb.kept - mb.loss_part - sum(b.kept for b in blocks[j:])
        mb.add(f"block {j}'s all-gather", "forward", grads=shards,
               activations=kept + blocks[j].shape.stream_row,
               temporaries=partial + before + blocks[j].unit,
               buffers=mb.buffers + fsdp.root + gathered)  # fmt: skip


def _reduce_input(block: BlockKind, fsdp: FsdpUnits, element: int) -> int:
    """A block's gradients in float32 as FSDP reduces them: its gathered unit in float32
    (``element`` the bytes it gathers each in); where FSDP2 replicates float32 parameters over a
    shard group of one rank (DDP beside tensor parallelism), its shard, the whole block in float32
    (float8 layers' weights are copied in one byte an element there, but their gradients reduced
    in float32; measured by `dtlab plan --check`)."""
    if not fsdp.scatters and element == FP32 and block.unit_shard:
        return block.unit_shard
    return block.unit // element * FP32


def _root_backward(
    mb: _MicroBatch, s: RankState, fsdp: FsdpUnits, grads: int, temps: int, element: int
) -> None:
    """The end of micro-batch k's backward under FSDP, every block's gradients reduced (``grads``
    and ``temps`` what the wrappers hold of them): the embedding's backward, the root still
    gathered, its gradient made in the parameters' dtype (a tied model's added to the output's,
    a third copy, measured by `dtlab plan --check`) beside the first block's reduce-scatter input;
    then the root's own post-backward, resharded, its gradients copied into FSDP's float32 buffer
    to reduce-scatter beside their unsharded copies (one of the largest moments of a step where
    the vocabulary is large and the tokens few: `llama3.2-1b` on 8 ranks at 1,024 tokens, and a
    mixture of experts' few blocks)."""
    blocks = mb.blocks
    rest = mb.left_by_blocks()
    embed = s.embed_grads // FP32 * element
    # (Over a shard group of one rank resharded after forward, DDP beside tensor parallelism, the
    # same float32 copy waits for its all-reduce: the blocks' points below.)
    waits = fsdp.scatters or fsdp.reshard
    first_input = _reduce_input(blocks[0], fsdp, element) if waits and blocks[0].unit else 0
    made = embed + (embed if s.tied_grad else 0)
    # (Beside it, its output's gradient: the residual stream's, from the first block.)
    into = blocks[0].shape.stream_row if blocks else 0
    mb.add("the embedding's backward", grads=grads + s.head_grads, activations=rest,
           temporaries=temps + first_input + s.tied_grad + made + into,
           buffers=mb.buffers + fsdp.root)  # fmt: skip
    root_input = fsdp.root // element * FP32
    where = "the root's gradients copied into FSDP's float32 buffer to reduce-scatter"
    mb.add(where, grads=grads + s.head_grads + embed, activations=rest,
           temporaries=temps + root_input, buffers=mb.buffers)  # fmt: skip
    if fsdp.scatters:
        # Its output, the shard, is made once the copies are freed but the embedding's (an
        # untied model's, still held by autograd then).
        mb.add(f"{where} (its output)", grads=grads + (0 if s.tied_grad else embed),
               activations=rest, temporaries=temps + root_input + root_input // fsdp.shard,
               buffers=mb.buffers)  # fmt: skip
