"""``make gpu-check`` (python -m dtlab.gpucheck): on this CPU machine it runs the pipeline of checks as a
smoke, exits 0 and says what it skipped and why; a failing check fails the run; the report names the
machine; docs/gpu.md's list of CUDA tests is the suite's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import PYTHON, cli_env
from dtlab.analysis.devices import PROFILES
from dtlab.analysis.plan import plan
from dtlab.config import load_config
from dtlab.errors import DtlabError
from dtlab.gpucheck import cudatests
from dtlab.gpucheck.checks import (
    Context,
    collectives,
    cuda_tests,
    equivalence,
    ft_killed,
    killed_rank,
    resume,
)
from dtlab.gpucheck.runner import Check, Deadline, StepTimeout, run_logged
from dtlab.gpucheck.settings import BUDGET_S, CHECKS, MULTI_GPU, settings_for, skip_reason
from dtlab.verify import parse_layouts

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # the CPU path, on any machine


def gpucheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "dtlab.gpucheck", *args],
        capture_output=True, text=True, cwd=ROOT, env=cli_env({**NO_GPU, **(env or {})}),
        timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any], str]:
    """The whole check, as ``make gpu-check`` runs it, on this machine's CPU."""
    out = tmp_path_factory.mktemp("gpu-check") / "report"
    proc = gpucheck("--out", str(out))
    report = json.loads((out / "report.json").read_text())
    return proc, report, (out / "report.md").read_text()


def test_on_cpu_it_runs_what_it_can_exits_0_and_says_what_it_skipped(
    cpu_run: tuple[Any, dict[str, Any], str],
) -> None:
    proc, report, md = cpu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["machine", *CHECKS]
    status = {name: c["status"] for name, c in checks.items()}
    assert status == {
        "machine": "passed", "cuda-tests": "skipped", "train": "passed", "float8": "passed",
        "memory": "skipped",
        "checkpoint": "passed", "resume": "passed", "collectives": "skipped",
        "equivalence": "skipped", "killed-rank": "skipped", "ft-killed": "skipped",
    }, {n: (c["status"], c["reason"]) for n, c in checks.items()}  # fmt: skip
    assert report["ok"] and report["failed"] == []
    assert set(report["skipped"]) == {
        "cuda-tests",
        "memory",
        "collectives",
        "equivalence",
        "killed-rank",
        "ft-killed",
    }
    # Every CUDA test collected, each skipped with its reason.
    tests = checks["cuda-tests"]["figures"]["tests"]
    assert tests and all(t["outcome"] == "skipped" and "CUDA" in t["reason"] for t in tests)
    assert f"{len(tests)} CUDA tests collected, all skipped" in checks["cuda-tests"]["reason"]
    assert "not judged on CPU" in checks["memory"]["reason"]
    assert checks["memory"]["figures"]["predicted_bytes"] > 0
    for name in MULTI_GPU:
        assert checks[name]["reason"].startswith("needs 2 CUDA GPUs, this machine has 0")
    # The figures of the smoke are there, and labelled as a CPU smoke.
    train = checks["train"]["figures"]
    assert train["tokens_per_s"] > 0 and 0 < train["mfu_vs_measured_gemm"] < 1
    assert train["loss_last"] < train["loss_first"]
    assert checks["train"]["reason"].startswith("CPU smoke")
    # Float8 beside the bf16 baseline: emulated on a CPU, and said to be no measure of speed.
    f8 = checks["float8"]["figures"]
    assert f8["emulated"] is True and f8["float8_over_bf16"] > 0
    assert checks["float8"]["reason"].endswith("emulated: says nothing of speed")
    ckpt = checks["checkpoint"]["figures"]["async"]
    assert ckpt["saves"] == 3 and ckpt["blocked_s"] >= 0
    assert checks["resume"]["figures"]["checks"][0]["max_loss_diff"] == 0.0
    # Each step's wall time, within its timeout; the markdown says what was skipped and why.
    for name in ("train", "checkpoint", "resume"):
        assert 0 < checks[name]["wall_s"] <= checks[name]["timeout_s"]
    assert md.startswith("# dtlab GPU check: PASSED")
    skipped = md.split("## Skipped")[1]
    for name in report["skipped"]:
        assert f"- {name}: {checks[name]['reason']}" in skipped
    assert "| train | passed |" in md


