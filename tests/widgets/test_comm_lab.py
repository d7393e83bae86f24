"""The communication lab: widgets, sweeps and the pictures they draw."""
import pytest

from helpers import tiny_config
from labkit.metrics.communication import communication_cut, cumulative
from labkit.widgets.communication import (CommunicationLab, bandwidth_settings, comm_frac_figure, loss_figure,
                                          sent_share_figure)


def row(compression, bandwidth, frac, tps, comm_s=1.0, wire=(100, 100)):
    return {"label": f"{compression}@{bandwidth}", "comm.compression": compression, "comm.bandwidth_gbps": bandwidth,
            "comm_frac": frac, "tokens_per_s": tps, "comm_s": comm_s, "wire_bytes": list(wire), "loss": [3.0, 2.0],
            "step": [0, 1], "entropy_floor": 1.5}


def test_settings_and_labels_follow_the_widgets():
    lab = CommunicationLab(tiny_config())
    lab.compression.value = "topk"
    lab.ratio.value = 0.1
    lab.bandwidth.value = 10.0
    lab.precision.value = "bf16"
    s = lab.settings()
    assert (s["comm.compression"], s["comm.compression_ratio"], s["comm.bandwidth_gbps"], s["precision.mode"]) == \
        ("topk", pytest.approx(0.1), 10.0, "bf16")
    assert lab.label() == "topk, bf16, 10 Gb/s"
    lab.sync.value = "diloco"
    lab.every.value = 16
    assert lab.settings()["comm.compression"] == "none"  # periodic sync replaces per-step (compressed) sync
    assert lab.label() == "diloco H=16, bf16, 10 Gb/s"


@pytest.mark.multiproc
def test_run_button_launches_a_real_run_and_draws_it():
    lab = CommunicationLab(tiny_config(**{"run.steps": 4}), nproc=2)
    lab.compression.value = "sign"
    lab.bandwidth.value = 1.0
    lab.run_button.click()
    assert len(lab.rows) == 1 and lab.rows[0]["label"] == "sign, fp32, 1 Gb/s"
    assert "communication" in lab.status.value and bytes(lab.picture.value).startswith(b"\x89PNG")
    assert all(w < r for w, r in zip(lab.rows[0]["wire_bytes"], lab.rows[0]["raw_bytes"]))  # 1 bit an entry


def test_bandwidth_sweep_settings():
    got = bandwidth_settings([1, 10], ["none", "topk"], latency_us=20)
    assert [label for label, _ in got] == ["none @ 1 Gb/s", "none @ 10 Gb/s", "topk @ 1 Gb/s", "topk @ 10 Gb/s"]
    assert got[0][1] == {"comm.bandwidth_gbps": 1, "comm.latency_us": 20, "comm.compression": "none"}


def test_comm_frac_figure_draws_the_25_and_35_percent_lines():
    rows = [row("none", 1, 0.5, 100), row("none", 10, 0.2, 300), row("topk", 1, 0.1, 400), row("topk", 10, 0.05, 420)]
    ax_frac, ax_tput = comm_frac_figure(rows).axes
    levels = sorted(line.get_ydata()[0] for line in ax_frac.lines if line.get_linestyle() == "--")
    assert levels == [25, 35]
    assert list(ax_frac.lines[0].get_ydata()) == [50.0, 20.0] and list(ax_tput.lines[1].get_ydata()) == [400, 420]
    with_exposed = [dict(r, comm_exposed_frac=r["comm_frac"] / 2) for r in rows]  # in flight and exposed, both drawn
    ax_frac = comm_frac_figure(with_exposed).axes[0]
    exposed = [line for line in ax_frac.lines if line.get_linestyle() == ":"]
    assert [list(line.get_ydata()) for line in exposed] == [[25.0, 10.0], [5.0, 2.5]]
    assert "none: exposed" in [t.get_text() for t in ax_frac.get_legend().get_texts()]


def test_communication_cut_and_loss_vs_bytes():
    before, after = row("none", 1, 0.5, 100, comm_s=1.0), row("bf16", 1, 0.3, 140, comm_s=0.58, wire=(50, 50))
    cut = communication_cut(before, after)
    assert cut["comm_s_cut"] == pytest.approx(0.42) and cut["bytes_cut"] == pytest.approx(0.5)
    assert cut["speedup"] == pytest.approx(1.4)
    assert cumulative([1, 2, 3]) == [1, 3, 6]
    ax_step, ax_bytes = loss_figure([before, after]).axes
    assert list(ax_bytes.lines[1].get_xdata()) == [50 / 1e6, 100 / 1e6]


def test_sent_share_figure_sorts_parameters_and_draws_the_budget():
    shares = {"wte.weight": 0.23, "blocks.0.attn.qkv.weight": 0.0002, "ln_f.weight": 0.6, "blocks.0.ln_1.weight": 0.0}
    ax = sent_share_figure(shares, "topk 1%", budget=0.01).axes[0]
    bars = ax.patches
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "blocks.0.ln_1.weight", "blocks.0.attn.qkv.weight", "wte.weight", "ln_f.weight"]  # largest on top
    assert [round(b.get_width(), 6) for b in bars[1:]] == [0.02, 23.0, 60.0]  # percent of the parameter
    assert 0 < bars[0].get_width() < 0.02  # a parameter that sent nothing still shows, at the edge
    assert [line.get_xdata()[0] for line in ax.lines] == [1.0] and "0%" in [t.get_text().strip() for t in ax.texts]


def test_the_lab_shows_where_a_sparsifiers_bytes_went_and_hides_it_otherwise():
    lab = CommunicationLab(tiny_config())
    topk = {**row("topk", 1, 0.1, 400), "comm.compression_ratio": 0.01, "sent_shares": {"wte.weight": 0.3, "h": 0.001}}
    lab.rows = [topk]
    lab.draw(topk)
    assert bytes(lab.shares_picture.value).startswith(b"\x89PNG") and lab.shares_picture.layout.display is None
    plain = {**row("none", 1, 0.5, 100), "sent_shares": {}}
    lab.rows.append(plain)
    lab.draw(plain)
    assert lab.shares_picture.layout.display == "none" and bytes(lab.picture.value).startswith(b"\x89PNG")
