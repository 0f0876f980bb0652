"""``dtlab train --nproc N``: start N workers through torch's elastic launcher (torchrun semantics).

Each worker is ``python -m dtlab train ...`` again; it sees the launcher's environment (RANK,
WORLD_SIZE, TORCHELASTIC_RUN_ID, ...) and runs as a worker instead of launching.
"""

from __future__ import annotations

import logging
import sys
import uuid
from dataclasses import dataclass

from dtlab.errors import Preempted


@dataclass(frozen=True)
class LaunchSpec:
    """What the launcher needs: how many processes on how many nodes, and where to meet."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0


def launch(spec: LaunchSpec, worker_args: list[str], module: str = "dtlab") -> int:
    """Run ``python -m <module> <worker_args>`` in ``spec.nproc`` local processes; returns an exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The elastic agent logs every restart and failure at length; the workers print their own errors.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    if spec.nnodes == 1 and spec.master_addr is None and spec.master_port is None:
        # Single node: a c10d store on a free local port, like `torchrun --standalone`.
        endpoint, run_id, rdzv_configs = (
            "localhost:0",
            f"dtlab-{uuid.uuid4().hex[:8]}",
            {"is_host": True},
        )
    else:
        endpoint = f"{spec.master_addr or 'localhost'}:{spec.master_port or 29500}"
        run_id, rdzv_configs = (
            f"dtlab-{spec.master_port or 29500}",
            {"is_host": spec.node_rank == 0},
        )
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=spec.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        # The agent passes the signals it handles on to the workers (which save a checkpoint and stop);
        # SIGUSR1, which Slurm can send ahead of a time limit, is not among torch's defaults.
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", module, *worker_args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        # Preempted: every rank saved before any exited (they meet after the commit), so ranks the agent
        # then terminated on its way out (negative codes: killed by a signal) lost nothing.
        if Preempted.exit_code in codes and all(c == Preempted.exit_code or c < 0 for c in codes):
            return Preempted.exit_code  # the workers said where they saved
        failures = ", ".join(
            f"rank {r} (exit code {f.exitcode})" for r, f in sorted(e.failures.items())
        )
        print(f"error: training failed on {failures}; see the messages above", file=sys.stderr)
        return 1
    except SignalException as e:
        # The launcher itself was signalled: the agent passed the signal on and waited for the workers.
        print(
            f"stopped by {e.sigval.name}: the workers saved a checkpoint if they could (see above); "
            "run the same command to resume",
            file=sys.stderr,
        )
        return Preempted.exit_code
    except RendezvousError as e:
        # e.g. the port is taken, or the other nodes never arrived: a setup problem, not a crash.
        print(
            f"error: could not start the process group at {endpoint} "
            f"(--master-addr/--master-port): {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 1
    return 0
