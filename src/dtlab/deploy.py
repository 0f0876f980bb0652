"""``dtlab launch``: job files for the schedulers users already have (Slurm, Kubernetes).

Each generator takes a validated config and writes the *resolved* config next to the job (so the job
trains exactly what was checked here, whatever the defaults are when it starts), with a fixed run
directory so that a requeued or restarted job finds its own checkpoints and resumes.

Every user value that reaches a shell is quoted with :func:`shlex.quote`; values that land in
``#SBATCH`` lines (which sbatch parses, not the shell) are checked against what Slurm accepts.
Kubernetes commands are argument lists, never a shell string.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dtlab import __version__
from dtlab.config import Config, config_from_dict, show
from dtlab.errors import ConfigError, Preempted

_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:@+=/-]+$")
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$")


@dataclass(frozen=True)
class SlurmJob:
    """What ``dtlab launch slurm`` puts in the sbatch script."""

    nodes: int
    nproc_per_node: int
    gpus_per_node: int = 0
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    signal_seconds: int = 120
    python: str = "python3"
    port: int | None = None


@dataclass(frozen=True)
class K8sJob:
    """What ``dtlab launch k8s`` puts in the PyTorchJob manifest."""

    nodes: int
    nproc_per_node: int
    image: str
    gpus_per_node: int = 0
    namespace: str | None = None
    pvc: str | None = None
    storage: str = "20Gi"
    cpu: str | None = None
    memory: str | None = None
    max_restarts: int = 3
    grace_seconds: int = 300


# A job that a scheduler may kill (preemption without warning, a node failure, an out-of-memory kill)
# restarts from its last periodic checkpoint: the signal-time save only happens when there is a signal.
# Where the step time cannot be predicted (CPU nodes: no looked-up peak), at most 1/20 of the run is
# lost, and at most this many steps in a long one.
LAUNCH_CHECKPOINT_EVERY_MAX = 100


@dataclass(frozen=True)
class JobShape:
    """What a launch knows of where its job runs, for the checkpoint interval: the world's shape, the
    nodes' GPU (a key of :data:`dtlab.analysis.devices.PROFILES`; None: the plan's default, assumed)
    and the write bandwidth of each node to the run directory (GB/s; None: assumed)."""

    nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    device: str | None = None
    save_gbps: float | None = None


def _divisor_of(every: int, durable_every: int) -> int:
    """``every``, or with ``durable_every`` set a value that divides it: the largest divisor of
    ``durable_every`` not above ``every``, or ``durable_every`` itself when that divisor is less than
    half of ``every`` (a prime, say), so that a job never saves every step for the sake of a divisor."""
    if not durable_every:
        return every
    divisor = max(d for d in range(1, min(every, durable_every) + 1) if durable_every % d == 0)
    return divisor if 2 * divisor >= every else durable_every


def launch_checkpoint_every(steps: int, durable_every: int = 0) -> int:
    """The ``checkpoint.every`` a launched job on CPU nodes gets when the config has none (0).

    ``max(1, min(steps // 20, 100))``: a killed job repeats at most 5% of its steps, and at most 100
    steps of a long run; with ``durable_every`` set, a value that divides it (:func:`_divisor_of`).
    """
    return _divisor_of(max(1, min(steps // 20, LAUNCH_CHECKPOINT_EVERY_MAX)), durable_every)


def runs_on_gpus(config: Config, shape: JobShape) -> bool:
    """Whether the job's ranks train on GPUs: ``train.device: cuda``, or ``auto`` with GPUs requested
    or named (``--device``: a partition may give GPUs without ``--gpus-per-node``)."""
    device = config.train.device
    return device == "cuda" or (
        device == "auto" and (shape.gpus_per_node > 0 or shape.device is not None)
    )


def _check_shape(shape: JobShape) -> None:
    """The interval's flags, checked whether or not the job runs on GPUs (a typo is never ignored)."""
    from dtlab.analysis.devices import PROFILES

    if shape.device is not None and shape.device not in PROFILES:
        raise ConfigError(f"--device {shape.device!r} is not known; allowed: {', '.join(PROFILES)}")
    gbps = shape.save_gbps
    if gbps is not None and not 0 < gbps < float("inf"):
        raise ConfigError(
            f"--save-bandwidth-gbps {gbps}: allowed: a finite number > 0 (GB/s each node writes)"
        )


def _save_interval(config: Config, shape: JobShape) -> tuple[int, str, str | None]:
    """(the interval, its reasoning, why it is the whole run when the chosen interval is) for a GPU
    job: :mod:`dtlab.analysis.save_interval`."""
    from dtlab.analysis.devices import PROFILES
    from dtlab.analysis.plan import DEFAULT_DEVICE
    from dtlab.analysis.save_interval import (
        ASSUMED_SAVE_GBPS,
        describe,
        last_step_reason,
        predict_interval,
    )

    key = shape.device or DEFAULT_DEVICE
    gbps = shape.save_gbps
    profile = PROFILES[key]
    choice = predict_interval(
        config, shape.nodes, shape.nproc_per_node, profile, gbps or ASSUMED_SAVE_GBPS
    )
    device = f"{key}, " + ("given: --device" if shape.device else "assumed: pass --device KEY")
    per_node = gbps or ASSUMED_SAVE_GBPS
    bandwidth = f"{per_node:.3g} GB/s per node x {shape.nodes} node(s), " + (
        "given: --save-bandwidth-gbps"
        if gbps
        else "assumed: a parallel filesystem; pass --save-bandwidth-gbps"
    )
    reason = last_step_reason(choice) if choice.every >= choice.steps else None
    if config.checkpoint.every:
        return (
            config.checkpoint.every,
            describe(choice, device, bandwidth, every=config.checkpoint.every),
            reason,
        )
    durable = config.checkpoint.durable_every
    every = _divisor_of(choice.every, durable)
    if every == choice.every:
        return every, describe(choice, device, bandwidth), reason
    why = (
        f"checkpoint.durable_every = {durable} must be a multiple of it (without that, "
        f"{every_steps(choice.every)})"
    )
    return every, describe(choice, device, bandwidth, every=every, why=why), reason


def every_steps(n: int) -> str:
    """The words for an interval of ``n`` steps: "every step" or "every N steps" (a copy of
    :func:`dtlab.analysis.save_interval.every_steps`: that module imports torch, and CPU jobs
    need none of it)."""
    return "every step" if n == 1 else f"every {n} steps"


def _default_every_note(every: int, steps: int, reason: str | None) -> str:
    """The first line of what the launch says about the interval it chose for ``checkpoint.every: 0``.

    An interval of the whole run or more is its last step only: then no periodic save exists for a
    requeued job to resume from, and the line says what a requeue does resume from (``reason``: why
    periodic saves are not worth it, when the rule knows)."""
    choose = "set --set checkpoint.every=N to choose"
    if every < steps:
        return (
            f"checkpoint.every is 0: the job saves {every_steps(every)} so that a requeued job "
            f"resumes; {choose}, or pass --no-checkpoint to keep them off"
        )
    why = f", as periodic saves are not worth it for this run: {reason}" if reason else ""
    return (
        f"checkpoint.every is 0: the job saves at its last step only (step {steps}){why}; a job "
        "requeued after a stop signal (SIGUSR1 or SIGTERM, as on preemption) resumes from the "
        "checkpoint the signal saves, one killed without warning starts over from step 0; "
        f"{choose}"
    )


def launch_checkpointing(
    config: Config, no_checkpoint: bool = False, shape: JobShape | None = None
) -> tuple[Config, str | None]:
    """The config a launched job runs, as far as checkpoints go, and what to tell the user about it.

    ``checkpoint.every: 0`` (the default) becomes an interval chosen so that a requeued or restarted
    job resumes near where it stopped instead of from step 0. On GPUs it comes from the predicted save
    and step times (:mod:`dtlab.analysis.save_interval`), and the note shows them; on CPU nodes, whose
    step time is not predicted, it is :func:`launch_checkpoint_every`. A non-zero value is kept (on
    GPUs the note shows what it costs). ``no_checkpoint`` (``--no-checkpoint``) keeps or sets 0: no
    periodic checkpoints (a stop by a signal still saves one).
    """
    c = config.checkpoint
    shape = shape or JobShape()
    _check_shape(shape)
    if no_checkpoint:
        if c.every == 0:
            return config, None
        every = 0
        note = (
            f"checkpoint.every is {c.every}: --no-checkpoint sets it to 0, so the job saves no periodic "
            "checkpoints (a stop by a signal still saves one); a job killed without one restarts from step 0"
        )
    elif not runs_on_gpus(config, shape):
        if c.every:
            return config, None
        every = launch_checkpoint_every(config.train.steps, c.durable_every)
        one = "the run has one step" if config.train.steps == 1 else None
        note = _default_every_note(every, config.train.steps, one)
        if every < config.train.steps:
            note += (
                " (1/20 of the run, at most 100 steps: the step time of CPU nodes is not predicted)"
            )
    else:
        every, why, reason = _save_interval(config, shape)
        if c.every:
            return config, f"checkpoint.every is {c.every}, as given (the config or --set):\n{why}"
        note = _default_every_note(every, config.train.steps, reason) + "\n" + why
    data = config.to_dict()
    data["checkpoint"]["every"] = every
    return config_from_dict(data), note


def _check(value: str | None, pattern: re.Pattern[str], what: str, allowed: str) -> None:
    if value is not None and not pattern.match(value):
        raise ConfigError(f"{what}: {value!r} is not valid; allowed: {allowed}")


def slug(name: str, limit: int = 63) -> str:
    """``name`` as a Slurm job / Kubernetes object name: lowercase letters, digits and '-'."""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:limit].strip("-")
    return s or "dtlab"


def companion_paths(out: Path) -> tuple[Path, Path]:
    """(job file, resolved config beside it): ``job.sbatch`` -> ``job.config.yaml``."""
    out = out.resolve()
    return out, out.with_name(out.stem + ".config.yaml")


def slurm_config(config: Config, run_root: Path) -> Config:
    """The config the job runs: a fixed, absolute run directory (requeued jobs resume from it)."""
    resolved = config.model_copy(deep=True)
    if resolved.run.dir is None:
        resolved.run.dir = str((run_root / slug(config.run.name)).resolve())
    else:
        resolved.run.dir = str(Path(resolved.run.dir).expanduser().resolve())
    return resolved


@dataclass(frozen=True)
class FaultTolerantLayout:
    """How a fault-tolerant job's ranks form replica groups: ``replicas`` groups of ``group`` ranks,
    ``per_node`` groups on each node, each group trained in ``<run_dir>/replica-<i>``; a lighthouse
    is started for the job unless ``lighthouse`` (parallel.fault_tolerance.lighthouse) names one."""

    replicas: int
    group: int
    per_node: int
    max_restarts: int
    run_dir: str
    lighthouse: str | None = None


def replica_layout(config: Config, nodes: int, nproc_per_node: int) -> tuple[int, int]:
    """(replica groups, ranks per group) of a launched fault-tolerant job: the groups that
    ``dtlab train`` would make of the whole world, each of which must fit on one node."""
    from dtlab.parallel.ft import replica_groups

    replicas, group = replica_groups(config, nodes * nproc_per_node)
    if nproc_per_node % group:
        raise ConfigError(
            f"parallel.fault_tolerance with --nodes {nodes} --nproc-per-node {nproc_per_node}: a "
            f"replica group has {group} ranks, which must fit on one node (one agent restarts a "
            f"group); allowed: parallel.replicate = a multiple of --nodes ({nodes}) dividing the "
            f"{nodes * nproc_per_node} ranks"
        )
    return replicas, group


def fault_tolerant_layout(config: Config, job: SlurmJob) -> FaultTolerantLayout | None:
    """The replica groups of a job with parallel.fault_tolerance (None without): the groups that
    ``dtlab train`` would make of the whole world (DDP: one per rank; HSDP: parallel.replicate),
    which must not span nodes (a group's ranks share one elastic agent)."""
    o = config.parallel.fault_tolerance
    if not o.enabled:
        return None
    replicas, group = replica_layout(config, job.nodes, job.nproc_per_node)
    assert config.run.dir is not None  # resolved by slurm_config
    return FaultTolerantLayout(
        replicas, group, job.nproc_per_node // group, o.max_restarts, config.run.dir, o.lighthouse
    )


def _fault_tolerant_body(ft: FaultTolerantLayout, port: str) -> list[str]:
    """The sbatch script's lines that start the lighthouse (once, in the batch step: the first node)
    and one srun task per replica group, each under its own agent that restarts that group alone."""
    q = shlex.quote
    lines = [
        f"RUN_DIR={q(ft.run_dir)}",
        f"REPLICAS={ft.replicas}",
        f"GROUP_RANKS={ft.group}",
        f"MAX_RESTARTS={ft.max_restarts}",
        'FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"LIGHTHOUSE_PORT={port}",
        "STORE_PORT=$((LIGHTHOUSE_PORT + 1))  # where the groups meet on their first start",
        'export DTLAB_FT_REPLICAS="$REPLICAS" DTLAB_FT_START_STORE="$FIRST_NODE:$STORE_PORT"',
        'export RUST_LOG="${RUST_LOG:-warn}"  # torchft logs every quorum tick at INFO',
        'mkdir -p "$RUN_DIR" && rm -f "$RUN_DIR"/replica-*.exit',
    ]
    if ft.lighthouse is None:
        lines += [
            'export TORCHFT_LIGHTHOUSE="http://$FIRST_NODE:$LIGHTHOUSE_PORT"',
            "# One lighthouse for the job, here in the batch step (on the first node), listening on",
            "# every address of this node: the replica groups on the other nodes reach it there.",
            '"$PYTHON" -m dtlab.fault_tolerance --lighthouse "0.0.0.0:$LIGHTHOUSE_PORT" \\',
            '    --store-port "$STORE_PORT" --config "$CONFIG" &',
            "LIGHTHOUSE_PID=$!",
            "trap 'kill \"$LIGHTHOUSE_PID\" 2>/dev/null' EXIT",
            "for _ in $(seq 600); do  # up to 60 s for it to listen",
            '    (exec 3<>"/dev/tcp/$FIRST_NODE/$LIGHTHOUSE_PORT") 2>/dev/null && break',
            '    kill -0 "$LIGHTHOUSE_PID" 2>/dev/null || { echo "dtlab: the lighthouse did not start"; exit 1; }',
            "    sleep 0.1",
            "done",
        ]
    else:
        lines.append(
            f"export TORCHFT_LIGHTHOUSE={q(ft.lighthouse)}  # parallel.fault_tolerance.lighthouse"
        )
    lines += [
        'echo "dtlab: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $REPLICAS replica group(s) of'
        ' $GROUP_RANKS rank(s), lighthouse $TORCHFT_LIGHTHOUSE"',
        "",
        "# One task per replica group (SLURM_PROCID is the group), each under its own elastic agent that",
        "# restarts that group alone, up to MAX_RESTARTS times; --kill-on-bad-exit=0: a group that fails",
        "# for good does not end the others. Each task records its exit code; the signal before the time",
        "# limit (USR1) is passed on to the agent, which passes it to its ranks.",
        "srun --kill-on-bad-exit=0 --ntasks-per-node=" + str(ft.per_node) + " bash -c \\",
        '    \'i=$SLURM_PROCID; export DTLAB_FT_REPLICA=$i DTLAB_FT_HOST="${DTLAB_FT_HOST:-$(hostname)}"',
        '     export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / $2 > 0 ? $(nproc) / $2 : 1 ))}"',
        '     "$0" -m dtlab.fault_tolerance --nproc "$2" --max-restarts "$3" --run-dir "$4/replica-$i" \\',
        '         -- train "$1" --set "run.dir=$4/replica-$i" & pid=$!',
        '     trap "kill -USR1 $pid 2>/dev/null" USR1; trap "kill -TERM $pid 2>/dev/null" TERM',
        '     wait "$pid"; rc=$?; while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done',
        '     echo "$rc" > "$4/replica-$i.exit"; exit "$rc"\' \\',
        '    "$PYTHON" "$CONFIG" "$GROUP_RANKS" "$MAX_RESTARTS" "$RUN_DIR"',
        "# The job finished the run when a group did; 75 (requeue) when every group saved and stopped.",
        "finished=0; saved=1",
        "for ((i = 0; i < REPLICAS; i++)); do",
        '    code=$(cat "$RUN_DIR/replica-$i.exit" 2>/dev/null || echo 1)',
        '    echo "dtlab: replica group $i exited with $code"',
        "    [[ $code == 0 ]] && finished=1",
        f"    [[ $code == {Preempted.exit_code} ]] || saved=0",
        "done",
        f"if [[ $finished == 1 ]]; then rc=0; elif [[ $saved == 1 ]]; then rc={Preempted.exit_code}; else rc=1; fi",
    ]
    return lines


def slurm_script(
    script_path: Path,
    config_path: Path,
    job: SlurmJob,
    name: str,
    ft: FaultTolerantLayout | None = None,
) -> str:
    """An sbatch script: one task per node, each starting dtlab's launcher with a c10d rendezvous on
    the first node; preemption (``--signal``) saves a checkpoint and requeues the job, which resumes.
    With ``ft`` (parallel.fault_tolerance): a lighthouse for the job and one task per replica group."""
    _check(job.partition, _SLURM_WORD, "--partition", "a Slurm partition name")
    _check(job.account, _SLURM_WORD, "--account", "a Slurm account name")
    _check(
        job.time,
        _SLURM_TIME,
        "--time",
        "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS",
    )
    if job.signal_seconds < 1 or job.signal_seconds > 65535:
        raise ConfigError(
            f"--signal-seconds: {job.signal_seconds} is not valid; allowed: 1 to 65535"
        )
    directives = [
        f"--job-name={slug(name)}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={ft.per_node if ft else 1}",
        f"--output={script_path.parent / (slug(name) + '-%j.out')}",
        "--open-mode=append",
        "--requeue",
        # SIGUSR1 to every task (our launchers) this many seconds before the time limit: they pass it to
        # the workers, which save a checkpoint and exit with Preempted.exit_code.
        f"--signal=USR1@{job.signal_seconds}",
    ]
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_task:
        directives.append(f"--cpus-per-task={job.cpus_per_task}")
    for flag, value in (
        ("--partition", job.partition),
        ("--time", job.time),
        ("--account", job.account),
    ):
        if value:
            directives.append(f"{flag}={value}")
    for d in directives:
        # sbatch reads a directive up to the end of the line, and the shell never sees it.
        if any(ch.isspace() for ch in d):
            raise ConfigError(
                f"Slurm directive {d!r} contains whitespace; use a path without spaces"
            )
    port = (
        str(job.port)
        if job.port
        else "$((20000 + SLURM_JOB_ID % 20000))  # one per job: jobs may share a first node"
    )
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# Written by `dtlab launch slurm` (dtlab {__version__}). Submit: sbatch {q(str(script_path))}",
        *(f"#SBATCH {d}" for d in directives),
        "set -uo pipefail",
        "",
        f"PYTHON={q(job.python)}",
        f"CONFIG={q(str(config_path))}",
    ]
    if ft is not None:
        lines += _fault_tolerant_body(ft, port)
    else:
        lines += [
            f"NPROC_PER_NODE={job.nproc_per_node}",
            'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"MASTER_PORT={port}",
            'echo "dtlab: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES node(s),'
            ' rendezvous $MASTER_ADDR:$MASTER_PORT"',
            "",
            "# One task per node starts dtlab's launcher, which starts NPROC_PER_NODE workers. The node rank is",
            "# read inside each task; every other value is passed as an argument, never spliced into code.",
            "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c \\",
            '    \'exec "$0" -m dtlab train "$1" --nproc "$2" --nnodes "$SLURM_JOB_NUM_NODES" \\',
            '         --node-rank "$SLURM_NODEID" --master-addr "$3" --master-port "$4"\' \\',
            '    "$PYTHON" "$CONFIG" "$NPROC_PER_NODE" "$MASTER_ADDR" "$MASTER_PORT"',
            "rc=$?",
        ]
    lines += [
        f"if [[ $rc -eq {Preempted.exit_code} ]]; then",
        '    echo "dtlab: checkpoint saved before the time limit or preemption; requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        "exit $rc",
        "",
    ]
    return "\n".join(lines)


