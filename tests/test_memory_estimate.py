"""labkit.memory_estimate: the paper formulas, reproduced by hand."""
from __future__ import annotations

import pytest

from labkit.memory_estimate import (
    PRESETS,
    MemoryPlan,
    activation_bytes_per_layer,
    estimate_memory,
    gpt_param_count,
    preset,
    zero_model_state_bytes,
    zero_model_state_split,
)
from labkit.parallel.reports.data_parallel import predict_rank_memory  # a strategy's ZeRO stage is the strategy's fact

S, B, H, A = 2048, 1, 12288, 96  # Korthikanti et al.'s GPT-3 175B example
SBH = S * B * H


@pytest.mark.parametrize("stage, gigabytes", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(stage, gigabytes):
    assert round(zero_model_state_bytes(7.5e9, dp=64, stage=stage, k=12) / 1e9, 1) == gigabytes


def test_zero_stages_never_grow_and_stage3_scales_as_one_over_dp():
    totals = [zero_model_state_bytes(1e9, dp=8, stage=stage) for stage in range(4)]
    assert totals == sorted(totals, reverse=True)
    assert zero_model_state_bytes(1e9, 16, 3) == pytest.approx(zero_model_state_bytes(1e9, 8, 3) / 2)


def test_dp_one_makes_all_stages_equal():
    assert len({zero_model_state_bytes(1e9, dp=1, stage=stage) for stage in range(4)}) == 1


def test_split_shards_one_more_state_per_stage():
    assert zero_model_state_split(100, 4, 0) == (200, 200, 1200)
    assert zero_model_state_split(100, 4, 1) == (200, 200, 300)
    assert zero_model_state_split(100, 4, 2) == (200, 50, 300)
    assert zero_model_state_split(100, 4, 3) == (50, 50, 300)


def test_korthikanti_activation_per_layer():
    assert 5 * A * S / H == 80
    assert activation_bytes_per_layer(S, B, H, A) == 114 * 2048 * 12288 == 2_868_903_936


def test_tensor_parallel_divides_the_24_term_and_the_scores():
    assert activation_bytes_per_layer(S, B, H, A, tp=8) == pytest.approx(SBH * (10 + 24 / 8 + 80 / 8))
    assert activation_bytes_per_layer(S, B, H, A, tp=8, sequence_parallel=True) == pytest.approx(SBH * 114 / 8)


def test_recomputation():
    assert activation_bytes_per_layer(S, B, H, A, recompute="full") == 2 * SBH
    assert activation_bytes_per_layer(S, B, H, A, tp=8, recompute="full") == 2 * SBH
    assert activation_bytes_per_layer(S, B, H, A, tp=8, recompute="selective") == pytest.approx(SBH * 13)
    assert activation_bytes_per_layer(S, B, H, A, tp=8, recompute="selective", sequence_parallel=True) \
        == pytest.approx(SBH * 34 / 8)
    for tp in (1, 2, 8):
        none = activation_bytes_per_layer(S, B, H, A, tp=tp)
        selective = activation_bytes_per_layer(S, B, H, A, tp=tp, recompute="selective")
        assert activation_bytes_per_layer(S, B, H, A, tp=tp, recompute="full") <= selective <= none


def test_pipeline_splits_layers_with_ceil():
    plan = preset("gpt3-175b")
    per_layer = activation_bytes_per_layer(S, B, H, A)
    assert estimate_memory(plan).activations == pytest.approx(96 * per_layer)
    assert estimate_memory(plan, pp=8).activations == pytest.approx(12 * per_layer)
    assert estimate_memory(plan, pp=5).activations == pytest.approx(20 * per_layer)
    assert estimate_memory(plan, pp=8).parameters == pytest.approx(estimate_memory(plan).parameters / 8)


def test_estimate_memory_combines_parallelism():
    plan = MemoryPlan(params=8e9, tp=2, pp=2, dp=4, zero_stage=3, precision="fp32")
    result = estimate_memory(plan)
    assert (result.parameters, result.gradients, result.optimizer_state) == (2e9, 2e9, 4e9)
    assert result.activations is None and result.total == 8e9
    assert "n/a" in result.describe() and "GB" in str(result)


def test_presets_load():
    assert set(PRESETS) >= {"gpt2-small", "gpt2-xl", "llama2-7b", "zero-paper-7.5b"}
    small = preset("gpt2-small")
    assert small.total_params == gpt_param_count(12, 768, 50257, 1024) == 124_318_464
    assert 6.5e9 < preset("llama2-7b").total_params < 6.8e9
    assert preset("zero-paper-7.5b").total_params == 7.5e9
    for name in PRESETS:
        assert estimate_memory(preset(name), dp=8, zero_stage=2).total > 0
    assert "activations" in str(estimate_memory(small))


@pytest.mark.parametrize("strategy, expected", [
    ("torch_ddp", (4000, 4000, 8000)), ("zero1", (4000, 4000, 4000)),
    ("zero2", (4000, 2000, 4000)), ("fsdp2", (2000, 2000, 4000)),
])
def test_predict_rank_memory_fp32(strategy, expected):
    result = predict_rank_memory(1000, world_size=2, strategy=strategy)
    assert (result.parameters, result.gradients, result.optimizer_state) == expected


def test_predict_rank_memory_mixed():
    result = predict_rank_memory(1000, world_size=2, strategy="zero1", precision="mixed")
    assert (result.parameters, result.gradients, result.optimizer_state) == (2000, 2000, 6000)


@pytest.mark.parametrize("call, name", [
    (lambda: zero_model_state_bytes(1e9, dp=8, stage=4), "stage"),
    (lambda: zero_model_state_bytes(1e9, dp=0, stage=1), "dp"),
    (lambda: zero_model_state_bytes(-1, dp=1, stage=1), "params"),
    (lambda: MemoryPlan(params=1e9, tp=0), "tp"),
    (lambda: MemoryPlan(params=1e9, pp=0), "pp"),
    (lambda: MemoryPlan(params=1e9, recompute="some"), "recompute"),
    (lambda: MemoryPlan(params=1e9, precision="fp8"), "precision"),
    (lambda: MemoryPlan(n_layer=2, hidden=100, heads=3), "heads"),
    (lambda: MemoryPlan(n_layer=2, hidden=96, heads=12, tp=5), "tp"),
    (lambda: MemoryPlan(n_layer=-2, hidden=96, heads=12), "n_layer"),
    (lambda: MemoryPlan(params=1e9, micro_batch=0), "micro_batch"),
    (lambda: MemoryPlan(), "params"),
    (lambda: activation_bytes_per_layer(S, B, H, A, recompute="half"), "recompute"),
    (lambda: predict_rank_memory(1e6, 2, "zero4"), "strategy"),
    (lambda: predict_rank_memory(1e6, 0, "zero1"), "world_size"),
    (lambda: preset("gpt5"), "name"),
])
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()
