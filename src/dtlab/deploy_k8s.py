"""``dtlab launch k8s``: a Kubeflow PyTorchJob for a run, or a Kubeflow Trainer v2 TrainJob
(:mod:`dtlab.deploy_trainer`), and with ``parallel.fault_tolerance`` a lighthouse Deployment and
Service with one Job per replica group.

Like the Slurm generator (:mod:`dtlab.deploy`), it writes the resolved config beside the manifest,
with a fixed run directory; commands are argument lists, never a shell string.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dtlab import __version__
from dtlab.config import Config
from dtlab.deploy import K8sJob, cannot_write, check_value, replica_layout, slug
from dtlab.deploy_k8s_pod import (
    CONFIG_MOUNT,
    K8S_DNS1035,
    K8S_LABEL_MAX,
    K8S_NAME,
    RUNS_MOUNT,
    check_pod_flags,
    config_map,
    pod_spec,
    resources,
    runs_claim,
    torchrun_command,
    volume_mounts,
)
from dtlab.deploy_trainer import TRAINER_API, trainjob_objects, trainjob_pod_suffix
from dtlab.errors import ConfigError

# What the Kubeflow training operator (kubeflow.org/v1 PyTorchJob) expects; see docs/deploy.md.
K8S_CONTAINER = (
    "pytorch"  # the operator reads ports from, and sets PET_* variables in, this container
)
K8S_PORT_NAME = "pytorchjob-port"  # the port it takes the rendezvous port from
K8S_PORT = 23456  # the operator's default for that port
APIS = ("pytorchjob", TRAINER_API)


def _pod_suffix(nodes: int, api: str = "pytorchjob") -> str:
    """The suffix of the last pod's name (and hostname): ``-worker-<N-1>`` for a PyTorchJob."""
    return trainjob_pod_suffix(nodes) if api == TRAINER_API else f"-worker-{nodes - 1}"


def k8s_job_name(run_name: str, nodes: int, api: str = "pytorchjob") -> str:
    """A job name from ``run.name``: a DNS-1035 label (it starts with a letter) short enough that the
    operator's pod and Service names (``<name>-worker-<index>``; a TrainJob's ``<name>-node-0-<index>``)
    stay valid labels."""
    base = slug(run_name, K8S_LABEL_MAX)
    if not base[0].isalpha():
        base = f"dtlab-{base}"
    limit = K8S_LABEL_MAX - len(_pod_suffix(nodes, api))
    return base[:limit].rstrip("-")


def _check_k8s_job(job: K8sJob, name: str) -> None:
    """Refuse an API, name, namespace, claim, quantity, image or pod setting that Kubernetes would
    not accept."""
    if job.api not in APIS:
        raise ConfigError(f"--api: {job.api!r} is not valid; allowed: {', '.join(APIS)}")
    if job.runtime is not None and job.api != TRAINER_API:
        raise ConfigError(
            f"--runtime: {job.runtime!r} names a Trainer v2 runtime; it goes with --api {TRAINER_API}"
        )
    check_value(job.runtime, K8S_NAME, "--runtime", "a ClusterTrainingRuntime's name")
    check_value(
        name,
        K8S_DNS1035,
        "--name",
        "lowercase letters, digits and '-', starting with a letter (a DNS-1035 label)",
    )
    suffix = _pod_suffix(job.nodes, job.api)
    limit = K8S_LABEL_MAX - len(suffix)
    if len(name) > limit:
        raise ConfigError(
            f"--name: {name!r} is {len(name)} characters; allowed: at most {limit} with --nodes "
            f"{job.nodes} (pods and their Services are named {name[:8]}...{suffix}, "
            f"at most {K8S_LABEL_MAX} characters)"
        )
    check_pod_flags(job)


