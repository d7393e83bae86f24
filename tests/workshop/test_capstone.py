"""The capstone's scoring and leaderboard (labkit/workshop/capstone.py): on constructed run-store records, and once
for real (a baseline and one attempt, 2 processes, quick mode)."""
from pathlib import Path

import pytest

from labkit.config import apply_overrides, load_config
from labkit.metrics.store import RunStore
from labkit.tuning.flowchart import COMMUNICATION_BOUND, classify
from labkit.workshop import capstone
from labkit.workshop.exercises import repo_root

BASE_CONFIG = load_config(repo_root() / "configs" / "capstone_slow.yaml").to_dict()


STEPS = BASE_CONFIG["run"]["steps"]
EVAL_EVERY = BASE_CONFIG["run"]["eval_every"]


def falling(final, start=2.9):
    """A validation curve falling evenly to ``final`` over the run's evaluations."""
    n = STEPS // EVAL_EVERY
    return [start + (final - start) * k / (n - 1) for k in range(n)]


def record(run_id, overrides=None, step_s=0.2, val_losses=None, tokens_per_s=1000.0, loss=2.0, status="finished",
           world_size=2, name=None, comm_exposed_frac=0.5):
    """A run-store record as :func:`capstone.with_evals` makes it: every step ``step_s`` long, an evaluation every
    ``EVAL_EVERY`` steps (the last at the run's end) with ``val_losses`` (default: falling to ``loss``)."""
    config = apply_overrides(BASE_CONFIG, {**(overrides or {}), "run.name": name or f"capstone-ada-{run_id}"})
    losses = falling(loss) if val_losses is None else val_losses
    eval_steps = [EVAL_EVERY * (k + 1) - 1 for k in range(len(losses))]
    evals = capstone.eval_trajectory([(i, step_s) for i in range(STEPS)], list(zip(eval_steps, losses)))
    return {"id": run_id, "name": config["run"]["name"], "status": status, "config": config,
            "tokens_per_s": tokens_per_s, "final_loss": loss, "world_size": world_size, "mfu": 0.05,
            "comm_frac": 0.7, "comm_exposed_frac": comm_exposed_frac, "evals": evals}


BASELINE = record("base", name="capstone-baseline")  # reaches its target (2.04) at its last evaluation: 24 s


def test_the_trajectory_sums_the_step_times_before_each_evaluation():
    assert capstone.eval_trajectory([(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0)], [(1, 3.0), (3, float("nan"))]) == [
        [1, 3.0, 3.0], [3, None, 15.0]]


def test_a_finished_attempt_scores_its_time_to_the_target_validation_loss():
    assert capstone.target_loss(BASELINE) == pytest.approx(2.0 * (1 + capstone.LOSS_TOLERANCE))
    assert capstone.score(BASELINE) == (pytest.approx(STEPS * 0.2), "counts")
    assert capstone.score(record("a", {"comm.compression": "bf16"}, step_s=0.1), BASELINE) == (
        pytest.approx(STEPS * 0.1), "counts")


def test_a_faster_attempt_ranks_higher_and_the_baseline_is_one():
    rows = capstone.rank_rows([BASELINE, record("slow", step_s=0.16), record("fast", step_s=0.05)])
    assert [r["id"] for r in rows] == ["fast", "slow", "base"]
    assert [r["rank"] for r in rows] == [1, 2, 3]
    assert [r["speedup"] for r in rows] == pytest.approx([4.0, 1.25, 1.0])


def test_more_tokens_a_second_is_not_a_higher_score_reaching_the_loss_sooner_is():
    """Slower steps that learn faster win; faster steps that learn slower lose: the score is the time to a loss."""
    learns_sooner = record("sooner", step_s=0.3, val_losses=falling(1.9, start=2.1))  # 2.04 at its 5th: 15 s
    learns_later = record("later", step_s=0.15, tokens_per_s=9e3, val_losses=falling(2.0, start=4.0)[:-1] + [2.1])
    rows = {r["id"]: r for r in capstone.rank_rows([BASELINE, learns_sooner, learns_later])}
    assert rows["sooner"]["score"] == pytest.approx(5 * EVAL_EVERY * 0.3) and rows["sooner"]["rank"] == 1
    assert rows["sooner"]["speedup"] == pytest.approx(STEPS * 0.2 / (5 * EVAL_EVERY * 0.3))
    assert rows["later"]["rank"] is None
    assert "never reached the target validation loss 2.0400" in rows["later"]["reason"]


