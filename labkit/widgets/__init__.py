"""Notebook widgets: panels that build configs and dashboards that watch runs.

Widgets never touch process groups: they build a :class:`~labkit.config.Config`, call
:func:`labkit.launch`, and read the run directory through the :class:`~labkit.launcher.Run` handle.
Labs that compare settings run them through :mod:`labkit.experiments`; the numbers they show come
from the library next to what they analyse, and every figure is drawn with :mod:`labkit.plots`.

The names below are imported on first use, so that a process that needs one widget module (the dashboard's
painter process draws figures and never trains) does not import torch with the others.
"""
import importlib

_HOMES = {"ConfigPanel": "labkit.widgets.panel", "RunDashboard": "labkit.widgets.dashboard",
          "dashboard_figure": "labkit.widgets.dashboard", "summary_text": "labkit.widgets.dashboard"}

__all__ = ["ConfigPanel", "RunDashboard", "dashboard_figure", "summary_text"]


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'labkit.widgets' has no attribute {name!r}")
