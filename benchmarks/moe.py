"""Mixture of experts, checked and measured (issue 37): the grouped matmul against the loop, a MoE GPT against a
dense one at the same active FLOPs, and the steps each balancing method takes to undo an overloaded router.

Each part is its own flag (none given: the first three); each appends its tables to ``benchmarks/results/moe.jsonl``
(:mod:`labkit.results`). Timings follow labkit's rounds rule (:mod:`labkit.rounds`): the two sides alternate which
goes first, every round is kept, and "faster" is said only when the interquartile range of the rounds' ratios
excludes 1.0; a series that drifts is reported as drift.

1. ``--grouped``: one MoE layer (``model.moe``'s defaults: top-2, capacity 1.25, the Switch auxiliary loss), forward
   and backward with ``impl: loop`` (a Python loop over the experts) against ``impl: grouped`` (one
   ``torch._grouped_mm`` per expert layer), on the same tokens from the same weights. First checked: both give the
   same output and gradients. The row says which path ran (``MoE.last_path``: ``grouped_mm``, or
   ``grouped_split`` where the width does not suit the grouped matmul) and on which CPU (on the CPU, torch runs the
   grouped matmul as a loop of matmuls in C++: what it saves is the Python loop and the per-expert gathers).
2. ``--dense``: a dense GPT against a MoE GPT whose every MLP is E experts of the same width with top-1 routing and
   no capacity limit (dropless), so each token goes through exactly one MLP's worth of weights: the same active
   FLOPs but for the router's E·d per layer (checked with labkit's own count, ``labkit.model.flops_per_token``, in
   each run's summary). Both train with labkit's trainer, one process, the same data, seed and steps; loss-free
   balancing, so the training loss is the language-modelling loss alone. Parameters both models share by name
   start equal (``labkit.model.init``). Reported: tokens/s in interleaved rounds (MoE over dense, higher is
   faster), and the training and validation loss after the N steps.
3. ``--balance``: a router overloaded at the start — before the first step each MoE layer's router row 0 gets the
   mean direction of the tokens entering it, scaled so that the mean token's logit for expert 0 rises by
   ``OVERLOAD_LOGIT`` — then the optimizer steps until a step's max/mean load (worst MoE layer) is ≤ 1.1, with
   ``balance: loss_free`` (DeepSeek-V3's bias, the default step u = 0.001) and with ``balance: aux_loss`` at each
   ``--aux-alphas`` (Switch's α; the default 0.01 first). labkit's real training loop (``labkit.train.train``, a
   config per run); the overload is one extra callback whose ``on_start`` turns the routers
   (:class:`OverloadedStart`). Every seed's count is kept; a run that never got there within ``--bound`` steps
   says so (its count is null) and its arm's quartiles are then lower bounds. The starting max/mean of every run is
   measured (the first step's), not assumed. The first step at ≤ 1.1 can be a dip: each run also says how often
   the load stayed there afterwards and its median over the last 100 steps, beside what a perfectly balanced
   router measures on a batch of this size by chance. Each run's cosine schedule spans ``--bound`` steps, so the
   bound is part of the setting (the results keep it).
4. ``--ep``: one MoE GPT on 4 processes (dp 4) at ep = 1, 2, 4, launched as a user would (torchrun), in rounds of
   the three in rotated order: the median steady step time against ep = 1, the all-to-all's share of the step (it
   blocks: all of it is exposed) and the bytes rank 0 sent on the ep axis, counted at the collective, beside the
   balanced formula 2·k·T·d·(ep − 1)/ep per layer each way. On a 2-core machine 4 processes share 2 cores: the
   ratio says what the dispatch costs here, not on a cluster. Not run by default (``--ep``).

    .venv/bin/python benchmarks/moe.py [--grouped] [--dense] [--balance] [--ep] [--rounds 8] [--steps 200]
        [--seeds 1 2 3 4 5 6] [--bound 1500] [--aux-alphas 0.01 0.1]
    .venv/bin/python benchmarks/moe.py --quick    # every part shrunk to a smoke run (tests/benchmarks)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional
from unittest import mock

import torch

import labkit.train
from labkit.callbacks import Callback
from labkit.config import Config, load_config
from labkit.cpu import cpu_model
from labkit.data import validation_loader
from labkit.model.init import initialise
from labkit.model.moe import MoE, MoEShape, moe_layers
from labkit.results import results_path, write_results
from labkit.rounds import MIN_ROUNDS, describe, quartiles, ratio_summary
from labkit.sim.experts import rank_imbalance

NAME = "moe"
PARTS = ("grouped", "dense", "balance", "ep")
WARMUP = 5  # training steps before the clock starts
WARMUP_PASSES = 2  # one layer's forward-and-backward passes before the clock starts, each round
BALANCED = 1.1  # max/mean load at or under which a step counts as balanced
OVERLOAD_LOGIT = 3.0  # how far the mean token's logit for expert 0 rises at the start of a --balance run
FLOPS_TOLERANCE = 0.01  # the MoE GPT's FLOPs per token within 1% of the dense one's (the router's share)
EP_WORLD = 4  # part 4's processes: ep = 1, 2 and 4 of them (on 2 cores, 2 processes per core)

# Each size: part 1's layer, part 2's GPT and steps, part 3's GPT, bound and seeds; the flags override.
FULL = {"layer": {"n_embd": 128, "experts": 8, "tokens": 2048}, "passes": 5, "grouped_rounds": 8, "dense_rounds": 6,
        "gpt": {"model.n_layer": 4, "model.n_head": 4, "model.n_embd": 128, "model.block_size": 128,
                "data.batch_size": 16, "data.micro_batch_size": 16},
        "experts": 8, "steps": 200,
        "balance_gpt": {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 64,
                        "data.batch_size": 16, "data.micro_batch_size": 16},
        "balance_experts": 4, "bound": 1500, "seeds": [1, 2, 3, 4, 5, 6], "aux_alphas": [0.01, 0.1],
        "ep_gpt": {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 64,
                   "data.batch_size": 16, "data.micro_batch_size": 4},
        "ep_rounds": 6, "ep_steps": 30}
QUICK = {"layer": {"n_embd": 32, "experts": 4, "tokens": 256}, "passes": 2, "grouped_rounds": MIN_ROUNDS,
         "dense_rounds": 2,
         "gpt": {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 32,
                 "data.batch_size": 4, "data.micro_batch_size": 4},
         "experts": 4, "steps": WARMUP + 3,
         "balance_gpt": {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 32,
                         "data.batch_size": 8, "data.micro_batch_size": 8},
         "balance_experts": 4, "bound": 6, "seeds": [1, 2], "aux_alphas": [0.01],
         "ep_gpt": {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16,
                    "data.batch_size": 8, "data.micro_batch_size": 2},
         "ep_rounds": 1, "ep_steps": WARMUP + 3}


def round_order(r: int, sides: tuple[str, str]) -> tuple[str, str]:
    """Round r's order: the first side first in even rounds, the second in odd ones (ABBA: neither always leads)."""
    return sides if r % 2 == 0 else sides[::-1]


