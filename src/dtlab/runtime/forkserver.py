"""A fork server: Python processes that start with torch and dtlab already imported.

A fresh ``python -m dtlab ...`` spends seconds importing torch, its distributed packages and dtlab
before it does anything. This server imports them once and forks a child for each such process. A
small shim (``forkshim.py``) stands where the interpreter would: it sends its arguments, working
directory, environment and standard streams here, and mirrors the child: it passes on the signals it
gets and ends as the child ended (the same exit code, or killed by the same signal). When the shim
dies (SIGKILL), its child kills itself, so a killed process is a killed process either way.

Two users: ``dtlab train`` with ``parallel.fault_tolerance.warm_restart`` (a killed replica group's
new process starts in a fraction of the time, :mod:`dtlab.fault_tolerance`), and the test suite
(``tests/conftest.py``), whose processes all start here.

A child is what a fresh ``python [-u] -m MODULE ARGS`` or ``python [-u] SCRIPT ARGS`` would be: its own
``sys.argv``, environment, working directory, streams, process group, random state and module
``__main__``, and it ends through the interpreter's own teardown. What differs: modules imported here
were imported with this server's environment (nothing dtlab sets is read by torch at import time),
and ``sys.executable`` is the shim, so that the processes a child starts come here too.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Where the shims find the server (a Unix socket's path): set for the processes that use it.
SOCKET_ENV = "DTLAB_FORKSERVER"
# In a child: the server's pid (a process that this child starts fresh inherits it, with another parent).
FORKED_ENV = "DTLAB_FORKED_FROM"

# What every child needs: imported once here. They start no thread (checked before serving).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.run",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "torch._dynamo",
    "dtlab.cli",
    "dtlab.launcher",
    "dtlab.train.loop",
    "dtlab.parallel.apply",
)
# The most descriptors beyond 0-2 a shim passes on (forkshim.MAX_PASSED_FDS: more, and it runs the
# real interpreter instead).
MAX_PASSED_FDS = 64

FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


@dataclass
class ForkServer:
    """A started fork server: its process, and the shim that stands for the interpreter."""

    process: subprocess.Popen[bytes]
    home: Path
    socket: Path
    shim: Path

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until it serves (its imports take seconds); False if it ended or took longer."""
        deadline = time.monotonic() + timeout_s
        while not self.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        """Stop it (its children are killed: it is stopped once they are done) and remove its files."""
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        import shutil

        shutil.rmtree(self.home, ignore_errors=True)


def start() -> ForkServer:
    """Start a fork server for this interpreter; it serves once its imports are done (until then,
    and if it cannot serve, the shim runs the real interpreter). It ends with the process that
    started it, even when that one is killed."""
    home = Path(tempfile.mkdtemp(prefix="dtlab-fork-"))
    shim = home / "python"
    shim.write_text(
        f"#!{sys.executable} -S\n" + Path(__file__).with_name("forkshim.py").read_text()
    )
    shim.chmod(0o755)
    (home / "pids").mkdir()  # the shims note their children here (shim pid -> child pid)
    sock = home / "server.sock"
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), str(sock), str(shim)],
        start_new_session=True,  # a Ctrl-C reaches it through its parent's stop only
    )
    return ForkServer(process, home, sock, shim)


def forked() -> bool:
    """Whether this process is a fork server's child (started warm), not a fresh interpreter."""
    return os.environ.get(FORKED_ENV) == str(os.getppid())


def real_pid(pid: int) -> int:
    """The process that does the work of process ``pid``: the fork server's child when ``pid`` is a
    shim (``python -S SHIM ...``, which notes its child beside itself), else ``pid`` itself. A signal
    the shim cannot pass on (SIGSTOP, SIGCONT) goes there."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if len(argv) > 2 and argv[1] == b"-S":
            return int((Path(os.fsdecode(argv[2])).parent / "pids" / str(pid)).read_text())
    except (OSError, ValueError):
        pass
    return pid


def _threads() -> int:
    """The threads of this process (native ones included, where /proc lists them)."""
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:
        return threading.active_count()


def _streams(unbuffered: bool) -> None:
    """Standard streams on the descriptors 0-2 the shim sent, buffered as a fresh interpreter's."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        mode = "rb" if fd == 0 else "wb"
        try:
            raw = io.open(fd, mode, buffering=0, closefd=False)  # noqa: UP020, SIM115
        except OSError:
            setattr(sys, name, None)
            setattr(sys, f"__{name}__", None)
            continue
        tty = raw.isatty()
        binary: Any = raw
        if not (unbuffered and fd != 0):
            binary = (io.BufferedReader if fd == 0 else io.BufferedWriter)(raw)
        text = io.TextIOWrapper(
            binary,
            encoding="utf-8",
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=tty or fd == 2,
            write_through=unbuffered or fd == 2,
        )
        setattr(sys, name, text)
        setattr(sys, f"__{name}__", text)


