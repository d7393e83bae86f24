"""The communication layer: the one place labkit launches gradient collectives.

Going through one place is what makes communication *measurable*: every all-reduce here is
counted (bytes, calls) and timed from launch to completion by a :class:`~labkit.metrics.CommTimer`.
Later layers (compression, a network emulator, partitions) wrap these same functions.
"""

import torch
import torch.distributed as dist

from labkit.metrics.timers import CommTimer


def timed_all_reduce_mean(tensor: torch.Tensor, timer: CommTimer, group=None) -> torch.futures.Future[torch.Tensor]:
    """Asynchronously all-reduce ``tensor`` in place and divide by the world size.

    Returns a future whose value is the averaged tensor; the timer records the launch now and
    the completion when the collective finishes (on the backend's thread).
    """
    world = dist.get_world_size(group)
    start = timer.launched(tensor.numel() * tensor.element_size())
    future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        timer.completed(start)
        return fut.value()[0].div_(world)

    return future.then(finish)


def timed_allreduce_hook(timer: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: torch's plain averaging all-reduce, timed and counted."""
    return timed_all_reduce_mean(bucket.buffer(), timer)
