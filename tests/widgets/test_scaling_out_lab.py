"""The scaling-out lab: a published model on a catalog cluster through the step model, redrawn on each change."""
import pytest

import labkit.widgets.scaling_out as so
from helpers import legible
from labkit.metrics.communication import SCALING_COLLAPSES, SCALING_HOLDS
from labkit.plots import render_png


def test_the_lab_draws_the_breakdown_and_redraws_it_on_each_change():
    lab = so.ScalingOutLab()
    first = lab.breakdown
    assert first is not None and "✓ dp=1 × tp=8 × pp=8" in lab.status.value and "modelled" in lab.status.value
    assert bytes(lab.image.value).startswith(b"\x89PNG") and "step time (a model)" in lab.text.value
    assert first.attention_memory > 0
    lab.attention.value = "flash"  # FlashAttention: no s × s scores through memory, a shorter step
    assert lab.breakdown.attention_memory == 0 and lab.breakdown.total < first.total
    lab.attention.value = "naive"
    lab.micro_batches.value = 8
    assert lab.breakdown.bubble / lab.breakdown.total > first.bubble / first.total  # fewer micro-batches, more bubble
    lab.zero.value = 3
    lab.gpus.value = 128
    assert lab.breakdown.gpus == 128 and lab.breakdown.dp_comm_hidden + lab.breakdown.dp_comm_exposed > 0
    lab.model.value = "labkit quickstart"
    lab.tp.value, lab.pp.value = 1, 1
    assert lab.breakdown.memory_total < lab.breakdown.gpu_memory and lab.breakdown.gpus == 128


def test_a_layout_that_does_not_divide_the_gpus_is_explained_not_crashed():
    lab = so.ScalingOutLab()
    lab.gpus.value = 32  # tp × pp = 64 > 32
    assert lab.breakdown is None and "Cannot model this layout" in lab.status.value
    assert "tp × pp = 64 does not divide 32 GPUs" in lab.status.value
    lab.gpus.value = 64
    lab.tp.value = 64  # 96 heads
    assert "96 attention heads cannot be split 64 ways" in lab.status.value and lab.breakdown is None
    lab.tp.value, lab.gpus.value = 8, 2048
    lab.cluster.value = "dgx2h-v100"  # 512 GPUs
    assert "2048 GPUs asked for, the cluster has 512" in lab.status.value
    lab.gpus.value = 64  # fits now, but a V100 has no bf16 peak: said, not crashed
    assert lab.breakdown is None and "Tesla V100-SXM2-32GB has no published dense bf16 peak" in lab.status.value
    lab.precision.value = "fp16"
    assert lab.breakdown is not None and "✓ dp=1 × tp=8 × pp=8 on 4 node(s) of dgx2h-v100" in lab.status.value


def test_the_figures_are_legible():
    lab = so.ScalingOutLab()
    fig = so.breakdown_figure(lab.breakdown, "GPT-3 175B")
    assert legible(fig) and render_png(fig).startswith(b"\x89PNG")
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert [t.rsplit(" ", 1)[0] for t in legend] == [label for _, label in lab.breakdown.TIME_TERMS]
    rows = lab.sweep([64, 128, 256])
    assert [r["gpus"] for r in rows] == [64, 128, 256] and rows[0]["efficiency"] == pytest.approx(1.0)
    fig = so.sweep_figure(rows)
    assert legible(fig)
    assert (sorted(line.get_ydata()[0] for line in fig.axes[0].lines[2:])
            == [100 * SCALING_HOLDS, 100 * SCALING_COLLAPSES])


def test_the_sweep_falls_as_the_network_becomes_the_bottleneck():
    shape = so.MODELS["labkit quickstart"]
    rows = so.gpu_sweep(shape, so.Layout(micro_batch=1), "dgx-a100-ethernet", [8, 16, 64, 128])
    eff = [r["efficiency"] for r in rows]
    assert eff == sorted(eff, reverse=True) and eff[-1] < 1 and all(r["label"] == so.MODELLED for r in rows)
