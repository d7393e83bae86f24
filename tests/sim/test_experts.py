"""The step model's mixtures of experts (labkit.sim.experts): active FLOPs, experts held E/ep a rank, the ep
all-to-all's bytes as labkit's dispatch counts them, and the imbalance's cost."""
from fractions import Fraction

import pytest

from labkit.comm.collectives import wire_exact
from labkit.config import load_config
from labkit.model.flops import count_params, flops_per_token as labkit_flops
from labkit.model.gpt import GPTShape
from labkit.sim.cluster import CLUSTERS
from labkit.sim.experts import ep_messages, rank_imbalance, expert_parameters, imbalance_flops_per_token, mlp_parameters
from labkit.sim.layout import Layout, ModelShape
from labkit.sim.step import flops_per_token, rank_memory, step_time

MOE = ModelShape(1024, 16, 16, 1024, 50304, experts=8, top_k=2)
H100 = CLUSTERS["dgx-h100"]


def test_a_shape_read_from_a_gpt_keeps_its_experts_and_counts_what_labkit_counts():
    cfg = load_config(None, {"model.n_layer": 4, "model.n_embd": 64, "model.n_head": 2, "model.block_size": 32,
                             "model.moe.experts": 4, "model.moe.top_k": 2, "model.moe.every": 2})
    gpt = GPTShape.from_config(cfg.model, 17)
    shape = ModelShape.from_gpt(gpt)
    assert (shape.experts, shape.top_k, shape.moe_every) == (4, 2, 2)
    assert flops_per_token(shape) == labkit_flops(gpt)  # active parameters: top-k experts a token
    assert count_params(shape.gpt_fields())["total"] == count_params(gpt)["total"]  # the memory holds all of them
    assert ModelShape.from_gpt(GPTShape.from_config(load_config(None, {}).model, 17)).experts == 0


def test_each_rank_holds_e_over_ep_of_the_experts():
    whole = rank_memory(MOE, Layout(dp=8), "fp32")["parameters"]
    spread = rank_memory(MOE, Layout(dp=8, ep=8), "fp32")["parameters"]
    assert whole - spread == 4 * 16 * 8 * mlp_parameters(MOE) * 7 // 8  # fp32: 4 bytes; 16 layers of 8 experts
    assert expert_parameters(MOE, 1) == 0


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_the_all_to_all_bytes_are_two_k_t_d_times_ep_minus_one_over_ep_each_way(ep):
    """What tests/parallel/test_expert_parallel.py counts at the collective for a balanced router: per layer and
    micro-batch, dispatch + combine forward and their gradients backward."""
    lay = Layout(dp=8, ep=ep, micro_batch=2)
    (count, op, nbytes), counts = ep_messages(MOE, lay, 4)
    assert counts == (16, "all_to_all", 8 * MOE.experts)  # the counts first, a call a layer: E int64
    tokens = 2 * 1024
    per_layer = count // 16 * wire_exact(op, Fraction(nbytes), ep)
    assert per_layer == 2 * (2 * 2 * tokens * 1024 * 4 * Fraction(ep - 1, ep))  # forward and backward
    assert ep_messages(MOE, Layout(dp=8), 4) == []


def test_imbalance_slows_the_step_only_when_the_experts_are_spread():
    balanced = step_time(MOE, Layout(dp=8, micro_batch=4, ep=8), H100)
    skewed = step_time(MOE, Layout(dp=8, micro_batch=4, ep=8, expert_imbalance=1.5), H100)
    assert skewed.ep_comm > balanced.ep_comm and skewed.expert_imbalance > 0 == balanced.expert_imbalance
    assert skewed.total > balanced.total and "ep comm" in dict(skewed.TIME_TERMS).values()
    assert imbalance_flops_per_token(MOE, Layout(dp=8, expert_imbalance=1.5)) == 0  # ep = 1: every rank runs all
    assert step_time(MOE, Layout(dp=8, micro_batch=4), H100).ep_comm == 0


@pytest.mark.parametrize("layout, message", [
    (Layout(dp=8, ep=3), "not divisible by it"),
    (Layout(dp=6, ep=4), "must divide the data-parallel ranks"),
    (Layout(dp=8, ep=2, expert_imbalance=0.5), "max/mean load, >= 1"),
])
def test_what_the_trainer_refuses_the_model_refuses(layout, message):
    with pytest.raises(ValueError, match=message):
        step_time(MOE, layout, H100)
    with pytest.raises(ValueError, match="the shape has none"):
        step_time(ModelShape(1024, 16, 16, 1024, 50304), Layout(dp=8, ep=2), H100)


def test_the_imbalance_that_costs_is_the_busiest_ranks_not_the_busiest_experts():
    """Each ep rank holds a contiguous block of E/ep experts: its rows are their sum."""
    load = [40, 10, 10, 20, 30, 10, 10, 40]  # experts' max/mean 40/21.25 = 1.88
    assert rank_imbalance(load, 8) == pytest.approx(40 / 21.25)
    assert rank_imbalance(load, 2) == pytest.approx(90 / 85)  # blocks of 4: 80 and 90
    assert rank_imbalance(load, 4) == pytest.approx(50 / 42.5)  # 50, 30, 40, 50
    assert rank_imbalance(load, 1) == 1.0 and rank_imbalance([0, 0], 2) == 1.0
