"""Claims the docs make about what dtlab can do and what it measured, checked against the code and
the recorded measurements:

- a capability table's strategies are the ones the config accepts; so are docs/mlx.md's list of
  what the MLX engine refuses and the README's layouts beside expert parallelism;
- a family table's classes are the ones the code writes; every default a page gives is the code's;
- every figure of the test tiers is one tests/tiers.json records; every figure of the README's
  feature rows is in the page the row links, and its GPUs row names the cards docs/gpu.md reports;
- every sentence saying dtlab does not do something (yet), or refuses a setting, has a probe that
  still finds it so (tests/docs_claims.py).

Each checker is also run on stale sentences the docs once held, taken from the repository's
history, and must catch them."""

from __future__ import annotations

import hashlib
import re
import typing
from pathlib import Path

import pytest
import yaml

from docs_claims import (
    CLAIMS,
    TIERS,
    check_gap_sentences,
    check_tier_figures,
    fast_listed,
    load_tiers,
    sentences,
)
from dtlab.config import Config, check_world, load_config
from dtlab.config.loading import describe_fields
from dtlab.errors import ConfigError
from dtlab.models.families import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STRATEGIES = ("single", "ddp", "fsdp", "hsdp")

# compression.md's table: the method, and the settings that turn it on.
METHODS = {
    "`fp16`, `bf16`": ["parallel.compression=bf16"],
    "`powersgd`": ["parallel.compression=powersgd"],
    "`dct`": ["parallel.compression=dct"],
    "`parallel.diloco`": ["parallel.diloco.inner_steps=2", "parallel.diloco.replicas=2"],
    "`train.optimizer: demo`": ["train.optimizer=demo"],
}

# make test-fast as the issue that found the docs stale measured it: 5 min 39 s.
MEASURED_BY_THE_ISSUE = {"test-fast": {"measurements": [{"seconds": 339}]}}

