"""Shared helpers: run the real CLI in subprocesses and read what a run wrote."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from dtlab.runtime import forkserver

# Trained tokenizers and streaming token files go to a cache of this test session's own (subprocesses
# inherit it): no test reads what another session left, and nothing is written to the home directory.
os.environ["DTLAB_CACHE"] = tempfile.mkdtemp(prefix="dtlab-test-cache-")


def _start_forkserver() -> str:
    """Start the fork server (:mod:`dtlab.runtime.forkserver`) and return the interpreter the tests
    start processes with: its shim, or this interpreter when DTLAB_TEST_FORK=0 (or when it did not
    start)."""
    if os.environ.get("DTLAB_TEST_FORK", "1") == "0" or not hasattr(os, "fork"):
        return sys.executable
    running = os.environ.get(forkserver.SOCKET_ENV), os.environ.get("DTLAB_TEST_PYTHON")
    if running[0] and running[1] and Path(running[0]).exists():  # a test's own pytest: share it
        return running[1]
    server = forkserver.start()
    atexit.register(server.stop)
    # Its imports take a few seconds; every test after gets the same.
    if not server.wait_ready(timeout_s=120):
        print("fork server did not start: every process starts fresh", file=sys.stderr)
        return sys.executable
    os.environ[forkserver.SOCKET_ENV] = str(server.socket)
    os.environ["DTLAB_TEST_PYTHON"] = str(server.shim)
    return str(server.shim)


# The interpreter the tests start Python processes with (python -m dtlab ..., the test workers).
PYTHON = _start_forkserver()

# A run of the debug model on synthetic data: well under a second per step.
FAST = [
    "model.preset=debug",
    "data.source=synthetic",
    "data.seq_len=64",
    "train.global_batch_size=8",
    "train.warmup_steps=2",
    "train.lr=3e-3",
    "run.log_every=1",
    "run.tensorboard=false",
    "run.plot=false",
    "run.progress=none",
]


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without a launcher's variables (so the CLI launches), plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "TORCHELASTIC_RUN_ID",
            "DTLAB_FAULTS",
            "MLX_RANK",
            "MLX_HOSTFILE",
            "DTLAB_MLX_STATUS_DIR",
        )
    }
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **(extra or {})}


def run_cli(
    *args: str, cwd: Path | None = None, timeout: int = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m dtlab ARGS`` in a fresh process; returns the completed process (never raises on exit code)."""
    env = cli_env(env)
    return subprocess.run(
        [PYTHON, "-m", "dtlab", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def train_run(
    run_dir: Path, *overrides: str, nproc: int = 1, steps: int = 12
) -> list[dict[str, Any]]:
    """Train with FAST + overrides on ``nproc`` processes and return the metrics it wrote."""
    args = [
        "train",
        "--nproc",
        str(nproc),
        "--set",
        *FAST,
        f"train.steps={steps}",
        f"run.dir={run_dir}",
        *overrides,
    ]
    proc = run_cli(*args)
    assert proc.returncode == 0, (
        f"dtlab {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return read_metrics(run_dir)


def run_worker(name: str, nproc: int, *args: str, timeout: int = 300) -> None:
    """Run ``tests/workers/<name>`` under torchrun on ``nproc`` local gloo processes; fail on a non-zero exit."""
    worker = Path(__file__).parent / "workers" / name
    proc = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(worker), *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


class Watched:
    """``python -m dtlab ARGS`` started as a user starts it (through :data:`PYTHON`), its stderr
    collected line by line while it runs; ``env`` is added to :func:`cli_env`'s."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        import threading

        self.proc = subprocess.Popen(
            [PYTHON, "-m", "dtlab", *args],
            env=cli_env(env), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        stream = self.proc.stderr
        assert stream is not None
        self.reader = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self.reader.start()

    def _wait(self, done: Any, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.err}"
            assert time.monotonic() < deadline, f"{what} in {timeout} s:\n{self.err}"
            time.sleep(0.01)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        """Until a line of stderr holds ``text``."""
        self._wait(lambda: any(text in line for line in list(self.lines)), f"no {text!r}", timeout)

    def wait_for_file(self, path: Path, timeout: float = 120) -> None:
        """Until ``path`` exists and is not empty."""
        self._wait(lambda: path.is_file() and path.read_bytes(), f"no {path}", timeout)

    def wait_for_step(self, run: Path, step: int, timeout: float = 300) -> None:
        """Until ``run``'s metrics.jsonl has logged ``step``."""
        path = run / "metrics.jsonl"
        self._wait(
            lambda: path.exists() and f'"step": {step},' in path.read_text(),
            f"no step {step}",
            timeout,
        )

    def finish(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout)
        self.reader.join(10)
        return code

    @property
    def err(self) -> str:
        return "".join(self.lines)


def real_pid(pid: int) -> int:
    """The process that does the work of process ``pid``: the fork server's child when ``pid`` is a
    shim (:mod:`dtlab.runtime.forkserver`), else ``pid`` itself. A shim has no children of its own."""
    return forkserver.real_pid(pid)


def kill_job(proc: subprocess.Popen[Any], run_dir: Path | None = None) -> None:
    """SIGKILL a launcher started with ``start_new_session`` and every process under it, as a machine
    going down would: torch starts each worker in a session of its own, out of the launcher's process
    group. Returns once they are gone (with ``run_dir``: once the kernel released its lock, which the
    last of them, a fork server's child, may hold a moment longer than its shim)."""
    import fcntl
    import signal

    tree, parents = {proc.pid}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    grew = True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= below
        grew = bool(below)
    for pid in sorted(tree, key=lambda p: p != proc.pid):  # the launcher first: it spawns no more
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    if run_dir is None or not (run_dir / ".lock").exists():
        return
    fd = os.open(run_dir / ".lock", os.O_RDONLY)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except OSError:
                assert time.monotonic() < deadline, f"{run_dir} is still locked 30 s after the kill"
                time.sleep(0.01)
    finally:
        os.close(fd)


def checkpoint_tensors(path: Path) -> dict[str, Any]:
    """Every tensor of a committed checkpoint (parameters, optimizer and compression state), unsharded."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dtlab.checkpoint.manifest import verify_checkpoint

    verify_checkpoint(path)
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    tensors = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(tensors, checkpoint_id=str(path), no_dist=True)
    return tensors


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def planned_state(plan: Any) -> dict[str, int]:
    """A plan's state between steps by the check's component names (its FSDP gathered units are
    the check's buffers, as the wrappers hold them)."""
    return {
        "params": plan.params_bytes,
        "grads": plan.grads_bytes,
        "optimizer": plan.optimizer_bytes,
        "buffers": plan.gathered_bytes + plan.buffers_bytes,
    }


def assert_state_is_planned(config: Any, nproc: int, rank: int, components: dict[str, int]) -> None:
    """A checked rank's state (``components``, the check's measurement) is the plan's for that rank
    to the byte: its parameters (some), gradients and optimizer state (its pipeline stage's)."""
    from dtlab.analysis.model import plan_step
    from dtlab.dims import ParallelDims

    dims = ParallelDims.from_config(config, nproc)
    at = dims.coordinates(rank)
    plan = plan_step(config, nproc, pp_rank=at["pp"] if dims.pp_enabled else None)
    assert components["params"] == plan.params_bytes > 0, (components, plan.params_bytes)
    assert components["grads"] == plan.grads_bytes, (components, plan.grads_bytes)
    assert components["optimizer"] == plan.optimizer_bytes, (components, plan.optimizer_bytes)


def assert_groups_match(
    ft_dir: Path, ref: list[dict[str, Any]], steps: int, norm_rel: float
) -> None:
    """Every fault-tolerant replica group's run in ``ft_dir`` (``replica-0``, ``replica-1``) took
    steps 1 to ``steps`` with both groups, with the reference's losses (to 1e-6) and gradient norms
    (to ``norm_rel``), relative: the same samples and the same average, to float rounding."""
    for replica in (0, 1):
        run = read_metrics(ft_dir / f"replica-{replica}")
        assert [m["step"] for m in run] == list(range(1, steps + 1))
        for m, r in zip(run, ref, strict=True):
            assert m["loss"] == pytest.approx(r["loss"], rel=1e-6, abs=0), m["step"]
            assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=norm_rel, abs=0), m["step"]
            assert m["replicas"] == 2 and "samples_lost" not in m


Metrics = list[dict[str, Any]]


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``single_reference(*overrides, steps=12)``: the single-process run of FAST + ``overrides``,
    trained once per test session whichever tests ask for it (keyed by the overrides and steps).
    Each caller gets its own copy of the metrics."""
    import copy

    runs: dict[tuple[tuple[str, ...], int], Metrics] = {}

    def get(*overrides: str, steps: int = 12) -> Metrics:
        key = (overrides, steps)
        if key not in runs:
            runs[key] = train_run(tmp_path_factory.mktemp("single"), *overrides, steps=steps)
        return copy.deepcopy(runs[key])

    return get


@pytest.fixture(scope="session")
def reference_run(single_reference: Any) -> Metrics:
    """The single-process reference every strategy is compared with."""
    return single_reference()


# Validation on: 10% held out (on synthetic data, a seed stream of its own), evaluated every 4 steps.
EVAL = ["data.val_fraction=0.1", "eval.every=4", "eval.batches=2"]


@pytest.fixture(scope="session")
def eval_reference(single_reference: Any) -> Metrics:
    """The reference run, evaluating: the validation loss every layout and engine is compared with."""
    return single_reference(*EVAL)


CLIP = (
    0.1  # below every step's gradient norm in the reference run: clipping is active on every step
)


@pytest.fixture(scope="session")
def clipped_reference(single_reference: Any) -> Metrics:
    """One process with a clip below every step's gradient norm: clipping is active on every step."""
    run = single_reference(f"train.grad_clip={CLIP}")
    assert all(m["grad_norm"] > CLIP for m in run), [m["grad_norm"] for m in run]
    return run


# float32 reduction-order noise over 12 steps stays far below this.
TOL = 1e-4


def assert_same_training(run: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    assert [m["step"] for m in run] == [m["step"] for m in ref]
    for m, r in zip(run, ref, strict=True):
        assert m["loss"] == pytest.approx(r["loss"], abs=TOL), (
            f"step {m['step']}: loss {m['loss']} vs reference {r['loss']}"
        )
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-3, abs=TOL), (
            f"step {m['step']}: grad_norm"
        )
        assert m["lr"] == pytest.approx(r["lr"], rel=1e-9)
        assert m["tokens"] == r["tokens"]
    # And it really trains: a clear fall over 12 steps on the learnable synthetic chains.
    assert run[-1]["loss"] < run[0]["loss"] - 0.3


MODEL_PARALLEL_TOL = 1e-5  # tensor and pipeline layouts: the loss of every step within this


def assert_close_losses(run: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    """:func:`assert_same_training`, and the loss within MODEL_PARALLEL_TOL on every step."""
    assert_same_training(run, ref)
    worst = max(abs(m["loss"] - r["loss"]) for m, r in zip(run, ref, strict=True))
    assert worst <= MODEL_PARALLEL_TOL, worst


def verify_layouts(
    out: Path, layouts: str, *overrides: str, checks: tuple[str, ...] = (), steps: int = 4
) -> dict[str, Any]:
    """``dtlab verify --layouts LAYOUTS`` of FAST + ``overrides`` into ``out`` (clipped at CLIP, 2
    micro-batches for the pipeline; ``checks``: ``--checks`` arguments): every row within loss 1e-5
    and parameters 1e-4 of the first layout, clipping active on every reference step. The result,
    with the reference's metrics under ``reference``."""
    proc = run_cli(
        "verify", "--layouts", layouts, "--steps", str(steps), "--out", str(out), *checks,
        "--set", *FAST, "train.micro_batch_size=2", f"train.grad_clip={CLIP}", *overrides,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / "verify.json").read_text())
    assert result["ok"] and [r["layout"] for r in result["rows"]] == layouts.split(",")[1:]
    for row in result["rows"]:
        assert row["max_loss_diff"] <= 1e-5 and row["max_param_diff"] <= 1e-4, row
    reference = read_metrics(next(out.glob("0-*")))
    assert all(m["grad_norm"] > CLIP for m in reference), [m["grad_norm"] for m in reference]
    result["reference"] = reference
    return result


def close(predicted: int, checked: int, within: float = 0.03) -> bool:
    """Within ``within`` of the checked figure, or a few bytes (scalars); a component held but not
    predicted, or predicted but not held, never is."""
    if (predicted == 0) != (checked == 0):
        return False
    return abs(predicted - checked) <= max(within * checked, 64)


# --- make test-fast: a few quick tests of every test module, for the edit loop ---------------------
# --- make test: all but the tests in slow.txt (marked slow), which make test-all adds ---------------
FAST_LIST = Path(__file__).parent / "fast.txt"
SLOW_LIST = Path(__file__).parent / "slow.txt"


def stale_ids(listed: set[str], collected: list[str]) -> list[str]:
    """The ids of ``listed`` whose module was collected but which name none of its ``collected``
    tests."""
    have = set(collected)
    modules = {nodeid.split("::")[0] for nodeid in collected}
    return sorted(i for i in listed if i.split("::")[0] in modules and i not in have)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="only the tests in tests/fast.txt (written by tests/pick_fast.py from measured "
        "durations), and the first test of any test module it does not name",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The longest tests (tests/pick_fast.py chose them from measured durations) are marked slow:
    # make test and CI leave them out (-m "not slow"), make test-all runs them.
    slow = {line.strip() for line in SLOW_LIST.read_text().splitlines() if line.strip()}
    lists = [(SLOW_LIST, slow, "leave the slow tier unmarked")]
    if config.getoption("--fast"):
        fast = {line.strip() for line in FAST_LIST.read_text().splitlines() if line.strip()}
        lists.append((FAST_LIST, fast, "drop it from make test-fast"))
    # Where whole modules were collected (no test named on the command line), all their ids are here.
    whole = not any("::" in arg for arg in config.args)
    for path, listed, what in lists if whole else []:
        stale = stale_ids(listed, [item.nodeid for item in items])
        if stale:
            raise pytest.UsageError(
                f"tests/{path.name} names tests that its collected modules no longer have (a "
                f"renamed test or parameter, which would {what}): {', '.join(stale)}; rename "
                "them there (or rerun tests/pick_fast.py)"
            )
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    if not config.getoption("--fast"):
        return
    chosen = {line.strip() for line in FAST_LIST.read_text().splitlines() if line.strip()}
    named = {nodeid.split("::")[0] for nodeid in chosen}
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    seen: set[str] = set()
    for item in items:
        module = item.nodeid.split("::")[0]
        first_of_unnamed = module not in named and module not in seen
        seen.add(module)
        (keep if item.nodeid in chosen or first_of_unnamed else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
