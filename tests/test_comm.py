"""CommCounter counts every collective once, with its bytes, whichever thread issues it."""

from __future__ import annotations

import pytest
import torch

from conftest import run_worker


def test_a_collective_is_counted_once_on_every_kind_of_thread() -> None:
    """The thread that entered the counter, a thread that inherited its dispatch mode (the autograd
    engine's device threads, where a CUDA backward runs DDP's hooks), and a backend's thread."""
    run_worker("comm_threads_worker.py", 2, "threads", "cpu")


@pytest.mark.parametrize("compression", ["fp16", "powersgd"])
def test_ddp_hooks_are_counted_to_the_byte(compression: str) -> None:
    """A DDP step's hooks on two gloo ranks (PowerSGD's second all-reduce from a future callback):
    the bytes counted are the hook's analytic bytes and the step's reduction, exactly."""
    run_worker("comm_threads_worker.py", 2, compression, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("case", ["threads", "fp16", "powersgd"])
def test_cuda_ddp_hooks_run_on_the_autograd_thread_and_are_counted_once(case: str) -> None:
    """On CUDA the hooks run on the autograd engine's device thread, which inherits the counter's
    dispatch mode: counted there once (not also by the Python API's count), to the byte. Two
    ranks, one GPU each: a collective over one rank moves nothing and is not counted (one GPU
    counted nothing, rightly, and this test failed there)."""
    run_worker("comm_threads_worker.py", 2, case, "cuda")


def test_the_counter_wraps_only_the_collectives_this_torch_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch before 2.12 has no ``all_gather_single`` (dtlab supports torch 2.6 and later): the
    counter wraps what exists and leaves the rest as it found it (torch 2.11 on an H200 raised
    AttributeError entering it)."""
    import torch.distributed as dist

    from dtlab.metrics.comm import CommCounter

    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    before = dist.all_reduce
    with CommCounter():
        assert dist.all_reduce is not before  # wrapped while active
        assert not hasattr(dist, "all_gather_single")
    assert dist.all_reduce is before and not hasattr(dist, "all_gather_single")
