"""Pipeline parallelism (labkit.parallel.pp.pipeline, labkit.parallel.pp.torch_pipelining): the split, the textbook
schedules and bubble, one stage equal to the GPT, and a real pipeline on gloo equal to the whole model."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.launcher import free_port
from labkit.model.gpt import GPT, GPTShape
from labkit.parallel.pp.pipeline import (GPTStage, PipelineSchedule, bubble_fraction, describe_partition,
                                      expected_p2p_bytes, format_grid, ideal_bubble, ideal_schedule, partition,
                                      partition_ends, peak_activations_in_flight, replayed_bubble, span_busy_s,
                                      stage_layers, stage_order)
from labkit.model.flops import flops_per_token, part_flops_per_token
from labkit.parallel.pp.torch_pipelining import TorchPipelineSchedule

WORKER = Path(__file__).parent / "pipeline_worker.py"
SHAPE = GPTShape(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_embd=16, attention="naive", bias=False)


def test_blocks_split_contiguously_earlier_stages_taking_the_extra_ones():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_layers(3, 1) == [range(0, 3)]
    with pytest.raises(ValueError, match="cannot split 3 blocks into 4 pipeline stages: every stage needs at least"):
        stage_layers(3, 4)


def test_stages_balance_their_counted_cost_a_heavy_head_leaving_the_last_stage_fewer_blocks():
    """ends = the embedding's and the head's extra cost, in blocks: the costliest stage costs as little as it can."""
    assert stage_layers(4, 2, (0.0, 0.04)) == [range(0, 2), range(2, 4)]  # a small head: still the even split
    assert [len(r) for r in stage_layers(8, 4, (0.0, 1.5))] == [3, 2, 2, 1]  # costs 3, 2, 2, 2.5 (even: 2, 2, 2, 3.5)
    assert [len(r) for r in stage_layers(12, 4, (0.0, 4.46))] == [4, 4, 3, 1]  # GPT-2's head: 4.46 blocks
    assert [len(r) for r in stage_layers(6, 2, (0.5, 0.5))] == [3, 3]
    assert [len(r) for r in stage_layers(6, 3, (2.0, 0.0))] == [1, 3, 2]


def test_the_partition_is_the_counted_flops_and_every_part_of_labkit_uses_it():
    heavy = GPTShape(vocab_size=8192, block_size=8, n_layer=8, n_head=2, n_embd=16, attention="naive", bias=False)
    first, last = partition_ends(heavy)
    parts = part_flops_per_token(heavy)
    assert first == 0.0 and last == pytest.approx(parts["head"] / parts["block"]) and last > 1
    assert heavy.n_layer * parts["block"] + parts["head"] == flops_per_token(heavy)
    split = partition(heavy, 4)
    assert [len(r) for r in split] != [2, 2, 2, 2] and len(split[-1]) == 1
    assert [r["n_blocks"] for r in describe_partition(heavy, 4)] == [len(r) for r in split]
    torch.manual_seed(0)
    model = GPT(heavy)
    assert [GPTStage.from_gpt(model, s, 4).layers for s in range(4)] == split
    assert [len(r) for r in partition(heavy, 4)] == [len(r) for r in partition(heavy.__dict__, 4)]  # a dict too


def test_1f1b_warms_up_then_alternates_then_cools_down():
    assert stage_order(4, 6, "1f1b", 0) == [("F", 0), ("F", 1), ("F", 2),  # warm-up: p − 0 − 1 forwards
                                            ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("F", 5), ("B", 2),
                                            ("B", 3), ("B", 4), ("B", 5)]  # cool-down
    assert stage_order(4, 2, "1f1b", 1) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # m < p − s − 1: all warm-up
    assert stage_order(3, 2, "gpipe", 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        stage_order(2, 2, "zb", 0)


def test_the_ideal_grids_are_the_textbook_pictures():
    """Hand-drawn: F and B one slot each; a step runs once the neighbour it needs is done; "." is idle."""
    assert format_grid(ideal_schedule(2, 4, "gpipe")) == [
        "F0 F1 F2 F3 .  .  B0 B1 B2 B3",
        ".  F0 F1 F2 F3 B0 B1 B2 B3 ."]
    assert format_grid(ideal_schedule(2, 4, "1f1b")) == [
        "F0 F1 .  B0 F2 B1 F3 B2 .  B3",
        ".  F0 B0 F1 B1 F2 B2 F3 B3 ."]
    assert format_grid(ideal_schedule(4, 4, "gpipe")) == [
        "F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3",
        ".  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .",
        ".  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .",
        ".  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  ."]
    assert format_grid(ideal_schedule(4, 4, "1f1b")) == [
        "F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3",
        ".  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 .",
        ".  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .  .",
        ".  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  ."]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (2, 4), (3, 2), (4, 4), (4, 8), (8, 3)])
def test_the_ideal_grids_idle_share_is_the_bubble_formula_and_their_peak_is_the_activation_count(schedule, p, m):
    grid = ideal_schedule(p, m, schedule)
    slots = 2 * (m + p - 1)
    assert [len(row) for row in grid] == [slots] * p
    idle = sum(slots - sum(cell is not None for cell in row) for row in grid)
    assert idle / (p * slots) == pytest.approx(ideal_bubble(p, m))
    for stage, row in enumerate(grid):
        held = [sum(1 if kind == "F" else -1 for kind, _ in filter(None, row[:t + 1])) for t in range(len(row))]
        assert max(held) == peak_activations_in_flight(p, m, schedule, stage)


def test_bubble_formula_and_peak_activations():
    assert ideal_bubble(1, 8) == 0
    assert ideal_bubble(2, 4) == pytest.approx(1 / 5) and ideal_bubble(4, 4) == pytest.approx(3 / 7)
    assert [peak_activations_in_flight(4, 8, "1f1b", s) for s in range(4)] == [4, 3, 2, 1]
    assert [peak_activations_in_flight(4, 2, "1f1b", s) for s in range(4)] == [2, 2, 2, 1]
    assert [peak_activations_in_flight(4, 8, "gpipe", s) for s in range(4)] == [8] * 4
    assert [expected_p2p_bytes(s, 3, 4, 100) for s in range(3)] == [400, 800, 400]
    assert expected_p2p_bytes(0, 1, 4, 100) == 0


def test_measured_bubble_is_the_idle_share_of_stages_times_makespan():
    """Two stages, one micro-batch; the makespan is 4 s, each rank busy 2 s of it (waits are idle)."""
    rank0 = [{"kind": "F", "mb": 0, "start": 0.0, "end": 1.0, "wait": 0.0},
             {"kind": "B", "mb": 0, "start": 2.0, "end": 4.0, "wait": 1.0}]
    rank1 = [{"kind": "F", "mb": 0, "start": 0.0, "end": 2.0, "wait": 1.0},
             {"kind": "B", "mb": 0, "start": 2.0, "end": 3.0, "wait": 0.0}]
    assert bubble_fraction([rank0, rank1]) == pytest.approx(0.5)
    assert bubble_fraction([[{"kind": "F", "mb": 0, "start": 5.0, "end": 6.0, "wait": 0.0}]]) == pytest.approx(0.0)


def _constant_timelines(p: int, m: int, schedule: str, forward: float, backward: float) -> list[list[dict]]:
    return [[{"kind": kind, "mb": i, "start": 0.0, "end": forward if kind == "F" else backward, "wait": 0.0,
              "cpu": forward if kind == "F" else backward} for kind, i in stage_order(p, m, schedule, s)]
            for s in range(p)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 8), (4, 16), (3, 5)])
def test_a_replay_of_equal_spans_leaves_the_bubble_of_the_formula(schedule, p, m):
    """Equal forwards and equal backwards (a backward twice a forward) on every stage: no imbalance, no jitter."""
    timelines = _constant_timelines(p, m, schedule, 1.0, 2.0)
    assert replayed_bubble(timelines) == pytest.approx(ideal_bubble(p, m))
    assert replayed_bubble(timelines, clock="cpu") == pytest.approx(ideal_bubble(p, m))


def test_a_replay_shows_a_slow_stage_and_reads_the_clock_it_is_given():
    timelines = _constant_timelines(2, 8, "1f1b", 1.0, 2.0)
    for span in timelines[1]:
        span["end"] *= 1.5  # the last stage 1.5× slower (its head): the first waits for it
    assert replayed_bubble(timelines) > ideal_bubble(2, 8) * 1.5
    assert replayed_bubble(timelines, clock="cpu") == pytest.approx(ideal_bubble(2, 8))  # its CPU time did not grow
    timelines[0][0]["wait"] = 0.5  # a wait is no work
    assert span_busy_s(timelines[0][0]) == 0.5 and span_busy_s(timelines[0][0], "cpu") == 1.0


def _batch(m: int, micro: int = 2):
    torch.manual_seed(3)
    x, y = (torch.randint(0, SHAPE.vocab_size, (m * micro, SHAPE.block_size)) for _ in range(2))
    return list(zip(x.split(micro), y.split(micro)))


def test_one_stage_is_the_gpt_exactly_tie_included():
    torch.manual_seed(0)
    model = GPT(SHAPE)
    stage = GPTStage.from_gpt(model, 0, 1)
    assert stage.lm_head.weight is stage.wte.weight and stage.wte.weight is not model.wte.weight
    (x, y), = _batch(1)
    logits, loss = model(x, y)
    loss.backward()
    assert torch.equal(stage(x), logits) and torch.equal(stage(x, y), loss)
    stage(x, y).backward()
    for name, param in stage.named_parameters():
        assert torch.equal(param.grad, model.get_parameter(stage.gpt_name(name)).grad), name


def test_two_stages_split_the_model_and_untie_the_embedding():
    torch.manual_seed(0)
    model = GPT(SHAPE)
    first, last = GPTStage.from_gpt(model, 0, 2), GPTStage.from_gpt(model, 1, 2)
    assert [n for n, _ in first.named_parameters()][:2] == ["wte.weight", "wpe.weight"]
    names = {first.gpt_name(n) for n, _ in first.named_parameters()}
    assert {"blocks.0.attn.qkv.weight", "blocks.1.mlp.fc.weight"} <= names and "blocks.2.mlp.fc.weight" not in names
    assert last.gpt_name("blocks.0.ln_1.weight") == "blocks.2.ln_1.weight" and not hasattr(last, "wte")
    assert torch.equal(last.lm_head.weight, model.wte.weight) and last.lm_head.weight is not model.wte.weight
    (x, y), = _batch(1)
    _, want = model(x, y)
    assert torch.equal(last(first(x), y), want)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_of_one_stage_is_gradient_accumulation(schedule):
    """No process group needed: a one-stage schedule never communicates. Each micro-batch's loss / m, summed."""
    torch.manual_seed(0)
    model = GPT(SHAPE)
    stage = GPTStage.from_gpt(model, 0, 1)
    micro_batches = _batch(4)
    want = 0.0
    for x, y in micro_batches:
        share = model(x, y)[1] / 4
        share.backward()
        want += share.item()
    runner = PipelineSchedule(stage, 0, 1, schedule=schedule)
    assert runner.run(micro_batches) == pytest.approx(want, rel=1e-6)
    for name, param in stage.named_parameters():
        assert torch.equal(param.grad, model.get_parameter(stage.gpt_name(name)).grad), name
    assert runner.max_in_flight == peak_activations_in_flight(1, 4, schedule, 0) and runner.p2p_bytes == 0
    assert [(s["kind"], s["mb"]) for s in runner.timeline] == stage_order(1, 4, schedule, 0)


