"""Which GPU each process of a node trains on: one GPU per process, never two processes on one (unless
``parallel.backend`` is ``gloo``, chosen on purpose: gloo lets ranks share a GPU, NCCL does not).

Pure arithmetic (no CUDA needed), so that the launching process can refuse a world its node's GPUs
cannot hold before any worker starts, and every worker checks the same rule again at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from dtlab.errors import DtlabError

__all__ = ["check_gpus", "gpu_for", "group_gpus", "replica_group_gpu_env", "visible_gpus"]


def check_gpus(nproc: int, gpus: int, where: str) -> None:
    """Refuse ``nproc`` processes on a node of ``gpus`` GPUs when there are more processes than GPUs.

    Two ranks on one GPU is what ``local_rank % device_count`` would give; NCCL refuses it (a duplicate
    GPU), and even where it did not, the ranks would share one GPU's memory and time. ``where`` says
    where ``nproc`` and ``gpus`` came from, for the message.
    """
    if nproc > gpus:
        raise DtlabError(
            f"{nproc} processes per node but {gpus} GPU{'s' if gpus != 1 else ''} {where}: "
            f"each process needs a GPU of its own (NCCL refuses two ranks on one GPU); allowed: at "
            f"most {gpus} process{'es' if gpus != 1 else ''} per node, train.device=cpu, or "
            "parallel.backend=gloo (ranks then share GPUs)"
        )


def gpu_for(local_rank: int, local_world: int, gpus: int, share: bool = False) -> int:
    """The GPU of local rank ``local_rank`` among ``local_world`` processes on a node with ``gpus``
    visible GPUs: its own index (a DtlabError when the node has fewer GPUs than processes), or with
    ``share`` (gloo, chosen on purpose) ``local_rank % gpus``."""
    if share:
        return local_rank % gpus
    # A local rank beyond the node's size (a launcher's odd numbering) needs as many GPUs as well.
    nproc = max(local_world, local_rank + 1)
    check_gpus(nproc, gpus, "visible to this node's workers (torch.cuda.device_count())")
    return local_rank


def check_node_gpus(device: str, backend: str, nproc: int) -> None:
    """Before ``dtlab train --nproc N`` starts its workers: refuse more processes than this node's GPUs
    when they would train on CUDA (``train.device`` ``cuda``, or ``auto`` where CUDA is available),
    unless ``parallel.backend`` is ``gloo``."""
    import torch

    if device == "cpu" or backend == "gloo" or not torch.cuda.is_available():
        return  # on the CPU (a cuda request without CUDA is refused by the workers' device choice)
    check_gpus(nproc, torch.cuda.device_count(), "visible on this node (torch.cuda.device_count())")


def check_job_gpus(device: str, backend: str, nproc_per_node: int, gpus_per_node: int) -> None:
    """Before ``dtlab launch`` writes a job: refuse more processes per node than the GPUs it requests
    per node (``--gpus-per-node``; 0 requests none and is not checked), unless it trains on the CPU or
    ``parallel.backend`` is ``gloo``."""
    if device != "cpu" and backend != "gloo" and gpus_per_node > 0:
        check_gpus(nproc_per_node, gpus_per_node, "requested per node (--gpus-per-node)")


def visible_gpus(env: Mapping[str, str], count: int) -> list[str]:
    """This node's GPUs as CUDA names them to a child of this process: the entries of a user's
    ``CUDA_VISIBLE_DEVICES`` (indices, UUIDs or MIG names), else ``0`` .. ``count - 1``."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [name.strip() for name in listed.split(",") if name.strip()][:count]


def group_gpus(
    visible: Sequence[str], replicas: int, group: int, share: bool = False
) -> list[list[str]] | None:
    """Each of ``replicas`` replica groups' own GPUs: group ``i`` gets the ``group`` GPUs after the
    first ``i * group`` of ``visible``, so that no two groups' ranks (each group's local ranks are
    0 .. group-1) land on one GPU. More ranks than GPUs are refused, unless ``share`` (gloo, chosen on
    purpose): then None, every group sees every GPU and its ranks share them as one world's would."""
    ranks = replicas * group
    if ranks > len(visible):
        if share:
            return None
        check_gpus(
            ranks, len(visible),
            f"visible on this node for {replicas} replica groups of {group} rank"
            f"{'s' * (group > 1)} (torch.cuda.device_count(), CUDA_VISIBLE_DEVICES)",
        )  # fmt: skip
    return [list(visible[i * group : (i + 1) * group]) for i in range(replicas)]


def replica_group_gpu_env(
    device: str, backend: str, replicas: int, group: int
) -> list[dict[str, str]]:
    """The environment each replica group's agent adds so that its ranks train on GPUs of their own
    (``CUDA_VISIBLE_DEVICES``: the group's slice of this node's GPUs); nothing on the CPU (``train.device``
    ``cpu``, or ``auto`` without CUDA)."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return [{} for _ in range(replicas)]
    visible = visible_gpus(os.environ, torch.cuda.device_count())
    slices = group_gpus(visible, replicas, group, share=backend == "gloo")
    if slices is None:
        return [{} for _ in range(replicas)]
    return [{"CUDA_VISIBLE_DEVICES": ",".join(s)} for s in slices]
