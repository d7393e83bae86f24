"""Leave one paper out: the two efficiencies fitted on two of the three papers, the third predicted — out of sample.

The in-sample table (:func:`labkit.sim.validate.validation_table` with the shipped constants) uses
MATMUL_EFFICIENCY and NETWORK_EFFICIENCY fitted on all three papers' points at once: its errors say how well the
model *can be made to fit* them, not how well it predicts a run it has not seen. Here each paper in turn is held
out (:data:`FOLDS`, the split written before anything is computed): the same fit
(:func:`labkit.sim.validate.fit_constants`, the same grid and objective) on the other two papers' points, then the
held-out paper's points predicted with those two constants and the measured overlap cost.

Held out strictly: when the V100 paper (Shoeybi et al. 2019) is held out, the V100's rate derived from its
baseline is held out with it, and the V100 runs at the fold's fitted matmul efficiency; :attr:`Fold.own_v100_rows`
gives the same paper predicted with the derived rate (one number from the held-out paper), to compare.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from labkit.sim.validate import FITTED, HELD_OUT, PAPERS, V100_PAPER, Row, fit_constants, validation_table

# (the paper held out, the papers the efficiencies are fitted on), one fold per paper
FOLDS = tuple((held, tuple(p for p in PAPERS if p != held)) for held in PAPERS)


@dataclass(frozen=True)
class Fold:
    """One paper predicted out of sample: the constants fitted on the others, and its rows."""
    held_out: str
    fitted_on: tuple[str, ...]
    eff: float
    net: float
    v100: Optional[float]  # the V100's rate in the prediction; None: the derived one (its paper is fitted on)
    rows: tuple[Row, ...]  # the held-out paper's points, each HELD_OUT (or DERIVED from held-out points)
    own_v100_rows: tuple[Row, ...] = ()  # the V100 paper held out, predicted with its own derived rate instead


def held_out(rows: list[Row]) -> tuple[Row, ...]:
    """``rows`` relabelled: a fitted-on point becomes held out (a derived one stays derived)."""
    return tuple(dataclasses.replace(r, role=HELD_OUT) if r.role == FITTED else r for r in rows)


def predict_fold(held: str, fitted_on: tuple[str, ...], slow: Optional[float] = None) -> Fold:
    """Fit the two efficiencies on ``fitted_on``, predict ``held`` with them (the V100 strictly, see the module)."""
    eff, net = fit_constants(slow, fitted_on)
    v100 = eff if held == V100_PAPER else None
    rows = held_out(validation_table(eff, net, slow, (held,), v100))
    own = held_out(validation_table(eff, net, slow, (held,))) if v100 is not None else ()
    return Fold(held, fitted_on, eff, net, v100, rows, own)


def leave_one_paper_out(slow: Optional[float] = None) -> list[Fold]:
    """Every fold of :data:`FOLDS`, in order."""
    return [predict_fold(held, fitted_on, slow) for held, fitted_on in FOLDS]
