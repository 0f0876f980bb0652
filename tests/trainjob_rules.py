"""What Kubeflow Trainer v2 (2.3) does with a ``trainer.kubeflow.org/v1alpha1`` TrainJob, as a small model.

The tests apply it to the manifests ``dtlab launch k8s --api trainjob`` writes:

- **the CRD schema**: every TrainJob and TrainingRuntime is read by the API's own models, generated
  from the same OpenAPI schema as the CRDs (the ``kubeflow-trainer-api`` package), typed strictly; a
  field the schema does not have is dropped there, so a manifest that does not read back the same is
  refused with the field named. Then the CRDs' validation rules (CEL, ``x-kubernetes-validations``)
  that a written manifest can break: the job's name (a DNS-1035 label of at most 63 characters).
- **the admission webhook** (``pkg/runtime/framework/plugins``): the runtime referenced exists (in the
  manifest, or the ``torch-distributed`` ClusterTrainingRuntime an install has); a runtime patch's
  manager is a domain-prefixed path and patches only jobs and containers the runtime has, never the
  ``node`` container's env; the trainer's env sets none of the torch plugin's reserved names.
- **the torch plugin** (``plugins/torch``): the trainer is the container ``node`` of the job labelled
  ``trainjob-ancestor-step: trainer``; it gets ``PET_NNODES`` (``numNodes``), ``PET_NPROC_PER_NODE``
  (``numProcPerNode``, else ``auto``), ``PET_NODE_RANK`` (the pod's completion index),
  ``PET_MASTER_ADDR`` (``<name>-node-0-0.<name>``) and ``PET_MASTER_PORT`` (29500).
- **the JobSet**: one job of ``numNodes`` pods, hostnames ``<name>-node-0-<index>`` (DNS labels)
  under the JobSet's headless Service ``<name>``; the pod's volumes and mounts agree.
- then how torchrun reads that environment (:func:`pytorchjob_rules.torchrun_settings`).

    check_trainjob(docs, nodes, nproc)  ->  the pods, with their env and resolved torchrun settings
"""

from __future__ import annotations

import copy
import re
from typing import Any

from kubeflow_trainer_api.models import (
    TrainerV1alpha1TrainingRuntime,
    TrainerV1alpha1TrainJob,
)
from pydantic import ValidationError

from pytorchjob_rules import Pod, Rejected, torchrun_settings

API = "trainer.kubeflow.org/v1alpha1"
NODE = "node"
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
MASTER_PORT = 29500  # the Trainer's ContainerTrainerPort
RESERVED_ENV = {
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
}
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DOMAIN_PATH = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[A-Za-z0-9._~-]+)+$")

# The ClusterTrainingRuntime a Trainer install ships (charts/.../runtimes/torch-distributed.yaml),
# as far as the plugins read it: one "node" job, trainer ancestor, a "node" container.
TORCH_DISTRIBUTED = {
    "apiVersion": API,
    "kind": "ClusterTrainingRuntime",
    "metadata": {"name": "torch-distributed"},
    "spec": {
        "mlPolicy": {"numNodes": 1, "torch": {}},
        "template": {
            "spec": {
                "replicatedJobs": [
                    {
                        "name": NODE,
                        "template": {
                            "metadata": {"labels": {ANCESTOR: "trainer"}},
                            "spec": {
                                "template": {
                                    "spec": {
                                        "containers": [
                                            {"name": NODE, "image": "pytorch/pytorch:2.13.0"}
                                        ]
                                    }
                                }
                            },
                        },
                    }
                ]
            }
        },
    },
}


def _strip_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _strip_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_strip_none(v) for v in x]
    return x


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The first path where ``a`` (the manifest) has what ``b`` (as the schema read it) lacks."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a:
            if k not in b:
                return f"{path}.{k}"
            d = _first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else path


def check_schema(doc: dict[str, Any]) -> None:
    """Read ``doc`` with the API's model of its kind: a wrong type is refused, and so is a field the
    schema does not have (the model drops it: the document does not read back the same)."""
    model = {"TrainJob": TrainerV1alpha1TrainJob, "TrainingRuntime": TrainerV1alpha1TrainingRuntime}
    cls = model.get(doc.get("kind", ""))
    if cls is None or doc.get("apiVersion") != API:
        raise Rejected(f"{doc.get('apiVersion')}/{doc.get('kind')} is not a Trainer v2 kind here")
    try:
        read = cls.from_dict(copy.deepcopy(doc))
    except ValidationError as e:
        raise Rejected(f"{doc['kind']}: the schema refuses it: {e.errors()[0]}") from None
    assert read is not None
    back = _strip_none(read.to_dict())
    where = _first_difference(doc, back)
    if where is not None:
        raise Rejected(f"{doc['kind']}: unknown field {where}")


