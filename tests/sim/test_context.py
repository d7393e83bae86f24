"""Context parallelism in the step model (labkit.sim.context): its bytes are labkit.parallel.cp.volume's, its causal
imbalance labkit.parallel.cp's, its activations ÷ cp, its gradients averaged over dp × cp, and what the trainer refuses
the model refuses in the trainer's words.

The toy cluster and the small model of tests/sim/test_step.py (4 GPUs per node, intra 100 GB/s and 1 µs, inter 10 GB/s
and 10 µs, no GEMM quantisation, memory that streams for free; efficiencies 0.5), so that values follow by hand.
"""
import dataclasses
from fractions import Fraction

import pytest

from labkit.comm.collectives import wire_exact
from labkit.config import load_config
from labkit.model.flops import flops_per_token
from labkit.model.gpt import GPTShape
from labkit.parallel.cp.volume import cp_imbalance, cp_wire_bytes
from labkit.parallel.layout_checks import layout_problems
from labkit.sim import context, gemm
from labkit.sim.cluster import A100, Cluster, Link
from labkit.sim.step import Layout, ModelShape, rank_memory, step_time

INTRA = Link("toy NVLink", 100e9, 1e-6, "test")
INTER = Link("toy IB", 10e9, 10e-6, "test")
TOY = Cluster("toy", dataclasses.replace(A100, memory_bandwidth=float("inf"), sms=None), 4, 16, INTRA, INTER, "test")
SHAPE = ModelShape(hidden=64, layers=4, heads=4, seq=16, vocab=128)
GPT = GPTShape(vocab_size=128, block_size=16, n_layer=4, n_head=4, n_embd=64)
EFF, NET, BF16 = 0.5, 0.5, 2
RATE = EFF * 312e12
VARIANTS = ("ring", "allgather", "ulysses")


def run(**layout):
    return step_time(SHAPE, Layout(**layout), TOY, "bf16", EFF, NET, 0.0)


