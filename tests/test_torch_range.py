"""The torch range labkit declares is the one it is tested on, and every install path agrees with it."""
import re
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def declared_torch_range() -> SpecifierSet:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_requirement,) = [Requirement(d) for d in dependencies if Requirement(d).name == "torch"]
    return torch_requirement.specifier


def makefile_torch_pin() -> Version:
    """The version ``make lab`` / ``make test`` install before labkit (TORCH_VERSION ?= X; labkit/torch_build.py
    picks its build)."""
    (pin,) = re.findall(r"^TORCH_VERSION\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    return Version(pin)


def conda_torch_range() -> SpecifierSet:
    (spec,) = re.findall(r"^\s*-\s*pytorch-cpu\s*([^\s#]+)", (ROOT / "environment.yml").read_text(), re.MULTILINE)
    return SpecifierSet(spec)


def test_the_installed_torch_is_inside_the_declared_range():
    assert Version(torch.__version__) in declared_torch_range(), (torch.__version__, str(declared_torch_range()))


def test_the_makefile_pin_satisfies_the_range_so_pip_never_pulls_another_build():
    assert makefile_torch_pin() in declared_torch_range()


def test_the_range_is_one_release_series_and_conda_declares_the_same():
    declared = declared_torch_range()
    pin = makefile_torch_pin()
    older, newer = f"{pin.major}.{pin.minor - 1}.99", f"{pin.major}.{pin.minor + 1}.0"
    assert older not in declared and newer not in declared, f"{declared} is wider than the tested {pin}"
    assert conda_torch_range() == declared


@pytest.mark.parametrize("machine", [("Linux", "x86_64", False, ()), ("Linux", "x86_64", True, ()),
                                     ("Darwin", "arm64", False, ()),
                                     ("Linux", "x86_64", False, ("torch-{v}+cpu-cp311-cp311-linux_x86_64.whl",))])
def test_every_build_the_install_picks_is_inside_the_range(machine):
    from labkit.torch_build import Machine, choose

    system, arch, nvidia, wheels = machine
    pin = str(makefile_torch_pin())
    requirement = Requirement(choose(pin, Machine(system, arch, nvidia, "cp311",
                                                  tuple(w.format(v=pin) for w in wheels))).args[0])
    assert requirement.name == "torch"
    (version,) = [Version(s.version) for s in requirement.specifier]
    assert version in declared_torch_range()
