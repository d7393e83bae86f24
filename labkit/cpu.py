"""This CPU: what it is (model, ISA flags, the kernel level torch and oneDNN run at), the load it is under, and how
fast it multiplies, timed as a best case.

``labkit.hardware`` turns these into the peak behind MFU and the choices that suit the machine; this module only
identifies and times. A timed matmul is a best case when it is warm (:func:`timed_calls` runs untimed matmuls first),
writes into one output tensor (no allocation timed), runs at the thread count the worker will use, and is short enough
that some of the timed ones finish between two preemptions on a shared machine (:func:`pick_size`).
"""
from __future__ import annotations

import json
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional


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
    root = (os.environ.get("LABKIT_CACHE_DIR")
            or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "labkit")
    return Path(root)


def cpu_flags() -> set[str]:
    return set((cpuinfo_field("flags") or "").split())


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")  # what changes kernels' rounding
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # the instructions that multiply bf16 without converting it to fp32
KERNEL_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # settings that lower the kernels


def kernel_limits() -> dict[str, str]:
    """The environment settings in force that keep torch (ATen) or oneDNN from the CPU's best instructions."""
    return {name: os.environ[name] for name in KERNEL_LIMITS if os.environ.get(name)}


def cpu_fingerprint() -> dict:
    """Which CPU this is, as far as floating-point results go: model, ISA flags, torch's kernel level.

    torch picks its vectorised kernels by ``torch.backends.cpu.get_cpu_capability()`` (``ATEN_CPU_CAPABILITY``
    lowers it), so two machines agree to the last bit only where these agree. oneDNN, which runs bf16 matmuls,
    has its own limit (``ONEDNN_MAX_CPU_ISA``): recorded only when set.
    """
    import torch

    flags = cpu_flags()
    onednn = {k: v for k, v in kernel_limits().items() if k != "ATEN_CPU_CAPABILITY"}
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "isa": [f for f in ISA_FLAGS if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            **({"onednn_limit": onednn} if onednn else {})}


# ---------------------------------------------------------------- how much of it this process may use

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> Optional[float]:
    """The CPUs' worth of time this process's control group may use (a container's ``--cpus``, a JupyterHub
    spawner's ``cpu_limit``), or None when nothing limits it. A 64-core hub giving a user 2 CPUs leaves every core
    in the affinity mask; only the quota says 2.

    cgroup v2: ``cpu.max`` holds "QUOTA PERIOD" ("max PERIOD": no limit); cgroup v1: ``cpu.cfs_quota_us`` (−1: no
    limit) over ``cpu.cfs_period_us``. Every group from this process's up to the root counts (a parent's quota
    binds its children), and the tightest wins. Paths come from ``proc_cgroup``; in a container whose cgroup
    namespace shows "/", the mounted root is its own group."""
    limits = [limit for directory in _cgroup_dirs(root, proc_cgroup) for limit in [_quota(directory)] if limit]
    return min(limits) if limits else None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """The cgroup directories holding this process's CPU quota, its own and every ancestor's, as mounted under
    ``root``: the unified (v2) hierarchy's, and the v1 ``cpu`` controller's."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: "0::/user.slice/…"
            mounts = [root]
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/docker/…"
            mounts = [root / controllers, root / "cpu", root / "cpu,cpuacct"]
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        for mount in mounts:
            dirs += [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return list(dict.fromkeys(dirs))


def _quota(directory: Path) -> Optional[float]:
    """CPUs' worth of quota set in one cgroup directory, or None (no file there, or no limit)."""
    try:
        if (directory / "cpu.max").exists():
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if (directory / "cpu.cfs_quota_us").exists():
            quota = int((directory / "cpu.cfs_quota_us").read_text())
            period = int((directory / "cpu.cfs_period_us").read_text())
            return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None
    return None


