"""Checkers of two kinds of claims the docs make, for tests/test_docs_claims.py, which runs them on
today's docs and on stale sentences the docs once held (each must be caught).

Figures of the test tiers: every count and time a ``make test-fast`` / ``make test`` /
``make test-all`` line of a command block (or the Makefile's help and comments) gives is one that
tests/tiers.json records as measured; an approximate one ("about 2 minutes", "~2 min") within 25% of
a recorded time.

What dtlab does not do yet, or refuses: every sentence that says so ("not yet", "so far", "once the
plan models ...", "until it can be tested", "nothing ... has run", "no GPU figures have been
measured", or "refused" with a setting in backticks) is matched to a :class:`Claim` whose probe asks
the code (a config that must still be refused, a feature that must still be missing, a measurement a
test still holds at its error, the test that proves a run's refusal). A sentence no claim matches,
or whose probe finds the gap closed, is a problem named by file and line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TIERS = Path(__file__).resolve().parent / "tiers.json"


@dataclass(frozen=True)
class Problem:
    """A claim that does not hold: where it is and why."""

    where: str
    line: int
    text: str
    why: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.why}: {self.text.strip()!r}"


# --- figures of the test tiers -------------------------------------------------------------------

TIER = re.compile(r"\bmake (test-fast|test-all|test)\b")
COUNT = re.compile(
    r"\b(\d{1,3}(?:,\d{3})+|\d+)(?: of [\d,]+)? tests\b|\ball (\d{1,3}(?:,\d{3})+)\b"
)
DURATION = re.compile(
    r"(?P<approx>about |~)?(?:(?P<min>\d+) min(?:ute)?s?\b(?: (?P<s>\d+) s\b)?|(?P<sec>\d+) s\b)"
)
# An approximate time ("about 2 minutes", "~2 min", "11 min") holds within this of a measured one.
APPROX = 0.25


def load_tiers(path: Path = TIERS) -> dict[str, Any]:
    """The recorded measurements of the test tiers (tests/tiers.json)."""
    return json.loads(path.read_text(encoding="utf-8"))


def fast_listed(fast_list: Path) -> int:
    """How many tests tests/fast.txt names: what ``pytest --fast`` runs, but for the first test of
    a test module added since, which it runs too (conftest.py) until the list is chosen again."""
    return len({ln.strip() for ln in fast_list.read_text().splitlines() if ln.strip()})


def _seconds(values: Any) -> list[float]:
    """Every figure under a key ending in ``seconds``, flattened."""
    out: list[float] = []
    if isinstance(values, dict):
        for key, v in values.items():
            if key.endswith("seconds"):
                out += [float(x) for x in (v if isinstance(v, list) else [v])]
            else:
                out += _seconds(v)
    elif isinstance(values, list):
        for v in values:
            out += _seconds(v)
    return out


def tier_lines(where: str, text: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of the lines that state a tier's figures as today's: a ``make test...``
    command in a fenced block of a page; in the Makefile, the help's echo lines and each target's
    comment (joined, and starting with its target's name)."""
    lines = text.splitlines()
    if where.endswith("Makefile"):
        for i, line in enumerate(lines):
            if line.lstrip().startswith("@echo") and TIER.search(line):
                yield i + 1, line
            m = re.match(r"^(test-fast|test-all|test):", line)
            if m:
                j = i
                while j > 0 and lines[j - 1].startswith("#"):
                    j -= 1
                if j < i:
                    comment = " ".join(ln.lstrip("# ") for ln in lines[j:i])
                    yield j + 1, f"make {m.group(1)}: {comment}"
        return
    fenced = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and TIER.match(line.lstrip()):
            yield i + 1, line


