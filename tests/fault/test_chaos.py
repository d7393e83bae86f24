"""The chaos soak (issue 38 §1): a seeded plan of faults of every kind, its cost predicted before the run, the
timeout ladder and the hang watchdog — and the soak itself: 4 gloo processes, every kind at least once, the
final model bit for bit a clean run's with the same dropped updates, the useful fraction within 5 points of the
prediction."""
import threading
import time

import pytest

from labkit.config import ConfigError
from labkit.fault.chaos import (CHAOS_KINDS, ENDS_ATTEMPT, Planned, SoakCosts, chaos_plan, checkpoint_steps,
                                dropped_updates, fault_plan, measured_soak, planned_drops, predicted_soak,
                                replayed)
from labkit.fault.recovery import match_recoveries
from labkit.soak import fault_table, soak_experiment
from labkit.fault.watchdog import Watchdog
from labkit.validation import validate
from helpers import tiny_config

SOAK = {"run.steps": 150, "fault.checkpoint_every": 10, "fault.keep_last": 3, "fault.max_restarts": 8,
        "fault.chaos_faults": 6, "fault.chaos_every": 16, "fault.chaos_seed": 3, "fault.straggler_ms": 100.0,
        "fault.straggler_steps": 5, "comm.timeout_s": 8.0, "data.batch_size": 16, "data.micro_batch_size": 4,
        "metrics.alerts": False, "metrics.progress": False,
        "parallel.dp.strategy": "ddp_bucketed"}  # torch's DDP rebuilds its buckets after a resume: at dp 4 the sums
#                                                  then run in another order (a 1e-9 difference), not bit for bit


# ---------------------------------------------------------------- the plan

def test_a_plan_is_seeded_and_holds_every_kind_before_any_repeats():
    plan = chaos_plan(3, 8, 10.0, CHAOS_KINDS, 4, 400, 10)
    assert plan == chaos_plan(3, 8, 10.0, CHAOS_KINDS, 4, 400, 10) != chaos_plan(4, 8, 10.0, CHAOS_KINDS, 4, 400, 10)
    assert sorted(f.kind for f in plan[:6]) == sorted(CHAOS_KINDS) and len(plan) == 8
    steps = [f.step for f in plan]
    assert steps == sorted(set(steps)) and steps[0] >= 2 and steps[-1] < 399  # rising, distinct, inside the run
    assert all(0 <= f.rank < 4 for f in plan) and [f.index for f in plan] == list(range(8))
    saves = checkpoint_steps(10, 400)
    assert all(f.step in saves[1:] for f in plan if f.kind == "corrupt_checkpoint")  # a save with a valid one before
    assert checkpoint_steps(10, 40) == [9, 19, 29] and checkpoint_steps(0, 40) == []


def test_a_plan_that_does_not_fit_the_run_says_so():
    with pytest.raises(ValueError, match="do not fit in run.steps=30"):
        chaos_plan(0, 6, 20.0, CHAOS_KINDS, 4, 30, 5)


def test_the_single_fault_config_is_a_plan_of_one():
    cfg = tiny_config(**{"fault.inject": "crash", "fault.inject_step": 7, "fault.inject_rank": 1})
    assert fault_plan(cfg.fault, 2, 20) == [Planned(0, 7, "crash", 1)]
    assert fault_plan(tiny_config().fault, 2, 20) == []


# ---------------------------------------------------------------- the prediction, on a plan worked by hand

def test_the_prediction_adds_up_each_faults_terms():
    """Saves after steps 9, 19, 29, 39 (every 10 of 50). A crash before step 25 replays 20..24 (5 steps) and no
    save; a hang before 35: 30..34, plus the timeout; a corrupted save at 39 (it crashes after saving): back to
    the save at 29, replaying 30..39 and the save at 39 again; a NaN at 12 is redone by no restart (dropped), one at
    41... none later; a straggler at 44 for 3 steps."""
    plan = [Planned(0, 12, "nan", 0), Planned(1, 25, "crash", 1), Planned(2, 35, "hang", 2),
            Planned(3, 39, "corrupt_checkpoint", 3), Planned(4, 44, "straggler", 0)]
    costs = SoakCosts(step_s=0.1, save_s=0.5, restart_s=4.0, timeout_s=8.0, straggler_s=0.2)
    got = predicted_soak(plan, 50, 10, costs, straggler_steps=3)
    terms = got["terms_s"]
    assert terms["steps"] == pytest.approx(5.0) and terms["saves"] == pytest.approx(4 * 0.5)
    assert terms["restarts"] == pytest.approx(3 * 4.0) and terms["timeouts"] == pytest.approx(8.0)
    assert terms["replayed"] == pytest.approx((5 + 5 + 10) * 0.1 + 1 * 0.5)
    assert terms["stragglers"] == pytest.approx(3 * 0.2)
    assert got["dropped_updates"] == [12] and got["useful_s"] == pytest.approx(49 * 0.1)
    assert got["useful_fraction"] == pytest.approx(4.9 / sum(terms.values()))
    assert replayed(25, [9, 19], set()) == (5, 0) and replayed(40, [9, 19, 29, 39], {39}) == (10, 1)


