"""The low-communication bench's finished runs, kept for a later invocation (``--reuse``).

A bench at the papers' horizons takes hours (3 seeds of 2,000 steps of each method and its
baselines), longer than one sitting, and every invocation runs DDP and each dense twin again. With
``--reuse`` a run whose settings are those a new invocation would train with is read back from its
run directory instead of trained again, so that methods measured at different times share their
baselines and land in one table and one plot.

A run is kept only once it finished: a file beside its run directory, written after ``dtlab train``
exited 0, records what it trained (the whole command's settings, the link, and the dtlab and torch
versions). A run stopped part
way, or one that an older bench wrote, has no such file and runs again. Only runs on an uncapped
link without an injected round trip are reused: there the figures read are the losses and the
bytes, which do not depend on when the run took place; a capped link's step times do. Nor is a run
from another processor model: the same settings and seed end at other losses there (measured on
`tiny` at 1,000 steps, seed 0, on two machines: DDP 1.2143 and 1.2146, 1-bit Streaming DiLoCo
1.2488 and 1.2270), the float kernels' roundings compounding over the steps, so a table mixing
them would pair a method's seed with a baseline that did not train alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtlab.bench.link import Link


def processor() -> str:
    """This machine's processor model (Linux's ``/proc/cpuinfo``; elsewhere what ``platform``
    says)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def identity(settings: list[str], link: Link) -> dict[str, Any]:
    """What a run trains: every ``--set`` of its ``dtlab train`` command (run.dir left out), the
    link it runs on, the dtlab and torch versions that train it and the processor it ran on."""
    import torch

    from dtlab import __version__

    kept = [s for s in settings if not s.startswith("run.dir=")]
    return {
        "settings": kept, "link": link.name, "rtt_s": link.rtt_s, "dtlab": __version__,
        "torch": torch.__version__, "processor": processor(),
    }  # fmt: skip


def _done_file(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + ".done.json")


def mark_done(run_dir: Path, settings: list[str], link: Link) -> None:
    """Record that ``run_dir``'s run finished with ``settings`` on ``link``."""
    _done_file(run_dir).write_text(json.dumps(identity(settings, link), indent=1))


def forget(run_dir: Path) -> None:
    """Remove ``run_dir``'s record (before the run is trained again)."""
    _done_file(run_dir).unlink(missing_ok=True)


def reusable(run_dir: Path, settings: list[str], link: Link) -> list[dict[str, Any]] | None:
    """The records of ``run_dir``'s finished run when it trained ``settings`` on ``link`` (an
    uncapped link without an injected round trip), else None."""
    if link.rate_bps or link.rtt_s:
        return None
    done, metrics = _done_file(run_dir), run_dir / "metrics.jsonl"
    if not (done.is_file() and metrics.is_file()):
        return None
    try:
        if json.loads(done.read_text()) != identity(settings, link):
            return None
        return [json.loads(line) for line in metrics.read_text().splitlines()]
    except (OSError, ValueError):
        return None


def reused_note(rows: list[dict[str, Any]]) -> str:
    """The report's line naming the rows read back from earlier invocations ("" when none was)."""
    names = [
        f"{r['link']}-{r['method']}" + (f"-seed{r['seed']}" if r.get("seed") is not None else "")
        for r in rows
        if r.get("reused")
    ]
    return f"\nRead back from earlier invocations (--reuse): {', '.join(names)}.\n" if names else ""
