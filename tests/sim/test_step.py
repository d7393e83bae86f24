"""The step model's terms, each checked by hand on a small model and a toy cluster of round numbers.

Toy cluster: 4 GPUs per node (A100s, 312 TFLOP/s bf16, memory that streams for free unless a test gives it a
bandwidth; no SM count, so no GEMM tile or wave quantisation: labkit.sim.gemm is tested on its own), intra 100 GB/s
and 1 µs, inter 10 GB/s and 10 µs. Efficiencies are passed explicitly (eff = 0.5, net = 0.5, no overlap cost unless a
test asks) so the expected values are easy to follow.
"""
import dataclasses
import math

import pytest

from labkit.memory_estimate import MemoryPlan, estimate_memory
from labkit.model.flops import count_params
from labkit.model.flops import flops_per_token as labkit_flops_per_token
from labkit.model.gpt import GPTShape
from labkit.parallel.pp.pipeline import ideal_bubble
from labkit.sim import step
from labkit.sim.cluster import A100, Cluster, Link
from labkit.sim.step import Layout, ModelShape, in_flight, rank_memory, step_time

INTRA = Link("toy NVLink", 100e9, 1e-6, "test")
INTER = Link("toy IB", 10e9, 10e-6, "test")
TOY = Cluster("toy", dataclasses.replace(A100, memory_bandwidth=float("inf"), sms=None), 4, 16, INTRA, INTER, "test")
SHAPE = ModelShape(hidden=64, layers=4, heads=4, seq=16, vocab=128)
EFF, NET = 0.5, 0.5
RATE = EFF * 312e12
GPT = GPTShape(vocab_size=128, block_size=16, n_layer=4, n_head=4, n_embd=64)


def run(cluster=TOY, overlap_cost=0.0, **layout):
    return step_time(SHAPE, Layout(**layout), cluster, "bf16", EFF, NET, overlap_cost)


