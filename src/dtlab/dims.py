"""Parallel degrees: how the world's ranks share the model, validated once, and the device mesh they make.

``parallel.strategy`` is the user's shorthand. :meth:`ParallelDims.from_config` maps it, with
``parallel.sharding`` and ``parallel.replicate``, onto degrees here and nowhere else; the rest of dtlab
asks the degrees (``fsdp_enabled``, ``replicate_enabled``, ``distributed``, ...) instead of comparing
strategy names::

    strategy  sharding             dp_replicate  dp_shard         wrapper  mesh dims
    single    (any)                1             1                none     none: no process group
    ddp       (any)                world         1                ddp      (dp_replicate,)
              optimizer: the same, and ``shard_optimizer`` (ZeRO-1)
    fsdp      full, shard_grad_op  1             world            fsdp     (dp_shard,)
    fsdp      no_shard             world         1                fsdp     (dp_replicate, dp_shard)
    hsdp      full, shard_grad_op  replicate     world/replicate  fsdp     (dp_replicate, dp_shard)
    hsdp      no_shard             world         1                fsdp     (dp_replicate, dp_shard)
    fsdp/hsdp on one rank (any)    1             1                fsdp     (dp_shard,)

FSDP2 replicates over a mesh's first dimension and shards over its second, so sharding ``no_shard`` is
``fully_shard`` on a (world, 1) mesh: the same degrees as DDP, another wrapper. DDP all-reduces over the
default process group; its mesh is there for what needs one.

``parallel.tp`` (tensor parallelism) splits each block's matrices over ``tp`` ranks and ``parallel.pp``
(pipeline parallelism) the blocks into ``pp`` groups of stages; the strategy then maps the remaining
``world / (tp * pp)`` ranks onto the data-parallel degrees as above, and the mesh gains an innermost
``tp`` and an outermost ``pp`` dimension. DistributedDataParallel does not take tensor-parallel
(DTensor) parameters, so ``ddp`` with ``tp`` > 1 replicates through FSDP2 on a (replicas, 1)
data-parallel mesh: the same training, FSDP's wrapper. So does ``ddp`` with ``pp`` > 1: a pipeline
stage runs backward once per micro-batch, which DDP's reducer does not take from the pipeline
schedules. ``single`` with ``tp`` or ``pp`` > 1 is model parallelism alone, and so is ``ddp`` with
one data-parallel rank (``tp * pp`` = world): nothing wraps, and no gradient is all-reduced over a
group of one. ``fsdp`` and ``hsdp`` with one data-parallel rank keep FSDP2, for its mixed precision,
on a ``dp_shard`` dimension of one rank, where it sends nothing.

``parallel.cp`` (context parallelism) splits each sequence over ``cp`` ranks that read the same samples;
the gradients are averaged over the data x cp ranks, and the mesh gains a ``cp`` dimension inside the
data-parallel ones. Where the parameters are sharded, FSDP shards over the data x cp ranks (``cp``
after ``dp_shard``, flattened with it, :meth:`ParallelDims.fsdp_mesh`); where every rank holds them
whole, ``cp`` follows ``dp_replicate`` and is flattened with it into the ranks that replicate
(:attr:`ParallelDims.cp_replicates`), ``dp_shard`` (of one rank) after it::

    strategy   sharding   tp, pp      wrapper  mesh dims                                  averaged over
    ddp        (any)      1           ddp      (dp_replicate, cp)                         all ranks
    ddp        (any)      tp or pp>1  fsdp     (pp, dp_replicate, cp, dp_shard, tp)       dp_replicate x cp
    fsdp/hsdp  no_shard   (any)       fsdp     (pp, dp_replicate, cp, dp_shard, tp)       dp_replicate x cp
    fsdp       full, ...  (any)       fsdp     (pp, dp_shard, cp, tp)                     shards over dp_shard x cp
    hsdp       full, ...  (any)       fsdp     (pp, dp_replicate, dp_shard, cp, tp)       dp_replicate; shards
                                                                                          over dp_shard x cp

(``pp`` and ``tp`` where above 1; ZeRO-1, ``ddp`` with sharding ``optimizer``, is refused under cp.)
``ddp`` with one data-parallel rank still wraps under cp: its cp ranks have gradients to average. A dimension of degree 1 moves no rank, so the global ranks still
fill the mesh row-major in the order of :data:`DIM_NAMES` (``coordinates``).

``parallel.diloco`` (DiLoCo, ``inner_steps`` > 0) groups the data-parallel ranks into ``replicas``
(``diloco``, one per data-parallel rank by default) of contiguous ranks that train alone between
outer syncs; the strategy lays out each replica's ``world / replicas`` ranks as above (DDP or FSDP
inside a replica), and the mesh gains a ``diloco`` dimension outside them: the outer syncs run along
it, each rank with the ranks that hold the same part of the model in the other replicas. Under context
parallelism (``parallel.cp``) the replicas split the data-parallel ranks, and each replica's ranks are
its data x cp ranks, laid out as without DiLoCo (DDP over them, FSDP sharding over them, or with
``no_shard`` FSDP2 replicating over them): a rank
syncs with the ranks of the same (data, cp) coordinates, which hold the same parameters (or shard)::

    diloco 2 x ddp 1 x cp 2:  mesh (diloco, dp_replicate, cp) = (2, 1, 2); replicas {0, 1} {2, 3},
                              each DDP over its cp ranks; outer syncs {0, 2} {1, 3}

``parallel.ep`` (expert parallelism, mixture-of-experts models) borrows its ranks from the data-parallel
ranks, as torchtitan does, and adds no dimension to the world: each of the ``dp`` data-parallel ranks
still trains its own share of the batch. Under context parallelism it borrows from the data x cp ranks:
each cp rank holds other tokens of the same sequences, so for the experts it is one more data rank.
The ``dp x cp`` ranks (data-parallel index, then cp index, :meth:`ParallelDims.ep_rank`) form
``dp x cp / ep`` groups of ``ep`` consecutive ones; the ranks of a group split each MoE block's routed
experts between them (expert e on the group's rank ``e // (experts / ep)``) and send each token to its
experts' ranks. The expert shards are then data-parallel over the ``dp x cp / ep`` ranks that hold the
same experts (one per group, ``ep_dp``), their gradients averaged over the ``dp x cp`` ranks as every
other gradient is. A second mesh over the same world, ``(pp, ep_dp, ep, tp)``, holds those two
dimensions (:meth:`ParallelDims.expert_mesh`); everything else keeps the data-parallel layout above::

    dp ranks   0 1 2 3        ep 2:  EP groups {0, 1} {2, 3}; experts' data parallelism {0, 2} {1, 3}
    dp 2 x cp 2: (dp, cp) = (0, 0) (0, 1) (1, 0) (1, 1) = ranks 0 1 2 3; ep 2: EP groups {0, 1} {2, 3}
               (each a cp group), ep 4: one EP group of all four

This module imports neither the config (the config's own checks use it) nor, until a mesh is built, torch.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dtlab.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class DPWrapper(enum.Enum):
    """What wraps the model for data parallelism."""

    NONE = "none"  # the plain model, one process, no process group
    DDP = "ddp"  # DistributedDataParallel: whole parameters everywhere, gradients all-reduced in buckets
    FSDP = "fsdp"  # FSDP2 ``fully_shard`` on the data-parallel mesh

    @classmethod
    def of(cls, strategy: str) -> DPWrapper:
        """The wrapper that ``parallel.strategy = strategy`` uses."""
        try:
            return _WRAPPERS[strategy]
        except KeyError:
            raise ValueError(
                f"parallel.strategy = {strategy!r} is not a strategy (allowed: {', '.join(_WRAPPERS)})"
            ) from None


# Each strategy's wrapper, in the schema's order; the degrees follow in ParallelDims.from_config.
_WRAPPERS = {
    "single": DPWrapper.NONE,
    "ddp": DPWrapper.DDP,
    "fsdp": DPWrapper.FSDP,
    "hsdp": DPWrapper.FSDP,
}


def needs_replica_groups(strategy: str) -> bool:
    """Whether ``parallel.strategy = strategy`` needs ``parallel.replicate`` (hybrid sharding)."""
    return strategy == "hsdp"


def strategies_with(*wrappers: DPWrapper) -> list[str]:
    """The ``parallel.strategy`` names whose wrapper is one of ``wrappers``, in the schema's order."""
    return [s for s, w in _WRAPPERS.items() if w in wrappers]


