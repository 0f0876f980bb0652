"""The routed experts on torch's grouped kernel (``torch._grouped_mm``) where it runs, the loop over
experts elsewhere: which one each device and dtype takes, that both give the same values and
gradients, that selective checkpointing keeps the kernel's outputs, and that the plan assumes what
the model runs."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import dtlab.models.moe as moe_model
from dtlab.analysis.moe import routed_grouped
from dtlab.config import load_config
from dtlab.models.args import MoEArgs
from dtlab.models.moe import GroupedExperts, compute_dtype, grouped_kernel_runs
from dtlab.parallel.apply import apply_ac

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16


@pytest.mark.parametrize(
    ("device", "capability", "dtype", "dim", "hidden", "runs"),
    [
        ("cpu", None, BF16, 64, 256, True),
        ("cuda", (9, 0), BF16, 64, 256, True),  # H100
        ("cuda", (8, 0), BF16, 64, 256, True),  # A100: torch's kernel takes SM 8.0 and newer
        ("cuda", (7, 5), BF16, 64, 256, False),  # T4
        ("cuda", None, BF16, 64, 256, False),  # a CUDA device torch cannot see
        ("cpu", None, FP32, 64, 256, False),  # the kernel's meta function takes bf16 only
        ("cpu", None, FP16, 64, 256, False),
        ("cuda", (9, 0), FP32, 64, 256, False),
        ("cpu", None, BF16, 60, 256, False),  # rows of 120 bytes: strides not 16-byte multiples
        ("cpu", None, BF16, 64, 100, False),
        ("mps", None, BF16, 64, 256, False),
    ],
)
def test_the_grouped_kernel_runs_where_torch_has_it_and_the_loop_elsewhere(
    device: str, capability: tuple[int, int] | None, dtype: torch.dtype, dim: int, hidden: int,
    runs: bool,
) -> None:  # fmt: skip
    assert grouped_kernel_runs(device, capability, dtype, dim, hidden) is runs


def test_a_matmul_runs_in_autocasts_dtype_where_it_is_on() -> None:
    x = torch.ones(2, 8)
    assert compute_dtype(x) == FP32
    with torch.autocast("cpu", dtype=BF16):
        assert compute_dtype(x) == BF16
        assert compute_dtype(torch.ones(2, dtype=torch.int64)) == torch.int64


@pytest.mark.parametrize(
    "precision", ["bf16", "fp16", "fp32"]
)  # the plan's rule, against the model's for the same shapes
@pytest.mark.parametrize(("dim", "expert_dim"), [(64, 64), (64, 100), (72, 256), (68, 64)])
def test_the_plan_assumes_the_kernel_the_model_runs(
    precision: str, dim: int, expert_dim: int
) -> None:
    config = load_config(
        overrides=[
            "model.preset=debug-moe", f"model.dim={dim}", "model.n_heads=2", "model.n_kv_heads=1",
            f"model.moe.expert_dim={expert_dim}", f"train.precision={precision}",
        ]
    )  # fmt: skip
    dtype = {"bf16": BF16, "fp16": FP16, "fp32": FP32}[precision]
    for device, capability in (("cpu", None), ("cuda", (9, 0))):
        runs = grouped_kernel_runs(device, capability, dtype, dim, expert_dim)
        assert routed_grouped(config) is runs, (device, precision, dim, expert_dim)


def test_a_torch_without_the_kernel_runs_and_plans_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch before the grouped matmul: the model's loop, and the plan's (no grouped backward).
    config = load_config(overrides=["model.preset=debug-moe", "train.precision=bf16"])
    assert routed_grouped(config)
    monkeypatch.setattr(moe_model, "_GROUPED_MM", None)
    assert not grouped_kernel_runs("cpu", None, BF16, 64, 256)
    assert not routed_grouped(config)


def _experts(experts: int, dim: int, hidden: int) -> GroupedExperts:
    torch.manual_seed(0)
    m = GroupedExperts(experts, dim, hidden)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m


def _run(
    m: GroupedExperts, x: torch.Tensor, counts: Any, grouped: bool, autocast: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    before = moe_model.grouped_kernel_runs
    if not grouped:
        moe_model.grouped_kernel_runs = lambda *a: False  # type: ignore[assignment]
    try:
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            y = m(x, counts)
        grads = torch.autograd.grad(y.float().square().sum(), [x, *m.parameters()])
    finally:
        moe_model.grouped_kernel_runs = before
    return y, list(grads)


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "bf16 weights"])
@pytest.mark.parametrize("as_list", [False, True], ids=["counts on the device", "counts read"])
def test_the_grouped_kernel_gives_the_loops_values_and_gradients(
    autocast: bool, as_list: bool
) -> None:
    # Uneven counts with an expert that gets no row. Under autocast: float32 weights and rows cast
    # as autocast casts a matmul's; else bf16 weights and rows (FSDP's gathered parameters).
    m = _experts(4, 64, 128)
    if not autocast:
        m = m.to(BF16)
    x = torch.randn(40, 64, dtype=FP32 if autocast else BF16, requires_grad=True)
    counts_t = torch.tensor([10, 0, 22, 8])
    counts = counts_t.tolist() if as_list else counts_t
    y, grads = _run(m, x, counts, grouped=True, autocast=autocast)
    ref, ref_grads = _run(m, x, counts, grouped=False, autocast=autocast)
    assert y.dtype == ref.dtype == BF16
    assert torch.equal(y, ref)
    # The gradients as the loop's: the rows' two casts meet in float32, as two linears' do.
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=0, atol=1e-6)
    assert grads[1].abs().sum() > 0  # the weights' gradients are not all zero


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("mode", "recomputed"), [("selective", 0), ("full", 3)])
def test_selective_checkpointing_keeps_the_grouped_kernels_outputs(
    mode: str, recomputed: int
) -> None:
    # An MoE block's routed experts make three grouped matmuls in forward and two for each in
    # backward (the rows' and the weights' gradients); selective checkpointing keeps their
    # outputs as it keeps every matmul's, full checkpointing makes the three again.
    from dtlab.models.llama import build_model

    config = load_config(
        overrides=["model.preset=debug-moe", "model.moe.shared_experts=0", "train.precision=bf16"]
    )
    torch.manual_seed(0)
    model = build_model(config.model, "cpu")
    apply_ac(model, mode)
    tokens = torch.randint(0, config.model.vocab_size, (2, 16))
    ops = _Ops()
    with ops, torch.autocast("cpu", dtype=BF16):
        model(tokens).float().sum().backward()
    moe_blocks = config.model.n_layers - config.model.moe.dense_layers
    assert ops.calls["_grouped_mm"] == moe_blocks * (3 + 6 + recomputed), ops.calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_grouped_kernel_on_a_gpu_gives_the_loops_values() -> None:
    cuda = torch.device("cuda")
    capability = torch.cuda.get_device_capability(cuda)
    assert grouped_kernel_runs("cuda", capability, BF16, 64, 128) is (capability >= (8, 0))
    m = _experts(4, 64, 128).to(cuda, BF16)
    x = torch.randn(40, 64, device=cuda, dtype=BF16, requires_grad=True)
    counts = torch.tensor([10, 0, 22, 8], device=cuda)
    y = m(x, counts)
    before = moe_model.grouped_kernel_runs
    moe_model.grouped_kernel_runs = lambda *a: False  # type: ignore[assignment]
    try:
        ref = m(x, counts)
    finally:
        moe_model.grouped_kernel_runs = before
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)


def _layer() -> moe_model.MoE:
    torch.manual_seed(0)
    layer = moe_model.MoE(16, MoEArgs(experts=4, top_k=2, expert_dim=32))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    layer.init_buffers()
    return layer


def _recomputed_block(choose_in_backward: moe_model.Chooser | None) -> tuple[torch.Tensor, int]:
    """One MoE layer (fp32: the loop, which reads its counts) under full checkpointing, one forward
    and backward; ``choose_in_backward``: the routing its recomputation takes instead of the
    forward's. Returns (the input's gradient, the records left)."""
    layer = _layer()
    layer.experts.reads.on = True
    x = torch.randn(2, 8, 16, requires_grad=True)
    out = checkpoint(layer, x, use_reentrant=False)
    assert len(layer.experts.reads) == 1  # the forward's read, kept
    if choose_in_backward is None:
        out.sum().backward()
    else:
        with moe_model.routing_override(choose_in_backward):
            out.sum().backward()
    assert x.grad is not None
    return x.grad, len(layer.experts.reads)


def test_a_recomputed_block_takes_its_forwards_counts_and_gives_the_same_gradients() -> None:
    grad, left = _recomputed_block(None)
    assert left == 0  # taken by the recomputation
    layer = _layer()
    x = torch.randn(2, 8, 16, requires_grad=True)
    layer(x).sum().backward()
    assert len(layer.experts.reads) == 0  # not checkpointed: nothing kept
    assert torch.equal(grad, x.grad)


def test_a_recomputation_that_routes_otherwise_fails() -> None:
    # A nondeterministic router, or another micro-batch's record: the kept splits would send rows
    # by another routing's counts; the recomputation's counts are checked against the kept ones.
    def experts_0_and_1(n: int, args: MoEArgs, device: torch.device) -> torch.Tensor:
        return torch.tensor([[0, 1]] * n, device=device)

    with pytest.raises(RuntimeError, match="routed its tokens otherwise than its forward did"):
        _recomputed_block(experts_0_and_1)
