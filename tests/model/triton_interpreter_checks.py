"""Run labkit's Triton FlashAttention kernels under Triton's CPU interpreter; print the results as JSON.

Run by tests/model/test_flash_triton.py in a subprocess with TRITON_INTERPRET=1: the variable must be set
before the kernels are decorated (``triton.jit`` reads it), which another test of the same pytest
process may already have done without it.
"""
import json
import os

import torch

from helpers import gpt_loss_and_grads
from labkit.model.flash_triton import TritonFlashAttentionFunction, interpreted, triton_flash_attention
from test_flash import reference_attention as reference


def rel_err(a, b):
    """||a − b|| / ||b||; absolute when b is zero (dQ, dK of a one-token sequence)."""
    a, b = a.double(), b.double()
    return (a - b).norm().item() / (b.norm().item() or 1.0)


def compare(shape, causal, block_q, block_k, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    out = triton_flash_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    d_out = torch.randn(shape, generator=gen).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = reference(*ref_in, causal)
    ref_grads = torch.autograd.grad(ref, ref_in, d_out.double())
    mine = (out, *grads)
    return {"shape": list(shape), "causal": causal, "dtype": str(dtype),
            "dtypes_kept": all(t.dtype == dtype and t.shape == q.shape for t in mine),
            "finite": all(bool(torch.isfinite(t).all()) for t in mine),
            "errors": {name: rel_err(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), mine, (ref, *ref_grads))}}


def saved_shapes(seq):
    q, k, v = (torch.randn(1, 2, seq, 16, requires_grad=True) for _ in range(3))
    shapes = []

    def pack(t):
        shapes.append(list(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = triton_flash_attention(q, k, v, block_q=16, block_k=16)
    return {"shapes": shapes, "grad_fn": type(out.grad_fn).__name__}


def dots(causal, seq=64, block=16):
    """tl.dot calls of forward + backward: one count per (query block × key block) tile visited, times a constant."""
    from triton.runtime.interpreter import InterpreterBuilder

    original, calls = InterpreterBuilder.create_dot, [0]

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    InterpreterBuilder.create_dot = counting
    try:
        q, k, v = (torch.randn(1, 1, seq, 16, requires_grad=True) for _ in range(3))
        out = triton_flash_attention(q, k, v, causal=causal, block_q=block, block_k=block)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        InterpreterBuilder.create_dot = original
    return calls[0]


def main():
    results = {"interpreted": interpreted(), "env": os.environ.get("TRITON_INTERPRET"), "cases": []}
    for seq in (1, 17, 40, 64):
        for causal in (True, False):
            results["cases"].append(compare((1, 2, seq, 16), causal, 16, 16, seed=seq))
    results["cases"].append(compare((1, 2, 40, 16), True, 32, 16, seed=1))   # rectangular tiles
    results["cases"].append(compare((1, 2, 40, 16), True, 16, 32, seed=2))
    results["cases"].append(compare((2, 33, 32), True, 16, 16, seed=3))      # (batch, seq, dim)
    results["low_precision"] = [compare((1, 2, 40, 16), True, 16, 16, dtype, seed=4)
                                for dtype in (torch.float16, torch.bfloat16)]
    results["saved"] = saved_shapes(64)
    results["saved_class"] = TritonFlashAttentionFunction.__name__
    results["dots"] = {"causal": dots(True), "full": dots(False)}
    (loss, grads), (loss_ref, grads_ref) = (gpt_loss_and_grads("labkit_triton", n_layer=1),
                                            gpt_loss_and_grads("sdpa", n_layer=1))
    results["gpt"] = {"loss": rel_err(loss, loss_ref), "grads": max(rel_err(g, r) for g, r in zip(grads, grads_ref))}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
