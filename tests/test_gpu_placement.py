"""Which GPUs each process of a node gets when there are several: the decisions a multi-GPU run makes,
tested on the CPU (the GPU count and visibility are the node's facts, given here), and on CUDA where a
node has the GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FAST, cli_env
from dtlab.errors import DtlabError
from dtlab.parallel.devices import group_gpus, replica_group_gpu_env, visible_gpus

EIGHT = [str(i) for i in range(8)]


def test_each_replica_group_gets_gpus_of_its_own() -> None:
    # DDP with fault tolerance on 8 GPUs: 8 groups of one rank, each rank its local rank 0.
    assert group_gpus(EIGHT, 8, 1) == [[str(i)] for i in range(8)]
    # HSDP with 2 groups of 4: GPUs 0-3 and 4-7, not 0-3 twice.
    assert group_gpus(EIGHT, 2, 4) == [EIGHT[:4], EIGHT[4:]]


def test_a_users_visible_devices_are_the_ones_sliced() -> None:
    visible = visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3, 5,GPU-7f"}, 4)
    assert visible == ["2", "3", "5", "GPU-7f"]
    assert group_gpus(visible, 2, 2) == [["2", "3"], ["5", "GPU-7f"]]
    assert visible_gpus({}, 3) == ["0", "1", "2"]


def test_more_group_ranks_than_gpus_is_refused_unless_gloo_shares_them() -> None:
    with pytest.raises(DtlabError, match=r"12 processes per node but 8 GPUs visible on this node "
                       r"for 3 replica groups of 4 ranks"):  # fmt: skip
        group_gpus(EIGHT, 3, 4)
    assert group_gpus(EIGHT, 3, 4, share=True) is None  # gloo on purpose: the groups share
    assert group_gpus(EIGHT, 2, 4, share=True) == [EIGHT[:4], EIGHT[4:]]


def test_the_agents_environment_names_each_groups_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    # The node's facts (4 GPUs, a user's CUDA_VISIBLE_DEVICES): what each group's agent is given.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert replica_group_gpu_env("auto", "nccl", 4, 1) == [
        {"CUDA_VISIBLE_DEVICES": d} for d in ("4", "5", "6", "7")
    ]
    assert replica_group_gpu_env("cuda", "nccl", 2, 2) == [
        {"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"},
    ]  # fmt: skip
    assert replica_group_gpu_env("cpu", "gloo", 2, 2) == [{}, {}]


def test_a_fault_tolerant_run_with_more_ranks_than_gpus_stops_before_any_process(
    tmp_path: Path,
) -> None:
    # The launching process refuses it (before the lighthouse and the agents); the node's 2 GPUs are
    # given to it by a sitecustomize that stands in for CUDA's count.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.cuda.device_count = lambda: 2\n"
    )
    path = os.environ.get("PYTHONPATH")
    env = cli_env({"PYTHONPATH": f"{site}{os.pathsep}{path}" if path else str(site)})
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dtlab", "train", "--nproc", "4", "--set", *FAST,
         "parallel.strategy=ddp", "parallel.fault_tolerance.enabled=true", "parallel.backend=nccl",
         f"run.dir={run_dir}"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert (
        "4 processes per node but 2 GPUs visible on this node for 4 replica groups" in proc.stderr
    )
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
def test_each_groups_ranks_see_only_their_own_gpus() -> None:
    """Two fault-tolerant replica groups of one rank on a node of 2+ GPUs: each group's process sees
    one GPU (its CUDA_VISIBLE_DEVICES slice), and the two are different cards (their UUIDs)."""
    envs = replica_group_gpu_env("cuda", "nccl", 2, 1)
    code = (
        "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_properties(0).uuid)"
    )
    seen = []
    for extra in envs:
        env = {**cli_env(), **extra}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        count, uuid = out.stdout.split()
        assert count == "1"
        seen.append(uuid)
    assert len(set(seen)) == 2, seen


# --- the process group between replica groups, and what a recovering peer is sent ----------------
def test_replica_groups_average_over_nccl_on_cuda_and_gloo_on_the_cpu() -> None:
    import torchft

    from dtlab.parallel.ft import GROUPS_PG_NAME, cross_group_backend, groups_pg_class

    assert cross_group_backend(torch.device("cuda", 2)) == "nccl"
    assert cross_group_backend(torch.device("cpu")) == "gloo"
    members: list[int] = []
    assert issubclass(groups_pg_class("nccl", members, 4), torchft.ProcessGroupNCCL)
    gloo = groups_pg_class("gloo", members, 4)
    assert issubclass(gloo, torchft.ProcessGroupGloo)
    assert not issubclass(gloo, torchft.ProcessGroupNCCL)
    assert GROUPS_PG_NAME == "dtlab_ft_replica_groups"


def test_a_recovering_peer_is_sent_the_weights_after_the_queued_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchft's quorum thread copies the state on a stream of its own: the training stream's queued
    # optimizer step must have run first, so the device is waited for before the state is read.
    from dtlab.parallel import ft

    order: list[str] = []
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device=None: order.append(f"sync {device}")
    )

    class State:
        def state_dict(self) -> dict[str, torch.Tensor]:
            order.append("read")
            return {"w": torch.zeros(2)}

    replicas = object.__new__(ft.Replicas)
    replicas._states = {"model": State()}
    replicas._device = torch.device("cuda", 1)
    assert set(replicas._state_dict()) == {"model"}
    assert order == ["sync cuda:1", "read"]
    order.clear()
    replicas._device = torch.device("cpu")
    replicas._state_dict()
    assert order == ["read"]


def test_each_slurm_task_of_a_fault_tolerant_job_takes_its_groups_gpus(tmp_path: Path) -> None:
    # The group's srun task runs under bash with Slurm's variables: the node's GPUs (as Slurm made
    # them visible) sliced by the task's local id, the group's ranks each; no slice without GPUs.
    def script(*extra: str) -> str:
        out = tmp_path / "job.sbatch"
        proc = subprocess.run(
            [sys.executable, "-m", "dtlab", "launch", "slurm", "--nodes", "2", "--nproc-per-node",
             "4", *extra, "--out", str(out), "--set", *FAST, "parallel.strategy=hsdp",
             "parallel.replicate=4", "parallel.fault_tolerance.enabled=true"],
            env=cli_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return out.read_text()

    assert "CUDA_VISIBLE_DEVICES" not in script()
    text = script("--gpus-per-node", "4")
    # The task's body: from srun's `bash -c '` to its closing quote.
    body = text.split("bash -c \\\n    '", 1)[1].split("' \\\n", 1)[0]
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "$CUDA_VISIBLE_DEVICES" > "$OUT_FILE"\n')
    fake.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    seen = {}
    for local_id, visible in [("0", "4,5,6,7"), ("1", "4,5,6,7"), ("1", None)]:
        env = {**cli_env(), "SLURM_PROCID": local_id, "SLURM_LOCALID": local_id,
               "OUT_FILE": str(tmp_path / "seen")}  # fmt: skip
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        # HSDP with 4 replicate groups on 2 nodes x 4 ranks: groups of 2, two tasks per node.
        proc = subprocess.run(
            ["bash", "-c", body, str(fake), "cfg.yaml", "2", "0", str(run_dir)],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        seen[(local_id, visible)] = (tmp_path / "seen").read_text().strip()
    assert seen == {("0", "4,5,6,7"): "4,5", ("1", "4,5,6,7"): "6,7", ("1", None): "2,3"}
