"""Checkpoints of the whole training state: sharded, atomic, verified, async, tiered, exportable."""
