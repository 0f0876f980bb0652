"""The checkpoint interval ``dtlab launch`` gives a job: from the predicted save and step times.

The jobs are written, never submitted: these tests need no Slurm and no Kubernetes. They run the
command in this process (the same parser and checks; a 70B model is only shaped, on the meta device).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_cli
from dtlab.analysis.save_interval import (
    MAX_LOSS_S,
    MAX_SAVE_FRACTION,
    SaveInterval,
    choose_every,
    describe,
)
from dtlab.cli import main as cli_main
from dtlab.config import config_from_dict

# A 70B run on 16 nodes of 8 GPUs: a checkpoint is ~800 GiB (float32 weights and AdamW's moments).
BIG = [
    "model.preset=llama3.1-70b",
    "data.source=synthetic",
    "data.seq_len=4096",
    "train.precision=bf16",
    "parallel.strategy=fsdp",
    "train.global_batch_size=512",
    "train.micro_batch_size=1",
    "train.activation_checkpointing=full",
    "train.steps=100",  # what steps // 20 made a checkpoint every 5 steps
]
BIG_JOB = ["--nodes", "16", "--nproc-per-node", "8", "--gpus-per-node", "8"]
TINY = [
    "model.preset=tiny",
    "data.source=synthetic",
    "data.seq_len=64",
    "train.global_batch_size=8",
]
GPU1 = ["--nodes", "1", "--nproc-per-node", "1", "--gpus-per-node", "1"]
# "every 27 steps: saving costs 2.0% of training time (...), a kill without warning loses at most
# 21.9 min of work"
COST = re.compile(
    r"every (\d+) steps: saving costs ([\d.]+)% of training time .*loses at most ([\d.]+) "
    r"(min|s|ms) of work"
)


def _launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], scheduler: str, *args: str
) -> tuple[int, str]:
    """``dtlab launch SCHEDULER ARGS`` (without submitting): the job config's ``checkpoint.every``
    and what the command printed."""
    out = tmp_path / ("job.sbatch" if scheduler == "slurm" else "job.yaml")
    extra = ["--image", "dtlab:cuda"] if scheduler == "k8s" else []
    code = cli_main(["launch", scheduler, *extra, "--out", str(out), *args])
    err = capsys.readouterr().err
    assert code == 0, err
    if scheduler == "slurm":
        text = (tmp_path / "job.config.yaml").read_text()
    else:
        text = next(yaml.safe_load_all(out.read_text()))["data"]["config.yaml"]
    return config_from_dict(yaml.safe_load(text)).checkpoint.every, err


def _cost(stderr: str) -> tuple[int, float, float]:
    """(interval, % of training time saving, minutes a kill loses) as the command printed them."""
    m = COST.search(stderr)
    assert m, stderr
    scale = {"min": 1.0, "s": 1 / 60, "ms": 1 / 60000}[m[4]]
    return int(m[1]), float(m[2]), float(m[3]) * scale


@pytest.mark.parametrize("scheduler", ["slurm", "k8s"])
def test_a_70b_job_saves_as_often_as_its_save_time_allows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], scheduler: str
) -> None:
    """Not every 5 steps: a ~800 GiB checkpoint at 2 GB/s per node takes ~26 s on 16 nodes, so saving
    costs at most 2% of training time only every ~27 steps of ~49 s; and the command shows why."""
    every, err = _launch(tmp_path, capsys, scheduler, *BIG_JOB, "--set", *BIG)
    assert every >= 20, err
    assert "predicted: checkpoint 788.5 GiB (parameters and optimizer state)" in err
    assert "2 GB/s per node x 16 node(s), assumed: a parallel filesystem" in err
    assert "h100, assumed: pass --device KEY" in err
    shown, percent, loss_min = _cost(err)
    assert shown == every
    assert percent <= MAX_SAVE_FRACTION * 100 and loss_min <= MAX_LOSS_S / 60
    # The smallest such interval: one step fewer would cost more than the target.
    save_s = float(re.search(r"saved in ([\d.]+) s", err)[1])  # type: ignore[index]
    step_s = float(re.search(r"a step ([\d.]+) s", err)[1])  # type: ignore[index]
    assert save_s / ((every - 1) * step_s + save_s) > MAX_SAVE_FRACTION
    assert "set --set checkpoint.every=N to choose" in err


def test_the_same_job_on_more_nodes_saves_faster_and_steps_faster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """64 nodes write 4x the bytes per second and take a quarter of the batch each: a shorter
    interval in time, and the given bandwidth is used and named."""
    every16, err16 = _launch(tmp_path, capsys, "slurm", *BIG_JOB, "--set", *BIG)
    big = ["--nodes", "64", "--nproc-per-node", "8", "--gpus-per-node", "8"]
    every64, err64 = _launch(
        tmp_path, capsys, "slurm", *big, "--save-bandwidth-gbps", "8", "--set", *BIG
    )
    assert "8 GB/s per node x 64 node(s), given: --save-bandwidth-gbps" in err64
    assert _cost(err64)[2] < _cost(err16)[2]
    assert every64 < every16


def test_when_saving_is_too_slow_the_loss_bound_wins_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At 0.05 GB/s per node a save takes ~18 min: 2% of training time would mean a checkpoint every
    ~15 hours. The job still saves at least every 30 minutes of work, and the command says what that
    costs."""
    every, err = _launch(
        tmp_path, capsys, "slurm", *BIG_JOB, "--save-bandwidth-gbps", "0.05", "--set", *BIG
    )
    _, percent, loss_min = _cost(err)
    assert loss_min <= MAX_LOSS_S / 60 and percent > MAX_SAVE_FRACTION * 100
    assert "both targets cannot hold" in err and "the loss bound wins" in err
    assert 1 < every < 100


