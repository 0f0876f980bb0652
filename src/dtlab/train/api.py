"""``dtlab.train(config)``: train from Python (a script or a notebook) and get the run's summary.

The run trains in this process, on one process, through the same loop as ``dtlab train`` without
``--nproc``: strategy ``single`` needs no process group; ``ddp``/``fsdp`` on one process make a local
one. What the run sets up in this process is given back when it ends, also on an error: the process
group, the run directory's lock and the signal handlers (by the loop), the ``dtlab`` logger's handlers
and torch's thread count (here), so it can be called again. Started by a launcher (``torchrun``), it
trains as that launcher's rank, as ``dtlab train`` does.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dtlab.config import Config, apply_override, check_world, config_from_dict, load_config
from dtlab.dims import ParallelDims
from dtlab.errors import ConfigError

__all__ = ["resolve_config", "train"]


def resolve_config(
    config: Config | Mapping[str, Any] | str | Path | None, overrides: Iterable[str] = ()
) -> Config:
    """The run's config: a :class:`Config` (copied), a dict of sections (as the YAML file holds), the
    path of a YAML file or run directory, or None for the built-in default; then ``overrides``
    (``"key=value"`` strings, as ``--set`` takes them) and the same validation as the CLI."""
    given = overrides
    overrides = [] if isinstance(given, str) else list(given)
    if isinstance(given, str) or any(not isinstance(o, str) for o in overrides):
        raise ConfigError(
            f"overrides = {given!r}: allowed: a list of 'key=value' strings, e.g. ['train.lr=1e-4']"
        )
    if config is None or isinstance(config, str | Path):
        return load_config(config, overrides)
    if isinstance(config, Config):
        data = config.to_dict()
    elif isinstance(config, Mapping):
        data = copy.deepcopy(dict(config))  # overrides must not change the caller's dict
    else:
        raise ConfigError(
            f"config = <{type(config).__name__}>: allowed: a dtlab.Config, a dict of config sections, "
            "the path of a YAML file or run directory, or None (the built-in default)"
        )
    for ov in overrides:
        apply_override(data, ov)
    return config_from_dict(data)


def train(
    config: Config | Mapping[str, Any] | str | Path | None = None, overrides: Iterable[str] = ()
) -> dict[str, Any]:
    """Train as configured, in this process, and return the run's summary (what
    ``<run dir>/summary.json`` holds).

    ``config``: a :class:`dtlab.Config`, a dict of config sections (``{"model": {"preset": "debug"}}``),
    the path of a YAML file or run directory, or None for the built-in default; ``overrides``:
    ``"key=value"`` strings, as ``dtlab train --set`` takes them (they win over ``config``).

    Raises a :class:`dtlab.errors.DtlabError` for what the user gave (config, data, paths), also when
    the config needs more than one process (then ``dtlab train CONFIG --nproc N`` runs it), and
    :class:`dtlab.errors.Preempted` when a signal stopped the run after saving a checkpoint (calling
    again with the same config resumes it).
    """
    from dtlab.parallel.dist import is_worker_env

    cfg = resolve_config(config, overrides)
    if is_worker_env():  # one rank of a world a launcher started: the loop checks that world
        return _train_here(cfg)
    check_one_process(cfg)
    if cfg.train.engine == "mlx":
        from dtlab.mlx import require_mlx
        from dtlab.mlx.train import train_mlx

        require_mlx()
        with _restored_process_state():
            return train_mlx(cfg)
    from dtlab.checkpoint.init_from import check_before_launch

    check_before_launch(cfg, None)
    return _train_here(cfg)


def check_one_process(cfg: Config) -> None:
    """A ConfigError, saying how to run it, when ``cfg`` cannot train on one process."""
    try:
        check_world(cfg, 1)
    except ConfigError as e:
        fewest = ParallelDims.min_world_size(cfg)
        nproc = fewest if fewest > 1 else "N"
        raise ConfigError(
            f"{e}. dtlab.train runs one process (world size 1); this config needs more: run it "
            f"with `dtlab train CONFIG --nproc {nproc}`"
        ) from None


def _train_here(cfg: Config) -> dict[str, Any]:
    from dtlab.train.loop import train as train_rank

    with _restored_process_state():
        return train_rank(cfg)


@contextmanager
def _restored_process_state() -> Iterator[None]:
    """Put back what a run changes in the process beyond the loop's own clean-up: the ``dtlab``
    logger's handlers and level, and torch's thread count."""
    import torch

    log = logging.getLogger("dtlab")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        log.handlers[:] = handlers
        log.setLevel(level)
        log.propagate = propagate
        torch.set_num_threads(threads)
