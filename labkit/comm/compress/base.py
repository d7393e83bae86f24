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

**State survives restarts and bucket rebuilds.** The error memory is what the model is still owed:
dropping it loses gradient. A bucket's state is tied to its *layout* — which parameters, by name, in
which order (:meth:`Compressor.place`). When DDP rebuilds its buckets (after the first step) or a
restarted worker loads :meth:`Compressor.state_dict` from a checkpoint, flat per-bucket tensors are
cut into per-parameter pieces and reassembled in the new order, so a resumed run continues exactly.

No ``from __future__ import annotations`` here: DDP inspects the hook's annotations at runtime
and only accepts the real ``dist.GradBucket`` / ``torch.futures.Future[torch.Tensor]`` objects.
"""
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from labkit.comm import collectives
from labkit.metrics.timers import CommTimer
from labkit.registry import Registry

# every compressor, by ``comm.compression`` name; each module of this package registers its own
COMPRESSORS = Registry("comm.compression", what="compressor")


@dataclass
class CompressionStats:
    raw_bytes: int = 0  # what the uncompressed all-reduce of the same buckets would have sent
    wire_bytes: int = 0  # what this compressor actually sent (same ring formula)
    compress_s: float = 0.0  # compress + decompress time, collectives excluded


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Compressor:
    """Approximate averaging all-reduce of flat gradient buckets (see the module docstring).

    A subclass registered with ``@COMPRESSORS.register`` declares, besides ``name`` and ``defaults``,
    what the rest of labkit reads without building one: where its options come from in the config
    (``config_options``), its collective and whether it keeps error feedback (the package table),
    its place in option lists (``order``), its config checks (``problems``) and the line the tuning
    flowchart proposes it with (``advice``). Which strategies take a compressor is the strategies'
    fact (``compresses``, :mod:`labkit.parallel.spec`).
    """

    name = "base"
    defaults: dict = {}  # option -> default value; the only options a compressor accepts
    config_options: dict[str, str] = {}  # option -> the dotted config key it is read from
    order = 100  # place in option lists (lower first)
    collective = "all-reduce"  # what goes on the wire
    error_feedback = False  # remembers what it did not send, for the next step
    advice: str | None = None  # the tuning flowchart proposes it, with this reason, when communication-bound

    @classmethod
    def options_from_config(cls, cfg) -> dict:
        """The options this compressor is built with, read from a run config."""
        options = {}
        for option, dotted in cls.config_options.items():
            node = cfg
            for part in dotted.split("."):
                node = getattr(node, part)
            options[option] = node
        return options

    @classmethod
    def problems(cls, cfg, world: int) -> list[str]:
        """What is wrong in ``cfg`` for this compressor (its config keys), said before any worker starts."""
        return []

    def __init__(self, timer: CommTimer, group=None, **options):
        self.timer, self.group = timer, group
        self.options = {**self.defaults, **options}
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            accepted = ", ".join(self.defaults) or "none"
            raise ValueError(f"{self.name}: unknown option {unknown[0]!r}; accepted options: {accepted}")
        self.check_options(self.options)
        self.state: dict[int, dict] = {}  # per bucket: error memory, step counters, ...
        self.layouts: dict[int, tuple] = {}  # per bucket: ((parameter name, shape), ...) it holds
        self.param_names: dict[int, str] = {}  # data_ptr -> parameter name (see name_parameters)
        self._pieces: dict[tuple, torch.Tensor] = {}  # (state key, parameter name) -> its piece
        self._parked: dict[tuple, dict] = {}  # layout -> the rest of a bucket's state
        self.stats = CompressionStats()
        self._collective_s = 0.0
        self.sent: dict[str, list[int]] = {}  # parameter name -> [entries this rank sent, entries offered]

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

    def count_sent(self, bucket_index: int, indices: torch.Tensor) -> None:
        """Tally which parameters this rank's sent entries (flat bucket ``indices``) belong to."""
        layout = self.layouts.get(bucket_index)
        if not layout:
            return
        sizes = [math.prod(shape) for _, shape in layout]
        owner = torch.bucketize(indices.long(), torch.tensor(sizes).cumsum(0), right=True)
        for (name, _), size, count in zip(layout, sizes, torch.bincount(owner, minlength=len(sizes)).tolist()):
            tally = self.sent.setdefault(name, [0, 0])
            tally[0], tally[1] = tally[0] + count, tally[1] + size

    def sent_shares(self) -> dict[str, float]:
        """Per parameter: the fraction of its entries this rank sent per step, since this worker started.

        Only the sparsifiers (topk, randomk) choose entries; for the others this is empty. randomk
        spreads its budget evenly. topk sends where the accumulated gradient is largest, so its shares
        show where the bytes go: parameters with large gradients (the norms, the token embedding) take
        more than their share, and matrices that send less wait, their error memory growing, until an
        entry is large enough to be picked. Notebook 04 draws a live run's shares; the compression
        benchmark's prototype measurements are step ``topk_allocation`` of
        ``benchmarks/results/compression_history.jsonl``.
        """
        return {name: sent / offered for name, (sent, offered) in self.sent.items()}

    # -- state that follows the parameters: bucket rebuilds and checkpoints ------------------------
    per_parameter_keys = ("error",)  # flat per-bucket tensors, laid out like the bucket

    def name_parameters(self, model) -> None:
        """Learn the parameters' names, so layouts (and checkpoints) do not depend on memory addresses."""
        self.param_names = {p.data_ptr(): name for name, p in model.named_parameters()}

    def layout_of(self, params) -> tuple:
        return tuple((self.param_names.get(p.data_ptr(), str(p.data_ptr())), tuple(p.shape)) for p in params)

    def place(self, bucket_index: int, layout: tuple) -> None:
        """Make bucket ``bucket_index``'s state belong to ``layout`` before it is compressed.

        Nothing to do while the layout is unchanged. When a known bucket changes (DDP rebuilt its
        buckets), every bucket's state is parked as per-parameter pieces; each bucket then takes its
        parameters' pieces back in its own order (:meth:`_unpark`).
        """
        known = self.layouts.get(bucket_index)
        if known == layout:
            return
        names = {name for name, _ in layout}
        held = {name for i, other in self.layouts.items() if i != bucket_index for name, _ in other}
        if known is not None or names & held:
            for index in list(self.layouts):
                self._park(self.layouts.pop(index), self._take_state(index))
        self._give_state(bucket_index, self._unpark(layout))
        self.layouts[bucket_index] = layout

    def _take_state(self, bucket_index: int) -> dict:
        return self.state.pop(bucket_index, {})

    def _give_state(self, bucket_index: int, state: dict) -> None:
        if state:
            self.state[bucket_index] = state
        else:
            self.state.pop(bucket_index, None)

    def _split(self, key: str, tensor: torch.Tensor, layout: tuple) -> dict[str, torch.Tensor]:
        return split_by_parameter(tensor, layout)

    def _join(self, key: str, pieces: dict, layout: tuple):
        return join_by_parameter(pieces, layout)

    def _dissolve(self, layout: tuple, state: dict) -> tuple[dict, dict]:
        """(per-parameter pieces, the rest) of one bucket's state."""
        rest, pieces = dict(state), {}
        for key in self.per_parameter_keys:
            if rest.get(key) is not None:
                pieces.update({(key, name): piece for name, piece in self._split(key, rest.pop(key), layout).items()})
        return pieces, rest

    def _park(self, layout: tuple, state: dict) -> None:
        pieces, rest = self._dissolve(layout, state)
        self._pieces.update(pieces)
        if rest:
            self._parked[layout] = rest  # order-dependent (a warm start) or counters: same layout only

    def _unpark(self, layout: tuple) -> dict:
        state = self._parked.pop(layout, {})
        for key in self.per_parameter_keys:
            pieces = {name: self._pieces.pop((key, name)) for name, _ in layout if (key, name) in self._pieces}
            joined = self._join(key, pieces, layout) if pieces else None
            if joined is not None:
                state[key] = joined
        return state

    def global_state(self) -> dict:
        """State not tied to a bucket (subclasses add theirs)."""
        return {}

    def load_global_state(self, state: dict) -> None:
        pass

    def state_dict(self) -> dict:
        """This rank's state as tensors and numbers, by parameter name: its share of a checkpoint."""
        pieces, parked = dict(self._pieces), dict(self._parked)
        unplaced = {index: clone_state(state) for index, state in self.state.items() if index not in self.layouts}
        for index, layout in self.layouts.items():
            bucket_pieces, rest = self._dissolve(layout, self._bucket_state(index))
            pieces.update(bucket_pieces)
            if rest:
                parked[layout] = clone_state(rest)
        return {"pieces": pieces, "parked": parked, "unplaced": unplaced, "global": self.global_state()}

    def _bucket_state(self, bucket_index: int) -> dict:
        """A bucket's state, left in place."""
        state = self._take_state(bucket_index)
        self._give_state(bucket_index, state)
        return state

    def load_state_dict(self, saved: dict) -> None:
        """Restore :meth:`state_dict`; each bucket takes its pieces back when it is next placed."""
        for index in list(self.layouts):
            self._take_state(index)
        self.layouts, self.state = {}, {int(i): dict(s) for i, s in saved["unplaced"].items()}
        self._pieces, self._parked = dict(saved["pieces"]), dict(saved["parked"])
        self.load_global_state(saved["global"])

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
        collectives.all_reduce(tensor, self.group, timer=self.timer)
        self._collective_s += time.perf_counter() - start
        return tensor

    def all_gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's equal-size 1-D ``local``, stacked as rows in rank order: (world, numel)."""
        gathered = local.new_empty(self.world * local.numel())
        self._count("all_gather", gathered)
        start = time.perf_counter()
        collectives.all_gather(gathered, local.contiguous(), self.group, timer=self.timer)
        self._collective_s += time.perf_counter() - start
        return gathered.view(self.world, -1)

    def ddp_hook(self):
        """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``."""
        return self, compressed_allreduce_hook


