"""Tensor parallelism: each layer's weights split across the ``tp`` ranks (Megatron-LM, Shoeybi et al. 2019).

labkit's own, from scratch: :mod:`~labkit.parallel.tp.layers` (column- and row-parallel linears, the attention
split by heads), :mod:`~labkit.parallel.tp.model` (the GPT's embedding and head split over the vocabulary),
:mod:`~labkit.parallel.tp.sequence` (sequence parallelism for the norms and dropout between them). torch's beside
them: :mod:`~labkit.parallel.tp.dtensor` (a DTensor plan). The bytes each sends, in theory:
:mod:`~labkit.parallel.tp.volume`.
"""
