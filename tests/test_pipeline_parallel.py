"""Pipeline parallelism trains exactly like one process, with every schedule (real gloo processes).

The model has four blocks here, so that the schedules with several stages per rank have a block per
stage. Every run clips (the clip is below every step's gradient norm), so the global norm must be taken
over all stages, and splits each rank's batch into four pipeline micro-batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import CLIP, FAST, assert_close_losses, run_cli, train_run

LAYERS = "model.n_layers=4"
PIPE = [LAYERS, f"train.grad_clip={CLIP}"]


@pytest.fixture(scope="module")
def pipe_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One process, four blocks, clipping on every step."""
    run = train_run(tmp_path_factory.mktemp("pipe-ref"), *PIPE)
    assert all(m["grad_norm"] > CLIP for m in run), [m["grad_norm"] for m in run]
    return run


@pytest.mark.parametrize(
    "schedule",
    ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"],
)
def test_every_schedule_matches_single_process(
    tmp_path: Path, pipe_reference: list[dict[str, Any]], schedule: str
) -> None:
    run = train_run(
        tmp_path / schedule, *PIPE, "parallel.pp=2", f"parallel.pp_schedule={schedule}",
        "parallel.pp_microbatches=4", nproc=2,
    )  # fmt: skip
    assert_close_losses(run, pipe_reference)


@pytest.mark.parametrize(("strategy", "schedule"), [("ddp", "1f1b"), ("fsdp", "interleaved_1f1b")])
def test_pipeline_with_data_parallel_matches_single_process(
    tmp_path: Path, pipe_reference: list[dict[str, Any]], strategy: str, schedule: str
) -> None:
    """PP2 x DP2 on a 2-D mesh; train.micro_batch_size sets the pipeline's micro-batches."""
    run = train_run(
        tmp_path / strategy, *PIPE, "parallel.pp=2", f"parallel.strategy={strategy}",
        f"parallel.pp_schedule={schedule}", "train.micro_batch_size=1", nproc=4,
    )  # fmt: skip
    assert_close_losses(run, pipe_reference)


def test_pipeline_checkpoint_resumes_as_tensor_parallel(
    tmp_path: Path, pipe_reference: list[dict[str, Any]]
) -> None:
    """Saved by PP2 x FSDP2 with two stages per rank (stopped after step 6), resumed by TP2: every
    stage's model and optimizer state is in the checkpoint under the whole model's names."""
    run_dir = tmp_path / "run"
    args = ["train", "--nproc", "4", "--set", *FAST, *PIPE, "train.steps=12", f"run.dir={run_dir}",
            "parallel.pp=2", "parallel.strategy=fsdp", "parallel.pp_schedule=interleaved_1f1b"]  # fmt: skip
    first = run_cli(*args, env={"DTLAB_FAULTS": "sigterm@6"})
    assert first.returncode == 75, first.stderr
    # The stages' checkpoint exports as one model: every block, the plain model's names and shapes.
    export = run_cli("export", str(run_dir / "checkpoints" / "step-00000006"), "--format", "hf",
                     "--out", str(tmp_path / "export"))  # fmt: skip
    assert export.returncode == 0, export.stderr
    from safetensors.torch import load_file

    from dtlab.config import load_config
    from dtlab.models.llama import build_model

    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    whole = build_model(load_config(overrides=[*FAST, LAYERS]).model)
    assert len(exported) == len(dict(whole.named_parameters()))
    assert sum(v.numel() for v in exported.values()) == sum(p.numel() for p in whole.parameters())
    assert sum(k.startswith("model.layers.3.") for k in exported) == 9  # the last stage's block
    run = train_run(run_dir, *PIPE, "parallel.tp=2", nproc=2)
    assert_close_losses(run, pipe_reference)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.strategy=fsdp"],
         "parallel.pp_schedule = 'zbv' (zero bubble) is not supported with data parallelism"),
        # Its weight half recomputes a checkpointed block once per weight; selective fails in it.
        (["parallel.pp=2", "parallel.pp_schedule=zbv", "train.activation_checkpointing=full"],
         "'zbv' (zero bubble) is not supported with train.activation_checkpointing = 'full'"),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_zb",
          "train.activation_checkpointing=selective"],
         "(zero bubble) is not supported with train.activation_checkpointing = 'selective'"),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
         "= 4 stages, but model.n_layers = 2: each stage needs at least one block"),
        (["parallel.pp=2", "train.precision=fp16"],
         "train.precision = 'fp16' is not supported with parallel.pp = 2"),
        (["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_stages_per_rank=2"],
         "parallel.pp_schedule = '1f1b' runs one stage per rank"),
    ],
)  # fmt: skip
def test_pipeline_config_errors(overrides: list[str], message: str) -> None:
    proc = run_cli("config", "--set", *FAST, *overrides)
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_pipeline_micro_batches_must_split_the_batch(tmp_path: Path) -> None:
    proc = run_cli("train", "--nproc", "2", "--set", *FAST, "parallel.pp=2",
                   "parallel.pp_microbatches=3", f"run.dir={tmp_path / 'r'}")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        "3 pipeline micro-batches do not split each data-parallel rank's 8 samples" in proc.stderr
    )
    assert not (tmp_path / "r").exists()


def test_three_dimensions_match_single_process(
    tmp_path: Path, pipe_reference: list[dict[str, Any]]
) -> None:
    """PP2 x FSDP2 x TP2 with sequence parallelism: 8 processes on one 3-D mesh."""
    run = train_run(
        tmp_path / "3d", *PIPE, "parallel.pp=2", "parallel.strategy=fsdp", "parallel.tp=2",
        "parallel.sequence_parallel=true", "parallel.pp_microbatches=2", nproc=8,
    )  # fmt: skip
    assert_close_losses(run, pipe_reference)


def test_a_stage_killed_mid_run_is_named_without_a_traceback(tmp_path: Path) -> None:
    """Rank 1 (the last stage) is killed after step 3: rank 0's pipeline receive fails, and it says
    which rank is behind from the ledgers, as for any other collective."""
    proc = run_cli("train", "--nproc", "2", "--set", *FAST, *PIPE, "parallel.pp=2", "train.steps=8",
                   f"run.dir={tmp_path / 'run'}", env={"DTLAB_FAULTS": "kill@3:r1"})  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "[rank0] error: a collective failed on rank 0" in proc.stderr
    assert "Rank 1 (pid" in proc.stderr and "is behind" in proc.stderr, proc.stderr


def test_the_schedule_is_asked_for_no_outputs_only_where_its_torch_takes_the_keyword() -> None:
    """Torch's schedules since ``return_outputs`` are told not to keep the last stage's outputs
    (every micro-batch's logits, alive to the next step otherwise); an older schedule, whose
    unknown keywords go to the model, is passed none."""
    from torch.distributed.pipelining import ScheduleGPipe

    from dtlab.parallel.pipeline import _no_outputs

    class Older(ScheduleGPipe):
        def step(self, *args: Any, target: Any = None, losses: Any = None, **kwargs: Any) -> None:
            raise AssertionError("not run")

    plain = ScheduleGPipe.__new__(ScheduleGPipe)
    assert _no_outputs(plain) == {"return_outputs": False}
    assert _no_outputs(Older.__new__(Older)) == {}
