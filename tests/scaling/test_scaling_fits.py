"""Scaling-law fits recover the laws that generated synthetic data; bad input fails loudly."""
import math

import numpy as np
import pytest

from labkit.scaling import (
    CHINCHILLA_PUBLISHED,
    PF_DAY_FLOPS,
    TrainingCurve,
    allocation_exponents,
    budget_to_flops,
    fit_chinchilla_envelope,
    fit_chinchilla_isoflop,
    fit_chinchilla_parametric,
    fit_loss_vs_params,
    fit_loss_vs_params_and_tokens,
    fit_loss_vs_tokens,
    kaplan_allocation,
    optimal_allocation,
    plan,
    predicted_loss,
)

TRUE_LAW = {"E": 1.5, "A": 400.0, "B": 400.0, "alpha": 0.34, "beta": 0.28}
TRUE_A = TRUE_LAW["beta"] / (TRUE_LAW["alpha"] + TRUE_LAW["beta"])


def noisy(values, relative_noise, rng):
    return values * (1 + relative_noise * rng.standard_normal(np.shape(values)))


# ------------------------------------------------------------------ approach 3

@pytest.fixture(scope="module")
def parametric_data():
    """200 runs, a 20 x 10 grid of (N, D), loss from TRUE_LAW with 1% multiplicative noise.

    The ranges are wide (N 1e5-1e11, D 1e7-1e13) on purpose. With N 1e6-1e9 and
    D 1e8-1e11, 1% noise leaves E so entangled with A and B that E lands within 1%
    for only ~40% of noise seeds, even with plain least squares: the data, not the
    optimiser, set that limit. Over these ranges all five bars hold for ~95% of
    seeds (measured over 100); seed 0 was not chosen by looking at the outcome.
    """
    rng = np.random.default_rng(0)
    n = np.repeat(np.logspace(5, 11, 20), 10)
    d = np.tile(np.logspace(7, 13, 10), 20)
    return n, d, noisy(predicted_loss(n, d, TRUE_LAW), 0.01, rng)


@pytest.fixture(scope="module")
def parametric_fit(parametric_data):
    return fit_chinchilla_parametric(*parametric_data, n_bootstrap=20, seed=0)


def test_parametric_fit_from_default_grid_recovers_the_law(parametric_fit):
    fit = parametric_fit
    assert fit.alpha == pytest.approx(TRUE_LAW["alpha"], rel=0.02)
    assert fit.beta == pytest.approx(TRUE_LAW["beta"], rel=0.02)
    assert fit.E == pytest.approx(TRUE_LAW["E"], rel=0.01)
    assert fit.A == pytest.approx(TRUE_LAW["A"], rel=0.10)
    assert fit.B == pytest.approx(TRUE_LAW["B"], rel=0.10)


def test_parametric_fit_reports_residuals_intervals_and_predictions(parametric_data, parametric_fit):
    n, d, loss = parametric_data
    fit = parametric_fit
    assert np.allclose(fit.residuals, np.log(loss) - np.log(fit.predict(n, d)))
    assert np.median(np.abs(fit.residuals)) < 0.01  # 1% noise: half the points within ~0.7%
    assert fit.bootstrap_samples.shape == (20, 5)
    for name, (low, high) in fit.intervals.items():
        assert low < high, name
        assert low <= fit.params[name] * 1.05 and high >= fit.params[name] * 0.95, name
    again = fit_chinchilla_parametric(n, d, loss, n_bootstrap=3, seed=1, n_starts=4)
    assert again.alpha == pytest.approx(fit.alpha, rel=1e-4)  # same optimum from fewer starts


def test_parametric_fit_shrugs_off_a_few_diverged_runs(parametric_data):
    """Huber at work: 5 runs with 30% too-high loss barely move the exponents."""
    n, d, loss = parametric_data
    spoiled = loss.copy()
    spoiled[::40] *= 1.3
    fit = fit_chinchilla_parametric(n, d, spoiled, n_bootstrap=0, n_starts=8)
    assert fit.alpha == pytest.approx(TRUE_LAW["alpha"], rel=0.03)
    assert fit.beta == pytest.approx(TRUE_LAW["beta"], rel=0.03)
    assert np.all(np.isnan([bounds for bounds in fit.intervals.values()]))


# ------------------------------------------------------------------ allocation

@pytest.mark.parametrize("flops", [1e18, 1e21, 5.76e23, 1e26])
def test_published_allocation_spends_the_budget_exactly(flops):
    n_opt, d_opt = optimal_allocation(flops, CHINCHILLA_PUBLISHED)
    assert 6 * n_opt * d_opt == pytest.approx(flops, rel=1e-9)


