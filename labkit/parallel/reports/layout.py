"""Reading model-parallel runs back: the schedule a pipeline really ran, the bubble, tensor parallelism's bytes,
each rank's share of the model, and where a step's time went.

Pure functions over a run's events (``events.jsonl``: the start event and the step events) and its config, so
the model-parallel lab (``notebooks/03_model_parallel.ipynb``), its widgets and the tests share one source.
Each measured number sits beside the number labkit predicts for it on paper:

=========================================  ============================================================================
measured (a step event)                    beside
=========================================  ============================================================================
``rank_pipeline_timeline``                 ``pipeline.ideal_schedule`` (:func:`measured_grid`)
``rank_pipeline_idle``, the timelines      ``pipeline.ideal_bubble`` (:func:`pipeline_summary`, :func:`bubble_over_m`)
``pipeline_in_flight`` (rank 0)            ``pipeline.peak_activations_in_flight``
``model_comm_bytes`` (rank 0)              ``tp.volume.tp_wire_bytes`` (:func:`tp_bytes_per_layer`)
``rank_param_bytes``, grad, optimizer      :func:`predicted_rank_memory_for_layout` (:func:`rank_memory`)
``rank_activation_bytes``, held            :func:`labkit.parallel.reports.activation_memory.activation_memory`
the step's parts, ``pipeline_idle_s``      ``step_time_s``: they add up to it (:func:`step_split`)
=========================================  ============================================================================

Ranks are global ranks on the (pp, dp, cp, tp) grid of :mod:`labkit.parallel.mesh`; the start event's ``mesh``
gives its sizes. This module imports no plotting library and nothing of ``labkit.config`` (a config is read
by attribute only), so worker processes can import it for free.
"""
from __future__ import annotations

from statistics import mean
from typing import Optional

from labkit.memory_estimate import MemoryBreakdown, activation_bytes_per_layer
from labkit.parallel.mesh import ParallelDims
from labkit.model.flops import moe_layer_params
from labkit.model.gpt import GPTShape
from labkit.parallel.pp.pipeline import (bubble_fraction, ideal_bubble, ideal_schedule, partition,
                                      peak_activations_in_flight)
from labkit.parallel.reports.data_parallel import predict_rank_memory
from labkit.parallel.tp.volume import sequence_parallel_sync_bytes, tp_wire_bytes

FP32_BYTES = 4


# ---------------------------------------------------------------- events

def start_event(events: list[dict]) -> dict:
    """The run's start event (what it was: mesh, micro-batches per step, parameters)."""
    for e in events:
        if e.get("type") == "start":
            return e
    raise ValueError("no start event: the run did not get as far as building its model")


def steady_steps(events: list[dict], skip: int = 1) -> list[dict]:
    """The step events past the first ``skip`` (warm-up: allocations, first messages); all of them if the run
    was shorter."""
    steps = [e for e in events if e.get("type") == "step"]
    if not steps:
        raise ValueError("no step event: the run finished no step")
    return steps[skip:] or steps


def mesh_of(events: list[dict]) -> ParallelDims:
    """The run's (dp, pp, tp) sizes, from its start event."""
    return as_dims(start_event(events)["mesh"])


def as_dims(dims) -> ParallelDims:
    return dims if isinstance(dims, ParallelDims) else ParallelDims(**{k: int(v) for k, v in dict(dims).items()})


def pipeline_ranks(dims, dp: int = 0, tp: int = 0) -> list[int]:
    """The global ranks of one pipeline, stage by stage: the one at data-parallel coordinate ``dp`` and
    tensor-parallel coordinate ``tp``."""
    dims = as_dims(dims)
    return [dims.rank_at(dp=dp, pp=stage, tp=tp) for stage in range(dims.pp)]


# ---------------------------------------------------------------- the pipeline: schedule and bubble

