"""Turn a budget (FLOPs, GPU-hours or money) into a concrete training plan.

A scaling law speaks in FLOPs; people budget in hours or currency. The bridge is
the *achieved* throughput of your own setup: model FLOP/s actually sustained in a
real run (``6 N`` FLOPs per token divided by measured step time), not the datasheet
peak. ``labkit.metrics.achieved_tflops`` reports it per device in TFLOP/s, so for
``k`` devices pass ``flops_per_second = tflops * 1e12 * k``.

The plan lists the compute-optimal choice and a few neighbours at the *same*
budget (smaller model trained longer, larger model trained shorter), so you can
see how flat the optimum is: Chinchilla's IsoFLOP curves are shallow near the
bottom, and a factor of two in model size usually costs only a little loss.
Neighbours are assumed to reach the same FLOP/s, which is optimistic for small
models (they use a GPU less well).
"""
import math
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.scaling._checks import as_positive_number
from labkit.scaling.allocation import (
    CHINCHILLA_PUBLISHED,
    _law,
    optimal_allocation,
    predicted_loss,
)

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class TrainingChoice:
    """One way to spend the budget: a model size and how many tokens to train it on."""

    n_params: float
    tokens: float
    flops: float  # 6 * n_params * tokens, the same for every choice in a plan
    size_factor: float  # n_params / N_opt: 1.0 is the compute-optimal choice
    predicted_loss: float
    steps: int | None  # ceil(tokens / tokens_per_step); None without tokens_per_step
    wall_seconds: float | None  # flops / flops_per_second; None without a throughput

    @property
    def tokens_per_parameter(self) -> float:
        return self.tokens / self.n_params

    @property
    def wall_hours(self) -> float | None:
        return None if self.wall_seconds is None else self.wall_seconds / SECONDS_PER_HOUR


@dataclass(frozen=True)
class TrainingPlan:
    flops: float
    recommended: TrainingChoice
    neighbours: list  # of TrainingChoice, same flops, other model sizes

    @property
    def choices(self) -> list:
        """Recommended and neighbours together, smallest model first: a table for plotting."""
        return sorted([self.recommended, *self.neighbours], key=lambda choice: choice.n_params)


def budget_to_flops(budget_flops=None, budget_hours=None, budget_money=None, *,
                    price_per_hour=None, flops_per_second=None) -> float:
    """Exactly one budget, converted to FLOPs.

    hours -> ``hours * 3600 * flops_per_second``;
    money -> ``(money / price_per_hour)`` hours, then as above.
    """
    given = {name: value for name, value in
             (("budget_flops", budget_flops), ("budget_hours", budget_hours), ("budget_money", budget_money))
             if value is not None}
    if not given:
        raise ValueError("no budget given: pass exactly one of budget_flops, budget_hours or budget_money")
    if len(given) > 1:
        raise ValueError(f"got {' and '.join(given)}; pass exactly one budget")
    if price_per_hour is not None and budget_money is None:
        raise ValueError("price_per_hour only converts budget_money; drop it or pass budget_money instead")
    (name, value), = given.items()
    amount = as_positive_number(name, value)
    if name == "budget_flops":
        return amount
    if flops_per_second is None:
        raise ValueError(f"{name} needs flops_per_second (the achieved FLOP/s measured in a run) to become FLOPs")
    rate = as_positive_number("flops_per_second", flops_per_second)
    if name == "budget_money":
        if price_per_hour is None:
            raise ValueError("budget_money needs price_per_hour to become hours")
        amount /= as_positive_number("price_per_hour", price_per_hour)
    return amount * SECONDS_PER_HOUR * rate


def _choice(n_params: float, flops: float, n_opt: float, fit, tokens_per_step, flops_per_second) -> TrainingChoice:
    tokens = flops / (6 * n_params)
    return TrainingChoice(
        n_params=float(n_params),
        tokens=float(tokens),
        flops=float(flops),
        size_factor=float(n_params / n_opt),
        predicted_loss=float(predicted_loss(n_params, tokens, fit)),
        steps=None if tokens_per_step is None else math.ceil(tokens / tokens_per_step),
        wall_seconds=None if flops_per_second is None else flops / flops_per_second,
    )


def plan(budget_flops=None, budget_hours=None, budget_money=None, *, price_per_hour=None,
         flops_per_second=None, fit=CHINCHILLA_PUBLISHED, neighbours: Sequence[float] = (0.25, 0.5, 2.0, 4.0),
         tokens_per_step=None) -> TrainingPlan:
    """The compute-optimal (N, D) for one budget under ``fit``, and neighbours at the same FLOPs.

    ``fit`` is approach-3 parameters (``CHINCHILLA_PUBLISHED``, a mapping, or a
    ``ParametricLossFit``). ``neighbours`` are multiples of the optimal model size;
    each keeps ``6 N D`` equal to the budget. ``tokens_per_step`` (global batch size
    times sequence length) turns tokens into optimiser steps.
    """
    flops = budget_to_flops(budget_flops, budget_hours, budget_money,
                            price_per_hour=price_per_hour, flops_per_second=flops_per_second)
    rate = None if flops_per_second is None else as_positive_number("flops_per_second", flops_per_second)
    batch = None if tokens_per_step is None else as_positive_number("tokens_per_step", tokens_per_step)
    factors = [as_positive_number(f"neighbours[{i}]", factor) for i, factor in enumerate(neighbours)]
    n_opt, _ = optimal_allocation(flops, fit)
    n_opt = float(n_opt)
    return TrainingPlan(
        flops=flops,
        recommended=_choice(n_opt, flops, n_opt, fit, batch, rate),
        neighbours=[_choice(n_opt * factor, flops, n_opt, fit, batch, rate) for factor in factors],
    )


def below_floor(the_plan: TrainingPlan, floor: float | None) -> list:
    """The plan's choices whose predicted loss is under the data's entropy floor (none without a floor)."""
    return [] if floor is None else [c for c in the_plan.choices if c.predicted_loss < floor]


def floor_note(the_plan: TrainingPlan, floor: float | None, fit=CHINCHILLA_PUBLISHED) -> str:
    """What a predicted loss under the data's entropy floor means; empty when none is under it.

    The floor is the exact entropy of the process that generated the corpus: no model's loss goes below it. A
    law ``E + A/N^alpha + B/D^beta`` predicts below it only when its fitted E is under the floor (every other term
    is positive): the fit put part of the loss that training removes into E, and this budget reaches past the
    runs it was fitted on. Which size is best depends on A, B, alpha and beta only, so the ranking still holds.
    """
    under = below_floor(the_plan, floor)
    if not under:
        return ""
    return (f"{len(under)} of the {len(the_plan.choices)} predicted losses (down to "
            f"{min(c.predicted_loss for c in under):.4f}) are below the data's entropy floor, {floor:.4f} nats/token, "
            "which no model can beat: it is the exact entropy of the process that generated the corpus. The law "
            f"gets there because its irreducible loss E = {_law(fit)['E']:.4f} sits under the floor, and this budget "
            "reaches past the runs it was fitted on: it extrapolates. Expect a loss near the floor, not under it. "
            "Which size is best depends on A, B, α and β, not on E: the ranking of the choices still holds.")
