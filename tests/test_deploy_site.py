"""A cluster's settings in ``dtlab launch slurm`` (site file, command line), the job's own Python and a
named run directory: the scripts are run with srun/scontrol/module replaced by recorders, and one is
submitted to the local Slurm cluster when one answers."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import FAST, read_metrics, run_cli
from dtlab.deploy import SlurmJob, slurm_script
from dtlab.deploy_site import SiteSettings, site_from_dict
from dtlab.errors import ConfigError
from test_deploy import _job_state, _wait_for, slurm  # noqa: F401  (slurm: the fixture)

SITE = {
    "partition": "gpu",
    "account": "proj42",
    "qos": "high",
    "exclusive": True,
    "sbatch": ["--mem=0"],
    "modules": ["cuda/12.4", "nccl/2.21"],
    "setup": ['echo "setup ran" > "$RECORD_DIR/setup.txt"'],
    "env": {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "ODD": "a b'$(x)"},
    "container": {"image": "nvcr.io#nvidia/pytorch:24.05-py3", "mounts": ["/scratch"]},
    "run_root": "RUNS",  # replaced by a path under tmp_path
}


def _bin(tmp: Path) -> Path:
    """``srun``, ``scontrol`` and ``module`` stand-ins: srun records its arguments (NUL-separated) and
    the job's variables it was started with; module records its arguments."""
    d = tmp / "bin"
    d.mkdir()
    args = 'for a in "$@"; do printf "%s\\0" "$a"; done > "$RECORD_DIR/$(basename "$0").args"\n'
    env = 'env | grep -E "^(NCCL|ODD)" | sort > "$RECORD_DIR/srun.env"\n'
    (d / "srun").write_text("#!/bin/bash\n" + args + env + "exit ${FAKE_RC:-0}\n")
    (d / "scontrol").write_text("#!/bin/bash\necho node-a\necho node-b\n")
    (d / "module").write_text(
        '#!/bin/bash\necho "$@" >> "$RECORD_DIR/module.calls"\n[[ $2 != missing* ]]\n'
    )
    for f in d.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return d


def _run_script(
    tmp: Path, script: Path, path: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": f"{_bin(tmp)}:{path if path is not None else os.environ['PATH']}",
        "RECORD_DIR": str(tmp),
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_NUM_NODES": "2",
    }
    return subprocess.run(["bash", str(script)], cwd=tmp, env=env, capture_output=True, text=True)


def _srun_args(tmp: Path) -> list[str]:
    return (tmp / "srun.args").read_text().split("\0")[:-1]


def _launch(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "launch", "slurm", "--nodes", "2", "--nproc-per-node", "2", "--out", str(tmp / "job.sbatch"),
        "--set", *FAST, "parallel.strategy=fsdp", "run.name=site-test", *args, cwd=tmp,
    )  # fmt: skip


def test_site_file_and_flags_make_the_script(tmp_path: Path) -> None:
    site = {**SITE, "run_root": str(tmp_path / "shared" / "runs")}
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    proc = _launch(
        tmp_path, "--site", str(tmp_path / "site.yaml"), "--account", "other", "--module", "gcc/13",
        "--env", "NCCL_IB_HCA=mlx5_2", "--container-mount", "/data:/data:ro", "--gpus-per-node", "2", "--sbatch", "reservation=big",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "job.sbatch"
    text = script.read_text()
    directives = [ln.split(None, 1)[1] for ln in text.splitlines() if ln.startswith("#SBATCH")]
    # The command line wins (--account); the file gives the rest.
    assert {
        "--partition=gpu",
        "--account=other",
        "--qos=high",
        "--exclusive",
        "--mem=0",
        "--reservation=big",
    } <= set(directives)
    assert "--account=proj42" not in directives
    # The site's lines come before `set -u` (module scripts read unset variables).
    order = ["export NCCL_SOCKET_IFNAME=ib0", "setup ran", "module load cuda/12.4", "set -uo"]
    assert sorted(order, key=text.index) == order
    run_dir = tmp_path / "shared" / "runs" / "site-test"
    assert yaml.safe_load((tmp_path / "job.config.yaml").read_text())["run"]["dir"] == str(run_dir)

    res = _run_script(tmp_path, script)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "module.calls").read_text().split("\n")[:-1] == [
        "load cuda/12.4", "load nccl/2.21", "load gcc/13",
    ]  # fmt: skip
    assert (tmp_path / "setup.txt").read_text() == "setup ran\n"
    # Every variable reaches the tasks intact (quoted, never run); the flag replaces the file's value.
    assert (tmp_path / "srun.env").read_text().splitlines() == [
        "NCCL_IB_HCA=mlx5_2", "NCCL_SOCKET_IFNAME=ib0", "ODD=a b'$(x)",
    ]  # fmt: skip
    args = _srun_args(tmp_path)
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in args
    mounts = f"--container-mounts=/scratch,/data:/data:ro,{tmp_path},{run_dir}"
    assert mounts in args
    assert run_dir.is_dir()  # made before srun: pyxis mounts only what exists
    inner = args[args.index("-c") + 1 :]
    assert inner[1:3] == ["python3", str(tmp_path / "job.config.yaml")]  # the image's Python


