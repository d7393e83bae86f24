"""torch's DTensor tensor parallelism (labkit.parallel.tp.dtensor) equals labkit's and the full model."""
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from tp_cases import run_workers

from labkit.model.gpt import GPT, GPTShape
from labkit.parallel.tp.dtensor import SplitQKVAttention, fused_qkv_state, split_qkv

WORKER = Path(__file__).parent / "tensor_dtensor_worker.py"


def test_splitting_the_fused_qkv_layer_changes_no_number_and_its_state_fuses_back():
    """The module surgery before the plan: three Linear q, k, v holding [q | k | v]'s rows compute the same,
    and ``fused_qkv_state`` gives the full model's state dict back (names, order and values)."""
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=16, block_size=8, n_layer=1, n_head=4, n_embd=16, bias=True, attention="naive"))
    split = SplitQKVAttention.from_attention(model.blocks[0].attn)
    assert all(isinstance(m, nn.Linear) and m.out_features == 16 for m in (split.q, split.k, split.v))
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(split(x), model.blocks[0].attn(x))
    whole = model.state_dict()
    split_qkv(model)  # and back: a checkpoint under the full model's names
    assert {n for n in model.state_dict() if ".attn.q." in n} == {"blocks.0.attn.q.weight", "blocks.0.attn.q.bias"}
    fused = fused_qkv_state(model.state_dict())
    assert list(fused) == list(whole)
    for name in whole:
        torch.testing.assert_close(fused[name], whole[name])


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_tp_equals_labkit_tp_and_the_full_model(tmp_path, world):
    """``parallelize_gpt_dtensor`` (colwise q/k/v and MLP-in, rowwise out-projections, the embedding by
    vocabulary, loss parallel on the vocabulary-sharded head, the head tied to the embedding as one DTensor),
    with and without ``sequence_parallel``, on gloo: the loss of the full model and of labkit's TP; every
    gradient's ``full_tensor()`` equals the full model's and its ``to_local()`` labkit's shard; two AdamW steps
    keep the weights equal. CommDebugMode sees labkit's collectives per block (2 all-reduces forward and 2
    backward; with SP 2 all-gathers + 2 reduce-scatters each way), and their bytes are labkit's exactly (with
    SP plus one all-gather of the position embedding's gradient, where labkit all-reduces it after backward)."""
    for rank, seen in enumerate(run_workers(WORKER, world, tmp_path, timeout=400)):
        assert len(seen["checks"]) == 8  # attention × bias × sequence parallelism
        for case, checks in seen["checks"].items():
            failed = [name for name, ok in checks.items() if not ok]
            assert not failed, (rank, case, failed)
