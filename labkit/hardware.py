"""What the hardware can do: the peak behind MFU, and the settings that suit this machine — measured.

MFU (model FLOPs utilization) = achieved model FLOP/s ÷ the device's peak FLOP/s. The peak
must be a real number for *this* device and *this* precision, or MFU is meaningless:

* GPUs: dense (not 2:4-sparse) tensor-core figures from the vendors' datasheets, per device
  (``labkit.gpu_peaks``).
* CPUs: no datasheet number fits every laptop, so labkit measures one — the best FLOP/s of a
  large matmul with the threads a worker will use, best of several after a warm-up — and caches
  it with the load and the machine it was measured on. A busy machine makes the number low (and
  every MFU high), so the cache is measured again when it proves low (:func:`remeasure_reason`).
* Anything else (an unknown GPU, a precision the device lacks): ``None``, shown as "n/a".
  A missing number is honest; a made-up one misleads every conclusion drawn from it.

Whether bf16 pays on a CPU is measured the same way (:func:`bf16_speed`: bf16 against fp32 matmuls, in
turns), not read from its flags: :func:`recommend` and the labs go by the measurement, and the flags explain it.

This module knows the machine and nothing of runs: the run store (``labkit.metrics.store``), the
config and the trainer import it, never the other way round.
"""
from __future__ import annotations

import time
from typing import Optional

from labkit.cpu import (MATMUL_REPEATS, NATIVE_BF16, busy, cache_dir, cpu_fingerprint, cpu_flags, cpu_model,  # noqa: F401
                        cpuinfo_field, current_load, kernel_limits, matmul_samples, measuring_alone, rate_text,
                        read_cache)
from labkit.files import write_json
from labkit.gpu_peaks import PEAK_TFLOPS, gpu_peak_tflops, match_gpu  # noqa: F401 (PEAK_TFLOPS: the table, read here)


# ---------------------------------------------------------------- the CPU peak: a best case, measured

QUICK_REPEATS = 5  # timed matmuls in the check a cached peak must pass at every run start
PLAUSIBLE_MARGIN = 1.10  # a quick check this much faster than the cached peak proves the cache low
PEAK_METHOD = 2  # how the peak is measured (2: warm-up, ~2 ms matmuls, best of 20); a cache measured otherwise
#                  is redone


def measure_matmul_tflops(dtype: str = "fp32", threads: int = 1, repeats: int = MATMUL_REPEATS,
                          size: Optional[int] = None) -> float:
    """The best TFLOP/s of a matmul on this CPU: the fastest of ``repeats`` (see :func:`matmul_samples`)."""
    return max(matmul_samples(dtype, threads, repeats, size)["samples"])


def measure_cpu_peak(dtype: str, threads: int, measure=matmul_samples, reason: str = "") -> dict:
    """One full measurement as the cache records it: the peak, its samples, and what it was measured under."""
    load = current_load()
    got = measure(dtype=dtype, threads=threads, repeats=MATMUL_REPEATS)
    return {"tflops": max(got["samples"]), "samples": got["samples"], "size": got["size"], "dtype": dtype,
            "threads": threads, **load, "machine": cpu_fingerprint(), "measured_at": time.time(),
            "measured_on": time.strftime("%Y-%m-%d %H:%M"), "reason": reason, "method": PEAK_METHOD}


