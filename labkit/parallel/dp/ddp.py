"""Data parallelism written out: labkit's own DDP, naive and bucketed.

Both keep a full model replica per rank and average gradients with all-reduce, so all replicas
take the same step. They differ in *when* they communicate:

* ``ddp_naive`` waits for backward to finish, then all-reduces every parameter's gradient, one
  blocking call each. Simple, but every byte of communication is exposed: nothing overlaps it,
  and many small messages each pay the network's latency.
* ``ddp_bucketed`` packs gradients into buckets of ``bucket_mb`` and launches a bucket's
  all-reduce asynchronously from backward hooks the moment its last gradient is ready, while
  backward keeps computing earlier layers. It waits for all of them only before the optimizer
  step. Gradients become ready in roughly reverse order of the parameters, so buckets are
  filled from the last parameter backwards (as torch DDP does). Each gradient *is* a view of
  its bucket (torch DDP's ``gradient_as_bucket_view``): the first time a gradient appears the
  hook copies it into the bucket and points ``.grad`` there, so later micro-batches accumulate in
  place and the gradients are held once, not twice.

Both copy rank 0's weights to every rank at wrap time, skip frozen parameters
(``requires_grad=False``), count a tied parameter once, and communicate only on the last
micro-batch under gradient accumulation (the trainer calls ``sync_gradients`` once per step).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from labkit.comm import collectives as comm
from labkit.comm import compressor_from_config
from labkit.model.init import is_meta
from labkit.parallel.dp.base import Strategy
from labkit.parallel.ep import is_expert
from labkit.parallel.spec import STRATEGIES, refusing

DTENSOR_GRADIENTS = "labkit's DDP all-reduces plain gradient tensors, and DTensor's are DTensors"  # tp=dtensor: why not

def broadcast_from_rank0(module: nn.Module, group=None, src: int = 0) -> None:
    """Make every replica start from the first replica's weights (and buffers).

    ``src`` is that replica's global rank, the first of the data-parallel ``group`` (None: the world).
    A tensor still on the meta device has no value yet: each rank draws it later from the same seed; an expert
    tensor under expert parallelism is another one on each ep rank (drawn from the seed too). Set-up traffic: sent
    before any step, it is counted on no step's timer.
    """
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if is_meta(tensor) or is_expert(tensor):
                continue
            local = tensor.data.to_local() if hasattr(tensor.data, "to_local") else tensor.data  # DTensor: its slice
            comm.broadcast(local, src, group)


def trainable_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that get gradients and that every replica holds alike, each once (``parameters()`` already
    dedups tied weights): not the experts under expert parallelism, which ``labkit.parallel.ep`` averages."""
    return [p for p in module.parameters() if p.requires_grad and not is_expert(p)]


class ReplicatedModule(nn.Module):
    """A full replica; ``.module`` is the wrapped model, as with torch DDP."""

    def __init__(self, module: nn.Module, group=None, src: int = 0):
        super().__init__()
        self.module = module
        broadcast_from_rank0(module, group, src)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@STRATEGIES.register
class NaiveDDP(Strategy):
    name, order = "ddp_naive", 20
    refuses = refusing("tp", DTENSOR_GRADIENTS, ("dtensor",))

    def wrap(self, model: nn.Module) -> nn.Module:
        return ReplicatedModule(model, self.group, self.src)

    def sync_gradients(self, module: nn.Module) -> None:
        self.comm_timer.backward_done()
        for p in trainable_params(module):
            if p.grad is None:  # unused this step: same on every rank, contributes zeros
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, self.group)
            p.grad.div_(self.replicas)
        self.run_gradient_hooks()


