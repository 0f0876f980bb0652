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
from dataclasses import dataclass, field
from pathlib import Path

from dtlab import __version__
from dtlab.config import Config, config_from_dict, show
from dtlab.deploy_site import SiteSettings, python_lines, site_directives, site_setup, task_wrapper
from dtlab.errors import ConfigError, Preempted

_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:@+=/-]+$")
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


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
    port: int | None = None
    # The cluster's settings (site file and command line): qos, exclusive nodes, modules, container,
    # variables, the job's Python and the run directories' root.
    settings: SiteSettings = field(default_factory=SiteSettings)
    # The Python that wrote the script: used, with a message, only when the job finds none with dtlab.
    fallback_python: str | None = None


@dataclass(frozen=True)
class K8sJob:
    """What ``dtlab launch k8s`` puts in the manifest (a PyTorchJob, or a Trainer v2 TrainJob)."""

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
    # pytorchjob (kubeflow.org/v1) or trainjob (trainer.kubeflow.org/v1alpha1, Kubeflow Trainer v2).
    api: str = "pytorchjob"
    # A TrainJob's ClusterTrainingRuntime to patch (None: the manifest holds a TrainingRuntime of its own).
    runtime: str | None = None
    # "key=value" node labels the pods must have.
    node_selector: tuple[str, ...] = ()
    # "key[=value][:effect]" taints the pods tolerate.
    tolerations: tuple[str, ...] = ()
    # "name=quantity" extended resources each pod asks for (RDMA devices, ...), beside the GPUs.
    resources: tuple[str, ...] = ()
    # "claim:/mount[:ro]" PersistentVolumeClaims mounted in every pod (data, weights, ...).
    volumes: tuple[str, ...] = ()


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
    # Whose words the notes use: a Slurm job is requeued; a Kubernetes job's pods are restarted.
    scheduler: str = "slurm"


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


