"""Attention on a CUDA GPU: correctness against float64, then time and memory of forward + backward.

Backends: labkit_triton (labkit's FlashAttention-2 in Triton), flash_attn (the flash-attn package),
sdpa (PyTorch's fused kernel — FlashAttention-2 inside on recent GPUs) and labkit_flash (the same
algorithm in plain PyTorch, for reference). A backend that cannot run here (flash-attn not installed)
is a row marked *unavailable*, not a failure.

    python benchmarks/gpu_attention.py check            # correctness, bf16 and fp32
    python benchmarks/gpu_attention.py bench [--seqs 1024 2048 4096 8192 16384]

Prints one JSON line per row (``{"kind": ...}``) and a table; ``gpu_check.sh`` collects the rows.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

BACKENDS = ("labkit_triton", "flash_attn", "sdpa", "labkit_flash")
BATCH, HEADS, HEAD_DIM = 1, 8, 64


def backend_fn(name: str):
    """The backend's function, or the reason it cannot run on this machine."""
    if name == "flash_attn":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return None, "unavailable: flash-attn not installed (pip install labkit[gpu] on a CUDA machine)"
    from labkit.model.attention import get_attention

    try:
        return get_attention(name), None
    except ValueError as error:
        return None, f"unavailable: {error}"


def reference(q, k, v, d_out):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    seq = q.size(-2)
    scores = (q64 @ k64.transpose(-2, -1)) / math.sqrt(q.size(-1))
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v64
    grads = torch.autograd.grad(out, (q64, k64, v64), d_out.double())
    return out.detach(), grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(name: str, dtype: torch.dtype, seq: int = 1000) -> dict:
    row = {"kind": "check", "backend": name, "dtype": str(dtype).replace("torch.", ""), "seq": seq}
    fn, why = backend_fn(name)
    if fn is None:
        return {**row, "status": why}
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, seq, HEAD_DIM, device="cuda", generator=gen, dtype=dtype).requires_grad_()
               for _ in range(3))
    d_out = torch.randn(2, HEADS, seq, HEAD_DIM, device="cuda", generator=gen, dtype=dtype)
    try:
        out = fn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
    except Exception as error:  # noqa: BLE001 — a row that says what broke
        return {**row, "status": f"FAIL: {type(error).__name__}: {str(error)[:120]}"}
    ref_out, ref_grads = reference(q, k, v, d_out)
    errors = [rel_err(out, ref_out)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    limit = 1e-4 if dtype == torch.float32 else 1e-2
    if name == "flash_attn" and dtype == torch.float32:
        limit = 1e-2  # flash-attn computes in bf16 even for fp32 inputs (labkit casts)
    finite = all(math.isfinite(e) for e in errors)
    ok = finite and max(errors) < limit
    return {**row, "errors": errors, "limit": limit, "status": "PASS" if ok else "FAIL"}


def bench(name: str, seq: int, repeats: int = 10) -> dict:
    row = {"kind": "bench", "backend": name, "seq": seq, "dtype": "bfloat16"}
    fn, why = backend_fn(name)
    if fn is None:
        return {**row, "status": why}
    try:
        q, k, v = (torch.randn(BATCH, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        d_out = torch.randn_like(q)
        torch.autograd.grad(fn(q, k, v), (q, k, v), d_out)  # warm-up: compilation, autotuning
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            start.record()
            torch.autograd.grad(fn(q, k, v), (q, k, v), d_out)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        peak = torch.cuda.max_memory_allocated() - base
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {**row, "status": "out of memory"}
    except Exception as error:  # noqa: BLE001
        return {**row, "status": f"FAIL: {type(error).__name__}: {str(error)[:120]}"}
    best = min(times)
    flops = 4 * BATCH * HEADS * seq * seq * HEAD_DIM / 2 * 3.5  # causal: half; fwd+bwd ≈ 3.5× forward's 2 matmuls
    return {**row, "status": "ok", "time_ms": 1e3 * best, "peak_mib": peak / 2**20, "tflops": flops / best / 1e12}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["check", "bench"])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU visible: this script is for a GPU machine", file=sys.stderr)
        return 2
    failed = False
    if args.what == "check":
        for name in args.backends:
            for dtype in (torch.float32, torch.bfloat16):
                row = check(name, dtype)
                failed |= row["status"].startswith("FAIL")
                print(json.dumps(row), flush=True)
    else:
        for seq in args.seqs:
            for name in args.backends:
                if name == "labkit_flash" and seq > 4096:
                    continue  # the PyTorch version launches ops per tile: minutes at 16k, and not the point
                print(json.dumps(bench(name, seq)), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
