"""A cluster's settings for ``dtlab launch slurm``: written once in a site file, given or overridden on
the command line.

A site file is YAML (``--site FILE``); every key is optional::

    partition: gpu
    account: proj42
    qos: high
    exclusive: true                    # whole nodes
    sbatch: ["--mem=0"]                # more #SBATCH options, as sbatch spells them
    modules: [cuda/12.4, nccl/2.21]    # `module load` lines, before anything else runs
    setup: ["source /etc/profile.d/lmod.sh"]   # shell lines run as written (the admin's own)
    env: {NCCL_SOCKET_IFNAME: ib0, NCCL_IB_HCA: mlx5}
    container: {image: nvcr.io#nvidia/pytorch:24.05-py3, runtime: pyxis, mounts: [/scratch]}
    venv: /shared/envs/dtlab           # or python: /shared/envs/dtlab/bin/python
    run_root: /scratch/proj42/runs     # run directories on shared storage

The command line wins over the file for single values; its lists (``--module``, ``--setup``,
``--container-mount``, ``--sbatch``) come after the file's, and its ``--env NAME=VALUE`` replace the
file's value of NAME.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dtlab.errors import ConfigError

_WORD = re.compile(r"^[A-Za-z0-9_.,:@+=/-]+$")  # what an #SBATCH value may hold
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SBATCH_OPTION = re.compile(r"^--[a-z][a-z0-9-]*(=\S+)?$")
_IMAGE = re.compile(r"^\S+$")
_MOUNT = re.compile(r"^[^\s,:]+(:[^\s,:]+){0,2}$")
RUNTIMES = ("pyxis", "apptainer")
# #SBATCH options the script writes itself, and the flag (or key) that sets each: an extra `sbatch`
# option may not repeat one (sbatch would take one of the two values without a word).
_OWN_OPTIONS = {
    "--job-name": "run.name",
    "--nodes": "--nodes",
    "--ntasks-per-node": "--nproc-per-node (one task per node)",
    "--output": "--out",
    "--open-mode": "nothing (append: the log spans requeues)",
    "--requeue": "nothing (always on)",
    "--signal": "--signal-seconds",
    "--gpus-per-node": "--gpus-per-node",
    "--cpus-per-task": "--cpus-per-task",
    "--partition": "--partition or partition:",
    "--time": "--time or time:",
    "--account": "--account or account:",
    "--qos": "--qos or qos:",
    "--exclusive": "--exclusive or exclusive: true",
}


@dataclass(frozen=True)
class Container:
    """The image every task runs in: ``pyxis`` (srun ``--container-image``, enroot) or
    ``apptainer`` (``apptainer exec``); ``mounts`` are ``SRC[:DST[:FLAGS]]``, and the job's config and
    run directory are always mounted at their own paths."""

    image: str
    runtime: str = "pyxis"
    mounts: tuple[str, ...] = ()


@dataclass(frozen=True)
class SiteSettings:
    """What a cluster adds to every job: scheduler options, the environment the tasks run in, and where
    run directories go."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    exclusive: bool = False
    sbatch: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    container: Container | None = None
    python: str | None = None
    venv: str | None = None
    run_root: str | None = None
    source: str = field(default="", compare=False)  # the site file, for messages


# key: what it holds (for the message that lists what is allowed)
_NESTED = {
    "container.image": "an image without whitespace (pyxis: registry#image:tag; apptainer: a path)",
    "container.mounts": "a list of SRC[:DST[:FLAGS]] without whitespace or commas",
    "--container-image": "an image without whitespace",
    "--container-mount": "SRC[:DST[:FLAGS]] without whitespace or commas",
    "--sbatch": "an sbatch option: [--]name or [--]name=value, no whitespace",
    "--module": "a module name: letters, digits, _.,:@+=/-",
}
SITE_KEYS = {
    "partition": "a Slurm partition name",
    "account": "a Slurm account name",
    "qos": "a Slurm QoS name",
    "time": "a time limit, e.g. 4:00:00",
    "exclusive": "true or false (whole nodes)",
    "sbatch": "a list of sbatch options, e.g. ['--mem=0']",
    "modules": "a list of module names (module load)",
    "setup": "a list of shell lines",
    "env": "a mapping NAME: value",
    "container": "a mapping with image, runtime (pyxis or apptainer), mounts",
    "python": "the Python on the nodes that runs dtlab",
    "venv": "a virtual environment on the nodes holding dtlab",
    "run_root": "a directory on shared storage for the run directories",
}
_CONTAINER_KEYS = ("image", "runtime", "mounts")


def _bad(where: str, key: str, value: object, allowed: str) -> ConfigError:
    return ConfigError(f"{where}: {key}: {value!r} is not valid; allowed: {allowed}")


# What one item of a list key may be.
_ITEM = {
    "sbatch": _NESTED["--sbatch"],
    "modules": _NESTED["--module"],
    "setup": "a shell line (a string)",
    "container.mounts": _NESTED["--container-mount"],
}


