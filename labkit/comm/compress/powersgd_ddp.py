"""torch's ``powerSGD_hook`` as a DDP hook, counted like every other collective in labkit.

torch's hook calls ``dist.all_reduce`` itself — up to three per bucket: the tensors not worth
compressing (1-D ones like biases), then all Ps, then all Qs — so while it runs we route
``dist.all_reduce`` through :func:`labkit.comm.collectives.all_reduce` (as
``instrument_torch_collectives`` does for FSDP2): its bytes and time land in the shared
``CommTimer`` and in the compressor's stats. :func:`powersgd_collective_bytes` predicts the same
payloads analytically from the bucket's shapes (the tests check the two agree).

The hook runs torch's chain *synchronously*: each all-reduce is waited for as soon as it is
launched, so the chain's callbacks run right away in the hook's own thread and the hook returns a
finished bucket. Run as torch wrote it, the hook launches its P and Q all-reduces from callbacks on
gloo's worker threads and blocks there; with several buckets in flight that has deadlocked on gloo
(observed at world 4 with three buckets; world 2, or a single bucket, got by). Synchronously,
every rank issues its collectives in the same order and no worker thread waits on another — at the
price of overlapping communication with the rest of backward. ``compress_s`` is the hook's wall
time minus the time spent in its all-reduces: the matmuls and orthogonalisations.
"""
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from labkit.comm import collectives
from labkit.comm.compress.base import Compressor, nbytes


def powersgd_collective_bytes(state: torch_powersgd.PowerSGDState, bucket: dist.GradBucket) -> list[int]:
    """Payload bytes of each all-reduce torch's ``powerSGD_hook`` is about to issue for ``bucket``."""
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        return [nbytes(buffer)]  # the plain warm-up all-reduce
    uncompressed = ps = qs = 0
    for grad in bucket.gradients():  # torch's rule: view as (shape[0], rest), compress if worth it
        n, m = grad.shape[0], grad.numel() // grad.shape[0]
        rank = min(n, m, state.matrix_approximation_rank)
        if torch_powersgd._should_compress(n, m, rank, state.min_compression_rate)[0]:
            ps, qs = ps + n * rank, qs + m * rank
        else:
            uncompressed += grad.numel()
    return [count * buffer.element_size() for count in (uncompressed, ps, qs)]


@contextmanager
def counted_all_reduces(compressor: Compressor, in_flight_s: list):
    """While active, ``dist.all_reduce`` goes through labkit's wrapper and into ``compressor.stats``."""
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        compressor.stats.wire_bytes += collectives.wire_bytes("all_reduce", nbytes(tensor), dist.get_world_size(group))
        start = time.perf_counter()
        work = collectives.all_reduce(tensor, group, op, async_op, timer=compressor.timer)
        if work is not None:
            work.wait()  # synchronous: torch's .then() callbacks now run here, in the hook's thread
        in_flight_s.append(time.perf_counter() - start)
        return work

    original, dist.all_reduce = dist.all_reduce, all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


def powersgd_ddp_hook(compressor: Compressor, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook`` on ``compressor.torch_state``, one bucket at a time, counted."""
    compressor.timer.grad_ready()
    compressor.place(bucket.index(), compressor.layout_of(bucket.parameters()))
    world = dist.get_world_size(compressor.group)
    compressor.stats.raw_bytes += collectives.wire_bytes("all_reduce", nbytes(bucket.buffer()), world)
    start, in_flight_s = time.perf_counter(), []
    with counted_all_reduces(compressor, in_flight_s):
        averaged = torch_powersgd.powerSGD_hook(compressor.torch_state, bucket).wait()
    compressor.stats.compress_s += max(0.0, time.perf_counter() - start - sum(in_flight_s))
    future = torch.futures.Future()
    future.set_result(averaged)
    return future
