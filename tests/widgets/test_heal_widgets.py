"""Notebook 07's restart-or-heal section without processes: the restart row and the heal's spec are read from a
run's files, the heal's split is put in the same terms, the picture marks both recoveries, and the shipped table
says benchmarks/results/heal.jsonl's own numbers."""
import json
import statistics

import pytest

from labkit.fault.heal import HealSpec
from labkit.plots import illegible_texts
from labkit.results import latest, load_results
from labkit.widgets import heal
from labkit.widgets.heal import (HEAL, RESTART, heal_figure, heal_row, heal_spec_like, restart_row, shipped_heal_table,
                                 torchft_missing)


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def killed_run(tmp_path):
    """A restart-path run of 2 ranks: steps 0-12, rank 1 killed at t=100 (recorded at step 12), step 12 still logged
    at 100.1, the resume at step 10 at 108, steps 10-15 after it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {"block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64},
                                                 "data": {"batch_size": 32}, "run": {"seed": 3}}))
    steps = [{"type": "step", "time": 88.0 + i, "step": i, "step_time_s": 0.1 + 0.01 * (i % 3)} for i in range(12)]
    write_lines(run / "events.jsonl", [
        {"type": "start", "time": 87.0, "world_size": 2, "vocab_size": 16}, *steps,
        {"type": "step", "time": 100.1, "step": 12, "step_time_s": 0.11},
        {"type": "start", "time": 107.0, "world_size": 2, "vocab_size": 16},
        {"type": "resume", "time": 108.0, "next_step": 10},
        *({"type": "step", "time": 108.5 + i, "step": 10 + i, "step_time_s": 0.11} for i in range(6))])
    write_lines(run / "faults.jsonl", [{"type": "fault", "time": 100.0, "kind": "kill", "rank": 1, "step": 12},
                                       {"type": "detected", "time": 100.4, "rank": 0}])
    return run


def test_the_restart_row_is_the_runs_own_recovery(killed_run):
    row = restart_row(killed_run)
    assert row["path"] == RESTART and row["step"] == 13  # step 12 was still logged after the kill was recorded
    assert row["resumed_at_step"] == 10
    assert row["recovery_s"] == pytest.approx(8.5) and row["detected_s"] == pytest.approx(0.4)
    assert row["steps_lost"] == 3 and row["others_steps"] == 0  # steps 10-12 done again; nothing kept


def test_a_run_without_a_recovered_fault_has_no_restart_row(killed_run):
    (killed_run / "faults.jsonl").write_text("")
    with pytest.raises(ValueError, match="no fault it recovered from"):
        restart_row(killed_run)


def test_the_heal_takes_the_runs_model_batch_step_time_and_kill(killed_run):
    spec = heal_spec_like(killed_run, steps_after=4)
    assert spec.model == {"vocab_size": 16, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64}
    assert (spec.replicas, spec.victim, spec.kill_at, spec.solo_steps) == (2, 1, 13, 0)
    assert spec.batch == 16 and spec.seed == 3 and spec.steps_after == 4
    assert spec.min_step_s == pytest.approx(0.11)  # the median step time of the run


def test_the_heals_split_in_the_restart_rows_terms():
    split = {"total_s": 3.2, "detect_s": 0.3, "healthy_steps_dropped": 1, "healthy_steps_meanwhile": 7.0}
    assert heal_row(split, HealSpec(kill_at=13)) == {"path": HEAL, "step": 13, "recovery_s": 3.2, "detected_s": 0.3,
                                                     "steps_lost": 1, "others_steps": 7.0}


def test_the_picture_starts_both_paths_at_the_kill_and_shades_each_recovery(killed_run, tmp_path):
    heal_dir = tmp_path / "heal"
    heal_dir.mkdir()
    write_lines(heal_dir / "events.jsonl", [
        *({"type": "step", "t": 50.0 + i, "replica": r, "life": 0, "step": i, "committed": True}
          for i in range(4) for r in (0, 1)),
        {"type": "kill", "t": 53.5, "at": 53.5, "replica": None},
        *({"type": "step", "t": 54.0 + i, "replica": 0, "life": 0, "step": 4 + i, "committed": True}
          for i in range(4)),
        {"type": "step", "t": 57.2, "replica": 1, "life": 1, "step": 8, "committed": True}])
    side = {"run_dir": str(killed_run), "heal_dir": str(heal_dir),
            "rows": [{"path": RESTART, "recovery_s": 8.5}, {"path": HEAL, "recovery_s": 3.7}]}
    fig = heal_figure(side)
    assert illegible_texts(fig) == []  # at a notebook's output width, no text under 12 px
    restart_ax, heal_ax = fig.axes
    assert "kill → training again: 8.5 s" in restart_ax.get_legend_handles_labels()[1]
    labels = heal_ax.get_legend_handles_labels()[1]
    assert "kill → training again: 3.7 s" in labels and "replica 1 (started again)" in labels
    healthy = next(line for line in heal_ax.lines if line.get_label() == "replica 0")
    assert list(healthy.get_xdata())[-4:] == pytest.approx([0.5, 1.5, 2.5, 3.5])  # it kept stepping after the kill


def test_the_shipped_table_says_the_results_files_medians():
    record = latest(load_results("heal"), "heal")
    table = shipped_heal_table()
    first = record["rows"][0]
    for row in record["rows"]:
        split = (row["median_total_s"], row["median_detect_s"], row["median_respawn_s"])
        assert "| {:.2f} | {:.2f} | {:.2f} |".format(*split) in table
    restart = next(r for r in load_results("heal") if r["table"] == "restart_rounds" and r["date"] == record["date"])
    seen = statistics.median(r["detected_s"] for r in restart["rows"])
    assert f"| {RESTART} | {first['median_restart_recovery_s']:.2f} | {seen:.2f} |" in table
    assert record["commit"][:7] in table and f"Medians of {first['rounds']} rounds" in table


def test_without_a_results_file_the_table_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_RESULTS_DIR", str(tmp_path))
    assert shipped_heal_table().startswith("No shipped measurement: `heal.jsonl` is missing")


def test_without_torchft_the_section_says_why(monkeypatch):
    monkeypatch.setattr(heal.importlib.util, "find_spec", lambda name: None)
    assert "torchft is not installed here" in torchft_missing()


@pytest.mark.multiproc
def test_a_killed_runs_fault_is_healed_live_on_the_same_model(tmp_path):
    """The notebook's path: a 2-process run killed from outside at step 6 and restarted, then heal_beside: torchft heals
    the same kill on the same model, and both rows come back in the same terms."""
    pytest.importorskip("torchft", reason="torchft (the ft extra) is not installed")
    import time

    import labkit
    from helpers import tiny_config
    from labkit.widgets.heal import heal_beside

    cfg = tiny_config(**{"run.steps": 16, "fault.checkpoint_every": 4, "fault.max_restarts": 1, "comm.timeout_s": 10.0})
    run = labkit.launch(cfg, nproc=2, run_dir=tmp_path / "run")
    while len(run.metrics["step"]) < 6 and run.status == "running":
        time.sleep(0.05)
    run.kill_rank(1)
    assert run.wait(timeout=300) == "finished", run.log()[-3000:]
    side = heal_beside(run, steps_after=2, root=tmp_path / "heal", timeout_s=240)
    restart, healed = side["rows"]
    assert restart["path"] == RESTART and restart["recovery_s"] > 0 and restart["others_steps"] == 0
    assert restart["resumed_at_step"] % 4 == 0  # at a checkpoint (one every 4 steps)
    assert restart["steps_lost"] == restart["step"] - restart["resumed_at_step"]
    assert healed["path"] == HEAL and healed["steps_lost"] <= 1 and healed["recovery_s"] > 0
    assert side["split"]["healed_equal_to_sender"] and side["split"]["final_equal"]
    assert side["spec"]["model"]["n_embd"] == 32 and side["spec"]["kill_at"] == restart["step"]
    assert "| " + RESTART + " |" in side["table"] and "| " + HEAL + " |" in side["table"]
