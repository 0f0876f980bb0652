"""A pipeline rank's step walked op by op: its stages' figures as its schedule sees them, their
gradients and FSDP's units, and the moments each forward and backward of the schedule makes, as
:func:`dtlab.analysis.pipeline_memory.pipeline_timeline` records them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from dtlab.analysis.activations import FP32
from dtlab.analysis.shapes import RankPart
from dtlab.analysis.timeline import BlockShape, LossShape, Moment, RankState, Timeline


@dataclass(frozen=True)
class StageFigures:
    """A pipeline rank's stages as its schedule sees them: a micro-batch's activations on each
    (``per_mb``), autocast's weight copies of each (made at its first forward, kept through the
    step), and the sizes of a stage's boundary buffers (``stream``, one micro-batch's residual
    stream) and of the last stage's logits of a micro-batch."""

    per_mb: list[int]
    copies: list[int]
    stream: int
    logits: int
    # Under a zero-bubble schedule, what a stage's input half leaves for its weight half: the
    # gradient of each weight's output, kept from the one to the other.
    captured: list[int] = field(default_factory=list)
    # A V schedule's stages next to each other on one rank pass their tensors directly: the
    # later stage's input gradients become the earlier one's output-gradient buffers, made in
    # backward and kept to the next step's (``microbatches`` of the stream each).
    local: int = 0
    # The last stage's float32 log-softmax of a micro-batch: a zero-bubble input half frees it (the
    # loss sits above the output projection, whose weight half needs only the logits' gradient).
    log_softmax: int = 0
    # Of ``copies``, those of autocast's cached casts (every weight's copy but the routed experts'
    # and the float8 layers'), and of them the output projection's (the last stage's). The casts'
    # autograd nodes are made in the stage's first forward of the step, so in every later
    # micro-batch's backward they are older than every node of its own graph, and the engine,
    # which runs the newest ready node first, casts their gradients to float32 only when the
    # micro-batch's own backward is done: each weight's half-precision gradient waits until then.
    casts: list[int] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StageGrads:
    """A stage's gradients as backward makes them (bytes): every one of its parameters', its
    blocks', and its output's and final norm's (the last stage's) and embedding's (the first's)."""

    total: int
    blocks: int
    head: int
    embed: int


@dataclass(frozen=True)
class StageFsdp:
    """FSDP under a pipeline (bytes gathered, in the dtype it gathers in): each stage's root parts
    (its embedding, final norm and output), one block; ``reshard``: units are freed after each
    forward (sharding ``full``) and gathered again for backward, where they stay (torch's schedule
    turns resharding after backward off); ``buffered``: the gradients it accumulates unsharded
    across micro-batches live in float32 buffers of its own (half-precision parameters) rather than
    as the parameters' own gradients; ``shards``: each stage's gradient shards (float32), what
    its reduction leaves; ``scatter``: the ranks each unit's gradients are reduce-scattered over.

    torch's schedule reduces a stage's gradients after its last backward (``REDUCE_GRAD``: at the
    step's end under single-stage schedules, between the others' backwards under multi-stage ones),
    and reshards its units then: unit by unit, each copied into a float32 buffer to reduce-scatter
    (the first unit's, beside all the stage's unsharded gradients, is its reduction's peak).
    """

    roots: list[int]
    block: int
    reshard: bool
    buffered: bool
    shards: list[int]
    scatter: int

    @property
    def prefetched(self) -> int:
        """What backward gathers of a block ahead of its turn: a buffer of the block's own over a
        shard group of several ranks, nothing over one (DDP beside the pipeline: a block's shards
        are its parameters)."""
        return self.block if self.scatter > 1 else 0


class StageOp(NamedTuple):
    """One op of a pipeline rank's walk: on the rank's stage ``i`` (the model's stage ``sid``;
    ``last``: the model's last), with ``held`` activations alive then
    (:func:`dtlab.analysis.pipeline_memory.schedule_walk`)."""

    i: int
    sid: int
    last: bool
    held: int


