"""What a run's communication measured, and how much a change cut it.

A run's summary holds two communication shares of step time: **in flight** (``comm_frac``: from a
collective's launch to its completion, hidden behind backward or not, waits for a straggler
included) and **exposed** (``comm_exposed_frac``: what backward did not hide, the time it costs;
None where the host cannot see it, e.g. under ``fsdp2``). It also holds seconds in communication
per step (``comm_s``, ``comm_exposed_s``) and throughput; its step events hold the bytes each rank
put on the wire (``comm_bytes``) and, under compression, what they would have been without it
(``raw_bytes``). :func:`communication_row` gathers them for one run; :func:`communication_cut`
compares two — the source text's "communication fell by 42%" made measurable.

Decisions (the tuning flowchart, the anomaly detector) go by the exposed share: communication that
overlaps backward costs nothing, however long it is in flight.
"""
from __future__ import annotations

SCALING_COLLAPSES = 0.35
"""The source text's rule of thumb: above ~35% of step time in communication, scaling efficiency collapses ..."""
SCALING_HOLDS = 0.25
"""... and under ~25% it holds. labkit applies both lines to the *exposed* share (what the step waits for)."""


def percent(value, spec: str = ".1f") -> str:
    """``0.123`` → ``12.3%``; ``n/a`` for None."""
    return "n/a" if value is None else f"{format(100 * value, spec)}%"


def comm_text(in_flight, exposed, spec: str = ".1f") -> str:
    """Both communication shares in words, the same everywhere: ``communication in flight 12.3% (exposed 4.5%)``."""
    return f"communication in flight {percent(in_flight, spec)} (exposed {percent(exposed, spec)})"


def exposed_frac(event: dict):
    """A step event's exposed communication share; derived from ``comm_exposed_s`` for events written
    before ``comm_exposed_frac`` existed. None where exposed time was not measured."""
    if event.get("comm_exposed_frac") is not None:
        return event["comm_exposed_frac"]
    exposed, step = event.get("comm_exposed_s"), event.get("step_time_s")
    return exposed / step if exposed is not None and step else None


def communication_row(run, label: str, settings: dict) -> dict:
    """One finished run's communication record: its ``settings`` (dotted config keys), summary numbers
    and per-step curves. ``wire_bytes`` is what was sent; ``raw_bytes`` what uncompressed would have been."""
    m, s = run.metrics, run.summary
    wire = [b or 0 for b in m["comm_bytes"]]
    raw = [r if r is not None else b for r, b in zip(m.get("raw_bytes", wire), wire)]
    return {"label": label, "nproc": run.nproc, **settings, "comm_frac": s["comm_frac"],
            "comm_exposed_frac": s.get("comm_exposed_frac"), "comm_exposed_s": s.get("comm_exposed_s"),
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
            "comm_exposed_frac_before": baseline.get("comm_exposed_frac"),
            "comm_exposed_frac_after": improved.get("comm_exposed_frac"),
            "speedup": improved["tokens_per_s"] / baseline["tokens_per_s"]}
