"""A real JupyterLab in a real Chromium, driven the way a workshop room uses it.

:class:`Lab` starts JupyterLab on a free port over a *copy* of ``notebooks/`` (so nothing it runs or autosaves
touches the repository's notebooks, which are stored without outputs), beside links to the folders the
notebooks read (``configs/``, ``datasets/``, ``benchmarks/``). :class:`Browser` is Playwright driving Debian's
``chromium`` (Playwright's own browser download is not used) at 1,400 × 900 with the file browser open, as
the defects of issue 27 were seen.

:func:`run_all` opens a notebook, runs every cell through JupyterLab's own "Run All" command and waits until
the kernel is idle with every code cell executed; :func:`page_problems` then lists what a person would see
wrong: error outputs (tracebacks), broken images, widgets that never rendered.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LINKED = ("configs", "datasets", "benchmarks")  # what the notebooks read through ../
SETTINGS = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
VIEWPORT = {"width": 1400, "height": 900}
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update", "--disable-dev-shm-usage"]


def chromium() -> str:
    """Debian's chromium, which ``make test`` installs; a clear error (never a skip) when it is missing."""
    path = shutil.which("chromium")
    if not path:
        raise RuntimeError("the browser tests need Debian's chromium: `make test` installs it "
                           "(apt-get install chromium)")
    return path


def free_port() -> int:
    from labkit.launcher import free_port as labkit_free_port

    return labkit_free_port()


@dataclass
class Lab:
    """A running JupyterLab: its base URL (with the token) and the folder it serves."""
    process: subprocess.Popen
    port: int
    token: str
    root: Path

    def url(self, path: str = "lab") -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def start_lab(workdir: Path, quick: bool = True, extra_env: dict | None = None) -> Lab:
    """JupyterLab over a copy of the notebooks in ``workdir`` (quick mode unless told otherwise)."""
    if not SETTINGS.exists():
        raise RuntimeError(f"{SETTINGS} is missing: `make test` installs labkit's JupyterLab settings "
                           "(no news pop-up over the page)")
    served = workdir / "notebooks"
    served.mkdir(parents=True)
    for nb in NOTEBOOKS:
        shutil.copy(nb, served / nb.name)
    for name in LINKED:
        (workdir / name).symlink_to(ROOT / name)
    port, token = free_port(), secrets.token_hex(12)
    env = {**os.environ, "LABKIT_QUICK": "1" if quick else "0", **(extra_env or {})}
    if not quick:
        env.pop("LABKIT_QUICK")
    log = open(workdir / "jupyterlab.log", "w")
    process = subprocess.Popen(  # its own workspace and user settings: no tab or preference from another session
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={served}", "--LabApp.expose_app_in_browser=True",
         f"--LabApp.workspaces_dir={workdir / 'workspaces'}", f"--LabApp.user_settings_dir={workdir / 'settings'}",
         "--ServerApp.allow_root=True"], cwd=served, env=env, stdout=log, stderr=subprocess.STDOUT)
    lab = Lab(process, port, token, served)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited: see {workdir / 'jupyterlab.log'}")
        try:
            urllib.request.urlopen(lab.url("api/status"), timeout=2)
            return lab
        except OSError:
            time.sleep(0.5)
    lab.stop()
    raise RuntimeError("JupyterLab did not answer within 120 s")


# ---------------------------------------------------------------- what runs in the page

FINISHED = """() => {
    const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
    if (!nb) return false;
    const prompts = [...nb.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim());
    const kernel = window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel;
    const errored = [...nb.querySelectorAll('[data-mime-type="application/vnd.jupyter.stderr"]')]
        .some(e => e.textContent.includes('Traceback'));  // JupyterLab renders a traceback as stderr
    const done = prompts.length > 0 && prompts.every(t => /^\\[\\d+\\]:$/.test(t));
    return kernel?.status === 'idle' && !prompts.includes('[*]:') && (done || errored);
}"""

PROBLEMS = """() => {
    const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
    const found = [];
    const prompts = [...nb.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim());
    const skipped = prompts.filter(t => !/^\\[\\d+\\]:$/.test(t)).length;
    if (skipped) found.push(`${skipped} code cell(s) never ran`);
    for (const e of nb.querySelectorAll('[data-mime-type="application/vnd.jupyter.stderr"]')) {
        const text = e.textContent;  // a traceback is rendered as stderr; so are warnings, which are let through
        if (/Traceback|Error\b|Exception\b/.test(text)) found.push('error output: ' + text.slice(0, 400));
    }
    for (const img of nb.querySelectorAll('.jp-OutputArea img'))
        if (!img.complete || img.naturalWidth === 0)
            if (getComputedStyle(img).display !== 'none' && img.offsetParent !== null)
                found.push('broken image: ' + (img.src || '').slice(0, 80));
    for (const e of nb.querySelectorAll('.jp-OutputArea-output'))
        if (/Error displaying widget|Loading widget\\.\\.\\.|model not found/.test(e.textContent))
            found.push('widget not rendered: ' + e.textContent.slice(0, 200));
    for (const t of document.querySelectorAll('.Toastify__toast'))
        if (/Jupyter news/.test(t.textContent)) found.push('the news pop-up covers the page');
    return found;
}"""


class Browser:
    """Playwright's Chromium (Debian's binary) with one page at the workshop's window size."""

    def __init__(self):
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        self.browser = self._playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        self.page = self.browser.new_page(viewport=VIEWPORT)

    def close(self) -> None:
        self.browser.close()
        self._playwright.stop()


def open_notebook(page, lab: Lab, name: str) -> None:
    """``name`` alone in a workspace of its own: no tab restored from an earlier notebook can take the focus."""
    page.goto(lab.url(f"lab/workspaces/{secrets.token_hex(6)}/tree/{name}"))
    page.wait_for_function("""name => window.jupyterapp?.shell.currentWidget?.context?.path === name
                                    && document.querySelector('.jp-NotebookPanel .jp-Notebook')""",
                           arg=name, timeout=90_000)
    page.wait_for_function("""() => window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel
                                    ?.status === 'idle'""", timeout=90_000)


def run_all(page, lab: Lab, name: str, timeout_s: float = 300) -> float:
    """Open ``name``, press Run All, wait until every code cell has run (or an error stopped the run); the
    seconds it took."""
    open_notebook(page, lab, name)
    start = time.monotonic()
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(FINISHED, timeout=timeout_s * 1000, polling=500)
    return time.monotonic() - start


def page_problems(page) -> list[str]:
    return page.evaluate(PROBLEMS)


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


def close_notebook(page) -> None:
    """Shut the notebook's kernel down and close its tab without saving (the copy is thrown away anyway)."""
    page.evaluate("""async () => {
        const w = window.jupyterapp.shell.currentWidget;
        await w.sessionContext.shutdown();
        w.context.model.dirty = false;
        w.dispose();
    }""")
