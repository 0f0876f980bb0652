"""The fit rule, measured: real training runs under a memory cap set from ``dtlab plan``'s prediction.

    python -m dtlab.bench.fitrule [--quick] [--malloc default,exact] [--ratios 0.5,0.8] [--json OUT]

Each case of a grid (model sizes, layouts single / ddp / fsdp on 1 and 2 processes, activation
checkpointing, micro-batch sizes) runs ``dtlab train`` for a few steps in a memory cgroup of its own
(cgroup v2 ``memory.max`` or v1 ``memory.limit_in_bytes``; no swap): first without a cap (what it
takes), then once for every ratio r of predicted / cap, the cap leaving each rank ``predicted / r``
bytes above the launch's baseline. A run ends ``ok``, ``out of memory`` (the kernel killed a process
of the group for the cap, or torch said it could not allocate) or ``other error`` (anything else,
never counted as fitting). The rule: the highest ratio at and below which no run of the grid failed,
and beside it the lowest ratio at which one ran out of memory.

Under two mallocs (torch's CPU allocator calls glibc's): ``default``, as ``dtlab train`` runs, where
freed memory stays in glibc's heaps (the CPU's allocator cache and fragmentation); ``exact``, where
every allocation over 64 KiB is a mapping of its own, unmapped when freed, so that the process holds
what its tensors hold: that grid checks the analytic model alone.

What is capped: the whole launch (launcher and ranks) in one cgroup, its resident memory and what the
kernel charges for it; page cache is reclaimed before anything is killed. The plan predicts tensors
only, so the cap is the launch's baseline plus the ranks' predictions over r. The baseline is
measured at the start, once per layout and malloc: the peak of the same launch with a model of a few
thousand parameters, less that model's own prediction (the interpreter, torch's libraries, the
process group, the launcher). The ranks of a case share the cgroup: they are symmetric (the same
prediction each), so the cap is the baseline plus world times the per-rank share.

Needs root and a writable memory cgroup (it creates children of this process's own cgroup and removes
them after each run); it says so and exits 1 where it cannot. The default grid takes about 25 minutes
on 2 cores; --quick under 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dtlab.analysis.model import plan_step
from dtlab.cliargs import output_file, positive_float, positive_int, run_command
from dtlab.config import check_world, load_config
from dtlab.errors import ConfigError

OK, OOM, OTHER = "ok", "out of memory", "other error"
# How the C library's malloc (which torch's CPU allocator calls) runs: ``default``, as ``dtlab train``
# runs (freed memory stays in its heaps for the next allocation: the CPU's allocator cache and
# fragmentation); ``exact``, every allocation over 64 KiB a mapping of its own, unmapped when freed,
# so that the process holds what its tensors hold: the analytic model alone, without the allocator.
MALLOC: dict[str, dict[str, str]] = {
    "default": {},
    "exact": {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"},
}
# The ratios worth running under each: around where the runs start to run out of memory.
RATIOS = {"default": (0.3, 0.4, 0.5, 0.6, 0.7, 0.8), "exact": (0.9, 0.95, 1.0, 1.05, 1.1)}
QUICK_RATIOS = {"default": (0.6, 1.0), "exact": (0.9, 1.1)}
# Every run: synthetic data, no files beside the metrics, no final checkpoint (a save stages its own
# copies, which the plan's step peak does not model).
COMMON = [
    "data.source=synthetic",
    "train.warmup_steps=1",
    "run.log_every=1",
    "run.tensorboard=false",
    "run.plot=false",
    "run.progress=none",
    "checkpoint.final=false",
    "eval.every=0",
]
# A model of a few thousand parameters: its launch measures the baseline of a layout.
NEGLIGIBLE = [
    "model.preset=debug",
    "model.dim=16",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=32",
    "data.seq_len=16",
    "train.micro_batch_size=1",
]
# ~12M parameters: tiny's vocabulary and sequence, a wider model.
MID = ["model.preset=tiny", "model.dim=512", "model.n_layers=4", "model.ffn_dim=1408"]


@dataclass(frozen=True)
class Case:
    """One configuration of the grid: a name, its ranks, its ``--set`` overrides and its malloc."""

    name: str
    nproc: int
    overrides: tuple[str, ...]
    malloc: str = "default"  # a key of MALLOC

    @property
    def layout(self) -> tuple[str, ...]:
        """The overrides that decide the launch's fixed cost (its baseline): the parallel ones."""
        return tuple(o for o in self.overrides if o.startswith("parallel."))


