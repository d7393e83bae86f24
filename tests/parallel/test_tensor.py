"""labkit's tensor-parallel layers (labkit.parallel.tp.layers) equal the full layers they split."""
import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tp_cases import run_workers

from labkit.model.gpt import GPT, Block, GPTShape
from labkit.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, parallelize_block, shard_bounds
from labkit.parallel.tp.model import VocabParallelEmbedding, parallelize_gpt, vocab_parallel_cross_entropy
from labkit.parallel.tp.volume import tp_wire_bytes

WORKER = Path(__file__).parent / "tensor_worker.py"
GPT_WORKER = Path(__file__).parent / "tensor_gpt_worker.py"


def test_with_one_rank_every_layer_is_the_ordinary_one(group_of_one):
    torch.manual_seed(0)
    up, down, emb = nn.Linear(8, 16), nn.Linear(16, 8), nn.Embedding(10, 8)
    ids = torch.randint(0, 10, (2, 5))
    want = down(F.gelu(up(emb(ids))))
    got = RowParallelLinear.from_linear(down)(F.gelu(ColumnParallelLinear.from_linear(up)(
        VocabParallelEmbedding.from_embedding(emb)(ids))))
    torch.testing.assert_close(got, want)
    block = Block(GPTShape(vocab_size=10, block_size=5, n_layer=1, n_head=2, n_embd=8, attention="naive"))
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(parallelize_block(copy.deepcopy(block))(x), block(x))
    logits, target = torch.randn(2, 5, 10), torch.randint(0, 10, (2, 5))
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, target, 0),
                               F.cross_entropy(logits.view(-1, 10), target.view(-1)))
    gpt = GPT(GPTShape(vocab_size=10, block_size=5, n_layer=1, n_head=2, n_embd=8, bias=True))
    for sequence_parallel in (False, True):
        split = parallelize_gpt(copy.deepcopy(gpt), sequence_parallel=sequence_parallel)
        torch.testing.assert_close(split(ids, ids)[1], gpt(ids, ids)[1])


def test_slices_cover_the_dimension_and_a_degree_that_does_not_divide_it_is_refused():
    assert [shard_bounds(12, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(ValueError, match="12 does not divide into 5 tensor-parallel shards"):
        shard_bounds(12, 0, 5)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_split_layers_equal_the_full_ones_forward_and_backward(tmp_path, world):
    """Column (gathered), an MLP column → gelu → row, the vocab-split embedding and the vocab-split loss: outputs,
    input gradients and each rank's slice of the weight gradients equal the full layer's, on every rank. And
    torch's own (DTensor ``parallelize_module`` with ColwiseParallel / RowwiseParallel) gives labkit's MLP numbers:
    the same output, input gradient and local weight-gradient shards. A whole GPT block split by heads (q, k, v
    by columns, the projection by rows) equals the block, layer-norm gradients included."""
    for rank, seen in enumerate(run_workers(WORKER, world, tmp_path)):
        assert set(seen) == {"column", "mlp", "dtensor", "block", "embedding", "cross_entropy"}
        for name, checks in seen.items():
            assert all(checks), (rank, name, checks)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_a_whole_gpt_split_with_and_without_sequence_parallelism_equals_the_full_model(tmp_path, world):
    """``parallelize_gpt`` on tiny GPTs (vocab 16, block 8, 2 layers, 4 heads, n_embd 16; attention naive and sdpa,
    bias on and off), with and without ``sequence_parallel``: the same loss as the full model and, for every
    parameter, the full gradient's slice (the tied embedding/head is one parameter with wte's gradient rows);
    three AdamW steps on the local shards keep the weights equal. The CommTimer's bytes of one forward+backward
    equal ``tp_wire_bytes`` part by part (embedding, each block, head, loss), the same with sequence parallelism,
    and its after-backward sync sends ``sequence_parallel_sync_bytes``; sequence parallelism flags exactly the
    replicated parameters used on sequence shards, and refuses a block_size the tp degree does not divide.
    With recompute "selective" and "full" the gradients still equal the full model's, and the bytes counted
    include the recomputed collectives ``tp_wire_bytes(recompute=...)`` predicts."""
    for rank, seen in enumerate(run_workers(GPT_WORKER, world, tmp_path)):
        assert set(seen) == {"naive_bias1", "naive_bias0", "sdpa_bias1", "sdpa_bias0", "recompute_selective",
                             "recompute_full", "errors"}
        for case, checks in seen.items():
            failed = [name for name, ok in checks.items() if not ok]
            assert not failed, (rank, case, failed)
        assert len(seen["naive_bias1"]) > 100  # every parameter was compared, not just a few


def test_the_analytic_bytes_are_the_same_with_sequence_parallelism_and_nothing_on_one_rank():
    """All-reduce = reduce-scatter + all-gather: sequence parallelism moves the same bytes. Per block, four
    all-reduces of one (batch, seq, n_embd) activation: 4 · 2(p−1)/p · B·T·C·bytes."""
    plain = tp_wire_bytes(8, 1024, 768, 12, 4, 2)
    assert plain == tp_wire_bytes(8, 1024, 768, 12, 4, 2, sequence_parallel=True)
    assert plain["per_layer"] == 4 * 2 * 3 * 8 * 1024 * 768 * 2 // 4
    assert plain["loss"] == 3 * 2 * 3 * 8 * 1024 * 4 // 4 and plain["blocks"] == 12 * plain["per_layer"]
    assert tp_wire_bytes(8, 1024, 768, 12, 1, 2)["total"] == 0
    # recomputation reruns a region's forward collectives but its closing one (checkpoint's early stop)
    activation_all_reduce = plain["per_layer"] // 4
    assert tp_wire_bytes(8, 1024, 768, 12, 4, 2, recompute="selective") == plain
    assert tp_wire_bytes(8, 1024, 768, 12, 4, 2, recompute="full")["per_layer"] == 5 * activation_all_reduce
    assert tp_wire_bytes(8, 1024, 768, 12, 4, 2, True, "selective")["per_layer"] == 4.5 * activation_all_reduce
    assert tp_wire_bytes(8, 1024, 768, 12, 4, 2, True, "full")["per_layer"] == 5.5 * activation_all_reduce
    with pytest.raises(ValueError, match="recompute"):
        tp_wire_bytes(8, 1024, 768, 12, 4, 2, recompute="all")