# ---------------------------------------------------------------- part 1: loop against grouped matmul


def moe_layer(impl: str, n_embd: int, experts: int, seed: int = 0) -> MoE:
    """A MoE layer with ``model.moe``'s defaults but ``experts`` and ``impl``, drawn by name from ``seed``
    (so two layers of one seed hold the same weights whatever their ``impl``), in training mode."""
    layer = MoE(MoEShape(experts=experts, impl=impl), n_embd)
    initialise(layer, 1, seed)
    return layer.train()


def forward_backward(layer: MoE, x: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    """One training pass as a block runs it: forward, the auxiliary loss added, backward; returns the output."""
    layer.zero_grad(set_to_none=True)
    layer.tally.reset()
    out = layer(x)
    ((out * upstream).sum() + layer.aux_loss).backward()
    return out.detach()


def largest_difference(loop: MoE, grouped: MoE, x: torch.Tensor, upstream: torch.Tensor) -> float:
    """The largest absolute difference between the two paths' outputs and every parameter's gradient."""
    outs = [forward_backward(layer, x, upstream) for layer in (loop, grouped)]
    grads = [{name: p.grad for name, p in layer.named_parameters()} for layer in (loop, grouped)]
    pairs = [tuple(outs)] + [(grads[0][name], grads[1][name]) for name in grads[0]]
    return max(float((a - b).abs().max()) for a, b in pairs)


def seconds_per_pass(layer: MoE, x: torch.Tensor, upstream: torch.Tensor, passes: int) -> float:
    """Mean wall time of ``passes`` forward-and-backward passes, after ``WARMUP_PASSES`` untimed ones."""
    for _ in range(WARMUP_PASSES):
        forward_backward(layer, x, upstream)
    start = time.perf_counter()
    for _ in range(passes):
        forward_backward(layer, x, upstream)
    return (time.perf_counter() - start) / passes


def grouped_vs_loop(size: dict, rounds: int) -> tuple[list[dict], dict]:
    """Part 1: each round times both paths, alternating which goes first; returns the rounds and the summary."""
    shape = size["layer"]
    layers = {impl: moe_layer(impl, shape["n_embd"], shape["experts"]) for impl in ("loop", "grouped")}
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, shape["tokens"], shape["n_embd"], generator=generator)
    upstream = torch.randn(1, shape["tokens"], shape["n_embd"], generator=generator)
    difference = largest_difference(layers["loop"], layers["grouped"], x, upstream)
    print(f"\n[1] one MoE layer, {shape['experts']} experts × {shape['n_embd']} wide, top-2, {shape['tokens']} tokens, "
          f"forward + backward, {size['passes']} passes per side per round, {torch.get_num_threads()} threads; "
          f"paths {layers['loop'].last_path} and {layers['grouped'].last_path} agree to {difference:.1e}")
    rows = []
    for r in range(rounds):
        order = round_order(r, ("loop", "grouped"))
        seconds = {impl: seconds_per_pass(layers[impl], x, upstream, size["passes"]) for impl in order}
        rows.append({"round": r + 1, "first": order[0], "loop_s": seconds["loop"], "grouped_s": seconds["grouped"],
                     "grouped_vs_loop": seconds["grouped"] / seconds["loop"]})
        print(f"  round {r + 1}: loop {1000 * seconds['loop']:8.2f} ms   grouped {1000 * seconds['grouped']:8.2f} ms"
              f"   grouped/loop {rows[-1]['grouped_vs_loop']:.3f}")
    spread = ratio_summary([row["grouped_vs_loop"] for row in rows], lower_is_faster=True)
    summary = {"check": "grouped/loop time per pass", **spread, "summary": describe(spread, "grouped/loop time"),
               "loop_path": layers["loop"].last_path, "grouped_path": layers["grouped"].last_path,
               "cpu": cpu_model(), "threads": torch.get_num_threads(), "largest_difference": difference,
               "paths_agree": difference <= 1e-4}
    print(f"  {summary['summary']} (the grouped path ran as {summary['grouped_path']}; {summary['cpu']})")
    return rows, summary


