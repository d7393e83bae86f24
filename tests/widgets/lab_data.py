"""Small synthetic results for the labs' figures and printed tables: a partition and four consistency modes (01), seven
data-parallel strategies (02), pipeline, tensor-parallel and composed runs (03), attention costs (05), a scaling sweep
(08). Shaped like what the runs and :mod:`labkit.parallel.reports.layout` produce."""
import numpy as np

# ---------------------------------------------------------------- 01: a partition, four modes


def worker(spans):
    return [{"step": i + 1, "t_start": a, "t_end": b, "busy_s": 0.05, "loss": 3.0 - 0.01 * i}
            for i, (a, b) in enumerate(spans)]


WORKERS = {1: worker([(0, 0.5), (0.5, 2.2), (2.2, 2.5)]), 2: worker([(0, 0.5), (0.5, 1.0), (1.0, 2.5)])}
SERIES = [{"t": 0.5, "max": 0.0, "mean": 0.0}, {"t": 2.2, "max": 0.1, "mean": 0.05}]


def cap_summary(mode, busy, divergence):
    return {"status": "finished", "consistency": mode, "partition": [1.0, 2.0], "partition_rank": 1,
            "steps_in_partition": {"1": 0, "2": 3},
            "availability": {"1": {"busy_in_partition": 0.0, "busy_outside_partition": 0.5},
                             "2": {"busy_in_partition": busy, "busy_outside_partition": 0.5}},
            "busy_in_partition": busy / 2, "busy_fraction": 0.4, "divergence_max": divergence,
            "divergence_max_in_partition": divergence, "divergence_relative_max": divergence / 10,
            "recovery_s": 0.1, "final_loss": 2.0 + divergence}

CAP_RUNS = [("sync", 0.0, 0.0), ("local_sgd", 0.2, 0.1), ("ssp", 0.3, 0.2), ("async", 0.45, 0.3)]  # mode, busy, div.


# ---------------------------------------------------------------- 02: seven strategies

STRATEGIES = ("torch_ddp", "ddp_naive", "ddp_bucketed", "zero1", "zero2", "zero3", "fsdp2")
TIMELINE = {"data": [(0, 0.001)], "fwd_bwd": [(0.001, 0.01)], "sync": [(0.01, 0.012)],
            "optimizer": [(0.012, 0.013)], "comm": [(0.01, 0.0125)]}
DP_ROWS = [{"strategy": s, "world_size": 2, "params": 100_000, "grad_accum": 1, "step_s": 0.013, "compute_s": 0.01,
            "exposed_s": None if s == "fsdp2" else 0.002, "data_s": 0.001, "comm_bytes": 400_000, "timeline": TIMELINE,
            "peak_step": 1, "peak_forward_bytes": [5e6, 6e6], "peak_backward_bytes": [7e6, 8e6],
            "peak_optimizer_bytes": [3e6, 4e6], "state_precision": "fp32"} for s in STRATEGIES]

# ---------------------------------------------------------------- 03: a pipeline, tensor parallelism, a composition


def span(kind, mb, start, end, wait=0.0):
    return {"kind": kind, "mb": mb, "start": start, "end": end, "wait": wait}


GRID = [[span("F", 0, 0.0, 0.01), span("B", 0, 0.02, 0.04, 0.005)],
        [span("F", 0, 0.0, 0.02, 0.01), span("B", 0, 0.02, 0.03)]]
BUBBLES = [{"p": 2, "m": m, "schedule": "gpipe", "bubble": b, "idle": b - 0.02, "ideal": 1 / (m + 1), "step_s": 1.0}
           for m, b in ((1, 0.55), (4, 0.25), (8, 0.15))]
TP_PARTS = {"embedding": 10, "per_layer": 100, "blocks": 200, "head": 10, "loss": 3, "total": 223,
            "sequence_parallel_sync": 7}
TP_ROWS = [(label, {"tp": 2, "pp": 1, "sequence_parallel": sp, "micro_batches": 2, "n_layer": 2, "measured_total": 453,
                    "analytic_total": 453, "measured_per_layer": 100, "analytic_per_layer": 100,
                    "analytic_parts": TP_PARTS}) for label, sp in (("tp=2 m=2", False), ("tp=2 SP m=2", True))]


def memory_row(rank, pp, total):
    return {"rank": rank, "dp": 0, "pp": pp, "tp": 0, "params": total // 16, "predicted": {}, "predicted_total": total,
            "measured": {"param": total / 4, "grad": total / 4, "optimizer": total / 2}, "measured_total": total}


def activation_row(rank, measured, held):
    return {"rank": rank, "dp": 0, "pp": rank, "tp": 0, "layers": 1, "measured": measured, "predicted": 2e6,
            "held": held, "held_predicted": 2 - rank, "measured_peak": measured * held, "predicted_peak": 2e6 * held}


