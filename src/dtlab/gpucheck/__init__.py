"""``make gpu-check`` (``python -m dtlab.gpucheck``): one command that proves a GPU machine, in at most
10 minutes, and writes a report naming the card.

With CUDA GPUs it runs every CUDA test of the suite; a bf16 + torch.compile training of llama3.2-1b
(tokens/s, MFU against the card's measured bf16 GEMM peak); the training's peak memory against
``dtlab plan``'s prediction; sync and async saves (the time each blocked training and the training
time it cost); a resume from an async save that must continue as the uninterrupted run; and, with two
GPUs or more, the collectives' bus bandwidth across every GPU (each rank on a GPU of its own), DDP,
FSDP, TP, PP and CP against one process (``dtlab verify``; with four, HSDP and FSDP x TP too) and a
run whose rank 1 is killed, which must end in a clear error within its collective timeout, and
one of two fault-tolerant replica groups whose group 1 is killed, which must rejoin and finish. On a CPU machine it runs the same
pipeline on the debug model with the step counts cut down (under a minute) and says what it skipped
and why. Each step has its own timeout, cut to what is left of the budget; any check that fails
makes the exit code 1, and the report says which.

    python -m dtlab.gpucheck [--out DIR] [--only NAMES] [--skip NAMES] [--budget S]
    python -m dtlab.gpucheck --list-cuda-tests          # the suite's CUDA tests, as docs/gpu.md lists them
    python -m dtlab.gpucheck --update-docs docs/gpu.md  # regenerate that list

``DTLAB_FAULTS`` in the environment reaches every run of the checks (to see one fail on purpose).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dtlab.cliargs import run_command
from dtlab.errors import DtlabError
from dtlab.gpucheck import cudatests
from dtlab.gpucheck.checks import CHECK_FUNCTIONS, MIN_STEP_S, Context
from dtlab.gpucheck.report import as_json, write_report
from dtlab.gpucheck.runner import FAILED, Check, Deadline, StepTimeout, python, run_logged
from dtlab.gpucheck.settings import BUDGET_S, CHECKS, settings_for, skip_reason

__all__ = ["CHECKS", "main", "run_checks"]

MACHINE_TIMEOUT_S = 60.0


def _names(text: str | None, flag: str) -> set[str]:
    if text is None:
        return set()
    names = {x.strip() for x in text.split(",") if x.strip()}
    unknown = sorted(names - set(CHECKS))
    if not names or unknown:
        raise DtlabError(
            f"{flag} {text!r}: {', '.join(unknown) or 'no name'} is not a check; allowed: "
            f"{', '.join(CHECKS)}"
        )
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dtlab.gpucheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", type=Path, default=None,
        help="report directory, new or empty (default runs/gpu-check-<UTC timestamp>)",
    )  # fmt: skip
    p.add_argument(
        "--only", default=None, help=f"comma-separated checks to run: {', '.join(CHECKS)}"
    )
    p.add_argument("--skip", default=None, help="comma-separated checks not to run")
    p.add_argument(
        "--budget", type=float, default=BUDGET_S,
        help=f"seconds for everything; each step's timeout is cut to what is left (default {BUDGET_S:g})",
    )  # fmt: skip
    p.add_argument(
        "--tests", type=Path, default=None, help="the test suite (default: the checkout's tests/)"
    )
    p.add_argument(
        "--list-cuda-tests", action="store_true",
        help="print the suite's CUDA tests (id: the first paragraph of the docstring) and exit",
    )  # fmt: skip
    p.add_argument(
        "--update-docs", type=Path, default=None, metavar="PATH",
        help="rewrite the generated list of CUDA tests in PATH (docs/gpu.md) and exit",
    )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tests = args.tests or cudatests.find_tests()
    if args.tests is not None and not args.tests.is_dir():
        raise DtlabError(f"--tests {args.tests}: not a directory")
    if args.list_cuda_tests or args.update_docs is not None:
        if tests is None:
            raise DtlabError(
                "no test suite found: run it from a dtlab checkout or give --tests DIR"
            )
        found = cudatests.collect(tests)
        if args.update_docs is not None:
            changed = cudatests.update_docs(args.update_docs, found)
            print(
                f"{args.update_docs}: {len(found)} CUDA tests, {'updated' if changed else 'unchanged'}"
            )
        else:
            print(cudatests.render(found))
        return 0
    if not 0 < args.budget < float("inf"):
        raise DtlabError(f"--budget {args.budget}: allowed: a finite number of seconds > 0")
    only, skip = _names(args.only, "--only"), _names(args.skip, "--skip")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("runs") / f"gpu-check-{stamp}"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DtlabError(f"--out {out}: exists and is not an empty directory; give a new one")
    out.mkdir(parents=True, exist_ok=True)
    report = run_checks(out, only or set(CHECKS), skip, args.budget, tests)
    md, js = write_report(out, report)
    print(f"\n{'passed' if report['ok'] else 'FAILED: ' + ', '.join(report['failed'])} in "
          f"{report['wall_s']:.0f} s; report: {md} and {js}")  # fmt: skip
    return 0 if report["ok"] else 1


def run_checks(
    out: Path, selected: set[str], skip: set[str], budget_s: float, tests: Path | None
) -> dict[str, Any]:
    """Name the machine, then run each check of ``selected`` not in ``skip`` that this machine can
    run; returns the report (as report.json holds it)."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    deadline = Deadline(budget_s)
    machine_check = Check("machine", "name the card: GPUs, memory, driver, CUDA, NCCL, torch")
    machine = _machine(out, machine_check)
    gpus = int(machine.get("device_count", 0))
    memory = min((d["memory_bytes"] for d in machine.get("devices", [])), default=None)
    ctx = Context(out, machine, settings_for(gpus, memory), deadline, tests=tests)
    checks = [machine_check]
    for i, (name, title) in enumerate(CHECKS.items()):
        check = Check(name, title, timeout_s=ctx.settings.timeouts[name])
        checks.append(check)
        ctx.done[name] = check
        reason = skip_reason(name, gpus)
        if name not in selected or name in skip:
            check.skipped("not selected (--only / --skip)")
        elif reason is not None:
            check.skipped(reason)
        elif deadline.left() < MIN_STEP_S:
            check.failed(f"not started: {max(0.0, deadline.left()):.0f} s of the budget left")
        else:
            print(f"[{i + 1}/{len(CHECKS)}] {name}: {title}", flush=True)
            _run_one(ctx, check)
        print(f"  {name}: {check.status} ({check.wall_s:.1f} s): {check.reason}", flush=True)
    return as_json(machine, checks, deadline.elapsed(), budget_s, started)


