import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Measure the CPU peak once per test session, in a cache the tests own."""
    os.environ["LABKIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("labkit-cache"))
    os.environ["LABKIT_PROGRESS"] = "0"
    yield
