"""Young's checkpoint interval at scale: τ* = √(2δM), M = per-GPU MTBF / N, δ from the modelled model states."""
import math

import pytest

from labkit.fault.recovery import expected_overhead
from labkit.sim import checkpointing as ck
from labkit.sim.scenario import LABEL


@pytest.fixture(scope="module")
def rows():
    return ck.young_daly_sweep()


@pytest.fixture(scope="module")
def headline(rows):
    return next(r for r in rows if r["gpus"] == ck.HEADLINE_GPUS)


def test_at_1024_gpus_the_interval_is_young_s_square_root(headline):
    s = ck.job_step(1024)
    delta = (s.memory_parameters + s.memory_optimizer) / ck.WRITE_BYTES_PER_S
    mtbf = ck.PER_GPU_MTBF_S / 1024
    assert headline["checkpoint_s"] == pytest.approx(delta) and headline["mtbf_s"] == pytest.approx(mtbf)
    assert headline["interval_s"] == pytest.approx(math.sqrt(2 * delta * mtbf))
    assert headline["dp"] == 16 and headline["fits"]


def test_the_per_gpu_failure_rate_is_llama_3_s_snapshot():
    snap = ck.LLAMA3_SNAPSHOT
    assert ck.PER_GPU_MTBF_S == pytest.approx(snap["days"] * 86_400 * snap["gpus"] / snap["unexpected_interruptions"])
    assert 5 < ck.PER_GPU_MTBF_S / ck.YEAR < 7  # "a few years" per GPU; ~3 hours for the whole 16,384


def test_the_interval_and_the_mtbf_shrink_as_the_gpus_grow(rows):
    assert [r["gpus"] for r in rows] == sorted(ck.GPU_COUNTS)
    taus, mtbfs = [r["interval_s"] for r in rows], [r["mtbf_s"] for r in rows]
    assert all(a > b for a, b in zip(taus, taus[1:])) and all(a > b for a, b in zip(mtbfs, mtbfs[1:]))
    for r in rows:
        assert r["mtbf_s"] * r["gpus"] == pytest.approx(ck.PER_GPU_MTBF_S)


def test_the_overhead_grows_with_scale_and_tau_star_beats_any_other_interval(rows):
    big = [r["overhead"] for r in rows if r["gpus"] >= ck.HEADLINE_GPUS]
    assert big == sorted(big) and rows[-1]["goodput"] < rows[0]["goodput"]
    for r in rows:
        assert r["saving"] == pytest.approx(r["lost_work"])  # at the optimum the two halves are equal
        assert r["overhead"] == pytest.approx(math.sqrt(2 * r["checkpoint_s"] / r["mtbf_s"]))
        assert r["goodput"] == pytest.approx(1 - r["overhead"])
        for other in (r["interval_s"] / 2, r["interval_s"] * 2, ck.FIXED_INTERVAL_S):
            assert expected_overhead(other, r["checkpoint_s"], r["mtbf_s"])["total"] >= r["overhead"]


def test_zero_1_shards_the_optimizer_so_each_gpu_writes_less_as_dp_grows(rows):
    sizes = [r["checkpoint_bytes"] for r in rows]
    assert all(a > b for a, b in zip(sizes, sizes[1:]))
    s64, s1024 = ck.job_step(64), ck.job_step(1024)
    assert s64.memory_parameters == pytest.approx(s1024.memory_parameters)  # parameters are not sharded by ZeRO-1
    assert s1024.memory_optimizer == pytest.approx(s64.memory_optimizer / 16)


def test_a_faster_disk_shortens_the_interval_by_root_two():
    slow, fast = ck.young_daly(1024), ck.young_daly(1024, write_bytes_per_s=2 * ck.WRITE_BYTES_PER_S)
    assert fast["checkpoint_s"] == pytest.approx(slow["checkpoint_s"] / 2)
    assert fast["interval_s"] == pytest.approx(slow["interval_s"] / math.sqrt(2))


def test_gpu_counts_that_split_no_model_parallel_group_are_refused():
    with pytest.raises(ValueError, match="tp·pp"):
        ck.young_daly(100)


def test_every_row_and_the_text_say_modelled_and_name_their_settings(rows):
    assert all(r["label"] == LABEL for r in rows)
    text = ck.checkpoint_text(quick=True)
    assert LABEL in text.splitlines()[0] and "1,024 GPUs" in text.splitlines()[0]
    assert "illustrative" in text and "Dubey et al. 2024" in text and "restarts not counted" in text


def test_the_figure_is_legible():
    from matplotlib.text import Text

    fig = ck.checkpoint_figure(quick=True)
    assert len(fig.axes) == 2 and fig.get_figwidth() <= 9.5
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text().strip() and t.get_visible()]
    assert sizes and min(sizes) >= 12
    assert "modelled" in fig.get_suptitle()
