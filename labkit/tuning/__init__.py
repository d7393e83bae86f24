"""Tuning: make a training run faster by walking the optimisation flowchart with real measurements.

* :mod:`labkit.tuning.flowchart` — the flowchart's decisions as pure functions: classify a
  measurement (communication-bound, compute-bound, utilisation OK), propose candidates, accept
  a trial only if it measured faster beyond the noise with a loss no worse.
* :mod:`labkit.tuning.runner` — :func:`~labkit.tuning.runner.optimize` walks the flowchart with
  real runs, logging every try as a :class:`~labkit.tuning.flowchart.Decision`.
"""
