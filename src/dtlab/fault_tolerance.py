"""``dtlab train --nproc N`` with ``parallel.fault_tolerance``: a lighthouse and one elastic agent per
replica group, each group its own world that its agent restarts alone.

    dtlab train (this process)      the lighthouse (torchft's, on 127.0.0.1) and a start store
      replica 0: python -m dtlab.fault_tolerance --replica 0 ...  -> its elastic agent -> its ranks
      replica 1: ...                                               (run.dir/replica-1, ...)

Each group trains in its own run directory (``<run.dir>/replica-<i>``: its metrics, checkpoints and
summary), and this process writes ``<run.dir>/fault_tolerance.json``, how each group ended. The groups
meet through the lighthouse (:mod:`dtlab.parallel.ft`); when a group has finished the run, the
others have ``timeout_s`` (plus a margin) to finish too, and are then stopped (a group still
recovering then would otherwise train the last steps alone: it stops at its next quorum).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from dtlab.config import Config
from dtlab.errors import DtlabError
from dtlab.launcher import LaunchSpec, _loopback_store, failure_grace_s, launch
from dtlab.metrics.ft_summary import RUN_SUMMARY_ENV, run_summary, run_summary_table
from dtlab.parallel.devices import replica_group_gpu_env
from dtlab.parallel.ft import (
    FINISHED_KEY,
    HOST_ENV,
    LIGHTHOUSE_ENV,
    REPLICA_ENV,
    REPLICAS_ENV,
    START_STORE_ENV,
    replica_groups,
    require_torchft,
    start_store,
)
from dtlab.runtime import forkserver
from dtlab.runtime.lifeline import die_with_parent, started_here
from dtlab.runtime.proctitle import set_process_title

# After the first group finishes, how long the others have beyond parallel.fault_tolerance.timeout_s.
FINISH_MARGIN_S = 20.0
# The interpreter each group's agent starts its ranks with: the fork server's shim (warm_restart).
WORKER_PYTHON_ENV = "DTLAB_FT_WORKER_PYTHON"


def replica_dir(run_dir: Path, replica: int) -> Path:
    """Replica group ``replica``'s own run directory."""
    return run_dir / f"replica-{replica}"


def start_lighthouse(config: Config) -> tuple[Any, str]:
    """torchft's lighthouse on 127.0.0.1 (nothing beyond this machine reaches it): (server, address)."""
    from torchft.coordination import LighthouseServer  # (RUST_LOG set by launch_replicas)

    o = config.parallel.fault_tolerance
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=o.min_replicas,
        # A quorum waits this long for a group it hears from that has not asked to join yet.
        join_timeout_ms=int(o.timeout_s * 1000),
        quorum_tick_ms=50,
        heartbeat_timeout_ms=int(o.heartbeat_timeout_s * 1000),
    )
    # It names itself by this machine's host name; the groups reach it where it listens.
    port = str(server.address()).rsplit(":", 1)[1]
    return server, f"http://127.0.0.1:{port}"


def _with_override(worker_args: list[str], override: str) -> list[str]:
    """``worker_args`` (``train [CONFIG] [--set K=V ...]``) with one more ``--set`` override, last."""
    if "--set" in worker_args:
        return [*worker_args, override]
    return [*worker_args, "--set", override]