def check_tier_figures(where: str, text: str, tiers: dict[str, Any]) -> list[Problem]:
    """Every count and time the tier lines of ``text`` give, against the recorded ``tiers``: a count
    is the tier's (or, in "N of M tests", M the whole suite's), a time one measured for that tier
    (exactly, to the second; an approximate one within 25%)."""
    problems: list[Problem] = []
    for number, line in tier_lines(where, text):
        mentions = list(TIER.finditer(line))
        for k, m in enumerate(mentions):
            tier = m.group(1)
            end = mentions[k + 1].start() if k + 1 < len(mentions) else len(line)
            segment = line[m.end() : end]
            record = tiers.get(tier, {})
            counts = {record.get("tests")} - {None}
            for c in COUNT.finditer(segment):
                n = int((c.group(1) or c.group(2)).replace(",", ""))
                if counts and n not in counts:
                    why = f"make {tier}: {n:,} tests, but tests/tiers.json records {min(counts):,}"
                    problems.append(Problem(where, number, line, why))
            measured = _seconds(record.get("measurements", []))
            for d in DURATION.finditer(segment):
                if d.group("sec") is not None and d.group("min") is None:
                    claimed, exact = float(d.group("sec")), not d.group("approx")
                else:
                    claimed = 60.0 * int(d.group("min")) + int(d.group("s") or 0)
                    exact = d.group("s") is not None and not d.group("approx")
                if exact:
                    ok = any(abs(claimed - s) <= 1 for s in measured)
                else:
                    ok = any(abs(claimed - s) <= APPROX * s for s in measured)
                if not ok:
                    shown = ", ".join(f"{s:.0f} s" for s in measured) or "nothing"
                    why = (
                        f"make {tier}: {d.group(0).strip()}, but tests/tiers.json measured {shown}"
                    )
                    problems.append(Problem(where, number, line, why))
    return problems


# --- what dtlab does not do yet ------------------------------------------------------------------

# A sentence that says dtlab lacks something (headings are titles, not claims; "so far" after a sum
# or a count is the running total, not a claim).
GAP = re.compile(
    r"\bnot yet\b|\(yet\)|\byet\b(?=\s*(?:[.;:,)]|$))|\bnot (?:built|wired)\b"
    r"|(?<!sums )(?<!bytes )(?<!totals )(?<!found )(?<!outcome )(?<!forwards )\bso far\b"
    r"|\bonce (?:the|dtlab|it)\s+\w+\s+(?:models|supports|handles|learns|counts|runs)\b"
    r"|\bno GPU figures\b|\bnothing\b[^.]{0,40}\bhas run\b"
    r"|\buntil (?:it can be|it is measured|then\b|a GPU measures)",
    re.I,
)


def sentences(text: str) -> Iterator[tuple[int, str]]:
    """(line number, sentence) of a Markdown page: a paragraph's or list item's sentences (joined
    over its lines), a table row, a line of a fenced block; headings left out."""
    block: list[tuple[int, str]] = []

    def flush() -> Iterator[tuple[int, str]]:
        if not block:
            return
        joined, starts = "", []
        for number, line in block:
            starts.append((len(joined), number))
            joined += line.strip() + " "
        pos = 0
        for part in re.split(r"(?<=[.!?])\s+(?=[A-Z`(*\[])", joined):
            at = joined.index(part, pos)
            pos = at + len(part)
            m = GAP.search(part)
            offset = at + (m.start() if m else 0)
            yield max(n for s, n in starts if s <= offset), part
        block.clear()

    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            yield from flush()
            fenced = not fenced
        elif fenced or stripped.startswith("|"):
            yield from flush()
            yield number, line
        elif not stripped or stripped.startswith("#"):
            yield from flush()
        else:
            if re.match(r"([-*]|\d+\.) ", stripped):
                yield from flush()
            block.append((number, line))
    yield from flush()


Probe = Callable[[], "str | None"]

# A sentence that says dtlab refuses a setting (a config key or value in backticks): checked as the
# "not yet" ones are, against a config that must still be refused or the test that proves it.
REFUSAL = re.compile(r"\brefuse[sd]?\b", re.I)
SETTING = re.compile(
    r"`(?:parallel|train|model|data|eval|checkpoint|run|alerts)\.[a-z_.]+"
    r"|`(?:sharding|cp_method|balance|engine|pp_schedule)\b"
    r"|`(?:zbv|dualpipev|interleaved_zb|ddp|fsdp|hsdp|alltoall|ring)`"
)


def says_refused(sentence: str) -> bool:
    """Whether ``sentence`` says a setting is refused (a numbered list of quoted errors, as
    architecture.md's feature pairs, and table rows are checked elsewhere)."""
    stripped = sentence.lstrip()
    if stripped.startswith("|") or re.match(r"\d+\. ", stripped):
        return False
    return bool(REFUSAL.search(sentence) and SETTING.search(sentence))