def measured_grid(rank_pipeline_timeline: list[dict], pp_ranks_by_stage: list[int]) -> list[list[dict]]:
    """Per stage, the forwards and backwards it ran in one step, on one time axis: seconds from the first span
    of any of these ranks.

    ``rank_pipeline_timeline`` is a step event's (one entry per global rank: ``step_start``, a
    ``time.perf_counter`` reading, and spans relative to it); ``pp_ranks_by_stage`` the global rank of each
    stage (:func:`pipeline_ranks`). Each span keeps its ``kind``, ``mb`` and ``wait`` (the part of it, at its
    start, spent waiting for a neighbour's message). perf_counter is one clock for every process of a
    machine: across machines the alignment would be only as good as their clocks."""
    if not rank_pipeline_timeline:
        raise ValueError("this step event has no pipeline timeline: the run had parallel.pp.degree=1")
    chosen = [rank_pipeline_timeline[r] for r in pp_ranks_by_stage]
    if any(t is None or not t.get("spans") for t in chosen):
        raise ValueError("a stage recorded no spans (torch's interleaved 1F1B is not timed chunk by chunk); "
                         "parallel.pp.schedule=1f1b or gpipe shows the schedule")
    t0 = min(t["step_start"] + s["start"] for t in chosen for s in t["spans"])
    return [[{**s, "start": t["step_start"] + s["start"] - t0, "end": t["step_start"] + s["end"] - t0}
             for s in t["spans"]] for t in chosen]


def _mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def pipeline_summary(events: list[dict], cfg, skip: int = 1) -> dict:
    """One pipeline run, measured beside the textbook: p stages, m micro-batches per step, the schedule.

    * ``idle``: the mean over steady steps and over the stages of one pipeline of ``rank_pipeline_idle`` (each
      stage's share of its schedule's run spent not computing: waiting for a neighbour, or for its own sends;
      None where the schedule was not timed, torch's);
    * ``bubble``: the mean over steady steps of :func:`labkit.parallel.pp.pipeline.bubble_fraction` of the
      measured grid (idle share of stages × makespan, the definition the formula counts);
    * ``ideal``: (p − 1) / (m + p − 1);
    * ``in_flight``: the most micro-batches whose activations rank 0 (stage 0) held at once, beside
      ``in_flight_predicted`` (m for GPipe, min(p, m) for 1F1B at stage 0); ``activation_bytes`` what one
      micro-batch's forward saved for backward there (None where the run did not count it);
    * ``grid``: the last steady step's :func:`measured_grid`, ``ideal_grid`` the schedule on paper."""
    start, steps = start_event(events), steady_steps(events, skip)
    dims, m, schedule = as_dims(start["mesh"]), int(start["grad_accum"]), cfg.parallel.pp.schedule
    p, ranks = dims.pp, pipeline_ranks(start["mesh"])
    grids = []
    for e in steps:
        try:
            grids.append(measured_grid(e.get("rank_pipeline_timeline"), ranks))
        except ValueError:
            grids.append(None)
    return {
        "p": p, "m": m, "schedule": schedule, "impl": cfg.parallel.pp.impl,
        "idle": _mean(mean(e["rank_pipeline_idle"][r] for r in ranks) for e in steps
                      if e.get("rank_pipeline_idle")) if p > 1 else 0.0,
        "bubble": _mean(bubble_fraction(g) for g in grids if g) if p > 1 else 0.0,
        "ideal": ideal_bubble(p, m),
        "in_flight": steps[-1].get("pipeline_in_flight"),
        "in_flight_predicted": peak_activations_in_flight(p, m, schedule, 0),
        "activation_bytes": steps[-1].get("activation_bytes"),
        "grid": grids[-1], "ideal_grid": ideal_schedule(p, m, schedule),
        "step_s": _mean(e["step_time_s"] for e in steps),
    }


def bubble_over_m(runs: list[tuple[list[dict], object]], skip: int = 1) -> list[dict]:
    """Several pipeline runs (``(events, cfg)`` each, differing in micro-batches per step), sorted by m: the
    measured bubble (``idle`` and ``bubble`` of :func:`pipeline_summary`) beside ``ideal_bubble(p, m)``."""
    rows = []
    for events, cfg in runs:
        s = pipeline_summary(events, cfg, skip)
        rows.append({key: s[key] for key in ("p", "m", "schedule", "idle", "bubble", "ideal", "step_s")})
    return sorted(rows, key=lambda r: (r["p"], r["m"]))


# ---------------------------------------------------------------- tensor parallelism: bytes on the wire