def launch_replicas(spec: LaunchSpec, config: Config, worker_args: list[str], run_dir: Path) -> int:
    """Train with fault-tolerant replica groups on this machine; returns the exit code: 0 when a
    group finished the run, else the groups' (75 when every group stopped with a checkpoint)."""
    if spec.nnodes > 1:
        raise DtlabError(
            f"--nnodes {spec.nnodes} with parallel.fault_tolerance: dtlab train starts the replica "
            "groups of one machine; on several, start them with dtlab launch (one lighthouse per "
            "job, parallel.fault_tolerance.lighthouse)"
        )
    # torchft's Rust side logs every quorum tick at INFO: quieter unless asked (set before torchft
    # is first imported here, where its logger may read it).
    os.environ.setdefault("RUST_LOG", "warn")
    require_torchft()  # here, once, before any process starts
    o = config.parallel.fault_tolerance
    # DDP: each rank is a replica group; HSDP: each replicate group of nproc / replicate ranks.
    replicas, group = replica_groups(config, spec.nproc)
    # Each group's ranks are its local ranks 0 .. group-1: without a slice of the node's GPUs of its
    # own, every group would train on the first GPUs. (Refused here, before any process starts.)
    gpus = replica_group_gpu_env(config.train.device, config.parallel.backend, replicas, group)
    run_dir.mkdir(parents=True, exist_ok=True)
    set_process_title("dtlab train", "dtlab train")  # the run's process (its lighthouse)
    server, address = None, o.lighthouse
    if address is None:
        server, address = start_lighthouse(config)
    # Where the groups meet on their first start, and where a finished group says so.
    store = _loopback_store()
    forks = _fork_server() if o.warm_restart else None
    env = _groups_env(address, store.port, replicas * group, forks)
    print(
        f"fault tolerance: {replicas} replica group{'s' * (replicas > 1)} of {group} rank"
        f"{'s' * (group > 1)}, lighthouse {address}"
        f"{' (started here, on 127.0.0.1)' if server is not None else ''}, each group restarted "
        f"up to {o.max_restarts} times by its own agent"
        f"{' (from a fork server: warm_restart)' if forks is not None else ''}; run dir {run_dir}",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    procs = _start_agents(config, worker_args, run_dir, group, [{**env, **g} for g in gpus])
    try:
        codes = _supervise(procs, o.timeout_s + FINISH_MARGIN_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if server is not None:
            server.shutdown()
        if forks is not None:
            forks.stop()
    return _end_run(run_dir, address, codes, time.monotonic() - started)


def _end_run(run_dir: Path, address: str, codes: dict[int, int], wall_s: float) -> int:
    """Write ``fault_tolerance.json`` (how each group ended, the run's figures), say the run's one
    end summary where a group finished it, and return the run's exit code (:func:`_run_code`)."""
    dirs = [replica_dir(run_dir, i) for i in range(len(codes))]
    summary = run_summary(run_dir, codes, wall_s, dirs)
    record = {"replicas": len(codes), "lighthouse": address, "exit_codes": codes}
    record["summary"] = {k: v for k, v in summary.items() if k != "group"}
    (run_dir / "fault_tolerance.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
    if summary["finished"]:  # one summary for the run, where each group would have said its own
        print(f"\ndtlab run finished\n{run_summary_table(summary)}", flush=True)
    return _run_code(codes)


def _groups_env(
    address: str, store_port: int, ranks: int, forks: forkserver.ForkServer | None
) -> dict[str, str]:
    """The environment every group's agent starts with: the groups' count is added by the caller;
    the lighthouse, the start store, the loopback, the cores shared by the run's ``ranks``."""
    env = {
        **os.environ,
        LIGHTHOUSE_ENV: address,
        START_STORE_ENV: f"127.0.0.1:{store_port}",
        HOST_ENV: "127.0.0.1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        # torchft's Rust side logs every quorum tick at INFO.
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
        RUN_SUMMARY_ENV: "1",  # this process says the end summary, not each group
    }
    if "OMP_NUM_THREADS" not in os.environ:
        # Each group is a world of its own, whose ranks would each take the machine's cores
        # (parallel.dist): share them among every group's ranks instead, as one world's would.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    if forks is not None:
        env.update({forkserver.SOCKET_ENV: str(forks.socket), WORKER_PYTHON_ENV: str(forks.shim)})
    return env


def _start_agents(
    config: Config,
    worker_args: list[str],
    run_dir: Path,
    group: int,
    envs: list[dict[str, str]],
) -> list[subprocess.Popen[bytes]]:
    """One elastic agent per replica group (``python -m dtlab.fault_tolerance``), each training in
    its own run directory with its environment from ``envs`` (one per group); each dies with this
    process, even when it is killed -9."""
    if config.parallel.diloco.inner_steps:
        # Each group is one DiLoCo replica, its own world of one rank (dtlab.train.diloco_ft).
        worker_args = _with_override(worker_args, "parallel.diloco.replicas=null")
    procs = []
    replicas = len(envs)
    for i, env in enumerate(envs):
        args = _with_override(worker_args, f"run.dir={replica_dir(run_dir, i)}")
        cmd = [
            sys.executable, "-m", "dtlab.fault_tolerance", "--nproc", str(group),
            "--max-restarts", str(config.parallel.fault_tolerance.max_restarts),
            "--failure-grace-s", str(failure_grace_s(config.parallel.collective_timeout_s)),
            "--run-dir", str(replica_dir(run_dir, i)), "--", *args,
        ]  # fmt: skip
        agent_env = {**env, REPLICAS_ENV: str(replicas), REPLICA_ENV: str(i)}
        procs.append(subprocess.Popen(cmd, env=started_here(agent_env)))
    return procs


def _run_code(codes: dict[int, int]) -> int:
    """The run's exit code from its groups': 0 when a group finished the run (the others said),
    75 when every group stopped with a checkpoint, else 1."""
    finished = [i for i, c in codes.items() if c == 0]
    if finished:
        others = {i: c for i, c in codes.items() if c != 0}
        if others:
            print(
                f"fault tolerance: replica groups {finished} finished the run; "
                + ", ".join(f"group {i} did not (exit code {c})" for i, c in others.items()),
                file=sys.stderr,
                flush=True,
            )
        return 0
    if codes and all(c == 75 for c in codes.values()):
        return 75
    return 1


def _fork_server() -> forkserver.ForkServer | None:
    """A fork server for the groups' ranks (parallel.fault_tolerance.warm_restart): a rank, and a
    killed group's new one, starts from a process that has imported torch and dtlab already, instead
    of a fresh interpreter (seconds of imports). None where there is none to start: not Linux, a
    Slurm job (which tracks its processes itself), or one already serving this process's children
    (its shim is then this interpreter)."""
    if not sys.platform.startswith("linux") or "SLURM_JOB_ID" in os.environ:
        return None  # fork() without exec is safe on Linux (not with macOS's frameworks)
    if os.environ.get(forkserver.SOCKET_ENV):
        return None
    # Not waited for: until it serves (its imports take seconds), the ranks start fresh.
    return forkserver.start()


def _supervise(procs: list[subprocess.Popen[bytes]], grace_s: float) -> dict[int, int]:
    """Wait for the agents; once one group finished, the others get ``grace_s`` to finish too.
    SIGINT and SIGTERM are passed on to every agent (which passes them to its ranks)."""
    codes: dict[int, int] = {}
    done_at: float | None = None
    got: list[int] = []

    def handle(signum: int, frame: Any) -> None:
        got.append(signum)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while len(codes) < len(procs):
            for i, p in enumerate(procs):
                if i not in codes and p.poll() is not None:
                    codes[i] = p.returncode
            if done_at is None and 0 in codes.values():
                done_at = time.monotonic()  # (its agent said so in the store: say_finished)
            if done_at is not None and time.monotonic() - done_at > grace_s:
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        print(
                            f"fault tolerance: replica group {i} had not finished {grace_s:.0f} s "
                            "after another did; stopping it",
                            file=sys.stderr,
                            flush=True,
                        )
                        p.terminate()
                done_at = time.monotonic()  # then killed by the caller if still there
                grace_s = 10.0
            time.sleep(0.1)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return codes


def serve_lighthouse(config: Config, bind: str, store_port: int | None = None) -> int:
    """A job's lighthouse (``dtlab launch slurm``): torchft's LighthouseServer bound to ``bind``
    (HOST:PORT, where every replica group can reach it) and, on ``store_port``, the start store the
    groups meet at on their first start; serves until SIGTERM or SIGINT, then returns 0."""
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    o = config.parallel.fault_tolerance
    server = LighthouseServer(
        bind=bind,
        min_replicas=o.min_replicas,
        join_timeout_ms=int(o.timeout_s * 1000),
        quorum_tick_ms=50,
        heartbeat_timeout_ms=int(o.heartbeat_timeout_s * 1000),
    )
    store = None
    if store_port is not None:
        import torch.distributed as dist

        store = dist.TCPStore(
            bind.rsplit(":", 1)[0], store_port, is_master=True, wait_for_workers=False
        )
    print(f"fault tolerance: lighthouse on {bind}", file=sys.stderr, flush=True)
    stop: list[int] = []
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, frame: stop.append(signum))
    while not stop:
        time.sleep(0.2)
    server.shutdown()
    del store
    return 0


def main(argv: list[str] | None = None) -> int:
    """One replica group's elastic agent: ``python -m dtlab.fault_tolerance --nproc G
    --max-restarts K --run-dir DIR -- train ...`` (started by :func:`launch_replicas` and by
    ``dtlab launch slurm``); or a job's lighthouse: ``--lighthouse HOST:PORT --config FILE
    [--store-port P]``."""
    parser = argparse.ArgumentParser(prog="python -m dtlab.fault_tolerance")
    parser.add_argument("--lighthouse", metavar="HOST:PORT")
    parser.add_argument("--config", type=Path)
    parser.add_argument("--store-port", type=int)
    parser.add_argument("--nproc", type=int)
    parser.add_argument("--max-restarts", type=int)
    parser.add_argument("--failure-grace-s", type=float, default=30.0)
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument("worker_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.lighthouse:
        from dtlab.config import load_config

        return serve_lighthouse(load_config(args.config, []), args.lighthouse, args.store_port)
    if args.nproc is None or args.max_restarts is None or args.run_dir is None:
        parser.error("--nproc, --max-restarts and --run-dir are needed (or --lighthouse)")
    worker_args = args.worker_args
    if worker_args[:1] == ["--"]:
        worker_args = worker_args[1:]
    spec = LaunchSpec(
        args.nproc, max_restarts=args.max_restarts, failure_grace_s=args.failure_grace_s
    )
    replica = os.environ.get(REPLICA_ENV)
    if replica is not None:
        # Every group has a rank 0: the agent's own lines (a rank that died, the restart, the
        # workers' last words) say which group they are about, as the workers' log lines do.
        sys.stderr = GroupLines(sys.stderr, f"[replica {replica}] ")  # type: ignore[assignment]
        # Its name only: tools find an agent by its command line (-m dtlab.fault_tolerance).
        set_process_title(f"dtlab agent: replica {replica}", f"dtlab r{replica} agent", argv=False)
    # The workers (and their restarts) through the run's fork server, where it has one.
    code = launch(spec, worker_args, args.run_dir, python=os.environ.get(WORKER_PYTHON_ENV))
    if code == 0:
        say_finished()
    return code


class GroupLines:
    """A text stream that writes each line to ``stream`` with ``prefix`` in front of it."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream, self.prefix = stream, prefix
        self.at_start = True

    def write(self, text: str) -> int:
        """Write ``text``, the prefix before each line it starts."""
        out = []
        for piece in text.splitlines(keepends=True):
            if self.at_start and piece.strip():
                out.append(self.prefix)
            out.append(piece)
            self.at_start = piece.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        """Flush the underlying stream."""
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding: the stream's own
        return getattr(self.stream, name)


def say_finished() -> None:
    """This group finished the run: say so in the start store (``DTLAB_FT_START_STORE``), where a
    group still behind reads it at its next quorum and stops instead of training the last steps
    alone. Here, not only in :func:`launch_replicas`: a launched job has no process that watches
    every group, and the lighthouse's store is the one place they all reach. Best effort: a store
    that is gone (the job ending) changes nothing."""
    with contextlib.suppress(RuntimeError, OSError, ValueError):
        store = start_store()
        if store is not None:
            store.set(FINISHED_KEY, "1")


if __name__ == "__main__":
    die_with_parent()
    sys.exit(main())
