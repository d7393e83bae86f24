"""Notebook 04's experiments, fitted to the machine they run on, and what their results mean.

A fixed list of links teaches nothing on a machine where it is the wrong list: on a slow core a 1 Gb/s link hides
its all-reduce inside a long step, and 1 Gb/s against 10 Gb/s differ by less than the step-to-step noise (the
inversion seen in quick mode). So the sweep first measures this machine's compute on a link too fast to matter
(:data:`FAST_LINK_GBPS`), then picks the links whose all-reduces would take a chosen share of the step
(:func:`lesson_links`: the α–β cost of ``labkit.comm.network`` solved for β). Likewise the source text's
"42%" mechanism computes in bf16 only where bf16 measured fast here (:func:`mixed_precision_settings`).

Whatever the runs then measure is put in words from their numbers (:func:`ordering_notes`, :func:`cut_text`): a
result against the lesson is explained, never printed bare.
"""
from __future__ import annotations

import math
from typing import Optional

from labkit.comm.network import Cost, Network, bandwidth_for, collective_cost
from labkit.config import Config
from labkit.metrics.communication import communication_cut, percent
from labkit.text import wrap
from labkit.widgets.communication import Progress, bandwidth_settings, sweep
from labkit.widgets.precision import NOISE_SIGMAS, bf16_here, step_noise

FAST_LINK_GBPS = 100.0  # the first run's link: its all-reduces take a fraction of a millisecond, so it measures compute
LATENCY_US = 50.0  # the emulated links' latency α (a setting, like a data-centre link's tens of µs)


def step_parts(row: dict) -> dict:
    """A run's step taken apart: ``compute_s`` (the step without its exposed communication), the bytes each rank
    put on the wire per step and the collectives per step (``calls``)."""
    exposed = row.get("comm_exposed_s")
    comm = exposed if exposed is not None else row["comm_s"]
    wire = row["wire_bytes"]
    return {"compute_s": max(row["step_time_s"] - comm, 0.0), "wire_bytes": sum(wire) / max(len(wire), 1),
            "calls": row.get("comm_calls") or 1.0}


def step_cost(parts: dict, nproc: int) -> Cost:
    """The α–β cost of a step's all-reduces: each collective's rounds, and every byte through the busiest link
    (the counted wire bytes are exactly that: ``labkit.comm.collectives.WIRE_FACTOR``)."""
    return Cost(round(parts["calls"]) * collective_cost("all_reduce", 1.0, nproc).rounds, parts["wire_bytes"])


def modelled_comm_s(parts: dict, nproc: int, gbps: float, latency_us: float = LATENCY_US) -> float:
    """What the emulated link holds a step's all-reduces for (approximate for a compressor's other collectives)."""
    return Network(latency_us * 1e-6, gbps * 1e9 / 8).seconds(step_cost(parts, nproc))


def lesson_links(row: dict, nproc: int, shares, latency_us: float = LATENCY_US) -> list[tuple[float, float]]:
    """(share, Gb/s) pairs, fastest link first: the link (two significant digits) on which the all-reduces of ``row``'s
    step would take ``share`` of the step if none of it were hidden, i.e. compute · share / (1 − share) seconds. A
    share the latencies alone exceed gets no link (whatever the bandwidth, the step is latency-bound there)."""
    parts = step_parts(row)
    links = {}
    for share in sorted(shares):
        beta = bandwidth_for(parts["compute_s"] * share / (1 - share), step_cost(parts, nproc), latency_us * 1e-6)
        if beta:
            links.setdefault(float(f"{beta * 8 / 1e9:.2g}"), share)
    return sorted(((share, gbps) for gbps, share in links.items()), key=lambda link: -link[1])