def _cannot_write(out: Path, e: OSError | ValueError) -> ConfigError:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return ConfigError(f"--out {show(str(out))}: cannot write the job file there: {reason}")


def write_slurm(config: Config, job: SlurmJob, out: Path) -> tuple[Path, Path]:
    """Write the sbatch script and its resolved config; returns their paths."""
    try:
        script_path, config_path = companion_paths(out)
    except (OSError, ValueError) as e:  # a NUL in the path, a loop of links
        raise _cannot_write(out, e) from None
    resolved = slurm_config(config, script_path.parent / "runs")
    ft = fault_tolerant_layout(resolved, job)
    text = slurm_script(script_path, config_path, job, config.run.name, ft)
    try:
        script_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(resolved.to_yaml())
        script_path.write_text(text)
        script_path.chmod(0o755)
    except OSError as e:
        raise _cannot_write(out, e) from None
    return script_path, config_path


def submit(script: Path) -> str:
    """``sbatch`` the script; returns the job id."""
    try:
        res = subprocess.run(
            ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        raise ConfigError(
            "--submit: sbatch not found; run this on a Slurm login node, or submit the script there"
        ) from None
    if res.returncode != 0:
        raise ConfigError(f"sbatch failed (exit {res.returncode}): {res.stderr.strip()}")
    return res.stdout.strip().split(";")[0]


CONFIG_MOUNT = "/etc/dtlab"
RUNS_MOUNT = "/runs"

# What the Kubeflow training operator (kubeflow.org/v1 PyTorchJob) expects; see docs/deploy.md.
K8S_CONTAINER = (
    "pytorch"  # the operator reads ports from, and sets PET_* variables in, this container
)
K8S_PORT_NAME = "pytorchjob-port"  # the port it takes the rendezvous port from
K8S_PORT = 23456  # the operator's default for that port
K8S_LABEL_MAX = 63  # a Service name (one per pod: <name>-worker-<index>) is a DNS-1035 label
_K8S_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _worker_suffix(nodes: int) -> str:
    return f"-worker-{nodes - 1}"


def k8s_job_name(run_name: str, nodes: int) -> str:
    """A PyTorchJob name from ``run.name``: a DNS-1035 label (it starts with a letter) short enough
    that the operator's pod and Service names, ``<name>-worker-<index>``, stay valid labels."""
    base = slug(run_name, K8S_LABEL_MAX)
    if not base[0].isalpha():
        base = f"dtlab-{base}"
    limit = K8S_LABEL_MAX - len(_worker_suffix(nodes))
    return base[:limit].rstrip("-")


def k8s_manifest(config: Config, job: K8sJob, name: str) -> str:
    """A ConfigMap with the resolved config, a PersistentVolumeClaim for the run directory (unless
    ``job.pvc`` names an existing one) and a Kubeflow ``PyTorchJob`` whose containers run dtlab.

    The job has ``job.nodes`` Worker replicas and no Master, for every node count. With an
    ``elasticPolicy`` the operator only admits jobs with a Worker replica, and it points every pod's
    rendezvous (``PET_RDZV_ENDPOINT``) at ``<name>-worker-0`` on the Worker's ``pytorchjob-port``;
    torchrun's c10d rendezvous then numbers the nodes, so no replica needs to be special.
    """
    _check(
        name,
        _K8S_DNS1035,
        "--name",
        "lowercase letters, digits and '-', starting with a letter (a DNS-1035 label)",
    )
    limit = K8S_LABEL_MAX - len(_worker_suffix(job.nodes))
    if len(name) > limit:
        raise ConfigError(
            f"--name: {name!r} is {len(name)} characters; allowed: at most {limit} with --nodes "
            f"{job.nodes} (pods and their Services are named {name[:8]}...{_worker_suffix(job.nodes)}, "
            f"at most {K8S_LABEL_MAX} characters)"
        )
    _check(job.namespace, _K8S_NAME, "--namespace", "lowercase letters, digits and '-'")
    _check(job.pvc, _K8S_NAME, "--pvc", "lowercase letters, digits and '-'")
    for flag, value in (("--cpu", job.cpu), ("--memory", job.memory), ("--storage", job.storage)):
        _check(value, _K8S_QUANTITY, flag, "a Kubernetes quantity such as 4, 500m, 16Gi")
    if not job.image or any(ch.isspace() for ch in job.image):
        raise ConfigError(f"--image: {job.image!r} is not valid; allowed: an image reference")

    resolved = config.model_copy(deep=True)
    resolved.run.dir = f"{RUNS_MOUNT}/{name}"
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/managed-by": "dtlab"}}
    if job.namespace:
        meta["namespace"] = job.namespace

    def named(suffix: str) -> dict[str, Any]:
        return {**meta, "name": f"{name}-{suffix}"}

    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": named("config"),
            "data": {"config.yaml": resolved.to_yaml()},
        }
    ]
    claim = job.pvc or f"{name}-runs"
    if job.pvc is None:
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": named("runs"),
                "spec": {
                    # Every node writes its checkpoint shards to the same run directory.
                    "accessModes": ["ReadWriteMany" if job.nodes > 1 else "ReadWriteOnce"],
                    "resources": {"requests": {"storage": job.storage}},
                },
            }
        )
    resources: dict[str, Any] = {}
    if job.gpus_per_node:
        resources["limits"] = {"nvidia.com/gpu": job.gpus_per_node}
    requests = {k: v for k, v in (("cpu", job.cpu), ("memory", job.memory)) if v}
    if requests:
        resources["requests"] = requests
    container: dict[str, Any] = {
        "name": K8S_CONTAINER,
        "image": job.image,
        "imagePullPolicy": "IfNotPresent",
        # torchrun takes the node count, processes per node, rendezvous backend and endpoint and the
        # restart budget from the PET_* variables the operator derives from elasticPolicy and
        # nprocPerNode; a flag here would override them, so there is none. dtlab runs as its worker.
        "command": [
            "python",
            "-m",
            "torch.distributed.run",
            "--module",
            "dtlab",
            "train",
            f"{CONFIG_MOUNT}/config.yaml",
        ],
        # Declared, not left to the operator's defaulting: worker 0 serves the rendezvous on it.
        "ports": [{"name": K8S_PORT_NAME, "containerPort": K8S_PORT}],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": resources,
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "runs", "mountPath": RUNS_MOUNT},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    pod = {
        "spec": {
            # On eviction the kubelet sends SIGTERM: the workers save a checkpoint before they exit,
            # and the restarted pod resumes from it. Give them time to write it.
            "terminationGracePeriodSeconds": job.grace_seconds,
            "containers": [container],
            "volumes": [
                {"name": "config", "configMap": {"name": f"{name}-config"}},
                {"name": "runs", "persistentVolumeClaim": {"claimName": claim}},
                {"name": "shm", "emptyDir": {"medium": "Memory"}},
            ],
        }
    }
    if config.parallel.fault_tolerance.enabled:
        docs += _k8s_fault_tolerant(config, job, name, meta, container, pod)
    else:
        docs.append(_pytorchjob(job, meta, pod))
    header = f"# Written by `dtlab launch k8s` (dtlab {__version__}). Apply: kubectl apply -f <this file>\n"
    return header + yaml.safe_dump_all(docs, sort_keys=False)


