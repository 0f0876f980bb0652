"""A new user's first hour: checks before anything starts, messages that point the right way, warnings
for settings that are allowed but probably not meant, no leftovers, and a terminal that stays readable."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from conftest import FAST, cli_env, read_metrics, run_cli
from dtlab.config import ConfigError, check_batch_split, check_world, config_warnings, load_config
from dtlab.train.schedules import lr_at

ROOT = Path(__file__).resolve().parents[1]


# --- 1: checks that depend on the process count, once, before any process starts -----------------


def test_a_batch_that_does_not_split_is_refused_once_before_any_worker_starts(
    tmp_path: Path,
) -> None:
    proc = run_cli("train", str(ROOT / "configs" / "fsdp.yaml"), "--nproc", "3", cwd=tmp_path)
    want = (
        "error: train.global_batch_size = 16 samples cannot be split over 3 ranks: use 1, 2, 4 or 8 "
        "processes, or train.global_batch_size 15 or 18"
    )
    assert proc.returncode == 2, proc.stderr
    # Said once (three workers would each say it), and nothing was started or written.
    assert proc.stderr.strip() == want, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_single_strategy_with_several_processes_says_what_would_work(tmp_path: Path) -> None:
    proc = run_cli("train", "--nproc", "2", "--set", *FAST, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: parallel.strategy = 'single' runs one process, but 2 were asked for; use "
        "--set parallel.strategy=ddp (or fsdp, hsdp) for several, or --nproc 1"
    ), proc.stderr
    assert not (tmp_path / "runs").exists()


def test_plan_says_the_batch_does_not_split_instead_of_advising_memory_savings() -> None:
    proc = run_cli("plan", str(ROOT / "configs" / "fsdp.yaml"), "--nproc", "3")
    assert proc.returncode == 2
    assert "cannot be split over 3 ranks: use 1, 2, 4 or 8 processes" in proc.stderr, proc.stderr
    assert "activation checkpointing" not in proc.stderr + proc.stdout


def test_the_split_check_names_what_would_work_with_micro_batches() -> None:
    config = load_config(
        overrides=[
            "parallel.strategy=ddp",
            "train.global_batch_size=16",
            "train.micro_batch_size=4",
        ]
    )
    assert check_batch_split(config, 2) == 2  # 16 = 4 x 2 ranks x 2 accumulation steps
    with pytest.raises(ConfigError) as exc:
        check_world(config, 3)
    # No micro-batch size splits 16 over 3 ranks, so none is offered.
    assert str(exc.value) == (
        "train.global_batch_size = 16 samples cannot be split into micro-batches of "
        "train.micro_batch_size = 4 on 3 ranks (16 is not a multiple of 4 x 3): use 1, 2 or 4 "
        "processes, or train.global_batch_size 12 or 24"
    )
    with pytest.raises(ConfigError) as exc:
        check_world(
            load_config(
                overrides=[
                    "parallel.strategy=ddp",
                    "train.global_batch_size=24",
                    "train.micro_batch_size=4",
                ]
            ),
            4,
        )
    assert str(exc.value).endswith(
        "use 1, 2, 3 or 6 processes, or train.global_batch_size 16 or 32, "
        "or train.micro_batch_size 2, 3 or 6"
    ), str(exc.value)
    # Without micro_batch_size every rank takes its whole share at once: no accumulation.
    assert check_batch_split(load_config(overrides=["train.global_batch_size=16"]), 4) == 1


# --- 3: warnings for settings that are allowed but probably not meant -----------------------------


def test_config_warnings_name_the_setting_and_its_effect() -> None:
    assert config_warnings(load_config(overrides=[*FAST, "train.steps=10"])) == []
    warm = config_warnings(load_config(overrides=[*FAST, "train.steps=3", "train.warmup_steps=5"]))
    assert warm == [
        "train.warmup_steps = 5 > train.steps = 3: the whole run is warm-up, and the learning rate "
        "never reaches train.lr = 0.003 (the last step's is 0.0018)"
    ]
    # Warm-up step k (1-based) trains at train.lr x k / warmup_steps: as many warm-up steps as steps
    # reach train.lr on the last step, which is no reason to warn.
    reached = load_config(overrides=[*FAST, "train.steps=20", "train.warmup_steps=20"])
    assert config_warnings(reached) == []
    assert lr_at(reached.train.steps - 1, reached.train) == reached.train.lr
    paths = config_warnings(load_config(overrides=[*FAST, "data.paths=[a.txt]"]))
    assert paths == [
        "data.paths is set but data.source = 'synthetic': the paths are not read "
        "(data.source=files trains on them)"
    ]


@pytest.mark.parametrize(
    ("set_", "switch_on", "said"),
    [
        ("parallel.diloco.eager=true", "parallel.diloco.inner_steps=4",
         "parallel.diloco.eager is set but parallel.diloco.inner_steps = 0: DiLoCo is off"),
        ("parallel.compression_options.rank=8", "parallel.compression=powersgd",
         "parallel.compression_options.rank is set but parallel.compression = 'none'"),
        ("parallel.fault_tolerance.timeout_s=3", "parallel.fault_tolerance.enabled=true",
         "parallel.fault_tolerance.timeout_s is set but parallel.fault_tolerance.enabled = false"),
        ("train.float8.recipe=rowwise", "train.float8.enabled=true",
         "train.float8.recipe is set but train.float8.enabled = false"),
        ("parallel.cp_method=alltoall", "parallel.cp=2",
         "parallel.cp_method = 'alltoall' is set but parallel.cp = 1"),
    ],
)  # fmt: skip
def test_a_key_of_a_feature_that_is_off_is_said_to_be_unused(
    set_: str, switch_on: str, said: str
) -> None:
    (warning,) = config_warnings(load_config(overrides=[*FAST, set_]))
    assert warning.startswith(said), warning
    # The feature on, the key is used: nothing to say of it.
    on = [*FAST, set_, switch_on, "parallel.strategy=ddp"]
    if switch_on == "train.float8.enabled=true":
        on.append("train.precision=bf16")
    assert not [w for w in config_warnings(load_config(overrides=on)) if set_.split("=")[0] in w]


def test_a_run_directorys_config_warns_of_nothing_the_user_did_not_set(tmp_path: Path) -> None:
    # config.yaml in a run directory gives every key, most at their defaults: a dense model's
    # model.moe keys, DiLoCo's, DeMo's, float8's are there but were not set by anyone.
    written = load_config(overrides=[*FAST, "train.steps=10"])
    (tmp_path / "config.yaml").write_text(written.to_yaml())
    assert config_warnings(load_config(tmp_path)) == []
    # A key given its default value changes nothing whether its feature is on or off.
    assert config_warnings(load_config(overrides=[*FAST, "parallel.diloco.eager=false"])) == []
    # What the user did set, outside its feature, is still said on reading it back.
    unused = load_config(overrides=[*FAST, "train.steps=10", "parallel.diloco.fragments=2"])
    (tmp_path / "config.yaml").write_text(unused.to_yaml())
    (warning,) = config_warnings(load_config(tmp_path))
    assert warning.startswith("parallel.diloco.fragments is set but"), warning


# --- 5, 6, 12: messages, leftovers, and what the run will see ------------------------------------


def test_an_unknown_key_from_set_is_blamed_on_set_not_the_file() -> None:
    proc = run_cli("train", str(ROOT / "configs" / "debug.yaml"), "--set", "train.stpes=3")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --set 'train.stpes=3': "), proc.stderr
    assert "debug.yaml" not in proc.stderr, proc.stderr
    assert "unknown key 'train.stpes' (did you mean train.steps?)" in proc.stderr, proc.stderr
    # A section that does not exist, introduced by --set, is blamed on that --set too.
    section = run_cli("config", "--set", "trian.steps=3")
    assert section.stderr.startswith(
        "error: --set 'trian.steps=3': unknown key 'trian' (did you mean train?)"
    ), section.stderr


def test_a_set_value_that_reads_as_a_mapping_says_how_to_quote_it() -> None:
    proc = run_cli("config", "--set", "run.name=my run: 1/2")
    assert proc.returncode == 2
    assert "quote it: --set 'run.name=\"my run: 1/2\"'" in proc.stderr, proc.stderr
    quoted = run_cli("config", "--set", 'run.name="my run: 1/2"')
    # Quoted, it is the string it was meant to be (and a '/' in a run name is then refused plainly).
    assert "'my run: 1/2'" in quoted.stderr and "contains '/'" in quoted.stderr, quoted.stderr


def test_a_directory_without_a_config_lists_the_yaml_files_in_it() -> None:
    proc = run_cli("train", str(ROOT / "configs"))
    assert proc.returncode == 2
    assert "is a directory without a config.yaml" in proc.stderr, proc.stderr
    assert "does not exist" not in proc.stderr
    assert f"{ROOT / 'configs' / 'ddp.yaml'}" in proc.stderr, proc.stderr


def test_config_keys_prints_yaml_values() -> None:
    proc = run_cli("config", "--keys")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines() if line.strip()}
    assert rows["model.preset"] == "tiny"  # not 'tiny'
    assert rows["train.micro_batch_size"] == "null"  # not None
    assert rows["run.plot"] in ("true", "false")  # not True/False
    python_only = {"None", "True", "False"}
    assert not [v for v in rows.values() if v in python_only or v.startswith("'")], rows


def test_a_run_that_fails_before_writing_leaves_no_run_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-corpus.txt"
    bad = ["data.source=files", f"data.paths=[{missing}]"]
    # A default run directory (runs/bad-data-<timestamp>) and one given as run.dir.
    for where in (["run.name=bad-data"], [f"run.dir={tmp_path / 'explicit'}"]):
        proc = run_cli("train", "--set", *FAST, *bad, *where, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert str(missing) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    runs = tmp_path / "runs"
    assert not (runs.exists() and list(runs.iterdir())), list(runs.iterdir())
    assert not (tmp_path / "explicit").exists()


def test_the_run_says_what_it_will_see_and_what_it_warns_about(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"abcdefgh" * 200)  # 1,600 byte tokens
    run = tmp_path / "run"
    proc = run_cli(
        "train", "--set", *FAST, "data.source=files", f"data.paths=[{corpus}]", "data.seq_len=32",
        "train.steps=3", "train.warmup_steps=4", f"run.dir={run}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = next(s for s in proc.stderr.splitlines() if " data: " in s)
    m = re.search(
        r"data: .*?, ([\d,]+) tokens = ([\d,]+) samples of 32 tokens; this run trains on ([\d,]+) "
        r"samples = ([\d.]+) epochs",
        line,
    )
    assert m, line
    tokens, samples, trained, epochs = (float(g.replace(",", "")) for g in m.groups())
    assert tokens >= 1600 and 0 < samples <= tokens / 32, line
    assert trained == 3 * 8 and epochs == pytest.approx(trained / samples, rel=1e-2), line
    assert "the whole run is warm-up" in proc.stderr, proc.stderr
    assert len(read_metrics(run)) == 3


# --- 2: the progress bar and log lines on a terminal ---------------------------------------------


def _screen(stream: str) -> list[str]:
    """What a terminal shows after ``stream``: carriage returns move to column 0 and overwrite,
    newlines start a line, escape sequences (colours, cursor moves within the line) are dropped."""
    stream = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream)
    lines: list[list[str]] = [[]]
    col = 0
    for ch in stream:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append([])
            col = 0
        else:
            line = lines[-1]
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    return ["".join(chars).rstrip() for chars in lines if "".join(chars).strip()]


def test_log_lines_and_the_progress_bar_interleave_cleanly_on_a_terminal(tmp_path: Path) -> None:
    run = tmp_path / "run"
    steps = 6
    args = [
        *FAST,
        f"train.steps={steps}",
        "checkpoint.every=2",
        f"run.dir={run}",
        "run.progress=auto",
    ]
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtlab", "train", "--set", *args],
        stdin=subprocess.DEVNULL, stdout=sub, stderr=sub, env=cli_env({"TERM": "xterm"}),
    )  # fmt: skip
    os.close(sub)
    chunks = []
    while True:
        ready, _, _ = select.select([main], [], [], 300)
        assert ready, "no output for 300 s"
        try:
            data = os.read(main, 65536)
        except OSError:  # the other end is closed: the run is over
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")
    screen = _screen(b"".join(chunks).decode(errors="replace"))
    text = "\n".join(screen)

    log_line = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")
    bar = re.compile(r"\d+%\|.*\| \d+/\d+ \[")
    bars = [s for s in screen if bar.search(s)]
    logs = [s for s in screen if log_line.match(s)]
    assert bars and any("checkpoint step 2 saved" in s for s in logs), text
    # No log text glued to a bar, and every timestamp starts a log line (none split or mid-line).
    for s in screen:
        assert not (bar.search(s) and re.search(r"\d\d:\d\d:\d\d (INFO|WARNING)", s)), (
            f"{s!r}\n{text}"
        )
        if re.search(r"\d\d:\d\d:\d", s) and not bar.search(s):
            assert log_line.match(s), f"a log line that does not start its line: {s!r}\n{text}"
    # The bar ends once, at 100%, with the last step's loss.
    final = [s for s in bars if "100%" in s]
    last_loss = read_metrics(run)[-1]["loss"]
    assert len(final) == 1, text
    assert f"loss={last_loss:.4f}" in final[0], f"{final[0]!r} vs {last_loss}"
