"""Consistency through collectives: ``sync`` (all-reduce every step) and ``local_sgd`` (every H steps).

* ``sync``: each step every worker all-reduces its gradient and applies the mean — the replicas
  stay bit-for-bit identical (C), and a worker that cannot be reached stops everyone (not A).
* ``local_sgd``: workers step alone and average parameters every H = ``comm.sync_every`` steps
  (:func:`labkit.parallel.dp.local_sgd.average_parameters`, the communication issue's implementation). A
  partition stalls the others only at the next averaging: up to H steps of availability bought with
  replicas that drift apart in between. H = 1 with plain SGD is exactly ``sync``.

The run stops when ``run.steps`` are done or ``comm.duration_s`` has passed; because collectives
need every rank, the ranks agree on stopping with one more all-reduce (a flag per rank).
"""
from __future__ import annotations

import torch

from labkit.comm import collectives as comm
from labkit.parallel.dp.local_sgd import average_parameters
from labkit.optim import lr_at


def time_up(cfg, log) -> bool:
    return cfg.comm.duration_s is not None and log.now() >= cfg.comm.duration_s


def run_allreduce_worker(cfg, env, replica, faults, log, snapshots, timer) -> None:
    workers, mode = env.world_size, cfg.comm.consistency
    every = 1 if mode == "sync" else cfg.comm.sync_every
    snapshots.take(0, log.now(), replica.vector())
    step = 0
    while True:
        t_start, loss, grad, busy = replica.timed_gradient(faults, env.rank, log)
        lr = lr_at(step, cfg.optim, cfg.run.steps)
        wait_start = log.now()
        synced = (step + 1) % every == 0
        stop = step + 1 >= cfg.run.steps
        if mode == "sync":
            flags = torch.tensor([loss, float(time_up(cfg, log))])
            buffer = torch.cat([grad, flags])
            comm.all_reduce(buffer, timer=timer)
            replica.sgd_step(buffer[:-2] / workers, lr)
            mean_loss, stop = buffer[-2].item() / workers, stop or buffer[-1].item() > 0
        else:
            replica.sgd_step(grad, lr)
            mean_loss = None
            if synced:
                average_parameters(replica.params, timer=timer)
                flag = torch.tensor([float(time_up(cfg, log))])
                comm.all_reduce(flag, timer=timer)
                stop = stop or flag.item() > 0
        step += 1
        t_end = log.now()
        log.write(step=step, t_start=t_start, t_end=t_end, loss=loss, mean_loss=mean_loss, busy_s=busy,
                  wait_s=t_end - wait_start, lr=lr, synced=synced)
        if stop or snapshots.due(step) or (synced and mode == "local_sgd"):  # after each average, too
            snapshots.take(step, t_end, replica.vector())
        if stop:
            return
