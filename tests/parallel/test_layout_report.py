"""Reading model-parallel runs back (labkit.parallel.reports.layout): each rank's exact share of the model, the
measured schedule on one time axis, the bubble, tensor parallelism's bytes, and a step split into parts that
add up. Everything here runs in this process, on synthetic events or on models built in it; one marked test
checks the arithmetic against a real 2-process run."""
import copy

import pytest
import torch

import labkit.parallel.tp.layers as tensor
from labkit.parallel.tp.model import parallelize_gpt
from helpers import tiny_config
from labkit.model import count_params
from labkit.model.gpt import GPT, GPTShape
from labkit.parallel.reports.layout import (bubble_over_m, format_layout_memory, layout_memory_rows, measured_grid,
                                           pipeline_ranks, pipeline_summary, predicted_rank_memory_for_layout,
                                           predicted_rank_params, rank_memory, start_event, step_split,
                                           tp_bytes_per_layer)
from labkit.parallel.mesh import ParallelDims
from labkit.parallel.reports.activation_memory import activation_memory
from labkit.parallel.pp.pipeline import GPTStage, bubble_fraction, ideal_bubble
from labkit.parallel.tp.volume import sequence_parallel_sync_bytes, tp_wire_bytes


def local_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied parameter is listed once


def split_model(shape: GPTShape, dims: ParallelDims, rank: int, monkeypatch) -> torch.nn.Module:
    """What ``train.build_trainer`` leaves on ``rank``: the full seeded GPT, its stage, then labkit's tensor-parallel
    layers. Building the layers only slices the weights, so this rank's tp coordinate and the tp size stand in
    for a process group (the same slices a real group of ``tp`` ranks would give; no collective runs)."""
    coord = dims.coordinate(rank)
    monkeypatch.setattr(tensor, "tp_rank_and_size", lambda group: (coord["tp"], dims.tp))
    torch.manual_seed(0)
    model = GPT(shape)
    if dims.pp > 1:
        model = GPTStage.from_gpt(model, coord["pp"], dims.pp)
    if dims.tp > 1:
        model = parallelize_gpt(model)
    return model


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("pp, tp", [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (3, 1), (3, 4)])
def test_the_predicted_count_is_each_ranks_local_parameters(monkeypatch, bias, pp, tp):
    shape = GPTShape(vocab_size=16, block_size=8, n_layer=3, n_head=4, n_embd=16, bias=bias)
    dims = ParallelDims(dp=2, pp=pp, tp=tp)
    for rank in range(dims.world_size):
        assert predicted_rank_params(shape, dims, rank) == local_params(split_model(shape, dims, rank, monkeypatch))


def test_over_a_real_group_of_one_the_split_model_holds_the_whole_count(group_of_one):
    shape = GPTShape(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=True)
    model = parallelize_gpt(copy.deepcopy(GPT(shape)))
    assert predicted_rank_params(shape, ParallelDims(), 0) == local_params(model) == count_params(shape)["total"]


def test_hand_counted_stages_of_the_quickstart_model():
    """n_embd 64, 2 blocks of 49,280 (4·64² + 8·64² matrices + two 64-wide norms), vocabulary 16, block 64, no bias:
    stage 0 = wte 1,024 + wpe 4,096 + one block; stage 1 = one block + ln_f 64 + its own copy of the head 1,024."""
    shape = GPTShape(vocab_size=16, block_size=64, n_layer=2, n_head=4, n_embd=64)
    pp2 = ParallelDims(pp=2)
    assert [predicted_rank_params(shape, pp2, r) for r in (0, 1)] == [54_400, 50_368]
    tp2 = ParallelDims(tp=2)  # each tp rank: half of every matrix and of the vocabulary; wpe and norms whole
    assert predicted_rank_params(shape, tp2, 0) == 2 * 24_576 + 2 * 128 + 512 + 4_096 + 64 == 54_080
    whole = count_params(shape)["total"]
    assert sum(predicted_rank_params(shape, pp2, r) for r in (0, 1)) == whole + 16 * 64  # the head's copy
    with pytest.raises(ValueError, match="n_embd=64 does not divide into 3 tensor-parallel slices"):
        predicted_rank_params(shape, ParallelDims(tp=3), 0)


