"""Memory this worker measured: its peak (allocated GPU memory, or peak RSS on CPU), its capacity, the
bytes autograd saves for backward (the activations), and the peak of each phase of a step (PhasePeaks)."""
from __future__ import annotations

import resource
import sys
import threading
import weakref
from contextlib import contextmanager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from labkit.metrics.steps import PHASES


def peak_memory_bytes(device: str) -> int:
    if device == "cuda":  # PhasePeaks resets the allocator's peak: the larger one before a reset counts too
        return max(_cuda_peak_before_resets, int(torch.cuda.max_memory_allocated()))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def memory_kind(device: str) -> str:
    return "cuda_max_allocated" if device == "cuda" else "cpu_peak_rss"


def memory_capacity_bytes(device: str, local_rank: int = 0, local_world_size: int = 1) -> int | None:
    """What this worker may use: its GPU's memory, or its share of the machine's RAM on CPU."""
    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(local_rank).total_memory)
    try:
        with open("/proc/meminfo") as f:
            total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return None
    return total_kib * 1024 // max(1, local_world_size)


def _is_weight(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (``F.linear`` may save the transposed weight)."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


class count_saved_bytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the tensors autograd saves for backward (the activations), each storage counted once.

    Weights are not activations: ``exclude``'s storages and any ``nn.Parameter`` or view of one are left out —
    FSDP2's gathered full weights too, which are Parameters while a module runs (and are freed after its
    forward, gathered again for its backward). A weight's cast copy under autocast is not a Parameter, and is
    counted."""

    def __init__(self, exclude=()):
        self.total = 0
        self._seen = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                      for p in exclude}  # weights are not activations

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if _is_weight(tensor):
                return tensor
            storage = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).untyped_storage()  # DTensor
            if storage.data_ptr() not in self._seen:
                self._seen.add(storage.data_ptr())
                self.total += storage.nbytes()
            return tensor

        super().__init__(pack, lambda tensor: tensor)

    def __enter__(self):
        super().__enter__()
        return self



# ---------------------------------------------------------------- peak memory per phase of a step
#
# ``max_mem_bytes`` is one number per step, read after the fact (on CPU the process's peak RSS since it
# started). The ZeRO paper's Fig. 1 is about *when* memory peaks: parameters + gradients + optimizer state
# per rank, with activations on top while backward runs. So a tracked step records the peak of each phase
# (labkit.metrics.steps.PHASES): on CUDA from the caching allocator's own counters, on CPU — which keeps no
# such counters — from :class:`AllocationTracker`, written here to teach what the counters count. torch's
# ``torch.distributed._tools.mem_tracker.MemTracker`` is the native tracker of the same kind (it also sorts
# the bytes into parameters, gradients, activations, ... per module); tests/metrics/test_phase_memory.py
# shows both find the same peak for a training step.

class AllocationTracker(TorchDispatchMode):
    """Bytes held by live tensor storages, and the most held at once since :meth:`reset_peak`.

    While the mode is entered (``with tracker:``) every aten op passes through :meth:`__torch_dispatch__`;
    each storage behind its outputs, and behind its inputs the first time one is seen (a buffer made before
    tracking began, such as a gradient bucket), is counted once, by its ``untyped_storage()``: views share
    their base's storage, and torch keeps one Python storage object per live storage, so the object's
    ``id`` names the storage while it lives. A finalizer on that object subtracts the bytes when the storage
    is freed — also when that happens after the mode is left, so one tracker can be entered around each
    phase of a step and stays right in between. ``torch.UntypedStorage.resize_`` (FSDP2 frees and refills
    its gathered parameters that way) bypasses dispatch, so it is wrapped while the mode is entered.

    What was alive before is declared with :meth:`hold` (the model's and optimizer's tensors: the baseline);
    a storage made by C++ code outside any op (torch DDP's reducer buckets) is seen only once an op uses
    it. Sizes are the storages' bytes, without an allocator's rounding; the numbers are torch's tensors,
    not the process's RSS.
    """

    def __init__(self):
        super().__init__()
        self.current = 0  # bytes held now by the storages counted
        self.peak = 0  # the most ``current`` has been since reset_peak()
        self._sizes: dict[int, int] = {}  # id(storage) → bytes, for the storages counted and still alive
        self._finalizers: list[weakref.finalize] = []
        self._lock = threading.Lock()  # a storage may be freed on another thread (a backend's)
        self._resize = None
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # a torch built without distributed
            DTensor = None
        self._dtensor = DTensor

    def hold(self, tensors) -> "AllocationTracker":
        """Count tensors that already live (the baseline); each storage once, however often it is given."""
        for tensor in tensors:
            self._count(tensor)
        return self

    def reset_peak(self) -> None:
        """The peak starts again from what is held now (at a phase's start)."""
        self.peak = self.current

    def close(self) -> None:
        """Stop following the storages still alive (their finalizers would outlive the tracker)."""
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._dtensor is not None and any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here with plain tensors
        out = func(*args, **(kwargs or {}))
        for tensor in _tensors((args, kwargs)):  # inputs first: they were alive before the output was made
            self._count(tensor)
        for tensor in _tensors((out,)):
            self._count(tensor)
        return out

    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        original, tracker = self._resize, self

        def resize_(storage, size):
            result = original(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def _count(self, tensor: torch.Tensor) -> None:
        for storage in _storages(tensor):
            self._add(storage)

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes or not storage.nbytes():
            return
        with self._lock:
            self._sizes[key] = storage.nbytes()
            self._grow(storage.nbytes())
        finalizer = weakref.finalize(storage, self._freed, key)
        finalizer.atexit = False
        self._finalizers.append(finalizer)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self._sizes:
            self._add(storage)  # counted from now on
            return
        with self._lock:
            self._grow(storage.nbytes() - self._sizes[key])
            self._sizes[key] = storage.nbytes()

    def _freed(self, key: int) -> None:
        with self._lock:
            self.current -= self._sizes.pop(key, 0)

    def _grow(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current


def _tensors(values):
    """The tensors among an op's arguments or outputs (in lists too: ``_foreach`` ops take lists)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)
        elif isinstance(value, dict):
            yield from _tensors(value.values())


def _storages(tensor: torch.Tensor):
    """The storages behind a tensor: its own, or a wrapper subclass's inner tensors' (a DTensor's local shard)."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
        return
    if tensor.device.type == "meta" or tensor.layout != torch.strided:
        return  # no memory behind a meta tensor; sparse layouts have no single storage
    yield tensor.untyped_storage()


def held_tensors(model: torch.nn.Module, optimizer=None, *owners, depth: int = 4):
    """What already lives when a step starts: parameters, buffers and gradients of ``model``; the
    optimizer's parameters (ZeRO's flat shards are its own), their gradients and its state; and every
    tensor ``owners`` reach through their attributes, lists, tuples and dicts, ``depth`` levels down (a
    strategy's gradient buckets, made when it wrapped the model). Repeats are fine: storages count once."""
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from model.buffers()
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                yield p
                if p.grad is not None:
                    yield p.grad
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    seen: set[int] = set()
    for owner in owners:
        yield from _reachable_tensors(owner, depth, seen)


def _reachable_tensors(obj, depth: int, seen: set[int]):
    """Tensors (and a leaf's gradient) reachable from ``obj``; each object visited once, ``depth`` deep."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.requires_grad and obj.is_leaf and obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, torch.nn.Module):
        yield from held_tensors(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _reachable_tensors(value, depth - 1, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from _reachable_tensors(value, depth - 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
        for value in vars(obj).values():
            yield from _reachable_tensors(value, depth - 1, seen)


_cuda_peak_before_resets = 0  # the allocator's peak, kept across PhasePeaks' resets of it (peak_memory_bytes)


class PhasePeaks:
    """The peak bytes allocated in each phase of one step, as ``peak_{phase}_bytes`` stats.

    ``with peaks.phase("backward"): ...`` measures one span; a phase entered more than once in a step
    (forward and backward once per micro-batch under gradient accumulation) keeps its largest peak. A
    phase's peak includes everything alive at its start: parameters, gradients, optimizer state, and the
    activations forward left for backward.

    * CUDA: ``torch.cuda.reset_peak_memory_stats()`` at a phase's start, ``max_memory_allocated()`` at its
      end (the caching allocator's own count, in its 512-byte blocks; free to read).
    * CPU: one :class:`AllocationTracker` for the step, entered only inside the phases (what is freed in
      between is still subtracted), holding ``live`` (:func:`held_tensors`) from the start.
    """

    def __init__(self, device: str, live=()):
        self.device = device
        self.peaks: dict[str, int] = {}
        self.growth: dict[str, int] = {}  # the most a phase's peak rose above what was alive when it began
        self.tracker = None if device == "cuda" else AllocationTracker().hold(live)

    @contextmanager
    def phase(self, name: str):
        global _cuda_peak_before_resets
        if self.tracker is None:
            _cuda_peak_before_resets = max(_cuda_peak_before_resets, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            began = torch.cuda.memory_allocated()
            try:
                yield
            finally:
                self._keep(name, torch.cuda.max_memory_allocated(), began)
            return
        self.tracker.reset_peak()
        began = self.tracker.current
        try:
            with self.tracker:
                yield
        finally:
            self._keep(name, self.tracker.peak, began)

    def _keep(self, name: str, peak: int, began: int) -> None:
        self.peaks[name] = max(self.peaks.get(name, 0), int(peak))
        self.growth[name] = max(self.growth.get(name, 0), int(peak) - int(began))

    def current_bytes(self) -> int:
        """Bytes allocated now, by the same instrument: the tracker's live storages (CPU), the CUDA allocator's
        ``memory_allocated`` (GPU). A pipeline reads it between its forwards for its stage's activation peak."""
        return int(torch.cuda.memory_allocated()) if self.tracker is None else self.tracker.current

    def stats(self) -> dict:
        """``peak_{phase}_bytes`` for every phase (None for one the step did not enter), and
        ``growth_backward_bytes``: how far backward's peak rose above what was alive when it began (with tiny
        activations, the gradients' peak: what ZeRO-2 holds of them); ends the tracking."""
        if self.tracker is not None:
            self.tracker.close()
        return {**{f"peak_{phase}_bytes": self.peaks.get(phase) for phase in PHASES},
                "growth_backward_bytes": self.growth.get("backward")}


class Untracked:
    """A step whose memory is not tracked: its phases cost nothing and its peaks are None."""

    current_bytes = None  # nothing to read between a pipeline's forwards

    def phase(self, name: str):
        return nullcontext()

    def stats(self) -> dict:
        return {**{f"peak_{phase}_bytes": None for phase in PHASES}, "growth_backward_bytes": None}


UNTRACKED = Untracked()


def tracked_memory_step(start: int, log_every: int = 1, after: int = 1) -> int:
    """The one step of an attempt (its first step is ``start``) whose phase peaks are tracked.

    Following every op costs host time on CPU (a tracked step of the quickstart model takes about twice as
    long; CUDA's counters are free), so one step per attempt is tracked, chosen so that no other measurement
    sees the cost: the first step at least ``after`` steps in (by default the second: warm, with the
    optimizer state built and the strategies' lazy set-up done) that is written to ``events.jsonl`` (a
    multiple of ``metrics.log_every``). That is inside every warm-up: the summaries' step-time means leave
    out the first steps (or weigh this one as 1 of hundreds), and the watchdog judges no step before it has
    ``warmup_steps`` + ``min_baseline`` (30 by default) behind it, so with ``log_every`` below that it never
    judges the tracked one. ``run.compile=verify`` times steps 1–7; it passes ``after`` = 8. Every other
    step reports None.
    """
    first = start + after
    return first + (-first) % max(1, log_every)
