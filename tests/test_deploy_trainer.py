"""``dtlab launch k8s --api trainjob``: Kubeflow Trainer v2 TrainJobs that the Trainer admits (its
CRD schema, its webhook's rules and its torch plugin, modelled in ``trainjob_rules``), whose pods meet
and train with the environment the plugin gives them; and the pod settings every manifest takes
(node selectors, tolerations, extended resources, volumes for the data and the weights)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import FAST, read_metrics, run_cli
from dtlab.cli import main as cli_main
from dtlab.config import check_world, config_from_dict
from pytorchjob_rules import Rejected, check_job
from test_deploy import _free_port, run_pods
from trainjob_rules import check_schema, check_trainjob

ROOT = Path(__file__).resolve().parent.parent


def _launch(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    """``dtlab launch k8s`` in this process (the same parser and checks, without a Python start)."""
    out = tmp_path / "job.yaml"
    assert cli_main(["launch", "k8s", *args, "--out", str(out)]) == 0
    return list(yaml.safe_load_all(out.read_text()))


def _trainjob(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    return _launch(tmp_path, "--api", "trainjob", "--image", "dtlab:cpu", *args)


def _kinds(docs: list[dict[str, Any]]) -> list[str]:
    return [d["kind"] for d in docs]


def _node_pod(runtime: dict[str, Any]) -> dict[str, Any]:
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    pod: dict[str, Any] = rjob["template"]["spec"]["template"]["spec"]
    return pod


def test_a_two_node_fsdp_trainjob_with_site_settings(tmp_path: Path) -> None:
    """2 nodes x 8 GPUs, FSDP, a container image, node selector, toleration, RDMA devices and the
    weights' claim: the Trainer admits it, and each setting is where the Trainer reads it."""
    docs = _trainjob(
        tmp_path, "--nodes", "2", "--nproc-per-node", "8", "--gpus-per-node", "8",
        "--node-selector", "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
        "--toleration", "nvidia.com/gpu:NoSchedule", "--resource", "rdma/ib=1",
        "--volume", "weights:/weights:ro", "--memory", "200Gi", "--namespace", "ml",
        "--set", "run.name=fsdp", "parallel.strategy=fsdp", "train.global_batch_size=32",
        "model.init_from=/weights/llama",
    )  # fmt: skip
    assert _kinds(docs) == ["ConfigMap", "PersistentVolumeClaim", "TrainingRuntime", "TrainJob"]
    pods = check_trainjob(docs, 2, 8)
    assert [p.name for p in pods] == ["fsdp-node-0-0", "fsdp-node-0-1"]
    assert {p.torchrun["master_addr"] for p in pods} == {"fsdp-node-0-0.fsdp"}
    _, _, runtime, job = docs
    assert job["spec"]["runtimeRef"] == {
        "name": "fsdp-runtime", "apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
    }  # fmt: skip
    assert runtime["metadata"]["namespace"] == job["metadata"]["namespace"] == "ml"
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 8
    assert trainer["resourcesPerNode"] == {
        "limits": {"nvidia.com/gpu": "8", "rdma/ib": "1"}, "requests": {"memory": "200Gi"},
    }  # fmt: skip
    pod = _node_pod(runtime)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 300
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/weights"]["readOnly"] is True and "/runs" in mounts and "/etc/dtlab" in mounts
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {"fsdp-runs", "weights"}
    # A failed pod fails the JobSet's job at once, and the JobSet restarts the whole job.
    assert runtime["spec"]["template"]["spec"]["failurePolicy"] == {"maxRestarts": 3}
    config = config_from_dict(yaml.safe_load(docs[0]["data"]["config.yaml"]))
    assert config.run.dir == "/runs/fsdp"
    check_world(config, 16)


@pytest.mark.parametrize(
    ("nodes", "nproc"), [(1, 1), (1, 4), (2, 1), (2, 8), (3, 2), (8, 8), (100, 1)]
)
@pytest.mark.parametrize("runtime", [None, "torch-distributed"])
def test_trainjobs_meet_the_trainers_rules(
    tmp_path: Path, nodes: int, nproc: int, runtime: str | None
) -> None:
    """For every node count, with the manifest's own runtime or the installed torch-distributed one,
    the Trainer admits the job and every pod's torchrun meets the others on node 0."""
    extra = ["--runtime", runtime] if runtime else []
    docs = _trainjob(
        tmp_path, "--nodes", str(nodes), "--nproc-per-node", str(nproc), *extra,
        "--set", "parallel.strategy=ddp", f"train.global_batch_size={nodes * nproc * 2}",
    )  # fmt: skip
    pods = check_trainjob(docs, nodes, nproc)
    assert len({p.torchrun["master_addr"] for p in pods}) == 1
    assert sorted(p.torchrun["node_rank"] for p in pods) == sorted(str(i) for i in range(nodes))
    if runtime:
        assert "TrainingRuntime" not in _kinds(docs)
        (patch,) = docs[-1]["spec"]["runtimePatches"]
        assert patch["manager"] == "dtlab.io/launch"


