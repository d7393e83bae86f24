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
    assert "in flight" in comm.get_title().lower() and "exposed" in comm.get_title()


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


# ---------------------------------------------------------------- notebook 09 at a notebook's width (A5, A6)

def test_monitoring_figures_are_legible_at_the_output_width():
    from labkit.plots import illegible_texts

    trend = [{"id": f"r{i}", "created": 1.7e9 + 60 * i, "tokens_per_s": v} for i, v in enumerate([100, 102, 60])]
    for fig in (ranks_figure(EVENTS), memory_figure(EVENTS), trend_figure(trend, [{"id": "r2"}])):
        assert illegible_texts(fig) == []


def test_alert_labels_never_overlap():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    alerts = [{"type": "alert", "kind": kind, "step": s, "rank": rank} for kind, s, rank in
              [("straggler", 20, 1), ("throughput_drop", 21, None), ("comm_frac_jump", 22, None),
               ("straggler", 23, 1), ("throughput_drop", 54, None), ("straggler", 60, 0)]]
    steps = [{"type": "step", "step": s, "max_mem_bytes": MIB, "rank_busy_s": [0.01, 0.01],
              "rank_comm_s": [0.002, 0.002]} for s in range(100)]
    fig = ranks_figure([EVENTS[0], *steps, *alerts])
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    labels = fig.axes[0].texts
    boxes = [t.get_window_extent(renderer) for t in labels]
    assert len(labels) == 3 and "straggler (rank 1) ×2" in labels[0].get_text()  # 20–23: one label, each kind once
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert not any(box.overlaps(fig.legends[0].get_window_extent(renderer)) for box in boxes)


PROFILE_TXT = """cpu op time: compute 235.4 ms, communication 9.9 ms (4%); trace: /runs/x/diagnosis/alert1-rank1.json

-------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------  
                                                   Name    Self CPU %      Self CPU   CPU total %     CPU total  CPU time avg    # of Calls  
-------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------  
                                               aten::mm        28.95%      71.041ms        28.99%      71.137ms     439.120us           162  
autograd::engine::evaluate_function: torch::autograd...         7.80%      19.136ms        14.25%      34.973ms     388.589us            90  
                                       c10d::allreduce_         4.05%       9.943ms         4.05%       9.943ms       1.657ms             6  
-------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------  
Self CPU time total: 245.368ms
"""  # noqa: E501


def test_the_profilers_table_fits_a_notebooks_width():
    import re

    from labkit.widgets.monitoring import NAME_CHARS, PROFILE_COLUMNS, profile_rows, profile_table_html

    rows = profile_rows(PROFILE_TXT)
    assert rows[1] == {"operator": "autograd::engine::evaluate_function: torch::autograd...", "self time": "19.136ms",
                       "share": "7.80%", "calls": "90"}  # a name with a space stays whole
    table = profile_table_html(PROFILE_TXT, "rank 1 (the straggler)")
    assert table.count("<th") == len(PROFILE_COLUMNS) == 4  # of torch's seven columns
    cells = re.findall(r"<t[dh] style='([^']*)'", table)
    assert len(cells) == 4 * 4 and all("white-space:nowrap" in c for c in cells)  # no cell broken mid-word
    names = re.findall(r"<code>(.*?)</code>", table)
    assert max(map(len, names)) <= NAME_CHARS and names[1].endswith("…")  # shortened ...
    assert "title='autograd::engine::evaluate_function: torch::autograd...'" in table  # ... the full name on hover
    assert "compute 235.4 ms, communication 9.9 ms (4%)" in table and "trace:" not in table
