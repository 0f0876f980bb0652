"""``dtlab launch`` with parallel.fault_tolerance: a lighthouse per job and one task per replica group.

The last test submits to a real Slurm cluster (``deploy/slurm/local-cluster.sh start``); with
DTLAB_REQUIRE_SLURM=1 a missing cluster fails instead of skipping.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import FAST, cli_env, run_cli
from test_deploy import _free_port, _wait_for, slurm  # noqa: F401  (slurm: the fixture)

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


def _k8s_docs(tmp_path: Path, *overrides: str) -> list[dict[str, Any]]:
    out = tmp_path / "job.yaml"
    proc = run_cli(
        "launch", "k8s", "--image", "dtlab:cpu", "--nproc-per-node", "2", "--out", str(out),
        "--set", *FAST, *FT, *overrides,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(out.read_text()) if d]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_ft_k8s_manifest_has_a_lighthouse_and_a_job_per_group(tmp_path: Path) -> None:
    docs = _k8s_docs(tmp_path, "parallel.fault_tolerance.max_restarts=4", "run.name=ftk")
    kinds = [d["kind"] for d in docs]
    assert kinds == [
        "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "Job", "Job", "NetworkPolicy",
    ]  # fmt: skip
    deployment, service = docs[2], docs[3]
    assert deployment["spec"]["replicas"] == 1  # the lighthouse, once
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    lh = deployment["spec"]["template"]["spec"]["containers"][0]
    assert lh["command"][3:5] == ["--lighthouse", "0.0.0.0:29510"]
    assert [p["port"] for p in service["spec"]["ports"]] == [29510, 29511]
    # Only the job's pods reach the job's pods (the lighthouse's and the groups' servers).
    policy = docs[-1]["spec"]
    pods = {"dtlab.io/job": "ftk"}
    assert policy["podSelector"]["matchLabels"] == pods
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": pods}}]}]
    for d in docs[2:6]:
        assert d["metadata"]["labels"]["dtlab.io/job"] == "ftk"
        if d["kind"] in ("Deployment", "Job"):
            assert d["spec"]["template"]["metadata"]["labels"]["dtlab.io/job"] == "ftk"
    for i, job in enumerate(docs[4:6]):
        assert job["metadata"]["name"] == f"ftk-replica-{i}"
        assert job["spec"]["backoffLimit"] == 4
        spec = job["spec"]["template"]["spec"]
        assert spec["restartPolicy"] == "Never"
        (container,) = spec["containers"]
        assert container["command"][3:9] == [
            "--nproc", "1", "--max-restarts", "4", "--run-dir", f"/runs/ftk/replica-{i}",
        ]  # fmt: skip
        env = _env(container)
        assert env["DTLAB_FT_REPLICA"] == str(i) and env["DTLAB_FT_REPLICAS"] == "2"
        assert env["TORCHFT_LIGHTHOUSE"] == "http://ftk-lighthouse:29510"
        assert env["DTLAB_FT_START_STORE"] == "ftk-lighthouse:29511"
        assert env["DTLAB_FT_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_ft_k8s_pods_meet_at_the_lighthouse_and_train(tmp_path: Path) -> None:
    """Run the lighthouse's and each group's command as written, with the Service's name mapped to
    loopback and the pod IP to 127.0.0.1 (no cluster here): the groups meet and train to the end."""
    docs = _k8s_docs(tmp_path, "train.steps=3", "run.name=ftk")
    config = yaml.safe_load(docs[0]["data"]["config.yaml"])
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    runs = tmp_path / "runs"
    lh_port, store_port = _free_port(), _free_port()

    def here(arg: str) -> str:
        arg = arg.replace("/etc/dtlab/config.yaml", str(config_file))
        arg = arg.replace("0.0.0.0:29510", f"127.0.0.1:{lh_port}")
        if arg.startswith("/runs/"):
            return f"{runs}/{arg.removeprefix('/runs/')}"
        return arg.replace("=/runs/", f"={runs}/")

    lh = docs[2]["spec"]["template"]["spec"]["containers"][0]["command"]
    lh_cmd = [sys.executable, *map(here, lh[1:])]
    lh_cmd[lh_cmd.index("--store-port") + 1] = str(store_port)
    lighthouse = subprocess.Popen(lh_cmd, env=cli_env({}), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while True:  # until the lighthouse listens, as a pod would retry
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", lh_port)) == 0:
                    break
            assert lighthouse.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        procs = []
        for job in (d for d in docs if d["kind"] == "Job"):
            container = job["spec"]["template"]["spec"]["containers"][0]
            env = {k: v for k, v in _env(container).items() if isinstance(v, str)}
            env |= {
                "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lh_port}",
                "DTLAB_FT_START_STORE": f"127.0.0.1:{store_port}",
                "DTLAB_FT_HOST": "127.0.0.1",
                "OMP_NUM_THREADS": "1",
            }
            cmd = [sys.executable, *map(here, container["command"][1:])]
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=cli_env(env),
                    cwd=tmp_path,
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    for i in range(2):
        replica = runs / "ftk" / f"replica-{i}"
        assert json.loads((replica / "summary.json").read_text())["steps"] == 3
        events = [json.loads(x) for x in (replica / "ft_events.jsonl").read_text().splitlines()]
        assert any(e["event"] == "quorum" and e["members"] == [0, 1] for e in events), events


@pytest.mark.parametrize("scheduler", ["slurm", "k8s"])
def test_ft_group_spanning_nodes_is_refused(tmp_path: Path, scheduler: str) -> None:
    """HSDP with parallel.replicate = 1 over 2 nodes would make one group of 4 ranks on 2 nodes."""
    extra = ["--image", "dtlab:cpu"] if scheduler == "k8s" else []
    proc = run_cli(
        "launch", scheduler, *extra, "--nodes", "2", "--nproc-per-node", "2",
        "--out", str(tmp_path / "job"), "--set", *FAST, "parallel.strategy=hsdp",
        "parallel.replicate=1", "parallel.fault_tolerance.enabled=true",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "a replica group has 4 ranks, which must fit on one node" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "job").exists()
