"""Context parallelism (:mod:`dtlab.parallel.context`): each sequence split over the ranks in zigzag
chunks; its attention (ring and all-to-all) equal to one process's causal attention, forward and
backward, and its training equal to one process's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import FAST, Metrics, assert_same_training, run_cli, run_worker, train_run
from dtlab.config import check_world, load_config
from dtlab.data.loader import BatchLayout, BatchLoader
from dtlab.data.sources import build_data
from dtlab.dims import ParallelDims, layout_name
from dtlab.errors import ConfigError
from dtlab.models.sequence import shard_sequence, unshard_sequence, zigzag_chunks


def test_each_rank_holds_an_early_and_a_late_chunk() -> None:
    assert [zigzag_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    x = torch.arange(16).reshape(1, 16)
    parts = [shard_sequence(x, 4, r) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(unshard_sequence(parts), x)
    with pytest.raises(ValueError, match="a sequence of 12 does not split into 8 chunks"):
        shard_sequence(torch.zeros(1, 12), 4, 0)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("method", ["ring", "alltoall"])
def test_context_parallel_attention_equals_one_process_forward_and_backward(
    cp: int, dtype: str, method: str
) -> None:
    run_worker("ring_attention_worker.py", cp, dtype, method, "4")


@pytest.mark.parametrize("kv_heads", ["2", "1"])
def test_alltoall_attention_with_grouped_key_value_heads(kv_heads: str) -> None:
    # 4 query heads over 2 ranks: 2 key/value heads split with them; 1 is expanded first.
    run_worker("ring_attention_worker.py", 2, "float64", "alltoall", kv_heads)


# --- the ring's blocks on a GPU's kernels ------------------------------------------------------------
def test_the_rings_kernel_is_the_one_the_models_attention_picks_on_each_device() -> None:
    from dtlab.parallel.context import CPU_FLASH, CUDA_EFFICIENT, CUDA_FLASH, ring_kernel

    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert ring_kernel("cpu", dtype, False) == ring_kernel("cpu", dtype, True) == CPU_FLASH
    h100 = (9, 0)
    assert ring_kernel("cuda", torch.bfloat16, False, h100) == CUDA_FLASH
    assert ring_kernel("cuda", torch.float16, False, h100) == CUDA_FLASH
    # A document mask's part of a block: an additive bias, which flash does not take.
    assert ring_kernel("cuda", torch.bfloat16, True, h100) == CUDA_EFFICIENT
    assert ring_kernel("cuda", torch.float32, False, h100) == CUDA_EFFICIENT  # flash: half only
    assert ring_kernel("cuda", torch.float16, False, (7, 5)) == CUDA_EFFICIENT  # no flash on a T4
    with pytest.raises(ValueError, match=r"bf16 on sm75: no fused kernel; parallel\.cp_method = "):
        ring_kernel("cuda", torch.bfloat16, False, (7, 5))
    with pytest.raises(ValueError, match=r"got tensors on mps: parallel\.cp_method = 'alltoall'"):
        ring_kernel("mps", torch.float32, False)


@pytest.mark.parametrize(
    ("kernel", "dtype", "masked"),
    [("cuda flash", torch.bfloat16, False), ("cuda efficient", torch.float32, False),
     ("cuda efficient", torch.float32, True), ("cuda efficient", torch.bfloat16, True)],
)  # fmt: skip
@pytest.mark.parametrize("causal", [True, False])
def test_the_gpu_kernels_are_called_as_their_signatures_take_them(
    kernel: str, dtype: torch.dtype, masked: bool, causal: bool
) -> None:
    """Each CUDA kernel's forward and backward as a ring block calls them (flash without a mask,
    the memory-efficient kernel with one or in fp32), on meta tensors (their shapes and dtypes,
    torch's own checks of the arguments): 20 positions a chunk, neither the bias's alignment of 16
    nor the memory-efficient kernel's log-sum-exp rows of 32."""
    from dtlab.parallel.context import _attend, _attend_backward

    meta = torch.device("meta")
    q, k, v = (torch.empty(2, 4, 20, 16, device=meta, dtype=dtype) for _ in range(3))
    allowed = torch.ones(2, 1, 20, 20, dtype=torch.bool, device=meta) if masked else None
    out, lse, state = _attend(q, k, v, causal, 0.25, allowed, kernel)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 4, 20) and lse.dtype == torch.float32
    assert len(state) == 2  # the kernel's random state, which its backward takes
    grads = _attend_backward(out, q, k, v, out, lse, causal, 0.25, allowed, state, kernel)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, dtype)] * 3