# Stale sentences the docs held, as the repository's history has them (a commit where each was
# there; a long one abridged around its claim), and what the checkers must say of them.
STALE_TIER_LINES = [
    # README.md at 3304250 (make test-fast then took 5 min 39 s, and 6 min 45 s at 3d62876).
    ("README.md", "```bash\nmake test-fast  # a quick part of every test module, about 2 minutes, "
     "for the edit loop\n```", MEASURED_BY_THE_ISSUE, "about 2 minutes"),
    # docs/development.md at 8004ad2.
    ("docs/development.md", "```bash\nmake test-fast     # a quick part of every test module: "
     "1,937 of 2,136 tests, 1 min 45 s\n```", MEASURED_BY_THE_ISSUE, "1 min 45 s"),
    ("docs/development.md", "```bash\nmake test-fast     # a quick part of every test module: "
     "1,937 of 2,136 tests, 1 min 45 s\n```", None, "1,937 tests"),
    # The Makefile at 3304250: its help and the target's comment.
    ("Makefile", '\t@echo "make test        the test suite but its longest tests (real gloo '
     "processes on CPU); make test-all: all of it; make test-fast: a quick part of every test "
     'module (~2 min)"\n', MEASURED_BY_THE_ISSUE, "~2 min"),
    ("Makefile", "# A quick test or more of every test module (tests/fast.txt, chosen by "
     "tests/pick_fast.py from the\n# measured durations): about 2 minutes, for the edit loop. make "
     "test runs everything.\ntest-fast: install-dev\n", MEASURED_BY_THE_ISSUE, "about 2 minutes"),
    # docs/development.md at f0876d2 (README said 3,334 tests and about 19 min of slow ones).
    ("docs/development.md", "```bash\nmake test-all      # every test, the longest too (marked "
     "slow): 2,903 tests, about 60 min\n```", None, "about 60 min"),
]  # fmt: skip
STALE_GAP_SENTENCES = [
    # docs/choosing.md at e84b49d^, beside docs/gpu.md's H100 and H200 reports.
    ("docs/choosing.md", "- **Measured**: taken with `dtlab bench` on the development machine "
     "(AMD EPYC, 2 cores, 24 GiB, torch 2.13\n  CPU, gloo), from [performance](performance.md) and "
     "[compression](compression.md). No GPU figures have\n  been measured yet; on a GPU, check a "
     "plan with `dtlab bench` (see [benchmarking](benchmarking.md)).", "passed train check"),
    # docs/configuration.md at d05c265^.
    ("docs/configuration.md", "The three large shapes are for building on the meta device (and "
     "for planning, once the plan models\nexperts). What dtlab's model cannot express of them: "
     "Qwen3's 32 query heads of 128.", "dtlab plan models the experts"),
    # docs/planning.md at f0876d2.
    ("docs/planning.md", "- **Fault tolerance's part of the step**: the groups' average runs "
     "through torchft. The check runs a rank as one replica group on its own and says so in\n  its "
     "note; neither the plan nor the check counts that part yet.", "planned as a moment"),
    # README.md's long sequences at f0876d2 (HSDP, TP, PP, DiLoCo and fault tolerance composed).
    ("README.md", "| Long sequences | context parallelism (`parallel.cp`): each sequence split "
     "over ranks in zigzag chunks; over DDP's or FSDP's ranks (sharded over data x cp, tensor "
     "parallelism inside FSDP's) (a mixture of experts too; document masks too) so far, equal to "
     "one process |", "the config accepts parallel.cp=2"),
    # docs/long-context.md at 31aeb16 (no_shard, and DDP beside tp or pp, later composed with cp).
    ("docs/long-context.md", "Refused with the reason when the config is validated, before any "
     "process starts: FSDP's `no_shard`, DDP\nwith tensor or pipeline parallelism (FSDP2's "
     "replication over a mesh that does not take cp yet), an\n`ep` that does not divide the data x "
     "cp ranks, ZeRO-1, gradient compression, and the MLX engine.",
     "the config accepts parallel.sharding=no_shard"),
    # docs/gpu.md at f0876d2 (gpu-check runs its layouts and a killed rank on two GPUs).
    ("docs/gpu.md", "Not yet built for several GPUs: `make gpu-check` fails where torch cannot "
     "see the node's GPUs, but uses one GPU (no NCCL bus bandwidth or layout verification across "
     "the node's GPUs).", "a check of the layouts on two GPUs"),
    # docs/long-context.md at 2446102 (the ring on the CPU's kernel alone).
    ("docs/long-context.md", "The ring runs on the CPU's attention kernel "
     "(`aten._scaled_dot_product_flash_attention_for_cpu`,\nwhich returns the log-sum-exp); CUDA's "
     "flash and memory-efficient kernels return it too, but their calls\nare not wired yet, so the "
     "ring on a GPU is refused when the run starts (`alltoall` runs on any device's\nattention, on "
     "the kernel the model's own attention picks).", "the ring's CUDA kernels"),
    ("docs/long-context.md", "Not yet: the search does not weigh context parallelism against "
     "layouts that fit without it, nor try the\nring on a GPU (it runs on the CPU's kernel so far; "
     "its overlap is not modelled either).", "the ring's CUDA kernels"),
    # docs/long-context.md and README.md at 619c75a (before the ring was planned on a GPU's kernels).
    ("docs/long-context.md", "Not yet: the search does not weigh context parallelism against "
     "layouts that fit without it, nor try the\nring on a GPU (its memory and time on a GPU's "
     "kernels are not planned yet; its overlap is not modelled\neither).",
     "the plan's refusal of the ring on a GPU"),
    ("README.md", "Long sequences: the ring on the device's fused attention kernel (a GPU's not yet "
     "run, nor planned: the plan uses all-to-all there).", "the plan's refusal of the ring on a GPU"),
    # docs/gpu.md at 9672b6f (before the collectives' bus bandwidth).
    ("docs/gpu.md", "Not yet built for several GPUs: DiLoCo's host copies still run on the compute "
     "stream; `dtlab plan --device this` on a GPU node measures the GPU's GEMM and\nmemory but not "
     "the NCCL bandwidth among its GPUs; `make gpu-check` fails where torch cannot see the node's "
     "GPUs, but uses one GPU, or two for its layouts (`ddp:2`, `fsdp:2`, `tp:2`) and its killed "
     "rank (no NCCL bus bandwidth, nothing across more of the node's GPUs).",
     "the plan's measurement of the bus bandwidth among a node's GPUs"),
]  # fmt: skip
# docs/compression.md's DiLoCo row at e84b49d^.
STALE_DILOCO_ROW = (
    "| `parallel.diloco` | single, ddp | every H steps, per fragment: a float32 all-reduce | "
    "each replica's weights |"
)