def sent(messages, cp: int) -> Fraction:
    """The wire bytes one rank sends for the step model's messages: the ring factors' exact count."""
    return sum((n * wire_exact(op, nbytes, cp) for n, op, nbytes in messages), Fraction(0))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_the_cp_bytes_are_the_volume_formulas(variant, cp, recompute):
    lay = Layout(tp=2, cp=cp, micro_batch=2, cp_impl=variant, recompute=recompute)
    block = 2 * (4 // 2) * (16 // cp) * (64 // 4) * BF16  # micro-batch × heads/tp × seq/cp × head dim × bf16
    assert context.block_bytes(SHAPE, lay, BF16) == block
    wire = cp_wire_bytes(variant, cp, block)
    passes = 1 if recompute == "none" else 2  # the checkpoint reruns the attention, and its collectives
    assert sent(context.cp_messages(SHAPE, lay, BF16), cp) == 4 * (passes * wire["forward"] + wire["backward"])


def test_the_ring_sends_by_hand_and_nothing_without_cp():
    lay = Layout(cp=4, micro_batch=1)
    kv = 2 * 1 * 4 * (16 // 4) * 16 * BF16  # k and v of one rank: 2 × its q-sized block
    [(n_fwd, op_f, fwd), (n_bwd, op_b, bwd)] = context.cp_messages(SHAPE, lay, BF16)
    assert (op_f, op_b) == ("send", "send") and fwd == bwd == kv
    assert (n_fwd, n_bwd) == (4 * 3, 4 * 7)  # per layer: cp − 1 blocks on; backward the block (cp − 1) and grads (cp)
    assert context.cp_messages(SHAPE, Layout(), BF16) == [] and run().cp_comm == 0


@pytest.mark.parametrize("tp,cp,link", [(2, 2, INTRA), (1, 4, INTRA), (2, 4, INTER)])
def test_cp_comm_costs_the_messages_on_the_link_of_cp_ranks_tp_apart(tp, cp, link):
    s = run(tp=tp, cp=cp, micro_batch=2, micro_batches=3)
    kv = 2 * 2 * (4 // tp) * (16 // cp) * 16 * BF16
    sends = 4 * ((cp - 1) + (2 * cp - 1))  # 4 layers, forward and backward
    assert s.cp_comm == pytest.approx(3 * sends * (link.latency + kv / (NET * link.bandwidth)))


def attention_seconds(s, lay: Layout) -> float:
    """The attention core's share of the compute term: compute less the other FLOPs (6N per token), per rank."""
    other = flops_per_token(GPT) - 12 * 4 * 64 * 16  # labkit's count less its 12·L·d·T
    return s.compute - other * lay.micro_batch * 16 / lay.cp / (lay.tp * lay.pp) * lay.micro_batches / RATE


@pytest.mark.parametrize("cp", [2, 4])
def test_a_contiguous_split_predicts_longer_attention_than_head_tail_by_the_imbalance(cp):
    head_tail, contiguous = (Layout(cp=cp, micro_batch=2, cp_layout=chunks) for chunks in ("head_tail", "contiguous"))
    s_ht, s_c = step_time(SHAPE, head_tail, TOY, "bf16", EFF, NET, 0.0), step_time(SHAPE, contiguous, TOY, "bf16",
                                                                                     EFF, NET, 0.0)
    mean = 12 * 4 * 64 * 16 * 2 * 16 / cp / RATE  # 12·L·d·T per token, the rank's tokens
    assert attention_seconds(s_ht, head_tail) == pytest.approx(mean)  # head-tail: balanced
    ratio = attention_seconds(s_c, contiguous) / attention_seconds(s_ht, head_tail)
    assert ratio == pytest.approx(cp_imbalance("ring", cp, "contiguous")) and ratio == pytest.approx((2 * cp - 1) / cp)
    assert s_c.total > s_ht.total and s_c.cp_comm == s_ht.cp_comm  # the same bytes, more work on the busiest rank
    ulysses = [run(cp=cp, micro_batch=2, cp_impl="ulysses", cp_layout=chunks) for chunks in ("head_tail", "contiguous")]
    assert ulysses[0].compute == ulysses[1].compute  # whole sequences of cp's share of the heads: no imbalance


def test_the_naive_scores_and_the_recomputed_attention_follow_the_busiest_rank():
    hbm = dataclasses.replace(TOY, gpu=dataclasses.replace(TOY.gpu, memory_bandwidth=1e12))  # the scores cost time
    for cluster, term in ((hbm, "attention_memory"), (TOY, "recompute")):  # TOY: no roofline, the same matmul rate
        whole, ht, c = (getattr(step_time(SHAPE, Layout(micro_batch=2, recompute="selective", **lay), cluster, "bf16",
                                          EFF, NET, 0.0), term)
                        for lay in ({}, dict(cp=4), dict(cp=4, cp_layout="contiguous")))
        assert ht == pytest.approx(whole / 4)  # s/cp query rows of the scores; selective reruns only the core
        assert c == pytest.approx(ht * 7 / 4)  # (2·cp − 1)/cp


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activations_per_rank_divide_by_cp(recompute):
    whole = rank_memory(SHAPE, Layout(micro_batch=4, recompute=recompute))
    for cp in (2, 4):
        split = rank_memory(SHAPE, Layout(micro_batch=4, recompute=recompute, cp=cp))
        assert split["activations"] == pytest.approx(whole["activations"] / cp)
        assert split["parameters"] == whole["parameters"]  # every cp rank holds the whole model


def test_gradients_are_averaged_and_zero_sharded_over_dp_times_cp():
    a, b = Layout(dp=2, cp=4, zero=1, micro_batch=2), Layout(dp=8, zero=1, micro_batch=2)
    assert a.gpus == 8 and a.gradient_ranks == 8 and a.global_batch == 4  # cp adds GPUs, not sequences
    assert rank_memory(SHAPE, a)["optimizer"] == rank_memory(SHAPE, b)["optimizer"]  # sharded over 8 either way
    s_a, s_b = step_time(SHAPE, a, TOY, "bf16", EFF, NET, 0.0), step_time(SHAPE, b, TOY, "bf16", EFF, NET, 0.0)
    assert s_a.dp_comm_hidden + s_a.dp_comm_exposed == pytest.approx(s_b.dp_comm_hidden + s_b.dp_comm_exposed)
    assert s_a.model_flops == pytest.approx(s_b.model_flops / 4)  # 2 replicas' sequences, not 8


def test_the_gemms_of_a_cp_rank_are_a_cp_th_of_the_flops():
    whole, quarter = (gemm.layer_gemms(64, 4, 16, 2, 1, cp) for cp in (1, 4))
    assert gemm.layer_gemms(64, 4, 16, 2, 1) == whole
    flops = [sum(2 * m * n * k * b for m, n, k, b in g) for g in (whole, quarter)]
    assert flops[1] * 4 == flops[0]


def quickstart(**dotted):
    return load_config("configs/quickstart.yaml", {"data.micro_batch_size": 1, "data.batch_size": 8,
                                                   "parallel.dp.strategy": "ddp_naive", **dotted})


@pytest.mark.parametrize("layout,shape,dotted", [
    (dict(cp=3), SHAPE, {"parallel.cp.degree": 3, "model.block_size": 16}),  # 6 head-tail chunks of 16 tokens
    (dict(cp=8, cp_impl="ulysses"), ModelShape(64, 4, 4, 64, 128),
     {"parallel.cp.degree": 8, "parallel.cp.impl": "ulysses", "model.n_head": 4}),  # 4 heads over 8 ranks
    (dict(cp=2, tp=2, sequence_parallel=True), SHAPE,
     {"parallel.cp.degree": 2, "parallel.tp.degree": 2, "parallel.tp.sequence_parallel": True, "model.block_size": 16}),
    (dict(cp=2, cp_impl="native"), SHAPE, {"parallel.cp.degree": 2, "parallel.cp.impl": "native"}),
])
def test_what_the_trainer_refuses_the_model_refuses_in_its_words(layout, shape, dotted):
    with pytest.raises(ValueError) as refused:
        step_time(shape, Layout(**layout), TOY)
    cfg = quickstart(**dotted)
    trainer_says = layout_problems(cfg, 8 * cfg.parallel.cp.degree * cfg.parallel.tp.degree)
    said = [p for p in trainer_says if p in str(refused.value)]
    assert said and str(refused.value) == "; ".join(said)


def test_an_unknown_variant_is_refused_and_the_axes_text_names_cp():
    with pytest.raises(ValueError, match="cp_impl must be one of"):
        run(cp=2, cp_impl="zigzag")
    assert Layout(dp=2, tp=2, pp=2).axes == "dp 2 × tp 2 × pp 2"
    assert Layout(dp=2, cp=4, cp_layout="contiguous").axes == "dp 2 × tp 1 × pp 1 × cp 4 (ring, contiguous)"