def usable_cores(affinity: Optional[int] = None, limit: Optional[float] = None) -> int:
    """The cores this process may keep busy: the CPUs it may run on (its affinity), cut to the control group's
    quota, rounded down (a thread past the quota waits for the next period), at least 1."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if limit is None:
        limit = cgroup_cpu_limit()
    return max(1, min(affinity, int(limit))) if limit is not None else max(1, affinity)


def current_load() -> dict:
    """The 1-minute load average (runnable processes) beside the CPU count it should be read against."""
    try:
        load = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # no load average on this platform
        load = None
    return {"load_1min": load, "cpus": os.cpu_count()}


PROC = Path("/proc")


def process_cpu_seconds(pid: int, proc: Path = PROC) -> Optional[float]:
    """User plus system CPU seconds process ``pid`` (all its threads) has used, as the kernel counts them
    (``/proc/PID/stat``, fields 14 and 15, in clock ticks); None once it is gone or where there is no /proc."""
    try:
        fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(root: int, proc: Path = PROC) -> dict[int, str]:
    """``root`` and every process below it, each with its command line (arguments joined by spaces)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            tree[pid] = (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        todo.extend(children.get(pid, []))
    return tree


def busy(load: dict) -> bool:
    """More runnable processes than CPUs: a matmul measured now shares its cores and reads low."""
    return load.get("load_1min") is not None and load["load_1min"] > (load.get("cpus") or 1)


def read_cache(path: Path) -> dict:
    """A cache file of measurements (empty when there is none, or it cannot be read)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@contextmanager
def measuring_alone(path: Path):
    """Hold ``path``'s lock while measuring: the ranks of a run start together, and the second must read what the
    first measured, or they could decide differently. (No lock where ``fcntl`` is missing: Windows.)"""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


# ---------------------------------------------------------------- timing matmuls: a best case

MATMUL_REPEATS = 20  # timed matmuls in a measurement; the peak is the fastest of them
MIN_MATMUL_S = 0.002  # the size doubles until one matmul takes this long: the arithmetic, not the call's overhead,
MAX_MATMUL_SIZE = 4096  # is what is timed (never beyond this size), yet short enough that on a shared machine
# some of the timed matmuls run between two preemptions: a 20 ms matmul on a core shared with other work is
# nearly always interrupted, and its best of 5 read half the peak (measured: 1024² best of 5 against 512² best of 20)
WARMUP_S = 0.2  # untimed matmuls at the measured size for this long first: an idle core's clock takes time to rise


def timed_calls(work, repeats: int, warmup_s: float = WARMUP_S, clock=time.perf_counter) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``work()``, timed only after untimed calls have run for ``warmup_s``.

    The first call allocates and picks kernels; the calls after it keep the core busy until its clock has
    risen and its caches hold the operands, so what is timed is the best case, not the start-up.
    """
    start = clock()
    work()
    while clock() - start < warmup_s:
        work()
    seconds = []
    for _ in range(repeats):
        begin = clock()
        work()
        seconds.append(clock() - begin)
    return seconds


def matmul_samples(dtype: str = "fp32", threads: int = 1, repeats: int = MATMUL_REPEATS,
                   size: Optional[int] = None, warmup_s: float = WARMUP_S) -> dict:
    """TFLOP/s of ``repeats`` timed (size × size) @ (size × size) matmuls at ``threads`` threads.

    ``size`` None picks one (:func:`pick_size`). At that size, matmuls run untimed for ``warmup_s`` first
    (:func:`timed_calls`), and each writes into the same output tensor, so no allocation is timed.
    Returns ``{"size": n, "samples": [TFLOP/s, ...]}``.
    """
    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)

    def matmul(n: int):
        a, b, out = (torch.randn(n, n, dtype=torch_dtype) for _ in range(3))
        return lambda: torch.matmul(a, b, out=out)

    try:
        n = size or pick_size(lambda n: min(timed_calls(matmul(n), 1, warmup_s=0)))
        seconds = timed_calls(matmul(n), repeats, warmup_s)
        return {"size": n, "samples": [2 * n**3 / s / 1e12 for s in seconds]}
    finally:
        torch.set_num_threads(previous)


def pick_size(seconds_at) -> int:
    """The matmul size to time: from 256, doubling until one (n × n) matmul takes ``MIN_MATMUL_S``
    (``seconds_at(n)``: one matmul's seconds, after a first call), never beyond ``MAX_MATMUL_SIZE``."""
    n = 256
    while n < MAX_MATMUL_SIZE and seconds_at(n) < MIN_MATMUL_S:
        n *= 2
    return n


def rate_text(tflops: float) -> str:
    """A FLOP rate in the unit that keeps it readable: a laptop core does GFLOP/s, a GPU TFLOP/s."""
    return f"{tflops:.3g} TFLOP/s" if tflops >= 1 else f"{1e3 * tflops:.1f} GFLOP/s"