def _accepts(strategy: str, overrides: list[str]) -> bool:
    """Whether a 4-process run of ``strategy`` with ``overrides`` is a valid config."""
    extra = ["parallel.replicate=2"] if strategy == "hsdp" else []
    world = 1 if strategy == "single" else 4
    return _valid([f"parallel.strategy={strategy}", *extra, *overrides], world)


def _claimed(cell: str) -> set[str]:
    """The strategies a table cell names (what follows in parentheses is a remark)."""
    words = re.split(r"[,\s]+", cell.split("(")[0])
    return {w for w in words if w in STRATEGIES}


def _compression_row_error(method: str, row: str) -> str | None:
    """What is wrong with compression.md's row of ``method`` (None: its strategies are the ones
    the config accepts)."""
    claimed = _claimed(row.split("|")[2])
    accepted = {s for s in STRATEGIES if _accepts(s, METHODS[method])}
    if claimed == accepted:
        return None
    return f"docs/compression.md says {method} runs on {sorted(claimed)}: {sorted(accepted)}"


@pytest.mark.parametrize("method", METHODS)
def test_compression_tables_strategies_are_what_the_config_accepts(method: str) -> None:
    text = (ROOT / "docs" / "compression.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith(f"| {method} |"))
    assert _compression_row_error(method, row) is None


def test_the_compression_check_catches_diloco_listed_for_single_and_ddp_only() -> None:
    error = _compression_row_error("`parallel.diloco`", STALE_DILOCO_ROW)
    assert error is not None and "'fsdp', 'hsdp'" in error


def test_the_families_table_names_the_classes_the_code_writes() -> None:
    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `(\w+)` \| `(\w+)` \|", text, flags=re.MULTILINE)
    }
    assert rows == {f.name: f.hf_class for f in FAMILIES.values()}


# docs/mlx.md's list of what the engine refuses, at 3c1a266 (it named demo; sgd and muon are
# refused too).
STALE_MLX_LIST = (
    "`parallel.strategy` `hsdp`, `parallel.compression`, `train.optimizer: demo`, "
    "`train.precision: fp16`,\n`train.activation_checkpointing: selective` and "
    "`train.device: cuda` "
    "are refused with the engine's\nallowed values."
)
NAMED = re.compile(
    r"`(?P<key>[a-z_]+\.[a-z_]+)(?:: (?P<value>\w+))?`(?P<more>(?: `\w+`(?:/`\w+`)*)?)"
)


def _choices(key: str) -> list[str]:
    """The values a config key whose type is a Literal takes."""
    model: typing.Any = Config
    *path, last = key.split(".")
    for part in path:
        model = model.model_fields[part].annotation
    return [str(v) for v in typing.get_args(model.model_fields[last].annotation)]


def _valid(overrides: list[str], world: int) -> bool:
    """Whether ``overrides`` make a valid config for ``world`` processes."""
    try:
        check_world(load_config(None, overrides), world)
    except (ConfigError, ValueError):
        return False
    return True


def _mlx_refuses(key: str, value: str) -> bool:
    """Whether the MLX engine refuses ``key=value`` that the torch engine takes (on 1, 2 or 4
    processes, as the value needs)."""
    layout = {"parallel.compression": ["parallel.strategy=ddp"], "parallel.strategy": []}.get(
        key, []
    )
    world = {"ddp": 2, "fsdp": 2, "hsdp": 4}.get(value, 2 if layout else 1)
    overrides = [*layout, f"{key}={value}"] + (["parallel.replicate=2"] if value == "hsdp" else [])
    assert _valid(overrides, world), overrides
    return not _valid([*overrides, "train.engine=mlx"], world)


