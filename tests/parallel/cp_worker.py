"""One rank of tests/parallel/test_context_parallel.py (torchrun, gloo): every context-parallel variant, layout,
mask and dtype against one-rank attention over the whole sequence, every rank computing the reference from the
same seed; and the bytes counted at the collectives against labkit.parallel.cp.volume. Writes OUT/rankN.json."""
import itertools
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.metrics.timers import CommTimer
from labkit.parallel.cp import LAYOUTS, VARIANTS, attention, shard
from labkit.parallel.cp.volume import cp_wire_bytes

dist.init_process_group("gloo")
rank, cp = dist.get_rank(), dist.get_world_size()
B, H, S, D = 2, 4, 16, 8
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def reference(q, k, v, causal):
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def close(a, b, dtype) -> bool:
    try:
        torch.testing.assert_close(a, b, **TOLERANCE[dtype])
        return True
    except AssertionError:
        return False


results = {}
for variant, layout, causal, dtype in itertools.product(VARIANTS, LAYOUTS, (True, False), TOLERANCE):
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(B, H, S, D, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]
    d_out = torch.randn(B, H, S, D, generator=g, dtype=dtype)
    want = reference(*full, causal)
    want.backward(d_out)
    mine = [shard(t.detach(), rank, cp, layout).requires_grad_(True) for t in full]
    timer = CommTimer()
    got = attention(variant)(*mine, group=None, layout=layout, causal=causal, timer=timer)
    forward_bytes = timer.bytes
    got.backward(shard(d_out, rank, cp, layout))
    expected = cp_wire_bytes(variant, cp, mine[0].numel() * mine[0].element_size())
    results[f"{variant}-{layout}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"] = {
        "output": close(got, shard(want.detach(), rank, cp, layout), dtype),
        "grads": [close(m.grad, shard(f.grad, rank, cp, layout), dtype) for m, f in zip(mine, full)],
        "bytes": {"forward": forward_bytes, "backward": timer.bytes - forward_bytes}, "expected": expected}

try:  # Ulysses with heads that cp does not divide: refused, with the reason
    odd = torch.zeros(1, cp + 1, 2 * cp, 4)
    attention("ulysses")(odd, odd, odd)
    results["ulysses_odd_heads"] = "ran"
except ValueError as e:
    results["ulysses_odd_heads"] = str(e)

Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(results))
dist.barrier()
dist.destroy_process_group()