def _case(name: str, nproc: int, *overrides: str) -> Case:
    return Case(name, nproc, tuple(overrides))


TINY = ("model.preset=tiny", "data.seq_len=256")
GRID = [
    _case("tiny single mb8", 1, *TINY, "train.global_batch_size=8"),
    _case("tiny single mb8 ac", 1, *TINY, "train.global_batch_size=8",
          "train.activation_checkpointing=full"),
    _case("tiny ddp2 mb4", 2, *TINY, "train.global_batch_size=8", "parallel.strategy=ddp"),
    _case("tiny fsdp2 mb4", 2, *TINY, "train.global_batch_size=8", "parallel.strategy=fsdp"),
    _case("mid fsdp2 mb2 ac", 2, *MID, "data.seq_len=256", "train.global_batch_size=4",
          "parallel.strategy=fsdp", "train.activation_checkpointing=full"),
]  # fmt: skip
QUICK_GRID = [GRID[0], GRID[3]]  # at QUICK_RATIOS, no uncapped runs: under 2 minutes


@dataclass
class RunResult:
    """One capped run: what was predicted, the cap, and what happened."""

    case: str
    nproc: int
    overrides: list[str]
    malloc: str
    predicted_bytes: int  # per rank, the plan's peak (plan_step's total)
    ratio: float | None  # predicted / the cap's per-rank share above the baseline; None: no cap
    baseline_bytes: int  # the launch's measured fixed cost (all its processes)
    cap_bytes: int | None  # the cgroup's limit: baseline + nproc * predicted / ratio
    outcome: str
    returncode: int | None
    oom_kills: int
    peak_bytes: int  # the cgroup's peak usage, all processes
    measured_bytes: int  # per rank: (peak - baseline) / nproc
    seconds: float
    detail: str = ""  # the last lines of stderr when the run did not end ok
    extra: dict[str, Any] = field(default_factory=dict)


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be created here (not root, no memory controller, read-only)."""


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, filesystem type, super options) of every cgroup filesystem mounted."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, _, tail = line.partition(" - ")
        fstype, _, options = [*tail.split(), "", "", ""][:3]
        if fstype in ("cgroup", "cgroup2"):
            out.append((head.split()[4], fstype, set(options.split(","))))
    return out


def own_memory_cgroup() -> tuple[Path, int]:
    """This process's memory cgroup directory and the cgroup version (1 or 2) that has it."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = _mounts()
    except OSError as e:
        raise CgroupUnavailable(f"cannot read this process's cgroups: {e}") from e
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid != "0" and "memory" in controllers.split(","):
            for point, fstype, options in mounts:
                if fstype == "cgroup" and "memory" in options:
                    return Path(point) / path.lstrip("/"), 1
        if hid == "0":
            for point, fstype, _ in mounts:
                d = Path(point) / path.lstrip("/")
                if fstype == "cgroup2" and "memory" in _read(d / "cgroup.controllers").split():
                    return d, 2
    raise CgroupUnavailable(
        "no memory controller in this process's cgroups (/proc/self/cgroup): the cap needs cgroup "
        "v2 with the memory controller or a cgroup v1 memory hierarchy"
    )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class MemoryCgroup:
    """A child memory cgroup of this process's own, with an optional limit; removed by ``close``."""

    def __init__(self, limit_bytes: int | None, name: str | None = None) -> None:
        parent, self.version = own_memory_cgroup()
        self.path = parent / (name or f"dtlab-fitrule-{os.getpid()}-{time.monotonic_ns()}")
        try:
            self.path.mkdir()
        except OSError as e:
            raise CgroupUnavailable(
                f"cannot create a memory cgroup under {parent} ({e.strerror}): run as root on a "
                "machine whose cgroups are writable"
            ) from e
        try:
            if self.version == 2 and not (self.path / "memory.max").exists():
                raise CgroupUnavailable(
                    f"{parent} does not hand the memory controller to its children "
                    "(cgroup.subtree_control has no memory)"
                )
            if limit_bytes is not None:
                self._limit(limit_bytes)
        except (OSError, CgroupUnavailable) as e:
            self.close()
            if isinstance(e, CgroupUnavailable):
                raise
            raise CgroupUnavailable(f"cannot set a memory limit in {self.path}: {e}") from e

    def _limit(self, limit: int) -> None:
        if self.version == 2:
            (self.path / "memory.max").write_text(str(limit))
            swap = self.path / "memory.swap.max"
            if swap.exists():  # swapping instead of running out would hide the cap
                swap.write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            memsw = self.path / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # memory + swap: the same limit, no swap
                memsw.write_text(str(limit))

    def enter(self) -> None:
        """Move the calling process into the cgroup (a child's ``preexec_fn``: before it execs)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        """The highest usage since the cgroup was created, in bytes."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        text = _read(self.path / name).strip()
        return int(text) if text.isdigit() else 0

    def oom_kills(self) -> int:
        """How many processes of the cgroup the kernel killed for its limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        m = re.search(r"^oom_kill (\d+)", _read(self.path / name), re.M)
        return int(m.group(1)) if m else 0

    def pids(self) -> list[int]:
        return [int(p) for p in _read(self.path / "cgroup.procs").split()]

    def close(self) -> None:
        """Kill what is left in the cgroup (only processes this bench started) and remove it."""
        for _ in range(50):
            left = self.pids()
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)  # the killed processes are still exiting


# What torch and Python say when an allocation fails (a cap on the address space or the data
# segment rather than a cgroup, or an allocation the kernel refused outright).
_OOM_TEXT = re.compile(
    r"MemoryError|OutOfMemoryError|out of memory|can't allocate memory|Cannot allocate memory|"
    r"std::bad_alloc",
    re.I,
)


def classify(returncode: int | None, oom_kills: int, stderr: str) -> str:
    """``ok``, ``out of memory`` or ``other error`` for a finished run.

    Out of memory: the cgroup's OOM killer killed a process of the run (the launcher then exits
    non-zero, its rank dead of SIGKILL), or the run failed saying an allocation failed. Anything else
    that did not exit 0 (a config error, a timeout: ``returncode`` None) is another error; a run that
    exited 0 while the kernel killed one of its processes is counted as out of memory, never as fitting.
    """
    if oom_kills > 0:
        return OOM
    if returncode == 0:
        return OK
    if returncode is not None and _OOM_TEXT.search(stderr):
        return OOM
    return OTHER


def predicted_bytes(case: Case) -> int:
    """The plan's per-rank peak for ``case`` (``plan_step`` on CPU: what ``dtlab plan`` reports)."""
    config = load_config(overrides=[*COMMON, *case.overrides])
    check_world(config, case.nproc)
    return plan_step(config, case.nproc, device_type="cpu").total_bytes


