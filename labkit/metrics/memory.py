"""Memory this worker measured: its peak (allocated GPU memory, or peak RSS on CPU), its capacity, and the
bytes autograd saves for backward (the activations)."""
from __future__ import annotations

import resource
import sys

import torch


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

