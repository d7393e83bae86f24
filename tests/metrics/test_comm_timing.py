"""How CommTimer's times are taken (issue 25): the host clock for CPU tensors, CUDA events for CUDA ones.

The CUDA path runs here on a fake device whose events fire at times the test chooses, on a clock of its
own: the same arithmetic (events → host-clock intervals through the anchor, exposed time) as on a GPU,
where ``benchmarks/gpu_comm_check.py`` checks the real events.
"""
import pytest
import torch
import torch.distributed as dist

from labkit.comm import collectives as comm
from labkit.metrics import timers
from labkit.metrics.timers import (CUDA_EVENTS, HOST_CLOCK, HOST_CLOCK_REAL, UNVERIFIED, CommTimer,
                                   CudaEventSource, cuda_event_source, exposed_length, host_times)


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class FakeEvent:
    def __init__(self, device):
        self.device, self.fires_at = device, None

    def synchronize(self):
        self.device.waited += 1

    def elapsed_time(self, other) -> float:  # ms from this event to ``other``, as torch.cuda.Event's
        return (other.fires_at - self.fires_at) * 1e3


class FakeDevice(CudaEventSource):
    """A GPU whose clock has its own origin: each event fires at ``gpu_now`` when it is stamped.

    It keeps the real ``resolve`` (events → host seconds against the anchor); only recording is faked."""

    ORIGIN = 5000.0  # the device clock's zero is nowhere near the host's

    def __init__(self, host):
        self._pool, self._stream, self.host, self.waited, self.created = [], None, host, 0, 0
        self.gpu_now = None  # host-clock seconds at which the next stamped event fires
        self.capturing = False

    def _take(self):
        if self._pool:
            return self._pool.pop()
        self.created += 1
        return FakeEvent(self)

    def stamp(self):
        if self.capturing:
            return None
        event = self._take()
        event.fires_at = self.ORIGIN + (self.host[0] if self.gpu_now is None else self.gpu_now)
        return event

    def anchor(self, clock):
        event = self._take()
        event.fires_at = self.ORIGIN + self.host[0]  # an idle stream: it fires as the host issues it
        return event, clock()


class FakeTensor:
    is_cuda = True


def fake_timer():
    host = [0.0]
    device = FakeDevice(host)
    timer = CommTimer(clock=lambda: host[0], device_timing=lambda t: device if getattr(t, "is_cuda", False) else None)
    return timer, device, host


def test_pure_parts_events_to_host_seconds_and_exposed_time():
    assert host_times(10.0, [0.0, 250.0, 1000.0]) == pytest.approx([10.0, 9.75, 9.0])
    assert exposed_length([(0.0, 1.0), (0.5, 2.0)], None) == pytest.approx(2.0)
    assert exposed_length([(0.0, 1.0), (0.5, 2.0)], 1.5) == pytest.approx(0.5)
    assert exposed_length([(0.0, 1.0)], 1.5) == 0.0


def test_cpu_tensors_are_timed_on_the_host_clock(group_of_one):
    timer = CommTimer()
    assert timer.timing == HOST_CLOCK  # nothing timed yet
    x = torch.ones(8)
    comm.all_reduce(x, timer=timer)
    comm.timed_all_reduce_mean(x, timer=timer).wait()
    got = timer.collect()
    assert timer.timing == HOST_CLOCK_REAL == "host clock (gloo: completion is real)"
    assert got["comm_calls"] == 2 and all(isinstance(s, float) and not hasattr(s, "event")
                                          for interval in got["comm_intervals"] for s in interval)
    assert cuda_event_source(x) is None and cuda_event_source(None) is None
    bytes_only = CommTimer()
    bytes_only.completed(bytes_only.launched(100))  # no tensor: a caller counting bytes
    assert bytes_only.timing == HOST_CLOCK


def test_cuda_collective_is_timed_where_it_ran_not_where_it_was_queued():
    """The issue's bug: NCCL completes the future when the all-reduce is queued (host 1.001 s), but the
    GPU runs it from 1.050 to 1.080 s, behind the compute queued before it."""
    timer, device, host = fake_timer()
    host[0], device.gpu_now = 0.999, 1.049
    timer.grad_ready()  # no device seen yet: the host stamp only
    host[0], device.gpu_now = 1.0, 1.050
    start = timer.launched(64 << 20, FakeTensor())
    assert float(start) == 1.0 and start.event.fires_at == FakeDevice.ORIGIN + 1.050
    host[0], device.gpu_now = 1.001, 1.080
    timer.completed(start)  # in the future's callback, at enqueue: the end event fires when it ran
    host[0], device.gpu_now = 1.2, None
    got = timer.collect()
    assert got["comm_intervals"] == [pytest.approx((1.050, 1.080))]  # host-clock seconds, as the gloo ones
    assert got["comm_s"] == pytest.approx(0.030)
    assert got["comm_exposed_s"] == pytest.approx(0.030)  # compute (host stamp 0.999) ended before it began
    assert got["comm_bytes"] == 64 << 20 and got["comm_calls"] == 1
    assert timer.timing == f"{CUDA_EVENTS} ({UNVERIFIED})"
    assert device.waited == 2  # both events waited on once, at collect


