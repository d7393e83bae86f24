"""The class leaderboard across laptops (labkit/workshop/board.py): attempts submitted from two run stores (two
laptops), merged by the instructor, each scored again against its own machine's baseline."""
import json

import pytest

from labkit.cli import main
from labkit.config import apply_overrides, load_config
from labkit.metrics.store import RunStore
from labkit.workshop import board
from labkit.workshop.exercises import repo_root

BASE_CONFIG = load_config(repo_root() / "configs" / "capstone_slow.yaml").to_dict()


def run_dir(root, run_id, name, step_s, overrides=None, loss=2.0):
    """A run directory as the store reads it: its config, its summary, its events (every step ``step_s`` long, an
    evaluation every ``run.eval_every`` steps, the validation loss falling to ``loss``)."""
    d = root / run_id
    d.mkdir(parents=True)
    config = apply_overrides(BASE_CONFIG, {**(overrides or {}), "run.name": name})
    steps, every = config["run"]["steps"], config["run"]["eval_every"]
    (d / "config.json").write_text(json.dumps(config))
    (d / "summary.json").write_text(json.dumps({"status": "finished", "tokens_per_s": 100.0 / step_s,
                                                "final_loss": loss, "world_size": 2}))
    events = [{"type": "step", "step": i, "step_time_s": step_s, "loss": loss} for i in range(steps)]
    evals = [{"type": "eval", "step": i, "val_loss": loss + (steps - 1 - i) / steps} for i in range(steps)
             if (i + 1) % every == 0]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events + evals))
    return d


def laptop(tmp_path, who, base_step_s, attempts, store_path=None):
    """One participant's store: a baseline and their attempts (run id, seconds a step, overrides)."""
    store = RunStore(store_path or tmp_path / who / "runs.sqlite")
    store.record_run(run_dir(tmp_path / who, f"{who}-base", "capstone-baseline", base_step_s))
    for n, (run_id, step_s, overrides) in enumerate(attempts, 1):
        store.record_run(run_dir(tmp_path / who, run_id, f"capstone-{who}-{n}", step_s, overrides))
    return store


def test_two_laptops_merge_into_one_board_ranked_by_speedup_over_their_own_baseline(tmp_path):
    shared = tmp_path / "shared"
    fast_laptop = laptop(tmp_path, "ada", 0.03, [("ada-1", 0.02, {"comm.compression": "bf16"})])  # 1.5×
    slow_laptop = laptop(tmp_path, "bob", 0.2, [("bob-1", 0.1, {"parallel.dp.strategy": "ddp_bucketed"}),
                                                ("bob-2", 0.01, {"data.batch_size": 128})])  # 2×; a cheat
    for store, base, attempt in ((fast_laptop, "ada-base", "ada-1"), (slow_laptop, "bob-base", "bob-1"),
                                 (slow_laptop, "bob-base", "bob-2"), (slow_laptop, "bob-base", "bob-1")):
        board.write_submission(board.submission(store, base, attempt), shared)
    (shared / "notes.json").write_text("[1, 2]")
    entries, problems = board.read_submissions(shared)
    rows = board.merged_rows(entries)
    assert [(r["participant"], r["rank"]) for r in rows] == [("bob", 1), ("ada", 2), ("bob", None)]
    assert [r["speedup"] for r in rows[:2]] == pytest.approx([2.0, 1.5])  # bob's laptop is slower, his speed-up larger
    assert rows[0]["time_to_target_s"] == pytest.approx(0.1 * BASE_CONFIG["run"]["steps"])
    assert "data.batch_size" in rows[2]["reason"] and len(rows) == 3  # bob-1 submitted twice counts once
    assert problems == ["notes.json: not a labkit capstone submission (format 2)"]


def test_a_submissions_own_claim_is_not_taken(tmp_path):
    store = laptop(tmp_path, "eve", 0.2, [("eve-1", 0.04, {"fault.skip_steps": [3]})])
    entry = board.submission(store, "eve-base", "eve-1")
    assert entry["claimed_score"] is None and "fault." in entry["claimed_reason"]
    entry["claimed_score"], entry["claimed_reason"] = 1.0, "counts"  # edited by hand
    (row,) = board.merged_rows([entry])
    assert not row["qualified"] and row["rank"] is None and "fault.skip_steps" in row["reason"]


def test_the_cli_submits_and_the_instructor_merges(tmp_path, capsys):
    store = laptop(tmp_path, "ada", 0.3, [("ada-1", 0.2, {"comm.compression": "bf16"})])
    store.close()
    db, shared = str(tmp_path / "ada" / "runs.sqlite"), str(tmp_path / "shared")
    assert main(["workshop", "submit", "--store", db, "--baseline", "ada-base", "--attempt", "ada-1",
                 "--to", shared]) == 0
    assert "submitted capstone-ada-1 (counts)" in capsys.readouterr().out
    assert main(["workshop", "leaderboard", shared]) == 0
    out = capsys.readouterr().out
    assert "ada" in out and "1.50×" in out and "comm.compression" in out
    assert main(["workshop", "submit", "--store", db, "--baseline", "ada-base", "--attempt", "nope",
                 "--to", shared]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
    assert main(["workshop", "submit", "--attempt", "ada-1"]) == 2
    assert "--baseline, --to" in capsys.readouterr().err


def test_under_the_hub_the_instructors_board_reads_every_seats_store(tmp_path, capsys):
    from labkit.hub import seat_home, seat_store

    state = tmp_path / ".hub"
    for who, base, attempts in (("ana", 0.2, [("ana-1", 0.1, {"comm.compression": "bf16"})]),
                                ("bob", 0.3, [("bob-1", 0.1, {"comm.sync": "local_sgd", "comm.sync_every": 8}),
                                              ("bob-2", 0.01, {"run.steps": 10})])):
        seat_store(state, who).parent.mkdir(parents=True)
        laptop(tmp_path, who, base, attempts, store_path=seat_store(state, who)).close()
    seat_home(state, "cy").mkdir(parents=True)  # logged in, nothing run yet: no store, no row
    entries, problems = board.hub_entries(state)
    rows = board.merged_rows(entries)
    assert [(r["participant"], r["rank"]) for r in rows] == [("bob", 1), ("ana", 2), ("bob", None)]
    assert rows[0]["speedup"] == pytest.approx(3.0) and "run.steps" in rows[2]["reason"] and problems == []
    assert main(["workshop", "leaderboard", "--hub", str(state)]) == 0
    out = capsys.readouterr().out
    assert "3.00×" in out and "2.00×" in out and "disqualified" in out
