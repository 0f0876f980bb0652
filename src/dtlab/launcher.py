"""``dtlab train --nproc N``: start N workers through torch's elastic launcher (torchrun semantics).

Each worker is ``python -m dtlab train ...`` again; it sees the launcher's environment (RANK,
WORLD_SIZE, TORCHELASTIC_RUN_ID, ...) and runs as a worker instead of launching.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtlab.errors import Preempted
from dtlab.parallel.ft_ports import bound_store
from dtlab.runtime.lifeline import started_here
from dtlab.runtime.messages import MESSAGES_ENV, messages_directory, take_messages
from dtlab.train.rundir import finished_since, stopped_with_checkpoint

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig


@dataclass(frozen=True)
class LaunchSpec:
    """What the launcher needs: how many processes on how many nodes, and where to meet."""

    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    # How long the agent lets the other ranks run once one has failed, before it kills them: past
    # the collective timeout, so that a rank waiting on the dead one names it (see failure_grace_s).
    failure_grace_s: float = 30.0


# What a rank whose collective timed out takes to say so: its peers' newest entries settle, the dumps
# are acknowledged, and the aborted groups end its wait (dtlab.parallel.ledger), with room to spare.
REPORT_S = 30.0


def failure_grace_s(collective_timeout_s: float) -> float:
    """How long the elastic agent waits for the other ranks once a rank has failed, before SIGKILL:
    ``parallel.collective_timeout_s`` plus the time a rank takes to report (at least torch's 30 s).
    On NCCL a survivor waits in a collective with the dead rank until that timeout; killed sooner, it
    never names the dead rank (gloo's survivors fail at once, and end well within it)."""
    return max(30.0, collective_timeout_s + REPORT_S)


@contextlib.contextmanager
def _failure_grace(seconds: float) -> Iterator[None]:
    """Inside, torch's elastic agent waits ``seconds`` (not its fixed 30) for the other workers to end
    once one has failed: its ``_stop_workers`` passes no timeout to ``_shutdown`` (torch 2.13), so
    neither ``LaunchConfig.shutdown_timeout`` nor its environment variable reaches that path."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._stop_workers

    def stop_workers(self: Any, worker_group: Any) -> None:
        self._shutdown(timeout=math.ceil(seconds))

    LocalElasticAgent._stop_workers = stop_workers  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._stop_workers = original  # type: ignore[method-assign]


def launch(
    spec: LaunchSpec,
    worker_args: list[str],
    run_dir: Path | None = None,
    module: str = "dtlab",
    python: str | None = None,
) -> int:
    """Run ``python -m <module> <worker_args>`` in ``spec.nproc`` local processes; returns an exit code.
    ``python``: the interpreter the workers start with (this one's by default; a fork server's shim,
    :mod:`dtlab.runtime.forkserver`, for warm restarts).

    75 only when the workers stopped on a signal *and* committed a checkpoint (their stop marker in
    ``run_dir``; without one, the workers' exit codes); a signal that left nothing saved gives
    128 + the signal's number. What the workers leave to say (:mod:`dtlab.runtime.messages`) is said
    once, before the launcher's own last line.
    """
    with _worker_messages() as messages:
        return _launch(spec, worker_args, run_dir, module, messages, python or sys.executable)


def _launch(
    spec: LaunchSpec,
    worker_args: list[str],
    run_dir: Path | None,
    module: str,
    messages: Path,
    python: str,
) -> int:
    """Start the workers under the elastic agent; each way they can end becomes an exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    # The elastic agent logs every restart and failure at length; the workers leave their own errors
    # to say (above). Of its records dtlab keeps two, said in one line: which rank died how, and the
    # restart.
    _report_restarts(spec, lambda: _say(messages, spec.nproc))
    config = _launch_config(spec)
    ending = _Ending(spec.nproc, messages, run_dir, config.run_id, since=time.time())
    ctrl_c = _CtrlC()
    started_here()  # the ranks die with this process, even when it is killed -9
    try:
        with ctrl_c, _failure_grace(spec.failure_grace_s):
            elastic_launch(config, entrypoint=python)("-m", module, *worker_args)
    except _Interrupted as e:
        return ending.interrupted(e.aborted)
    except ChildFailedError as e:
        return ending.failed({r: f.exitcode for r, f in e.failures.items()})
    except SignalException as e:
        # The launcher itself was signalled: the agent passed the signal on and waited for the workers.
        return ending.after_signal(e.sigval)
    except RendezvousError as e:
        # e.g. the port is taken, or the other nodes never arrived: a setup problem, not a crash.
        return ending.no_rendezvous(config.rdzv_endpoint, e)
    ending.say()
    return 0


def _say(messages: Path, nproc: int, stop_said: bool = False) -> None:
    """Say what the workers left to say (each message once); ``stop_said``: but for the stop, which
    the launcher says itself."""
    for line in said_once(take_messages(messages), nproc, stop_said=stop_said):
        print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _Ending:
    """How a launch ends, said and given as an exit code: the workers' messages (in ``messages``),
    then the launcher's own line; ``since``: when the workers started, so that only a checkpoint or
    an end they reached in this launch counts."""

    nproc: int
    messages: Path
    run_dir: Path | None
    run_id: str
    since: float

    def say(self, stop_said: bool = False) -> None:
        """What the workers left to say (:func:`_say`)."""
        _say(self.messages, self.nproc, stop_said=stop_said)

    def saved(self) -> dict[str, Any] | None:
        """The workers' stop marker, when they committed a checkpoint in this launch."""
        if self.run_dir is None:
            return None
        return stopped_with_checkpoint(self.run_dir, self.run_id, self.since)

    def after_signal(self, sig: signal.Signals) -> int:
        """The launcher was stopped by ``sig``: 0 when the run had finished, else
        :func:`_after_signal`."""
        self.say(stop_said=True)
        if self.run_dir is not None and finished_since(self.run_dir, self.since):
            # The signal came while the finished workers were leaving: nothing was stopped.
            print(
                f"{sig.name} arrived after the run had finished; nothing to save", file=sys.stderr
            )
            return 0
        return _after_signal(sig, self.saved())

    def interrupted(self, aborted: bool) -> int:
        """Ctrl-C: a stop like any signal's, or (``aborted``, a second one) no save at all."""
        if aborted:
            self.say(stop_said=True)
            print(
                "aborted by a second Ctrl-C: the workers were stopped without saving",
                file=sys.stderr,
            )
            return 128 + signal.SIGINT
        return self.after_signal(signal.SIGINT)

    def failed(self, codes: dict[int, int]) -> int:
        """Workers failed with these exit codes (by rank): :func:`_after_failure`."""
        self.say()
        return _after_failure(codes, self.run_dir, self.saved)

    def no_rendezvous(self, endpoint: str, e: Exception) -> int:
        """The process group never formed at ``endpoint``: 1, with the rendezvous's error."""
        self.say()
        print(
            f"error: could not start the process group at {endpoint} "
            f"(--master-addr/--master-port): {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 1


@contextlib.contextmanager
def _worker_messages() -> Iterator[Path]:
    """A directory for the workers' last words (:mod:`dtlab.runtime.messages`), named in the
    environment they inherit while they run."""
    directory = messages_directory()
    before = os.environ.get(MESSAGES_ENV)
    os.environ[MESSAGES_ENV] = str(directory)
    try:
        yield directory
    finally:
        if before is None:
            os.environ.pop(MESSAGES_ENV, None)
        else:
            os.environ[MESSAGES_ENV] = before
        shutil.rmtree(directory, ignore_errors=True)


def said_once(messages: list[dict[str, Any]], ranks: int, stop_said: bool = False) -> list[str]:
    """The lines that say the workers' ``messages`` (:func:`dtlab.runtime.messages.take_messages`),
    each distinct one once, in the order of the first rank that said it: an error said by all
    ``ranks`` workers as one process would say it, else prefixed with the ranks that said it
    (``[rank0,2] error: ...``); a stop (``preempted``) unless ``stop_said`` (the launcher says it)."""
    said: dict[tuple[str, str], list[int]] = {}
    for m in sorted(messages, key=lambda m: m["rank"]):
        said.setdefault((m["kind"], m["text"]), []).append(m["rank"])
    lines = []
    for (kind, text), who in said.items():
        if kind == "preempted":
            if not stop_said:
                lines.append(f"preempted: {text}")
            continue
        everyone = ranks > 1 and len(who) == ranks
        prefix = "" if everyone or ranks == 1 else f"[rank{','.join(map(str, who))}] "
        lines.append(f"{prefix}error: {text}")
    return lines


def _launch_config(spec: LaunchSpec) -> LaunchConfig:
    """The elastic agent's settings: the rendezvous (on loopback for one node), restarts, signals."""
    from torch.distributed.launcher.api import LaunchConfig

    single_node = spec.nnodes == 1 and spec.master_addr is None and spec.master_port is None
    backend, local_addr = "c10d", None
    if single_node:
        # Single node: like `torchrun --standalone`, but nothing listens beyond this machine: the
        # stores on loopback, and gloo's sockets too unless the user chose an interface.
        backend, local_addr = _register_loopback_rendezvous(), "127.0.0.1"
        if Path("/sys/class/net/lo").exists():
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        endpoint, run_id, rdzv_configs = (
            "127.0.0.1:0",
            f"dtlab-{uuid.uuid4().hex[:8]}",
            {"is_host": True},
        )
    else:
        endpoint = f"{spec.master_addr or 'localhost'}:{spec.master_port or 29500}"
        run_id, rdzv_configs = (
            f"dtlab-{spec.master_port or 29500}",
            {"is_host": spec.node_rank == 0},
        )
    return LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        local_addr=local_addr,
        rdzv_configs=rdzv_configs,
        max_restarts=spec.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        # The agent passes the signals it handles on to the workers (which save a checkpoint and stop);
        # SIGUSR1, which Slurm can send ahead of a time limit, is not among torch's defaults. SIGINT
        # (Ctrl-C) is dtlab's own: see _CtrlC.
        signals_to_handle="SIGTERM,SIGHUP,SIGQUIT,SIGUSR1",
    )


def _after_failure(
    codes: dict[int, int], run_dir: Path | None, saved: Callable[[], dict[str, Any] | None]
) -> int:
    """The exit code when workers failed, from each failed rank's exit code."""
    # Preempted: every rank agreed the checkpoint was committed before any exited, so ranks the
    # agent then terminated on its way out (negative codes: killed by a signal) lost nothing.
    stopped = Preempted.exit_code in codes.values() and all(
        c == Preempted.exit_code or c < 0 for c in codes.values()
    )
    if stopped and (run_dir is None or saved() is not None):
        return Preempted.exit_code  # the workers said where they saved
    failures = ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(codes.items()))
    print(f"error: training failed on {failures}; see the messages above", file=sys.stderr)
    return 1


class _RestartReporter(logging.Handler):
    """Turns the elastic agent's records of a failed worker and of the restart that follows into one
    line: ``rank 1 died (SIGKILL); restarting the workers (restart 1 of 2)``."""

    FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
    RESTART = re.compile(r"(\d+)/(\d+) attempts left; will restart")

    def __init__(self, spec: LaunchSpec, say: Callable[[], None]) -> None:
        super().__init__(logging.INFO)
        self.spec, self.say = spec, say
        self.failure = "a worker failed"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:
            return
        if m := self.FAILED.search(text):
            code, local = int(m[1]), int(m[2])
            rank = self.spec.node_rank * self.spec.nproc + local
            how = (
                f"died ({signal.Signals(-code).name})"
                if code < 0 and -code in signal.Signals._value2member_map_
                else f"exited with code {code}"
            )
            self.failure = f"rank {rank} {how}"
        elif m := self.RESTART.search(text):
            left, most = int(m[1]), int(m[2])
            self.say()  # why the workers stopped, before they start again
            print(
                f"{self.failure}; restarting the workers (restart {most - left + 1} of {most})",
                file=sys.stderr,
                flush=True,
            )


def _report_restarts(spec: LaunchSpec, say: Callable[[], None]) -> None:
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.handlers[:] = [_RestartReporter(spec, say)]
    elastic.propagate = False  # nothing else of the agent's reaches the terminal
    elastic.setLevel(logging.INFO)
    # Each module's logger has a level of its own (torch sets WARNING): let the two records through.
    for name in ("agent.server.api", "multiprocessing.api"):
        logging.getLogger(f"torch.distributed.elastic.{name}").setLevel(logging.INFO)


LOOPBACK_RENDEZVOUS = "dtlab-loopback"


def _loopback_store() -> Any:
    """A TCPStore server that listens on 127.0.0.1 only (TCPStore itself binds every interface)."""
    return bound_store("127.0.0.1")


def _register_loopback_rendezvous() -> str:
    """Register (once) the rendezvous of a single-node launch: torch's dynamic c10d rendezvous, with
    its store and the store it shares with the workers on loopback."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return LOOPBACK_RENDEZVOUS

    class LoopbackHandler(DynamicRendezvousHandler):
        def _create_tcp_store_server(self, master_addr: Any, master_port: Any) -> Any:
            return _loopback_store()

    def create(params: RendezvousParameters) -> LoopbackHandler:
        store = _loopback_store()
        return LoopbackHandler.from_backend(
            run_id=params.run_id,
            store=store,
            backend=LoopbackBackend(store, params.run_id),
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            local_addr=params.local_addr,
            timeout=RendezvousTimeout(join=timedelta(seconds=600)),
        )

    with contextlib.suppress(ValueError):  # already registered in this process
        rendezvous_handler_registry.register(LOOPBACK_RENDEZVOUS, create)  # type: ignore[arg-type]
    return LOOPBACK_RENDEZVOUS


def _after_signal(sig: signal.Signals, marker: dict[str, Any] | None) -> int:
    """The exit code and message of a launcher that was signalled: 75 only with a committed checkpoint."""
    if marker is None:
        print(
            f"stopped by {sig.name}: the workers did not commit a checkpoint (see the messages "
            "above); nothing since the last checkpoint was kept",
            file=sys.stderr,
        )
        return 128 + int(sig)
    print(
        f"stopped by {sig.name} after step {marker['step']}: checkpoint saved in "
        f"{marker['checkpoint']}; run the same command to resume",
        file=sys.stderr,
    )
    return Preempted.exit_code


class _Interrupted(Exception):
    """Ends the launch after Ctrl-C: the workers have exited (``aborted``: killed without saving)."""

    def __init__(self, aborted: bool) -> None:
        super().__init__("interrupted")
        self.aborted = aborted


class _CtrlC:
    """The launcher's Ctrl-C: the first passes SIGINT on to the workers (which save and stop) and waits
    for them to exit; a second, during that wait, kills them at once. Either way the launch then ends:
    the agent must not restart workers that were asked to stop."""

    def __init__(self) -> None:
        self.count = 0
        self.previous: Any = None

    def __enter__(self) -> _CtrlC:
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count > 1:  # runs inside the first call's wait below, which it ends
            _kill_children()
            raise _Interrupted(aborted=True)
        for pid in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        while _children():
            time.sleep(0.05)
        raise _Interrupted(aborted=False)


def _children() -> list[int]:
    """This process's running child processes (the workers; an exited one that is not yet reaped
    does not count)."""
    proc = Path("/proc")
    if not proc.is_dir():  # macOS: no /proc
        out = subprocess.run(
            ["pgrep", "-P", str(os.getpid())], capture_output=True, text=True, check=False
        )
        return [int(p) for p in out.stdout.split()]
    pids = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # After the parenthesised command name: the state, then the parent's pid.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _kill_children() -> None:
    """SIGKILL this process's child processes (the workers)."""
    for pid in _children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
