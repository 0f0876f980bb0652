"""Experiment trackers beside metrics.jsonl: MLflow and Weights & Biases (offline).

Global rank 0 only; the other ranks get :class:`~dtlab.metrics.sinks.NullSink`. Each tracker sink

- at the start opens one tracker run per training run, or reopens the one this run directory names in
  ``trackers.json`` when the run resumes from a checkpoint, and logs the resolved config as params with
  dotted keys (``train.lr``). A missing package, a bad URI or a store that cannot be opened is a
  DtlabError there, before the first step;
- logs every finite number of each logged step's record but ``step`` under its own name (``loss``,
  ``lr``, ..., ``val_loss``, ``val_ppl``), at that step;
- at the end (:meth:`finish`, once ``summary.json`` and ``loss.png`` are written) takes those two files
  as artifacts and the summary's numbers as ``summary/<key>``, and ends the tracker run.

After the start a tracker never stops training: the first failure is reported, the records lost are
counted (``lost``, summed into the summary's ``metrics_lost``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dtlab.config import Config
from dtlab.errors import DtlabError
from dtlab.metrics.logging import logger

__all__ = [
    "TRACKERS_FILE",
    "MLflowSink",
    "TrackerSink",
    "WandbSink",
    "check_trackers",
    "flat_params",
    "mlflow_tracking_uri",
    "open_trackers",
    "step_values",
]

TRACKERS_FILE = "trackers.json"  # the tracker runs of this run directory, reopened on resume
EXTERNAL = ("mlflow", "wandb")  # the trackers that need a package of their own (an extra)
# The end-of-run files every tracker takes as artifacts (routing.png: a mixture of experts only).
OUTPUTS = ("loss.png", "routing.png", "summary.json")
MLFLOW_URIS = "allowed: a directory or file: URI (a file store), sqlite:///PATH, http(s)://SERVER"


def check_trackers(config: Config) -> None:
    """Raise a DtlabError if a tracker that ``run.trackers`` lists has no package installed.

    Cheap (nothing is imported): a launcher can call it before it starts any process.
    """
    for name in dict.fromkeys(config.run.trackers):
        if name in EXTERNAL and importlib.util.find_spec(name) is None:
            raise _missing(name)


def _missing(name: str, cause: ImportError | None = None) -> DtlabError:
    message = f"run.trackers lists {name}: pip install 'dtlab[{name}]'"
    if cause is not None and cause.name not in (None, name):  # installed, but broken
        message += f" (importing {name} failed: {cause})"
    return DtlabError(message)


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise _missing(name, e) from None


def flat_params(config: Config) -> dict[str, Any]:
    """The resolved config as one level of dotted keys (``{"train.lr": 0.003, ...}``)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            out[prefix] = value

    walk("", config.to_dict())
    return out


