"""Where step metrics go: metrics.jsonl, TensorBoard, and the terminal (progress bar or plain lines);
MLflow and W&B in :mod:`dtlab.metrics.trackers`.

Only global rank 0 creates real sinks; the other ranks get :class:`NullSink`, so the loop can call the
same methods everywhere.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any, Protocol

from dtlab.metrics.logging import logger


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (also inside dicts and lists) replaced by None.

    Strict JSON has no inf/NaN; writing null keeps every file readable by any JSON parser.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class Sink(Protocol):
    def log(self, metrics: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class NullSink:
    """What ranks other than 0 log to."""

    def log(self, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object per logged optimizer step."""

    def __init__(self, path: Path, resume_step: int = 0) -> None:
        kept = []
        if resume_step and path.exists():
            # A resumed run continues the file: keep the lines up to the checkpoint, drop the ones after
            # it (they are trained again).
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a crash
        self.lost = 0  # records that could not be written (a full disk)
        self.file = path.open("w", encoding="utf-8")
        self.file.writelines(kept)

    def log(self, metrics: dict[str, Any]) -> None:
        try:
            self.file.write(json.dumps(json_safe(metrics)) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: say so once, count what is lost, keep training
            self.lost += 1
            if self.lost == 1:
                logger.error(
                    "metrics.jsonl: the record of step %s could not be written (%s); training goes "
                    "on, the records lost are counted in the summary (metrics_lost)",
                    metrics.get("step"), e.strerror or e,
                )  # fmt: skip

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()


def tensorboard_tag(key: str) -> str:
    """A record's key as a TensorBoard tag: validation figures under ``val/`` (``val_loss`` ->
    ``val/loss``), the rest under ``train/``, so that each group gets a section of its own."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


class TensorBoardSink:
    """Scalars in ``<run dir>/tensorboard``, tagged by :func:`tensorboard_tag`."""

    def __init__(self, log_dir: Path, resume_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events after the checkpoint that an interrupted attempt wrote.
        self.writer = SummaryWriter(
            log_dir=str(log_dir), purge_step=resume_step + 1 if resume_step else None
        )

    def log(self, metrics: dict[str, Any]) -> None:
        step = metrics["step"]
        for key, value in metrics.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(tensorboard_tag(key), value, step)

    def close(self) -> None:
        self.writer.close()


def format_step(m: dict[str, Any], total: int) -> str:
    return (
        f"step {m['step']}/{total} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | grad_norm {m['grad_norm']:.3f} "
        f"| {m['tokens_per_s']:,.0f} tok/s | {m['step_time_s']:.3f} s/step"
    )


class ProgressSink:
    """A tqdm bar on a terminal; plain log lines otherwise (logs, CI, Slurm output files)."""

    def __init__(self, mode: str, total: int, log_every: int, initial: int = 0) -> None:
        use_bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        self.mode = "none" if mode == "none" else ("bar" if use_bar else "lines")
        self.total, self.log_every = total, log_every
        self.bar = None
        self._redirect: contextlib.AbstractContextManager[Any] | None = None
        if self.mode == "bar":
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(
                total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr
            )
            # Log lines go through the bar's own writer: it clears the bar, prints the line and
            # draws the bar again below it, instead of appending to the bar's line.
            self._redirect = logging_redirect_tqdm(loggers=[logger], tqdm_class=tqdm)
            self._redirect.__enter__()

    def step(self, metrics: dict[str, Any]) -> None:
        """Called every step (cheap); prints a line only on logged steps."""
        if self.bar is not None:
            # The figures first, then the move: the bar is drawn once per step, with this step's loss.
            self.bar.set_postfix(
                loss=f"{metrics['loss']:.4f}",
                tok_s=f"{metrics['tokens_per_s']:,.0f}",
                refresh=False,
            )
            self.bar.update(metrics["step"] - self.bar.n)  # also right after a rollback
        elif self.mode == "lines" and (
            metrics["step"] % self.log_every == 0 or metrics["step"] == self.total
        ):
            logger.info(format_step(metrics, self.total))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
