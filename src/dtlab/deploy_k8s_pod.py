"""What every ``dtlab launch k8s`` manifest is made of, whichever API runs it (a Kubeflow PyTorchJob,
a Kubeflow Trainer v2 TrainJob, or the batch Jobs of fault-tolerant replica groups): the ConfigMap with
the resolved config, the run directory's claim, the container that runs dtlab, and the pod around it
(volumes, node selectors, tolerations, extended resources).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

from dtlab.config import Config
from dtlab.deploy import K8sJob, check_value
from dtlab.errors import ConfigError

K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
K8S_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$")
K8S_LABEL_MAX = 63  # a pod's hostname and a Service's name are DNS labels
CONFIG_MOUNT = "/etc/dtlab"
RUNS_MOUNT = "/runs"
# A label key or extended resource name: an optional DNS-subdomain prefix and a name.
_QUALIFIED = re.compile(
    r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_RESERVED_MOUNTS = (CONFIG_MOUNT, RUNS_MOUNT, "/dev/shm")


def named(meta: dict[str, Any], suffix: str) -> dict[str, Any]:
    """The job's metadata for one of its objects, named ``<name>-<suffix>``."""
    return {**meta, "name": f"{meta['name']}-{suffix}"}


def check_pod_flags(job: K8sJob) -> None:
    """Refuse a namespace, claim, quantity, image, node selector, toleration, resource or volume that
    Kubernetes would not accept."""
    check_value(job.namespace, K8S_NAME, "--namespace", "lowercase letters, digits and '-'")
    check_value(job.pvc, K8S_NAME, "--pvc", "lowercase letters, digits and '-'")
    for flag, value in (("--cpu", job.cpu), ("--memory", job.memory), ("--storage", job.storage)):
        check_value(value, K8S_QUANTITY, flag, "a Kubernetes quantity such as 4, 500m, 16Gi")
    if not job.image or any(ch.isspace() for ch in job.image):
        raise ConfigError(f"--image: {job.image!r} is not valid; allowed: an image reference")
    node_selector(job)
    tolerations(job)
    extended_resources(job)
    extra_volumes(job)


def node_selector(job: K8sJob) -> dict[str, str]:
    """``--node-selector key=value`` flags as a pod's nodeSelector."""
    out: dict[str, str] = {}
    for item in job.node_selector:
        key, eq, value = item.partition("=")
        if not eq or not _QUALIFIED.match(key) or not _LABEL_VALUE.match(value):
            raise ConfigError(
                f"--node-selector: {item!r} is not valid; allowed: KEY=VALUE with a label key and "
                "value, e.g. nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"
            )
        out[key] = value
    return out


def tolerations(job: K8sJob) -> list[dict[str, str]]:
    """``--toleration key[=value][:effect]`` flags as a pod's tolerations (``Equal`` with a value,
    ``Exists`` without)."""
    out = []
    for item in job.tolerations:
        rest, colon, effect = item.rpartition(":") if ":" in item else (item, "", "")
        key, eq, value = rest.partition("=")
        if (
            not _QUALIFIED.match(key)
            or (eq and not _LABEL_VALUE.match(value))
            or (colon and effect not in _EFFECTS)
        ):
            raise ConfigError(
                f"--toleration: {item!r} is not valid; allowed: KEY[=VALUE][:EFFECT] with EFFECT one "
                f"of {', '.join(_EFFECTS)}, e.g. nvidia.com/gpu:NoSchedule"
            )
        t = {"key": key, "operator": "Equal" if eq else "Exists"}
        if eq:
            t["value"] = value
        if colon:
            t["effect"] = effect
        out.append(t)
    return out


def extended_resources(job: K8sJob) -> dict[str, str]:
    """``--resource name=quantity`` flags: extended resources (RDMA devices, ...) each pod asks for."""
    out: dict[str, str] = {}
    for item in job.resources:
        name, eq, quantity = item.partition("=")
        if (
            not eq
            or "/" not in name
            or not _QUALIFIED.match(name)
            or not K8S_QUANTITY.match(quantity)
        ):
            raise ConfigError(
                f"--resource: {item!r} is not valid; allowed: NAME=QUANTITY with a domain-prefixed "
                "resource name, e.g. rdma/ib=1 or nvidia.com/hostdev=4"
            )
        if name == "nvidia.com/gpu":
            raise ConfigError(f"--resource: {item!r}: set GPUs with --gpus-per-node")
        out[name] = quantity
    return out


def extra_volumes(job: K8sJob) -> list[tuple[str, str, bool]]:
    """``--volume claim:/mount[:ro]`` flags as (claim, mount path, read-only)."""
    out = []
    for item in job.volumes:
        claim, _, rest = item.partition(":")
        mount, _, mode = rest.partition(":")
        if (
            not K8S_NAME.match(claim)
            or not mount.startswith("/")
            or mode not in ("", "ro", "rw")
            or PurePosixPath(mount) in {PurePosixPath(m) for m in _RESERVED_MOUNTS}
        ):
            raise ConfigError(
                f"--volume: {item!r} is not valid; allowed: CLAIM:/MOUNT[:ro] with an existing "
                "PersistentVolumeClaim's name and an absolute path other than "
                f"{', '.join(_RESERVED_MOUNTS)}, e.g. weights:/weights:ro"
            )
        out.append((claim, mount, mode == "ro"))
    return out