def test_one_gpu_is_pure_compute_from_labkits_flop_count():
    s = run(micro_batch=2, micro_batches=3)
    expected = labkit_flops_per_token(GPT) * 2 * 16 * 3 / RATE
    assert s.compute == pytest.approx(expected)
    assert s.total == pytest.approx(expected)
    assert (s.recompute, s.attention_memory, s.elementwise_memory, s.tp_comm, s.pp_comm, s.bubble,
            s.dp_comm_hidden, s.dp_comm_exposed, s.overlap_slowdown) == (0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert s.mfu == pytest.approx(EFF)  # nothing but matmuls at EFF of the peak
    assert s.model_flops == pytest.approx(labkit_flops_per_token(GPT) * 2 * 16 * 3)


def test_model_shape_from_gpt_shape():
    assert ModelShape.from_gpt(GPT) == SHAPE


@pytest.mark.parametrize("mode, extra_per_token", [
    ("none", 0.0),
    ("selective", 4 * 4 * 64 * 16),  # attention core forward: 4·L·d·T
    ("full", 2 * 4 * (12 * 64 * 64 + 2 * 64) + 4 * 4 * 64 * 16),  # blocks' forward: 2·N_blocks + 4·L·d·T
])
def test_recompute_is_one_extra_forward(mode, extra_per_token):
    s = run(micro_batch=2, recompute=mode)
    assert s.recompute == pytest.approx(extra_per_token * 2 * 16 / RATE)
    assert s.compute == pytest.approx(run(micro_batch=2).compute)  # model FLOPs do not change


def test_full_recompute_costs_a_third_of_the_blocks_model_flops():
    blocks = 4 * count_params(GPT)["per_block"]
    assert step.recompute_flops_per_token(SHAPE, "full") == 2 * blocks + 4 * 4 * 64 * 16


def ring_all_reduce_s(nbytes, p, link):
    return 2 * (p - 1) * link.latency + 2 * (p - 1) / p * nbytes / (NET * link.bandwidth)


def tree_all_reduce_s(nbytes, p, link):  # NCCL's double binary tree: 2·⌈log2 p⌉ rounds, 2n bytes (n at p = 2)
    rounds = 2 * math.ceil(math.log2(p))
    return rounds * link.latency + (1 if p == 2 else 2) * nbytes / (NET * link.bandwidth)


def all_reduce_s(nbytes, p, link):  # the cheaper of the two, as NCCL picks
    return min(ring_all_reduce_s(nbytes, p, link), tree_all_reduce_s(nbytes, p, link))


def test_small_all_reduces_take_the_tree_and_large_ones_the_ring():
    small, large = 4 * 1024, 64 * 2 ** 20
    assert (step.collective_seconds("all_reduce", small, 8, INTRA, NET)
            == pytest.approx(tree_all_reduce_s(small, 8, INTRA)))
    assert tree_all_reduce_s(small, 8, INTRA) < ring_all_reduce_s(small, 8, INTRA)
    assert (step.collective_seconds("all_reduce", large, 8, INTRA, NET)
            == pytest.approx(ring_all_reduce_s(large, 8, INTRA)))
    assert step.collective_seconds("all_reduce", large, 1, INTRA, NET) == 0


def test_nccl_tree_all_reduce_sends_about_2n_bytes_per_rank_not_2_log_p_times_n():
    """NCCL's pipelined double binary tree, by hand (NET = 0.5): 2⌈log2 p⌉ rounds of latency and 2n bytes through
    the busiest rank. At 64 ranks across nodes (10 µs, 10 GB/s) a 25 MiB bucket takes the tree: 12 × 10 µs + 2 ×
    26,214,400 B / 5 GB/s = 10.60576 ms, against the ring's 126 × 10 µs + 63/32 × 26,214,400 B / 5 GB/s = 11.58192
    ms. (A textbook binomial tree would send 12n: 62.9 ms, and never win.)"""
    bucket = 25 * 2 ** 20
    assert step.collective_seconds("all_reduce", bucket, 64, INTER, NET) == pytest.approx(10.60576e-3)
    assert ring_all_reduce_s(bucket, 64, INTER) == pytest.approx(11.58192e-3)
    # at 8 ranks in a node (1 µs, 100 GB/s) a 64 MiB message takes the ring: 14 µs + 1.75 × 67,108,864 B / 50 GB/s
    # = 2.36281 ms; the tree would be 6 µs + 2 × 67,108,864 B / 50 GB/s = 2.69035 ms
    big = 64 * 2 ** 20
    assert step.collective_seconds("all_reduce", big, 8, INTRA, NET) == pytest.approx(2.36281024e-3)
    assert tree_all_reduce_s(big, 8, INTRA) == pytest.approx(2.69035456e-3)
    from labkit.comm.network import Cost
    from labkit.sim.collective import algorithm_cost

    assert algorithm_cost("all_reduce", 1000, 8, "tree") == Cost(6, 2000)
    assert algorithm_cost("all_reduce", 1000, 1024, "tree") == Cost(20, 2000)  # ⌈log2 1024⌉ = 10, up and down
    assert algorithm_cost("all_reduce", 1000, 2, "tree") == Cost(2, 1000)  # two ranks: each tree is one edge
    assert algorithm_cost("all_reduce", 1000, 8, "ring") == Cost(14, 1750)


def test_nccl_runs_only_the_all_reduce_on_its_tree():
    """A small all-gather or reduce-scatter goes round the ring even where a tree would have fewer rounds: NCCL has
    no tree for them. By hand, 4 KiB over 8 ranks in a node: 7 × 1 µs + 7/8 × 4,096 B / 50 GB/s = 7.07168 µs."""
    for op in ("all_gather", "reduce_scatter"):
        assert step.collective_seconds(op, 4096, 8, INTRA, NET) == pytest.approx(7.07168e-6)
    from labkit.sim.collective import algorithm_cost

    assert algorithm_cost("all_gather", 4096, 8, "tree") is None
    assert algorithm_cost("reduce_scatter", 4096, 8, "tree") is None


def test_tp_all_reduce_inside_a_node_uses_the_node_link():
    s = run(tp=4, micro_batch=2)
    act = 2 * 16 * 64 * 2  # micro_batch · seq · hidden · 2 bytes
    assert s.tp_comm == pytest.approx(4 * 4 * all_reduce_s(act, 4, INTRA))  # 4 layers × 4 all-reduces
    assert s.compute == pytest.approx(run(micro_batch=2).compute / 4)


def test_tp_group_larger_than_a_node_runs_at_the_inter_node_link():
    s = step_time(ModelShape(64, 4, 8, 16, 128), Layout(tp=8, micro_batch=2), TOY, "bf16", EFF, NET)
    act = 2 * 16 * 64 * 2
    assert s.tp_comm == pytest.approx(4 * 4 * all_reduce_s(act, 8, INTER))


def test_full_recompute_adds_two_tp_all_reduces_per_layer():
    base, full = run(tp=2), run(tp=2, recompute="full")
    assert full.tp_comm == pytest.approx(base.tp_comm * 6 / 4)


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 4), (4, 16), (8, 3)])
def test_bubble_is_ideal_bubble_of_the_pipeline_part(p, m):
    s = step_time(ModelShape(64, 8, 4, 16, 128), Layout(pp=p, micro_batches=m), TOY, "bf16", EFF, NET)
    busy = s.compute + s.recompute + s.attention_memory + s.tp_comm + s.pp_comm
    assert s.bubble / (busy + s.bubble) == pytest.approx(ideal_bubble(p, m))
    assert s.bubble == pytest.approx(busy * (p - 1) / m)