def test_the_report_names_the_machine(cpu_run: tuple[Any, dict[str, Any], str]) -> None:
    _, report, md = cpu_run
    m = report["machine"]
    assert m["torch"] == torch.__version__
    assert m["device_count"] == 0 and m["devices"] == [] and m["cuda_available"] is False
    for key in ("nvidia_driver", "cuda_runtime", "cuda_driver_api", "nccl", "python", "platform",
                "hostname", "cpu", "cpu_count", "host_memory_bytes"):  # fmt: skip
        assert key in m, key
    assert m["cpu_count"] >= 1 and m["host_memory_bytes"] > 0
    assert f"- card: no CUDA GPU: {m['cpu']}" in md
    assert f"torch {m['torch']}" in md


def test_the_docs_list_every_cuda_test(cpu_run: tuple[Any, dict[str, Any], str]) -> None:
    """docs/gpu.md's list is what `python -m dtlab.gpucheck --update-docs docs/gpu.md` writes now."""
    _, report, _ = cpu_run
    (check,) = [c for c in report["checks"] if c["name"] == "cuda-tests"]
    found = [{"id": t["id"], "doc": t["doc"]} for t in check["figures"]["tests"]]
    documented = cudatests.documented((ROOT / "docs" / "gpu.md").read_text())
    assert documented == cudatests.render(found), (
        "docs/gpu.md's CUDA tests are stale: run python -m dtlab.gpucheck --update-docs docs/gpu.md"
    )


