"""Consistency models and the CAP trade-off, on real processes (config ``comm.consistency``).

The CAP theorem (Brewer 2000; proved by Gilbert & Lynch 2002): when the network partitions, a
distributed system keeps its replicas **C**onsistent or stays **A**vailable — not both. Data-
parallel training faces the same choice at every synchronisation:

========== ================================ =========================== ============================
mode       how updates are shared           during a partition          replicas
========== ================================ =========================== ============================
sync       all-reduce of gradients, each    everyone waits (gives up A) identical at every step (C)
           step
local_sgd  parameter average every H steps  progress until the next     drift apart between
                                            average, then everyone      averages, agree after each
                                            waits
ssp        parameter server; a worker may   the others run ≤ s clocks   bounded staleness ≤ s
           run ≤ s clocks ahead of the      ahead, then wait
           slowest
async      parameter server, no bound       the others carry on         unbounded staleness (gives
                                            (keeps A)                   up C)
========== ================================ =========================== ============================

A partition (``comm.partition_rank``, ``partition_start_s``, ``partition_s``) and a straggler
(``comm.slow_rank``, ``slow_factor``) are injected at labkit's communication layer
(:mod:`labkit.comm.partition`); :mod:`labkit.consistency.measure` turns the logs into availability,
divergence, staleness and recovery time.
"""
from labkit.consistency.lab import SERVER_MODES, processes_for, train_consistency
from labkit.consistency.measure import summarize

__all__ = ["SERVER_MODES", "processes_for", "summarize", "train_consistency"]