def test_a_much_worse_loss_is_disqualified_with_the_reason():
    worse = record("worse", {"comm.compression": "topk"}, step_s=0.01, tokens_per_s=9000.0, loss=2.3)
    value, why = capstone.score(worse, BASELINE)
    assert value is None and "never reached" in why and "its best 2.3000" in why
    rows = capstone.rank_rows([BASELINE, worse])
    assert rows[-1]["id"] == "worse" and rows[-1]["rank"] is None and not rows[-1]["qualified"]
    assert capstone.score(record("ok", loss=2.0 * (1 + capstone.LOSS_TOLERANCE / 2)), BASELINE)[0] == pytest.approx(
        STEPS * 0.2)


def test_a_run_without_evaluations_cannot_be_scored():
    value, why = capstone.score(record("blind", val_losses=[]), BASELINE)
    assert value is None and "never reached" in why and "no finite validation loss" in why
    value, why = capstone.score(BASELINE, record("b", val_losses=[], name="capstone-baseline"))
    assert value is None and "no validation loss on record for capstone-baseline" in why


@pytest.mark.parametrize("status", ["failed", "stopped", "unknown"])
def test_an_unfinished_run_is_disqualified(status):
    value, why = capstone.score(record("x", tokens_per_s=5000.0, status=status), BASELINE)
    assert value is None and "did not finish" in why and status in why


@pytest.mark.parametrize("overrides, key", [({"comm.bandwidth_gbps": None}, "comm.bandwidth_gbps"),
                                            ({"model.n_layer": 1}, "model.n_layer"), ({"run.steps": 10}, "run.steps"),
                                            ({"run.eval_every": 1}, "run.eval_every")])
def test_changing_the_problem_itself_is_disqualified(overrides, key):
    value, why = capstone.score(record("cheat", overrides, step_s=1e-3, tokens_per_s=9e9), BASELINE)
    assert value is None and key in why


@pytest.mark.parametrize("overrides, reason", [
    ({"data.batch_size": 128}, "data.batch_size"),  # 8× the tokens a step: more tokens/s, the loss no sooner
    ({"comm.sync": "local_sgd", "comm.sync_every": 120}, "at least every 16 steps"),  # once in the whole run
    ({"fault.skip_steps": list(range(0, 120, 2))}, "fault.skip_steps"),  # half the updates dropped on purpose
])
def test_the_three_gamed_attempts_are_disqualified(overrides, reason):
    """Each of these used to count: a faster throughput and a loss within the tolerance, without training faster."""
    gamed = record("gamed", overrides, step_s=0.05, tokens_per_s=9e3, loss=2.0)
    value, why = capstone.score(gamed, BASELINE)
    assert value is None and reason in why
    rows = capstone.rank_rows([BASELINE, gamed])
    assert rows[0]["id"] == "base" and rows[-1]["rank"] is None


def test_local_sgd_within_the_bound_still_counts():
    attempt = record("h16", {"comm.sync": "local_sgd", "comm.sync_every": capstone.MAX_SYNC_EVERY}, step_s=0.1)
    assert capstone.score(attempt, BASELINE) == (pytest.approx(STEPS * 0.1), "counts")


def test_the_diff_lists_exactly_the_changed_overrides():
    overrides = {"comm.compression": "powersgd", "parallel.dp.bucket_mb": 25.0, "data.micro_batch_size": 8}
    row = next(r for r in capstone.rank_rows([BASELINE, record("a", overrides)]) if r["id"] == "a")
    assert row["changes"] == {k: (capstone.flatten(BASE_CONFIG)[k], v) for k, v in overrides.items()}
    assert capstone.changes_text({}) == "nothing changed"


def test_the_baseline_is_communication_bound_by_the_flowchart():
    node, _ = classify(capstone.measurement(BASELINE))
    assert node == COMMUNICATION_BOUND