def test_interleaving_divides_the_bubble_by_the_chunks():
    plain = run(pp=4, micro_batches=8)
    inter = run(pp=4, micro_batches=8, schedule="interleaved", chunks=2)
    assert inter.pp_comm == pytest.approx(2 * plain.pp_comm)  # twice the sends
    busy = inter.compute + inter.recompute + inter.tp_comm + inter.pp_comm
    assert inter.bubble == pytest.approx(busy * 3 / (2 * 8))
    assert inter.bubble < plain.bubble


def test_pp_sends_one_activation_each_way_per_micro_batch():
    s = run(pp=4, micro_batch=2, micro_batches=5)  # 4 stages fit one node: intra link
    act = 2 * 16 * 64 * 2
    assert s.pp_comm == pytest.approx(5 * 2 * (INTRA.latency + act / (NET * INTRA.bandwidth)))
    crossing = run(pp=4, dp=2, micro_batch=2, micro_batches=5)  # stages 2 apart: 8 ranks span two nodes
    assert crossing.pp_comm == pytest.approx(5 * 2 * (INTER.latency + act / (NET * INTER.bandwidth)))
    sliced = run(pp=4, tp=2, micro_batch=2, micro_batches=5)  # each TP rank sends its half (scatter/gather)
    assert sliced.pp_comm == pytest.approx(5 * 2 * (INTER.latency + act / 2 / (NET * INTER.bandwidth)))
    whole = run(pp=4, tp=2, micro_batch=2, micro_batches=5, pp_scatter_gather=False)
    assert whole.pp_comm == pytest.approx(5 * 2 * (INTER.latency + act / (NET * INTER.bandwidth)))
    sp = run(pp=4, tp=2, micro_batch=2, micro_batches=5, pp_scatter_gather=False, sequence_parallel=True)
    assert sp.pp_comm == pytest.approx(sliced.pp_comm)


def test_dp_all_reduce_goes_in_buckets_each_paying_its_latency():
    grads = count_params(GPT)["total"] * 2  # every gradient, the position embedding's too
    one = run(dp=2, overlap_dp=False)
    assert one.dp_comm_exposed == pytest.approx(all_reduce_s(grads, 2, INTRA)) and one.dp_comm_hidden == 0
    four = run(dp=2, overlap_dp=False, bucket_bytes=grads / 4)
    assert four.dp_comm_exposed == pytest.approx(4 * all_reduce_s(grads / 4, 2, INTRA))
    # 3 more rings of 2 rounds
    assert four.dp_comm_exposed - one.dp_comm_exposed == pytest.approx(3 * 2 * INTRA.latency)


def test_dp_buckets_hide_under_backward_but_the_last_and_the_excess_are_exposed():
    grads = count_params(GPT)["total"] * 2  # every gradient, the position embedding's too
    one_bucket = run(dp=2)  # the only bucket is ready when backward ends: nothing to hide under
    assert one_bucket.dp_comm_hidden == 0 and one_bucket.dp_comm_exposed == pytest.approx(all_reduce_s(grads, 2, INTRA))
    s = run(dp=8, bucket_bytes=grads / 4)  # across nodes: slow enough to exceed the backward
    bucket = all_reduce_s(grads / 4, 8, INTER)
    backward = 2 / 3 * s.compute
    assert s.dp_comm_hidden == pytest.approx(min(3 * bucket, backward))
    assert s.dp_comm_exposed == pytest.approx(4 * bucket - s.dp_comm_hidden)
    assert s.total == pytest.approx(s.compute + s.dp_comm_exposed)


def test_hidden_communication_slows_the_compute_beside_it_by_the_overlap_cost():
    grads = count_params(GPT)["total"] * 2  # every gradient, the position embedding's too
    free, costly = run(dp=8, bucket_bytes=grads / 4), run(dp=8, bucket_bytes=grads / 4, overlap_cost=0.25)
    assert costly.overlap_slowdown == pytest.approx(0.25 * free.dp_comm_hidden) and free.overlap_slowdown == 0
    assert costly.total == pytest.approx(free.total + 0.25 * free.dp_comm_hidden)


