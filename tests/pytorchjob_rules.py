"""What the Kubeflow training operator does with a kubeflow.org/v1 PyTorchJob, as a small model.

The tests apply it to the manifests ``dtlab launch k8s`` writes. It mirrors, by behaviour, the
operator's admission webhook (``pkg/webhooks/pytorch``), its defaulting (``pkg/apis/kubeflow.org/v1``,
``pytorch_defaults``) and the environment its controller gives each pod (``pkg/controller.v1/pytorch``:
``envvar``, ``elastic``, ``master``), as of training-operator v1.7 to v1.9; and then how torchrun reads
that environment. Each rule says which behaviour it mirrors.

    check_job(docs, nodes, nproc)  ->  the pods, with their env and resolved torchrun settings
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

MASTER, WORKER = "Master", "Worker"
CONTAINER = "pytorch"  # the operator's default container name
PORT_NAME = "pytorchjob-port"  # the operator's default port name
DEFAULT_PORT = 23456  # the operator's default port
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# torchrun options the operator's PET_* variables stand for (PET_<OPTION>, dashes as underscores).
TORCHRUN_ENV_OPTIONS = (
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
    "standalone", "max_restarts", "node_rank", "master_addr", "master_port",
)  # fmt: skip


class Rejected(AssertionError):
    """The operator (or torchrun) would not run this job as meant."""


@dataclass
class Pod:
    name: str  # also its hostname, and the name of the headless Service the operator creates for it
    replica_type: str
    index: int
    container: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    torchrun: dict[str, str] = field(
        default_factory=dict
    )  # option -> value, as torchrun resolves it

    def ports(self) -> dict[str, int]:
        return {p["name"]: int(p["containerPort"]) for p in self.container.get("ports", [])}


def admit(job: dict[str, Any]) -> None:
    """The validating webhook: raises Rejected with the operator's reason."""
    name = job["metadata"]["name"]
    # The job name must be a DNS-1035 label (lowercase, starts with a letter, at most 63 characters).
    if not DNS1035.match(name) or len(name) > 63:
        raise Rejected(f"metadata.name {name!r} is not a DNS-1035 label")
    spec = job["spec"]
    replicas = spec.get("pytorchReplicaSpecs")
    if not replicas:
        raise Rejected("spec.pytorchReplicaSpecs is required")
    # With an elasticPolicy a Worker replica is required (the rendezvous endpoint is derived from it).
    if spec.get("elasticPolicy") is not None and WORKER not in replicas:
        raise Rejected(
            "spec.pytorchReplicaSpecs[Worker] must be configured if elastic policy is used"
        )
    # The deprecated elasticPolicy.nProcPerNode must not be combined with spec.nprocPerNode.
    if (spec.get("elasticPolicy") or {}).get("nProcPerNode") is not None and "nprocPerNode" in spec:
        raise Rejected("elasticPolicy.nProcPerNode must not be used with spec.nprocPerNode")
    for rtype, rspec in replicas.items():
        # Only Master and Worker replica types exist.
        if rtype not in (MASTER, WORKER):
            raise Rejected(f"replica type {rtype!r} is not supported: Master, Worker")
        containers = (rspec or {}).get("template", {}).get("spec", {}).get("containers") or []
        # Every replica has containers, each with an image, and one of them is named "pytorch".
        if not containers:
            raise Rejected(f"{rtype}: containers must be specified")
        if any(not c.get("image") for c in containers):
            raise Rejected(f"{rtype}: every container needs an image")
        if not any(c.get("name") == CONTAINER for c in containers):
            raise Rejected(f"{rtype}: must have at least one container named {CONTAINER!r}")
        # A Master has exactly one replica; a Worker at least one.
        count = rspec.get("replicas")
        if rtype == MASTER and count != 1:
            raise Rejected("Master replicas must be 1")
        if rtype == WORKER and count is not None and count < 1:
            raise Rejected("Worker replicas must be at least 1")


