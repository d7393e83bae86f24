"""What a data-parallel strategy declares about itself, and the registries that list them.

Every strategy is a :class:`labkit.parallel.dp.base.Strategy` subclass, declared once in its own module
and registered with ``@STRATEGIES.register`` (chosen by ``parallel.dp.strategy``) or
``@SYNC_STRATEGIES.register`` (chosen by ``comm.sync``: strategies that synchronise less often than
every step and so replace per-step gradient synchronisation). Besides building and running, a
strategy class answers, without being built:

* ``order`` — its place in option lists;
* ``zero_stage`` — which model states it shards across the replicas (0 none; 1 optimizer state;
  2 and gradients; 3 and weights), what :func:`labkit.parallel.reports.data_parallel.predict_rank_memory` reads;
* ``wire_factor(accum)`` — bytes one rank sends per step in units of (p−1)/p·Ψ under ring
  collectives (:func:`labkit.parallel.reports.data_parallel.analytic_wire_bytes`);
* ``compresses`` — whether it passes its gradient buckets through ``comm.compression``'s compressor;
* ``reduces_over`` — the mesh axis its gradients are averaged (and its state sharded) over:
  :data:`labkit.parallel.mesh.GRADIENT_AXIS` (dp, flattened with cp), the group ``Strategy`` is built on;
* ``refuses`` — the model-parallel layouts it does not run beside, and only those: (axis, implementation) →
  why, in words (axis one of :data:`IMPLS`, ``tp``/``pp``/``cp``, implementation one of ``parallel.<axis>.impl``'s
  values; :func:`refusing` spells every implementation of an axis). What it does not refuse it runs beside:
  :func:`labkit.parallel.layout_checks.layout_problems` says the reason when a config asks for a refused pair,
  names the strategies that take it, and ``parallel.dp.strategy=auto`` takes the first strategy, in this
  registry's order, that refuses none of the layout's pairs (:func:`labkit.parallel.layout_checks.auto_strategy`);
  a sync strategy (``comm.sync``) is asked the same;
* ``problems(cfg, world)`` — what is wrong with a config for it, one sentence each (see
  :mod:`labkit.registry` for how entries are asked).

This module imports nothing from labkit but the generic registry and the mesh's axis names, and never
labkit.config.
"""
from __future__ import annotations

from labkit.parallel.mesh import EXPERT_GRADIENT_AXIS, GRADIENT_AXIS
from labkit.registry import Registry

TP_IMPLS = ("labkit", "dtensor")  # parallel.tp.impl: labkit's own Megatron layers, or torch's DTensor plan
PP_IMPLS = ("labkit", "torch")  # parallel.pp.impl: labkit's send/recv schedules, or torch.distributed.pipelining
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # parallel.pp.schedule (see layout_checks for what runs)
# parallel.cp.impl: labkit's ring attention, all-gather KV and Ulysses (labkit.parallel.cp), or torch's context_parallel
CP_IMPLS = ("ring", "allgather", "ulysses", "native")
CP_LAYOUTS = ("head_tail", "contiguous")  # parallel.cp.layout (labkit.parallel.cp.sharding)
EP_IMPLS = ("labkit",)  # parallel.ep.impl: labkit's all-to-all dispatch (labkit.parallel.ep)
# the model-parallel axes (labkit.parallel.mesh.DEGREES but dp, and ep, which splits the experts over dp ranks) and
# each one's parallel.<axis>.impl values, in the order layouts are described and checked
IMPLS = {"tp": TP_IMPLS, "pp": PP_IMPLS, "cp": CP_IMPLS, "ep": EP_IMPLS}
# a strategy that treats every parameter alike — shards it, or averages it, over the whole gradient axis — cannot hold
# the experts apart: under ep each rank holds other experts (what its ``refuses`` says of ep)
SAME_PARAMETERS_EVERYWHERE = ("it treats every parameter as held alike by every data-parallel rank, and under expert "
                              "parallelism each rank holds other experts (labkit.parallel.ep sums theirs apart: "
                              "torch_ddp, ddp_naive and ddp_bucketed leave them to it)")