# ---------------------------------------------------------------- training runs (parts 2 and 3)


def gpt_config(model: dict, steps: int, seed: int, moe: Optional[dict] = None) -> Config:
    """One process, ``steps`` steps, validation once after the last, nothing written but the events. No alerts (a
    profile they start would land in one run, not the other) and a stated peak: no MFU is reported here, and the
    CPU's measured peak would cost seconds of matmuls inside the first run."""
    return load_config(None, {"run.name": "moe-bench", "run.steps": steps, "run.eval_every": steps, "run.seed": seed,
                              "run.save_final": False, "metrics.progress": False, "metrics.alerts": False,
                              "metrics.peak_tflops": 1.0, **model, **(moe or {})})


def top1_dropless(experts: int, balance: str = "loss_free") -> dict:
    """Every MLP E experts of its width, each token through one of them, none dropped: one MLP's FLOPs a token."""
    return {"model.moe.experts": experts, "model.moe.top_k": 1, "model.moe.capacity_factor": None,
            "model.moe.balance": balance}


def trained(cfg: Config) -> tuple[dict, list[dict]]:
    """Train ``cfg`` in this process with labkit's trainer; its summary and its step events."""
    with tempfile.TemporaryDirectory() as run_dir:
        summary = labkit.train.train(cfg, run_dir)
        events = [json.loads(line) for line in open(Path(run_dir) / "events.jsonl")]
    assert summary["status"] == "finished", summary.get("error")
    return summary, [e for e in events if e["type"] == "step"]


def steady_tokens_per_s(steps: list[dict], tokens_per_step: int) -> float:
    """Tokens/s between the end of step ``WARMUP`` and the end of the last (each event is written as its step
    ends; the evaluation after the last step comes after its event)."""
    steady = steps[WARMUP:]
    return tokens_per_step * (len(steady) - 1) / (steady[-1]["time"] - steady[0]["time"])


def mean_loss(steps: list[dict], last: int = 10) -> float:
    """The mean training loss of the last ``last`` steps (one step's loss is one batch's: noisy)."""
    return statistics.mean(e["loss"] for e in steps[-last:])


# ---------------------------------------------------------------- part 2: dense against MoE


def dense_run(cfg: Config) -> dict:
    """One run's tokens/s, losses and labkit's FLOP and parameter counts."""
    summary, steps = trained(cfg)
    return {"tokens_per_s": steady_tokens_per_s(steps, cfg.data.batch_size * cfg.model.block_size),
            "final_loss": steps[-1]["loss"], "train_loss_last10": mean_loss(steps), "val_loss": summary["val_loss"],
            "val_floor": summary.get("val_floor"), "flops_per_token": summary["flops_per_token"],
            "params": summary["params"], "max_mean": steps[-1].get("moe_max_mean")}


def flops_check(dense: dict, moe: dict) -> dict:
    """The MoE GPT's FLOPs per token against the dense one's (labkit's count: active parameters for a MoE)."""
    ratio = moe["flops_per_token"] / dense["flops_per_token"]
    return {"check": "active FLOPs per token, MoE/dense", "dense_flops_per_token": dense["flops_per_token"],
            "moe_flops_per_token": moe["flops_per_token"], "ratio": ratio,
            "held": abs(ratio - 1) <= FLOPS_TOLERANCE, "tolerance": FLOPS_TOLERANCE,
            "dense_params": dense["params"], "moe_params": moe["params"]}


def loss_row(name: str, runs: list[dict]) -> dict:
    """A model's losses after the N steps: the median over rounds and each round's (a seeded run repeats them)."""
    keys = ("final_loss", "train_loss_last10", "val_loss")
    return {"check": f"{name} loss", "model": name, **{k: statistics.median(run[k] for run in runs) for k in keys},
            **{f"{k}_rounds": [run[k] for run in runs] for k in keys}, "val_floor": runs[0]["val_floor"]}


def dense_vs_moe(size: dict, rounds: int, steps: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Part 2: each round trains both models from scratch, alternating which goes first; returns the rounds and the
    summary rows (the FLOPs check, the tokens/s ratio, each model's losses)."""
    configs = {"dense": gpt_config(size["gpt"], steps, seed),
               "moe": gpt_config(size["gpt"], steps, seed, top1_dropless(size["experts"]))}
    print(f"\n[2] dense GPT against MoE GPT ({size['experts']} experts, top-1, dropless, loss-free), "
          f"{steps} steps each ({WARMUP} warm-up), seed {seed}: {size['gpt']}")
    rows, runs = [], {"dense": [], "moe": []}
    for r in range(rounds):
        for name in round_order(r, ("dense", "moe")):
            runs[name].append(dense_run(configs[name]))
        dense, moe = runs["dense"][-1], runs["moe"][-1]
        rows.append({"round": r + 1, "first": round_order(r, ("dense", "moe"))[0],
                     "dense_tokens_per_s": dense["tokens_per_s"], "moe_tokens_per_s": moe["tokens_per_s"],
                     "moe_vs_dense": moe["tokens_per_s"] / dense["tokens_per_s"],
                     "dense_val_loss": dense["val_loss"], "moe_val_loss": moe["val_loss"]})
        print(f"  round {r + 1}: dense {dense['tokens_per_s']:9.0f} tok/s   MoE {moe['tokens_per_s']:9.0f} tok/s   "
              f"MoE/dense {rows[-1]['moe_vs_dense']:.3f}   val loss {dense['val_loss']:.4f} / {moe['val_loss']:.4f}")
    flops = flops_check(runs["dense"][0], runs["moe"][0])
    spread = ratio_summary([row["moe_vs_dense"] for row in rows], lower_is_faster=False)
    speed = {"check": "MoE/dense tokens per second", **spread, "summary": describe(spread, "MoE/dense tokens/s")}
    summary = [flops, speed, loss_row("dense", runs["dense"]), loss_row("moe", runs["moe"])]
    print(f"  FLOPs per token MoE/dense {flops['ratio']:.4f} ({'held' if flops['held'] else 'NOT held'}: "
          f"within {FLOPS_TOLERANCE:.0%}); {speed['summary']}")
    for row in summary[2:]:
        print(f"  {row['model']:5s} after {steps} steps: train loss (last 10) {row['train_loss_last10']:.4f}, "
              f"validation {row['val_loss']:.4f} (floor {row['val_floor']})")
    return rows, summary


# ---------------------------------------------------------------- part 3: steps to balance


def layer_inputs(model: torch.nn.Module, layer: MoE, idx: torch.Tensor) -> torch.Tensor:
    """The (tokens, d) rows that reach ``layer``'s router when ``model`` reads ``idx``."""
    seen = []
    hook = layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].reshape(-1, args[0].size(-1))))
    try:
        model(idx)
    finally:
        hook.remove()
    return seen[0]


