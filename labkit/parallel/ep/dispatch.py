"""Tokens to their experts and back: expert parallelism's two all-to-alls, one MoE layer's forward.

Each of the ep ranks holds E/ep of a layer's E experts — rank j experts j·E/ep … (j+1)·E/ep − 1 — and routes its
own tokens over all E (the router is replicated). A forward then runs (:func:`combine_expert_parallel`):

1. **sort**: this rank's kept assignments sorted by expert (token order within each, as the one-rank layer does,
   :func:`labkit.model.moe.combine_grouped`), so each rank's rows are one contiguous block: ``counts[e]`` rows
   for expert e;
2. **exchange the counts** (:func:`exchange_counts`): how many rows each rank will receive from each other one is
   not known in advance — it is what the routers chose — so a small all-to-all of the counts goes first;
3. **dispatch**: one all-to-all with uneven splits moves every row to the rank holding its expert
   (:func:`all_to_all_rows`; rows arrive grouped by source rank, by expert within each);
4. **compute**: the rows regrouped by local expert (:func:`by_local_expert`), each expert on its rows (the grouped
   matmul or the loop, as ``model.moe.impl`` says), put back in arrival order;
5. **combine**: the reverse all-to-all returns every output row to the rank its token lives on, in the order it
   was sent; each is weighted by its gate and added to its token.

The all-to-all is differentiable (:class:`_AllToAll`): its backward is the all-to-all with the splits swapped, so
each expert's gradient collects every rank's tokens, and each token's gradient comes home. Per layer and rank the
rows sent each way are the kept assignments whose expert is elsewhere: at perfect balance
k·T·(ep − 1)/ep of them, d values each — 2·k·T·d·(ep − 1)/ep values for dispatch and combine, and as much again
in backward. Everything sent is counted on the ``ep`` axis (:mod:`labkit.comm.axes`).
"""
from __future__ import annotations

import torch

from labkit.comm import collectives as comm


class _AllToAll(torch.autograd.Function):
    """Rows to ranks, uneven: ``in_splits[j]`` of ``rows`` go to rank j, ``out_splits[j]`` come back from it.
    Backward sends each row's gradient the way it came (the splits swapped)."""

    @staticmethod
    def forward(ctx, rows, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        comm.all_to_all(out, rows.contiguous(), group, output_split_sizes=out_splits, input_split_sizes=in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def all_to_all_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """``rows`` cut by ``in_splits`` to the ranks of ``group``, what they send here (``out_splits``) returned."""
    return _AllToAll.apply(rows, out_splits, in_splits, group)


def exchange_counts(counts: torch.Tensor, ep: int, group) -> torch.Tensor:
    """``counts`` (E,): the rows this rank has for each expert → (ep, E/ep): the rows each rank has for each of this
    rank's experts (row j: what rank j will send). One small all-to-all of counts, before the rows."""
    received = torch.empty_like(counts)
    comm.all_to_all(received, counts.contiguous(), group)
    return received.view(ep, -1)


def by_local_expert(received: torch.Tensor) -> torch.Tensor:
    """The permutation that regroups rows arriving source by source (each source's by expert) into expert by
    expert (source order within each): ``received`` (ep, E_local) the counts from :func:`exchange_counts`."""
    ep, local = received.shape
    expert_of_row = torch.arange(local, device=received.device).repeat(ep).repeat_interleave(received.reshape(-1))
    return torch.argsort(expert_of_row, stable=True)


def run_local_experts(experts, rows: torch.Tensor, counts: torch.Tensor, impl: str) -> torch.Tensor:
    """This rank's experts on their rows (sorted by local expert, ``counts[e]`` each): one grouped matmul per layer,
    or the loop."""
    if impl == "grouped":
        return experts.grouped(rows, counts)
    parts = rows.split(counts.tolist())
    return torch.cat([experts.one(e, part) for e, part in enumerate(parts)]) if parts else rows


def combine_expert_parallel(experts, tokens, chosen, gates, kept, *, group, ep: int, impl: str) -> torch.Tensor:
    """One MoE layer's expert output for this rank's ``tokens`` (T, d), its experts spread over the ``ep`` ranks of
    ``group`` (``experts``: this rank's E/ep); the module docstring's five steps. Equal to the one-rank layer's
    :func:`labkit.model.moe.combine_grouped` with all E experts, up to the rounding of a matmul over other rows."""
    experts_total = experts.fc.weight.size(0) * ep
    token, slot = torch.where(kept)  # 1. sort: the kept assignments, by expert
    expert = chosen[token, slot]
    order = torch.argsort(expert, stable=True)
    token, slot, expert = token[order], slot[order], expert[order]
    counts = torch.bincount(expert, minlength=experts_total)
    received = exchange_counts(counts, ep, group)  # 2. how many rows arrive from each rank, for each local expert
    send = counts.view(ep, -1).sum(dim=1).tolist()
    arrive = received.sum(dim=1).tolist()
    rows = all_to_all_rows(tokens[token], arrive, send, group)  # 3. dispatch
    regroup = by_local_expert(received)  # 4. compute, by local expert, then back in arrival order
    out = run_local_experts(experts, rows[regroup], received.sum(dim=0), impl)
    out = out[torch.argsort(regroup)]
    back = all_to_all_rows(out, send, arrive, group)  # 5. combine: home, in the order sent
    contribution = gates[token, slot, None] * back
    return torch.zeros_like(tokens).index_add(0, token, contribution.to(tokens.dtype))