def _watch(conn: socket.socket) -> None:
    """Die as the shim died: its end of the connection closes only when it ends, and it ends before
    the child only when it was killed."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _become(request: dict[str, Any], conn: socket.socket, shim: str) -> int:
    """In the forked child: turn into the process the shim stands for, run it, return its exit code."""
    import random
    import runpy
    import traceback

    os.setpgid(0, 0)
    for sig in (*FORWARDED, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[FORKED_ENV] = str(os.getppid())
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    _streams(unbuffered)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # OpenMP read it when torch was imported here
        import torch

        torch.set_num_threads(int(threads))
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.executable = shim
    sys.orig_argv = [shim, *request["orig_args"]]
    threading.Thread(target=_watch, args=(conn,), daemon=True, name="forkserver-watch").start()
    module, script, args = request["module"], request["script"], request["args"]
    try:
        if module is not None:
            sys.argv = [module, *args]  # runpy puts the module's path here, as -m does
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as a fresh interpreter ends on an uncaught Ctrl-C
        return 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


@dataclass
class _Serving:
    """What the serving loop holds: the listening socket, the wake-up pipe that signals write to,
    and each running child's shim connection (a forked child closes them all)."""

    listener: socket.socket
    selector: selectors.BaseSelector
    wake_r: int
    wake_w: int
    shim: str
    children: dict[int, socket.socket] = field(default_factory=dict)
    stop: bool = False

    def request_stop(self, *_: Any) -> None:
        """SIGTERM's handler: the loop ends at its next turn."""
        self.stop = True


def serve(path: str, shim: str) -> int | None:
    """Accept the shims' requests until told to stop; in a forked child, returns its exit code."""
    listener = _preload_and_listen(path)
    if listener is None:
        return None
    os.rename(path + ".tmp", path)  # the shims connect only once everything is imported
    server = _serving(listener, shim)
    parent = os.getppid()
    while (
        not server.stop and os.getppid() == parent
    ):  # its starter ended, even by SIGKILL: so does this
        for key, _ in server.selector.select(timeout=1.0):
            code = _handle(server, key)
            if code is not None:  # this is the forked child, and it has run
                return code
        _reap(server)
    for pid in server.children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.unlink(path)
    return None


def _preload_and_listen(path: str) -> socket.socket | None:
    """Import what every child needs, then listen at ``path + ".tmp"``; None (nothing left behind)
    when an import started a thread, which the children would lack."""
    import torch  # noqa: F401  # loading its library starts an idle native thread, as in any process

    baseline = _threads()  # forking after `import torch` is how DataLoader workers start: supported
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    if _threads() != baseline:  # threads started by an import would be missing in the children
        listener.close()
        os.unlink(path + ".tmp")
        print(f"forkserver: {_threads()} threads after the imports; not serving", file=sys.stderr)
        return None
    return listener


def _serving(listener: socket.socket, shim: str) -> _Serving:
    """The loop's state, with the signals it handles: SIGCHLD and SIGTERM wake its select through
    the pipe, and SIGTERM stops it."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    server = _Serving(listener, selector, wake_r, wake_w, shim)
    signal.signal(signal.SIGTERM, server.request_stop)
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    return server


def _handle(server: _Serving, key: selectors.SelectorKey) -> int | None:
    """Serve one ready descriptor: drain the wake-up pipe, or fork a child for a shim's request.
    Returns the child's exit code in the forked child, None in the server."""
    if key.fileobj is server.wake_r:
        os.read(server.wake_r, 4096)
        return None
    conn, _ = server.listener.accept()
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError):
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        _leave_server(server)
        conn = _place_fds(fds, request.get("passed_fds", []), conn)
        return _become(request, conn, server.shim)
    for fd in fds:
        os.close(fd)
    server.children[pid] = conn
    conn.sendall(struct.pack("!q", pid))
    return None


def _leave_server(server: _Serving) -> None:
    """In the forked child: close what belongs to the server."""
    signal.set_wakeup_fd(-1)
    server.selector.close()
    server.listener.close()
    os.close(server.wake_r)
    os.close(server.wake_w)
    for other in server.children.values():
        other.close()


def _place_fds(fds: list[int], passed: list[int], conn: socket.socket) -> socket.socket:
    """In the forked child: the shim's streams on 0-2 and the descriptors it was passed under their
    own numbers (each first moved above every target, so that no placement closes another one, nor
    the connection to the shim, which is moved too); returns that connection."""
    targets = [0, 1, 2, *passed]
    floor = max(targets) + 1
    if conn.fileno() <= floor:
        moved = fcntl.fcntl(conn.fileno(), fcntl.F_DUPFD_CLOEXEC, floor)
        conn.close()
        conn = socket.socket(fileno=moved)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(targets, high, strict=True):
        os.dup2(fd, target)  # inheritable, as the shim's were (its own children may need them)
        os.close(fd)
    return conn


def _reap(server: _Serving) -> None:
    """Collect the children that ended and tell each one's shim how it ended."""
    while server.children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        shim_conn = server.children.get(pid)
        if shim_conn is not None:
            del server.children[pid]
            with contextlib.suppress(OSError):
                shim_conn.sendall(struct.pack("!q", status))
            shim_conn.close()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A shim's request: its JSON (length-prefixed) and the three descriptors of its streams."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3 + MAX_PASSED_FDS)
    (size,) = struct.unpack("!I", data[:4])
    data = data[4:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise ValueError("short request")
        data += more
    request = json.loads(data)
    expected = 3 + len(request.get("passed_fds", []))
    if len(fds) != expected:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected {expected} descriptors, got {len(fds)}")
    return request, list(fds)


def _leave(code: int) -> None:
    """End a child as the interpreter ends: wait for its threads, run its exit functions, flush its
    streams; but without freeing every object, which here would copy most of the server's memory
    page by page (a second or more per process)."""
    import atexit

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)


if __name__ == "__main__":
    # Not this file's directory (its modules are dtlab.runtime's, not top-level ones): the working
    # directory, as ``python -m`` has it; each child puts its own there.
    sys.path[0] = os.getcwd()
    os.environ.pop("OMP_NUM_THREADS", None)  # the children set their own (read at import)
    code = serve(sys.argv[1], sys.argv[2])
    if code is not None:
        _leave(code)
