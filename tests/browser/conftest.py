"""One JupyterLab and one Chromium for all the browser tests (quick mode), torn down at the end."""
import pytest

from browser_lab import Browser, start_lab


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    started = start_lab(tmp_path_factory.mktemp("browser-lab"))
    yield started
    started.stop()


@pytest.fixture(scope="session")
def browser():
    opened = Browser()
    yield opened
    opened.close()


@pytest.fixture
def page(browser):
    return browser.page
