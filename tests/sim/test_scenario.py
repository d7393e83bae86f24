"""The 128-GPU scenario through the step model: its data, every value labelled modelled."""
import pytest

from labkit.metrics.communication import SCALING_COLLAPSES
from labkit.sim import scenario as sc
from labkit.text import too_wide


@pytest.fixture(scope="module")
def result():
    return sc.scenario()


def test_the_baseline_has_over_35_percent_exposed_communication_and_near_the_source_efficiency(result):
    before = result["before"]
    assert before["gpus"] == 128 and before["precision"] == "fp32" and before["fits"]
    assert before["exposed_share"] > SCALING_COLLAPSES
    assert abs(before["efficiency"] - sc.SOURCE["efficiency_before"]) <= sc.NEAR


def test_mixed_precision_and_compression_lower_the_communication(result):
    before, mixed, both = result["before"], result["mixed_precision"], result["mixed_precision_and_compression"]
    assert mixed["dp_comm_s"] < before["dp_comm_s"] and mixed["comm_cut"] == pytest.approx(0.5, abs=0.01)
    assert mixed["exposed_share"] > before["exposed_share"]  # bf16 speeds the compute more than it cuts bytes
    assert both["exposed_share"] < before["exposed_share"] and both["efficiency"] > before["efficiency"]
    assert result["source_cut"]["comm_cut"] == pytest.approx(sc.SOURCE["cut"], abs=0.01)
    assert result["source_cut_reaches"] == (result["source_cut"]["efficiency"] >= sc.SOURCE["efficiency_after"])


def test_the_network_sweep_is_monotone_in_bandwidth(result):
    for lat in sc.LATENCY_SCALES:
        rows = [r for r in result["network_sweep"] if r["latency_scale"] == lat]
        assert [r["bandwidth_scale"] for r in rows] == sorted(sc.BANDWIDTH_SCALES)
        eff = [r["before"]["efficiency"] for r in rows]
        share = [r["before"]["exposed_share"] for r in rows]
        assert eff == sorted(eff) and share == sorted(share, reverse=True)
    for r in result["network_sweep"]:  # the verdict is the story's three conditions, on that network
        b, cut = r["before"], r["source_cut"]
        assert r["story_holds"] == (b["exposed_share"] > SCALING_COLLAPSES and cut["efficiency"] >= sc.SOURCE[
            "efficiency_after"] and abs(b["efficiency"] - sc.SOURCE["efficiency_before"]) <= sc.NEAR)
        assert cut["efficiency"] > b["efficiency"]  # the cut always helps; whether it helps enough is the question


def test_every_block_says_it_is_modelled(result):
    assert "not measured" in result["label"] and "modelled" in result["label"]
    for key in ("before", "mixed_precision", "mixed_precision_and_compression", "source_cut"):
        assert result[key]["label"] == sc.LABEL
    assert all(r["label"] == sc.LABEL and r["before"]["label"] == sc.LABEL for r in result["network_sweep"])
    text = sc.format_scenario(result)
    assert text.startswith("The 128-GPU scenario — modelled") and "network sweep (inter-node link; modelled)" in text
    assert not too_wide(text)  # prints in a notebook without wrapping
    assert "measured" not in text.replace("not measured", "")


def test_compression_is_the_layouts_gradient_compression_for_any_layout():
    base = sc.cluster(sc.CLUSTER)
    for layout in (sc.Layout(micro_batch=4), sc.Layout(tp=2, micro_batch=4)):
        squeezed = sc.point(sc.SHAPE, layout, base, 64, "bf16", compression=4)
        direct = sc.step_time(sc.SHAPE, sc.dataclasses.replace(layout, dp=64 // layout.tp, grad_compression=4),
                              base.with_gpus(64), "bf16")
        assert squeezed == direct
        plain = sc.point(sc.SHAPE, layout, base, 64, "bf16")
        assert squeezed.dp_comm_hidden + squeezed.dp_comm_exposed < plain.dp_comm_hidden + plain.dp_comm_exposed


def test_the_cut_needed_is_the_smallest_that_reaches_the_sources_efficiency(result):
    needed, base = result["cut_needed"], sc.cluster(sc.CLUSTER)
    assert needed["efficiency"] >= sc.SOURCE["efficiency_after"] and needed["label"] == sc.LABEL
    smaller = sc.efficiency(sc.SHAPE, result["layout"], base, "fp32", compression=1 / (1 - needed["bytes_cut"] + 2e-3))
    assert smaller["efficiency"] < sc.SOURCE["efficiency_after"]  # 0.2% fewer bytes cut misses the target
    assert result["source_cut_reaches"] == (needed["bytes_cut"] <= sc.SOURCE["cut"])
    # a network fast enough to be near the target already needs almost no cut; a slow one needs more
    cuts = [r["cut_needed"]["bytes_cut"] for r in result["network_sweep"] if r["latency_scale"] == 1.0]
    assert cuts == sorted(cuts, reverse=True)
