"""The benchmark scripts beside ``dtlab bench`` (``python -m dtlab.bench.*``): each runs end to end at the
smallest size and prints its figures, and a mistake in ``--set`` is one line, never a traceback.

Structure only: no figure's size is asserted (speed belongs to the benchmarks, not to tests).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import FAST, PYTHON, cli_env


def run_script(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", f"dtlab.bench.{module}", *args],
        capture_output=True, text=True, env=cli_env(), timeout=300,
    )  # fmt: skip


SMALLEST = {
    "checkpoint": (
        ["--preset", "debug", "--repeats", "1"],
        r"disk write, 8 files \(fsync\)\s+[\d,]+ MiB/s .*: the limit at the writer's parallelism "
        r"\(1 file: [\d,]+ MiB/s .*\)\n(.*\n)"
        r"sync save\s+[\d.]+ s \[[\d.-]+\] = [\d,]+ MiB/s; \d+% \[\d+%-\d+%\] of the disk's "
        r"8-file write beside it, \d+% best against best\n"
        r"  phases: prepare [\d.]+ s, write [\d.]+ s, manifest [\d.]+ s, rename [\d.]+ s, "
        r"retention \(background\) [\d.]+ s\n"
        r"training time a save costs \(blocked \+ slower steps; .*\):\n"
        r"  sync +-?[\d.]+ s \[.*\]: blocked [\d.]+ s, steps slower by -?[\d.]+ s over .*\n"
        r"  async +-?[\d.]+ s .*\n  auto +-?[\d.]+ s .*\n  auto picks (sync|async) here .*\n"
        r"  the first async save .*\n"
        r"load \(verify \+ load\)\s+[\d.]+ s cold.*\n"
        r"load resharded \(verify \+ load\)\s+[\d.]+ s cold .* \(written by 2 FSDP processes",
    ),
    "codec": (
        [
            "--methods",
            "streaming-int1,sparseloco",
            "--values",
            "8192",
            "--repeats",
            "2",
            "--replicas",
            "2,3",
        ],
        r"\| streaming-int1 \| 1\.008 \| 1\.0 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|\n"
        r"\| sparseloco \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|",
    ),
    "experts": (
        ["--presets", "debug-moe", "--experts", "0,8", "--tokens", "64", "--repeats", "2"],
        r"debug-moe\s+4\s+[\d.]+\s+[\d.]+\s+[\d.]+x\ndebug-moe\s+8\s+[\d.]+\s+[\d.]+\s+[\d.]+x",
    ),
    "ledger": (
        ["--preset", "debug", "--blocks", "2", "--block-steps", "2", "--set", *FAST[1:]],
        r"step wall time: median [\d.]+ ms with, [\d.]+ ms without",
    ),
    "optimizer": (
        ["--presets", "debug", "--threads", "1", "--steps", "3"],
        r"debug\s+1(\s+[\d.]+){3}\s+[\d.]+x\s+[\d.]+x",
    ),
    "memory": (
        ["--preset", "debug", "--seq-len", "16", "--batch", "2"],
        r"\| bf16 \| selective \| [\d.]+ \| [\d.]+ \|",
    ),
}


@pytest.mark.parametrize("module", sorted(SMALLEST))
def test_benchmark_script_runs_and_prints_its_figures(module: str, tmp_path: Path) -> None:
    args, figure = SMALLEST[module]
    if module == "checkpoint":  # a directory that does not exist yet is created
        args = [*args, "--dir", str(tmp_path / "not" / "yet")]
    proc = run_script(module, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(figure, proc.stdout), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("module", ["checkpoint", "ledger", "memory", "overhead"])
def test_a_bad_override_is_one_line_before_anything_runs(module: str) -> None:
    proc = run_script(module, "--set", "train.lr=oops")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: --set 'train.lr=oops': train.lr = 'oops'"), proc.stderr
    # Said once, by the script, before it launches ranks or prints a table.
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout


INT_RANGE = "expected an integer from {} to 2147483647, got {}"
BAD_COUNTS = [
    ("calibrate", ["--warmup", "-1"], INT_RANGE.format(0, -1)),
    ("calibrate", ["--rounds", "0"], INT_RANGE.format(1, 0)),
    ("chaos", ["--replicas", "1"], INT_RANGE.format(2, 1)),  # a storm needs a survivor
    ("chaos", ["--every", "-1"], "argument --every: expected a finite number above 0, got '-1'"),
    ("chaos", ["--storm-s", "nan"], "expected a finite number above 0, got 'nan'"),
    ("chaos", ["--max-restarts", "-1"], INT_RANGE.format(0, -1)),
    ("chaos", ["--diloco", "--factor", "0"], "argument --factor: expected a finite number above 0"),
    ("chaos", ["--diloco", "--replicas", "1"], INT_RANGE.format(2, 1)),
    ("checkpoint", ["--repeats", "0"], INT_RANGE.format(1, 0)),
    ("codec", ["--repeats", "0"], INT_RANGE.format(1, 0)),
    ("codec", ["--methods", "ddp,int9"], "--methods 'ddp,int9': ddp, int9 not a compressed"),
    ("codec", ["--device", "tpu"], "--device 'tpu': allowed: cpu or cuda"),
    ("cp_comm", ["--warmup", "-1"], INT_RANGE.format(0, -1)),
    ("cp_comm", ["--cp", "2,x"], "--cp '2,x': allowed: comma-separated integers, each 2 or more"),
    ("cp_memory", ["--seq", "0"], "--seq '0': allowed: comma-separated integers, each 1 or more"),
    ("experts", ["--experts", "x"], "--experts 'x': allowed: comma-separated integers, each 0"),
    ("experts", ["--presets", "debug"], "--presets debug: not a mixture of experts"),
    ("fitrule", ["--timeout", "0"], "argument --timeout: expected a finite number above 0"),
    ("handloop", ["--nproc", "0"], INT_RANGE.format(1, 0)),
    ("ledger", ["--blocks", "1"], INT_RANGE.format(2, 1)),  # one block has none to compare with
    ("ledger", ["--block-steps", "0"], INT_RANGE.format(1, 0)),
    ("lowcomm", ["--seeds", "0"], INT_RANGE.format(1, 0)),
    ("lowcomm", ["--steps", "x"], "argument --steps: expected an integer from 1"),
    ("memory", ["--batch", "0"], INT_RANGE.format(1, 0)),
    ("optimizer", ["--threads", "0"], "--threads '0': allowed: comma-separated integers, each 1"),
    ("overhead", ["--repeats", "0"], INT_RANGE.format(1, 0)),
    ("overlap", ["--device-s", "-1"], "expected a finite number of 0 or more, got '-1'"),
    ("pipeline", ["--pp", "1"], INT_RANGE.format(2, 1)),
    ("pipeline", ["--microbatches", "4,,x"], "--microbatches '4,,x': allowed: comma-separated"),
    ("worker", ["--peak-flops", "inf"], "expected a finite number above 0, got 'inf'"),
]


@pytest.mark.parametrize(("module", "argv", "message"), BAD_COUNTS)
def test_a_count_out_of_range_is_one_line_before_anything_runs(
    module: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each was a traceback, a run of nothing that exited 0, or a run started on it.
    import importlib

    from dtlab.cliargs import run_command

    main = importlib.import_module(f"dtlab.bench.{module}").main
    try:
        code = run_command(lambda: main(argv))
    except SystemExit as e:  # argparse's usage error
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and message in err, err
    assert "Traceback" not in err and out == "", out


OUTPUTS = [
    (
        "calibrate",
        ["--json", "{file}/rows.json"],
        "--json '{file}/rows.json': its directory '{file}'",
    ),
    ("chaos", ["--out", "{file}"], "--out '{file}' cannot be created: File exists"),
    ("chaos", ["--diloco", "--out", "{file}"], "--out '{file}' cannot be created: File exists"),
    ("checkpoint", ["--dir", "{file}"], "--dir '{file}' cannot be created: File exists"),
    ("codec", ["--json", "{dir}"], "--json '{dir}' is a directory; allowed: a file's path"),
    ("cp_comm", ["--json", "{file}/x.json"], "--json '{file}/x.json': its directory '{file}'"),
    ("cp_memory", ["--plot", "{file}/x.png"], "--plot '{file}/x.png': its directory '{file}'"),
    ("fitrule", ["--json", "{file}/x.json"], "--json '{file}/x.json': its directory '{file}'"),
    ("lowcomm", ["--out", "{file}"], "--out '{file}' cannot be created: File exists"),
    ("lowcomm", ["--json", "{dir}"], "--json '{dir}' is a directory; allowed: a file's path"),
    ("overlap", ["--json", "{dir}"], "--json '{dir}' is a directory; allowed: a file's path"),
    ("pipeline", ["--out", "{file}"], "--out '{file}' cannot be created: File exists"),
]


@pytest.mark.parametrize(("module", "argv", "message"), OUTPUTS)
def test_an_output_that_cannot_be_written_is_one_line_before_anything_runs(
    module: str, argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A file where a directory goes: each was a FileExistsError traceback, or (calibrate's,
    # fitrule's --json) an error after the hour of measuring, its results lost.
    import importlib

    from dtlab.cliargs import run_command

    paths = {"file": str(tmp_path / "a-file"), "dir": str(tmp_path)}
    (tmp_path / "a-file").write_text("")
    main = importlib.import_module(f"dtlab.bench.{module}").main
    try:
        code = run_command(lambda: main([a.format(**paths) for a in argv]))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and message.format(**paths) in err, err
    assert "Traceback" not in err and out == "", out


def test_the_codec_bench_on_a_gpu_torch_cannot_see_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    from dtlab.bench.codec import main
    from dtlab.cliargs import run_command

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: --device cuda runs")
    code = run_command(lambda: main(["--device", "cuda"]))
    out, err = capsys.readouterr()
    assert code == 2 and "--device cuda: torch sees no CUDA GPU here; allowed: cpu" in err, err
    assert out == "", out


def test_chaos_report_only_without_a_report_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dtlab.bench import chaos

    for argv in (["--report-only"], ["--diloco", "--report-only"]):
        assert chaos.main([*argv, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --report-only: no report to rebuild in {tmp_path}"), err


def test_pipeline_bubble_is_measured_and_drawn(tmp_path: Path) -> None:
    """The pipeline benchmark times every block of one schedule and reports the bubble next to
    (p - 1) / (m + p - 1) and to the schedule's own order of work played out."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [PYTHON, "-m", "dtlab.bench.pipeline", "--preset", "debug", "--schedules", "1f1b",
         "--microbatches", "2", "--steps", "3", "--warmup", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads((out / "results.json").read_text())
    assert row["schedule"] == "1f1b" and row["predicted"] == pytest.approx(1 / 3)
    assert 0 < row["bubble"] < 1 and len(row["bubble_per_rank"]) == 2
    # The order of work as it ran, played out with F = 1, B = 2, is 1F1B's: the textbook figure.
    assert row["table"] == pytest.approx(1 / 3)
    assert 0 < row["table_at_measured"] < 1 and set(row["action_ms"]) == {"F", "B"}
    timeline = json.loads((out / "1f1b-2.json").read_text())["timeline"]
    # Rank 0 holds the first stage: 2 forwards and 2 backwards per timed step, inside the schedule.
    step = timeline[0]["steps"][-1]
    assert sorted(b["kind"] for b in step["blocks"]) == ["B", "B", "F", "F"]
    assert all(step["start"] <= b["start"] <= b["end"] <= step["end"] for b in step["blocks"])
    assert (out / "pipeline-schedules.png").stat().st_size > 10_000
