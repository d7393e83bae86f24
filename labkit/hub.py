"""One machine serves the room: JupyterHub with a seat per participant (``make hub``).

The hub (PyPI ``jupyterhub``, its proxy ``configurable-http-proxy`` from npm under ``.hub/``) listens on 127.0.0.1
unless told otherwise and is configured by ``configs/hub/jupyterhub_config.py``, which reads its settings through
:func:`hub_settings`. Every participant's server runs as the same system account (no system users are made), from
the same ``.venv`` (so labkit's kernel is registered once, in the venv), in a home of its own, ``.hub/users/NAME/``:
a copy of the notebooks beside links to the folders they read (:func:`prepare_home`). So each seat's runs
(``notebooks/runs/``, the notebooks' ``run.runs_dir``), its run store (``$LABKIT_RUN_STORE``, set there too) and
its labkit cache are its own; rendezvous ports are the kernel's free ones (:func:`labkit.launcher.free_port`), and a
run's ``launch.json`` records which it took.

The limits each seat runs under, set on its server before it starts and inherited by its kernels and workers:

- **CPU**: the cores it may run on (its affinity, :func:`seat_cores`), which labkit's own core count
  (:func:`labkit.cpu.usable_cores`) reads, so a seat's workers take threads for its cores, not the machine's.
- **memory**: ``RLIMIT_DATA`` on every process of the seat (a process past it gets ``MemoryError``). It caps each
  process, not the seat's sum: a hard cap on a seat's total needs control groups (systemd or a container), which
  this spawner does not set up.

Every process of the hub carries ``LABKIT_HUB_DIR`` in its environment (and a seat's, ``LABKIT_HUB_SEAT``), which is
how :func:`hub_processes` finds them: the sizing benchmark sums a seat's memory and CPU over them, and the browser
test checks that none outlives the hub.
"""
from __future__ import annotations

import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

ROOT = Path(__file__).resolve().parents[1]
HUB_DIR = ROOT / ".hub"  # the hub's state (its database, cookie secret, the seats' homes) and the npm proxy
CONFIG = ROOT / "configs" / "hub" / "jupyterhub_config.py"
PROXY = HUB_DIR / "node_modules" / ".bin" / "configurable-http-proxy"
LINKED = ("configs", "datasets", "benchmarks")  # what the notebooks read through ../
DIR_ENV, SEAT_ENV = "LABKIT_HUB_DIR", "LABKIT_HUB_SEAT"
USER_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class HubError(ValueError):
    """A hub setting that cannot work, said before the hub starts."""


@dataclass(frozen=True)
class HubSettings:
    """What an instructor sets (environment variables, see :func:`hub_settings`)."""
    users: tuple[str, ...]
    password: str
    cpus_per_seat: int
    memory_per_process: Optional[int]  # bytes of RLIMIT_DATA; None: no cap
    state_dir: Path = HUB_DIR
    quick: bool = False


def parse_memory(text: str) -> Optional[int]:
    """``"4G"``, ``"512M"``, ``"1073741824"`` → bytes; ``""``, ``"0"`` or ``"none"`` → None (no cap)."""
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    if cleaned in ("", "0", "NONE"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)", cleaned)
    if not match:
        raise HubError(f"memory limit {text!r}: write a size such as 4G or 512M (or 0 for none)")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def parse_users(text: str) -> tuple[str, ...]:
    """A comma- or space-separated list of user names (lower-case letters, digits, ``-``, ``_``)."""
    names = tuple(dict.fromkeys(n for n in re.split(r"[,\s]+", text.strip()) if n))
    bad = [n for n in names if not USER_NAME.match(n)]
    if bad:
        raise HubError(f"user name(s) {bad}: each starts with a lower-case letter, then letters, digits, - or _ "
                       "(at most 32)")
    if not names:
        raise HubError("LABKIT_HUB_USERS names no user: list the room's names, e.g. LABKIT_HUB_USERS=ana,ben,chen")
    return names