def test_dp_across_nodes_uses_the_inter_node_link():
    grads = count_params(GPT)["total"] * 2  # every gradient, the position embedding's too
    s = run(dp=8, overlap_dp=False)
    assert s.dp_comm_exposed == pytest.approx(all_reduce_s(grads, 8, INTER))


def test_dp_comm_is_sized_once_per_step_with_accumulation():
    one, four = run(dp=2, overlap_dp=False), run(dp=2, micro_batches=4, overlap_dp=False)
    assert four.dp_comm_exposed == pytest.approx(one.dp_comm_exposed)
    assert four.compute == pytest.approx(4 * one.compute)


def test_compression_divides_the_gradient_bytes_and_local_sgd_syncs_every_h_steps():
    grads = count_params(GPT)["total"] * 2  # every gradient, the position embedding's too
    packed = run(dp=8, overlap_dp=False, grad_compression=4)
    assert packed.dp_comm_exposed == pytest.approx(all_reduce_s(grads / 4, 8, INTER))
    local = run(dp=8, sync_every=4, bucket_bytes=grads / 4)  # averaged after the optimizer: nothing hidden
    assert local.dp_comm_hidden == 0
    assert local.dp_comm_exposed == pytest.approx(4 * all_reduce_s(grads / 4, 8, INTER) / 4)


def test_zero3_gathers_weights_twice_and_scatters_grads_every_micro_batch_layer_by_layer():
    weights = count_params(GPT)["total"] * 2
    p, layers = 4, 4
    per_layer = weights / layers
    ring = (p - 1) * INTRA.latency + (p - 1) / p * per_layer / (NET * INTRA.bandwidth)
    gather = layers * ring  # NCCL's all-gather and reduce-scatter run on the ring alone
    s = run(dp=p, zero=3, micro_batches=3, overlap_dp=False)
    assert s.dp_comm_exposed == pytest.approx(3 * 3 * gather)  # all-gather ×2 + reduce-scatter (same bytes)
    full = run(dp=p, zero=3, micro_batches=3, overlap_dp=False, recompute="full")
    assert full.dp_comm_exposed == pytest.approx(3 * 3 * gather)  # the recompute reuses the backward's gather
    overlapped = run(dp=p, zero=3, micro_batches=3)
    fwd, bwd = overlapped.compute / 9, 2 * overlapped.compute / 9  # per micro-batch
    assert overlapped.dp_comm_hidden == pytest.approx(3 * (min(gather, fwd) + min(2 * gather, bwd)))
    assert overlapped.dp_comm_hidden + overlapped.dp_comm_exposed == pytest.approx(s.dp_comm_exposed)


def test_the_score_kernels_stream_the_attention_scores_through_memory():
    hbm = dataclasses.replace(TOY, gpu=dataclasses.replace(TOY.gpu, memory_bandwidth=1e12))
    s = run(cluster=hbm, micro_batch=2, tp=2)
    scores = 2 * (4 / 2) * 16 ** 2 * 4  # micro-batch · heads per TP rank · seq² · layers
    assert s.attention_memory == pytest.approx(scores * (9 + 11) / 1e12)  # bf16: 4 values + a mask byte, then 5 + 1
    again = run(cluster=hbm, micro_batch=2, tp=2, recompute="selective")
    assert again.attention_memory == pytest.approx(scores * (9 + 11 + 9) / 1e12)  # the forward kernels rerun
    flash = run(cluster=hbm, micro_batch=2, tp=2, attention="flash")
    assert flash.attention_memory == 0  # FlashAttention never writes the scores ...
    # with a finite bandwidth these tiny GEMMs are memory-bound (labkit.sim.gemm's roofline): they run at ``rate``
    rate = step.matmul_rate(SHAPE, Layout(micro_batch=2, tp=2), hbm.gpu, "bf16", EFF)
    assert rate < RATE
    assert flash.recompute == pytest.approx(2 * 4 * 64 * 16 * 2 * 16 / 2 / rate)  # ... but redoes QKᵀ: 2·L·d·T
    plain = run(micro_batch=2, tp=2)
    assert s.compute == pytest.approx(plain.compute * RATE / rate)
    assert s.total - s.compute == pytest.approx(plain.total - plain.compute + s.attention_memory + s.elementwise_memory)


