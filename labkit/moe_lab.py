"""Notebook 13's runs and data: a mixture of experts routed in this process, trained by labkit's launcher, and spread
over ranks by expert parallelism.

Three kinds of numbers, each said for what it is:

* **routing in this process** (:func:`route`, :func:`drop_curve`): labkit's own router functions
  (:mod:`labkit.model.moe`: ``router_probabilities``, ``select_experts``, ``expert_capacity``, ``within_capacity``,
  ``switch_aux_loss``, ``loss_free_update``) on a fixed, seeded router and fixed tokens — no training: the load,
  capacity and drops are counted, the loss-free bias is moved step by step against the load of fixed probabilities
  (the bias's rule alone, without the gradient steps a run takes between two of its moves);
* **real runs** (:func:`lab_config`, :func:`balance_runs`, :func:`ep_run`): a small MoE GPT trained by
  :func:`labkit.launch` on the lab's gloo processes (:func:`lab_layout`: 2 on a 2-core laptop, 4 with four or more
  cores); each step event carries every MoE layer's load per expert, max/mean load and drop rate, and with
  ``parallel.ep.degree`` the all-to-all's bytes and seconds (``model_comm_bytes``, ``model_comm_s``: counted on the
  ``ep`` axis);
* **formulas, said to be** (:func:`balanced_drop`, :func:`balanced_ep_bytes`): what a perfectly balanced router
  would drop, and would send over the ep axis — printed beside what was counted.

The scaling trade (a dense GPT against a MoE GPT of the same active FLOPs) is ``benchmarks/moe.py --dense``'s, read
from ``benchmarks/results/moe.jsonl`` (:func:`dense_trade`); a file without it says so.
"""
from __future__ import annotations

import statistics
from typing import Callable, Optional

from labkit.config import Config, cpu_count, load_config
from labkit.metrics.events import final_trajectory

EXPERTS, TOP_K = 8, 2  # the lab's MoE: 8 experts a layer, each token through 2 of them
ROUTING_TOKENS, ROUTING_WIDTH = 512, 32  # the in-process routing: tokens of one forward, and their width
ALPHA = 0.01  # the auxiliary loss's α (model.moe.aux_loss_alpha's default), for the value the explorer prints
FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)  # capacity factors the drop curve measures
ARMS = ("none", "aux_loss", "loss_free")  # model.moe.balance, side by side
WARMUP = 3  # steps left out of the expert-parallel run's medians (allocations, first all-to-alls)


# ---------------------------------------------------------------- routing, in this process