def test_apptainer_venv_and_run_root_flags(tmp_path: Path) -> None:
    venv = tmp_path / "env"
    proc = _launch(
        tmp_path, "--container-image", "/images/dtlab.sif", "--container-runtime", "apptainer",
        "--venv", str(venv), "--run-root", str(tmp_path / "shared"), "--gpus-per-node", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    res = _run_script(tmp_path, tmp_path / "job.sbatch")
    assert res.returncode == 0, res.stderr
    args = _srun_args(tmp_path)
    run_dir = tmp_path / "shared" / "site-test"
    i = args.index("apptainer")
    assert args[i : i + 6] == [
        "apptainer", "exec", "--nv", "--bind", f"{tmp_path},{run_dir}", "/images/dtlab.sif",
    ]  # fmt: skip
    inner = args[args.index("-c") + 1 :]
    assert inner[1] == str(venv / "bin" / "python")


def test_a_module_that_fails_to_load_stops_the_job(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "--module", "cuda/12.4", "--module", "missing/1")
    assert proc.returncode == 0, proc.stderr
    res = _run_script(tmp_path, tmp_path / "job.sbatch")
    assert res.returncode == 1 and "dtlab: module load missing/1 failed" in res.stderr
    assert not (tmp_path / "srun.args").exists()


def test_the_job_finds_its_own_python(tmp_path: Path) -> None:
    """Without --python: python3 on the job's PATH if it has dtlab, else the interpreter of `dtlab` on
    the PATH, else (saying so) the one that wrote the script, else a clear error."""
    config = tmp_path / "job.config.yaml"
    job = SlurmJob(nodes=1, nproc_per_node=1, fallback_python=sys.executable)
    venv_bin = str(
        Path(sys.executable).parent
    )  # holds `dtlab`, whose #! line names the venv's Python
    empty = tmp_path / "empty"

    def python_of(path: str, fallback: str | None) -> subprocess.CompletedProcess[str]:
        j = SlurmJob(nodes=1, nproc_per_node=1, fallback_python=fallback)
        script = tmp_path / "job.sbatch"
        script.write_text(slurm_script(script, config, j, "t", run_dir=str(tmp_path / "r")))
        (tmp_path / "srun.args").unlink(missing_ok=True)
        shutil.rmtree(tmp_path / "bin", ignore_errors=True)
        return _run_script(tmp_path, script, path)

    # python3 on the PATH with dtlab (an activated venv, a loaded module): that one.
    res = python_of(f"{venv_bin}:/usr/bin:/bin", None)
    assert res.returncode == 0, res.stderr
    assert _srun_args(tmp_path)[-5] == str(Path(venv_bin) / "python3")
    # A PATH whose python3 lacks dtlab but has `dtlab` (pipx, say): the interpreter of its #! line.
    dtlab_only = tmp_path / "dtlab-only"
    dtlab_only.mkdir()
    shutil.copy(Path(venv_bin) / "dtlab", dtlab_only / "dtlab")
    res = python_of(f"{dtlab_only}:/usr/bin:/bin", None)
    assert res.returncode == 0, res.stderr
    assert _srun_args(tmp_path)[-5] == sys.executable
    # Neither: the Python that wrote the script, with a message.
    res = python_of("/usr/bin:/bin", job.fallback_python)
    assert res.returncode == 0, res.stderr
    assert _srun_args(tmp_path)[-5] == sys.executable and "the one that wrote" in res.stdout
    # None at all: the job stops before srun, saying what to do.
    res = python_of("/usr/bin:/bin", str(empty / "python"))
    assert res.returncode == 1 and "pass --python or --venv" in res.stderr
    assert not (tmp_path / "srun.args").exists()


@pytest.mark.parametrize(
    ("site", "needle"),
    [
        ({"qos ": "x"}, "unknown key 'qos '; allowed: partition, account, qos"),
        ({"qos": 3}, "qos: 3 is not valid; allowed: a Slurm QoS name"),
        ({"exclusive": "yes"}, "exclusive: 'yes' is not valid; allowed: true or false"),
        ({"sbatch": ["--mem 0"]}, "sbatch[0]: '--mem 0' is not valid; allowed: an sbatch option"),
        ({"env": {"NCCL-X": "1"}}, "env: 'NCCL-X' is not valid; allowed: variable names"),
        ({"container": {"image": "x", "runtime": "docker"}}, "allowed: pyxis or apptainer"),
        ({"container": {"img": "x"}}, "unknown key container.img; allowed: image, runtime"),
        ({"container": {"image": "x", "mounts": ["/a,/b"]}}, "allowed: SRC[:DST[:FLAGS]]"),
        ({"python": "/p", "venv": "/v"}, "python and venv both given"),
        (
            {"sbatch": ["--time=5"]},
            "sbatch[0]: '--time=5' is an option dtlab writes itself; set it with --time",
        ),
        ([1], "a site file is a mapping"),
    ],
)
def test_bad_site_files_name_the_key(site: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as e:
        site_from_dict(site, "--site s.yaml")
    assert needle in str(e.value) and str(e.value).startswith("--site s.yaml: ")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--site", "nope.yaml"], "--site nope.yaml: cannot read it"),
        (["--env", "NCCL_IB_HCA"], "--env 'NCCL_IB_HCA' is not valid; allowed: NAME=VALUE"),
        (["--qos", "a b"], "--qos: 'a b' is not valid"),
        (["--python", "/p", "--venv", "/v"], "--python and --venv both given"),
        (["--container-mount", "/a"], "--container-mount/--container-runtime without an image"),
        (
            ["--sbatch", "mem 0"],
            "--sbatch: option: '--mem 0' is not valid; allowed: an sbatch option",
        ),
        (
            ["--sbatch", "nodes=4"],
            "'--nodes=4' is an option dtlab writes itself; set it with --nodes",
        ),
    ],
)
def test_bad_site_flags_are_clear_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = _launch(tmp_path, *args)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("job*"))  # nothing written