def test_published_allocation_exponent_is_beta_over_alpha_plus_beta():
    alpha, beta = CHINCHILLA_PUBLISHED["alpha"], CHINCHILLA_PUBLISHED["beta"]
    a, b = allocation_exponents(CHINCHILLA_PUBLISHED)
    assert a == pytest.approx(beta / (alpha + beta))
    assert b == pytest.approx(alpha / (alpha + beta))
    n_small, _ = optimal_allocation(1e20, CHINCHILLA_PUBLISHED)
    n_large, _ = optimal_allocation(1e24, CHINCHILLA_PUBLISHED)
    assert math.log(n_large / n_small) / math.log(1e4) == pytest.approx(a, rel=1e-9)


def test_optimal_allocation_is_the_bottom_of_the_isoflop_curve():
    flops = 1e21
    n_opt, _ = optimal_allocation(flops, CHINCHILLA_PUBLISHED)
    sizes = n_opt * np.array([0.9, 0.99, 1.0, 1.01, 1.1])
    losses = predicted_loss(sizes, flops / (6 * sizes), CHINCHILLA_PUBLISHED)
    assert np.argmin(losses) == 2


def test_kaplan_allocation_puts_most_of_the_growth_into_parameters():
    n, d = kaplan_allocation(PF_DAY_FLOPS)
    assert n == pytest.approx(1.3e9)
    assert 6 * n * d == pytest.approx(PF_DAY_FLOPS)
    n_big, _ = kaplan_allocation(PF_DAY_FLOPS * 1e3)
    assert math.log10(n_big / n) / 3 == pytest.approx(0.73)


# ------------------------------------------------------------------ approaches 1 and 2

def isoflop_sweep(rng, relative_noise=0.005):
    """9 budgets, 9 sizes each spanning 100x around a 20-tokens-per-parameter guess."""
    flops, sizes, losses = [], [], []
    for budget in np.logspace(18, 22, 9):
        n = np.sqrt(budget / 6 / 20) * np.logspace(-1, 1, 9)
        flops += [budget] * n.size
        sizes += list(n)
        losses += list(noisy(predicted_loss(n, budget / (6 * n), TRUE_LAW), relative_noise, rng))
    return np.array(flops), np.array(sizes), np.array(losses)


def test_isoflop_fit_recovers_the_allocation_exponent():
    fit = fit_chinchilla_isoflop(*isoflop_sweep(np.random.default_rng(0)))
    assert abs(fit.a - TRUE_A) < 0.02
    assert fit.a + fit.b == pytest.approx(1.0)
    assert fit.a_interval[0] < fit.a < fit.a_interval[1]
    n_opt, d_opt = fit.predict(1e20)
    assert 6 * n_opt * d_opt == pytest.approx(1e20)


def test_isoflop_fit_refuses_a_minimum_outside_the_sweep():
    flops, sizes, losses = isoflop_sweep(np.random.default_rng(0), relative_noise=0.0)
    first = flops == flops[0]
    keep = ~first | (sizes > np.median(sizes[first]))  # only the right half of the first parabola
    with pytest.raises(ValueError, match="outside the sizes tried"):
        fit_chinchilla_isoflop(flops[keep], sizes[keep], losses[keep])


def test_envelope_fit_recovers_the_allocation_exponent():
    """Approach 1 can only name a model size it trained: N_opt is quantised to the grid.

    Neighbouring sizes differ by a factor q, so each envelope point may sit up to
    half a step (log q / 2) off the true log N_opt. Across the fitted span of log C,
    that can tilt the fitted line by about log q / span: the tolerance (~0.03 here).
    """
    rng = np.random.default_rng(0)
    sizes = np.logspace(6, 9, 16)
    tokens = np.logspace(7, 12, 200)
    curves = [TrainingCurve(n, tokens, noisy(predicted_loss(n, tokens, TRUE_LAW), 0.002, rng)) for n in sizes]
    fit = fit_chinchilla_envelope(curves, n_bootstrap=30)
    tolerance = math.log(sizes[1] / sizes[0]) / math.log(fit.flops.max() / fit.flops.min())
    assert 0.02 < tolerance < 0.05
    assert abs(fit.a - TRUE_A) < tolerance
    assert fit.a_interval[0] <= fit.a <= fit.a_interval[1]


# ------------------------------------------------------------------ Kaplan

