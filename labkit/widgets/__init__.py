"""Notebook widgets: panels that build configs and dashboards that watch runs.

Widgets never touch process groups: they build a :class:`~labkit.config.Config`, call
:func:`labkit.launch`, and read the run directory through the :class:`~labkit.launcher.Run` handle.
"""
from labkit.widgets.dashboard import RunDashboard, dashboard_figure, render_png, summary_text
from labkit.widgets.panel import ConfigPanel

__all__ = ["ConfigPanel", "RunDashboard", "dashboard_figure", "render_png", "summary_text"]
