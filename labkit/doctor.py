"""``labkit doctor``: is this laptop ready for the labs, and which of them run at full speed here?

A participant runs it at the start of a session. Each check looks at one thing — CPU cores, memory, torch, GPUs,
a real 2-process gloo all-reduce, one real 2-process training step timed against the reference machine's, free
ports, bf16, JupyterLab, the kernel, a browser, disk — and returns a :class:`Check`: its name, ``ok`` / ``warn`` /
``fail``, what it found and what to do about it. Then every lab in :data:`LABS` (written once, here) gets a
:class:`Verdict` — full speed, slow or won't run — from the checks alone (:func:`lab_verdicts`, a pure function,
tested on constructed checks).

Slow is measured, not inferred from the core count alone: the ``step`` check reads the 1-minute load average and
times a real 2-process data-parallel step (through labkit's launcher, the trainer every lab runs) of the shape the
shipped ``data_parallel`` benchmark timed, and divides it by that benchmark's newest step time (:class:`Reference`):
above :data:`SLOW_RATIO` the machine is "slow", with the ratio (:func:`step_verdict`, pure).

The checks touch the machine; the parsing, the verdicts and the report are pure. ``--quick`` skips the slow probes
(the gloo run, the timed step, the bf16 timing): a bf16 speed this machine already measured is still read from
labkit's cache, and the load is still read.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from labkit.text import PRINT_WIDTH, wrap

OK, WARN, FAIL = "ok", "warn", "fail"
GiB = 1024 ** 3


@dataclass(frozen=True)
class Check:
    """One check's result: ``status`` is ok, warn or fail; ``found`` says what is here, ``advice`` what to do;
    ``data`` holds the facts the lab verdicts read (e.g. ``{"cores": 2}``)."""
    name: str
    status: str
    found: str
    advice: str = ""
    data: dict = field(default_factory=dict)


# ---------------------------------------------------------------- the labs and what they need

@dataclass(frozen=True)
class Lab:
    """What one lab notebook needs from the machine (from ``workshops/labs.md``).

    ``procs``: the worker processes its runs start (0: it computes in the notebook's own process); ``most_procs``
    and ``most_part``: an optional part that starts more; ``on_gpu``: its runs use one GPU per process when there
    are GPUs (the CAP lab stays on the CPU over gloo anywhere); ``bf16``: it compares bf16 against fp32;
    ``gpu_kernels``: it compares attention kernels of which some are GPU-only."""
    notebook: str
    procs: int
    most_procs: int = 0
    most_part: str = ""
    on_gpu: bool = True
    bf16: bool = False
    gpu_kernels: bool = False


LABS = (
    Lab("00_quickstart", 2, 4, "the panel's 4-process run"),
    Lab("01_cap_tradeoffs", 2, 3, "ssp and async (a parameter server beside 2 workers)", on_gpu=False),
    Lab("02_data_parallel", 2, 4, "the 4-process comparison"),
    Lab("03_model_parallel", 2, 4, "the composed grid"),
    Lab("04_communication", 2),
    Lab("05_flash_attention", 0, gpu_kernels=True),
    Lab("06_mixed_precision", 2, bf16=True),
    Lab("07_fault_tolerance", 2),
    Lab("08_scaling_laws", 1),
    Lab("09_optimization_loop", 2),
    Lab("10_scaling_out", 0),
    Lab("11_capstone", 2),
    Lab("12_context_parallel", 2, on_gpu=False),  # cp gloo processes on the CPU (4 where there are 4 cores)
    Lab("13_mixture_of_experts", 2, on_gpu=False),  # MoE runs on gloo processes on the CPU (4 where there are 4 cores)
)

FULL, SLOW, NO = "full speed", "slow", "won't run"


@dataclass(frozen=True)
class Verdict:
    notebook: str
    speed: str  # FULL, SLOW or NO
    reasons: tuple[str, ...] = ()


def _data(checks: list[Check], name: str) -> dict:
    return next((c.data for c in checks if c.name == name), {})


def _status(checks: list[Check], name: str) -> Optional[str]:
    return next((c.status for c in checks if c.name == name), None)


def lab_verdict(lab: Lab, checks: list[Check]) -> Verdict:
    """How ``lab`` runs on the machine the ``checks`` describe: the slowest cause decides, every cause is said."""
    blockers, slow, notes = [], [], []
    if _status(checks, "torch") == FAIL:
        blockers.append("torch is not importable")
    if _status(checks, "jupyter") == FAIL:
        blockers.append("JupyterLab or ipywidgets is missing")
    if lab.procs >= 2 and _status(checks, "gloo") == FAIL:
        blockers.append("the gloo all-reduce failed: its worker processes cannot talk")
    cores = _data(checks, "cores").get("cores")
    gpus = _data(checks, "gpu").get("count", 0)
    on_gpus = gpus > 0 and lab.on_gpu
    if on_gpus and lab.procs > gpus:
        blockers.append(f"its runs start {lab.procs} processes, one per GPU, and {gpus} GPU is visible: "
                        "add run.device=cpu to run them on the CPU")
    elif not on_gpus and cores:
        if lab.procs > cores:
            slow.append(f"{lab.procs} processes on {cores} core{'s' if cores != 1 else ''}: "
                        "they take turns on the cores (time-slicing)")
        elif lab.most_procs > cores:
            notes.append(f"{lab.most_part}: {lab.most_procs} processes take turns on {cores} cores")
    if lab.bf16:
        bf16 = _data(checks, "bf16")
        if bf16.get("fast") is False:
            slow.append(bf16.get("lab06") or "bf16 is emulated here")
        elif bf16.get("fast") is None:
            notes.append("bf16's speed was not measured (--quick)")
    if lab.gpu_kernels and gpus == 0:
        notes.append("no GPU: it compares the CPU kernels; labkit_triton runs only under Triton's interpreter "
                     "(slow) and flash_attn is refused")
    step = _data(checks, "step")
    if lab.procs >= 2 and step.get("slow"):
        slow.append(f"a 2-process step measured {step['ratio']:.1f}× the reference machine's (slow above "
                    f"{step['threshold']:g}×): its runs take about that much longer than planned")
    if lab.procs and _data(checks, "memory").get("low"):
        slow.append("little free memory: the runs may swap")
    speed = NO if blockers else SLOW if slow else FULL
    return Verdict(lab.notebook, speed, tuple(blockers + slow + notes))


def lab_verdicts(checks: list[Check], labs=LABS) -> list[Verdict]:
    return [lab_verdict(lab, checks) for lab in labs]


# ---------------------------------------------------------------- pure helpers the checks use

def meminfo(text: str) -> dict[str, int]:
    """``{"MemTotal": bytes, "MemAvailable": bytes, ...}`` from /proc/meminfo's text (its kB are KiB)."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            out[key.strip()] = int(words[0]) * (1024 if words[1:2] == ["kB"] else 1)
    return out


TORCH_SERIES = "2.13"  # pyproject.toml: torch>=2.13,<2.14; the Makefile installs torch==2.13.0
LOW_MEMORY_GIB = 2.0  # less available than this: two workers beside JupyterLab may swap
LOW_DISK_GIB, NO_DISK_GIB = 2.0, 0.2
JUPYTER_PORT = 8888  # what `make lab` opens JupyterLab on
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "firefox")