def test_a_nan_step_done_again_after_a_restart_keeps_its_update():
    plan = [Planned(0, 12, "nan", 0), Planned(1, 15, "crash", 1)]  # back to the save at 9: 10..14 again
    costs = SoakCosts(0.1, 0.5, 4.0, 8.0, 0.2)
    assert predicted_soak(plan, 50, 10, costs, 3)["dropped_updates"] == []
    events = [{"type": "step", "step": 12, "skipped": True}, {"type": "step", "step": 13, "skipped": False},
              {"type": "resume"}, {"type": "step", "step": 12, "skipped": False}]
    assert dropped_updates(events) == []
    assert dropped_updates(events[:2]) == [12]
    assert planned_drops(plan, 50, 10) == [] and planned_drops(plan[:1], 50, 10) == [12]


def test_the_measured_fraction_reads_the_wall_time_from_the_first_steps_start_to_the_last():
    events = [{"type": "step", "step": 0, "time": 10.0, "step_time_s": 0.5, "skipped": False},
              {"type": "resume", "attempt": 1, "time": 15.0},
              {"type": "step", "step": 1, "time": 20.5, "step_time_s": 0.5, "skipped": True}]
    got = measured_soak(events, 2, 0.5)
    assert got["wall_s"] == pytest.approx(11.0) and got["dropped_updates"] == [1] and got["restarts"] == 1
    assert got["useful_fraction"] == pytest.approx(0.5 / 11.0)


def test_faults_that_end_no_attempt_match_no_resume_and_detections_are_timed():
    faults = [{"type": "fault", "kind": "nan", "step": 3, "time": 1.0, "planned": 0},
              {"type": "fault", "kind": "crash", "step": 6, "time": 2.0, "planned": 1},
              {"type": "detected", "rank": 0, "time": 2.25, "error": "peer closed"}]
    events = [{"type": "resume", "time": 5.0, "next_step": 5}, {"type": "step", "step": 5, "time": 6.0}]
    nan, crash = match_recoveries(faults, events)
    assert nan["recovery_s"] is None and nan["detected_s"] is None
    assert crash["detected_s"] == pytest.approx(0.25) and crash["recovery_s"] == pytest.approx(4.0)
    assert crash["steps_recomputed"] == 1 and crash["planned"] == 1


# ---------------------------------------------------------------- the ladder, the watchdog, bad input

@pytest.mark.parametrize("overrides, message", [
    ({"comm.timeout_s": 700.0}, "comm.timeout_s is not below fault.rendezvous_timeout_s"),
    ({"fault.watchdog_s": 100.0, "comm.timeout_s": 200.0}, "comm.timeout_s is not below fault.watchdog_s"),
    ({"fault.watchdog_s": 900.0}, "fault.watchdog_s is not below fault.rendezvous_timeout_s"),
    ({"fault.watchdog_s": 0.0}, "fault.watchdog_s: must be > 0"),
    ({"fault.max_restarts": 2}, "allow at least 4 restarts"),
    ({"fault.inject": "crash"}, "choose one"),
    ({"fault.chaos_kinds": ["boom"]}, "choose from crash, kill"),
    ({"fault.checkpoint_every": 0}, "needs checkpoints every fixed number of steps"),
    ({"fault.keep_last": 1}, "keep fault.keep_last >= 2"),
    ({"run.steps": 40}, "do not fit in run.steps=40"),
    ({"fault.chaos_every": 0.5}, "mean steps between faults must be >= 1"),
])
def test_bad_chaos_and_timeout_settings_are_refused_before_workers_start(overrides, message):
    validate(tiny_config(**SOAK), nproc=4)  # the soak's own config is sound
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**{**SOAK, **overrides}), nproc=4)


def test_the_watchdog_fires_once_when_no_step_finishes_and_never_while_steps_do():
    fired = []
    done = threading.Event()
    dog = Watchdog(0.3, lambda idle: (fired.append(idle), done.set()), poll_s=0.02).start()
    for _ in range(10):  # a second of steps, each well inside the timeout
        time.sleep(0.1)
        dog.beat()
    assert not fired
    assert done.wait(5) and len(fired) == 1 and fired[0] > 0.3
    time.sleep(0.2)
    assert len(fired) == 1 and not dog.thread.is_alive()
    quiet = Watchdog(0.2, fired.append, poll_s=0.02).start()
    quiet.stop()
    time.sleep(0.4)
    assert len(fired) == 1


# ---------------------------------------------------------------- the soak

@pytest.mark.multiproc
def test_the_chaos_soak_loses_nothing_and_costs_what_was_predicted(tmp_path):
    cfg = tiny_config(**SOAK)
    record = soak_experiment(cfg, 4, tmp_path, timeout_s=300, say=print)
    kinds = [f["kind"] for f in record["plan"]]
    assert len(kinds) >= 6 and set(kinds) == set(CHAOS_KINDS)
    assert record["soak_s"] <= 180, f"the soak took {record['soak_s']:.0f} s (bound: 3 min)"
    assert record["bitwise_equal"], record["equality"]
    assert record["measured"]["dropped_updates"] == record["predicted"]["dropped_updates"]
    assert record["summary"]["restarts"] == sum(k in ENDS_ATTEMPT for k in kinds)
    for row in fault_table(record):  # every fault on record, each that ended an attempt seen and recovered
        assert row["on_record"], row
        if row["kind"] in ENDS_ATTEMPT:
            assert row["detected_s"] is not None and row["recovery_s"] > row["detected_s"] >= 0, row
    assert record["points_apart"] <= 5, (
        f"useful fraction measured {record['measured']['useful_fraction']:.3f}, predicted "
        f"{record['predicted']['useful_fraction']:.3f}")