def _env(malloc: str) -> dict[str, str]:
    # Launch, not join: a launcher's variables would make the CLI run as a worker. The ranks inherit
    # the malloc settings from the launcher.
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("MALLOC_")}
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **MALLOC[malloc]}


def run_case(
    case: Case,
    limit_bytes: int | None,
    steps: int = 3,
    timeout: float = 300,
) -> tuple[str, int | None, int, int, float, str]:
    """``dtlab train`` of ``case`` for ``steps`` steps in a fresh memory cgroup limited to
    ``limit_bytes`` (None: no limit). Returns (outcome, returncode, oom kills, peak bytes, seconds,
    the last lines of stderr)."""
    group = MemoryCgroup(limit_bytes)
    try:
        with tempfile.TemporaryDirectory(prefix="dtlab-fitrule-") as tmp:
            cmd = [
                sys.executable, "-m", "dtlab", "train", "--nproc", str(case.nproc), "--set",
                *COMMON, *case.overrides, f"train.steps={steps}", f"run.dir={tmp}/run",
            ]  # fmt: skip
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=_env(case.malloc),
                preexec_fn=group.enter,
                start_new_session=True,  # its ranks too are killed on a timeout
            )
            returncode: int | None
            try:
                _, err = proc.communicate(timeout=timeout)
                returncode = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                _, err = proc.communicate()
                returncode, err = None, f"timed out after {timeout:.0f} s\n{err}"
            seconds = time.perf_counter() - t0
        kills, peak = group.oom_kills(), group.peak()
    finally:
        group.close()
    outcome = classify(returncode, kills, err)
    tail = "" if outcome == OK else "\n".join(err.strip().splitlines()[-5:])
    return outcome, returncode, kills, peak, seconds, tail


