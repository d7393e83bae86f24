"""Pipeline parallelism: the layers split into stages on the ``pp`` ranks, micro-batches flowing through them.

labkit's own, from scratch: :mod:`~labkit.parallel.pp.pipeline` (the stage, GPipe and 1F1B over send/recv, the
bubble in theory). torch's beside it: :mod:`~labkit.parallel.pp.torch_pipelining`
(``torch.distributed.pipelining``'s schedules on the same stages).
"""
