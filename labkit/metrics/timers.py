"""Measuring where a step's time goes.

``StepClock`` times named phases of a step on the host (synchronising CUDA first, so GPU work is
counted where it ran, not where it was queued). ``CommTimer`` records when each collective was
launched and when it completed, from inside labkit's communication layer, so communication time
is *measured*:

* ``comm_s`` — wall time during which at least one collective was in flight (overlapping
  buckets are not double counted);
* ``comm_exposed_s`` — the part of it after backward's compute was done: the time the step sat
  waiting on the network because there was no compute left to hide it behind. Compute is done
  when the last gradient became ready (strategies that communicate from backward hooks report
  that moment with ``grad_ready()``) or, for those that communicate after backward, when
  backward returned (``backward_done()``).

How the times were taken depends on where the tensors live, and the timer says which (``timing``):

* **CPU tensors (gloo)** — the host clock at launch, and again when the backend reports the work done
  (blocking call returned, or the future's callback ran): gloo completes a future when the data has
  moved, so completion is real.
* **CUDA tensors (NCCL)** — a host stamp would be wrong there: NCCL returns, and completes its future,
  when the collective is *queued* on its stream, not when it has run, so ``comm_s`` would be about 0 and
  the communication would be counted as compute. So each collective gets a pair of CUDA timing events
  instead (:class:`CudaEventSource`): the start recorded on the current stream just before the launch
  (NCCL's stream waits on that stream, so the event fires when the collective could begin), the end
  recorded where ``completed()`` is called — in a future's callback, which torch runs on a stream
  synchronised with the collective's kernels (``torch.futures.Future.then``), or after a blocking call,
  whose ``wait()`` has made the current stream wait on NCCL's. ``grad_ready()`` and ``backward_done()``
  record an event on the current stream as well, so compute's end is taken on the GPU too. Nothing
  waits on these events while the step runs: ``collect()`` (called after the step has been timed)
  waits for them once, reads their times against an *anchor* event recorded on an otherwise idle stream
  while the host clock is read, and turns every event into host-clock seconds, so the intervals line up
  with ``StepClock``'s spans and the step's start, exactly as the gloo ones do.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


class StepClock:
    """Totals per phase name, and every phase's (name, start, end) for a timeline of the step."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)
        self.spans: list[tuple[str, float, float]] = []

    def reset(self) -> None:
        self.totals.clear()
        self.spans = []

    @contextmanager
    def phase(self, name: str):
        _sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            end = time.perf_counter()
            self.totals[name] += end - start
            self.spans.append((name, start, end))


class PartTimes:
    """Host seconds spent in each named part of the loop's bookkeeping, summed over the run.

    Only totals are kept (constant memory, however long the run): ``per_step()`` divides them by the
    steps counted, so a slower part shows by name in the summary and in ``benchmarks/overhead.py``.
    """

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - start

    def count_step(self) -> None:
        self.steps += 1

    def per_step(self) -> dict[str, float]:
        """Seconds per step in each part (0 steps counted: the totals as they are)."""
        return {name: total / max(1, self.steps) for name, total in self.totals.items()}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end] intervals."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


# What ``CommTimer.timing`` says about how its times were taken.
HOST_CLOCK = "host clock"  # no tensor seen (a caller that counts bytes only)
HOST_CLOCK_REAL = "host clock (gloo: completion is real)"  # CPU tensors: the backend completes when data has moved
CUDA_EVENTS = "cuda events"
UNVERIFIED = "unverified on this backend"
# Set to True once benchmarks/gpu_check.sh's comm check (benchmarks/gpu_comm_check.py) has agreed with plain
# CUDA-event measurements on a GPU; until then CUDA figures carry "(unverified on this backend)".
CUDA_EVENTS_VERIFIED = False


def host_times(anchor_host: float, ms_before_anchor) -> list[float]:
    """Host-clock seconds of device events, from how many milliseconds each fired before an anchor event
    that fired at ``anchor_host`` (``event.elapsed_time(anchor)``)."""
    return [anchor_host - ms / 1e3 for ms in ms_before_anchor]


def exposed_length(intervals: list[tuple[float, float]], compute_end) -> float:
    """The part of the intervals' union after ``compute_end`` (None: compute's end unknown, all of it)."""
    if compute_end is None:
        return union_length(intervals)
    return union_length([(max(s, compute_end), e) for s, e in intervals if e > compute_end])