def _default_every_note(
    every: int, steps: int, reason: str | None, scheduler: str = "slurm"
) -> str:
    """The first line of what the launch says about the interval it chose for ``checkpoint.every: 0``.

    An interval of the whole run or more is its last step only: then no periodic save exists for a
    restarted job to resume from, and the line says what a restart does resume from (``reason``: why
    periodic saves are not worth it, when the rule knows). ``scheduler`` picks the words: Slurm
    requeues a job (after SIGUSR1 or SIGTERM); Kubernetes restarts its pods (after SIGTERM)."""
    choose = "set --set checkpoint.every=N to choose"
    restarted, signals = (
        ("requeued", "SIGUSR1 or SIGTERM, as on preemption")
        if scheduler == "slurm"
        else ("restarted", "SIGTERM, as on eviction or preemption")
    )
    if every < steps:
        return (
            f"checkpoint.every is 0: the job saves {every_steps(every)} so that a {restarted} job "
            f"resumes; {choose}, or pass --no-checkpoint to keep them off"
        )
    why = f", as periodic saves are not worth it for this run: {reason}" if reason else ""
    return (
        f"checkpoint.every is 0: the job saves at its last step only (step {steps}){why}; a job "
        f"{restarted} after a stop signal ({signals}) resumes from the "
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
        note = _default_every_note(every, config.train.steps, one, shape.scheduler)
        if every < config.train.steps:
            note += (
                " (1/20 of the run, at most 100 steps: the step time of CPU nodes is not predicted)"
            )
    else:
        every, why, reason = _save_interval(config, shape)
        if c.every:
            return config, f"checkpoint.every is {c.every}, as given (the config or --set):\n{why}"
        note = _default_every_note(every, config.train.steps, reason, shape.scheduler) + "\n" + why
    data = config.to_dict()
    data["checkpoint"]["every"] = every
    return config_from_dict(data), note


def check_value(value: str | None, pattern: re.Pattern[str], what: str, allowed: str) -> None:
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
    gpus: int = 0  # GPUs per node (--gpus-per-node); 0: the job requests none


def replica_layout(config: Config, nodes: int, nproc_per_node: int) -> tuple[int, int]:
    """(replica groups, ranks per group) of a launched fault-tolerant job: the groups that
    ``dtlab train`` would make of the whole world, each of which must fit on one node."""
    from dtlab.parallel.ft import replica_groups

    replicas, group = replica_groups(config, nodes * nproc_per_node)
    if nproc_per_node % group:
        allowed = (
            f"parallel.replicate = a multiple of --nodes ({nodes}) dividing the "
            f"{nodes * nproc_per_node} ranks"
            if config.parallel.tp == 1
            else f"parallel.tp dividing --nproc-per-node ({nproc_per_node})"
        )
        raise ConfigError(
            f"parallel.fault_tolerance with --nodes {nodes} --nproc-per-node {nproc_per_node}: a "
            f"replica group has {group} ranks, which must fit on one node (one agent restarts a "
            f"group); allowed: {allowed}"
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
        replicas, group, job.nproc_per_node // group, o.max_restarts, config.run.dir, o.lighthouse,
        job.gpus_per_node,
    )  # fmt: skip


def _ft_settings(ft: FaultTolerantLayout, port: str) -> list[str]:
    """The script's variables for the groups: their layout, the first node's ports, and a clean
    record of their exits."""
    q = shlex.quote
    return [
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


def _ft_lighthouse(ft: FaultTolerantLayout, srun_opts: str = "", wrapper: str = "") -> list[str]:
    """The lines that start the job's lighthouse and wait for it to listen, or name the given
    one. In a container (``srun_opts``/``wrapper`` from :func:`task_wrapper`) the lighthouse runs in
    the image too, as a one-task step on the first node that shares the job's resources
    (``--overlap``): the batch step itself runs outside the image, where dtlab may not be."""
    if ft.lighthouse is not None:
        return [
            f"export TORCHFT_LIGHTHOUSE={shlex.quote(ft.lighthouse)}  # parallel.fault_tolerance.lighthouse"
        ]
    listen = '--lighthouse "0.0.0.0:$LIGHTHOUSE_PORT" \\'
    if srun_opts or wrapper:
        start = [
            "# One lighthouse for the job, in the image: a one-task step on the first node, listening",
            "# on every address of that node: the replica groups on the other nodes reach it there.",
            'srun --overlap --nodes=1 --ntasks=1 --nodelist="$FIRST_NODE" --kill-on-bad-exit=0 '
            f'{srun_opts}{wrapper}"$PYTHON" -m dtlab.fault_tolerance {listen}',
        ]
    else:
        start = [
            "# One lighthouse for the job, here in the batch step (on the first node), listening on",
            "# every address of this node: the replica groups on the other nodes reach it there.",
            f'"$PYTHON" -m dtlab.fault_tolerance {listen}',
        ]
    return [
        'export TORCHFT_LIGHTHOUSE="http://$FIRST_NODE:$LIGHTHOUSE_PORT"',
        *start,
        '    --store-port "$STORE_PORT" --config "$CONFIG" &',
        "LIGHTHOUSE_PID=$!",
        "trap 'kill \"$LIGHTHOUSE_PID\" 2>/dev/null' EXIT",
        "for _ in $(seq 600); do  # up to 60 s for it to listen",
        '    (exec 3<>"/dev/tcp/$FIRST_NODE/$LIGHTHOUSE_PORT") 2>/dev/null && break',
        '    kill -0 "$LIGHTHOUSE_PID" 2>/dev/null || { echo "dtlab: the lighthouse did not start"; exit 1; }',
        "    sleep 0.1",
        "done",
    ]


def _ft_groups(ft: FaultTolerantLayout, srun_opts: str = "", wrapper: str = "") -> list[str]:
    """The srun of one task per replica group, each under its own agent (in the site's container,
    with ``srun_opts``/``wrapper``), and the job's exit code decided from the groups' recorded ones."""
    return [
        'echo "dtlab: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $REPLICAS replica group(s) of'
        ' $GROUP_RANKS rank(s), lighthouse $TORCHFT_LIGHTHOUSE"',
        "",
        "# One task per replica group (SLURM_PROCID is the group), each under its own elastic agent that",
        "# restarts that group alone, up to MAX_RESTARTS times; --kill-on-bad-exit=0: a group that fails",
        "# for good does not end the others. Each task records its exit code; the signal before the time",
        "# limit (USR1) is passed on to the agent, which passes it to its ranks.",
        f"srun --kill-on-bad-exit=0 --ntasks-per-node={ft.per_node} {srun_opts}{wrapper}bash -c \\",
        '    \'i=$SLURM_PROCID; export DTLAB_FT_REPLICA=$i DTLAB_FT_HOST="${DTLAB_FT_HOST:-$(hostname)}"',
        '     export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / $2 > 0 ? $(nproc) / $2 : 1 ))}"',
        *_ft_task_gpus(ft),
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


def _ft_task_gpus(ft: FaultTolerantLayout) -> list[str]:
    """In each group's task: its own slice of the node's GPUs (the task's local id times the
    group's ranks, taken from the GPUs Slurm made visible on the node, else 0 .. gpus-1), since every
    group numbers its local ranks from 0; nothing for a job without GPUs."""
    if not ft.gpus:
        return []
    return [
        f'     IFS=, read -ra gpus <<< "${{CUDA_VISIBLE_DEVICES:-$(seq -s, 0 {ft.gpus - 1})}}"',
        '     export CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${gpus[*]:$(( SLURM_LOCALID * $2 )):$2}")"',
    ]


def _fault_tolerant_body(
    ft: FaultTolerantLayout, port: str, settings: SiteSettings, mounts: list[str]
) -> list[str]:
    """The sbatch script's lines that start the lighthouse (once, on the first node) and one srun
    task per replica group, each under its own agent that restarts that group alone; in the site's
    container, if any, with ``mounts`` at their own paths."""
    srun_opts, wrapper = task_wrapper(settings, mounts, ft.gpus > 0)
    return [
        *_ft_settings(ft, port),
        *_ft_lighthouse(ft, srun_opts, wrapper),
        *_ft_groups(ft, srun_opts, wrapper),
    ]


def _check_slurm_job(job: SlurmJob) -> None:
    """Refuse a partition, account, time or signal lead that sbatch would not accept."""
    check_value(job.partition, _SLURM_WORD, "--partition", "a Slurm partition name")
    check_value(job.account, _SLURM_WORD, "--account", "a Slurm account name")
    check_value(job.settings.qos, _SLURM_WORD, "--qos", "a Slurm QoS name")
    check_value(
        job.time,
        _SLURM_TIME,
        "--time",
        "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS",
    )
    if job.signal_seconds < 1 or job.signal_seconds > 65535:
        raise ConfigError(
            f"--signal-seconds: {job.signal_seconds} is not valid; allowed: 1 to 65535"
        )


def _directives(
    script_path: Path, job: SlurmJob, name: str, ft: FaultTolerantLayout | None
) -> list[str]:
    """The script's ``#SBATCH`` options, each checked to hold no whitespace."""
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
    directives += site_directives(job.settings)
    for d in directives:
        # sbatch reads a directive up to the end of the line, and the shell never sees it.
        if any(ch.isspace() for ch in d):
            raise ConfigError(
                f"Slurm directive {d!r} contains whitespace; use a path without spaces"
            )
    return directives


def _rendezvous_port(job: SlurmJob) -> str:
    """The first node's port, as the script sets it: ``--port``, or one derived from the job id."""
    return (
        str(job.port)
        if job.port
        else "$((20000 + SLURM_JOB_ID % 20000))  # one per job: jobs may share a first node"
    )


def _nodes_body(job: SlurmJob, port: str, mounts: list[str]) -> list[str]:
    """The lines of a job without fault tolerance: one srun task per node, each starting dtlab's
    launcher with the rendezvous on the first node (in the site's container, if any, with ``mounts``
    at their own paths)."""
    srun_opts, wrapper = task_wrapper(job.settings, mounts, job.gpus_per_node > 0)
    return [
        f"NPROC_PER_NODE={job.nproc_per_node}",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT={port}",
        'echo "dtlab: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES node(s),'
        ' rendezvous $MASTER_ADDR:$MASTER_PORT"',
        "",
        "# One task per node starts dtlab's launcher, which starts NPROC_PER_NODE workers. The node rank is",
        "# read inside each task; every other value is passed as an argument, never spliced into code.",
        f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 {srun_opts}{wrapper}bash -c \\",
        '    \'exec "$0" -m dtlab train "$1" --nproc "$2" --nnodes "$SLURM_JOB_NUM_NODES" \\',
        '         --node-rank "$SLURM_NODEID" --master-addr "$3" --master-port "$4"\' \\',
        '    "$PYTHON" "$CONFIG" "$NPROC_PER_NODE" "$MASTER_ADDR" "$MASTER_PORT"',
        "rc=$?",
    ]


def _requeue_tail() -> list[str]:
    """The script's last lines: requeue the job when its workers saved and stopped; exit with
    rc."""
    return [
        f"if [[ $rc -eq {Preempted.exit_code} ]]; then",
        '    echo "dtlab: checkpoint saved before the time limit or preemption; requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        "exit $rc",
        "",
    ]


def slurm_script(
    script_path: Path,
    config_path: Path,
    job: SlurmJob,
    name: str,
    ft: FaultTolerantLayout | None = None,
    run_dir: str | None = None,
) -> str:
    """An sbatch script: one task per node, each starting dtlab's launcher with a c10d rendezvous on
    the first node; preemption (``--signal``) saves a checkpoint and requeues the job, which resumes.
    With ``ft`` (parallel.fault_tolerance): a lighthouse for the job and one task per replica group."""
    _check_slurm_job(job)
    directives = _directives(script_path, job, name, ft)
    port = _rendezvous_port(job)
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# Written by `dtlab launch slurm` (dtlab {__version__}). Submit: sbatch {q(str(script_path))}",
        *(f"#SBATCH {d}" for d in directives),
        *site_setup(job.settings),
        "set -uo pipefail",
        "",
        *python_lines(job.settings, job.fallback_python),
        f"CONFIG={q(str(config_path))}",
    ]
    mounts = [str(config_path.parent), *([run_dir] if run_dir else [])]
    if ft is not None:
        lines += _fault_tolerant_body(ft, port, job.settings, [str(config_path.parent), ft.run_dir])
    else:
        if job.settings.container is not None and run_dir:
            lines.append(f"mkdir -p {q(run_dir)}  # mounted into the container: it must exist")
        lines += _nodes_body(job, port, mounts)
    lines += _requeue_tail()
    return "\n".join(lines)


def cannot_write(out: Path, e: OSError | ValueError) -> ConfigError:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return ConfigError(f"--out {show(str(out))}: cannot write the job file there: {reason}")


def write_slurm(config: Config, job: SlurmJob, out: Path) -> tuple[Path, Path]:
    """Write the sbatch script and its resolved config; returns their paths."""
    try:
        script_path, config_path = companion_paths(out)
    except (OSError, ValueError) as e:  # a NUL in the path, a loop of links
        raise cannot_write(out, e) from None
    root = job.settings.run_root
    resolved = slurm_config(
        config, Path(root).expanduser() if root else script_path.parent / "runs"
    )
    ft = fault_tolerant_layout(resolved, job)
    text = slurm_script(script_path, config_path, job, config.run.name, ft, resolved.run.dir)
    try:
        script_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(resolved.to_yaml())
        script_path.write_text(text)
        script_path.chmod(0o755)
    except OSError as e:
        raise cannot_write(out, e) from None
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
