"""``dtlab train --engine mlx --nproc N``: start N ranks on this machine through ``mlx.launch``.

``mlx.launch`` runs ``python -m dtlab train ...`` once per rank with the ring backend's host file
(``parallel.backend: ring``, and ``auto``); with ``parallel.backend: mpi`` the ranks run under Open MPI's
``mpirun``, started here (``mlx.launch``'s own MPI command needs Open MPI 5; Debian's and Ubuntu's
are 4), else under ``mlx.launch``'s. Either relays their output and stops the others when one fails. It
does not report the ranks' exit codes, so each rank writes its own into a status directory that this
launcher reads at the end (a rank that leaves none was killed). Signals sent to ``dtlab train`` (Ctrl-C,
a scheduler's SIGTERM/SIGUSR1) are passed to the ranks, which save a checkpoint and exit together.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from dtlab.errors import DtlabError, Preempted
from dtlab.runtime.status import STATUS_ENV, is_mlx_worker, record_exit, record_pid, worker_rank

__all__ = [
    "STATUS_ENV", "is_mlx_worker", "launch_mlx", "record_exit", "record_pid", "worker_rank",
]  # fmt: skip


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_ports(n: int) -> int:
    """A first port p such that p .. p+n-1 are free on 127.0.0.1 (the ring listens on one per rank)."""
    rng = random.Random()
    # Below the kernel's ephemeral range: a port in it can be taken by any process's outgoing
    # connection between this check and the ring's bind (seen under a busy test suite).
    low, high = 10000, _ephemeral_start()
    if high - n <= low:
        low, high = 20000, 60000
    for _ in range(200):
        base = rng.randrange(low, high - n)
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise DtlabError(f"could not find {n} consecutive free ports on 127.0.0.1 for the ring backend")


def _mlx_launch() -> list[str]:
    beside = Path(sys.executable).with_name("mlx.launch")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("mlx.launch")
    if found:
        return [found]
    return [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]


def launch_backend(backend: str) -> str:
    """The backend ``parallel.backend`` starts the ranks with: ``auto`` is the ring (it needs nothing
    installed, on one machine or several); ``mpi`` only when asked for (it can split the group: an
    MLX layout of tensor- and data-parallel ranks needs it)."""
    return "ring" if backend == "auto" else backend


def open_mpi_version(mpirun: str) -> int | None:
    """The major version of the Open MPI whose ``mpirun`` this is (None: another MPI, or none)."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.stdout.splitlines():
        if "Open MPI" in line or "OpenRTE" in line:
            with contextlib.suppress(ValueError, IndexError):
                return int(line.split()[-1].split(".")[0])
    return None


