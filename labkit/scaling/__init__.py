"""Scaling laws: fit how loss falls with model size and data, then spend a budget well.

**Two papers, two answers.** Kaplan et al. 2020 fitted ``L(N) = (N_c/N)^alpha_N``,
``L(D) = (D_c/D)^alpha_D`` and a joint ``L(N, D)``, and concluded that a growing
compute budget should go mostly into parameters (``N_opt ~ C^0.73``). Hoffmann et
al. 2022 ("Chinchilla") trained over 400 models, each with a learning-rate schedule
matched to its own length, and found ``N_opt ~ C^0.5``: parameters and tokens should
grow together, about 20 tokens per parameter at their scale. Their 70B Chinchilla,
trained on 4x more data than the 280B Gopher at the same compute, beat it. They
located the optimum three independent ways (``fit_chinchilla_envelope``,
``fit_chinchilla_isoflop``, ``fit_chinchilla_parametric``); that the three roughly
agree is the evidence, not any single fit.

**Why fit in log space.** Power laws are straight lines on log-log axes, so
``log L = alpha log N_c - alpha log N`` is ordinary linear regression. Just as
important, errors in loss are relative: a run 1% above the curve is equally
surprising at loss 4 and at loss 2. Squared errors on raw loss would let the large
early losses dominate; on log-loss every run counts the same. And sizes span six
orders of magnitude: logs keep the optimiser's numbers of order one.

**Why Huber.** Real sweeps contain a few bad runs: a loss spike, a diverged
learning rate, a job killed early. Least squares weighs each error by its square,
so one such run can bend the exponents. The Huber loss is quadratic for small
residuals and linear beyond ``delta`` (1e-3 in log-loss, i.e. 0.1%), so an outlier
pulls with a bounded force. It costs some efficiency on clean data, the price of
robustness.

Modules: ``fits`` (Kaplan and Chinchilla approaches 1-2), ``parametric``
(approach 3), ``allocation`` (closed-form optimum from approach 3, and Kaplan's for
contrast), ``planner`` (budget in FLOPs, hours or money -> N, D, steps, loss).
"""
from labkit.scaling.allocation import (
    CHINCHILLA_PUBLISHED,
    KAPLAN_N_OPT_AT_ONE_PF_DAY,
    KAPLAN_N_OPT_EXPONENT,
    PF_DAY_FLOPS,
    allocation_coefficient,
    allocation_exponents,
    kaplan_allocation,
    optimal_allocation,
    optimal_loss,
    predicted_loss,
    tokens_per_parameter,
)
from labkit.scaling.fits import (
    ComputeOptimalFit,
    KaplanJointLaw,
    KaplanPowerLaw,
    TrainingCurve,
    fit_chinchilla_envelope,
    fit_chinchilla_isoflop,
    fit_loss_vs_params,
    fit_loss_vs_params_and_tokens,
    fit_loss_vs_tokens,
)
from labkit.scaling.parametric import (
    HOFFMANN_GRID,
    ParametricLossFit,
    fit_chinchilla_parametric,
)
from labkit.scaling.planner import TrainingChoice, TrainingPlan, budget_to_flops, plan

__all__ = [
    "CHINCHILLA_PUBLISHED",
    "HOFFMANN_GRID",
    "KAPLAN_N_OPT_AT_ONE_PF_DAY",
    "KAPLAN_N_OPT_EXPONENT",
    "PF_DAY_FLOPS",
    "ComputeOptimalFit",
    "KaplanJointLaw",
    "KaplanPowerLaw",
    "ParametricLossFit",
    "TrainingChoice",
    "TrainingCurve",
    "TrainingPlan",
    "allocation_coefficient",
    "allocation_exponents",
    "budget_to_flops",
    "fit_chinchilla_envelope",
    "fit_chinchilla_isoflop",
    "fit_chinchilla_parametric",
    "fit_loss_vs_params",
    "fit_loss_vs_params_and_tokens",
    "fit_loss_vs_tokens",
    "kaplan_allocation",
    "optimal_allocation",
    "optimal_loss",
    "plan",
    "predicted_loss",
    "tokens_per_parameter",
]