def test_a_tiny_model_saves_every_few_thousand_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 35 MiB checkpoint (a second at least) against steps of milliseconds: thousands of steps
    apart, not steps // 20 capped at 100; a short run saves at its end only."""
    every, err = _launch(tmp_path, capsys, "slurm", *GPU1, "--set", *TINY, "train.steps=1000000")
    assert 1000 < every < 1_000_000
    _, percent, loss_min = _cost(err)
    assert percent <= MAX_SAVE_FRACTION * 100 and loss_min <= MAX_LOSS_S / 60
    every, err = _launch(tmp_path, capsys, "k8s", *GPU1, "--set", *TINY, "train.steps=1000")
    assert every == 1000
    assert "the job saves at its last step only" in err


@pytest.mark.parametrize("scheduler", ["slurm", "k8s"])
def test_an_explicit_checkpoint_every_wins_and_its_cost_is_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], scheduler: str
) -> None:
    every, err = _launch(tmp_path, capsys, scheduler, *BIG_JOB, "--set", *BIG, "checkpoint.every=5")
    assert every == 5
    assert "checkpoint.every is 5, as given (the config or --set)" in err
    shown, percent, _ = _cost(err)
    assert shown == 5 and percent > MAX_SAVE_FRACTION * 100  # what every 5 steps costs
    chosen = int(re.search(r"without it the launch would choose (\d+)", err)[1])  # type: ignore[index]
    assert chosen >= 20


def test_a_named_gpu_is_a_gpu_job_and_its_peak_sets_the_step_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--device`` without ``--gpus-per-node`` (a partition that gives GPUs by itself): the A100's
    lower peak predicts longer steps than the H100's, so fewer steps make the same save cost."""
    nodes = ["--nodes", "16", "--nproc-per-node", "8"]
    a100, err = _launch(tmp_path, capsys, "slurm", *nodes, "--device", "a100-80gb", "--set", *BIG)
    assert "a100-80gb, given: --device" in err
    h100, _ = _launch(tmp_path, capsys, "slurm", *nodes, "--device", "h100", "--set", *BIG)
    assert a100 < h100