def test_attempt_names_are_the_leaderboard_tag():
    assert capstone.attempt_name("ada", 3) == "capstone-ada-3"
    assert capstone.participant_of("capstone-ada_l-12") == "ada_l"
    with pytest.raises(ValueError):
        capstone.attempt_name("Ada Lovelace", 1)


def test_the_html_has_one_row_per_attempt_in_a_projector_font():
    rows = capstone.rank_rows([BASELINE, record("a", {"comm.compression": "bf16"}, step_s=0.1),
                               record("b", status="failed")])
    text = capstone.leaderboard_html(rows, font_px=10)
    assert "font-size:14px" in text and text.count("<tr") == 1 + len(rows)
    assert "time to target" in text and "12.0 s" in text and "2.00×" in text
    assert "comm.compression: none → bf16" in text and "disqualified: did not finish" in text


@pytest.mark.multiproc
def test_a_real_baseline_and_attempt_make_a_leaderboard(tmp_path, monkeypatch):
    monkeypatch.delenv("LABKIT_RUN_STORE", raising=False)
    config = load_config(repo_root() / "configs" / "capstone_slow.yaml").replace(
        **{**capstone.QUICK_OVERRIDES, "run.runs_dir": str(tmp_path / "runs"), "metrics.progress": False})
    with RunStore(tmp_path / "store.sqlite") as store:
        base = capstone.run_attempt(config, {}, capstone.BASELINE_NAME, store)
        capstone.run_attempt(config, {"comm.compression": "bf16"}, capstone.attempt_name("test", 1), store)
        rows = capstone.leaderboard(store, Path(base.run_dir).name)
    assert len(rows) == 2, rows
    baseline = next(r for r in rows if r["baseline"])
    attempt = next(r for r in rows if not r["baseline"])
    assert baseline["speedup"] == 1.0 and baseline["qualified"] and baseline["score"] > 0
    assert baseline["val_loss"] is not None  # the capstone evaluates, so the score has a loss to reach
    assert attempt["changes"] == {"comm.compression": ("none", "bf16")} and attempt["tokens_per_s"] > 0
    assert attempt["qualified"] or attempt["reason"]


def reference_record():
    from labkit.results import latest, load_results
    return latest(load_results("capstone"), "capstone")


def test_labs_md_shows_the_reference_attempts_as_the_newest_results_render_them():
    text = (repo_root() / "workshops" / "labs.md").read_text()
    block = text.split(capstone.REFERENCE_BEGIN)[1].split(capstone.REFERENCE_END)[0].strip()
    assert block == capstone.reference_table(reference_record()), (
        "labs.md's reference attempts are not the newest benchmarks/results/capstone.jsonl: render them again with "
        "capstone.reference_table")


def test_what_labs_md_and_two_day_md_expect_of_the_reference_attempts_is_what_was_measured():
    """The prose's claims, each against the newest results: local SGD cuts the most, bf16 and bigger buckets help by
    less, top-k never reaches the target (the most tokens a second), bigger micro-batches gain a little, about what
    their tokens a second gain."""
    record = reference_record()
    assert not record["uncommitted_changes"] and record["settings"]["rounds"] >= 6
    rows = {row["overrides"].get("comm.compression") or row["overrides"].get("comm.sync")
            or next(iter(row["overrides"])): row for row in record["rows"]}
    local, bf16, buckets = rows["local_sgd"], rows["bf16"], rows["parallel.dp.bucket_mb"]
    topk, micro = rows["topk"], rows["data.micro_batch_size"]
    assert local["verdict"] == bf16["verdict"] == buckets["verdict"] == "faster"
    assert local["median"] > max(bf16["median"], buckets["median"])
    assert topk["counted"] == 0 and all("never reached" in why for why in topk["reasons"])
    assert topk["tokens_per_s_ratio"] == max(row["tokens_per_s_ratio"] for row in record["rows"] if row is not local)
    assert micro["verdict"] == "faster" and micro["median"] < min(bf16["median"], buckets["median"])
    assert 0.9 < micro["tokens_per_s_ratio"] < 1.1 and abs(micro["median"] - micro["tokens_per_s_ratio"]) < 0.05
    assert set(capstone.REFERENCE_ATTEMPTS) == {row["attempt"] for row in record["rows"]}