STRATEGIES = Registry("parallel.dp.strategy", what="parallel.dp.strategy", choices="available")
SYNC_STRATEGIES = Registry("comm.sync", what="comm.sync", choices="available")
EVERY_STEP = "every_step"  # comm.sync's off value: gradients synchronised every step, by the dp strategy
AUTO = "auto"  # parallel.dp.strategy's value that lets labkit choose one that combines with the layout


def strategy_choices() -> tuple[str, ...]:
    """Every value of ``parallel.dp.strategy``: ``auto``, then the registered strategies."""
    return (AUTO, *STRATEGIES)


def sync_modes() -> tuple[str, ...]:
    """Every value of ``comm.sync``: per-step synchronisation, then the registered sync strategies."""
    return (EVERY_STEP, *SYNC_STRATEGIES)


def refusing(axis: str, reason: str, impls: tuple[str, ...] | None = None) -> dict[tuple[str, str], str]:
    """``refuses`` entries: each of ``impls`` of ``axis`` (every implementation of it when None) refused for
    ``reason``."""
    if axis not in IMPLS:
        raise ValueError(f"unknown model-parallel axis {axis!r}; axes are {', '.join(IMPLS)}")
    unknown = [impl for impl in impls or () if impl not in IMPLS[axis]]
    if unknown:
        raise ValueError(f"unknown parallel.{axis}.impl {', '.join(unknown)}; choices: {', '.join(IMPLS[axis])}")
    return {(axis, impl): reason for impl in (IMPLS[axis] if impls is None else impls)}


class StrategyFacts:
    """The declarations every strategy inherits; the defaults describe plain data parallelism."""

    name = "base"
    order = 100
    zero_stage = 0
    compresses = False
    reduces_over = GRADIENT_AXIS  # the mesh axis (a flattened one: dp × cp) its gradients are averaged over
    reduces_experts_over = EXPERT_GRADIENT_AXIS  # where the experts' are, under ep (labkit.parallel.ep's hook)
    refuses: dict[tuple[str, str], str] = {}  # (axis, parallel.<axis>.impl) → why not; anything else it runs beside
    shards_in_groups = False  # takes parallel.dp.shard_degree (HSDP: shard inside a group, replicate across)

    @classmethod
    def wire_factor(cls, accum: int = 1) -> float:
        """One all-reduce of the gradients per step: 2(p−1)/p·Ψ."""
        return 2

    @classmethod
    def problems(cls, cfg, world: int) -> list[str]:
        """Checks of ``parallel.dp``'s keys, and of what combines with this strategy when it is chosen."""
        found, dp, compression = [], cfg.parallel.dp, cfg.comm.compression
        if dp.bucket_mb <= 0:
            found.append(f"parallel.dp.bucket_mb: must be > 0 (megabytes per gradient bucket), got {dp.bucket_mb}")
        if dp.shard_degree < 0:
            found.append(f"parallel.dp.shard_degree: must be >= 0 (0: one shard group), got {dp.shard_degree}")
        elif dp.strategy == cls.name and dp.shard_degree and not cls.shards_in_groups:
            takers = " or ".join(name for name, s in STRATEGIES.items() if s.shards_in_groups)
            found.append(f"parallel.dp.shard_degree={dp.shard_degree} shards the model inside groups of that many "
                         f"ranks (HSDP): use parallel.dp.strategy={takers}, or parallel.dp.shard_degree=0")
        if dp.strategy == cls.name and compression != "none" and not cls.compresses:
            takers = " or ".join(name for name, s in STRATEGIES.items() if s.compresses)
            found.append(f"comm.compression={compression} compresses all-reduced gradient buckets: use "
                         f"parallel.dp.strategy={takers}, not {dp.strategy}")
        return found