def test_the_dp_strategy_shares_the_states_over_the_replicas():
    shape = GPTShape(vocab_size=16, block_size=64, n_layer=2, n_head=4, n_embd=64)
    dims = ParallelDims(dp=2, pp=2, tp=1)
    rank = dims.rank_at(dp=1, pp=0)
    params = predicted_rank_params(shape, dims, rank)
    assert params == 54_400
    plain = predicted_rank_memory_for_layout(shape, dims, rank, "ddp_naive")
    assert (plain.parameters, plain.gradients, plain.optimizer_state) == (4 * params, 4 * params, 8 * params)
    zero2 = predicted_rank_memory_for_layout(shape, dims, rank, "zero2")
    assert (zero2.parameters, zero2.gradients, zero2.optimizer_state) == (4 * params, 2 * params, 4 * params)
    fsdp = predicted_rank_memory_for_layout(shape, dims, rank, "fsdp2")
    assert fsdp.model_states == 8 * params
    mixed = predicted_rank_memory_for_layout(shape, ParallelDims(), 0, "ddp_naive", "mixed")
    assert mixed.model_states == 16 * count_params(shape)["total"]


def test_the_layout_table_of_a_big_model():
    gpt3 = GPTShape(vocab_size=51200, block_size=2048, n_layer=96, n_head=96, n_embd=12288, bias=True)
    rows = layout_memory_rows(gpt3, [dict(dp=1, pp=1, tp=1), dict(dp=1, pp=8, tp=8), dict(dp=8, pp=8, tp=8)],
                              strategy="zero1", precision="mixed")
    whole, split, sharded = rows
    assert whole["params"] == count_params(gpt3)["total"] and whole["model_states"] == 16 * whole["params"]
    assert split["busiest_rank"] == 0 and split["params"] == predicted_rank_params(gpt3, ParallelDims(pp=8, tp=8), 0)
    assert sharded["model_states"] == pytest.approx(4 * split["params"] + 12 * split["params"] / 8)
    assert whole["activations"] > split["activations"] > 0
    table = format_layout_memory(rows).splitlines()
    assert table[0].split()[:5] == ["dp", "×", "pp", "×", "tp"] and table[3].split()[:5] == ["8", "×", "8", "×", "8"]


# ---------------------------------------------------------------- the pipeline, from synthetic events

def span(kind, mb, start, end, wait=0.0):
    return {"kind": kind, "mb": mb, "start": start, "end": end, "wait": wait}


def two_stage_timeline(offset=0.0):
    """Two stages, one micro-batch, GPipe: stage 1's clock reading at its step start is 0.5 s later."""
    return [{"step_start": 100.0 + offset, "spans": [span("F", 0, 0.0, 1.0), span("B", 0, 2.0, 4.0, 1.0)]},
            {"step_start": 100.5 + offset, "spans": [span("F", 0, -0.5, 1.5, 1.0), span("B", 0, 1.5, 2.5)]}]


def test_the_measured_grid_lines_the_stages_up_on_one_clock():
    grid = measured_grid(two_stage_timeline(), [0, 1])
    assert [(s["start"], s["end"]) for s in grid[0]] == [(0.0, 1.0), (2.0, 4.0)]
    assert [(s["start"], s["end"]) for s in grid[1]] == [(0.0, 2.0), (2.0, 3.0)]
    assert grid[1][0]["wait"] == 1.0 and grid[0][1]["kind"] == "B"
    assert bubble_fraction(grid) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="not timed chunk by chunk"):
        measured_grid([{"step_start": 0.0, "spans": []}, {"step_start": 0.0, "spans": []}], [0, 1])