def test_site_file_yaml_errors(tmp_path: Path) -> None:
    (tmp_path / "site.yaml").write_text("qos: [unclosed\n")
    proc = _launch(tmp_path, "--site", str(tmp_path / "site.yaml"))
    assert proc.returncode == 2 and "not valid YAML" in proc.stderr, proc.stderr
    assert site_from_dict(None) == SiteSettings()


def _finished(job_id: str) -> dict[str, str]:
    """The job's state once the local cluster has ended it (scontrol's fields)."""
    return _wait_for(
        job_id, lambda i: i["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300
    )


@pytest.mark.slow
def test_site_job_runs_on_the_local_slurm(tmp_path: Path, slurm: None) -> None:  # noqa: F811
    """A job with a site file (variables, a setup line, exclusive node, the venv named, a run root)
    submitted to the local cluster trains, and its tasks see the site's variables."""
    site = {
        "exclusive": True,
        "env": {"NCCL_SOCKET_IFNAME": "lo", "DTLAB_SITE_MARK": "from the site file"},
        "setup": [f'echo "$DTLAB_SITE_MARK" > {tmp_path}/setup.txt || true'],
        "venv": str(Path(sys.executable).parents[1]),
        "run_root": str(tmp_path / "shared"),
    }
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    proc = run_cli(
        "launch", "slurm", "--nproc-per-node", "2", "--time", "10", "--site", str(tmp_path / "site.yaml"),
        "--out", str(tmp_path / "job.sbatch"), "--submit",
        "--set", *FAST, "train.steps=3", "parallel.strategy=ddp", "run.name=site-job", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    info = _finished(job_id)
    log = (tmp_path / f"site-job-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    run_dir = tmp_path / "shared" / "site-job"
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert info.get("OverSubscribe") == "NO"  # --exclusive reached the scheduler
    assert (tmp_path / "setup.txt").read_text() == "from the site file\n"


def _docs_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, Path]:
    """(the script docs/deploy.md shows, the one its site file and command write here with
    /shared/... mapped into ``tmp_path``, that script's path)."""
    from dtlab.cli import main as cli_main

    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "deploy.md").read_text(encoding="utf-8")
    section = text[text.index("A 2-node x 8-GPU FSDP job in the NGC PyTorch image") :]
    site = re.search(r"```yaml\n(.*?)```", section, re.S)
    command = re.search(r"```bash\ncd /shared/jobs\n(dtlab launch slurm .*?)\n```", section, re.S)
    shown = re.search(r"```bash\n(#!/bin/bash\n.*?)```", section, re.S)
    assert site and command and shown
    shared = tmp_path / "shared"
    (shared / "dtlab").mkdir(parents=True)
    (shared / "jobs").mkdir()
    (shared / "dtlab" / "site.yaml").write_text(site.group(1))
    words = command.group(1).replace("\\\n", " ").split()[2:]
    words = [w.replace("/shared/", f"{shared}/") for w in words]
    words[words.index("--out") + 1] = str(shared / "jobs" / "fsdp.sbatch")
    monkeypatch.chdir(root)
    assert cli_main(["launch", *words]) == 0
    script = shared / "jobs" / "fsdp.sbatch"
    return shown.group(1), script.read_text().replace(str(shared), "/shared"), script


def test_the_docs_site_example_is_what_the_command_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/deploy.md's 2-node x 8-GPU FSDP script (a container, the site's settings) is what its
    site file and command write, line for line."""
    shown, written, _ = _docs_example(tmp_path, monkeypatch)
    assert written == shown


@pytest.mark.slow
def test_the_docs_site_example_is_accepted_by_the_local_slurm(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    slurm: None,  # noqa: F811
) -> None:
    """Submitted held to the local cluster (one CPU node: the command line overrides the partition,
    node count and GPUs it cannot meet), Slurm reads every directive the docs' script has."""
    _, _, script = _docs_example(tmp_path, monkeypatch)
    res = subprocess.run(
        ["sbatch", "--parsable", "--hold", "--partition=debug", "--nodes=1", "--gpus-per-node=0",
         f"--output={tmp_path}/out-%j", str(script)],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().split(";")[0]
    try:
        info = _job_state(job_id)
        assert info["Account"] == "proj42" and info["Requeue"] == "1", info
        assert info["TimeLimit"] == "12:00:00" and info["OverSubscribe"] == "NO", info
        assert info["MinMemoryNode"] == "0", info
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)