def routing_inputs(experts: int, tokens: int = ROUTING_TOKENS, width: int = ROUTING_WIDTH, seed: int = 0):
    """Seeded tokens (T, width + 1) and router weights (E, width + 1): a random router (logits of unit spread)
    whose last input is a constant 1, so that raising weight[e, -1] raises expert e's logit for every token."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(tokens, width, generator=g), torch.ones(tokens, 1)], dim=1)
    weight = torch.cat([torch.randn(experts, width, generator=g) / width ** 0.5, torch.zeros(experts, 1)], dim=1)
    return x, weight


def route(experts: int = EXPERTS, top_k: int = TOP_K, factor: Optional[float] = 1.25, skew: float = 0.0,
          bias_steps: int = 0, bias_update: float = 0.01, tokens: int = ROUTING_TOKENS, seed: int = 0) -> dict:
    """One forward's routing of ``tokens`` tokens by labkit's functions: expert 0's logit raised by ``skew``; with
    ``bias_steps`` the loss-free bias moved that many times (step ``bias_update``) against the load of these fixed
    probabilities, then used for the choice; capacity ``factor`` (None: dropless).

    Returns the load per expert (assignments routed to it), what each kept and dropped, the capacity, max/mean
    load, the share dropped, the Switch auxiliary loss α·E·Σ fᵢ·Pᵢ at α = :data:`ALPHA`, and the bias."""
    import torch

    from labkit.model.moe import (expert_capacity, loss_free_update, router_probabilities, select_experts,
                                  switch_aux_loss, within_capacity)

    x, weight = routing_inputs(experts, tokens, seed=seed)
    weight[0, -1] = skew
    probs = router_probabilities(x, weight)
    bias = torch.zeros(experts)
    for _ in range(bias_steps):
        chosen, _ = select_experts(probs, top_k, bias)
        loss_free_update(bias, torch.bincount(chosen.reshape(-1), minlength=experts), bias_update)
    chosen, _ = select_experts(probs, top_k, bias if bias_steps else None)
    capacity = expert_capacity(tokens, experts, top_k, factor)
    kept = within_capacity(chosen, experts, capacity)
    load = torch.bincount(chosen.reshape(-1), minlength=experts)
    took = torch.bincount(chosen[kept], minlength=experts)
    return {"experts": experts, "top_k": top_k, "tokens": tokens, "factor": factor, "skew": skew,
            "bias_steps": bias_steps, "bias_update": bias_update, "capacity": capacity,
            "load": load.tolist(), "kept": took.tolist(), "dropped": (load - took).tolist(),
            "max_mean": float(load.max()) / (top_k * tokens / experts),
            "drop_share": float((~kept).sum()) / (top_k * tokens),
            "aux_loss": float(switch_aux_loss(probs, load, ALPHA)), "alpha": ALPHA, "bias": bias.tolist()}


def balanced_drop(tokens: int, experts: int, top_k: int, factor: Optional[float]) -> float:
    """The share of assignments dropped if every expert got exactly k·T/E of them (a formula, not a count):
    max(0, 1 − C ÷ (k·T/E)) with C = ⌈k·T/E × factor⌉ (:func:`labkit.model.moe.expert_capacity`)."""
    from labkit.model.moe import expert_capacity

    capacity = expert_capacity(tokens, experts, top_k, factor)
    return 0.0 if capacity is None else max(0.0, 1.0 - capacity / (top_k * tokens / experts))


def drop_curve(skew: float, factors=FACTORS, experts: int = EXPERTS, top_k: int = TOP_K,
               tokens: int = ROUTING_TOKENS, seed: int = 0) -> list[dict]:
    """The share dropped at each capacity factor, counted by ``within_capacity`` on one fixed routing (expert 0's
    logit raised by ``skew``), beside :func:`balanced_drop`'s formula."""
    rows = []
    for factor in factors:
        routed = route(experts, top_k, factor, skew, tokens=tokens, seed=seed)
        rows.append({"factor": factor, "capacity": routed["capacity"], "measured": routed["drop_share"],
                     "balanced_formula": balanced_drop(tokens, experts, top_k, factor),
                     "max_mean": routed["max_mean"]})
    return rows


# ---------------------------------------------------------------- the layout, and the runs' config


def lab_layout(cores: Optional[int] = None) -> dict:
    """How many gloo processes the lab's runs start, and the expert-parallel degree: 4 (ep = 4, 2 experts a rank)
    with four or more cores, else 2 (ep = 2: more processes than cores would share them); said in ``why``."""
    cores = cores or cpu_count()
    nproc = 4 if cores >= 4 else 2
    over = "both" if nproc == 2 else f"all {nproc}"
    why = (f"{cores} CPU core{'s' if cores != 1 else ''} here: {nproc} gloo processes on the CPU, expert parallelism "
           f"over {over} (ep = {nproc}: {EXPERTS // nproc} of the {EXPERTS} experts on each rank)")
    if cores < nproc:
        why += f"; {nproc} processes take turns on {cores} core"
    return {"nproc": nproc, "ep": nproc, "cores": cores, "why": why}


def lab_config(quick: bool, **overrides) -> Config:
    """The lab's MoE GPT: 2 blocks 64 wide, each MLP 8 experts with top-2 routing (capacity 1.25, the Switch
    auxiliary loss: ``model.moe``'s defaults), on the shipped Markov corpus, on the CPU over gloo. Quick mode (the
    test run) trains 30 steps instead of 150. No alerts: a profile one started would land in one run of a
    comparison and not the others. ``overrides``: dotted keys."""
    steps = 30 if quick else 150
    base = {"run.name": "moe-lab", "run.steps": steps, "run.eval_every": steps, "run.save_final": False,
            "run.device": "cpu", "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 64,
            "model.moe.experts": EXPERTS, "model.moe.top_k": TOP_K, "data.dataset": "markov",
            "data.batch_size": 16, "data.micro_batch_size": 4, "optim.lr": 1e-2, "optim.warmup_steps": 5,
            "metrics.alerts": False}
    return load_config(None, {**base, **overrides})


def describe_config(cfg: Config, nproc: int) -> str:
    m, moe = cfg.model, cfg.model.moe
    capacity = "dropless" if moe.capacity_factor is None else f"capacity factor {moe.capacity_factor:g}"
    return (f"{m.n_layer} blocks × {m.n_embd} wide, every MLP {moe.experts} experts, top-{moe.top_k}, {capacity}; "
            f"{cfg.data.batch_size} sequences of {m.block_size} tokens a step on {nproc} processes, "
            f"{cfg.run.steps} steps")


# ---------------------------------------------------------------- a MoE run's step events