def clone_state(state: dict) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def split_by_parameter(flat: torch.Tensor, layout: tuple) -> dict[str, torch.Tensor]:
    """A flat bucket-sized tensor cut into each parameter's piece (``layout`` gives the order)."""
    pieces, start = {}, 0
    for name, shape in layout:
        numel = math.prod(shape)
        pieces[name] = flat[start:start + numel].clone()
        start += numel
    return pieces


def join_by_parameter(pieces: dict[str, torch.Tensor], layout: tuple) -> torch.Tensor:
    """The inverse of :func:`split_by_parameter` in a (possibly different) order; zeros where no piece."""
    like = next(iter(pieces.values()))
    return torch.cat([pieces[name] if name in pieces else like.new_zeros(math.prod(shape)) for name, shape in layout])


def compressed_allreduce_hook(compressor: Compressor, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages each bucket with ``compressor.allreduce``.

    It is *synchronous*: the collectives finish before the hook returns (a completed future), so
    the bucket's communication does not overlap the rest of backward — simple and deterministic,
    at the price of the overlap DDP's default hook gets.

    DDP rebuilds its buckets once, after the first iteration, in the order gradients actually
    became ready; a bucket index may then hold different parameters in a different order, so the
    hook first places the bucket (:meth:`Compressor.place`): its error memory follows the parameters.
    """
    compressor.timer.grad_ready()
    compressor.place(bucket.index(), compressor.layout_of(bucket.parameters()))
    buffer = bucket.buffer()
    buffer.copy_(compressor.allreduce(bucket.index(), buffer))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future
