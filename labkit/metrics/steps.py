"""One step's measurements become an event; a run's events become its summary.

After every step each rank has its own measurements (``Trainer.step``'s stats, taken by
:class:`labkit.metrics.step_meter.StepMeter`). :func:`gather_ranks` puts every rank's on every rank (one small
all-reduce), :func:`step_event` turns them into the JSON line rank 0 writes to ``events.jsonl``, and
:class:`StepTally` keeps what the summary needs from them in constant memory: averages over the steady-state
steps, past the warm-up.
"""
from __future__ import annotations

import torch

from labkit.metrics.mfu import achieved_tflops, mfu
from labkit.metrics.window import SUMMARY_MEANS, WARMUP_SKIP, Window, steady_means, summarize  # noqa: F401

STEP_FIELDS = ["loss", "step_time_s", "comm_s", "comm_exposed_s", "comm_bytes", "max_mem_bytes", "pipeline_idle",
               "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "pipeline_in_flight",
               "peak_forward_bytes", "peak_backward_bytes", "peak_optimizer_bytes", "grad_peak_bytes",
               "activation_peak_bytes", "growth_backward_bytes"]
PHASES = ("forward", "backward", "optimizer")  # a step's phases whose peak memory is tracked
UNCOUNTED = float("nan")  # a field this rank did not count (None): NaN in the gathered table, None in the event


def gather_ranks(stats: dict, env, axis: str = "world", sum_over=None) -> dict[str, list[float]]:
    """Every ``axis`` member's measurements, on each of them (one small collective, outside the timed step).

    ``axis`` names a rank-grid axis (``labkit.parallel.mesh``); by default the world: the per-rank
    lists of a step event have one entry per global rank. Each member fills its own row of a table of zeros
    and ``sum_over(table, group)`` sums it over the axis's group: :func:`labkit.comm.control.sum_over_ranks`,
    handed in (labkit.comm imports labkit.metrics, not the other way round). A group of one needs none.
    """
    grid = env.grid
    size = grid.size(axis)
    table = torch.zeros(size, len(STEP_FIELDS), dtype=torch.float64, device=env.torch_device)
    row = [UNCOUNTED if stats.get(k) is None else float(stats[k]) for k in STEP_FIELDS]
    table[grid.coord(axis)] = torch.tensor(row, dtype=torch.float64)
    if size > 1:  # a group of one has gathered already (and its backend's thread stays asleep)
        sum_over(table, grid.group(axis))  # each filled its own row: the sum is the table
    table = table.T.tolist()
    return dict(zip(STEP_FIELDS, table))