@dataclass(frozen=True)
class Claim:
    """Something the docs say dtlab does not do (yet), and how to tell that it still does not.

    ``says``: a pattern of the sentences that say it; ``probe``: None while the gap is there,
    otherwise what shows it closed; ``kind``: ``code`` (a config refused, a feature missing),
    ``measured`` (a measurement a test or the code still holds at its figure), ``open`` (an
    unexplained measurement: nothing to probe, the reason given) or ``prose`` ("yet" that claims
    nothing of dtlab)."""

    says: str
    probe: Probe
    kind: str = "code"


def nothing() -> str | None:
    """The probe of a sentence that claims nothing a probe can test."""
    return None


# Each claim's probe runs once a session (several sentences can say the same).
_PROBED: dict[str, str | None] = {}


def check_gap_sentences(where: str, text: str, claims: list[Claim]) -> list[Problem]:
    """Every sentence of ``text`` that says dtlab lacks something: matched to a claim of ``claims``
    whose probe still finds the gap."""
    problems: list[Problem] = []
    for number, sentence in sentences(text):
        if not (GAP.search(sentence) or says_refused(sentence)):
            continue
        matched = [c for c in claims if re.search(c.says, sentence, re.I | re.S)]
        if not matched:
            why = (
                "says dtlab does not do (or refuses) something, and no probe checks it "
                "(docs_claims.CLAIMS)"
            )
            problems.append(Problem(where, number, sentence, why))
        for claim in matched:
            if claim.says not in _PROBED:
                _PROBED[claim.says] = claim.probe()
            closed = _PROBED[claim.says]
            if closed:
                problems.append(Problem(where, number, sentence, f"no longer true: {closed}"))
    return problems


# --- the probes ----------------------------------------------------------------------------------


def _accepted(overrides: list[str], world: int) -> str | None:
    """None if ``overrides`` make a valid config for ``world`` processes, else the error."""
    from dtlab.config import check_world, load_config
    from dtlab.errors import ConfigError

    try:
        check_world(load_config(None, overrides), world)
    except (ConfigError, ValueError) as e:
        return str(e)
    return None


def refused(base: list[str], *extra: str, world: int = 4, base_world: int | None = None) -> Probe:
    """The probe of "``extra`` is refused": ``base`` alone is a valid config (so the refusal is
    ``extra``'s), and ``base`` with ``extra`` is not (on ``world`` processes; ``base`` on
    ``base_world``, ``world`` by default)."""

    def probe() -> str | None:
        error = _accepted(base, base_world or world)
        if error is not None:
            return f"the probe's own config {' '.join(base)} is refused: {error}"
        if _accepted([*base, *extra], world) is None:
            return f"the config accepts {' '.join(extra)} with {' '.join(base)}"
        return None

    return probe


def takes(overrides: list[str], world: int = 4) -> Probe:
    """The probe of "``overrides`` are taken" (beside a refusal: what the docs say works)."""

    def probe() -> str | None:
        error = _accepted(overrides, world)
        return f"{' '.join(overrides)} is refused: {error}" if error else None

    return probe


def every(*probes: Probe) -> Probe:
    """All of ``probes`` (the first that finds the gap closed speaks)."""

    def probe() -> str | None:
        return next((p for p in (q() for q in probes) if p), None)

    return probe


def lacks(path: str, pattern: str, what: str) -> Probe:
    """The probe of a feature the code at ``path`` must still lack (``pattern`` absent)."""

    def probe() -> str | None:
        text = (ROOT / path).read_text(encoding="utf-8")
        return f"{path} has {what}" if re.search(pattern, text) else None

    return probe


def holds(path: str, pattern: str, what: str) -> Probe:
    """The probe of a measurement or behaviour ``path`` still holds at its figure (``pattern``)."""

    def probe() -> str | None:
        text = (ROOT / path).read_text(encoding="utf-8")
        return None if re.search(pattern, text) else f"{path} no longer holds {what}"

    return probe


def unchecked(overrides: list[str], world: int) -> Probe:
    """The probe of "``dtlab plan --check`` does not check this layout": it says why not."""

    def probe() -> str | None:
        from dtlab.analysis.check_fake import unsupported
        from dtlab.config import load_config

        if unsupported(load_config(None, overrides), world) is None:
            return f"dtlab plan --check checks {' '.join(overrides)} on {world} ranks"
        return None

    return probe