def test_cuda_exposed_time_is_taken_against_compute_on_the_gpu():
    timer, device, host = fake_timer()
    host[0], device.gpu_now = 0.1, 0.5
    a = timer.launched(10, FakeTensor())  # bucket 1 runs on the GPU from 0.5 to 0.7 s...
    host[0], device.gpu_now = 0.11, 0.7
    timer.completed(a)
    for gpu in (0.6, 0.8, 0.9):  # the gradients become ready on the GPU; the host queued them long before
        host[0], device.gpu_now = 0.12, gpu
        timer.grad_ready()
    host[0], device.gpu_now = 0.13, 0.9
    b = timer.launched(10, FakeTensor())
    host[0], device.gpu_now = 0.14, 1.2
    timer.completed(b)  # ...bucket 2 from 0.9 to 1.2 s, after the last gradient: exposed
    host[0], device.gpu_now = 1.3, None
    got = timer.collect()
    assert got["comm_s"] == pytest.approx(0.5) and got["comm_exposed_s"] == pytest.approx(0.3)
    c = timer.launched(10, FakeTensor())  # no hooks (naive DDP): compute ends when backward returns
    device.gpu_now = 1.5
    timer.backward_done()
    device.gpu_now = 1.9
    timer.completed(c)
    assert timer.collect()["comm_exposed_s"] == pytest.approx(0.4)
    events = device.created
    for _ in range(3):  # events are pooled: a steady step creates none
        device.gpu_now = 2.0
        timer.grad_ready()
        timer.completed(timer.launched(1, FakeTensor()))
        timer.collect()
    assert device.created == events


def test_a_cuda_collective_still_in_flight_completes_into_the_next_step():
    timer, device, host = fake_timer()
    device.gpu_now = 3.0
    start = timer.launched(10, FakeTensor())
    assert timer.collect()["comm_calls"] == 1 and timer.collect()["comm_intervals"] == []
    device.gpu_now = 3.5
    timer.completed(start)
    assert timer.collect()["comm_intervals"] == [pytest.approx((3.0, 3.5))]


def test_no_events_under_graph_capture_is_unverified_not_a_wrong_number_passed_off():
    timer, device, host = fake_timer()
    device.capturing = True
    host[0] = 1.0
    start = timer.launched(10, FakeTensor())
    host[0] = 1.25
    timer.completed(start)
    assert timer.collect()["comm_s"] == pytest.approx(0.25)  # the host clock, and said to be
    assert timer.timing == UNVERIFIED


def test_verified_cuda_events_say_so(monkeypatch):
    timer, device, host = fake_timer()
    timer.completed(timer.launched(1, FakeTensor()))
    monkeypatch.setattr(timers, "CUDA_EVENTS_VERIFIED", True)
    assert timer.timing == CUDA_EVENTS


def test_real_cuda_events_when_a_gpu_is_here():
    """On a machine with a GPU the real event source runs the same path (CPU machines: the fake above)."""
    if not torch.cuda.is_available():
        assert cuda_event_source(torch.ones(1)) is None
        return
    x = torch.ones(1 << 20, device="cuda")
    timer = CommTimer()
    start = timer.launched(0, x)
    torch.cuda._sleep(10_000_000)
    timer.completed(start)
    got = timer.collect()
    assert got["comm_s"] > 0 and timer.timing.startswith(CUDA_EVENTS)


def test_a_wait_for_an_earlier_steps_collective_is_exposed_in_the_step_that_waited():
    """ZeRO's parameter all-gather runs from one step's optimizer into the next step's forward: whatever the forward
    stood waiting for it (``waited``) is exposed, although its interval ends before the step's compute does."""
    host = [0.0]
    timer = CommTimer(clock=lambda: host[0])
    start = timer.launched(100)  # launched after the optimizer of step k
    assert timer.collect()["comm_exposed_s"] == 0.0  # still in flight: nothing of step k
    host[0] = 2.0
    timer.completed(start)  # done in step k + 1's forward, which waited for 0.5 s of it
    timer.waited(0.5)
    host[0] = 5.0
    timer.grad_ready()  # step k + 1's compute ends later
    got = timer.collect()
    assert got["comm_exposed_s"] == pytest.approx(0.5) and got["comm_s"] == pytest.approx(2.0)
    assert timer.collect()["comm_exposed_s"] == 0.0  # the wait is counted once
