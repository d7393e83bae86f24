"""labkit.experiments: run to the end or raise, and sweep settings one run at a time (real 1-process runs)."""
import pytest

from helpers import tiny_config
from labkit.experiments import RunFailed, run_to_end, sweep
from labkit.fault.inject import CRASH_EXIT_CODE

pytestmark = pytest.mark.multiproc  # every test here starts worker processes

TINY = {"run.steps": 2, "run.save_final": False, "metrics.progress": False}
CRASH = {"fault.inject": "crash", "fault.inject_rank": 0, "fault.inject_step": 1, "fault.max_restarts": 0}


def test_a_sweep_runs_each_point_in_turn_and_collects_what_it_asks_for():
    said, seen = [], []

    def collect(run, label, overrides):
        seen.append((label, overrides, run.status))
        return {"label": label, "params": run.summary["params"]["total"], "steps": run.metrics["step"],
                "run_dir": run.run_dir}

    points = [("narrow", {"model.n_embd": 16}), ("wide", {"model.n_embd": 32})]
    rows = sweep(tiny_config(**TINY), 1, points, collect, said.append)
    assert [r["label"] for r in rows] == ["narrow", "wide"]
    assert rows[0]["params"] < rows[1]["params"]  # each point's overrides reached its run
    assert seen == [("narrow", {"model.n_embd": 16}, "finished"), ("wide", {"model.n_embd": 32}, "finished")]
    assert all(r["steps"] == [0, 1] for r in rows)
    assert rows[0]["run_dir"] != rows[1]["run_dir"]  # each point is a run of its own
    assert said == ["run 1/2: narrow…", "run 2/2: wide…", "done: 2 runs"]
    assert sweep(tiny_config(**TINY), 1, [], collect) == []  # nothing to run: nothing launched, no progress needed


def test_a_run_that_does_not_finish_raises_with_its_log_and_stops_the_sweep():
    said, collected = [], []
    points = [("crashes", CRASH), ("never run", {})]
    with pytest.raises(RunFailed) as failure:
        sweep(tiny_config(**TINY), 1, points, lambda run, *_: collected.append(run), said.append)
    message = str(failure.value)
    first_line = message.splitlines()[0]
    assert first_line.startswith("run 'crashes' failed: see ") and first_line.endswith("/launcher.log")
    assert f"worker (local rank 0) failed (exit code {CRASH_EXIT_CODE})" in message  # the log's tail says what happened
    assert said == ["run 1/2: crashes…"] and collected == []  # the second point never started
    assert isinstance(failure.value, RuntimeError)  # callers that caught RuntimeError still do


def test_run_to_end_returns_the_finished_run():
    run = run_to_end(tiny_config(**TINY), 1, "plain")
    assert run.status == "finished" and run.summary["steps_completed"] == 2