class CudaEventSource:
    """Timing events on one CUDA device, and the anchor that puts them on the host clock.

    ``stamp()`` records a pooled ``torch.cuda.Event(enable_timing=True)`` on the device's current stream
    (None while a CUDA graph is being captured: no timing events there). ``anchor(clock)`` records one on a
    stream of its own, which nothing else uses, so it fires as soon as the host issues it: the host times
    read just before and just after it bound when it fired, and their mean is its host time (off by at
    most half that window, a few µs). ``resolve`` waits for the events and places each against the anchor.
    """

    _by_device: dict = {}
    _creating = threading.Lock()

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self._pool: list = []
        self._stream = None

    @classmethod
    def on(cls, device) -> "CudaEventSource":
        key = str(device)
        source = cls._by_device.get(key)
        if source is None:
            with cls._creating:
                source = cls._by_device.setdefault(key, cls(device))
        return source

    def _take(self):
        import torch

        try:
            return self._pool.pop()
        except IndexError:
            return torch.cuda.Event(enable_timing=True)

    def release(self, events) -> None:
        self._pool.extend(events)

    def stamp(self):
        import torch

        if torch.cuda.is_current_stream_capturing():
            return None
        event = self._take()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def anchor(self, clock) -> tuple[object, float]:
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        event = self._take()
        before = clock()
        event.record(self._stream)
        event.synchronize()
        after = clock()
        return event, (before + after) / 2

    def resolve(self, events: list, clock) -> list[float]:
        """Host-clock seconds of each event (waits for them: call it outside the timed step)."""
        for event in events:
            event.synchronize()
        anchor, anchor_host = self.anchor(clock)
        times = host_times(anchor_host, [event.elapsed_time(anchor) for event in events])
        self.release([anchor])
        return times


def cuda_event_source(tensor):
    """The event source for a CUDA tensor's device; None for anything else (host clock)."""
    if not getattr(tensor, "is_cuda", False):
        return None
    return CudaEventSource.on(tensor.device)


class _DeviceStart(float):
    """A launch's host time that also carries its start event on the device. It is a float, so whatever
    the caller does with a launch time (``labkit.comm.network.hold_until``) sees the host time it always did."""

    __slots__ = ("event", "source")


