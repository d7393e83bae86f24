"""labkit: a kit for teaching and experimenting with distributed deep-learning training.

Start here: ``labkit.load_config`` → ``labkit.launch(config, nproc=2)`` → ``Run``.
"""
import os

from labkit.config import Config, ConfigError, load_config
from labkit.validation import validate
from labkit.launcher import Run, launch, open_run
from labkit.recordings import RecordedRun, replay

__version__ = "0.1.0"

QUICK = os.environ.get("LABKIT_QUICK", "") not in ("", "0")
"""True under ``LABKIT_QUICK=1`` (the test run): notebooks shrink their work."""


__all__ = ["Config", "ConfigError", "load_config", "validate", "launch", "Run", "open_run", "RecordedRun", "replay",
           "QUICK", "__version__"]