class Bucket:
    """A flat buffer for a group of parameters' gradients, all-reduced as one message."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.buffer = torch.zeros(offset, dtype=params[0].dtype, device=params[0].device)
        self.ready: set[int] = set()
        self.work = None

    def views(self):
        for index in range(len(self.params)):
            yield self.params[index], self.view(index)

    def view(self, index: int) -> torch.Tensor:
        p, offset = self.params[index], self.offsets[index]
        return self.buffer[offset: offset + p.numel()].view_as(p)


@torch.no_grad()
def as_bucket_view(p: nn.Parameter, bucket: Bucket, index: int) -> None:
    """Point ``p.grad`` into its bucket (copying it there, the one time it is a tensor of its own: after
    ``zero_grad(set_to_none=True)`` autograd makes a fresh one), as torch DDP's ``gradient_as_bucket_view``."""
    view = bucket.view(index)
    if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
        view.copy_(p.grad)
        p.grad = view


def bucket_params(params: list[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """Group parameters, last first, into buckets of at most ``bucket_bytes``.

    A parameter larger than a bucket gets a bucket of its own; dtypes never mix in a bucket.
    """
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def make_buckets(params: list[nn.Parameter], bucket_bytes: float) -> list[Bucket]:
    """:func:`bucket_params`, each group with its flat buffer."""
    return [Bucket(group) for group in bucket_params(params, bucket_bytes)]


class _Done:
    """A compressor's finished average: nothing to wait for, and the buffer already holds the mean."""

    def wait(self) -> None:
        pass


@STRATEGIES.register
class BucketedDDP(Strategy):
    name, order = "ddp_bucketed", 30
    refuses = {**refusing("tp", DTENSOR_GRADIENTS, ("dtensor",)),
               **refusing("pp", "its backward hooks are held back until a stage's last backward by labkit's "
                                "schedule, not by torch's", ("torch",))}  # torch's pipeline cannot hold them back
    compresses = True  # comm.compression's compressor averages each bucket

    def __init__(self, cfg, env):
        super().__init__(cfg, env)
        self.bucket_bytes = cfg.parallel.dp.bucket_mb * 2**20
        self.buckets: list[Bucket] = []
        self._sync = True

    def wrap(self, model: nn.Module) -> nn.Module:
        wrapped = ReplicatedModule(model, self.group, self.src)
        self.compressor = compressor_from_config(self.cfg, self.comm_timer, self.process_group)
        if self.compressor is not None:
            self.compressor.name_parameters(model)
        self.buckets = make_buckets(trainable_params(model), self.bucket_bytes)
        for bucket in self.buckets:
            for index, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(self._hook(bucket, index))
        return wrapped

    def _hook(self, bucket: Bucket, index: int):
        def on_grad_ready(p: nn.Parameter) -> None:
            as_bucket_view(p, bucket, index)
            if not self._sync:
                return  # gradient accumulation: keep summing, in the bucket
            self.comm_timer.grad_ready()
            bucket.ready.add(index)
            if len(bucket.ready) == len(bucket.params):
                self._launch(bucket)

        return on_grad_ready

    def _launch(self, bucket: Bucket) -> None:
        with torch.no_grad():
            for p, view in bucket.views():
                if p.grad is None:  # unused this step: contributes zeros
                    view.zero_()
        if self.compressor is None:
            bucket.work = comm.all_reduce(bucket.buffer, self.group, async_op=True)
        else:  # compressors average synchronously (their result is already the mean)
            index = self.buckets.index(bucket)
            self.compressor.place(index, self.compressor.layout_of(bucket.params))
            bucket.buffer.copy_(self.compressor.allreduce(index, bucket.buffer))
            bucket.work = _Done()

    @contextmanager
    def _no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def no_sync(self, module: nn.Module):
        return self._no_sync()

    def sync_gradients(self, module: nn.Module) -> None:
        """Launch any bucket backward did not complete (unused parameters), then wait for all."""
        self.comm_timer.backward_done()
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            if not isinstance(bucket.work, _Done):
                bucket.buffer.div_(self.replicas)
            bucket.work, bucket.ready = None, set()
            for p, view in bucket.views():
                p.grad = view  # the averaged gradient, in place
        self.run_gradient_hooks()
