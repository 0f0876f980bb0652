"""Rank-aware logging: rank 0 reports progress; every rank reports warnings and errors, tagged."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("dtlab")


def setup_logging(rank: int = 0, world_size: int = 1) -> None:
    """Configure the ``dtlab`` logger: INFO on rank 0, WARNING elsewhere; a rank tag when distributed."""
    tag = f"[rank{rank}] " if world_size > 1 else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {tag}%(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