def test_the_rules_reject_what_the_trainer_rejects(tmp_path: Path) -> None:
    """The model of the Trainer fails where the Trainer (or torchrun) does: each change below to a
    good manifest is refused for the Trainer's reason."""
    own = _trainjob(tmp_path, "--nodes", "2", "--set", "parallel.strategy=ddp")
    patched = _trainjob(
        tmp_path, "--nodes", "2", "--runtime", "torch-distributed", "--volume", "data:/data",
        "--set", "parallel.strategy=ddp",
    )  # fmt: skip
    check_trainjob(own, 2, 1)
    check_trainjob(patched, 2, 1)

    def trainer(docs: list[dict[str, Any]]) -> dict[str, Any]:
        t: dict[str, Any] = docs[-1]["spec"]["trainer"]
        return t

    def node_patch(docs: list[dict[str, Any]]) -> dict[str, Any]:
        (patch,) = docs[-1]["spec"]["runtimePatches"]
        (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        pod: dict[str, Any] = rjob["template"]["spec"]["template"]["spec"]
        return pod

    def runtime_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
        return _node_pod(docs[-2])

    cases: list[tuple[list[dict[str, Any]], Any, str | None]] = [
        (own, lambda d: trainer(d).update(numProcs=1), "unknown field .spec.trainer.numProcs"),
        (own, lambda d: trainer(d).update(numNodes="2"), "schema refuses"),
        (
            own,
            lambda d: d[-1]["spec"]["trainer"].pop("numProcPerNode"),
            "nproc_per_node '<cpu cores>'",
        ),
        (own, lambda d: d[-1]["spec"]["trainer"].update(numNodes=3), "nnodes 3 for 3 pods"),
        (
            own,
            lambda d: d[-1]["spec"]["trainer"].update(env=[{"name": "PET_NNODES", "value": "2"}]),
            "must not have reserved envs",
        ),
        (
            own,
            lambda d: runtime_pod(d)["containers"][0].update(name="main"),
            "no container named 'node'",
        ),
        (own, lambda d: d[-2]["spec"]["mlPolicy"].pop("torch"), "no torch ML policy"),
        (own, lambda d: d[-1]["spec"]["runtimeRef"].update(name="other"), "must be created before"),
        (own, lambda d: d[-1]["metadata"].update(name="2024-run"), "RFC 1035 DNS label"),
        (own, lambda d: d[-1]["metadata"].update(name="r" * 64), "no more than 63 characters"),
        (own, lambda d: d[-1]["metadata"].update(name="r" * 56), "is not a DNS label"),
        (
            own,
            lambda d: runtime_pod(d)["containers"][0]["volumeMounts"].append(
                {"name": "nope", "mountPath": "/x"}
            ),
            "'nope' is not a volume",
        ),
        (
            patched,
            lambda d: d[-1]["spec"]["runtimePatches"][0].update(manager="dtlab"),
            "domain-prefixed",
        ),
        (
            patched,
            lambda d: node_patch(d)["containers"][0].update(env=[{"name": "A", "value": "1"}]),
            "must not have envs",
        ),
        (
            patched,
            lambda d: node_patch(d)["containers"][0].update(name="main"),
            "doesn't exist in the runtime job",
        ),
        (patched, lambda d: d[-1]["spec"]["runtimeRef"].update(name="other"), "is not installed"),
        (own, lambda d: trainer(d).update(image="dtlab:2"), None),  # harmless: an override
    ]
    for good, change, reason in cases:
        docs = copy.deepcopy(good)
        change(docs)
        if reason is None:
            check_trainjob(docs, 2, 1)
            continue
        with pytest.raises(Rejected, match=re.escape(reason)):
            check_trainjob(docs, 2, 1)


def test_the_schema_check_reads_the_apis_own_models() -> None:
    """The schema check is the API's: a field of the wrong type or one the API lacks is named."""
    good = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "a"},
        "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": {"numNodes": 2}},
    }
    check_schema(good)
    bad = copy.deepcopy(good)
    bad["spec"]["trainer"]["command"] = "python -m dtlab"  # a string, not a list
    with pytest.raises(Rejected, match="schema refuses"):
        check_schema(bad)
    bad = copy.deepcopy(good)
    bad["spec"]["podTemplateOverrides"] = []  # not in Trainer 2.3's TrainJob
    with pytest.raises(Rejected, match=r"unknown field \.spec\.podTemplateOverrides"):
        check_schema(bad)