def torch_series_ok(version: str) -> bool:
    """Whether a torch version (``2.13.0+cpu``) is of the series labkit is tested on."""
    return version.split("+")[0].split(".")[:2] == TORCH_SERIES.split(".")


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


# ---------------------------------------------------------------- the checks (these touch the machine)

def check_cores() -> Check:
    from labkit.config import cpu_count
    from labkit.cpu import cgroup_cpu_limit

    usable, total, quota = cpu_count(), os.cpu_count() or 1, cgroup_cpu_limit()
    by_quota = quota is not None and usable == max(1, int(quota)) and usable < total
    why = f"a control-group CPU quota of {quota:g}" if by_quota else "CPU affinity"
    found = f"{usable} usable" + (f" of {total} (limited by {why})" if usable != total else "")
    if usable >= 2:
        return Check("cores", OK, found, data={"cores": usable})
    return Check("cores", WARN, found, "the multi-process labs share one core: they run, slowly",
                 data={"cores": usable})


def check_memory(read=lambda: Path("/proc/meminfo").read_text()) -> Check:
    try:
        info = meminfo(read())
        total, available = info["MemTotal"], info.get("MemAvailable", info.get("MemFree"))
    except (OSError, KeyError):
        try:  # macOS and other Unixes: the total, not what is free
            total, available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), None
        except (ValueError, OSError, AttributeError):
            return Check("memory", WARN, "could not read the memory size here", data={})
    if available is None:
        low = total < 2 * LOW_MEMORY_GIB * GiB
        return Check("memory", WARN if low else OK, f"{gib(total)} in all (free memory not readable here)",
                     "close other programs before the labs" if low else "", {"total": total, "low": low})
    low = available < LOW_MEMORY_GIB * GiB
    return Check("memory", WARN if low else OK, f"{gib(available)} available of {gib(total)}",
                 f"under {LOW_MEMORY_GIB:g} GiB free: close other programs" if low else "",
                 {"total": total, "available": available, "low": low})


