"""``dtlab verify``: its layout syntax, a passing verification, and a broken layout caught and named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import FAST, run_cli
from dtlab.errors import ConfigError
from dtlab.verify import FT_ON, Layout, parse_checks, parse_layouts
from dtlab.verify_state import CHECKS, compare_exports


def test_layouts_parse_into_processes_and_overrides() -> None:
    layouts = parse_layouts("single, fsdp:2xtp:2, sp:2, pp:2:gpipe, hsdp:4xpp:2")
    assert layouts == [
        Layout("single", 1, ("parallel.strategy=single",)),
        Layout("fsdp:2xtp:2", 4, ("parallel.strategy=fsdp", "parallel.tp=2")),
        Layout("sp:2", 2, ("parallel.strategy=single", "parallel.tp=2",
                           "parallel.sequence_parallel=true")),
        Layout("pp:2:gpipe", 2, ("parallel.strategy=single", "parallel.pp=2",
                                 "parallel.pp_schedule=gpipe")),
        Layout("hsdp:4xpp:2", 8, ("parallel.strategy=hsdp", "parallel.replicate=2",
                                  "parallel.pp=2")),
    ]  # fmt: skip
    zero, diloco, h4 = parse_layouts("zero:2,diloco:2,diloco:4:4")
    assert zero == Layout("zero:2", 2, ("parallel.strategy=ddp", "parallel.sharding=optimizer"))
    assert diloco == Layout("diloco:2", 2, ("parallel.strategy=ddp",
                                            "parallel.diloco.inner_steps=1"))  # fmt: skip
    assert h4.nproc == 4 and "parallel.diloco.inner_steps=4" in h4.overrides
    assert diloco.diloco and not zero.diloco
    assert parse_checks("resume") == ("loss", "resume") and parse_checks("all") == CHECKS
    ft, ft_tp = parse_layouts("ft:2,ft:2xtp:2")
    assert ft == Layout("ft:2", 2, ("parallel.strategy=ddp", FT_ON))
    assert ft_tp.nproc == 4 and "parallel.tp=2" in ft_tp.overrides
    assert ft.ft and ft_tp.ft and not zero.ft


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("single", "give at least two layouts"),
        ("single,zp:2", "'zp:2' in 'zp:2' is not NAME:DEGREE"),
        ("single,tp:2xsp:2", "gives tp parallelism twice"),
        ("single,ddp:2xfsdp:2", "gives data parallelism twice"),
        (
            "single,tp:2:gpipe",
            "only pp (its schedule), diloco (its H) and cp (its method: ring "
            "or alltoall) take an option",
        ),
        ("single,hsdp:3", "its degree must be even"),
        ("single,ddp:2,ddp:2", "names a layout twice"),
        ("single,diloco:2:0", "diloco's option is H"),
        ("single,zero:2xddp:2", "gives data parallelism twice"),
    ],
)
def test_bad_layouts_are_named(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_layouts(text)


def test_verify_passes_equal_layouts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("verify", "--layouts", "single,sp:2,pp:2:gpipe", "--steps", "6",
                   "--out", str(out), "--set", *FAST, "model.n_layers=4",
                   "train.micro_batch_size=2", "train.grad_clip=0.1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result = json.loads((out / "verify.json").read_text())
    assert result["ok"] and [r["layout"] for r in result["rows"]] == ["sp:2", "pp:2:gpipe"]
    for row in result["rows"]:
        assert row["max_loss_diff"] <= 1e-5 and row["max_param_diff"] <= 1e-4, row
    assert re.search(r"^sp:2 +2 +\S+ +\S+ +\S+ +ok$", proc.stdout, re.M), proc.stdout
    # One verdict last, with where the details are.
    last = proc.stdout.strip().splitlines()[-1]
    assert (
        last == f"verified: every comparison within tolerance (2); details in {out / 'verify.json'}"
    )


def test_verify_catches_a_skipped_gradient_sync(tmp_path: Path) -> None:
    """Every DDP rank skips the gradient all-reduce of step 3 (one process has none to skip): verify
    exits 1, names step 3 as the first that differs, and the parameter that differs most."""
    proc = run_cli("verify", "--layouts", "single,ddp:2", "--steps", "6", "--out",
                   str(tmp_path / "out"), "--set", *FAST, env={"DTLAB_FAULTS": "skipsync@3"})  # fmt: skip
    assert proc.returncode == 1, proc.stderr + proc.stdout
    assert re.search(r"^ddp:2 +2 .+ DIFFERS$", proc.stdout, re.M), proc.stdout
    assert (
        proc.stdout.strip().splitlines()[-1].startswith("NOT verified: a layout or check differs")
    )
    m = re.search(
        r"^ddp:2: the training first differs beyond tolerance at step (\d+); the parameter that "
        r"differs most at the end is (\S+) \(by ([\d.e+-]+)\)$",
        proc.stdout,
        re.M,
    )
    assert m, proc.stdout
    assert m[1] == "3" and re.fullmatch(
        r"(layers\.\d+\.\S+|tok_embeddings|output|norm)\.weight", m[2]
    )
    assert float(m[3]) > 1e-4


def test_a_layout_the_config_cannot_run_is_refused_before_any_trains(tmp_path: Path) -> None:
    proc = run_cli("verify", "--layouts", "single,ddp:2,tp:4", "--out", str(tmp_path / "out"),
                   "--set", *FAST)  # fmt: skip
    assert proc.returncode == 2, proc.stdout
    assert (
        "layout tp:4: config: model.n_kv_heads = 2 is not divisible by parallel.tp = 4"
        in proc.stderr
    )
    assert not (tmp_path / "out").exists() and "Traceback" not in proc.stderr


def test_unknown_checks_are_named() -> None:
    with pytest.raises(
        ConfigError,
        match=re.escape("allowed: a comma-separated list of loss, resume, export, or all"),
    ):
        parse_checks("resume,exports")


def test_resume_and_export_checks_pass_and_catch_a_wrong_resume(tmp_path: Path) -> None:
    """Every layout saves at step 2 of 4; resumed there on itself and on the reference, it must
    continue as the uninterrupted run, and its export must give the reference's tensors. Rank 1 gets
    wrong weights whenever it loads the step-2 checkpoint (``badload``): the one resume that runs
    a rank 1 (ddp:2 on itself) is caught; the others, and the exports, pass."""
    out = tmp_path / "out"
    proc = run_cli("verify", "--layouts", "single,ddp:2", "--steps", "4", "--checks", "all",
                   "--out", str(out), "--set", *FAST, "train.grad_clip=0.1",
                   env={"DTLAB_FAULTS": "badload@2:r1"})  # fmt: skip
    assert proc.returncode == 1, proc.stderr + proc.stdout
    result = json.loads((out / "verify.json").read_text())
    assert result["rows"][0]["ok"]  # the uninterrupted runs agree
    checks = {(s["layout"], c["check"]): c for s in result["state"] for c in s["checks"]}
    assert set(checks) == {
        ("single", "resume"), ("single", "export (the reference)"), ("ddp:2", "resume"),
        ("ddp:2", "resume on single"), ("ddp:2", "export"),
    }  # fmt: skip
    for key, c in checks.items():
        assert c["ok"] == (key != ("ddp:2", "resume")), (key, c)
    assert checks["ddp:2", "resume"]["max_loss_diff"] > 1e-4
    assert checks["ddp:2", "resume on single"]["max_param_diff"] <= 1e-4
    assert checks["ddp:2", "export"]["max_param_diff"] <= 1e-4
    assert re.search(r"^ddp:2 +resume +\S+ +\S+ +\S+ +DIFFERS$", proc.stdout, re.M), proc.stdout
    assert "ddp:2 resume: first differs at step 3" in proc.stdout, proc.stdout


def test_an_export_that_differs_is_named(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    x = torch.zeros(4, 3)
    save_file({"w": x, "v": torch.ones(2)}, str(a / "model.safetensors"))
    save_file({"w": x + 0.5, "v": torch.ones(2)}, str(b / "model.safetensors"))
    save_file({"w": x}, str(c / "model.safetensors"))
    assert compare_exports(a, a) == (0.0, "-", "")
    assert compare_exports(a, b)[:2] == (0.5, "w")
    worst, name, note = compare_exports(a, c)
    assert worst == float("inf") and name == "v" and "v only in the reference export" in note


def test_verify_compares_every_fault_tolerant_group(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    out = tmp_path / "out"
    proc = run_cli("verify", "--layouts", "ddp:2,ft:2", "--steps", "4", "--out", str(out),
                   "--set", *FAST, "train.grad_clip=0.5")  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result = json.loads((out / "verify.json").read_text())
    assert [r["layout"] for r in result["rows"]] == ["ft:2 group 0", "ft:2 group 1"]
    for row in result["rows"]:
        assert row["ok"] and row["max_loss_diff"] <= 1e-5 and row["max_param_diff"] <= 1e-5, row


@pytest.mark.parametrize(
    ("layouts", "checks", "message"),
    [
        ("ft:2,ddp:2", "loss", "the reference 'ft:2' is fault-tolerant"),
        ("ddp:2,ft:2", "resume", "--checks resume/export with an ft layout: not built"),
    ],
)
def test_ft_layouts_refused_where_not_built(
    tmp_path: Path, layouts: str, checks: str, message: str
) -> None:
    proc = run_cli("verify", "--layouts", layouts, "--checks", checks, "--out",
                   str(tmp_path / "out"), "--set", *FAST)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_diloco_checkpoint_is_not_resumed_on_another_layout_when_set_for_every_layout(
    tmp_path: Path,
) -> None:
    # DiLoCo from --set (or the config) on every layout, not from a diloco:N layout: the resume of
    # one layout's checkpoint on the reference's was tried, refused by the trainer, and failed
    # verify. It is said not run, as for a diloco:N layout, and nothing trains for it.
    from dtlab.config import load_config
    from dtlab.verify import Tolerances, _resume_check, _StateContext, _Target, with_base_config

    sets = [*FAST, "parallel.diloco.replicas=2", "parallel.diloco.inner_steps=2"]
    plain = parse_layouts("ddp:2,ddp:4")
    assert not any(x.diloco for x in plain)  # the layouts alone do not say it
    assert with_base_config(plain, load_config(None, list(FAST))) == plain
    ref, other = with_base_config(plain, load_config(None, sets))
    assert ref.diloco and other.diloco and ref.overrides == plain[0].overrides
    reports: list[str] = []
    ctx = _StateContext(None, sets, 4, tmp_path, Tolerances(), reports.append, ref,
                        tmp_path / "ref", "torch")  # fmt: skip
    got = _resume_check(
        ctx, other, tmp_path / "x", tmp_path / "none", _Target(ref, ctx.ref_dir, "resume on ddp:2")
    )
    assert got.ok and got.note.startswith("not run: a DiLoCo checkpoint"), got
    assert reports == [] and list(tmp_path.iterdir()) == []  # nothing trained
