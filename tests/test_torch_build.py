"""Which torch build ``make lab`` installs (``labkit/torch_build.py``): the rule on constructed machines, pip's
configured sources read from ``pip config list`` text and from folders made here, and the script on this machine.
No network: nothing here asks an index anything."""
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import torch_build
from labkit.torch_build import (CPU_INDEX, CPU_INDEXED, CPU_LOCAL, PYPI_CUDA, PYPI_DEFAULT, Machine, choose,
                                local_cpu_wheel, nvidia_present, pip_sources, torch_wheels_in)

ROOT = Path(__file__).resolve().parents[1]
V = "2.13.0"
CPU_WHEEL = f"torch-{V}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"


def laptop(nvidia=False, wheels=(), system="Linux", arch="x86_64", python_tag="cp311") -> Machine:
    return Machine(system, arch, nvidia, python_tag, tuple(wheels))


def test_a_linux_laptop_without_a_gpu_gets_the_cpu_index_not_pypis_cuda_build():
    choice = choose(V, laptop())
    assert choice.args == (f"torch=={V}", "--index-url", CPU_INDEX) and choice.build == CPU_INDEXED


def test_a_local_cpu_wheel_that_pip_finds_is_used_pinned_with_no_other_index():
    choice = choose(V, laptop(wheels=["torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl", CPU_WHEEL]))
    assert choice.args == (f"torch=={V}+cpu",) and choice.build == CPU_LOCAL and CPU_WHEEL in choice.why


@pytest.mark.parametrize("wheel, why", [
    (CPU_WHEEL.replace("cp311", "cp312"), "another Python"),
    (CPU_WHEEL.replace("x86_64", "aarch64"), "another CPU"),
    (CPU_WHEEL.replace("2.13.0", "2.13.1"), "another torch"),
    (CPU_WHEEL.replace("+cpu", ""), "not the CPU build"),
    (CPU_WHEEL.replace("+cpu", "+cu128"), "a CUDA build"),
])
def test_a_local_wheel_that_does_not_fit_is_not_used(wheel, why):
    assert local_cpu_wheel(V, laptop(wheels=[wheel])) is None, why
    assert choose(V, laptop(wheels=[wheel])).build == CPU_INDEXED


def test_an_nvidia_driver_gets_pypis_default_cuda_build_even_beside_a_local_cpu_wheel():
    choice = choose(V, laptop(nvidia=True, wheels=[CPU_WHEEL]))
    assert choice.args == (f"torch=={V}",) and choice.build == PYPI_CUDA


@pytest.mark.parametrize("system, arch", [("Darwin", "arm64"), ("Darwin", "x86_64"), ("Windows", "AMD64"),
                                          ("Linux", "aarch64")])
def test_elsewhere_pypis_default_build(system, arch):
    choice = choose(V, laptop(system=system, arch=arch))
    assert choice.args == (f"torch=={V}",) and choice.build == PYPI_DEFAULT and system in choice.why


@pytest.mark.parametrize("which, present, expected", [
    (lambda name: "/usr/bin/nvidia-smi", set(), True),
    (lambda name: None, {"/proc/driver/nvidia"}, True),
    (lambda name: None, {"/usr/lib/wsl/lib/nvidia-smi"}, True),  # WSL2 with the Windows NVIDIA driver
    (lambda name: None, set(), False),
])
def test_an_nvidia_driver_is_seen_by_its_tool_or_its_files(which, present, expected):
    assert nvidia_present(which, present.__contains__) is expected


def test_pip_sources_reads_every_scope_of_pip_config_list():
    text = """:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
site.index-url='https://mirror.example/simple'
"""
    assert pip_sources(text) == ["/opt/wheels", "file:///opt/pypi/simple", "file:///opt/pypi-more/simple",
                                 "https://mirror.example/simple"]
    assert pip_sources("") == []


def test_torch_wheels_are_found_in_a_find_links_folder_and_a_file_index(tmp_path):
    links = tmp_path / "wheels"
    links.mkdir()
    (links / CPU_WHEEL).touch()
    (links / "numpy-2.0.0-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    index = tmp_path / "simple" / "torch"
    index.mkdir(parents=True)
    other = "torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl"
    (index / "index.html").write_text(f'<html><body><a href="../../files/{other}#sha256=00">{other}</a></body></html>')
    sources = [str(links), (tmp_path / "simple").as_uri(), str(tmp_path / "absent"), "https://pypi.org/simple"]
    assert torch_wheels_in(sources) == (CPU_WHEEL, other)


@pytest.mark.multiproc  # it asks this Python's pip for its configuration
def test_this_machine_keeps_its_offline_install():
    # pip here is configured with a local folder holding torch's CPU wheel (and can reach no other index): the
    # script must pick that wheel, pinned, with no --index-url. Elsewhere the same script prints another choice.
    machine = torch_build.this_machine()
    expected = choose(V, machine)
    if machine.nvidia or not local_cpu_wheel(V, machine):
        pytest.skip(f"not a machine with a local CPU wheel: {expected.why}")
    assert expected.args == (f"torch=={V}+cpu",)


@pytest.mark.multiproc
def test_the_script_prints_the_pip_arguments_and_says_why():
    done = subprocess.run([sys.executable, str(ROOT / "labkit" / "torch_build.py"), V], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == " ".join(choose(V, torch_build.this_machine()).args)
    assert done.stderr.startswith("torch: ") and "because" in done.stderr
    usage = subprocess.run([sys.executable, str(ROOT / "labkit" / "torch_build.py")], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr
