"""The step's memory timeline: what one rank holds at each moment of an optimizer step, and its peak.

What decides whether a step runs out of memory is the most alive at once, not each part's own peak
added up. A step is a sequence of moments, named as ``dtlab plan --check`` names them
(:class:`dtlab.analysis.check._Peaks`): ``forward k``, ``backward k`` and ``after backward k`` of
each micro-batch k, then ``optimizer``. For each moment the plan predicts the most alive at once
and what it is, by component (this module holds the moments and the shapes they are drawn from;
:mod:`dtlab.analysis.step_points` the points of a step without pipeline parallelism,
:mod:`dtlab.analysis.pipeline_steps` a pipeline rank's):

- ``params``, ``optimizer``: the rank's own parameters (its shards) and optimizer state, at every
  moment;
- ``grads``: the parameters' gradients alive then: nothing before the step's first backward (they
  are freed after each step), the blocks' gradients as backward makes them (FSDP's unsharded ones
  until their reduce-scatter, then the shards), the whole set from the second micro-batch on; DDP's
  are its buckets, allocated once and kept;
- ``activations``: what forward made and is still alive (what it keeps for backward, a block
  recomputed under checkpointing, and at the loss the logits beside their log-softmax);
- ``temporaries``: what backward and the optimizer make and free (the gradients of the logits and
  of each block's activations, FSDP's reduce-scatter buffers, HSDP's partial shards between
  micro-batches);
- ``buffers``: module buffers (RoPE tables) and parameters gathered beyond the rank's own shards.

Within a moment the candidates for its peak are the points where the most is alive: in forward,
the loss (the logits beside their log-softmax); in backward, the loss's gradient over the
vocabulary, and the feed-forward's backward of the last and of the first block (the gated product's
two gradients beside the down projection's input gradient, after that projection's saved input is
freed). Each point's figures follow the tensors dtlab's model, loss and wrappers make there,
measured op by op with ``dtlab plan --check`` on every layout the tests hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dtlab.analysis.activations import FP32

COMPONENTS = ("params", "grads", "optimizer", "activations", "temporaries", "buffers")


@dataclass(frozen=True)
class Moment:
    """The most one rank holds at once in one moment of the step, by component, and where."""

    name: str  # "forward 1", "backward 1", "after backward 1", "optimizer"
    where: str  # what runs at that point
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    temporaries: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.temporaries
            + self.buffers
        )

    def components(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in COMPONENTS}

    def as_dict(self) -> dict[str, object]:
        return {"moment": self.name, "where": self.where, "total": self.total, **self.components()}


@dataclass
class Timeline:
    """The step's moments, each its most alive at once (the largest of its candidate points)."""

    moments: dict[str, Moment] = field(default_factory=dict)
    _totals: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    buffers_peak: int = 0  # the most buffers at any point, kept or not

    def add(self, m: Moment) -> None:
        self.buffers_peak = max(self.buffers_peak, m.buffers)
        total = m.total
        if total > self._totals.get(m.name, -1):
            self.moments[m.name] = m
            self._totals[m.name] = total

    @property
    def peak(self) -> Moment:
        return max(self.moments.values(), key=lambda m: m.total)

    def at(self, name: str) -> Moment | None:
        return self.moments.get(name)

    def as_list(self) -> list[Moment]:
        return list(self.moments.values())