def step_values(record: dict[str, Any]) -> dict[str, float]:
    """What a tracker logs of a step's record: every finite number but ``step`` itself."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and math.isfinite(value)
    }


def _summary_values(summary: dict[str, Any]) -> dict[str, float]:
    return {f"summary/{key}": value for key, value in step_values(summary).items()}


def _outputs(run_dir: Path) -> list[Path]:
    return [run_dir / name for name in OUTPUTS if (run_dir / name).is_file()]


def _short(e: BaseException) -> str:
    """An exception in one line (tracker libraries raise messages of many lines)."""
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Logger ``name`` says only warnings and errors meanwhile."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def mlflow_tracking_uri(config: Config, run_dir: Path) -> str:
    """``run.mlflow_uri``, or (null) a SQLite database ``<run dir>/mlflow.db``, the local store MLflow
    recommends (its file store needs an opt-in since MLflow 3); a run directory that already has a file
    store in ``<run dir>/mlruns`` (a run started before this default) keeps it."""
    if config.run.mlflow_uri is not None:
        return config.run.mlflow_uri
    if (run_dir / "mlruns").is_dir():
        return (run_dir / "mlruns").resolve().as_uri()
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class TrackerSink:
    """What the tracker sinks share: a failure after the start is reported once and counted."""

    tracker = ""  # the run.trackers name
    title = ""  # how messages name it

    def __init__(self) -> None:
        self.lost = 0  # logged steps that did not reach the tracker
        self.finished = False  # finish() ran: the training run reached its end
        self.closed = False
        self._warned = False

    def _failed(self, what: str, e: Exception, *, count: bool = True) -> None:
        """Report the first failure; ``count``: a logged step that the tracker missed."""
        if count:
            self.lost += 1
        if self._warned:
            return
        self._warned = True
        then = (
            "training goes on; the steps it misses are counted in the summary (metrics_lost)"
            if count
            else "the run directory's own files are complete"
        )
        logger.warning("%s: %s failed (%s); %s", self.title, what, _short(e), then)

    def log(self, metrics: dict[str, Any]) -> None:
        """Log one step's record (never raises)."""
        try:
            self._log(int(metrics["step"]), step_values(metrics))
        except Exception as e:  # a tracker's hiccup must not stop training
            self._failed(f"logging step {metrics.get('step')}", e)

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        """The run reached its end: the outputs as artifacts and the summary's figures (never raises)."""
        self.finished = True
        try:
            self._finish(summary, _outputs(run_dir))
        except Exception as e:
            self._failed("logging summary.json and loss.png", e, count=False)

    def close(self) -> None:
        """End the tracker run: finished if :meth:`finish` ran, otherwise stopped early (never raises)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._end(self.finished)
        except Exception as e:
            self._failed("ending its run", e, count=False)

    def saved(self) -> dict[str, Any]:
        """What ``trackers.json`` keeps of this tracker run, to reopen it on resume."""
        raise NotImplementedError

    def _log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def _finish(self, summary: dict[str, Any], files: list[Path]) -> None:
        raise NotImplementedError

    def _end(self, finished: bool) -> None:
        raise NotImplementedError


class MLflowSink(TrackerSink):
    """One MLflow run per training run: experiment ``run.name``, run name the run directory's name."""

    tracker, title = "mlflow", "MLflow"

    def __init__(
        self, config: Config, run_dir: Path, resume_step: int, saved: dict[str, Any] | None
    ) -> None:
        super().__init__()
        _import("mlflow")
        from mlflow.tracking import MlflowClient

        self.setting = config.run.mlflow_uri
        self.uri = mlflow_tracking_uri(config, run_dir)
        scheme = self.uri.split(":", 1)[0] if re.match(r"^[A-Za-z][\w+.-]*:", self.uri) else ""
        if scheme in ("", "file"):
            # MLflow 3 keeps its file store behind an opt-in: a store the user names, or an older
            # run's default, is one, so opt in (a user's own MLFLOW_ALLOW_FILE_STORE still wins).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # Without a location a SQL store would put artifacts in ./mlruns of whatever directory
        # training started in: a sqlite database keeps them beside itself.
        self.artifacts = self._prepare_sqlite() if scheme == "sqlite" else None
        try:
            with _quiet("mlflow.store.db.utils"):  # its table creation lines; dtlab said it above
                self.client = MlflowClient(self.uri)
            experiment = self._experiment(config.run.name)
            self.run_id = self._reopen(saved, resume_step) or self._create(experiment, run_dir)
            self._log_params(flat_params(config), resume_step)
        except DtlabError:
            raise
        except ImportError as e:  # sqlite:// needs sqlalchemy and alembic (part of the extra)
            raise DtlabError(
                f"run.mlflow_uri = {self.uri!r} needs {e.name or 'a package'} that is not installed: "
                "pip install 'dtlab[mlflow]'"
            ) from None
        except Exception as e:
            raise DtlabError(
                f"run.mlflow_uri = {self.uri!r}: MLflow could not start a run there ({_short(e)}); "
                f"{MLFLOW_URIS}"
            ) from None

    def _prepare_sqlite(self) -> str:
        """Create the database's directory (like run.dir's); returns where its artifacts go."""
        path = Path(self.uri.removeprefix("sqlite:///").split("?", 1)[0])
        with contextlib.suppress(OSError):  # if it cannot be created, MLflow says why below
            path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            logger.info("MLflow: creating the database %s (a few seconds, once)", path)
        return (path.parent.resolve() / "mlartifacts").as_uri()

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is None:
            try:
                return str(self.client.create_experiment(name, self.artifacts))
            except Exception:
                found = self.client.get_experiment_by_name(name)  # another run created it meanwhile
                if found is None:
                    raise
        if found.lifecycle_stage == "deleted":
            raise DtlabError(
                f"run.name = {name!r}: its MLflow experiment is deleted in {self.uri!r}; restore it "
                "(mlflow experiments restore) or give the run another run.name"
            )
        return str(found.experiment_id)

    def _reopen(self, saved: dict[str, Any] | None, resume_step: int) -> str | None:
        """The MLflow run of the run this one resumes, set running again (None: start a new one)."""
        if not saved or not resume_step:
            return None
        if saved.get("uri") != self.setting:
            logger.warning(
                "run.mlflow_uri is %r now, %r when this run started: a new MLflow run in %r",
                self.setting, saved.get("uri"), self.uri,
            )  # fmt: skip
            return None
        run_id = str(saved.get("run_id"))
        try:
            self.client.get_run(run_id)
        except Exception as e:
            logger.warning(
                "MLflow run %s of this run directory is not in %r (%s): a new MLflow run",
                run_id, self.uri, _short(e),
            )  # fmt: skip
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def _create(self, experiment: str, run_dir: Path) -> str:
        run = self.client.create_run(
            experiment, run_name=run_dir.name, tags={"dtlab.run_dir": str(run_dir.resolve())}
        )
        return str(run.info.run_id)

    def _log_params(self, params: dict[str, Any], resume_step: int) -> None:
        """Params are write-once in MLflow: a resumed run adds the new keys, and a value the user
        changed since goes to the tag ``changed.<key>`` (the latest word wins; see docs/tracking.md)."""
        from mlflow.entities import Param, RunTag
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        run = self.client.get_run(self.run_id)
        have, tags = run.data.params, run.data.tags
        new, changed = [], []
        for key, value in params.items():
            text = (value if isinstance(value, str) else json.dumps(value))[:MAX_PARAM_VAL_LENGTH]
            if key not in have:
                new.append(Param(key, text))
            elif have[key] != text:
                changed.append(RunTag(f"changed.{key}", f"{text} (from step {resume_step + 1})"))
            elif f"changed.{key}" in tags:  # changed back to the first value
                self.client.delete_tag(self.run_id, f"changed.{key}")
        for i in range(0, max(len(new), len(changed)), MAX_PARAMS_TAGS_PER_BATCH):
            batch = slice(i, i + MAX_PARAMS_TAGS_PER_BATCH)
            self.client.log_batch(self.run_id, params=new[batch], tags=changed[batch])

    def saved(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "uri": self.setting}

    def _log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # A step logged again (a resumed or rolled-back run) is kept beside the first value; the
        # newest timestamp is the one that counts.
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()]
        )

    def _finish(self, summary: dict[str, Any], files: list[Path]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(summary.get("steps") or 0)
        figures = [Metric(k, v, now, step) for k, v in _summary_values(summary).items()]
        self.client.log_batch(self.run_id, metrics=figures)
        for path in files:
            self.client.log_artifact(self.run_id, str(path))

    def _end(self, finished: bool) -> None:
        # KILLED: stopped before its end (preempted, failed, interrupted); a resume sets it running.
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


def _wandb_name(text: str, limit: int) -> str:
    """``text`` as a W&B project name: none of / \\ # ? % : and at most ``limit`` characters."""
    return re.sub(r"[/\\#?%:]", "-", text)[:limit] or "dtlab"


class WandbSink(TrackerSink):
    """One W&B run per training run, offline only: files under ``<run dir>/wandb``, no network, no
    login; ``wandb sync`` uploads them later. Project ``run.name``, run name the run directory's."""

    tracker, title = "wandb", "W&B"

    def __init__(
        self, config: Config, run_dir: Path, resume_step: int, saved: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.wandb = wandb = _import("wandb")
        run_id = str(saved["run_id"]) if saved and resume_step and saved.get("run_id") else None
        settings = wandb.Settings(
            mode="offline",
            silent=True,  # nothing on the terminal: dtlab's own lines stay readable
            console="off",  # leave sys.stdout and sys.stderr alone (no capture of the training log)
        )
        try:
            self.run = wandb.init(
                dir=str(run_dir),
                project=_wandb_name(config.run.name, 128),
                name=run_dir.name,
                id=run_id,
                # An offline resume writes a new fragment of the same run id; wandb sync joins them.
                resume="allow" if run_id else None,
                config=flat_params(config),
                allow_val_change=True,  # a resumed run takes the hyper-parameters given now
                reinit="create_new",  # never touch another W&B run of this process
                settings=settings,
            )
        except Exception as e:
            raise DtlabError(
                f"run.trackers lists wandb, but W&B could not start an offline run in "
                f"{run_dir / 'wandb'} ({_short(e)})"
            ) from None
        self.last_step = resume_step

    def saved(self) -> dict[str, Any]:
        return {"run_id": self.run.id, "project": self.run.project}

    def _log(self, step: int, values: dict[str, float]) -> None:
        if step <= self.last_step:
            # W&B's history only moves forward: the steps a rollback trains again keep their first
            # values there (metrics.jsonl has both).
            return
        self.last_step = step
        self.run.log(values, step=step)

    def _finish(self, summary: dict[str, Any], files: list[Path]) -> None:
        self.run.summary.update(_summary_values(summary))
        if not files:
            return
        # Copies in this run's own offline directory: what wandb sync uploads does not change when a
        # resumed run rewrites the originals, and nothing goes outside the run directory.
        kept = Path(self.run.dir).parent / "outputs"
        kept.mkdir(exist_ok=True)
        artifact = self.wandb.Artifact(f"run-{self.run.id}-outputs", type="dtlab-outputs")
        for path in files:
            copy = kept / path.name
            shutil.copyfile(path, copy)
            artifact.add_file(str(copy), policy="immutable")
        self.run.log_artifact(artifact)

    def _end(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


def _read_saved(run_dir: Path) -> dict[str, Any]:
    try:
        saved = json.loads((run_dir / TRACKERS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _write_saved(run_dir: Path, saved: dict[str, Any]) -> None:
    path = run_dir / TRACKERS_FILE
    tmp = path.with_name(f".{TRACKERS_FILE}.tmp")
    try:
        tmp.write_text(json.dumps(saved, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning(
            "%s could not be written (%s): a resumed run will start new tracker runs",
            path, e.strerror or e,
        )  # fmt: skip


def open_trackers(config: Config, run_dir: Path, resume_step: int = 0) -> list[TrackerSink]:
    """The MLflow and W&B sinks ``run.trackers`` asks for (rank 0), each continuing the tracker run
    ``trackers.json`` names when the run resumes from step ``resume_step`` > 0; raises a DtlabError
    (before any step) if one cannot start."""
    names = [name for name in dict.fromkeys(config.run.trackers) if name in EXTERNAL]
    if not names:
        return []
    check_trackers(config)  # every missing package before any tracker starts
    saved = _read_saved(run_dir) if resume_step else {}
    sinks: list[TrackerSink] = []
    try:
        for name in names:
            previous = saved.get(name) if isinstance(saved.get(name), dict) else None
            if name == "mlflow":
                sinks.append(MLflowSink(config, run_dir, resume_step, previous))
            else:
                sinks.append(WandbSink(config, run_dir, resume_step, previous))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    _write_saved(run_dir, {**saved, **{sink.tracker: sink.saved() for sink in sinks}})
    return sinks
