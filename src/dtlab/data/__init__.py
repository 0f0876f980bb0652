"""Data: sample sources (synthetic, stdlib corpus, files), the byte tokenizer, per-rank batching."""

from dtlab.data.loader import BatchLayout, BatchLoader
from dtlab.data.sources import SyntheticSource, TokenWindows, build_source, stdlib_files

__all__ = [
    "BatchLayout",
    "BatchLoader",
    "SyntheticSource",
    "TokenWindows",
    "build_source",
    "stdlib_files",
]
