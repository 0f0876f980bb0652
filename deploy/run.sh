#!/usr/bin/env bash
# Multi-node dtlab on any cluster: run this on every node with the same variables except NODE_RANK.
#
#   NPROC_PER_NODE  processes (GPUs) on this node        (default 1)
#   NNODES          number of nodes                      (default 1)
#   NODE_RANK       this node's rank, 0 .. NNODES-1       (default 0)
#   MASTER_ADDR     address of node 0, reachable by all  (default localhost)
#   MASTER_PORT     a free TCP port on node 0            (default 29500)
#   PYTHON          run `$PYTHON -m dtlab` instead of the `dtlab` command
#
# Arguments go to `dtlab train` (a config file, --set ..., --max-restarts ...). Example, two nodes:
#   node0$ NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 MASTER_ADDR=10.0.0.1 deploy/run.sh configs/fsdp.yaml
#   node1$ NNODES=2 NODE_RANK=1 NPROC_PER_NODE=8 MASTER_ADDR=10.0.0.1 deploy/run.sh configs/fsdp.yaml
set -euo pipefail

NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29500}"

if [[ -n "${PYTHON:-}" ]]; then
    cmd=("$PYTHON" -m dtlab)
else
    cmd=(dtlab)
fi
exec "${cmd[@]}" train "$@" \
    --nproc "$NPROC_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
