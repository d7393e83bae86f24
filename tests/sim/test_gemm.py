"""The GEMM-shape model (labkit.sim.gemm): tile and wave quantisation and the roofline, by hand; then what it does to
the step model: the same FLOPs run slower in narrow GEMMs than in wide ones."""
import dataclasses

import pytest

from labkit.sim import gemm
from labkit.sim.cluster import A100, cluster
from labkit.sim.step import Layout, ModelShape, matmul_rate, step_time


def test_a_gemm_that_fills_whole_waves_wastes_nothing():
    # 108 SMs, 128 x 256 tiles: [128·108, 256] is exactly one wave of full tiles
    assert gemm.wave_share(128 * 108, 256, 108) == 1.0
    assert gemm.wave_share(128 * 216, 256, 108) == 1.0  # two full waves


def test_the_last_wave_runs_partly_empty():
    # 120 full tiles on 108 SMs: two waves, 216 tile slots, 120 used
    assert gemm.wave_share(128 * 120, 256, 108) == pytest.approx(120 / 216)


def test_a_tile_over_the_edge_computes_padding():
    # one row past a tile: 2 tiles of 128 rows for 129 rows (on one SM: no wave effect beyond the tiles)
    assert gemm.wave_share(129, 256, 1) == pytest.approx(129 / 256)  # 129 useful rows of 256 computed
    assert gemm.wave_share(128, 100, 1) == pytest.approx(100 / 256)


def test_batched_gemms_share_the_waves():
    # 54 small [128, 256] GEMMs at once: 54 tiles on 108 SMs, half a wave
    assert gemm.wave_share(128, 256, 108, batch=54) == pytest.approx(0.5)
    assert gemm.wave_share(128, 256, 108, batch=108) == 1.0


def test_no_sm_count_means_no_quantisation():
    assert gemm.wave_share(129, 3, None) == 1.0


def test_a_narrow_gemm_is_bound_by_memory_a_wide_one_by_its_flops():
    rate, bandwidth = 200e12, 2e12
    # [4096, 4096] x [4096, 4096]: 2·4096³ FLOPs = 1.37e11 → 0.69 ms at 200 TFLOP/s; 3·4096²·2 bytes → 0.05 ms
    wide = gemm.gemm_seconds(4096, 4096, 4096, rate, bandwidth, 2, None)
    assert wide == pytest.approx(2 * 4096 ** 3 / rate)
    # k = 8: 2·4096²·8 FLOPs = 2.7e8 → 1.3 µs; (2·4096·8 + 4096²)·2 bytes = 33.7 MB → 16.8 µs: memory binds
    narrow = gemm.gemm_seconds(4096, 4096, 8, rate, bandwidth, 2, None)
    assert narrow == pytest.approx((4096 * 8 * 2 + 4096 * 4096) * 2 / bandwidth)


def test_a_layer_runs_every_linear_three_times_and_the_attention_core_six():
    gemms = gemm.layer_gemms(hidden=64, heads=4, seq=16, micro_batch=2, tp=2)
    assert len(gemms) == 4 * 3 + 6
    flops = sum(2 * m * n * k * b for m, n, k, b in gemms)
    t = 2 * 16
    linear = 3 * 2 * t * (64 * 96 + 32 * 64 + 64 * 128 + 128 * 64)  # QKV, proj, fc1, fc2 on one TP rank of 2
    core = 3 * 2 * 2 * (2 * 4 // 2) * 16 * 16 * 16  # QKᵀ and A·V, forward and twice backward, 4 heads' batch
    assert flops == linear + core


def test_a_small_hidden_size_reaches_a_lower_share_than_a_large_one():
    """Korthikanti et al. 2022's 22B (hidden 6,144, micro-batch 4) and 530B (hidden 20,480, micro-batch 1) at TP 8:
    one constant efficiency cannot fit both; their GEMMs' shapes give the 22B's a lower share."""
    a100 = cluster("dgx-a100").gpu
    small = ModelShape(6144, 48, 64, 2048, 51200), Layout(tp=8, micro_batch=4, sequence_parallel=True)
    large = ModelShape(20480, 105, 128, 2048, 51200), Layout(tp=8, pp=35, micro_batch=1, sequence_parallel=True)
    shares = [gemm.layer_share(s, lay, a100, 2, 0.69 * 312e12) for s, lay in (small, large)]
    assert 0.5 < shares[0] < shares[1] <= 1.0
    assert shares[1] - shares[0] > 0.03


def test_the_step_model_runs_narrow_gemms_slower_per_flop():
    """Same cluster, same efficiency: a model of width 512 gets fewer FLOP/s per GPU than one of width 8,192."""
    c = cluster("dgx-a100", 8)
    rates = [matmul_rate(ModelShape(h, 4, h // 64, 2048, 51200), Layout(tp=8), c.gpu, "bf16") for h in (512, 8192)]
    assert rates[0] < 0.8 * rates[1]
    s = step_time(ModelShape(512, 4, 8, 2048, 51200), Layout(tp=8), c, "bf16")
    no_waves = dataclasses.replace(c, gpu=dataclasses.replace(A100, sms=None, memory_bandwidth=float("inf")))
    assert s.compute > step_time(ModelShape(512, 4, 8, 2048, 51200), Layout(tp=8), no_waves, "bf16").compute


def test_a_rate_that_costs_nothing_has_no_shape_effect_and_no_division_by_zero():
    # labkit.sim.calibrate writes an infinite rate when its fit finds no compute cost (a noisy quick run): every
    # GEMM then takes no time, and the step model must still run (it once raised ZeroDivisionError here)
    free = dataclasses.replace(A100, memory_bandwidth=float("inf"), sms=None)
    shape = ModelShape(hidden=64, layers=2, heads=4, seq=16, vocab=32)
    assert gemm.layer_share(shape, Layout(), free, 4, float("inf")) == 1.0
    assert step_time(shape, Layout(), dataclasses.replace(cluster("dgx-a100", 1), gpu=free), "fp32",
                     matmul_efficiency=float("inf")).compute == 0.0
