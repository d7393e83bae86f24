import os

import pytest


def pytest_report_header(config):
    """Every test log says which machine it ran on: a failure that depends on the CPU names it."""
    from labkit.hardware import cpu_fingerprint

    fp = cpu_fingerprint()
    forced = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE")
              if k in os.environ}
    return [f"labkit machine: {fp['cpu']}, {fp['cores']} cores, ISA {' '.join(fp['isa']) or 'none listed'}, "
            f"torch {fp['torch']} kernels at {fp['torch_cpu_capability']}"
            + (f" (forced: {forced})" if forced else "")]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Measure the CPU peak once per test session, in a cache the tests own."""
    os.environ["LABKIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("labkit-cache"))
    os.environ["LABKIT_PROGRESS"] = "0"
    yield


# ---------------------------------------------------------------- markers: multiproc, notebook
# `make test-fast` runs `-m "not multiproc and not notebook"`: no worker processes, no notebooks. So that
# the selection stays honest, a test that is not marked multiproc (or notebook) cannot start a Python
# process (a worker, torchrun, a script) or fork: each way is refused while it runs, with a message naming
# the marker. Short external tools (git for a result's commit, a compiler) are not workers and may run.
import subprocess  # noqa: E402
import sys  # noqa: E402

import _posixsubprocess  # noqa: E402

PROCESS_STARTERS = [(subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"),
                    (os, "posix_spawn"), (os, "posix_spawnp")]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith("notebooks/") or item.nodeid.endswith(".ipynb") or ".ipynb::" in item.nodeid:
            item.add_marker(pytest.mark.notebook)


def _starts_python(args) -> bool:
    """Whether a process-starting call's arguments name a Python interpreter or torchrun."""
    words = []
    for arg in args[:2]:  # fork_exec(args, executables, ...); posix_spawn(path, argv, env)
        if isinstance(arg, (str, bytes, os.PathLike)):
            words.append(os.fsdecode(arg))
        elif isinstance(arg, (list, tuple)):
            words += [os.fsdecode(a) for a in arg[:1] if isinstance(a, (str, bytes, os.PathLike))]
    names = {os.path.basename(w) for w in words}
    return any(n.startswith("python") or n in ("torchrun", os.path.basename(sys.executable)) for n in names)


def _may_start_processes(item) -> bool:
    return any(item.get_closest_marker(name) for name in ("multiproc", "notebook"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _processes_refused(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _processes_refused(item):
        yield


class _processes_refused:
    def __init__(self, item):
        self.item, self.saved = item, []

    def __enter__(self):
        if _may_start_processes(self.item):
            return

        nodeid = self.item.nodeid

        def guarded(original, always: bool):
            def start(*args, **kwargs):
                if always or _starts_python(args):
                    raise RuntimeError(f"{nodeid} starts a process: mark it @pytest.mark.multiproc "
                                       "(make test-fast leaves such tests out)")
                return original(*args, **kwargs)
            return start

        for module, name in PROCESS_STARTERS:
            if hasattr(module, name):
                original = getattr(module, name)
                self.saved.append((module, name, original))
                setattr(module, name, guarded(original, always=name == "fork"))

    def __exit__(self, *exc):
        for module, name, original in self.saved:
            setattr(module, name, original)
