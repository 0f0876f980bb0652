"""The report of ``make gpu-check``: ``report.json`` (everything) and ``report.md`` (for people): the
machine, each check's verdict, reason, wall time and figures, and what was skipped and why."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dtlab.gpucheck.runner import FAILED, PASSED, SKIPPED, Check

__all__ = ["write_report"]

GIB = 2**30


def as_json(
    machine: dict[str, Any], checks: list[Check], wall_s: float, budget_s: float, started: str
) -> dict[str, Any]:
    """The report's JSON: ``ok`` only when no check failed."""
    failed = [c.name for c in checks if c.status == FAILED]
    return {
        "ok": not failed,
        "started": started,
        "wall_s": round(wall_s, 1),
        "budget_s": budget_s,
        "machine": machine,
        "failed": failed,
        "skipped": [c.name for c in checks if c.status == SKIPPED],
        "passed": [c.name for c in checks if c.status == PASSED],
        "checks": [asdict(c) for c in checks],
    }


def _card(m: dict[str, Any]) -> str:
    devices = m.get("devices") or []
    if not devices:
        return f"no CUDA GPU: {m.get('cpu')} ({m.get('cpu_count')} cores)"
    names = sorted({d["name"] for d in devices})
    mem = devices[0]["memory_bytes"] / GIB
    return (
        f"{len(devices)} x {', '.join(names)} ({mem:.1f} GiB each, compute capability "
        f"{devices[0]['capability']})"
    )


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    verdict = "PASSED" if report["ok"] else f"FAILED: {', '.join(report['failed'])}"
    lines = [
        f"# dtlab GPU check: {verdict}",
        "",
        f"Started {report['started']}, {report['wall_s']:.0f} s in all (budget "
        f"{report['budget_s']:.0f} s).",
        "",
        "## Machine",
        "",
        f"- card: {_card(m)}",
        f"- NVIDIA driver {m.get('nvidia_driver') or '-'}, CUDA {m.get('cuda_runtime') or '-'} "
        f"(torch's build; the driver supports up to {m.get('cuda_driver_api') or '-'}), NCCL "
        f"{m.get('nccl') or '-'}",
        f"- torch {m.get('torch')}, Python {m.get('python')}, {m.get('platform')}",
        f"- host {m.get('hostname')}: {m.get('cpu')}, {m.get('cpu_count')} cores, "
        f"{(m.get('host_memory_bytes') or 0) / GIB:.0f} GiB",
        "",
        "## Checks",
        "",
        "| check | result | wall time | timeout | what it proves |",
        "|---|---|---|---|---|",
    ]
    for c in report["checks"]:
        timeout = f"{c['timeout_s']:.0f} s" if c["timeout_s"] else "-"
        lines.append(
            f"| {c['name']} | {c['status']} | {c['wall_s']:.1f} s | {timeout} | {c['title']} |"
        )
    for c in report["checks"]:
        lines += ["", f"### {c['name']}: {c['status']}", "", c["reason"] or "-"]
        figures = {k: v for k, v in c["figures"].items() if k != "tests"}
        if figures:
            lines += ["", "```json", json.dumps(figures, indent=1), "```"]
        tests = c["figures"].get("tests")
        if tests:
            lines += ["", "| test | outcome | reason |", "|---|---|---|"]
            lines += [f"| `{t['id']}` | {t['outcome']} | {t['reason']} |" for t in tests]
        if c["commands"]:
            lines += ["", "Commands (logs: " + ", ".join(c["logs"]) + "):", ""]
            lines += [f"    {cmd}" for cmd in c["commands"]]
    if report["skipped"]:
        lines += ["", "## Skipped", ""]
        lines += [
            f"- {c['name']}: {c['reason']}" for c in report["checks"] if c["status"] == SKIPPED
        ]
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    """``out/report.json`` and ``out/report.md``."""
    js, md = out / "report.json", out / "report.md"
    js.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    md.write_text(markdown(report), encoding="utf-8")
    return md, js