def _mpirun(nproc: int, worker_args: list[str], env: dict[str, str]) -> list[str] | None:
    """Open MPI's ``mpirun`` command for ``nproc`` local ranks (None: no Open MPI; ``mlx.launch``
    then starts the ranks). Flags both Open MPI 4 and 5 take; the variables the ranks need passed
    on by name (``-x``), as ``mpirun`` does not forward the environment to remote daemons."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise DtlabError(
            "parallel.backend = 'mpi' needs mpirun on the PATH (Open MPI: apt-get install "
            "openmpi-bin libopenmpi-dev, or brew install open-mpi); parallel.backend = 'ring' "
            "needs nothing installed"
        )
    if open_mpi_version(mpirun) is None:
        return None
    if os.geteuid() == 0:  # Open MPI refuses root without both (4 reads the flag, 5 the variables)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    passed = [STATUS_ENV, "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYTHONPATH"]
    return [
        mpirun, "-np", str(nproc), "--oversubscribe",
        *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
        *(a for v in passed if v in env for a in ("-x", v)),
        sys.executable, "-m", "dtlab", *worker_args,
    ]  # fmt: skip


def launch_mlx(nproc: int, backend: str, worker_args: list[str]) -> int:
    """Run ``python -m dtlab <worker_args>`` as ``nproc`` MLX ranks; returns an exit code."""
    backend = launch_backend(backend)
    if backend == "jaccl" and nproc > 1:
        raise DtlabError(
            f"parallel.backend = 'jaccl' with --nproc {nproc}: JACCL joins several Macs over "
            "Thunderbolt, whose ranks mlx.launch starts from a host file listing their RDMA "
            "devices (mlx.launch --hostfile hosts.json --backend jaccl -- -m dtlab train ...); "
            "dtlab train --nproc starts ranks on this machine (allowed: auto, ring, mpi)"
        )
    status = Path(tempfile.mkdtemp(prefix="dtlab-mlx-"))
    env = {**os.environ, STATUS_ENV: str(status)}
    # Share the cores among the ranks (as the torch engine does) when the BLAS MLX calls is threaded.
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(var, threads)
    cmd = _mpirun(nproc, worker_args, env) if backend == "mpi" else None
    if cmd is None:
        cmd = [
            *_mlx_launch(), "-n", str(nproc), "--backend", backend, "--python", sys.executable,
            *(["--starting-port", str(_free_ports(nproc))] if backend == "ring" else []),
            "--", "-m", "dtlab", *worker_args,
        ]  # fmt: skip
    # Its own session: a Ctrl-C reaches this launcher only, which passes it on as a stop request.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    relay = _SignalRelay(status, proc.pid)
    with relay:
        while proc.poll() is None:
            relay.deliver()
            time.sleep(0.1)
    codes: dict[int, int | None] = {}
    for r in range(nproc):
        f = status / f"rank{r}.exit"
        codes[r] = int(f.read_text()) if f.is_file() else None
    shutil.rmtree(status, ignore_errors=True)
    return _outcome(codes, relay)


class _SignalRelay:
    """Passes the signals this launcher receives on to the ranks, which run in a session of their own.

    A signal is passed on from its handler, at once, as the torch engine's launcher does: the ranks
    then read it at the same step boundary as torch's workers would. A rank whose pid file appears
    later (it had not yet installed its handlers) gets every signal received so far from
    :meth:`deliver`, which the launcher calls as it polls. SIGINT (Ctrl-C) and SIGUSR1 stay what they
    are, so the ranks say what happened; SIGTERM and SIGHUP ask for a stop as SIGTERM. A second
    Ctrl-C is the launcher's own: it kills every rank at once, without saving, and is not passed on.
    """

    HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)

    def __init__(self, status: Path, group: int) -> None:
        self.status, self.group = status, group
        self.received: list[int] = []
        self.delivered: dict[Path, int] = {}  # pid file -> how many of the received signals it got
        self.aborted = False
        self._delivering = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _SignalRelay:
        self._previous = {s: signal.signal(s, self._note) for s in self.HANDLED}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if self.received.count(signal.SIGINT) > 1 and not self.aborted:
            self.aborted = True
            for pid_file in self.status.glob("rank*.pid"):
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.killpg(self.group, signal.SIGKILL)
        self.deliver()

    def deliver(self) -> None:
        """Send each rank the signals received since it was last sent any (nothing once aborted)."""
        # This handler may interrupt a delivery under way (the poll's, or another signal's): that one
        # sends the new signal too, since it goes round until every rank has had every signal (one
        # that lands in the instant after its last round waits for the next poll). Two deliveries at
        # once could send a rank the same Ctrl-C twice, which would abort it.
        if self._delivering:
            return
        self._delivering = True
        try:
            behind = True
            while behind and not self.aborted:
                behind = False
                for pid_file in sorted(self.status.glob("rank*.pid")):
                    while (sent := self.delivered.get(pid_file, 0)) < len(self.received):
                        self.delivered[pid_file] = sent + 1  # first: never twice, whatever comes
                        with contextlib.suppress(OSError, ValueError):
                            os.kill(int(pid_file.read_text()), _passed_on(self.received[sent]))
                        behind = True
        finally:
            self._delivering = False


def _passed_on(signum: int) -> signal.Signals:
    """The signal a rank gets for ``signum`` received by the launcher (see :class:`_SignalRelay`)."""
    if signum in (signal.SIGINT, signal.SIGUSR1):
        return signal.Signals(signum)
    return signal.SIGTERM


def _outcome(codes: dict[int, int | None], relay: _SignalRelay) -> int:
    """The launcher's exit code from each rank's (``None``: killed before it could say)."""
    if relay.aborted:
        print("aborted by a second Ctrl-C: the ranks were stopped without saving", file=sys.stderr)
        return 128 + signal.SIGINT
    if all(c == 0 for c in codes.values()):
        return 0
    # Rank 0 writes the checkpoint and exits 75 only once it is committed; the others follow it.
    if codes.get(0) == Preempted.exit_code and all(
        c in (Preempted.exit_code, None) for c in codes.values()
    ):
        return Preempted.exit_code
    failed = ", ".join(
        f"rank {r} ({'killed' if c is None else f'exit code {c}'})"
        for r, c in codes.items()
        if c != 0
    )
    print(f"error: MLX training failed on {failed}; see the messages above", file=sys.stderr)
    if relay.received:
        # Signalled, and no checkpoint was committed at the stop: not "saved, start me again".
        return 128 + relay.received[0]
    return 1