def apply_defaults(job: dict[str, Any]) -> dict[str, Any]:
    """The defaulting the API server applies before the controller sees the job."""
    job = copy.deepcopy(job)
    spec = job["spec"]
    for rspec in spec["pytorchReplicaSpecs"].values():
        # Replicas default to 1.
        rspec.setdefault("replicas", 1)
        # The "pytorch" container gets the port named pytorchjob-port (23456) unless it declares it.
        for c in rspec["template"]["spec"]["containers"]:
            if c.get("name") == CONTAINER and not any(
                p.get("name") == PORT_NAME for p in c.get("ports", [])
            ):
                c.setdefault("ports", []).append({"name": PORT_NAME, "containerPort": DEFAULT_PORT})
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        # minReplicas / maxReplicas: each defaults to the other, both to the Worker replicas.
        lo, hi = elastic.get("minReplicas"), elastic.get("maxReplicas")
        workers = spec["pytorchReplicaSpecs"][WORKER]["replicas"]
        elastic["minReplicas"] = lo if lo is not None else (hi if hi is not None else workers)
        elastic["maxReplicas"] = hi if hi is not None else elastic["minReplicas"]
    # nprocPerNode defaults to "auto" unless the deprecated elasticPolicy.nProcPerNode is given.
    if elastic is None or elastic.get("nProcPerNode") is None:
        spec.setdefault("nprocPerNode", "auto")
    return job


def _port(job: dict[str, Any], rtype: str) -> int:
    # The operator reads the port named pytorchjob-port of the "pytorch" container of that replica.
    for c in job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]["containers"]:
        if c.get("name") == CONTAINER:
            for p in c.get("ports", []):
                if p.get("name") == PORT_NAME:
                    return int(p["containerPort"])
    raise Rejected(f"{rtype}: no port named {PORT_NAME!r} on the {CONTAINER!r} container")


def pod_env(job: dict[str, Any], rtype: str, index: int) -> dict[str, str]:
    """The variables the controller adds to a pod's "pytorch" container."""
    spec, name = job["spec"], job["metadata"]["name"]
    replicas = spec["pytorchReplicaSpecs"]
    env = {"PYTHONUNBUFFERED": "1"}
    total = sum(r["replicas"] for r in replicas.values())
    nproc = spec.get("nprocPerNode")
    if MASTER in replicas:
        # With a Master: MASTER_ADDR is the Master's pod, the port its pytorchjob-port, and ranks are
        # static (Master 0, Worker i -> i + 1); WORLD_SIZE counts 1 process per node unless
        # nprocPerNode is an integer.
        addr, port = f"{name}-master-0", str(_port(job, MASTER))
        rank = index + 1 if rtype == WORKER else index
        per_node = int(nproc) if nproc is not None and nproc.isdigit() else 1
        env.update(
            MASTER_ADDR=addr, PET_MASTER_ADDR=addr, MASTER_PORT=port, PET_MASTER_PORT=port,
            WORLD_SIZE=str(total * per_node), RANK=str(rank), PET_NODE_RANK=str(rank),
        )  # fmt: skip
    if nproc is not None:
        env["PET_NPROC_PER_NODE"] = nproc
    elastic = spec.get("elasticPolicy")
    if elastic is None:
        env["PET_NNODES"] = str(total)
        return env
    # Elastic: the rendezvous endpoint is rdzvHost (default: the first Worker's pod) and rdzvPort
    # (default: the Worker's pytorchjob-port); it is the same for every pod, Master included.
    host = elastic.get("rdzvHost") or f"{name}-worker-0"
    port = elastic.get("rdzvPort") or _port(job, WORKER)
    env["PET_RDZV_ENDPOINT"] = f"{host}:{port}"
    env["PET_RDZV_BACKEND"] = elastic.get("rdzvBackend") or "c10d"
    env["PET_NNODES"] = f"{elastic['minReplicas']}:{elastic['maxReplicas']}"
    if elastic.get("maxRestarts") is not None:
        env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
    if elastic.get("nProcPerNode") is not None:
        env["PET_NPROC_PER_NODE"] = str(elastic["nProcPerNode"])
    if elastic.get("rdzvId") is not None:
        env["PET_RDZV_ID"] = elastic["rdzvId"]
    if elastic.get("standalone"):
        env["PET_STANDALONE"] = ""
    return env


