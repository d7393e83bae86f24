from labkit.metrics.events import EventWriter, read_events
from labkit.metrics.mfu import achieved_tflops, mfu
from labkit.metrics.timers import CommTimer, StepClock

__all__ = ["EventWriter", "read_events", "achieved_tflops", "mfu", "CommTimer", "StepClock"]