class _DiLoCoSection(Protocol):
    @property
    def inner_steps(self) -> int: ...
    @property
    def replicas(self) -> int | None: ...


class _ParallelSection(Protocol):
    @property
    def strategy(self) -> str: ...
    @property
    def sharding(self) -> str: ...
    @property
    def replicate(self) -> int | None: ...
    @property
    def tp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def diloco(self) -> _DiLoCoSection: ...
    @property
    def ep(self) -> int: ...


class _NamedSection(_ParallelSection, Protocol):
    """What :func:`layout_name` reads beside the degrees (``dtlab.config.ParallelConfig``)."""

    @property
    def sequence_parallel(self) -> bool: ...
    @property
    def pp_schedule(self) -> str: ...


class _HasParallel(Protocol):
    """A config (``dtlab.config.Config``): only its ``parallel`` section is read here."""

    @property
    def parallel(self) -> _ParallelSection: ...


# The dimensions a mesh can have, outermost first: pipeline stages exchange the least, tensor-parallel
# ranks the most (innermost, so that they are neighbours on a node).
# DiLoCo's replicas sit outside the data-parallel dimensions of each replica: they talk the least of all
# data-parallel ranks (every H steps).
DIM_NAMES = ("pp", "diloco", "dp_replicate", "dp_shard", "cp", "tp")
# The experts' mesh (parallel.ep > 1): the same world, its data x cp ranks split into EP groups
# (``ep``, innermost of them) and the ranks holding the same experts (``ep_dp``).
EXPERT_DIM_NAMES = ("pp", "ep_dp", "ep", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of one world; their product is the world size.

    Built by :meth:`from_config`, once per process (the launching process checks before it spawns;
    a worker builds it in ``init_distributed`` and finds it in ``DistInfo.dims``). The default is one
    process without a process group.
    """

    dp_replicate: int = 1  # data-parallel replicas (DDP's ranks, HSDP's replica groups)
    dp_shard: int = 1  # ranks each data-parallel replica's parameters are sharded over (FSDP)
    # Context parallel: each sequence split over this many ranks (parallel.cp); they hold the same
    # model and read the same samples, and average their gradients with the data-parallel ranks.
    cp: int = 1
    tp: int = 1  # tensor parallel: each block's matrices split over this many ranks
    pp: int = 1  # pipeline parallel: ranks the blocks are split over, in stages
    # DiLoCo replicas (parallel.diloco): groups of data-parallel ranks that train alone between outer
    # syncs; within a replica, dp_replicate and dp_shard as the strategy says.
    diloco: int = 1
    wrapper: DPWrapper = DPWrapper.NONE
    # Expert parallel (parallel.ep): each MoE block's routed experts split over groups of this many
    # data x cp ranks; no dimension of its own (it divides dp x cp, see the module's docstring).
    ep: int = 1
    # ZeRO-1 (ddp with sharding optimizer): each of the dp_replicate ranks keeps and steps the
    # optimizer state of its share of the parameters.
    shard_optimizer: bool = False
    # The mesh's dimensions, outermost first. A dimension of degree 1 may be one (HSDP with one replica
    # group, no_shard's shard dimension); every degree above 1 must be.
    mesh_dims: tuple[str, ...] = ()
    _meshes: dict[str, DeviceMesh] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        degrees = self.degrees
        if any(n < 1 for n in degrees.values()):
            raise ValueError(f"parallel degrees must be at least 1, got {degrees}")
        if set(self.mesh_dims) - set(degrees) or len(set(self.mesh_dims)) != len(self.mesh_dims):
            raise ValueError(
                f"mesh_dims = {self.mesh_dims} must be distinct names of {list(degrees)}"
            )
        left_out = [n for n, k in degrees.items() if k > 1 and n not in self.mesh_dims]
        if left_out:
            raise ValueError(
                f"degrees {left_out} are above 1 but not dimensions of {self.mesh_dims}"
            )
        # init_device_mesh lays the ranks out row-major over mesh_dims, coordinates() over
        # DIM_NAMES: the two agree when the dimensions above 1 keep DIM_NAMES' order (one of degree
        # 1 may sit anywhere, as dp_shard does after cp where the cp ranks replicate).
        above_one = [n for n in self.mesh_dims if degrees[n] > 1]
        if above_one != [n for n in DIM_NAMES if n in above_one]:
            raise ValueError(
                f"mesh_dims = {self.mesh_dims}: the dimensions above 1 must keep the order of "
                f"{DIM_NAMES}"
            )
        if (self.wrapper is DPWrapper.NONE and self.world_size == 1) != (not self.mesh_dims):
            raise ValueError(
                f"wrapper {self.wrapper.value} with mesh_dims = {self.mesh_dims}: only a run without "
                "a process group (wrapper none, one process) has no mesh"
            )
        if self.ep < 1 or self.ep_span % self.ep or (self.ep > 1 and self.diloco > 1):
            raise ValueError(
                f"ep = {self.ep} must divide the {self.ep_span} data x cp ranks (dp = {self.dp} x "
                f"cp = {self.cp}; and DiLoCo's {self.diloco} replicas must be 1 with it)"
            )
        if self.wrapper is DPWrapper.NONE and self.dp > 1:
            raise ValueError(f"{self.dp} data-parallel ranks need a wrapper (ddp or fsdp)")
        if self.wrapper is DPWrapper.DDP and self.dp_shard > 1:
            raise ValueError(f"DDP replicates whole parameters; dp_shard = {self.dp_shard}")
        if self.shard_optimizer and (
            self.wrapper is not DPWrapper.DDP or self.mesh_dims != ("dp_replicate",)
        ):
            raise ValueError(
                f"ZeRO-1 shards plain DDP's optimizer state; wrapper {self.wrapper.value} with "
                f"mesh_dims = {self.mesh_dims}"
            )

    @classmethod
    def from_config(cls, config: _HasParallel, world_size: int) -> ParallelDims:
        """Map ``parallel.strategy`` (with ``sharding`` and ``replicate``) onto the degrees of a world of
        ``world_size`` processes; a ConfigError when that world cannot run it."""
        dims = cls._from_config(config, world_size)
        ep = config.parallel.ep
        if ep == 1:
            return dims
        span = dims.ep_span
        if span % ep:
            fits = [str(k) for k in range(1, span + 1) if span % k == 0]
            p = config.parallel
            ranks = f"{world_size} processes / (parallel.tp = {p.tp} x parallel.pp = {p.pp})"
            kind, lent = "data-parallel", "data parallelism"
            # A cp rank routes its own tokens: one more data rank to the experts.
            if dims.cp_enabled:
                ranks += f" = {dims.dp} data-parallel x parallel.cp = {dims.cp}"
                kind, lent = "data x cp", "data and context parallelism"
            raise ConfigError(
                f"parallel.ep = {ep} does not divide the {span} {kind} ranks ({ranks}): expert "
                f"parallelism borrows its ranks from {lent} (allowed here: {', '.join(fits)}; or "
                f"run a multiple of {ep} {kind} ranks)"
            )
        return dataclasses.replace(dims, ep=ep)

    @classmethod
    def _from_config(cls, config: _HasParallel, world_size: int) -> ParallelDims:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        p = config.parallel
        tp, pp = p.tp, p.pp
        if world_size % (tp * pp):
            raise ConfigError(
                f"parallel.tp = {tp} x parallel.pp = {pp} does not divide the world size "
                f"{world_size}: use a multiple of {tp * pp} processes"
            )
        if p.diloco.inner_steps and tp == 1 and pp == 1:
            return cls._diloco(config, world_size)
        cp = getattr(p, "cp", 1)
        if cp > 1:
            return cls._context_parallel(config, world_size // (tp * pp), cp, tp, pp)
        dp = cls._data_parallel(config, world_size // (tp * pp))
        if tp == 1 and pp == 1:
            return dp
        wrapper, dp_dims = dp.wrapper, dp.mesh_dims
        if dp.dp == 1 and wrapper is DPWrapper.DDP:
            # One replica: nothing to average the gradients over, so nothing wraps (FSDP2 replicating
            # over a group of one rank would all-reduce every gradient to itself).
            wrapper, dp_dims = DPWrapper.NONE, ()
        elif wrapper is DPWrapper.DDP:  # FSDP2 replicates instead (see above)
            wrapper, dp_dims = DPWrapper.FSDP, ("dp_replicate", "dp_shard")
        return cls(
            dp.dp_replicate, dp.dp_shard, tp=tp, pp=pp, wrapper=wrapper,
            mesh_dims=(*(("pp",) if pp > 1 else ()), *dp_dims, *(("tp",) if tp > 1 else ())),
        )  # fmt: skip

    @classmethod
    def _context_parallel(
        cls, config: _HasParallel, world_size: int, cp: int, tp: int = 1, pp: int = 1
    ) -> ParallelDims:
        """Data-parallel ranks with each sequence split over ``cp`` of them, of ``world_size``
        (the world less tensor and pipeline parallelism's ``tp x pp``). The gradients are averaged
        over the data x cp ranks: DDP over every rank; FSDP sharding over the data x cp ranks
        (:meth:`fsdp_mesh`); or, where the parameters are whole on every rank (``ddp`` with tp or
        pp, sharding ``no_shard``), FSDP2 replicating over them (:attr:`cp_replicates`)."""
        if world_size % cp:
            raise ConfigError(
                f"parallel.cp = {cp} does not divide the world size {world_size * tp * pp} / "
                f"(parallel.tp x parallel.pp = {tp * pp}): use a multiple of {cp * tp * pp} processes"
            )
        p, dp = config.parallel, world_size // cp
        wrapper = DPWrapper.of(p.strategy)
        if wrapper is DPWrapper.DDP and tp == 1 and pp == 1:
            return cls(dp_replicate=dp, cp=cp, wrapper=wrapper, mesh_dims=("dp_replicate", "cp"))
        if wrapper is DPWrapper.DDP or p.sharding == "no_shard":
            # FSDP2 replicates over its mesh's first dimension and shards over its second: the
            # data x cp ranks (flattened: cp next to dp_replicate) and a shard group of one rank.
            # dp_shard, of degree 1, sits after cp, where it moves no rank.
            return cls(
                dp_replicate=dp, cp=cp, tp=tp, pp=pp, wrapper=DPWrapper.FSDP,
                mesh_dims=(
                    *(("pp",) if pp > 1 else ()), "dp_replicate", "cp", "dp_shard",
                    *(("tp",) if tp > 1 else ()),
                ),
            )  # fmt: skip
        replicate = 1
        if needs_replica_groups(p.strategy):
            replicate = p.replicate or 1
            if dp % replicate:
                raise ConfigError(
                    f"parallel.replicate = {replicate} does not divide the {dp} data-parallel "
                    f"ranks (world / (cp x tp x pp))"
                )
        return cls(
            dp_replicate=replicate, dp_shard=dp // replicate, cp=cp, tp=tp, pp=pp,
            wrapper=DPWrapper.FSDP,
            mesh_dims=(
                *(("pp",) if pp > 1 else ()), *(("dp_replicate",) if replicate > 1 else ()),
                "dp_shard", "cp", *(("tp",) if tp > 1 else ()),
            ),
        )  # fmt: skip

    @classmethod
    def _data_parallel(cls, config: _HasParallel, world_size: int) -> ParallelDims:
        """The data-parallel degrees of ``world_size`` data-parallel ranks (tp = 1)."""
        p = config.parallel
        wrapper = DPWrapper.of(p.strategy)
        if wrapper is DPWrapper.NONE:
            if world_size > 1 and p.tp == 1 and p.pp == 1:
                raise ConfigError(
                    f"parallel.strategy = 'single' runs one process, but {world_size} were asked for; "
                    "use --set parallel.strategy=ddp (or fsdp, hsdp) for several, or --nproc 1"
                )
            if world_size > 1:
                model = p.tp * p.pp
                raise ConfigError(
                    f"parallel.strategy = 'single' has no data parallelism, but {world_size * model} "
                    f"processes with parallel.tp = {p.tp} and parallel.pp = {p.pp} make {world_size} "
                    "data-parallel ranks; use --set parallel.strategy=ddp (or fsdp, hsdp) for those, "
                    f"or --nproc {model}"
                )
            return cls()
        if wrapper is DPWrapper.DDP:
            return cls(
                dp_replicate=world_size, wrapper=wrapper, mesh_dims=("dp_replicate",),
                shard_optimizer=p.sharding == "optimizer",
            )  # fmt: skip
        replicate = 1
        if needs_replica_groups(p.strategy):
            if p.replicate is None:
                raise ConfigError(
                    "parallel.strategy = 'hsdp' needs parallel.replicate (the number of replica "
                    "groups, e.g. the number of nodes)"
                )
            if world_size % p.replicate:
                raise ConfigError(
                    f"parallel.replicate = {p.replicate} does not divide the world size {world_size}"
                )
            replicate = p.replicate
        if world_size == 1:
            # FSDP of one rank stays for its mixed precision (half-precision gathers of float32
            # master weights); on a one-dimensional mesh it sends nothing, where a replica dimension
            # of one rank (sharding no_shard, hsdp) would all-reduce every gradient to itself.
            return cls(wrapper=wrapper, mesh_dims=("dp_shard",))
        hybrid = ("dp_replicate", "dp_shard")
        if p.sharding == "no_shard":  # every rank holds everything: shard groups of one rank
            return cls(dp_replicate=world_size, wrapper=wrapper, mesh_dims=hybrid)
        if needs_replica_groups(p.strategy):
            return cls(replicate, world_size // replicate, wrapper=wrapper, mesh_dims=hybrid)
        return cls(dp_shard=world_size, wrapper=wrapper, mesh_dims=("dp_shard",))

    @classmethod
    def _diloco(cls, config: _HasParallel, world_size: int) -> ParallelDims:
        """DiLoCo's replicas, each laid out by the strategy over its share of the ranks (contiguous
        ranks: a replica reads the samples one rank of ``replicas`` ranks would). Under context
        parallelism a replica's ranks are its data x cp ranks (DDP over them, or FSDP sharding over
        them), laid out as without DiLoCo; the replicas split the data-parallel ranks."""
        p = config.parallel
        if DPWrapper.of(p.strategy) is DPWrapper.NONE:  # one process: DiLoCo over itself
            return cls._data_parallel(config, world_size)
        cp = getattr(p, "cp", 1)
        if world_size % cp:
            raise ConfigError(
                f"parallel.cp = {cp} does not divide the world size {world_size}: use a multiple "
                f"of {cp} processes"
            )
        data = world_size // cp  # the data-parallel ranks the replicas split
        replicas = p.diloco.replicas or data
        if data % replicas:
            allowed = [str(n) for n in range(1, data + 1) if data % n == 0]
            ranks = f" (world {world_size} / parallel.cp = {cp})" if cp > 1 else ""
            raise ConfigError(
                f"parallel.diloco.replicas = {replicas} does not divide the {data} "
                f"data-parallel ranks{ranks} (allowed: {', '.join(allowed)}, or null: one per rank)"
            )
        if DPWrapper.of(p.strategy) is DPWrapper.FSDP and data == replicas and cp == 1:
            raise ConfigError(
                f"parallel.diloco.replicas = {replicas} with {data} data-parallel ranks leaves "
                f"one rank per replica, which parallel.strategy = {p.strategy!r} has nothing to shard "
                f"over; use parallel.strategy = 'ddp', or fewer replicas (a divisor of {data} "
                f"below {data}), or parallel.cp > 1 (a replica shards over its cp ranks)"
            )
        inner_world = world_size // replicas
        inner = (
            cls._context_parallel(config, inner_world, cp)
            if cp > 1
            else cls._data_parallel(config, inner_world)
        )
        return cls(
            inner.dp_replicate, inner.dp_shard, cp=cp, wrapper=inner.wrapper, diloco=replicas,
            mesh_dims=("diloco", *inner.mesh_dims),
        )  # fmt: skip

    @staticmethod
    def min_world_size(config: _HasParallel) -> int:
        """The fewest processes ``config``'s degrees can run on: one per replica group for hsdp."""
        p = config.parallel
        replicas = (p.replicate or 1) if needs_replica_groups(p.strategy) else 1
        return replicas * p.tp * p.pp * getattr(p, "cp", 1)

    @property
    def degrees(self) -> dict[str, int]:
        """Each dimension's degree, outermost first."""
        return {name: getattr(self, name) for name in DIM_NAMES}

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the global batch is split over them."""
        return self.diloco * self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def fsdp_shard(self) -> int:
        """The ranks FSDP shards each parameter over: ``dp_shard``, and under context parallelism
        its cp ranks with them (:meth:`fsdp_mesh`) unless they replicate (:attr:`cp_replicates`);
        ``dp_shard`` (1) where FSDP does not shard."""
        sharded_cp = self.fsdp_enabled and not self.cp_replicates
        return self.dp_shard * self.cp if sharded_cp else self.dp_shard

    @property
    def fsdp_replicate(self) -> int:
        """The ranks FSDP all-reduces each gradient shard over (its mesh's first dimension):
        ``dp_replicate``, and its cp ranks with them where they replicate (:attr:`cp_replicates`);
        1 without FSDP."""
        if not self.fsdp_enabled:
            return 1
        return self.dp_replicate * self.cp if self.cp_replicates else self.dp_replicate

    @property
    def cp_replicates(self) -> bool:
        """Under context parallelism, whether each cp rank holds whole parameters (DDP, and FSDP2
        replicating: ``ddp`` with tp or pp, sharding ``no_shard``): the mesh's ``cp`` follows
        ``dp_replicate``, with which it is flattened into the group the gradients are averaged
        over. Otherwise FSDP shards over the data x cp ranks (``cp`` follows ``dp_shard``)."""
        if not self.cp_enabled:
            return False
        at = self.mesh_dims.index("cp")
        return at > 0 and self.mesh_dims[at - 1] == "dp_replicate"

    @property
    def cp_enabled(self) -> bool:
        """Each sequence is split over more than one rank (context parallelism)."""
        return self.cp > 1

    @property
    def distributed(self) -> bool:
        """A process group is needed (DDP and FSDP make one even on one process)."""
        return self.wrapper is not DPWrapper.NONE or self.world_size > 1

    @property
    def tp_enabled(self) -> bool:
        """The blocks' matrices are split over more than one rank (tensor parallelism)."""
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        """The blocks are split into pipeline stages over more than one rank."""
        return self.pp > 1

    @property
    def diloco_enabled(self) -> bool:
        """DiLoCo's replicas are a dimension of the mesh (a process group; one process alone has none)."""
        return "diloco" in self.mesh_dims

    @property
    def diloco_inner(self) -> int:
        """The data-parallel ranks of one DiLoCo replica (all of them without DiLoCo)."""
        return self.dp_replicate * self.dp_shard

    @property
    def replica_ranks(self) -> int:
        """The ranks of one DiLoCo replica: its data-parallel ranks and the cp ranks of each (the
        ranks that agree on a step between outer syncs; the whole world without DiLoCo)."""
        return self.world_size // self.diloco

    @property
    def dp_mesh_dims(self) -> tuple[str, ...]:
        """The mesh dimensions data parallelism spans within a DiLoCo replica (FSDP's mesh; DiLoCo's
        replicas each train alone), outermost first."""
        return tuple(n for n in self.mesh_dims if n in ("dp_replicate", "dp_shard"))

    def fsdp_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh FSDP shards over: the data-parallel dimensions, and under context parallelism
        the context-parallel ranks with them, flattened into one: with the shard dimension (the
        parameters are not replicated over the ranks that split a sequence), or where they hold
        whole parameters (:attr:`cp_replicates`) with the replicate dimension."""
        if not self.cp_enabled:
            return self.mesh(device_type, *self.dp_mesh_dims)
        if self.cp_replicates:
            # Replicated over the data x cp ranks, in shard groups of one rank.
            self.mesh(device_type, "dp_replicate", "cp")._flatten("dp_replicate_cp")
            return self.build_mesh(device_type)["dp_replicate_cp", "dp_shard"]
        shard = self.mesh(device_type, "dp_shard", "cp")._flatten("dp_shard_cp")
        if "dp_replicate" not in self.mesh_dims:
            return shard
        # HSDP: its replica groups, each sharding over its data x cp ranks.
        return self.build_mesh(device_type)["dp_replicate", "dp_shard_cp"]

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global rank ``rank`` sits along each dimension (ranks fill the mesh row-major over
        :data:`DIM_NAMES`, as ``init_device_mesh`` lays them out)."""
        out: dict[str, int] = {}
        for name in reversed(DIM_NAMES):
            k = self.degrees[name]
            out[name], rank = rank % k, rank // k
        return {n: out[n] for n in DIM_NAMES}

    def dp_rank(self, rank: int) -> int:
        """Global rank ``rank``'s index among the data-parallel ranks: which share of the batch it reads."""
        c = self.coordinates(rank)
        return (c["diloco"] * self.dp_replicate + c["dp_replicate"]) * self.dp_shard + c["dp_shard"]

    @property
    def ep_enabled(self) -> bool:
        """Each MoE block's routed experts are split over more than one rank (expert parallelism)."""
        return self.ep > 1

    @property
    def ep_span(self) -> int:
        """The ranks expert parallelism borrows from, ``dp x cp`` (a cp rank holds other tokens: for
        the experts, one more data rank): ``ep`` divides it, and the experts' gradients are averaged
        over all of them, as every other gradient is."""
        return self.dp * self.cp

    @property
    def ep_dp(self) -> int:
        """The data x cp ranks that hold the same experts (one per EP group): their expert shards'
        gradients are summed over these."""
        return self.ep_span // self.ep

    def ep_rank(self, rank: int) -> int:
        """Global rank ``rank``'s place in its EP group (of consecutive (data-parallel, cp) indices):
        it holds the experts ``[ep_rank * experts / ep, (ep_rank + 1) * experts / ep)``."""
        return self.expert_coordinates(rank)[EXPERT_DIM_NAMES.index("ep")]

    def expert_coordinates(self, rank: int) -> tuple[int, ...]:
        """Where global rank ``rank`` sits on the experts' mesh, along :data:`EXPERT_DIM_NAMES`: its
        (data-parallel, cp) index, ``dp_rank x cp + cp rank``, split into (``ep_dp``, ``ep``)."""
        c = self.coordinates(rank)
        ep_dp, ep = divmod(self.dp_rank(rank) * self.cp + c["cp"], self.ep)
        return (c["pp"], ep_dp, ep, c["tp"])

    def expert_groups(self, dim: str) -> list[list[int]]:
        """The global ranks of each group along the experts' mesh dimension ``dim`` (one of
        :data:`EXPERT_DIM_NAMES`), each group in its order along ``dim``."""
        i = EXPERT_DIM_NAMES.index(dim)
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in sorted(range(self.world_size), key=self.expert_coordinates):
            place = self.expert_coordinates(r)
            groups.setdefault(place[:i] + place[i + 1 :], []).append(r)
        return [groups[k] for k in sorted(groups)]

    def expert_mesh(self, device_type: str, *dims: str) -> DeviceMesh:
        """The experts' mesh over the whole world, dimensions :data:`EXPERT_DIM_NAMES` (``ep``: an EP
        group, ``ep_dp``: the ranks holding the same experts), or its submesh over ``dims``. Built
        on first use (every rank must call it, in the same order as its other collectives)."""
        if not self.ep_enabled:
            raise RuntimeError(
                "parallel.ep = 1: the experts are not split, there is no expert mesh"
            )
        key = f"experts:{device_type}"
        if key not in self._meshes:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            # Each rank at its expert_coordinates, row-major (DiLoCo is refused with ep): global
            # ranks run row-major over (pp, dp, cp, tp), so EP groups are consecutive data x cp ranks.
            order = sorted(range(self.world_size), key=self.expert_coordinates)
            ranks = torch.tensor(order).view(self.pp, self.ep_dp, self.ep, self.tp)
            self._meshes[key] = DeviceMesh(device_type, ranks, mesh_dim_names=EXPERT_DIM_NAMES)
        mesh = self._meshes[key]
        return mesh[dims] if dims else mesh

    @property
    def ddp_enabled(self) -> bool:
        """Whole parameters on every data-parallel rank, their gradients averaged over the ranks: the
        model is wrapped in DistributedDataParallel, or under ZeRO-1 (``shard_optimizer``) left plain,
        its gradients reduce-scattered by :mod:`dtlab.parallel.zero`."""
        return self.wrapper is DPWrapper.DDP

    @property
    def fsdp_enabled(self) -> bool:
        """The model is wrapped by FSDP2's ``fully_shard`` (also with sharding no_shard, or on one rank)."""
        return self.wrapper is DPWrapper.FSDP

    @property
    def replicate_enabled(self) -> bool:
        """More than one replica: gradients are all-reduced across replicas."""
        return self.dp_replicate > 1

    @property
    def shard_enabled(self) -> bool:
        """Parameters, gradients and optimizer state are sharded over more than one rank."""
        return self.dp_shard > 1

    @property
    def dp_enabled(self) -> bool:
        """More than one data-parallel rank."""
        return self.dp > 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.degrees[n] for n in self.mesh_dims)

    def mesh(self, device_type: str, *dims: str) -> DeviceMesh:
        """The submesh over ``dims`` (the whole mesh without any)."""
        mesh = self.build_mesh(device_type)
        return mesh if not dims or dims == self.mesh_dims else mesh[dims]

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The device mesh over ``mesh_dims`` (built on first use, then the same object). Needs the
        process group; every rank must call it, in the same order as its other collectives."""
        if not self.mesh_dims:
            raise RuntimeError("a run without a process group (strategy single) has no device mesh")
        if device_type not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            self._meshes[device_type] = init_device_mesh(
                device_type, self.mesh_shape, mesh_dim_names=self.mesh_dims
            )
        return self._meshes[device_type]


def layout_name(dims: ParallelDims, parallel: _NamedSection) -> str:
    """How a layout is named to people, everywhere (start line, summary, plot title, bench rows): each
    dimension of parallelism with its degree, joined by `` x ``, e.g. ``fsdp 1 x tp 2``, ``ddp 2 x pp 2
    (1f1b)``, ``hsdp 2x2 x tp 2 (sp)`` (HSDP: replica groups x ranks per group). The same dimensions,
    in the same order, as ``dtlab verify --layouts`` writes them (``fsdp:2xtp:2``): data parallelism
    by its strategy's name (left out for ``single``), then ``cp`` (with its method), ``ep``, ``tp``
    and ``pp``; DiLoCo's replicas first.
    A choice that changes what a rank holds follows its dimension in parentheses: the sharding when
    it is not ``full`` (ZeRO-1 for ``ddp``), sequence parallelism, the pipeline schedule."""
    parts = []
    wrapper = DPWrapper.of(parallel.strategy)
    if wrapper is not DPWrapper.NONE:
        inner = dims.diloco_inner
        degree = (
            f"{dims.dp_replicate}x{dims.dp_shard}"
            if needs_replica_groups(parallel.strategy)
            else str(inner)
        )
        data = f"{parallel.strategy} {degree}"
        if dims.shard_optimizer:
            data += " (zero-1)"
        elif wrapper is DPWrapper.FSDP and parallel.sharding != "full":
            data += f" ({parallel.sharding})"
        if dims.diloco > 1:
            parts.append(f"diloco {dims.diloco}")
        parts.append(data)
    if dims.cp_enabled:
        parts.append(f"cp {dims.cp} ({getattr(parallel, 'cp_method', 'ring')})")
    if dims.ep_enabled:
        parts.append(f"ep {dims.ep}")
    if dims.tp_enabled:
        parts.append(f"tp {dims.tp}" + (" (sp)" if parallel.sequence_parallel else ""))
    if dims.pp_enabled:
        parts.append(f"pp {dims.pp} ({parallel.pp_schedule})")
    return " x ".join(parts) or "single"


def layout_warnings(dims: ParallelDims, parallel: _NamedSection) -> list[str]:
    """Layouts that are legal and train correctly but are not what their strategy is chosen for,
    said at start: HSDP whose replica groups hold one rank each shards nothing."""
    out = []
    alone = (
        dims.dp_shard == 1 and not dims.cp_enabled
    )  # (under cp a group shards over its cp ranks)
    if needs_replica_groups(parallel.strategy) and dims.dp_replicate > 1 and alone:
        out.append(
            f"{dims.dp_replicate} HSDP replica groups of 1 rank each shard nothing: "
            f"{layout_name(dims, parallel)} is {dims.dp_replicate} replicas (ddp "
            f"{dims.dp_replicate} with FSDP2's replication); for sharded replicas run "
            f"parallel.replicate x N processes, N > 1 (e.g. --nproc {2 * dims.dp_replicate})"
        )
    return out


def layout_fields(dims: ParallelDims) -> dict[str, int]:
    """The degrees of a layout as ``summary.json`` gives them: ``dp`` data-parallel ranks in all (the
    global batch is split over them), within a DiLoCo replica ``dp_replicate`` replicas of ``dp_shard``
    ranks each, ``diloco`` replicas, ``tp``, ``pp``, ``ep`` (expert parallelism: ranks of ``dp x cp``
    the experts are split over, not a factor of the world), ``cp`` (the ranks each sequence is split
    over) and ``world_size`` (``dp x cp x tp x pp``)."""
    return {
        "dp": dims.dp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
        "diloco": dims.diloco, "cp": dims.cp, "tp": dims.tp, "pp": dims.pp, "ep": dims.ep,
        "world_size": dims.world_size,
    }  # fmt: skip


def stage_layers(n_layers: int, n_stages: int) -> list[list[int]]:
    """The blocks of each stage, in order; earlier stages take one more when they do not divide."""
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        k = base + (s < extra)
        out.append(list(range(start, start + k)))
        start += k
    return out


def stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in the order the schedule expects them."""
    if schedule in ("zbv", "dualpipev"):  # a V: the first and the last stage on rank 0
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]
