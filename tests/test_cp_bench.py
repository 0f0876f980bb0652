"""The context-parallel benchmarks: ``dtlab.bench.cp_comm`` counts the bytes the plan predicts for
both methods (real gloo processes), and ``dtlab.bench.cp_memory --plot`` draws a PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtlab.bench import cp_comm, cp_memory
from dtlab.errors import DtlabError

# The debug model's shape at a short sequence: 2 sequences a step, ddp, cp = world.
TINY = cp_comm.shape_overrides(seq=64, dim=64, layers=2, heads=4, kv_heads=2, vocab=256, batch=2)


def test_cp_bytes_counted_in_a_step_equal_the_plan_for_both_methods() -> None:
    figures = cp_comm.measure(TINY, 2, ["ring", "alltoall"], counts=(1, 1, 1))
    rows = {r["method"]: r for r in cp_comm.rows_for(TINY, 2, figures)}
    assert set(rows) == {"ring", "alltoall"}
    for method, kind in (("ring", "send/recv"), ("alltoall", "all_to_all")):
        r = rows[method]
        # Each method's own collectives only, and as many bytes as the plan says, exactly.
        assert set(r["cp_bytes_measured"]) == {kind}, r["all_measured"]
        assert r["cp_bytes_measured"] == r["cp_bytes_predicted"], (
            r["all_measured"],
            r["all_predicted"],
        )
        assert r["ratio"] == 1.0
        # Apart from the plan: a step is one attention call (forward + backward) per layer, one
        # micro-batch, nothing recomputed; and the transport timed alone moves the call's bytes.
        call = r["attention_cp_bytes"][kind]
        assert call > 0 and r["cp_bytes_measured"][kind] == 2 * call
        assert r["same_bytes"]
        a = r["attention_ms"]
        assert a["together"] > 0 and a["compute"] > 0 and a["comm"] > 0
        assert r["hidden"] is not None and 0 <= r["hidden"] <= 1
    # By hand, per layer (2 layers, 2 sequences of 32 tokens a rank, float32): the ring passes its
    # keys and values (every head: 64 wide) once in forward and once in backward, and their
    # gradients twice; alltoall swaps q (64 wide), k, v (32) and the output (64) each way.
    assert rows["ring"]["cp_bytes_measured"]["send/recv"] == 2 * 4 * (2 * 2 * 32 * 64 * 4)
    assert rows["alltoall"]["cp_bytes_measured"]["all_to_all"] == 2 * 2 * (2 * 32 * 192 * 4)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cp", "1"], "--cp '1': allowed: comma-separated integers, each 2 or more"),
        (["--methods", "ring,ulysses"], "--methods 'ring,ulysses': allowed: distinct names"),
    ],
)
def test_cp_comm_refuses_what_it_cannot_measure(argv: list[str], message: str) -> None:
    with pytest.raises(DtlabError, match=message):
        cp_comm.main(argv)


def test_cp_memory_plot_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "img" / "cp_memory.png"
    assert cp_memory.main(["--seq", "32", "--cp", "1", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000
