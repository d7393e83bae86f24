"""An emulated network, clearly labelled as one.

Two processes on one machine talk over loopback, which moves gigabytes per second with
microseconds of latency — far faster than the links between real machines. Nothing is ever
communication-bound here, so the lessons about communication could never be seen.

So labkit can *hold* each collective until the time a real network would have needed. A single
message of n bytes takes α + n/β in the α–β model (Hockney 1994) — α the latency, paid once per
message, β the bandwidth. A collective is not one message: it is an *algorithm*, rounds of
messages between the p ranks, and its time is the sum over the rounds on its critical path::

    time = (rounds) · α + (bytes through the busiest link) / β

Two families of algorithms, the ones MPI libraries and NCCL choose between (costs from Thakur,
Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH"; the
ring all-reduce from Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters
of workstations"; :data:`ALGORITHMS` lists every collective's phases):

* **ring** — the ranks form a circle; each round every rank passes one n/p-byte chunk to its
  neighbour. A reduce-scatter (or an all-gather) takes p − 1 rounds: (p−1)·α + (p−1)/p · n/β.
  An all-reduce is a reduce-scatter then an all-gather: **2(p−1)·α** + 2(p−1)/p · n/β. The
  bandwidth term hardly grows with p (it tends to 2n/β: optimal), but the latency term grows
  *linearly* — a chunk needs p − 1 hops to get round the circle.
* **tree** — a binomial tree: in each round every rank that has the data sends it to one that
  has not, so the number of ranks reached doubles and ⌈log2 p⌉ rounds reach everyone. A
  broadcast (or a reduce) costs ⌈log2 p⌉ · (α + n/β); an all-reduce is a reduce then a
  broadcast: **2⌈log2 p⌉·α** + 2⌈log2 p⌉ · n/β. Latency grows only with *log p*, but every
  round moves the whole message, so the bandwidth term grows with log p too. (NCCL's tree is a
  pipelined double binary tree, which recovers most of the bandwidth; this is the textbook one.)

Which wins depends on the message size. Small messages (a scalar loss, a flag, a tiny bucket)
are latency-bound: the tree's log p rounds beat the ring's 2(p−1). Large messages (gradient
buckets of megabytes) are bandwidth-bound: the ring sends each byte about twice, the tree about
2·log p times. At p = 8, α = 50 µs and 1 Gb/s an all-reduce below about 12 kB is faster on the tree
(6 rounds against 14), above it on the ring (1.75·n/β against 6·n/β); the crossing moves up as p
grows. NCCL and gloo use the ring for large messages, so ``ring`` is the default. (At p = 2 the two
have the same rounds and the ring sends half as much: it always wins.)

The costs are exact for p a power of two; otherwise log2 p is rounded up, as the rounds are. The
model leaves out the time to reduce.

A collective that finishes on loopback sooner than the model's time waits for the rest; the wait
counts as communication time, exactly as a slow network's would. Each process has **one link**, and
its collectives take it in launch order (:func:`reserve`): one launched while another is still on the
link starts when that one ends. So n buckets in flight at once share the bandwidth, as they do on a
real NIC, instead of each getting all of it. A group of one rank sends nothing and costs nothing.
Runs say "emulated" wherever this is on.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional


@dataclass(frozen=True)
class Cost:
    """A collective's cost in the α–β model: ``rounds`` latencies plus ``bytes`` through the busiest link."""
    rounds: int
    bytes: float

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.rounds + other.rounds, self.bytes + other.bytes)


FREE = Cost(0, 0.0)


def ceil_log2(p: int) -> int:
    """⌈log2 p⌉: the rounds a binomial tree needs to reach p ranks (0 for p = 1)."""
    return (p - 1).bit_length()


def others_share(p: int) -> Fraction:
    """(p−1)/p, exactly: of n bytes cut into p equal chunks, the part that is not one rank's own chunk.

    One pass round the ring moves exactly that through every rank (each forwards the p − 1 chunks that are
    not its own); a binomial scatter sends that out of the root. The counted wire bytes are built from it
    (:data:`labkit.comm.collectives.WIRE_FACTOR`, exact); the times here use it as a float."""
    return Fraction(p - 1, p)