def _admit_name(job: dict[str, Any]) -> None:
    # The CRD's rules on metadata.name (x-kubernetes-validations).
    name = job["metadata"]["name"]
    if not DNS1035.match(name):
        raise Rejected("metadata.name must match RFC 1035 DNS label format")
    if len(name) > 63:
        raise Rejected("metadata.name must be no more than 63 characters")


def _runtime_of(job: dict[str, Any], docs: list[dict[str, Any]]) -> dict[str, Any]:
    ref = job["spec"]["runtimeRef"]
    kind = ref.get("kind", "ClusterTrainingRuntime")
    if ref.get("apiGroup", "trainer.kubeflow.org") != "trainer.kubeflow.org":
        raise Rejected(f"runtimeRef.apiGroup {ref['apiGroup']!r} is not supported")
    if kind == "ClusterTrainingRuntime":
        if ref["name"] != TORCH_DISTRIBUTED["metadata"]["name"]:
            raise Rejected(f"ClusterTrainingRuntime {ref['name']!r} is not installed")
        return TORCH_DISTRIBUTED
    for d in docs:
        if d.get("kind") == kind and d["metadata"]["name"] == ref["name"]:
            if d["metadata"].get("namespace") != job["metadata"].get("namespace"):
                raise Rejected("a TrainingRuntime must be in the TrainJob's namespace")
            return d
    raise Rejected(f"specified trainingRuntime {ref['name']!r} must be created before the TrainJob")


def _jobs(runtime: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {j["name"]: j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]}


def _containers(rjob: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in rjob["template"]["spec"]["template"]["spec"]["containers"]}


def _admit_patches(job: dict[str, Any], runtime: dict[str, Any]) -> None:
    """The webhook's checks of runtimePatches (jobset plugin's Validate)."""
    jobs = _jobs(runtime)
    for patch in job["spec"].get("runtimePatches", []):
        if not DOMAIN_PATH.match(patch["manager"]):
            raise Rejected(f"manager {patch['manager']!r} is not a domain-prefixed path")
        spec = patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {})
        for rjob in spec.get("replicatedJobs", []):
            if rjob["name"] not in jobs:
                raise Rejected(
                    "must not have replicated job that doesn't exist in the runtime job template"
                )
            pod = rjob.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            have = _containers(jobs[rjob["name"]])
            for c in pod.get("containers", []):
                if c["name"] not in have:
                    raise Rejected(
                        f"must not have container that doesn't exist in the runtime job {rjob['name']}"
                    )
                if c.get("env") and c["name"] == NODE:
                    raise Rejected(
                        "must not have envs for the dataset-initializer, model-initializer, node containers"
                    )


def _merge_list(
    base: list[dict[str, Any]], patch: list[dict[str, Any]], key: str
) -> list[dict[str, Any]]:
    out = {x[key]: copy.deepcopy(x) for x in base}
    for x in patch:
        out[x[key]] = {**out.get(x[key], {}), **x}
    return list(out.values())


def _patched_pod(runtime: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """The trainer's pod spec after the runtime patches (a strategic merge: lists keyed by name)."""
    pod = copy.deepcopy(_jobs(runtime)[NODE]["template"]["spec"]["template"]["spec"])
    for patch in job["spec"].get("runtimePatches", []):
        spec = patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {})
        for rjob in spec.get("replicatedJobs", []):
            p = rjob.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            for k, v in p.items():
                if k == "containers":
                    for c in v:
                        (mine,) = [x for x in pod["containers"] if x["name"] == c["name"]]
                        for ck, cv in c.items():
                            if ck == "volumeMounts":
                                mine[ck] = _merge_list(mine.get(ck, []), cv, "mountPath")
                            elif ck != "name":
                                mine[ck] = cv
                elif k == "volumes":
                    pod[k] = _merge_list(pod.get(k, []), v, "name")
                elif k == "tolerations":
                    pod[k] = [*pod.get(k, []), *v]
                else:
                    pod[k] = v
    return pod


