"""Every figure labs 01, 02, 03, 05, 08, 10, 12 and 13 draw is legible where it is shown: at a notebook's output width
(968 px), no text under 12 px (``labkit.plots.illegible_texts``). Each is built from small synthetic data."""
import numpy as np
import pytest
import torch

from labkit.memory_estimate import estimate_memory, preset
from labkit.moe_lab import dense_trade, drop_curve, ep_record, lab_config, route
from labkit.model.flash import online_softmax_steps
from labkit.parallel.pp.pipeline import ideal_schedule
from labkit.plots import OUTPUT_WIDTH_PX, illegible_texts
from labkit.scaling.parametric import ParametricLossFit
from labkit.sim import checkpointing, optimize_report
from labkit.widgets import cap, context_parallel, data_parallel, flash, memory_calculator, scaling, scaling_out
from labkit.widgets import moe, moe_panels
from labkit.widgets import model_parallel_figures as mpf

from lab_data import (BUBBLES, CAP_RUNS, DP_ROWS, GRID, SERIES, SPLIT, TP_ROWS, WORKERS, activation_row,
                      attention_rows, cap_summary, cp_lab, memory_row, moe_events, sweep)
from test_moe_lab import dense_record

LAW = ParametricLossFit(2.0, 100.0, 100.0, 0.5, 0.3, {}, np.zeros((0, 5)), np.zeros(0), 0.0)


def _breakdown():
    return scaling_out.ScalingOutLab().breakdown


FIGURES = {
    "01 progress": lambda: cap.progress_figure(WORKERS, (1.0, 2.0), "async: progress"),
    "01 divergence and staleness": lambda: cap.divergence_figure(SERIES, (1.0, 2.0),
                                                                 [{"staleness": s} for s in (0, 2)]),
    "01 divergence, no server": lambda: cap.divergence_figure(SERIES, (1.0, 2.0), None),
    "01 comparison": lambda: cap.comparison_figure([(cap_summary(*run), WORKERS) for run in CAP_RUNS]),
    "02 comparison": lambda: data_parallel.comparison_figure(DP_ROWS),
    "02 timeline": lambda: data_parallel.timeline_figure(DP_ROWS),
    "02 memory calculator": lambda: memory_calculator.memory_figure(
        estimate_memory(preset("zero-paper-7.5b"), dp=64), "zero-paper-7.5b: 120.0 GB per GPU"),
    "03 schedule": lambda: mpf.schedule_figure(GRID, ideal_schedule(2, 1, "gpipe"), "pp=2 gpipe m=1"),
    "03 ideal schedules": lambda: mpf.ideal_schedules_figure(4, 8),
    "03 bubble": lambda: mpf.bubble_figure(BUBBLES),
    "03 tensor-parallel bytes": lambda: mpf.tp_bytes_figure(TP_ROWS),
    "03 model states": lambda: mpf.memory_figure([("pp=2", [memory_row(0, 0, 1.6e6), memory_row(1, 1, 1.4e6)])]),
    "03 activations": lambda: mpf.activation_figure([("pp=2 1f1b", {"rows": [activation_row(0, 2e6, 2),
                                                                            activation_row(1, 3e6, 1)]})]),
    "03 step split": lambda: mpf.step_split_figure([("tp=2", SPLIT), ("pp=2 × tp=2 1f1b m=4", SPLIT)]),
    "05 online softmax": lambda: flash.softmax_step_figure(
        torch.arange(16.0).sin() * 2, online_softmax_steps(torch.arange(16.0).sin() * 2, 4), 1),
    "05 attention costs": lambda: flash.attention_costs_figure(attention_rows()),
    "08 curves": lambda: scaling.curves_figure(sweep(), 2.01),
    "08 isoflop": lambda: scaling.isoflop_figure(sweep()),
    "08 surface": lambda: scaling.surface_figure(sweep(), LAW, 2.01),
    "08 allocation": lambda: scaling.allocation_figure(LAW.params),
    "10 breakdown": lambda: scaling_out.breakdown_figure(_breakdown(), "GPT-3 175B on dgx-a100"),
    "10 sweep": lambda: scaling_out.sweep_figure(scaling_out.gpu_sweep(
        scaling_out.MODELS["GPT-3 175B"], scaling_out.Layout(tp=8, pp=8, micro_batches=64), "dgx-a100",
        [64, 128, 256])),
    "10 optimisation walk": lambda: optimize_report.optimize_figure(),
    "10 checkpointing": lambda: checkpointing.checkpoint_figure(quick=True),
    "12 memory": lambda: context_parallel.memory_figure(2**16, 40.0),
    "12 ring, cp 2": lambda: context_parallel.ring_figure(cp_lab(2)),
    "12 ring, cp 4": lambda: context_parallel.ring_figure(cp_lab(4), "contiguous"),
    "12 imbalance": lambda: context_parallel.imbalance_figure(cp_lab(4)),
    "13 explorer": lambda: moe.explorer_figure(route(skew=2.0)),
    "13 explorer, dropless, 16 experts": lambda: moe.explorer_figure(route(16, 2, None, skew=3.0)),
    "13 drops": lambda: moe.drop_figure({"router as drawn": drop_curve(0.0), "expert 0's logit +2": drop_curve(2.0)},
                                        tokens=512),
    "13 routing, live": lambda: moe_panels.routing_figure(moe_events(40, skew=70)),
    "13 routing, waiting": lambda: moe_panels.routing_figure([]),
    "13 balance": lambda: moe_panels.balance_figure({"none": moe_events(40, skew=140), "aux_loss": moe_events(40, 14),
                                                     "loss_free": moe_events(40)}),
    "13 all-to-all, ep 2": lambda: moe.all_to_all_figure(ep_record(moe_events(12), lab_config(True), 2, 2)),
    "13 all-to-all, ep 4": lambda: moe.all_to_all_figure(ep_record(moe_events(12), lab_config(True), 4, 4)),
    "13 scaling trade": lambda: moe.trade_figure(dense_trade([dense_record(False)])),
}


@pytest.mark.parametrize("name", list(FIGURES))
def test_every_text_is_at_least_12_px_at_the_notebooks_width(name):
    fig = FIGURES[name]()
    assert illegible_texts(fig) == [], name
    assert fig.get_size_inches()[0] * fig.dpi <= OUTPUT_WIDTH_PX  # drawn for the width: never shrunk to fit