def choice_text(first: dict, nproc: int, shares, links: list[tuple[float, float]],
                latency_us: float = LATENCY_US) -> str:
    """Why the sweep runs on these links, from the first run's numbers."""
    parts = step_parts(first)
    cost = step_cost(parts, nproc)
    aims = ", ".join(f"{gbps:g} Gb/s → {share:.0%}" for share, gbps in links)
    text = (f"The first run, on a {FAST_LINK_GBPS:g} Gb/s link (communication too fast to matter), measured this "
            f"machine: {1e3 * parts['compute_s']:.0f} ms of compute per step, {parts['wire_bytes'] / 1e6:.2f} MB "
            f"all-reduced per rank in {parts['calls']:.0f} collective(s). Each step's all-reduces cost "
            f"{cost.rounds}·α + bytes/β on the emulated link (α = {latency_us:g} µs), so these links aim "
            f"communication at a share of the step, if none of it were hidden: {aims or 'none'}.")
    if len(links) < len(set(shares)):
        text += (f" The latencies alone take {1e3 * cost.rounds * latency_us * 1e-6:.1f} ms a step: no bandwidth "
                 "reaches the larger shares, the link is latency-bound there.")
    return wrap(text)


def network_sweep(config: Config, nproc: int, compressions: list[str], shares, latency_us: float = LATENCY_US,
                  progress: Progress = None) -> tuple[list[dict], str]:
    """Section 1: ``none`` on the fast link first (it measures the compute), then every compressor on the fast link
    and on the :func:`lesson_links` for ``shares``. Returns the rows and why these links."""
    if progress:
        progress(f"measuring this machine's step: none @ {FAST_LINK_GBPS:g} Gb/s…")
    first = sweep(config, nproc, bandwidth_settings([FAST_LINK_GBPS], ["none"], latency_us))[0]
    links = lesson_links(first, nproc, shares, latency_us)
    rest = [point for point in bandwidth_settings([FAST_LINK_GBPS, *(gbps for _, gbps in links)], compressions,
                                                  latency_us) if point[0] != first["label"]]
    return [first, *sweep(config, nproc, rest, progress)], choice_text(first, nproc, shares, links, latency_us)


def _pair_note(fast: dict, slow: dict, nproc: int) -> Optional[str]:
    """Why a slower link did not cost throughput beyond the noise, or None where it did (the lesson holds)."""
    change = slow["tokens_per_s"] / fast["tokens_per_s"] - 1
    band = NOISE_SIGMAS * math.hypot(step_noise(fast["tokens_per_s_steps"]), step_noise(slow["tokens_per_s_steps"]))
    if change < -band:
        return None
    pair = (f"{fast['label']} → {slow['label']}: {fast['tokens_per_s']:,.0f} → {slow['tokens_per_s']:,.0f} "
            f"tokens/s ({change:+.0%})")
    if change > band:
        return (f"{pair}: faster on the slower link, beyond the step-to-step noise (±{band:.0%}). The runs ran one "
                f"after the other, and the machine's 1-minute load went from {fast.get('load_1min')} to "
                f"{slow.get('load_1min')}: something else took the cores. Run the cell again.")
    extra = (modelled_comm_s(step_parts(slow), nproc, slow["comm.bandwidth_gbps"], slow["comm.latency_us"])
             - modelled_comm_s(step_parts(fast), nproc, fast["comm.bandwidth_gbps"], fast["comm.latency_us"]))
    step, exposed = fast["step_time_s"], [1e3 * (r.get("comm_exposed_s") or r["comm_s"]) for r in (fast, slow)]
    note = (f"{pair}, within the step-to-step noise (±{band:.0%}): the slower link adds {1e3 * extra:.1f} ms of "
            f"modelled communication to a {1e3 * step:.0f} ms step ({extra / step:.0%}); exposed communication "
            f"measured {exposed[0]:.1f} → {exposed[1]:.1f} ms a step.")
    if extra / step < band:
        return note + " Too little to stand out of the noise: the links are too close for this machine."
    if exposed[1] - exposed[0] < 0.5e3 * extra:
        return note + " Backward hid most of it."
    return note + (f" The machine's 1-minute load went from {fast.get('load_1min')} to {slow.get('load_1min')} "
                   "between the runs.")


