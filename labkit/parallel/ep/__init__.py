"""Expert parallelism: each MoE layer's experts spread over the ``ep`` axis, the tokens sent to them and back.

A mixture-of-experts layer (:mod:`labkit.model.moe`) holds E MLPs, each token using k of them. With E large the
experts are most of the model's parameters, yet every token needs only k: so instead of every data-parallel
replica holding all E, ``ep`` of the replicas split them — E/ep each — and each token travels to the rank that
holds its expert and back (GShard, Lepikhin et al. 2020; Switch Transformer; torchtitan's ``ExpertParallel``).
The ep ranks are data-parallel ranks (:mod:`labkit.parallel.mesh`: the innermost ``ep`` of dp): each still reads
its own sequences and computes the rest of the model whole. So in one step

* **attention, embeddings, router, dense MLPs, shared expert** are held alike by every data-parallel rank: their
  gradients average over all of dp × cp (:data:`labkit.parallel.mesh.GRADIENT_AXIS`), by the data-parallel
  strategy, as without experts;
* **the experts** are held alike only by the ranks at the same ep coordinate (``expert_dp_cp``, dp × cp without
  ep): their gradients are summed there and divided by the number of data-parallel ranks
  (:func:`expert_gradient_hook`) — each expert's local gradient already holds every token its ep group sent it;
* **every MoE layer**, in forward and again in backward, sends each token to its experts' ranks and the result
  back: two all-to-alls with uneven splits (:mod:`labkit.parallel.ep.dispatch`), counted on the ``ep`` axis.

:func:`apply_expert_parallel` cuts the experts (each rank keeps its E/ep, made real from the values the one-rank
GPT would have); parameters are flagged (:func:`is_expert`) so the data-parallel strategies leave them to the hook
(those that cannot hold them apart refuse ep: ``refuses`` in :mod:`labkit.parallel.spec`). Saving gathers them back
(:func:`gather_experts`), so a run with experts spread saves what one process would.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from labkit.comm import collectives as comm
from labkit.parallel.ep.dispatch import combine_expert_parallel
from labkit.parallel.mesh import EXPERT_GRADIENT_AXIS, GRADIENT_AXIS

EXPERT = "_labkit_expert"  # the flag on a parameter that is one rank's part of the experts under ep > 1


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` holds this rank's experts apart from the other ep ranks' (summed by the expert hook, not the
    data-parallel strategy)."""
    return getattr(p, EXPERT, False)


def apply_expert_parallel(model: nn.Module, grid, make_real=None) -> nn.Module:
    """Keep this rank's E/ep experts of every MoE layer of ``model`` (in place) and route through the ep axis's
    all-to-all; ep = 1 leaves it. An expert tensor on the meta device is made real whole first (``make_real``,
    :func:`labkit.parallel.parallelize.part_maker`), so each slice holds what the one-rank GPT's does."""
    from labkit.model.moe import MoE

    ep = grid.size("ep")
    if ep == 1:
        return model
    group, index = grid.axis_group("ep"), grid.coord("ep")
    for name, layer in model.named_modules():
        if isinstance(layer, MoE):
            if make_real is not None:
                make_real(layer.experts, f"{name}.experts")
            keep_experts(layer, index, ep)
            layer.expert_parallel = partial(combine_expert_parallel, group=group, ep=ep, impl=layer.moe.impl)
    return model


@torch.no_grad()
def keep_experts(layer, index: int, ep: int) -> None:
    """``layer``'s experts cut to the ``index``-th of ``ep`` equal blocks (experts index·E/ep onwards), flagged."""
    for linear in (layer.experts.fc, layer.experts.proj):
        for key, p in list(linear._parameters.items()):
            if p is None:
                continue
            part = p.size(0) // ep
            local = nn.Parameter(p[index * part:(index + 1) * part].clone(), requires_grad=p.requires_grad)
            setattr(local, EXPERT, True)
            linear._parameters[key] = local


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every flagged expert tensor of ``model``, in the model's order."""
    return [(name, p) for name, p in model.named_parameters() if is_expert(p)]


def expert_gradient_hook(model: nn.Module, grid):
    """A strategy's gradient hook for the experts under ep > 1 (None otherwise): their gradients summed over the
    ranks that hold the same experts (``expert_dp_cp``) in one flat all-reduce, and divided by the number of
    data-parallel ranks — the average over every rank's tokens, as the strategy's is for the other parameters."""
    params = [p for _, p in expert_parameters(model) if p.requires_grad]
    if not params:
        return None
    group, ranks = grid.axis_group(EXPERT_GRADIENT_AXIS), grid.size(GRADIENT_AXIS)

    def average_expert_gradients() -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group)
        flat.div_(ranks)
        for p, part in zip(params, flat.split([g.numel() for g in grads])):
            p.grad = part.view_as(p)
    return average_expert_gradients


def gather_experts(state: dict, model: nn.Module, grid) -> dict:
    """``state`` (this rank's ``state_dict``) with every expert tensor gathered whole over the ep axis, experts in
    order (a collective: every ep rank calls it)."""
    names = {name for name, _ in expert_parameters(model)}
    if grid.size("ep") == 1 or not names:
        return state
    group, ep = grid.axis_group("ep"), grid.size("ep")
    whole = {}
    for key, value in state.items():
        if key in names:
            gathered = value.new_empty((ep * value.size(0), *value.shape[1:]))
            comm.all_gather(gathered, value.contiguous(), group)
            value = gathered
        whole[key] = value
    return whole