def baseline(case: Case, steps: int, timeout: float) -> int:
    """The fixed cost of ``case``'s launch (all its processes), measured: the peak of the same
    layout under the same malloc with a negligible model, less that model's own prediction."""
    probe = Case(
        f"baseline {case.nproc}",
        case.nproc,
        (*NEGLIGIBLE, *case.layout, f"train.global_batch_size={case.nproc}"),
        case.malloc,
    )
    outcome, rc, _, peak, _, tail = run_case(probe, None, steps, timeout)
    if outcome != OK:
        raise RuntimeError(f"the baseline run of {case.nproc} process(es) failed ({rc}): {tail}")
    return peak - case.nproc * predicted_bytes(probe)


def cap_for(predicted: int, ratio: float, base: int, nproc: int) -> int:
    """The cgroup limit that leaves each of ``nproc`` ranks ``predicted / ratio`` bytes above the
    launch's baseline ``base``."""
    return base + round(nproc * predicted / ratio)


def run_grid(
    cases: Sequence[Case],
    ratios: Sequence[float],
    steps: int = 3,
    timeout: float = 300,
    uncapped: bool = True,
    log: Any = None,
) -> list[RunResult]:
    """Every case at every ratio (first without a cap, with ``uncapped``: what the case really
    takes), the baselines measured once per layout and malloc; each run printed as it finishes."""
    bases: dict[tuple[int, tuple[str, ...], str], int] = {}
    results = []
    for case in cases:
        predicted = predicted_bytes(case)
        key = (case.nproc, case.layout, case.malloc)
        if key not in bases:
            bases[key] = baseline(case, steps, timeout)
        base = bases[key]
        for ratio in (None, *ratios) if uncapped else ratios:
            cap = None if ratio is None else cap_for(predicted, ratio, base, case.nproc)
            outcome, rc, kills, peak, seconds, tail = run_case(case, cap, steps, timeout)
            r = RunResult(
                case.name, case.nproc, list(case.overrides), case.malloc, predicted, ratio, base,
                cap, outcome, rc, kills, peak, (peak - base) // case.nproc, seconds, tail,
            )  # fmt: skip
            results.append(r)
            if log:
                print(format_row(r), file=log, flush=True)
    return results


