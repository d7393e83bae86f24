"""Monitoring pictures: per-rank lanes with alerts, memory efficiency, and the history trend."""
from labkit.widgets.monitoring import memory_figure, ranks_figure, trend_figure

MIB = 2**20
EVENTS = [{"type": "start", "memory_capacity_bytes": 1000 * MIB, "memory_kind": "cpu_peak_rss"}] + [
    {"type": "step", "step": s, "max_mem_bytes": (100 + s) * MIB, "param_bytes": 4 * MIB, "grad_bytes": 4 * MIB,
     "optimizer_bytes": 8 * MIB, "activation_bytes": None,
     "rank_busy_s": [0.010, 0.010 if s < 5 else 0.090], "rank_comm_s": [0.002 if s < 5 else 0.082, 0.002]}
    for s in range(10)] + [{"type": "alert", "kind": "straggler", "step": 7, "rank": 1}]


def test_ranks_figure_draws_a_lane_per_rank_and_marks_alerts():
    busy, comm = ranks_figure(EVENTS).axes
    assert [line.get_label() for line in busy.lines if line.get_label().startswith("rank")] == ["rank 0", "rank 1"]
    assert busy.lines[1].get_ydata()[-1] == 90.0 and comm.lines[0].get_ydata()[-1] == 82.0
    assert any("straggler (rank 1)" in t.get_text() for t in busy.texts)


def test_ranks_figure_draws_exposed_communication_dashed_beside_in_flight():
    events = [dict(e, rank_comm_exposed_s=[0.001, None]) if e["type"] == "step" else e for e in EVENTS]
    comm = ranks_figure(events).axes[1]
    exposed = [line for line in comm.lines if line.get_label() == "rank 0 exposed"]
    assert len(exposed) == 1 and exposed[0].get_linestyle() == "--" and exposed[0].get_ydata()[-1] == 1.0
    assert "rank 1 exposed" not in [line.get_label() for line in comm.lines]  # not measured: not drawn as zero
    assert "in flight" in comm.get_title() and "exposed" in comm.get_title()


def test_memory_figure_shows_share_of_capacity_and_split():
    peak, split = memory_figure(EVENTS).axes
    assert peak.get_title() == "Peak memory: 10.9% of capacity"
    labels = [t.get_text() for t in split.get_yticklabels()]
    assert labels[:3] == ["parameters", "gradients", "optimizer"] and "activations" not in labels  # not measured


def test_trend_figure_circles_regressions():
    trend = [{"id": f"r{i}", "created": 1.7e9 + 60 * i, "tokens_per_s": v} for i, v in enumerate([100, 102, 60])]
    ax = trend_figure(trend, [{"id": "r2"}]).axes[0]
    assert list(ax.lines[0].get_ydata()) == [100, 102, 60]
    assert list(ax.lines[1].get_ydata()) == [60] and ax.lines[1].get_label() == "regression"
