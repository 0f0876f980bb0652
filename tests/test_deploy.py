"""dtlab launch (Slurm, Kubernetes), deploy/run.sh and multi-node runs.

The Slurm tests submit to a real cluster when one answers (`deploy/slurm/local-cluster.sh start` makes
one on localhost; CI does). With DTLAB_REQUIRE_SLURM=1 a missing cluster fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import FAST, cli_env, read_metrics, run_cli, train_run

ROOT = Path(__file__).resolve().parents[1]
RUN_SH = ROOT / "deploy" / "run.sh"
# A name and a path full of shell syntax: none of it may run.
EVIL_NAME = "x'; touch PWNED; echo $(touch PWNED2) `touch PWNED3`"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fake_bin(tmp: Path) -> Path:
    """``srun`` / ``scontrol`` stand-ins that record their arguments, NUL-separated (never run them)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    record = 'for a in "$@"; do printf "%s\\0" "$a"; done > "$RECORD_DIR/$(basename "$0").args"\n'
    (bin_dir / "srun").write_text("#!/bin/bash\n" + record + "exit ${FAKE_RC:-0}\n")
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [[ "$1" == show ]]; then echo node-a; echo node-b; exit 0; fi\n' + record
    )
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_sbatch_script_quotes_every_value(tmp_path: Path) -> None:
    odd = tmp_path / "dir;$(touch${IFS}PWNED4)'q"  # sbatch directives cannot hold whitespace
    odd.mkdir()
    python = str(odd / "py thon")  # spaces and quotes in the interpreter path
    proc = run_cli(
        "launch", "slurm", "--nodes", "2", "--nproc-per-node", "4", "--gpus-per-node", "4",
        "--partition", "gpu", "--time", "1-02:00:00", "--python", python,
        "--out", str(odd / "job.sbatch"), "--set", f"run.name={EVIL_NAME}", "parallel.strategy=fsdp",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    script = odd / "job.sbatch"
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    directives = [ln.split(None, 1)[1] for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert {"--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--partition=gpu"} <= set(
        directives
    )
    assert "--time=1-02:00:00" in directives and "--requeue" in directives
    assert "--signal=USR1@120" in directives
    # The resolved config sits beside the script, with a fixed absolute run directory to resume from.
    resolved = yaml.safe_load((odd / "job.config.yaml").read_text())
    assert resolved["run"]["name"] == EVIL_NAME
    assert Path(resolved["run"]["dir"]).is_absolute()

    # Run the script for real, with srun/scontrol replaced by recorders: nothing in the values runs,
    # and srun gets the launcher command with every value intact.
    env = {
        **os.environ,
        "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}",
        "RECORD_DIR": str(tmp_path),
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_NUM_NODES": "2",
    }
    res = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert not list(tmp_path.rglob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))
    args = (tmp_path / "srun.args").read_text().split("\0")[:-1]
    inner = args[args.index("-c") + 1 :]
    assert inner[1:] == [python, str(odd / "job.config.yaml"), "4", "node-a", str(20000 + 1234)]
    assert not (tmp_path / "scontrol.args").exists()  # no requeue after a normal exit

    # A preempted run (exit 75: checkpoint saved) requeues the job.
    res = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env={**env, "FAKE_RC": "75"}, capture_output=True
    )
    assert res.returncode == 75
    assert (tmp_path / "scontrol.args").read_text().split("\0")[:-1] == ["requeue", "1234"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--time", "1h"], "--time: '1h' is not valid"),
        (["--time", "10\n#SBATCH --exclusive"], "is not valid"),
        (["--partition", "gpu debug"], "--partition: 'gpu debug' is not valid"),
        (["--nproc-per-node", "3", "--set", "parallel.strategy=ddp"], "global_batch_size"),
    ],
)
def test_bad_slurm_values_are_clear_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = run_cli("launch", "slurm", *args, "--set", *FAST, cwd=tmp_path)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def _k8s(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    out = tmp_path / "job.yaml"
    proc = run_cli("launch", "k8s", *args, "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return list(yaml.safe_load_all(out.read_text()))


def test_k8s_manifest_structure(tmp_path: Path) -> None:
    docs = _k8s(
        tmp_path, "--nodes", "3", "--nproc-per-node", "8", "--gpus-per-node", "8",
        "--image", "registry.example/dtlab:1", "--memory", "64Gi",
        "--set", "run.name=Big Run", "parallel.strategy=fsdp", "train.global_batch_size=48",
    )  # fmt: skip
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ConfigMap", "PersistentVolumeClaim", "PyTorchJob"]
    cm, pvc, job = docs
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert config["parallel"]["strategy"] == "fsdp" and config["run"]["dir"] == "/runs/big-run"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every node writes its shards there
    assert job["apiVersion"] == "kubeflow.org/v1" and job["metadata"]["name"] == "big-run"
    spec = job["spec"]
    assert spec["nprocPerNode"] == "8"
    assert spec["elasticPolicy"] == {
        "rdzvBackend": "c10d", "minReplicas": 3, "maxReplicas": 3, "maxRestarts": 3,
    }  # fmt: skip
    replicas = spec["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    for r in replicas.values():
        pod = r["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == "registry.example/dtlab:1"
        assert c["command"][:3] == ["python", "-m", "torch.distributed.run"]
        assert c["command"][-3:] == ["dtlab", "train", "/etc/dtlab/config.yaml"]
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 8}
        assert c["resources"]["requests"] == {"memory": "64Gi"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["config"]["configMap"]["name"] == "big-run-config"
        assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == "big-run-runs"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["config"] == "/etc/dtlab" and mounts["runs"] == "/runs"


def test_k8s_single_node_existing_claim(tmp_path: Path) -> None:
    docs = _k8s(tmp_path, "--image", "dtlab:cpu", "--pvc", "shared-runs", "--namespace", "ml")
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    job = docs[-1]
    assert job["metadata"]["namespace"] == "ml"
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["shared-runs"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--image", "dtlab", "--name", "Bad_Name"], "--name: 'Bad_Name' is not valid"),
        (["--image", "dtlab x"], "--image: 'dtlab x' is not valid"),
        (["--image", "dtlab", "--memory", "lots"], "--memory: 'lots' is not valid"),
        ([], "--image"),
    ],
)
def test_bad_k8s_values_are_clear_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = run_cli("launch", "k8s", *args, cwd=tmp_path)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())


def test_two_launchers_with_nnodes_2_match_one_with_2_processes(tmp_path: Path) -> None:
    """Two `--nnodes 2` launchers (node ranks 0 and 1, loopback rendezvous, started through
    deploy/run.sh) train exactly what one launcher with 2 processes trains."""
    common = [*FAST, "parallel.strategy=ddp", "train.steps=6"]
    reference = train_run(tmp_path / "one", "parallel.strategy=ddp", nproc=2, steps=6)
    run_dir = tmp_path / "two"
    port = _free_port()
    procs = [
        subprocess.Popen(
            ["bash", str(RUN_SH), "--set", *common, f"run.dir={run_dir}"],
            env=cli_env(
                {
                    "PYTHON": sys.executable,
                    "NPROC_PER_NODE": "1",
                    "NNODES": "2",
                    "NODE_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    two = read_metrics(run_dir)
    assert [m["step"] for m in two] == [m["step"] for m in reference]
    for a, b in zip(two, reference, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-6)
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2


# --- a real Slurm cluster ------------------------------------------------------------------------


def _slurm_up() -> bool:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    res = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    return res.returncode == 0 and any(
        s.startswith(("idle", "mix", "alloc")) for s in res.stdout.split()
    )


@pytest.fixture
def slurm() -> None:
    if not _slurm_up():
        reason = "no Slurm cluster answers (start one: sudo deploy/slurm/local-cluster.sh start)"
        if os.environ.get("DTLAB_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def _job_state(job_id: str) -> dict[str, str]:
    res = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True
    )
    return dict(kv.split("=", 1) for kv in res.stdout.split() if "=" in kv)


def _wait_for(job_id: str, done: Any, timeout: float = 420) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = _job_state(job_id)
        if done(info):
            return info
        time.sleep(1)  # polling a scheduler, not waiting for a result to appear by chance
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} not done in {timeout}s: {_job_state(job_id)}")


def _submit(tmp_path: Path, *overrides: str, nproc: int = 2) -> tuple[str, Path]:
    proc = run_cli(
        "launch", "slurm", "--nodes", "1", "--nproc-per-node", str(nproc), "--time", "15",
        "--signal-seconds", "60", "--out", str(tmp_path / "job.sbatch"), "--submit",
        "--set", *FAST, "parallel.strategy=ddp", "run.name=slurm-test", *overrides,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    assert job_id.isdigit(), proc.stdout
    return job_id, tmp_path / "runs" / "slurm-test"


@pytest.mark.slow
def test_slurm_job_completes_with_metrics(tmp_path: Path, slurm: None) -> None:
    job_id, run_dir = _submit(tmp_path, "train.steps=5")
    info = _wait_for(
        job_id, lambda i: i["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    )
    log = (tmp_path / f"slurm-test-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 5


@pytest.mark.slow
def test_slurm_preemption_requeues_and_resumes(tmp_path: Path, slurm: None) -> None:
    """SIGUSR1 to the job's tasks (what `--signal` sends before the time limit): the workers save a
    checkpoint, the script requeues the job, and the requeued job resumes to the same end."""
    steps = 30
    job_id, run_dir = _submit(tmp_path, f"train.steps={steps}", "checkpoint.every=1000")
    metrics_file = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, _job_state(job_id)
        assert _job_state(job_id)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING")
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    # Slurm holds a requeued job back (~2 minutes) until the previous run is cleaned up on the node;
    # starting it earlier makes the node refuse it ("job credential revoked").
    info = _wait_for(
        job_id,
        lambda i: (
            i["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
            and int(i.get("Restarts", "0")) >= 1
        ),
        timeout=600,
    )
    log = (tmp_path / f"slurm-test-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "requeueing job" in log and "resumed from" in log.lower(), log[-3000:]
    metrics = read_metrics(run_dir)
    assert metrics[-1]["step"] == steps
    # The reference: the same training without a stop.
    reference = train_run(
        tmp_path / "ref", "parallel.strategy=ddp", "run.name=slurm-test", nproc=2, steps=steps
    )
    assert metrics[-1]["loss"] == pytest.approx(reference[-1]["loss"], rel=1e-5)


def test_checked_in_examples_are_valid() -> None:
    assert (
        subprocess.run(["bash", "-n", str(ROOT / "deploy" / "slurm" / "demo.sbatch")]).returncode
        == 0
    )
    assert subprocess.run(["bash", "-n", str(RUN_SH)]).returncode == 0
    assert (
        subprocess.run(
            ["bash", "-n", str(ROOT / "deploy" / "slurm" / "local-cluster.sh")]
        ).returncode
        == 0
    )
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "demo.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PersistentVolumeClaim", "PyTorchJob"]
    from dtlab.config import config_from_dict

    # The configs inside validate against today's schema.
    config_from_dict(yaml.safe_load(docs[0]["data"]["config.yaml"]))
    config_from_dict(yaml.safe_load((ROOT / "deploy" / "slurm" / "demo.config.yaml").read_text()))
