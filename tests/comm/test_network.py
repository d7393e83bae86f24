"""The emulated network's cost model: each collective as an algorithm (ring or tree), checked by hand.

n = 800 bytes throughout, so (p−1)/p · n is 400, 600 and 700 bytes at p = 2, 4 and 8, and ⌈log2 p⌉ is 1, 2, 3.
"""
import time

import pytest
import torch
import torch.distributed as dist

from helpers import tiny_config
from labkit.comm import collectives as comm
from labkit.comm import network
from labkit.comm.network import (ALGORITHMS, FREE, LOOPBACK, Cost, Network, collective_cost, hold_until,
                                 network_from_config)
from labkit.config import ConfigError
from labkit.metrics.timers import CommTimer
from labkit.validation import validate

N = 800

# (algorithm, collective, p) → (rounds, bytes through the busiest link), worked out by hand.
HAND = {
    # ring all-reduce: reduce-scatter + all-gather, 2(p−1) rounds of n/p
    ("ring", "all_reduce", 2): (2, 800), ("ring", "all_reduce", 4): (6, 1200), ("ring", "all_reduce", 8): (14, 1400),
    # ring reduce-scatter / all-gather: p−1 rounds of n/p
    ("ring", "reduce_scatter", 2): (1, 400), ("ring", "reduce_scatter", 4): (3, 600),
    ("ring", "reduce_scatter", 8): (7, 700),
    ("ring", "all_gather", 2): (1, 400), ("ring", "all_gather", 4): (3, 600), ("ring", "all_gather", 8): (7, 700),
    # ring broadcast: binomial scatter (⌈log2 p⌉ rounds, (p−1)/p·n) + ring all-gather
    ("ring", "broadcast", 2): (2, 800), ("ring", "broadcast", 4): (5, 1200), ("ring", "broadcast", 8): (10, 1400),
    # ring reduce: ring reduce-scatter + binomial gather (the broadcast, backwards)
    ("ring", "reduce", 2): (2, 800), ("ring", "reduce", 4): (5, 1200), ("ring", "reduce", 8): (10, 1400),
    # tree broadcast and reduce: ⌈log2 p⌉ rounds of the whole message
    ("tree", "broadcast", 2): (1, 800), ("tree", "broadcast", 4): (2, 1600), ("tree", "broadcast", 8): (3, 2400),
    ("tree", "reduce", 2): (1, 800), ("tree", "reduce", 4): (2, 1600), ("tree", "reduce", 8): (3, 2400),
    # tree all-reduce: reduce + broadcast, 2⌈log2 p⌉ rounds of the whole message
    ("tree", "all_reduce", 2): (2, 1600), ("tree", "all_reduce", 4): (4, 3200), ("tree", "all_reduce", 8): (6, 4800),
    # tree reduce-scatter: reduce (⌈log2 p⌉·n) + binomial scatter ((p−1)/p·n); all-gather: gather + broadcast
    ("tree", "reduce_scatter", 2): (2, 1200), ("tree", "reduce_scatter", 4): (4, 2200),
    ("tree", "reduce_scatter", 8): (6, 3100),
    ("tree", "all_gather", 2): (2, 1200), ("tree", "all_gather", 4): (4, 2200), ("tree", "all_gather", 8): (6, 3100),
    # all-to-all: p−1 pairwise rounds, each moving the n/p chunk meant for one other rank, whatever the algorithm
    ("ring", "all_to_all", 2): (1, 400), ("ring", "all_to_all", 4): (3, 600), ("ring", "all_to_all", 8): (7, 700),
    ("tree", "all_to_all", 2): (1, 400), ("tree", "all_to_all", 4): (3, 600), ("tree", "all_to_all", 8): (7, 700),
    # a point-to-point send is one message, whatever the algorithm
    ("ring", "send", 2): (1, 800), ("ring", "send", 4): (1, 800), ("ring", "send", 8): (1, 800),
    ("tree", "send", 2): (1, 800), ("tree", "send", 4): (1, 800), ("tree", "send", 8): (1, 800),
}


@pytest.mark.parametrize("algorithm,op,p", sorted(HAND))
def test_each_collective_costs_what_the_textbook_says(algorithm, op, p):
    rounds, nbytes = HAND[(algorithm, op, p)]
    assert collective_cost(op, N, p, algorithm) == Cost(rounds, nbytes)


def test_every_algorithm_runs_every_collective():
    assert all(set(ops) == set(network.COLLECTIVES) - {"send"} for ops in ALGORITHMS.values())
    assert {(a, op) for a, op, p in HAND} == {(a, op) for a in ALGORITHMS for op in network.COLLECTIVES}


def test_the_model_turns_rounds_and_bytes_into_seconds():
    # α = 1 ms, β = 100 kB/s: 800 bytes whole take 8 ms
    ring, tree = (Network(latency_s=1e-3, bandwidth_bytes_per_s=1e5, algorithm=a) for a in ("ring", "tree"))
    assert ring.collective_s("all_reduce", N, 8) == pytest.approx(14e-3 + 14e-3)  # 14 α + 1400 B / β
    assert tree.collective_s("all_reduce", N, 8) == pytest.approx(6e-3 + 48e-3)   # 6 α + 4800 B / β
    assert ring.collective_s("all_gather", N, 4) == pytest.approx(3e-3 + 6e-3)
    assert tree.collective_s("broadcast", N, 4) == pytest.approx(2e-3 + 16e-3)
    assert ring.collective_s("send", N, 8) == tree.collective_s("send", N, 8) == pytest.approx(ring.transfer_s(N))
    assert ring.transfer_s(N) == pytest.approx(1e-3 + 8e-3)  # α + n/β


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8, 16, 64])
def test_the_ring_all_reduce_pays_2_p_minus_1_latencies_and_the_tree_2_log_p(p):
    latency_only = {a: Network(latency_s=1e-3, algorithm=a) for a in ALGORITHMS}  # unlimited bandwidth
    assert latency_only["ring"].collective_s("all_reduce", 10**9, p) == pytest.approx(2 * (p - 1) * 1e-3)
    log_p = {2: 1, 3: 2, 4: 2, 5: 3, 8: 3, 16: 4, 64: 6}[p]
    assert latency_only["tree"].collective_s("all_reduce", 10**9, p) == pytest.approx(2 * log_p * 1e-3)