def _string(
    where: str,
    key: str,
    value: object,
    pattern: re.Pattern[str] | None = None,
    allowed: str | None = None,
) -> str:
    allowed = allowed or SITE_KEYS.get(key) or _NESTED.get(key, key)
    if not isinstance(value, str) or not value or (pattern and not pattern.match(value)):
        raise _bad(where, key, value, allowed)
    return value


def _strings(
    where: str, key: str, value: object, pattern: re.Pattern[str] | None = None
) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _bad(where, key, value, SITE_KEYS.get(key) or _NESTED.get(key, key))
    item = _ITEM.get(key)
    return tuple(_string(where, f"{key}[{i}]", v, pattern, item) for i, v in enumerate(value))


def _sbatch(where: str, key: str, options: list[str]) -> tuple[str, ...]:
    """Extra ``#SBATCH`` options: well-formed, and none that the script sets itself (``key`` names
    them in messages: the site file's key, or the flag)."""
    # The leading -- is optional (a flag's value cannot start with one: ``--sbatch mem=0``).
    options = [o if not isinstance(o, str) or o.startswith("-") else "--" + o for o in options]
    for i, option in enumerate(options):
        label = f"{key}[{i}]" if key == "sbatch" else key
        _string(where, label, option, _SBATCH_OPTION, _NESTED["--sbatch"])
        name = option.split("=", 1)[0]
        if name in _OWN_OPTIONS:
            raise ConfigError(
                f"{where}: {label}: {option!r} is an option dtlab writes itself; set it with "
                f"{_OWN_OPTIONS[name]}"
            )
    return tuple(options)


def _env(where: str, value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise _bad(where, "env", value, SITE_KEYS["env"])
    out = []
    for name, v in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise _bad(where, "env", name, "variable names: letters, digits and _")
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise _bad(where, f"env.{name}", v, "a string or a number")
        out.append((name, str(v)))
    return tuple(out)


def _container(where: str, value: object) -> Container:
    if not isinstance(value, dict):
        raise _bad(where, "container", value, SITE_KEYS["container"])
    for key in value:
        if key not in _CONTAINER_KEYS:
            raise ConfigError(
                f"{where}: unknown key container.{key}; allowed: {', '.join(_CONTAINER_KEYS)}"
            )
    if "image" not in value:
        raise ConfigError(f"{where}: container needs an image (container.image)")
    runtime = value.get("runtime", "pyxis")
    if runtime not in RUNTIMES:
        raise _bad(where, "container.runtime", runtime, " or ".join(RUNTIMES))
    mounts = _strings(where, "container.mounts", value.get("mounts", []), _MOUNT)
    image = _string(where, "container.image", value["image"], _IMAGE)
    return Container(image, runtime, mounts)


def _field(where: str, key: str, value: object) -> object:
    """The checked value of one site key."""
    if key in ("partition", "account", "qos", "time"):
        return _string(where, key, value, _WORD)
    if key == "exclusive":
        if not isinstance(value, bool):
            raise _bad(where, key, value, SITE_KEYS[key])
        return value
    if key == "sbatch":
        if not isinstance(value, list):
            raise _bad(where, key, value, SITE_KEYS[key])
        return _sbatch(where, key, value)
    if key == "modules":
        return _strings(where, key, value, _WORD)
    if key == "setup":
        return _strings(where, key, value)
    if key == "env":
        return _env(where, value)
    if key == "container":
        return _container(where, value)
    return _string(where, key, value)  # python, venv, run_root: paths


def site_from_dict(data: object, where: str = "site") -> SiteSettings:
    """Checked settings from a parsed site file; unknown keys and wrong types are errors that name the
    key and what it may hold."""
    if data is None:
        return SiteSettings(source=where)
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: a site file is a mapping of keys; allowed: {', '.join(SITE_KEYS)}"
        )
    values = {}
    for key, value in data.items():
        if key not in SITE_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}; allowed: {', '.join(SITE_KEYS)}")
        values[key] = _field(where, key, value)
    if "python" in values and "venv" in values:
        raise ConfigError(f"{where}: python and venv both given; allowed: one of them")
    return SiteSettings(**values, source=where)  # type: ignore[arg-type]


def load_site(path: str) -> SiteSettings:
    """The settings of a site file (``--site FILE``)."""
    where = f"--site {path}"
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    return site_from_dict(data, where)