def test_one_pipeline_of_a_grid_is_every_stage_at_one_dp_and_tp_coordinate():
    dims = ParallelDims(dp=2, pp=2, tp=2)
    assert pipeline_ranks(dims) == [0, 4] and pipeline_ranks(dims, dp=1, tp=1) == [3, 7]  # pp outermost
    assert pipeline_ranks({"dp": 1, "pp": 4, "tp": 1}) == [0, 1, 2, 3]


class Cfg:
    """The attributes of a Config the report reads."""

    def __init__(self, schedule="gpipe", impl="labkit"):
        self.parallel = type("P", (), {"pp": type("PP", (), {"schedule": schedule, "impl": impl})()})()


def pipeline_events(m, idle=(0.4, 0.2), in_flight=1, mesh=None):
    start = {"type": "start", "mesh": mesh or {"dp": 1, "pp": 2, "tp": 1}, "grad_accum": m}
    step = {"type": "step", "step_time_s": 4.0, "rank_pipeline_idle": list(idle),
            "rank_pipeline_timeline": two_stage_timeline(), "pipeline_in_flight": in_flight}
    warmup = {**step, "rank_pipeline_idle": [0.9, 0.9]}
    return [start, warmup, step, step]


def test_pipeline_summary_and_the_bubble_over_m():
    s = pipeline_summary(pipeline_events(1), Cfg())
    assert (s["p"], s["m"], s["schedule"]) == (2, 1, "gpipe")
    assert s["idle"] == pytest.approx(0.3)  # the warm-up step is left out
    assert s["bubble"] == pytest.approx(0.5) and s["ideal"] == pytest.approx(0.5)
    assert (s["in_flight"], s["in_flight_predicted"]) == (1, 1) and len(s["ideal_grid"]) == 2
    rows = bubble_over_m([(pipeline_events(4), Cfg()), (pipeline_events(1), Cfg())])
    assert [r["m"] for r in rows] == [1, 4] and rows[1]["ideal"] == pytest.approx(ideal_bubble(2, 4))
    one_f_one_b = pipeline_summary(pipeline_events(8, in_flight=2), Cfg("1f1b"))
    assert one_f_one_b["in_flight_predicted"] == 2  # min(p, m) at stage 0, where GPipe would hold 8


def test_the_idle_share_is_read_from_one_pipelines_ranks():
    mesh = {"dp": 1, "pp": 2, "tp": 2}  # ranks 0, 2 are pipeline (tp 0); 1, 3 its tp neighbours
    events = pipeline_events(2, idle=(0.1, 0.9, 0.3, 0.9), mesh=mesh)
    for e in events[1:]:
        e["rank_pipeline_timeline"] = [two_stage_timeline()[0], None, two_stage_timeline()[1], None]
    assert pipeline_summary(events, Cfg())["idle"] == pytest.approx(0.2)


# ---------------------------------------------------------------- tensor parallelism's bytes

class TpCfg:
    def __init__(self, sp=False, n_layer=2, impl="labkit"):
        self.model = type("M", (), {"n_layer": n_layer, "n_embd": 32, "block_size": 16, "bias": False,
                                    "recompute": "none"})()
        self.data = type("D", (), {"micro_batch_size": 4})()
        self.parallel = type("P", (), {"tp": type("T", (), {"sequence_parallel": sp, "impl": impl})()})()