def hub_settings(environ: Mapping[str, str] = os.environ) -> HubSettings:
    """The hub's settings from the environment, checked: ``LABKIT_HUB_USERS`` (who may log in),
    ``LABKIT_HUB_PASSWORD`` (the room's shared password, at least 8 characters), ``LABKIT_HUB_CPUS`` (cores per
    seat, default 2, or all the cores where fewer), ``LABKIT_HUB_MEMORY`` (RLIMIT_DATA per process, default 4G),
    ``LABKIT_HUB_DIR`` (the state folder, default ``.hub``) and ``LABKIT_QUICK`` (passed on to every seat)."""
    password = environ.get("LABKIT_HUB_PASSWORD", "")
    if len(password) < 8:
        raise HubError("set LABKIT_HUB_PASSWORD to the room's shared password (at least 8 characters): "
                       "every listed user logs in with it")
    cores = len(available_cores())
    cpus_text = environ.get("LABKIT_HUB_CPUS", str(min(2, cores)))
    if not cpus_text.isdigit() or int(cpus_text) < 1:
        raise HubError(f"LABKIT_HUB_CPUS={cpus_text!r}: the cores each seat may use, a whole number ≥ 1")
    if int(cpus_text) > cores:
        raise HubError(f"LABKIT_HUB_CPUS={cpus_text} but this machine lets the hub use {cores} core(s)")
    return HubSettings(users=parse_users(environ.get("LABKIT_HUB_USERS", "")), password=password,
                       cpus_per_seat=int(cpus_text),
                       memory_per_process=parse_memory(environ.get("LABKIT_HUB_MEMORY", "4G")),
                       state_dir=Path(environ.get(DIR_ENV) or HUB_DIR).resolve(),
                       quick=environ.get("LABKIT_QUICK", "") not in ("", "0"))


# ---------------------------------------------------------------- a seat: its home, cores, limits, environment

def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def seat_cores(seat: int, cpus_per_seat: int, cores: list[int]) -> list[int]:
    """The cores of seat number ``seat`` (0, 1, …): consecutive blocks of ``cpus_per_seat``, dealt round the
    machine's cores, so seats share a core only once every core has a seat."""
    if not 1 <= cpus_per_seat <= len(cores):
        raise HubError(f"{cpus_per_seat} core(s) per seat on a machine with {len(cores)}")
    start = seat * cpus_per_seat
    return sorted({cores[(start + i) % len(cores)] for i in range(cpus_per_seat)})


def seat_home(state_dir: Path, user: str) -> Path:
    return Path(state_dir) / "users" / user


def seat_store(state_dir: Path, user: str) -> Path:
    """A seat's run store: its notebooks' ``runs/labkit-runs.sqlite`` (the instructor's board reads each)."""
    return seat_home(state_dir, user) / "notebooks" / "runs" / "labkit-runs.sqlite"


def seat_stores(state_dir: Path) -> dict[str, Path]:
    """``{user: run store}`` for every seat of the hub in ``state_dir`` whose store exists."""
    users = sorted(p.name for p in (Path(state_dir) / "users").glob("*") if p.is_dir())
    return {u: seat_store(state_dir, u) for u in users if seat_store(state_dir, u).exists()}