@torch.no_grad()
def overload_routers(model: torch.nn.Module, idx: torch.Tensor, logit: float) -> None:
    """Turn each MoE layer's router towards expert 0: its row 0 gains logit·m/|m|², m the mean of the rows h entering
    it, so each row's logit for expert 0 rises by logit·(h·m)/|m|² — by ``logit`` on average, and for most rows by
    about that much, since most lean along their mean. Layers in order, each seeing the earlier ones already
    turned; evaluation mode (nothing is counted) on validation tokens (the training data's order is left alone)."""
    model.eval()
    for layer in moe_layers(model):
        mean = layer_inputs(model, layer, idx).mean(dim=0)
        layer.router.weight[0] += logit * mean / mean.square().sum()
    model.train()


class OverloadedStart(Callback):
    """Before the first step, :func:`overload_routers` on the first validation micro-batch."""

    def __init__(self, model, val_ds, micro_batch_size: int, logit: float):
        self.model, self.logit = model, logit
        self.idx = validation_loader(val_ds, micro_batch_size).next_micro_batch()[0]

    def on_start(self, trainer) -> None:
        overload_routers(self.model, self.idx, self.logit)


def with_overloaded_start(logit: float):
    """labkit's callbacks with :class:`OverloadedStart` first: patches ``labkit.train.standard_callbacks`` while a
    run is built (a context manager)."""
    standard = labkit.train.standard_callbacks

    def callbacks(cfg, env, run_dir, sink, val_ds, model, summary):
        first = OverloadedStart(model, val_ds, cfg.data.micro_batch_size, logit)
        return [first, *standard(cfg, env, run_dir, sink, val_ds, model, summary)]
    return mock.patch.object(labkit.train, "standard_callbacks", callbacks)


def arms(aux_alphas: list[float]) -> list[dict]:
    """The balancing methods compared: loss-free at its default step, then the auxiliary loss at each α."""
    loss_free = {"method": "loss_free", "overrides": {"model.moe.balance": "loss_free"}}
    return [loss_free] + [{"method": f"aux_loss alpha={alpha:g}", "overrides": {
        "model.moe.balance": "aux_loss", "model.moe.aux_loss_alpha": alpha}} for alpha in aux_alphas]


def worst_max_mean(step: dict) -> float:
    """A step's max/mean load over its MoE layers: the most overloaded layer's."""
    return max(step["moe_max_mean"])


def steps_to_balance(steps: list[dict], balanced: float = BALANCED) -> Optional[int]:
    """Optimizer steps taken before the first step whose load is balanced (step i's forward ran after i updates);
    None if no step was."""
    return next((i for i, step in enumerate(steps) if worst_max_mean(step) <= balanced), None)


def chance_max_mean(tokens: int, experts: int, draws: int = 1000) -> float:
    """The median max/mean load of ``tokens`` sent each to an expert drawn uniformly at random: what a perfectly
    balanced top-1 router measures on one batch (a finite batch's noise; the closer to ``BALANCED``, the more a
    step's load crosses it by chance)."""
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(experts, (draws, tokens), generator=generator)
    load = torch.zeros(draws, experts).scatter_add_(1, picks, torch.ones(draws, tokens))
    return float((load.max(dim=1).values / (tokens / experts)).median())


def language_model_loss(step: dict) -> float:
    """A step's loss less its auxiliary losses (one micro-batch a step: the event's loss is their sum)."""
    return step["loss"] - sum(aux or 0.0 for aux in step["moe_aux_loss"])


def balance_run(size: dict, seed: int, bound: int, arm: dict) -> dict:
    """One seed, one method: ``bound`` steps from the overloaded start; the count, the start and what followed."""
    cfg = gpt_config(size["balance_gpt"], bound, seed, {**top1_dropless(size["balance_experts"]), **arm["overrides"]})
    with with_overloaded_start(OVERLOAD_LOGIT):
        summary, steps = trained(cfg)
    count = steps_to_balance(steps)
    after = steps[count:] if count is not None else []
    moe = cfg.model.moe
    return {"method": arm["method"], "seed": seed, "steps_to_balance": count, "reached": count is not None,
            "bound": bound, "start_max_mean": worst_max_mean(steps[0]), "overloaded": worst_max_mean(steps[0]) >= 2,
            "end_max_mean": worst_max_mean(steps[-1]),
            "median_max_mean_last100": statistics.median(worst_max_mean(s) for s in steps[-100:]),
            "share_balanced_after": (sum(worst_max_mean(s) <= BALANCED for s in after) / len(after)) if after else None,
            "balance": moe.balance, "aux_loss_alpha": moe.aux_loss_alpha, "bias_update": moe.bias_update,
            "lm_loss_last10": statistics.mean(language_model_loss(s) for s in steps[-10:]),
            "val_loss": summary["val_loss"], "loop": "labkit.train.train (one process), OverloadedStart callback"}