def test_a_failing_check_fails_the_run_and_is_named(tmp_path: Path) -> None:
    # Every parameter is off by 1e-3 once loaded from the step-2 checkpoint: the resume differs.
    out = tmp_path / "report"
    proc = gpucheck("--out", str(out), "--only", "resume", env={"DTLAB_FAULTS": "badload@2"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert not report["ok"] and report["failed"] == ["resume"]
    (resume,) = [c for c in report["checks"] if c["name"] == "resume"]
    assert resume["reason"].startswith("the resumed run differs from the uninterrupted one")
    assert (out / "report.md").read_text().startswith("# dtlab GPU check: FAILED: resume")
    assert "FAILED: resume" in proc.stdout


def test_a_wrong_check_name_or_a_used_directory_is_refused(tmp_path: Path) -> None:
    proc = gpucheck("--only", "train,nope")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        "--only 'train,nope': nope is not a check; allowed: train, float8, memory," in proc.stderr
    )
    (tmp_path / "x").write_text("")
    proc = gpucheck("--out", str(tmp_path), "--only", "memory")
    assert proc.returncode == 2
    assert f"--out {tmp_path}: exists and is not an empty directory" in proc.stderr


def test_memory_without_the_train_check_is_skipped(tmp_path: Path) -> None:
    proc = gpucheck("--out", str(tmp_path / "report"), "--only", "memory")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    (memory,) = [c for c in report["checks"] if c["name"] == "memory"]
    assert (
        memory["status"] == "skipped" and "train check's run, which did not run" in memory["reason"]
    )


def test_what_a_gpu_machine_runs() -> None:
    """The device decision, read without a GPU: one GPU runs every check but the 2-GPU ones; the
    configs of every check are valid; the timeouts fit the 10 minutes."""
    assert skip_reason("train", 0) is None and skip_reason("equivalence", 2) is None
    assert skip_reason("killed-rank", 1) == "needs 2 CUDA GPUs, this machine has 1"
    gpu = settings_for(1)
    assert gpu.gpu and not settings_for(0).gpu
    for key in ("model.preset=llama3.2-1b", "train.precision=bf16", "train.compile=true"):
        assert key in gpu.train
    assert gpu.save_kinds == ("none", "sync", "async") and "checkpoint.async=true" in gpu.resume
    for s in (gpu, settings_for(0)):
        for overrides in (s.train, s.checkpoint, s.resume, s.equivalence, s.killed):
            load_config(overrides=overrides)
    # The 1B training fits an 80 GB card unsharded, as dtlab plan predicts it.
    (single,) = plan(load_config(overrides=gpu.train), 1, 1, PROFILES["h100"], None, False)[
        "strategies"
    ]
    assert single["fits"] and single["per_rank"]["total_bytes"] < 60 * 2**30
    # A 40 GB card takes one sample a step, which fits it.
    small = settings_for(1, 40 * 2**30)
    assert "train.global_batch_size=1" in small.train and "train.global_batch_size=4" in gpu.train
    (single,) = plan(load_config(overrides=small.train), 1, 1, PROFILES["a100-40gb"], None, False)[
        "strategies"
    ]
    assert single["fits"], single
    assert BUDGET_S < 600 and set(gpu.timeouts) == set(CHECKS)
    # Each kind of parallelism over 2 GPUs; the 2-D layouts where there are 4.
    assert settings_for(2).layouts == "single,ddp:2,fsdp:2,tp:2,pp:2,cp:2,ft:2"
    assert settings_for(8).layouts == settings_for(2).layouts + ",hsdp:4,fsdp:2xtp:2"
    (moe, compiled) = settings_for(2).more_verifies
    assert moe[2] == "single,ep:2" and load_config(overrides=moe[3]).model.moe is not None
    assert compiled[2] == "single,fsdp:2"
    assert load_config(overrides=compiled[3]).train.compile
    assert load_config(overrides=compiled[3]).train.precision == "bf16"
    for n in (2, 8):  # every layout's world fits the node, and its config is valid there
        s = settings_for(n)
        for layouts, config in [
            (s.layouts, s.equivalence),
            *((r[2], r[3]) for r in s.more_verifies),
        ]:
            for layout in parse_layouts(layouts):
                assert layout.nproc <= n
                load_config(overrides=[*config, *layout.overrides])


def test_a_step_past_its_timeout_is_stopped(tmp_path: Path) -> None:
    log = tmp_path / "slow.log"
    with pytest.raises(StepTimeout, match="timed out after 1 s"):
        run_logged([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                   1.0, log)  # fmt: skip
    assert "# timed out" in log.read_text() and "started" in log.read_text()


def test_cuda_tests_past_their_timeout_fail_the_check(tmp_path: Path) -> None:
    ctx = Context(tmp_path, {"device_count": 0}, settings_for(0), Deadline(60.0),
                  tests=ROOT / "tests", env=NO_GPU)  # fmt: skip
    check = Check("cuda-tests", CHECKS["cuda-tests"], timeout_s=1.0)
    cuda_tests(ctx, check)
    assert check.status == "failed" and check.reason.startswith("timed out after 1 s"), check.reason
    assert (tmp_path / "cuda-tests" / "pytest.log").read_text().count("# timed out") == 1


def test_the_docs_list_is_rewritten_between_its_markers(tmp_path: Path) -> None:
    doc = tmp_path / "gpu.md"
    doc.write_text(f"intro\n\n{cudatests.BEGIN}\n\n- old\n\n{cudatests.END}\nafter\n")
    tests = [{"id": "tests/t.py::test_b[x]", "doc": "B."}, {"id": "tests/t.py::test_b[y]", "doc": "B."},
             {"id": "tests/t.py::test_a", "doc": "A."}]  # fmt: skip
    assert cudatests.update_docs(doc, tests)
    assert doc.read_text() == (
        f"intro\n\n{cudatests.BEGIN}\n\n- `tests/t.py::test_a`: A.\n- `tests/t.py::test_b[x, y]`: B."
        f"\n\n{cudatests.END}\nafter\n"
    )
    assert not cudatests.update_docs(doc, tests)
    doc.write_text("no list here\n")
    with pytest.raises(DtlabError, match="has no generated list"):
        cudatests.update_docs(doc, tests)


@pytest.mark.slow
def test_the_layouts_a_node_of_4_gpus_verifies_are_equal_to_one_process_on_gloo(
    tmp_path: Path,
) -> None:
    """What the equivalence check runs on 4 GPUs or more, every layout and the config as there
    (the dense model's, then the mixture of experts' and FSDP's in bf16 with compile), on gloo
    processes: each within verify's tolerances of one process."""
    s = settings_for(8)
    ctx = Context(tmp_path, {"device_count": 0}, s, Deadline(1200.0), env=NO_GPU)
    check = Check("equivalence", CHECKS["equivalence"], timeout_s=1200.0)
    equivalence(ctx, check)
    assert check.status == "passed", (check.reason, check.figures)
    # Each layout's row (each fault-tolerant group's its own), the dense model's, then the MoE's
    # and the compiled bf16 run's.
    rows = [(r["run"], re.sub(r" group \d$", "", r["layout"])) for r in check.figures["rows"]]
    assert list(dict.fromkeys(rows)) == [
        *(("verify", x) for x in s.layouts.split(",")[1:]),
        ("verify-moe", "ep:2"), ("verify-bf16-compile", "fsdp:2"),
    ]  # fmt: skip
    assert rows.count(("verify", "ft:2")) == 2


def test_the_killed_rank_check_reads_rank_0s_error_on_gloo(tmp_path: Path) -> None:
    """What the 2-GPU check runs, on 2 gloo processes: rank 1 killed after step 3, rank 0's error
    naming it is found (and the launcher's line alone would not do)."""
    ctx = Context(tmp_path, {"device_count": 0}, settings_for(0), Deadline(120.0), env=NO_GPU)
    check = Check("killed-rank", CHECKS["killed-rank"], timeout_s=120.0)
    killed_rank(ctx, check)
    assert check.status == "passed", (check.reason, check.figures)
    assert check.figures["exit_code"] == 1
    assert re.match(r"exit code 1 after [\d.]+ s \(collective timeout 10 s\): \[rank0\] error: "
                    r"a collective failed on rank 0: .*Rank 1 \(pid \d+", check.reason)  # fmt: skip
    launcher = [x for x in check.figures["error_lines"] if x.startswith("error: training failed")]
    assert launcher and "rank 1 (exit code -9)" in launcher[0]


def test_the_collectives_check_on_gloo_checks_every_result_and_reports_the_bus_bandwidth(
    tmp_path: Path,
) -> None:
    """What the node's check runs across its GPUs (NCCL), on 2 gloo processes: each collective's
    result checked, the bus bandwidth at each size, labelled as no GPU's figure; the card's
    datasheet link beside it where the card is known."""
    machine = {"device_count": 0, "devices": [{"name": "NVIDIA H100 80GB HBM3"}]}
    ctx = Context(tmp_path, machine, settings_for(0), Deadline(120.0), env=NO_GPU)
    check = Check("collectives", CHECKS["collectives"], timeout_s=120.0)
    collectives(ctx, check)
    assert check.status == "passed", (check.reason, check.figures)
    f = check.figures
    assert f["backend"] == "gloo" and f["world"] == 2
    assert [(r["op"], r["size"]) for r in f["results"]] == [
        (op, size)
        for op in ("all_reduce", "all_gather", "reduce_scatter")
        for size in (65_536, 2**20)
    ]
    assert all(r["correct"] for r in f["results"])
    assert set(f["busbw_gbps_at_largest"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert f["datasheet_link_gbps"] == PROFILES["h100"].intra_node_gbps
    assert check.reason.startswith(
        "2 ranks over gloo (CPU processes: not a GPU's figure), every result right; bus "
        "bandwidth at 1 MiB, GB/s: all_reduce "
    ) and check.reason.endswith("(the card's link: 450 GB/s, looked up)")
    assert check.commands == [
        f"python -m dtlab.bench.collectives --device cpu --nproc 2 --sizes 64K,1M --json "
        f"{tmp_path / 'collectives' / 'busbw.json'}"
    ]
    assert skip_reason("collectives", 1) == "needs 2 CUDA GPUs, this machine has 1"
    assert settings_for(8).collective_sizes == "1M,64M,1G"


@pytest.mark.slow
def test_the_resume_check_of_a_node_resumes_fsdps_async_save_across_layouts_on_gloo(
    tmp_path: Path,
) -> None:
    """What the resume check runs with 2 GPUs, on gloo: one process and FSDP over 2 each save
    asynchronously at the middle step; each resumes on its own layout, and FSDP's save on one
    process too, every run continuing as the uninterrupted one."""
    s = settings_for(2)
    assert s.resume_layouts == "single,fsdp:2" and settings_for(1).resume_layouts == "single"
    ctx = Context(tmp_path, {"device_count": 0}, s, Deadline(600.0), env=NO_GPU)
    check = Check("resume", CHECKS["resume"], timeout_s=600.0)
    resume(ctx, check)
    assert check.status == "passed", (check.reason, check.figures)
    kinds = [c["check"] for c in check.figures["checks"]]
    # One process's own resume, FSDP's on FSDP and on one process.
    assert sorted(kinds) == ["resume", "resume", "resume on single"], kinds
    assert check.reason.startswith(
        "resumed at step 5 of 10 (single,fsdp:2: each on its own layout and on the first)"
    )


@pytest.mark.slow
def test_the_ft_killed_check_sees_the_group_rejoin_on_gloo(tmp_path: Path) -> None:
    """What the 2-GPU check runs, on 2 gloo processes: group 1 killed after step 8, restarted by
    its agent, the live state taken from group 0, both groups to the last step."""
    pytest.importorskip("torchft")
    ctx = Context(tmp_path, {"device_count": 0}, settings_for(0), Deadline(300.0), env=NO_GPU)
    check = Check("ft-killed", CHECKS["ft-killed"], timeout_s=300.0)
    ft_killed(ctx, check)
    assert check.status == "passed", (check.reason, check.figures)
    assert check.figures["steps"] == [20, 20] and check.figures["exit_code"] == 0
    assert check.figures["died"] == [
        "[replica 1] rank 0 died (SIGKILL); restarting the workers (restart 1 of 10)"
    ]
    (recovery,) = check.figures["recoveries"][1]
    assert recovery["to_step"] == 8 and check.figures["recoveries"][0] == []
    assert re.match(
        r"group 1 killed after step 8, restarted, recovered the state after step 8 from a live "
        r"peer in [\d.]+ s \(it was at step 5 here\); both groups ended step 20 in [\d.]+ s$",
        check.reason,
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_report_names_the_card_and_its_versions() -> None:
    """The card's name, memory and capability as torch sees them, the NVIDIA driver (nvidia-smi), the
    CUDA version the driver supports (libcuda) and NCCL's version, read in a process of its own."""
    proc = subprocess.run([sys.executable, "-m", "dtlab.gpucheck.machine"], capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    m = json.loads(proc.stdout)
    assert m["cuda_available"] and m["device_count"] == torch.cuda.device_count()
    first = torch.cuda.get_device_properties(0)
    assert m["devices"][0]["name"] == first.name
    assert m["devices"][0]["memory_bytes"] == first.total_memory
    assert m["cuda_runtime"] == torch.version.cuda
    assert re.fullmatch(r"\d+\.\d+", m["cuda_driver_api"]), m["cuda_driver_api"]
    assert re.fullmatch(r"\d+\.\d+(\.\d+)*", m["nvidia_driver"] or ""), m["nvidia_driver"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", m["nccl"] or ""), m["nccl"]


def test_gpus_that_torch_cannot_see_fail_the_check_and_say_why(tmp_path: Path) -> None:
    # A machine whose driver lists GPUs (nvidia-smi, stood in for here) while torch sees none: the
    # CPU smoke must not pass for a GPU check. This torch is a CPU build: that is the reason given.
    from dtlab.gpucheck.machine import why_torch_sees_no_gpu

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"; '
        'echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)"; else echo 580.1; fi\n'
    )
    smi.chmod(0o755)
    out = tmp_path / "report"
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    env = {"PATH": path, "CUDA_VISIBLE_DEVICES": "0,1"}
    proc = gpucheck("--out", str(out), "--only", "equivalence", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["failed"] == ["machine"] and not report["ok"]
    (machine,) = [c for c in report["checks"] if c["name"] == "machine"]
    assert machine["reason"].startswith(
        "2 NVIDIA GPUs on this machine (nvidia-smi -L) but torch sees none: torch "
    ), machine["reason"]
    assert "is a CPU build" in machine["reason"]
    # The other reasons, decided from the versions.
    assert why_torch_sees_no_gpu(0, "2.13.0", None, None, None) is None
    old_driver = why_torch_sees_no_gpu(8, "2.13.0+cu130", "13.0", "12.4", None)
    assert (
        old_driver is not None
        and "the NVIDIA driver supports CUDA 12.4, older than the CUDA 13.0" in old_driver
    )
    # Hidden on purpose (the CPU path of these tests): not a failure.
    assert why_torch_sees_no_gpu(8, "2.13.0+cu130", "13.0", "13.0", "") is None