class CommTimer:
    """Collects (launch, completion, bytes) of each collective; thread-safe (callbacks run on comm threads).

    ``launched(wire_bytes, tensor)`` returns the launch's start, to be handed to ``completed`` once the
    collective is done. With a CUDA ``tensor`` the start and end are CUDA events (module docstring), turned
    into host-clock intervals by ``collect()``; without one, or with a CPU tensor, host-clock stamps.
    ``timing`` says which this timer used, for the step event to carry.

    ``device_timing`` maps a tensor to its event source, or None for the host clock (tests give a fake
    device here; the default is :func:`cuda_event_source`).
    """

    def __init__(self, clock=time.perf_counter, device_timing=cuda_event_source):
        self._clock = clock
        self._device_timing = device_timing
        self._lock = threading.Lock()
        self._source = None  # the device event source of the last device tensor seen (sticky)
        self._host_tensors = False  # a CPU tensor was timed
        self._unverified = False  # a device tensor had to be timed on the host (no events: graph capture)
        self._reset()

    def _reset(self) -> None:
        self._intervals: list[tuple[float, float]] = []
        self._pending: list[float] = []
        self._device_done: list[tuple[_DeviceStart, object]] = []  # (start, end event), resolved at collect
        self._last_grad_ready = None
        self._backward_done = None
        self._grad_event = None  # (source, event) of the last grad_ready / backward_done on the device
        self._backward_event = None
        self._waited = 0.0  # seconds compute stood waiting for a collective launched in an earlier step
        self.bytes = 0
        self.calls = 0

    @property
    def timing(self) -> str:
        """How this timer's times were measured: host clock, CUDA events, or unverified on this backend."""
        if self._unverified:
            return UNVERIFIED
        if self._source is not None:
            return CUDA_EVENTS if CUDA_EVENTS_VERIFIED else f"{CUDA_EVENTS} ({UNVERIFIED})"
        return HOST_CLOCK_REAL if self._host_tensors else HOST_CLOCK

    def launched(self, wire_bytes: int, tensor=None) -> float:
        source = None if tensor is None else self._device_timing(tensor)
        event = None
        if source is not None:
            self._source = source
            event = source.stamp()
            self._unverified = self._unverified or event is None
        elif tensor is not None:
            self._host_tensors = True
        start = self._clock()
        if event is not None:
            start = _DeviceStart(start)
            start.event, start.source = event, source
        with self._lock:
            self._pending.append(start)
            self.bytes += wire_bytes
            self.calls += 1
        return start

    def completed(self, start: float) -> None:
        """The collective launched at ``start`` is done — on a device: call it on a stream ordered after the
        collective (a future callback's, or the caller's after a blocking call or ``work.wait()``)."""
        end_event = start.source.stamp() if isinstance(start, _DeviceStart) else None
        end = self._clock()
        with self._lock:
            if isinstance(start, _DeviceStart):
                del self._pending[next(i for i, p in enumerate(self._pending) if p is start)]
                if end_event is not None:
                    self._device_done.append((start, end_event))
                    return
                self._unverified = True
                start.source.release([start.event])
                start = float(start)
            else:
                self._pending.remove(start)
            self._intervals.append((start, end))

    def _stamp_device(self, previous):
        """Record the moment on the device too (once a device tensor was seen), replacing ``previous``."""
        source = self._source
        if source is None:
            return previous
        event = source.stamp()
        if event is None:
            return previous
        if previous is not None:
            previous[0].release([previous[1]])
        return source, event

    def grad_ready(self, tensor=None) -> None:
        """A gradient is ready (the last call of a step marks compute's end). Once the timer has seen a CUDA
        tensor (or ``tensor`` is one) the moment is also recorded on the current stream, where the gradient's
        kernels were queued; before that (the very first bucket of a run) it is the host stamp alone."""
        if tensor is not None and self._source is None:
            self._source = self._device_timing(tensor)
        self._last_grad_ready = self._clock()
        if self._source is not None:
            self._grad_event = self._stamp_device(self._grad_event)

    def waited(self, seconds: float) -> None:
        """Compute stood still ``seconds`` for a collective it needed (ZeRO's parameter all-gather, launched after
        the last step's optimizer and waited for in this step's forward): exposed, wherever it falls."""
        with self._lock:
            self._waited += seconds

    def backward_done(self) -> None:
        """Backward has returned (strategies that communicate after it); on the device too, as ``grad_ready``."""
        self._backward_done = self._clock()
        if self._source is not None:
            self._backward_event = self._stamp_device(self._backward_event)

    def collect(self) -> dict:
        """This step's totals, then start afresh for the next step.

        Device events are resolved here, with one wait for them: call it after the step has been timed."""
        with self._lock:
            intervals, nbytes, calls = self._intervals, self.bytes, self.calls
            grad_ready, backward_done = self._last_grad_ready, self._backward_done
            device_done, moments = self._device_done, (self._grad_event, self._backward_event)
            pending, waited = self._pending, self._waited
            self._reset()
            self._pending = pending  # still in flight: completes into the next step
        if device_done:
            device_intervals, (grad_event, backward_event) = self._on_host(device_done, moments)
            intervals = intervals + device_intervals
            grad_ready = grad_ready if grad_event is None else grad_event
            backward_done = backward_done if backward_event is None else backward_event
        else:
            for moment in moments:  # no device collective this step: nothing to place them against
                if moment is not None:
                    moment[0].release([moment[1]])
        compute_end = grad_ready or backward_done
        exposed = exposed_length(intervals, compute_end) + waited
        return {"comm_s": union_length(intervals), "comm_exposed_s": exposed, "comm_bytes": nbytes,
                "comm_calls": calls, "comm_intervals": sorted(intervals)}

    def _on_host(self, device_done, moments) -> tuple[list[tuple[float, float]], list]:
        """Host-clock (start, end) of each device collective, and of each recorded moment (grad_ready,
        backward_done; None where not recorded on the device): one wait and one anchor per device."""
        groups: dict = {}  # id(source) -> (source, its events)

        def add(source, event) -> tuple[int, int]:
            group = groups.setdefault(id(source), (source, []))
            group[1].append(event)
            return id(source), len(group[1]) - 1

        slots = [(add(start.source, start.event), add(start.source, end)) for start, end in device_done]
        moment_slots = [None if moment is None else add(*moment) for moment in moments]
        times = {}
        for key, (source, events) in groups.items():
            times[key] = source.resolve(events, self._clock)
            source.release(events)

        def at(slot) -> float:
            return times[slot[0]][slot[1]]

        return [(at(a), at(b)) for a, b in slots], [None if slot is None else at(slot) for slot in moment_slots]
