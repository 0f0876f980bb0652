"""The manifest that makes a checkpoint directory complete.

A checkpoint is written into a temporary directory; ``manifest.json`` (sizes and SHA-256 of every file,
step, config fingerprint, world size, versions) is written last, and the directory is then renamed into
place. A directory without a valid manifest, or whose files do not match it, is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dtlab.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


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


def write_manifest(ckpt_dir: Path, threads: int = 1, **fields: Any) -> dict[str, Any]:
    """Checksum every file under ``ckpt_dir`` and write ``manifest.json`` atomically; returns it.

    ``threads`` files are hashed at a time (hashlib releases the GIL on large buffers).
    """
    import torch

    import dtlab

    paths = sorted(
        p
        for p in ckpt_dir.rglob("*")
        if p.is_file() and p.relative_to(ckpt_dir).as_posix() not in (MANIFEST, MANIFEST + ".tmp")
    )
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        digests = list(pool.map(file_sha256, paths))
    files = {
        p.relative_to(ckpt_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": h}
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
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint manifest '{path}' has format {manifest.get('format')!r}; "
            f"this dtlab reads format {FORMAT_VERSION}"
        )
    return manifest


def verify_checkpoint(ckpt_dir: Path, checksums: bool = True) -> dict[str, Any]:
    """Check every file of ``ckpt_dir`` against its manifest; returns the manifest.

    Raises CheckpointError naming the first file that is missing, has the wrong size or (with
    ``checksums``) the wrong SHA-256.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint '{ckpt_dir}' does not exist or is not a directory")
    manifest = read_manifest(ckpt_dir)
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
        if checksums and file_sha256(path) != want["sha256"]:
            raise CheckpointError(f"checkpoint file '{path}' does not match its SHA-256 checksum")
    return manifest
