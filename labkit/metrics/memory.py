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