def remeasure_reason(record: Optional[dict], quick_check) -> Optional[str]:
    """Why a cached CPU peak must be measured again, or None when it stands. In this order:

    1. there is none, or one measured by an older procedure (:data:`PEAK_METHOD`: the old one timed 20 ms
       matmuls, best of 5, which a shared machine interrupts);
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
    if record.get("method") != PEAK_METHOD:
        return "measured by an older procedure (long matmuls, best of 5: low on a shared machine)"
    if record["machine"] != cpu_fingerprint():
        return "measured on a different machine (CPU, cores, ISA flags or torch)"
    if busy(record) and not busy(current_load()):
        return f"measured at load {record['load_1min']} on {record['cpus']} CPUs; the machine is quieter now"
    fresh = quick_check(record["size"])
    if fresh > PLAUSIBLE_MARGIN * record["tflops"]:
        return f"a quick check measured {rate_text(fresh)}, above the cached {rate_text(record['tflops'])}"
    return None


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
    cache = read_cache(path)
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

def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def detect() -> dict:
    """What this machine offers for training: device kind and count, precisions, kernels.

    On a CPU, ``bf16`` is what its flags claim (``bf16_flags``: the native-bf16 instructions it lists); whether bf16
    is *fast* here is measured by :func:`bf16_speed`, and that is what :func:`recommend` goes by."""
    import torch

    if torch.cuda.is_available():
        from labkit.precision import fp8_capable

        name = torch.cuda.get_device_name()
        return {"device": "cuda", "count": torch.cuda.device_count(), "name": name,
                "bf16": torch.cuda.is_bf16_supported(), "fp16": True,
                "fp8": fp8_capable(torch.cuda.get_device_capability()),  # sm_89+: Ada, Hopper, Blackwell
                "flash_attn": installed("flash_attn"), "triton": installed("triton")}
    native = [f for f in NATIVE_BF16 if f in cpu_flags()]
    return {"device": "cpu", "count": 1, "name": cpu_model(), "bf16": bool(native), "bf16_flags": native,
            "fp16": False, "fp8": False, "flash_attn": False, "triton": installed("triton")}


# ---------------------------------------------------------------- bf16 or fp32 on a CPU: measured

PROBE_SIZE = 256  # the probe's matmuls are a small model's (n_embd 256): the speed a lab's run will see
PROBE_ROUNDS = 3  # fp32 and bf16 take turns (fp32 bf16, bf16 fp32, ...): a busy moment slows both alike
BF16_WORTH_IT = 1.15  # bf16 matmuls must be this much faster than fp32's to pay for autocast's casts
SETTLED_S = 60  # a measurement this old may be redone: never between the ranks of one run, which start together


def bf16_samples(threads: int, size: int = PROBE_SIZE, rounds: int = PROBE_ROUNDS, measure=matmul_samples) -> dict:
    """The best TFLOP/s of fp32 and of bf16 (size × size) matmuls at ``threads`` threads, measured in turns."""
    best = {"fp32": 0.0, "bf16": 0.0}
    for i in range(rounds):
        for dtype in ("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32"):
            samples = measure(dtype=dtype, threads=threads, repeats=QUICK_REPEATS, size=size)["samples"]
            best[dtype] = max(best[dtype], *samples)
    return {**best, "size": size, "threads": threads}


def bf16_speed(threads: Optional[int] = None, measure=bf16_samples) -> dict:
    """How fast this CPU multiplies bf16 against fp32, at ``threads`` threads (None: this process's count), as a
    run's worker would: ``{"fp32", "bf16"}`` (TFLOP/s), ``speedup`` (bf16 ÷ fp32), ``size``, ``threads`` and what it
    was measured under. Measured once per machine (:func:`cpu_fingerprint`), again if it was measured while the
    machine was busy and it is quiet now, and cached in ``cache_dir()/bf16_speed.json``; ``measure(threads)`` is
    :func:`bf16_samples` (tests pass their own)."""
    import torch

    threads = threads or torch.get_num_threads()
    path, key = cache_dir() / "bf16_speed.json", f"threads={threads}|size={PROBE_SIZE}"
    with measuring_alone(path):
        cache = read_cache(path)
        record = cache.get(key)
        if (not record or record.get("machine") != cpu_fingerprint()
                or busy(record) and not busy(current_load()) and time.time() - record["measured_at"] > SETTLED_S):
            got = measure(threads)
            record = cache[key] = {**got, "speedup": got["bf16"] / got["fp32"], **current_load(),
                                   "machine": cpu_fingerprint(), "measured_at": time.time(),
                                   "measured_on": time.strftime("%Y-%m-%d %H:%M")}
            write_json(path, cache, indent=1)
    return record


def bf16_choice(speed: dict, native: list[str]) -> tuple[str, str]:
    """("bf16" or "fp32", why) from a :func:`bf16_speed` measurement; the CPU's ``native`` bf16 flags explain it."""
    r, n = speed["speedup"], speed["size"]
    measured = (f"bf16 matmuls measured ×{r:#.2g} fp32's rate here ({rate_text(speed['bf16'])} against "
                f"{rate_text(speed['fp32'])}, {n}×{n}, {speed['threads']} "
                f"thread{'s' if speed['threads'] != 1 else ''})")
    if r >= BF16_WORTH_IT:
        return "bf16", (f"{measured}: the CPU multiplies bf16 natively "
                        f"({', '.join(native) or 'in its matmul kernels'}), "
                        "with fp32's range (no loss scaling)")
    limits = [f"{k}={v}" for k, v in kernel_limits().items()]
    if native:
        why = f"the CPU lists {', '.join(native)}, but the kernels torch runs here do not use it" + \
              (f" ({', '.join(limits)} {'is' if len(limits) == 1 else 'are'} set)" if limits else "")
    else:
        why = "the CPU has no native bf16 (no avx512_bf16, no amx_bf16): each bf16 number is converted to fp32 and back"
    return "fp32", f"{measured}: {why}; fp32 is {'as fast' if r >= 1 / BF16_WORTH_IT else 'faster'}"


def recommend(info: dict | None = None, speed: dict | None = None) -> dict[str, tuple[str, str]]:
    """Backend, precision, attention and compile choices for this machine, each with its reason.

    On a CPU the precision is decided by measurement (``speed``: :func:`bf16_speed`, measured and cached when None),
    the flags only explain it: a CPU can list avx512_bf16 and still run bf16 slowly (its kernels limited), or run it
    fast without the flag. On a GPU it follows the datasheet: bf16 tensor cores where the GPU has them.
    """
    info = info or detect()
    gpu = info["device"] == "cuda"
    backend = ("nccl", "NVIDIA GPUs: NCCL runs collectives on the GPUs over NVLink/InfiniBand") if gpu else \
        ("gloo", "CPU processes: gloo is torch's CPU collective backend")
    if not gpu:
        precision = bf16_choice(speed or bf16_speed(), info.get("bf16_flags", []))
    elif info["bf16"]:
        precision = ("bf16", f"{info['name']} has bf16 tensor cores: about half the time and memory of fp32, "
                             "with fp32's range (no loss scaling)")
    elif info["fp16"]:
        precision = ("fp16", "no bf16 on this GPU: fp16 tensor cores with a gradient scaler")
    else:
        precision = ("fp32", "this GPU has no bf16 or fp16 tensor cores: fp32")
    if gpu and info["flash_attn"]:
        attention = ("flash_attn", "the flash-attn package is installed: the fastest exact attention on NVIDIA GPUs")
    else:
        attention = ("sdpa", "torch's fused scaled_dot_product_attention: a flash-style kernel where the "
                             "device has one" + ("" if gpu else " (this CPU's included)"))
    compile_choice = ("verify", "compilation helps on some hardware and hurts on other: measure both, keep the faster")
    return {"backend": backend, "precision": precision, "attention": attention, "compile": compile_choice}