def tp_bytes_per_layer(event: dict, start: dict, cfg) -> dict:
    """Tensor parallelism's bytes in one step, measured on rank 0 beside :func:`tp_wire_bytes` for the same shape.

    A step runs m = ``grad_accum`` forward + backward passes (the micro-batches), each sending the collectives
    of ``tp_wire_bytes`` (fp32: the count is exact for one dtype throughout); sequence parallelism adds one
    all-reduce of the partial gradients after backward (:func:`sequence_parallel_sync_bytes`). Rank 0 sits on
    the first pipeline stage: its L₀ blocks (all of them when pp = 1) and the embedding, and the head and the
    loss only when pp = 1 (the pipeline's own messages are counted apart, ``pipeline_comm_bytes``). So

        measured per layer = (model_comm_bytes − m·(embedding [+ head + loss]) − SP sync) / (m · L₀)

    is compared with ``per_layer``, and the step's total with m·(its parts) + SP sync. With
    ``parallel.tp.impl=dtensor`` torch's collectives are not counted by labkit (``measured_*`` are None)."""
    dims, m = as_dims(start["mesh"]), int(start["grad_accum"])
    model, tp = cfg.model, cfg.parallel.tp
    sp = bool(tp.sequence_parallel)
    vocab = start.get("vocab_size") or getattr(model, "vocab_size", None) or 256  # the split barely depends on it
    layers = len(partition({"n_layer": model.n_layer, "n_embd": model.n_embd, "vocab_size": vocab,
                            "block_size": model.block_size, "bias": getattr(model, "bias", False)}, dims.pp)[0])
    parts = tp_wire_bytes(cfg.data.micro_batch_size, model.block_size, model.n_embd, layers, dims.tp,
                          FP32_BYTES, sp, model.recompute)
    if dims.pp > 1:  # the first stage holds no head and computes no loss
        parts = {**parts, "head": 0, "loss": 0, "total": parts["embedding"] + parts["blocks"]}
    sync = sequence_parallel_sync_bytes(model.n_embd, model.n_layer, model.block_size, model.bias, dims.tp) if sp else 0
    around = parts["embedding"] + parts["head"] + parts["loss"]
    measured = event.get("model_comm_bytes")
    per_layer = None if measured is None else (measured - m * around - sync) / (m * layers)
    return {"tp": dims.tp, "pp": dims.pp, "sequence_parallel": sp, "micro_batches": m, "n_layer": layers,
            "measured_total": measured, "analytic_total": m * parts["total"] + sync,
            "measured_per_layer": per_layer, "analytic_per_layer": parts["per_layer"],
            "analytic_parts": {**parts, "sequence_parallel_sync": sync}}


# ---------------------------------------------------------------- each rank's share of the model

def _shape_value(shape, name: str):
    return getattr(shape, name) if not isinstance(shape, dict) else shape[name]


