"""What a GPU check runs on a machine with ``gpus`` CUDA GPUs: the configs, step counts and timeouts
of each check, and which checks this machine cannot run (and why). A function of the GPU count
alone, so that what a GPU machine runs can be read (and tested) on any machine."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUDGET_S", "CHECKS", "Settings", "layouts_for", "settings_for", "skip_reason"]

BUDGET_S = 570.0  # the whole check, every step included: under 10 minutes with make's own start

# name: what it proves (the report's titles), in the order they run: the CUDA tests last, with what the
# bounded checks before them left of the budget (their number grows; the others' work does not).
CHECKS: dict[str, str] = {
    "train": "a bf16 + torch.compile training of llama3.2-1b: tokens/s, and MFU against this "
    "card's measured bf16 GEMM peak",
    "float8": "the same training with the blocks' linear layers in float8 (train.float8, "
    "torchao): tokens/s and loss beside bf16's, float8 GEMMs native",
    "memory": "the training's peak memory against dtlab plan's prediction",
    "checkpoint": "async and sync saves: the time each blocked training and the training time it "
    "cost, against a run without saves",
    "resume": "a resume from an async save continues as the uninterrupted run (dtlab verify "
    "--checks resume; with 2 GPUs, FSDP's save resumed on FSDP and on one process too)",
    "collectives": "all-reduce, all-gather and reduce-scatter across every GPU of the node, each "
    "result checked: bus bandwidth as nccl-tests reports it, beside the card's datasheet link",
    "equivalence": "DDP, FSDP, TP, PP, CP, fault-tolerant groups, a mixture of experts' EP and FSDP "
    "in bf16 with compile (with 4 GPUs, HSDP and FSDP x TP too) train as one process on the same "
    "global batch (dtlab verify)",
    "killed-rank": "a rank killed mid-run ends the run in a clear error naming it, within the "
    "collective timeout",
    "ft-killed": "DDP over 2 fault-tolerant replica groups (torchft), group 1 killed mid-run: it "
    "rejoins with the live state of group 0 and the run ends every step",
    "cuda-tests": "every CUDA test of the suite (pytest -m cuda)",
}
MULTI_GPU = ("collectives", "equivalence", "killed-rank", "ft-killed")

# Every dtlab run of the check: no plot, no trackers, no progress bar.
QUIET = ["run.tensorboard=false", "run.plot=false", "run.progress=none", "run.trackers=[]"]
# The debug model on synthetic data: what the test suite trains (well under a second a step on CPU).
DEBUG = [
    "model.preset=debug", "data.source=synthetic", "data.seq_len=64", "train.global_batch_size=8",
    "train.warmup_steps=2", "train.lr=3e-3", "train.precision=fp32",
]  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """The configs (``--set`` overrides), step counts and timeouts of each check."""

    gpu: bool  # a GPU run: speed and memory judged; otherwise a smoke of the pipeline, shown only
    smoke: str  # on CPU, what the figures are (said before each figure-giving check's verdict)
    timeouts: dict[str, float]
    train: list[str]
    train_steps: int
    train_warmup: int
    checkpoint: list[str]
    checkpoint_steps: int
    checkpoint_every: int
    save_kinds: tuple[str, ...]  # runs of the checkpoint check: none (no saves), sync, async
    resume: list[str]
    resume_steps: int
    resume_layouts: str  # "single" (one process alone), or verify's layouts
    equivalence: list[str]
    equivalence_steps: int
    layouts: str
    killed: list[str]
    killed_collective_timeout_s: float
    collective_sizes: str  # --sizes of python -m dtlab.bench.collectives
    # dtlab verify's runs after the dense model's layouts: (name, what, layouts, config) each.
    more_verifies: tuple[tuple[str, str, str, list[str]], ...]


# dtlab verify's layouts on a node's GPUs: on 2, each kind of parallelism over NCCL (pipelines'
# sends, the context-parallel ring on the GPU's attention kernels); on 4 or more, also the 2-D ones
# (HSDP's replica groups, FSDP with TP); fault-tolerant replica groups over torchft's process
# group. Each a short fp32 run of tiny: a minute or two in all.
LAYOUTS_2 = "single,ddp:2,fsdp:2,tp:2,pp:2,cp:2,ft:2"
# A mixture of experts, its experts split over the 2 ranks (torchft's groups, ft:2, above).
MOE_LAYOUTS = "single,ep:2"
COMPILED_LAYOUTS = "single,fsdp:2"
LAYOUTS_4 = LAYOUTS_2 + ",hsdp:4,fsdp:2xtp:2"


def layouts_for(gpus: int) -> str:
    """The layouts the equivalence check verifies with ``gpus`` CUDA GPUs (2 or more)."""
    return LAYOUTS_4 if gpus >= 4 else LAYOUTS_2


GIB = 2**30
BIG_CARD = 64 * GIB  # the 1B training's 4 samples a step take about 41 GiB (dtlab plan)


def settings_for(gpus: int, memory_bytes: int | None = None) -> Settings:
    """What each check runs with ``gpus`` CUDA GPUs of ``memory_bytes`` each (0 GPUs: a CPU smoke of
    the same pipeline)."""
    timeouts = {
        "cuda-tests": 420.0, "train": 140.0, "float8": 140.0, "memory": 30.0, "checkpoint": 90.0,
        "resume": 60.0 if gpus < 2 else 120.0, "collectives": 90.0, "equivalence": 240.0, "killed-rank": 75.0,
        "ft-killed": 120.0,
    }  # fmt: skip
    if gpus == 0:
        # A shared CPU's load, not the work, decides how long these take: no step of the smoke is
        # failed for a neighbour's test run.
        return Settings(
            gpu=False, timeouts=dict.fromkeys(timeouts, 150.0),
            smoke="CPU smoke of the pipeline (the debug model in fp32, no compile, a few steps; not "
            "a measurement of a GPU)",
            train=DEBUG, train_steps=2, train_warmup=1,
            checkpoint=DEBUG, checkpoint_steps=6, checkpoint_every=2, save_kinds=("none", "async"),
            resume=[*DEBUG, "checkpoint.async=true"], resume_steps=4, resume_layouts="single",
            equivalence=DEBUG, equivalence_steps=4, layouts="single,ddp:2,fsdp:2,tp:2",
            killed=[*DEBUG, "parallel.strategy=ddp"], killed_collective_timeout_s=10.0,
            collective_sizes="64K,1M",
            more_verifies=(),
        )  # fmt: skip
    synthetic = ["data.source=synthetic", "train.warmup_steps=5"]
    # ~1.2B parameters, 8,192 tokens a step (2,048 on a card under 64 GiB), unsharded.
    # On a smaller card, one sample a step: about 26 GiB (the parameters, gradients and AdamW state
    # alone take 18.4 GiB), so a 32 GB card still runs it.
    batch = 4 if memory_bytes is None or memory_bytes >= BIG_CARD else 1
    big = [
        "model.preset=llama3.2-1b", "train.precision=bf16", "train.compile=true",
        "data.seq_len=2048", f"train.global_batch_size={batch}", *synthetic,
    ]  # fmt: skip
    # ~85M parameters: a checkpoint of ~1 GB, saved at steps 7, 14 and 21 (each overlapped with
    # steps after it; none at the last step, whose save only the run's end would wait for).
    small = [
        "model.preset=small", "train.precision=bf16", "data.seq_len=512",
        "train.global_batch_size=8", *synthetic,
    ]  # fmt: skip
    # fp32: the layouts and the resumed run are compared at float32 reduction noise.
    tiny = [
        "model.preset=tiny", "train.precision=fp32", "data.seq_len=128",
        "train.global_batch_size=8", "train.lr=3e-3", *synthetic,
    ]  # fmt: skip
    return Settings(
        gpu=True, timeouts=timeouts, smoke="",
        train=big, train_steps=30, train_warmup=5,
        checkpoint=small, checkpoint_steps=24, checkpoint_every=7,
        save_kinds=("none", "sync", "async"),
        resume=[*tiny, "checkpoint.async=true"], resume_steps=10,
        # With 2 GPUs an async save of FSDP's shards resumed on FSDP and on one process too.
        resume_layouts="single,fsdp:2" if gpus >= 2 else "single",
        equivalence=[*tiny, "train.grad_clip=0.1"], equivalence_steps=8,
        more_verifies=(
            ("verify-moe", "a mixture of experts", MOE_LAYOUTS,
             [*tiny, "train.grad_clip=0.1", "model.preset=debug-moe"]),
            # FSDP's bf16 parameters and reductions, with the blocks compiled (torch.compile); the
            # debug model, on which verify's bf16 tolerances were set (tiny's loss, larger, moves
            # past the absolute 5e-3 in bf16 on DDP too: 8.3e-3 at step 6 on gloo).
            ("verify-bf16-compile", "bf16 with compile", COMPILED_LAYOUTS,
             [*DEBUG, "train.grad_clip=0.5", "train.precision=bf16", "train.compile=true"]),
        ),
        layouts=layouts_for(gpus),
        killed=[*DEBUG, "parallel.strategy=ddp"], killed_collective_timeout_s=20.0,
        # A small buffer (latency), a mid one, and 1 GiB (the link's rate, as nccl-tests' largest).
        collective_sizes="1M,64M,1G",
    )  # fmt: skip


def skip_reason(name: str, gpus: int) -> str | None:
    """Why this machine cannot run check ``name`` (None: it can)."""
    import importlib.util

    if name == "float8" and importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'dtlab[float8]')"
    if name == "ft-killed" and importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install 'dtlab[ft]')"
    if name in MULTI_GPU and gpus < 2:
        return f"needs 2 CUDA GPUs, this machine has {gpus}" + (
            " (on CPU, make test runs these layouts and the killed rank on gloo: "
            "tests/test_verify.py, tests/test_hang.py)"
            if gpus == 0
            else ""
        )
    return None