def steps_summary(method: str, runs: list[dict], bound: int, chance: float) -> dict:
    """An arm's counts over the seeds: median and IQR, a run that hit the bound counted as ``bound`` — the
    quartiles are then lower bounds (``at_least``), never a count that was not measured. Beside them, how the load
    went on (the first balanced step may be a dip: ``share_balanced_after``, ``median_max_mean_last100``) and
    ``chance``, a perfectly balanced router's max/mean on one batch (:func:`chance_max_mean`)."""
    shares = [run["share_balanced_after"] for run in runs if run["share_balanced_after"] is not None]
    counts = [run["steps_to_balance"] for run in runs]
    q1, median, q3 = quartiles([bound if c is None else c for c in counts])
    reached = sum(c is not None for c in counts)
    return {"check": f"steps to max/mean <= {BALANCED}", "method": method, "seeds": [run["seed"] for run in runs],
            "steps": counts, "reached": reached, "n_seeds": len(runs), "bound": bound,
            "bound_hit": reached < len(runs), "median": median, "q1": q1, "q3": q3, "at_least": reached < len(runs),
            "start_max_mean": [run["start_max_mean"] for run in runs],
            "every_start_overloaded": all(run["overloaded"] for run in runs),
            "share_balanced_after": statistics.median(shares) if shares else None,
            "median_max_mean_last100": statistics.median(run["median_max_mean_last100"] for run in runs),
            "chance_max_mean": chance, "lm_loss_last10": statistics.median(run["lm_loss_last10"] for run in runs),
            "enough_seeds": len(runs) >= MIN_ROUNDS}


def describe_steps(row: dict) -> str:
    """'loss_free: 480 steps (IQR 455–512, 6 of 6 seeds balanced)', 'at least' where a seed hit the bound."""
    bound = "at least " if row["at_least"] else ""
    return (f"{row['method']}: {bound}{row['median']:.0f} steps (IQR {row['q1']:.0f}–{row['q3']:.0f}; "
            f"{row['reached']} of {row['n_seeds']} seeds balanced within {row['bound']} steps); over the last 100 "
            f"steps max/mean {row['median_max_mean_last100']:.2f} (a balanced router's, by chance: "
            f"{row['chance_max_mean']:.2f})")


def steps_to_balance_table(size: dict, seeds: list[int], bound: int, aux_alphas: list[float]):
    """Part 3: every seed under every method; returns the runs and one summary row per method."""
    print(f"\n[3] steps to max/mean ≤ {BALANCED} from an overloaded router (+{OVERLOAD_LOGIT:g} logit towards "
          f"expert 0), {size['balance_experts']} experts, top-1, dropless, at most {bound} steps, seeds {seeds}: "
          f"{size['balance_gpt']}")
    gpt = size["balance_gpt"]
    chance = chance_max_mean(gpt["data.batch_size"] * gpt["model.block_size"], size["balance_experts"])
    runs, summary = [], []
    for arm in arms(aux_alphas):
        mine = []
        for seed in seeds:
            mine.append(balance_run(size, seed, bound, arm))
            run = mine[-1]
            print(f"  {arm['method']:20s} seed {seed}: max/mean {run['start_max_mean']:.2f} → "
                  f"{run['end_max_mean']:.2f} (median of the last 100 steps {run['median_max_mean_last100']:.2f}); "
                  f"first ≤ {BALANCED} after {run['steps_to_balance'] if run['reached'] else f'> {bound} (bound hit)'}"
                  f" steps")
        runs += mine
        summary.append(steps_summary(arm["method"], mine, bound, chance))
        print(f"  {describe_steps(summary[-1])}")
    return runs, summary


# ---------------------------------------------------------------- part 4: expert parallelism (to come)


def ep_config(size: dict, ep: int, steps: int) -> Config:
    """Part 4's run: a MoE GPT on ``EP_WORLD`` processes (dp = EP_WORLD), its experts spread over ``ep`` of them."""
    return load_config(None, {"run.name": f"moe-ep{ep}", "run.steps": steps, "run.eval_every": 0, "run.seed": 7,
                              "run.save_final": False, "metrics.progress": False, "metrics.alerts": False,
                              "metrics.peak_tflops": 1.0, "parallel.dp.strategy": "ddp_bucketed",
                              "parallel.ep.degree": ep, **size["ep_gpt"],
                              "model.moe.experts": size["experts"], "model.moe.top_k": 2,
                              "model.moe.capacity_factor": None})