def test_kaplan_single_variable_fits_recover_the_exponents():
    rng = np.random.default_rng(0)
    n = np.logspace(6, 9, 30)
    by_params = fit_loss_vs_params(n, noisy((8.8e13 / n) ** 0.076, 0.005, rng))
    assert by_params.alpha == pytest.approx(0.076, abs=3 * by_params.alpha_stderr + 1e-3)
    assert by_params.alpha == pytest.approx(0.076, rel=0.05)
    d = np.logspace(8, 11, 30)
    by_tokens = fit_loss_vs_tokens(d, noisy((5.4e13 / d) ** 0.095, 0.005, rng))
    assert by_tokens.alpha == pytest.approx(0.095, rel=0.05)
    assert by_tokens.predict(1e10) == pytest.approx((5.4e13 / 1e10) ** 0.095, rel=0.01)


def test_kaplan_joint_fit_recovers_both_exponents():
    rng = np.random.default_rng(0)
    n = np.repeat(np.logspace(6, 9, 10), 10)
    d = np.tile(np.logspace(8, 11, 10), 10)
    loss = ((8.8e13 / n) ** (0.076 / 0.095) + 5.4e13 / d) ** 0.095
    fit = fit_loss_vs_params_and_tokens(n, d, noisy(loss, 0.005, rng))
    assert fit.alpha_n == pytest.approx(0.076, rel=0.05)
    assert fit.alpha_d == pytest.approx(0.095, rel=0.05)
    assert fit.stderr["alpha_n"] > 0


# ------------------------------------------------------------------ bad input

GOOD_N, GOOD_D, GOOD_LOSS = [1e6, 1e7, 1e8, 1e9, 1e6, 1e8], [1e9, 1e9, 1e10, 1e10, 1e11, 1e11], [4, 3, 3, 2.5, 3, 2.4]


@pytest.mark.parametrize(("n", "d", "loss", "message"), [
    (GOOD_N[:5], GOOD_D, GOOD_LOSS, "mismatched lengths: n_params has 5, tokens has 6"),
    ([-1e6, *GOOD_N[1:]], GOOD_D, GOOD_LOSS, "n_params must be positive.*-1000000.0 at index 0"),
    (GOOD_N, [*GOOD_D[:3], 0, *GOOD_D[4:]], GOOD_LOSS, "tokens must be positive.*index 3"),
    (GOOD_N, GOOD_D, [*GOOD_LOSS[:2], float("nan"), *GOOD_LOSS[3:]], "loss contains NaN or inf.*index 2"),
    (GOOD_N, GOOD_D, [*GOOD_LOSS[:5], float("inf")], "loss contains NaN or inf.*index 5"),
    (GOOD_N[:4], GOOD_D[:4], GOOD_LOSS[:4], "5 parameters but got only 4 points"),
    ([1e6] * 6, GOOD_D, GOOD_LOSS, "n_params takes a single value"),
])
def test_parametric_fit_names_the_problem_with_bad_input(n, d, loss, message):
    with pytest.raises(ValueError, match=message):
        fit_chinchilla_parametric(n, d, loss, n_bootstrap=0)


def test_other_fits_name_the_problem_with_bad_input():
    with pytest.raises(ValueError, match="2 parameters but got only 1 points"):
        fit_loss_vs_params([1e6], [3.0])
    with pytest.raises(ValueError, match="loss does not fall"):
        fit_loss_vs_tokens([1e8, 1e9, 1e10], [2.0, 2.5, 3.0])
    with pytest.raises(ValueError, match="4 parameters but got only 3"):
        fit_loss_vs_params_and_tokens([1e6, 1e7, 1e8], [1e9, 1e10, 1e11], [3, 2.5, 2])
    with pytest.raises(ValueError, match="at least 3 training curves, got 2"):
        fit_chinchilla_envelope([TrainingCurve(1e6, [1e8, 1e9], [3, 2])] * 2)
    with pytest.raises(ValueError, match=r"curves\[1\].tokens must hold at least two strictly increasing"):
        fit_chinchilla_envelope([TrainingCurve(1e6, [1e8, 1e9], [3, 2]), TrainingCurve(1e7, [1e9, 1e8], [3, 2]),
                                 TrainingCurve(1e8, [1e8, 1e9], [3, 2])])
    with pytest.raises(ValueError, match="2 parameters but got only 1 points"):
        fit_chinchilla_isoflop([1e20] * 3, [1e7, 1e8, 1e9], [3, 2, 3])
    with pytest.raises(ValueError, match="curves downward"):
        fit_chinchilla_isoflop([1e20] * 3 + [1e21] * 3, [1e7, 1e8, 1e9] * 2, [2, 3, 2, 2, 3, 2])