def test_the_chosen_interval_divides_durable_every(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    every, err = _launch(
        tmp_path, capsys, "slurm", *BIG_JOB, "--set", *BIG, "checkpoint.durable_every=50"
    )
    assert 50 % every == 0 and every >= 20, err
    assert _cost(err)[0] == every  # the figures shown are the interval's the job gets
    # A durable_every below the best interval forces a short one: what it costs is said, and why.
    every, err = _launch(
        tmp_path, capsys, "slurm", *GPU1, "--set", *TINY, "train.steps=100000",
        "checkpoint.durable_every=7",
    )  # fmt: skip
    assert every == 7
    shown, percent, _ = _cost(err)
    assert shown == 7 and percent > MAX_SAVE_FRACTION * 100
    assert "checkpoint.durable_every = 7 must be a multiple of it (without that, every " in err


def test_a_run_shorter_than_one_save_and_a_step_longer_than_the_loss_bound_are_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    every, err = _launch(tmp_path, capsys, "slurm", *GPU1, "--set", *TINY, "train.steps=2")
    assert every == 2
    assert "one save takes longer than the whole run (2 steps, 20 ms)" in err
    hour = SaveInterval(1, 10**12, 2.0, 500.0, 3600.0, 100, True)
    text = describe(hour, "h100", "2 GB/s")
    assert "every step: saving costs" in text and "every 1 steps" not in text
    assert "one step alone takes longer than 30 min: it saves after each" in text


# The README's command: the tiny preset's 100 steps on 2 nodes of 8 GPUs, where a save (1 s at least)
# takes as long as the whole run (100 steps of 10 ms at least).
README_JOB = ["configs/fsdp.yaml", "--nodes", "2", "--nproc-per-node", "8", "--gpus-per-node", "8"]
# "one save takes as long as the whole run (100 steps, 1 s)"
SHARE = re.compile(
    r"one save takes (as long as|longer than) the whole run \((\d+) steps, ([^)]+)\)"
)


def _seconds(text: str) -> float:
    """A duration as the command prints it ("1 s", "20 ms", "1.5 min") in seconds."""
    value, unit = text.split()
    return float(value) * {"min": 60.0, "s": 1.0, "ms": 1e-3, "µs": 1e-6}[unit]


@pytest.mark.parametrize("scheduler", ["slurm", "k8s"])
def test_a_run_that_saves_at_its_last_step_only_says_what_a_requeue_resumes_from(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    scheduler: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "every 100 steps" of a 100-step run is its last step: a job requeued before the end resumes
    only from the save a stop signal makes, and one killed without warning starts over; the lines
    never claim more, and the save-against-run comparison agrees with the figures printed."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    every, err = _launch(tmp_path, capsys, scheduler, *README_JOB)
    assert every == 100, err
    first = err.splitlines()[0]
    assert "so that a" not in first and "every 100 steps" not in first
    assert "the job saves at its last step only (step 100)" in first
    assert "periodic saves are not worth it for this run: one save takes as long as" in first
    signals = (
        "job requeued after a stop signal (SIGUSR1 or SIGTERM, as on preemption)"
        if scheduler == "slurm"
        else "job restarted after a stop signal (SIGTERM, as on eviction or preemption)"
    )
    assert signals in first
    assert "resumes from the checkpoint the signal saves" in first
    assert "one killed without warning starts over from step 0" in first
    # The figures the comparison names are the ones printed: 1 s against 1 s is "as long as".
    save = re.search(r"saved in ([^ ]+ (?:min|s|ms))", err)
    share = SHARE.search(err)
    assert save and share, err
    assert share[2] == "100" and share[3] == save[1] == "1 s"
    assert share[1] == "as long as"
    # The loss bound's line agrees: the whole run, 1 s, is all a kill can lose.
    assert "a kill without warning loses at most 1 s of work" in err


@pytest.mark.parametrize(
    ("save_s", "step_s", "steps", "phrase", "run"),
    [
        (1.0, 0.01, 100, "as long as", "1 s"),  # equal
        (1.0004, 0.01, 100, "as long as", "1 s"),  # longer, but printed alike
        (1.0, 0.00999, 100, "longer than", "999 ms"),
        (1.0, 0.01, 2, "longer than", "20 ms"),
    ],
)
def test_the_save_against_the_run_reads_as_its_figures(
    save_s: float, step_s: float, steps: int, phrase: str, run: str
) -> None:
    every, both = choose_every(save_s, step_s, steps)
    assert every == steps and both
    text = describe(SaveInterval(every, 10**6, 2.0, save_s, step_s, steps, both), "h100", "2 GB/s")
    share = SHARE.search(text)
    assert share, text
    assert (share[1], share[3]) == (phrase, run)
    shown = re.search(r"saved in ([^ ]+ (?:min|s|ms))", text)
    assert shown
    assert (_seconds(shown[1]) > _seconds(share[3])) == (phrase == "longer than")


def test_a_short_run_whose_save_costs_under_the_target_does_not_claim_more() -> None:
    """Two 1 s steps and a 30 ms save: one save is 1.5% of the run, under the 2% target, yet a save
    every step would cost 2.9%: the last step only, for that reason and not a false one."""
    every, both = choose_every(0.03, 1.0, 2)
    assert (every, both) == (2, True)
    text = describe(SaveInterval(every, 10**6, 2.0, 0.03, 1.0, 2, both), "h100", "2 GB/s")
    assert "costs 1.5% of the whole run (2 steps, 2 s)" in text, text
    assert "1.5% of the whole run (2 steps, 2 s), more than" not in text
    assert "a save more often than every 2 steps would cost more than the 2% target" in text
    big = describe(SaveInterval(100, 10**6, 2.0, 0.5, 0.1, 100, True), "h100", "2 GB/s")
    assert "costs 5.0% of the whole run (100 steps, 10 s), more than the 2% target" in big, big


@pytest.mark.parametrize("scheduler", ["slurm", "k8s"])
def test_cpu_nodes_saving_every_step_say_every_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], scheduler: str
) -> None:
    """20 steps on CPU nodes: 1/20 of the run is one step, and the line reads as English."""
    every, err = _launch(
        tmp_path, capsys, scheduler, "--nodes", "1", "--nproc-per-node", "2",
        "--set", *TINY, "parallel.strategy=ddp", "train.steps=20",
    )  # fmt: skip
    assert every == 1
    restarted = "requeued" if scheduler == "slurm" else "restarted"
    assert f"the job saves every step so that a {restarted} job resumes" in err, err
    assert "every 1 steps" not in err


