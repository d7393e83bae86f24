"""labkit's tensor-parallel layers (labkit.parallel.tensor) equal the full layers they split."""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.launcher import free_port
from labkit.model.gpt import Block, GPTShape
from labkit.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, parallelize_block,
                                    shard_bounds, vocab_parallel_cross_entropy)

WORKER = Path(__file__).parent / "tensor_worker.py"


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(WORKER), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(world):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(seen) == {"column", "mlp", "dtensor", "block", "embedding", "cross_entropy"}
        for name, checks in seen.items():
            assert all(checks), (rank, name, checks)
