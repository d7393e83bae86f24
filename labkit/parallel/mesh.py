"""The rank grid: where each rank sits among the parallelisms, and the process group of each axis.

A run of ``world = dp × pp × tp`` processes is a three-dimensional grid, laid out as torch's
``init_device_mesh`` lays out a mesh of shape ``(dp, pp, tp)``: tensor parallelism innermost (its
ranks are neighbours, on one node's fastest links), pipeline stages next, data-parallel replicas
outermost. For global rank ``r``::

    r = (d · pp + p) · tp + t          d = dp coordinate, p = stage, t = tensor-parallel coordinate

Every component asks this one object for the group of its axis, as picotron's
``ProcessGroupManager`` and torchtitan's ``ParallelDims`` do: a data-parallel strategy averages
gradients over the ``dp`` group, the loader gives each dp coordinate its own shard, evaluation
averages over ``dp``. With ``pp = tp = 1`` the dp group is the whole world (torch hands back the
default group itself), so a data-parallel run behaves exactly as it would without a mesh.

:class:`ParallelDims` is pure arithmetic (no process group needed: tests and the planner use it);
:class:`RankGrid` adds the live ``DeviceMesh`` (gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

from dataclasses import dataclass, field

AXES = ("dp", "pp", "tp")  # outermost to innermost, the order of the mesh's dimensions
WORLD = "world"  # the name of the axis spanning every rank (per-rank measurements gather over it)


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each parallelism; their product is the world size."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "ParallelDims":
        """The degrees ``cfg.parallel`` asks for; ``dp: auto`` takes what tp and pp leave of the world."""
        tp, pp = cfg.parallel.tp.degree, cfg.parallel.pp.degree
        dp = cfg.parallel.dp.degree
        if dp == "auto":
            dp = max(1, world_size // max(1, tp * pp))
        return cls(dp=dp, pp=pp, tp=tp)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.size(axis) for axis in AXES)

    def sizes(self) -> dict[str, int]:
        return {axis: self.size(axis) for axis in AXES}

    def size(self, axis: str) -> int:
        return self.world_size if axis == WORLD else getattr(self, _known(axis))

    def coordinate(self, rank: int) -> dict[str, int]:
        """``rank``'s position on each axis: ``{"dp": d, "pp": p, "tp": t}``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the grid {self.describe()} (ranks 0..{self.world_size - 1})")
        d, rest = divmod(rank, self.pp * self.tp)
        p, t = divmod(rest, self.tp)
        return {"dp": d, "pp": p, "tp": t}

    def rank_at(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        """The global rank at a coordinate (the inverse of :meth:`coordinate`)."""
        return (dp * self.pp + pp) * self.tp + tp

    def axis_ranks(self, rank: int, axis: str) -> list[int]:
        """The global ranks in ``rank``'s group along ``axis`` (those differing from it on that axis only)."""
        if axis == WORLD:
            return list(range(self.world_size))
        here = self.coordinate(rank)
        return [self.rank_at(**{**here, _known(axis): i}) for i in range(self.size(axis))]

    def describe(self) -> str:
        return " × ".join(f"{axis}={self.size(axis)}" for axis in AXES)


def _known(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; axes are {', '.join(AXES)} and {WORLD!r}")
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

    def size(self, axis: str) -> int:
        return self.dims.size(axis)

    def coord(self, axis: str) -> int:
        """This rank's index within its ``axis`` group (its rank in that group)."""
        return self.rank if axis == WORLD else self.dims.coordinate(self.rank)[axis]

    def group(self, axis: str):
        """The process group of ``axis`` (None, torch's default group, for the world)."""
        if axis == WORLD or self.device_mesh is None:
            if axis != WORLD and self.size(axis) not in (1, self.dims.world_size):
                raise RuntimeError(f"no process group for axis {axis!r} of {self.dims.describe()}: "
                                   "this grid was made without a device mesh")
            return None
        return self.device_mesh[_known(axis)].get_group()

    def submesh(self, axis: str):
        """torch's one-dimensional ``DeviceMesh`` of ``axis`` (what FSDP2 and DTensor take)."""
        if self.device_mesh is None:
            raise RuntimeError("this grid was made without a device mesh")
        return self.device_mesh[_known(axis)]

    def ranks(self, axis: str) -> list[int]:
        return self.dims.axis_ranks(self.rank, axis)

    def first_rank(self, axis: str) -> int:
        """The global rank at coordinate 0 of this rank's ``axis`` group (where broadcasts start)."""
        return self.ranks(axis)[0]

    def describe(self) -> str:
        return self.dims.describe()


def grid_problems(cfg, world: int, nproc: int | None = None, nnodes: int = 1) -> list[str]:
    """Said before any worker starts: degrees >= 1, dp×tp×pp = world size, and a global batch that the
    dp replicas' micro-batches divide (what a split model needs: ``layout_checks.layout_problems``).

    ``nproc`` and ``nnodes`` only word the mismatch (default: ``world`` processes on one node).
    """
    problems: list[str] = []
    p, d = cfg.parallel, cfg.data
    nproc = world if nproc is None else nproc
    for name, deg in [("tp", p.tp.degree), ("pp", p.pp.degree)]:
        if deg < 1:
            problems.append(f"parallel.{name}.degree: must be >= 1, got {deg}")
    dp = ParallelDims.from_config(cfg, world).dp
    product = dp * max(p.tp.degree, 1) * max(p.pp.degree, 1)
    if world >= 1 and product != world:
        problems.append(f"parallel degrees dp×tp×pp = {dp}×{p.tp.degree}×{p.pp.degree} = {product} do not "
                        f"match the world size {world} (nproc={nproc} × nnodes={nnodes}); set "
                        f"parallel.dp.degree=auto or choose degrees whose product is {world}")
    elif cfg.comm.consistency is None and d.micro_batch_size > 0 and d.batch_size > 0 \
            and d.batch_size % (dp * d.micro_batch_size):
        problems.append(f"data.batch_size={d.batch_size} is not divisible by dp ({dp}) × "
                        f"data.micro_batch_size ({d.micro_batch_size}) = {dp * d.micro_batch_size}; "
                        f"use a batch_size that is a multiple of {dp * d.micro_batch_size}")
    return problems


def build_grid(dims: ParallelDims, rank: int, device_type: str) -> RankGrid:
    """Every rank calls this together: torch's ``init_device_mesh`` creates each axis's groups."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)
    return RankGrid(dims, rank, mesh)