# ------------------------------------------------------------------ planner

def test_budgets_convert_to_flops_through_measured_throughput():
    assert budget_to_flops(budget_flops=3e20) == 3e20
    assert budget_to_flops(budget_hours=10, flops_per_second=2e14) == pytest.approx(10 * 3600 * 2e14)
    money = budget_to_flops(budget_money=500, price_per_hour=2.5, flops_per_second=2e14)
    assert money == pytest.approx(200 * 3600 * 2e14)


def test_plan_neighbours_spend_the_same_flops_and_lose_more():
    result = plan(budget_hours=24, flops_per_second=4e14, tokens_per_step=2**19)
    flops = 24 * 3600 * 4e14
    best = result.recommended
    n_opt, d_opt = optimal_allocation(flops, CHINCHILLA_PUBLISHED)
    assert (best.n_params, best.tokens) == pytest.approx((float(n_opt), float(d_opt)))
    assert best.steps == math.ceil(best.tokens / 2**19)
    assert best.wall_hours == pytest.approx(24)
    assert [c.size_factor for c in result.neighbours] == pytest.approx([0.25, 0.5, 2, 4])
    for choice in result.neighbours:
        assert 6 * choice.n_params * choice.tokens == pytest.approx(flops)
        assert choice.flops == result.flops == pytest.approx(flops)
        assert choice.predicted_loss > best.predicted_loss
    assert [c.n_params for c in result.choices] == sorted(c.n_params for c in result.choices)


def test_plan_accepts_a_fitted_law(parametric_fit):
    result = plan(budget_flops=1e20, fit=parametric_fit, neighbours=[0.5])
    n_opt, _ = optimal_allocation(1e20, TRUE_LAW)
    assert result.recommended.n_params == pytest.approx(float(n_opt), rel=0.25)
    assert result.recommended.steps is None and result.recommended.wall_seconds is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "no budget given"),
    ({"budget_flops": 1e20, "budget_hours": 5}, "got budget_flops and budget_hours; pass exactly one"),
    ({"budget_flops": -1e20}, "budget_flops must be a finite positive number"),
    ({"budget_hours": 0, "flops_per_second": 1e14}, "budget_hours must be a finite positive number"),
    ({"budget_hours": 5}, "needs flops_per_second"),
    ({"budget_money": 100, "flops_per_second": 1e14}, "needs price_per_hour"),
    ({"budget_money": 100, "price_per_hour": -2, "flops_per_second": 1e14}, "price_per_hour must be"),
    ({"budget_flops": 1e20, "price_per_hour": 2}, "price_per_hour only converts budget_money"),
    ({"budget_flops": 1e20, "neighbours": [0.5, 0]}, r"neighbours\[1\] must be"),
])
def test_plan_rejects_invalid_budgets(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan(**kwargs)


def test_a_predicted_loss_below_the_entropy_floor_is_marked_and_explained():
    """A law whose fitted E sits under the data's floor predicts losses no model can reach once the budget is large:
    the planner says so instead of printing them bare (notebook 08: E 2.166 against a floor of 2.323)."""
    from labkit.scaling.planner import below_floor, floor_note
    from labkit.widgets.scaling import BudgetPlanner, plan_table_html

    law = {"E": 2.0, "A": 10.0, "B": 10.0, "alpha": 0.5, "beta": 0.5}
    big = plan(budget_flops=1e12, fit=law)
    assert all(c.predicted_loss < 2.1 for c in big.choices)
    note = floor_note(big, 2.1, law)
    assert len(below_floor(big, 2.1)) == 5 and note.startswith("5 of the 5 predicted losses")
    assert "entropy floor, 2.1000" in note and "E = 2.0000" in note and "extrapolates" in note
    assert floor_note(big, 1.9, law) == floor_note(big, None, law) == "" and below_floor(big, None) == []
    small = plan(budget_flops=1e9, fit=law)  # a small budget stays above the floor: nothing to say
    assert floor_note(small, 2.1, law) == ""
    html = plan_table_html(big, 2.1, law)
    assert html.count("†") == 6 and "extrapolates" in html  # five marked losses and the note
    assert "†" not in plan_table_html(big, None, law)
    planner = BudgetPlanner(law, 1e12, tokens_per_step=2048, floor=2.1)
    planner.minutes.value = 1000.0
    assert "†" in planner.table.value and "entropy floor" in planner.table.value
