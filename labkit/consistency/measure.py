"""Measuring both sides of the CAP trade-off from what a consistency run logged (pure functions).

* **Availability** — the fraction of wall time a worker spends computing (not waiting on the
  network), overall and inside the partition window; the steps each worker started *and* finished
  inside the window.
* **Consistency** — divergence between replicas: for each replica the L2 distance of its
  parameters to the replicas' average, max and mean over replicas, at every moment a snapshot
  was taken (each replica as it last was at that moment) and at every step all replicas reached.
  Also the staleness of every update a parameter server applied.
* **Recovery** — seconds from the heal until every worker has finished a step begun after it and
  the divergence is back to its level before the partition.
"""
from __future__ import annotations

import bisect
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Optional

import torch


def divergence(vectors: list[torch.Tensor]) -> tuple[float, float]:
    """(max, mean) over replicas of ‖θ_r − θ̄‖₂."""
    stacked = torch.stack([v.double() for v in vectors])
    distances = (stacked - stacked.mean(0)).norm(dim=1)
    return distances.max().item(), distances.mean().item()


def divergence_over_time(snapshots: dict[int, dict], lockstep: bool = False) -> list[dict]:
    """Divergence at every snapshot time, each replica taken as it last was by then.

    ``lockstep`` (sync, local SGD): replicas advance in rounds, so compare them after the same step,
    at the moment the last of them got there — otherwise the few milliseconds between two ranks
    finishing the same all-reduce would show up as divergence.
    """
    if lockstep:
        when = [dict(zip(s["steps"], s["times"])) for s in snapshots.values()]
        return [{**point, "t": max(w[point["step"]] for w in when)} for point in divergence_by_step(snapshots)]
    times = sorted({t for snap in snapshots.values() for t in snap["times"]})
    series = []
    for t in times:
        latest = []
        for snap in snapshots.values():
            i = bisect.bisect_right(snap["times"], t) - 1
            if i < 0:
                break
            latest.append(snap["vectors"][i])
        else:
            worst, mean = divergence(latest)
            series.append({"t": t, "max": worst, "mean": mean, "relative": _relative(latest, worst)})
    return series


def _relative(vectors: list[torch.Tensor], worst: float) -> float:
    norm = torch.stack([v.double() for v in vectors]).mean(0).norm().item()
    return worst / norm if norm else 0.0


def divergence_by_step(snapshots: dict[int, dict]) -> list[dict]:
    """Divergence at each step every replica reached (replicas compared after the same step)."""
    common = set.intersection(*(set(s["steps"]) for s in snapshots.values())) if snapshots else set()
    where = [(dict(zip(snap["steps"], range(len(snap["steps"])))), snap["vectors"]) for snap in snapshots.values()]
    series = []
    for step in sorted(common):
        vectors = [vectors[index[step]] for index, vectors in where]
        worst, mean = divergence(vectors)
        series.append({"step": step, "max": worst, "mean": mean, "relative": _relative(vectors, worst)})
    return series


def overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def availability(records: list[dict], window: Optional[tuple[float, float]]) -> dict:
    """One worker's progress: computing share of wall time, overall and inside the partition."""
    if not records:
        return {"steps": 0, "busy_fraction": 0.0, "steps_in_partition": None, "busy_in_partition": None}
    end = records[-1]["t_end"]
    busy = sum(r["busy_s"] for r in records)
    result = {"steps": records[-1]["step"], "busy_fraction": busy / end if end > 0 else 0.0,
              "steps_per_s": records[-1]["step"] / end if end > 0 else 0.0,
              "steps_in_partition": None, "busy_in_partition": None}
    if window:
        lo, hi = window
        result["steps_in_partition"] = sum(1 for r in records if r["t_start"] >= lo and r["t_end"] <= hi)
        inside = sum(overlap(r["t_start"], r["t_start"] + r["busy_s"], lo, hi) for r in records)
        result["busy_in_partition"] = inside / (hi - lo)
        outside = end - overlap(0.0, end, lo, hi)
        result["busy_outside_partition"] = (busy - inside) / outside if outside > 0 else None
    return result


def recovery_s(workers: dict[int, list[dict]], series: list[dict], window) -> Optional[float]:
    """Seconds after the heal until all workers stepped again and divergence is back to its earlier level."""
    if not window:
        return None
    start, heal = window
    resumed = []
    for records in workers.values():
        after = [r["t_end"] for r in records if r["t_start"] >= heal]
        if not after:
            return None
        resumed.append(after[0])
    before = [p["max"] for p in series if p["t"] < start]
    level = max(before) if before else 0.0
    agreed = next((p["t"] for p in series if p["t"] >= heal and p["max"] <= level * (1 + 1e-6)), None)
    if agreed is None:
        return None
    return max(max(resumed), agreed) - heal


def staleness_counts(updates: list[dict], key: str = "staleness") -> dict[int, int]:
    return dict(sorted(Counter(int(u[key]) for u in updates).items()))


def summarize(workers: dict[int, list[dict]], snapshots: dict[int, dict], updates: list[dict],
              window: Optional[tuple[float, float]], lockstep: bool = False) -> dict:
    """The numbers a CAP run is judged by (see the module docstring)."""
    series = divergence_over_time(snapshots, lockstep)
    per_worker = {rank: availability(records, window) for rank, records in workers.items()}
    # the replicas as they were when the partition began persist into it until one of them moves
    before = [p for p in series if window and p["t"] < window[0]][-1:]
    during = before + [p for p in series if window and window[0] <= p["t"] < window[1]]
    summary = {
        "workers": len(workers),
        "availability": per_worker,
        "busy_fraction": statistics.mean(a["busy_fraction"] for a in per_worker.values()) if per_worker else 0.0,
        "divergence_max": max((p["max"] for p in series), default=0.0),
        "divergence_relative_max": max((p["relative"] for p in series), default=0.0),
        "divergence_final": series[-1]["max"] if series else 0.0,
        "recovery_s": recovery_s(workers, series, window),
    }
    if window:
        summary.update(
            partition=list(window),
            busy_in_partition=statistics.mean(a["busy_in_partition"] for a in per_worker.values()),
            steps_in_partition={rank: a["steps_in_partition"] for rank, a in per_worker.items()},
            divergence_max_in_partition=max((p["max"] for p in during), default=None))
    if updates:
        summary.update(staleness_max=max(u["staleness"] for u in updates),
                       staleness_counts=staleness_counts(updates),
                       delay_max=max(u["delay"] for u in updates),
                       delay_mean=statistics.mean(u["delay"] for u in updates),
                       updates_applied=len(updates))
    return summary


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # a line still being written
    return [json.loads(line) for line in lines if line.strip()]


def load_progress(run_dir: str | Path) -> dict[int, list[dict]]:
    """Each worker's step records so far (safe to call while the run is live)."""
    cap = Path(run_dir) / "cap"
    return {int(p.stem[len("worker"):]): read_jsonl(p) for p in sorted(cap.glob("worker*.jsonl"))}


def load(run_dir: str | Path) -> tuple[dict[int, list[dict]], dict[int, dict], list[dict]]:
    """(worker records by rank, parameter snapshots by rank, server updates) of a finished consistency run."""
    cap = Path(run_dir) / "cap"
    workers = load_progress(run_dir)
    snapshots = {}
    for path in sorted(cap.glob("params_rank*.pt")):
        saved = torch.load(path, weights_only=True)
        snapshots[int(path.stem[len("params_rank"):])] = {**saved, "vectors": list(saved["vectors"])}
    return workers, snapshots, read_jsonl(cap / "server.jsonl")
