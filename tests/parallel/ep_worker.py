"""One MoE layer with its experts spread over ep ranks against the one-rank layer holding all of them, on every rank's
own tokens: ``torchrun --nproc-per-node 4 ep_worker.py OUT`` (tests/parallel/test_expert_parallel.py).

For ep ∈ {2, 4} (world 4: two ep groups of 2, or one of 4), the grouped matmul and the loop, dropless and with a
capacity: the output and the tokens' and router's gradients equal the reference's on this rank's tokens; each
expert's gradient equals the reference gradients summed over the ep group (every token the group sent it), in fp32.
The bytes counted at the collective are the rows this rank sent to the others' experts (and got back), d values each.
Each rank writes what it saw to OUT/rank{r}.json; an assertion that fails exits non-zero.
"""
import copy
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.comm.axes import counting
from labkit.comm.network import LOOPBACK, Network, set_network
from labkit.metrics.timers import CommTimer
from labkit.model.moe import MoE, MoEShape
from labkit.parallel.ep import keep_experts
from labkit.parallel.ep.dispatch import combine_expert_parallel
from labkit.parallel.mesh import ParallelDims, build_grid

TOKENS, WIDTH, EXPERTS, TOP_K = 24, 16, 8, 2


def reference_layer(impl: str, capacity) -> MoE:
    torch.manual_seed(0)  # the same whole layer on every rank
    layer = MoE(MoEShape(experts=EXPERTS, top_k=TOP_K, capacity_factor=capacity, balance="none", impl=impl), WIDTH,
                bias=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def run(layer: MoE, tokens: torch.Tensor, weights: torch.Tensor):
    x = tokens.clone().requires_grad_()
    out = layer(x.view(2, -1, WIDTH))
    (out.reshape(-1, WIDTH) * weights).sum().backward()
    return out.reshape(-1, WIDTH).detach(), x.grad


def check(grid, ep: int, impl: str, capacity) -> dict:
    rank = dist.get_rank()
    reference = reference_layer(impl, capacity)
    spread = copy.deepcopy(reference)
    keep_experts(spread, grid.coord("ep"), ep)
    spread.expert_parallel = partial(combine_expert_parallel, group=grid.axis_group("ep"), ep=ep, impl=impl)
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own tokens
    tokens, weights = torch.randn(TOKENS, WIDTH, generator=g), torch.randn(TOKENS, WIDTH, generator=g)
    want_out, want_dx = run(reference, tokens, weights)
    timer = CommTimer()
    with counting({"ep": timer}):
        got_out, got_dx = run(spread, tokens, weights)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(spread.router.weight.grad, reference.router.weight.grad, rtol=1e-5, atol=1e-6)
    local, index = EXPERTS // ep, grid.coord("ep")
    for name in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"):
        whole = reference.experts.get_parameter(name).grad.clone()
        dist.all_reduce(whole, group=grid.group("ep"))  # every token of the ep group, as the spread experts saw
        torch.testing.assert_close(spread.experts.get_parameter(name).grad, whole[index * local:(index + 1) * local],
                                   rtol=1e-5, atol=1e-6)
    _, chosen, _, kept = reference.route(tokens)
    per_expert = torch.bincount(chosen[kept], minlength=EXPERTS)
    group_counts = [torch.empty_like(per_expert) for _ in range(ep)]
    dist.all_gather(group_counts, per_expert, group=grid.group("ep"))
    mine = slice(index * local, (index + 1) * local)
    sent = int(per_expert.sum() - per_expert[mine].sum())  # rows whose expert another rank holds
    received = sum(int(c[mine].sum()) for j, c in enumerate(group_counts) if j != index)
    return {"ep": ep, "impl": impl, "capacity": capacity, "rank": rank, "rows_sent": sent, "rows_received": received,
            "kept": int(kept.sum()), "dropped": int((~kept).sum()), "bytes": timer.bytes, "calls": timer.calls,
            # forward: dispatch sends `sent` rows, combine returns `received`; backward the other way round; fp32
            "row_bytes": 2 * (sent + received) * WIDTH * 4,
            "count_bytes": 8 * EXPERTS * (ep - 1) // ep}  # one exchange of int64 counts, forward only


def held(grid, ep: int, latency_s: float = 0.05) -> dict:
    """One forward and backward of the spread layer with an emulated network of ``latency_s`` per round: each of its
    five all-to-alls (counts, dispatch, combine, and both back) takes ep − 1 pairwise rounds on the emulated link."""
    layer = reference_layer("grouped", None)
    keep_experts(layer, grid.coord("ep"), ep)
    layer.expert_parallel = partial(combine_expert_parallel, group=grid.axis_group("ep"), ep=ep, impl="grouped")
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    tokens, weights = torch.randn(TOKENS, WIDTH, generator=g), torch.randn(TOKENS, WIDTH, generator=g)
    set_network(Network(latency_s=latency_s))
    try:
        start = time.perf_counter()
        run(layer, tokens, weights)
        elapsed = time.perf_counter() - start
    finally:
        set_network(LOOPBACK)
    return {"ep": ep, "held_s": elapsed, "modelled_s": 5 * (ep - 1) * latency_s}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    seen = []
    for ep in (2, 4):
        grid = build_grid(ParallelDims(dp=4, ep=ep), dist.get_rank(), "cpu")
        for impl in ("grouped", "loop"):
            for capacity in (None, 1.0):
                seen.append(check(grid, ep, impl, capacity))
        seen.append(held(grid, ep))
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)
