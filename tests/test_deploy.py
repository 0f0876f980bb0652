"""dtlab launch (Slurm, Kubernetes), deploy/run.sh and multi-node runs.

The Slurm tests submit to a real cluster when one answers (`deploy/slurm/local-cluster.sh start` makes
one on localhost; CI does). With DTLAB_REQUIRE_SLURM=1 a missing cluster fails instead of skipping.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
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
from dtlab.cli import main as cli_main
from dtlab.config import check_world, config_from_dict
from dtlab.deploy import launch_checkpoint_every
from pytorchjob_rules import Rejected, check_job

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


def _launched_checkpoint(tmp_path: Path, scheduler: str, *args: str) -> tuple[int, str]:
    """``dtlab launch SCHEDULER ARGS`` with FAST: the job config's ``checkpoint.every`` and stderr."""
    out = tmp_path / ("job.sbatch" if scheduler == "slurm" else "job.yaml")
    extra = ["--image", "dtlab:cpu"] if scheduler == "k8s" else []
    proc = run_cli(
        "launch", scheduler, *extra, "--out", str(out), *args, "--set", *FAST, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    if scheduler == "slurm":
        text = (tmp_path / "job.config.yaml").read_text()
    else:
        text = next(yaml.safe_load_all(out.read_text()))["data"]["config.yaml"]
    config = config_from_dict(yaml.safe_load(text))  # the job's config is a valid one
    return config.checkpoint.every, proc.stderr


@pytest.mark.parametrize("scheduler", ["slurm", "k8s"])
@pytest.mark.parametrize(("steps", "every"), [(200, 10), (20000, 100), (5, 1)])
def test_launch_gives_checkpoint_every_0_a_default(
    tmp_path: Path, scheduler: str, steps: int, every: int
) -> None:
    """A job from a config without periodic checkpoints gets them (a killed, requeued job would
    otherwise restart from step 0), and the command says so and how to override it."""
    got, stderr = _launched_checkpoint(tmp_path, scheduler, "--set", f"train.steps={steps}")
    assert got == every
    interval = "every step" if every == 1 else f"every {every} steps"
    restarted = "requeued" if scheduler == "slurm" else "restarted"  # Slurm's word, not Kubernetes'
    assert (
        f"checkpoint.every is 0: the job saves {interval} so that a {restarted} job resumes; "
        "set --set checkpoint.every=N to choose"
    ) in stderr
    assert "--no-checkpoint" in stderr
    if scheduler == "k8s":
        assert not re.search(r"requeu|SIGUSR1|sbatch|slurm", stderr, re.I), stderr


@pytest.mark.parametrize("scheduler", ["slurm", "k8s"])
def test_launch_keeps_an_explicit_checkpoint_every(tmp_path: Path, scheduler: str) -> None:
    got, stderr = _launched_checkpoint(tmp_path, scheduler, "--set", "checkpoint.every=7")
    assert got == 7 and "checkpoint.every" not in stderr


@pytest.mark.parametrize("scheduler", ["slurm", "k8s"])
def test_launch_no_checkpoint_keeps_them_off(tmp_path: Path, scheduler: str) -> None:
    got, stderr = _launched_checkpoint(tmp_path, scheduler, "--no-checkpoint")
    assert got == 0 and "checkpoint.every" not in stderr
    # The command line wins over the config file, and says what it changed.
    got, stderr = _launched_checkpoint(
        tmp_path, scheduler, "--no-checkpoint", "--set", "checkpoint.every=50"
    )
    assert got == 0 and "checkpoint.every is 50: --no-checkpoint sets it to 0" in stderr


@pytest.mark.parametrize(
    ("steps", "durable_every", "every"),
    [
        (20000, 0, 100),
        (20000, 1000, 100),
        (20000, 250, 50),  # the largest divisor of 250 not above 100
        (20000, 101, 101),  # a prime: its only divisor below 100 is 1, not every step
        (200, 30, 10),
        (200, 4, 4),
        (10, 0, 1),
    ],
)
def test_launch_checkpoint_every_divides_durable_every(
    steps: int, durable_every: int, every: int
) -> None:
    got = launch_checkpoint_every(steps, durable_every)
    assert got == every
    assert durable_every == 0 or durable_every % got == 0


def test_launch_default_checkpoint_is_valid_with_durable_every(tmp_path: Path) -> None:
    got, _ = _launched_checkpoint(
        tmp_path, "slurm", "--set", "train.steps=20000", "checkpoint.durable_every=250"
    )
    assert got == 50  # a multiple of it is what the config check asks for


def test_launched_job_killed_mid_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """What the default is for: the job's config, killed (SIGKILL, no chance to save) after step 5,
    then started again (a requeue), resumes from step 4 instead of step 0."""
    _launched_checkpoint(tmp_path, "slurm", "--set", "train.steps=40")  # every 2 steps
    config = str(tmp_path / "job.config.yaml")
    first = run_cli("train", config, cwd=tmp_path, env={"DTLAB_FAULTS": "kill@5"})
    assert first.returncode == -signal.SIGKILL, first.stderr
    second = run_cli("train", config, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    run_dir = Path(yaml.safe_load(Path(config).read_text())["run"]["dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["resumed_from"] or "").endswith("step-00000004"), summary["resumed_from"]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 41))


def _k8s(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    out = tmp_path / "job.yaml"
    proc = run_cli("launch", "k8s", *args, "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return list(yaml.safe_load_all(out.read_text()))


def _k8s_here(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    """``dtlab launch k8s`` in this process (the same parser and checks, without a Python start)."""
    out = tmp_path / "job.yaml"
    assert cli_main(["launch", "k8s", *args, "--out", str(out)]) == 0
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
    assert list(replicas) == ["Worker"] and replicas["Worker"]["replicas"] == 3
    pod = replicas["Worker"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["name"] == "pytorch" and c["image"] == "registry.example/dtlab:1"
    assert c["command"][:3] == ["python", "-m", "torch.distributed.run"]
    assert c["command"][-3:] == ["dtlab", "train", "/etc/dtlab/config.yaml"]
    assert c["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert c["resources"]["requests"] == {"memory": "64Gi"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "big-run-config"
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == "big-run-runs"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["config"] == "/etc/dtlab" and mounts["runs"] == "/runs"


@pytest.mark.parametrize(
    ("nodes", "nproc"), [(1, 1), (1, 4), (2, 1), (2, 8), (3, 2), (8, 8), (100, 1)]
)
def test_fault9_k8s_manifests_meet_the_operators_rules(
    tmp_path: Path, nodes: int, nproc: int
) -> None:
    """For every node count, the operator admits the job, and every pod's torchrun meets the others at
    one c10d rendezvous on a pod that exists, with the world size the config was checked for."""
    world = nodes * nproc
    docs = _k8s_here(
        tmp_path, "--nodes", str(nodes), "--nproc-per-node", str(nproc), "--image", "dtlab:cpu",
        "--set", "parallel.strategy=ddp", f"train.global_batch_size={world * 2}",
    )  # fmt: skip
    pods = check_job(docs, nodes, nproc)
    assert [p.name for p in pods] == [f"dtlab-worker-{i}" for i in range(nodes)]
    assert {p.torchrun["rdzv_endpoint"] for p in pods} == {"dtlab-worker-0:23456"}
    assert all(p.torchrun["nnodes"] == f"{nodes}:{nodes}" for p in pods)
    assert all(
        "MASTER_ADDR" not in p.env and "RANK" not in p.env for p in pods
    )  # c10d numbers ranks
    config = config_from_dict(yaml.safe_load(docs[0]["data"]["config.yaml"]))
    check_world(config, world)


def test_fault9_the_rules_reject_what_the_operator_rejects(tmp_path: Path) -> None:
    """The model of the operator fails where the operator (or torchrun) does: each change below to a
    good manifest is refused for the reason the operator gives."""
    good = _k8s_here(
        tmp_path, "--nodes", "2", "--image", "dtlab:cpu", "--set", "parallel.strategy=ddp"
    )
    check_job(good, 2, 1)

    def broken(change: Any) -> list[dict[str, Any]]:
        docs = copy.deepcopy(good)
        change(docs[-1])
        return docs

    def worker(job: dict[str, Any]) -> dict[str, Any]:
        return job["spec"]["pytorchReplicaSpecs"]["Worker"]

    def container(job: dict[str, Any]) -> dict[str, Any]:
        return worker(job)["template"]["spec"]["containers"][0]

    def flag_then_value(job: dict[str, Any]) -> None:
        container(job)["command"][3:3] = ["--nproc-per-node", "auto"]

    def master_only(job: dict[str, Any]) -> None:  # what dtlab wrote for one node before
        job["spec"]["pytorchReplicaSpecs"] = {"Master": {**worker(job), "replicas": 1}}

    cases = [
        (master_only, "Worker] must be configured if elastic policy is used"),
        (lambda j: worker(j).update(replicas=3), "nnodes 2:2 for 3 pods"),
        (flag_then_value, "nproc_per_node 'auto'"),
        (lambda j: j["spec"].pop("nprocPerNode"), "nproc_per_node 'auto'"),
        (lambda j: container(j).update(name="main"), "container named 'pytorch'"),
        (lambda j: container(j)["command"].insert(3, "--nnodes=1"), "nnodes 1 for 2 pods"),
        (
            lambda j: container(j)["command"].insert(3, "--rdzv-backend=c10d"),
            None,
        ),  # the same value
        (lambda j: container(j).setdefault("args", []).extend(["--nproc-per-node", "9"]), None),
        (lambda j: j["spec"]["elasticPolicy"].update(rdzvHost="head"), "'head' is not a pod"),
        (lambda j: j["spec"]["elasticPolicy"].update(rdzvPort=29400), "port 29400 is not a port"),
        (lambda j: j["spec"]["elasticPolicy"].update(rdzvBackend="etcd"), "backend 'etcd'"),
        (lambda j: j["metadata"].update(name="2024-run"), "not a DNS-1035 label"),
        (lambda j: j["metadata"].update(name="r" * 55), "is not a DNS-1035 label"),
    ]
    for change, reason in cases:
        if reason is None:  # harmless changes pass
            check_job(broken(change), 2, 1)
            continue
        with pytest.raises(Rejected, match=re.escape(reason)):
            check_job(broken(change), 2, 1)


def test_k8s_single_node_existing_claim(tmp_path: Path) -> None:
    docs = _k8s(tmp_path, "--image", "dtlab:cpu", "--pvc", "shared-runs", "--namespace", "ml")
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    job = docs[-1]
    assert job["metadata"]["namespace"] == "ml"
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]  # elastic jobs need a Worker
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["shared-runs"]
    check_job(docs, 1, 1)


@pytest.mark.parametrize(
    ("run_name", "nodes", "job_name"),
    [
        ("2024 sweep", 1, "dtlab-2024-sweep"),  # a DNS-1035 label starts with a letter
        ("Big_Run!", 1, "big-run"),
        ("x" * 100, 1, "x" * 54),  # <name>-worker-0 is at most 63 characters
        ("x" * 100, 10, "x" * 54),
        ("x" * 100, 11, "x" * 53),  # ... and <name>-worker-10 too
        ('"---"', 1, "dtlab"),  # quoted: a bare --- is a YAML document marker
    ],
)
def test_k8s_default_name_is_a_valid_job_name(
    tmp_path: Path, run_name: str, nodes: int, job_name: str
) -> None:
    docs = _k8s_here(
        tmp_path, "--nodes", str(nodes), "--image", "dtlab:cpu",
        "--set", f"run.name={run_name}", "parallel.strategy=ddp", "train.global_batch_size=660",
    )  # fmt: skip
    assert docs[-1]["metadata"]["name"] == job_name
    check_job(docs, nodes, 1)


@pytest.mark.parametrize("nodes", [1, 2])
def test_fault9_k8s_pods_rendezvous_and_train_with_the_operators_env(
    tmp_path: Path, nodes: int
) -> None:
    """Run each pod's command as written, with the environment the operator would give it and the
    rendezvous host mapped to loopback (there is no cluster DNS here): the pods meet and train."""
    docs = _k8s_here(
        tmp_path, "--nodes", str(nodes), "--image", "dtlab:cpu",
        "--set", *FAST, "parallel.strategy=ddp", "train.steps=3",
    )  # fmt: skip
    pods = check_job(docs, nodes, 1)
    port = str(_free_port())
    run_dir = run_pods(tmp_path, docs, pods, {"PET_RDZV_ENDPOINT": f"127.0.0.1:{port}"})
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == nodes


def run_pods(
    tmp_path: Path, docs: list[dict[str, Any]], pods: list[Any], loopback: dict[str, str]
) -> Path:
    """Run each pod's command as written, with the environment its operator gives it and
    ``loopback``'s variables mapping the rendezvous to this machine (there is no cluster DNS here),
    on the manifest's config with its run directory under ``tmp_path``; every pod must exit 0.
    Returns the run directory."""
    config = yaml.safe_load(docs[0]["data"]["config.yaml"])
    run_dir = tmp_path / "runs" / "dtlab"
    config["run"]["dir"] = str(run_dir)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    procs = []
    for pod in pods:
        command = [sys.executable, *pod.container["command"][1:]]
        assert command[-1] == "/etc/dtlab/config.yaml"
        command[-1] = str(config_file)
        procs.append(
            subprocess.Popen(
                command,
                env=cli_env({**pod.env, **loopback}),
                cwd=tmp_path,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(pods), "\n".join(outs)
    return run_dir


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--image", "dtlab", "--name", "Bad_Name"], "--name: 'Bad_Name' is not valid"),
        (["--image", "dtlab", "--name", "1job"], "starting with a letter (a DNS-1035 label)"),
        (
            [
                "--image",
                "dtlab",
                "--nodes",
                "11",
                "--name",
                "n" * 54,
                "--set",
                "train.global_batch_size=66",
            ],
            "is 54 characters; allowed: at most 53 with --nodes 11",
        ),
        (["--image", "dtlab x"], "--image: 'dtlab x' is not valid"),
        (["--image", "dtlab", "--memory", "lots"], "--memory: 'lots' is not valid"),
        ([], "--image"),
    ],
)
def test_bad_k8s_values_are_clear_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = run_cli("launch", "k8s", *args, "--set", "parallel.strategy=ddp", cwd=tmp_path)
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
    # Enough steps that the signal (sent once 3 steps are logged) finds the run training: 30 steps of
    # the debug model took 0.4 s, and a signal after the end stops nothing.
    steps = 300
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
    check_job(docs, nodes=2, nproc=2)  # what its header says it was written for

    # The configs inside validate against today's schema.
    config_from_dict(yaml.safe_load(docs[0]["data"]["config.yaml"]))
    config_from_dict(yaml.safe_load((ROOT / "deploy" / "slurm" / "demo.config.yaml").read_text()))


# The commands that wrote deploy/'s examples (a checkout at /shared/dtlab, seen by every node).
SLURM_EXAMPLE = ["configs/demo.yaml", "--nodes", "2", "--nproc-per-node", "2", "--time", "1:00:00",
                 "--python", "python3"]  # fmt: skip
K8S_EXAMPLE = ["configs/demo.yaml", "--nodes", "2", "--nproc-per-node", "2", "--image", "dtlab:cpu",
               "--cpu", "2", "--memory", "8Gi"]  # fmt: skip


def _without_example_lines(text: str) -> str:
    """The file without its ``# Example:`` comment (the command that wrote it, added by hand)."""
    lines = text.splitlines(keepends=True)
    keep, skip = [], False
    for line in lines:
        if line.startswith("# Example:"):
            skip = line.rstrip().endswith("\\")
            continue
        if skip:
            skip = line.rstrip().endswith("\\")
            continue
        keep.append(line)
    return "".join(keep)


def test_checked_in_examples_are_what_the_generators_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/slurm/demo.sbatch with its config and deploy/k8s/demo.yaml are what today's generators
    write for the demo config (paths under /shared/dtlab), so they cannot fall behind the code."""
    monkeypatch.chdir(ROOT)
    shared = tmp_path / "dtlab"
    out = shared / "deploy" / "slurm" / "demo.sbatch"
    assert cli_main(["launch", "slurm", *SLURM_EXAMPLE, "--out", str(out)]) == 0
    for name in ("demo.sbatch", "demo.config.yaml"):
        written = (out.parent / name).read_text().replace(str(shared), "/shared/dtlab")
        kept = _without_example_lines((ROOT / "deploy" / "slurm" / name).read_text())
        assert written == kept, f"deploy/slurm/{name} is stale: regenerate it"
    k8s = tmp_path / "demo.yaml"
    assert cli_main(["launch", "k8s", *K8S_EXAMPLE, "--out", str(k8s)]) == 0
    kept = _without_example_lines((ROOT / "deploy" / "k8s" / "demo.yaml").read_text())
    assert k8s.read_text() == kept, "deploy/k8s/demo.yaml is stale: regenerate it"