def test_the_elementwise_kernels_stream_the_activations_through_memory():
    """LayerNorm, bias-dropout-add and bias-GeLU, counted value by value (bf16: 2 bytes, a mask 1 byte), per token
    in multiples of the hidden size: the hidden-wide kernels move 10 values + 2 mask bytes forward and 16 + 2
    backward, the 4·hidden-wide GeLU 8 values forward and 12 backward. Without sequence parallelism the
    hidden-wide kernels run whole on every TP rank (the GeLU is split); with it, 1/tp of everything."""
    hbm = dataclasses.replace(TOY, gpu=dataclasses.replace(TOY.gpu, memory_bandwidth=1e12))
    elements = 2 * 16 * 4 * 64  # micro-batch · seq · layers · hidden
    forward_1, backward_1 = elements * (10 * 2 + 2 + 8 * 2), elements * (16 * 2 + 2 + 12 * 2)
    one = run(cluster=hbm, micro_batch=2)
    assert one.elementwise_memory == pytest.approx((forward_1 + backward_1) / 1e12)
    tp = run(cluster=hbm, micro_batch=2, tp=2)  # the LayerNorms and dropouts replicated, the GeLU split
    replicated = elements * ((10 * 2 + 2) + (16 * 2 + 2))
    assert tp.elementwise_memory == pytest.approx((replicated + elements * (8 * 2 + 12 * 2) / 2) / 1e12)
    sp = run(cluster=hbm, micro_batch=2, tp=2, sequence_parallel=True)  # sequence parallelism splits them all
    assert sp.elementwise_memory == pytest.approx(one.elementwise_memory / 2)
    full = run(cluster=hbm, micro_batch=2, recompute="full")  # the forward ones run again
    assert full.elementwise_memory == pytest.approx((2 * forward_1 + backward_1) / 1e12)
    assert run(micro_batch=2).elementwise_memory == 0  # memory that streams for free


def test_total_is_the_sum_of_the_visible_terms():
    s = run(dp=2, tp=2, pp=2, micro_batches=4, recompute="selective", sequence_parallel=True)
    d = s.as_dict()
    parts = [name for name, _ in s.TIME_TERMS]
    assert d["total"] == pytest.approx(sum(d[k] for k in parts))
    costly = run(cluster=dataclasses.replace(TOY, gpu=A100), overlap_cost=0.2, dp=2, tp=2, pp=2, micro_batches=4,
                 recompute="selective", sequence_parallel=True, bucket_bytes=1e4)
    assert all(costly.as_dict()[k] > 0 for k in parts  # cp: tests/sim/test_context.py; ep: tests/sim/test_experts.py
               if k not in ("cp_comm", "ep_comm", "expert_imbalance"))
    assert s.tflops_per_gpu == pytest.approx(s.model_flops / s.total / 8 / 1e12)


@pytest.mark.parametrize("layout", [dict(), dict(dp=4, zero=1), dict(dp=4, zero=3, tp=2), dict(tp=4, recompute="full"),
                                    dict(tp=2, recompute="selective", sequence_parallel=True)])
def test_memory_matches_memory_estimate_for_the_same_layout(layout):
    lay = Layout(micro_batch=2, **layout)
    plan = MemoryPlan(params=count_params(GPT)["total"], n_layer=4, hidden=64, heads=4, vocab=128, seq_len=16,
                      micro_batch=2, dp=lay.dp, zero_stage=lay.zero, tp=lay.tp, pp=lay.pp, recompute=lay.recompute,
                      sequence_parallel=lay.sequence_parallel)
    from labkit.sim.memory import working_memory

    est, mem, work = estimate_memory(plan), rank_memory(SHAPE, lay), working_memory(SHAPE, lay)
    kept = (mem["parameters"] - work["gathered_layer"], mem["gradients"] - work["layer_gradient"], mem["optimizer"],
            mem["activations"] - work["recompute"])  # what is kept is estimate_memory's; the working set on top
    assert kept == pytest.approx((est.parameters, est.gradients, est.optimizer_state, est.activations))
    s = step_time(SHAPE, lay, TOY, "bf16")
    assert s.memory_total == pytest.approx(est.total + sum(work.values())) and s.fits


