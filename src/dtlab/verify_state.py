"""``dtlab verify --checks resume,export``: a layout's checkpoint, resume and export paths, beside its loss.

For every layout, the uninterrupted run of :mod:`dtlab.verify` saves a checkpoint at the middle step M
and at the end. Then:

- **resume** on the same layout: a new run starts from the layout's step-M checkpoint and trains to the
  end; its steps M+1.. and final parameters must equal the uninterrupted run's.
- **resume** on the first layout (the reference): the reference's layout starts from the same
  checkpoint (DCP reshards it) and must continue exactly as the reference itself did. A DiLoCo layout's
  checkpoint holds each replica's own state and resumes only on its own layout: not checked.
- **export**: ``dtlab export RUN --out OUT --format hf`` of the layout's final checkpoint, as a user runs it, must
  give the tensors of the first layout's export (same names, shapes, values within the parameter
  tolerance).

Each check runs as a user runs it: ``dtlab train`` and ``dtlab export`` in processes of their own.
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dtlab.errors import DtlabError

__all__ = ["CHECKS", "StateCheck", "compare_exports", "export_run"]

CHECKS = ("loss", "resume", "export")


@dataclass
class StateCheck:
    """One check of one layout against what it must equal."""

    check: str  # "resume" (same layout), "resume on <reference>", "export"
    max_loss_diff: float | None  # over the steps after the resumed one (None: an export)
    max_grad_norm_rel_diff: float | None
    max_param_diff: float  # any element of the final parameters (an export's tensors)
    worst_param: str
    ok: bool
    note: str = ""  # why a check did not run, or what differs


def export_run(run_dir: Path, out: Path) -> None:
    """``dtlab export RUN_DIR --out OUT --format hf``: the run's newest checkpoint as a Hugging Face
    directory of the model's family (:mod:`dtlab.models.families`), as a user exports it; a
    DtlabError with the output's tail when it fails. A model no family's class computes (sigmoid
    router scores; a trained balancing bias where the family has no selection bias) is exported
    with dtlab's names (``--format safetensors``)."""
    from dtlab.config import load_config
    from dtlab.models.families import family_refusal
    from dtlab.models.hf_moe import MOE_NAMES

    model = load_config(run_dir / "config.yaml").model
    args, family = model.args(), model.hf_family()
    biased = args.moe is not None and args.moe.bias_balance and MOE_NAMES[family.name].bias is None
    dtlab_names = biased or family_refusal(family, args) is not None
    cmd = [
        sys.executable,
        "-m",
        "dtlab",
        "export",
        str(run_dir),
        "--out",
        str(out),
        "--format",
        "safetensors" if dtlab_names else "hf",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
        raise DtlabError(f"dtlab export {run_dir} failed (exit code {proc.returncode}):\n{tail}")


def compare_exports(ref: Path, got: Path) -> tuple[float, str, str]:
    """The largest element difference of the tensors of two exports (``model.safetensors``), the name
    of the tensor it is in, and a note naming tensors only one side has or whose shapes differ (an
    infinite difference)."""
    from safetensors.torch import load_file

    a, b = load_file(str(ref / "model.safetensors")), load_file(str(got / "model.safetensors"))
    notes: list[str] = []
    worst, worst_name = 0.0, "-"
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            notes.append(f"{name} only in {'the reference' if name in a else 'this'} export")
            worst, worst_name = math.inf, name
            continue
        if a[name].shape != b[name].shape:
            notes.append(f"{name}: shape {tuple(b[name].shape)} against {tuple(a[name].shape)}")
            worst, worst_name = math.inf, name
            continue
        d = float((a[name].float() - b[name].float()).abs().max()) if a[name].numel() else 0.0
        if not d <= worst:  # NaN counts as the worst
            worst, worst_name = d, name
    return worst, worst_name, "; ".join(notes)
