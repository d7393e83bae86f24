"""Context parallelism's pieces in one process: which chunks a rank holds, what causal work that leaves each
rank, and the block arithmetic (log-sum-exp merge, recomputed backward) against plain attention."""

import pytest
import torch

from labkit.parallel.cp.blocks import backward_blocks, finish, forward_blocks
from labkit.parallel.cp.check import full_attention
from labkit.parallel.cp.sharding import chunk_ids, imbalance, positions, rank_work, shard, unshard


def qkv(seq=12, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, seq, 4, generator=g, dtype=torch.float64, requires_grad=requires_grad) for _ in range(3)]


def test_head_tail_pairs_an_early_chunk_with_a_late_one():
    assert [chunk_ids(r, 4, "head_tail") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_ids(r, 4, "contiguous") for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert positions(8, 1, 2, "head_tail").tolist() == [2, 3, 4, 5]
    assert positions(8, 0, 2, "head_tail").tolist() == [0, 1, 6, 7]
    assert positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_then_unshard_gives_the_sequence_back(layout, cp):
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    assert torch.equal(unshard([shard(x, r, cp, layout, dim=1) for r in range(cp)], layout, dim=1), x)


def test_a_length_that_does_not_cut_into_chunks_is_refused_with_the_divisor():
    with pytest.raises(ValueError, match="does not cut into 8 equal chunks.*divisible by 8"):
        shard(torch.zeros(1, 12, 2), 0, 4, "head_tail")
    with pytest.raises(ValueError, match="unknown context-parallel layout 'zigzag'"):
        chunk_ids(0, 2, "zigzag")


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_work_is_uneven_on_a_contiguous_split_and_even_head_tail(cp):
    assert imbalance(cp, "contiguous") == pytest.approx((2 * cp - 1) / cp)
    assert imbalance(cp, "head_tail") == pytest.approx(1.0)
    assert imbalance(cp, "contiguous", causal=False) == 1.0
    # the whole causal triangle is shared out, whichever the split: n_chunks²/2 blocks
    for layout, n in (("contiguous", cp), ("head_tail", 2 * cp)):
        assert sum(rank_work(r, cp, layout) for r in range(cp)) == pytest.approx(n * n / 2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1, 0, 2]])
def test_blocks_merged_by_log_sum_exp_in_any_order_are_attention(causal, order):
    q, k, v = qkv(seq=12)
    ks, vs = k.chunk(4, dim=-2), v.chunk(4, dim=-2)
    partials = [None] * 4
    for j in order:  # key chunks arriving one at a time, as round a ring
        forward_blocks(q, ks[j], vs[j], [0, 1, 2, 3], [j], causal, 0.5, partials)
    out, _ = finish(partials)
    torch.testing.assert_close(out, full_attention(q, k, v, causal), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_the_recomputed_backward_is_autograds(causal):
    q, k, v = qkv(seq=12, requires_grad=True)
    d_out = torch.randn(2, 3, 12, 4, dtype=torch.float64)
    full_attention(q, k, v, causal).backward(d_out)
    with torch.no_grad():
        ids = [0, 1, 2, 3]
        partials = [None] * 4
        forward_blocks(q, k, v, ids, ids, causal, 0.5, partials)
        out, lse = finish(partials)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        backward_blocks(q, k, v, d_out, lse, (d_out * out).sum(-1), ids, ids, causal, 0.5, *grads)
    for mine, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, want, rtol=1e-10, atol=1e-12)


def test_a_causal_block_after_the_queries_is_skipped_and_counted_as_no_work():
    q, k, v = qkv(seq=8)
    partials = [None, None]
    assert forward_blocks(q, k, v, [0, 1], [2, 3], True, 1.0, partials) == 0.0 and partials == [None, None]
    assert forward_blocks(q, k, v, [2, 3], [0, 1], True, 1.0, [None, None]) == 4.0
    # two diagonals (½ each) and one below
    assert forward_blocks(q, k, v, [0, 1], [0, 1], True, 1.0, [None, None]) == 2.0


def test_the_bug_zoo_names_its_bugs_and_refuses_an_unknown_one():
    from labkit.parallel.cp import blocks
    from labkit.parallel.cp.bugs import BUGS, bug

    assert set(BUGS) == {"stale_kv", "no_lse_rescale", "mask_off_by_one_chunk"}
    right = blocks.merge
    with bug("no_lse_rescale"):
        assert blocks.merge is not right
    assert blocks.merge is right
    with pytest.raises(ValueError, match="unknown context-parallel bug 'typo': choose one of stale_kv"):
        with bug("typo"):
            pass


def test_the_missing_rescale_gives_wrong_attention_in_one_process_too():
    from labkit.parallel.cp.bugs import bug

    q, k, v = qkv(seq=12)
    partials = [None] * 4
    with bug("no_lse_rescale"):
        for j in range(4):
            forward_blocks(q, k.chunk(4, -2)[j], v.chunk(4, -2)[j], [0, 1, 2, 3], [j], True, 0.5, partials)
    assert not torch.allclose(finish(partials)[0], full_attention(q, k, v, True))


@pytest.mark.parametrize("cp", [2, 4])
def test_counting_a_diagonal_block_whole_gives_the_imbalance_of_the_blocks_computed(cp):
    assert imbalance(cp, "contiguous", diagonal=1.0) == pytest.approx(2 * cp / (cp + 1))
    assert imbalance(cp, "head_tail", diagonal=1.0) == pytest.approx(1.0)
