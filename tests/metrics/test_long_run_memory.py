"""A long run holds bounded memory: the trainer keeps no list of its steps, a watcher thins old ones."""
import time

import pytest

import labkit
from helpers import tiny_config
from labkit.metrics.events import EventHistory

STEPS = 5000
# A step event is a dict of ~40 fields with lists (per-rank numbers, the step's timeline): a few KB in
# Python. Keeping every one, as the trainer once did, grows a 5,000-step run's worker by well over 8 MB.
GROWTH_LIMIT_BYTES = 8 << 20


def test_history_keeps_the_newest_steps_whole_and_thins_older_ones():
    history = EventHistory(capacity=100)
    for step in range(10_000):
        history.extend([{"type": "step", "step": step}] + ([{"type": "alert", "step": step}] if step == 5000 else []))
        assert len(history) <= 100
    events = history.snapshot()
    steps = [e["step"] for e in events if e["type"] == "step"]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-40:] == list(range(9960, 10_000))
    assert [e for e in events if e["type"] == "alert"] == [{"type": "alert", "step": 5000}]  # never thinned
    assert len(steps) < 100 and steps[-1] - steps[0] == 9999  # the whole run, at a lower resolution


@pytest.mark.multiproc
@pytest.mark.timeout(900)  # ~25 s on an idle 2-core machine; a busy one may take many times that
def test_a_5000_step_run_has_flat_memory_in_the_worker_and_the_watcher():
    cfg = tiny_config(**{"run.steps": STEPS, "model.n_embd": 16, "model.block_size": 8, "data.batch_size": 2,
                         "data.micro_batch_size": 2, "run.save_final": False, "metrics.alerts": False,
                         "run.threads_per_proc": 1})
    run = labkit.launch(cfg, nproc=1)
    held = []
    while run.status == "running":
        held.append(len(run.events()))
        time.sleep(0.5)
    assert run.wait(timeout=800) == "finished", run.log()[-3000:]
    held.append(len(run.events()))
    assert max(held) <= run._events.capacity < STEPS  # the watcher's copy never held the whole run
    steps = run.metrics["step"]
    assert steps[0] == 0 and steps[-1] == STEPS - 1 and steps == sorted(steps)
    rss = dict(zip(run.metrics["step"], run.metrics["max_mem_bytes"]))  # the worker's peak RSS, each step
    early = max(v for s, v in rss.items() if s <= 1000)
    growth = rss[STEPS - 1] - early
    print(f"worker peak RSS: {early / 2**20:.1f} MiB by step 1000, {rss[STEPS - 1] / 2**20:.1f} MiB at the end")
    assert growth < GROWTH_LIMIT_BYTES, growth