def step_event(step: int, lr: float, stats: dict, ranks: dict, tokens: int, fpt: float, peak, env) -> dict:
    step_time = stats["step_time_s"]
    slowest = max(ranks["step_time_s"])
    pipeline_measured = ranks.get("pipeline_timeline") is not None
    tflops = achieved_tflops(fpt, tokens, slowest, env.world_size)
    return {
        "step": step, "loss": sum(ranks["loss"]) / env.world_size, "lr": lr, "grad_norm": stats["grad_norm"],
        "tokens": tokens, "tokens_per_s": tokens / slowest, "step_time_s": step_time,
        "data_s": stats["data_s"], "compute_s": stats["compute_s"], "comm_s": stats["comm_s"],
        # in flight (launch to completion: hidden behind backward or not, straggler waits included) and
        # exposed (what backward did not hide: the time it costs; None where the host cannot see it)
        "comm_exposed_s": stats["comm_exposed_s"], "comm_frac": stats["comm_s"] / step_time,
        # how comm_s was measured (CommTimer.timing): host clock or CUDA events
        "comm_timing": stats.get("comm_timing"),
        "comm_exposed_frac": _share(stats["comm_exposed_s"], step_time),
        "comm_bytes": stats["comm_bytes"], "comm_calls": stats["comm_calls"], "raw_bytes": stats["raw_bytes"],
        "model_comm_s": stats.get("model_comm_s", 0.0), "model_comm_bytes": stats.get("model_comm_bytes", 0),
        "model_comm_frac": _share(stats.get("model_comm_s", 0.0), step_time),
        "pipeline_comm_bytes": stats.get("pipeline_comm_bytes", 0),
        "pipeline_idle_s": stats.get("pipeline_idle_s", 0.0),
        # both pipelines time their stages' forwards and backwards: the mean idle share is the bubble
        "pipeline_idle": sum(ranks["pipeline_idle"]) / env.world_size if pipeline_measured else None,
        "rank_pipeline_idle": ranks["pipeline_idle"] if pipeline_measured else None,
        "pipeline_in_flight": stats.get("pipeline_in_flight"),
        # per rank: {step_start, spans: [{kind, mb, start, end, wait}]} (labkit.parallel.pp.pipeline's timeline)
        "rank_pipeline_timeline": ranks.get("pipeline_timeline"),
        "compression_ratio": stats["compression_ratio"], "compress_s": stats["compress_s"], "tflops": tflops,
        "mfu": mfu(tflops, peak), "max_mem_bytes": int(max(ranks["max_mem_bytes"])),
        "param_bytes": stats["param_bytes"], "grad_bytes": stats["grad_bytes"],
        "optimizer_bytes": stats["optimizer_bytes"], "activation_bytes": stats["activation_bytes"],
        "timeline": stats["timeline"], "skipped": stats["skipped"],
        "loss_scale": stats.get("loss_scale"), "overflow": bool(stats.get("overflow", False)),
        "rank_step_time_s": ranks["step_time_s"],
        "rank_comm_s": ranks["comm_s"],
        "rank_comm_exposed_s": [None if v != v else v for v in ranks["comm_exposed_s"]],  # NaN: not measured
        # time not spent in communication: in synchronous training every rank's step takes as long
        # as the slowest one's, so a straggler shows here (more busy) and in its peers' comm_s (waiting)
        "rank_busy_s": [t - c for t, c in zip(ranks["step_time_s"], ranks["comm_s"])],
        "rank_comm_bytes": ranks["comm_bytes"],
        # model states per rank: what a split model or a sharded strategy leaves on each
        "rank_param_bytes": ranks["param_bytes"], "rank_grad_bytes": ranks["grad_bytes"],
        "rank_optimizer_bytes": ranks["optimizer_bytes"],
        # activations per rank: one micro-batch's saved tensors on its stage, and how many it held at once
        "rank_activation_bytes": _counts(ranks["activation_bytes"]),
        "rank_pipeline_in_flight": _counts(ranks["pipeline_in_flight"]),
        # a pipeline stage's held activations at their peak, read by the allocation tracker (the tracked step)
        "rank_activation_peak_bytes": _counts(ranks["activation_peak_bytes"]),
        # peak bytes allocated during each phase of the step, per rank (None where the step was not tracked)
        **{f"rank_peak_{phase}_bytes": _counts(ranks[f"peak_{phase}_bytes"]) for phase in PHASES},
        # how far the backward phase's peak rose above what was alive as it began (the same instrument)
        "rank_growth_backward_bytes": _counts(ranks["growth_backward_bytes"]),
        # the most gradient bytes alive at once in backward, where the strategy counts them (zero2)
        "rank_grad_peak_bytes": _counts(ranks["grad_peak_bytes"]),
    }


def _counts(values: list[float]) -> list:
    return [None if v != v else int(v) for v in values]  # NaN (UNCOUNTED) is the one value unequal to itself


def _share(part, whole: float):
    return None if part is None else part / whole


def step_timeline(start: float, spans, comm_intervals) -> dict:
    """Where one step's time went, as [start, end] seconds from the step's start, for a timeline plot."""
    def rel(a: float, b: float) -> list[float]:
        return [round(a - start, 6), round(b - start, 6)]

    phases: dict[str, list] = {}
    for name, a, b in spans:
        phases.setdefault(name, []).append(rel(a, b))
    return {**phases, "comm": [rel(a, b) for a, b in comm_intervals]}


class StepTally:
    """What the summary needs from an attempt's step events, in constant memory: a long run keeps no list.

    The first ``4 × WARMUP_SKIP`` events are kept (a run that short is summarized from them, skipping a
    quarter); after that the numbers come from a :class:`~labkit.metrics.window.Window` of every step past the
    warm-up, added in the same order as :func:`~labkit.metrics.window.summarize` would, so both give the same
    numbers (and a dashboard's headline too, once the run has ended).
    """

    def __init__(self):
        self.head: list[dict] = []
        self.count = 0
        self.window = Window()
        self.last: dict | None = None
        self.max_mem_bytes: int | None = None
        self.overflows = 0

    def add(self, event: dict) -> None:
        if len(self.head) < 4 * WARMUP_SKIP:
            self.head.append({key: event.get(key) for key in SUMMARY_MEANS})
        if self.count >= WARMUP_SKIP:
            self.window.add(event)
        self.count += 1
        self.last = {"step": event["step"], "loss": event["loss"]}
        self.max_mem_bytes = max(event["max_mem_bytes"], self.max_mem_bytes or 0)
        self.overflows += bool(event.get("overflow"))

    def means(self) -> dict:
        if self.count < 4 * WARMUP_SKIP:
            return steady_means(self.head)
        return self.window.means()


def overflow_steps(events: list[dict]) -> int:
    """Steps the fp16 loss scaler skipped because their gradients overflowed (0 without a scaler)."""
    return sum(1 for e in events if e.get("overflow"))

