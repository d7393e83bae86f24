"""The optimisation flowchart's decisions, branch by branch, on synthetic measurements."""
import dataclasses

import pytest
import yaml

from labkit.config import Config, from_dict
from labkit.tuning.flowchart import (
    COMMUNICATION_BOUND,
    COMPUTE_BOUND,
    KERNELS_AND_COMPILE,
    UTILIZATION_OK,
    Candidate,
    Decision,
    Measurement,
    Thresholds,
    accept,
    best_config_yaml,
    candidate_actions,
    classify,
    flatten,
    next_node,
)

CURRENT = flatten(Config().to_dict())  # labkit's defaults: n_embd 64, n_head 2, fp32, sdpa, compile off


def measure(mfu=0.3, comm=0.1, tok=1000.0, loss=2.0, **kw):
    return Measurement(tokens_per_s=tok, mfu=mfu, comm_frac=comm, loss=loss, **kw)


def keys(candidates):
    return [c.feature for c in candidates]


# ---------------------------------------------------------------- classify, branch by branch

def test_low_mfu_high_comm_is_communication_bound():
    node, reason = classify(measure(mfu=0.2, comm=0.5))
    assert node == COMMUNICATION_BOUND and "20%" in reason and "50%" in reason and "35%" in reason
    assert keys(candidate_actions(node, CURRENT)) == [
        "comm.compression=bf16", "comm.compression=powersgd", "comm.compression=topk",
        "comm.sync=local_sgd", "comm.sync=diloco"]


def test_low_mfu_low_comm_is_compute_bound():
    node, reason = classify(measure(mfu=0.2, comm=0.1))
    assert node == COMPUTE_BOUND and "compute-bound" in reason
    candidates = candidate_actions(node, CURRENT)
    assert keys(candidates) == ["precision.mode=bf16", "model.n_embd=64"]
    shape = candidates[1]
    assert shape.overrides == {"model.n_embd": 64, "model.n_head": 1} and shape.changes_model
    assert "changes the model" in shape.reason
    assert not candidates[0].changes_model


def test_high_mfu_tries_a_bigger_batch_and_more_processes():
    node, reason = classify(measure(mfu=0.8, comm=0.5))  # utilisation first: comm does not matter here
    assert node == UTILIZATION_OK and "80%" in reason
    candidates = candidate_actions(node, {**CURRENT, "nproc": 2}, max_nproc=8)
    assert [c.overrides for c in candidates] == [{"data.micro_batch_size": 16, "data.batch_size": 32},
                                                 {"nproc": 4, "data.batch_size": 32}]
    assert all(c.available for c in candidates) and "changes the optimisation" in candidates[0].reason
    roomy = candidate_actions(node, {**CURRENT, "data.batch_size": 64}, max_nproc=8)
    assert roomy[0].overrides == {"data.micro_batch_size": 16} and "same global batch" in roomy[0].reason
    assert roomy[1].overrides == {"nproc": 2}


def test_then_kernels_and_compilation():
    for node in (COMMUNICATION_BOUND, COMPUTE_BOUND, UTILIZATION_OK):
        assert next_node(node) == KERNELS_AND_COMPILE
    assert next_node(KERNELS_AND_COMPILE) is None
    fresh = {**CURRENT, "attention.backend": "naive"}
    assert keys(candidate_actions(KERNELS_AND_COMPILE, fresh)) == [
        "attention.backend=sdpa", "attention.backend=labkit_flash", "run.compile=verify"]
    assert keys(candidate_actions(KERNELS_AND_COMPILE, CURRENT)) == [  # sdpa is the default: already applied
        "attention.backend=labkit_flash", "run.compile=verify"]


def test_mfu_unknown_goes_by_communication_and_says_so():
    node, reason = classify(measure(mfu=None, comm=0.6))
    assert node == COMMUNICATION_BOUND and "n/a" in reason and "unknown" in reason
    node, reason = classify(measure(mfu=None, comm=0.1))
    assert node == COMPUTE_BOUND and "n/a" in reason
    node, reason = classify(measure(mfu=0.3, comm=None))
    assert node == COMPUTE_BOUND and "unknown" in reason


def test_thresholds_move_the_boundaries():
    assert classify(measure(mfu=0.5), Thresholds(utilization=0.4))[0] == UTILIZATION_OK
    assert classify(measure(mfu=0.2, comm=0.3), Thresholds(comm_frac=0.25))[0] == COMMUNICATION_BOUND
    assert classify(measure(mfu=0.7, comm=0.9))[0] == UTILIZATION_OK  # at the threshold counts as fine


