"""The source's FlashAttention claim through the step model: naive against flash attention time, modelled."""
import dataclasses

import pytest

from labkit.sim import attention as att
from labkit.sim.cluster import cluster
from labkit.sim.layout import Layout, ModelShape
from labkit.sim.step import step_time

GPT3 = ModelShape(12288, 96, 96, 2048, 51200)


def test_the_naive_extra_is_the_step_models_score_kernels_and_flash_adds_the_qk_recompute():
    lay = Layout(micro_batch=2)
    r = att.attention_seconds(GPT3, lay, "dgx-a100")
    naive = step_time(GPT3, lay, cluster("dgx-a100"), "bf16")
    flash = step_time(GPT3, dataclasses.replace(lay, attention="flash"), cluster("dgx-a100"), "bf16")
    # the two kernels differ, in the step, by exactly what they differ by here
    assert naive.total - flash.total == pytest.approx(r["naive_s"] - r["flash_s"], rel=1e-9)
    assert flash.attention_memory == 0 and r["flash_s"] < r["naive_s"] and r["label"] == att.LABEL


def test_the_sequence_barely_moves_the_cut_and_smaller_heads_gain_more():
    cuts = [att.attention_seconds(dataclasses.replace(GPT3, seq=s), Layout(), "dgx-a100")["cut"] for s in (512, 4096)]
    assert cuts[0] != cuts[1] and cuts[0] == pytest.approx(cuts[1], abs=0.02)  # only through the GEMMs' shapes
    small_heads = dataclasses.replace(GPT3, heads=192)  # head dim 64 instead of 128
    assert att.attention_seconds(small_heads, Layout(), "dgx-a100")["cut"] > cuts[0]


def test_a_gpu_with_more_flops_per_byte_gains_more():
    a100, h100 = (att.attention_seconds(GPT3, Layout(), c)["cut"] for c in ("dgx-a100", "dgx-h100"))
    assert h100 > a100


def test_the_sweep_text_marks_the_sources_range():
    rows = att.sweep({"GPT-3 175B": GPT3}, clusters=("dgx-a100", "dgx-h100"))
    text = att.format_sweep(rows)
    assert text.startswith("FlashAttention's cut of attention time — modelled") and "40–60%" in text
    for r in rows:
        assert r["in_source_range"] == (0.40 <= r["cut"] <= 0.60)
        assert f"{100 * r['cut']:.1f}%" in text