# The phases collectives are built from. Each takes the collective's size n (bytes) and p (ranks).

def ring_pass(n: float, p: int) -> Cost:
    """p − 1 rounds round the ring, each moving one n/p chunk: a reduce-scatter or an all-gather."""
    return Cost(p - 1, float(others_share(p)) * n)


def tree_whole(n: float, p: int) -> Cost:
    """⌈log2 p⌉ rounds down (or up) a binomial tree, each moving the whole message: a broadcast or a reduce."""
    return Cost(ceil_log2(p), ceil_log2(p) * n)


def tree_split(n: float, p: int) -> Cost:
    """A binomial scatter (or gather): ⌈log2 p⌉ rounds moving n/2, n/4, ...: (p−1)/p · n in all."""
    return Cost(ceil_log2(p), float(others_share(p)) * n)


Phase = Callable[[float, int], Cost]

# Each algorithm: collective → its phases, in order (Thakur, Rabenseifner & Gropp 2005).
ALGORITHMS: dict[str, dict[str, tuple[Phase, ...]]] = {
    "ring": {
        "reduce_scatter": (ring_pass,),
        "all_gather": (ring_pass,),
        "all_reduce": (ring_pass, ring_pass),  # reduce-scatter, then all-gather (Patarasuk & Yuan 2009)
        "broadcast": (tree_split, ring_pass),  # scatter, then all-gather (van de Geijn)
        "reduce": (ring_pass, tree_split),     # reduce-scatter, then gather (Rabenseifner)
        "all_to_all": (ring_pass,),  # p − 1 pairwise rounds, each moving one n/p chunk (context parallelism)
    },
    "tree": {
        "broadcast": (tree_whole,),
        "reduce": (tree_whole,),
        "all_reduce": (tree_whole, tree_whole),  # reduce to the root, then broadcast
        "reduce_scatter": (tree_whole, tree_split),  # reduce to the root, then scatter
        "all_gather": (tree_split, tree_whole),  # gather to the root, then broadcast
        "all_to_all": (ring_pass,),  # pairwise whatever the algorithm: no tree moves less
    },
}
COLLECTIVES = ("send",) + tuple(ALGORITHMS["ring"])


def check_algorithm(name: str) -> None:
    """Raise a ValueError naming the choices unless ``name`` is one of :data:`ALGORITHMS`."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown collective algorithm {name!r}: choose one of {', '.join(ALGORITHMS)}")


def collective_cost(op: str, nbytes: float, world: int, algorithm: str = "ring") -> Cost:
    """Rounds and bytes of ``op`` on ``nbytes`` over ``world`` ranks with ``algorithm``.

    ``nbytes`` is the collective's size: the tensor (all-reduce, broadcast, reduce), the full input
    (reduce-scatter) or the full output (all-gather). A ``send`` is one message, α + n/β, whatever
    the algorithm. A group of one rank sends nothing: :data:`FREE`.
    """
    check_algorithm(algorithm)
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(COLLECTIVES)}")
    if world <= 1:
        return FREE
    if op == "send":
        return Cost(1, nbytes)
    return sum((phase(nbytes, world) for phase in ALGORITHMS[algorithm][op]), FREE)


@dataclass(frozen=True)
class Network:
    latency_s: float = 0.0
    bandwidth_bytes_per_s: Optional[float] = None  # None: no emulation (loopback as it is)
    algorithm: str = "ring"  # how collectives are run: a key of ALGORITHMS

    def __post_init__(self):
        check_algorithm(self.algorithm)

    @property
    def emulated(self) -> bool:
        return self.bandwidth_bytes_per_s is not None or self.latency_s > 0

    def seconds(self, cost: Cost) -> float:
        """rounds · α + bytes / β."""
        bandwidth = self.bandwidth_bytes_per_s
        return cost.rounds * self.latency_s + (cost.bytes / bandwidth if bandwidth else 0.0)

    def transfer_s(self, wire_bytes: int) -> float:
        """α + n/β: the time one message of ``wire_bytes`` takes on this network."""
        return self.seconds(Cost(1, wire_bytes))

    def collective_s(self, op: str, nbytes: float, world: int) -> float:
        """The time ``op`` on ``nbytes`` over ``world`` ranks takes with this network's algorithm."""
        return self.seconds(collective_cost(op, nbytes, world, self.algorithm))

    def describe(self) -> str:
        if not self.emulated:
            return "loopback (not emulated)"
        rate = "unlimited bandwidth" if self.bandwidth_bytes_per_s is None else \
            f"{self.bandwidth_bytes_per_s * 8 / 1e9:g} Gb/s"
        return f"emulated network: {rate}, {self.latency_s * 1e6:g} µs latency, {self.algorithm} collectives"


