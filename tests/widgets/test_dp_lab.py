"""The data-parallel lab and the memory calculator, driven through their widgets."""
import pytest

from helpers import tiny_config
from labkit.parallel.reports.data_parallel import analytic_wire_bytes, format_table
from labkit.widgets.data_parallel import DataParallelLab, comparison_figure, peak_table, phase_peaks, timeline_figure
from labkit.widgets.memory_calculator import MemoryCalculator


def test_memory_calculator_reacts_to_every_knob():
    calc = MemoryCalculator("zero-paper-7.5b")  # the ZeRO paper's example: 7.5B params, 64-way DP, mixed Adam
    assert "120.00 GB" in calc.table.value
    totals = []
    for stage in (1, 2, 3):
        calc.zero_stage.value = stage
        totals.append(round(calc.breakdown.total / 1e9, 1))
    assert totals == [31.4, 16.6, 1.9]
    assert bytes(calc.picture.value).startswith(b"\x89PNG")
    calc.preset.value = "gpt2-xl"
    before = calc.breakdown.activations
    calc.recompute.value = "full"
    assert calc.breakdown.activations < before
    calc.tp.value = 8  # 25 heads cannot be split 8 ways: explained, not crashed
    assert "Not possible" in calc.table.value and "tp (8) must divide heads (25)" in calc.table.value


def test_phase_peaks_come_from_the_tracked_step_and_a_row_without_them_draws():
    phases = ("forward", "backward", "optimizer")
    untracked = {"type": "step", "step": 0, **{f"rank_peak_{p}_bytes": [None, None] for p in phases}}
    tracked = {"type": "step", "step": 1, "rank_peak_forward_bytes": [5_000_000, 6_000_000],
               "rank_peak_backward_bytes": [7_000_000, 8_000_000], "rank_peak_optimizer_bytes": [3_000_000, 4_000_000]}
    events = [{"type": "start"}, untracked, tracked, {**untracked, "step": 2}]
    assert phase_peaks(events) == {"peak_step": 1, **{k[5:]: v for k, v in tracked.items() if k.startswith("rank_")}}
    assert phase_peaks([untracked]) == {"peak_step": None, "peak_forward_bytes": None, "peak_backward_bytes": None,
                                        "peak_optimizer_bytes": None}
    row = {"strategy": "zero1", "world_size": 2, "params": 100_000, "grad_accum": 1, "step_s": 0.01,
           "compute_s": 0.008, "exposed_s": 0.001, "data_s": 0.001, "comm_bytes": 3000, **phase_peaks(events)}
    fig = comparison_figure([row, {**row, "strategy": "zero2", **phase_peaks([untracked])}])
    memory = fig.axes[2]
    # zero1's three measured phases and the prediction's three parts; zero2's prediction only
    assert len(memory.patches) == 3 + 3 + 3
    labels = memory.get_legend_handles_labels()[1]
    assert "peak: backward" in labels and "ZeRO: optimizer (8 B/param)" in labels
    rows = [row, {**row, "strategy": "zero2", **phase_peaks([untracked])}]
    table = [line.split() for line in peak_table(rows).splitlines()]
    # zero1 on 2 ranks: 4 + 4 bytes per parameter, and half of the 8 bytes of Adam's moments; the largest rank's peaks
    assert table[1] == ["zero1", "1.20", "6.00", "8.00", "4.00"] and table[2][2:] == ["n/a"] * 3


def test_analytic_volumes():
    assert analytic_wire_bytes("torch_ddp", 1000, 2) == 4000
    assert analytic_wire_bytes("zero2", 1000, 4) == 2 * 0.75 * 4000
    assert analytic_wire_bytes("fsdp2", 1000, 4) == pytest.approx(1.5 * analytic_wire_bytes("ddp_naive", 1000, 4))


@pytest.mark.multiproc
def test_lab_compares_real_runs_and_draws_them():
    lab = DataParallelLab(tiny_config(**{"run.steps": 4}))
    lab.strategies.value = ("ddp_naive", "zero2", "fsdp2")
    lab.nproc.value = 2
    lab.n_embd.value = 64
    lab.compare_button.click()
    rows = lab.rows
    assert [r["strategy"] for r in rows] == ["ddp_naive", "zero2", "fsdp2"]
    assert all(r["world_size"] == 2 and r["comm_bytes"] > 0 for r in rows)
    naive, zero2, fsdp2 = rows
    assert zero2["optimizer_bytes"] < naive["optimizer_bytes"] and fsdp2["param_bytes"] < naive["param_bytes"]
    assert naive["exposed_s"] == pytest.approx(naive["comm_s"])  # nothing overlaps a naive all-reduce
    assert fsdp2["exposed_s"] is None  # not measurable from the host: n/a, not a guess
    assert len(lab.figures.children) == 2 and "done: 3 runs" in lab.status.value
    assert len(comparison_figure(rows).axes) == 3
    for r in rows:  # the memory chart's bars: each rank's measured peak per phase, from the tracked step
        assert r["peak_step"] == 1 and r["state_precision"] == "fp32"
        assert all(len(r[f"peak_{phase}_bytes"]) == 2 and None not in r[f"peak_{phase}_bytes"]
                   for phase in ("forward", "backward", "optimizer"))
    # ZeRO-3 shards all three states
    assert max(fsdp2["peak_optimizer_bytes"]) < max(naive["peak_optimizer_bytes"])
    table = format_table(rows).splitlines()
    assert (table[0].split()[0] == "strategy"
            and [line.split()[0] for line in table[1:]] == ["ddp_naive", "zero2", "fsdp2"])
    assert table[3].split()[2] == "n/a"  # fsdp2's exposed communication
    timeline = timeline_figure(rows)
    assert [t.get_text() for t in timeline.axes[0].get_yticklabels()] == ["fsdp2", "zero2", "ddp_naive"]