def torchrun_settings(container: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    """How ``python -m torch.distributed.run`` resolves its options: a flag on the command line wins,
    else the PET_<OPTION> variable, else its own default."""
    command = list(container.get("command", [])) + list(container.get("args", []))
    if command[1:3] != ["-m", "torch.distributed.run"]:
        raise Rejected(f"the container does not start torchrun: {command}")
    settings = {
        "nnodes": "1:1",
        "nproc_per_node": "1",
        "rdzv_backend": "static",
        "max_restarts": "0",
    }
    for option in TORCHRUN_ENV_OPTIONS:
        value = env.get(f"PET_{option.upper()}")
        if value is not None:
            settings[option] = value
    words = iter(command[3:])
    for word in words:
        if word in ("-m", "--module") or not word.startswith("--"):
            if not word.startswith("-"):
                break  # the script (or module) name: the rest are its own arguments
            continue
        option, eq, value = word[2:].partition("=")
        option = option.replace("-", "_")
        if option == "standalone":
            settings[option] = ""
        elif option in TORCHRUN_ENV_OPTIONS:
            settings[option] = value if eq else next(words)
    return settings


def check_job(docs: list[dict[str, Any]], nodes: int, nproc: int) -> list[Pod]:
    """Admit, default and expand the PyTorchJob in ``docs`` as the operator would, and check that its
    ``nodes`` pods meet at one rendezvous that exists, with ``nproc`` processes each."""
    (job,) = [d for d in docs if d.get("kind") == "PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    admit(job)
    job = apply_defaults(job)
    spec, name = job["spec"], job["metadata"]["name"]
    pods = []
    for rtype, rspec in spec["pytorchReplicaSpecs"].items():
        (container,) = [
            c for c in rspec["template"]["spec"]["containers"] if c["name"] == CONTAINER
        ]
        for i in range(rspec["replicas"]):
            pod = Pod(f"{name}-{rtype.lower()}-{i}", rtype, i, container, pod_env(job, rtype, i))
            pod.torchrun = torchrun_settings(container, {**_own_env(container), **pod.env})
            pods.append(pod)
    by_name = {p.name: p for p in pods}
    # The operator names each pod and its headless Service <job>-<type>-<index>; a Service name is a
    # DNS-1035 label, so it is at most 63 characters.
    for p in pods:
        if len(p.name) > 63 or not DNS1035.match(p.name):
            raise Rejected(f"pod/Service name {p.name!r} is not a DNS-1035 label")
    endpoints = {p.torchrun.get("rdzv_endpoint") for p in pods}
    for p in pods:
        t = p.torchrun
        # c10d: a TCP store on the endpoint; the pod whose hostname is the endpoint's host serves it.
        if t["rdzv_backend"] != "c10d":
            raise Rejected(f"{p.name}: rendezvous backend {t['rdzv_backend']!r}, not c10d")
        if "rdzv_endpoint" not in t:
            raise Rejected(f"{p.name}: no rendezvous endpoint")
        host, _, port = t["rdzv_endpoint"].rpartition(":")
        # Reachable only if it is a pod of this job: the operator's Services give exactly those names.
        if host not in by_name:
            raise Rejected(f"{p.name}: rendezvous host {host!r} is not a pod of this job")
        if int(port) not in by_name[host].ports().values():
            raise Rejected(f"{p.name}: rendezvous port {port} is not a port of {host}")
        # The number of pods must lie in torchrun's min:max, or the rendezvous never completes (too
        # few) or leaves nodes waiting (too many); dtlab asks for exactly `nodes`.
        lo, _, hi = t["nnodes"].partition(":")
        if not int(lo) <= len(pods) <= int(hi or lo) or int(lo) != nodes:
            raise Rejected(f"{p.name}: nnodes {t['nnodes']} for {len(pods)} pods, {nodes} wanted")
        # "auto" is one process per GPU, or per CPU core on a CPU node: not the world checked here.
        if t["nproc_per_node"] != str(nproc):
            raise Rejected(f"{p.name}: nproc_per_node {t['nproc_per_node']!r}, not {nproc}")
    if len(endpoints) != 1:
        raise Rejected(f"pods disagree on the rendezvous endpoint: {sorted(map(str, endpoints))}")
    if len(pods) != nodes:
        raise Rejected(f"{len(pods)} pods for {nodes} nodes")
    return pods


def _own_env(container: dict[str, Any]) -> dict[str, str]:
    # Variables the manifest sets itself; the operator appends its own after them, and the last
    # definition of a name wins in a container.
    return {e["name"]: str(e.get("value", "")) for e in container.get("env", [])}
