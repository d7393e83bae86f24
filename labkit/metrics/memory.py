"""Peak memory of this worker: allocated GPU memory, or the process's peak RSS on CPU."""
from __future__ import annotations

import resource
import sys


def peak_memory_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
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