def tested(path: str, *names: str) -> Probe:
    """The probe of a refusal a run makes (not the config): the tests in ``path`` that prove it are
    still there."""

    def probe() -> str | None:
        text = (ROOT / path).read_text(encoding="utf-8")
        gone = [n for n in names if not re.search(rf"^def {n}\(", text, re.M)]
        return f"{path} has no {', '.join(gone)}" if gone else None

    return probe


GPU_PAGE = "docs/gpu.md"


def gpu_reports() -> list[str]:
    """How many GPUs each of docs/gpu.md's reports ran on, as the page words it ("one")."""
    text = (ROOT / GPU_PAGE).read_text(encoding="utf-8")
    return re.findall(r"\b(one|two|three|four|eight|\d+)\s+NVIDIA\b", text)


def only_single_gpu_runs() -> str | None:
    """The probe of "nothing with two GPUs or more has run": every report is of one GPU, and none
    passed a check that needs two."""
    text = (ROOT / GPU_PAGE).read_text(encoding="utf-8")
    many = [n for n in gpu_reports() if n != "one"]
    if many:
        return f"{GPU_PAGE} has a report of {many[0]} GPUs"
    if re.search(r"^\| (equivalence|killed-rank)[^|]*\| passed", text, re.M):
        return f"{GPU_PAGE} reports a passed check that needs 2 GPUs"
    return None


def no_gpu_report() -> str | None:
    """The probe of "no GPU figures have been measured": docs/gpu.md has no passed training."""
    text = (ROOT / GPU_PAGE).read_text(encoding="utf-8")
    return (
        f"{GPU_PAGE} reports a passed train check"
        if re.search(r"\| train \| passed", text)
        else None
    )


def two_train_reports() -> str | None:
    """The probe of "two single-GPU machines ran gpu-check's train check": its passed rows."""
    text = (ROOT / GPU_PAGE).read_text(encoding="utf-8")
    n = len(re.findall(r"^\| train \| passed", text, re.M))
    return None if n == 2 else f"{GPU_PAGE} has {n} passed train checks"


def plan_lacks_experts() -> str | None:
    """The probe of "once the plan models experts": ``dtlab plan`` of an MoE model counts no
    active parameters apart from the whole."""
    import contextlib
    import io

    from dtlab.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(["plan", "--nproc", "2", "--json", "--set", "model.preset=debug-moe"])
    model = json.loads(out.getvalue())["model"]
    if model.get("active_params", model["params"]) < model["params"]:
        return (
            f"dtlab plan models the experts of debug-moe ({model['active_params']:,} of "
            f"{model['params']:,} parameters active per token)"
        )
    return None


DDP = ["parallel.strategy=ddp"]
MOE_EP = [*DDP, "model.preset=debug-moe", "parallel.ep=2"]
CP = [*DDP, "parallel.cp=2", "data.seq_len=64"]
MASK = ["data.document_mask=true"]
TP, PP = [*DDP, "parallel.tp=2"], [*DDP, "parallel.pp=2"]
SINGLE_PP = ["parallel.strategy=single", "parallel.pp=2"]
FT = [*DDP, "parallel.fault_tolerance.enabled=true"]
DILOCO_FT = ["parallel.diloco.inner_steps=2"]
# The ring's blocks on a GPU's kernels (until they were wired, the ring was refused on a GPU), and
# the plan's refusal to plan the ring for a GPU.
RING_CUDA = lacks(
    "src/dtlab/parallel/context.py",
    r"_scaled_dot_product_flash_attention\(",
    "the ring's CUDA kernels",
)
RING_NOT_PLANNED_ON_GPU = holds(
    "src/dtlab/analysis/plan.py",
    r'cp_method == "ring" and '
    r'device.kind == "cuda"',
    "the plan's refusal of the ring on a GPU",
)
DILOCO = ("parallel.diloco.inner_steps=2", "parallel.diloco.replicas=2")
ONE_GPU = "nothing with two (?:GPUs )?or more|nothing with two GPUs|several GPUs nothing has run"

