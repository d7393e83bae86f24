"""Reading runs back beside the theory, apart from the techniques that made them.

:mod:`~labkit.parallel.reports.data_parallel` — what each data-parallel strategy cost in time, bytes and memory,
and the per-rank predictions; :mod:`~labkit.parallel.reports.layout` — what a split run measured (bubble, bytes
per layer, memory per rank, the step's split); :mod:`~labkit.parallel.reports.activation_memory` — activations
per rank beside the estimate.
"""
