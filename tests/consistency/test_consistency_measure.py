"""The CAP lab's pure parts: measures, SSP's rule, the partition schedule, and bad input."""
import time

import pytest
import torch

from helpers import tiny_config
from labkit.comm.partition import NetworkFaults
from labkit.config import ConfigError
from labkit.validation import validate
from labkit.consistency import measure
from labkit.consistency.lab import processes_for
from labkit.consistency.parameter_server import may_read


def _snap(times, steps, vectors):
    return {"times": times, "steps": steps, "vectors": [torch.tensor(v, dtype=torch.float32) for v in vectors]}


def test_divergence_is_the_distance_of_each_replica_to_their_average():
    worst, mean = measure.divergence([torch.tensor([0.0, 0.0]), torch.tensor([6.0, 8.0])])
    assert worst == pytest.approx(5.0) and mean == pytest.approx(5.0)
    assert measure.divergence([torch.ones(3), torch.ones(3), torch.ones(3)]) == (0.0, 0.0)


def test_divergence_over_time_takes_each_replica_as_it_last_was():
    snaps = {1: _snap([0.0, 1.0, 2.0], [0, 1, 2], [[0.0], [2.0], [2.0]]),
             2: _snap([0.5, 1.5], [0, 1], [[0.0], [0.0]])}
    series = measure.divergence_over_time(snaps)
    assert [p["t"] for p in series] == [0.5, 1.0, 1.5, 2.0]  # 0.0: replica 2 had no state yet
    assert [p["max"] for p in series] == [0.0, 1.0, 1.0, 1.0]


def test_lockstep_divergence_compares_replicas_after_the_same_step():
    """In sync mode one rank finishes the all-reduce a moment before the other: comparing them at the
    same step (at the time the last got there) shows the replicas as they are — identical."""
    snaps = {0: _snap([0.0, 1.00, 2.00], [0, 1, 2], [[0.0], [1.0], [2.0]]),
             1: _snap([0.0, 1.01, 2.01], [0, 1, 2], [[0.0], [1.0], [2.0]])}
    assert max(p["max"] for p in measure.divergence_over_time(snaps)) == 0.5  # the 10 ms in between
    lockstep = measure.divergence_over_time(snaps, lockstep=True)
    assert [(p["step"], p["t"], p["max"]) for p in lockstep] == [(0, 0.0, 0.0), (1, 1.01, 0.0), (2, 2.01, 0.0)]


def _records(spans, busy=0.1):
    return [{"step": i + 1, "t_start": a, "t_end": b, "busy_s": busy} for i, (a, b) in enumerate(spans)]


def test_availability_counts_computing_time_and_steps_inside_the_partition():
    # steps of 0.1 s computing: three before the window [1, 2), one stalled across it, two after
    records = _records([(0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.9, 2.1), (2.1, 2.3), (2.3, 2.5)])
    a = measure.availability(records, (1.0, 2.0))
    assert a["steps"] == 6 and a["steps_in_partition"] == 0 and a["busy_in_partition"] == 0.0
    assert a["busy_fraction"] == pytest.approx(0.6 / 2.5)
    busy = measure.availability(_records([(1.0, 1.2), (1.2, 1.4)]), (1.0, 2.0))
    assert busy["steps_in_partition"] == 2 and busy["busy_in_partition"] == pytest.approx(0.2)


def test_recovery_waits_for_every_worker_and_for_agreement():
    workers = {1: _records([(0.0, 0.5), (2.0, 2.3)]), 2: _records([(0.0, 0.5), (2.1, 2.6)])}
    series = [{"t": 0.5, "max": 0.1}, {"t": 1.5, "max": 0.9}, {"t": 2.3, "max": 0.5}, {"t": 2.6, "max": 0.05}]
    assert measure.recovery_s(workers, series, (1.0, 2.0)) == pytest.approx(0.6)  # 2.6: agreement again
    assert measure.recovery_s({1: _records([(0.0, 0.5)])}, series, (1.0, 2.0)) is None  # never stepped again
    assert measure.recovery_s(workers, series, None) is None


def test_summary_carries_staleness_histograms():
    updates = [{"staleness": s, "delay": d} for s, d in [(0, 0), (1, 2), (1, 3), (2, 1)]]
    snaps = {1: _snap([0.0], [0], [[1.0]]), 2: _snap([0.0], [0], [[1.0]])}
    s = measure.summarize({1: _records([(0, 1)]), 2: _records([(0, 1)])}, snaps, updates, None)
    assert s["staleness_max"] == 2 and s["staleness_counts"] == {0: 1, 1: 2, 2: 1}
    assert s["delay_max"] == 3 and s["delay_mean"] == 1.5 and s["divergence_max"] == 0.0