LOOPBACK = Network()
_current = LOOPBACK


def bandwidth_for(seconds: float, cost: Cost, latency_s: float) -> Optional[float]:
    """The bandwidth (bytes/s) at which ``cost`` takes ``seconds`` with latency ``latency_s``: :meth:`Network.seconds`
    solved for β. None where the latencies alone (``cost.rounds`` · α) take that long: no bandwidth is slow enough
    to matter there, the link is latency-bound."""
    transfer_s = seconds - cost.rounds * latency_s
    return cost.bytes / transfer_s if transfer_s > 0 and cost.bytes > 0 else None


def network_from_config(comm_cfg) -> Network:
    gbps = comm_cfg.bandwidth_gbps
    return Network(latency_s=comm_cfg.latency_us * 1e-6,
                   bandwidth_bytes_per_s=None if gbps is None else gbps * 1e9 / 8,
                   algorithm=comm_cfg.collective_algorithm)


def set_network(network: Network) -> None:
    """Emulate ``network`` from now on in this process (its link idle)."""
    global _current, _link_free_at
    _current = network
    with _link_lock:
        _link_free_at = 0.0


def current() -> Network:
    return _current


_link_lock = threading.Lock()
_link_free_at = 0.0  # perf_counter time at which this process's emulated link has sent all it was given


def reserve(start: float, op: str, nbytes: int, world: int, network: Optional[Network] = None) -> float:
    """When ``op`` on ``nbytes`` over ``world`` ranks, launched at ``start``, is done on this process's emulated
    link: it starts once the collectives launched before it are off the link (first come, first served), then
    takes its modelled time. Call it at launch, in launch order. ``start`` itself when nothing is emulated or
    the collective costs nothing (a group of one)."""
    global _link_free_at
    network = network or _current
    seconds = network.collective_s(op, nbytes, world) if network.emulated else 0.0
    if seconds <= 0:
        return start
    with _link_lock:
        _link_free_at = max(start, _link_free_at) + seconds
        return _link_free_at


def wait_until(due: float) -> None:
    """Sleep until perf_counter time ``due`` (at once if it has passed)."""
    remaining = due - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


def hold_until(start: float, op: str, nbytes: int, world: int, network: Optional[Network] = None) -> None:
    """Block until ``op`` on ``nbytes`` over ``world`` ranks, launched at ``start``, is done on the emulated link
    (:func:`reserve`; returns at once when the real collective took longer)."""
    wait_until(reserve(start, op, nbytes, world, network))


def network_problems(c) -> list[str]:
    """The emulated network's settings (``comm.bandwidth_gbps``, ``comm.latency_us``), checked before a run.
    (``comm.collective_algorithm``'s name is checked with the config's types: it must be a key of ALGORITHMS.)"""
    problems = []
    if c.bandwidth_gbps is not None and c.bandwidth_gbps <= 0:
        problems.append(f"comm.bandwidth_gbps: must be > 0 Gb/s (or null for no emulation), got {c.bandwidth_gbps}")
    if c.latency_us < 0:
        problems.append(f"comm.latency_us: must be >= 0, got {c.latency_us}")
    return problems