def routed_steps(events: list[dict]) -> list[dict]:
    """The step events (of the trajectory that made the model) that carry routing counts."""
    return [e for e in final_trajectory(events) if e.get("moe_load")]


def worst_max_mean(step: dict) -> Optional[float]:
    """A step's max/mean load over its MoE layers: the most overloaded layer's (None before any token)."""
    values = [v for v in step.get("moe_max_mean") or [] if v is not None]
    return max(values) if values else None


def mean_over_steps(steps: list[dict], key: str, last: int = 10) -> Optional[float]:
    """The mean over the last ``last`` steps and over the MoE layers of a per-layer field (``moe_max_mean``,
    ``moe_drop_rate``); None without values."""
    values = [v for e in steps[-last:] for v in e.get(key) or [] if v is not None]
    return sum(values) / len(values) if values else None


def final_val_loss(events: list[dict]) -> Optional[float]:
    """A run's last validation loss (its ``eval`` events; evaluation runs in eval mode: no auxiliary loss)."""
    evals = [e for e in events if e.get("type") == "eval" and e.get("val_loss") is not None]
    return evals[-1]["val_loss"] if evals else None


# ---------------------------------------------------------------- balancing: runs that differ only in it


def balance_runs(config: Config, nproc: int, arms=ARMS, have: Optional[dict] = None,
                 on_progress: Optional[Callable[[str], None]] = None) -> dict[str, dict]:
    """One real run per ``model.moe.balance`` of ``arms``, one after another (same seed, data and steps: they differ
    only in the balancing); ``have`` holds arms already run (``{arm: Run}``: the live run). Returns
    ``{arm: {"events", "summary", "run_dir"}}`` in ``arms``' order."""
    from labkit.experiments import sweep

    have = dict(have or {})
    todo = [(arm, {"model.moe.balance": arm, "run.name": f"moe-{arm}"}) for arm in arms if arm not in have]
    done = sweep(config, nproc, todo, lambda run, label, _: (label, run), on_progress) if todo else []
    have.update(dict(done))
    return {arm: {"events": have[arm].events(), "summary": have[arm].summary, "run_dir": str(have[arm].run_dir)}
            for arm in arms}


def balance_rows(runs: dict[str, dict], last: int = 10) -> list[dict]:
    """Per arm: max/mean load and the share dropped over its last ``last`` steps (means over steps and layers), its
    validation loss at the end and its final auxiliary loss (None unless ``aux_loss``)."""
    rows = []
    for arm, run in runs.items():
        steps = routed_steps(run["events"])
        aux = [v for v in steps[-1].get("moe_aux_loss") or [] if v is not None] if steps else []
        rows.append({"balance": arm, "max_mean": mean_over_steps(steps, "moe_max_mean", last),
                     "drop_rate": mean_over_steps(steps, "moe_drop_rate", last),
                     "val_loss": final_val_loss(run["events"]), "aux_loss": sum(aux) if aux else None,
                     "steps": len(steps)})
    return rows


# ---------------------------------------------------------------- expert parallelism: the all-to-all


def balanced_ep_bytes(cfg: Config, nproc: int, ep: int) -> float:
    """What one rank sends per step on the ep axis if every expert got exactly its share (a formula, not a count):
    per MoE layer and micro-batch of T tokens, dispatch and combine each move the k·T·(ep − 1)/ep assignments
    whose expert is on another rank, d values each (4 bytes in fp32), forward and again backward, after the
    counts (E int64, (ep − 1)/ep of them to other ranks) that go first in forward (:mod:`labkit.parallel.ep.dispatch`;
    the step model's own messages, :func:`labkit.sim.experts.balanced_ep_bytes`)."""
    from labkit.sim.experts import balanced_ep_bytes as model_bytes
    from labkit.sim.layout import Layout, ModelShape

    m = cfg.model
    shape = ModelShape(m.n_embd, m.n_layer, m.n_head, m.block_size, 1, m.moe.experts, m.moe.top_k, m.moe.every)
    micro_batches = cfg.data.batch_size // (nproc * cfg.data.micro_batch_size)
    layout = Layout(dp=nproc, ep=ep, micro_batch=cfg.data.micro_batch_size, micro_batches=micro_batches)
    return model_bytes(shape, layout, 4)


