"""``dtlab launch k8s --api trainjob``: a Kubeflow Trainer v2 ``TrainJob`` (``trainer.kubeflow.org/
v1alpha1``, Trainer 2.3) with its training runtime.

Trainer v2 splits a job in two: a runtime (how a framework's job runs: a JobSet template and an ML
policy) and the TrainJob (this run's size, image and resources). By default the manifest holds a
namespaced ``TrainingRuntime`` of its own, ``<name>-runtime``, so the job needs nothing installed
beside the Trainer controller and states everything dtlab relies on: torch's ML policy, the ``node``
job whose pods run dtlab under torchrun, the volumes, the grace time to save on eviction, and a JobSet
failure policy that restarts the whole job (which resumes from its run directory). With ``--runtime
NAME`` the TrainJob refers to an installed ``ClusterTrainingRuntime`` (``torch-distributed``) instead,
and the volumes, node selectors, tolerations and grace time go in as a runtime patch.

The Trainer's torch plugin sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` (the pod's
completion index), ``PET_MASTER_ADDR`` (``<name>-node-0-0.<name>``) and ``PET_MASTER_PORT`` (29500)
in the container named ``node``; torchrun reads them (a static rendezvous on node 0), so the command
has no launch flag and the job's env sets none of them (the Trainer refuses those names).
"""

from __future__ import annotations

from typing import Any

from dtlab.deploy import K8sJob
from dtlab.deploy_k8s_pod import (
    named,
    pod_spec,
    resources,
    torchrun_command,
    volume_mounts,
)

TRAINER_API = "trainjob"
TRAINER_GROUP = "trainer.kubeflow.org"
TRAINER_VERSION = f"{TRAINER_GROUP}/v1alpha1"
NODE = "node"  # the replicated job and container the torch plugin fills in
ANCESTOR_LABEL = (
    f"{TRAINER_GROUP}/trainjob-ancestor-step"  # marks the job the TrainJob's trainer is
)
PATCH_MANAGER = "dtlab.io/launch"  # a runtime patch's owner: a domain-prefixed path


def trainjob_pod_suffix(nodes: int) -> str:
    """The last pod's name suffix: a TrainJob's JobSet names its pods
    ``<name>-node-<job index>-<pod index>``, one job of ``nodes`` pods."""
    return f"-{NODE}-0-{nodes - 1}"


def _env() -> list[dict[str, str]]:
    return [{"name": "PYTHONUNBUFFERED", "value": "1"}]


def _trainer(job: K8sJob, with_container: bool) -> dict[str, Any]:
    """The TrainJob's ``trainer``: the nodes, processes per node (a number: ``auto`` would be one
    process per GPU, or per CPU core on a CPU node, not the world the config was checked for) and
    each node's resources; with ``with_container`` also the image, command and env (a referenced
    runtime has its own)."""
    trainer: dict[str, Any] = {"numNodes": job.nodes, "numProcPerNode": job.nproc_per_node}
    if with_container:
        trainer |= {"image": job.image, "command": torchrun_command(), "env": _env()}
    res = resources(job)
    if res:
        trainer["resourcesPerNode"] = res
    return trainer


def _runtime(job: K8sJob, meta: dict[str, Any], claim: str) -> dict[str, Any]:
    """The job's own ``TrainingRuntime``: torch's ML policy and a JobSet of one ``node`` job whose
    pods run dtlab; a pod's failure fails its job at once (``backoffLimit: 0``, no restart in place:
    torchrun's static rendezvous cannot take one node back alone) and the JobSet restarts every
    job, up to ``--max-restarts`` times, resuming from the run directory."""
    name = meta["name"]
    container = {
        "name": NODE,
        "image": job.image,
        "imagePullPolicy": "IfNotPresent",
        "command": torchrun_command(),
        "env": _env(),
        "volumeMounts": volume_mounts(job),
    }
    pod = {**pod_spec(job, name, container, claim), "restartPolicy": "Never"}
    return {
        "apiVersion": TRAINER_VERSION,
        "kind": "TrainingRuntime",
        "metadata": {
            **named(meta, "runtime"),
            "labels": {**meta["labels"], f"{TRAINER_GROUP}/framework": "torch"},
        },
        "spec": {
            "mlPolicy": {"numNodes": job.nodes, "torch": {}},
            "template": {
                "spec": {
                    "failurePolicy": {"maxRestarts": job.max_restarts},
                    "replicatedJobs": [
                        {
                            "name": NODE,
                            "template": {
                                "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                                "spec": {"backoffLimit": 0, "template": {"spec": pod}},
                            },
                        }
                    ],
                }
            },
        },
    }


def _runtime_patch(job: K8sJob, name: str, claim: str) -> dict[str, Any]:
    """What a referenced ``ClusterTrainingRuntime``'s ``node`` pods get: the volumes and their
    mounts, where they may run and the grace time to save on eviction (the Trainer refuses env in
    a patch of the ``node`` container: it is the trainer's ``env``)."""
    pod = pod_spec(job, name, {"name": NODE, "volumeMounts": volume_mounts(job)}, claim)
    return {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}
                    ]
                }
            }
        },
    }


def trainjob_objects(job: K8sJob, meta: dict[str, Any], claim: str) -> list[dict[str, Any]]:
    """The TrainJob (and, without ``job.runtime``, the TrainingRuntime it runs on), the run
    directory on claim ``claim``."""
    name = meta["name"]
    spec: dict[str, Any] = {}
    docs: list[dict[str, Any]] = []
    if job.runtime is None:
        runtime = _runtime(job, meta, claim)
        docs.append(runtime)
        spec["runtimeRef"] = {
            "name": runtime["metadata"]["name"],
            "apiGroup": TRAINER_GROUP,
            "kind": "TrainingRuntime",
        }
        spec["trainer"] = _trainer(job, with_container=False)
    else:
        spec["runtimeRef"] = {
            "name": job.runtime,
            "apiGroup": TRAINER_GROUP,
            "kind": "ClusterTrainingRuntime",
        }
        spec["trainer"] = _trainer(job, with_container=True)
        spec["runtimePatches"] = [_runtime_patch(job, name, claim)]
    docs.append({"apiVersion": TRAINER_VERSION, "kind": "TrainJob", "metadata": meta, "spec": spec})
    return docs