@pytest.mark.parametrize("sp", [False, True])
def test_bytes_per_layer_take_out_what_is_not_a_layer_and_every_micro_batch(sp):
    m, parts = 3, tp_wire_bytes(4, 16, 32, 2, 2, 4, sp)
    sync = sequence_parallel_sync_bytes(32, 2, 16, False, 2) if sp else 0
    start = {"mesh": {"dp": 1, "pp": 1, "tp": 2}, "grad_accum": m}
    got = tp_bytes_per_layer({"model_comm_bytes": m * parts["total"] + sync}, start, TpCfg(sp))
    assert got["measured_total"] == got["analytic_total"] == m * parts["total"] + sync
    assert got["measured_per_layer"] == got["analytic_per_layer"] == parts["per_layer"]
    assert got["micro_batches"] == m and got["analytic_parts"]["sequence_parallel_sync"] == sync
    off = tp_bytes_per_layer({"model_comm_bytes": m * parts["total"] + sync + 6 * 100}, start, TpCfg(sp))
    assert off["measured_per_layer"] == parts["per_layer"] + 100  # 600 bytes more, over 3 micro-batches × 2 layers
    assert tp_bytes_per_layer({"model_comm_bytes": None}, start,
                              TpCfg(sp, impl="dtensor"))["measured_per_layer"] is None


def test_with_a_pipeline_rank_0_sends_its_stages_layers_and_the_embedding_only():
    """pp = 2 × tp = 2, 4 layers: rank 0 holds blocks 0 and 1 and the embedding; the head and the loss are on the
    last stage, and the pipeline's own messages are counted apart (``pipeline_comm_bytes``)."""
    m, parts = 2, tp_wire_bytes(4, 16, 32, 2, 2, 4)
    start = {"mesh": {"dp": 1, "pp": 2, "tp": 2}, "grad_accum": m}
    sent = m * (parts["embedding"] + 2 * parts["per_layer"])
    got = tp_bytes_per_layer({"model_comm_bytes": sent}, start, TpCfg(n_layer=4))
    assert got["analytic_total"] == sent and got["measured_per_layer"] == parts["per_layer"] and got["n_layer"] == 2


# ---------------------------------------------------------------- the step split

def step(step_time, data, exposed, model_comm, idle_s=0.0):
    return {"type": "step", "step_time_s": step_time, "data_s": data, "comm_exposed_s": exposed,
            "model_comm_s": model_comm, "pipeline_idle_s": idle_s}


def test_the_step_split_adds_up():
    events = [{"type": "start"}, step(9.0, 9.0, 9.0, 9.0),  # the warm-up step, left out
              step(1.0, 0.05, 0.1, 0.15, idle_s=0.2), step(1.2, 0.05, 0.1, 0.15, idle_s=0.2)]
    s = step_split(events)
    assert s["step"] == pytest.approx(1.1)
    assert (s["bubble"], s["model_comm"], s["dp_comm"], s["data"]) == pytest.approx((0.2, 0.15, 0.1, 0.05))
    assert s["compute"] == pytest.approx(0.6)
    assert s["compute"] + s["data"] + s["dp_comm"] + s["model_comm"] + s["bubble"] == pytest.approx(s["step"])
    plain = step_split([{"type": "start"}, step(1.0, 0.1, 0.2, 0.3)], skip=0)
    assert (plain["bubble"], plain["compute"]) == (0.0, pytest.approx(0.4)) and plain["model_comm_counted"]
    fsdp = step_split([{"type": "start"}, step(1.0, 0.1, None, 0.3)], skip=0)
    assert fsdp["compute"] is None and fsdp["step"] == 1.0
    dtensor = step_split([{"type": "start"}, step(1.0, 0.1, 0.2, None)], skip=0)
    assert not dtensor["model_comm_counted"] and dtensor["compute"] == pytest.approx(0.7)
    torch_pipeline = step_split([{"type": "start", "mesh": {"dp": 1, "pp": 2, "tp": 1}},
                                 {**step(1.0, 0.1, 0.2, 0.0), "rank_pipeline_timeline": None}], skip=0)
    assert not torch_pipeline["bubble_counted"] and plain["bubble_counted"]
    clamped = step_split([{"type": "start"}, step(1.0, 0.1, 0.2, 0.5, idle_s=0.3)], skip=0)
    assert clamped["compute"] == 0.0 and clamped["model_comm"] == pytest.approx(0.4)  # the parts still add up


# ---------------------------------------------------------------- one real run

