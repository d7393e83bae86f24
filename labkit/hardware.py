"""What the hardware can do: a peak-FLOPs table for GPUs and a measured peak for CPUs.

MFU (model FLOPs utilization) = achieved model FLOP/s ÷ the device's peak FLOP/s. The peak
must be a real number for *this* device and *this* precision, or MFU is meaningless:

* GPUs: dense (not 2:4-sparse) tensor-core figures from the vendors' datasheets, per device.
* CPUs: no datasheet number fits every laptop, so labkit measures one — the best FLOP/s of a
  large matmul with the threads a worker will use — once, and caches it.
* Anything else (an unknown GPU, a precision the device lacks): ``None``, shown as "n/a".
  A missing number is honest; a made-up one misleads every conclusion drawn from it.

This module knows the machine and nothing of runs: the run store (``labkit.metrics.store``), the
config and the trainer import it, never the other way round.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Optional

from labkit.files import write_json

# TFLOP/s per device, dense. Sources: NVIDIA/AMD datasheets (SXM parts unless named). fp8: the
# datasheets' sparse figure halved, only where it is certain; elsewhere absent (MFU n/a).
PEAK_TFLOPS: dict[str, dict[str, Optional[float]]] = {
    "B200": {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0},
    "H200": {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"fp8": 733.0, "bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "L4": {"fp8": 242.5, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "V100": {"bf16": None, "fp16": 125.0, "tf32": None, "fp32": 15.7},
    "T4": {"bf16": None, "fp16": 65.0, "tf32": None, "fp32": 8.1},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
}


def match_gpu(device_name: str) -> Optional[str]:
    """Map a CUDA device name ("NVIDIA H100 80GB HBM3") to a table row, most specific first."""
    name = device_name.upper()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.upper() in name:
            return key
    return None


def gpu_peak_tflops(device_name: str, dtype: str) -> Optional[float]:
    key = match_gpu(device_name)
    return PEAK_TFLOPS[key].get(dtype) if key else None


def cpuinfo_field(name: str) -> Optional[str]:
    """The first ``name`` line of /proc/cpuinfo (Linux), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cache_dir() -> Path:
    root = os.environ.get("LABKIT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "labkit"
    return Path(root)


def measure_matmul_tflops(dtype: str = "fp32", threads: int = 1, size: int = 1024, seconds: float = 0.6) -> float:
    """Best TFLOP/s of repeated (size × size) @ (size × size) matmuls on the CPU."""
    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, dtype=torch_dtype)
        b = torch.randn(size, size, dtype=torch_dtype)
        a @ b  # warm-up
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * size**3 / (time.perf_counter() - start))
        return best / 1e12
    finally:
        torch.set_num_threads(previous)


def cpu_peak_tflops(dtype: str, threads: int, measure=measure_matmul_tflops) -> dict:
    """The CPU peak for ``threads`` threads, measured once per CPU model/torch/dtype and cached."""
    import torch

    key = f"{cpu_model()}|torch {torch.__version__}|{dtype}|threads={threads}"
    path = cache_dir() / "cpu_peak.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = {"tflops": measure(dtype=dtype, threads=threads), "measured_at": time.time()}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, cache, indent=1)
    threads_text = f"{threads} thread" + ("s" if threads > 1 else "")
    return {"tflops": cache[key]["tflops"], "cache": str(path),
            "source": f"measured {dtype} matmul peak of this CPU ({cpu_model()}, {threads_text})"}


def device_peak(device: str, dtype: str, threads: int = 1, override: Optional[float] = None) -> dict:
    """``{"tflops": float | None, "source": str}`` for one device of a run."""
    if override:
        return {"tflops": float(override), "source": "metrics.peak_tflops (set by the user)"}
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name()
        peak = gpu_peak_tflops(name, dtype)
        source = f"datasheet, {match_gpu(name)}" if peak else f"n/a: no {dtype} peak known for {name!r}"
        return {"tflops": peak, "source": source}
    return cpu_peak_tflops(dtype, threads)


# ---------------------------------------------------------------- hardware-aware defaults

def cpu_flags() -> set[str]:
    return set((cpuinfo_field("flags") or "").split())


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")  # what changes kernels' rounding


def cpu_fingerprint() -> dict:
    """Which CPU this is, as far as floating-point results go: model, ISA flags, torch's kernel level.

    torch picks its vectorised kernels by ``torch.backends.cpu.get_cpu_capability()`` (``ATEN_CPU_CAPABILITY``
    lowers it), so two machines agree to the last bit only where these agree.
    """
    import torch

    flags = cpu_flags()
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "isa": [f for f in ISA_FLAGS if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def detect() -> dict:
    """What this machine offers for training: device kind and count, precisions, kernels."""
    import torch

    if torch.cuda.is_available():
        from labkit.precision import fp8_capable

        name = torch.cuda.get_device_name()
        return {"device": "cuda", "count": torch.cuda.device_count(), "name": name,
                "bf16": torch.cuda.is_bf16_supported(), "fp16": True,
                "fp8": fp8_capable(torch.cuda.get_device_capability()),  # sm_89+: Ada, Hopper, Blackwell
                "flash_attn": installed("flash_attn"), "triton": installed("triton")}
    flags = cpu_flags()
    return {"device": "cpu", "count": 1, "name": cpu_model(), "bf16": bool({"avx512_bf16", "amx_bf16"} & flags),
            "fp16": False, "fp8": False, "flash_attn": False, "triton": installed("triton")}


def recommend(info: dict | None = None) -> dict[str, tuple[str, str]]:
    """Backend, precision, attention and compile choices for this machine, each with its reason."""
    info = info or detect()
    gpu = info["device"] == "cuda"
    backend = ("nccl", "NVIDIA GPUs: NCCL runs collectives on the GPUs over NVLink/InfiniBand") if gpu else \
        ("gloo", "CPU processes: gloo is torch's CPU collective backend")
    if info["bf16"]:
        precision = ("bf16", f"{info['name']} computes bf16 natively: about half the time and memory of fp32, "
                             "with fp32's range (no loss scaling)")
    elif gpu and info["fp16"]:
        precision = ("fp16", "no bf16 on this GPU: fp16 tensor cores with a gradient scaler")
    else:
        precision = ("fp32", "this CPU has no native bf16 or fp16 arithmetic: fp32 is fastest")
    if gpu and info["flash_attn"]:
        attention = ("flash_attn", "the flash-attn package is installed: the fastest exact attention on NVIDIA GPUs")
    else:
        attention = ("sdpa", "torch's fused scaled_dot_product_attention: a flash-style kernel where the "
                             "device has one" + ("" if gpu else " (this CPU's included)"))
    compile_choice = ("verify", "compilation helps on some hardware and hurts on other: measure both, keep the faster")
    return {"backend": backend, "precision": precision, "attention": attention, "compile": compile_choice}
