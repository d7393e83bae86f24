"""Reading data-parallel runs back: what each strategy cost in time, bytes and memory.

Pure functions over a run's events, so the notebook's plots and the tests share one source.
"""
from __future__ import annotations

from statistics import mean
from typing import Optional

from labkit.comm.network import others_share
from labkit.memory_estimate import PRECISION_BYTES, MemoryBreakdown, zero_model_state_split
from labkit.parallel.spec import STRATEGIES, SYNC_STRATEGIES, StrategyFacts


def _steady(events: list[dict], skip: int) -> list[dict]:
    steps = [e for e in events if e.get("type") == "step"]
    return steps[skip:] or steps


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def analytic_wire_bytes(strategy: str, params: int, world: int, accum: int = 1, bytes_per_param: int = 4) -> float:
    """Bytes one rank sends per step under ring collectives (see ``labkit.comm.collectives``).

    DDP: one all-reduce of the gradients, 2(p−1)/p·Ψ. ZeRO-1 and ZeRO-2: a reduce-scatter of the
    gradients and an all-gather of the parameters, the same bytes. FSDP2 (ZeRO-3): an all-gather per
    forward and per backward of every micro-batch, and one reduce-scatter: (2·accum + 1)(p−1)/p·Ψ — about
    1.5× DDP without accumulation. (p−1)/p is :func:`labkit.comm.network.others_share`, the ring's factor.
    """
    share = float(others_share(world)) * params * bytes_per_param
    # each strategy declares its factor (labkit.parallel.spec); a name labkit does not know counts as DDP
    declared = {**SYNC_STRATEGIES, **STRATEGIES}.get(strategy, StrategyFacts)
    return declared.wire_factor(accum) * share


def predict_rank_memory(params: float, world_size: int, strategy: str, precision: str = "fp32") -> MemoryBreakdown:
    """Model-state bytes one rank of a labkit run should hold: the number live runs are checked against.

    Every labkit strategy is pure data parallelism over ``world_size`` ranks; they differ only in
    what they shard, their declared ``zero_stage`` (:mod:`labkit.parallel.spec`): DDP variants nothing
    (stage 0), ``zero1`` the optimizer state, ``zero2`` also the gradients, ``zero3`` and ``fsdp2`` everything
    (stage 3), as :func:`labkit.memory_estimate.zero_model_state_split` computes. Adam bytes per param: 4/4/8
    for fp32, 2/2/12 for mixed. Activations are left to the measurement (``activations`` is None).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {tuple(STRATEGIES)}, got {strategy!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {tuple(PRECISION_BYTES)}, got {precision!r}")
    weight_bytes, grad_bytes, k = PRECISION_BYTES[precision]
    split = zero_model_state_split(params, world_size, STRATEGIES[strategy].zero_stage, k, weight_bytes, grad_bytes)
    return MemoryBreakdown(*split)


def strategy_summary(events: list[dict], skip: int = 2) -> dict:
    """Steady-state means of a run's step time split, plus its last step's bytes and memory."""
    start = next(e for e in events if e.get("type") == "start")
    steps = _steady(events, skip)
    last = steps[-1]
    return {
        "strategy": start.get("strategy", "?"), "world_size": start["world_size"],
        "params": start["params"]["total"], "grad_accum": start.get("grad_accum", 1),
        "step_s": _mean(e["step_time_s"] for e in steps), "compute_s": _mean(e["compute_s"] for e in steps),
        "data_s": _mean(e["data_s"] for e in steps), "comm_s": _mean(e["comm_s"] for e in steps),
        "exposed_s": _mean(e["comm_exposed_s"] for e in steps), "comm_bytes": last["comm_bytes"],
        "param_bytes": last["param_bytes"], "grad_bytes": last["grad_bytes"],
        "optimizer_bytes": last["optimizer_bytes"], "activation_bytes": last.get("activation_bytes"),
        "timeline": last.get("timeline", {}),
        "loss": last["loss"],
    }


def format_table(rows: list[dict]) -> str:
    """A plain-text table of strategy summaries with the analytic and predicted numbers beside them."""
    def ms(value: Optional[float]) -> str:
        return "n/a" if value is None else f"{1e3 * value:.1f}"

    lines = [f"{'strategy':13s} {'step ms':>8s} {'exposed comm ms':>16s} {'MB sent':>8s} {'analytic':>9s} "
             f"{'state MB':>9s} {'predicted':>10s}"]
    for r in rows:
        analytic = analytic_wire_bytes(r["strategy"], r["params"], r["world_size"], r["grad_accum"])
        state = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        predicted = predict_rank_memory(r["params"], r["world_size"], r["strategy"]).model_states
        lines.append(f"{r['strategy']:13s} {ms(r['step_s']):>8s} {ms(r['exposed_s']):>16s} "
                     f"{r['comm_bytes'] / 1e6:8.2f} {analytic / 1e6:9.2f} {state / 1e6:9.2f} {predicted / 1e6:10.2f}")
    return "\n".join(lines)
