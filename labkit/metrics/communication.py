"""What a run's communication measured, and how much a change cut it.

A run's summary holds its communication share of step time (``comm_frac``), seconds in
communication per step (``comm_s``) and throughput; its step events hold the bytes each rank put
on the wire (``comm_bytes``) and, under compression, what they would have been without it
(``raw_bytes``). :func:`communication_row` gathers them for one run; :func:`communication_cut`
compares two — the source text's "communication fell by 42%" made measurable.
"""
from __future__ import annotations


def communication_row(run, label: str, settings: dict) -> dict:
    """One finished run's communication record: its ``settings`` (dotted config keys), summary numbers
    and per-step curves. ``wire_bytes`` is what was sent; ``raw_bytes`` what uncompressed would have been."""
    m, s = run.metrics, run.summary
    wire = [b or 0 for b in m["comm_bytes"]]
    raw = [r if r is not None else b for r, b in zip(m.get("raw_bytes", wire), wire)]
    return {"label": label, "nproc": run.nproc, **settings, "comm_frac": s["comm_frac"],
            "tokens_per_s": s["tokens_per_s"], "final_loss": s["final_loss"], "entropy_floor": s.get("entropy_floor"),
            "loss": m["loss"], "step": m["step"], "wire_bytes": wire, "raw_bytes": raw, "comm_s": s["comm_s"],
            "step_time_s": s["step_time_s"], "sent_shares": s.get("sent_shares", {}), "run_dir": str(run.run_dir)}


def cumulative(values: list[float]) -> list[float]:
    """Running totals: bytes sent per step → bytes sent so far."""
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def communication_cut(baseline: dict, improved: dict) -> dict:
    """How much communication time and share fell between two measured runs (the source's "42%")."""
    return {"comm_s_cut": 1 - improved["comm_s"] / baseline["comm_s"],
            "bytes_cut": 1 - sum(improved["wire_bytes"]) / sum(baseline["wire_bytes"]),
            "comm_frac_before": baseline["comm_frac"], "comm_frac_after": improved["comm_frac"],
            "speedup": improved["tokens_per_s"] / baseline["tokens_per_s"]}
