"""What the docs and every ``--help`` quote exists: paths, config keys and ``dtlab`` command lines.

The help texts: ``dtlab``'s, each command's and subcommand's, and the benchmark and GPU-check scripts'
(their module docstrings).

Every path under configs/, docs/ and deploy/ (and every relative Markdown link) names a file; every
``section.key`` names a config key; every quoted ``dtlab ...`` line parses with dtlab's own parser, and
the cheap ones (``dtlab config``, ``dtlab plan`` without ``--check``) run and succeed.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtlab.checkpoint.store import DERIVED_KEYS
from dtlab.cli import main as cli_main
from dtlab.cliargs import parse_config_args
from dtlab.cliparser import build_parser
from dtlab.config import Config, load_config
from dtlab.config.loading import describe_fields
from dtlab.config.suggest import KEY_SYNONYMS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KEYS = {key for key, _, _ in describe_fields()}
SECTIONS = sorted({key.split(".")[0] for key in KEYS})
# Groups of keys quoted as a whole (``parallel.diloco``, ``parallel.compression_options``).
GROUPS = {key.rsplit(".", 1)[0] for key in KEYS if key.count(".") == 2}

# A line that shows a mistake and what dtlab answers: its keys and commands are wrong on purpose.
MISTAKE = re.compile(r"error:|unknown key '|did you mean|is refused|refuses", re.I)
PATH = re.compile(r"(?<![\w./-])((?:configs|docs|deploy|scripts)/[\w./-]*\w)")
KEY = re.compile(
    r"(?<![\w./$-])((?:" + "|".join(SECTIONS) + r")(?:\.[a-z][a-z0-9_]*)+)(?!\.?[\w(/-])"
)
# Dotted words that are file names or Python names, not config keys.
NOT_KEYS = re.compile(r"\.(py|sh|md|ya?ml|jsonl?|safetensors|txt|png|csv|bin|pt|parquet|sbatch)$")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
COMMANDS = ("train", "config", "bench", "launch", "plan", "export", "verify", "generate")
COMMAND = re.compile(
    r"(^\s*|`|\$ |-m )(dtlab (?:" + "|".join(COMMANDS) + r")\b(?:[^`\n#>|&]*[^`\n#>|&\s])?)"
)


def _help_texts() -> Iterator[tuple[str, str]]:
    """(``dtlab ... --help``, its text) for the top parser and every command and subcommand."""

    def walk(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, str]]:
        # Unwrapped (whatever the terminal's width): a quote is never split over two lines.
        formatter = parser.formatter_class(prog=parser.prog, width=100_000)  # type: ignore[call-arg]
        parser._get_formatter = lambda: formatter  # type: ignore[method-assign]
        yield f"`{name} --help`", parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    yield from walk(p, f"{name} {sub}")

    yield from walk(build_parser(), "dtlab")


def _script_docs() -> Iterator[tuple[str, str]]:
    """The module docstrings that ``python -m dtlab.X --help`` prints (the scripts' parsers take their
    module's docstring as the description), read without importing them."""
    for path in sorted((ROOT / "src" / "dtlab").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        if "script_parser(" in source or "argparse.ArgumentParser(" in source:
            doc = ast.get_docstring(ast.parse(source), clean=False)
            if doc and path.name not in ("cliparser.py", "cliargs.py"):
                yield str(path.relative_to(ROOT)), doc


def _sources() -> list[tuple[str, str]]:
    return [
        *((str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in DOCS),
        *_help_texts(),
        *_script_docs(),
    ]


def _lines() -> Iterator[tuple[str, int, str, bool]]:
    """(where, line number, line, in a code block); a shell line continued with a backslash is one
    line. A help text's indented lines are its examples: code."""
    for where, text in _sources():
        held, start, fenced = "", 0, False
        for i, line in enumerate(text.splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced
                continue
            if line.endswith("\\"):
                held, start = held + line[:-1] + " ", start or i
                continue
            code = fenced or (where.startswith("`") and line.startswith("  "))
            yield where, start or i, held + line, code
            held, start = "", 0


def quoted_paths(line: str) -> list[str]:
    """The repository paths a line names (a trailing ``.`` or ``,`` is punctuation)."""
    return [m.rstrip(".,") for m in PATH.findall(line) if "*" not in m and "<" not in m]


def quoted_keys(line: str) -> list[str]:
    """The ``section.key`` words of a line that are meant as config keys."""
    return [k for k in KEY.findall(line) if not NOT_KEYS.search(k)]


def quoted_commands(line: str, code: bool) -> list[tuple[str, bool]]:
    """The ``dtlab ...`` commands a line quotes (up to a comment, a pipe or a redirection), each with
    whether it is a whole command line (in code) or a command named in prose (in backticks)."""
    found = []
    for m in COMMAND.finditer(line):
        words = m.group(2).strip()
        whole = code and m.group(1) != "`"
        # A synopsis (``dtlab train [CONFIG] ...``) or a placeholder (``dtlab generate RUN_DIR``) is
        # not a command to run.
        if whole and re.search(r"\[|\.\.\.|\b[A-Z][A-Z_]*\b|<\w", words):
            continue
        if not whole and m.group(1) != "`":
            continue  # prose outside backticks: "dtlab trains ..."
        found.append((words, whole))
    return found


def test_quoted_paths_exist() -> None:
    missing = [
        f"{where}:{i}: {p}"
        for where, i, line, _ in _lines()
        for p in quoted_paths(line)
        if not (ROOT / p).exists() and not MISTAKE.search(line)
    ]
    assert not missing, "quoted paths that do not exist:\n" + "\n".join(missing)


def test_relative_links_exist() -> None:
    missing = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


def test_quoted_config_keys_exist() -> None:
    unknown = [
        f"{where}:{i}: {k}"
        for where, i, line, _ in _lines()
        for k in quoted_keys(line)
        # Other trainers' names are quoted as what dtlab answers with its own (dtlab.config.suggest).
        if k not in {*KEYS, *GROUPS, *SECTIONS, *DERIVED_KEYS, *KEY_SYNONYMS}
        and not MISTAKE.search(line)
    ]
    assert not unknown, "quoted config keys that are not keys:\n" + "\n".join(unknown)


def _commands(whole: bool) -> list[tuple[str, str]]:
    """(where first quoted, command) of the whole command lines (or of the commands named in prose)."""
    seen: dict[str, str] = {}
    for where, i, line, code in _lines():
        if MISTAKE.search(line):
            continue
        for command, is_whole in quoted_commands(line, code):
            if is_whole == whole:
                seen.setdefault(command, f"{where}:{i}")
    return [(where, command) for command, where in seen.items()]


def test_docs_quote_commands() -> None:
    """The extraction finds the commands (a regex that matched nothing would check nothing)."""
    commands = [c for _, c in _commands(whole=True)]
    assert len(commands) >= 40
    for expected in ("dtlab train configs/fsdp.yaml --nproc 2", "dtlab config --keys"):
        assert expected in commands
    assert len(_commands(whole=False)) >= 20


@pytest.mark.parametrize(("where", "command"), _commands(whole=True))
def test_quoted_command_line_parses(where: str, command: str) -> None:
    """A whole command line parses, names files that exist, and its CONFIG and --set load."""
    argv = shlex.split(command)[1:]
    try:
        args = parse_config_args(build_parser(), argv)
    except SystemExit as e:
        pytest.fail(f"{where}: `{command}` does not parse (exit {e.code})")
    config = getattr(args, "config", None)
    if config is not None and config.endswith((".yaml", ".yml")):
        assert (ROOT / config).is_file(), f"{where}: {config} does not exist"
    if config is None or (ROOT / config).is_file():
        load_config(config and ROOT / config, getattr(args, "overrides", []))


def _subparser(words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of the (sub)command ``words`` starts with, and the words after it."""
    parser = build_parser()
    while words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        parser, words = subs[0].choices[words[0]], words[1:]
    return parser, words


@pytest.mark.parametrize(("where", "command"), _commands(whole=False))
def test_command_named_in_prose_exists(where: str, command: str) -> None:
    """``dtlab export --format hf`` in a sentence: the command exists and takes every flag named."""
    parser, rest = _subparser(shlex.split(command)[1:])
    flags = {s for a in parser._actions for s in a.option_strings}
    named = [w.partition("=")[0] for w in rest if w.startswith("--")]
    assert set(named) <= flags, (
        f"{where}: `{command}`: {sorted(set(named) - flags)} not flags of it"
    )
    assert parser.prog != "dtlab", f"{where}: `{command}` names no dtlab command"


def _cheap(command: str) -> bool:
    argv = shlex.split(command)[1:]
    if any(w.startswith("runs/") for w in argv):
        return False  # a run of the reader's own
    return argv[0] == "config" or (
        argv[0] == "plan" and "--check" not in argv and "this" not in argv
    )


@pytest.mark.parametrize("command", sorted({c for _, c in _commands(whole=True) if _cheap(c)}))
def test_cheap_quoted_commands_succeed(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dtlab config`` and ``dtlab plan`` lines run (from the repository root) and succeed."""
    monkeypatch.chdir(ROOT)
    assert cli_main(shlex.split(command)[1:]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "code", "paths", "keys", "commands"),
    [
        ("see `configs/tiny.yaml`.", False, ["configs/tiny.yaml"], [], []),
        ("`train.lr` and train.py", False, [], ["train.lr"], []),
        ("`dtlab train --set train.lr=1e-3`", False, [], ["train.lr"], [("dtlab train --set train.lr=1e-3", False)]),
        ("  dtlab generate runs/x --prompt a > out.txt   # greedy", True, [], [], [("dtlab generate runs/x --prompt a", True)]),
        ("$ dtlab plan --nproc 2", True, [], [], [("dtlab plan --nproc 2", True)]),
        ("dtlab train [CONFIG] --nproc N", True, [], [], []),
        ("dtlab trains a model", False, [], [], []),
        ("src/dtlab/docs/x.md dtlab.train.lr", False, [], [], []),
    ],
)  # fmt: skip
def test_extraction(
    line: str, code: bool, paths: list[str], keys: list[str], commands: list[tuple[str, bool]]
) -> None:
    assert quoted_paths(line) == paths
    assert quoted_keys(line) == keys
    assert quoted_commands(line, code) == commands


def _help(*command: str) -> str:
    return dict(_help_texts())[f"`{' '.join(['dtlab', *command])} --help`"]


def test_top_level_help_names_every_kind_of_parallelism() -> None:
    text = " ".join(_help().split())
    for name in (
        "DDP",
        "ZeRO-1",
        "FSDP",
        "HSDP",
        "tensor",
        "sequence",
        "pipeline",
        "DiLoCo",
        "DeMo",
    ):
        assert name in text, f"`dtlab --help` does not name {name}"


def test_export_help_names_the_manifests_checksum() -> None:
    from dtlab.checkpoint.manifest import _CHECKSUMS, FORMAT_VERSION

    name = _CHECKSUMS[FORMAT_VERSION][2]
    text = " ".join(_help("export").split())
    assert f"{name} checksums, manifest format {FORMAT_VERSION}" in text


def test_slurm_help_names_the_config_file_it_writes(tmp_path: Path) -> None:
    """The help's example of the config's name, followed: that file is what the command writes."""
    m = re.search(r"\((\w+)\.sbatch -> ([\w.]+)\)", " ".join(_help("launch", "slurm").split()))
    assert m is not None, "`dtlab launch slurm --help` does not say where the config goes"
    script = tmp_path / f"{m.group(1)}.sbatch"
    assert (
        cli_main(["launch", "slurm", str(ROOT / "configs/debug.yaml"), "--out", str(script)]) == 0
    )
    assert (tmp_path / m.group(2)).is_file(), sorted(p.name for p in tmp_path.iterdir())
    assert script.is_file()


def test_demo_run_dirs_quoted_are_what_make_demo_creates() -> None:
    """``make demo`` trains in ``runs/demo-<timestamp>`` (the Makefile's DEMO_DIR): a doc or help that
    names a demo run names one of that form."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "DEMO_DIR ?= runs/demo-$(DEMO_STAMP)" in makefile
    assert "DEMO_STAMP := $(shell date +%Y%m%d-%H%M%S)" in makefile
    made = re.compile(r"runs/demo-(\d{8}-\d{6}|\*|YYYYmmdd-HHMMSS)$")
    wrong = [
        f"{where}:{i}: {m}"
        for where, i, line, _ in _lines()
        for m in re.findall(r"(?<![\w/])runs/demo[\w*-]*", line)
        if not made.match(m) and not MISTAKE.search(line)
    ]
    assert not wrong, "demo run directories make demo never creates:\n" + "\n".join(wrong)


def test_docs_list_every_config_section() -> None:
    """Where a doc lists the config's sections (or quotes the message that does), it lists them all."""
    sections = [name for name in Config.model_fields]
    listed = 0
    for where, i, line, _ in _lines():
        for m in re.finditer(
            r"valid keys in the top level: ([\w, ]+)|Sections are ((?:`\w+`,? ?)+)", line
        ):
            names = re.findall(r"\w+", m.group(1) or m.group(2))
            assert names == sections, f"{where}:{i}: {names}, the config has {sections}"
            listed += 1
    assert listed >= 2


def test_troubleshooting_defines_d_as_the_data_parallel_degree() -> None:
    text = " ".join((ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8").split())
    assert "world size for every strategy" not in text
    assert "D is the data-parallel degree: world size / (`parallel.tp` x `parallel.pp`)" in text


TABLE_ROW = re.compile(r"^\| `dtlab train ([^`]*)` \| `([^`]*)` \|", re.M)


def _troubleshooting_rows() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    return [(a, m) for a, m in TABLE_ROW.findall(text) if "--nproc" not in shlex.split(a)]


def test_troubleshooting_table_is_found() -> None:
    assert len(_troubleshooting_rows()) >= 15


@pytest.mark.parametrize(("args", "quoted"), _troubleshooting_rows())
def test_troubleshooting_messages_are_what_dtlab_prints(
    args: str, quoted: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each config mistake of the table gives the message quoted (``...`` stands for the rest); the
    config is checked by ``dtlab config``, which loads it as ``dtlab train`` does but trains nothing."""
    monkeypatch.chdir(ROOT)
    try:
        code = cli_main(["config", *shlex.split(args)])
    except SystemExit as e:  # a mistake on the command line itself: argparse's exit 2
        code = e.code
    assert code != 0
    printed = capsys.readouterr().err.strip().splitlines()[-1]
    pattern = ".*".join(re.escape(part) for part in quoted.split("..."))
    assert re.fullmatch(pattern, printed), (
        f"docs/troubleshooting.md quotes {quoted!r}; printed {printed!r}"
    )


def test_quoted_modules_and_make_targets_exist() -> None:
    """``python -m dtlab.X`` names a module that runs, ``make X`` a target of the Makefile."""
    import importlib.util

    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M))
    missing, checked = [], 0
    for where, i, line, code in _lines():
        for found in re.findall(r"python -m (dtlab[\w.*]*)", line):
            module = found.rstrip(".")
            if "*" in module:
                continue  # dtlab.bench.*: every benchmark script
            spec = importlib.util.find_spec(module)
            runs = spec is not None and (
                spec.submodule_search_locations is None
                or importlib.util.find_spec(f"{module}.__main__") is not None
            )
            checked += 1
            if not runs:
                missing.append(f"{where}:{i}: python -m {module}")
        for target in (
            re.findall(r"(?:^\s*|`)make ([\w-]+)", line) if code or "`make" in line else []
        ):
            checked += 1
            if target not in targets:
                missing.append(f"{where}:{i}: make {target}")
    assert not missing, "quoted modules or make targets that do not exist:\n" + "\n".join(missing)
    assert checked >= 30  # the docs quote dozens: finding none would check nothing