def test_ssp_lets_a_worker_read_only_within_s_clocks_of_the_slowest():
    assert may_read(3, [1, 3], bound=2) and not may_read(4, [1, 4], bound=2)
    assert may_read(1, [1, 1], bound=0) and not may_read(2, [1, 2], bound=0)
    assert may_read(100, [0, 100], bound=None)  # async: never held


def test_a_partition_holds_only_the_isolated_rank_and_only_inside_its_window():
    t0 = time.time()
    faults = NetworkFaults(partition_rank=1, partition_start_s=0.0, partition_s=0.3, t0=t0)
    assert faults.window == (0.0, 0.3) and faults.isolated(1, now=t0 + 0.1) and not faults.isolated(0, now=t0 + 0.1)
    assert not faults.isolated(1, now=t0 + 0.31) and not faults.isolated(1, now=t0 - 0.01)
    assert faults.hold(0) == 0.0
    before = time.time()
    held = faults.hold(1)  # released at the heal, however late (a busy machine) the call came
    after = time.time()
    assert after >= t0 + 0.3 and faults.hold(1) == 0.0  # healed
    assert max(0.0, t0 + 0.3 - after) <= held <= after - before
    assert NetworkFaults().window is None and NetworkFaults(partition_rank=1).window is None


def test_processes_for_adds_the_parameter_server():
    assert [processes_for(m, 2) for m in ("sync", "local_sgd", "ssp", "async")] == [2, 2, 3, 3]


@pytest.mark.parametrize("dotted, nproc, message", [
    ({"comm.consistency": "ssp", "comm.staleness": -1}, 3, "comm.staleness"),
    ({"comm.consistency": "sync", "comm.partition_rank": 1, "comm.partition_s": 5.0,
      "comm.partition_start_s": 2.0, "comm.duration_s": 6.0}, 2, "longer than the run"),
    ({"comm.consistency": "sync", "comm.partition_rank": 1, "comm.partition_s": 1.0}, 2, "comm.duration_s"),
    ({"comm.consistency": "sync", "comm.partition_rank": 4, "comm.partition_s": 1.0,
      "comm.duration_s": 6.0}, 2, "comm.partition_rank=4 is outside the world"),
    ({"comm.consistency": "async", "comm.slow_rank": 3}, 3, "comm.slow_rank=3"),
    ({"comm.consistency": "async"}, 1, "parameter server"),
    ({"comm.consistency": "sync", "comm.slow_rank": 1, "comm.slow_factor": 0.5}, 2, "comm.slow_factor"),
    ({"comm.partition_rank": 1, "comm.partition_s": 1.0, "comm.duration_s": 6.0}, 2, "set comm.consistency"),
])
def test_bad_consistency_settings_are_refused_before_workers_start(dotted, nproc, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**dotted), nproc=nproc)


def test_divergence_in_the_partition_includes_the_state_carried_into_it():
    """No replica moves during the partition (SSP at its bound): they are still as far apart as at its start."""
    snaps = {1: _snap([0.0, 0.9, 2.5], [0, 1, 2], [[0.0], [1.0], [1.0]]),
             2: _snap([0.0, 0.8, 2.6], [0, 1, 2], [[0.0], [0.0], [1.0]])}
    s = measure.summarize({1: _records([(0, 1)]), 2: _records([(0, 1)])}, snaps, [], (1.0, 2.0))
    assert s["divergence_max_in_partition"] == 0.5


def test_validation_loss_is_judged_on_the_same_tokens_whatever_the_seed():
    """Runs that differ only in seed (or compressor) are compared on the same validation tokens."""
    from labkit.consistency.lab import evaluate
    from labkit.consistency.replica import Replica
    from labkit.data import build_datasets
    from labkit.model import GPTShape

    cfg = tiny_config(**{"run.eval_batches": 2})
    train_ds, val_ds, tokenizer, _ = build_datasets(cfg.data.dataset, cfg.data.tokenizer, cfg.model.block_size,
                                                    cfg.data.val_fraction)
    replica = Replica(cfg, GPTShape.from_config(cfg.model, tokenizer.vocab_size, "naive"), train_ds, 0, 1)
    theta = replica.vector()
    losses = {seed: evaluate(replica, theta, val_ds, cfg.replace(**{"run.seed": seed})) for seed in (0, 1, 7)}
    assert losses[0] == losses[1] == losses[7]
    other_tokens = evaluate(replica, theta, val_ds, cfg.replace(**{"data.micro_batch_size": 2}))
    assert other_tokens != losses[0]  # the loss does depend on which tokens are read