@pytest.mark.parametrize("layout, gathered, rebuilt", [
    (dict(), 0, 0),  # nothing gathered, nothing recomputed
    (dict(dp=4, zero=3, tp=2), (12 * 64 * 64 + 2 * 64) / 2 * 2, 0),  # one layer's weights, its 1/tp slice, bf16
    (dict(tp=4, recompute="full"), 0, 16 * 2 * 64 * (10 + 24 / 4 + 5 * 4 * 16 / (64 * 4)) - 2 * 16 * 2 * 64),
    (dict(tp=2, recompute="selective", sequence_parallel=True), 0, 16 * 2 * 64 * 5 * 4 * 16 / 64 / 2),
])
def test_one_layers_working_set_by_hand(layout, gathered, rebuilt):
    """ZeRO-3's gathered layer and its gradient (each a layer's bf16 weights on this TP rank); the recompute working
    set: a layer's activations without recompute (s·b·h·(10 + 24/t + 5·a·s/(h·t)), Korthikanti et al.) less what
    the recompute kept (full: the input, 2·s·b·h; selective with SP: all but the scores, 5·a·s²·b/t)."""
    lay = Layout(micro_batch=2, **layout)
    plan = MemoryPlan(params=count_params(GPT)["total"], n_layer=4, hidden=64, heads=4, vocab=128, seq_len=16,
                      micro_batch=2, dp=lay.dp, zero_stage=lay.zero, tp=lay.tp, pp=lay.pp, recompute=lay.recompute,
                      sequence_parallel=lay.sequence_parallel)
    est, mem = estimate_memory(plan), rank_memory(SHAPE, lay)
    assert (mem["parameters"] - est.parameters, mem["gradients"] - est.gradients,
            mem["activations"] - est.activations) == pytest.approx((gathered, gathered, rebuilt))
    from labkit.sim.memory import working_memory

    work = working_memory(SHAPE, lay)
    assert work == pytest.approx({"gathered_layer": gathered, "layer_gradient": gathered, "recompute": rebuilt})


def test_pipeline_memory_counts_the_micro_batches_in_flight():
    one = rank_memory(SHAPE, Layout(pp=4, micro_batches=1))["activations"]
    assert in_flight(Layout(pp=4, micro_batches=8)) == 4
    assert in_flight(Layout(pp=4, micro_batches=8, schedule="gpipe")) == 8
    assert in_flight(Layout(pp=4, micro_batches=2)) == 2
    assert rank_memory(SHAPE, Layout(pp=4, micro_batches=8))["activations"] == pytest.approx(4 * one)
    assert rank_memory(SHAPE, Layout(pp=4, micro_batches=8, schedule="gpipe"))["activations"] == pytest.approx(8 * one)


def test_a_model_too_big_for_the_gpu_does_not_fit():
    big = ModelShape(12288, 96, 96, 2048, 51200)  # 175B: 16 bytes a parameter is 2.8 TB on one GPU
    s = step_time(big, Layout(), TOY, "bf16")
    assert not s.fits and s.memory_total > 2e12


@pytest.mark.parametrize("bad", [dict(dp=0), dict(schedule="zigzag"), dict(chunks=2), dict(zero=4),
                                 dict(recompute="some"), dict(attention="fast"), dict(grad_compression=0.5),
                                 dict(sync_every=0), dict(bucket_bytes=0), dict(zero=3, sync_every=2),
                                 dict(tp=2, sync_every=2), dict(pp=2, sync_every=2), dict(cp=2, sync_every=2)])
def test_bad_layouts_are_refused(bad):
    with pytest.raises(ValueError):
        Layout(**bad)


def test_too_many_gpus_and_unknown_precision_are_refused():
    with pytest.raises(ValueError, match="GPUs"):
        run(dp=128)
    with pytest.raises(ValueError, match="precision"):
        step_time(SHAPE, Layout(), TOY, "fp8")


def test_fp32_runs_at_the_fp32_peak_with_four_byte_messages():
    s32 = step_time(SHAPE, Layout(tp=2), TOY, "fp32", EFF, NET)
    s16 = step_time(SHAPE, Layout(tp=2), TOY, "bf16", EFF, NET)
    assert s32.compute == pytest.approx(s16.compute * 312 / 19.5)
    assert s32.tp_comm > s16.tp_comm
    assert math.isclose(s32.peak_flops, 19.5e12)


def test_describe_shows_every_term_and_the_fit():
    text = run(dp=2, tp=2, pp=2, micro_batches=4).describe()
    for name in ("compute", "recompute", "attention memory", "tp comm", "pp comm", "bubble", "dp comm exposed",
                 "overlap slowdown", "dp comm hidden", "MFU", "parameters", "activations", "fits in 80 GB"):
        assert name in text, name
    assert "does NOT fit" in step_time(ModelShape(12288, 96, 96, 2048, 51200), Layout(), TOY).describe()
