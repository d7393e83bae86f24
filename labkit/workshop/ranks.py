"""Run a function on a few real gloo processes from a notebook: how the multi-process exercises check their answers.

``run_on_ranks(fn, world, *args)`` forks ``world`` processes from the calling one (a notebook's kernel, a test), joins
them into a ``torch.distributed`` group on the gloo backend (through a file store: no port to choose), calls
``fn(rank, world, *args)`` in each, and returns what each returned, rank 0 first. Forking is what lets ``fn`` be a
function defined in a notebook cell: the workers start as copies of the kernel, the participant's code included.

A rank that raises makes the call raise the same kind of exception, its message prefixed with the rank and the
worker's traceback attached as a note; a rank that is still waiting when ``timeout_s`` runs out (a send without its
matching receive, a collective one rank never reached) makes it raise ``TimeoutError``. Either way every worker is
stopped before the call returns.
"""
from __future__ import annotations

import multiprocessing
import os
import queue as queues
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable

MAX_WORLD = 8  # an exercise's world: a few processes on a laptop


def _worker(fn: Callable, rank: int, world: int, store_path: str, args: tuple, results, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # a few workers share a laptop's cores
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        try:
            value = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException as error:  # noqa: BLE001 — every failure goes back to the caller, by kind
        results.put((rank, False, (type(error), str(error), traceback.format_exc())))


def _raised(rank: int, kind: type, message: str, trace: str) -> BaseException:
    """The caller's copy of a rank's exception: the same kind where it can be rebuilt from a message."""
    try:
        error = kind(f"rank {rank}: {message}")
    except Exception:  # noqa: BLE001 — a kind whose constructor wants more than a message
        error = RuntimeError(f"rank {rank} raised {kind.__name__}: {message}")
    error.add_note(f"the worker's traceback (rank {rank}):\n{trace}")
    return error


def _stop(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()


def run_on_ranks(fn: Callable, world: int = 2, *args: Any, timeout_s: float = 60.0) -> list:
    """``[fn(0, world, *args), …, fn(world - 1, world, *args)]``, each called in its own gloo process."""
    if not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
        raise ValueError(f"world={world!r}: an exercise runs on 1 to {MAX_WORLD} processes")
    try:
        context = multiprocessing.get_context("fork")
    except ValueError:
        raise RuntimeError("the multi-process exercises fork their workers, which this system cannot do; run them "
                           "on Linux, macOS or WSL") from None
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="labkit-ranks-") as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded, fork() may deadlock": not here
        store_path = os.path.join(folder, "store")
        processes = [context.Process(target=_worker, args=(fn, rank, world, store_path, args, results, timeout_s),
                                     daemon=True, name=f"labkit-rank-{rank}") for rank in range(world)]
        try:
            for process in processes:
                process.start()
            return _collect(results, world, timeout_s)
        finally:
            _stop(processes)


def _collect(results, world: int, timeout_s: float) -> list:
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s + 10  # the workers' own timeout first: its message is the better one
    while len(values) < world:
        try:
            rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queues.Empty:
            missing = sorted(set(range(world)) - set(values))
            raise TimeoutError(f"rank(s) {missing} did not finish within {timeout_s:g} s: a send without its matching "
                               "receive, or a collective some rank never reached, waits for ever") from None
        if not ok:
            raise _raised(*_root_failure(rank, value, results))
        values[rank] = value
    return [values[rank] for rank in range(world)]


def _root_failure(rank: int, failure: tuple, results, grace_s: float = 2.0) -> tuple:
    """The failure to report: a rank whose wait timed out makes its peers' links close under them ("Connection
    closed by peer"), and their reports may come first; the others' reports that arrive within ``grace_s`` are
    read, and a timeout among them is the cause named."""
    failures, deadline = [(rank, *failure)], time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            other, ok, value = results.get(timeout=max(0.05, deadline - time.monotonic()))
        except queues.Empty:
            break
        if not ok:
            failures.append((other, *value))
    return next((f for f in failures if "timed out" in f[2].lower()), failures[0])
