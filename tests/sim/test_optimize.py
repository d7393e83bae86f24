"""The optimisation flowchart walked on the step model: which branch it takes, and that it never keeps a loss."""
import pytest

from labkit.sim import optimize as op
from labkit.sim.cluster import cluster
from labkit.sim.scenario import LABEL, SHAPE
from labkit.sim.step import Layout, step_time
from labkit.tuning.flowchart import COMMUNICATION_BOUND, COMPUTE_BOUND, UTILIZATION_OK, Thresholds
from labkit.tuning.runner import MEASURE, RECORD_BEST

LOW = Thresholds(utilization=0.3)  # the model's MFU never reaches 70%: a lower line reaches the utilization-ok branch


@pytest.fixture(scope="module")
def comm_bound():  # GPT-2 small's shape, pure DP in fp32 on 128 GPUs of DGX A100 nodes on 100 Gb/s Ethernet
    return op.optimize(SHAPE, Layout(dp=128, micro_batch=4), cluster("dgx-a100-ethernet", 128), "fp32")


@pytest.fixture(scope="module")
def compute_bound():
    return op.optimize(SHAPE, Layout(dp=8, micro_batch=8), cluster("dgx-a100", 8), "fp32")


@pytest.fixture(scope="module")
def busy():
    return op.optimize(SHAPE, Layout(dp=8, micro_batch=4, attention="flash"), cluster("dgx-a100", 64), "bf16", LOW)


def first_node(walk) -> str:
    return walk.decisions[0].reason.split("→ ")[1].split(":")[0]


def test_a_communication_bound_start_takes_the_communication_branch_first_and_ends_faster(comm_bound):
    assert first_node(comm_bound) == COMMUNICATION_BOUND
    assert comm_bound.start.measurement.comm_exposed_frac > Thresholds().comm_frac
    tried = [d for d in comm_bound.decisions if d.candidate is not None]
    assert tried[0].node == COMMUNICATION_BOUND and tried[0].kept
    assert "comm.compression" in tried[0].candidate.overrides
    assert comm_bound.speedup > 2 and comm_bound.best.step.fits
    assert comm_bound.best.step.total * comm_bound.start.layout.global_batch < \
        comm_bound.start.step.total * comm_bound.best.layout.global_batch  # faster per sequence, not just per step


def test_a_compute_bound_start_takes_the_compute_branch_and_switches_to_bf16(compute_bound):
    assert first_node(compute_bound) == COMPUTE_BOUND
    first = next(d for d in compute_bound.decisions if d.candidate is not None)
    assert first.node == COMPUTE_BOUND and first.candidate.overrides == {"precision.mode": "bf16"} and first.kept
    assert compute_bound.best.precision == "bf16" and compute_bound.speedup > 1


def test_utilization_ok_tries_a_bigger_micro_batch_and_more_gpus_while_the_cluster_has_them(busy):
    assert first_node(busy) == UTILIZATION_OK
    tried = [d for d in busy.decisions if d.node == UTILIZATION_OK]
    assert [next(iter(d.candidate.overrides)) for d in tried][:2] == ["data.micro_batch_size", "nproc"]
    assert all(d.trial is not None for d in tried[:2])  # 16 of 64 GPUs: both can be modelled
    full = op.optimize(SHAPE, Layout(dp=64, micro_batch=8, attention="flash"), cluster("dgx-a100", 64), "bf16", LOW)
    more = [d for d in full.decisions if d.candidate and "nproc" in d.candidate.overrides]
    assert more and not any(d.kept for d in more) and more[0].reason.startswith("skipped, not available")