def predicted_rank_params(shape, dims, rank: int) -> int:
    """Exactly how many parameters global ``rank`` holds under a (dp, pp, tp) layout, before any dp sharding.

    ``shape`` is a :class:`labkit.model.gpt.GPTShape` (or anything with ``n_layer``, ``n_embd``, ``vocab_size``,
    ``block_size``, ``bias``). The rank's stage keeps its blocks (:func:`labkit.parallel.pp.pipeline.partition`);
    the first stage also the token embedding (vocab/tp rows) and the position embedding (replicated); the last
    the final LayerNorm and the output layer — the embedding's own parameter when pp = 1 (tied, counted once), a
    copy of its vocab/tp rows when pp > 1. Tensor parallelism gives each block's q/k/v and MLP-expansion
    weights and biases by output rows, the two projections' weights by input columns: 1/tp each; the
    projections' biases and the LayerNorms stay replicated. A mixture-of-experts block holds its MoE layer whole on
    every tp rank (labkit's tensor parallelism leaves it), its experts E/ep under expert parallelism."""
    dims = as_dims(dims)
    d, vocab, block = (_shape_value(shape, k) for k in ("n_embd", "vocab_size", "block_size"))
    b = 1 if _shape_value(shape, "bias") else 0
    t, coord = dims.tp, dims.coordinate(rank)
    stage, p = coord["pp"], dims.pp
    for what, total in (("n_embd", d), ("vocab_size", vocab)):
        if total % t:
            raise ValueError(f"{what}={total} does not divide into {t} tensor-parallel slices")
    norm = d + b * d
    attention = (3 * d * d + b * 3 * d) // t + d * d // t + b * d  # q/k/v by rows; proj by columns, its bias whole
    mlp = (4 * d * d + b * 4 * d) // t + 4 * d * d // t + b * d  # fc by rows; proj by columns, its bias whole
    layers = partition(shape, p)[stage]
    moe = getattr(shape, "moe", None)  # a mixture of experts: its router, experts and shared one, whole on a tp rank
    experts = sum(moe.replaces(layer) for layer in layers) if moe else 0
    whole_mlp = 8 * d * d + 5 * b * d
    held = moe_layer_params(moe, d, b)[0] + whole_mlp - moe.experts * whole_mlp * (dims.ep - 1) // dims.ep if moe else 0
    count = len(layers) * (2 * norm + attention) + (len(layers) - experts) * mlp + experts * held
    if stage == 0:
        count += vocab * d // t + block * d  # token embedding by vocabulary; position embedding replicated
    if stage == p - 1:
        count += norm + (vocab * d // t if p > 1 else 0)  # ln_f; the head's own copy when it is not tied in place
    return count


def predicted_rank_memory_for_layout(shape, dims, rank: int, strategy: str, precision: str = "fp32",
                                     shard_degree: int = 0) -> MemoryBreakdown:
    """Model-state bytes global ``rank`` should hold: its :func:`predicted_rank_params`, then the dp strategy's
    sharding over the dp replicas (:func:`~labkit.parallel.reports.data_parallel.predict_rank_memory`: ZeRO-1 the
    optimizer state, ZeRO-2 also the gradients, FSDP2 everything). ``precision`` is the ZeRO paper's "fp32" (4 + 4 + 8
    bytes per parameter with Adam) or "mixed" (2 + 2 + 12); labkit's bf16 autocast keeps fp32 weights. The
    strategy shards over the gradient axis: dp × cp (a cp rank holds the same parameters as a replica), or over
    one HSDP shard group of ``shard_degree`` of them (``parallel.dp.shard_degree``; 0: all)."""
    dims = as_dims(dims)
    over = shard_degree or dims.size("dp_shard_cp")
    return predict_rank_memory(predicted_rank_params(shape, dims, rank), over, strategy, precision)


def rank_memory(events: list[dict], cfg, shape=None) -> list[dict]:
    """Every rank's model-state bytes in the last step (``rank_param_bytes``, ``rank_grad_bytes``,
    ``rank_optimizer_bytes``) beside :func:`predicted_rank_memory_for_layout`. ``shape`` defaults to the config's
    model with the run's vocabulary."""
    start, last = start_event(events), steady_steps(events)[-1]
    dims = as_dims(start["mesh"])
    if shape is None:
        shape = GPTShape.from_config(cfg.model, start["vocab_size"])
    rows = []
    for rank in range(dims.world_size):
        predicted = predicted_rank_memory_for_layout(shape, dims, rank, start["strategy"],
                                                     shard_degree=cfg.parallel.dp.shard_degree)
        measured = {key: last[f"rank_{key}_bytes"][rank] for key in ("param", "grad", "optimizer")}
        rows.append({"rank": rank, **dims.coordinate(rank), "params": predicted_rank_params(shape, dims, rank),
                     "measured": measured, "measured_total": sum(measured.values()),
                     "predicted": {"param": predicted.parameters, "grad": predicted.gradients,
                                   "optimizer": predicted.optimizer_state},
                     "predicted_total": predicted.model_states})
    return rows


def layout_memory_rows(shape, layouts: list[dict], strategy: str = "ddp_naive", precision: str = "mixed",
                       micro_batch: int = 1, heads: Optional[int] = None,
                       sequence_parallel: bool = False) -> list[dict]:
    """For a model too big for one device: per layout ``{"dp", "pp", "tp"}``, the busiest rank's parameters and
    model-state bytes (:func:`predicted_rank_memory_for_layout`) and the activations it keeps under 1F1B (stage 0:
    min(p, m) micro-batches of ``micro_batch`` sequences in flight, taking m ≥ p, through its layers, from
    :func:`labkit.memory_estimate.activation_bytes_per_layer`; ``heads`` defaults to ``shape.n_head``)."""
    heads = heads or _shape_value(shape, "n_head")
    d, block = (_shape_value(shape, k) for k in ("n_embd", "block_size"))
    rows = []
    for layout in layouts:
        dims = as_dims(layout)
        states = [(predicted_rank_memory_for_layout(shape, dims, r, strategy, precision).model_states, r)
                  for r in (dims.rank_at(pp=s) for s in range(dims.pp))]
        state, busiest = max(states)
        layers = len(partition(shape, dims.pp)[0])
        per_layer = activation_bytes_per_layer(block, micro_batch, d, heads, dims.tp,
                                               sequence_parallel=sequence_parallel and dims.tp > 1)
        rows.append({**dims.sizes(), "ranks": dims.world_size, "busiest_rank": busiest,
                     "params": predicted_rank_params(shape, dims, busiest), "model_states": state,
                     "activations": peak_activations_in_flight(dims.pp, dims.pp, "1f1b", 0) * layers * per_layer})
    return rows


def format_layout_memory(rows: list[dict]) -> str:
    """:func:`layout_memory_rows` as a plain-text table (GB = 1e9 bytes)."""
    lines = [f"{'dp × pp × tp':>14s} {'ranks':>6s} {'params/rank':>13s} {'model states GB':>16s} "
             f"{'activations GB':>15s}"]
    for r in rows:
        layout = f"{r['dp']} × {r['pp']} × {r['tp']}"
        lines.append(f"{layout:>14s} {r['ranks']:6d} {r['params'] / 1e9:12.2f}B {r['model_states'] / 1e9:16.1f} "
                     f"{r['activations'] / 1e9:15.1f}")
    return "\n".join(lines)


# ---------------------------------------------------------------- where a step's time went

SPLIT_PARTS = ("compute", "data", "dp_comm", "model_comm", "bubble")


def _split_one(e: dict) -> Optional[dict]:
    step, exposed = e["step_time_s"], e.get("comm_exposed_s")
    if exposed is None:
        return None
    data, model, bubble = e.get("data_s") or 0.0, e.get("model_comm_s") or 0.0, e.get("pipeline_idle_s") or 0.0
    compute = step - data - exposed - model - bubble
    if compute < 0:  # the parts are measured apart; never let rounding make compute negative
        model = max(0.0, model + compute)
        compute = 0.0
    return {"compute": compute, "data": data, "dp_comm": exposed, "model_comm": model, "bubble": bubble,
            "step": step}


def step_split(events: list[dict], skip: int = 1) -> dict:
    """Rank 0's steady-state mean step time in five parts that add up to it:

    * ``dp_comm``: exposed data-parallel communication (``comm_exposed_s``: what backward did not hide);
    * ``model_comm``: tensor-parallel communication (``model_comm_s``: blocking, inside forward and backward);
    * ``bubble``: rank 0's seconds in its pipeline schedule not spent computing (``pipeline_idle_s``): waiting
      for a neighbour's message at the pipeline's fill and drain (the pipeline's sends are launched and left
      to run, so its communication shows only as this waiting);
    * ``data``: loading the micro-batches;
    * ``compute``: what is left, step − data − dp_comm − model_comm − bubble (the trainer's ``compute_s``).

    Each part is a mean over the steady steps, so the parts add up to ``step`` (the mean step time). A strategy
    whose exposed communication cannot be measured from the host (fsdp2) gives ``None`` parts. What labkit does
    not time counts as compute: torch's DTensor collectives (``parallel.tp.impl=dtensor``: ``model_comm_counted``
    is False) and the waits of a pipeline whose chunks are not timed (``bubble_counted`` False; labkit's and
    torch's GPipe and 1F1B are both timed chunk by chunk)."""
    steps = steady_steps(events, skip)
    splits = [_split_one(e) for e in steps]
    pipelined = next((e for e in events if e.get("type") == "start"), {}).get("mesh", {}).get("pp", 1) > 1
    counted = {"model_comm_counted": all(e.get("model_comm_s") is not None for e in steps),
               "bubble_counted": not pipelined or all(e.get("rank_pipeline_timeline") for e in steps)}
    if any(s is None for s in splits):
        return {**{k: None for k in SPLIT_PARTS}, "step": mean(e["step_time_s"] for e in steps), **counted}
    return {**{k: mean(s[k] for s in splits) for k in (*SPLIT_PARTS, "step")}, **counted}
