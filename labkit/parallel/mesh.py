"""The rank grid: where each rank sits among the parallelisms, and the process group of each axis.

The axes are one ordered list, :data:`AXES`, outermost to innermost — each one line, and the mesh is built
from the list: a run of ``world = pp × dp × cp × tp`` processes is a grid laid out as torch's
``init_device_mesh`` lays out a mesh of shape ``(pp, dp_replicate, dp_shard, ep, cp, tp)``. This is torchtitan's
order (and Megatron-LM's, which names it innermost first: tp-cp-dp-pp), ordered by how much each axis sends and
how often it waits on it: tensor parallelism innermost (an all-reduce in every layer, forward and backward: its
ranks are neighbours, on one node's fastest links), context parallelism next (every attention layer passes keys
and values round its ring), then data-parallel replicas (the gradients once a step, overlapped with backward), and
pipeline stages outermost (one activation per micro-batch, point to point: the lightest traffic, the one that
crosses nodes best). Data parallelism is two axes: ``dp_shard``, the replicas that FSDP shards the model over,
and ``dp_replicate``, the groups of them that each hold a whole copy (HSDP, ``parallel.dp.shard_degree``); a run
that does not ask for HSDP has ``dp_replicate = 1``, so every dp rank is on ``dp_shard``. Expert parallelism
(``parallel.ep.degree``, :mod:`labkit.parallel.ep`) borrows the innermost ``ep`` of the dp ranks, as torchtitan's
does: each still reads its own sequences, and each holds 1/ep of the experts (the tokens travel to them by
all-to-all, in every MoE layer: the heaviest data-parallel traffic, so the innermost). For global rank ``r``::

    r = ((p · dp + d) · cp + c) · tp + t     p, d, c, t: the coordinates on pp, dp, cp and tp
    d = (d_r · dp_shard + d_s) · ep + e       d_r, d_s, e: the coordinates on dp_replicate, dp_shard and ep

Every component asks this one object for the group of its axis, as picotron's ``ProcessGroupManager`` and
torchtitan's ``ParallelDims`` do: the loader gives each dp coordinate its own shard, each cp coordinate takes
its chunks of every sequence, tensor parallelism splits matrices over ``tp``. Some work spans several axes at
once, named in :data:`FLATTENED`: ``dp`` is every replica (both data-parallel axes); the ranks of ``dp_cp`` hold
the same parameters and each sees a different part of the batch (other sequences on dp, other tokens on cp), so
gradients are averaged over all of them — but the experts', which only the ranks of ``expert_dp_cp`` (dp_cp without
ep) hold alike; ``dp_shard_cp`` is the group FSDP shards over (torchtitan's names). With
``pp = cp = tp = 1`` the dp group is the whole world (torch hands back the default group itself), so a
data-parallel run behaves exactly as it would without a mesh.

:class:`ParallelDims` is pure arithmetic (no process group needed: tests and the planner use it);
:class:`RankGrid` adds the live ``DeviceMesh`` (gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

AXES = (  # outermost to innermost, the order of the mesh's dimensions
    "pp",  # pipeline parallelism: the layers cut into stages (parallel.pp.degree)
    "dp_replicate",  # data parallelism, HSDP's replica groups: each holds a whole copy (dp / dp_shard of them)
    "dp_shard",  # data parallelism, the replicas a group shards over (parallel.dp.shard_degree / cp; all of dp: 0)
    "ep",  # expert parallelism: dp ranks that each hold a part of the experts (parallel.ep.degree; labkit.parallel.ep)
    "cp",  # context parallelism: each sequence cut into chunks (labkit.parallel.cp; parallel.cp.degree)
    "tp",  # tensor parallelism: every layer's matrices split (parallel.tp.degree)
)
FLATTENED = {  # several axes as one group (torch's DeviceMesh._flatten): name → its axes, outermost first
    "dp": ("dp_replicate", "dp_shard", "ep"),  # every data-parallel replica, each reading its own sequences
    "dp_shard_cp": ("dp_shard", "ep", "cp"),  # the ranks FSDP shards the model over (HSDP: inside one replica group)
    "dp_cp": ("dp_replicate", "dp_shard", "ep", "cp"),  # the ranks that hold the same dense parameters: their
    # gradients average here
    "expert_dp_cp": ("dp_replicate", "dp_shard", "cp"),  # the ranks that hold the same experts (dp_cp but ep)
}
DEGREES = ("pp", "dp", "cp", "tp")  # what a config sets, parallel.<axis>.degree, in the mesh's order
GRADIENT_AXIS = "dp_cp"  # where a data-parallel strategy averages gradients and shards state (labkit.parallel.dp.base)
EXPERT_GRADIENT_AXIS = "expert_dp_cp"  # where the experts' gradients are summed (labkit.parallel.ep)
SHARD_AXIS = "dp_shard_cp"  # where FSDP2 shards; with HSDP it all-reduces the shards' gradients over dp_replicate
HSDP = ("dp_replicate", SHARD_AXIS)  # FSDP2's 2-D mesh under HSDP: all-reduces over the first, shards over the second
WORLD = "world"  # the name of the axis spanning every rank (per-rank measurements gather over it)


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each parallelism; their product is the world size. (The fields keep the order in which
    they were added, so that ``ParallelDims(dp, pp, tp)`` still reads as before; the mesh's order is AXES.)
    ``dp_shard``: the dp replicas in one shard group (HSDP); 0, the default, is all of them (dp_replicate = 1).
    ``ep``: how many of the dp replicas split the experts between them (expert parallelism borrows data-parallel
    ranks, as torchtitan's does: each still reads its own sequences); the innermost part of dp."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    dp_shard: int = 0
    ep: int = 1

    def __post_init__(self):
        if self.dp_shard < 0 or (self.dp_shard and self.dp % self.dp_shard):
            raise ValueError(f"dp_shard={self.dp_shard} must divide dp={self.dp} into replica groups")
        if self.ep < 1 or (self.dp_shard or self.dp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide the dp replicas of a shard group ({self.dp_shard or self.dp})")

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "ParallelDims":
        """The degrees ``cfg.parallel`` asks for; ``dp: auto`` takes what tp, pp and cp leave of the world. A shard
        group of ``parallel.dp.shard_degree`` ranks holds whole cp groups: ``dp_shard = shard_degree / cp`` (a
        shard degree that does not cut dp × cp so is left at 0 here and refused by the strategy's checks)."""
        tp, pp, cp = cfg.parallel.tp.degree, cfg.parallel.pp.degree, context_degree(cfg)
        dp = cfg.parallel.dp.degree
        if dp == "auto":
            dp = max(1, world_size // max(1, tp * pp * cp))
        shard = getattr(cfg.parallel.dp, "shard_degree", 0) or 0
        dp_shard = shard // cp if shard > 0 and cp > 0 and shard % cp == 0 and dp % (shard // cp) == 0 else 0
        ep = expert_degree(cfg)
        ep = ep if ep >= 1 and (dp_shard or dp) % ep == 0 else 1  # one that does not divide dp: refused in validation
        return cls(dp=dp, pp=pp, tp=tp, cp=cp, dp_shard=0 if dp_shard == dp else dp_shard, ep=ep)

    @property
    def world_size(self) -> int:
        return math.prod(self.size(axis) for axis in AXES)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.size(axis) for axis in AXES)

    def sizes(self) -> dict[str, int]:
        """The degrees as a config sets them (:data:`DEGREES`), ``dp_shard`` when HSDP splits dp, ``ep`` when the dp
        replicas split the experts."""
        return ({axis: self.size(axis) for axis in DEGREES} | ({"dp_shard": self.dp_shard} if self.dp_shard else {})
                | ({"ep": self.ep} if self.ep > 1 else {}))

    def size(self, axis: str) -> int:
        if axis == WORLD:
            return self.world_size
        if axis in FLATTENED:
            return math.prod(self.size(a) for a in FLATTENED[axis])
        if axis == "dp_shard":
            return (self.dp_shard or self.dp) // self.ep
        if axis == "dp_replicate":
            return self.dp // (self.dp_shard or self.dp)
        return getattr(self, _known(axis))

    def _digits(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on every axis of the mesh (mixed-radix digits, innermost fastest)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the grid {self.describe()} (ranks 0..{self.world_size - 1})")
        digits = {}
        for axis in reversed(AXES):
            rank, digits[axis] = divmod(rank, self.size(axis))
        return digits

    def coordinate(self, rank: int) -> dict[str, int]:
        """``rank``'s position on each degree a config sets: ``{"pp": p, "dp": d, "cp": c, "tp": t}`` (d counts
        both data-parallel axes; :meth:`coordinate_on` gives any axis's)."""
        return {axis: self.coordinate_on(rank, axis) for axis in DEGREES}

    def coordinate_on(self, rank: int, axis: str) -> int:
        """``rank``'s index within its ``axis`` group (a flattened axis counts its axes outermost first)."""
        if axis == WORLD:
            return rank
        here, index = self._digits(rank), 0
        for a in _components(axis):
            index = index * self.size(a) + here[a]
        return index

    def rank_at(self, **coordinate: int) -> int:
        """The global rank at a coordinate (the inverse of :meth:`coordinate`; an axis left out is 0). A flattened
        axis (``dp``) stands for its axes: its index is cut into theirs, innermost fastest."""
        for name in [a for a in coordinate if a in FLATTENED]:
            index = coordinate.pop(name)
            for axis in reversed(FLATTENED[name]):
                index, coordinate[axis] = divmod(index, self.size(axis))
        rank = 0
        for axis in AXES:
            rank = rank * self.size(axis) + coordinate.get(axis, 0)
        return rank

    def axis_ranks(self, rank: int, axis: str) -> list[int]:
        """The global ranks in ``rank``'s group along ``axis`` (those differing from it on that axis only, or on
        a flattened axis's axes only), in the order of their index in the group."""
        if axis == WORLD:
            return list(range(self.world_size))
        ranks = [rank]
        for a in _components(axis):
            ranks = [self.rank_at(**{**self._digits(r), a: i}) for r in ranks for i in range(self.size(a))]
        return sorted(ranks, key=lambda r: self.coordinate_on(r, axis))

    def describe(self) -> str:
        named = [f"{axis}={self.size(axis)}" for axis in DEGREES if axis in ("dp", "pp", "tp") or self.size(axis) > 1]
        if self.dp_shard:
            named[1] += f" ({self.size('dp_replicate')} replicate × {self.dp_shard} shard)"
        if self.ep > 1:
            named[1] += f" (ep={self.ep})"
        return " × ".join(named)


def context_degree(cfg) -> int:
    """``parallel.cp.degree`` (1 for a config written before context parallelism: it has no ``parallel.cp``)."""
    cp = getattr(cfg.parallel, "cp", None)
    return cp.degree if cp is not None else 1


def expert_degree(cfg) -> int:
    """``parallel.ep.degree`` (1 for a config without ``parallel.ep``)."""
    ep = getattr(cfg.parallel, "ep", None)
    return ep.degree if ep is not None else 1


def _components(axis: str) -> tuple[str, ...]:
    """The mesh axes ``axis`` spans: a flattened axis's, or the axis itself."""
    return FLATTENED[axis] if axis in FLATTENED else (_known(axis),)


def _known(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; axes are {', '.join(AXES)}, the flattened "
                         f"{', '.join(FLATTENED)} and {WORLD!r}")
    return axis


@dataclass
class RankGrid:
    """This rank's place on the grid, and the process group of each axis.

    ``device_mesh`` is torch's ``DeviceMesh`` with dimension names :data:`AXES`; None for a grid
    described without a process group (a group of one made by hand in a test): then every axis's
    group is the default one, which is only right when the grid is ``dp = world``.
    """

    dims: ParallelDims
    rank: int = 0
    device_mesh: object = field(default=None, repr=False)
    flattened: dict = field(default_factory=dict, repr=False)  # FLATTENED's meshes, by name (made in build_grid)

    def size(self, axis: str) -> int:
        return self.dims.size(axis)

    def coord(self, axis: str) -> int:
        """This rank's index within its ``axis`` group (its rank in that group)."""
        return self.dims.coordinate_on(self.rank, axis)

    def group(self, axis: str):
        """The process group of ``axis`` (None, torch's default group, for the world)."""
        if axis == WORLD or self.device_mesh is None:
            if axis != WORLD and self.size(axis) not in (1, self.dims.world_size):
                raise RuntimeError(f"no process group for axis {axis!r} of {self.dims.describe()}: "
                                   "this grid was made without a device mesh")
            return None
        return self.submesh(axis).get_group()

    def axis_group(self, axis: str):
        """``axis``'s process group, typed with the axis's name (:class:`labkit.comm.axes.AxisGroup`): what the
        layers hold, so that the step decides which timer counts their collectives."""
        from labkit.comm.axes import AxisGroup

        return AxisGroup(axis, self.group(axis))

    def submesh(self, axis: str | tuple[str, ...]):
        """torch's ``DeviceMesh`` of ``axis`` (what FSDP2 and DTensor take); of several axes, a mesh with one
        dimension each (HSDP's ``("dp_replicate", "dp_shard_cp")``). A flattened axis whose axes are all of size 1
        but one is that one's (cp = 1: ``dp_cp`` is the dp axis itself)."""
        if self.device_mesh is None:
            raise RuntimeError("this grid was made without a device mesh")
        if isinstance(axis, tuple):
            return self.flattened[axis]  # made by build_grid: HSDP's (dp_replicate, dp_shard_cp)
        name = _mesh_name(self.dims, axis)
        return self.flattened[name] if name in FLATTENED else self.device_mesh[name]

    def ranks(self, axis: str) -> list[int]:
        return self.dims.axis_ranks(self.rank, axis)

    def first_rank(self, axis: str) -> int:
        """The global rank at coordinate 0 of this rank's ``axis`` group (where broadcasts start)."""
        return self.ranks(axis)[0]

    def describe(self) -> str:
        return self.dims.describe()


def _mesh_name(dims: ParallelDims, axis: str) -> str:
    """The name of ``axis``'s dimension in the device mesh: a flattened axis spanning one real axis is that axis,
    and one spanning the same real axes as a flattened axis named before it is that one (one group per set of
    ranks: with dp_replicate = 1, ``dp_cp`` is ``dp_shard_cp``)."""
    if axis not in FLATTENED:
        return _known(axis)
    spanned = [a for a in FLATTENED[axis] if dims.size(a) > 1]
    if len(spanned) <= 1:
        return spanned[0] if spanned else FLATTENED[axis][-1]
    return next(name for name, axes in FLATTENED.items() if [a for a in axes if dims.size(a) > 1] == spanned)


def grid_problems(cfg, world: int, nproc: int | None = None, nnodes: int = 1) -> list[str]:
    """Said before any worker starts: degrees >= 1, dp×tp×pp(×cp) = world size, and a global batch that the
    dp replicas' micro-batches divide (what a split model needs: ``layout_checks.layout_problems``).

    ``nproc`` and ``nnodes`` only word the mismatch (default: ``world`` processes on one node).
    """
    problems: list[str] = []
    p, d = cfg.parallel, cfg.data
    nproc = world if nproc is None else nproc
    cp = context_degree(cfg)
    for name, deg in [("tp", p.tp.degree), ("pp", p.pp.degree), ("cp", cp)]:
        if deg < 1:
            problems.append(f"parallel.{name}.degree: must be >= 1, got {deg}")
    dp = ParallelDims.from_config(cfg, world).dp
    product = dp * max(p.tp.degree, 1) * max(p.pp.degree, 1) * max(cp, 1)
    if world >= 1 and product != world:
        names, values = ("dp×tp×pp×cp", f"{dp}×{p.tp.degree}×{p.pp.degree}×{cp}") if cp != 1 else \
            ("dp×tp×pp", f"{dp}×{p.tp.degree}×{p.pp.degree}")
        problems.append(f"parallel degrees {names} = {values} = {product} do not "
                        f"match the world size {world} (nproc={nproc} × nnodes={nnodes}); set "
                        f"parallel.dp.degree=auto or choose degrees whose product is {world}")
    elif cfg.comm.consistency is None and d.micro_batch_size > 0 and d.batch_size > 0 \
            and d.batch_size % (dp * d.micro_batch_size):
        problems.append(f"data.batch_size={d.batch_size} is not divisible by dp ({dp}) × "
                        f"data.micro_batch_size ({d.micro_batch_size}) = {dp * d.micro_batch_size}; "
                        f"use a batch_size that is a multiple of {dp * d.micro_batch_size}")
    return problems


def build_grid(dims: ParallelDims, rank: int, device_type: str) -> RankGrid:
    """Every rank calls this together: torch's ``init_device_mesh`` creates each axis's groups, then each
    flattened axis that spans more than one real axis gets its own (``DeviceMesh._flatten``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)
    flattened = {name: mesh[axes]._flatten(name) for name, axes in FLATTENED.items() if _mesh_name(dims, name) == name}
    grid = RankGrid(dims, rank, mesh, flattened)
    if dims.size("dp_replicate") > 1:  # HSDP: the gradient axis as a 2-D mesh, replica groups × one shard group
        flattened[HSDP] = grid.submesh(GRADIENT_AXIS)._unflatten(0, tuple(map(dims.size, HSDP)), HSDP)
    return grid
