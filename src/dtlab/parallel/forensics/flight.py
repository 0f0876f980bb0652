"""Torch's flight recorder: the collectives this process issued, as torch itself recorded them.

Torch keeps two: the generic one (gloo's and other CPU backends' collectives,
``_dump_fr_trace``) and NCCL's (``_dump_nccl_trace``, in CUDA builds only), each filled only while
``TORCH_FR_BUFFER_SIZE`` (formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``) is above 0 when the process group
is created (:func:`dtlab.parallel.dist.nccl_env` sets it). A rank reads the one of its backend.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

__all__ = ["dump_names", "flight_recorder", "in_flight"]


def dump_names(backend: str | None) -> tuple[str, str]:
    """(the pickle dump, the JSON dump) of ``torch._C._distributed_c10d`` that hold ``backend``'s
    collectives: NCCL's own recorder for ``nccl``, the generic one otherwise."""
    if backend == "nccl":
        return "_dump_nccl_trace", "_dump_nccl_trace_json"
    return "_dump_fr_trace", "_dump_fr_trace_json"


def flight_recorder(after: int | None, backend: str | None = None) -> dict[str, Any] | None:
    """This process's flight-recorder dump for ``backend``'s collectives, or None (none recorded, or
    this torch build has no such recorder).

    ``after``: keep the Python call sites of the default group's collectives after this torch sequence
    number (reading call sites is slower; None reads none).
    """
    import torch._C._distributed_c10d as c10d

    dump, dump_json = (getattr(c10d, n, None) for n in dump_names(backend))
    try:
        if after is not None and dump is not None:
            # Torch's own pickle of this process's trace (the call sites come only this way).
            doc = pickle.loads(dump(includeStackTraces=True))
        elif dump_json is not None:
            doc = json.loads(dump_json())
        else:
            return None
    except Exception:
        return None
    entries = doc.get("entries") or []
    for e in entries:
        if not _since(e, after):
            e.pop("frames", None)
    return {"pg_status": doc.get("pg_status"), "entries": entries[-256:]}


# Call sites are where dtlab called into the ledger, not the ledger's own files.
_HERE = ("/dtlab/parallel/ledger.py", "/dtlab/parallel/forensics/")


def _since(e: dict[str, Any], after: int | None) -> bool:
    """Whether a flight-recorder entry is one of the default group's collectives after ``after``."""
    return after is not None and e.get("pg_id") == 0 and int(e.get("collective_seq_id", 0)) > after


def in_flight(fr: dict[str, Any] | None, after: int | None, most: int = 3) -> str:
    """The default group's collectives after torch sequence number ``after``, newest last; '' if none."""
    if not fr:
        return ""
    found = [e for e in fr.get("entries", []) if _since(e, after)]
    texts = []
    for e in found[-most:]:
        sizes = e.get("input_sizes") or []
        dtypes = e.get("input_dtypes") or []
        tensors = " ".join(
            f"{d}[{', '.join(map(str, s))}]" for d, s in zip(dtypes, sizes, strict=False)
        )
        text = f"torch #{e.get('collective_seq_id')} {e.get('profiling_name')} {tensors}".rstrip()
        for f in e.get("frames") or []:
            path = str(f.get("filename", ""))
            if "/dtlab/" in path and not any(h in path for h in _HERE):
                site = "dtlab/" + path.rsplit("/dtlab/", 1)[1]
                text += f" from {site}:{f.get('line')} ({f.get('name')})"
                break
        texts.append(text)
    if len(found) > most:
        texts.insert(0, f"{len(found) - most} more, then")
    return ", ".join(texts)
