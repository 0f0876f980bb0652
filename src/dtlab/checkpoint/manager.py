"""Saving and resuming the whole training state: sharded, atomic, verified, async, tiered.

A save writes ``<run dir>/checkpoints/.tmp-step-NNNNNNNN/`` (DCP shards from every rank, ``state.json`` and
``config.yaml`` from rank 0); rank 0 then writes the manifest and renames the directory to
``step-NNNNNNNN``. With ``checkpoint.async`` the training thread only stages a copy of the tensors;
writing and committing go on in a background thread, and the next save first waits for the previous one.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dtlab.checkpoint.autoasync import AutoAsync, SaveCost
from dtlab.checkpoint.manifest import MANIFEST, _fsync_dir, verify_checkpoint, write_manifest
from dtlab.checkpoint.staging import _Stager
from dtlab.checkpoint.state import (
    Stateful,
    load_rng_state,
    merge_tensors,
    rng_state,
    split_tensors,
)
from dtlab.checkpoint.store import (
    ALERT_DIR,
    STEP_DIR,
    Tier,
    alert_name,
    config_changes,
    refuse_resume_advice,
    resume_conflicts,
    resume_fingerprint,
    step_name,
)
from dtlab.checkpoint.writer import (
    _CheckedWriter,
    collect_checksums,
    yield_to_training,
)
from dtlab.config import Config
from dtlab.data.tokenizer import Tokenizer
from dtlab.errors import CheckpointError
from dtlab.metrics.logging import logger
from dtlab.parallel.ledger import raise_if_failed

# DCP says so each time a single process saves or loads without a process group, which is intended here.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)


WRITERS = 8  # DCP writer threads (files) per rank


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Coordinator(Protocol):
    """How the ranks of a run work together on a checkpoint: who they are, and one choice rank 0 makes
    for all of them (the torch engine's :class:`~dtlab.parallel.dist.DistInfo`, the MLX engine's group)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_main(self) -> bool: ...
    def decide(self, fn: Callable[[], str | None]) -> str | None:
        """``fn()`` on rank 0; every rank gets its result, or its DtlabError raised."""
        ...


def _durable_tier(durable_dir: str | None, run_dir: Path) -> Tier | None:
    """The durable tier (``checkpoint.durable_dir``), where each run keeps a directory of its own."""
    if not durable_dir:
        return None
    return Tier(f"{durable_dir.rstrip('/')}/{run_dir.resolve().name}", "durable")


def _path(text: str | None) -> Path | None:
    return None if text is None else Path(text)


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