def check_torch() -> Check:
    try:
        import torch
    except ImportError as error:
        return Check("torch", FAIL, f"not importable ({error})", "run `make lab`: it installs torch==2.13.0")
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    found = f"{torch.__version__}, {build} build"
    data = {"version": torch.__version__, "cuda": torch.version.cuda}
    if torch_series_ok(torch.__version__):
        return Check("torch", OK, found, data=data)
    return Check("torch", WARN, found, f"labkit is tested on torch {TORCH_SERIES}.x (the Makefile installs "
                 "torch==2.13.0): `make lab` in a fresh clone", data)


def check_gpu() -> Check:
    try:
        import torch
    except ImportError:
        return Check("gpu", WARN, "unknown: torch is not importable", data={"count": 0})
    if not torch.cuda.is_available():
        return Check("gpu", OK, "none: the labs run on the CPU, as designed", data={"count": 0, "names": []})
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Check("gpu", OK, f"{len(names)} CUDA GPU{'s' if len(names) != 1 else ''}: {', '.join(sorted(set(names)))}",
                 data={"count": len(names), "names": names})


GLOO_TIMEOUT_S = 60  # two cold Python processes importing torch on a busy 2-core laptop take a while

GLOO_WORKER = """
import datetime, os, sys
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["MASTER_PORT"], rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=float(sys.argv[1])))
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
dist.destroy_process_group()
sys.exit(0 if t.item() == 3.0 else 3)
"""


def gloo_all_reduce(timeout_s: float = GLOO_TIMEOUT_S) -> tuple[bool, str]:
    """(passed, what happened): two real processes form a gloo group on loopback and all-reduce 1 + 2; each must
    read 3. Both are killed if they have not finished within ``timeout_s``."""
    from labkit.launcher import free_port

    port = str(free_port())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
           "WORLD_SIZE": "2"}
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_WORKER, str(timeout_s)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        errors = []
        for rank, proc in enumerate(procs):
            left = max(0.1, timeout_s - (time.monotonic() - start))
            _, err = proc.communicate(timeout=left)
            if proc.returncode:
                lines = err.strip().splitlines() or [f"exit code {proc.returncode}"]
                errors.append(f"rank {rank}: {lines[-1]}")
        took = time.monotonic() - start
        if errors:
            return False, "; ".join(errors)
        return True, f"2 processes all-reduced over loopback (port {port}) in {took:.1f} s"
    except subprocess.TimeoutExpired:
        return False, f"no answer within {timeout_s:g} s (port {port})"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def check_gloo(run: bool = True, probe=gloo_all_reduce) -> Check:
    try:
        import torch.distributed as dist
    except ImportError:
        return Check("gloo", FAIL, "torch.distributed is not importable", "`make lab` installs torch",
                     {"ran": False})
    if not (dist.is_available() and dist.is_gloo_available()):
        return Check("gloo", FAIL, "this torch build has no gloo backend",
                     "install torch==2.13.0 from pytorch.org (`make lab`)", {"ran": False})
    if not run:
        return Check("gloo", OK, "built in; the 2-process all-reduce was not run (--quick)", data={"ran": False})
    passed, what = probe()
    if passed:
        return Check("gloo", OK, what, data={"ran": True})
    return Check("gloo", FAIL, f"2-process all-reduce failed: {what}",
                 "a firewall or VPN may block loopback connections; try again with them off", {"ran": True})


