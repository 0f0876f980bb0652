"""Which features the config accepts together: every pair of dtlab's features, accepted (on how many
processes) or refused (with the config's own reason).

The table in docs/architecture.md is this module's output (``python -m dtlab.config.features``),
and the tests train every accepted pair a few steps (tests/test_pairs.py). A pair is accepted when
``load_config`` and ``check_world`` accept the two features' settings together on the fewest
processes (2, 4 or 8; HSDP at least 4: two shard groups of two ranks) that lay them out, as
``dtlab train --nproc N`` would check them.
"""

from __future__ import annotations

import functools
import itertools
import sys
from dataclasses import dataclass

from dtlab.config.checks import check_world
from dtlab.config.loading import load_config
from dtlab.errors import ConfigError

__all__ = ["BASE", "FEATURES", "Verdict", "markdown", "pair_overrides", "pairs", "verdict"]

# What every pair trains on: the debug model, synthetic data, a batch every layout can split.
BASE = (
    "model.preset=debug",
    "data.source=synthetic",
    "data.seq_len=64",
    "train.global_batch_size=16",
    "train.warmup_steps=2",
)

# Each feature's settings (a strategy, a degree of 2, a switch); MoE comes with its expert degree.
FEATURES: dict[str, tuple[str, ...]] = {
    "DDP": ("parallel.strategy=ddp",),
    "FSDP": ("parallel.strategy=fsdp",),
    "HSDP": ("parallel.strategy=hsdp", "parallel.replicate=2"),
    "TP": ("parallel.tp=2",),
    "PP": ("parallel.pp=2",),
    "EP/MoE": ("model.preset=debug-moe", "parallel.ep=2"),
    "DiLoCo": ("parallel.diloco.inner_steps=2",),
    "FT": ("parallel.fault_tolerance.enabled=true",),
    "compression": ("parallel.compression=powersgd",),
    "ZeRO-1": ("parallel.sharding=optimizer",),
    "oom_retry": ("train.oom_retry=true",),
    "alerts": ("alerts.memory_fraction=0.99", "alerts.action=stop"),
    "compile": ("train.compile=true",),
    "CP": ("parallel.cp=2",),
}
STRATEGIES = ("DDP", "FSDP", "HSDP")
SIZES = (2, 4, 8)
# The fewest processes a feature is itself on: HSDP replicates over 2 shard groups of 2 ranks.
LEAST = {"HSDP": 4}


@dataclass(frozen=True)
class Verdict:
    """A pair's verdict: accepted on ``nproc`` processes, or refused with ``reason``; ``None`` for
    both: not a pair (two strategies)."""

    nproc: int | None = None
    reason: str | None = None

    @property
    def accepted(self) -> bool:
        return self.nproc is not None


def pair_overrides(a: str, b: str) -> list[str]:
    """The settings of features ``a`` and ``b`` together, on DDP where neither is a strategy."""
    base = [] if a in STRATEGIES or b in STRATEGIES else list(FEATURES["DDP"])
    return [*BASE, *base, *FEATURES[a], *FEATURES[b]]


@functools.cache
def verdict(a: str, b: str) -> Verdict:
    """Whether the config accepts ``a`` and ``b`` together (see the module's doc); decided once per
    process (the table, the tests' collection and their checks ask for the same pairs)."""
    if a in STRATEGIES and b in STRATEGIES:
        return Verdict()
    overrides = pair_overrides(a, b)
    try:
        config = load_config(None, overrides)
    except ConfigError as e:
        return Verdict(reason=_reason(e))
    first: ConfigError | None = None
    for nproc in SIZES:
        if nproc < max(LEAST.get(a, 1), LEAST.get(b, 1)):
            continue
        try:
            check_world(config, nproc)
            return Verdict(nproc=nproc)
        except ConfigError as e:
            first = first or e
    assert first is not None
    return Verdict(reason=_reason(first))


def _reason(e: ConfigError) -> str:
    text = str(e).strip()
    return text.removeprefix("config: ").splitlines()[0]


def markdown() -> str:
    """The accepted/refused matrix as markdown: a table (the number of processes, or a reason's
    number) and the reasons, each once."""
    names = list(FEATURES)
    reasons: list[str] = []
    rows = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = []
        for b in names:
            if a == b:
                cells.append("")
                continue
            v = verdict(*sorted((a, b), key=names.index))
            if v.accepted:
                cells.append(str(v.nproc))
            elif v.reason is None:
                cells.append("-")
            else:
                if v.reason not in reasons:
                    reasons.append(v.reason)
                cells.append(f"no ({reasons.index(v.reason) + 1})")
        rows.append(f"| {a} | " + " | ".join(cells) + " |")
    notes = [f"{i}. {r}" for i, r in enumerate(reasons, 1)]
    return "\n".join([*rows, "", *notes]) + "\n"


def pairs() -> list[tuple[str, str]]:
    """Every pair of different features, once, in the table's order."""
    return list(itertools.combinations(FEATURES, 2))


if __name__ == "__main__":
    sys.stdout.write(markdown())
