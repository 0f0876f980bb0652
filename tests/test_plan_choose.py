"""Which of the tied layouts ``dtlab plan`` recommends (dtlab.analysis.choose): the fastest, unless a
tied one leaves clearly more memory, waits for clearly less communication, or (both alike) is simpler;
and the recommendation names the criterion that decided."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlab.analysis.choose import CRITERIA, MEMORY_RESOLUTION, choose, reason
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


def _found(
    label: str, step_s: float, peak_gib: float, exposed_s: float, layout: list[str]
) -> Found:
    config = load_config(overrides=["model.preset=debug", *layout])
    row: Any = _Row(step_s, _Step(peak_gib * GIB), comm_s=2 * exposed_s, exposed_s=exposed_s)
    return Found({}, config, row, label)


def test_the_fastest_wins_when_the_others_are_alike() -> None:
    fastest = _found("a", 1.00, 40, 0.10, TP2)
    other = _found("b", 1.05, 41, 0.12, TP2)
    c = choose([fastest, other], USABLE, TIE_MARGIN)
    assert c.pick is fastest and c.other is other and c.decided_by == "step time"
    assert "the step time decided: 1 s against 1.05 s" in reason(c)


def test_the_fastest_wins_over_a_simpler_layout_with_less_memory_margin() -> None:
    """The rule that replaced "the simplest within 10%": a simpler tied layout that leaves less
    memory no longer wins."""
    fastest = _found("tp", 1.00, 30, 0.30, TP2_PP2)
    simpler = _found("fsdp", 1.08, 50, 0.05, FSDP)
    c = choose([fastest, simpler], USABLE, TIE_MARGIN)
    assert c.pick is fastest and c.decided_by == "memory margin"
    assert "34.0 GiB under the fit limit against 14.0 GiB" in reason(c)


def test_a_clearly_larger_memory_margin_wins_the_tie() -> None:
    tight = _found("tight", 1.00, 62, 0.10, TP2)
    roomy = _found("roomy", 1.09, 30, 0.40, TP2_PP2)
    c = choose([tight, roomy], USABLE, TIE_MARGIN)
    assert c.pick is roomy and c.other is tight and c.decided_by == "memory margin"
    assert reason(c).startswith("the memory margin decided: 34.0 GiB under the fit limit")


def test_alike_memory_margins_leave_it_to_the_exposed_communication() -> None:
    # 5 GiB apart: within MEMORY_RESOLUTION of the 64 GiB limit (6.4 GiB), alike.
    assert 5 * GIB < MEMORY_RESOLUTION * USABLE
    waits = _found("waits", 1.00, 40, 0.50, TP2)
    hides = _found("hides", 1.05, 35, 0.10, TP2_PP2)
    c = choose([waits, hides], USABLE, TIE_MARGIN)
    assert c.pick is hides and c.decided_by == "exposed communication"
    assert "waits for 100 ms of it against 500 ms" in reason(c)


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
