"""One consistency run (``comm.consistency`` set): every process's part, start to summary."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.comm import control
from labkit.comm.partition import NO_FAULTS, NetworkFaults, set_faults
from labkit.consistency import measure
from labkit.consistency.allreduce import run_allreduce_worker
from labkit.consistency.parameter_server import run_ps_worker, run_server
from labkit.consistency.replica import ProgressLog, Replica, Snapshots
from labkit.data import build_datasets, validation_loader
from labkit.fault.inject import restart_attempt
from labkit.metrics.timers import CommTimer
from labkit.model import GPTShape, count_params
from labkit.session import WorkerSession

SERVER_MODES = ("ssp", "async")
CAP_DEVICE, CAP_BACKEND = "cpu", "gloo"


def cap_config(cfg):
    """``cfg`` as the CAP lab runs it: on the CPU, over gloo — on a GPU machine too.

    The lab's tensors (each replica's model, the flat parameter and gradient vectors, the messages, the
    agreed start time) live in CPU memory, so its process group must be one that moves CPU tensors:
    gloo. ``comm.backend=auto`` on a CUDA machine would pick NCCL, which takes CUDA tensors only, and
    every send would fail. Moving the tensors to the GPUs instead would not do either: the parameter
    server receives from whichever worker sends first (``recv`` without a source), which NCCL does
    not offer, and the lab runs more processes (a server and its workers, several per core) than a
    machine has GPUs. The model is tiny and the lab is about who waits for whom, not about speed, so
    the CPU loses nothing. ``comm.backend=nccl`` set by hand is refused before a worker starts
    (:func:`labkit.consistency.checks.consistency_problems`).
    """
    return cfg.replace(**{"run.device": CAP_DEVICE, "comm.backend": CAP_BACKEND})


def processes_for(mode: str, workers: int) -> int:
    """Processes to launch for ``workers`` workers: the parameter-server modes add rank 0 as the server."""
    return workers + 1 if mode in SERVER_MODES else workers


def agreed_start_time() -> float:
    """Rank 0's clock, broadcast: every rank places the partition window the same way."""
    return control.broadcast_tensor(torch.tensor([time.time()], dtype=torch.float64), src=0).item()


def evaluate(replica: Replica, vector: torch.Tensor, val_ds, cfg) -> float:
    replica.load_vector(vector)
    loader = validation_loader(val_ds, cfg.data.micro_batch_size)
    with torch.no_grad():
        losses = [replica.model(*loader.next_micro_batch())[1].item() for _ in range(cfg.run.eval_batches)]
    return sum(losses) / len(losses)


def stall_message(cfg, env, faults: NetworkFaults, error: Exception) -> str:
    """Say what a collective or message that never completed means, instead of a bare socket error."""
    text = f"rank {env.rank}: the network did not answer ({error})"
    if faults.window:
        start, heal = faults.window
        text += (f". Rank {faults.partition_rank} was partitioned from {start:g} s to {heal:g} s and "
                 f"comm.consistency={cfg.comm.consistency} cannot progress without it; a partition longer "
                 f"than comm.timeout_s={cfg.comm.timeout_s:g} s ends the run (with fault.max_restarts > 0, "
                 "it restarts, without the partition)")
    return text


def train_consistency(cfg, run_dir: str | Path) -> dict | None:
    """Run this process's role (worker or parameter server); rank 0 writes the summary and returns it.

    Start-up and shutdown are the main trainer's (``labkit.session``): the same group, the same event
    log, and a summary written however the run ends. The group is gloo and the tensors stay on the
    CPU whatever the machine (:func:`cap_config`).
    """
    cfg = cap_config(cfg)
    with WorkerSession(cfg, run_dir, consistency=cfg.comm.consistency) as session:
        _run_role(session)
    return session.result()


def _run_role(session: WorkerSession) -> None:
    cfg, env, sink, summary, run_dir = session.cfg, session.env, session.sink, session.summary, session.run_dir
    mode = cfg.comm.consistency
    if CAP_BACKEND not in dist.get_backend():  # a group someone else started, that cannot move CPU tensors
        raise RuntimeError(f"the CAP lab sends CPU tensors and needs a {CAP_BACKEND} process group; "
                           f"this process's group is {dist.get_backend()}")
    serving = mode in SERVER_MODES
    workers = env.world_size - 1 if serving else env.world_size
    t0 = agreed_start_time()
    attempt = restart_attempt()  # like the fault injector's faults, a partition happens in the first attempt only
    faults = NetworkFaults.from_config(cfg.comm, t0) if attempt == 0 else NO_FAULTS
    set_faults(faults)
    session.closers.append(lambda: set_faults(NO_FAULTS))
    session.finishers.insert(0, lambda s: s.update(wall_s=time.time() - t0))
    train_ds, val_ds, tokenizer, _ = build_datasets(cfg.data.dataset, cfg.data.tokenizer,
                                                    cfg.model.block_size, cfg.data.val_fraction)
    shape = GPTShape.from_config(cfg.model, tokenizer.vocab_size, "naive")
    worker = env.rank - 1 if serving else env.rank
    replica = Replica(cfg, shape, train_ds, max(worker, 0), workers)
    described = dict(consistency=mode, workers=workers, world_size=env.world_size, server=0 if serving else None,
                     staleness_bound=cfg.comm.staleness if mode == "ssp" else None,
                     sync_every=cfg.comm.sync_every if mode == "local_sgd" else 1 if mode == "sync" else None,
                     partition=list(faults.window) if faults.window else None,
                     partition_rank=cfg.comm.partition_rank if faults.window else None,
                     slow_rank=cfg.comm.slow_rank, slow_factor=cfg.comm.slow_factor,
                     duration_s=cfg.comm.duration_s, steps=cfg.run.steps, params=count_params(shape))
    summary.update(described)
    if sink:
        sink.write("start", t0=t0, attempt=attempt, **described)
    cap = run_dir / "cap"
    timer = CommTimer()
    final = None
    if serving and env.rank == 0:
        log = ProgressLog(cap / "server.jsonl", t0)
        final = run_server(cfg, env, replica, log, timer)
    else:
        log = ProgressLog(cap / f"worker{env.rank}.jsonl", t0)
        snapshots = Snapshots(cfg.comm.measure_every)
        loop = run_ps_worker if serving else run_allreduce_worker
        try:
            loop(cfg, env, replica, faults, log, snapshots, timer)
        except RuntimeError as error:
            raise RuntimeError(stall_message(cfg, env, faults, error)) from error
        snapshots.save(cap / f"params_rank{env.rank}.pt")
    log.close()
    control.barrier()  # every log and snapshot is on disk
    if env.is_main:
        ranks, snaps, updates = measure.load(run_dir)
        if final is None:  # the replicas' average: what the next synchronisation would agree on
            final = torch.stack([s["vectors"][-1] for s in snaps.values()]).mean(0)
        summary.update(**measure.summarize(ranks, snaps, updates, faults.window, lockstep=not serving))
        summary["final_loss"] = evaluate(replica, final, val_ds, cfg) if val_ds is not None else None
    session.finished(restarts=attempt)
