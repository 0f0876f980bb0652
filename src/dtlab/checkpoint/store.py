"""Where checkpoints live: step directories in tiers, retention, and which run to resume.

A tier is a directory (a local path, or any fsspec URL for the durable tier) holding
``step-NNNNNNNN/`` checkpoint directories. Only names of that form that contain a manifest count; the
temporary directories a save writes into start with a dot and are never picked.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from dtlab.checkpoint.manifest import MANIFEST, verify_checkpoint
from dtlab.config import Config
from dtlab.config.loading import yaml_scalar
from dtlab.errors import CheckpointError

STEP_DIR = re.compile(r"^step-(\d{8})$")
# The checkpoint an alert stop saves (``alerts.action: stop``), kept aside for inspection: never what
# ``resume: auto`` takes, never counted or deleted by retention, so the last checkpoint from before the
# alert stays the one to resume from.
ALERT_DIR = re.compile(r"^alert-step-(\d{8})$")
OWNER = "owner.json"  # at the root of a durable tier: the run directory it belongs to

# Config keys whose change makes a checkpoint unusable (other shapes) or silently wrong (other samples).
RESUME_KEYS = (
    "model.dim",
    "model.n_layers",
    "model.n_heads",
    "model.n_kv_heads",
    "model.vocab_size",
    "model.ffn_dim",
    "model.tie_embeddings",
    "model.rope_theta",
    "model.norm_eps",
    "data.source",
    "data.paths",
    "data.seq_len",
    "data.tokenizer",
    "train.global_batch_size",
    "train.seed",
)
# Fingerprint entries that are not config keys: what the data source's samples are made of.
DERIVED_KEYS = ("data.identity",)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def alert_name(step: int) -> str:
    """The directory of the checkpoint an alert stop saved after ``step`` (see ``ALERT_DIR``)."""
    return f"alert-{step_name(step)}"


def alert_steps(root: Path) -> list[int]:
    """Steps of the alert checkpoints (with a manifest) in the local tier ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = (ALERT_DIR.match(p.name) for p in root.iterdir())
    return sorted(int(m.group(1)) for m in found if m and (root / m.group(0) / MANIFEST).is_file())


def _lookup(tree: dict[str, Any], key: str) -> Any:
    value: Any = tree
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def resume_fingerprint(config: Config | dict[str, Any]) -> dict[str, Any]:
    """The values of RESUME_KEYS: two configs with equal fingerprints can resume each other."""
    tree = config if isinstance(config, dict) else config.model_dump(by_alias=True, mode="json")
    return {k: _lookup(tree, k) for k in RESUME_KEYS}


def _differing(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The fingerprint's keys whose values differ. Derived entries (not config keys) count only where
    both sides have them: an older checkpoint that did not record one cannot be checked on it."""
    derived = [k for k in DERIVED_KEYS if k in saved and k in current]
    return [k for k in (*RESUME_KEYS, *derived) if saved.get(k) != current.get(k)]


def resume_conflicts(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: saved -> current`` for every key of the fingerprint that differs."""
    return [
        f"{k} = {saved.get(k)!r} in the checkpoint, {current.get(k)!r} now"
        for k in _differing(saved, current)
    ]


def refuse_resume_advice(
    saved: dict[str, Any],
    current: dict[str, Any],
    resume: str,
    own: bool,
    run_dir: Path,
    holds_run: bool,
) -> str:
    """What a run refused for ``resume_conflicts(saved, current)`` can do instead; each fix works when
    followed. ``resume``: ``checkpoint.resume``; ``own``: the checkpoint is one of ``run_dir``'s own;
    ``holds_run``: ``run_dir`` holds a run (then a new run there is refused, resume=never or not).
    """
    differing = _differing(saved, current)
    # Other samples (data.identity: the files or the stdlib changed) cannot be set back by a key.
    keep = (
        # Quoted for a shell where needed (a list's YAML has spaces).
        " ".join(shlex.quote(f"{k}={yaml_scalar(saved.get(k))}") for k in differing)
        if differing and all(k in RESUME_KEYS for k in differing)
        else ""
    )
    fresh = []
    if resume != "auto":  # "auto" in a directory of its own finds nothing: the run starts at step 0
        fresh.append("set checkpoint.resume=never")
    if own or holds_run or not fresh:
        fresh.append(f"give this run a run.dir of its own (or delete '{run_dir}')")
    start = "to start a new run from step 0, " + " and ".join(fresh)
    if not keep:
        return start[0].upper() + start[1:]
    return f"To resume, keep the settings the checkpoint was saved with (--set {keep}); {start}"


# Keys whose change says nothing about the training itself (where it runs, how it reports).
_NOT_TRAINING = ("run.", "checkpoint.resume")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix.rstrip("."): list(tree) if isinstance(tree, tuple) else tree}