def prepare_home(home: Path, repo: Path = ROOT) -> Path:
    """A seat's home: ``notebooks/`` (a copy of the labs, made once: a participant's edits are never overwritten)
    beside links to ``configs/``, ``datasets/`` and ``benchmarks/``. Returns the notebooks folder."""
    notebooks = home / "notebooks"
    notebooks.mkdir(parents=True, exist_ok=True)
    for lab in sorted((repo / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        if not (notebooks / lab.name).exists():
            shutil.copy(lab, notebooks / lab.name)
    for name in LINKED:
        if not (home / name).is_symlink():
            (home / name).symlink_to(repo / name)
    return notebooks


def seat_env(settings: HubSettings, user: str) -> dict[str, str]:
    """What a seat's server (and so its kernels and workers) runs with beside jupyterhub's own variables."""
    home = seat_home(settings.state_dir, user)
    env = {DIR_ENV: str(settings.state_dir), SEAT_ENV: user, "HOME": str(home), "USER": user,
           "LABKIT_RUN_STORE": str(seat_store(settings.state_dir, user)),
           "LABKIT_CACHE_DIR": str(home / ".cache" / "labkit"), "PATH": f"{Path(sys.executable).parent}:"
           + os.environ.get("PATH", "/usr/bin:/bin")}
    if settings.quick:
        env["LABKIT_QUICK"] = "1"
    return env


def apply_seat_limits(cores: list[int], memory_per_process: Optional[int]) -> None:
    """Run in the seat's server process before it starts (and so inherited by all it starts): its cores and its
    per-process data limit."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    if memory_per_process:
        resource.setrlimit(resource.RLIMIT_DATA, (memory_per_process, memory_per_process))


# ---------------------------------------------------------------- the hub's processes

def process_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def live(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def hub_processes(state_dir: Path) -> dict[int, Optional[str]]:
    """Every live process of the hub whose state is ``state_dir``: pid → the seat it serves (None: the hub itself
    or its proxy). Read from each process's environment (``/proc/PID/environ``)."""
    wanted, found = str(Path(state_dir).resolve()), {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            env = process_env(int(entry))
            if env.get(DIR_ENV) == wanted and live(int(entry)):
                found[int(entry)] = env.get(SEAT_ENV)
    return found


@dataclass
class Hub:
    """A running JupyterHub: its port, state folder and process."""
    process: subprocess.Popen
    port: int
    state_dir: Path
    users: tuple[str, ...] = field(default=())

    def url(self, path: str = "hub/login") -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def stop(self, timeout_s: float = 60) -> list[int]:
        """SIGTERM to the hub (it stops every seat's server and its proxy), then wait until none of its processes
        is left; any still there after ``timeout_s`` are killed. Returns the pids that had to be killed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while hub_processes(self.state_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        killed = list(hub_processes(self.state_dir))
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(10)
        return killed


def hub_command(port: int, ip: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "jupyterhub", "-f", str(CONFIG), f"--ip={ip}", f"--port={port}"]


def check_installed() -> None:
    """The hub's two programs, with what to run when one is missing."""
    try:
        import jupyterhub  # noqa: F401
    except ImportError as missing:
        raise HubError("jupyterhub is not installed: `make hub` installs it (pip install -e '.[hub]')") from missing
    if not PROXY.exists():
        raise HubError(f"{PROXY} is missing: `make hub` installs it (npm install --prefix .hub "
                       "configurable-http-proxy)")


def start_hub(state_dir: Path, port: int, users: tuple[str, ...], password: str, *, cpus_per_seat: int = 1,
              memory: str = "4G", quick: bool = True, timeout_s: float = 120) -> Hub:
    """Start JupyterHub with ``configs/hub/jupyterhub_config.py`` on 127.0.0.1:``port``, its state in ``state_dir``;
    return once its login page answers."""
    check_installed()
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, DIR_ENV: str(state_dir), "LABKIT_HUB_USERS": ",".join(users),
           "LABKIT_HUB_PASSWORD": password, "LABKIT_HUB_CPUS": str(cpus_per_seat), "LABKIT_HUB_MEMORY": memory,
           "LABKIT_QUICK": "1" if quick else "0", "CONFIGPROXY_AUTH_TOKEN": secrets.token_hex(16),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}  # this labkit
    hub_settings(env)  # a bad setting fails here, in the caller, not in the hub's log
    log = open(state_dir / "jupyterhub.log", "ab")
    process = subprocess.Popen(hub_command(port), cwd=state_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    hub = Hub(process, port, state_dir, tuple(users))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            hub.stop()
            raise RuntimeError(f"JupyterHub exited (code {process.returncode}): see {state_dir / 'jupyterhub.log'}")
        try:
            urllib.request.urlopen(hub.url("hub/login"), timeout=2)
            return hub
        except OSError:
            time.sleep(0.5)
    hub.stop()
    raise RuntimeError(f"JupyterHub did not answer within {timeout_s:.0f} s: see {state_dir / 'jupyterhub.log'}")


def main() -> None:
    """``python -m labkit.hub`` (``make hub`` runs it first): the installs and settings checked, and said."""
    try:
        settings = hub_settings()
        check_installed()
    except HubError as error:
        raise SystemExit(f"labkit hub: {error}") from None
    memory = f"{settings.memory_per_process / 2**30:g} GiB" if settings.memory_per_process else "no cap"
    print(f"labkit hub: {len(settings.users)} seat(s) ({', '.join(settings.users)}), {settings.cpus_per_seat} "
          f"core(s) each of {len(available_cores())}, data limit per process {memory}, state in {settings.state_dir}")


if __name__ == "__main__":
    main()


SIZING_BEGIN, SIZING_END = "<!-- hub sizing: begin -->", "<!-- hub sizing: end -->"


def sizing_table(measured: dict, estimate: dict) -> str:
    """The README's sizing table, from ``benchmarks/results/hub_sizing.jsonl``'s newest measured record and the
    estimate made from it: per seat count, the memory and CPU a seat took during the lab, then the labelled
    estimate for larger rooms."""
    settings = measured["settings"]
    lines = [f"Measured by `benchmarks/hub_sizing.py` at {measured['commit'][:7]} on {settings['cores']} cores: every "
             f"seat runs notebook {settings['notebook'][:2]} ({settings['mode']} mode) at once, "
             f"{settings['cpus_per_seat']} core(s) per seat.", "",
             "| seats | load before | peak memory per seat (PSS) | CPU seconds per seat | seconds per lab "
             "| hub's own |",
             "|---|---|---|---|---|---|"]
    for row in measured["rows"]:
        lines.append(f"| {row['seats']} | {row['load_1min_before']:.2f} | {row['peak_pss_mib_per_seat']:,} MiB | "
                     f"{row['cpu_s_per_seat']:.1f} | {row['seconds_per_lab']:.1f} | {row['hub_pss_mib']} MiB |")
    lines += ["", "| seats (**estimate**) | memory | cores to keep every seat at the one-seat pace |", "|---|---|---|"]
    lines += [f"| {row['seats']} | {row['memory_gib']:.1f} GiB | {row['cores_at_one_seat_pace']:.1f} |"
              for row in estimate["rows"]]
    return "\n".join(lines + ["", f"The estimate's basis: {estimate['rows'][0]['basis']}"])