def _mlx_list_errors(text: str) -> list[str]:
    """For each config key docs/mlx.md's list names, the values it says the engine refuses against
    those the config refuses (a key named alone: every value but its default)."""
    errors = []
    for m in NAMED.finditer(text):
        key = m.group("key")
        default = str(load_config(None, []).model_dump()[key.split(".")[0]][key.split(".")[1]])
        named = set(re.findall(r"`(\w+)`", m.group("more"))) | ({m.group("value")} - {None})
        if not named:
            named = set(_choices(key)) - {default}
        refused = {v for v in _choices(key) if v != default and _mlx_refuses(key, v)}
        if named != refused:
            errors.append(
                f"{key}: docs/mlx.md names {sorted(named)}, the config refuses {sorted(refused)}"
            )
    return errors


def _mlx_list() -> str:
    text = (ROOT / "docs" / "mlx.md").read_text(encoding="utf-8")
    section = text.split("## Not supported", 1)[1].split("\n## ", 1)[0]
    return re.split(r"are\s+refused with the engine's", section, maxsplit=1)[0]


def test_what_mlx_md_says_the_engine_refuses_is_what_the_config_refuses() -> None:
    text = _mlx_list()
    assert len(NAMED.findall(text)) >= 5, text
    assert not _mlx_list_errors(text)


def test_the_mlx_list_check_catches_a_value_left_out() -> None:
    assert _mlx_list_errors(STALE_MLX_LIST) == [
        "train.optimizer: docs/mlx.md names ['demo'], the config refuses ['demo', 'muon', 'sgd']"
    ]


# The README's MoE row: the layouts expert parallelism runs beside, by name.
MOE_LAYOUTS = {
    "DDP": (["parallel.strategy=ddp"], 2),
    "FSDP": (["parallel.strategy=fsdp"], 2),
    "HSDP": (["parallel.strategy=hsdp", "parallel.replicate=2"], 4),
    "TP": (["parallel.strategy=ddp", "parallel.tp=2"], 4),
    "PP": (["parallel.strategy=ddp", "parallel.pp=2"], 4),
    "CP": (["parallel.strategy=ddp", "parallel.cp=2", "data.seq_len=64"], 4),
}


def test_the_readmes_moe_row_names_layouts_expert_parallelism_runs_beside() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| Mixture of experts |"))
    m = re.search(r"\(`parallel\.ep`[^)]*\) beside ([A-Z, ]+ and [A-Z]+)", row)
    assert m, row
    named = re.findall(r"[A-Z]+", m.group(1))
    assert set(named) <= set(MOE_LAYOUTS), named
    moe = ["model.preset=debug-moe", "parallel.ep=2"]
    refused = [n for n in named if not _valid([*moe, *MOE_LAYOUTS[n][0]], MOE_LAYOUTS[n][1])]
    assert not refused, f"README.md: expert parallelism beside {refused} is refused"


# A measured figure: a number with its unit, or in scientific notation.
FIGURE = re.compile(
    r"(?<![\w.])(?:\d+(?:\.\d+)?e-\d+"
    r"|\d+(?:[.,]\d+)*\s?(?:%|x\b|GiB|MiB|GB|ms\b|s\b|TFLOP/s|tokens/s))"
)


def _unsourced_figures(row: str) -> list[str]:
    """The figures of a README row that the pages it links (without a link: any page of docs/) do
    not give."""
    links = re.findall(r"\]\((docs/[\w-]+\.md)", row)
    pages = [ROOT / link for link in links] or sorted((ROOT / "docs").glob("*.md"))
    text = " ".join(page.read_text(encoding="utf-8") for page in pages)
    return [f for f in FIGURE.findall(row) if f not in text and f.replace(" ", "") not in text]


def _feature_rows() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return [ln for ln in readme.splitlines() if ln.startswith("| ") and not ln.startswith("| |")]


def test_every_figure_of_the_readmes_features_is_in_the_page_it_links() -> None:
    rows = _feature_rows()
    assert sum(len(FIGURE.findall(row)) for row in rows) >= 3
    unsourced = {row.split("|")[1].strip(): _unsourced_figures(row) for row in rows}
    assert not {k: v for k, v in unsourced.items() if v}