def test_communication_bound_is_decided_on_exposed_communication_not_in_flight():
    """A bucketed all-reduce can be in flight most of the step behind backward and cost little: the flowchart's
    "communication overhead" is the exposed share, and the in-flight one is context in the reason."""
    hidden = measure(mfu=0.2, comm=0.8, comm_exposed_frac=0.05)  # in flight 80%, nearly all of it overlapped
    node, reason = classify(hidden)
    assert node == COMPUTE_BOUND and "exposed communication is 5%" in reason and "in flight 80%" in reason
    exposed = measure(mfu=0.2, comm=0.5, comm_exposed_frac=0.4)  # the step waits 40% for communication
    node, reason = classify(exposed)
    assert node == COMMUNICATION_BOUND and "exposed communication is 40%" in reason and "> 35%" in reason
    node, reason = classify(measure(mfu=None, comm=0.8, comm_exposed_frac=0.05))  # no peak: still by exposed
    assert node == COMPUTE_BOUND and "exposed communication is 5%" in reason


def test_in_flight_stands_in_only_where_exposed_is_not_measured_and_the_reason_says_so():
    node, reason = classify(measure(mfu=0.2, comm=0.5, comm_exposed_frac=None))  # fsdp2: exposed unmeasurable
    assert node == COMMUNICATION_BOUND and "in flight is 50%" in reason and "not measured" in reason
    node, reason = classify(measure(mfu=0.2, comm=0.5, comm_exposed_frac=0.1))
    assert node == COMPUTE_BOUND and "not measured" not in reason


def test_the_source_texts_lines_are_written_once():
    from labkit.metrics.communication import SCALING_COLLAPSES, SCALING_HOLDS

    assert (SCALING_COLLAPSES, SCALING_HOLDS) == (0.35, 0.25) and Thresholds().comm_frac == SCALING_COLLAPSES
    node, reason = classify(measure(mfu=0.2, comm=0.6, comm_exposed_frac=0.3))  # between the lines: watch it
    assert node == COMPUTE_BOUND and "25% line" in reason
    assert "25% line" not in classify(measure(mfu=0.2, comm=0.6, comm_exposed_frac=0.2))[1]


# ---------------------------------------------------------------- candidates: applied, unavailable, conflicts

def test_applied_actions_are_skipped_and_unavailable_ones_are_marked_not_dropped():
    current = {**CURRENT, "precision.mode": "bf16", "model.n_embd": 128, "model.n_head": 2}
    assert candidate_actions(COMPUTE_BOUND, current) == []  # bf16 on, head size 64: nothing left
    candidates = candidate_actions(KERNELS_AND_COMPILE, CURRENT, {
        "attention.backend=labkit_flash": "needs triton", "run.compile": False})
    assert [(c.feature, c.available, c.unavailable_reason) for c in candidates] == [
        ("attention.backend=labkit_flash", False, "needs triton"),
        ("run.compile=verify", False, "not available on this machine")]
    more = candidate_actions(UTILIZATION_OK, {**CURRENT, "nproc": 4}, max_nproc=4)[1]
    assert not more.available and "at most 4" in more.unavailable_reason
    unknown = candidate_actions(UTILIZATION_OK, CURRENT)[1]
    assert not unknown.available and "max_nproc" in unknown.unavailable_reason


def test_sync_and_compression_exclude_each_other():
    compressed = {**CURRENT, "comm.compression": "powersgd"}
    by_feature = {c.feature: c for c in candidate_actions(COMMUNICATION_BOUND, compressed)}
    assert "comm.compression=powersgd" not in by_feature
    assert by_feature["comm.sync=local_sgd"].overrides == {"comm.sync": "local_sgd", "comm.sync_every": 8,
                                                          "comm.compression": "none"}
    synced = {**CURRENT, "comm.sync": "diloco"}
    by_feature = {c.feature: c for c in candidate_actions(COMMUNICATION_BOUND, synced)}
    assert by_feature["comm.compression=bf16"].overrides == {"comm.compression": "bf16", "comm.sync": "every_step"}
    assert "comm.sync=diloco" not in by_feature


def test_every_candidate_is_a_valid_config():
    """The overrides use real config keys and values (``nproc`` is a launch argument, not a key)."""
    for node in (COMMUNICATION_BOUND, COMPUTE_BOUND, UTILIZATION_OK, KERNELS_AND_COMPILE):
        for c in candidate_actions(node, {**CURRENT, "attention.backend": "naive"}, max_nproc=8):
            overrides = {k: v for k, v in c.overrides.items() if k != "nproc"}
            Config().replace(**overrides)  # raises ConfigError on an unknown key or value


def test_unknown_node_is_an_error():
    with pytest.raises(ValueError, match="unknown flowchart node"):
        candidate_actions("fast", CURRENT)
    with pytest.raises(ValueError, match="unknown flowchart node"):
        next_node("fast")


# ---------------------------------------------------------------- accept

def test_accept_keeps_a_clearly_faster_trial():
    base = Measurement.from_repeats([1000, 1010, 990], mfu=0.3, comm_frac=0.4, loss=2.0)
    fast = Measurement.from_repeats([1300, 1310, 1290], mfu=0.4, comm_frac=0.2, loss=2.01)
    kept, reason = accept(base, fast)
    assert kept and reason.startswith("kept") and "1.300×" in reason


