"""Notebook widgets: panels that build configs and dashboards that watch runs.

Widgets never touch process groups: they build a :class:`~labkit.config.Config`, call
:func:`labkit.launch`, and read the run directory through the :class:`~labkit.launcher.Run` handle.
Labs that compare settings run them through :mod:`labkit.experiments`; the numbers they show come
from the library next to what they analyse, and every figure is drawn with :mod:`labkit.plots`.
"""
from labkit.widgets.dashboard import RunDashboard, dashboard_figure, summary_text
from labkit.widgets.panel import ConfigPanel

__all__ = ["ConfigPanel", "RunDashboard", "dashboard_figure", "summary_text"]
