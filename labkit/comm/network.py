"""An emulated network, clearly labelled as one.

Two processes on one machine talk over loopback, which moves gigabytes per second with
microseconds of latency — far faster than the links between real machines. Nothing is ever
communication-bound here, so the lessons about communication could never be seen.

So labkit can *hold* each collective until the time a real network would have needed: the
α–β model (Hockney 1994), where a message of n bytes takes α + n/β — α the latency, β the
bandwidth. A collective that finishes on loopback sooner than that waits for the rest; the wait
counts as communication time, exactly as a slow network's would. Runs say "emulated" wherever
this is on.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Network:
    latency_s: float = 0.0
    bandwidth_bytes_per_s: Optional[float] = None  # None: no emulation (loopback as it is)

    @property
    def emulated(self) -> bool:
        return self.bandwidth_bytes_per_s is not None or self.latency_s > 0

    def transfer_s(self, wire_bytes: int) -> float:
        """α + n/β: the time a message of ``wire_bytes`` takes on this network."""
        bandwidth = self.bandwidth_bytes_per_s
        return self.latency_s + (wire_bytes / bandwidth if bandwidth else 0.0)

    def describe(self) -> str:
        if not self.emulated:
            return "loopback (not emulated)"
        rate = "unlimited bandwidth" if self.bandwidth_bytes_per_s is None else \
            f"{self.bandwidth_bytes_per_s * 8 / 1e9:g} Gb/s"
        return f"emulated network: {rate}, {self.latency_s * 1e6:g} µs latency"


LOOPBACK = Network()
_current = LOOPBACK


def network_from_config(comm_cfg) -> Network:
    gbps = comm_cfg.bandwidth_gbps
    return Network(latency_s=comm_cfg.latency_us * 1e-6,
                   bandwidth_bytes_per_s=None if gbps is None else gbps * 1e9 / 8)


def set_network(network: Network) -> None:
    global _current
    _current = network


def current() -> Network:
    return _current


def hold_until(start: float, wire_bytes: int, network: Optional[Network] = None) -> None:
    """Sleep until ``start`` + α + n/β (returns at once when the real collective took longer)."""
    network = network or _current
    if network.emulated:
        remaining = start + network.transfer_s(wire_bytes) - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


def network_problems(c) -> list[str]:
    """The emulated network's settings (``comm.bandwidth_gbps``, ``comm.latency_us``), checked before a run."""
    problems = []
    if c.bandwidth_gbps is not None and c.bandwidth_gbps <= 0:
        problems.append(f"comm.bandwidth_gbps: must be > 0 Gb/s (or null for no emulation), got {c.bandwidth_gbps}")
    if c.latency_us < 0:
        problems.append(f"comm.latency_us: must be >= 0, got {c.latency_us}")
    return problems