def ordering_notes(rows: list[dict], nproc: int) -> str:
    """Does throughput fall as the link slows, for each compressor? Each pair of neighbouring links where it did
    not (within the noise, or the other way round) is explained from the runs' numbers."""
    notes = []
    for compression in dict.fromkeys(r["comm.compression"] for r in rows):
        mine = sorted((r for r in rows if r["comm.compression"] == compression and r["comm.bandwidth_gbps"]),
                      key=lambda r: r["comm.bandwidth_gbps"], reverse=True)
        notes += [note for fast, slow in zip(mine, mine[1:]) if (note := _pair_note(fast, slow, nproc))]
    if not notes:
        return wrap("Throughput falls as the link slows, beyond the step-to-step noise, for every compressor.")
    return wrap("\n".join(notes))


# ---------------------------------------------------------------- section 2: the source text's "42%"

def mixed_precision_settings(choice: str, why: str) -> tuple[str, dict, str]:
    """(label, settings, why) from :func:`labkit.widgets.precision.bf16_here`'s choice: bf16 compute and bf16 gradients
    where bf16 is fast here; elsewhere fp32 compute with bf16 gradients, the communication half of the mechanism."""
    if choice == "bf16":
        return "bf16 + bf16 gradients", {"precision.mode": "bf16", "comm.compression": "bf16"}, \
            f"bf16 compute and bf16 gradients. {why}."
    return "fp32 + bf16 gradients", {"precision.mode": "fp32", "comm.compression": "bf16"}, \
        (f"fp32 compute, bf16 gradients. {why}: bf16 compute would slow every step here, so only the communication "
         "half of the mechanism runs.")


def mixed_precision_cut(config: Config, nproc: int, rows: list[dict], progress: Progress = None,
                        speed: Optional[dict] = None) -> dict:
    """Section 2 on section 1's most communication-bound link: its ``none`` run is the baseline, and one run adds
    mixed precision as it suits this machine. Returns ``before``, ``after``, ``why`` (what was chosen) and ``text``."""
    slow = min(r["comm.bandwidth_gbps"] for r in rows if r["comm.bandwidth_gbps"])
    before = next(r for r in rows if r["comm.compression"] == "none" and r["comm.bandwidth_gbps"] == slow)
    choice, reason, _ = bf16_here(config, nproc, speed)
    label, settings, why = mixed_precision_settings(choice, reason)
    net = {"comm.bandwidth_gbps": slow, "comm.latency_us": before["comm.latency_us"]}
    after = sweep(config, nproc, [(label, {**net, **settings})], progress)[0]
    where = f"{nproc} processes over an emulated {slow:g} Gb/s link"
    return {"before": before, "after": after, "why": wrap(why), "text": cut_text(before, after, where)}


def cut_text(before: dict, after: dict, where: str) -> str:
    """The source text's "communication cut by 42%", as measured here; a result against it is explained."""
    cut = communication_cut(before, after)
    change = cut["comm_s_cut"]
    lines = [f"communication time {'cut' if change >= 0 else 'up'} by {abs(change):.0%} (bytes cut by "
             f"{cut['bytes_cut']:.0%}); communication in flight {percent(cut['comm_frac_before'], '.0f')} → "
             f"{percent(cut['comm_frac_after'], '.0f')} of the step "
             f"(exposed {percent(cut['comm_exposed_frac_before'], '.0f')}"
             f" → {percent(cut['comm_exposed_frac_after'], '.0f')}); "
             f"throughput ×{cut['speedup']:.2f}; measured on {where}"]
    compute = [1e3 * step_parts(row)["compute_s"] for row in (before, after)]
    if change < 0:
        lines.append(f"Communication took longer although {cut['bytes_cut']:.0%} fewer bytes were sent: its time runs "
                     f"from a collective's launch to its end, waits for the slower rank included, and compute went "
                     f"from {compute[0]:.0f} to {compute[1]:.0f} ms a step.")
    if cut["speedup"] < 1:
        saved = 1e3 * (before["comm_s"] - after["comm_s"])
        lines.append(f"Throughput fell: compute went from {compute[0]:.0f} to {compute[1]:.0f} ms a step, "
                     + (f"more than the {saved:.0f} ms of communication saved." if saved > 0 else
                        "and communication saved nothing."))
    return wrap("\n".join(lines))
