"""What expert parallelism needs of a config, said before any worker starts (``labkit.validation`` collects it).

Only the checks; the strategies that cannot hold the experts apart say so in their ``refuses``
(:mod:`labkit.parallel.spec`, checked with the other axes by :mod:`labkit.parallel.layout_checks`)."""
from __future__ import annotations

from labkit.parallel.mesh import ParallelDims, expert_degree


def expert_parallel_problems(cfg, world: int) -> list[str]:
    """``parallel.ep.degree``: ≥ 1; > 1 only for a mixture of experts whose experts it divides, and dividing the
    data-parallel ranks it borrows (each ep rank still reads its own sequences)."""
    ep = expert_degree(cfg)
    if ep < 1:
        return [f"parallel.ep.degree: must be >= 1, got {ep}"]
    if ep == 1:
        return []
    experts = cfg.model.moe.experts
    if experts <= 0:
        return [f"parallel.ep.degree={ep} spreads the experts of a mixture of experts over ranks: set "
                f"model.moe.experts (a multiple of {ep}), or parallel.ep.degree=1"]
    problems = []
    if experts % ep:
        problems.append(f"parallel.ep.degree={ep}: model.moe.experts={experts} is not divisible by it; each ep rank "
                        f"holds the same number of experts (use an ep that divides {experts})")
    dims = ParallelDims.from_config(cfg, world)
    group = cfg.parallel.dp.shard_degree // max(1, dims.cp) if cfg.parallel.dp.shard_degree > 0 else dims.dp
    if group % ep:
        problems.append(f"parallel.ep.degree={ep} must divide the data-parallel ranks it borrows (dp={dims.dp}"
                        + (f", a shard group's {group}" if group != dims.dp else "") + "): each ep rank is a "
                        f"dp rank that also reads its own sequences; choose an ep that divides {group}")
    return problems
