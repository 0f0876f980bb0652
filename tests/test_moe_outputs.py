"""What a mixture-of-experts run shows of its routing (metrics, summary, routing.png, the imbalance
alert) and where its weights go: the Hugging Face export, ``model.init_from`` back from it, and
``dtlab generate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import train_run
from dtlab.config import AlertsConfig, ConfigError, config_warnings, load_config
from dtlab.metrics.alerts import AlertMonitor

# Two MoE blocks after one dense block, so that sums over the blocks are tested as sums.
MOE3 = ["model.preset=debug-moe", "model.n_layers=3"]
TOKENS = 8 * 64  # FAST's global batch x seq_len


def test_a_run_logs_loads_plots_them_and_alerts_on_imbalance(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # Any real routing is above 1.0001 (an exact 1 needs 1,024 slots split exactly evenly).
    m = train_run(run, *MOE3, "alerts.moe_imbalance=1.0001", "run.plot=true", steps=4)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    for r in m:
        # Each token counts top_k = 2 times in each of the 2 MoE blocks.
        assert sum(r["moe_load"]) == TOKENS * 2 * 2 and len(r["moe_load"]) == 4
        layers = r["moe_layer_load"]
        assert len(layers) == 2 and all(sum(row) == TOKENS * 2 for row in layers)
        assert r["moe_load"] == [a + b for a, b in zip(*layers, strict=True)]
        worst = max(max(row) / (TOKENS * 2 / 4) for row in layers)
        assert r["moe_imbalance"] == pytest.approx(worst)
        assert r["moe_bias"] > 0
    # It fires when crossed, and not again while the imbalance stays above the threshold.
    assert m[0]["alerts"] == ["moe_imbalance"]
    assert all("alerts" not in r for r in m[1:])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["alerts"] == {"moe_imbalance": 1}
    worst_record = max(m, key=lambda r: r["moe_imbalance"])
    assert summary["moe_worst_imbalance"] == worst_record["moe_imbalance"]
    assert summary["moe_worst_imbalance_step"] == worst_record["step"]
    assert summary["moe_final_imbalance"] == m[-1]["moe_imbalance"]
    png = run / "routing.png"
    assert summary["routing_plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _monitor(**thresholds: float) -> AlertMonitor:
    return AlertMonitor(AlertsConfig(**thresholds), tokens_per_step=TOKENS)


def test_the_imbalance_alert_fires_above_its_threshold_and_never_when_off() -> None:
    def record(step: int, imbalance: float) -> dict[str, object]:
        return {"step": step, "loss": 2.0, "grad_norm": 1.0, "moe_imbalance": imbalance}

    off = _monitor()
    assert not off.config.enabled
    assert all(off.check(record(s, 4.0), 0.1, 0.01) == [] for s in range(1, 5))
    on = _monitor(moe_imbalance=1.5)
    assert on.check(record(1, 1.5), 0.1, 0.01) == []  # at the threshold: not above it
    fired = on.check(record(2, 2.25), 0.1, 0.01)
    assert [k for k, _ in fired] == ["moe_imbalance"]
    assert (
        "step 2: the most loaded expert has 2.25x the mean load (the worst MoE block's "
        "moe_imbalance), above alerts.moe_imbalance = 1.5" in fired[0][1]
    )
    assert on.check(record(3, 3.0), 0.1, 0.01) == []  # still above
    assert on.check(record(4, 1.2), 0.1, 0.01) == []
    assert [k for k, _ in on.check(record(5, 1.6), 0.1, 0.01)] == ["moe_imbalance"]
    # A dense step has no imbalance to judge.
    assert on.check({"step": 6, "loss": 2.0, "grad_norm": 1.0}, 0.1, 0.01) == []


def test_the_imbalance_alert_on_a_dense_model_is_said_to_be_unused() -> None:
    dense = load_config(None, ["model.preset=debug", "alerts.moe_imbalance=2"])
    assert any("alerts.moe_imbalance = 2 is set but model.moe.experts = 0" in w
               for w in config_warnings(dense))  # fmt: skip
    moe = load_config(None, ["model.preset=debug-moe", "alerts.moe_imbalance=2"])
    assert not any("moe_imbalance" in w for w in config_warnings(moe))
    with pytest.raises(ConfigError, match=r"alerts\.moe_imbalance = 0\.5"):
        load_config(None, ["model.preset=debug-moe", "alerts.moe_imbalance=0.5"])