@pytest.mark.multiproc
def test_a_real_tensor_parallel_run_sends_and_holds_what_the_report_predicts():
    """tp = 2 with sequence parallelism, 2 micro-batches per step: rank 0's model-parallel bytes are exactly
    2 × tp_wire_bytes + the sequence-parallel gradient sync, and every rank's model states are the prediction."""
    from labkit.widgets.model_parallel import layout_point, run_layouts, steady_last

    config = tiny_config(**{"run.steps": 2, "model.n_layer": 2, "parallel.dp.strategy": "ddp_naive",
                            "run.save_final": False})
    (record,) = run_layouts(config, 2, [layout_point(config, 2, tp=2, m=2, sequence_parallel=True)])
    events, cfg = record["events"], record["cfg"]
    got = tp_bytes_per_layer(steady_last(events), start_event(events), cfg)
    assert got["measured_total"] == got["analytic_total"] and got["measured_per_layer"] == got["analytic_per_layer"]
    for r in rank_memory(events, cfg):
        assert r["measured_total"] == r["predicted_total"], r


@pytest.mark.multiproc
def test_each_stages_activation_peak_read_by_the_tracker_is_the_prediction():
    """pp = 2, m = 4: labkit's 1F1B and GPipe and torch's 1F1B. On the tracked step the allocation tracker is read
    between the schedule's forwards (labkit.parallel.pp.pipeline.ActivationPeak): what the held micro-batches took at
    their peak, on every stage, is within 10% of activation_memory's prediction (one micro-batch's count × the
    schedule's number held) — and GPipe, holding all m, reads about m/min(p − s, m) times what 1F1B does."""
    from labkit.widgets.model_parallel import layout_point, run_layouts

    config = tiny_config(**{"run.steps": 3, "model.n_layer": 2, "model.n_embd": 64, "model.block_size": 64,
                            "parallel.dp.strategy": "ddp_naive", "run.save_final": False})
    points = [layout_point(config, 2, pp=2, m=4, schedule=schedule, extra={"parallel.pp.impl": impl})
              for impl, schedule in (("labkit", "1f1b"), ("torch", "1f1b"), ("labkit", "gpipe"))]
    peaks = {}
    for (label, overrides), record in zip(points, run_layouts(config, 2, points)):
        report = activation_memory(record["events"], record["cfg"])
        assert report["why_not"] is None
        for row in report["rows"]:
            assert row["measured_peak"] is not None, (label, row)
            assert abs(row["measured_peak"] / row["predicted_peak"] - 1) <= 0.10, (label, row)
        peaks[(overrides["parallel.pp.impl"], overrides["parallel.pp.schedule"])] = [
            row["measured_peak"] for row in report["rows"]]
    assert peaks[("labkit", "gpipe")][0] > 1.8 * peaks[("labkit", "1f1b")][0]  # m = 4 held against p − 0 = 2
    assert peaks[("labkit", "gpipe")][1] > 3.6 * peaks[("labkit", "1f1b")][1]  # 4 against 1


def test_a_context_parallel_rank_shards_its_state_over_dp_times_cp():
    """ZeRO and FSDP2 shard over the gradient axis (dp × cp): at dp 2 × cp 2 a rank keeps a quarter."""
    shape = GPTShape(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    params = predicted_rank_params(shape, ParallelDims(dp=2, cp=2), 0)
    assert params == predicted_rank_params(shape, ParallelDims(), 0)  # cp holds every parameter
    zero1 = predicted_rank_memory_for_layout(shape, ParallelDims(dp=2, cp=2), 3, "zero1")
    dp4 = predicted_rank_memory_for_layout(shape, ParallelDims(dp=4), 3, "zero1")
    assert zero1.optimizer_state == dp4.optimizer_state
    fsdp = predicted_rank_memory_for_layout(shape, ParallelDims(dp=2, cp=2), 3, "fsdp2")
    assert fsdp.parameters < 4 * params / 3  # about a quarter of 4 bytes each, not a half
