"""The ``dtlab`` command line's parser: every command, its flags and its help."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypeVar

from dtlab import __version__
from dtlab.cliargs import (
    SchemaChoices,
    add_config_args,
    non_negative_int,
    positive_int,
)

_Job = TypeVar("_Job")

if TYPE_CHECKING:
    # What add_subparsers returns (argparse does not export the name).
    _Commands = argparse._SubParsersAction[argparse.ArgumentParser]


TRAIN_EPILOG = """\
examples:
  dtlab train                                   # built-in default: tiny model, stdlib corpus, 1 process
  dtlab train configs/ddp.yaml --nproc 2        # DDP on 2 local processes
  dtlab train --nproc 2 --set parallel.strategy=fsdp train.lr=3e-4
  torchrun --nproc-per-node 2 -m dtlab train configs/fsdp.yaml   # under torchrun: runs as a worker

--set KEY=VALUE overrides one config key (repeatable; values are YAML: 1e-4 is a float,
true a bool, [a, b] a list). Precedence: --set > CONFIG > defaults. `dtlab config --keys` lists every key.
"""

VERIFY_EPILOG = """\
layouts (NAME:DEGREE joined by x; processes: the product of the degrees but ep's):
  single                  one process
  ddp:N  fsdp:N  hsdp:N   data parallel over N ranks (hsdp: two replica groups)
  zero:N                  DDP over N ranks with ZeRO-1 (parallel.sharding = optimizer)
  diloco:N[:H]            N DiLoCo replicas of one rank, syncing every H steps (default 1); the same
                          training as DDP with train.optimizer=sgd train.grad_clip=0
                          parallel.diloco.outer_lr=1 parallel.diloco.outer_momentum=0 and H = 1
  ft:N                    DDP over N fault-tolerant replica groups (torchft; with tp: each
                          group its TP ranks); each group's run compared
  tp:N   sp:N             tensor parallel over N ranks (sp: with sequence parallelism)
  pp:N[:SCHEDULE]         pipeline parallel over N ranks, e.g. pp:2:interleaved_1f1b
  ep:N                    expert parallel (MoE) over N of the data-parallel ranks (with cp, of the
                          data x cp ranks), which N must divide (fsdp:4xep:2: 4 processes); alone,
                          ddp:N with ep N (ep:2xcp:2: ddp 2 x cp 2, 4 processes)
  cp:N[:METHOD]           context parallel: each sequence split over N ranks, METHOD ring
                          (default) or alltoall (ddp:2xcp:2: 4 processes; alone, over DDP, also
                          with tp or pp: tp:2xcp:2 is ddp 1 x cp 2 x tp 2; inside DiLoCo
                          replicas and FT groups: diloco:2xcp:2, ft:2xcp:2)

checks (--checks, the loss always):
  resume                  each layout saves at the middle step; a run resumed from it on the same
                          layout, and on the first layout, must continue as the uninterrupted run
                          (with --engine mlx, also on the torch engine's first layout)
  export                  dtlab export --format hf of each layout's final checkpoint must give the
                          first layout's tensors

examples:
  dtlab verify configs/debug.yaml --layouts single,ddp:2,fsdp:2xtp:2,pp:2 --steps 10
  dtlab verify configs/debug.yaml --layouts single,ddp:2,zero:2,tp:2 --checks all
  dtlab verify --set model.preset=debug-moe --layouts single,ep:2,fsdp:4xep:2 --steps 10
  dtlab verify configs/debug.yaml --engine mlx --layouts single,ddp:2,tp:2 --checks all
"""

EXPORT_EPILOG = """\
formats:
  safetensors   DIR/model.safetensors with dtlab's parameter names, and DIR/config.yaml (the run's config)
  hf            a Hugging Face directory (config.json, model.safetensors) of the model's family
                (model.family: Llama, Qwen2, Qwen3, Mistral, Qwen2-MoE, Qwen3-MoE, ERNIE 4.5 MoE
                for a default bias-balanced mixture of experts, GLM-4.5 MoE for sigmoid scores)
                that transformers' AutoModelForCausalLM.from_pretrained(DIR) loads; what the
                family's class cannot compute (a trained bias where it has none) is refused

examples:
  dtlab export runs/dtlab-20250101-120000 --format hf --out exports/llama
  dtlab export runs/r1/checkpoints/step-00000200 --format safetensors --out exports/r1-200

A run directory exports its newest checkpoint that passes verification against its manifest (sizes and
CRC-32 checksums, manifest format 2; format 1's SHA-256 ones are verified too); newer ones that fail are
skipped with a warning. The export is written to a temporary directory next to DIR and renamed into place
at the end, so a failed export leaves nothing behind.
"""

GENERATE_EPILOG = """\
RUN_DIR_OR_CHECKPOINT_OR_EXPORT is one of:
  a run directory            its newest checkpoint that passes verification
  a checkpoint directory     RUN_DIR/checkpoints/step-NNNNNNNN (torch or MLX engine)
  a dtlab export             model.safetensors + config.yaml (dtlab export --format safetensors)
  a Hugging Face export      config.json + model.safetensors (dtlab export --format hf)

Only the generated text goes to stdout, token by token as it is produced; messages go to stderr.
The tokenizer is the tokenizer.json of the checkpoint, its run directory or the export; without one,
UTF-8 bytes (refused when the run's config names another tokenizer).

examples:
  dtlab generate runs/demo-20250101-120000 --prompt "def main(" --temperature 0
  dtlab generate exports/llama --prompt "import " --max-new-tokens 200 --top-p 0.9 --seed 1 > out.txt
"""


# Counts, ranks and steps on the command line fit 32 bits, as they do in torch's launcher; a product of
# two of them (the world size) then still fits the config's 64-bit integers.
# Kept here so that --help needs no torch import; dtlab.analysis.devices.PROFILES has the same keys.
DEVICE_KEYS = ("h100", "h200", "a100-80gb", "a100-40gb", "l4", "rtx4090")


def build_parser() -> argparse.ArgumentParser:
    """The ``dtlab`` parser: one small builder per command."""
    parser = argparse.ArgumentParser(
        prog="dtlab",
        description="Distributed Training Lab: train a Llama-style model on one process or many - data "
        "parallel (DDP, ZeRO-1, FSDP, HSDP), tensor and sequence parallel, pipeline parallel, and "
        "low-communication training (compressed gradients, DiLoCo, the DeMo optimizer) - and see what "
        "each costs (bench, plan) and that each trains the same (verify).",
    )
    parser.add_argument("--version", action="version", version=f"dtlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_train(sub)
    _add_config(sub)
    _add_bench(sub)
    _add_launch(sub)
    _add_plan(sub)
    _add_export(sub)
    _add_verify(sub)
    _add_generate(sub)
    return parser


def _add_train(sub: _Commands) -> None:
    t = sub.add_parser(
        "train",
        help="train a model",
        description="Train a model as configured.",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument(
        "--nproc",
        type=positive_int,
        default=1,
        help="processes on this node (default 1); >1 starts them through torch's elastic launcher",
    )
    t.add_argument("--nnodes", type=positive_int, default=1, help="number of nodes (default 1)")
    t.add_argument(
        "--engine",
        choices=SchemaChoices("train.engine"),
        metavar="ENGINE",  # argparse would list the choices, importing the config (and torch) for --help
        default=None,
        help="torch or mlx (same as --set train.engine=...; mlx ranks start through mlx.launch)",
    )
    t.add_argument(
        "--node-rank", type=non_negative_int, default=0, help="this node's rank (multi-node)"
    )
    t.add_argument(
        "--master-addr", default=None, help="rendezvous host (multi-node; default localhost)"
    )
    t.add_argument(
        "--master-port",
        type=positive_int,
        default=None,
        help="rendezvous port (multi-node; default 29500)",
    )
    t.add_argument(
        "--profile",
        action="store_true",
        help="record a torch.profiler trace of a few steps in <run dir>/profile (same as --set run.profile=true)",
    )
    t.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=0,
        help="restart the worker group up to K times after a failure",
    )
    add_config_args(t)


def _add_config(sub: _Commands) -> None:
    c = sub.add_parser(
        "config",
        help="print the resolved config, or every key",
        description="Print the resolved config as YAML (CONFIG, then --set), or with --keys every key with its default.",
    )
    add_config_args(c)
    c.add_argument(
        "--keys", action="store_true", help="list every key with its default and meaning"
    )


def _add_bench(sub: _Commands) -> None:
    # The comma-separated lists are checked against the config schema in cmd_bench.
    b = sub.add_parser(
        "bench",
        help="measure strategies side by side: throughput, MFU, memory, communication",
        description="Run each combination of --strategies, --nproc, --compression and --precision in its "
        "own processes (warm-up, then timed steps) and write DIR/results.json, results.csv, report.md and "
        "PNG plots. Measured figures sit next to dtlab's predictions.",
    )
    b.add_argument(
        "--strategies", default="single,ddp,fsdp", help="comma-separated (default single,ddp,fsdp)"
    )
    b.add_argument("--nproc", default="1,2", help="comma-separated process counts (default 1,2)")
    b.add_argument("--compression", default="none", help="comma-separated (default none)")
    b.add_argument(
        "--engine",
        default="torch",
        help="comma-separated engines (default torch); with mlx, each engine trains the same config "
        "and the report puts them side by side",
    )
    b.add_argument("--precision", default=None, help="comma-separated (default: the config's)")
    b.add_argument(
        "--steps", type=positive_int, default=10, help="timed steps per run (default 10)"
    )
    b.add_argument(
        "--warmup", type=non_negative_int, default=2, help="untimed steps first (default 2)"
    )
    b.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    b.add_argument(
        "--profile", action="store_true", help="record torch.profiler traces of 2 steps per run"
    )
    add_config_args(b)


def _add_launch(sub: _Commands) -> None:
    la = sub.add_parser(
        "launch",
        help="write (and submit) a Slurm or Kubernetes job that runs dtlab train",
        description="Write a job file for a scheduler, with the resolved config beside it (or inside it).",
    )
    lsub = la.add_subparsers(dest="scheduler", metavar="SCHEDULER")
    lsub.required = True
    _add_slurm(lsub)
    _add_k8s(lsub)


def _add_job_args(p: argparse.ArgumentParser) -> None:
    """What a Slurm script and a Kubernetes job both take: the world's shape, checkpoints, the config."""
    p.add_argument("--nodes", type=positive_int, default=1, help="number of nodes (default 1)")
    p.add_argument(
        "--nproc-per-node",
        type=positive_int,
        default=1,
        help="processes (GPUs) per node (default 1)",
    )
    p.add_argument(
        "--gpus-per-node", type=non_negative_int, default=0, help="GPUs to request per node"
    )
    p.add_argument(
        "--no-checkpoint",
        action="store_true",
        help="no periodic checkpoints (checkpoint.every = 0); without it, a config with "
        "checkpoint.every = 0 gets an interval so that a restarted job resumes: on GPUs, saving "
        "costs at most 2%% of training time and a kill loses at most 30 minutes, from the predicted "
        "save and step times (printed); on CPU nodes max(1, min(steps // 20, 100))",
    )
    p.add_argument(
        "--device",
        default=None,
        metavar="KEY",
        help="the nodes' GPU, for the predicted step time behind the checkpoint interval: "
        + ", ".join(DEVICE_KEYS)
        + " (default h100, assumed)",
    )
    p.add_argument(
        "--save-bandwidth-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help="GB/s each node writes checkpoints to the run directory at, for the predicted save "
        "time (default 2, assumed: a parallel filesystem)",
    )
    add_config_args(p)


def _add_slurm(lsub: _Commands) -> None:
    ls = lsub.add_parser(
        "slurm",
        help="an sbatch script: srun starts dtlab's launcher on every node (c10d rendezvous)",
        description="Write an sbatch script (--out) and, beside it, CONFIG's resolved form named after "
        "it (fsdp.sbatch -> fsdp.config.yaml). One task per node starts `dtlab train --nproc P "
        "--nnodes N` with a c10d rendezvous on the first node. Before the time limit Slurm sends SIGUSR1: the workers save a checkpoint, the script "
        "requeues the job, and the requeued job resumes from the run directory.",
    )
    _add_job_args(ls)
    ls.add_argument("--partition", default=None, help="Slurm partition")
    ls.add_argument("--time", default=None, help="time limit, e.g. 4:00:00 or 2-00:00:00")
    ls.add_argument("--account", default=None, help="Slurm account to charge")
    ls.add_argument("--cpus-per-task", type=positive_int, default=None, help="CPUs per node's task")
    ls.add_argument(
        "--signal-seconds",
        type=positive_int,
        default=120,
        help="send SIGUSR1 this long before the time limit, to checkpoint and requeue (default 120)",
    )
    _add_slurm_site(ls)
    ls.add_argument(
        "--master-port",
        type=positive_int,
        default=None,
        help="rendezvous port (default: from the job id)",
    )
    ls.add_argument(
        "--out", default=None, help="script path (default <run.name>.sbatch in this directory)"
    )
    ls.add_argument("--submit", action="store_true", help="run sbatch and print the job id")


def _add_slurm_site(ls: argparse.ArgumentParser) -> None:
    """The cluster's settings of ``launch slurm``: each also a key of a site file (--site)."""
    ls.add_argument(
        "--site",
        default=None,
        metavar="FILE",
        help="a YAML file of the cluster's settings (keys: partition, account, qos, time, exclusive, "
        "sbatch, modules, setup, env, container, python, venv, run_root); the flags below win",
    )
    ls.add_argument("--qos", default=None, help="Slurm quality of service")
    ls.add_argument("--exclusive", action="store_true", help="whole nodes (#SBATCH --exclusive)")
    for flag, metavar, what in (
        ("--sbatch", "OPTION", "another #SBATCH option, e.g. mem=0 (for --mem=0)"),
        ("--module", "NAME", "`module load NAME` in the job"),
        ("--setup", "LINE", "a shell line the job runs first"),
        ("--env", "NAME=VALUE", "a variable for the job, e.g. NCCL_IB_HCA=mlx5"),
        ("--container-mount", "SRC[:DST]", "another mount for the container"),
    ):
        ls.add_argument(flag, action="append", default=[], metavar=metavar, help=what + " (repeat)")
    ls.add_argument(
        "--container-image", default=None, help="run each task in this image (pyxis or apptainer)"
    )
    ls.add_argument(
        "--container-runtime", default=None, choices=["pyxis", "apptainer"], help="(default pyxis)"
    )
    ls.add_argument(
        "--python",
        default=None,
        help="the Python on the nodes that runs dtlab (default: the job's python3, or the one of "
        "`dtlab` on the job's PATH)",
    )
    ls.add_argument("--venv", default=None, help="a virtual environment on the nodes holding dtlab")
    ls.add_argument(
        "--run-root",
        default=None,
        metavar="DIR",
        help="where the run directory goes, on storage every node sees (default: runs/ beside "
        "--out); run.dir, when set, wins",
    )


def _add_k8s(lsub: _Commands) -> None:
    lk = lsub.add_parser(
        "k8s",
        help="a Kubeflow PyTorchJob (elastic, c10d) or Trainer v2 TrainJob, the config as a "
        "ConfigMap",
        description="Write a Kubernetes manifest: a ConfigMap with the resolved config, a "
        "PersistentVolumeClaim for the run directory (unless --pvc names one), and a kubeflow.org/v1 "
        "PyTorchJob (or, with --api trainjob, a Kubeflow Trainer v2 TrainJob and its "
        "TrainingRuntime) whose containers run dtlab under torchrun. Apply with kubectl apply -f OUT.",
    )
    _add_job_args(lk)
    lk.add_argument("--image", required=True, help="container image with dtlab installed")
    lk.add_argument(
        "--name", default=None, help="job name, a DNS-1035 label (default: from run.name)"
    )
    lk.add_argument("--namespace", default=None, help="Kubernetes namespace")
    lk.add_argument(
        "--pvc",
        default=None,
        help="existing PersistentVolumeClaim for the run directory (default: create <name>-runs)",
    )
    lk.add_argument("--storage", default="20Gi", help="size of the created claim (default 20Gi)")
    lk.add_argument("--cpu", default=None, help="CPU request per pod, e.g. 8")
    lk.add_argument("--memory", default=None, help="memory request per pod, e.g. 64Gi")
    lk.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=3,
        help="restarts: a PyTorchJob's elastic restarts, a TrainJob's JobSet restarts (default 3)",
    )
    lk.add_argument(
        "--api",
        choices=("pytorchjob", "trainjob"),
        default="pytorchjob",
        help="pytorchjob: a kubeflow.org/v1 PyTorchJob (training operator); trainjob: a Kubeflow "
        "Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) with a TrainingRuntime of its own "
        "(default pytorchjob)",
    )
    lk.add_argument(
        "--runtime",
        default=None,
        metavar="NAME",
        help="with --api trainjob: an installed ClusterTrainingRuntime to run on (e.g. "
        "torch-distributed), patched with the job's volumes and scheduling, instead of the "
        "manifest's own TrainingRuntime",
    )
    lk.add_argument(
        "--node-selector",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a node label the pods must run on (repeatable), e.g. "
        "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
    )
    lk.add_argument(
        "--toleration",
        dest="tolerations",
        action="append",
        default=[],
        metavar="KEY[=VALUE][:EFFECT]",
        help="a taint the pods tolerate (repeatable), e.g. nvidia.com/gpu:NoSchedule",
    )
    lk.add_argument(
        "--resource",
        dest="resources",
        action="append",
        default=[],
        metavar="NAME=QUANTITY",
        help="an extended resource each pod asks for beside its GPUs (repeatable), e.g. RDMA "
        "devices: rdma/ib=1",
    )
    lk.add_argument(
        "--volume",
        dest="volumes",
        action="append",
        default=[],
        metavar="CLAIM:/MOUNT[:ro]",
        help="an existing PersistentVolumeClaim mounted in every pod (repeatable): the data "
        "(data.paths), model.init_from's weights, ...; a path the config reads that no volume "
        "holds is named when the manifest is written",
    )
    lk.add_argument(
        "--out", default=None, help="manifest path (default <name>.yaml in this directory)"
    )


def _add_plan(sub: _Commands) -> None:
    pl = sub.add_parser(
        "plan",
        help="predict memory, communication and step time, and find the fastest layout that fits",
        description="Predict, without allocating the model, the per-rank memory (parameters, gradients, "
        "optimizer, activations), the bytes each collective moves per step, and an estimated step time "
        "of every data-parallel strategy at the config's own settings; then search every layout the "
        "config leaves open (tensor and pipeline degrees, sharding, pipeline schedule and "
        "micro-batches, micro-batch size, activation checkpointing, precision; keys set in CONFIG or by "
        "--set are kept), show the fastest that fit, and print the dtlab train line that runs the "
        "recommended one.",
    )
    pl.add_argument("--nproc", type=positive_int, default=1, help="processes (GPUs) per node")
    pl.add_argument("--nnodes", type=positive_int, default=1, help="number of nodes")
    pl.add_argument(
        "--device",
        default=None,
        help="device profile: "
        + ", ".join(DEVICE_KEYS)
        + ", or 'this' (this machine, measured); without it h100 is assumed, and the output says so",
    )
    pl.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="override the device memory",
    )
    pl.add_argument(
        "--step-model",
        choices=("flops", "kernels"),
        default="flops",
        help="how a GPU's compute time is estimated: flops (the step's FLOPs at 45%% of the peak; "
        "the default) or kernels (each kernel of the step at the rate its kind reaches, measured "
        "as fractions of an H200's datasheet figures, and the host's dispatch where it is slower: "
        "dense bf16/fp32 steps, eager or compiled; others stay at flops)",
    )
    pl.add_argument(
        "--check",
        action="store_true",
        help="also run the real code of --ranks at the full world size in this process (torch's fake "
        "process group and fake tensors: nothing of the model's size is allocated) for two training "
        "steps, and print each memory component and the bytes sent per step, predicted beside checked",
    )
    pl.add_argument(
        "--ranks",
        default=None,
        metavar="R,...",
        help="with --check: the ranks to check (default the first and the last)",
    )
    pl.add_argument(
        "--engine",
        choices=SchemaChoices("train.engine"),
        metavar="ENGINE",
        default=None,
        help="torch or mlx (same as --set train.engine=...); mlx: each MLX layout's memory per rank, "
        "as MLX's allocator counts it",
    )
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_config_args(pl)


def _add_verify(sub: _Commands) -> None:
    v = sub.add_parser(
        "verify",
        help="prove that parallel layouts train the same: loss, gradient norm and parameters",
        description="Train CONFIG with each layout of --layouts on the same global batch for --steps "
        "steps and compare each with the first, step by step: the largest loss and gradient-norm "
        "differences, and the largest parameter difference after the last step. Exit 0 only when "
        "every layout is within tolerance; for one that is not, say the first step that differs and "
        "the parameter that differs most.",
        epilog=VERIFY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument(
        "--layouts",
        required=True,
        help="comma-separated layouts, the first the reference, e.g. single,ddp:2,fsdp:2xtp:2,pp:2",
    )
    v.add_argument("--steps", type=positive_int, default=10, help="steps per layout (default 10)")
    v.add_argument(
        "--out", default="verify-out", help="where the layouts' runs go (default verify-out)"
    )
    # None: the default for the config's train.precision (dtlab.verify.default_tolerances).
    v.add_argument(
        "--loss-tol", type=float, help="absolute (default 1e-4; train.precision bf16/fp16: 5e-3)"
    )
    v.add_argument(
        "--grad-tol",
        type=float,
        help="relative, gradient norm (default 1e-3; train.precision bf16/fp16: 1e-2)",
    )
    v.add_argument(
        "--param-tol",
        type=float,
        help="absolute, parameters (default 1e-4; train.precision bf16/fp16: 5e-2)",
    )
    v.add_argument(
        "--checks",
        default="loss",
        help="what to check besides the loss: resume, export, or all (default: loss only)",
    )
    v.add_argument(
        "--engine",
        choices=SchemaChoices("train.engine"),
        metavar="ENGINE",
        default=None,
        help="torch or mlx: every layout on this engine (same as --set train.engine=...)",
    )
    add_config_args(v)


def _add_export(sub: _Commands) -> None:
    e = sub.add_parser(
        "export",
        help="export a checkpoint's model to safetensors or a Hugging Face directory",
        description="Export the model weights of a checkpoint (or of a run directory's newest verified "
        "checkpoint), in one process, without a process group.",
        epilog=EXPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument(
        "source",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run directory or a checkpoint directory (RUN_DIR/checkpoints/step-NNNNNNNN)",
    )
    e.add_argument(
        "--format",
        dest="fmt",
        choices=("safetensors", "hf"),
        required=True,
        help="safetensors: dtlab's names + config.yaml; hf: the Hugging Face class of the model's "
        "family, model.family (config.json + model.safetensors)",
    )
    e.add_argument(
        "--out", required=True, metavar="DIR", help="output directory (must not exist or be empty)"
    )
    e.add_argument("--force", action="store_true", help="replace DIR if it exists and is not empty")


def _add_generate(sub: _Commands) -> None:
    g = sub.add_parser(
        "generate",
        help="generate text with a trained model (a run, a checkpoint or an export)",
        description="Continue --prompt with the model, one token at a time (with a KV cache), and "
        "print the generated text. Stops after --max-new-tokens, or earlier at the document "
        "separator (id 0; a Hugging Face tokenizer's eos token) unless --ignore-separator. "
        "Prompt and generated tokens must fit the model's context (model.max_seq_len).",
        epilog=GENERATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g.add_argument(
        "source",
        metavar="RUN_DIR_OR_CHECKPOINT_OR_EXPORT",
        help="a run directory, a checkpoint directory, or a dtlab or Hugging Face export (see below)",
    )
    g.add_argument("--prompt", required=True, help="the text to continue (not empty)")
    g.add_argument(
        "--max-new-tokens",
        type=non_negative_int,
        default=100,
        metavar="N",
        help="generate at most N tokens (default 100)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        metavar="T",
        help="divide the logits by T before sampling; 0 = greedy (argmax, --seed unused) (default 1.0)",
    )
    g.add_argument(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="sample among the K most likely tokens only; 0 = all (default 0)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus sampling: among the fewest tokens whose probability reaches P, in (0, 1]; "
        "1 = all (default 1.0)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the sampling: the same seed gives the same text (default 0)",
    )
    g.add_argument(
        "--ignore-separator",
        action="store_true",
        help="do not stop at the document separator (id 0, or the tokenizer's eos token): always "
        "generate --max-new-tokens",
    )
    g.add_argument("--device", default="cpu", help="torch device to run on (default cpu)")


# `dtlab bench --compression` names beside the config's parallel.compression values; each maps to its
# overrides in dtlab.bench.sweep.compression_overrides.
