"""The attention kernel: chosen on purpose per device and dtype, the same attention whichever runs,
and the activations each kernel keeps predicted to the byte (measured on CPU by forcing the kernel)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import dtlab.models.attention as attention
from dtlab.analysis.model import attention_kernel, kernel_bytes, plan_step
from dtlab.bench.memory import activation_case
from dtlab.config import Config, load_config
from dtlab.models import build_model
from dtlab.models.attention import AttentionKernel, choose_kernel, describe_attention
from dtlab.models.llama import KVCache

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    ("device", "dtype", "gqa", "capability", "masked", "name", "expand"),
    [
        ("cpu", F32, True, None, False, "flash", False),  # torch's CPU kernel takes grouped heads
        ("cpu", BF16, True, None, True, "flash", False),
        ("cuda", BF16, True, (9, 0), False, "flash", False),  # flash / cuDNN take grouped heads
        ("cuda", F16, True, (8, 0), False, "flash", False),
        ("cuda", F32, True, (9, 0), False, "efficient", True),  # math otherwise: expand k/v
        ("cuda", F32, False, (9, 0), False, "efficient", False),  # nothing to expand
        ("cuda", F32, True, None, False, "efficient", True),  # sm80+ assumed
        ("cuda", BF16, True, (9, 0), True, "efficient", True),  # generation's mask: no flash
        ("cuda", F16, True, (7, 0), False, "efficient", True),  # no flash before sm80
        ("cuda", BF16, True, (7, 5), False, "math", False),  # no fused bf16 kernel before sm80
        ("meta", F32, True, None, False, "math", False),
    ],
)
def test_the_kernel_is_chosen_per_device_dtype_and_heads(
    device: str,
    dtype: torch.dtype,
    gqa: bool,
    capability: tuple[int, int] | None,
    masked: bool,
    name: str,
    expand: bool,
) -> None:
    kernel = choose_kernel(device, dtype, gqa, capability, masked)
    assert (kernel.name, kernel.expand_kv) == (name, expand), kernel
    assert kernel.name in kernel.describe() and kernel.why


@contextlib.contextmanager
def forced(kernel: str) -> Iterator[None]:
    """Run the model's attention on CPU as it runs elsewhere: ``efficient`` expands the key/value
    heads (what a GPU does in fp32), ``math`` restricts torch to its unfused kernel."""
    original = attention.choose_kernel
    if kernel == "efficient":

        def expanded(
            device_type: str,
            dtype: torch.dtype,
            gqa: bool,
            capability: tuple[int, int] | None = None,
            masked: bool = False,
        ) -> AttentionKernel:
            return AttentionKernel("efficient", gqa, "forced")

        attention.choose_kernel = expanded
    try:
        with sdpa_kernel(SDPBackend.MATH) if kernel == "math" else contextlib.nullcontext():
            yield
    finally:
        attention.choose_kernel = original


def test_expanded_key_value_heads_give_the_grouped_attention() -> None:
    """The model with k/v expanded to the query heads computes what grouped-query attention does:
    the logits and every gradient (float tolerance: a different kernel call)."""
    model = build_model(load_config(overrides=["model.preset=debug"]).model, device="cpu")
    assert model.args.n_kv_heads < model.args.n_heads  # the debug preset is grouped
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    results = []
    for kernel in ("flash", "efficient"):
        model.zero_grad(set_to_none=True)
        with forced(kernel):
            logits = model(tokens)
        logits.float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), grads))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b)
    assert ga.keys() == gb.keys() and len(ga) > 0
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], msg=name)
    # Generation: cached keys and an explicit mask (several new tokens at once), the same attention.
    cached = []
    for kernel in ("flash", "efficient"):
        cache = KVCache(max_len=32)
        with torch.no_grad(), forced(kernel):
            model(tokens[:, :10], cache=cache)
            cached.append(model(tokens[:, 10:], cache=cache))
    torch.testing.assert_close(cached[0], cached[1])
    torch.testing.assert_close(cached[0], a[:, 10:])  # and what the whole sequence gives


def _config(precision: str, ac: str) -> Config:
    return load_config(
        overrides=[
            "model.preset=debug",
            "data.source=synthetic",
            "data.seq_len=32",
            f"train.precision={precision}",
            f"train.activation_checkpointing={ac}",
        ]
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ac", ["none", "selective"])
def test_each_kernels_activations_are_predicted_to_the_byte(precision: str, ac: str) -> None:
    """Forced on CPU, the expanded heads and the math kernel keep more than the fused kernel, and
    exactly what :func:`kernel_bytes` adds for them (math: the B x H x T x T softmax)."""
    config = _config(precision, ac)
    measured = {}
    for kernel in ("flash", "efficient", "math"):
        with forced(kernel):
            r = activation_case(config, micro_batch=2)
        extra = kernel_bytes(config.model, 2 * 32, 32, precision, ac, kernel)
        assert r["measured"] == r["predicted"] + extra, (kernel, r, extra)
        measured[kernel] = r["measured"]
    assert measured["math"] > measured["flash"]
    if ac == "none":  # (checkpointing recomputes the expanded copies instead of keeping them)
        assert measured["flash"] < measured["efficient"] < measured["math"], measured


def test_the_plan_predicts_the_kernel_of_the_planned_device() -> None:
    """fp32 grouped-query attention: the fused CPU kernel on CPU, expanded k/v on a GPU (the plan's
    activations grow by exactly the copies); bf16: flash on both, the same figure."""
    fp32 = _config("fp32", "none")
    assert attention_kernel(fp32.model, "fp32", "cpu") == "flash"
    assert attention_kernel(fp32.model, "fp32", "cuda") == "efficient"
    cpu, gpu = (plan_step(fp32, 1, device_type=k).activations_bytes for k in ("cpu", "cuda"))
    m, t = fp32.model, fp32.train
    tokens = t.global_batch_size * 32
    assert gpu - cpu == kernel_bytes(m, tokens, 32, "fp32", "none", "efficient") > 0
    bf16 = _config("bf16", "none")
    assert attention_kernel(bf16.model, "bf16", "cuda") == "flash"
    cpu, gpu = (plan_step(bf16, 1, device_type=k).activations_bytes for k in ("cpu", "cuda"))
    assert gpu == cpu


BACKENDS = {
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_chosen_kernel_runs_on_the_gpu(precision: str) -> None:
    """With torch restricted to the chosen kernel (math disabled), the grouped-query model trains a
    step in fp32 (k/v expanded, memory-efficient kernel) and bf16 (flash or cuDNN): the choice is one
    torch can run, not a fall back to math."""
    device = torch.device("cuda", torch.cuda.current_device())
    model = build_model(load_config(overrides=["model.preset=debug"]).model, device=device)
    dtype = F32 if precision == "fp32" else BF16
    kernel = choose_kernel("cuda", dtype, True, torch.cuda.get_device_capability(device))
    assert kernel.name == ("efficient" if precision == "fp32" else "flash")
    tokens = torch.randint(0, 256, (2, 64), device=device)
    with (
        sdpa_kernel(BACKENDS[kernel.name]),
        torch.autocast("cuda", dtype=BF16, enabled=precision == "bf16"),
    ):
        loss = model(tokens).float().pow(2).mean()
        loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
    line = describe_attention(device, dtype, True)  # the run's start line says the same
    assert line.startswith(f"attention kernel: {kernel.name}")
    assert ("TF32 off" in line) == (precision == "fp32")
