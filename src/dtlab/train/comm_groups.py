"""Which collectives a step counts apart (``run.comm_bytes``): the process groups with a name of their
own, and the replica each rank belongs to, so that a collective whose group holds several replicas is
counted as crossing them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtlab.dims import ParallelDims
from dtlab.parallel.ft import GROUPS_PG_NAME

# The label of the collectives across fault-tolerant replica groups (torchft's).
REPLICA_GROUPS = "replica_groups"

if TYPE_CHECKING:
    from dtlab.parallel.dist import DistInfo
    from dtlab.train.diloco import DiLoCo


def replica_index(dims: ParallelDims, rank: int) -> int:
    """The replica global rank ``rank`` belongs to: its DiLoCo replica, or without DiLoCo its
    data-parallel index (tensor- and pipeline-parallel ranks of one model copy are one replica)."""
    if dims.diloco_enabled:
        return dims.coordinates(rank)["diloco"]
    return dims.dp_rank(rank)


def comm_labels(
    d: DistInfo, diloco: DiLoCo | None, replica_groups: int = 0
) -> tuple[dict[str, str], dict[str, int]]:
    """The process groups whose collectives are counted under a name of their own (group name ->
    label), and each label's group size: DiLoCo's outer syncs, the data-parallel groups inside
    its replicas, expert parallelism's groups, and under fault tolerance torchft's group across
    the ``replica_groups`` (:data:`REPLICA_GROUPS`; 0: no fault tolerance). Every other collective spans the world (a replica group's own)."""
    labels: dict[str, str] = {}
    sizes: dict[str, int] = {}
    if replica_groups:
        labels[GROUPS_PG_NAME], sizes[REPLICA_GROUPS] = REPLICA_GROUPS, replica_groups
    if diloco is not None and diloco.group is not None:
        labels[str(diloco.group.group_name)], sizes["diloco"] = "diloco", diloco.world
        # The replicas' agreement on a group of its own (syncs in flight): along the replicas too.
        labels[str(diloco.agreement.group_name)] = "diloco"
    if diloco is not None and diloco.replica[0] is not None:  # the step's agreement in a replica
        group, size = diloco.replica
        labels[str(group.group_name)], sizes["replica"] = "replica", size
    if d.dims.diloco_enabled:
        for name in d.dims.dp_mesh_dims:
            group = d.dims.mesh(d.device.type, name).get_group()
            if group.size() > 1:
                labels[str(group.group_name)], sizes[name] = name, group.size()
    if d.dims.cp_enabled:  # context parallelism's ring or all-to-alls
        group = d.dims.mesh(d.device.type, "cp").get_group()
        labels[str(group.group_name)], sizes["cp"] = "cp", group.size()
    if d.dims.ep_enabled:  # expert parallelism's all-to-alls, and its experts' all-reduce
        for name in ("ep", "ep_dp"):
            group = d.dims.expert_mesh(d.device.type, name).get_group()
            if group.size() > 1:
                labels[str(group.group_name)], sizes[name] = name, group.size()
    return labels, sizes