# Every sentence of today's docs (and of the stale ones the test keeps) that says dtlab lacks
# something, by what it says.
CLAIMS = [
    # Mixture of experts.
    Claim(
        r"not yet with sequence parallelism, ZeRO-1 or DiLoCo",
        every(
            refused([*MOE_EP, "parallel.tp=2"], "parallel.sequence_parallel=true"),
            refused(MOE_EP, "parallel.sharding=optimizer"),
            refused([*DDP, "model.preset=debug-moe"], *DILOCO),
        ),
    ),
    Claim(
        r"Not yet supported, and refused when the config is validated: "
        r"`parallel.sequence_parallel`",
        every(
            refused([*TP, "model.preset=debug-moe"], "parallel.sequence_parallel=true"),
            refused([*PP, "model.preset=debug-moe"], "model.moe.balance=aux"),
            refused([*DDP, "model.preset=debug-moe"], *DILOCO),
            refused(["model.preset=debug-moe"], "train.engine=mlx", world=1),
        ),
    ),
    Claim(r"once the plan models experts", plan_lacks_experts),
    # Context parallelism's ring on the CPU's kernel, and document masks.
    Claim(r"(ring|log-sum-exp).*CPU's (attention )?kernel(,)? so far", RING_CUDA),
    Claim(r"are not wired yet, so the ring on a GPU is refused", RING_CUDA),
    Claim(r"a GPU's not yet run, nor planned", RING_NOT_PLANNED_ON_GPU),
    Claim(r"nor try the\s+ring on a GPU", RING_NOT_PLANNED_ON_GPU),
    Claim(
        r"A GPU with no such kernel for the run's precision \(bf16 before sm80\) is refused",
        holds(
            "src/dtlab/parallel/context.py",
            r"ring_kernel\(device\.type, dtype, masked, cuda_capability\(device\)\)",
            "the ring's kernels checked when the run starts",
        ),
    ),
    Claim(
        r"two GPUs have not run the ring",
        lacks(
            "docs/gpu.md",
            r"test_ring_attention_over_nccl\w*.*passed",
            "a GPU's report of the ring over NCCL",
        ),
    ),
    Claim(r"their float32 kernel\s+has not run on a GPU since", nothing, "measured"),
    Claim(
        r"context parallelism is built over DDP's, FSDP's and HSDP's ranks",
        refused(CP, "parallel.sharding=optimizer"),
    ),
    Claim(
        r"Not yet: the search does not weigh context parallelism",
        holds(
            "src/dtlab/analysis/plan.py",
            r"if recommended\(found\) is not None",
            "the search with context parallelism only where nothing fits",
        ),
    ),
    Claim(
        r"Not yet with\s+pipeline parallelism or the MLX engine",
        every(
            refused([*PP, "data.seq_len=64"], *MASK),
            refused([], *MASK, "train.engine=mlx", world=1),
        ),
    ),
    # Tensor and pipeline parallelism.
    Claim(
        r"\*\*Not yet\*\*: fp16 with pp",
        every(
            refused(PP, "train.precision=fp16"),
            refused(TP, "train.compile=true"),
            refused(TP, "parallel.compression=powersgd"),
            refused(PP, "parallel.compression=powersgd"),
            refused(TP, "train.optimizer=demo"),
            refused(PP, "train.optimizer=demo"),
            refused(PP, "train.engine=mlx"),
        ),
    ),
    # GPUs.
    Claim(ONE_GPU, only_single_gpu_runs),
    Claim(r"no GPU figures have\s+been measured", no_gpu_report),
    Claim(r"Two single-GPU machines ran `make gpu-check`'s train check", two_train_reports),
    Claim(
        r"the test's reference is torch's attention in float32\s+\(not yet run on a GPU\)",
        nothing,
        "measured",
    ),
    Claim(
        r"Not yet built for several GPUs",
        every(
            holds(
                "src/dtlab/gpucheck/settings.py",
                r'LAYOUTS_4 = LAYOUTS_2 \+ ",hsdp:4,fsdp:2xtp:2"\n',
                "gpu-check's layouts on four GPUs at most",
            ),
            holds(
                "src/dtlab/gpucheck/checks.py",
                r'"--nproc", "2", "--set", \*s\.killed',
                "gpu-check's killed rank among two processes",
            ),
        ),
    ),
    # The plan's and the check's measured gaps, each held at its figure by a test or the code.
    Claim(
        r"What is \*\*not yet\*\* within 3%, measured",
        holds(
            "src/dtlab/analysis/check.py",
            r"def _compile_note",
            "the compiled step noted beside the eager check, not checked",
        ),
    ),
    Claim(
        r"What the plan does not count: PowerSGD's own compute",
        lacks("src/dtlab/analysis/steptime.py", r"(?i)powersgd", "PowerSGD's compute in the step"),
    ),
    Claim(
        r"the plan counts that part as a moment of its own",
        every(
            holds(
                "src/dtlab/analysis/check.py",
                r"is planned as a moment of its own, not checked",
                "the check's note: the groups' average planned, not checked",
            ),
            holds(
                "src/dtlab/analysis/check.py",
                r"DiLoCo's outer sync through it, is neither planned nor checked",
                "the check's note: DiLoCo's outer sync neither planned nor checked",
            ),
        ),
    ),
    Claim(
        r"not yet measured under a cap on a GPU\)",
        holds(
            "src/dtlab/analysis/fitrule.py",
            r"not yet measured under a cap on a GPU",
            "the fit rule's own words",
        ),
    ),
    Claim(
        r"Not yet timed by it \(they keep the FLOPs model",
        holds(
            "src/dtlab/analysis/roofline.py",
            r"float8 layers are timed by dtlab.analysis.float8_time",
            "the kernels' model still leaves float8 steps to the FLOPs model",
        ),
    ),
    Claim(r"ends 3\.3% above AdamW.*not yet within 2%", nothing, "measured"),
    Claim(
        r"neither the plan nor the check counts that part",
        lacks(
            "src/dtlab/analysis/rank_timeline.py",
            r"replica groups' average",
            "the replica groups' average planned as a moment of its own",
        ),
    ),
    Claim(
        r"over DDP's or FSDP's ranks.*so far",
        refused(
            ["parallel.strategy=hsdp", "parallel.replicate=2", "data.seq_len=64"], "parallel.cp=2"
        ),
    ),
    Claim(
        r"memory but not the NCCL bandwidth among its GPUs",
        lacks(
            "src/dtlab/analysis/devices.py",
            r"def node_link\(",
            "the plan's measurement of the bus bandwidth among a node's GPUs",
        ),
    ),
    Claim(
        r"\(no NCCL bus bandwidth, nothing across more of the node's GPUs\)",
        lacks(
            "src/dtlab/gpucheck/checks.py",
            r"def collectives\(",
            "gpu-check's collectives across every GPU of the node",
        ),
    ),
    Claim(
        r"uses one GPU \(no NCCL bus bandwidth or layout verification",
        lacks(
            "src/dtlab/gpucheck/settings.py",
            r'MULTI_GPU = \(.*"equivalence"',
            "a check of the layouts on two GPUs",
        ),
    ),
    Claim(
        r"keeps no ZeRO-1 row until\s+it is measured",
        lacks("docs/performance.md", r"(?mi)^\| [^|]*zero-?1[^|]*\| [\d.]+ \|", "a ZeRO-1 row"),
    ),
    Claim(
        r"needs the allocator's share measured under a cap on a GPU",
        holds(
            "src/dtlab/analysis/fitrule.py",
            r"not yet measured under a cap on a GPU",
            "the GPU margin's allocator share assumed, not measured under a cap",
        ),
    ),
    # Settings refused when the config is validated.
    Claim(
        r"Zero-bubble schedules with data parallelism",
        every(
            *(
                refused([*PP, "train.micro_batch_size=1"], f"parallel.pp_schedule={schedule}")
                for schedule in ("interleaved_zb", "zbv", "dualpipev")
            ),
            takes([*SINGLE_PP, "parallel.pp_schedule=zbv"], world=2),
        ),
    ),
    Claim(
        r"The V schedules \(`zbv`,\s+`dualpipev`\).*refused with them",
        refused([*SINGLE_PP, "model.tie_embeddings=true"], "parallel.pp_schedule=zbv", world=2),
    ),
    Claim(
        r"Refused with activation checkpointing\*\*: the check found",
        refused(
            [*SINGLE_PP, "parallel.pp_schedule=zbv"], "train.activation_checkpointing=full", world=2
        ),
    ),
    Claim(
        r"Refused when the config is validated, each with the reason: ZeRO-1",
        every(
            refused(MOE_EP, "parallel.sharding=optimizer"),
            refused(MOE_EP, "parallel.compression=bf16"),
            refused(MOE_EP, "train.optimizer=demo"),
            refused(MOE_EP, "train.oom_retry=true"),
            refused([*PP, "model.preset=debug-moe"], "model.moe.balance=aux"),
            refused([*TP, "model.preset=debug-moe"], "parallel.sequence_parallel=true"),
            refused([*DDP, "model.preset=debug-moe"], *DILOCO),
            refused(["model.preset=debug-moe"], "train.engine=mlx", world=1),
        ),
    ),
    Claim(
        r"Refused with the reason when the config is validated, before any process starts: an `ep`",
        every(
            refused([*CP, "model.preset=debug-moe"], "parallel.ep=3", world=4),
            refused(CP, "parallel.sharding=optimizer"),
            refused(CP, "parallel.compression=bf16"),
            refused(CP, "train.oom_retry=true"),
            refused(CP, "train.engine=mlx"),
        ),
    ),
    Claim(
        r"a window shorter than the sequence is taken by\s+`cp_method: alltoall`",
        every(
            refused(CP, "model.sliding_window=16", world=2),
            takes([*CP, "parallel.cp_method=alltoall", "model.sliding_window=16"], world=2),
        ),
    ),
    Claim(
        r"With\s+`train.engine: mlx` these options are refused",
        every(
            *(
                refused([], option, "train.engine=mlx", world=1)
                for option in (
                    "model.qkv_bias=true",
                    "model.qk_norm=true",
                    "model.head_dim=64",
                    "model.sliding_window=16",
                )
            )
        ),
    ),
    Claim(
        r"Not with `parallel.sequence_parallel` or `train.activation_checkpointing` \(refused with",
        every(
            takes([*TP, "train.engine=mlx"], world=2),
            refused([*TP, "train.engine=mlx"], "parallel.sequence_parallel=true", world=2),
            refused([*TP, "train.engine=mlx"], "train.activation_checkpointing=full", world=2),
            refused([*DDP, "train.engine=mlx"], "parallel.pp=2", world=2),
            takes([*TP, "train.engine=mlx", "parallel.strategy=fsdp"], world=4),
        ),
    ),
    Claim(
        r"which MLX 0.32.4's\s+ring and MPI backends do not have",
        tested("tests/test_mlx_fsdp.py", "test_mlx_fsdp2_matches_one_process_and_torch_fsdp2"),
    ),
    Claim(
        r"a run an engine refuses is a note with that engine's reason",
        tested(
            "tests/test_mlx_fsdp.py", "test_bench_engines_compares_fsdp_and_tensor_parallel_runs"
        ),
    ),
    Claim(
        r"Engine `mlx` refuses it \(`train.optimizer = 'muon'",
        refused([], "train.optimizer=muon", "train.engine=mlx", world=1),
    ),
    Claim(
        r"\*\*Refused\*\* with fault tolerance",
        every(
            refused([*FT, *DILOCO_FT], "parallel.diloco.fragments=2"),
            refused([*FT, *DILOCO_FT], "parallel.diloco.delay=1"),
            refused([*FT, *DILOCO_FT], "parallel.diloco.eager=true"),
            refused(
                ["parallel.strategy=fsdp", *DILOCO_FT, "parallel.diloco.replicas=2"],
                "parallel.fault_tolerance.enabled=true",
            ),
        ),
    ),
    Claim(
        r"are refused with `parallel.fault_tolerance`",
        every(
            refused(FT, "parallel.strategy=fsdp"),
            refused(
                ["parallel.strategy=hsdp", "parallel.replicate=2", FT[1]],
                "parallel.sharding=no_shard",
            ),
            refused(FT, "parallel.pp=2"),
            refused([*FT, "model.preset=debug-moe"], "parallel.ep=2"),
            refused(FT, "parallel.sharding=optimizer"),
            refused(FT, "parallel.compression=powersgd"),
        ),
    ),
    Claim(
        r"A config that needs more than one process \(for example `parallel.strategy: hsdp`",
        every(
            refused(["parallel.strategy=hsdp", "parallel.replicate=2"], world=1, base_world=4),
            tested(
                "tests/test_api.py", "test_python_train_refuses_a_config_that_needs_more_processes"
            ),
        ),
    ),
    Claim(
        r"before any process starts: FSDP's `no_shard`, DDP\s+with tensor or pipeline parallelism",
        every(
            refused(
                ["parallel.strategy=fsdp", "parallel.cp=2", "data.seq_len=64"],
                "parallel.sharding=no_shard",
            ),
            refused(CP, "parallel.tp=2"),
            refused(CP, "parallel.pp=2"),
        ),
    ),
    # Refusals a run makes (a run directory, a checkpoint, data, an export, a launch): the tests
    # that prove each.
    Claim(
        r"pointed at the same directory is refused before it starts any process",
        tested("tests/test_rundir_advice.py", "test_run_dir_in_use_advice_works"),
    ),
    Claim(
        r"Refused with a message that says what the directory holds",
        tested(
            "tests/test_rundir_advice.py",
            "test_resume_from_another_runs_checkpoint_advice_works",
            "test_resume_of_an_earlier_step_advice_works",
        ),
    ),
    Claim(
        r"\*\*Unsafe changes are refused\*\*",
        tested("tests/test_checkpoint.py", "test_unsafe_config_change_is_refused"),
    ),
    Claim(
        r"a DiLoCo checkpoint resumes on the layout that saved it; another one is refused",
        tested(
            "tests/test_cp_diloco.py", "test_a_diloco_checkpoint_resumes_on_its_own_cp_layout_only"
        ),
    ),
    Claim(
        r"A tokenizer with more ids than `model.vocab_size` is refused",
        holds("src/dtlab/data/tokenizer.py", r"must be at least that", "the tokenizer's refusal"),
    ),
    Claim(
        r"A split that would be empty is refused",
        tested("tests/test_eval.py", "test_an_empty_split_is_a_clear_error"),
    ),
    Claim(
        r"a group whose ranks would span nodes is refused",
        holds("src/dtlab/deploy.py", r"(?i)span", "the launch's refusal of a group across nodes"),
    ),
    Claim(
        r"More group ranks than GPUs is refused before any process starts",
        tested(
            "tests/test_gpu_placement.py",
            "test_more_group_ranks_than_gpus_is_refused_unless_gloo_shares_them",
        ),
    ),
    Claim(
        r"each rank refuses to start without `run.dir`",
        holds(
            "src/dtlab/mlx/train.py",
            r"run\.dir must be set when MLX ranks are started by mlx\.launch directly",
            "the MLX rank's refusal without run.dir",
        ),
    ),
    Claim(
        r"Refused, with the reason, because the class would compute other logits",
        tested("tests/test_moe_outputs.py", "test_what_qwen2_moe_cannot_compute_is_refused"),
    ),
    Claim(
        r"a real Qwen1.5-MoE, whose shared expert is gated, is refused",
        tested("tests/test_moe_outputs.py", "test_what_qwen2_moe_cannot_compute_is_refused"),
    ),
    Claim(
        r"an export whose trained bias is not zero is refused",
        tested("tests/test_moe_outputs.py", "test_what_qwen2_moe_cannot_compute_is_refused"),
    ),
    Claim(
        r"more processes per node than GPUs is refused before anything starts",
        tested(
            "tests/test_hang_nccl.py",
            "test_more_processes_than_gpus_are_refused_naming_both",
            "test_launch_refuses_a_job_with_more_processes_than_gpus_per_node",
        ),
    ),
    Claim(
        r"a new run is refused in it\); it is offered where it works",
        tested("tests/test_rundir_advice.py", "test_new_run_in_a_finished_run_dir_advice_works"),
    ),
    Claim(
        r"Refused with a `dtlab.errors.DtlabError` that names the value|leaves no room for them in "
        r"the model's context \(`model.max_seq_len`\) is refused",
        tested(
            "tests/test_generate.py",
            "test_cli_bad_inputs_fail_in_one_line",
            "test_api_bad_options_are_named",
        ),
    ),
    Claim(
        r"Every pair of dtlab's features, as the config checks them",
        tested("tests/test_pairs.py", "test_the_table_in_the_docs_is_the_configs"),
    ),
    Claim(
        r"are\s+refused with the engine's allowed values",
        tested(
            "tests/test_docs_claims.py",
            "test_what_mlx_md_says_the_engine_refuses_is_what_the_config_refuses",
        ),
    ),
    # Unexplained measurements: nothing to probe.
    Claim(r"not yet understood \(not counting the", nothing, "open"),
    Claim(r"the cause is not found yet", nothing, "open"),
    # "yet" and "so far" that claim nothing of dtlab.
    Claim(r"momentum not yet sent", nothing, "prose"),
    Claim(r"the list does not name yet|modules it does not\s+name yet", nothing, "prose"),
    Claim(r"nothing of its own reduced yet|every gradient not yet reduced", nothing, "prose"),
    Claim(r"\(until then they were materialised", nothing, "prose"),
]