# ---------------------------------------------------------------- one real step, timed against the reference

REFERENCE_RESULTS = "data_parallel"  # benchmarks/results/data_parallel.jsonl: benchmarks/data_parallel.py's records
REFERENCE_VARIANT = "torch_ddp"  # its row for PyTorch's DDP: the strategy the labs' configs take first
TIMED_STEPS = 3  # steps after the benchmark's warm-up steps; their median is the measured step
SLOW_RATIO = 2.0
"""Above this ratio of the measured step to the reference's, the machine is slow. Where it comes from: the reference
machine's own rounds of this step, in the 7 data_parallel records shipped by 2026-12-05 (AMD EPYC, 2 cores), ran from
0.26 s to 0.56 s, up to 1.8× the newest record's mean (0.32 s): a busy 2-core machine moves a step by that much.
Above 2× is beyond what the reference machine did to itself, and a lab's runs take more than twice their minutes."""
STEP_TIMEOUT_S = 300  # a cold start of two workers importing torch on a busy 2-core laptop, then a few steps


@dataclass(frozen=True)
class Reference:
    """The step the doctor times and what it took on the reference machine: ``shape`` (the benchmark's model, batch
    and strategy settings), ``warmup_steps``, ``step_s`` (its mean over the steady steps of every round) and
    ``where`` (the file, date and machine it was measured on)."""
    step_s: float
    shape: dict
    warmup_steps: int
    where: str


def step_reference(records: list[dict]) -> Reference:
    """The newest full (not ``--quick``) 2-process ``data_parallel`` table's DDP row, from its results records."""
    from labkit.results import latest

    record = latest(records, REFERENCE_RESULTS, quick=False, nproc=2)
    row = next(r for r in record["rows"] if r["variant"] == REFERENCE_VARIANT)
    machine = record["machine"]
    machine = machine if isinstance(machine, str) else f"{machine['cpu']}, {machine['cores']} cores"
    where = f"benchmarks/results/{REFERENCE_RESULTS}.jsonl, {REFERENCE_VARIANT}, {record['date'][:10]}, {machine}"
    return Reference(row["step_s"], dict(record["settings"]["shape"]), record["settings"]["warmup_steps"], where)


def load_reference() -> Optional[Reference]:
    """The shipped reference, or None where the results file is absent (labkit installed without its repository)."""
    from labkit.results import load_results

    try:
        return step_reference(load_results(REFERENCE_RESULTS))
    except (OSError, LookupError, KeyError, StopIteration, ValueError):
        return None


