"""Joining the process group: one worker process per rank.

torchrun (or labkit's launcher, which uses the same elastic agent) starts the workers and
sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` for each. Here a worker:

1. pins its CPU threads, so N workers on a small machine do not fight over the cores;
2. picks its device (one GPU per local rank, or the CPU);
3. joins the process group — gloo on CPU, NCCL on GPU — through a store namespace of its
   own per restart attempt, so a restarted group never meets the ghosts of the crashed one;
4. takes its place on the rank grid (``labkit.parallel.mesh``): a named (pp, dp, cp, tp) device mesh
   whose axes' groups every component asks for.

Started without torchrun, the same code forms a group of one, so every path runs alike.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from labkit.config import Config, cpu_count, resolve_backend, resolve_device
from labkit.parallel.mesh import ParallelDims, RankGrid, build_grid


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: str
    backend: str
    threads: int
    grid: RankGrid = field(default=None)  # None: a grid of data parallelism only, without a device mesh

    def __post_init__(self):
        if self.grid is None:
            self.grid = RankGrid(ParallelDims(dp=self.world_size), self.rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.device == "cuda" else torch.device("cpu")


def threads_per_proc(cfg: Config, local_world_size: int) -> int:
    if cfg.run.threads_per_proc != "auto":
        return int(cfg.run.threads_per_proc)
    return max(1, cpu_count() // max(1, local_world_size))


ATTEMPT_ENV = "LABKIT_ATTEMPT"  # which formation of the process group this worker belongs to (set by _store)


def _store(rank: int, timeout_s: float):
    """The rendezvous store, namespaced by the process group's formation.

    ``TORCHELASTIC_RESTART_COUNT`` is each agent's own count: on several nodes, when one node's worker dies its
    agent counts a restart while the other agents restart their healthy workers for the new rendezvous round
    without counting ("membership changes do not count as retries"), and the new group's ranks would meet in
    different namespaces. Each rank is started exactly once per formation, so the number of times *this rank*
    has joined, counted in the shared store, is the same on every rank."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(addr, port, is_master=(rank == 0 and not hosted_by_agent),
                          timeout=timedelta(seconds=timeout_s))  # fault.rendezvous_timeout_s
    formation = store.add(f"labkit/joined/rank{rank}", 1) - 1
    os.environ[ATTEMPT_ENV] = str(formation)
    return dist.PrefixStore(f"attempt_{formation}", store)


def init_distributed(cfg: Config) -> DistEnv:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device, backend = resolve_device(cfg), resolve_backend(cfg)
    threads = threads_per_proc(cfg, local_world)
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        timeout = timedelta(seconds=cfg.comm.timeout_s)
        store = _store(rank, cfg.fault.rendezvous_timeout_s) if "MASTER_ADDR" in os.environ else dist.HashStore()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    grid = build_grid(ParallelDims.from_config(cfg, world), rank, device)
    return DistEnv(rank, world, local_rank, local_world, device, backend, threads, grid)


def shutdown_distributed() -> None:
    import gc

    if dist.is_initialized():
        gc.collect()  # modules with communication hooks must be gone before the group is
        dist.barrier()
        dist.destroy_process_group()