def test_a_fault_tolerant_job_runs_its_lighthouse_and_groups_in_the_container(
    tmp_path: Path,
) -> None:
    """With a container, the lighthouse (a one-task step on the first node, sharing the job's
    resources) and every replica group's agent start in the image, with the config's directory and
    the run directory mounted; the batch step itself starts no dtlab of its own."""
    proc = _launch(
        tmp_path, "--container-image", "nvcr.io#nvidia/pytorch:24.05-py3",
        "--set", "parallel.strategy=ddp", "parallel.fault_tolerance.enabled=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "job.sbatch").read_text()
    sruns = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(sruns) == 2, sruns
    lighthouse, groups = sruns
    run_dir = tmp_path / "runs" / "site-test"
    mounts = f"--container-mounts={tmp_path},{run_dir}"
    for line in sruns:
        assert "--container-image='nvcr.io#nvidia/pytorch:24.05-py3'" in line and mounts in line
    assert lighthouse.startswith('srun --overlap --nodes=1 --ntasks=1 --nodelist="$FIRST_NODE"')
    assert '"$PYTHON" -m dtlab.fault_tolerance' in lighthouse
    assert "--kill-on-bad-exit=0 --ntasks-per-node=2" in groups
    # Nothing of dtlab starts outside an srun (the batch step may not have it).
    outside = [ln for ln in text.splitlines() if ln.startswith('"$PYTHON"')]
    assert not outside, outside
    assert f"\nRUN_DIR={run_dir}\n" in text
    assert text.index('mkdir -p "$RUN_DIR"') < text.index("srun ")  # pyxis mounts what exists


@pytest.mark.slow
def test_a_fault_tolerant_job_in_a_container_trains_on_the_local_slurm(
    tmp_path: Path,
    slurm: None,  # noqa: F811
) -> None:
    """An apptainer job with fault tolerance on the local cluster: a stand-in ``apptainer`` (which
    records its call and runs the command without an image) starts the lighthouse and both groups,
    they meet and train to the end, and the job completes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "apptainer"
    stand_in.write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {tmp_path}/apptainer.calls\n'
        "shift  # exec\n"
        "while [[ $1 == --* ]]; do [[ $1 == --bind ]] && shift; shift; done\n"
        "shift  # the image\n"
        'exec "$@"\n'
    )
    stand_in.chmod(0o755)
    site = {
        "container": {"image": "dtlab.sif", "runtime": "apptainer"},
        "setup": [f"export PATH={bin_dir}:$PATH"],
        "python": sys.executable,
        "run_root": str(tmp_path / "shared"),
    }
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    proc = run_cli(
        "launch", "slurm", "--nproc-per-node", "2", "--time", "10", "--site", str(tmp_path / "site.yaml"),
        "--out", str(tmp_path / "job.sbatch"), "--submit",
        "--set", *FAST, "train.steps=4", "parallel.strategy=ddp",
        "parallel.fault_tolerance.enabled=true", "run.name=ft-box", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    info = _finished(job_id)
    log = (tmp_path / f"ft-box-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    calls = (tmp_path / "apptainer.calls").read_text().split("exec --bind ")[1:]
    assert len(calls) == 3, calls  # the lighthouse and the two groups, each in the image
    assert sum("-m dtlab.fault_tolerance --lighthouse" in c for c in calls) == 1, calls
    assert sum("-m dtlab.fault_tolerance --nproc" in c for c in calls) == 2, calls
    run_dir = tmp_path / "shared" / "ft-box"
    for i in range(2):
        assert [m["step"] for m in read_metrics(run_dir / f"replica-{i}")] == [1, 2, 3, 4]
