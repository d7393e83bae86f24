"""labkit: a kit for teaching and experimenting with distributed deep-learning training.

Start here: ``labkit.load_config`` → ``labkit.launch(config, nproc=2)`` → ``Run``.
"""
import os

from labkit.config import Config, ConfigError, load_config, validate

__version__ = "0.1.0"

QUICK = os.environ.get("LABKIT_QUICK", "") not in ("", "0")
"""True under ``LABKIT_QUICK=1`` (the test run): notebooks shrink their work."""


def launch(config, nproc: int = 2, run_dir=None, overrides=None):
    """Start a run in the background and return a :class:`labkit.launch.Run`; see ``labkit.launch``."""
    from labkit.launch import launch as _launch

    return _launch(config, nproc=nproc, run_dir=run_dir, overrides=overrides)


__all__ = ["Config", "ConfigError", "load_config", "validate", "launch", "QUICK", "__version__"]
