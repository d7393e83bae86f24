"""What every gradient compressor shares: the interface, byte accounting and the DDP hook.

A compressor answers one question per gradient bucket — *what is the average of this gradient
over all ranks?* — approximately, so that it can put fewer bytes on the wire than the plain
all-reduce (2·(p−1)/p × the bucket, see :mod:`labkit.comm.collectives`). Subclasses implement
``_allreduce(bucket_index, grad)``; this base class times it, counts what a plain all-reduce
*would* have sent (``raw_bytes``) next to what was actually sent (``wire_bytes``), and keeps
per-bucket state (the error-feedback memory) in ``self.state[bucket_index]``.

Every collective goes through the counting wrappers of :mod:`labkit.comm.collectives`, and the
compressor adds the very same ``wire_bytes`` formula to its own stats, so ``stats.wire_bytes``
always equals what the shared :class:`CommTimer` saw for this compressor's collectives.

No ``from __future__ import annotations`` here: DDP inspects the hook's annotations at runtime
and only accepts the real ``dist.GradBucket`` / ``torch.futures.Future[torch.Tensor]`` objects.
"""
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from labkit.comm import collectives
from labkit.metrics.timers import CommTimer


@dataclass
class CompressionStats:
    raw_bytes: int = 0  # what the uncompressed all-reduce of the same buckets would have sent
    wire_bytes: int = 0  # what this compressor actually sent (same ring formula)
    compress_s: float = 0.0  # compress + decompress time, collectives excluded


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Compressor:
    """Approximate averaging all-reduce of flat gradient buckets (see the module docstring)."""

    name = "base"
    defaults: dict = {}  # option -> default value; the only options a compressor accepts

    def __init__(self, timer: CommTimer, group=None, **options):
        self.timer, self.group = timer, group
        self.options = {**self.defaults, **options}
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            accepted = ", ".join(self.defaults) or "none"
            raise ValueError(f"{self.name}: unknown option {unknown[0]!r}; accepted options: {accepted}")
        self.check_options(self.options)
        self.state: dict[int, dict] = {}  # per bucket: error memory, step counters, ...
        self.bucket_layouts: dict[int, tuple] = {}  # per DDP bucket: the parameters it held last step
        self.stats = CompressionStats()
        self._collective_s = 0.0

    def check_options(self, options: dict) -> None:
        """Raise ``ValueError`` naming a bad option and its fix (subclasses extend this)."""

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def allreduce(self, bucket_index: int, grad: torch.Tensor) -> torch.Tensor:
        """Average ``grad`` (this rank's flat gradient of one bucket) across ranks, approximately.

        Returns a new tensor that is identical on every rank; ``grad`` itself is left untouched.
        Per-bucket state (error feedback) carries over from call to call.
        """
        if grad.dim() != 1 or not grad.is_floating_point():
            raise ValueError(f"{self.name}: expected a flat (1-D) floating-point gradient, got shape "
                             f"{tuple(grad.shape)} and dtype {grad.dtype}; pass grad.flatten()")
        start, self._collective_s = time.perf_counter(), 0.0
        averaged = self._allreduce(bucket_index, grad)
        self.stats.compress_s += time.perf_counter() - start - self._collective_s
        self.stats.raw_bytes += collectives.wire_bytes("all_reduce", nbytes(grad), self.world)
        return averaged

    def _allreduce(self, bucket_index: int, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def collect_stats(self) -> dict:
        """This step's {raw_bytes, wire_bytes, compress_s}; then start counting afresh."""
        stats, self.stats = asdict(self.stats), CompressionStats()
        return stats

    def reset(self, bucket_index: int) -> None:
        """Forget a bucket's state (DDP calls this, through the hook, when it rebuilds buckets)."""
        self.state.pop(bucket_index, None)

    def error_buffer(self, bucket_index: int, like: torch.Tensor) -> torch.Tensor:
        """The bucket's error-feedback memory: what earlier steps computed but did not send."""
        error = self.state.setdefault(bucket_index, {}).get("error")
        if error is None or error.shape != like.shape:
            error = self.state[bucket_index]["error"] = torch.zeros_like(like)
        return error

    # -- collectives: through labkit's counting wrappers, and into this compressor's stats ---------
    def _count(self, op: str, tensor: torch.Tensor) -> None:
        self.stats.wire_bytes += collectives.wire_bytes(op, nbytes(tensor), self.world)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place."""
        self._count("all_reduce", tensor)
        start = time.perf_counter()
        collectives.all_reduce(tensor, self.timer, group=self.group)
        self._collective_s += time.perf_counter() - start
        return tensor

    def all_gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's equal-size 1-D ``local``, stacked as rows in rank order: (world, numel)."""
        gathered = local.new_empty(self.world * local.numel())
        self._count("all_gather", gathered)
        start = time.perf_counter()
        collectives.all_gather(gathered, local.contiguous(), self.timer, group=self.group)
        self._collective_s += time.perf_counter() - start
        return gathered.view(self.world, -1)

    def ddp_hook(self):
        """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``."""
        return self, compressed_allreduce_hook


def bucket_layout(bucket: dist.GradBucket) -> tuple:
    """Which parameters (by storage address) a DDP bucket holds, to notice a rebuild."""
    return tuple((p.data_ptr(), p.numel()) for p in bucket.parameters())


def compressed_allreduce_hook(compressor: Compressor, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages each bucket with ``compressor.allreduce``.

    It is *synchronous*: the collectives finish before the hook returns (a completed future), so
    the bucket's communication does not overlap the rest of backward — simple and deterministic,
    at the price of the overlap DDP's default hook gets.

    DDP rebuilds its buckets once, after the first iteration, in the order gradients actually
    became ready; a bucket index may then hold different parameters, so the hook forgets that
    bucket's error memory instead of adding it to the wrong gradients.
    """
    compressor.timer.grad_ready()
    layout, layouts = bucket_layout(bucket), compressor.bucket_layouts
    if layouts.get(bucket.index(), layout) != layout:
        compressor.reset(bucket.index())
    layouts[bucket.index()] = layout
    buffer = bucket.buffer()
    buffer.copy_(compressor.allreduce(bucket.index(), buffer))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future
