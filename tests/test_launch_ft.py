"""``dtlab launch`` with parallel.fault_tolerance: a lighthouse per job and one task per replica group.

The last test submits to a real Slurm cluster (``deploy/slurm/local-cluster.sh start``); with
DTLAB_REQUIRE_SLURM=1 a missing cluster fails instead of skipping.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import FAST, run_cli
from test_deploy import _wait_for, slurm  # noqa: F401  (slurm: the fixture)

FT = ["parallel.strategy=ddp", "parallel.fault_tolerance.enabled=true"]


def _script(tmp_path: Path, *args: str, overrides: tuple[str, ...] = ()) -> str:
    out = tmp_path / "job.sbatch"
    proc = run_cli(
        "launch", "slurm", *args, "--out", str(out), "--set", *FAST, *FT, *overrides,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    return out.read_text()


def test_ft_slurm_script_starts_one_lighthouse_and_a_task_per_group(tmp_path: Path) -> None:
    text = _script(
        tmp_path, "--nodes", "2", "--nproc-per-node", "2",
        overrides=("parallel.fault_tolerance.max_restarts=3", "run.name=ftjob"),
    )  # fmt: skip
    # DDP: every rank is a replica group, so 2 nodes x 2 ranks = 4 groups, 2 tasks per node.
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=2" in text
    assert "\nREPLICAS=4\n" in text and "\nGROUP_RANKS=1\n" in text
    assert "\nMAX_RESTARTS=3\n" in text
    run_dir = tmp_path / "runs" / "ftjob"
    assert f"\nRUN_DIR={run_dir}\n" in text
    # The lighthouse: started once, in the batch step, listening beyond the loopback.
    assert len(re.findall(r"-m dtlab\.fault_tolerance --lighthouse", text)) == 1
    assert '--lighthouse "0.0.0.0:$LIGHTHOUSE_PORT"' in text
    assert 'export TORCHFT_LIGHTHOUSE="http://$FIRST_NODE:$LIGHTHOUSE_PORT"' in text
    # One srun: a task per group, none killing the others, each under its own bounded agent.
    assert text.count("\nsrun ") == 1
    srun = text[text.index("\nsrun ") :]
    assert "--kill-on-bad-exit=0 --ntasks-per-node=2" in srun
    assert "DTLAB_FT_REPLICA=$i" in srun and "DTLAB_FT_HOST=" in srun
    assert '--max-restarts "$3"' in srun and '"$MAX_RESTARTS"' in srun
    assert '--set "run.dir=$4/replica-$i"' in srun
    assert "DTLAB_FT_REPLICAS=" in text and "DTLAB_FT_START_STORE=" in text
    # The job config keeps fault tolerance on, with the run directory the script uses.
    cfg = yaml.safe_load((tmp_path / "job.config.yaml").read_text())
    assert cfg["parallel"]["fault_tolerance"]["enabled"] is True
    assert cfg["run"]["dir"] == str(run_dir)


def test_ft_slurm_script_uses_a_given_lighthouse(tmp_path: Path) -> None:
    text = _script(
        tmp_path, "--nodes", "1", "--nproc-per-node", "2",
        overrides=("parallel.fault_tolerance.lighthouse=http://lh.example:29510",),
    )  # fmt: skip
    assert "--lighthouse" not in text
    assert "export TORCHFT_LIGHTHOUSE=http://lh.example:29510" in text


def test_ft_k8s_is_refused_clearly(tmp_path: Path) -> None:
    proc = run_cli(
        "launch", "k8s", "--image", "dtlab:cpu", "--nproc-per-node", "2",
        "--out", str(tmp_path / "job.yaml"), "--set", *FAST, *FT,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "not supported" in proc.stderr and "dtlab launch slurm" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "job.yaml").exists()


@pytest.mark.slow
def test_ft_slurm_job_of_two_groups_trains_to_the_end(tmp_path: Path, slurm: None) -> None:  # noqa: F811
    """2 replica groups of 1 rank on the local cluster meet at the job's lighthouse, train to the
    end, and the job exits 0 with both groups' summaries."""
    proc = run_cli(
        "launch", "slurm", "--nodes", "1", "--nproc-per-node", "2", "--time", "5",
        "--out", str(tmp_path / "job.sbatch"), "--submit",
        "--set", *FAST, *FT, "run.name=ft-slurm", "train.steps=5",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    info = _wait_for(
        job_id, lambda i: i["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 180
    )
    log = (tmp_path / f"ft-slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    assert log.count("fault tolerance: lighthouse on 0.0.0.0:") == 1
    run_dir = tmp_path / "runs" / "ft-slurm"
    for i in range(2):
        summary = json.loads((run_dir / f"replica-{i}" / "summary.json").read_text())
        assert summary["steps"] == 5
        assert summary["fault_tolerance"]["replica"] == i
        assert summary["fault_tolerance"]["replicas"] == 2
        events = [
            json.loads(line)
            for line in (run_dir / f"replica-{i}" / "ft_events.jsonl").read_text().splitlines()
        ]
        # Both groups met in one quorum at the job's lighthouse.
        assert any(e["event"] == "quorum" and e["members"] == [0, 1] for e in events), events
        assert (run_dir / f"replica-{i}.exit").read_text().strip() == "0"