def ep_run(cfg: Config) -> dict:
    """One launch (torchrun, ``EP_WORLD`` processes): the median steady step time, the share of it in the all-to-all
    (blocking: all of it exposed) and the bytes rank 0 sent on the ep axis per step (counted at the collective)."""
    from labkit.launcher import launch

    with tempfile.TemporaryDirectory() as root:
        run = launch(cfg, nproc=EP_WORLD, run_dir=Path(root) / "run")
        assert run.wait(timeout=900) == "finished", run.log()[-3000:]
        steps = [json.loads(line) for line in open(run.run_dir / "events.jsonl")]
    steady = [e for e in steps if e["type"] == "step"][WARMUP:]
    return {"step_s": statistics.median(e["step_time_s"] for e in steady),
            "all_to_all_s": statistics.median(e["model_comm_s"] for e in steady),
            "all_to_all_frac": statistics.median(e["model_comm_frac"] for e in steady),
            "ep_bytes_per_step": statistics.median(e["model_comm_bytes"] for e in steady),
            "max_mean": statistics.median(max(e["moe_max_mean"]) for e in steady),
            "rank_max_mean": statistics.median(max(rank_imbalance(load, cfg.parallel.ep.degree)
                                                   for load in e["moe_load"]) for e in steady)}


def balanced_ep_bytes(cfg: Config, ep: int) -> float:
    """What one rank sends per step on the ep axis at perfect balance (:func:`labkit.moe_lab.balanced_ep_bytes`: the
    step model's messages, 2·k·T·d·(ep − 1)/ep fp32 values each way a layer and micro-batch, and the counts)."""
    from labkit.moe_lab import balanced_ep_bytes as formula

    return formula(cfg, EP_WORLD, ep)


def modelled_ep_step(cfg: Config, imbalance: float) -> dict:
    """The step model calibrated on this machine (:mod:`labkit.sim.calibrate`, the newest full calibration in
    ``benchmarks/results/sim_calibration.jsonl``, fitted to other runs: these are held out) for this run, told the
    measured imbalance (max/mean rows over the ep ranks, :func:`labkit.sim.experts.rank_imbalance`): its step time
    and its all-to-all time — the calls' α–β time, their fitted per-call cost, and the wait for the busiest rank's
    experts, which a blocking all-to-all's timer holds on any rank but the busiest. Modelled, not measured."""
    from labkit.parallel.layout_checks import vocab_size_of
    from labkit.results import latest, load_results
    from labkit.sim.calibrate import Calibration, layout_of, predict, shape_of

    record = latest(load_results("sim_calibration"), "calibration", quick=False)
    cal = Calibration.from_dict(record["settings"]["constants"])
    layout = dataclasses.replace(layout_of(cfg, EP_WORLD), expert_imbalance=imbalance)
    terms = predict(shape_of(cfg, vocab_size_of(cfg)), layout, cal, EP_WORLD)
    all_to_all = terms["ep_comm"] + terms["all_to_all_overhead"] + terms["expert_imbalance"]
    return {"modelled_step_s": terms["total"], "modelled_all_to_all_s": all_to_all,
            "calibration": {"date": record["date"], "commit": record["commit"]}}