SPLIT = {"compute": 0.05, "data": 0.001, "dp_comm": 0.002, "model_comm": 0.01, "bubble": 0.02, "step": 0.083}

# ---------------------------------------------------------------- 05: three kernels; 08: a sweep


def attention_rows():
    return [{"backend": backend, "seq": seq, "time_s": 1e-3 * seq * k, "saved_bytes": seq * seq * k}
            for backend, k in (("naive", 4), ("sdpa", 1), ("labkit_flash", 1)) for seq in (128, 256, 512)]


def sweep():
    grid = [{"params": int(n), "tokens": int(d), "val_loss": 2.0 + 100 / n**0.5 + 100 / d**0.3, "steps": 100,
             "budget": None, "curve": [(d / 10, 3.0), (d, 2.5)]} for n in (1e4, 3e4, 1e5) for d in (1e5, 1e6, 1e7)]
    isoflop = [{"params": int(n), "tokens": int(c / 6 / n), "val_loss": 2.3 + 0.001 * np.log(n) ** 2, "steps": 100,
                "budget": c, "curve": []} for c in (1e12, 1e13) for n in (1e4, 3e4, 1e5)]
    return grid + isoflop


# ---------------------------------------------------------------- 12: a context-parallel lab record (cp = 4)

def cp_lab(cp: int = 4) -> dict:
    """What labkit.context_lab.run_lab returns, made up: every check right, every bug caught."""
    check = {"ok": True, "errors": {"output": 1e-7, "dq": 2e-7, "dk": 2e-7, "dv": 1e-7},
             "bytes": {"forward": 4096, "backward": 12288}, "expected": {"forward": 4096, "backward": 12288}}
    wrong = {**check, "ok": False, "errors": {"output": 1.5, "dq": 1.2, "dk": 0.9, "dv": 1e-7}}
    timeline = [[{"step": s, "rank": r, "block": (r - s) % cp, "work_blocks": 2.0, "compute_s": 1e-3 * (1 + r),
                  "wait_s": 2e-4} for s in range(cp)] for r in range(cp)]
    rounds = {"ring": [0.010, 0.011, 0.012], "allgather": [0.012, 0.013, 0.011], "ulysses": [0.02, 0.019, 0.021]}
    return {"cp": cp, "seq": 256, "heads": 4, "head_dim": 32,
            "checks": {v: [check] * cp for v in ("ring", "allgather", "ulysses")},
            "bugs": {b: [wrong] * cp for b in ("stale_kv", "no_lse_rescale", "mask_off_by_one_chunk")},
            "timelines": {"contiguous": timeline, "head_tail": timeline},
            "cpu_s": {"contiguous": [0.01 * (r + 1) for r in range(cp)], "head_tail": [0.02] * cp},
            "rounds_s": rounds, "median_s": {v: sorted(t)[1] for v, t in rounds.items()}}


# ---------------------------------------------------------------- 13: a mixture of experts' runs (8 experts, top-2)

MOE_TIMELINE = {"data": [[0.0, 0.001]], "fwd_bwd": [[0.001, 0.04]], "model_comm": [[0.005, 0.007], [0.03, 0.033]],
                "sync": [[0.04, 0.042]], "comm": [[0.04, 0.0415]], "optimizer": [[0.042, 0.045]]}


def moe_step(step: int, loads: list[list[int]], drop: float = 0.0, aux=None, **extra) -> dict:
    """A step event of a MoE run: ``loads`` holds each MoE layer's tokens per expert."""
    return {"type": "step", "step": step, "loss": 3.0 - 0.01 * step,
            "moe_layers": [2 * i + 1 for i in range(len(loads))], "moe_load": loads,
            "moe_max_mean": [max(load) / (sum(load) / len(load)) for load in loads],
            "moe_drop_rate": [drop] * len(loads), "moe_aux_loss": [aux] * len(loads), "step_time_s": 0.05 + step / 1e3,
            "model_comm_bytes": 1_000_000 + step, "model_comm_s": 0.005, "model_comm_frac": 0.1, "model_comm_calls": 24,
            "timeline": MOE_TIMELINE, **extra}


def moe_events(steps: int = 12, skew: int = 0, val_loss: float = 2.5, aux=None, drop: float = 0.0) -> list[dict]:
    """A MoE run's events, made up: 2 MoE layers of 8 experts, 256 assignments a step; expert 0 takes ``skew`` more
    assignments than its share each step (taken evenly from the other seven), less as the steps go."""
    events = [{"type": "start", "steps": steps, "world_size": 2, "backend": "gloo", "device": "cpu"}]
    for s in range(steps):
        extra = max(0, skew - 7 * s)
        load = [32 + 7 * (extra // 7)] + [32 - extra // 7] * 7
        events.append(moe_step(s, [load, list(reversed(load))], drop=drop, aux=aux))
    events.append({"type": "eval", "step": steps - 1, "val_loss": val_loss})
    return events
