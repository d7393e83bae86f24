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