@dataclass(frozen=True)
class LossShape:
    """What the loss makes over the vocabulary, per micro-batch of ``tokens`` tokens: ``vocab`` the
    rank's share of the logits' columns (split by tensor parallelism), ``half`` whether the logits
    come in half precision (autocast, or FSDP's half-precision parameters), ``parallel`` whether it
    is the vocabulary-parallel loss (tensor parallelism)."""

    tokens: int
    vocab: int
    half: bool
    parallel: bool
    # The compiled loss (dtlab.train.loss under train.compile): its fused kernels make no
    # [tokens, vocab] float32 in forward or backward; its backward makes the logits' gradient
    # in their dtype beside them (measured on an H200: docs/planning.md).
    compiled: bool = False

    def forward_extra(self) -> int:
        """Beyond what the loss keeps (its float32 log-softmax): the logits (and in half precision
        their float32 copy) alive at the log-softmax. The vocabulary-parallel loss holds one more
        [tokens, vocab] float32 (the shifted logits beside their exponent) and a few bytes a token
        (the row maxima and sums)."""
        if self.compiled:
            return 0
        cells = self.tokens * self.vocab
        logits = cells * (2 if self.half else FP32) + (FP32 * cells if self.half else 0)
        if self.parallel:
            return logits + FP32 * cells + 12 * self.tokens - 12
        return logits

    def backward_extra(self) -> int:
        """The loss's backward at its peak: the gradients of the log-softmax and of the logits
        (each [tokens, vocab] float32); the vocabulary-parallel loss holds three such (and a few
        bytes a token of masks and indices)."""
        cells = self.tokens * self.vocab
        if self.compiled:  # the logits' gradient
            return cells * (2 if self.half else FP32)
        if self.parallel:
            return 3 * FP32 * cells + 33 * self.tokens + 4
        return 2 * FP32 * cells

    def at_output(self, dim: int, compute: int, grad_bytes: int) -> tuple[int, int]:
        """The output projection's backward, after the loss's: (what the loss's forward kept and
        is freed by then, backward's own alive then): the log-softmax freed; the logits' gradient
        (in the logits' dtype), the projection's input gradient [tokens, dim] and its weight
        gradient [vocab, dim] (``grad_bytes`` an element) made."""
        cells = self.tokens * self.vocab
        logits = cells * (2 if self.half else FP32)
        # Compiled, what is freed is the logits themselves (their gradient is in temps).
        freed = self.freed_before_backward() + (logits if self.compiled else FP32 * cells)
        temps = logits + compute * self.tokens * dim
        return freed, temps + grad_bytes * self.vocab * dim

    def freed_before_backward(self) -> int:
        """What the loss keeps for its forward only and frees before its backward peak: the
        targets' int64 copy (the vocabulary-parallel loss keeps its own until later)."""
        return 0 if self.parallel else 8 * self.tokens - 4


@dataclass(frozen=True)
class RankState:
    """What a rank holds besides one micro-batch's activations, as the plan predicts it: its own
    parameters and optimizer state, the gradients the optimizer steps with, module buffers; and the
    gradients as backward makes them: the output's and final norm's (``head_grads``, made first),
    the embedding's (``embed_grads``, made last), each block's (in :class:`BlockShape`).

    ``tied_grad``: a tied model's output projection reads the embedding, which the model also
    looks up: autograd holds the output's gradient of it (a temporary, not yet the embedding's
    gradient) from the output's backward until the lookup's backward adds its own (measured by
    `dtlab plan --check`; 0 where the model is untied, or in a pipeline, whose last stage holds a
    copy of its own)."""

    params: int
    optimizer: int
    grads: int
    buffers: int
    head_grads: int = 0
    embed_grads: int = 0
    tied_grad: int = 0


@dataclass(frozen=True)
class FsdpUnits:
    """FSDP's units: the root (embedding, final norm, output) and each block, gathered (bytes in the
    dtype it gathers in); a block's gradient shard (float32, what its reduce-scatter leaves);
    ``reshard``: blocks are freed after their forward (sharding ``full``); ``hsdp``: before the
    last micro-batch the shards wait for the replica groups' all-reduce in buffers of FSDP's own
    (temporaries), not as the parameters' gradients."""

    root: int
    block: int
    block_shard: int
    reshard: bool
    hsdp: bool
    scatters: bool = True  # shard groups of several ranks: each unit's gradients reduce-scattered
    shard: int = 1  # the ranks of a shard group
    block_last: int = 0  # a block's last parameter, gathered (its :attr:`BlockKind.last_grad`)

    @property
    def prefetches(self) -> bool:
        """Backward gathers each block ahead of its turn into a buffer of its own: resharded after
        forward, over a shard group of several ranks (over one, a block's shards are its
        parameters: nothing is gathered)."""
        return self.reshard and self.scatters


@dataclass(frozen=True)
class BlockShape:
    """One block's backward at its feed-forward point: ``temps`` what is alive of backward's own
    (the residual gradient, the down projection's input gradient, the gated product's two),
    ``freed`` what the block's forward kept and is freed by then (the down projection's input, and
    its autocast weight copy), ``w2_grad`` the down projection's weight gradient (made by then),
    ``grads`` all of the block's weight gradients as backward makes them; ``incoming`` what of
    backward's own is alive as the block's backward starts (the residual stream's gradient, and
    under sequence parallelism its gathered copy), where a checkpointed block is recomputed."""

    temps: int
    freed: int
    w2_grad: int
    grads: int
    incoming: int = 0
    copy: int = 0  # of ``freed``, the down projection's autocast weight copy
    dim: int = 0  # the model's width
    compute: int = FP32  # bytes of an activation element
    grad_element: int = FP32  # bytes of a weight gradient's element, as backward makes it
    # The feed-forward's norm's backward, after the feed-forward's: backward's own alive at its
    # peak (the residual gradient and float32 [tokens, dim] temporaries, not split by tensor
    # parallelism), and what the block's forward kept that is freed by then (the feed-forward's
    # activations, the norm's output and its copies).
    norm_temps: int = 0
    norm_freed: int = 0
    # Context parallelism's ring (dtlab.analysis.context_plan): its attention's backward, after the
    # attention's output projection's: backward's own alive then (the residual gradient, the
    # ring's accumulators and blocks in flight); 0 where the attention's backward is no peak of its
    # own.
    attention_temps: int = 0
    attention_freed: int = 0  # the output projection's input, freed by its backward
    attention_grads: int = 0  # the output projection's weight gradient, made by then
    # train.float8 (dtlab.analysis.float8_plan): the down projection's backward at its input's
    # cast to float8 (for its weight's gradient), before that gradient is made and its input
    # freed: backward's own alive then; 0 where the down projection is no float8 layer.
    float8_temps: int = 0
    # An MoE block's routed experts' backward (:func:`dtlab.analysis.rank_timeline.routed_backward`):
    # backward's own alive at its peak (the stacked weights' gradients as autograd accumulates
    # them, the routed rows' output gradient) and what the block's forward kept that is freed by
    # then; 0 where the block routes nothing.
    routed_temps: int = 0
    routed_freed: int = 0
    # The same where the routed experts' gradients exist already (a later micro-batch's backward,
    # which adds each into its gradient as it comes): the grouped kernel's are then made and freed
    # one at a time; the loop's as in the first.
    routed_added: int = 0
    # The routed experts' gradients as backward makes them (the stacked weights'), alive at the
    # feed-forward norm's backward where the wrappers do not hold them already.
    routed_grads: int = 0
    # The model's final norm (a norm like the blocks' ones): its float32 input, kept until its
    # backward ends, and its backward's own at its peak: five float32 [tokens, dim] rows (the
    # incoming gradient's among them, whatever its dtype: no residual branch waits beside it).
    final_norm_kept: int = 0
    final_norm_temps: int = 0
    # Sequence parallelism under autocast on a float32 stream (no checkpointing): each matmul's
    # input gradient comes over the whole gathered sequence in bf16 and is cast to float32 before
    # the sum that is reduce-scattered. After w1's and w3's backward, two such [tokens, dim]
    # float32 beside the residual gradient and the scattered shard, the norm's output shard still
    # kept (``ffn_input_*``); in the attention's, three (the q, k and v projections' two and their
    # sum), with what is left of the block then: the attention norm's own and one cast of its
    # output (``qkv_input_kept``), and the output projection's and v's weight gradients made
    # (``qkv_grads``). 0 where these are no points of their own.
    ffn_input_temps: int = 0
    ffn_input_kept: int = 0
    # The same at the output projection's backward (its input's gradient, two whole float32
    # [tokens, dim] beside the scattered shard), the final norm's output shard still kept.
    output_input_temps: int = 0
    qkv_input_temps: int = 0
    qkv_input_kept: int = 0
    qkv_grads: int = 0
    # The residual stream on this rank ([tokens, dim], its sequence shard) in its dtype: a block's
    # input or output in forward.
    stream_row: int = 0
    # At the end of the feed-forward's forward, on unsharded weights, what it holds beyond what
    # it keeps for backward: its down projection's output, whole (under tensor parallelism one
    # float32 [tokens, dim] whatever the compute dtype; under sequence parallelism its partial
    # sum, its reduction's copy and scattered shard, and under autocast on a float32 stream a
    # float32 [tokens, dim] more).
    ffn_out_transients: int = 0

    def final_points(self, below: int) -> list[tuple[str, int, int, int]]:
        """The last stage's points between the output projection's backward and its last block's,
        as (where, gradients of the head not made yet, activations, backward's own temporaries),
        given ``below``: the activations alive at the final norm's backward (the blocks' and the
        norm's float32 input). Under sequence parallelism with autocast the output projection's
        input gradient first (the final norm's output shard still kept, its weight's gradient not
        made), then the final norm's backward."""
        points = [("the final norm's backward", 0, below, self.final_norm_temps)]
        if self.output_input_temps:
            unmade = self.dim * self.grad_element  # the final norm's weight's gradient
            points.insert(0, ("the output projection's input's gradient", unmade,
                              below + self.ffn_input_kept, self.output_input_temps))  # fmt: skip
        return points

    def forward_transients(self, tokens: int) -> int:
        """Inside the block's forward at its feed-forward's end, what it holds beyond what it
        keeps for backward, but its output: residual-stream-sized tensors of ``tokens`` rows in the
        compute dtype, one in float32 and three in half precision (measured by `dtlab plan
        --check` on whole models and pipeline stages under FSDP, not yet told apart)."""
        return (3 if self.compute < FP32 else 1) * tokens * self.dim * self.compute

    def kept_copies(self) -> BlockShape:
        """The same block where autocast's weight copies live through the step (a pipeline's one
        autocast region around its schedule): the down projection's is not freed."""
        return replace(self, freed=self.freed - self.copy, copy=0)


