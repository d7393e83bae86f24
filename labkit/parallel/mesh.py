"""The rank grid: where each rank sits among the parallelisms, and the process group of each axis.

The axes are one ordered list, :data:`AXES`, outermost to innermost — each one line, and the mesh is built
from the list: a run of ``world = pp × dp × cp × tp`` processes is a grid laid out as torch's
``init_device_mesh`` lays out a mesh of shape ``(pp, dp, cp, tp)``. This is torchtitan's order (and Megatron-LM's,
which names it innermost first: tp-cp-dp-pp), ordered by how much each axis sends and how often it waits on it:
tensor parallelism innermost (an all-reduce in every layer, forward and backward: its ranks are neighbours, on one
node's fastest links), context parallelism next (every attention layer passes keys and values round its ring),
then data-parallel replicas (the gradients once a step, overlapped with backward), and pipeline stages outermost
(one activation per micro-batch, point to point: the lightest traffic, the one that crosses nodes best). For
global rank ``r``::

    r = ((p · dp + d) · cp + c) · tp + t     p, d, c, t: the coordinates on pp, dp, cp and tp

Every component asks this one object for the group of its axis, as picotron's ``ProcessGroupManager`` and
torchtitan's ``ParallelDims`` do: the loader gives each dp coordinate its own shard, each cp coordinate takes
its chunks of every sequence, tensor parallelism splits matrices over ``tp``. Some work spans several axes at
once, named in :data:`FLATTENED`: the ranks of ``dp_cp`` hold the same parameters and each sees a different
part of the batch (other sequences on dp, other tokens on cp), so gradients are averaged over all of them
(torchtitan's ``dp_shard_cp``). With ``pp = cp = tp = 1`` the dp group is the whole world (torch hands back the
default group itself), so a data-parallel run behaves exactly as it would without a mesh.

:class:`ParallelDims` is pure arithmetic (no process group needed: tests and the planner use it);
:class:`RankGrid` adds the live ``DeviceMesh`` (gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

AXES = (  # outermost to innermost, the order of the mesh's dimensions; each axis's key is parallel.<axis>
    "pp",  # pipeline parallelism: the layers cut into stages
    "dp",  # data parallelism: replicas, each reading its own sequences
    "cp",  # context parallelism: each sequence cut into chunks (labkit.parallel.cp)
    "tp",  # tensor parallelism: every layer's matrices split
)
FLATTENED = {  # several axes as one group (torch's DeviceMesh._flatten): name → its axes, outermost first
    "dp_cp": ("dp", "cp"),  # the ranks that hold the same parameters and split the batch: gradients average here
}
GRADIENT_AXIS = "dp_cp"  # where a data-parallel strategy averages gradients and shards state (labkit.parallel.dp.base)
WORLD = "world"  # the name of the axis spanning every rank (per-rank measurements gather over it)


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each parallelism; their product is the world size. (The fields keep the order in which
    they were added, so that ``ParallelDims(dp, pp, tp)`` still reads as before; the mesh's order is AXES.)"""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "ParallelDims":
        """The degrees ``cfg.parallel`` asks for; ``dp: auto`` takes what tp, pp and cp leave of the world."""
        tp, pp, cp = cfg.parallel.tp.degree, cfg.parallel.pp.degree, context_degree(cfg)
        dp = cfg.parallel.dp.degree
        if dp == "auto":
            dp = max(1, world_size // max(1, tp * pp * cp))
        return cls(dp=dp, pp=pp, tp=tp, cp=cp)

    @property
    def world_size(self) -> int:
        return math.prod(self.size(axis) for axis in AXES)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.size(axis) for axis in AXES)

    def sizes(self) -> dict[str, int]:
        return {axis: self.size(axis) for axis in AXES}

    def size(self, axis: str) -> int:
        if axis == WORLD:
            return self.world_size
        if axis in FLATTENED:
            return math.prod(self.size(a) for a in FLATTENED[axis])
        return getattr(self, _known(axis))

    def coordinate(self, rank: int) -> dict[str, int]:
        """``rank``'s position on each axis: ``{"dp": d, "pp": p, "cp": c, "tp": t}``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the grid {self.describe()} (ranks 0..{self.world_size - 1})")
        coords = {}
        for axis in reversed(AXES):  # innermost first: mixed-radix digits
            rank, coords[axis] = divmod(rank, self.size(axis))
        return {axis: coords[axis] for axis in AXES}

    def coordinate_on(self, rank: int, axis: str) -> int:
        """``rank``'s index within its ``axis`` group (a flattened axis counts its axes outermost first)."""
        if axis == WORLD:
            return rank
        here, index = self.coordinate(rank), 0
        for a in _components(axis):
            index = index * self.size(a) + here[a]
        return index

    def rank_at(self, **coordinate: int) -> int:
        """The global rank at a coordinate (the inverse of :meth:`coordinate`; an axis left out is 0)."""
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
            ranks = [self.rank_at(**{**self.coordinate(r), a: i}) for r in ranks for i in range(self.size(a))]
        return sorted(ranks, key=lambda r: self.coordinate_on(r, axis))

    def describe(self) -> str:
        return " × ".join(f"{axis}={self.size(axis)}" for axis in AXES if axis in ("dp", "pp", "tp") or
                          self.size(axis) > 1)


def context_degree(cfg) -> int:
    """``parallel.cp.degree`` (1 for a config written before context parallelism: it has no ``parallel.cp``)."""
    cp = getattr(cfg.parallel, "cp", None)
    return cp.degree if cp is not None else 1


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

    def submesh(self, axis: str):
        """torch's one-dimensional ``DeviceMesh`` of ``axis`` (what FSDP2 and DTensor take). A flattened axis
        whose axes are all of size 1 but one is that one's (cp = 1: ``dp_cp`` is the dp axis itself)."""
        if self.device_mesh is None:
            raise RuntimeError("this grid was made without a device mesh")
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
    """The name of ``axis``'s dimension in the device mesh: a flattened axis spanning one real axis is that axis."""
    if axis not in FLATTENED:
        return _known(axis)
    spanned = [a for a in FLATTENED[axis] if dims.size(a) > 1]
    return spanned[0] if len(spanned) == 1 else (axis if spanned else FLATTENED[axis][0])


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
    return RankGrid(dims, rank, mesh, flattened)
