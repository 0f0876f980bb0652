"""How a rank writes its checkpoint files: DCP's file writer, with every file's CRC-32 taken as its bytes
go by (for the manifest), a save that fails when any writer thread failed, and a background save's
threads at the lowest CPU priority."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import threading
import zlib
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

# DCP writes a rank's files from several threads; a thread that fails (a full disk) dies with a
# traceback on stderr while DCP goes on with the results of the others, as if its items had been
# written. _CheckedWriter turns that into a failed save; the traceback becomes one recorded error.
_writer_errors: list[BaseException] = []
_previous_excepthook = threading.excepthook


def _writer_thread_hook(args: threading.ExceptHookArgs) -> None:
    if args.thread is not None and "_write_files_from_queue" in args.thread.name:
        _writer_errors.append(args.exc_value or RuntimeError("a writer thread failed"))
        return
    _previous_excepthook(args)


threading.excepthook = _writer_thread_hook


class _ChecksummedStream:
    """A file being written, whose bytes are CRC-32'd as they go by (zlib holds no interpreter lock
    on large buffers), so that the manifest need not read the file again."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.crc, self.size = raw, 0, 0

    def write(self, b: Any) -> int:
        self.crc = zlib.crc32(b, self.crc)
        self.size += memoryview(b).nbytes
        return int(self.raw.write(b))

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close: the file's own
        return getattr(self.raw, name)


def yield_to_training() -> None:
    """Give the calling thread the lowest CPU priority, niceness 19 (Linux keeps one per thread;
    elsewhere nothing changes). A background save's threads then take what training leaves idle rather
    than a fair share of the cores: 8 writer threads beside 2 training threads would get 4/5 of them.
    Not SCHED_IDLE: a thread that holds the interpreter lock must still get a turn on a busy machine, or
    the training thread waits for the lock behind it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


@contextlib.contextmanager
def _without_record_crc32() -> Generator[None, None, None]:
    """torch.save (DCP writes each tensor with it) CRC-32s every record it writes: a second pass over
    the bytes that the manifest's CRC-32 already covers, taken as they are written (a quarter of a
    save's CPU time, measured). Off in the calling thread while it writes a file: torch keeps the
    option per thread, so nothing else is touched (and torch.load reads either)."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    if get is None:  # a torch without the option
        yield
        return
    before = get()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording the CRC-32 and size of every file written through it; in
    a background save, its writer threads yield to training (:func:`yield_to_training`)."""

    def __init__(self, background: bool = False) -> None:
        super().__init__()
        self.checksums: dict[str, tuple[str, int]] = {}
        self.background = background
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            if self.background:  # a writer thread of DCP's, or the thread DCP's async save runs in
                yield_to_training()
            stream = _ChecksummedStream(raw)
            with _without_record_crc32():
                yield stream
        with self._lock:
            self.checksums[Path(path).name] = (f"{stream.crc:08x}", stream.size)


CHECKSUMS = ".crc32-rank{rank}.json"  # each rank's data files' checksums, for rank 0's manifest


class _CheckedWriter(dcp.FileSystemWriter):
    """DCP's file writer, except that a save whose items were not all written fails, and that it
    checksums the files as it writes them: each rank leaves its files' CRC-32s in ``CHECKSUMS`` for
    rank 0, which puts them in the manifest (:func:`collect_checksums`) instead of reading every
    byte again."""

    def __init__(self, path: str, thread_count: int, rank: int, background: bool = False) -> None:
        super().__init__(path, thread_count=thread_count)
        self.fs = _ChecksummingFileSystem(background)
        self.rank = rank

    def write_data(self, plan: Any, planner: Any) -> Any:
        before = len(_writer_errors)
        future = super().write_data(plan, planner)
        written, wanted = len(future.value()), len(plan.items)
        if written != wanted:
            raise save_failure(_writer_errors[before:], wanted - written, wanted, Path(self.path))
        sums = self.fs.checksums  # type: ignore[attr-defined]
        (Path(self.path) / CHECKSUMS.format(rank=self.rank)).write_text(json.dumps(sums))
        return future


# Below this many bytes free, a save whose threads failed without an OSError of their own failed for
# the disk (a short write, met by torch's zip writer as a position mismatch).
FULL_BELOW = 1 << 20


def save_failure(errors: list[BaseException], missing: int, wanted: int, path: Path) -> OSError:
    """The error a rank's save raises when ``missing`` of its ``wanted`` items were not written:
    its root cause, an OSError (a full disk) if a writer thread had one, the threads that failed
    after it failing on what it left (a zip writer's position check). A full disk can reach the
    threads as that position check alone (a short write that raised nothing): with less than
    :data:`FULL_BELOW` bytes left where ``path`` is, it is named as what it is."""
    oserrors = [e for e in errors if isinstance(e, OSError)]
    cause: BaseException | None = (oserrors or errors or [None])[0]
    code = getattr(cause, "errno", None) or errno.EIO
    if not oserrors:
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(path).free
            if free < FULL_BELOW:
                code = errno.ENOSPC
                cause = OSError(
                    errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free:,} bytes free); {cause}"
                )
    return OSError(
        code,
        f"{missing} of {wanted} items of this rank were not written (a writer thread failed: {cause})",
    )


def collect_checksums(ckpt_dir: Path) -> dict[str, tuple[str, int]]:
    """The checksums the ranks' writers recorded (file name -> (CRC-32, bytes)); their files are
    removed: the manifest holds them from here on."""
    out: dict[str, tuple[str, int]] = {}
    for path in ckpt_dir.glob(CHECKSUMS.format(rank="*")):
        out |= {k: (str(v[0]), int(v[1])) for k, v in json.loads(path.read_text()).items()}
        path.unlink()
    return out