@dataclass(frozen=True)
class BlockKind:
    """One block of a rank as its step's timeline sees it: its backward's ``shape``, what one
    micro-batch's forward keeps of it (``kept``), what recomputing it adds under checkpointing
    (``recompute``: at the recomputation's end, and of it what is freed before the feed-forward's
    backward), and FSDP's unit of it (``unit`` gathered, ``unit_shard`` its gradients' shard in
    float32). A dense model's blocks are alike; a mixture of experts' dense and MoE blocks are not."""

    shape: BlockShape
    kept: int
    recompute: tuple[int, int]
    unit: int = 0
    unit_shard: int = 0
    # Float32 gradients the block makes outside FSDP's units (expert parallelism's experts, whole
    # on the rank and averaged over their own group after backward): alive from its backward on.
    outside: int = 0
    # The unit's last parameter's gradient as backward makes it: FSDP's reduce keeps it through
    # the unit's reduce-scatter (torch 2.13's foreach_reduce's loop variable still names it).
    last_grad: int = 0


def dense_block(
    tokens: int,
    dim: int,
    hidden: int,
    tp: int,
    seq: int,
    compute: int,
    stream: int,
    autocast_copies: bool,
    grad_bytes: int,
    block_params: int,
    float8: tuple[bool, bool] | None = None,
) -> BlockShape:
    """:class:`BlockShape` of a dense (SwiGLU) block: ``hidden`` split over ``tp`` ranks, the residual
    stream's gradient a sequence shard over ``seq`` ranks, in ``stream`` bytes an element; the
    matmuls in ``compute`` bytes; ``grad_bytes``: a weight gradient's element (the parameters');
    ``block_params``: the block's parameter elements on this rank; ``float8``: the feed-forward's
    layers train in float8 (no autocast weight copies; the down projection's casts in backward:
    :func:`dtlab.analysis.float8_plan.down_projection_casts`), as (its weight cast in backward,
    recomputed under full checkpointing)."""
    local = tokens * hidden // tp
    residual = stream * tokens * dim // seq
    temps = residual + 3 * compute * local
    copy = 2 * dim * hidden // tp if autocast_copies and float8 is None else 0
    float8_temps = 0
    if float8 is not None:
        from dtlab.analysis.float8_plan import down_projection_casts

        # Its input's gradient made, the casts in flight; a float32 residual stream's gradient
        # comes to the layer as a copy in the compute dtype.
        casts = down_projection_casts(tokens, dim, hidden, tp, compute, *float8)
        copy_in = compute * tokens * dim if stream != compute else 0
        float8_temps = residual + compute * local + casts + copy_in
    w2 = grad_bytes * dim * hidden // tp
    gathered = compute * tokens * dim if seq > 1 else 0
    # RMSNorm's backward computes in float32 whatever the stream's dtype: at its peak (the
    # rsqrt's gradient) four [tokens, dim] float32 beside the residual gradient, five where the
    # gradient arrives in another dtype than float32 or as tensor parallelism's all-reduced sum
    # (measured by `dtlab plan --check`).
    row = FP32 * tokens * dim // seq
    extra = 5 if (tp > 1 or stream != FP32) else 4
    norm_temps = residual + extra * row
    # By then the norm's output in the stream's dtype (its sequence shard) and the feed-forward's
    # input are freed: that input is the norm's output itself (gathered over the sequence under
    # sequence parallelism) where the stream is in the matmuls' dtype, and autocast's two casts of
    # it (one for w1, one for w3) where it is not (measured by `dtlab plan --check`, tensor by
    # tensor, on bf16 and float32 streams, with and without sequence parallelism).
    casts = 1 if stream == compute else 2
    norm_input = stream * tokens * dim // seq + casts * compute * tokens * dim
    norm_freed = 4 * compute * local + 3 * copy + norm_input + FP32 * tokens // seq
    # (Measured by `dtlab plan --check` on pipeline stages, at two widths and token counts.)
    out = compute * tokens * dim
    if seq > 1:
        ffn_out = 5 * out // 2 + (FP32 * tokens * dim if stream != compute else 0)
    else:
        ffn_out = FP32 * tokens * dim if tp > 1 else out
    return BlockShape(
        temps, compute * local + copy, w2, grad_bytes * block_params, residual + gathered, copy,
        dim, compute, grad_bytes, norm_temps, norm_freed, float8_temps=float8_temps,
        final_norm_kept=row, final_norm_temps=5 * row, stream_row=residual,
        ffn_out_transients=ffn_out,
    )  # fmt: skip