def config_map(config: Config, meta: dict[str, Any]) -> dict[str, Any]:
    """The ConfigMap with the resolved config, whose run directory is the job's on the runs
    volume."""
    resolved = config.model_copy(deep=True)
    resolved.run.dir = f"{RUNS_MOUNT}/{meta['name']}"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": named(meta, "config"),
        "data": {"config.yaml": resolved.to_yaml()},
    }


def runs_claim(job: K8sJob, meta: dict[str, Any]) -> dict[str, Any]:
    """The PersistentVolumeClaim for the run directory, when ``job.pvc`` names none to reuse."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": named(meta, "runs"),
        "spec": {
            # Every node writes its checkpoint shards to the same run directory.
            "accessModes": ["ReadWriteMany" if job.nodes > 1 else "ReadWriteOnce"],
            "resources": {"requests": {"storage": job.storage}},
        },
    }


def resources(job: K8sJob) -> dict[str, Any]:
    """A pod's resources: the node's GPUs and extended resources as limits, CPU and memory as
    requests. Quantities are strings, as the API's schema types them."""
    out: dict[str, Any] = {}
    limits = {"nvidia.com/gpu": str(job.gpus_per_node)} if job.gpus_per_node else {}
    limits.update(extended_resources(job))
    if limits:
        out["limits"] = limits
    requests = {k: v for k, v in (("cpu", job.cpu), ("memory", job.memory)) if v}
    if requests:
        out["requests"] = requests
    return out


def volume_mounts(job: K8sJob) -> list[dict[str, Any]]:
    """The container's mounts: the config (read-only), the run directory, shared memory and the
    ``--volume`` claims."""
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "runs", "mountPath": RUNS_MOUNT},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    for i, (_, mount, read_only) in enumerate(extra_volumes(job)):
        mounts.append({"name": f"volume-{i}", "mountPath": mount, "readOnly": read_only})
    return mounts


def volumes(job: K8sJob, name: str, claim: str) -> list[dict[str, Any]]:
    """The pod's volumes, one for each of :func:`volume_mounts`."""
    out: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{name}-config"}},
        {"name": "runs", "persistentVolumeClaim": {"claimName": claim}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    for i, (extra, _, read_only) in enumerate(extra_volumes(job)):
        source = {"claimName": extra, **({"readOnly": True} if read_only else {})}
        out.append({"name": f"volume-{i}", "persistentVolumeClaim": source})
    return out


def scheduling(job: K8sJob) -> dict[str, Any]:
    """The pod spec's node selector and tolerations, where the flags give some."""
    out: dict[str, Any] = {}
    if job.node_selector:
        out["nodeSelector"] = node_selector(job)
    if job.tolerations:
        out["tolerations"] = tolerations(job)
    return out


def torchrun_command() -> list[str]:
    """torchrun with dtlab as its worker, on the mounted config; no launch flag: torchrun takes the
    node count, processes per node and rendezvous from the ``PET_*`` variables the operator sets,
    and a flag here would override them."""
    return [
        "python",
        "-m",
        "torch.distributed.run",
        "--module",
        "dtlab",
        "train",
        f"{CONFIG_MOUNT}/config.yaml",
    ]


def pod_spec(job: K8sJob, name: str, container: dict[str, Any], claim: str) -> dict[str, Any]:
    """A pod's spec: the container, its volumes, where it may run, and the time it has to save on
    eviction."""
    return {
        # On eviction the kubelet sends SIGTERM: the workers save a checkpoint before they exit,
        # and the restarted pod resumes from it. Give them time to write it.
        "terminationGracePeriodSeconds": job.grace_seconds,
        **scheduling(job),
        "containers": [container],
        "volumes": volumes(job, name, claim),
    }


# The config keys that name files a job reads: on Kubernetes each must be on a mounted volume (or in
# the image), or the pods do not find it.
_READ_PATHS = (
    "model.init_from",
    "data.paths",
    "data.val_paths",
    "data.tokenizer",
    "data.cache_dir",
)


def _config_paths(config: Config) -> list[tuple[str, str]]:
    """(key, path) of each local path the config names among :data:`_READ_PATHS`."""
    d = config.data
    named_paths = [("model.init_from", config.model.init_from), ("data.cache_dir", d.cache_dir)]
    named_paths += [(f"data.paths[{i}]", p) for i, p in enumerate(d.paths)]
    named_paths += [(f"data.val_paths[{i}]", p) for i, p in enumerate(d.val_paths)]
    if d.tokenizer not in ("bytes", "bpe"):
        named_paths.append(("data.tokenizer", d.tokenizer))
    return [(k, p) for k, p in named_paths if p and "://" not in p]


def unmounted_paths(config: Config, job: K8sJob) -> list[str]:
    """A line for each file the config reads that no volume of the job holds: such a path must be
    in the image, or the pods fail to find it (``model.init_from=/weights/...`` with no volume at
    /weights)."""
    mounts = [PurePosixPath(m) for _, m, _ in extra_volumes(job)] + [PurePosixPath(RUNS_MOUNT)]
    lines = []
    for key, path in _config_paths(config):
        p = PurePosixPath(path)
        if p.is_absolute() and any(p == m or m in p.parents for m in mounts):
            continue
        where = "a relative path (the image's working directory)" if not p.is_absolute() else path
        lines.append(
            f"{key}={path} is on no volume of the job ({where}): the pods find it only if the image "
            f"holds it; mount its claim with --volume CLAIM:{_mount_hint(p)}"
        )
    return lines


def _mount_hint(p: PurePosixPath) -> str:
    """Where a claim holding ``p`` would be mounted: its top directory, e.g. /weights."""
    return f"/{p.parts[1]}" if p.is_absolute() and len(p.parts) > 1 else "/data"