def expert_parallel_step_times(size: dict, rounds: int, steps: int) -> tuple[list[dict], list[dict]]:
    """Part 4: the same MoE GPT on ``EP_WORLD`` processes at ep = 1, 2, 4, in interleaved rounds (each round runs
    the three in a rotated order): step time against ep = 1, the all-to-all's share, and the bytes counted against
    the balanced formula (routing is never perfectly balanced: the ratio says by how much it differs)."""
    degrees = (1, 2, 4)
    configs = {ep: ep_config(size, ep, steps) for ep in degrees}
    print(f"\n[4] MoE GPT on {EP_WORLD} processes at ep = 1, 2, 4 ({size['experts']} experts, top-2, dropless), "
          f"{steps} steps each ({WARMUP} warm-up): {size['ep_gpt']}")
    rows = []
    for r in range(rounds):
        order = degrees[r % 3:] + degrees[:r % 3]
        runs = {ep: ep_run(configs[ep]) for ep in order}
        row = {"round": r + 1, "order": list(order)}
        for ep in degrees:
            row |= {f"ep{ep}_{key}": runs[ep][key] for key in runs[ep]}
        row |= {f"ep{ep}_vs_ep1": runs[ep]["step_s"] / runs[1]["step_s"] for ep in degrees[1:]}
        rows.append(row)
        print(f"  round {r + 1}: " + "   ".join(f"ep{ep} {runs[ep]['step_s'] * 1e3:6.1f} ms "
                                                f"(all-to-all {runs[ep]['all_to_all_frac']:.0%})" for ep in degrees))
    summary = []
    for ep in degrees[1:]:
        spread = ratio_summary([row[f"ep{ep}_vs_ep1"] for row in rows])
        counted = statistics.median(row[f"ep{ep}_ep_bytes_per_step"] for row in rows)
        formula = balanced_ep_bytes(configs[ep], ep)
        median = {key: statistics.median(row[f"ep{ep}_{key}"] for row in rows)
                  for key in ("step_s", "all_to_all_s", "all_to_all_frac", "max_mean", "rank_max_mean")}
        model = modelled_ep_step(configs[ep], median["rank_max_mean"])
        summary.append({"check": f"ep={ep} step time / ep=1", **spread, "summary": describe(spread, f"ep{ep}/ep1"),
                        **{f"measured_{key}": value for key, value in median.items()}, **model,
                        "modelled_vs_measured_step": model["modelled_step_s"] / median["step_s"],
                        "modelled_vs_measured_all_to_all": model["modelled_all_to_all_s"] / median["all_to_all_s"],
                        "bytes_per_step_counted": counted, "bytes_per_step_balanced_formula": formula,
                        "counted_vs_formula": counted / formula})
        row = summary[-1]
        print(f"  {row['summary']}; all-to-all {median['all_to_all_frac']:.0%} of the step; rank 0 sent {counted:.0f} "
              f"B/step on ep, {counted / formula:.3f}× the balanced formula; the calibrated model (max/mean "
              f"{median['rank_max_mean']:.2f} over the ranks, {median['max_mean']:.2f} over the experts): step "
              f"{row['modelled_vs_measured_step']:.2f}×, all-to-all "
              f"{row['modelled_vs_measured_all_to_all']:.2f}× the measured")
    return rows, summary


# ---------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for part in PARTS:
        parser.add_argument(f"--{part}", action="store_true", help=f"run part {part} (none given: all but ep)")
    parser.add_argument("--quick", action="store_true", help="every part shrunk to a smoke run")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds of parts 1 and 2 (default "
                        f"{FULL['grouped_rounds']} and {FULL['dense_rounds']})")
    parser.add_argument("--steps", type=int, help="part 2's training steps per run")
    parser.add_argument("--seed", type=int, default=1337, help="part 2's seed")
    parser.add_argument("--seeds", type=int, nargs="+", help="part 3's seeds")
    parser.add_argument("--bound", type=int, help="part 3's steps per run: a run not balanced by then hit it")
    parser.add_argument("--aux-alphas", type=float, nargs="+", help="part 3's auxiliary-loss α, one arm each")
    args = parser.parse_args(argv)
    if not any(getattr(args, part) for part in PARTS):
        args.grouped = args.dense = args.balance = True
    size = QUICK if args.quick else FULL
    args.steps = args.steps or size["steps"]
    args.seeds, args.bound = args.seeds or size["seeds"], args.bound or size["bound"]
    args.aux_alphas = args.aux_alphas or size["aux_alphas"]
    if args.steps < WARMUP + 2 or (args.rounds is not None and args.rounds < 1):
        parser.error(f"--steps must be >= {WARMUP + 2} (the first {WARMUP} are warm-up) and --rounds >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    size = QUICK if args.quick else FULL
    settings = {**vars(args), "size": size, "warmup": WARMUP, "warmup_passes": WARMUP_PASSES, "balanced": BALANCED,
                "overload_logit": OVERLOAD_LOGIT}
    if args.ep:
        rows, summary = expert_parallel_step_times(size, args.rounds or size["ep_rounds"], size["ep_steps"])
        write_results(NAME, rows, settings, table="ep_rounds")
        write_results(NAME, summary, settings, table="ep")
    if args.grouped:
        rows, summary = grouped_vs_loop(size, args.rounds or size["grouped_rounds"])
        write_results(NAME, rows, {**settings, "threads": summary["threads"]}, table="grouped_rounds")
        write_results(NAME, [summary], {**settings, "threads": summary["threads"]}, table="grouped")
    if args.dense:
        rows, summary = dense_vs_moe(size, args.rounds or size["dense_rounds"], args.steps, args.seed)
        write_results(NAME, rows, settings, table="dense_rounds")
        write_results(NAME, summary, settings, table="dense")
    if args.balance:
        runs, summary = steps_to_balance_table(size, args.seeds, args.bound, args.aux_alphas)
        write_results(NAME, runs, settings, table="balance_runs")
        write_results(NAME, summary, settings, table="balance")
    print(f"\nresults: appended to {results_path(NAME)}")


if __name__ == "__main__":
    main()
