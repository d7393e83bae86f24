"""The check that context-parallel attention is attention: one call against one rank's attention over the whole
sequence, forward and every gradient, on every rank of a real process group.

Context-parallel backward passes have shipped wrong gradients silently: the loss still falls, just not as it
should. The check needs nothing but the sequence's own numbers — every rank draws the same q, k, v and output
gradient from one seed, computes plain attention over the whole sequence, and compares its own rows of the
output and of dQ, dK, dV with what the context-parallel call gave it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.comm.axes import AxisGroup, counting, process_group
from labkit.metrics.timers import CommTimer
from labkit.parallel.cp.sharding import shard

TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def full_attention(q, k, v, causal: bool) -> torch.Tensor:
    """softmax(QKᵀ/√d [causal])·V over the whole sequence: the reference."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def gradient_check(f, layout: str, causal: bool = True, dtype=torch.float64, shape=(2, 4, 16, 8), group=None,
                   seed: int = 7) -> dict:
    """Run context-parallel attention ``f`` (``labkit.parallel.cp.attention(variant)``) once forward and backward
    on this rank's chunks; returns each of output, dq, dk, dv's largest error against the reference, whether all
    are within ``TOLERANCE[dtype]``, and the bytes the call sent (forward, backward)."""
    rank, cp = dist.get_rank(process_group(group)), dist.get_world_size(process_group(group))
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]
    d_out = torch.randn(*shape, generator=g, dtype=dtype)
    want = full_attention(*full, causal)
    want.backward(d_out)
    mine = [shard(t.detach(), rank, cp, layout).requires_grad_(True) for t in full]
    timer = CommTimer()
    with counting({"cp": timer}):  # the bytes f sends on the cp axis, forward and backward
        got = f(*mine, group=AxisGroup("cp", process_group(group)), layout=layout, causal=causal)
        sent_forward = timer.bytes
        got.backward(shard(d_out, rank, cp, layout))
    pairs = {"output": (got.detach(), want.detach()),
             **{f"d{n}": (m.grad, t.grad) for n, m, t in zip("qkv", mine, full)}}
    errors, ok = {}, True
    for name, (a, b) in pairs.items():
        b = shard(b, rank, cp, layout)  # this rank's rows of the reference
        errors[name] = (a - b).abs().max().item()
        ok = ok and torch.allclose(a, b, **TOLERANCE[dtype])
    return {"ok": ok, "errors": errors, "bytes": {"forward": sent_forward, "backward": timer.bytes - sent_forward},
            "block_bytes": mine[0].numel() * mine[0].element_size()}