def ep_record(events: list[dict], cfg: Config, nproc: int, ep: int) -> dict:
    """An expert-parallel run's all-to-all, from its step events after the first :data:`WARMUP`: the medians of
    the bytes rank 0 sent on the ep axis per step, the seconds in the all-to-alls and their share of the step, the
    balanced formula's bytes beside them, and the step whose time is the median (its timeline: what to draw)."""
    steps = routed_steps(events)
    steady = steps[WARMUP:] if len(steps) > WARMUP else steps
    times = sorted(steady, key=lambda e: e["step_time_s"])
    typical = times[len(times) // 2]
    counted = statistics.median(e["model_comm_bytes"] for e in steady)
    formula = balanced_ep_bytes(cfg, nproc, ep)
    return {"nproc": nproc, "ep": ep, "experts": cfg.model.moe.experts, "top_k": cfg.model.moe.top_k,
            "n_embd": cfg.model.n_embd, "tokens": cfg.data.micro_batch_size * cfg.model.block_size,
            "micro_batches": cfg.data.batch_size // (nproc * cfg.data.micro_batch_size),
            "moe_layers": cfg.model.n_layer // cfg.model.moe.every, "steps": len(steady),
            "bytes_per_step": counted, "formula_bytes": formula,
            "counted_vs_formula": counted / formula if formula else None,
            "all_to_all_s": statistics.median(e["model_comm_s"] for e in steady),
            "all_to_all_frac": statistics.median(e["model_comm_frac"] for e in steady),
            "step_s": statistics.median(e["step_time_s"] for e in steady),
            "calls": statistics.median(e.get("model_comm_calls") or 0 for e in steady),
            "drop_rate": statistics.median(sum(e["moe_drop_rate"]) / len(e["moe_drop_rate"]) for e in steady),
            "typical_step": typical["step"], "timeline": typical.get("timeline") or {}}


def ep_run(config: Config, nproc: int, ep: int, steps: Optional[int] = None,
           on_progress: Optional[Callable[[str], None]] = None) -> dict:
    """One real run with the experts spread over ``ep`` of the ``nproc`` ranks (``steps`` of them, default the
    config's; no evaluation: only the steps' all-to-alls are read); its :func:`ep_record`."""
    from labkit.experiments import sweep

    cfg = config.replace(**{"parallel.ep.degree": ep, "run.name": f"moe-ep{ep}", "run.eval_every": 0,
                            "run.steps": steps or config.run.steps})
    (events,) = sweep(cfg, nproc, [(f"ep = {ep}", {})], lambda run, *_: run.events(), on_progress)
    return {**ep_record(events, cfg, nproc, ep), "config": describe_config(cfg, nproc)}


# ---------------------------------------------------------------- the scaling trade, from benchmarks/moe.py


def dense_trade(records: Optional[list[dict]] = None) -> Optional[dict]:
    """``benchmarks/moe.py --dense``'s newest full (not ``--quick``) table from ``benchmarks/results/moe.jsonl``
    (or ``records``), as ``{"record", "flops", "speed", "dense", "moe"}``; None where it has not been measured."""
    record = benchmark_table("dense", records)
    if record is None:
        return None
    rows = record["rows"]
    by_check = {row["check"]: row for row in rows}
    return {"record": record, "flops": by_check.get("active FLOPs per token, MoE/dense"),
            "speed": by_check.get("MoE/dense tokens per second"),
            **{row["model"]: row for row in rows if row.get("model") in ("dense", "moe")}}


def benchmark_table(table: str, records: Optional[list[dict]] = None) -> Optional[dict]:
    """``benchmarks/moe.py``'s newest full (not ``--quick``) record of ``table`` in ``benchmarks/results/moe.jsonl``
    (or ``records``), or None where it has not been measured."""
    from labkit.results import latest, load_results, results_path

    if records is None:
        if not results_path("moe").is_file():
            return None
        records = load_results("moe")
    try:
        return latest(records, table, quick=False)
    except LookupError:
        return None


def balance_benchmark(records: Optional[list[dict]] = None) -> Optional[dict]:
    """``benchmarks/moe.py --balance``'s table: steps to max/mean ≤ 1.1 from an overloaded router, per method."""
    return benchmark_table("balance", records)


def ep_benchmark(records: Optional[list[dict]] = None) -> Optional[dict]:
    """``benchmarks/moe.py --ep``'s table: one MoE GPT on 4 processes at ep = 2 and 4 against ep = 1, in rounds."""
    return benchmark_table("ep", records)


__all__ = ["routed_steps", "worst_max_mean", "mean_over_steps", "final_val_loss", "route", "drop_curve",
           "balanced_drop", "lab_layout", "lab_config", "describe_config", "balance_runs", "balance_rows",
           "balanced_ep_bytes", "ep_record", "ep_run", "dense_trade", "benchmark_table", "balance_benchmark",
           "ep_benchmark"]