def time_step(reference: Reference, timeout_s: float = STEP_TIMEOUT_S) -> float:
    """Seconds of one 2-process step of the reference's shape, measured here: a real run through labkit's launcher
    on the CPU (gloo, as the reference ran, with as many threads per worker as the labs give), the median of
    :data:`TIMED_STEPS` steps after the warm-up. Raises RuntimeError when the run does not finish, ValueError
    (:class:`~labkit.config.ConfigError`) when validation refuses it here."""
    import tempfile

    from labkit.config import load_config
    from labkit.launcher import launch

    steps = reference.warmup_steps + TIMED_STEPS
    cfg = load_config(None, {**reference.shape, "run.name": "doctor", "run.steps": steps, "run.eval_every": 0,
                             "run.save_final": False, "metrics.progress": False, "run.device": "cpu"})
    with tempfile.TemporaryDirectory(prefix="labkit-doctor-") as run_dir:
        run = launch(cfg, nproc=2, run_dir=run_dir)
        try:
            status = run.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            run.stop()
            raise RuntimeError(f"no end within {timeout_s:g} s") from None
        if status != "finished":
            raise RuntimeError(f"the run {status}: {(run.log().strip().splitlines() or ['no log'])[-1]}")
        times = [e["step_time_s"] for e in run.events() if e["type"] == "step"][reference.warmup_steps:]
    if not times:
        raise RuntimeError("the run recorded no step after its warm-up")
    return sorted(times)[len(times) // 2]


def step_verdict(measured_s: float, reference_s: float, threshold: float = SLOW_RATIO) -> tuple[float, bool]:
    """(measured / reference, whether that is above ``threshold``): is this machine slow for the labs' runs?"""
    ratio = measured_s / reference_s
    return ratio, ratio > threshold


def load_average() -> Optional[float]:
    """The 1-minute load average (runnable processes), or None where the system has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def load_text(load: Optional[float], cores: int) -> str:
    return "load not readable here" if load is None else f"load {load:.1f} on {cores} core{'s' if cores != 1 else ''}"


def busy(load: Optional[float], cores: int) -> bool:
    """More runnable processes than cores, on average over the last minute: other programs compete for them."""
    return load is not None and load > cores


def step_check(measured_s: Optional[float], reference: Optional[Reference], load: Optional[float], cores: int,
               error: str = "", quick: bool = False) -> Check:
    """The ``step`` check from what was measured (pure): ``measured_s`` None means not timed — ``quick``, no
    ``reference`` to time against, or the run failed with ``error``."""
    data = {"ran": measured_s is not None or bool(error), "load": load, "cores": cores, "threshold": SLOW_RATIO,
            "slow": None}
    close = (f"the machine is busy ({load_text(load, cores)}): close other programs and run `labkit doctor` again"
             if busy(load, cores) else "")
    if error:
        return Check("step", WARN, f"the timed 2-process step did not finish: {error}; {load_text(load, cores)}",
                     close or "the gloo check above says whether the workers can talk", data)
    if measured_s is None or reference is None:
        why = "--quick" if quick else f"no reference: benchmarks/results/{REFERENCE_RESULTS}.jsonl is not here"
        return Check("step", WARN if busy(load, cores) else OK, f"not timed ({why}); {load_text(load, cores)}",
                     close, data)
    data["step_s"] = measured_s
    ratio, slow = step_verdict(measured_s, reference.step_s)
    data.update(reference_s=reference.step_s, ratio=ratio, slow=slow, reference=reference.where)
    found = (f"{'slow: ' if slow else ''}a 2-process step took {measured_s:.2f} s, {ratio:.1f}× the reference's "
             f"{reference.step_s:.2f} s ({'above' if slow else 'slow above'} {SLOW_RATIO:g}×); "
             f"{load_text(load, cores)}; the reference: {reference.where}")
    if not slow:
        return Check("step", OK, found, data=data)
    advice = close or (f"this machine is slower than the reference one: the labs' runs take about {ratio:.1f}× "
                       "the planned minutes; quick mode shortens them (workshops/README.md, \"Slow machines\")")
    return Check("step", WARN, found, advice, data)


def check_step(run: bool = True, measure=time_step, reference=load_reference, load=load_average) -> Check:
    """Read the load, then (unless ``run`` is False) time one real 2-process step and compare it with the
    reference. ``measure``, ``reference`` and ``load`` are the instruments, replaceable in tests."""
    from labkit.config import cpu_count

    cores, ref, before = cpu_count(), reference(), load()  # the load before the step's own workers add to it
    if not run or ref is None:
        return step_check(None, ref, before, cores, quick=not run)
    try:
        measured = measure(ref)
    except (RuntimeError, ValueError, OSError) as error:
        return step_check(None, ref, before, cores, str(error))
    return step_check(measured, ref, before, cores)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def check_ports() -> Check:
    from labkit.launcher import free_port

    try:
        port = free_port()
    except OSError as error:
        return Check("ports", FAIL, f"cannot bind a loopback port ({error})",
                     "the workers rendezvous on 127.0.0.1: allow local connections", {"free": False})
    if port_free(JUPYTER_PORT):
        return Check("ports", OK, f"loopback ports bind (e.g. {port}); {JUPYTER_PORT} is free for JupyterLab",
                     data={"free": True, "jupyter_port": True})
    return Check("ports", WARN, f"loopback ports bind (e.g. {port}); {JUPYTER_PORT} is taken",
                 'start JupyterLab on another port: make lab LAB_ARGS="--port 9999"',
                 {"free": True, "jupyter_port": False})


def lab06_text(speed: dict) -> str:
    """What lab 06 does on a CPU whose bf16 is slower than fp32 (``labkit.widgets.precision.plan_comparison``)."""
    return (f"bf16 is emulated here (×{speed['speedup']:#.2g} fp32's rate): lab 06 trains bf16 for fewer steps than "
            "fp32, enough for its loss curve and throughput, and says why; fp16 is refused on a CPU")


def check_bf16(measure: bool = True) -> Check:
    """Whether bf16 is fast here: on a GPU its tensor cores; on a CPU bf16 against fp32 matmuls, timed as lab 06's
    workers would (:func:`labkit.hardware.bf16_speed`, cached). ``measure`` False reads only a cached measurement."""
    import torch

    if torch.cuda.is_available():
        fast = torch.cuda.is_bf16_supported()
        return Check("bf16", OK if fast else WARN, "the GPU has bf16 tensor cores" if fast else
                     "this GPU has no bf16 tensor cores", "" if fast else "lab 06's bf16 runs are slow here",
                     {"fast": fast, "lab06": "" if fast else "this GPU has no bf16 tensor cores: bf16 runs slowly"})
    from labkit.config import cpu_count
    from labkit.cpu import cpu_fingerprint, read_cache
    from labkit.hardware import BF16_WORTH_IT, PROBE_SIZE, bf16_choice, bf16_speed, cache_dir, detect

    threads = max(1, cpu_count() // 2)  # lab 06 runs 2 workers: threads_per_proc's share each
    native = detect()["bf16_flags"]
    if measure:
        speed = bf16_speed(threads)
    else:
        speed = read_cache(cache_dir() / "bf16_speed.json").get(f"threads={threads}|size={PROBE_SIZE}")
        if not speed or speed.get("machine") != cpu_fingerprint():
            flags = f"the CPU lists {', '.join(native)}" if native else "the CPU lists no native bf16"
            return Check("bf16", OK, f"not measured (--quick); {flags}", data={"fast": None, "native": native})
    choice, why = bf16_choice(speed, native)
    fast = speed["speedup"] >= BF16_WORTH_IT
    state = "fast" if fast else "emulated (fp32 is as fast or faster)"
    return Check("bf16", OK, f"{state}: bf16 matmuls at ×{speed['speedup']:#.2g} fp32's rate, "
                 f"{threads} thread{'s' if threads != 1 else ''}" + ("" if measure else " (cached)"),
                 data={"fast": fast, "speedup": speed["speedup"], "choice": choice, "why": why, "native": native,
                       "lab06": "" if fast else lab06_text(speed)})


def check_jupyter(find=importlib.util.find_spec) -> Check:
    needed = ("jupyterlab", "ipywidgets", "ipykernel", "matplotlib")
    missing = [m for m in needed if find(m) is None]
    if missing:
        return Check("jupyter", FAIL, f"missing: {', '.join(missing)}",
                     "run `make lab` (or pip install -e '.[notebook]')", {"missing": missing})
    from importlib.metadata import PackageNotFoundError, version

    def v(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "?"
    return Check("jupyter", OK, ", ".join(f"{m} {v(m)}" for m in needed[:2]) + " importable",
                 data={"missing": []})


KERNEL_COMMAND = '.venv/bin/python -m ipykernel install --sys-prefix --name labkit --display-name "Python (labkit)"'


def check_kernel() -> Check:
    try:
        from jupyter_client.kernelspec import find_kernel_specs
    except ImportError:
        return Check("kernel", WARN, "jupyter_client is missing", "run `make lab`")
    specs = find_kernel_specs()
    if "labkit" in specs:
        return Check("kernel", OK, f'"Python (labkit)" registered ({specs["labkit"]})')
    return Check("kernel", WARN, 'the "Python (labkit)" kernel is not registered',
                 f"`make lab` registers it, or: {KERNEL_COMMAND}")


def check_browser(which: Callable[[str], Optional[str]] = shutil.which, platform: str = sys.platform) -> Check:
    found = [name for name in BROWSERS if which(name)]
    if found:
        return Check("browser", OK, f"{found[0]} ({which(found[0])})")
    if platform in ("darwin", "win32"):
        return Check("browser", OK, "the system's default browser (not looked for on macOS/Windows)")
    return Check("browser", WARN, f"none of {', '.join(BROWSERS)} on PATH",
                 f"open http://127.0.0.1:{JUPYTER_PORT} in the browser you use")


def check_disk(where: Optional[Path] = None, usage=shutil.disk_usage) -> Check:
    where = Path(where or Path.cwd()).resolve()
    while not where.exists():
        where = where.parent
    free = usage(where).free
    found = f"{gib(free)} free in {where}"
    if free < NO_DISK_GIB * GiB:
        return Check("disk", FAIL, found, "runs write checkpoints and events here: free some space",
                     {"free": free})
    if free < LOW_DISK_GIB * GiB:
        return Check("disk", WARN, found, f"under {LOW_DISK_GIB:g} GiB: lab 07's checkpoints may not fit",
                     {"free": free})
    return Check("disk", OK, found, data={"free": free})


def run_checks(quick: bool = False) -> list[Check]:
    """Every check, in the order they print; ``quick`` skips the gloo run, the timed step and the bf16 timing (a
    failed gloo run skips the step too: its workers could not talk)."""
    checks = [check_cores(), check_memory(), check_torch(), check_gpu()]
    if checks[2].status == FAIL:
        checks += [Check(name, FAIL, "not checked: torch is not importable") for name in ("gloo", "step", "bf16")]
    else:
        gloo = check_gloo(run=not quick)
        step = check_step(run=not quick and gloo.status != FAIL)
        checks += [gloo, step, check_bf16(measure=not quick)]
    return checks + [check_ports(), check_jupyter(), check_kernel(), check_browser(), check_disk()]


# ---------------------------------------------------------------- the report

def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def report_dict(checks: list[Check], verdicts: list[Verdict]) -> dict:
    return {"ok": exit_code(checks) == 0, "checks": [asdict(c) for c in checks],
            "labs": [{**asdict(v), "reasons": list(v.reasons)} for v in verdicts]}


def report_text(checks: list[Check], verdicts: list[Verdict], width: int = PRINT_WIDTH) -> str:
    """The report, every line at most ``width`` characters: checks, then the labs."""
    lines = ["labkit doctor: this machine, for the labs", ""]
    for c in checks:
        lines.append(wrap(f"  {c.status:5s} {c.name:8s} {c.found}", width, " " * 16))
        if c.advice:
            lines.append(wrap(f"{'':16s}→ {c.advice}", width, " " * 18))
    lines += ["", "labs"]
    for v in verdicts:
        lines.append(f"  {v.notebook:22s} {v.speed}")
        lines += [wrap(f"{'':25s}· {r}", width, " " * 27) for r in v.reasons]
    failed = [c.name for c in checks if c.status == FAIL]
    if _data(checks, "gloo").get("ran") is False and _status(checks, "gloo") == OK:
        lines += ["", wrap("--quick: the 2-process gloo run, the timed step and the bf16 timing were skipped; "
                           "`labkit doctor` without --quick tries them (about a minute)", width)]
    lines += ["", "not ready: fix " + ", ".join(failed) + " first" if failed else "ready for the labs"]
    return "\n".join(lines)


def main(quick: bool = False, as_json: bool = False, out=None) -> int:
    """``labkit doctor [--quick] [--json]``: print the report; 1 when a check failed, else 0."""
    checks = run_checks(quick)
    verdicts = lab_verdicts(checks)
    text = json.dumps(report_dict(checks, verdicts), indent=1) if as_json else report_text(checks, verdicts)
    print(text, file=out or sys.stdout)
    return exit_code(checks)
