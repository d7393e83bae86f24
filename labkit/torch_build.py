"""Which torch build ``make lab`` installs on this machine. It runs before torch is installed, so it imports neither
torch nor the rest of labkit (the Makefile runs it as a file, ``python labkit/torch_build.py 2.13.0``, which prints the
``pip install`` arguments on stdout and the reason on stderr).

The rule (:func:`choose`, pure; the README's supported-platform table says the same, and tests/test_readme.py checks
that it does):

* Linux x86_64 with an NVIDIA GPU (``nvidia-smi`` on PATH, ``/proc/driver/nvidia``, or WSL2's
  ``/usr/lib/wsl/lib/nvidia-smi``): PyPI's default build, the CUDA one (it brings the nvidia-* packages).
* Linux x86_64 without one: the CPU build. When pip is already configured (pip.conf, ``PIP_FIND_LINKS`` …) with a
  local folder or ``file://`` index that holds a ``+cpu`` wheel of this torch for this Python, that wheel, pinned
  (``torch==2.13.0+cpu``, no extra index: such a machine may reach no other); otherwise
  ``torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu``. PyPI's Linux x86_64 wheel is the CUDA build:
  without this, a laptop with no GPU downloads several GB of CUDA libraries it cannot use.
* Windows under WSL2 is Linux: the same two rules.
* macOS, other Linux CPUs (aarch64 …) and native Windows: PyPI's default build.

``make lab TORCH_SPEC="…"`` skips all of this: a spec the user gives always wins.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional
from urllib.parse import unquote, urlparse

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
NVIDIA_MARKERS = ("/proc/driver/nvidia", "/usr/lib/wsl/lib/nvidia-smi")  # the Linux driver; WSL2's passthrough
PIP_SOURCE_KEYS = ("find-links", "index-url", "extra-index-url")

PYPI_CUDA, CPU_LOCAL, CPU_INDEXED, PYPI_DEFAULT = "PyPI's CUDA build", "the local CPU wheel", "the CPU build", \
    "PyPI's default build"


@dataclass(frozen=True)
class Machine:
    """What the choice reads: ``system`` and ``arch`` as :mod:`platform` names them (Linux, Darwin, Windows;
    x86_64, aarch64, arm64, AMD64), whether an NVIDIA driver is present, and the names of the torch wheel files
    that pip's configured local sources hold."""
    system: str
    arch: str
    nvidia: bool
    python_tag: str = f"cp{sys.version_info.major}{sys.version_info.minor}"
    local_wheels: tuple[str, ...] = ()


@dataclass(frozen=True)
class Choice:
    """``args``: what follows ``pip install``; ``build``: which build that is; ``why``: one sentence."""
    args: tuple[str, ...]
    build: str
    why: str


def local_cpu_wheel(version: str, machine: Machine) -> Optional[str]:
    """The first local wheel that is torch ``version``'s ``+cpu`` build for this Python and CPU, or None."""
    pattern = re.compile(rf"torch-{re.escape(version)}\+cpu-{machine.python_tag}-[^-]+-([^-]+)\.whl$")
    for name in machine.local_wheels:
        match = pattern.match(name)
        if match and machine.arch.lower() in match.group(1):
            return name
    return None


def choose(version: str, machine: Machine) -> Choice:
    """Which build of torch ``version`` to install on ``machine`` (the rule in the module's docstring)."""
    if machine.system != "Linux" or machine.arch != "x86_64":
        return Choice((f"torch=={version}",), PYPI_DEFAULT,
                      f"{machine.system} {machine.arch}: PyPI's default build (no separate CPU build is needed)")
    if machine.nvidia:
        return Choice((f"torch=={version}",), PYPI_CUDA, "an NVIDIA driver is present: PyPI's default (CUDA) build")
    wheel = local_cpu_wheel(version, machine)
    if wheel:
        return Choice((f"torch=={version}+cpu",), CPU_LOCAL,
                      f"no NVIDIA GPU; pip is configured with a local folder that holds {wheel}")
    return Choice((f"torch=={version}", "--index-url", CPU_INDEX), CPU_INDEXED,
                  "no NVIDIA GPU: the CPU build from PyTorch's CPU index, not PyPI's multi-GB CUDA build")


# ---------------------------------------------------------------- reading the machine (each part replaceable in tests)

def nvidia_present(which: Callable[[str], Optional[str]] = shutil.which,
                   exists: Callable[[str], bool] = os.path.exists) -> bool:
    return bool(which("nvidia-smi")) or any(exists(marker) for marker in NVIDIA_MARKERS)


def pip_sources(config_list: str) -> list[str]:
    """Every find-links and index location in ``pip config list``'s output (lines like
    ``global.find-links='/opt/wheels'`` or ``:env:.extra-index-url='file:///a file:///b'``)."""
    sources = []
    for line in config_list.splitlines():
        key, _, value = line.partition("=")
        if key.rsplit(".", 1)[-1] in PIP_SOURCE_KEYS:
            sources += value.strip().strip("'\"").split()
    return list(dict.fromkeys(sources))


def local_path(source: str) -> Optional[Path]:
    """The folder a local source names (a path or a ``file://`` URL); None for a remote one."""
    if source.startswith("file:"):
        return Path(unquote(urlparse(source).path))
    if "://" in source:
        return None
    return Path(source)


def torch_wheels_in(sources: Iterable[str]) -> tuple[str, ...]:
    """The torch wheel names in the local sources: files in a find-links folder, links in a simple index's
    ``torch/index.html``."""
    names = []
    for source in sources:
        folder = local_path(source)
        if folder is None or not folder.is_dir():
            continue
        names += sorted(p.name for p in folder.glob("torch-*.whl"))
        index = folder / "torch" / "index.html"
        if index.is_file():
            names += re.findall(r">\s*(torch-[^<\s]+\.whl)\s*<", index.read_text(errors="replace"))
    return tuple(dict.fromkeys(names))


def pip_config_list(python: str = sys.executable) -> str:
    """``pip config list`` as this Python's pip reads it (its global, user, site and PIP_* settings); empty if
    pip cannot say."""
    try:
        return subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def this_machine() -> Machine:
    return Machine(platform.system(), platform.machine(), nvidia_present(),
                   local_wheels=torch_wheels_in(pip_sources(pip_config_list())))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python labkit/torch_build.py TORCH_VERSION  (e.g. 2.13.0)", file=sys.stderr)
        return 2
    choice = choose(argv[0], this_machine())
    print(f"torch: {choice.build}, because {choice.why}", file=sys.stderr)
    print(" ".join(choice.args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
