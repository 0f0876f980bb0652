"""Which of the tied layouts ``dtlab plan`` recommends (dtlab.analysis.choose): the fastest, unless a
tied one leaves clearly more memory, waits for clearly less communication, or (both alike) is simpler;
and the recommendation names the criterion that decided."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlab.analysis.choose import CRITERIA, MEMORY_MARGIN, choose, reason
from dtlab.analysis.devices import PROFILES
from dtlab.analysis.plan import TIE_MARGIN, format_plan, format_tflops, plan
from dtlab.analysis.search import Found
from dtlab.config import load_config

GIB = 2**30
USABLE = 64 * GIB  # an 80 GiB device under the 80% fit rule
H100 = PROFILES["h100"]

TP2 = ["parallel.strategy=fsdp", "parallel.tp=2"]  # one parallel dimension beside FSDP
TP2_PP2 = [*TP2, "parallel.pp=2"]  # two
FSDP = ["parallel.strategy=fsdp"]  # none


@dataclass
class _Step:
    total_bytes: float


@dataclass
class _Row:
    """The figures of a plan row that the choice reads."""

    step_time_s: float
    step: _Step
    comm_s: float
    exposed_s: float | None
    compute_s: float
    recompute_s: float = 0.0


def _found(
    label: str,
    step_s: float,
    peak_gib: float,
    exposed_s: float,
    layout: list[str],
    comm_s: float | None = None,
) -> Found:
    """A tied row: its step, peak, the communication its step waits for (of ``comm_s``, by default
    twice that, the rest hidden behind the compute: the step less the wait)."""
    config = load_config(overrides=["model.preset=debug", *layout])
    comm = 2 * exposed_s if comm_s is None else comm_s
    row: Any = _Row(step_s, _Step(peak_gib * GIB), comm, exposed_s, compute_s=step_s - exposed_s)
    return Found({}, config, row, label)


def test_the_fastest_wins_when_the_others_are_alike() -> None:
    fastest = _found("a", 1.00, 40, 0.10, TP2)
    other = _found("b", 1.05, 41, 0.12, TP2)
    c = choose([fastest, other], USABLE, TIE_MARGIN)
    assert c.pick is fastest and c.other is other and c.decided_by == "step time"
    assert "the step time decided: 1 s against 1.05 s" in reason(c)


def test_a_simpler_tight_layout_no_longer_wins_the_tie() -> None:
    """The rule that replaced "the simplest within 10%": a simpler tied layout whose peak leaves less
    than a tenth of the fit limit free loses to the fastest, which does not."""
    fastest = _found("tp", 1.00, 40, 0.10, TP2_PP2)
    simpler = _found("fsdp", 1.08, 60, 0.10, FSDP)
    c = choose([fastest, simpler], USABLE, TIE_MARGIN)
    assert c.pick is fastest and c.other is simpler and c.decided_by == "memory margin"
    assert "24.0 GiB under the fit limit against 4.0 GiB, less than the 10% of the limit" in reason(
        c
    )


def test_a_tight_fastest_row_loses_to_a_roomy_tied_one() -> None:
    tight = _found("tight", 1.00, 62, 0.10, TP2)
    roomy = _found("roomy", 1.09, 30, 0.40, TP2_PP2)
    c = choose([tight, roomy], USABLE, TIE_MARGIN)
    assert c.pick is roomy and c.other is tight and c.decided_by == "memory margin"
    assert reason(c).startswith("the memory margin decided: 34.0 GiB under the fit limit")


def test_headroom_beyond_the_margin_does_not_decide() -> None:
    """Both leave more than a tenth of the limit free: the one with three times the headroom, as
    simple and waiting as long, does not win over the faster."""
    fastest = _found("a", 1.00, 50, 0.10, TP2)
    light = _found("b", 1.05, 20, 0.10, TP2)
    assert choose([fastest, light], USABLE, TIE_MARGIN).pick is fastest
    # Nor when every tied row is tight: then the margins are alike too.
    fastest = _found("a", 1.00, 63, 0.10, TP2)
    lighter = _found("b", 1.05, 59, 0.10, TP2)
    c = choose([fastest, lighter], USABLE, TIE_MARGIN)
    assert c.pick is fastest and c.decided_by == "step time"


def test_alike_memory_margins_leave_it_to_the_exposed_communication() -> None:
    # Neither tight: both leave more than MEMORY_MARGIN of the 64 GiB limit (6.4 GiB) free.
    assert 24 * GIB > MEMORY_MARGIN * USABLE
    waits = _found("waits", 1.00, 40, 0.50, TP2, comm_s=0.60)
    hides = _found("hides", 1.05, 35, 0.10, TP2_PP2)
    c = choose([waits, hides], USABLE, TIE_MARGIN)
    assert c.pick is hides and c.decided_by == "exposed communication"
    assert "waits for 100 ms of it against 500 ms" in reason(c)


def test_communication_that_hides_only_by_a_perfect_overlap_counts_as_exposed() -> None:
    """Network-bound on paper: its hidden communication takes 99% of the compute that hides it, and
    a simpler, faster layout loses the tie to one that waits a little but has room to spare."""
    bound = _found("fsdp", 1.00, 40, 0.01, FSDP, comm_s=0.99)
    roomy = _found("tp", 1.05, 40, 0.05, TP2, comm_s=0.50)
    c = choose([bound, roomy], USABLE, TIE_MARGIN)
    assert c.pick is roomy and c.decided_by == "exposed communication"
    assert "against 990 ms (all of its communication: what it hides takes 99% of the compute" in (
        reason(c)
    )


def test_with_margins_and_waits_alike_the_simpler_layout_wins() -> None:
    involved = _found("involved", 1.00, 40, 0.10, TP2_PP2)
    plain = _found("plain", 1.08, 42, 0.15, FSDP)
    c = choose([involved, plain], USABLE, TIE_MARGIN)
    assert c.pick is plain and c.decided_by == "simplicity"
    assert "0 parallel dimensions beside data parallelism against 2" in reason(c)


def test_the_plan_says_why_and_heads_with_the_recommended_precision() -> None:
    """The recommendation names what decided it; the header shows the recommended row's precision
    (its peak and its recompute), the strategies' table says it keeps the config's own settings."""
    config = load_config(overrides=["model.preset=debug", "data.seq_len=64"])
    assert config.train.precision == "fp32"  # the default, which the search leaves for bf16
    result = plan(config, 4, 1, H100, None)
    rec = result["search"]["recommended"]
    assert rec["precision"] == "bf16"
    text = format_plan(result)
    peak = format_tflops(H100.peak_tflops["bf16"])
    assert f"  peak     {peak} TFLOP/s bf16 (recommended) (" in text
    assert result["device"]["peak_tflops"] == H100.peak_tflops["bf16"]
    assert f"activation checkpointing {rec['activation_checkpointing']} (recommended)" in text
    assert "the data-parallel strategies at the config's own settings (fp32, checkpointing " in text
    # The JSON says what decided it against which row, and the text in the same words.
    decided, other = rec["decided_by"], rec["compared_with"]
    assert rec["tied"] > 1  # on 4 processes GPipe and 1F1B tie, at least
    assert decided in CRITERIA and other, rec
    assert f"{other}" in result["recommendation"] and decided in result["recommendation"]