class Checkpointer:
    """Saves and restores named stateful parts in the run directory (and the durable tier, if set).

    ``states`` maps a name to anything with ``state_dict``/``load_state_dict``: the tensors of every
    state dict go through DCP under ``<name>.<key>``, the rest into ``state.json`` under ``<name>``. A
    part named in ``per_rank`` is each rank's own (gradient compression state): it is saved by every
    rank under its own name and restored only on the same world size.

    The commit (manifest, rename, retention, durable copy), the choice of a checkpoint to resume from
    and the staging directories are public: an engine that writes its own files (the MLX engine)
    stages them in :meth:`staging_dir` and calls :meth:`commit`. ``before_commit(step)`` is called
    between the written files and the manifest (fault injection: a torn or failed save), and
    ``before_stage(step)`` in the staging thread of an async save before it copies (a slow copy).

    An async save copies the tensors into buffers allocated once and reused from save to save, in a
    thread of its own: training goes on meanwhile, and must call :meth:`staged` before it next
    changes a saved tensor in place (the optimizer step), so the checkpoint holds the state of the
    step it was asked for.
    """

    def __init__(
        self,
        config: Config,
        run_dir: Path,
        coord: Coordinator,
        before_commit: Callable[[int], None] | None = None,
        data_identity: str | None = None,
        tokenizer: Tokenizer | None = None,
        before_stage: Callable[[int], None] | None = None,
    ) -> None:
        self.config, self.d, self.before_commit = config, coord, before_commit
        self.tokenizer = tokenizer  # saved in every checkpoint: generation and export read it there
        self.run_dir = run_dir
        # What the samples are made of: part of the resume fingerprint (another Python's stdlib,
        # changed files under the same paths: other samples).
        self.fingerprint = resume_fingerprint(config) | (
            {"data.identity": data_identity} if data_identity else {}
        )
        # The run's identity: its directory. The durable tier keeps each run in a directory of its own.
        self.identity = str(run_dir.resolve())
        self.local = Tier(run_dir / "checkpoints", "local")
        self.durable = _durable_tier(config.checkpoint.durable_dir, run_dir)
        self._init_async(coord, before_stage)
        self._init_records()

    def _init_async(self, coord: Coordinator, before_stage: Callable[[int], None] | None) -> None:
        """What async saves need (``checkpoint.async`` true or auto): their own process group, the
        staging buffers, and for auto the measurements that choose."""
        c = self.config.checkpoint
        # DCP's async write runs collectives from a background thread: give them their own group, so they
        # never interleave with the training step's collectives on the default group.
        uses_async = c.async_ is not False  # true, or auto
        self.group = (
            dist.new_group(backend="gloo") if uses_async and dist.is_initialized() else None
        )
        # The rank's own device (the engine's coordinator knows it; CPU otherwise): the staging
        # thread copies on it, never on whatever device a new thread starts on.
        device = getattr(coord, "device", None)
        device = device if isinstance(device, torch.device) else torch.device("cpu")
        self.stager = _Stager(device, before_stage) if uses_async else None
        # checkpoint.async: auto: the first saves measured, then the kind that cost training less.
        self.auto = AutoAsync() if c.async_ == "auto" else None

    def _init_records(self) -> None:
        """The saves' state and records: the running save, its error, and what was saved, failed
        and cost."""
        self._staging: Any = (
            None  # the running save's staging (a Future), until staged() waited for it
        )
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_step = 0
        self.resumed_from: str | None = None
        self.last_rollback: Path | None = None
        # Set by an alert stop before its save: what the alerts said. That save is committed as
        # alert-step-N (see store.ALERT_DIR), outside retention and the durable tier.
        self.alert: list[str] | None = None
        self.saved_steps: list[int] = []
        self.failures = 0
        self.durable_failures = 0  # copies to the durable tier that failed (the local commit stood)
        # Time each save kept the training thread: the call, and for an async save the waits for it
        # (its copy, before the next optimizer step; its write, at the next save or the end).
        self.blocked_s: list[float] = []
        # Seconds of the last save's phases (rank 0): gathering the state, writing the tensors (fsynced),
        # checksumming into the manifest, renaming into place.
        self.phases: dict[str, float] = {}
        # Checksums are CPU work: one thread per core, up to 4. Writing is I/O: more writers than
        # cores keep a fast disk busy (measured here: 2 writers 0.72 s, 8 writers 0.55 s for 1.1 GiB).
        self.threads = max(1, min(4, torch.get_num_threads()))
        self.writers = WRITERS
        self._retention: threading.Thread | None = None

    # --- saving ------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        every = self.config.checkpoint.every
        return every > 0 and step % every == 0

    def save(
        self,
        step: int,
        states: dict[str, Stateful],
        *,
        per_rank: Collection[str] = (),
        blocking: bool = False,
    ) -> None:
        """Save the state after optimizer step ``step``; with async and not ``blocking``, in the background.

        A save that fails (a full disk, no permission) is reported and counted, and training goes on:
        nothing of it is committed. Check ``step in saved_steps`` (rank 0) to know it was.
        """
        self.wait()
        t0 = time.perf_counter()
        use_async, record = self._save_kind(step, blocking)
        tmp = self.staging_dir(step)
        tensors, state = self._gather_state(step, tmp, states, per_rank)
        self.phases = {"prepare": time.perf_counter() - t0}
        try:
            if use_async:
                self._save_async(step, tmp, tensors, t0, state, record)
            else:
                self._save_sync(step, tmp, tensors, t0, state)
        except CheckpointException as e:
            self._save_failed(e, step, tmp)
        finally:
            if self._thread is None:
                self._report()
        blocked = time.perf_counter() - t0
        self.blocked_s.append(blocked)
        if record is not None:
            record.blocked_s += blocked

    def _save_kind(self, step: int, blocking: bool) -> tuple[bool, SaveCost | None]:
        """Whether this save is async, and what ``checkpoint.async: auto`` measures of it."""
        use_async = self.stager is not None and not blocking
        if use_async and self.auto is not None:
            use_async = self._auto_async()
        # What checkpoint.async: auto measures of this save (made before its thread can finish).
        record = (
            self.auto.started(step, use_async) if self.auto is not None and not blocking else None
        )
        return use_async, record

    def _gather_state(
        self, step: int, tmp: Path, states: dict[str, Stateful], per_rank: Collection[str]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The tensors DCP writes, and the JSON state rank 0 writes at the commit (with every rank's
        random state); rank 0 first clears ``tmp`` of a killed save's files."""
        tensors, rest = split_tensors({k: v.state_dict() for k, v in states.items()})
        rest = {k: v for k, v in rest.items() if k not in per_rank}  # rank 0 writes the JSON
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        # A collective: no rank goes on to write (DCP creates the directory) before the stale one is
        # gone. The JSON state is written by rank 0 when it commits, after the tensors.
        state = {"step": step, **rest, "rng": self._gather_rng()}
        return tensors, state

    def _save_async(
        self,
        step: int,
        tmp: Path,
        tensors: dict[str, Any],
        t0: float,
        state: dict[str, Any],
        record: SaveCost | None,
    ) -> None:
        """Stage the tensors and write them in the background; a thread of its own commits."""
        assert self.stager is not None
        self.stager.step = step
        response = dcp.async_save(
            tensors,
            storage_writer=self._writer(tmp, background=True),
            process_group=self.group,
            async_stager=self.stager,
            no_dist=_alone(),
        )
        assert isinstance(response, AsyncSaveResponse)  # an async stager: both futures
        self._staging = response.staging_completion
        wait_on: Any = response.upload_completion
        self._thread = threading.Thread(
            target=self._finish,
            args=(step, tmp, wait_on, t0, state, record),
            name="dtlab-ckpt",
            daemon=True,
        )
        self._thread.start()

    def _save_sync(
        self, step: int, tmp: Path, tensors: dict[str, Any], t0: float, state: dict[str, Any]
    ) -> None:
        """Write the tensors now, then commit."""
        dcp.save(tensors, storage_writer=self._writer(tmp), no_dist=_alone())
        self.phases["write"] = time.perf_counter() - t0 - self.phases["prepare"]
        self._finish(step, tmp, None, t0, state)

    def _save_failed(self, e: CheckpointException, step: int, tmp: Path) -> None:
        """Keep a failed write's error for the report and remove its files; a Ctrl-C pressed again
        during the save goes on as one."""
        # DCP gathered every rank's failure, so all ranks get here together.
        causes = [exc for exc, _ in e.failures.values()]
        if any(isinstance(c, KeyboardInterrupt) for c in causes):
            raise KeyboardInterrupt from None  # Ctrl-C pressed again during the save
        self._error, self._error_step = _first_cause(e, self.d.rank), step
        self._discard(tmp)

    def _auto_async(self) -> bool:
        """Whether this save of ``checkpoint.async: auto`` is async: the trial's kind, then the choice
        made (by rank 0's figures, for every rank alike) when the trial ends."""
        assert self.auto is not None
        use_async = self.auto.next_is_async()
        if use_async is not None:
            return use_async
        mine = self.auto.decide()
        verdict = self.d.decide(lambda: "async" if mine.use_async else "sync")
        choice = replace(mine, use_async=verdict == "async")
        self.auto.choice = choice
        if self.d.is_main:
            logger.info("%s", choice.message())
        if not choice.use_async and self.stager is not None:
            self.stager.close()  # its buffers: as large as the state, of no more use
            self.stager = None
        return choice.use_async

    def step_done(self, seconds: float) -> None:
        """A training step just ended after ``seconds`` (``checkpoint.async: auto`` judges an async
        save by how much slower the steps it overlaps run)."""
        if self.auto is not None:
            self.auto.step_done(seconds, time.perf_counter())

    @property
    def writing_in_background(self) -> bool:
        """Whether the last save was handed to a background thread (not yet waited for)."""
        return self._thread is not None

    def busy(self) -> bool:
        """Whether a background save or the deletion of old checkpoints is still running."""
        threads = (self._thread, self._retention)
        return any(t is not None and t.is_alive() for t in threads)

    def _writer(self, path: Path, background: bool = False) -> dcp.FileSystemWriter:
        # Several files per rank, written by parallel threads: one thread leaves most of the disk idle.
        return _CheckedWriter(
            str(path), thread_count=self.writers, rank=self.d.rank, background=background
        )

    def _gather_rng(self) -> list[dict[str, Any]]:
        mine = rng_state()
        if not dist.is_initialized():
            return [mine]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out

    def _finish(
        self,
        step: int,
        tmp: Path,
        future: Any,
        t0: float,
        state: dict[str, Any] | None = None,
        record: SaveCost | None = None,
    ) -> None:
        """Wait for the write, then (rank 0) commit: JSON state, manifest, rename, retention, durable copy."""
        if future is not None:  # the background thread of an async save
            yield_to_training()
        try:
            if future is not None:
                future.result()
                self.phases["write"] = time.perf_counter() - t0 - self.phases["prepare"]
            if self.d.is_main:
                if state is not None:
                    (tmp / "state.json").write_text(json.dumps(state), encoding="utf-8")
                    (tmp / "config.yaml").write_text(self.config.to_yaml(), encoding="utf-8")
                self._commit(step, tmp, t0)
            self.saved_steps.append(step)
        except BaseException as e:  # reported by wait(): a failed save must not go unnoticed
            self._error = _first_cause(e, self.d.rank) if isinstance(e, CheckpointException) else e
            self._error_step = step
            self._discard(tmp)
        finally:
            if record is not None:
                record.finished_at = time.perf_counter()

    def _discard(self, tmp: Path) -> None:
        """Rank 0 removes what a failed save wrote (every rank is done with it): on a full disk the
        space is needed, and nothing there was committed."""
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)

    def staging_dir(self, step: int) -> Path:
        """Where the files of step ``step``'s checkpoint are written before :meth:`commit`."""
        assert self.local.local_root is not None  # the local tier is a directory
        return self.local.local_root / f".tmp-{step_name(step)}"

    def commit(self, step: int, tmp: Path, t0: float) -> None:
        """Rank 0: make the checkpoint staged in ``tmp`` step ``step``'s (manifest, rename, retention,
        durable copy) and count it saved; ``t0`` is when its save began (for the logged rate)."""
        self._commit(step, tmp, t0)
        self.saved_steps.append(step)

    def record_failure(self, step: int, error: BaseException) -> None:
        """Report a save that failed: counted, logged, nothing committed; training goes on."""
        self._error, self._error_step = error, step
        self._report()

    def _commit(self, step: int, tmp: Path, t0: float) -> None:
        if self.tokenizer is not None:
            self.tokenizer.save(tmp)
        if self.before_commit is not None:
            self.before_commit(step)
        t1 = time.perf_counter()
        write_manifest(
            tmp,
            threads=self.threads,
            known=collect_checksums(tmp),
            step=step,
            world_size=self.d.world_size,
            strategy=self.config.parallel.strategy,
            engine=self.config.train.engine,
            resume_fingerprint=self.fingerprint,
            run_dir=self.identity,
            **({"alert": self.alert} if self.alert else {}),
        )
        final = tmp.parent / (alert_name(step) if self.alert else step_name(step))
        if final.exists():  # a checkpoint of the same step from an earlier attempt
            shutil.rmtree(final)
        t2 = time.perf_counter()
        tmp.rename(final)
        _fsync_dir(final.parent)
        size = _dir_bytes(final)
        dt = time.perf_counter() - t0
        self.phases |= {"manifest": t2 - t1, "rename": time.perf_counter() - t2}
        logger.info(
            "checkpoint step %d saved: %s (%.1f MiB in %.2f s, %.0f MiB/s)",
            step, final, size / 2**20, dt, size / 2**20 / max(dt, 1e-9),
        )  # fmt: skip
        if self.alert:
            # Saved after the step that raised the alert: kept aside, it deletes nothing, so the last
            # checkpoint from before the alert stays (and stays the one `resume: auto` takes).
            return
        # Deleting old checkpoints is not part of the commit: in the background (a second of a
        # large checkpoint's unlinking), joined before the next save, rollback or the end.
        self._retention = threading.Thread(
            target=self._prune, args=(step, tmp.name), name="dtlab-ckpt-retention", daemon=True
        )
        self._retention.start()
        c = self.config.checkpoint
        if self.durable is not None and (
            not c.durable_every or step % c.durable_every == 0 or step == self.config.train.steps
        ):
            self._copy_to_durable(final, step)

    def _prune(self, step: int, staged: str) -> None:
        # Never the checkpoint just committed, whatever else the directory holds.
        self.local.prune(self.config.checkpoint.keep, protect=[step])
        for stale in self.local.local_root.glob(".tmp-step-*"):  # type: ignore[union-attr]
            if stale.name < staged:  # left by saves that failed or were killed
                shutil.rmtree(stale, ignore_errors=True)

    def _copy_to_durable(self, final: Path, step: int) -> None:
        """Copy a committed checkpoint to the durable tier. A failure there (read-only, full, gone) is
        reported and counted; the local checkpoint stays committed and training goes on."""
        assert self.durable is not None
        where = self.durable.location(step)
        try:
            self.durable.claim(self.identity)
            if self.durable.put(final, step):
                logger.info("checkpoint step %d copied to %s", step, where)
            else:
                logger.info("checkpoint step %d is already in %s", step, where)
            self.durable.prune(self.config.checkpoint.keep, protect=[step])
        except Exception as e:  # any file system's error (fsspec backends raise their own kinds)
            self.durable_failures += 1
            logger.error(
                "copy of checkpoint step %d to %s failed: %s: %s (the local checkpoint is committed; "
                "the durable tier keeps what it had)",
                step, where, type(e).__name__, e,
            )  # fmt: skip

    def _report(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            self.failures += 1
            logger.error(
                "checkpoint of step %d failed: %s: %s (nothing of it was committed; the previous "
                "checkpoint stays the one to resume from)",
                self._error_step, type(e).__name__, e,
            )  # fmt: skip

    def staged(self) -> None:
        """Wait until the running async save has copied the tensors (at once if it has, or there is
        none); the wait counts as time the save blocked training. Call it before changing a saved
        tensor in place. A staging that failed is reported with the save."""
        if self._staging is None:
            return
        t0 = time.perf_counter()
        with contextlib.suppress(Exception):  # the save fails with it, and says so when waited for
            self._staging.result()
        self._staging = None
        if self.blocked_s:
            self.blocked_s[-1] += time.perf_counter() - t0

    def wait(self) -> None:
        """Wait for the background save, if any, and for retention; report a failed save. The wait
        counts as time the last save blocked training."""
        t0 = time.perf_counter()
        self.staged()
        t1 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._retention is not None:
            self._retention.join()
            self._retention = None
        t2 = time.perf_counter()
        if self.blocked_s:
            self.blocked_s[-1] += t2 - t1  # staged() counted its own
        if self.auto is not None:
            self.auto.waited(t2 - t0)
        self._report()

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    # --- resuming ----------------------------------------------------------------------------------
    def _pick(self) -> Path | None:
        """Rank 0: the checkpoint to resume from, verified, or None."""
        resume = self.config.checkpoint.resume
        if resume == "never":
            return None
        if resume != "auto":
            path = Path(resume)
            if not (path / MANIFEST).exists() and (path / "checkpoints").is_dir():
                steps = Tier(path / "checkpoints", "local").committed()
                if not steps:
                    raise CheckpointError(
                        f"checkpoint.resume = '{resume}': the run has no complete checkpoint"
                    )
                path = path / "checkpoints" / step_name(steps[-1])
            verify_checkpoint(path)
            return path
        tiers = [self.local, *([self.durable] if self.durable else [])]
        candidates = sorted(
            ((s, i) for i, t in enumerate(tiers) for s in t.committed()), reverse=True
        )
        for step, i in candidates:
            tier = tiers[i]
            try:
                if tier is self.local:
                    path = self.local.local_root / step_name(step)  # type: ignore[operator]
                else:
                    path = self._fetch(tier, step)
                manifest = verify_checkpoint(path)
                owner = manifest.get("run_dir")
                if tier is not self.local and owner is not None and owner != self.identity:
                    raise CheckpointError(f"it belongs to the run in '{owner}'")
                return path
            except CheckpointError as e:
                logger.warning("skipping checkpoint step %d (%s tier): %s", step, tier.name, e)
                if tier is self.local:
                    # Out of the way (kept for inspection): never picked, never counted by retention.
                    bad = self.local.local_root / step_name(step)  # type: ignore[operator]
                    aside = bad.parent / f".unusable-{step_name(step)}"
                    shutil.rmtree(aside, ignore_errors=True)
                    bad.rename(aside)
                    logger.warning("moved it to %s", aside)
        return None

    def _fetch(self, tier: Tier, step: int) -> Path:
        """Bring a durable checkpoint into the local tier (verified before it is renamed into place)."""
        final = self.local.local_root / step_name(step)  # type: ignore[operator]
        if final.exists():
            return final
        if tier.local_root is not None:
            return tier.local_root / step_name(step)
        tmp = final.parent / f".fetch-{step_name(step)}"
        shutil.rmtree(tmp, ignore_errors=True)
        tier.fetch(step, tmp)
        verify_checkpoint(tmp)
        tmp.rename(final)
        return final

    def choose(self, check: Callable[[Path | None], None] | None = None) -> Path | None:
        """The checkpoint ``checkpoint.resume`` selects, verified and checked against the config on
        rank 0; every rank gets the same answer (or the same error). ``check(path)`` runs on rank 0
        after the choice (the caller's own conditions), within the same agreement."""

        def pick() -> Path | None:
            if self.durable is not None:
                self.durable.check_owner(self.identity)
            path = self._pick()
            if path is not None:
                manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
                saved = manifest["resume_fingerprint"]
                conflicts = resume_conflicts(saved, self.fingerprint)
                if conflicts:
                    # What holds a run in a directory: see dtlab.train.rundir.check_start.
                    holds_run = bool(self.local.committed()) or any(
                        (self.run_dir / f).is_file() for f in ("metrics.jsonl", "summary.json")
                    )
                    advice = refuse_resume_advice(
                        saved, self.fingerprint, self.config.checkpoint.resume,
                        self.own_step(path) is not None, self.run_dir, holds_run,
                    )  # fmt: skip
                    raise CheckpointError(
                        f"cannot resume from '{path}': {'; '.join(conflicts)}. {advice}"
                    )
            if check is not None:
                check(path)
            return path

        return _path(self.d.decide(lambda: _text(pick())))

    def own_step(self, path: Path | None) -> int | None:
        """The step of ``path`` when it is one of this run's own checkpoints (either tier), else None."""
        if path is None:
            return None
        roots = [self.local.local_root, *([self.durable.local_root] if self.durable else [])]
        if not any(r is not None and path.parent.resolve() == r.resolve() for r in roots):
            return None
        m = STEP_DIR.match(path.name) or ALERT_DIR.match(path.name)
        return int(m.group(1)) if m else None

    def restored(self, path: Path) -> int:
        """Note that this run resumed from checkpoint ``path`` (loaded by its engine): logs the settings
        changed since it was saved (rank 0); returns its step."""
        self.resumed_from = str(path)
        if self.d.is_main:
            changes = config_changes(saved_config(path), self.config)
            if changes:
                # The config given now wins (learning rate, schedule, optimizer settings, ...).
                logger.info("settings changed since the checkpoint: %s", "; ".join(changes))
        return int(json.loads((path / "state.json").read_text(encoding="utf-8"))["step"])

    def load(
        self, path: Path, states: dict[str, Stateful], *, per_rank: Collection[str] = ()
    ) -> None:
        """Load checkpoint ``path`` into ``states`` (every rank; DCP reshards to this run's layout).

        A checkpoint the MLX engine wrote loads too (:mod:`dtlab.checkpoint.engines`): its tensors
        through DCP as the torch engine's; the parts it does not hold (the optimizer's param groups,
        the schedule, the loss scaler, the random states, per-rank state) keep this run's, which the
        caller sets to the resumed step."""
        from dtlab.checkpoint.engines import MlxFilesReader, engine_of
        from dtlab.checkpoint.safe_io import safe_load

        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        if "optim_param_groups" in state:  # written before the optimizer was a part like the others
            state["optim"] = {"param_groups": state.pop("optim_param_groups")}
        names = [k for k in states if k not in per_rank]
        tensors, live = split_tensors({k: states[k].state_dict() for k in names})
        mlx = engine_of(state) == "mlx"
        reader = MlxFilesReader(path) if mlx else None
        if mlx:
            state = {**live, **{k: v for k, v in state.items() if k in live}, "rng": []}
        saved_world = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["world_size"]
        own = {name: {} if mlx else _per_rank_template(path, name) for name in per_rank}
        if saved_world == self.d.world_size:
            tensors |= {name: t for name, t in own.items() if t}
        elif any(own.values()):
            logger.warning(
                "compression state of %d ranks cannot map onto %d: starting it afresh",
                saved_world, self.d.world_size,
            )  # fmt: skip
        safe_load(tensors, path, no_dist=_alone(), reader=reader)
        for name in names:
            states[name].load_state_dict(merge_tensors(tensors.get(name, {}), state.get(name, {})))
        for name in per_rank:
            if name in tensors:
                states[name].load_state_dict(tensors[name])
        rngs = state["rng"]
        if rngs:  # the MLX engine saves none: its training draws no random numbers after the start
            load_rng_state(rngs[self.d.rank] if self.d.rank < len(rngs) else rngs[0])

    def latest(self) -> Path | None:
        """The newest committed local checkpoint (for rolling back), as rank 0 sees it once its own
        background save has committed; every rank gets the same one."""
        self.wait()

        def newest() -> Path | None:
            steps = self.local.committed()
            return self.local.local_root / step_name(steps[-1]) if steps else None  # type: ignore[operator]

        return _path(self.d.decide(lambda: _text(newest())))


def _first_cause(e: CheckpointException, rank: int = 0) -> BaseException:
    """The error inside DCP's wrapper (this rank's, else the first failing rank's), or the OSError
    behind it: torch's writer reports a full disk as a RuntimeError raised while handling it."""
    failures = dict(sorted(e.failures.items()))
    if not failures:
        return e
    first: BaseException = failures.get(rank, next(iter(failures.values())))[0]
    exc: BaseException | None = first
    while exc is not None and not isinstance(exc, OSError):
        exc = exc.__cause__ or exc.__context__
    return exc or first


def _per_rank_template(path: Path, name: str) -> dict[str, Any]:
    """Empty tensors for the saved state of the per-rank part ``name``, shaped as the checkpoint's
    index says (its shapes need not be this run's)."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dtlab.checkpoint.safe_io import SafeFileSystemReader

    prefix = name + "."
    meta = SafeFileSystemReader(str(path)).read_metadata()
    return {
        k[len(prefix) :]: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }


def saved_config(path: Path) -> dict[str, Any]:
    """The resolved config stored in a checkpoint."""
    return yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))


def _alone() -> bool:
    """Whether this process saves or loads as the only rank (no process group). A rank whose
    collectives failed raises instead: torch then reports no process group, and it would commit a
    checkpoint of its own as though it were the whole run."""
    raise_if_failed()
    return not dist.is_initialized()