def _container(job: K8sJob) -> dict[str, Any]:
    """The container that runs torchrun with dtlab as its worker, on the config and runs volumes."""
    return {
        "name": K8S_CONTAINER,
        "image": job.image,
        "imagePullPolicy": "IfNotPresent",
        # torchrun takes the node count, processes per node, rendezvous backend and endpoint and the
        # restart budget from the PET_* variables the operator derives from elasticPolicy and
        # nprocPerNode; a flag here would override them, so there is none. dtlab runs as its worker.
        "command": torchrun_command(),
        # Declared, not left to the operator's defaulting: worker 0 serves the rendezvous on it.
        "ports": [{"name": K8S_PORT_NAME, "containerPort": K8S_PORT}],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": resources(job),
        "volumeMounts": volume_mounts(job),
    }


def _pod(job: K8sJob, name: str, container: dict[str, Any], claim: str) -> dict[str, Any]:
    """The pod template: the container, its volumes and the time it has to save on eviction."""
    return {"spec": pod_spec(job, name, container, claim)}


def k8s_manifest(config: Config, job: K8sJob, name: str) -> str:
    """A ConfigMap with the resolved config, a PersistentVolumeClaim for the run directory (unless
    ``job.pvc`` names an existing one) and a Kubeflow ``PyTorchJob`` whose containers run dtlab (with
    ``job.api`` ``trainjob``: a Trainer v2 ``TrainJob`` and its runtime, :mod:`dtlab.deploy_trainer`).

    The job has ``job.nodes`` Worker replicas and no Master, for every node count. With an
    ``elasticPolicy`` the operator only admits jobs with a Worker replica, and it points every pod's
    rendezvous (``PET_RDZV_ENDPOINT``) at ``<name>-worker-0`` on the Worker's ``pytorchjob-port``;
    torchrun's c10d rendezvous then numbers the nodes, so no replica needs to be special.
    """
    _check_k8s_job(job, name)
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/managed-by": "dtlab"}}
    if job.namespace:
        meta["namespace"] = job.namespace
    docs: list[dict[str, Any]] = [config_map(config, meta)]
    if job.pvc is None:
        docs.append(runs_claim(job, meta))
    claim = job.pvc or f"{name}-runs"
    if job.api == TRAINER_API:
        if config.parallel.fault_tolerance.enabled:
            raise ConfigError(
                f"--api {TRAINER_API}: parallel.fault_tolerance is enabled, whose replica groups run "
                "as a lighthouse and one batch Job per group, not as a TrainJob; leave out --api "
                f"{TRAINER_API}"
            )
        docs += trainjob_objects(job, meta, claim)
    else:
        container = _container(job)
        pod = _pod(job, name, container, claim)
        if config.parallel.fault_tolerance.enabled:
            docs += _k8s_fault_tolerant(config, job, name, meta, container, pod)
        else:
            docs.append(_pytorchjob(job, meta, pod))
    header = f"# Written by `dtlab launch k8s` (dtlab {__version__}). Apply: kubectl apply -f <this file>\n"
    return header + yaml.safe_dump_all(docs, sort_keys=False)


LIGHTHOUSE_PORT = 29510  # the k8s lighthouse Service's port; the start store is on the next one


def _lighthouse_container(container: dict[str, Any]) -> dict[str, Any]:
    """The lighthouse's container: dtlab's image, listening for the groups and their start store."""
    return {
        **container,
        "name": "lighthouse",
        # Every interface of its pod: the groups' pods reach it through the Service.
        "command": [
            "python",
            "-m",
            "dtlab.fault_tolerance",
            "--lighthouse",
            f"0.0.0.0:{LIGHTHOUSE_PORT}",
            "--store-port",
            str(LIGHTHOUSE_PORT + 1),
            "--config",
            f"{CONFIG_MOUNT}/config.yaml",
        ],
        "ports": [
            {"name": "lighthouse", "containerPort": LIGHTHOUSE_PORT},
            {"name": "start-store", "containerPort": LIGHTHOUSE_PORT + 1},
        ],
        "resources": {},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}],
    }


