"""The manifest that makes a checkpoint directory complete.

A checkpoint is written into a temporary directory; ``manifest.json`` (size and checksum of every file,
step, config fingerprint, world size, versions) is written last, and the directory is then renamed into
place. A directory without a valid manifest, or whose files do not match it, is never loaded.

The checksum is CRC-32 (format 2): it detects a torn, truncated or bit-flipped file as surely as a
cryptographic hash detects accidental damage (every burst of up to 32 flipped bits, and other damage
but for one case in 2^32), at several GB/s instead of SHA-256's one: checksumming a checkpoint costs a
fraction of writing it. A checkpoint is not a signed artifact; its metadata is read through a
restricted unpickler whatever its checksums say (:mod:`dtlab.checkpoint.safe_io`). Checkpoints of
format 1 (SHA-256) are still verified and loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dtlab.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
READ_FORMATS = (1, 2)
CHUNK = 8 << 20  # bytes read at a time: large enough that zlib and hashlib run without the GIL


def file_sha256(path: Path, chunk: int = CHUNK) -> str:
    """SHA-256 of a file (format 1 manifests)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_crc32(path: Path, chunk: int = CHUNK) -> str:
    """CRC-32 of a file, as 8 hex digits (format 2 manifests)."""
    crc = 0
    with path.open("rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


# Each format's checksum: (the manifest's key for it, how to compute it, its name in messages).
_CHECKSUMS: dict[int, tuple[str, Callable[[Path], str], str]] = {
    1: ("sha256", file_sha256, "SHA-256"),
    2: ("crc32", file_crc32, "CRC-32"),
}


def _fsync_dir(path: Path) -> None:
    # Make a rename or a new file durable; not every platform lets a directory be opened.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(
    ckpt_dir: Path,
    threads: int = 1,
    known: dict[str, tuple[str, int]] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """Checksum every file under ``ckpt_dir`` and write ``manifest.json`` atomically; returns it.

    ``known`` has the CRC-32 and size of files checksummed as they were written (by name, under the
    top directory); a file whose size differs from it is read again. The others are read,
    ``threads`` at a time (zlib releases the GIL on large buffers), from the page cache when they
    were just written.
    """
    import torch

    import dtlab

    paths = sorted(
        p
        for p in ckpt_dir.rglob("*")
        if p.is_file() and p.relative_to(ckpt_dir).as_posix() not in (MANIFEST, MANIFEST + ".tmp")
    )
    key, checksum, _ = _CHECKSUMS[FORMAT_VERSION]
    known = known or {}

    def rel(p: Path) -> str:
        return p.relative_to(ckpt_dir).as_posix()

    fresh = [p for p in paths if rel(p) not in known or known[rel(p)][1] != p.stat().st_size]
    computed = dict(zip(fresh, _map(checksum, fresh, threads), strict=True))
    digests = [computed[p] if p in computed else known[rel(p)][0] for p in paths]
    files = {
        p.relative_to(ckpt_dir).as_posix(): {"bytes": p.stat().st_size, key: h}
        for p, h in zip(paths, digests, strict=True)
    }
    manifest = {
        "format": FORMAT_VERSION,
        **fields,
        "torch_version": torch.__version__,
        "dtlab_version": dtlab.__version__,
        "files": files,
    }
    tmp = ckpt_dir / (MANIFEST + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST)
    _fsync_dir(ckpt_dir)
    return manifest


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """The manifest of ``ckpt_dir``; a CheckpointError if it is missing or unreadable."""
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{ckpt_dir}' has no {MANIFEST}: it is incomplete")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest '{path}' cannot be read: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint manifest '{path}' is not a dtlab manifest")
    if manifest.get("format") not in READ_FORMATS:
        raise CheckpointError(
            f"checkpoint manifest '{path}' has format {manifest.get('format')!r}; "
            f"this dtlab reads formats {', '.join(map(str, READ_FORMATS))}"
        )
    return manifest


def _map(fn: Callable[[Path], str], paths: list[Path], threads: int) -> list[str]:
    """``fn`` of every path, ``threads`` at a time, largest files first (the shortest finish)."""
    if threads <= 1 or len(paths) <= 1:
        return [fn(p) for p in paths]
    order = sorted(range(len(paths)), key=lambda i: -paths[i].stat().st_size)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        done = dict(zip(order, pool.map(fn, [paths[i] for i in order]), strict=True))
    return [done[i] for i in range(len(paths))]


def verify_checkpoint(ckpt_dir: Path, checksums: bool = True, threads: int = 2) -> dict[str, Any]:
    """Check every file of ``ckpt_dir`` against its manifest; returns the manifest.

    Raises CheckpointError naming the first file that is missing, has the wrong size or (with
    ``checksums``) the wrong checksum; ``threads`` files are checksummed at a time.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint '{ckpt_dir}' does not exist or is not a directory")
    manifest = read_manifest(ckpt_dir)
    key, checksum, name = _CHECKSUMS[manifest["format"]]
    for rel, want in manifest["files"].items():
        path = ckpt_dir / rel
        # Names come from the file: refuse anything that would leave the checkpoint directory.
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"checkpoint manifest '{ckpt_dir / MANIFEST}' names '{rel}'")
        if not path.is_file():
            raise CheckpointError(f"checkpoint file '{path}' is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint file '{path}' has {size} bytes; the manifest says {want['bytes']} (truncated or torn)"
            )
        if not isinstance(want.get(key), str):
            raise CheckpointError(
                f"checkpoint manifest '{ckpt_dir / MANIFEST}' has no {key} of '{rel}'"
            )
    if checksums:
        rels = list(manifest["files"])
        digests = _map(checksum, [ckpt_dir / r for r in rels], threads)
        for rel, got in zip(rels, digests, strict=True):
            if got != manifest["files"][rel][key]:
                raise CheckpointError(
                    f"checkpoint file '{ckpt_dir / rel}' does not match its {name} checksum"
                )
    return manifest
