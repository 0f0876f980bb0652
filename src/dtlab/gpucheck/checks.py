"""The checks of ``make gpu-check``, one function each: it runs its commands through the context (each
under its timeout, logged), judges what they left, and records figures and a verdict in its
:class:`Check`."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtlab.gpucheck import cudatests
from dtlab.gpucheck.pytest_plugin import TESTS_ENV
from dtlab.gpucheck.runner import PASSED, Check, Deadline, Proc, StepTimeout, python, run_logged
from dtlab.gpucheck.settings import QUIET, Settings

__all__ = ["CHECK_FUNCTIONS", "MEMORY_TOLERANCE", "Context"]

MIN_STEP_S = 15.0  # a step with less of the budget left is not started
MEMORY_TOLERANCE = 0.3  # the measured peak within 30% of dtlab plan's prediction
GIB = 2**30


@dataclass
class Context:
    """What every check reads and writes: the output directory, the machine, the settings, the
    budget, and the checks already run (memory reads train's figures)."""

    out: Path
    machine: dict[str, Any]
    settings: Settings
    deadline: Deadline
    done: dict[str, Check] = field(default_factory=dict)
    tests: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # for every command (tests hide the GPUs)

    @property
    def gpus(self) -> int:
        return int(self.machine.get("device_count", 0))

    def run(
        self, check: Check, cmd: list[str], log: str, env: dict[str, str] | None = None
    ) -> Proc:
        """``cmd`` under what is left of the check's timeout (and of the whole budget), logged in
        ``out/<check>/<log>.log``."""
        own = math.inf if check.timeout_s is None else check.timeout_s - check.wall_s
        left = min(own, self.deadline.left())
        shown = [c if c != python() else "python" for c in cmd]
        check.commands.append(" ".join(shown))
        path = self.out / check.name / f"{log}.log"
        check.logs.append(str(path.relative_to(self.out)))
        proc = run_logged(cmd, left, path, {**self.env, **(env or {})})
        check.wall_s += proc.wall_s
        return proc


def _tail(proc: Proc, lines: int = 6) -> str:
    text = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    return " | ".join(text[-lines:]) if text else "(no output)"


def _smoke(s: Settings, said: str) -> str:
    return f"{s.smoke}: {said}" if s.smoke else said


def dtlab(*args: str) -> list[str]:
    return [python(), "-m", "dtlab", *args]


# ---------------------------------------------------------------- every CUDA test


def cuda_tests(ctx: Context, check: Check) -> None:
    if not cudatests.has_pytest():
        return check.skipped("pytest is not installed (make install-dev installs it)")
    if ctx.tests is None:
        return check.skipped("no test suite here: run it from a dtlab checkout")
    results = ctx.out / check.name / "tests.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    timed_out = ""
    try:
        proc: Proc | None = ctx.run(
            check, cudatests.pytest_command(ctx.tests), "pytest", {TESTS_ENV: str(results)}
        )
    except StepTimeout as e:  # what ran before the timeout is still reported, test by test
        proc, timed_out = None, str(e)
    tests = json.loads(results.read_text(encoding="utf-8")) if results.exists() else []
    check.figures["tests"] = tests
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"] or "not run"] = counts.get(t["outcome"] or "not run", 0) + 1
    check.figures["counts"] = counts
    shown = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    if proc is None:
        return check.failed(f"{timed_out}; {len(tests)} CUDA tests: {shown}")
    if proc.returncode == 5 or not tests:
        return check.skipped("the suite has no CUDA test")
    bad = [t for t in tests if t["outcome"] in ("failed", "error", None)]
    if proc.returncode != 0 or bad:
        names = ", ".join(t["id"] for t in bad[:5]) or _tail(proc)
        return check.failed(f"{len(tests)} CUDA tests: {shown}; not passed: {names}")
    if counts.get("passed", 0) == 0:
        reasons = sorted({t["reason"] for t in tests})
        return check.skipped(
            f"{len(tests)} CUDA tests collected, all skipped: " + "; ".join(reasons)
        )
    check.passed(f"{len(tests)} CUDA tests: {shown}")


# ---------------------------------------------------------------- training speed


def train(ctx: Context, check: Check) -> None:
    s = ctx.settings
    out = ctx.out / check.name / "bench"
    cmd = dtlab(
        "bench", "--strategies", "single", "--nproc", "1", "--steps", str(s.train_steps),
        "--warmup", str(s.train_warmup), "--out", str(out), "--set", *s.train,
    )  # fmt: skip
    proc = ctx.run(check, cmd, "bench")
    rows = _rows(out / "results.json")
    if proc.returncode != 0 or not rows:
        return check.failed(f"dtlab bench failed (exit code {proc.returncode}): {_tail(proc)}")
    row = rows[0]
    tokens_per_s, flops = row["tokens_per_s"], row["flops_per_token"]
    gemm = row.get("gemm_flops_measured")
    mfu = flops * tokens_per_s / gemm if gemm else None
    losses = row.get("losses") or [row.get("loss_initial"), row.get("loss_final")]
    check.figures.update({
        "device": row.get("device"), "params": row.get("params"), "precision": row.get("precision"),
        "config": s.train, "steps_timed": s.train_steps, "warmup_steps": s.train_warmup,
        "step_time_s": row["step_time_s"], "step_time_min_s": row.get("step_time_min_s"),
        "step_time_max_s": row.get("step_time_max_s"), "tokens_per_s": tokens_per_s,
        "flops_per_token": flops, "gemm_tflops_measured": gemm / 1e12 if gemm else None,
        "mfu_vs_measured_gemm": mfu,
        "mfu_vs_datasheet": row.get("mfu") if "datasheet" in str(row.get("peak_flops_source")) else None,
        "peak_flops_source": row.get("peak_flops_source"),
        "peak_memory_bytes": row.get("peak_memory_bytes"),
        "loss_first": losses[0], "loss_last": losses[-1],
    })  # fmt: skip
    if not all(isinstance(x, float) and math.isfinite(x) for x in losses):
        return check.failed(f"a loss is not finite: {losses}")
    if not losses[-1] < losses[0]:
        return check.failed(f"the loss did not fall: {losses[0]:.4f} then {losses[-1]:.4f}")
    if not gemm or mfu is None or not 0 < mfu < 1:
        # Above 100% of a GEMM measured on the same card, the FLOP count or the timing is wrong.
        return check.failed(f"MFU against the measured GEMM peak is {mfu}: expected in (0, 1)")
    sheet = check.figures["mfu_vs_datasheet"]
    check.passed(_smoke(s, (
        f"{tokens_per_s:,.0f} tokens/s, {row['step_time_s'] * 1e3:.1f} ms a step, MFU {mfu:.1%} "
        f"of the measured {gemm / 1e12:,.2f} TFLOP/s GEMM"
        + (f" ({sheet:.1%} of the datasheet's peak)" if sheet else "")
    )))  # fmt: skip


def float8(ctx: Context, check: Check) -> None:
    """train's bench again with train.float8: tokens/s against bf16's (the train check's), the loss
    after the same steps, and the float8 GEMMs native (a GPU of compute capability 8.9 or later)."""
    s = ctx.settings
    base = ctx.done.get("train")
    if base is None or base.status != PASSED:
        return check.skipped("the train check (bf16, its baseline) did not pass")
    out = ctx.out / check.name / "bench"
    f8 = [*s.train, "train.precision=bf16", "train.float8.enabled=true"]
    cmd = dtlab(
        "bench", "--strategies", "single", "--nproc", "1", "--steps", str(s.train_steps),
        "--warmup", str(s.train_warmup), "--out", str(out), "--set", *f8,
    )  # fmt: skip
    proc = ctx.run(check, cmd, "bench")
    rows = _rows(out / "results.json")
    if proc.returncode != 0 or not rows:
        return check.failed(f"dtlab bench failed (exit code {proc.returncode}): {_tail(proc)}")
    row, b = rows[0], base.figures
    losses = row.get("losses") or [row.get("loss_initial"), row.get("loss_final")]
    emulated = bool((row.get("float8") or {}).get("emulated", not s.gpu))
    ratio = row["tokens_per_s"] / b["tokens_per_s"] if b.get("tokens_per_s") else None
    check.figures.update({
        "config": f8, "tokens_per_s": row["tokens_per_s"], "step_time_s": row["step_time_s"],
        "bf16_tokens_per_s": b.get("tokens_per_s"), "float8_over_bf16": ratio,
        "peak_memory_bytes": row.get("peak_memory_bytes"),
        "bf16_peak_memory_bytes": b.get("peak_memory_bytes"),
        "loss_first": losses[0], "loss_last": losses[-1], "bf16_loss_last": b.get("loss_last"),
        "emulated": emulated,
    })  # fmt: skip
    if not all(isinstance(x, float) and math.isfinite(x) for x in losses):
        return check.failed(f"a loss is not finite: {losses}")
    gap = abs(losses[-1] - b["loss_last"]) / b["loss_last"] if b.get("loss_last") else None
    if gap is None or gap > 0.02:
        return check.failed(f"the loss after {s.train_steps} steps is {gap} from bf16's (max 2%)")
    if s.gpu and emulated:
        return check.failed("the float8 GEMMs were emulated on a GPU (compute capability < 8.9?)")
    said = (
        f"{row['tokens_per_s']:,.0f} tokens/s, {ratio:.2f}x bf16's; loss {losses[-1]:.4f} "
        f"(bf16 {b['loss_last']:.4f})"
        if ratio
        else f"loss {losses[-1]:.4f}"
    )
    check.passed(_smoke(s, said + (", emulated: says nothing of speed" if emulated else "")))


def _rows(path: Path) -> list[dict[str, Any]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8")).get("rows", [])
    except (OSError, ValueError):
        return []
    return rows if isinstance(rows, list) else []


# ---------------------------------------------------------------- memory against the plan


def memory(ctx: Context, check: Check) -> None:
    s = ctx.settings
    trained = ctx.done.get("train")
    measured = trained.figures.get("peak_memory_bytes") if trained else None
    if trained is None or trained.status == "skipped":
        return check.skipped("it judges the train check's run, which did not run")
    if measured is None:
        return check.failed("no measured peak: the train check did not run to its end")
    proc = ctx.run(check, dtlab("plan", "--json", "--nproc", "1", "--set", *s.train), "plan")
    try:
        plan = json.loads(proc.stdout)
        single = {x["strategy"]: x for x in plan["strategies"]}["single"]  # plan's row by its name
        predicted = int(single["per_rank"]["total_bytes"])
    except (ValueError, KeyError, TypeError):
        return check.failed(f"dtlab plan --json gave no single-process figure: {_tail(proc)}")
    ratio = measured / predicted
    check.figures.update({
        "measured_bytes": measured, "predicted_bytes": predicted, "ratio": ratio,
        "predicted_components": single["per_rank"], "tolerance": MEMORY_TOLERANCE,
    })  # fmt: skip
    said = (
        f"peak {measured / GIB:.2f} GiB measured, {predicted / GIB:.2f} GiB predicted "
        f"({ratio:.0%} of it)"
    )
    if not s.gpu:
        return check.skipped(
            f"{said}; not judged on CPU: the peak there is the process's resident memory (the "
            "interpreter, torch and the data loader included), not a device allocator's"
        )
    if abs(ratio - 1) > MEMORY_TOLERANCE:
        return check.failed(f"{said}: off by more than {MEMORY_TOLERANCE:.0%}")
    check.passed(said)


# ---------------------------------------------------------------- what a save costs


SAVE_KINDS = {"none": None, "sync": "false", "async": "true"}  # checkpoint.async of each run


def checkpoint(ctx: Context, check: Check) -> None:
    s = ctx.settings
    runs = _save_runs(ctx, check)
    if runs is None:
        return None
    expected = s.checkpoint_steps // s.checkpoint_every
    base = runs["none"]["after_first_s"]
    for kind in [k for k in s.save_kinds if k != "none"]:
        r = runs[kind]
        saved = r.get("checkpoints_saved", 0)
        check.figures[kind] = _save_figures(r, base)
        if saved != expected or r.get("checkpoint_failures"):
            return check.failed(
                f"{kind}: {saved} checkpoints saved, {r.get('checkpoint_failures')} failed; "
                f"expected {expected} saved"
            )
    check.figures["none"] = {
        "train_time_s": runs["none"]["train_time_s"],
        "after_first_step_s": base,
        "median_step_time_s": runs["none"].get("median_step_time_s"),
    }
    check.figures["config"] = s.checkpoint
    said = _saves_said(check, expected, base)
    a, y = check.figures.get("async"), check.figures.get("sync")
    if s.gpu and a and y and a["blocked_per_save_s"] >= y["blocked_per_save_s"]:
        # On a GPU the copy to pinned memory is far quicker than a write: a save that blocks as
        # long as a sync one is not overlapped at all.
        return check.failed(f"{said}: an async save blocked as long as a sync one")
    check.passed(_smoke(s, said))


def _save_runs(ctx: Context, check: Check) -> dict[str, dict[str, Any]] | None:
    """The summary of each kind of save's training run, with its time after the first step; None
    (the check failed) when a run failed."""
    s = ctx.settings
    runs: dict[str, dict[str, Any]] = {}
    for kind in s.save_kinds:
        value = SAVE_KINDS[kind]
        run_dir = ctx.out / check.name / kind
        saves = (
            ["checkpoint.every=0"] if value is None
            else [f"checkpoint.every={s.checkpoint_every}", f"checkpoint.async={value}",
                  f"checkpoint.keep={s.checkpoint_steps}"]
        )  # fmt: skip
        cmd = dtlab(
            "train", "--set", *s.checkpoint, *QUIET, f"train.steps={s.checkpoint_steps}",
            f"run.dir={run_dir}", "run.log_every=1", "checkpoint.final=false", *saves,
        )  # fmt: skip
        proc = ctx.run(check, cmd, kind)
        summary = _summary(run_dir)
        if proc.returncode != 0 or summary is None:
            check.failed(f"the {kind} run failed (exit code {proc.returncode}): {_tail(proc)}")
            return None
        # The loop's time after its first step: the first (CUDA's and the allocator's warm-up, the
        # data's first batch) varies from run to run by more than a save may cost.
        summary["after_first_s"] = summary["train_time_s"] - _first_step_s(run_dir)
        runs[kind] = summary
    return runs


def _save_figures(r: dict[str, Any], base: float) -> dict[str, Any]:
    """A saving run's figures: what its saves blocked, and the training time they cost over the
    run without saves (``base``: its time after the first step)."""
    saved = r.get("checkpoints_saved", 0)
    lost = r["after_first_s"] - base
    return {
        "saves": saved,
        "blocked_s": r["checkpoint_blocked_s"],
        "blocked_per_save_s": r["checkpoint_blocked_s"] / saved if saved else None,
        "train_time_s": r["train_time_s"],
        "after_first_step_s": r["after_first_s"],
        "lost_s": lost,
        "lost_per_save_s": lost / saved if saved else None,
        "median_step_time_s": r.get("median_step_time_s"),
    }


def _saves_said(check: Check, expected: int, base: float) -> str:
    """The verdict's figures: per save, what each kind blocked and cost the training time."""
    return (
        f"{expected} saves a run; per save, "
        + ", ".join(
            f"{kind} blocked {f['blocked_per_save_s']:.3f} s and changed the training time by "
            f"{f['lost_per_save_s']:+.3f} s"
            for kind, f in check.figures.items()
            if kind in SAVE_KINDS and kind != "none"
        )
        + f" (the steps after the first: {base:.2f} s without saves)"
    )


def _first_step_s(run_dir: Path) -> float:
    """Step 1's time in a run's metrics.jsonl (0 when it is not there)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0.0
    for line in lines:
        record = json.loads(line)
        if record.get("step") == 1 and isinstance(record.get("step_time_s"), (int, float)):
            return float(record["step_time_s"])
    return 0.0


def _summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


# ---------------------------------------------------------------- resuming and layouts


def resume(ctx: Context, check: Check) -> None:
    s = ctx.settings
    out = ctx.out / check.name / "verify"
    cmd = [
        python(), "-m", "dtlab.gpucheck.resume", "--steps", str(s.resume_steps), "--out", str(out),
        "--layouts", s.resume_layouts, "--set", *s.resume, *QUIET,
    ]  # fmt: skip
    proc = ctx.run(check, cmd, "verify")
    result = _verify_json(out)
    if result is None:
        return check.failed(
            f"the resume check did not run (exit code {proc.returncode}): {_tail(proc)}"
        )
    rows = [c for layout in result["state"] for c in layout["checks"]]
    check.figures.update({"checks": rows, "middle_step": result.get("middle"), "config": s.resume,
                          "layouts": s.resume_layouts})  # fmt: skip
    bad = [c for c in rows if not c["ok"]]
    worst = max((c["max_loss_diff"] or 0.0) for c in rows) if rows else None
    if proc.returncode != 0 or bad or not rows:
        notes = "; ".join(f"{c['check']}: loss {c['max_loss_diff']}, params {c['max_param_diff']} "
                          f"{c.get('note', '')}" for c in bad)  # fmt: skip
        return check.failed(
            f"the resumed run differs from the uninterrupted one: {notes or _tail(proc)}"
        )
    across = (
        f" ({s.resume_layouts}: each on its own layout and on the first)"
        if "," in s.resume_layouts
        else ""
    )
    check.passed(_smoke(s,
        f"resumed at step {result.get('middle')} of {s.resume_steps}{across}: largest loss "
        f"difference {worst:.1e}, parameters {max(c['max_param_diff'] for c in rows):.1e}"
    ))  # fmt: skip


def equivalence(ctx: Context, check: Check) -> None:
    """``dtlab verify`` of the dense model's layouts, then each of the settings' further runs (a
    mixture of experts' expert parallelism, bf16 with compile), each against one process."""
    s = ctx.settings
    runs = [("verify", "", s.layouts, s.equivalence), *s.more_verifies]
    rows: list[dict[str, Any]] = []
    check.figures.update({"config": s.equivalence, "layouts": s.layouts, "more": [
        {"name": name, "layouts": layouts, "config": config}
        for name, _, layouts, config in s.more_verifies
    ]})  # fmt: skip
    for name, _, layouts, config in runs:
        out = ctx.out / check.name / name
        cmd = dtlab(
            "verify", "--layouts", layouts, "--steps", str(s.equivalence_steps), "--out", str(out),
            "--set", *config, *QUIET,
        )  # fmt: skip
        proc = ctx.run(check, cmd, name)
        result = _verify_json(out)
        if result is None:
            return check.failed(
                f"dtlab verify --layouts {layouts} did not finish (exit code {proc.returncode}): "
                f"{_tail(proc)}"
            )
        rows += [{**r, "run": name} for r in result["rows"]]
        check.figures["rows"] = rows
        bad = [r["layout"] for r in result["rows"] if not r["ok"]]
        if proc.returncode != 0 or bad:
            return check.failed(
                f"{name}: not within tolerance of {layouts.split(',')[0]}: "
                f"{', '.join(bad) or _tail(proc)}"
            )
    worst = max(r["max_loss_diff"] for r in rows)
    more = "".join(f"; {layouts} of {what}" for _, what, layouts, _ in s.more_verifies)
    check.passed(
        f"{s.layouts}{more}: every layout within tolerance, largest loss difference {worst:.1e}"
    )


def _verify_json(out: Path) -> dict[str, Any] | None:
    try:
        result = json.loads((out / "verify.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


# ---------------------------------------------------------------- bus bandwidth


def collectives(ctx: Context, check: Check) -> None:
    """NCCL's collectives across every GPU of the node (gloo between 2 processes on a CPU, as the
    tests run it): each result checked, the bus bandwidth at each size, one rank per GPU."""
    from dtlab.analysis.busbw import placement_problem
    from dtlab.analysis.devices import known_profile

    s = ctx.settings
    gpus = ctx.gpus
    ranks, device = (gpus, "cuda") if gpus else (2, "cpu")
    out = ctx.out / check.name / "busbw.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        python(), "-m", "dtlab.bench.collectives", "--device", device, "--nproc", str(ranks),
        "--sizes", s.collective_sizes, "--json", str(out),
    ]  # fmt: skip
    proc = ctx.run(check, cmd, "busbw")
    try:
        result = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return check.failed(
            f"the collectives did not finish (exit code {proc.returncode}): {_tail(proc)}"
        )
    rows = result["results"]
    largest = {r["op"]: r for r in rows if r["size"] == max(x["size"] for x in rows)}
    check.figures.update({
        "backend": result["backend"], "world": result["world"], "devices": result["devices"],
        "results": rows,
        "busbw_gbps_at_largest": {op: r["busbw_gbps"] for op, r in largest.items()},
    })  # fmt: skip
    names = {d.get("name") for d in ctx.machine.get("devices", [])}
    card = known_profile(names.pop()) if len(names) == 1 else None
    if card is not None:
        check.figures["datasheet_link_gbps"] = card.intra_node_gbps
        check.figures["datasheet_link_source"] = card.intra_node_source
    wrong = [f"{r['op']} at {r['size']} B" for r in rows if not r["correct"]]
    if wrong:
        return check.failed(f"wrong results: {', '.join(wrong)}")
    if device == "cuda" and len(set(result["devices"])) != ranks:
        return check.failed(f"the {ranks} ranks did not each have a device: {result['devices']}")
    placement = [p for p in result.get("placement") or [] if p is not None]
    check.figures["placement"] = placement
    if (problem := placement_problem(placement)) is not None:
        return check.failed(f"placement: {problem}")
    if proc.returncode != 0:
        return check.failed(f"exit code {proc.returncode}: {_tail(proc)}")
    size = next(iter(largest.values()))["size"] / 2**20
    said = ", ".join(f"{op} {r['busbw_gbps']:.1f}" for op, r in largest.items())
    beside = (
        f" (the card's link: {card.intra_node_gbps:g} GB/s, looked up)" if card is not None else ""
    )
    where = ", ".join(result["devices"]) if gpus else "CPU processes: not a GPU's figure"
    unread = [p["unchecked"] for p in placement if "unchecked" in p]
    if placement and not unread:
        where += "; each rank's CUDA context on a GPU of its own (nvidia-smi)"
    elif unread:
        where += f"; placement not read: {unread[0]}"
    check.passed(
        f"{ranks} ranks over {result['backend']} ({where}), every result right; bus bandwidth "
        f"at {size:g} MiB, GB/s: {said}{beside}"
    )


# ---------------------------------------------------------------- a killed rank


def killed_rank(ctx: Context, check: Check) -> None:
    s = ctx.settings
    limit = s.killed_collective_timeout_s
    cmd = dtlab(
        "train", "--nproc", "2", "--set", *s.killed, *QUIET, "train.steps=8",
        f"run.dir={ctx.out / check.name / 'run'}", f"parallel.collective_timeout_s={limit:g}",
    )  # fmt: skip
    proc = ctx.run(check, cmd, "train", {"DTLAB_FAULTS": "kill@3:r1"})
    errors = [line for line in proc.stderr.splitlines() if re.search(r"\berror\b", line)]
    # Rank 0's own report of the failed collective, naming the dead rank (the launcher's summary
    # line names every failed rank whatever happened: not enough).
    named = [line for line in errors if re.match(r"\[rank0\] error: .*\bRank 1\b", line)]
    check.figures.update(
        {"exit_code": proc.returncode, "wall_s": proc.wall_s, "error_lines": errors[:5]}
    )
    if proc.returncode == 0:
        return check.failed("the run with rank 1 killed at step 3 exited 0")
    if "Traceback" in proc.stderr:
        return check.failed("the run ended in a Python traceback, not a clear error")
    if not named:
        return check.failed(f"rank 0 reported no error naming rank 1: {_tail(proc)}")
    check.passed(
        f"exit code {proc.returncode} after {proc.wall_s:.1f} s (collective timeout {limit:g} s): "
        f"{named[0].strip()[:240]}"
    )


# ---------------------------------------------------------------- a fault-tolerant group killed


def _last_step(run_dir: Path) -> int | None:
    """The last step ``run_dir``'s metrics record (None: none)."""
    from dtlab.train.rundir import logged_steps

    records = logged_steps(run_dir)
    return int(records[-1]["step"]) if records else None


FT_STEPS, FT_KILLED_AT = 20, 8


def ft_killed(ctx: Context, check: Check) -> None:
    """DDP over 2 fault-tolerant replica groups (torchft; one GPU each), group 1's process killed
    after step 8: its agent restarts it, it takes the live state from group 0 and the run ends
    every step, both groups at the same weights."""
    s = ctx.settings
    run_dir = ctx.out / check.name / "run"
    cmd = dtlab(
        "train", "--nproc", "2", "--set", *s.killed, *QUIET, f"train.steps={FT_STEPS}",
        f"run.dir={run_dir}", "parallel.fault_tolerance.enabled=true",
        "parallel.fault_tolerance.min_replicas=2", "checkpoint.every=5",
    )  # fmt: skip
    proc = ctx.run(check, cmd, "train", {"DTLAB_FAULTS": f"kill@{FT_KILLED_AT}:r1"})
    lines = proc.stderr.splitlines()
    died = [x for x in lines if "died (SIGKILL)" in x]
    recovered = [x for x in lines if "recovered the state" in x]
    summaries = [_summary(run_dir / f"replica-{g}") for g in (0, 1)]
    steps = [_last_step(run_dir / f"replica-{g}") for g in (0, 1)]
    check.figures.update({
        "exit_code": proc.returncode, "wall_s": proc.wall_s, "died": died[:2],
        "recovered": recovered[:2], "steps": steps,
        "recoveries": [(x or {}).get("fault_tolerance", {}).get("recoveries") for x in summaries],
    })  # fmt: skip
    if proc.returncode != 0:
        return check.failed(f"the run exited with {proc.returncode}: {_tail(proc)}")
    if "Traceback" in proc.stderr:
        return check.failed("the run printed a Python traceback")
    if steps != [FT_STEPS, FT_STEPS]:
        return check.failed(f"the groups' last steps are {steps}, not {FT_STEPS}")
    if not died or not recovered:
        return check.failed(
            f"group 1 was not killed and recovered (died: {len(died)}, recovered: "
            f"{len(recovered)}): {_tail(proc)}"
        )
    said = re.search(r"recovered the state.*", recovered[0])
    check.passed(
        f"group 1 killed after step {FT_KILLED_AT}, restarted, "
        f"{said.group(0) if said else 'recovered'}; both groups ended step {FT_STEPS} in "
        f"{proc.wall_s:.1f} s"
    )


CHECK_FUNCTIONS: dict[str, Callable[[Context, Check], None]] = {
    "cuda-tests": cuda_tests,
    "train": train,
    "float8": float8,
    "memory": memory,
    "checkpoint": checkpoint,
    "resume": resume,
    "collectives": collectives,
    "equivalence": equivalence,
    "killed-rank": killed_rank,
    "ft-killed": ft_killed,
}
