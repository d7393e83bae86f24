"""Consistency through a parameter server: ``ssp`` (bounded staleness) and ``async`` (unbounded).

Rank 0 holds the parameters; ranks 1..N are workers. A worker computes a gradient on the
parameters it last read, *pushes* it (point-to-point send), and *reads* the parameters the server
sends back. The server applies each gradient the moment it arrives: θ ← θ − (η/N)·g.

A worker's *clock* is how many updates it has pushed. **Stale-synchronous parallel** (Ho et al.
2013) lets a worker read — and so start its next step — only while it is at most ``s`` clocks ahead
of the slowest worker; otherwise the server holds its reply. ``s = 0`` is synchronous (each read
contains every worker's previous updates, as an all-reduce would give); ``async`` never holds a
reply (Hogwild-style, Recht et al. 2011; Dean et al. 2012): no one ever waits for a straggler or a
partitioned worker, and gradients may be computed on parameters many updates old.

Every applied update is logged with two measures of staleness:
``staleness`` — how many clocks the reader was ahead of the slowest worker when it read (≤ s
under SSP); ``delay`` — how many updates by others were applied between its read and its update.
"""
from __future__ import annotations

import torch

from labkit.comm import collectives as comm
from labkit.consistency.allreduce import time_up
from labkit.optim import lr_at

UPDATE, DONE = 0.0, 1.0
HEADER = 3  # kind, clock, loss


def may_read(clock: int, clocks_of_active: list[int], bound) -> bool:
    """SSP's rule: a worker at ``clock`` may read while clock − slowest ≤ s (``bound`` None: async)."""
    return bound is None or not clocks_of_active or clock - min(clocks_of_active) <= bound


def run_server(cfg, env, replica, log, timer) -> torch.Tensor:
    """Serve until every worker is done; returns the final parameters."""
    workers = env.world_size - 1
    bound = cfg.comm.staleness if cfg.comm.consistency == "ssp" else None
    theta = replica.vector()
    message = torch.empty(HEADER + theta.numel())
    clocks = {w: 0 for w in range(1, workers + 1)}
    active, waiting = set(clocks), []
    reads = {w: (0, 0) for w in clocks}  # worker -> (version it read, its staleness when it read)
    version = 0
    while active:
        sender = comm.recv(message, timer=timer)
        if message[0].item() == DONE:
            active.discard(sender)
        else:
            clock = int(message[1].item())
            theta -= lr_at(clock, cfg.optim, cfg.run.steps) / workers * message[HEADER:]
            version += 1
            clocks[sender] += 1
            read_version, staleness = reads[sender]
            log.write(t=log.now(), worker=sender, clock=clock, version=version, staleness=staleness,
                      delay=version - 1 - read_version, loss=message[2].item())
            waiting.append(sender)
        for worker in list(waiting):
            ahead = [clocks[w] for w in active]
            if may_read(clocks[worker], ahead, bound):
                comm.send(torch.cat([torch.tensor([float(version)]), theta]), worker, timer=timer)
                reads[worker] = (version, clocks[worker] - min(ahead))
                waiting.remove(worker)
    return theta


def run_ps_worker(cfg, env, replica, faults, log, snapshots, timer) -> None:
    theta = replica.vector()
    reply = torch.empty(1 + theta.numel())
    snapshots.take(0, log.now(), theta)
    step = 0
    while True:
        t_start, loss, grad, busy = replica.timed_gradient(faults, env.rank, log)
        wait_start = log.now()
        comm.send(torch.cat([torch.tensor([UPDATE, float(step), loss]), grad]), 0, timer=timer)
        comm.recv(reply, src=0, timer=timer)
        replica.load_vector(reply[1:])
        step += 1
        t_end = log.now()
        stop = step >= cfg.run.steps or time_up(cfg, log)
        log.write(step=step, t_start=t_start, t_end=t_end, loss=loss, busy_s=busy, wait_s=t_end - wait_start,
                  version=int(reply[0].item()), lr=lr_at(step - 1, cfg.optim, cfg.run.steps))
        if stop or snapshots.due(step):
            snapshots.take(step, t_end, reply[1:])
        if stop:
            comm.send(torch.cat([torch.tensor([DONE, float(step), 0.0]), torch.zeros_like(grad)]), 0, timer=timer)
            return