@pytest.mark.parametrize("runtime", [None, "torch-distributed"])
def test_trainjob_pods_rendezvous_and_train_with_the_plugins_env(
    tmp_path: Path, runtime: str | None
) -> None:
    """Run each pod's command as the Trainer would start it, with the torch plugin's environment and
    the master host mapped to loopback (there is no cluster DNS here): the two pods meet and train."""
    extra = ["--runtime", runtime] if runtime else []
    docs = _trainjob(
        tmp_path, "--nodes", "2", *extra, "--set", *FAST, "parallel.strategy=ddp", "train.steps=3"
    )
    pods = check_trainjob(docs, 2, 1)
    port = str(_free_port())
    run_dir = run_pods(
        tmp_path, docs, pods, {"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port}
    )
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2


def test_pod_settings_reach_a_pytorchjob_too(tmp_path: Path) -> None:
    """The same flags on the kubeflow.org/v1 PyTorchJob: its pods get them, and the operator's rules
    still hold."""
    docs = _launch(
        tmp_path, "--image", "dtlab:cpu", "--nodes", "2", "--node-selector", "pool=gpu",
        "--toleration", "dedicated=ml:NoExecute", "--resource", "rdma/ib=2",
        "--volume", "data:/data", "--set", "parallel.strategy=ddp",
    )  # fmt: skip
    check_job(docs, 2, 1)
    pod = docs[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"}
    ]
    (c,) = pod["containers"]
    assert c["resources"]["limits"] == {"rdma/ib": "2"}
    assert {"name": "volume-0", "mountPath": "/data", "readOnly": False} in c["volumeMounts"]


def test_a_path_the_job_reads_on_no_volume_is_named(tmp_path: Path) -> None:
    """``model.init_from=/weights/...`` with no volume at /weights: the command names the key and
    the flag that mounts it; with the claim mounted, nothing is said."""
    args = ["launch", "k8s", "--api", "trainjob", "--image", "dtlab:cpu", "--out", "job.yaml"]
    keys = [
        "--set",
        "model.init_from=/weights/llama",
        "data.source=files",
        "data.paths=[/data/a.txt]",
    ]
    proc = run_cli(*args, *keys, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "model.init_from=/weights/llama is on no volume of the job" in proc.stderr
    assert "--volume CLAIM:/weights" in proc.stderr
    assert "data.paths[0]=/data/a.txt is on no volume" in proc.stderr
    proc = run_cli(
        *args, "--volume", "weights:/weights:ro", "--volume", "corpus:/data", *keys, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "on no volume" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--node-selector", "pool"], "--node-selector: 'pool' is not valid; allowed: KEY=VALUE"),
        (["--toleration", "gpu:Sometimes"], "--toleration: 'gpu:Sometimes' is not valid"),
        (["--resource", "ib=1"], "--resource: 'ib=1' is not valid"),
        (["--resource", "nvidia.com/gpu=8"], "set GPUs with --gpus-per-node"),
        (["--volume", "data"], "--volume: 'data' is not valid; allowed: CLAIM:/MOUNT[:ro]"),
        (["--volume", "data:/runs"], "--volume: 'data:/runs' is not valid"),
        (["--runtime", "torch-distributed"], "--runtime: 'torch-distributed' names a Trainer v2"),
        (["--api", "trainjob", "--runtime", "Bad_Name"], "--runtime: 'Bad_Name' is not valid"),
        (
            [
                "--api",
                "trainjob",
                "--nproc-per-node",
                "2",
                "--set",
                "parallel.fault_tolerance.enabled=true",
            ],
            "not as a TrainJob; leave out --api trainjob",
        ),
    ],
)
def test_bad_pod_flags_are_clear_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = run_cli(
        "launch", "k8s", "--image", "dtlab", *args, "--set", "parallel.strategy=ddp", cwd=tmp_path
    )
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())


def _docs_block(heading: str) -> tuple[str, str]:
    """(the command, the YAML) that docs/deploy.md shows under ``heading``."""
    text = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    command = re.search(r"```bash\n(dtlab launch k8s .*?)\n```", section, re.S)
    manifest = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert command and manifest, heading
    return command.group(1).replace("\\\n", " "), manifest.group(1)


@pytest.mark.parametrize(
    "heading", ["### A Trainer v2 TrainJob", "### The same job as a PyTorchJob"]
)
def test_the_docs_manifests_are_what_the_command_writes(tmp_path: Path, heading: str) -> None:
    """docs/deploy.md's 2-node x 8-GPU FSDP manifests (a container and site settings) are what the
    quoted command writes (the config map aside), and the Trainer's or the operator's rules admit
    them."""
    command, shown = _docs_block(heading)
    docs = _launch(tmp_path, *command.split()[3:])
    written = [d for d in docs if d["kind"] != "ConfigMap"]
    assert list(yaml.safe_load_all(shown)) == written
    if "TrainJob" in _kinds(docs):
        check_trainjob(docs, 2, 8)
    else:
        check_job(docs, 2, 8)