def _cli_env(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not _ENV_NAME.match(name):
            raise ConfigError(f"--env {pair!r} is not valid; allowed: NAME=VALUE")
        out.append((name, value))
    return tuple(out)


def _merged_env(*envs: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    merged: dict[str, str] = {}
    for env in envs:
        merged.update(env)
    return tuple(merged.items())


def _cli_container(args: argparse.Namespace, site: Container | None) -> Container | None:
    image = args.container_image or (site.image if site else None)
    if image is None:
        if args.container_mount or args.container_runtime:
            raise ConfigError(
                "--container-mount/--container-runtime without an image; allowed: with "
                "--container-image or a site file's container.image"
            )
        return None
    where = "--container-image"
    runtime = args.container_runtime or (site.runtime if site else "pyxis")
    mounts = (site.mounts if site else ()) + tuple(
        _string(where, "--container-mount", m, _MOUNT) for m in args.container_mount
    )
    return Container(_string(where, "--container-image", image, _IMAGE), runtime, mounts)


def site_from_args(args: argparse.Namespace) -> SiteSettings:
    """The site file (``--site``) with the command line's settings over it."""
    site = load_site(args.site) if args.site else SiteSettings()
    if args.python and args.venv:
        raise ConfigError("--python and --venv both given; allowed: one of them")
    for v in args.module:
        _string("--module", "--module", v, _WORD)
    sbatch = tuple(o for option in args.sbatch for o in _sbatch("--sbatch", "option", [option]))
    given_python = args.python or args.venv
    return SiteSettings(
        partition=args.partition or site.partition,
        account=args.account or site.account,
        qos=args.qos or site.qos,
        time=args.time or site.time,
        exclusive=args.exclusive or site.exclusive,
        sbatch=site.sbatch + sbatch,
        modules=site.modules + tuple(args.module),
        setup=site.setup + tuple(args.setup),
        env=_merged_env(site.env, _cli_env(args.env)),
        container=_cli_container(args, site.container),
        python=args.python or (None if given_python else site.python),
        venv=args.venv or (None if given_python else site.venv),
        run_root=args.run_root or site.run_root,
        source=site.source,
    )


def site_directives(site: SiteSettings) -> list[str]:
    """The ``#SBATCH`` options the site adds (partition, account and time are the job's)."""
    out = [f"--qos={site.qos}"] if site.qos else []
    if site.exclusive:
        out.append("--exclusive")
    return out + list(site.sbatch)


def site_setup(site: SiteSettings) -> list[str]:
    """The script's lines that make the job's environment, in this order: exported variables, the
    site's own lines (which may read them, or make ``module`` available), module loads (each one
    that fails stops the job), the venv first on PATH. They run before ``set -u``: module scripts
    read unset variables."""
    q = shlex.quote
    lines = []
    if site.modules or site.setup or site.env or site.venv:
        lines.append(f"# The job's environment{f' ({site.source})' if site.source else ''}.")
    lines += [f"export {name}={q(value)}" for name, value in site.env]
    lines += list(site.setup)
    for m in site.modules:
        failed = shlex.quote(f"dtlab: module load {m} failed")
        lines.append(f"module load {q(m)} || {{ echo {failed} >&2; exit 1; }}")
    if site.venv:
        venv = str(Path(site.venv).expanduser())
        lines.append(f'export VIRTUAL_ENV={q(venv)} PATH={q(venv + "/bin")}:"$PATH"')
    return lines


def task_wrapper(site: SiteSettings, paths: list[str], gpus: bool) -> tuple[str, str]:
    """(srun options, the command before a task's ``bash -c``) that run each task in the container,
    with ``paths`` (the config's directory, the run directory) mounted where they are."""
    c = site.container
    if c is None:
        return "", ""
    q = shlex.quote
    mounts = ",".join([*c.mounts, *dict.fromkeys(paths)])
    if c.runtime == "pyxis":
        return f"--container-image={q(c.image)} --container-mounts={q(mounts)} ", ""
    nv = "--nv " if gpus else ""
    return "", f"apptainer exec {nv}--bind {q(mounts)} {q(c.image)} "


def python_lines(site: SiteSettings, fallback: str | None) -> list[str]:
    """The lines that set ``PYTHON``: the one given (``--python``, ``--venv``), else the job's own:
    ``python3`` on its PATH if it imports dtlab, else the interpreter of ``dtlab`` on its PATH, else
    (saying so) ``fallback``, the Python that wrote the script, if the node has it."""
    q = shlex.quote
    if site.python:
        return [f"PYTHON={q(site.python)}"]
    if site.venv:
        return [f"PYTHON={q(str(Path(site.venv).expanduser()) + '/bin/python')}"]
    if site.container is not None:  # resolved inside the image, which this step does not run in
        return ["PYTHON=python3  # the image's"]
    return [
        "# The Python of the job's environment (after the lines above), not a path of the login node.",
        "has_dtlab() { [[ -n $1 ]] && \"$1\" -c 'import dtlab' 2>/dev/null; }",
        "PYTHON=$(command -v python3 || true)",
        'if ! has_dtlab "$PYTHON" && DTLAB_BIN=$(command -v dtlab); then',
        "    read -r PYTHON arg _ < <(head -n 1 \"$DTLAB_BIN\" | sed 's/^#! *//')",
        "    [[ $PYTHON == */env ]] && PYTHON=${arg:-}  # #!/usr/bin/env python3",
        "fi",
        f"FALLBACK={q(fallback or '')}",
        'if ! has_dtlab "$PYTHON" && has_dtlab "$FALLBACK"; then',
        "    echo \"dtlab: no Python with dtlab on the job's PATH; using $FALLBACK, the one that wrote"
        ' this script (pass --python or --venv, or set up the environment in a site file)"',
        "    PYTHON=$FALLBACK",
        "fi",
        'if ! has_dtlab "$PYTHON"; then',
        "    echo \"dtlab: no Python with dtlab on the job's PATH ($PATH); pass --python or --venv, or"
        ' load it with --module/--setup or a site file" >&2',
        "    exit 1",
        "fi",
    ]