def test_a_blocks_mask_is_the_bias_the_efficient_kernel_takes() -> None:
    """Additive, aligned, broadcast over the heads; a row with no key is zeros, not -inf (the
    kernel's bf16 backward makes NaN of a row of -inf; the row's output and gradient are
    replaced around the kernel)."""
    from dtlab.parallel.context import _bias

    allowed = torch.rand(2, 1, 5, 20, generator=torch.Generator().manual_seed(0)) > 0.5
    allowed[1, 0, 3] = False  # a query with no key in this block
    q, k = torch.empty(2, 4, 5, 8), torch.empty(2, 4, 20, 8)
    bias = _bias(allowed, q, k)
    assert bias.shape == (2, 4, 5, 20) and bias.dtype == torch.float32
    assert bias.stride(-2) % 16 == 0 and bias.stride(1) == 0  # rows aligned, heads broadcast
    expected = torch.zeros(2, 1, 5, 20).masked_fill(~allowed, float("-inf"))
    expected[1, 0, 3] = 0.0
    expected = expected.expand(2, 4, 5, 20)
    assert torch.equal(bias, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_ring_blocks_on_the_gpu_merge_to_torchs_own_attention(
    dtype: torch.dtype, documents: bool
) -> None:
    """The ring's blocks on this GPU's kernels, as one rank of cp 2 would run them: a late query
    chunk over an early key chunk (full) and its own (causal), merged by the log-sum-exps, equal
    to torch's causal attention of the two chunks; each block's backward from the merged output
    sums to torch's gradients. With a document mask the blocks take their part of it."""
    import torch.nn.functional as F

    from dtlab.models.sequence import additive_mask, same_document
    from dtlab.parallel.context import _attend, _attend_backward, _merge

    dev, tol = torch.device("cuda"), (5e-2 if dtype == torch.bfloat16 else 1e-4)
    g = torch.Generator(device=dev).manual_seed(0)
    b, h, t, d = 2, 4, 40, 16  # chunks of 40: neither alignment of the efficient kernel
    q, k, v, dout = (
        torch.randn(b, h, 2 * t, d, device=dev, dtype=dtype, generator=g) for _ in range(4)
    )
    docs = torch.tensor([[0] * 30 + [1] * 50, [0] * 75 + [1] * 5], device=dev)
    allowed = same_document(docs, docs, causal=True) if documents else None
    # Torch's own attention of the whole (two chunks) in float32 from the same inputs, the late
    # chunk's rows (a bf16 reference would carry its own kernel's rounding, or worse: below).
    wq, wk, wv = (x.float().requires_grad_() for x in (q, k, v))
    mask = None if allowed is None else additive_mask(allowed, torch.float32)
    ref = F.scaled_dot_product_attention(wq, wk, wv, attn_mask=mask, is_causal=mask is None)
    want = torch.autograd.grad(ref[:, :, t:], (wq, wk, wv), dout[:, :, t:].float())
    # The ring's two blocks of the late query chunk (over the early chunk, in full; over its own,
    # causally), merged; then each block's backward from the merged output.
    ql, dl, scale = q[:, :, t:], dout[:, :, t:], d**-0.5
    parts = []
    for c, causal in [(0, False), (1, True)]:
        keys = slice(c * t, (c + 1) * t)
        cut = None if allowed is None else allowed[:, :, t:, keys]
        o, lse, state = _attend(ql, k[:, :, keys], v[:, :, keys], causal, scale, cut)
        parts.append((keys, causal, cut, o, lse, state))
    (_, _, _, o0, l0, _), (_, _, _, o1, l1, _) = parts
    out, lse = _merge(o0.float(), l0, o1.float(), l1, documents)
    assert (out - ref[:, :, t:].float()).abs().max() <= tol
    out = out.to(dtype)
    dq = torch.zeros(ql.shape, device=dev)
    dk, dv = torch.zeros(k.shape, device=dev), torch.zeros(v.shape, device=dev)
    for keys, causal, cut, _, _, state in parts:
        gq, gk, gv = _attend_backward(
            dl, ql, k[:, :, keys], v[:, :, keys], out, lse, causal, scale, cut, state
        )
        dq += gq.float()
        dk[:, :, keys] += gk.float()
        dv[:, :, keys] += gv.float()
    for got, grad in zip((dq, dk, dv), (want[0][:, :, t:], want[1], want[2]), strict=True):
        assert (got - grad.float()).abs().max() <= tol


def _block_backward_peak(device: str, dtype: torch.dtype, samples: int, emulated: bool) -> int:
    """The most one ring block's backward holds above what was alive before it (a late query chunk
    over an early key chunk, as rank 0 of cp 2 runs it, on a GPU's kernel for ``dtype``): on a
    GPU, its allocator's; ``emulated``, the fake tensors :mod:`dtlab.analysis.check_ring` makes
    for the check of a GPU, on this host."""
    from contextlib import ExitStack

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    import dtlab.parallel.context as context
    from dtlab.analysis.check_ring import ring_as_on

    kernel = context.ring_kernel("cuda", dtype, False)
    with ExitStack() as stack:
        if emulated:
            stack.enter_context(FakeTensorMode())
            stack.enter_context(ring_as_on("cuda"))
            # Tracked from the inputs on: the tracker files a tensor's storage when an op first
            # makes a view of it, as the check's tracker has filed them before the block.
            tracker = stack.enter_context(MemTracker())
        b, h, chunk, d = samples, 8, 512, 64

        def tokens_major() -> torch.Tensor:  # [B, H, 2C, D] laid out [B, 2C, H, D], as the model's
            return torch.randn(b, 2 * chunk, h, d, device=device, dtype=dtype).transpose(1, 2)

        q, k, v = (tokens_major().chunk(2, dim=2)[i] for i in (1, 0, 0))
        out, lse, state = context._attend(q, k, v, False, d**-0.5, None, kernel)
        whole = tokens_major()  # the merged output and its gradient, a chunk of each
        whole.chunk(2, dim=2)[1].copy_(out)
        dout = torch.randn(b, h, 2 * chunk, d, device=device, dtype=dtype).chunk(2, dim=2)[1]
        lse = torch.cat([lse, lse], dim=2).chunk(2, dim=2)[1]  # a chunk of the merged one's
        args = (dout, q, k, v, whole.chunk(2, dim=2)[1], lse, False, d**-0.5, None, state, kernel)
        if emulated:
            before = tracker.get_tracker_snapshot("current")[torch.device(device)]["Total"]
            grads = context._attend_backward(*args)
            return int(tracker.get_tracker_snapshot("peak")[torch.device(device)]["Total"] - before)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = context._attend_backward(*args)
        torch.cuda.synchronize()
        del grads
        return int(torch.cuda.max_memory_allocated() - before)


def test_the_checks_gpu_kernels_hold_what_the_plan_counts_for_a_block() -> None:
    """The fake tensors the check makes for one block's backward on a GPU's kernel (flash in bf16,
    memory-efficient in fp32, dtlab.analysis.check_ring) are the plan's count of them
    (dtlab.analysis.attention_workspace): here, on fake tensors; where CUDA is, the next test holds
    them against the GPU's allocator."""
    from dtlab.analysis.attention_workspace import efficient_workspace_bytes, flash_backward_rows

    b, h, c, d = 2, 8, 512, 64
    half = b * h * c * d
    rows, width = flash_backward_rows(c, d)
    # The log-sum-exp's chunk made contiguous, the output's gradient and the output copied to the
    # kernel's layout, the gradients, and its float32 accumulators.
    flash = b * h * c * 4 + half * 2 * (2 + 3) + b * h * rows * 4 * (1 + width)
    assert _block_backward_peak("cpu", torch.bfloat16, b, True) == flash
    padded = b * h * c * 4  # the log-sum-exp, padded to rows of 32 for the kernel
    delta = max(half * 4 + b * h * c * 4, efficient_workspace_bytes(b, h, c, d))
    efficient = padded + half * 4 * (1 + 3) + b * h * c * 4 + delta
    assert _block_backward_peak("cpu", torch.float32, b, True) == efficient


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("samples", [1, 2])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_checks_gpu_kernels_hold_what_the_gpus_allocator_holds(
    dtype: str, samples: int
) -> None:
    """One ring block's backward on this GPU's kernel (flash in bf16, memory-efficient in fp32):
    what the allocator holds at its most, above what was alive before, against what the check of
    a GPU makes for it on fake tensors (dtlab.analysis.check_ring, read from PyTorch's sources):
    within 2% and a few of the allocator's 512-byte blocks."""
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    real = _block_backward_peak("cuda", torch_dtype, samples, False)
    emulated = _block_backward_peak("cpu", torch_dtype, samples, True)
    assert abs(real - emulated) <= 0.02 * real + 8 * 512, (real, emulated)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torchs_bf16_attention_with_a_document_mask_has_float32s_gradients() -> None:
    """Torch's own attention in bf16 with a document mask (the model's attention without context
    parallelism), forward and backward, against the same in float32: finite and within bf16's
    rounding. The ring's masked blocks in bf16 gave NaN query gradients on an H200 where the
    float32 ones were right; this says whether torch's kernel does the same to the model."""
    import torch.nn.functional as F

    from dtlab.models.sequence import additive_mask, same_document

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (
        torch.randn(2, 4, 80, 16, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    docs = torch.tensor([[0] * 30 + [1] * 50, [0] * 75 + [1] * 5], device=dev)
    allowed = same_document(docs, docs, causal=True)
    grads = []
    for dtype in (torch.bfloat16, torch.float32):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = F.scaled_dot_product_attention(*xs, attn_mask=additive_mask(allowed, dtype))
        grads.append([out, *torch.autograd.grad(out, xs, dout.to(dtype))])
    for half, full in zip(*grads, strict=True):
        assert torch.isfinite(half).all()
        assert (half.float() - full).abs().max() <= 5e-2


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ring_attention_over_nccl_on_two_gpus_equals_one_process(dtype: str) -> None:
    """The ring over 2 GPUs (NCCL): each rank's output and gradients equal one process's causal
    attention of the whole sequence, with grouped key/value heads."""
    run_worker("ring_attention_worker.py", 2, dtype, "ring", "2", "cuda")


# --- training with each sequence split over the ranks ---------------------------------------------
@pytest.mark.parametrize(
    ("layout", "nproc"),
    [
        (["parallel.cp=2"], 2),
        (["parallel.cp=2", "parallel.cp_method=alltoall"], 2),
        (["parallel.cp=2", "train.micro_batch_size=2"], 4),  # ddp 2 x cp 2, two micro-batches
        (["parallel.strategy=fsdp", "parallel.cp=2"], 4),  # sharded over the 4 data x cp ranks
        # Shards over the cp ranks alone, reduce-scattered with each micro-batch.
        (["parallel.strategy=fsdp", "parallel.cp=2", "train.micro_batch_size=4"], 2),
        # Two replica groups, each sharding over its cp ranks.
        (["parallel.strategy=hsdp", "parallel.replicate=2", "parallel.cp=2"], 4),
        # Pipeline stages of sequence parts (each stage's inputs and outputs a cp rank's tokens).
        (["parallel.strategy=fsdp", "parallel.cp=2", "parallel.pp=2"], 4),
        # Tensor parallelism inside: each tp rank's heads go round the cp ring (with sequence
        # parallelism, the all-to-all of the heads each tp rank holds).
        (["parallel.strategy=fsdp", "parallel.cp=2", "parallel.tp=2"], 4),
        (
            [
                "parallel.strategy=fsdp",
                "parallel.cp=2",
                "parallel.tp=2",
                "parallel.cp_method=alltoall",
                "parallel.sequence_parallel=true",
            ],
            4,
        ),
    ],
    ids=[
        "cp2-ring",
        "cp2-alltoall",
        "ddp2xcp2-accumulation",
        "fsdp2xcp2",
        "fsdp1xcp2-accumulation",
        "hsdp2xcp2",
        "fsdp1xcp2xpp2",
        "fsdp1xcp2xtp2",
        "fsdp1xcp2-alltoallxsp2",
    ],
)
def test_context_parallel_training_equals_one_process(
    tmp_path: Path, reference_run: Metrics, layout: list[str], nproc: int
) -> None:
    # The positions, the labels' shift and the loss are the whole sequence's; the gradients are
    # averaged over the data- and context-parallel ranks together.
    run = train_run(tmp_path / "run", "parallel.strategy=ddp", *layout, nproc=nproc)
    assert_same_training(run, reference_run)


def test_fsdp_shards_over_the_data_and_context_parallel_ranks() -> None:
    # As torchtitan does: the ranks that split a sequence hold different shards, not copies.
    config = load_config(overrides=[*FAST, "parallel.strategy=fsdp", "parallel.cp=2"])
    dims = ParallelDims.from_config(config, 8)
    assert (dims.dp_shard, dims.cp, dims.dp, dims.mesh_dims) == (4, 2, 4, ("dp_shard", "cp"))
    assert dims.fsdp_enabled and layout_name(dims, config.parallel) == "fsdp 4 x cp 2 (ring)"
    ddp = ParallelDims.from_config(load_config(overrides=[*FAST, "parallel.strategy=ddp",
                                                          "parallel.cp=4"]), 8)  # fmt: skip
    assert (ddp.dp_replicate, ddp.cp, ddp.mesh_dims) == (2, 4, ("dp_replicate", "cp"))
    # Each (data, cp) coordinate: the data-parallel index ignores cp (both read the same samples).
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.coordinates(r)["cp"] for r in range(4)] == [0, 1, 0, 1]


def test_a_rank_trains_on_its_zigzag_part_of_each_sequence(tmp_path: Path) -> None:
    config = load_config(overrides=[*FAST, "parallel.strategy=ddp", "parallel.cp=2"])
    layout = BatchLayout(8, 0, 1, 8, cp=2, cp_rank=1)
    source = build_data(config).train
    loader = BatchLoader(source, layout, prefetch=0)
    ((inputs, targets),) = loader.build_step(0)
    whole = torch.from_numpy(np.stack([source.sample(i) for i in range(8)]))
    assert torch.equal(inputs, shard_sequence(whole[:, :-1], 2, 1))
    assert torch.equal(targets, shard_sequence(whole[:, 1:], 2, 1))
    assert inputs.shape == (8, 32)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # ZeRO-1 shards DDP's optimizer state over the data ranks alone (ddp with tp or pp, and
        # no_shard, train: tests/test_cp_ddp_tp.py).
        (
            ["parallel.strategy=ddp", "parallel.sharding=optimizer"],
            "parallel.sharding = 'optimizer' is not supported with parallel.cp = 2 (allowed: "
            "'full', 'shard_grad_op', 'no_shard')",
        ),
        # Model parallelism alone has no data-parallel wrapper to average the cp ranks' gradients.
        (
            ["parallel.strategy=single", "parallel.tp=2"],
            "parallel.strategy = 'single' is not supported with parallel.cp = 2",
        ),
        (
            ["parallel.strategy=fsdp", "parallel.tp=4", "parallel.cp_method=alltoall"],
            "the 1 attention heads a rank holds",
        ),
        (["parallel.strategy=ddp", "train.engine=mlx"], "train.engine = 'mlx' is not supported"),
        # The cp ranks meet inside every block's attention: a step cannot be taken again alone.
        (["parallel.strategy=ddp", "train.oom_retry=true"], "train.oom_retry = true is not"),
        (["parallel.strategy=ddp", "data.seq_len=30"], "data.seq_len = 30 does not split into"),
        # Expert parallelism borrows the data x cp ranks (tests/test_cp_expert_parallel.py trains
        # ep 2 on 2 processes): an ep that does not divide them is refused.
        (
            ["parallel.strategy=ddp", "model.preset=debug-moe", "parallel.ep=4"],
            "parallel.ep = 4 does not divide the 2 data x cp ranks",
        ),
        # DiLoCo's replicas split the data-parallel ranks (tests/test_cp_diloco.py trains them
        # with cp inside, and fault-tolerant groups of cp ranks): 2 processes of cp 2 make one.
        (
            [
                "parallel.strategy=ddp",
                "parallel.diloco.inner_steps=2",
                "parallel.diloco.replicas=2",
            ],
            "parallel.diloco.replicas = 2 does not divide the 1 data-parallel ranks (world 2 / "
            "parallel.cp = 2)",
        ),
    ],
)
def test_what_context_parallelism_does_not_compose_with_yet_is_refused(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        # Checked for the 2 processes the command below runs (ep against the world's ranks).
        check_world(load_config(overrides=["model.preset=debug", "parallel.cp=2", *overrides]), 2)
    # Refused before any process starts, with the reason.
    proc = run_cli("train", "--nproc", "2", "--set", *FAST, "parallel.cp=2", *overrides)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr


def test_the_memory_a_step_holds_falls_with_cp() -> None:
    # What one step holds beyond the rank's state (activations, their gradients, temporaries): at
    # the same sequence, cp 2 holds well under cp 1's, the ring's blocks in flight included.
    from dtlab.bench.cp_memory import measure

    one, two = measure(256, 1), measure(256, 2)
    assert 0.4 * one < two < 0.7 * one, (one, two)


@pytest.mark.parametrize("method", ["ring", "alltoall"])
def test_context_parallelism_with_compile_equals_one_compiled_process(
    tmp_path: Path, single_reference: Any, method: str
) -> None:
    # The blocks compiled, the context-parallel attention inside them (a graph break at its
    # collectives), against one compiled process.
    compiled = ("train.compile=true",)
    reference = single_reference(*compiled, steps=6)
    run = train_run(
        tmp_path / "run", "parallel.strategy=ddp", "parallel.cp=2", f"parallel.cp_method={method}",
        *compiled, nproc=2, steps=6,
    )  # fmt: skip
    assert_same_training(run, reference)


def test_a_mixture_of_experts_with_context_parallelism_routes_as_one_process(
    tmp_path: Path, single_reference: Any
) -> None:
    # Each rank routes its part of the tokens; the loads are summed over every rank, so the experts'
    # loads and the balancing bias are one process's.
    moe = ("model.preset=debug-moe",)
    reference = single_reference(*moe)
    run = train_run(tmp_path / "run", "parallel.strategy=ddp", "parallel.cp=2", *moe, nproc=2)
    assert_same_training(run, reference)
    assert [m["moe_load"] for m in run] == [m["moe_load"] for m in reference]
    assert [m["moe_bias"] for m in run] == pytest.approx([m["moe_bias"] for m in reference])
