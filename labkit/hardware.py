"""What the hardware can do: a peak-FLOPs table for GPUs and a measured peak for CPUs.

MFU (model FLOPs utilization) = achieved model FLOP/s ÷ the device's peak FLOP/s. The peak
must be a real number for *this* device and *this* precision, or MFU is meaningless:

* GPUs: dense (not 2:4-sparse) tensor-core figures from the vendors' datasheets, per device.
* CPUs: no datasheet number fits every laptop, so labkit measures one — the best FLOP/s of a
  large matmul with the threads a worker will use, best of several after a warm-up — and caches
  it with the load and the machine it was measured on. A busy machine makes the number low (and
  every MFU high), so the cache is measured again when it proves low (:func:`remeasure_reason`).
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

# TFLOP/s per device, dense (not 2:4-sparse), from the vendors' datasheets. Where a datasheet gives only
# the sparse figure (marked "*"), the dense one is half of it. A precision the datasheet does not give, or
# the device lacks, is absent or None: MFU is then "n/a".
H100_SXM = {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}  # H100 SXM5 and H200 SXM
H100_PCIE = {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}
HOPPER_NVL = {"fp8": 1670.5, "bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}  # H100 NVL, H200 NVL
A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}  # SXM4 and PCIe, 40 and 80 GB alike
V100_SXM2 = {"bf16": None, "fp16": 125.0, "tf32": None, "fp32": 15.7}  # Volta: no bf16, no tf32
V100_PCIE = {"bf16": None, "fp16": 112.0, "tf32": None, "fp32": 14.0}

# Keyed by the exact name torch.cuda.get_device_name() reports. A new SKU gets its own row, never a
# neighbour's: "L40" is not an "L4", an "A10G" is not an "A10", an "H100 NVL" is not an SXM part.
PEAK_TFLOPS: dict[str, dict[str, Optional[float]]] = {
    "NVIDIA B200": {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},  # HGX B200
    "NVIDIA H200": H100_SXM,  # H200 SXM: H100's compute, more memory
    "NVIDIA H200 NVL": HOPPER_NVL,
    "NVIDIA H100 80GB HBM3": H100_SXM,  # H100 SXM5
    "NVIDIA H100 PCIe": H100_PCIE,
    "NVIDIA H100 NVL": HOPPER_NVL,  # per GPU of the NVLink-bridged pair
    "NVIDIA A100-SXM4-40GB": A100,
    "NVIDIA A100-SXM4-80GB": A100,
    "NVIDIA A100-PCIE-40GB": A100,
    "NVIDIA A100 80GB PCIe": A100,
    "NVIDIA L40S": {"fp8": 733.0, "bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "NVIDIA L40": {"fp8": 362.0, "bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "NVIDIA L4": {"fp8": 242.5, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "NVIDIA A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "NVIDIA A10G": {},  # AWS's variant of the A10, with its own clocks: NVIDIA publishes no figures for it
    "NVIDIA GeForce RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},  # fp32 accumulate
    "NVIDIA GeForce RTX 4090 D": {},  # the cut-down 4090 sold in China: no published tensor figures
    "Tesla V100-SXM2-16GB": V100_SXM2,
    "Tesla V100-SXM2-32GB": V100_SXM2,
    "Tesla V100-PCIE-16GB": V100_PCIE,
    "Tesla V100-PCIE-32GB": V100_PCIE,
    "Tesla T4": {"bf16": None, "fp16": 65.0, "tf32": None, "fp32": 8.1},
    "AMD Instinct MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
}


def normalise_gpu_name(name: str) -> str:
    """Compare names as written, forgiving only case, spacing and a leading "NVIDIA "."""
    return " ".join(name.split()).casefold().removeprefix("nvidia ")


def match_gpu(device_name: str) -> Optional[str]:
    """The table row for exactly this device ("NVIDIA H100 80GB HBM3"), or None for a device not listed.

    No substring matching: "NVIDIA L40" contains "L4", "NVIDIA A10G" contains "A10", and each is a
    different chip. An unknown name gets no peak rather than a neighbour's.
    """
    wanted = normalise_gpu_name(device_name)
    return next((key for key in PEAK_TFLOPS if normalise_gpu_name(key) == wanted), None)


def gpu_peak_tflops(device_name: str, dtype: str) -> Optional[float]:
    """The datasheet's dense peak of this device at this precision, or None where none is known."""
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
    """Where labkit keeps what it measured about this machine: $LABKIT_CACHE_DIR, else ~/.cache/labkit."""
    root = os.environ.get("LABKIT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "labkit"
    return Path(root)


# ---------------------------------------------------------------- the CPU peak: a best case, measured

MATMUL_REPEATS = 5  # timed matmuls in a measurement; the peak is the fastest of them
QUICK_REPEATS = 2  # timed matmuls in the check a cached peak must pass at every run start
MIN_MATMUL_S = 0.02  # the size grows until one matmul takes this long: large enough that the arithmetic,
MAX_MATMUL_SIZE = 4096  # not the call's overhead, is what is timed (and never beyond this size)
PLAUSIBLE_MARGIN = 1.10  # a quick check this much faster than the cached peak proves the cache low


def _matmul_seconds(a, b) -> float:
    start = time.perf_counter()
    a @ b
    return time.perf_counter() - start


def matmul_samples(dtype: str = "fp32", threads: int = 1, repeats: int = MATMUL_REPEATS,
                   size: Optional[int] = None) -> dict:
    """TFLOP/s of ``repeats`` timed (size × size) @ (size × size) matmuls at ``threads`` threads.

    ``size`` None picks one: from 512, doubling until one matmul takes ``MIN_MATMUL_S``. The first
    matmul at each size is a warm-up (it allocates, picks kernels and fills caches) and is not timed.
    Returns ``{"size": n, "samples": [TFLOP/s, ...]}``.
    """
    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = size or 512
        while True:
            a, b = torch.randn(n, n, dtype=torch_dtype), torch.randn(n, n, dtype=torch_dtype)
            a @ b  # warm-up
            if size or n >= MAX_MATMUL_SIZE or _matmul_seconds(a, b) >= MIN_MATMUL_S:
                break
            n *= 2
        return {"size": n, "samples": [2 * n**3 / _matmul_seconds(a, b) / 1e12 for _ in range(repeats)]}
    finally:
        torch.set_num_threads(previous)


def measure_matmul_tflops(dtype: str = "fp32", threads: int = 1, repeats: int = MATMUL_REPEATS,
                          size: Optional[int] = None) -> float:
    """The best TFLOP/s of a matmul on this CPU: the fastest of ``repeats`` (see :func:`matmul_samples`)."""
    return max(matmul_samples(dtype, threads, repeats, size)["samples"])


def current_load() -> dict:
    """The 1-minute load average (runnable processes) beside the CPU count it should be read against."""
    try:
        load = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # no load average on this platform
        load = None
    return {"load_1min": load, "cpus": os.cpu_count()}


def busy(load: dict) -> bool:
    """More runnable processes than CPUs: a matmul measured now shares its cores and reads low."""
    return load.get("load_1min") is not None and load["load_1min"] > (load.get("cpus") or 1)


def measure_cpu_peak(dtype: str, threads: int, measure=matmul_samples, reason: str = "") -> dict:
    """One full measurement as the cache records it: the peak, its samples, and what it was measured under."""
    load = current_load()
    got = measure(dtype=dtype, threads=threads, repeats=MATMUL_REPEATS)
    return {"tflops": max(got["samples"]), "samples": got["samples"], "size": got["size"], "dtype": dtype,
            "threads": threads, **load, "machine": cpu_fingerprint(), "measured_at": time.time(),
            "measured_on": time.strftime("%Y-%m-%d %H:%M"), "reason": reason}


def remeasure_reason(record: Optional[dict], quick_check) -> Optional[str]:
    """Why a cached CPU peak must be measured again, or None when it stands. In this order:

    1. there is none (or one from before labkit recorded how it was measured);
    2. it was measured on another machine: CPU model, core count, ISA flags, torch's kernel level or
       torch version differ (:func:`cpu_fingerprint`);
    3. it was measured while the machine was busy (load above the CPU count) and now it is not;
    4. it is implausibly low: ``quick_check(size)`` (the best of a few matmuls of the cached size, now)
       beats it by more than ``PLAUSIBLE_MARGIN``, so something else ran while it was measured.

    A peak is a best case, so a number can only be proven too low, never too high: a slower
    quick check (the machine busy now) keeps the cache.
    """
    if not record or "machine" not in record:
        return "no measurement (with its load and machine recorded) yet"
    if record["machine"] != cpu_fingerprint():
        return "measured on a different machine (CPU, cores, ISA flags or torch)"
    if busy(record) and not busy(current_load()):
        return f"measured at load {record['load_1min']} on {record['cpus']} CPUs; the machine is quieter now"
    fresh = quick_check(record["size"])
    if fresh > PLAUSIBLE_MARGIN * record["tflops"]:
        return f"a quick check measured {rate_text(fresh)}, above the cached {rate_text(record['tflops'])}"
    return None


def rate_text(tflops: float) -> str:
    """A FLOP rate in the unit that keeps it readable: a laptop core does GFLOP/s, a GPU TFLOP/s."""
    return f"{tflops:.3g} TFLOP/s" if tflops >= 1 else f"{1e3 * tflops:.1f} GFLOP/s"


def describe_cpu_peak(record: dict) -> str:
    """What the peak behind a CPU's MFU is, in words: it reads after "MFU 12% of"."""
    load = "an unknown load" if record["load_1min"] is None else f"load {record['load_1min']:.1f}"
    return (f"this process's {record['threads']}-thread {record['dtype']} matmul peak ({rate_text(record['tflops'])}: "
            f"best of {len(record['samples'])} {record['size']}×{record['size']} matmuls, measured at {load} "
            f"on {record['cpus']} CPUs, {record['measured_on']})")


def cpu_peak_tflops(dtype: str, threads: int, measure=matmul_samples) -> dict:
    """The CPU peak for ``threads`` threads at ``dtype``: cached, and measured again when
    :func:`remeasure_reason` finds the cached one stale or too low.

    ``measure(dtype=, threads=, repeats=, size=)`` returns ``{"size", "samples"}`` like :func:`matmul_samples`
    (tests pass their own). The cache, ``cache_dir()/cpu_peak.json``, keeps one record per precision and
    thread count, with the load and the machine it was measured on.
    """
    path = cache_dir() / "cpu_peak.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    key = f"{dtype}|threads={threads}"
    record = cache.get(key)

    def quick_check(size: int) -> float:
        return max(measure(dtype=dtype, threads=threads, repeats=QUICK_REPEATS, size=size)["samples"])

    reason = remeasure_reason(record, quick_check)
    if reason:
        record = cache[key] = measure_cpu_peak(dtype, threads, measure, reason)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, cache, indent=1)
    return {"tflops": record["tflops"], "source": describe_cpu_peak(record), "cache": str(path),
            "measurement": record}


def device_peak(device: str, dtype: str, threads: int = 1, override: Optional[float] = None) -> dict:
    """``{"tflops": float | None, "source": str, ...}`` for one device of a run.

    ``source`` says what the peak is, in words that read after "MFU 12% of": the run's start event and
    summary carry it as ``peak_source``, and the dashboard shows it beside the MFU panel.
    """
    if override:
        return {"tflops": float(override), "source": "metrics.peak_tflops (set by the user)"}
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name()
        peak = gpu_peak_tflops(name, dtype)
        source = (f"the dense {dtype} peak of the {match_gpu(name)} ({peak:g} TFLOP/s, vendor datasheet)" if peak
                  else f"n/a: no {dtype} peak known for {name!r}")
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