def test_cpu_nodes_keep_the_fraction_of_the_run_and_say_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    every, err = _launch(tmp_path, capsys, "slurm", "--set", *TINY, "train.steps=200")
    assert every == 10
    assert "the step time of CPU nodes is not predicted" in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--save-bandwidth-gbps", "0"], "--save-bandwidth-gbps 0.0: allowed: a finite number > 0"),
        (["--save-bandwidth-gbps", "nan"], "--save-bandwidth-gbps nan: allowed"),
        (["--device", "tpu-v5"], "--device 'tpu-v5' is not known; allowed: h100, h200"),
    ],
)
@pytest.mark.parametrize("job", [GPU1, []], ids=["gpu", "cpu"])
def test_bad_interval_flags_are_clear_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    needle: str,
    job: list[str],
) -> None:
    """Also for a job on CPU nodes, which does not use them: a typo is never ignored."""
    out = tmp_path / "job.sbatch"
    code = cli_main(["launch", "slurm", *job, *args, "--out", str(out), "--set", *TINY])
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("save_s", "step_s", "steps", "every", "both"),
    [
        (10.0, 1.0, 10**6, 490, True),  # 10 / (490 + 10) = 2%
        (100.0, 10.0, 10**6, 180, False),  # 2% needs 490 steps, 30 minutes allow 180
        (10.0, 3600.0, 10**6, 1, True),  # a step longer than 30 minutes: save after each
        (10.0, 1.0, 100, 100, True),  # a run shorter than the interval: its last step only
    ],
)
def test_choose_every(save_s: float, step_s: float, steps: int, every: int, both: bool) -> None:
    assert choose_every(save_s, step_s, steps) == (every, both)


def test_the_docs_show_what_the_command_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/deploy.md quotes the 70B example's reasoning: it is what the command prints today."""
    _, err = _launch(tmp_path, capsys, "slurm", *BIG_JOB, "--set", *BIG)
    docs = (Path(__file__).resolve().parents[1] / "docs" / "deploy.md").read_text()
    lines = [
        ln for ln in err.splitlines() if ln.startswith(("checkpoint.every", "predicted", "every"))
    ]
    assert len(lines) == 3
    for line in lines:
        assert line in docs, line


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_chosen_interval_keeps_its_promise_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where the floors decide (a tiny model, whose predicted step is microseconds): the interval the
    launch chooses for a long run on this GPU, against the step and save times measured on it, keeps
    saving at most 2% of training time and a kill's loss under 30 minutes."""
    from dtlab.analysis.devices import PROFILES, lookup_cuda

    profile = lookup_cuda(torch.cuda.get_device_name())
    key = next((k for k, p in PROFILES.items() if p is profile), "h100")
    every, err = _launch(
        tmp_path, capsys, "slurm", *GPU1, "--device", key, "--set", *TINY, "train.steps=1000000"
    )
    run = tmp_path / "run"
    proc = run_cli(
        "train", "--set", *TINY, "train.device=cuda", "train.steps=24", "checkpoint.every=6",
        "checkpoint.final=false", f"run.dir={run}", "run.tensorboard=false", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["checkpoints_saved"] == 4
    save_s = summary["checkpoint_blocked_s"] / summary["checkpoints_saved"]
    step_s = summary["median_step_time_s"]
    assert save_s / (every * step_s + save_s) <= MAX_SAVE_FRACTION, (save_s, step_s, err)
    assert every * step_s <= MAX_LOSS_S, (step_s, err)
