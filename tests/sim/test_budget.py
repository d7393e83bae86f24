"""A GPU-hour budget → Chinchilla's N and D → a GPT shape → the fastest fitting layout → the wall clock."""
import math

import pytest

from labkit.text import too_wide
from labkit.scaling.allocation import CHINCHILLA_PUBLISHED, optimal_allocation
from labkit.sim import budget as bd
from labkit.sim.cluster import cluster
from labkit.sim.scenario import LABEL
from labkit.sim.step import step_time


@pytest.fixture(scope="module")
def small():
    return bd.plan_budget(10_000, "dgx-h100", 256)


@pytest.fixture(scope="module")
def large():
    return bd.plan_budget(100_000, "dgx-h100", 256)


@pytest.mark.parametrize("target", [3e8, 1.5e9, 7e9, 7e10])
def test_the_shape_rule_keeps_heads_of_128_and_lands_near_the_target(target):
    shape = bd.shape_for(target)
    assert shape.hidden % bd.WIDTH_STEP == 0 and shape.heads * bd.HEAD_DIM == shape.hidden
    assert shape.heads % 8 == 0  # 8-way tensor parallelism divides the heads
    assert abs(math.log(bd.total_params(shape) / target)) < math.log(1.6)
    if target > 5e9:
        assert 0.75 < shape.hidden / (bd.ASPECT * shape.layers) < 1.25


def test_a_budget_too_small_for_the_rule_is_refused():
    with pytest.raises(ValueError, match="below the rule's smallest model"):
        bd.shape_for(1e7)


def test_a_larger_budget_buys_a_larger_model_and_more_tokens(small, large):
    assert large.n_params > small.n_params and large.tokens > small.tokens
    assert large.chinchilla.n_params > small.chinchilla.n_params
    assert large.wall_s == pytest.approx(10 * small.wall_s)  # same GPUs, ten times the hours


@pytest.mark.parametrize("name", ["small", "large"])
def test_the_plan_is_a_fixed_point_that_spends_the_budget_exactly(name, request):
    p = request.getfixturevalue(name)
    assert p.converged and p.iterations[-1]["shape"] == p.iterations[-2]["shape"] == p.shape
    assert p.flops == pytest.approx(p.gpu_hours * 3600 * p.flops_per_s_per_gpu)  # the hours at the achieved rate
    n_opt, d_opt = optimal_allocation(p.flops, CHINCHILLA_PUBLISHED)
    assert p.chinchilla.n_params == pytest.approx(float(n_opt)) and p.chinchilla.tokens == pytest.approx(float(d_opt))
    assert 6 * p.n_params * p.tokens == pytest.approx(p.flops)
    assert p.wall_s == pytest.approx(p.gpu_hours * 3600 / p.layout.gpus)
    assert p.steps == math.ceil(p.tokens / (p.layout.global_batch * p.shape.seq))


@pytest.mark.parametrize("name", ["small", "large"])
def test_the_layout_fits_uses_every_gpu_and_is_the_fastest_that_fits(name, request):
    p = request.getfixturevalue(name)
    lay, c = p.layout, p.cluster
    assert p.step.fits and lay.gpus == c.gpus and lay.global_batch * p.shape.seq == bd.GLOBAL_BATCH_TOKENS
    assert p.shape.heads % lay.tp == 0 and lay.tp <= c.gpus_per_node and (lay.pp == 1 or lay.zero <= 1)
    fitting = [s.total for s in (step_time(p.shape, other, c) for other in bd.layouts(p.shape, c, lay.global_batch))
               if s.fits]
    assert len(fitting) <= p.layouts_tried and p.step.total == min(fitting)


def test_a_model_too_big_for_the_cluster_has_no_layout():
    with pytest.raises(ValueError, match="no layout"):
        bd.fastest_layout(bd.shape_for(1e12), cluster("dgx-a100", 8), 1024)


def test_quick_searches_fewer_layouts_and_everything_says_modelled(large):
    quick = bd.plan_budget(100_000, "dgx-h100", 256, quick=True)
    assert quick.layouts_tried < large.layouts_tried and quick.step.fits
    assert large.label == LABEL and "modelled" in LABEL
    text = bd.budget_text(100_000, "dgx-h100", 256, quick=True)
    assert LABEL in text.splitlines()[0] and "Chinchilla" in text and "wall clock" in text
    assert not too_wide(text)  # prints in a notebook without wrapping mid-word
