from labkit.comm.collectives import timed_allreduce_hook

__all__ = ["timed_allreduce_hook"]