def rule(results: Sequence[RunResult]) -> dict[str, Any]:
    """The margin the capped runs support: the highest ratio at and below which every run ended ok,
    the lowest ratio at which one ran out of memory, and the counts; per case, what it took against
    its prediction (the uncapped run, else the largest peak of a capped run that ended ok)."""
    capped = [r for r in results if r.ratio is not None]
    ratios = sorted({r.ratio for r in capped if r.ratio is not None})
    failed = {r.ratio for r in capped if r.outcome != OK}
    safe = None
    for ratio in ratios:
        if ratio in failed:
            break
        safe = ratio
    ooms = [r.ratio for r in capped if r.outcome == OOM and r.ratio is not None]
    took: dict[str, RunResult] = {}
    for r in results:
        if r.outcome == OK and r.measured_bytes > 0:
            best = took.get(r.case)
            if best is None or (best.ratio is not None and r.ratio is None):
                took[r.case] = r  # the uncapped run, if there is one, is the figure
            elif (best.ratio is None) == (
                r.ratio is None
            ) and r.measured_bytes > best.measured_bytes:
                took[r.case] = r
    cases = {
        name: {
            "predicted_bytes": r.predicted_bytes,
            "measured_bytes": r.measured_bytes,
            "measured_uncapped": r.ratio is None,
            # The ratio above which this case cannot fit: predicted over what it took.
            "break_even_ratio": r.predicted_bytes / r.measured_bytes,
        }
        for name, r in took.items()
    }
    return {
        "fits_up_to_ratio": safe,
        "lowest_oom_ratio": min(ooms) if ooms else None,
        "runs": len(capped),
        "ok": sum(r.outcome == OK for r in capped),
        "out_of_memory": len(ooms),
        "other_errors": sum(r.outcome == OTHER for r in capped),
        "uncapped_failures": sum(r.outcome != OK for r in results if r.ratio is None),
        "cases": cases,
    }


def rules(results: Sequence[RunResult]) -> dict[str, dict[str, Any]]:
    """:func:`rule` under each malloc the runs used."""
    mallocs = dict.fromkeys(r.malloc for r in results)
    return {m: rule([r for r in results if r.malloc == m]) for m in mallocs}


HEADER = (
    f"{'case':<20} {'malloc':<7} {'ratio':>5} {'predicted':>10} {'measured':>10} {'base':>9} "
    f"{'cap':>10}  outcome"
)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}M"


def format_row(r: RunResult) -> str:
    """One run as a line of the table (bytes per rank but for the baseline and the cap: the launch)."""
    measured = _mib(r.measured_bytes) if r.outcome == OK else "-"
    ratio = "none" if r.ratio is None else f"{r.ratio:.2f}"
    cap = "none" if r.cap_bytes is None else _mib(r.cap_bytes)
    line = (
        f"{r.case:<20} {r.malloc:<7} {ratio:>5} {_mib(r.predicted_bytes):>10} {measured:>10} "
        f"{_mib(r.baseline_bytes):>9} {cap:>10}  {r.outcome}"
    )
    if r.outcome == OTHER:
        line += f" ({r.detail.splitlines()[-1] if r.detail else r.returncode})"
    return line


def format_summary(malloc: str, s: dict[str, Any]) -> str:
    """The rule under one malloc, and each case's measured need against its prediction."""
    safe, low = s["fits_up_to_ratio"], s["lowest_oom_ratio"]
    lines = [f"malloc {malloc}:"]
    lines += [
        f"  {case:<20} predicted {_mib(c['predicted_bytes']):>9} per rank, took "
        f"{_mib(c['measured_bytes']):>9} ({c['measured_bytes'] / c['predicted_bytes'] - 1:+.0%}): "
        f"break-even ratio {c['break_even_ratio']:.2f}"
        + ("" if c["measured_uncapped"] else " (from a capped run)")
        for case, c in s["cases"].items()
    ]
    lines += [
        f"  {s['runs']} capped runs: {s['ok']} ok, {s['out_of_memory']} out of memory, "
        f"{s['other_errors']} other errors"
        + (f"; {s['uncapped_failures']} uncapped runs failed" if s["uncapped_failures"] else ""),
        (
            f"  fits up to predicted/cap = {safe:.2f} (no run at or below it failed)"
            if safe is not None
            else "  fits at no ratio of the grid (a run failed at the lowest)"
        )
        + "; the lowest ratio that ran out of memory: "
        + (f"{low:.2f}" if low is not None else "none in the grid"),
    ]
    return "\n".join(lines)