def test_small_messages_favour_the_tree_and_large_ones_the_ring():
    ring, tree = (Network(latency_s=1e-3, bandwidth_bytes_per_s=1e5, algorithm=a) for a in ("ring", "tree"))
    assert tree.collective_s("all_reduce", 8, 8) < ring.collective_s("all_reduce", 8, 8)  # 6.5 ms < 14.1 ms
    assert ring.collective_s("all_reduce", N, 8) < tree.collective_s("all_reduce", N, 8)  # 28 ms < 54 ms
    assert ring.collective_s("all_reduce", 10**6, 2) < tree.collective_s("all_reduce", 10**6, 2)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("op", network.COLLECTIVES)
def test_a_group_of_one_costs_nothing(algorithm, op):
    assert collective_cost(op, 10**9, 1, algorithm) == FREE
    assert Network(latency_s=1.0, bandwidth_bytes_per_s=1.0, algorithm=algorithm).collective_s(op, 10**9, 1) == 0


def test_an_unknown_algorithm_or_collective_names_the_choices():
    with pytest.raises(ValueError, match="unknown collective algorithm 'butterfly': choose one of ring, tree"):
        Network(latency_s=1e-3, algorithm="butterfly")
    with pytest.raises(ValueError, match="unknown collective algorithm 'butterfly': choose one of ring, tree"):
        collective_cost("all_reduce", N, 4, "butterfly")
    with pytest.raises(ValueError, match="unknown collective 'alltoall': choose one of send, .*all_reduce"):
        collective_cost("alltoall", N, 4)
    with pytest.raises(ConfigError, match="comm.collective_algorithm: 'butterfly' is not one of 'ring', 'tree'"):
        validate(tiny_config(**{"comm.collective_algorithm": "butterfly"}), nproc=1)


def test_the_algorithm_comes_from_the_config_and_shows_in_the_description():
    assert network_from_config(tiny_config().comm).algorithm == "ring"  # what NCCL and gloo use for large messages
    net = network_from_config(tiny_config(**{"comm.collective_algorithm": "tree", "comm.latency_us": 50}).comm)
    assert net.algorithm == "tree"
    assert net.describe() == "emulated network: unlimited bandwidth, 50 µs latency, tree collectives"


def test_the_emulator_waits_at_least_the_modelled_time():
    net = Network(latency_s=0.01, bandwidth_bytes_per_s=4e6)  # ring all-reduce of 400 kB over 4: 6 α + 600 kB / β
    start = time.perf_counter()
    hold_until(start, "all_reduce", 400_000, 4, net)
    assert time.perf_counter() - start >= 0.06 + 0.15


def test_the_link_serves_collectives_in_launch_order():
    """One link per process: a collective launched while another is on it starts when that one ends, so n buckets
    in flight share the bandwidth instead of each getting all of it."""
    net = Network(latency_s=0.01, bandwidth_bytes_per_s=1e6)  # all-reduce of 100 kB over 2: 2 α + n/β = 0.12 s
    network.set_network(net)
    try:
        t = time.perf_counter()
        assert network.reserve(t, "all_reduce", 100_000, 2) == pytest.approx(t + 0.12)
        assert network.reserve(t, "all_reduce", 100_000, 2) == pytest.approx(t + 0.24)  # launched with it: queued
        assert network.reserve(t + 1, "all_reduce", 100_000, 2) == pytest.approx(t + 1.12)  # the link idle again
        assert network.reserve(t + 1, "all_reduce", 100_000, 1) == t + 1  # a group of one: nothing sent, no wait
        network.set_network(net)  # a new network: its link idle
        assert network.reserve(t, "all_reduce", 100_000, 2) == pytest.approx(t + 0.12)
    finally:
        network.set_network(LOOPBACK)
    assert network.reserve(t, "all_reduce", 100_000, 2) == t  # nothing emulated: no wait


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collectives_tell_the_emulator_their_kind_size_and_world(group_of_one, monkeypatch):
    held = []
    monkeypatch.setattr(network, "reserve",
                        lambda start, op, nbytes, world, *_: held.append((op, nbytes, world)) or start)
    timer, x, out = CommTimer(), torch.zeros(6), torch.zeros(6)
    comm.all_reduce(x, timer=timer)
    comm.all_reduce(x, async_op=True, timer=timer).wait()
    comm.all_gather(out, x, timer=timer)
    comm.reduce_scatter(out, x, timer=timer)
    comm.broadcast(x, 0, timer=timer)
    assert held == [("all_reduce", 24, 1), ("all_reduce", 24, 1), ("all_gather", 24, 1),
                    ("reduce_scatter", 24, 1), ("broadcast", 24, 1)]