@pytest.mark.parametrize("name", ["comm_bound", "compute_bound", "busy"])
def test_the_walk_never_keeps_a_slower_or_unfitting_configuration(name, request):
    walk = request.getfixturevalue(name)
    need = walk.thresholds.min_speedup
    rates = [walk.start.measurement.tokens_per_s]
    for d in walk.decisions:
        if d.kept:
            assert d.trial.tokens_per_s >= need * d.baseline.tokens_per_s
            rates.append(d.trial.tokens_per_s)
        elif d.trial is not None:
            assert d.trial.tokens_per_s < need * d.baseline.tokens_per_s or "does not fit" in d.reason
    assert rates == sorted(rates) and rates[-1] == walk.best.measurement.tokens_per_s
    assert walk.decisions[0].node == MEASURE and walk.decisions[-1].node == RECORD_BEST


def test_the_best_settings_replay_to_the_same_prediction(comm_bound):
    again = op.evaluate(SHAPE, comm_bound.start.layout, comm_bound.cluster, comm_bound.best.settings)
    assert again.step.total == comm_bound.best.step.total and again.layout == comm_bound.best.layout


def test_what_the_model_cannot_judge_is_skipped_with_a_reason_never_kept(comm_bound, compute_bound):
    for walk in (comm_bound, compute_bound):
        skipped = {next(iter(d.candidate.overrides)): d for d in walk.decisions if d.candidate and d.trial is None}
        assert "not modelled" in skipped["run.compile"].reason and not skipped["run.compile"].kept
        assert "labkit_flash" in str(walk.decisions) and "not modelled" in skipped["attention.backend"].reason


def test_exposed_communication_counts_the_collectives_the_step_waits_for():
    s = step_time(SHAPE, Layout(dp=4, tp=2, pp=2, micro_batches=4), cluster("dgx-a100", 16))
    in_flight, exposed = op.comm_shares(s)
    assert exposed == pytest.approx((s.tp_comm + s.pp_comm + s.dp_comm_exposed) / s.total)
    assert in_flight == pytest.approx(exposed + s.dp_comm_hidden / s.total) and s.tp_comm > 0 and s.pp_comm > 0
    m = op.measurement(SHAPE, Layout(dp=4, tp=2, pp=2, micro_batches=4), s, {})
    assert m.comm_exposed_frac == exposed and m.mfu == s.mfu and m.loss is None


def test_compression_ratios_follow_the_compressors():
    assert op.compression_ratio("bf16", SHAPE, 128, "fp32") == 2
    assert op.compression_ratio("bf16", SHAPE, 128, "bf16") == 1  # bf16 gradients already: nothing to halve
    assert op.compression_ratio("powersgd", SHAPE, 128, "fp32") > 10  # a low-rank sketch: far fewer bytes
    assert op.compression_ratio("topk", SHAPE, 2, "fp32") > 1  # two ranks: the gathered 1% is small
    with pytest.raises(op.NotModelled, match="rejected"):  # 128 ranks: every rank's 1% and indices outweigh it
        op.compression_ratio("topk", SHAPE, 128, "fp32")
    with pytest.raises(op.NotModelled, match="not modelled"):
        op.compression_ratio("sign", SHAPE, 128, "fp32")


def test_local_sgd_becomes_sync_every_and_replaces_compression():
    start = Layout(dp=128, micro_batch=8)
    settings = {**op.start_settings(SHAPE, start, "fp32"), "comm.compression": "none", "comm.sync": "local_sgd",
                "comm.sync_every": 8}
    layout, precision = op.model_of(SHAPE, start, settings)
    assert layout.sync_every == 8 and layout.grad_compression == 1 and precision == "fp32"
    split = Layout(dp=64, tp=2, micro_batch=8)  # the trainer refuses local SGD beside a split model: so does the model
    with pytest.raises(op.NotModelled, match="whole models"):
        op.model_of(SHAPE, split, {**op.start_settings(SHAPE, split, "fp32"), "comm.sync": "local_sgd",
                                   "comm.sync_every": 8})


def test_every_result_says_it_is_modelled(comm_bound):
    assert comm_bound.label == LABEL and "modelled" in LABEL
    assert all("modelled" in d.reason for d in comm_bound.decisions if d.candidate and d.trial)


def test_a_start_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        op.optimize(SHAPE, Layout(dp=8, micro_batch=512), cluster("dgx-a100", 8), "fp32")