def test_torch_schedules_refuse_what_they_cannot_run():
    torch.manual_seed(0)
    stage = GPTStage.from_gpt(GPT(SHAPE), 0, 1)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        PipelineSchedule(stage, 0, 1, schedule="zb")
    with pytest.raises(ValueError, match="interleaved 1F1B takes several stages per rank"):
        TorchPipelineSchedule(stage, 0, 1, schedule="interleaved_1f1b")


def _torchrun(world: int, out: Path, timeout: float = 240):
    """Run the worker on ``world`` ranks; on timeout end torchrun (which ends its workers) and fail.

    The workers sit in sessions of their own (torchrun starts them so); each also ends itself after 150 s
    (faulthandler's watchdog), so none outlives a hang even if torchrun had to be killed."""
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(WORKER), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
        pytest.fail(f"the {world}-rank pipeline did not finish in {timeout} s:\n{stderr[-3000:]}")
    return proc.returncode, stderr


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_a_pipeline_on_gloo_equals_the_whole_model(tmp_path, world):
    """For labkit's and torch's GPipe and 1F1B, m in 1, p − 1, p, 2p: the loss and every stage's gradients equal
    the whole model's (the tied embedding's summed over its two copies); labkit's 1F1B gives GPipe's gradients
    bitwise; labkit's equal torch's bitwise (torch is run with labkit's loss scaling), and torch's 1F1B its GPipe;
    labkit counts the
    analytic bytes (m activations forward and m gradients back per boundary, plus the loss broadcast and the tied
    all-reduce) and holds the textbook number of activations. torch's 1F1B refuses m < p with a clear reason;
    torch's interleaved 1F1B (2 stages per rank, 2p blocks) equals the whole model at m = p and 2p."""
    returncode, stderr = _torchrun(world, tmp_path)
    assert returncode == 0, stderr[-3000:]
    timelines = {"labkit": [], "torch": []}
    for rank in range(world):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        failed = {name: checks for name, checks in seen["checks"].items() if not all(checks)}
        assert not failed, (rank, failed)
        assert any(name.startswith("torch_interleaved") for name in seen["checks"])
        assert {f"labkit_vs_torch_1f1b_m{world}", f"torch_1f1b_equals_gpipe_m{2 * world}"} <= set(seen["checks"])
        for impl, spans in seen["timelines"].items():
            timelines[impl].append(spans)
    for impl, spans in timelines.items():  # the same step replayed without waits can only be as idle, or less
        measured, replayed = bubble_fraction(spans), replayed_bubble(spans)
        assert ideal_bubble(world, 2 * world) * 0.5 <= replayed <= measured + 1e-9 < 1.0, (impl, replayed, measured)