def _lighthouse_objects(
    name: str, meta: dict[str, Any], labels: dict[str, str], container: dict[str, Any]
) -> list[dict[str, Any]]:
    """The job's own lighthouse: a Deployment (restarted on its own) and the Service the groups
    reach it through."""
    lh_name = f"{name}-lighthouse"
    lh_labels = {**labels, "dtlab.io/role": "lighthouse"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**meta, "name": lh_name, "labels": lh_labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": lh_labels},
            "template": {
                "metadata": {"labels": lh_labels},
                "spec": {
                    "containers": [_lighthouse_container(container)],
                    "volumes": [{"name": "config", "configMap": {"name": f"{name}-config"}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**meta, "name": lh_name, "labels": lh_labels},
        "spec": {
            "selector": lh_labels,
            "ports": [
                {"name": "lighthouse", "port": LIGHTHOUSE_PORT},
                {"name": "start-store", "port": LIGHTHOUSE_PORT + 1},
            ],
        },
    }
    return [deployment, service]


@dataclass(frozen=True)
class _ReplicaGroups:
    """What each replica group's Job is made of: the job's metadata, labels, container and pod, the
    groups' shape, and where they find the lighthouse (``start_store``: the job's own lighthouse's
    start store, None with a given lighthouse)."""

    name: str
    meta: dict[str, Any]
    labels: dict[str, str]
    container: dict[str, Any]
    pod: dict[str, Any]
    resources: dict[str, Any]
    replicas: int
    group: int
    max_restarts: int
    lighthouse: str
    start_store: str | None


def _group_resources(job: K8sJob, container: dict[str, Any], group: int) -> dict[str, Any]:
    """A group's pod's resources: the container's, with the GPUs of the group's ranks as a limit."""
    out = dict(container["resources"])
    if job.gpus_per_node:
        gpus = job.gpus_per_node * group // job.nproc_per_node
        out["limits"] = {**out["limits"], "nvidia.com/gpu": str(gpus)}
    return out


def _group_env(groups: _ReplicaGroups, i: int) -> list[dict[str, Any]]:
    """Group ``i``'s environment: its index, the group count and where the lighthouse is."""
    env = [
        *groups.container["env"],
        {"name": "DTLAB_FT_REPLICA", "value": str(i)},
        {"name": "DTLAB_FT_REPLICAS", "value": str(groups.replicas)},
        {"name": "TORCHFT_LIGHTHOUSE", "value": groups.lighthouse},
        {"name": "RUST_LOG", "value": "warn"},
        # The pod's own IP: where the other groups reach this group's manager.
        {"name": "DTLAB_FT_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if groups.start_store is not None:
        env.append({"name": "DTLAB_FT_START_STORE", "value": groups.start_store})
    return env


def _group_container(groups: _ReplicaGroups, i: int) -> dict[str, Any]:
    """Group ``i``'s container: the group's agent, which trains in its own run directory."""
    run_dir = f"{RUNS_MOUNT}/{groups.name}/replica-{i}"
    return {
        **groups.container,
        "command": [
            "python",
            "-m",
            "dtlab.fault_tolerance",
            "--nproc",
            str(groups.group),
            "--max-restarts",
            str(groups.max_restarts),
            "--run-dir",
            run_dir,
            "--",
            "train",
            f"{CONFIG_MOUNT}/config.yaml",
            "--set",
            f"run.dir={run_dir}",
        ],
        "ports": [],
        "env": _group_env(groups, i),
        "resources": groups.resources,
    }


def _replica_group_job(groups: _ReplicaGroups, i: int) -> dict[str, Any]:
    """The batch Job of replica group ``i``, which Kubernetes recreates alone when its pod is
    lost."""
    group_labels = {**groups.labels, "dtlab.io/role": "replica-group", "dtlab.io/replica": str(i)}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {**groups.meta, "name": f"{groups.name}-replica-{i}", "labels": group_labels},
        "spec": {
            # The agent in the pod restarts the group's ranks; a lost pod (node failure,
            # eviction) is recreated by the Job, this group alone.
            "backoffLimit": groups.max_restarts,
            "template": {
                "metadata": {"labels": group_labels},
                "spec": {
                    **groups.pod["spec"],
                    "restartPolicy": "Never",
                    "containers": [_group_container(groups, i)],
                },
            },
        },
    }


def _k8s_fault_tolerant(
    config: Config,
    job: K8sJob,
    name: str,
    meta: dict[str, Any],
    container: dict[str, Any],
    pod: dict[str, Any],
) -> list[dict[str, Any]]:
    """A fault-tolerant job's objects: the lighthouse (a Deployment and its Service, so that it is
    restarted on its own and no replica group is special) and one batch Job per replica group, whose
    pod runs the group's own agent (rank restarts) and which Kubernetes recreates alone when the
    pod is lost (``backoffLimit``); both bounded by parallel.fault_tolerance.max_restarts."""
    o = config.parallel.fault_tolerance
    replicas, group = replica_layout(config, job.nodes, job.nproc_per_node)
    labels = {**meta.get("labels", {}), "dtlab.io/job": name}
    lh_name = f"{name}-lighthouse"
    docs: list[dict[str, Any]] = []
    if o.lighthouse is None:
        docs += _lighthouse_objects(name, meta, labels, container)
    groups = _ReplicaGroups(
        name=name,
        meta=meta,
        labels=labels,
        container=container,
        pod=pod,
        resources=_group_resources(job, container, group),
        replicas=replicas,
        group=group,
        max_restarts=o.max_restarts,
        lighthouse=o.lighthouse or f"http://{lh_name}:{LIGHTHOUSE_PORT}",
        start_store=f"{lh_name}:{LIGHTHOUSE_PORT + 1}" if o.lighthouse is None else None,
    )
    docs += [_replica_group_job(groups, i) for i in range(replicas)]
    docs.append(_network_policy(name, meta, labels))
    return docs


def _network_policy(name: str, meta: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """Only the job's own pods reach its pods: the lighthouse, the groups' manager servers, their
    stores and the checkpoint servers that stream the model and optimizer state to a recovering
    peer listen without authentication of their own (torchft's), so a process elsewhere in the
    cluster must not reach them (enforced where the cluster's network plugin enforces policies)."""
    job = {"dtlab.io/job": labels["dtlab.io/job"]}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {**meta, "name": f"{name}-job-only", "labels": labels},
        "spec": {
            "podSelector": {"matchLabels": job},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": job}}]}],
        },
    }


def _pytorchjob(job: K8sJob, meta: dict[str, Any], pod: dict[str, Any]) -> dict[str, Any]:
    """The Kubeflow PyTorchJob of a job without fault tolerance: ``job.nodes`` Worker replicas."""
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": meta,
        "spec": {
            # A number, never the default "auto": torchrun reads auto as one process per GPU, or
            # per CPU core on a CPU node, and the config was checked for nodes x nproc ranks.
            "nprocPerNode": str(job.nproc_per_node),
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                # min = max = the Worker replicas: the rendezvous waits for every node, and the
                # world size is the one the config was checked for.
                "minReplicas": job.nodes,
                "maxReplicas": job.nodes,
                "maxRestarts": job.max_restarts,
            },
            "runPolicy": {"cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": job.nodes,
                    "restartPolicy": "OnFailure",
                    "template": pod,
                }
            },
        },
    }


def write_k8s(config: Config, job: K8sJob, out: Path, name: str | None = None) -> Path:
    """Write the manifest; returns its path."""
    text = k8s_manifest(config, job, name or k8s_job_name(config.run.name, job.nodes))
    try:
        path = out.resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except (OSError, ValueError) as e:
        raise cannot_write(out, e) from None
    return path