def test_accept_keeps_a_faster_trial_whose_repeats_did_not_vary():
    base = Measurement.from_repeats([1000, 1000], mfu=0.3, comm_frac=0.4, loss=2.0)
    fast = Measurement.from_repeats([1300, 1300], mfu=0.4, comm_frac=0.2, loss=2.0)
    kept, reason = accept(base, fast)  # noise exactly 0: no division by it
    assert kept and "did not vary" in reason


def test_accept_never_keeps_a_slower_trial():
    base = Measurement.from_repeats([1000, 1010, 990], mfu=0.3, comm_frac=0.4, loss=2.0)
    for speed in (500, 900, 999, 1000):
        slow = Measurement.from_repeats([speed, speed + 1, speed - 1], mfu=0.3, comm_frac=0.4, loss=1.5)
        kept, reason = accept(base, slow)
        assert not kept and reason.startswith("rejected")


def test_accept_rejects_a_worse_loss_even_when_faster():
    base = measure(tok=1000, loss=2.0)
    kept, reason = accept(base, measure(tok=2000, loss=2.1))
    assert not kept and "loss" in reason and "2%" in reason
    assert accept(base, measure(tok=2000, loss=2.03))[0]  # 1.5% worse: within the 2% tolerance
    assert not accept(base, measure(tok=2000, loss=float("nan")))[0]
    assert not accept(base, measure(tok=2000, loss=None))[0]


def test_accept_needs_more_than_noise_and_more_than_min_speedup():
    noisy = Measurement.from_repeats([800, 1200, 1000], mfu=0.3, comm_frac=0.1, loss=2.0)
    trial = Measurement.from_repeats([1100, 1150, 1050], mfu=0.3, comm_frac=0.1, loss=2.0)
    kept, reason = accept(noisy, trial)
    assert not kept and "noise" in reason
    kept, reason = accept(measure(tok=1000), measure(tok=1020))  # +2% < min_speedup 1.03
    assert not kept and "1.03" in reason
    kept, reason = accept(measure(tok=1000), measure(tok=1100))  # no repeats: the ratio alone decides
    assert kept and "noise unknown" in reason
    with_std = dataclasses.replace(measure(tok=1000), tokens_per_s_std=80.0)
    assert not accept(with_std, measure(tok=1100))[0]  # 100 < 2 × 80


# ---------------------------------------------------------------- validation, the log, the result

@pytest.mark.parametrize("field, value, words", [
    ("utilization", 70, "did you mean 0.7?"), ("utilization", 0, "(0, 1]"), ("comm_frac", 1.5, "(0, 1]"),
    ("comm_frac", -0.1, "(0, 1]"), ("loss_tolerance", 1.0, "[0, 1)"), ("min_speedup", 0.9, "[1, 10)"),
    ("noise_sigmas", -1, "[0, 100)"), ("utilization", "high", "a fraction"), ("comm_frac", True, "a fraction"),
])
def test_threshold_validation(field, value, words):
    t = Thresholds(**{field: value})
    with pytest.raises(ValueError, match="invalid optimisation thresholds") as info:
        t.validate()
    assert field in str(info.value) and words in str(info.value)
    with pytest.raises(ValueError):
        classify(measure(), t)
    with pytest.raises(ValueError):
        accept(measure(), measure(), t)


def test_decision_log_record():
    base, trial = measure(mfu=0.2, comm=0.5), measure(mfu=0.3, comm=0.2, tok=1500)
    node, _ = classify(base)
    candidate = candidate_actions(node, CURRENT)[0]
    kept, reason = accept(base, trial)
    d = Decision(iteration=1, node=node, candidate=candidate, baseline=base, trial=trial, kept=kept, reason=reason)
    record = dataclasses.asdict(d)
    assert record["candidate"]["overrides"] == {"comm.compression": "bf16"} and record["kept"]
    assert isinstance(candidate, Candidate)


def test_best_config_yaml_applies_overrides_and_is_a_valid_config():
    base = {"model": {"n_layer": 4, "n_embd": 128}, "run": {"name": "tuned", "steps": 50}}
    text = best_config_yaml(base, {"comm.compression": "bf16", "precision.mode": "bf16", "nproc": 4})
    assert text.startswith("# found by labkit.tuning") and "--nproc 4" in text
    data = yaml.safe_load(text)
    assert data["model"] == {"n_layer": 4, "n_embd": 128} and data["comm"]["compression"] == "bf16"
    assert "nproc" not in data and base == {"model": {"n_layer": 4, "n_embd": 128},
                                            "run": {"name": "tuned", "steps": 50}}  # not modified
    assert from_dict(data).precision.mode == "bf16"
    assert "kept: nothing" in best_config_yaml(base, {})
