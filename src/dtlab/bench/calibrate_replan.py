"""An earlier calibration's measured steps predicted again by today's plan, from the inputs that
calibration measured: ``python -m dtlab.bench.calibrate --replan cal.json``.

A calibration takes half an hour of a machine's whole CPU, and its inputs (the probed step of each
model, gloo's rate of each collective, the wrappers' costs, the loopback's rate, the GEMM peak) move
between runs as much as the closest layouts differ. A change to the step-time model is judged
fairly against the same measurements and the same inputs: each row's device is rebuilt from what
the calibration's ``--json`` recorded, nothing is measured again, and only the predictions, the
errors and the ranking are new. Rows on a capped link are left out (the link's measured rate is not
recorded).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from dtlab.errors import DtlabError

# A grid row's label ("fsdp (4)") -> its model, process count and overrides beyond the model's base.
Layouts = dict[str, tuple[str, int, list[str]]]


def _device(result: dict[str, Any], inputs: dict[str, Any], key: str, model_config: Any) -> Any:
    """The device the calibration predicted ``key``'s rows (``"tiny x 2"``) on, rebuilt from its
    recorded ``inputs`` (of one round, or of the only one)."""
    from dtlab.analysis.devices import ComputeProbe, DeviceProfile
    from dtlab.analysis.shapes import param_shapes

    probe = inputs["probes"].get(key)
    gbps = float(result["loopback_gbps"])
    return DeviceProfile(
        "this",
        "this machine (the calibration's recorded inputs)",
        0.0,
        {k: float(v) for k, v in result["peak_tflops"].items()},
        intra_node_gbps=gbps,
        inter_node_gbps=gbps,
        source="recorded by the calibration",
        intra_node_source="recorded by the calibration",
        inter_node_source="assumed: the same as within this machine",
        copy_gbps=gbps,
        probe=None
        if probe is None
        else ComputeProbe(
            threads=int(probe["threads"]),
            cores=int(probe["cores"]),
            seconds_per_token=float(probe["seconds_per_token"]),
            fixed_seconds=float(probe["fixed_seconds"]),
            params=sum(s.numel for s in param_shapes(model_config)),
            seq_len=int(probe["seq_len"]),
            source=str(probe["source"]),
            # (0 in calibrations recorded before it was measured: their compute as they had it.)
            pass_seconds=float(probe.get("pass_seconds", 0.0)),
            slicing=float(probe.get("slicing", 1.0)),
        ),
        collective_gbps=inputs["collectives"].get(key),
        collective_source="recorded by the calibration",
        wrapper_s=inputs["wrappers"].get(key),
    )


def median_prediction(wants: list[dict[str, float]]) -> dict[str, float]:
    """Each figure of a row's per-round predictions ``wants``: the median over the rounds, as its
    measured step is."""
    return {k: statistics.median(w[k] for w in wants) for k in wants[0]}


def replan(
    result: dict[str, Any],
    layouts: Layouts,
    predict: Callable[[list[str], int, Any], dict[str, float]],
    ranking: Callable[[list[dict[str, Any]]], dict[str, Any]],
) -> dict[str, Any]:
    """``result`` (a calibration's ``--json``) with every uncapped row's prediction and error made
    again by ``predict`` (the plan's step of overrides on a process count and device) on the
    recorded inputs (where each round measured its own, each round's, their median), and its
    summary (errors, ``ranking``) recomputed; ``layouts``: the grid's rows by label."""
    from dtlab.config import load_config

    need = ("rows", "base", "probes", "collectives", "wrappers", "loopback_gbps", "peak_tflops")
    missing = [k for k in need if k not in result]
    if missing:
        raise DtlabError(f"--replan: not a calibration's --json (no {', '.join(missing)})")
    bases: dict[str, list[str]] = result["base"]
    rows_in: list[dict[str, Any]] = result["rows"]
    rows: list[dict[str, Any]] = []
    devices: dict[tuple[str, int], Any] = {}
    rounds = result.get("inputs_rounds") or [result]
    for r in rows_in:
        if not isinstance(r.get("error"), float) or r.get("link", "none") != "none":
            continue
        if r["layout"] not in layouts:
            raise DtlabError(
                f"--replan: layout {r['layout']!r} is not in today's grid; known: "
                f"{', '.join(layouts)}"
            )
        model, nproc, extra = layouts[r["layout"]]
        overrides = [*bases[model], *extra]
        key = f"{model} x {nproc}"
        wants = []
        for i, inputs in enumerate(rounds):
            if (key, i) not in devices:
                model_config = load_config(None, bases[model]).model
                devices[key, i] = _device(result, inputs, key, model_config)
            wants.append(predict(overrides, nproc, devices[key, i]))
        want = median_prediction(wants)
        again = {**r, "predicted": want, "error": want["step_time_s"] / r["measured_s"] - 1}
        if "predicted_rounds_s" in r:
            again["predicted_rounds_s"] = [w["step_time_s"] for w in wants]
        rows.append(again)
    if not rows:
        raise DtlabError("--replan: the file has no measured row on an uncapped link")
    errors = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    return {
        **result,
        "rows": rows,
        "ranking": ranking(rows),
        "mean_abs_error": sum(errors) / len(errors),
        "worst": {"layout": worst["layout"], "error": worst["error"]},
        "replanned": True,
    }