LIGHTHOUSE_PORT = 29510  # the k8s lighthouse Service's port; the start store is on the next one


def _k8s_fault_tolerant(
    config: Config,
    job: K8sJob,
    name: str,
    meta: dict[str, Any],
    container: dict[str, Any],
    pod: dict[str, Any],
) -> list[dict[str, Any]]:
    """A fault-tolerant job's objects: the lighthouse (a Deployment and its Service, so that it is
    restarted on its own and no replica group is special) and one batch Job per replica group, whose
    pod runs the group's own agent (rank restarts) and which Kubernetes recreates alone when the
    pod is lost (``backoffLimit``); both bounded by parallel.fault_tolerance.max_restarts."""
    o = config.parallel.fault_tolerance
    replicas, group = replica_layout(config, job.nodes, job.nproc_per_node)
    labels = {**meta.get("labels", {}), "dtlab.io/job": name}
    lh_name = f"{name}-lighthouse"
    lighthouse = o.lighthouse or f"http://{lh_name}:{LIGHTHOUSE_PORT}"
    docs: list[dict[str, Any]] = []
    if o.lighthouse is None:
        lh_labels = {**labels, "dtlab.io/role": "lighthouse"}
        lh_container = {
            **container,
            "name": "lighthouse",
            # Every interface of its pod: the groups' pods reach it through the Service.
            "command": [
                "python",
                "-m",
                "dtlab.fault_tolerance",
                "--lighthouse",
                f"0.0.0.0:{LIGHTHOUSE_PORT}",
                "--store-port",
                str(LIGHTHOUSE_PORT + 1),
                "--config",
                f"{CONFIG_MOUNT}/config.yaml",
            ],
            "ports": [
                {"name": "lighthouse", "containerPort": LIGHTHOUSE_PORT},
                {"name": "start-store", "containerPort": LIGHTHOUSE_PORT + 1},
            ],
            "resources": {},
            "volumeMounts": [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}],
        }
        docs += [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {**meta, "name": lh_name, "labels": lh_labels},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": lh_labels},
                    "template": {
                        "metadata": {"labels": lh_labels},
                        "spec": {
                            "containers": [lh_container],
                            "volumes": [
                                {"name": "config", "configMap": {"name": f"{name}-config"}}
                            ],
                        },
                    },
                },
            },
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {**meta, "name": lh_name, "labels": lh_labels},
                "spec": {
                    "selector": lh_labels,
                    "ports": [
                        {"name": "lighthouse", "port": LIGHTHOUSE_PORT},
                        {"name": "start-store", "port": LIGHTHOUSE_PORT + 1},
                    ],
                },
            },
        ]
    resources = dict(container["resources"])
    if job.gpus_per_node:
        resources["limits"] = {"nvidia.com/gpu": job.gpus_per_node * group // job.nproc_per_node}
    for i in range(replicas):
        run_dir = f"{RUNS_MOUNT}/{name}/replica-{i}"
        env = [
            *container["env"],
            {"name": "DTLAB_FT_REPLICA", "value": str(i)},
            {"name": "DTLAB_FT_REPLICAS", "value": str(replicas)},
            {"name": "TORCHFT_LIGHTHOUSE", "value": lighthouse},
            {"name": "RUST_LOG", "value": "warn"},
            # The pod's own IP: where the other groups reach this group's manager.
            {"name": "DTLAB_FT_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ]
        if o.lighthouse is None:
            env.append(
                {"name": "DTLAB_FT_START_STORE", "value": f"{lh_name}:{LIGHTHOUSE_PORT + 1}"}
            )
        group_container = {
            **container,
            "command": [
                "python",
                "-m",
                "dtlab.fault_tolerance",
                "--nproc",
                str(group),
                "--max-restarts",
                str(o.max_restarts),
                "--run-dir",
                run_dir,
                "--",
                "train",
                f"{CONFIG_MOUNT}/config.yaml",
                "--set",
                f"run.dir={run_dir}",
            ],
            "ports": [],
            "env": env,
            "resources": resources,
        }
        group_labels = {**labels, "dtlab.io/role": "replica-group", "dtlab.io/replica": str(i)}
        docs.append(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {**meta, "name": f"{name}-replica-{i}", "labels": group_labels},
                "spec": {
                    # The agent in the pod restarts the group's ranks; a lost pod (node failure,
                    # eviction) is recreated by the Job, this group alone.
                    "backoffLimit": o.max_restarts,
                    "template": {
                        "metadata": {"labels": group_labels},
                        "spec": {
                            **pod["spec"],
                            "restartPolicy": "Never",
                            "containers": [group_container],
                        },
                    },
                },
            }
        )
    return docs


def _pytorchjob(job: K8sJob, meta: dict[str, Any], pod: dict[str, Any]) -> dict[str, Any]:
    """The Kubeflow PyTorchJob of a job without fault tolerance: ``job.nodes`` Worker replicas."""
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": meta,
        "spec": {
            # A number, never the default "auto": torchrun reads auto as one process per GPU, or
            # per CPU core on a CPU node, and the config was checked for nodes x nproc ranks.
            "nprocPerNode": str(job.nproc_per_node),
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                # min = max = the Worker replicas: the rendezvous waits for every node, and the
                # world size is the one the config was checked for.
                "minReplicas": job.nodes,
                "maxReplicas": job.nodes,
                "maxRestarts": job.max_restarts,
            },
            "runPolicy": {"cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": job.nodes,
                    "restartPolicy": "OnFailure",
                    "template": pod,
                }
            },
        },
    }


def write_k8s(config: Config, job: K8sJob, out: Path, name: str | None = None) -> Path:
    """Write the manifest; returns its path."""
    text = k8s_manifest(config, job, name or k8s_job_name(config.run.name, job.nodes))
    try:
        path = out.resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except (OSError, ValueError) as e:
        raise _cannot_write(out, e) from None
    return path