def _machine(out: Path, check: Check) -> dict[str, Any]:
    """This machine, as a process of its own describes it (the checking process stays off the GPU)."""
    t0 = time.perf_counter()
    check.commands.append("python -m dtlab.gpucheck.machine")
    check.logs.append("machine.log")
    try:
        proc = run_logged(
            [python(), "-m", "dtlab.gpucheck.machine"], MACHINE_TIMEOUT_S, out / "machine.log"
        )
        machine: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (StepTimeout, ValueError, IndexError) as e:
        check.failed(f"could not describe this machine: {e}")
        machine = {"device_count": 0, "devices": []}
    else:
        gpus = machine["device_count"]
        names = sorted({d["name"] for d in machine["devices"]})
        if machine.get("no_gpu_reason"):
            # GPUs torch cannot use: the smoke on the CPU must not pass for a GPU check.
            check.failed(machine["no_gpu_reason"])
            check.wall_s = time.perf_counter() - t0
            print(f"[0/{len(CHECKS)}] machine: FAILED: {check.reason}", flush=True)
            return machine
        check.passed(
            f"{gpus} CUDA GPU(s){': ' + ', '.join(names) if names else ''}; torch {machine['torch']}"
        )
    check.wall_s = time.perf_counter() - t0
    print(f"[0/{len(CHECKS)}] machine: {check.reason}", flush=True)
    return machine


def _run_one(ctx: Context, check: Check) -> None:
    t0 = time.perf_counter()
    try:
        CHECK_FUNCTIONS[check.name](ctx, check)
    except StepTimeout as e:
        check.failed(str(e))
    except (
        Exception
    ) as e:  # a check's own bug: reported as that check's failure, the others still run
        log = ctx.out / check.name / "error.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc(), encoding="utf-8")
        check.failed(f"{type(e).__name__}: {e} (traceback in {log})")
    check.wall_s = time.perf_counter() - t0
    if check.status == "pending":
        check.failed("the check gave no verdict")
    if check.status == FAILED and not check.reason:
        check.reason = "failed"


if __name__ == "__main__":
    raise SystemExit(run_command(main))