@dataclass
class PipelineSteps:
    """A pipeline rank's step as :func:`dtlab.analysis.pipeline_memory.pipeline_timeline` walks
    it, its moments recorded into ``t``: the rank's figures (its arguments, ``n_blocks`` at least
    one a stage; ``shapes``: each stage's block with autocast's weight copies kept through the
    step, ``copies``: the down projection's copy of each) and what the ops so far have left."""

    t: Timeline
    state: RankState
    part: RankPart
    figures: StageFigures
    tokens: int
    walk: list[tuple[str, int, int, list[int]]]
    grads: list[StageGrads]
    n_blocks: list[int]
    loss_part: int
    loss: LossShape | None
    recompute: tuple[int, int]
    fsdp: StageFsdp | None
    shapes: list[BlockShape]
    copies: list[int]
    forwards: int = 0
    sending: int = 0  # the last backward's input gradient, sent back, alive until the next's
    made_n: int = 0  # the gradients of the stages done (each stage's made at its first backward)
    shards_n: int = 0  # the gradient shards of the stages reduced
    # Under a zero-bubble schedule (torch's runtime waits for its sends at the step's end) the
    # input gradients sent to the previous rank, alive to the step's end.
    sent: int = 0
    pending: int = 0  # the output gradients zero-bubble input halves keep for their weight halves
    # The backward running is of a single-stage schedule's latest forward (the only micro-batch in
    # flight), whose output the schedule's loop still references.
    held_over: bool = False
    left: int = 0  # the activations alive after the last backward so far
    # Each stage's: gradients made (its first backward done), last op a backward, first forward
    # run, gradients reduced, and backwards to come.
    done: list[bool] = field(init=False)
    after_backward: list[bool] = field(init=False)
    started: list[bool] = field(init=False)
    reduced: list[bool] = field(init=False)
    backwards: list[int] = field(init=False)
    split: bool = field(init=False)  # a zero-bubble schedule: backward in input and weight halves

    def __post_init__(self) -> None:
        n = len(self.part.stages)
        self.done, self.after_backward = [False] * n, [False] * n
        self.started, self.reduced = [False] * n, [False] * n
        self.backwards = [
            sum(1 for kind, j, _, _ in self.walk if kind in ("B", "W") and j == i) for i in range(n)
        ]
        self.split = any(kind in ("I", "W") for kind, _, _, _ in self.walk)

    @property
    def buffered(self) -> bool:
        """FSDP accumulates the gradients in float32 buffers of its own."""
        return self.fsdp is not None and self.fsdp.buffered

    def add(self, name: str, where: str, **parts: int) -> None:
        """Record a point of moment ``name`` beside the rank's own parameters and optimizer state."""
        self.t.add(Moment(name, where, params=self.state.params, optimizer=self.state.optimizer,
                          **parts))  # fmt: skip

    def made(self) -> tuple[int, int]:
        """The gradients of the stages done: (as the parameters', in FSDP's buffers); the shards
        of the stages reduced are the parameters'."""
        local = self.figures.local + self.sent
        if self.buffered:
            return self.shards_n, self.made_n + local
        return self.made_n + self.shards_n, local

    def gathered(self, i: int | None, blocks: int) -> int:
        """FSDP's gathered units of the stages not yet reduced: where not resharded after forward,
        every stage's that has run; else the stages whose last op was a backward, whole (the
        schedule turns resharding after backward off; their next forward reshards them), and
        stage ``i`` in a backward after a forward, its root and ``blocks`` of its blocks."""
        fsdp = self.fsdp
        if fsdp is None:
            return 0
        out = 0
        for j, was_backward in enumerate(self.after_backward):
            if self.reduced[j]:
                continue
            if was_backward or (self.started[j] and not fsdp.reshard):
                out += fsdp.roots[j] + self.n_blocks[j] * fsdp.block
            elif j == i:
                out += fsdp.roots[j] + blocks * fsdp.block
        return out

    def forward(self, op: StageOp) -> None:
        """A forward's moment: at its end (the last stage's at the loss) and, under FSDP resharding
        after forward, inside the stage's last block."""
        g_kept, t_kept = self.made()
        self.forwards += 1
        loss, fsdp, name = self.loss, self.fsdp, f"forward {self.forwards}"
        gathered = self.after_backward[op.i]
        if fsdp is not None and fsdp.reshard and gathered:
            # After a backward the stage's units are all still gathered (the schedule turns
            # resharding after backward off); this forward reshards them block by block, the
            # first at its end: the first block's forward made beside every unit gathered, what
            # the last backward left alive (a later stage's input among it: its receive buffer,
            # which the block keeps) and the block's transients (as at the last block's below).
            block = self.shapes[op.i]
            own = self._blocks_kept(op) // self.n_blocks[op.i]
            received = self.figures.stream if op.sid > 0 else 0
            transient = block.forward_transients(self.tokens) + block.stream_row
            self.add(name, "the stage's first block, its units gathered from its backward",
                     grads=g_kept,
                     activations=self.left + own - received + transient,
                     temporaries=t_kept + self.sending,
                     buffers=self.state.buffers + self.gathered(None, 0))  # fmt: skip
        self.after_backward[op.i] = False
        self.started[op.i] = True
        extra = loss.forward_extra() if op.last and loss is not None else 0
        self.add(name, "the loss" if extra else "a stage's forward", grads=g_kept,
                 activations=op.held + extra, temporaries=t_kept + self.sending,
                 buffers=self.state.buffers + self.gathered(None, 0))  # fmt: skip
        if fsdp is not None and fsdp.reshard:
            self._last_block_forward(op, fsdp, g_kept, t_kept, gathered)
        elif fsdp is None and not op.last and self.shapes[op.i].ffn_out_transients:
            # Inside the stage's last block, at its feed-forward's end: its down projection's
            # output beside what the stage keeps (under sequence parallelism with autocast, the
            # step's peak on a first stage).
            self.add(name, "the stage's last block's feed-forward", grads=g_kept,
                     activations=op.held + self.shapes[op.i].ffn_out_transients,
                     temporaries=t_kept + self.sending,
                     buffers=self.state.buffers)  # fmt: skip

    def _last_block_forward(
        self, op: StageOp, fsdp: StageFsdp, g_kept: int, t_kept: int, gathered: bool
    ) -> None:
        """Inside the stage's last block's forward, FSDP resharding after forward: as FSDP gathers
        it, and (but on the last stage, whose loss outweighs it) at its feed-forward's end;
        ``gathered``: the stage's units are still gathered from its backward (nothing is gathered
        again: no flat buffer)."""
        name = f"forward {self.forwards}"
        block = self.shapes[op.i]
        flat = fsdp.block if fsdp.scatter > 1 and not gathered else 0
        bufs = self.state.buffers + self.gathered(None, 0) + fsdp.roots[op.i] + fsdp.block
        # Its all-gather copied out, the unit's before it still in its flat buffer (torch frees
        # that after the copy-out): nothing of the block kept yet but, on the last stage, its
        # input (the loss's part holds the last block's output, not its input; measured by
        # `dtlab plan --check` on a pipeline's first, middle and last stages).
        before = fsdp.block if self.n_blocks[op.i] > 1 else fsdp.roots[op.i]
        if flat and before:
            own = self._blocks_kept(op) // self.n_blocks[op.i]
            activations = op.held - own - (self.loss_part - block.stream_row if op.last else 0)
            self.add(name, "the stage's last block's all-gather", grads=g_kept,
                     activations=activations, temporaries=t_kept + self.sending + before + flat,
                     buffers=bufs)  # fmt: skip
        if not op.last:
            # Inside the stage's last block, at its feed-forward's end: the stage's root and
            # the block gathered, FSDP's flat all-gather buffer of the block (made in forward,
            # kept until the next unit's all-gather or the stage's end), and the block's own
            # transients, three of the residual stream's size in the compute dtype (measured
            # by `dtlab plan --check` with FSDP, FSDP x TP and FSDP x TP x SP pipelines).
            # Over a shard group of one rank (DDP beside a pipeline: FSDP2 replicating) FSDP2
            # copies each shard into its parameter without an all-gather: no flat buffer, and
            # the transients of a stage on unsharded weights (BlockShape.ffn_out_transients).
            flat_ones = block.forward_transients(self.tokens)
            transient = flat_ones if flat else block.ffn_out_transients
            self.add(name, "the stage's last block's feed-forward", grads=g_kept,
                     activations=op.held + transient, temporaries=t_kept + self.sending + flat,
                     buffers=bufs)  # fmt: skip

    def input_half(self, op: StageOp) -> None:
        """A zero-bubble schedule's input half of a backward: it keeps the micro-batch's
        activations and the gradient of every weight's output for its weight half, and sends the
        input's gradient back."""
        g_kept, t_kept = self.made()
        i, sid, last, held = op
        loss, block, bufs = self.loss, self.shapes[i], self.state.buffers
        captured, name = self.figures.captured[i], f"backward {self.forwards}"
        if last and loss is not None:
            self.add(name, "the loss's backward (its gradients over the vocabulary)",
                     grads=g_kept, activations=held - loss.freed_before_backward(),
                     temporaries=t_kept + self.sending + self.pending + loss.backward_extra(),
                     buffers=bufs)  # fmt: skip
        self.add(name, "the input gradients made (the weights' wait)", grads=g_kept,
                 activations=held,
                 temporaries=t_kept + self.sending + self.pending + captured + block.norm_temps
                 - (0 if last else block.incoming),
                 buffers=bufs)  # fmt: skip
        self.pending += captured
        self.sent += self.figures.stream if sid - 1 not in self.part.stages else 0
        g_kept, t_kept = self.made()
        self.add(f"after backward {self.forwards}", "between backward and the next forward",
                 grads=g_kept, activations=held,
                 temporaries=t_kept + self.sending + self.pending, buffers=bufs)  # fmt: skip

    def weight_half(self, op: StageOp) -> None:
        """A zero-bubble schedule's weight half of a backward: it makes the weights' gradients and
        frees what its input half kept (the micro-batch's activations, its weights' output
        gradients)."""
        g_kept, t_kept = self.made()
        i, _, last, held = op
        figures, block, bufs = self.figures, self.shapes[i], self.state.buffers
        self.add(f"backward {self.forwards}", "the weight gradients made", grads=g_kept,
                 activations=held,
                 temporaries=t_kept + self.sending + self.pending + block.w2_grad,
                 buffers=bufs)  # fmt: skip
        self.pending -= figures.captured[i]
        if last:  # its micro-batch's log-softmax, freed at its input half, is not freed again
            held += figures.log_softmax
        if not self.done[i]:
            self.made_n += self.grads[i].total
        self.done[i] = True
        g_kept, t_kept = self.made()
        left = held - figures.per_mb[i] - (0 if last else figures.stream)
        self.left = left
        self.add(f"after backward {self.forwards}", "between backward and the next forward",
                 grads=g_kept, activations=left,
                 temporaries=t_kept + self.sending + self.pending, buffers=bufs)  # fmt: skip

    def backward(self, op: StageOp, final: bool) -> None:
        """A whole backward (``final``: the walk's last op): the loss's, the stage's blocks', what
        is left after it and, after the stage's last backward under FSDP, its reduction."""
        kept = self.made()
        first_time = not self.done[op.i]
        # FSDP gathers the stage's units for a backward after a forward (resharded by it), the
        # next block prefetched; after a backward they are all still gathered.
        regather = self.fsdp is not None and self.fsdp.reshard and not self.after_backward[op.i]
        self._loss_backward(op, kept, first_time, regather)
        self._blocks_backward(op, kept, first_time, regather)
        self.left = self._after_backward(op, final, regather)
        self._reduce_stage(op, self.left)

    def tied_received(self, nbytes: int, after_step: bool) -> None:
        """One end of a tied model's pipeline receiving ``nbytes`` of the embedding from the other
        into a buffer of its own (:class:`dtlab.parallel.pipeline.TiedEmbedding`): the first
        stage's rank the copy's gradient after the step's backward, beside every gradient; the
        last stage's rank (``after_step``) the embedding's new value after the optimizer step,
        beside the gradients it stepped with (dropped after it). Both outside the optimizer's
        step: the check files them under the last ``after backward`` moment."""
        grads = self.state.grads if after_step else self.made()[0]
        what = "the embedding's new value" if after_step else "its copy's gradient"
        self.add(f"after backward {self.forwards}", f"the tied embedding: {what} received",
                 grads=grads, activations=self.left, temporaries=nbytes,
                 buffers=self.state.buffers + self.gathered(None, 0))  # fmt: skip

    def _loss_backward(
        self, op: StageOp, kept: tuple[int, int], first_time: bool, regather: bool
    ) -> None:
        """On the last stage, the loss's backward and, where FSDP gathers the stage again, the
        output projection's, with FSDP's prefetch of the stage's last block."""
        loss, fsdp, block = self.loss, self.fsdp, self.shapes[op.i]
        if not op.last or loss is None:
            return
        g_kept, t_kept = kept
        name = f"backward {self.forwards}"
        self.add(name, "the loss's backward (its gradients over the vocabulary)", grads=g_kept,
                 activations=op.held - loss.freed_before_backward(),
                 temporaries=t_kept + self.sending + loss.backward_extra(),
                 buffers=self.state.buffers + self.gathered(None, 0))  # fmt: skip
        head = self._deferred(op.i, first_time)[0]
        if fsdp is not None and regather:
            freed, out = loss.at_output(block.dim, block.compute, block.grad_element)
            self.add(name, "the output projection's backward", grads=g_kept,
                     activations=op.held - freed,
                     temporaries=t_kept + self.sending + out + fsdp.prefetched + head,
                     buffers=self.state.buffers + self.gathered(op.i, 0))  # fmt: skip
        # The final norm's backward (dtlab.analysis.step_points): the output's gradients made, the
        # loss's activations freed but the norm's float32 input.
        new = self._grads_at(op.i, first_time, 0)[0] - block.w2_grad
        ahead = fsdp.prefetched if fsdp is not None and regather else 0
        below = op.held - self.loss_part + block.final_norm_kept
        for where, unmade, activations, own in block.final_points(below):
            self.add(name, where, grads=g_kept + max(0, new - unmade), activations=activations,
                     temporaries=t_kept + self.sending + own + ahead + head,
                     buffers=self.state.buffers + self.gathered(op.i, 0))  # fmt: skip

    def _blocks_backward(
        self, op: StageOp, kept: tuple[int, int], first_time: bool, regather: bool
    ) -> None:
        """The stage's blocks' backward at the points :meth:`_block_points` names: each one's
        recomputation's end (checkpointed), its feed-forward's backward and its norm's."""
        i, last = op.i, op.last
        block, w2_copy, fsdp = self.shapes[i], self.copies[i], self.fsdp
        g_kept, t_kept = kept
        name = f"backward {self.forwards}"
        # The residual gradient into a stage before the last is its receive buffer (counted);
        # under sequence parallelism its gathered copy is backward's own.
        into = 0 if last else block.stream_row
        temps = block.temps - into
        # A backward after the stage's first: each cast weight's half-precision gradient waits
        # for the backward's end (StageFigures.casts), the output projection's and those of the
        # blocks above; of the block's own, the down projection's at its backward, the
        # feed-forward's three at its norm's, all of them at the attention norm's.
        head, per_block = self._deferred(i, first_time)
        ffn_wait = 3 * w2_copy if per_block else 0
        grows = first_time or self.buffered
        prefetch = fsdp.prefetched if fsdp is not None and regather and self.n_blocks[i] > 1 else 0
        again, gone = self.recompute
        for which, alive, above, ahead in self._block_points(op, prefetch):
            bufs = self.state.buffers + self.gathered(i, above + 1)
            new, moved = self._grads_at(i, first_time, above)
            moved += head + above * per_block  # (the casts' gradients waiting: temporaries)
            if not above and fsdp is not None and regather and fsdp.prefetched:
                # The stage's last block gathered for its backward: its parameters copied out of
                # FSDP's all-gather buffer, both alive, the residual gradient come in, nothing of
                # the block's freed yet (the step's peak where a stage's block outweighs the final
                # norm's float32 temporaries; measured by `dtlab plan --check`).
                # On a stage without the loss, whose root is first used at its backward's end
                # (the embedding), the root's flat all-gather buffer, made as the stage's
                # backward starts, is still alive then too; where the block is the stage's only
                # one, the root is the unit it prefetches, after its own buffer is freed
                # (measured by `dtlab plan --check` on first stages of one and of eight blocks).
                root_flat = 0 if last else fsdp.roots[i]
                flats = fsdp.prefetched + root_flat
                if self.n_blocks[i] == 1:
                    flats = max(fsdp.prefetched, root_flat)
                self.add(name, f"the stage's {which} block copied out of its all-gather buffer",
                         grads=g_kept + max(0, new - block.w2_grad), activations=alive,
                         temporaries=t_kept + moved + self.sending
                         + (block.incoming if last else 0) + flats,
                         buffers=bufs)  # fmt: skip
            if again:
                self.add(name, f"the stage's {which} block recomputed",
                         grads=g_kept + max(0, new - block.w2_grad), activations=alive + again,
                         temporaries=t_kept + moved + self.sending
                         + (block.incoming if last else 0),
                         buffers=bufs)  # fmt: skip
            if block.float8_temps:  # train.float8: the down projection's casts
                f8 = block.float8_temps - into
                self.add(name, f"the stage's {which} block's down projection's float8 casts",
                         grads=g_kept + max(0, new - block.w2_grad),
                         activations=alive + again - gone,
                         temporaries=t_kept + moved + self.sending + f8 + ahead,
                         buffers=bufs)  # fmt: skip
            self.add(name, f"the stage's {which} block's feed-forward backward",
                     grads=g_kept + new, activations=alive + again - gone - block.freed,
                     temporaries=t_kept + moved + self.sending + temps + ahead
                     + (w2_copy if per_block else 0),
                     buffers=bufs)  # fmt: skip
            if not again and not block.attention_temps:
                # The attention norm's backward (dtlab.analysis.step_points): every weight gradient
                # of the block made, what it kept freed but the norm's float32 input.
                # (After the stage's first backward each is added into its gradient as it is
                # made, but where FSDP buffers them.)
                made = block.grads + block.routed_grads - block.w2_grad if grows else 0
                self.add(name, f"the stage's {which} block's attention norm's backward",
                         grads=g_kept + new + made,
                         activations=alive - self._blocks_kept(op) // self.n_blocks[i]
                         + block.final_norm_kept,
                         temporaries=t_kept + moved + self.sending + block.norm_temps - into
                         + ahead + per_block,
                         buffers=bufs)  # fmt: skip
            if block.routed_temps:  # an MoE block's routed experts (dtlab.analysis.rank_timeline)
                self.add(name, f"the stage's {which} block's routed experts' backward",
                         grads=g_kept + max(0, new - block.w2_grad),
                         activations=alive + again - gone - block.routed_freed,
                         temporaries=t_kept + moved + self.sending + ahead
                         + (block.routed_temps if grows else block.routed_added),
                         buffers=bufs)  # fmt: skip
            # (The gradients alive from here to the block's attention backward.)
            norm_grads = (
                g_kept + new + (2 * block.w2_grad + block.dim * block.grad_element if grows else 0)
            )
            # The feed-forward's activations freed by then (autocast's weight copies are not).
            at_norm = alive + again - gone - block.norm_freed + 3 * w2_copy
            self.add(name, f"the stage's {which} block's feed-forward norm's backward",
                     grads=norm_grads, activations=at_norm,
                     temporaries=t_kept + moved + self.sending + block.norm_temps - into + ahead
                     + ffn_wait,
                     buffers=bufs)  # fmt: skip
            # Sequence parallelism under autocast (dtlab.analysis.timeline.BlockShape): the
            # feed-forward's and the attention's input gradients over the whole sequence.
            if block.ffn_input_temps:
                self.add(name, f"the stage's {which} block's feed-forward input's gradient",
                         grads=norm_grads, activations=at_norm + block.ffn_input_kept,
                         temporaries=t_kept + moved + self.sending + block.ffn_input_temps
                         - into + ahead + ffn_wait,
                         buffers=bufs)  # fmt: skip
            if block.qkv_input_temps:
                self.add(name, f"the stage's {which} block's attention input's gradient",
                         grads=norm_grads + block.qkv_grads,
                         activations=alive - self._blocks_kept(op) // self.n_blocks[i]
                         + block.qkv_input_kept,
                         temporaries=t_kept + moved + self.sending + block.qkv_input_temps
                         - into + ahead + per_block,
                         buffers=bufs)  # fmt: skip
            if block.attention_temps:  # context parallelism's ring (dtlab.analysis.context_plan)
                self.add(name, f"the stage's {which} block's attention backward",
                         grads=norm_grads + block.attention_grads,
                         activations=at_norm - block.attention_freed,
                         temporaries=t_kept + moved + self.sending + block.attention_temps
                         - into + ahead + ffn_wait,
                         buffers=bufs)  # fmt: skip

    def _deferred(self, i: int, first_time: bool) -> tuple[int, int]:
        """A backward of stage ``i`` after its first (:attr:`StageFigures.casts`): (the output
        projection's half-precision weight gradient, one block's), alive from that layer's
        backward to the backward's end; (0, 0) at the stage's first backward, or where autocast
        casts no weight."""
        f = self.figures
        if first_time or not f.casts or not f.casts[i]:
            return 0, 0
        head = f.heads[i]
        return head, (f.casts[i] - head) // self.n_blocks[i]

    def _blocks_kept(self, op: StageOp) -> int:
        """What one micro-batch's forward keeps of stage ``op.i``'s blocks (the stage's own less
        the loss's part; each block an equal share)."""
        return self.figures.per_mb[op.i] - (self.loss_part if op.last else 0)

    def _block_points(self, op: StageOp, prefetch: int) -> list[tuple[str, int, int, int]]:
        """The stage's blocks looked at in a backward, as (which, activations alive, blocks above
        it, FSDP's prefetch then): its last block, its second (with FSDP regathering, the last
        point with a block prefetched, one block's activations more than the first) and its
        first."""
        i, last = op.i, op.last
        n = self.n_blocks[i]
        top_alive = op.held - (self.loss_part if last else 0)
        own = self._blocks_kept(op)
        bottom_alive = top_alive - own + own // n
        points = [("last", top_alive, 0, prefetch)]
        if n > 2:
            points.append(("second", bottom_alive + own // n, n - 2, prefetch))
        if n > 1:
            points.append(("first", bottom_alive, n - 1, 0))
        return points

    def _grads_at(self, i: int, first_time: bool, above: int) -> tuple[int, int]:
        """At a block's feed-forward backward on stage ``i`` (``above`` blocks above it done):
        (the gradients made as the parameters', those moved into FSDP's float32 buffers)."""
        g, block = self.grads[i], self.shapes[i]
        per_block = g.blocks // self.n_blocks[i]
        # At the stage's first backward every one so far (its output's first), later the down
        # projection's (FSDP's own gradients, not accumulated).
        if first_time:
            new = g.head + above * per_block + block.w2_grad
        else:
            new = block.w2_grad if self.buffered else 0
        moved = 0
        if self.buffered:
            # FSDP in half precision moves each block's gradients, once made, into float32
            # buffers of its own (temporaries; at the stage's first backward, those of the
            # blocks above): only the block in backward's are the parameters', and the
            # root's, made anew at every backward and so until the stage's backward ends.
            moved = above * per_block if first_time else 0
            new = g.head + block.w2_grad
        return new, moved

    def _after_backward(self, op: StageOp, final: bool, regather: bool = False) -> int:
        """Between a backward and the next op (the schedule's own code): the stage's gradients
        made, the micro-batch's activations freed, and a stage before the last frees its output
        kept for backward (``regather``: FSDP gathered the stage again for this backward).
        Returns the activations then alive."""
        i, sid, last, held = op
        figures, g, block = self.figures, self.grads[i], self.shapes[i]
        first_time, sent_before = not self.done[i], self.sending
        if first_time:
            self.made_n += g.total
        self.done[i] = True
        self.after_backward[i] = True
        if self.split and sid != 0 and sid - 1 not in self.part.stages:
            self.sent += figures.stream
        # Single-stage schedules wait for a backward's send at the next one's; the multi-stage
        # schedules wait at once, and every schedule for its last sends.
        self.sending = figures.stream if sid != 0 and len(self.part.stages) == 1 else 0
        if final:
            self.sending = 0
        g_kept, t_kept = self.made()
        name = f"backward {self.forwards}"
        # The micro-batch's activations freed, with its output (the last stage's logits), but
        # where a single-stage schedule's loop still holds its latest forward's output (torch's
        # GPipe and 1F1B keep it in a local until their next forward).
        out = 0 if self.held_over else figures.stream if not last else figures.logits
        left = held - figures.per_mb[i] - out
        root = g.head + g.embed // FP32 * block.grad_element  # in the parameters' dtype
        fsdp = self.fsdp
        if fsdp is not None and fsdp.reshard and sid == 0 and fsdp.scatter > 1 and not regather:
            # A backward after a backward: the blocks still gathered, the root (resharded by the
            # last one) gathered again for the embedding's backward, its flat buffer alive beside
            # it with the embedding's input gradient, every other gradient of the stage made, the
            # micro-batch's activations freed but its output (measured by `dtlab plan --check`:
            # with a large vocabulary a first stage's peak). A backward after a forward gathers
            # the root at its start instead (its buffer at the last block's copy-out, above).
            self.add(name, "the embedding's backward", grads=g_kept, activations=left + out,
                     temporaries=t_kept + self.sending + fsdp.roots[i] + figures.stream,
                     buffers=self.state.buffers + self.gathered(None, 0))  # fmt: skip
        if self.buffered and root:
            # The stage's root unit (its embedding, or its output and final norm) is reduced last,
            # at the backward's end: its gradients, made in the parameters' dtype, are alive
            # beside their float32 copy in FSDP's buffers until they are freed (measured by
            # `dtlab plan --check`: llama3.2-1b's first stage, its 501 MiB bf16 embedding).
            self.add(name, "the root's gradients copied into FSDP's float32 buffers",
                     grads=g_kept + root, activations=left, temporaries=t_kept + self.sending,
                     buffers=self.state.buffers + self.gathered(None, 0))  # fmt: skip
        head, per_block = self._deferred(i, first_time)
        waiting = head + per_block * self.n_blocks[i]
        if fsdp is not None and fsdp.scatter == 1 and sid == 0 and block.compute < FP32:
            left = self._replicated_embedding(op, left + out, waiting)
        elif fsdp is None and sid == 0 and not first_time:
            # The embedding's backward after the stage's first: its float32 gradient made (then
            # added into the parameter's), beside its output's gradient and the cast weights'.
            self.add(name, "the embedding's backward", grads=g_kept, activations=left + out,
                     temporaries=t_kept + self.sending + waiting + g.embed
                     + FP32 * self.tokens * block.dim,
                     buffers=self.state.buffers + self.gathered(None, 0))  # fmt: skip
        if waiting:
            # The backward's end: the cast weights' gradients cast to float32 one by one, the
            # newest cast first (the output projection's, else the last block's down
            # projection's), its float32 gradient beside every half-precision one; the stage's
            # input gradient made (measured by `dtlab plan --check` and in real gloo runs).
            first = (head or self.copies[i]) // block.compute * FP32
            into = figures.stream if sid != 0 else 0
            self.add(name, "the cast weights' gradients cast to float32", grads=g_kept,
                     activations=left + out,
                     temporaries=t_kept + sent_before + waiting + first + into,
                     buffers=self.state.buffers + self.gathered(None, 0))  # fmt: skip
        self.add(f"after backward {self.forwards}", "between backward and the next forward",
                 grads=g_kept, activations=left, temporaries=t_kept + self.sending,
                 buffers=self.state.buffers + self.gathered(None, 0))  # fmt: skip
        return left

    def _replicated_embedding(self, op: StageOp, left: int, waiting: int) -> int:
        """DDP beside a pipeline (FSDP2 replicating over shard groups of one rank) in half
        precision, its first stage: each unit's float32 gradients are made as the unit's backward
        ends, so at the embedding's backward (the stage's last) every one but the embedding's is,
        beside the embedding's gradient in the compute dtype twice and the float32 gradient of its
        output; and the stage keeps its output in float32 through the step's end, twice the stream
        it sent (measured by `dtlab plan --check`); ``left``: the activations alive then, the
        output among them; ``waiting``: the cast weights' gradients of a backward after the
        stage's first (:meth:`_deferred`), whose embedding's gradient is added into its own.
        Returns them."""
        g_kept, t_kept = self.made()
        g, block = self.grads[op.i], self.shapes[op.i]
        half = g.embed // FP32 * block.compute
        self.add(f"backward {self.forwards}", "the embedding's backward",
                 grads=g_kept - (0 if waiting else g.embed), activations=left,
                 temporaries=t_kept + self.sending + 2 * half + FP32 * self.tokens * block.dim
                 + waiting,
                 buffers=self.state.buffers + self.gathered(None, 0))  # fmt: skip
        return left

    def _reduce_stage(self, op: StageOp, left: int) -> None:
        """After the stage's last backward under FSDP: its gradients reduced, its units resharded
        (torch's REDUCE_GRAD), the first unit's float32 copy beside every unreduced gradient;
        ``left``: the activations alive."""
        i, fsdp = op.i, self.fsdp
        self.backwards[i] -= 1
        if fsdp is None or self.backwards[i]:
            return
        g_kept, t_kept = self.made()
        block, name = self.shapes[i], f"after backward {self.forwards}"
        root_copy = fsdp.roots[i] // block.grad_element * FP32
        block_copy = fsdp.block // block.grad_element * FP32
        # A root unit's gradients outlive its copy until its reduce-scatter's output is made
        # (measured by `dtlab plan --check`; a block's are freed before). Over a shard group
        # of one rank (DDP beside a pipeline: FSDP2 replicating) no output is made apart.
        out = root_copy // fsdp.scatter if fsdp.scatter > 1 else 0
        copy = root_copy + out if root_copy else block_copy
        first = fsdp.roots[i] or fsdp.block
        bufs = self.state.buffers + self.gathered(None, 0)
        self.add(name, "the stage's gradients reduce-scattered", grads=g_kept, activations=left,
                 temporaries=t_kept + self.sending + copy, buffers=bufs - first)  # fmt: skip
        if root_copy:
            # Then its first block's: the root's gradients freed, their shard made (its copy
            # freed as the block's starts), the block resharded and copied in turn.
            dropped = (0, root_copy) if self.buffered else (root_copy, 0)
            self.add(name, "the stage's gradients reduce-scattered (its first block's)",
                     grads=g_kept - dropped[0], activations=left,
                     temporaries=t_kept - dropped[1] + self.sending + root_copy // fsdp.scatter
                     + block_copy,
                     buffers=bufs - first - fsdp.block)  # fmt: skip
        self.made_n -= self.grads[i].total
        self.shards_n += fsdp.shards[i]
        self.reduced[i] = True
