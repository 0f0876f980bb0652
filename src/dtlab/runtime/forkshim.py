"""Stands where the Python interpreter would (see forkserver.py): ``python [-u] -m MODULE ARGS`` and
``python [-u] SCRIPT ARGS`` become a child of the fork server; anything else, or no server, runs the
real interpreter. Started with ``python -S``: it imports only the standard library's built-ins."""

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import threading
from typing import NoReturn

REAL = sys.executable  # the shebang's interpreter: the one this shim stands for
MAX_PASSED_FDS = 64  # forkserver.MAX_PASSED_FDS: the most descriptors beyond 0-2 the server takes


def _passthrough() -> NoReturn:
    """Become the real interpreter, with this shim's arguments."""
    os.execv(REAL, [REAL, *sys.argv[1:]])


def _parse(args: list[str]) -> dict | None:
    """The request for ``[-u] -m MODULE ARGS`` or ``[-u] SCRIPT.py ARGS``; None for anything else."""
    unbuffered = False
    while args and args[0] == "-u":
        unbuffered, args = True, args[1:]
    if len(args) >= 2 and args[0] == "-m":
        return {"unbuffered": unbuffered, "module": args[1], "script": None, "args": args[2:]}
    if args and not args[0].startswith("-") and args[0].endswith(".py"):
        return {"unbuffered": unbuffered, "module": None, "script": args[0], "args": args[1:]}
    return None


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``; empty if it closed before them."""
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            return b""
        data += more
    return data


def _die_with_parent() -> None:
    """dtlab.runtime.lifeline's die_with_parent for the shim (its child is bound to it): killed when
    the dtlab process that started it dies, ended now if that one already has. The variable stays
    for the child, which reads it as a fork server's child (bound to this shim) and drops it."""
    raw = os.environ.get("DTLAB_PARENT_PID", "")
    if not raw.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PDEATHSIG
        return
    if os.getppid() != int(raw):
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    """Run the process this shim stands for as a fork server's child, and end as it ended."""
    _die_with_parent()
    path = os.environ.get("DTLAB_FORKSERVER")
    request = _parse(sys.argv[1:])
    # Slurm tracks a job's processes itself: a job's interpreters are its own.
    if not path or request is None or "SLURM_JOB_ID" in os.environ:
        _passthrough()
    sock = _connect(path)
    _send(sock, request)
    pid = _child_pid(sock)
    marker = _note_child(pid)
    _forward_signals(pid)
    status = _child_status(sock)
    with contextlib.suppress(OSError):
        os.unlink(marker)
    _end_as(status)


def _connect(path: str) -> socket.socket:
    """A connection to the fork server at ``path``; the real interpreter runs when there is none."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        _passthrough()
    return sock


def _passed_fds(sock: socket.socket) -> list[int]:
    """The descriptors beyond 0-2 this process was given (``subprocess``'s ``pass_fds``: Inductor's
    compile workers read and write theirs by number), which the child must have under the same
    numbers; not the fork server's connection."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    out = []
    for name in names:
        fd = int(name)
        if fd <= 2 or fd == sock.fileno():
            continue
        try:
            os.fstat(fd)  # (the listing's own descriptor is closed by now)
        except OSError:
            continue
        if os.get_inheritable(fd):
            out.append(fd)
    return sorted(out)


def _send(sock: socket.socket, request: dict) -> None:
    """Send the request with this process's directory, environment and descriptors: its standard
    streams, and those it was passed (``passed_fds``: their numbers, in the order sent after 0-2)."""
    passed = _passed_fds(sock)
    if len(passed) > MAX_PASSED_FDS:
        _passthrough()
    request.update(cwd=os.getcwd(), env=dict(os.environ), orig_args=sys.argv[1:], passed_fds=passed)
    fds, opened = [], []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:  # a closed stream: the child gets /dev/null there
            null = os.open(os.devnull, os.O_RDWR)
            fds.append(null)
            opened.append(null)
    body = json.dumps(request).encode()
    socket.send_fds(sock, [struct.pack("!I", len(body)) + body], fds + passed)
    for fd in opened:
        os.close(fd)


def _child_pid(sock: socket.socket) -> int:
    """The pid of the child the server forked; this process ends (1) if the server refused."""
    reply = _recv_exact(sock, 8)
    if not reply:
        print("forkshim: the fork server refused the request", file=sys.stderr)
        os._exit(1)
    (pid,) = struct.unpack("!q", reply)
    return pid


def _note_child(pid: int) -> str:
    """Note the child beside the shim; returns the note's path (removed once the child ended)."""
    # Where a signal meant for this process finds the one doing its work (forkserver.real_pid).
    marker = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "pids", str(os.getpid()))
    with contextlib.suppress(OSError), open(marker, "w") as f:
        f.write(str(pid))
    return marker


def _forward_signals(pid: int) -> None:
    """Pass the signals this process gets on to the child (as forkserver.FORWARDED lists them)."""

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    for sig in (
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
    ):
        signal.signal(sig, forward)


def _child_status(sock: socket.socket) -> int:
    """How the child ended (a wait status); this process ends (1) if the server ended first."""
    reply = _recv_exact(sock, 8)
    if not reply:
        print("forkshim: the fork server ended before the child", file=sys.stderr)
        os._exit(1)
    (status,) = struct.unpack("!q", reply)
    return status


def _end_as(status: int) -> NoReturn:
    """End as the child ended: the same exit code, or killed by the same signal."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: so is this process
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        signal.pthread_kill(threading.get_ident(), -code)
    os._exit(code)


main()
