"""A parameter's first value comes from the seed and its name alone, so a part made real on its own (a pipeline
stage, a slice) equals the same part of the one-process model (labkit.model.init)."""
import torch
import torch.nn as nn

from labkit.model.gpt import GPT, GPTShape
from labkit.model.init import initial_value, is_meta, materialise
from labkit.parallel.pp.pipeline import GPTStage

SHAPE = GPTShape(vocab_size=11, block_size=8, n_layer=4, n_head=2, n_embd=16, bias=True)


def meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(SHAPE)


def test_a_value_depends_on_the_seed_and_the_name_only():
    a = initial_value("blocks.2.mlp.fc.weight", (64, 16), 4, seed=5)
    assert torch.equal(a, initial_value("blocks.2.mlp.fc.weight", (64, 16), 4, seed=5))
    assert not torch.equal(a, initial_value("blocks.1.mlp.fc.weight", (64, 16), 4, seed=5))
    assert not torch.equal(a, initial_value("blocks.2.mlp.fc.weight", (64, 16), 4, seed=6))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    initial_value("wte.weight", (11, 16), 4, seed=5)
    assert torch.equal(torch.get_rng_state(), before)  # the global generator is not drawn from


def test_the_values_are_gpt2s():
    model = GPT(SHAPE, init_seed=1)
    assert torch.equal(model.blocks[0].attn.qkv.bias, torch.zeros(48))
    assert torch.equal(model.ln_f.weight, torch.ones(16))
    big = GPT(GPTShape(vocab_size=11, block_size=8, n_layer=4, n_head=2, n_embd=256), init_seed=1)
    fc, proj = big.blocks[0].mlp.fc.weight, big.blocks[0].mlp.proj.weight
    assert abs(float(fc.detach().std()) - 0.02) < 0.001
    assert abs(float(proj.detach().std()) - 0.02 / 8**0.5) < 0.0005  # residual projections: 0.02/√(2L)


def test_a_meta_model_made_real_is_the_one_process_model_and_keeps_its_tie():
    real = GPT(SHAPE, init_seed=9)
    made = materialise(meta_gpt(), SHAPE.n_layer, 9, "cpu")
    assert not any(is_meta(p) for p in made.parameters())
    assert made.lm_head.weight is made.wte.weight
    for (name, a), (_, b) in zip(real.state_dict().items(), made.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_stage_made_real_on_its_own_is_the_same_stage_of_the_whole_model():
    from labkit.parallel.parallelize import part_maker

    whole = GPT(SHAPE, init_seed=4)
    for stage in range(2):
        want = GPTStage.from_gpt(whole, stage, 2)
        got = GPTStage.from_gpt(meta_gpt(), stage, 2)
        part_maker(got, seed=4, device="cpu")(got)
        assert set(got.state_dict()) == set(want.state_dict())
        for name, value in want.state_dict().items():
            assert torch.equal(got.state_dict()[name], value), (stage, name)
    # the last stage's own copy of the tied embedding starts equal to the first stage's embedding
    assert torch.equal(got.lm_head.weight, whole.wte.weight)


def test_one_unit_is_made_real_at_a_time_and_flags_carry_over():
    model = meta_gpt()
    model.ln_f.weight.sequence_parallel = True
    materialise(model.blocks[1], SHAPE.n_layer, 3, "cpu", lambda name: f"blocks.1.{name}")
    assert not any(is_meta(p) for p in model.blocks[1].parameters())
    assert all(is_meta(p) for p in model.blocks[0].parameters())
    materialise(model, SHAPE.n_layer, 3, "cpu")
    assert model.ln_f.weight.sequence_parallel and isinstance(model.ln_f.weight, nn.Parameter)
    assert torch.equal(model.blocks[1].mlp.fc.weight, GPT(SHAPE, init_seed=3).blocks[1].mlp.fc.weight)