def test_the_readme_figure_check_catches_a_figure_its_page_does_not_give() -> None:
    row = next(row for row in _feature_rows() if row.startswith("| GPUs |"))
    assert _unsourced_figures(row.replace("64.6%", "66.4%")) == ["66.4%"]


def test_the_readmes_gpu_row_names_the_cards_docs_gpu_md_reports_and_one_gpu_each() -> None:
    reports = (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8")
    cards = re.findall(r"\b(one|two|\d+)\s+NVIDIA ([A-Z]\w*\d+)", reports)
    row = next(row for row in _feature_rows() if row.startswith("| GPUs |"))
    assert cards and {n for n, _ in cards} == {"one"}, cards
    assert set(re.findall(r"\b([AHL]\d{2,3})\b", row)) == {card for _, card in cards}, row
    assert re.search(r"\brun on one GPU\b", row) and re.search(
        r"Nothing with two GPUs or more", row
    )


DEFAULTS = {key: default for key, default, _ in describe_fields()}
# "`parallel.collective_timeout_s` (default 600 s)", "(10 minutes by default)", "(120 s by
# default)".
PROSE_DEFAULT = re.compile(
    r"`(?P<key>[a-z_]+(?:\.[a-z_]+)+)` \((?:default `?(?P<value>[\w.-]+)`?(?P<unit> s| minutes)?"
    r"|(?P<n>[\d.]+)(?P<by_unit> s| minutes) by default)\)"
)


def _same(doc: str, code: str, minutes: bool = False) -> bool:
    """Whether a default as the docs write it is the code's (YAML values; minutes in seconds)."""
    a, b = yaml.safe_load(doc), yaml.safe_load(code)
    try:
        return float(a) * (60 if minutes else 1) == float(b)
    except (TypeError, ValueError):
        return a == b


def _default_errors(text: str) -> list[str]:
    """Each default docs/configuration.md's key tables (or a page's prose) give that is not the
    code's."""
    errors, section = [], None
    for number, line in enumerate(text.splitlines(), 1):
        heading = re.match(r"^### `(\w+)`", line)
        if heading or line.startswith("## "):
            section = heading.group(1) if heading else None
        row = re.match(r"^\| `(\w+)` \| (?:[^|\\]|\\\|)* \| `([^`]*)`", line)
        if row and section:
            keys = [k for k in DEFAULTS if k.startswith(f"{section}.") and k.endswith(f".{row[1]}")]
            if len(keys) != 1:
                errors.append(f"{number}: `{row[1]}` under `{section}` is {keys or 'no key'}")
            elif not _same(row[2], DEFAULTS[keys[0]]):
                errors.append(f"{number}: {keys[0]} defaults to {DEFAULTS[keys[0]]}, not {row[2]}")
        for m in PROSE_DEFAULT.finditer(line):
            value, unit = m["value"] or m["n"], m["unit"] or m["by_unit"]
            if m["key"] not in DEFAULTS:
                errors.append(f"{number}: {m['key']} is no config key")
            elif not _same(value, DEFAULTS[m["key"]], minutes=unit == " minutes"):
                errors.append(f"{number}: {m['key']} defaults to {DEFAULTS[m['key']]}, not {m[0]}")
    return errors


def test_every_default_the_docs_give_is_the_codes() -> None:
    table = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert len(re.findall(r"^\| `\w+` \|.*\| `[^`]*`", table, re.M)) >= 100
    errors = {
        str(doc.relative_to(ROOT)): _default_errors(doc.read_text(encoding="utf-8")) for doc in DOCS
    }
    prose = sum(len(PROSE_DEFAULT.findall(doc.read_text(encoding="utf-8"))) for doc in DOCS)
    assert prose >= 3
    assert not {k: v for k, v in errors.items() if v}


def test_the_default_check_catches_a_default_the_code_no_longer_has() -> None:
    text = "### `parallel`\n\n| `collective_timeout_s` | float | `300` | seconds |\n"
    text += "A rank waits `parallel.collective_timeout_s` (5 minutes by default).\n"
    assert _default_errors(text) == [
        "3: parallel.collective_timeout_s defaults to 600.0, not 300",
        "4: parallel.collective_timeout_s defaults to 600.0, not "
        "`parallel.collective_timeout_s` (5 minutes by default)",
    ]


def _tier_sources() -> list[Path]:
    return [*DOCS, ROOT / "Makefile"]


def test_every_test_tier_figure_the_docs_give_is_the_recorded_measurement() -> None:
    tiers = load_tiers()
    problems = [
        str(p)
        for path in _tier_sources()
        for p in check_tier_figures(
            str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"), tiers
        )
    ]
    assert not problems, "\n".join(problems)


def test_the_recorded_test_fast_time_is_of_todays_fast_list() -> None:
    fast = ROOT / "tests" / "fast.txt"
    record = load_tiers()["test-fast"]
    assert record["tests"] == fast_listed(fast), (
        f"tests/fast.txt names {fast_listed(fast)} tests, {TIERS.name} {record['tests']}"
    )
    digest = hashlib.sha256(fast.read_bytes()).hexdigest()
    assert record["fast_txt_sha256"] == digest, (
        f"tests/fast.txt changed since make test-fast was timed: time it again and write its "
        f"figures and sha256 {digest} in {TIERS.name}"
    )


def test_a_slow_tier_id_its_module_no_longer_has_is_named() -> None:
    """A test renamed (or a parameter's id changed) leaves its line in tests/slow.txt marking
    nothing, and the test runs in make test unmarked: conftest names such a line when its module is
    collected, so that make test stops on it. A module not collected says nothing of its ids."""
    from conftest import stale_ids

    collected = ["tests/test_a.py::test_x[int8-1]", "tests/test_a.py::test_y"]
    listed = {"tests/test_a.py::test_x[int8]", "tests/test_a.py::test_y", "tests/test_b.py::test_z"}
    assert stale_ids(listed, collected) == ["tests/test_a.py::test_x[int8]"]


def test_make_test_stays_under_the_20_minutes_development_md_allows() -> None:
    # docs/development.md: "it must stay under 20 minutes with the install and make check".
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    assert "must stay under 20 minutes with the install" in text
    latest = load_tiers()["test"]["measurements"][0]
    assert latest["with_install_seconds"] < 20 * 60, latest


@pytest.mark.parametrize(
    ("where", "text", "record", "caught"),
    STALE_TIER_LINES,
    ids=[f"{w}-{c}" for w, _, _, c in STALE_TIER_LINES],
)
def test_the_tier_check_catches_the_stale_figures(
    where: str, text: str, record: dict | None, caught: str
) -> None:
    problems = check_tier_figures(where, text, record or load_tiers())
    assert any(caught in p.why for p in problems), [str(p) for p in problems]


def test_every_sentence_saying_dtlab_does_not_do_something_yet_is_probed() -> None:
    problems = [
        str(p)
        for path in DOCS
        for p in check_gap_sentences(
            str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"), CLAIMS
        )
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("where", "text", "caught"),
    STALE_GAP_SENTENCES,
    ids=[w for w, _, _ in STALE_GAP_SENTENCES],
)
def test_the_gap_check_catches_the_stale_sentences(where: str, text: str, caught: str) -> None:
    problems = check_gap_sentences(where, text, CLAIMS)
    assert any(caught in p.why for p in problems), [str(p) for p in problems]


def test_an_unprobed_gap_sentence_is_named_with_its_file_and_line() -> None:
    text = "# Title\n\nSome intro.\n\nTraining on a TPU is not yet\nsupported.\n"
    (problem,) = check_gap_sentences("docs/x.md", text, CLAIMS)
    assert (problem.where, problem.line) == ("docs/x.md", 5)
    assert "no probe checks it" in str(problem) and "docs/x.md:5" in str(problem)


def test_every_claim_speaks_of_a_sentence_of_the_docs_or_a_stale_one() -> None:
    said = [s for path in DOCS for _, s in sentences(path.read_text(encoding="utf-8"))]
    said += [s for _, text, _ in STALE_GAP_SENTENCES for _, s in sentences(text)]
    unused = [c.says for c in CLAIMS if not any(re.search(c.says, s, re.I | re.S) for s in said)]
    assert not unused, f"claims no sentence makes (remove them from docs_claims.CLAIMS): {unused}"
