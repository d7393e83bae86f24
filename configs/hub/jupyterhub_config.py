"""JupyterHub for a workshop room: one machine, a seat per participant (``make hub``; see labkit/hub.py).

Settings come from the environment (checked by :func:`labkit.hub.hub_settings` before anything starts):
LABKIT_HUB_USERS (who may log in), LABKIT_HUB_PASSWORD (the room's shared password), LABKIT_HUB_CPUS (cores per
seat), LABKIT_HUB_MEMORY (RLIMIT_DATA per process), LABKIT_HUB_DIR (the hub's state, default .hub/), LABKIT_QUICK.
"""
import os
import sys
from pathlib import Path

from jupyterhub.spawner import SimpleLocalProcessSpawner

from jupyterhub.utils import random_port
from labkit.hub import (DIR_ENV, PROXY, apply_seat_limits, available_cores, hub_settings, prepare_home, seat_cores,
                        seat_env, seat_home)

c = get_config()  # noqa: F821 — jupyterhub's config loader provides it
settings = hub_settings()
state = settings.state_dir
state.mkdir(parents=True, exist_ok=True)
os.environ[DIR_ENV] = str(state)  # the proxy inherits it: labkit.hub.hub_processes finds it by it

c.JupyterHub.ip = "127.0.0.1"  # `make hub HUB_IP=0.0.0.0` opens it to the room's network
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = random_port()  # the hub's API and the proxy's: free ones, so two hubs on a machine never clash
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{random_port()}"
c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(state / "jupyterhub.pid")
c.JupyterHub.cleanup_servers = True  # stopping the hub stops every seat's server (and so its kernels and runs)
c.ConfigurableHTTPProxy.command = [str(PROXY)]
c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")

c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = settings.password
c.Authenticator.allowed_users = set(settings.users)


class LabkitSeatSpawner(SimpleLocalProcessSpawner):
    """Each user's server as this same system account, in its own home (a copy of the labs), on its own cores,
    under a per-process memory limit."""

    def seat(self) -> int:
        return settings.users.index(self.user.name) if self.user.name in settings.users else len(settings.users)

    def make_preexec_fn(self, name):
        home = Path(self.home_dir)
        cores = seat_cores(self.seat(), settings.cpus_per_seat, available_cores())

        def preexec():
            os.chdir(home / "notebooks")
            apply_seat_limits(cores, settings.memory_per_process)

        return preexec

    def user_env(self, env):
        return {**env, **seat_env(settings, self.user.name)}

    async def start(self):
        prepare_home(Path(self.home_dir))
        return await super().start()


c.JupyterHub.spawner_class = LabkitSeatSpawner
c.LabkitSeatSpawner.home_dir_template = str(seat_home(state, "{username}"))
c.Spawner.cmd = [str(Path(sys.executable).parent / "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~/notebooks"
c.Spawner.cpu_limit = float(settings.cpus_per_seat)  # what a seat sees in $CPU_LIMIT; the affinity enforces it
c.Spawner.mem_limit = settings.memory_per_process  # in $MEM_LIMIT; RLIMIT_DATA enforces it per process
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
# window.jupyterapp: the browser test and benchmarks/hub_sizing.py drive each seat's JupyterLab through it
c.Spawner.args = ["--LabApp.expose_app_in_browser=True", *(["--ServerApp.allow_root=True"] if os.geteuid() == 0 else [])]
