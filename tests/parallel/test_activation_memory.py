"""labkit's count of what a block, a stage and a rank keep for backward, against what autograd really saves.

The multi-process layouts (tp, pp, SP, dp strategies) are checked against real runs in test_layouts.py; here
the single-process parts, exactly, and the count's relation to Korthikanti et al.'s Table 2.
"""
import pytest
import torch

from labkit.config import load_config
from labkit.memory_estimate import activation_bytes_per_layer
from labkit.metrics.memory import count_saved_bytes
from labkit.model.gpt import GPT, Block, GPTShape
from labkit.parallel.reports.activation_memory import (CP_ATTENTION, SCALAR_SLACK, block_activation_parts,
                                                       stage_activation_bytes, stage_end_parts, why_not_predicted)
from labkit.parallel.pp.pipeline import GPTStage

B, S, H, A, V = 3, 32, 48, 4, 24


def shape(**changes) -> GPTShape:
    return GPTShape(**{"vocab_size": V, "block_size": S, "n_layer": 3, "n_head": A, "n_embd": H, "bias": True,
                       **changes})


@pytest.mark.parametrize("attention", ["sdpa", "naive", "labkit_flash"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_blocks_count_is_what_autograd_saves(attention, recompute, dropout):
    block = Block(shape(attention=attention, recompute=recompute, dropout=dropout))
    x = torch.randn(B, S, H, requires_grad=True)
    with count_saved_bytes(block.parameters()) as saved:
        block(x)
    # on the CPU a dropout mask is a float of the activations' width
    parts = block_activation_parts(B, S, H, A, attention=attention, recompute=recompute, dropout=dropout > 0)
    assert saved.total == sum(parts.values())


@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_each_pipeline_stage_keeps_its_blocks_and_its_ends(n_stages):
    torch.manual_seed(0)
    model = GPT(shape())
    ids, targets = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))  # two tensors, as a batch gives them
    x = ids
    for stage in range(n_stages):
        part = GPTStage.from_gpt(model, stage, n_stages)
        with count_saved_bytes(part.parameters()) as saved:
            out = part(x, targets if stage == n_stages - 1 else None)
        x = out.detach().requires_grad_(True) if stage < n_stages - 1 else None
        predicted = stage_activation_bytes(model.shape, B, stage, n_stages)
        assert 0 <= saved.total - predicted <= SCALAR_SLACK, (stage, saved.total, predicted)


def test_the_ends_belong_to_the_first_and_last_stage():
    middle = stage_end_parts(B, S, H, V, first=False, last=False)
    both = stage_end_parts(B, S, H, V, first=True, last=True)
    assert middle == {}
    assert both["softmax of the logits"] == 4 * B * S * V
    assert stage_end_parts(B, S, H, V, 2, first=False, last=True)["softmax of the logits"] == 4 * B * S * V / 2


def test_at_the_papers_widths_the_count_is_the_papers_less_the_attention_dropout():
    """Korthikanti et al. count fp16 values and one-byte dropout masks, with dropout on the attention
    probabilities too (5·a·s²·b: probabilities 2, mask 1, their dropout's output 2). labkit drops out only the
    residual stream, so at the same widths its block keeps 3·a·s²·b bytes less — and the small terms the paper
    leaves out (layer norms' statistics, the causal mask)."""
    small = {"layer norm 1 statistics", "layer norm 2 statistics", "causal mask"}

    def labkit(tp, sp=False):
        parts = block_activation_parts(B, S, H, A, tp, value_bytes=2, mask_bytes=1, dropout=True,
                                       sequence_parallel=sp, attention="naive")
        return sum(v for k, v in parts.items() if k not in small)

    probabilities_dropout = 3 * A * S * S * B
    for tp in (1, 2, 4):
        paper = activation_bytes_per_layer(S, B, H, A, tp)
        assert labkit(tp) == pytest.approx(paper - probabilities_dropout / tp)
    # sequence parallelism: labkit's column layers keep the gathered input (2 values of s·b·h, 4 bytes at fp16)
    # where Megatron keeps the shard and gathers again in backward
    for tp in (2, 4):
        paper = activation_bytes_per_layer(S, B, H, A, tp, sequence_parallel=True)
        assert labkit(tp, sp=True) == pytest.approx(paper - probabilities_dropout / tp + 4 * S * B * H * (1 - 1 / tp))


def test_tensor_and_sequence_parallelism_shard_what_the_paper_says():
    one, two = (sum(block_activation_parts(B, S, H, A, tp).values()) for tp in (1, 2))
    two_sp = sum(block_activation_parts(B, S, H, A, 2, sequence_parallel=True).values())
    assert two_sp < two < one
    full = block_activation_parts(B, S, H, A, 2, recompute="full", sequence_parallel=True)
    assert full == {"block input": 4 * B * S * H / 2}


def test_weights_and_their_views_are_not_activations():
    layer = torch.nn.Linear(H, H)
    x = torch.randn(B, S, H, requires_grad=True)
    with count_saved_bytes() as saved:  # nothing excluded by storage: the weight is left out as a Parameter
        layer(x).sum()
    assert saved.total == x.numel() * 4


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_keeps_what_a_fused_kernel_does_and_all_gather_the_whole_kv_besides(cp):
    """Ring and Ulysses keep q, k, v, two outputs and a log-sum-exp of a rank's tokens (as labkit's flash kernel);
    all-gather KV keeps every rank's keys and values as well: 2·cp times a rank's own k. (That autograd saves exactly
    this, rank by rank, is checked on real runs in test_layouts.py.)"""
    s = S // cp
    parts = {impl: block_activation_parts(B, s, H, A, attention=name, cp=cp) for impl, name in CP_ATTENTION.items()}
    flash = block_activation_parts(B, s, H, A, attention="labkit_flash")
    assert parts["ring"] == parts["ulysses"] == flash
    extra = {k: v for k, v in parts["allgather"].items() if k not in flash}
    assert extra == {"gathered keys and values": 2 * cp * 4 * B * s * H}


def test_runs_the_count_does_not_cover_say_why():
    start = {"mesh": {"dp": 1, "pp": 1, "tp": 2}}
    assert why_not_predicted(load_config(None, {"parallel.tp.degree": 2}), start) is None
    for dotted, word in (({"precision.mode": "bf16"}, "bf16"), ({"parallel.tp.impl": "dtensor"}, "DTensor")):
        assert word in why_not_predicted(load_config(None, {"parallel.tp.degree": 2, **dotted}), start)
    with pytest.raises(ValueError, match="not modelled"):
        block_activation_parts(B, S, H, A, attention="flash_attn")
