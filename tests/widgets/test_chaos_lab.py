"""Notebook 07's chaos section: the text and the figure say the soak's own numbers, and the shipped soak renders."""
import pytest

from labkit.widgets.chaos import KIND_COLOURS, shipped_soak, soak_figure, soak_text

TERMS = {"steps": 10.0, "saves": 1.0, "restarts": 30.0, "timeouts": 8.0, "replayed": 2.0, "stragglers": 0.5}


def record(points: float = 1.5) -> dict:
    row = {"faults": 3, "kinds": ["crash", "hang", "nan"], "restarts": 2, "predicted_useful_fraction": 0.2,
           "measured_useful_fraction": 0.2 + points / 100, "points_apart": points, "target_points": 5.0,
           "predicted_wall_s": 51.5, "measured_wall_s": 47.6, "predicted_terms_s": TERMS, "soak_s": 60.0,
           "bound_s": 180, "equality": "all 10 tensors are bit-for-bit identical", "dropped_updates": [12]}
    return {"date": "2026-12-05T15:00:00+00:00", "commit": "abcdef1234", "machine": {"cpu": "AMD EPYC", "cores": 2},
            "settings": {"nproc": 4, "quick": False}, "rows": [row]}


FAULTS = [{"index": 0, "step": 5, "kind": "crash", "rank": 1, "detected_s": 0.2, "recovery_s": 6.5},
          {"index": 1, "step": 9, "kind": "hang", "rank": 0, "detected_s": 8.1, "recovery_s": 15.0},
          {"index": 2, "step": 12, "kind": "nan", "rank": 2, "detected_s": None, "recovery_s": None}]


def test_the_text_says_what_was_predicted_what_was_measured_and_the_verdict():
    text = soak_text(record(1.5))
    for said in ("3 faults (crash, hang, nan), 2 of them restarts", "predicted 20.0% before the soak",
                 "measured 21.5%", "1.5 points apart (target ≤ 5) — held", "predicted 52 s, measured 48 s",
                 "[12]: all 10 tensors are bit-for-bit identical", "abcdef1", "AMD EPYC"):
        assert said in text, said
    assert "MISSED" in soak_text(record(7.0))


def test_the_figure_marks_every_fault_and_splits_the_predicted_wall_time_into_its_terms():
    fig = soak_figure(record(), FAULTS)
    faults_ax, wall_ax = fig.axes[:2]
    labels = faults_ax.get_legend_handles_labels()[1]
    assert labels == ["crash", "hang", "nan", "detected"]
    wall_labels = wall_ax.get_legend_handles_labels()[1]
    assert wall_labels[0] == "useful steps" and "restarts" in wall_labels and "all the rest (measured)" in wall_labels
    predicted = sum(p.get_width() for p in wall_ax.patches if p.get_y() > 0.5)  # the predicted bar, y = 1
    assert predicted == pytest.approx(0.2 * 51.5 + sum(TERMS.values()) - TERMS["steps"])
    measured = sum(p.get_width() for p in wall_ax.patches if p.get_y() < 0.5)
    assert measured == pytest.approx(47.6)
    assert set(KIND_COLOURS) >= {f["kind"] for f in FAULTS}


def test_the_shipped_soak_renders():
    soak = shipped_soak()
    assert soak is not None, "benchmarks/results/chaos_soak.jsonl holds no full soak: run benchmarks/chaos_soak.py"
    summary, faults = soak
    row = summary["rows"][0]
    assert row["faults"] >= 30 and len(faults) == row["faults"]
    assert "points apart" in soak_text(summary) and soak_figure(summary, faults).axes