def _parse_ratios(text: str) -> list[float]:
    """``0.8,1.0`` as numbers; a ValueError naming what is wrong."""
    try:
        ratios = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--ratios {text!r}: expected comma-separated numbers, e.g. 0.8,1.0,1.2"
        ) from None
    if any(not r > 0 for r in ratios):
        raise ValueError(f"--ratios {text!r}: every ratio must be a positive number")
    return ratios


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m dtlab.bench.fitrule``."""
    p = argparse.ArgumentParser(
        prog="python -m dtlab.bench.fitrule",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 cases at 2 ratios under each malloc, no uncapped runs (under 2 minutes)",
    )
    p.add_argument(
        "--malloc",
        default="default,exact",
        help="comma-separated, of default (as dtlab train runs) and exact (freed memory returned at "
        "once: the tensors alone); default: both",
    )
    p.add_argument(
        "--ratios",
        help="comma-separated predicted/cap ratios for every malloc (default: "
        + "; ".join(f"{m} {','.join(map(str, r))}" for m, r in RATIOS.items())
        + ")",
    )
    p.add_argument(
        "--steps", type=positive_int, default=3, help="optimizer steps per run (default 3)"
    )
    p.add_argument(
        "--timeout", type=positive_float, default=300, help="seconds per run (default 300)"
    )
    p.add_argument("--json", type=Path, help="write every run and the rule to this file")
    return p


def _checked(
    p: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[str], list[float] | None]:
    """The mallocs and the ratios given (None: each malloc's own), or the parser's error (exit 2)
    naming the bad value."""
    mallocs = [m.strip() for m in args.malloc.split(",") if m.strip()]
    if not mallocs or any(m not in MALLOC for m in mallocs):
        p.error(f"--malloc {args.malloc!r}: expected a comma-separated list of {', '.join(MALLOC)}")
    try:
        given = _parse_ratios(args.ratios) if args.ratios else None
    except ValueError as e:
        p.error(str(e))
    return mallocs, given


def _can_run(cases: Sequence[Case]) -> bool:
    """Whether every case is valid and a memory cgroup can be made, before anything runs; says
    why not on stderr."""
    try:
        for case in cases:
            predicted_bytes(case)
        MemoryCgroup(None).close()
    except (ConfigError, CgroupUnavailable) as e:
        print(f"dtlab.bench.fitrule: {e}", file=sys.stderr)
        return False
    return True


def _run_mallocs(
    cases: Sequence[Case], mallocs: list[str], given: list[float] | None, args: argparse.Namespace
) -> list[RunResult]:
    """The grid under each malloc, at the ratios given or that malloc's own, each run printed."""
    results: list[RunResult] = []
    for malloc in mallocs:
        ratios = given or (QUICK_RATIOS if args.quick else RATIOS)[malloc]
        with_malloc = [replace(c, malloc=malloc) for c in cases]
        results += run_grid(
            with_malloc, ratios, args.steps, args.timeout, not args.quick, log=sys.stdout
        )
    return results


def _report(results: list[RunResult], t0: float, out: Path | None) -> None:
    """The rule under each malloc, printed with the seconds since ``t0``, and with every run
    written to ``out`` (--json)."""
    summary = rules(results)
    print()
    for malloc, s in summary.items():
        print(format_summary(malloc, s))
    print(f"({len(results)} runs and the baselines in {time.perf_counter() - t0:.0f} s)")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"rule": summary, "runs": [asdict(r) for r in results]}, indent=1) + "\n"
        )
        print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    mallocs, given = _checked(p, args)
    if args.json is not None:
        output_file(args.json, "--json")
    cases = QUICK_GRID if args.quick else GRID
    # A kill stops the bench as Ctrl-C does: the runs in flight and their cgroups go with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not _can_run(cases):
        return 1
    print(
        f"{len(cases)} cases x malloc {', '.join(mallocs)}, {args.steps} steps each; bytes per rank "
        "but base and cap (the whole launch); ratio = predicted / (cap - base) per rank\n"
    )
    print(HEADER, flush=True)
    t0 = time.perf_counter()
    results = _run_mallocs(cases, mallocs, given, args)
    _report(results, t0, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
