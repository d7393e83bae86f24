"""FlashAttention-2 in plain PyTorch: matches a float64 naive reference, saves only O(n) tensors."""
import math

import pytest
import torch

from labkit.model.flash import FlashAttentionFunction, flash_attention, labkit_flash_attention, online_softmax_steps

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def reference_attention(q, k, v, causal=True):
    """Naive attention in float64: the whole score matrix, masked (top-left aligned) and softmaxed."""
    q, k, v = q.double(), k.double(), v.double()
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if causal:
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a − b|| / ||b||, in float64; absolute when b is exactly zero (e.g. dQ, dK for a 1-token sequence)."""
    assert torch.isfinite(a).all(), "non-finite values"
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def leaves(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype).requires_grad_() for _ in range(3)]


def check_against_reference(shape, dtype, causal, block_q, block_k, seed=0):
    q, k, v = leaves(shape, dtype, seed)
    out = flash_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    assert out.dtype == dtype and out.shape == q.shape
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), d_out)

    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*ref_inputs, causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_inputs, d_out.double())

    tol = TOLERANCE[dtype]
    assert rel_err(out, ref) < tol
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype and g.shape == r.shape
        assert rel_err(g, r) < tol, f"d{name}: {rel_err(g, r):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq", [1, 17, 100])
def test_matches_float64_reference_bhsd(seq, causal, dtype):
    check_against_reference((2, 3, seq, 16), dtype, causal, block_q=16, block_k=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_float64_reference_bsd(causal, dtype):
    check_against_reference((3, 45, 8), dtype, causal, block_q=8, block_k=8)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_q, block_k", [
    (4, 4),      # many tiles, 33 = 8·4 + 1: a one-row last tile
    (8, 16),     # rectangular tiles, diagonal crossing tiles mid-way
    (16, 5),     # more key blocks than query blocks
    (33, 33),    # tile == sequence
    (64, 128),   # tiles larger than the sequence: one tile, pure softmax
])
def test_tile_sizes_smaller_equal_larger_than_sequence(block_q, block_k, causal):
    check_against_reference((1, 2, 33, 8), torch.float32, causal, block_q, block_k, seed=3)


def test_default_backend_matches_naive_and_sdpa():
    from labkit.model.attention import naive_attention, sdpa_attention

    q, k, v = leaves((2, 4, 70, 16), torch.float32, seed=5)
    out = labkit_flash_attention(q, k, v)
    assert rel_err(out, naive_attention(q, k, v)) < 1e-5
    assert rel_err(out, sdpa_attention(q, k, v)) < 1e-5


def test_float64_passes_gradcheck():
    q, k, v = leaves((1, 2, 7, 4), torch.float64, seed=7)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, block_q=3, block_k=2), (q, k, v))


def saved_shapes(seq):
    q, k, v = leaves((1, 2, seq, 16), torch.float32, seed=0)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = flash_attention(q, k, v)
    assert type(out.grad_fn).__name__ == f"{FlashAttentionFunction.__name__}Backward"
    return shapes


def test_saved_tensors_are_linear_in_sequence_length():
    small, large = saved_shapes(128), saved_shapes(256)
    assert len(small) == 5  # q, k, v, out, log-sum-exp
    for shape in large:
        assert not (len(shape) >= 2 and shape[-1] == 256 and shape[-2] == 256), f"seq × seq tensor saved: {shape}"
    ratio = sum(math.prod(s) for s in large) / sum(math.prod(s) for s in small)
    assert ratio == pytest.approx(2.0, rel=0.05)  # quadratic memory would give 4


def test_online_softmax_steps_end_at_softmax():
    row = torch.randn(23, generator=torch.Generator().manual_seed(0)) * 4
    steps = online_softmax_steps(row, block=5)
    assert [(s["start"], s["stop"]) for s in steps] == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    maxes = [s["max"] for s in steps]
    assert all(a <= b for a, b in zip(maxes, maxes[1:]))
    assert maxes[-1] == pytest.approx(row.max().item())
    assert torch.allclose(steps[-1]["probs"], torch.softmax(row, dim=-1), atol=1e-6)
    assert steps[-1]["sum"] == pytest.approx(torch.exp(row - row.max()).sum().item(), rel=1e-6)
    for s in steps:  # each step is a softmax of the scores seen so far
        seen = row[: s["stop"]]
        assert torch.allclose(s["probs"][: s["stop"]], torch.softmax(seen, dim=-1), atol=1e-6)
        assert (s["probs"][s["stop"]:] == 0).all()


def test_mismatched_head_dims_name_both_shapes():
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match=r"q \(1, 2, 8, 16\).*k \(1, 2, 8, 32\)"):
        flash_attention(q, k, v)


def test_causal_skips_key_blocks_above_the_diagonal():
    """8 × 8 tiles: causal computes the 36 on or below the diagonal, forward and backward, not all 64."""
    from torch.utils.flop_counter import FlopCounterMode

    def matmul_flops(causal):
        q, k, v = leaves((1, 2, 64, 16), torch.float32, seed=0)
        with FlopCounterMode(display=False) as counter:
            out = flash_attention(q, k, v, causal=causal, block_q=8, block_k=8)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return counter.get_total_flops()

    assert matmul_flops(True) / matmul_flops(False) == pytest.approx(36 / 64)