def check_trainjob(docs: list[dict[str, Any]], nodes: int, nproc: int) -> list[Pod]:
    """Validate, admit and expand the TrainJob in ``docs`` as Trainer 2.3 would, and check that its
    ``nodes`` pods meet at one rendezvous that exists, with ``nproc`` processes each."""
    (job,) = [d for d in docs if d.get("kind") == "TrainJob"]
    for d in docs:
        if d.get("apiVersion") == API:
            check_schema(d)
    _admit_name(job)
    runtime = _runtime_of(job, docs)
    if "torch" not in runtime["spec"].get("mlPolicy", {}):
        raise Rejected("the runtime has no torch ML policy: no PET_* variables are set")
    _admit_patches(job, runtime)
    trainer = job["spec"].get("trainer", {})
    reserved = sorted(RESERVED_ENV & {e["name"] for e in trainer.get("env", [])})
    if reserved:
        raise Rejected(f"must not have reserved envs, invalid envs configured: {reserved}")
    rjob = _jobs(runtime).get(NODE)
    if (
        rjob is None
        or rjob["template"].get("metadata", {}).get("labels", {}).get(ANCESTOR) != "trainer"
    ):
        raise Rejected("the runtime has no trainer job (label trainjob-ancestor-step: trainer)")
    pod = _patched_pod(runtime, job)
    containers = {c["name"]: c for c in pod["containers"]}
    if NODE not in containers:
        raise Rejected("the trainer job has no container named 'node': no PET_* variables are set")
    container = copy.deepcopy(containers[NODE])
    for k in ("image", "command", "args"):
        if k in trainer:
            container[k] = trainer[k]
    if "resourcesPerNode" in trainer:
        container["resources"] = trainer["resourcesPerNode"]
    # Volumes and mounts agree (the API server refuses a mount of no volume).
    have = {v["name"] for v in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        if m["name"] not in have:
            raise Rejected(f"volumeMounts: {m['name']!r} is not a volume of the pod")
    if pod.get("restartPolicy", "OnFailure") not in ("Never", "OnFailure"):
        raise Rejected("a Job's pods restart Never or OnFailure")
    name = job["metadata"]["name"]
    count = trainer.get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
    procs = trainer.get("numProcPerNode")
    gpus = int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
    if procs is None:  # "auto": one per GPU, or per CPU core
        procs = "auto" if gpus else "<cpu cores>"
    own = {
        e["name"]: str(e.get("value", ""))
        for e in [*container.get("env", []), *trainer.get("env", [])]
    }
    pods = []
    for i in range(count):
        hostname = f"{name}-{NODE}-0-{i}"
        if len(hostname) > 63 or not DNS1035.match(hostname):
            raise Rejected(f"pod hostname {hostname!r} is not a DNS label")
        env = {
            **own,
            "PET_NNODES": str(count),
            "PET_NPROC_PER_NODE": str(procs),
            "PET_NODE_RANK": str(i),
            "PET_MASTER_ADDR": f"{name}-{NODE}-0-0.{name}",
            "PET_MASTER_PORT": str(MASTER_PORT),
        }
        p = Pod(hostname, NODE, i, container, env)
        p.torchrun = torchrun_settings(container, env)
        pods.append(p)
    hosts = {f"{p.name}.{name}" for p in pods}
    for p in pods:
        t = p.torchrun
        if t["rdzv_backend"] == "static":
            # node 0 serves the store on master_addr:master_port; every node has a distinct rank
            if t.get("master_addr") not in hosts:
                raise Rejected(
                    f"{p.name}: master {t.get('master_addr')!r} is not a pod of this job"
                )
            if t.get("node_rank") != str(p.index):
                raise Rejected(f"{p.name}: node_rank {t.get('node_rank')!r}, not {p.index}")
        else:
            raise Rejected(
                f"{p.name}: rendezvous backend {t['rdzv_backend']!r} (the plugin sets a static one)"
            )
        lo, _, hi = t["nnodes"].partition(":")
        if int(lo) != nodes or int(hi or lo) != nodes or count != nodes:
            raise Rejected(f"{p.name}: nnodes {t['nnodes']} for {count} pods, {nodes} wanted")
        if t["nproc_per_node"] != str(nproc):
            raise Rejected(f"{p.name}: nproc_per_node {t['nproc_per_node']!r}, not {nproc}")
    return pods
