"""Fault injection, for testing a setup end to end: ``DTLAB_FAULTS`` holds comma-separated items
``KIND@STEP[-LAST][:rRANK]``, for example ``DTLAB_FAULTS="nan@5-7,kill@12:r1"``. Kinds:

- ``nan``: the loss of those optimizer steps becomes NaN (so do the gradients);
- ``kill``: after the step, the process kills itself with SIGKILL (like ``kill -9``);
- ``sigterm`` / ``sigusr1`` / ``sigint``: during the step, the process sends itself that signal
  (preemption; ``sigint`` is a Ctrl-C): the ranks agree on it in that step and stop after it;
- ``error``: after the step, the process raises an exception (a crash with a traceback);
- ``hang``: after the step, the process stops taking part (a stuck node): the other ranks' next
  collective never completes; it leaves (exit 1) only when a launcher signals it to stop;
- ``skipcoll``: the process skips the loss all-reduce of that step (the MLX engine: the gradient
  all_sum), so its collectives are out of step with the others' from there on;
- ``badshape``: the process issues that same collective with one element more than the others;
- ``skipsync``: the gradients of that step are not synchronised over the data-parallel ranks (DDP,
  FSDP): each rank steps with its own, a broken layout for ``dtlab verify`` to catch (give it to every
  rank: one rank alone would leave the others waiting in the gradient sync);
- ``killsave``: while saving the checkpoint of that step, after the data files are written and before
  the manifest commits it, the process kills itself (a torn checkpoint);
- ``failsave``: the same moment, an OSError instead (a failed write: reported, training goes on);
- ``slowsave``: the same moment, a 3-second stall (a slow file system: rank 0 commits late);
- ``slowstage``: an async save of that step stalls 3 seconds before it copies the tensors (a slow copy:
  training must wait for it before it changes them);
- ``oom``: the step's first micro-batch raises torch.OutOfMemoryError after its backward (once: a
  retry of the step, ``train.oom_retry``, goes through);
- ``spike``: the loss of that step, and so its gradients, is multiplied by 100 (a loss and gradient
  norm spike; the torch engine);
- ``slow``: the step takes a second longer (a slow node or a throttled device);
- ``hog``: before the step, the process takes ``DTLAB_HOG_MB`` (default 1024) MiB of memory and
  holds it for the rest of its life (a leak);
- ``memlimit``: before the step, the process caps its address space (``RLIMIT_AS``) at what it uses
  now plus ``DTLAB_MEMLIMIT_MB`` (default 256) MiB, for the rest of its life: a real allocation failure
  for whatever needs more;
- ``badload``: when the process loads the checkpoint of that step (a resume or a rollback), it adds
  1e-3 to every parameter after loading it: a resume that is quietly wrong, for ``dtlab verify --checks
  resume`` to catch (the torch engine).

A collective that fails or times out (``hang``, ``skipcoll``, ``badshape``) is reported with the
ranks' ledgers of collectives (:mod:`dtlab.parallel.ledger`): who is behind, or how the ranks differ.

Without ``:rRANK`` a fault hits every rank. Under fault tolerance RANK is the run's: replica group
``g``'s rank ``r`` is ``g`` x the group's ranks + ``r`` (``:r1`` with groups of one rank: group 1). Faults fire in a launcher's first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0), so that a restart after an injected crash can recover, and each
``nan`` step fires once per process, so that a rollback past it can recover.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dtlab.errors import DtlabError
from dtlab.runtime.status import record_exit

__all__ = ["FAULTS_ENV", "KINDS", "Faults", "InjectedError"]

FAULTS_ENV = "DTLAB_FAULTS"
KINDS = (
    "nan", "kill", "sigterm", "sigusr1", "sigint", "error", "hang", "killsave", "failsave",
    "slowsave", "slowstage", "skipcoll", "badshape", "skipsync", "oom", "memlimit", "spike", "slow", "hog",
    "badload",
)  # fmt: skip
MEMLIMIT_ENV = "DTLAB_MEMLIMIT_MB"
HOG_ENV = "DTLAB_HOG_MB"
SPIKE_FACTOR = 100.0
SLOW_STEP_S = 1.0
SLOW_SAVE_S = 3.0
_ITEM = re.compile(r"^(?P<kind>[a-z]+)@(?P<first>\d+)(?:-(?P<last>\d+))?(?::r(?P<rank>\d+))?$")


class InjectedError(RuntimeError):
    """The crash that ``error@STEP`` asks for."""


@dataclass
class Faults:
    """The faults of ``DTLAB_FAULTS`` that concern this rank."""

    items: list[tuple[str, int, int]] = field(default_factory=list)
    fired: set[tuple[str, int]] = field(default_factory=set)
    held: list[bytearray] = field(default_factory=list)  # what ``hog`` took
    # Called before ``kill`` strikes (the ledger publishes its newest entries there, so that the
    # others know what this rank did last; a real kill -9 may lag one publication).
    before_kill: list[Callable[[], None]] = field(default_factory=list)
    # The steps (first, last) at which some rank, this one or another, faults its step's reduction
    # (``skipcoll``, ``badshape``): the ranks publish their ledgers before it there.
    collective_steps: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def from_env(cls, rank: int, env: dict[str, str] | None = None) -> Faults:
        env = dict(os.environ) if env is None else env
        spec = env.get(FAULTS_ENV, "").strip()
        if not spec or env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return cls()
        items, collective_steps = [], []
        for raw in spec.split(","):
            m = _ITEM.match(raw.strip())
            if not m or m["kind"] not in KINDS:
                raise DtlabError(
                    f"{FAULTS_ENV} item {raw.strip()!r} is not KIND@STEP[-LAST][:rRANK] "
                    f"with KIND one of {', '.join(KINDS)}"
                )
            first = int(m["first"])
            last = int(m["last"] or first)
            if m["kind"] in ("skipcoll", "badshape"):
                collective_steps.append((first, last))
            if m["rank"] is None or int(m["rank"]) == rank:
                items.append((m["kind"], first, last))
        return cls(items, collective_steps=collective_steps)

    def _due(self, kind: str, step: int) -> bool:
        if (kind, step) in self.fired:
            return False
        if any(k == kind and a <= step <= b for k, a, b in self.items):
            self.fired.add((kind, step))
            return True
        return False

    def nan_loss(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) gets a NaN loss."""
        return self._due("nan", step)

    def skip_sync(self, step: int) -> bool:
        """Whether step ``step``'s gradients stay unsynchronised (``skipsync``)."""
        return self._due("skipsync", step)

    def collective_fault(self, step: int) -> str | None:
        """What happens to step ``step``'s faultable collective: ``"skip"``, ``"badshape"`` or None."""
        if self._due("skipcoll", step):
            return "skip"
        if self._due("badshape", step):
            return "badshape"
        return None

    def collective_fault_anywhere(self, step: int) -> bool:
        """Whether some rank (this one or another) faults step ``step``'s reduction."""
        return any(a <= step <= b for a, b in self.collective_steps)

    def out_of_memory(self, step: int) -> bool:
        """Whether step ``step`` gets an injected out-of-memory error (``oom``)."""
        return self._due("oom", step)

    def bad_load(self, step: int) -> bool:
        """Whether the checkpoint of step ``step``, just loaded, is to be made wrong (``badload``)."""
        return self._due("badload", step)

    def loss_factor(self, step: int) -> float:
        """What step ``step``'s loss is multiplied by (``spike``: 100; else 1)."""
        return SPIKE_FACTOR if self._due("spike", step) else 1.0

    def before_step(self, step: int) -> None:
        """Before step ``step`` starts: ``hog``, ``memlimit``, ``slow``."""
        if self._due("hog", step):
            # Filled, not only reserved: the pages are resident.
            self.held.append(bytearray(b"\x01") * (int(os.environ.get(HOG_ENV, "1024")) * 2**20))
        if self._due("memlimit", step):
            cap_address_space(int(os.environ.get(MEMLIMIT_ENV, "256")) * 2**20)
        if self._due("slow", step):
            time.sleep(SLOW_STEP_S)

    def during_step(self, step: int) -> None:
        """Before step ``step``'s reduction: the stop signals (the ranks agree on them in it)."""
        for kind, sig in (
            ("sigterm", signal.SIGTERM), ("sigusr1", signal.SIGUSR1), ("sigint", signal.SIGINT),
        ):  # fmt: skip
            if self._due(kind, step):
                os.kill(os.getpid(), sig)

    def after_step(self, step: int) -> None:
        if self._due("kill", step):
            for hook in self.before_kill:
                hook()
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("hang", step):
            stops = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}
            signal.pthread_sigmask(signal.SIG_BLOCK, stops)
            signal.sigwait(stops)
            record_exit(1)  # for dtlab's MLX launcher; nothing without it
            os._exit(1)
        if self._due("error", step):
            raise InjectedError(f"{FAULTS_ENV}: injected error after step {step}")

    def before_commit(self, step: int) -> None:
        if self._due("killsave", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("failsave", step):
            raise OSError(f"{FAULTS_ENV}: injected write failure of the checkpoint of step {step}")
        if self._due("slowsave", step):
            time.sleep(SLOW_SAVE_S)

    def before_stage(self, step: int) -> None:
        if self._due("slowstage", step):
            time.sleep(SLOW_SAVE_S)


def cap_address_space(headroom: int) -> None:
    """Limit this process's address space to its current size plus ``headroom`` bytes (Linux)."""
    import resource

    with open("/proc/self/status", encoding="ascii") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    soft = size + headroom if hard == resource.RLIM_INFINITY else min(size + headroom, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