def config_changes(saved: dict[str, Any], current: Config) -> list[str]:
    """``key: old -> new`` for every training setting that differs between a checkpoint's config and now."""
    old, new = _flatten(saved), _flatten(current.to_dict())
    return [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(old.keys() | new.keys())
        if old.get(k) != new.get(k) and not k.startswith(_NOT_TRAINING)
    ]


class Tier:
    """One place checkpoints are kept: ``root`` is a local directory or an fsspec URL."""

    def __init__(self, root: str | Path, name: str) -> None:
        self.root, self.name = str(root), name
        self.is_local = "://" not in self.root or self.root.startswith("file://")
        self.local_root = Path(self.root.removeprefix("file://")) if self.is_local else None

    def _fs(self) -> Any:
        import fsspec

        fs, path = fsspec.core.url_to_fs(self.root)
        return fs, path.rstrip("/")

    def committed(self) -> list[int]:
        """Steps of the checkpoints in this tier that have a manifest, oldest first."""
        steps = []
        if self.local_root is not None:
            if not self.local_root.is_dir():
                return []
            for p in self.local_root.iterdir():
                m = STEP_DIR.match(p.name)
                if m and (p / MANIFEST).is_file():
                    steps.append(int(m.group(1)))
        else:
            fs, root = self._fs()
            if not fs.exists(root):
                return []
            for entry in fs.ls(root, detail=False):
                m = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
                if m and fs.exists(f"{entry.rstrip('/')}/{MANIFEST}"):
                    steps.append(int(m.group(1)))
        return sorted(steps)

    def location(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/{step_name(step)}"

    def owner(self) -> str | None:
        """The run directory this tier belongs to (``OWNER`` at its root), or None if unclaimed."""
        try:
            if self.local_root is not None:
                text = (self.local_root / OWNER).read_text(encoding="utf-8")
            else:
                fs, root = self._fs()
                text = fs.cat_file(f"{root}/{OWNER}").decode("utf-8")
        except (FileNotFoundError, OSError):
            return None
        try:
            return str(json.loads(text)["run_dir"])
        except (ValueError, KeyError, TypeError):
            return f"<unreadable {OWNER}>"

    def check_owner(self, identity: str) -> None:
        """Refuse a tier that belongs to another run (a run directory elsewhere with the same name)."""
        owner = self.owner()
        if owner is not None and owner != identity:
            raise CheckpointError(
                f"the durable tier '{self.root}' belongs to the run in '{owner}', not to this run "
                f"('{identity}'); give this run another run.dir name or checkpoint.durable_dir"
            )

    def claim(self, identity: str) -> None:
        """Mark this tier as the run ``identity``'s (once; see :meth:`check_owner`)."""
        if self.owner() is not None:
            return
        text = json.dumps({"run_dir": identity})
        if self.local_root is not None:
            self.local_root.mkdir(parents=True, exist_ok=True)
            (self.local_root / OWNER).write_text(text, encoding="utf-8")
        else:
            fs, root = self._fs()
            fs.pipe_file(f"{root}/{OWNER}", text.encode("utf-8"))

    def put(self, local_dir: Path, step: int) -> bool:
        """Copy a committed local checkpoint here: the files first, the manifest last.

        Returns False (and copies nothing) when this tier already holds that step's checkpoint.
        """
        if step in self.committed():
            return False
        if self.local_root is not None:
            final = self.local_root / step_name(step)
            shutil.rmtree(final, ignore_errors=True)  # an incomplete copy (no manifest)
            tmp = self.local_root / f".tmp-{step_name(step)}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                shutil.copytree(local_dir, tmp, ignore=shutil.ignore_patterns(MANIFEST))
                shutil.copy2(local_dir / MANIFEST, tmp / MANIFEST)
                tmp.rename(final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # never half a copy (a full disk needs room)
                raise
            return True
        fs, root = self._fs()
        dest = f"{root}/{step_name(step)}"
        files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
        for p in [*files, local_dir / MANIFEST]:  # an object store has no rename: manifest last
            fs.put_file(str(p), f"{dest}/{p.relative_to(local_dir).as_posix()}")
        return True

    def fetch(self, step: int, local_dir: Path) -> None:
        """Copy checkpoint ``step`` of this (remote) tier into ``local_dir``."""
        fs, root = self._fs()
        src = f"{root}/{step_name(step)}"
        for entry in fs.find(src):
            rel = entry[len(src) :].lstrip("/")
            # Keys come from the remote store: none may name a place outside the checkpoint.
            if not entry.startswith(f"{src}/") or not rel or ".." in Path(rel).parts:
                raise CheckpointError(
                    f"durable checkpoint '{self.location(step)}' holds the key '{entry}', which "
                    "would be written outside the checkpoint directory; refusing to fetch it"
                )
            target = local_dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(entry, str(target))

    def delete(self, step: int) -> None:
        if self.local_root is not None:
            # Drop the manifest first: a half-deleted checkpoint must not look complete.
            d = self.local_root / step_name(step)
            (d / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(d, ignore_errors=True)
        else:
            fs, root = self._fs()
            fs.rm(f"{root}/{step_name(step)}/{MANIFEST}")
            fs.rm(f"{root}/{step_name(step)}", recursive=True)

    def prune(self, keep: int, protect: Iterable[int] = ()) -> list[int]:
        """Keep ``keep`` checkpoints: those in ``protect``, then the newest of the others; delete the rest.

        Returns the deleted steps.
        """
        steps = self.committed()
        kept = [s for s in steps if s in set(protect)]
        others = [s for s in steps if s not in set(protect)]
        doomed = others[: max(0, len(others) - max(0, keep - len(kept)))]
        for s in doomed:
            self.delete(s)
        return doomed


def newest_verified(root: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint of the local tier ``root`` that verifies against its manifest, or None.

    Each newer one that fails verification is skipped with a warning (through ``warn``) that names
    it and what is wrong.
    """
    for step in reversed(Tier(root, "local").committed()):
        ckpt = root / step_name(step)
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as e:
            warn(f"skipping checkpoint '{ckpt}': {e}")
            continue
        return ckpt
    return None


def find_resumable_run(config: Config) -> Path | None:
    """The newest unfinished ``runs/<name>-*`` directory this config can resume, if any.

    With ``run.dir`` unset every start gets a new timestamped directory; for ``checkpoint.resume: auto``
    "the same command again" must find the run it continues: one with the same name, no summary.json
    (it did not finish), a committed checkpoint, and a config with the same resume fingerprint.
    """
    runs = Path("runs")
    if not runs.is_dir():
        return None
    want = resume_fingerprint(config)
    candidates = sorted(
        (p for p in runs.glob(f"{glob_escape(config.run.name)}-*") if p.is_dir()),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for run in candidates:
        if (run / "summary.json").exists() or not Tier(run / "checkpoints", "local").committed():
            continue
        try:
            saved = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(saved, dict) and not resume_conflicts(resume_fingerprint(saved), want):
            return run
    return None


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)
