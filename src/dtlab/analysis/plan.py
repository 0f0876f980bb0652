"""``dtlab plan``: per-strategy memory, communication and step time, predicted without allocating the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlab.analysis.devices import DeviceProfile
from dtlab.analysis.model import StepPlan, flops_per_token, param_shapes, plan_step
from dtlab.config import Config, check_world
from dtlab.errors import ConfigError

# Assumptions of the estimate (the plan prints them as such). What fraction of a device's peak a
# well-tuned training step reaches on a GPU; the CPU profile is already a measured GEMM rate.
ACHIEVABLE_FRACTION = {"cuda": 0.45, "cpu": 1.0}
HEADROOM = 0.9  # of device memory usable for tensors (allocator fragmentation, workspaces, context)


@dataclass
class PlanRow:
    label: str
    step: StepPlan
    compute_s: float
    comm_s: float
    fits: bool
    error: str | None = None

    @property
    def step_time_s(self) -> float:
        """Compute plus communication, assuming no overlap (an upper bound)."""
        return self.compute_s + self.comm_s

    def as_dict(self) -> dict[str, Any]:
        d = self.step.as_dict()
        d["label"] = self.label
        d["comm"]["time_s"] = self.comm_s
        d["compute_time_s"] = self.compute_s
        d["step_time_s"] = self.step_time_s
        d["step_time_overlapped_s"] = max(self.compute_s, self.comm_s)
        d["fits"] = self.fits
        if self.error:
            d["error"] = self.error
        return d


def candidates(config: Config, world: int, nnodes: int) -> list[tuple[str, Config]]:
    """The strategies worth comparing for this world: each as a label and a config."""
    out = []
    options: list[tuple[str, dict[str, Any]]] = [("single", {"strategy": "single"})]
    if world > 1:
        options = [
            ("ddp", {"strategy": "ddp"}),
            ("fsdp full", {"strategy": "fsdp", "sharding": "full"}),
            ("fsdp shard_grad_op", {"strategy": "fsdp", "sharding": "shard_grad_op"}),
            ("fsdp no_shard", {"strategy": "fsdp", "sharding": "no_shard"}),
        ]
        replicate = nnodes if nnodes > 1 else (2 if world % 2 == 0 and world >= 4 else 0)
        if replicate:
            options.append(
                (
                    f"hsdp {replicate}x{world // replicate}",
                    {"strategy": "hsdp", "sharding": "full", "replicate": replicate},
                )
            )
    for label, values in options:
        cfg = config.model_copy(deep=True)
        for k, v in values.items():
            setattr(cfg.parallel, k, v)
        out.append((label, cfg))
    return out


def plan(
    config: Config, nproc: int, nnodes: int, device: DeviceProfile, memory_gib: float | None
) -> dict[str, Any]:
    """The plan as a JSON-ready dict: one row per strategy, and a recommendation."""
    world = nproc * nnodes
    shapes = param_shapes(config.model)
    params = sum(s.numel for s in shapes)
    memory = (memory_gib if memory_gib is not None else device.memory_gib) * 2**30
    memory_source = "given: --device-memory" if memory_gib is not None else device.memory_source
    precision = config.train.precision
    peak = device.peak_tflops.get(precision)
    kind = "cpu" if device.key == "this" else "cuda"
    rows: list[dict[str, Any]] = []
    for label, cfg in candidates(config, world, nnodes):
        try:
            check_world(cfg, world)
        except ConfigError as e:
            rows.append({"label": label, "error": str(e)})
            continue
        step = plan_step(cfg, world, shapes)
        tokens_per_rank = cfg.train.global_batch_size * cfg.seq_len / world
        compute = (
            flops_per_token(cfg.model, cfg.seq_len)
            * tokens_per_rank
            / (peak * 1e12 * ACHIEVABLE_FRACTION[kind])
            if peak
            else float("nan")
        )
        comm = 0.0
        for collective, bus in step.comm_bus_bytes.items():
            group = step.comm_groups[collective]
            # A group spread over nodes (HSDP's replicate groups; anything when it spans all nodes) is
            # limited by the network; a group inside one node by the intra-node links.
            across = nnodes > 1 and (
                group > nproc or (cfg.parallel.strategy == "hsdp" and collective == "all_reduce")
            )
            comm += bus / ((device.inter_node_gbps if across else device.intra_node_gbps) * 1e9)
        row = PlanRow(label, step, compute, comm, step.total_bytes <= memory * HEADROOM)
        rows.append(row.as_dict())
    ok = [r for r in rows if "error" not in r and r["fits"]]
    if ok:
        # Fastest estimated step; with an unknown peak (NaN compute time) the least communication.
        best = min(
            ok,
            key=lambda r: (
                r["step_time_s"] if r["step_time_s"] == r["step_time_s"] else r["comm"]["time_s"],
                r["per_rank"]["total_bytes"],
            ),
        )
        recommendation = (
            f"{best['label']}: the fastest estimated step among the strategies that fit "
            f"({best['per_rank']['total_bytes'] / 2**30:.1f} GiB per rank, {best['step_time_s']:.3f} s per step)"
        )
    else:
        recommendation = (
            "nothing fits: use activation checkpointing (train.activation_checkpointing=full), a smaller "
            "micro-batch or sequence, more ranks, or bf16"
        )
    return {
        "model": {
            "params": params,
            "preset": config.model.preset,
            "flops_per_token": flops_per_token(config.model, config.seq_len),
        },
        "world_size": world,
        "nproc": nproc,
        "nnodes": nnodes,
        # Each figure with where it comes from: measured, looked up, given or assumed.
        "device": {
            "name": device.name,
            "memory_gib": memory / 2**30,
            "memory_source": memory_source,
            "peak_tflops": peak,
            "source": device.source,
            "intra_node_gbps": device.intra_node_gbps,
            "intra_node_source": device.intra_node_source,
            "inter_node_gbps": device.inter_node_gbps,
            "inter_node_source": device.inter_node_source,
        },
        "assumptions": {
            "achievable_fraction_of_peak": ACHIEVABLE_FRACTION[kind],
            "usable_memory_fraction": HEADROOM,
            "step_time": "compute + communication, no overlap (an upper bound)",
        },
        "precision": precision,
        "global_batch_size": config.train.global_batch_size,
        "seq_len": config.seq_len,
        "strategies": rows,
        "recommendation": recommendation,
    }


def format_plan(p: dict[str, Any]) -> str:
    """The plan as a table for a terminal."""
    gib = 2**30
    dev, a = p["device"], p["assumptions"]
    peak = dev["peak_tflops"]
    lines = [
        f"model {p['model']['preset'] or 'custom'}: {p['model']['params'] / 1e9:.3f}B params, "
        f"{p['model']['flops_per_token'] / 1e9:.2f} GFLOP/token | {p['world_size']} ranks "
        f"({p['nnodes']} node(s) x {p['nproc']}) | global batch {p['global_batch_size']} x "
        f"{p['seq_len']} tokens",
        f"device {dev['name']}:",
        f"  peak     {f'{peak:.4g}' if peak else 'unknown'} TFLOP/s {p['precision']} ({dev['source']})",
        f"  memory   {dev['memory_gib']:.0f} GiB ({dev['memory_source']})",
        f"  in node  {dev['intra_node_gbps']:.3g} GB/s per rank ({dev['intra_node_source']})",
        f"  across   {dev['inter_node_gbps']:.3g} GB/s per rank ({dev['inter_node_source']})",
        f"assumed: compute at {a['achievable_fraction_of_peak']:.0%} of the peak, "
        f"{a['usable_memory_fraction']:.0%} of memory usable, step s = {a['step_time']}",
        "",
        f"{'strategy':<20} {'params':>9} {'grads':>9} {'optim':>9} {'activ':>9} {'total':>9}  {'fits':<4} "
        f"{'comm/step':>10} {'comm s':>8} {'step s':>8}",
    ]
    for r in p["strategies"]:
        if "error" in r:
            lines.append(f"{r['label']:<20} {r['error']}")
            continue
        pr = r["per_rank"]
        comm = sum(r["comm"]["bytes_per_step"].values())
        lines.append(
            f"{r['label']:<20} "
            + " ".join(
                f"{pr[k] / gib:8.2f}G"
                for k in (
                    "params_bytes",
                    "grads_bytes",
                    "optimizer_bytes",
                    "activations_bytes",
                    "total_bytes",
                )
            )
            + f"  {'yes' if r['fits'] else 'NO':<4} {comm / gib:9.2f}G {r['comm']['time_s']:8.3f} {r['step_time_s']:8.3f}"
        )
    lines += ["", f"recommendation: {p['recommendation']}"]
    return "\n".join(lines)
