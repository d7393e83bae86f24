"""A strategy declares only what it refuses (``refuses`` in labkit.parallel.spec), and those declarations alone
decide what combines: layout_problems refuses exactly the declared (axis, implementation) pairs with the declared
reason and names the strategies that take them, auto skips a strategy that refuses the layout, a sync strategy's
refusals drive comm.sync's line, and a strategy's ``reduces_over`` is the group it is built on."""
from __future__ import annotations

import pytest

from labkit.config import load_config
from labkit.parallel.dp.base import Strategy
from labkit.parallel.dp.local_sgd import LocalSGD
from labkit.parallel.layout_checks import auto_strategy, layout_problems, split_axes, takers, uncombined
from labkit.parallel.mesh import DEGREES, GRADIENT_AXIS
from labkit.parallel.spec import IMPLS, STRATEGIES, SYNC_STRATEGIES, StrategyFacts, refusing

REASON = "the toy's hooks are not written for torch's pipeline"
MODEL = {"model.n_head": 4, "model.n_layer": 4, "model.block_size": 64, "model.vocab_size": 256,
         "data.batch_size": 64, "data.micro_batch_size": 4, "run.compile": "off", "precision.mode": "fp32"}


def config(**overrides):
    return load_config(None, {**MODEL, **overrides})


def pipeline(impl: str, strategy: str = "auto", **extra):
    return config(**{"parallel.pp.degree": 2, "parallel.pp.impl": impl, "parallel.dp.strategy": strategy, **extra})


@pytest.fixture
def toy():
    """A strategy first in the registry's order that refuses torch's pipeline, and nothing else."""
    @STRATEGIES.register
    class Toy(Strategy):
        name, order = "toy_refuser", 1
        refuses = refusing("pp", REASON, ("torch",))

    yield Toy
    STRATEGIES.unregister("toy_refuser")


def test_a_declared_refusal_is_said_with_its_reason_and_the_strategies_that_take_the_pair(toy):
    (line,) = [p for p in layout_problems(pipeline("torch", "toy_refuser"), 2) if "does not combine" in p]
    assert line.startswith(f"parallel.dp.strategy=toy_refuser does not combine with parallel.pp.impl=torch: {REASON}; ")
    assert line.endswith("use parallel.dp.strategy=ddp_naive or zero1 or zero2 or fsdp2 (or auto)")
    assert takers("pp", "torch") == ["ddp_naive", "zero1", "zero2", "fsdp2"]  # no toy, no torch_ddp, zero3, bucketed
    # the pair it does not declare, it runs beside: no line at all
    assert not [p for p in layout_problems(pipeline("labkit", "toy_refuser"), 2) if "does not combine" in p]
    assert "toy_refuser" in takers("pp", "labkit")


def test_auto_skips_a_strategy_that_refuses_the_layout_and_says_why(toy):
    assert auto_strategy(pipeline("labkit"))[0] == "toy_refuser"  # first in order, and it refuses nothing here
    name, why = auto_strategy(pipeline("torch"))
    assert name == "ddp_naive"  # toy (1) refuses, torch_ddp (10) refuses either pipeline: the next one
    assert why.endswith(f"; toy_refuser does not run beside parallel.pp.impl=torch: {REASON}")


def test_taking_a_refusal_back_makes_the_pair_combine(monkeypatch):
    torch_ddp = STRATEGIES.get("torch_ddp")
    assert uncombined(torch_ddp, pipeline("labkit")) == [("pp", "labkit")]
    assert auto_strategy(pipeline("labkit"))[0] == "ddp_naive"
    monkeypatch.setattr(torch_ddp, "refuses", {k: v for k, v in torch_ddp.refuses.items() if k[0] != "pp"})
    assert uncombined(torch_ddp, pipeline("labkit")) == []
    assert auto_strategy(pipeline("labkit"))[0] == "torch_ddp"
    assert not [p for p in layout_problems(pipeline("labkit", "torch_ddp"), 2) if "does not combine" in p]


def test_the_default_refuses_nothing():
    assert StrategyFacts.refuses == {} and Strategy.refuses == {}
    every = config(**{"parallel.tp.degree": 2, "parallel.pp.degree": 2, "parallel.cp.degree": 2,
                      "parallel.ep.degree": 2})
    assert [axis for axis, _, _ in split_axes(every)] == ["tp", "pp", "cp", "ep"]  # every such axis is asked
    for axis, impls in IMPLS.items():
        for impl in impls:
            cfg = config(**{f"parallel.{axis}.degree": 2, f"parallel.{axis}.impl": impl})
            assert uncombined(StrategyFacts, cfg) == []
            # fsdp2 declares only the experts held apart (it shards every parameter over the whole gradient axis)
            assert uncombined(STRATEGIES.get("fsdp2"), cfg) == ([("ep", "labkit")] if axis == "ep" else [])


def test_every_declared_refusal_names_a_model_parallel_axis_an_implementation_and_a_reason():
    assert set(IMPLS) == set(DEGREES) - {"dp"} | {"ep"}  # ep splits the experts over dp ranks
    for strategy in [*STRATEGIES.values(), *SYNC_STRATEGIES.values()]:
        for (axis, impl), reason in strategy.refuses.items():
            assert axis in IMPLS and impl in IMPLS[axis], (strategy.name, axis, impl)
            assert isinstance(reason, str) and len(reason) > 20, (strategy.name, axis, impl)
    with pytest.raises(ValueError, match="unknown model-parallel axis 'dp'"):
        refusing("dp", "no")
    with pytest.raises(ValueError, match=r"unknown parallel.tp.impl megatron; choices: labkit, dtensor"):
        refusing("tp", "no", ("megatron",))
    assert refusing("cp", "why") == {("cp", impl): "why" for impl in IMPLS["cp"]}


def test_a_sync_strategys_refusals_drive_comm_syncs_line(monkeypatch):
    cp = config(**{"parallel.cp.degree": 2, "comm.sync": "local_sgd"})
    assert [p for p in layout_problems(cp, 2) if p.startswith("comm.sync=local_sgd: replicas that drift apart")]
    monkeypatch.setattr(LocalSGD, "refuses", refusing("tp", "only tp is refused here"))
    assert not [p for p in layout_problems(cp, 2) if p.startswith("comm.sync=")]
    tp = config(**{"parallel.tp.degree": 2, "comm.sync": "local_sgd"})
    assert ("comm.sync=local_sgd: only tp is refused here; with a split model (tp=2) use comm.sync=every_step"
            in layout_problems(tp, 2))


class _Grid:
    """A grid that answers every axis with two ranks and records which axis a strategy asked for."""

    def __init__(self):
        self.asked = []

    def group(self, axis):
        self.asked.append(axis)
        return f"group:{axis}"

    def axis_group(self, axis):
        from labkit.comm.axes import AxisGroup

        return AxisGroup(axis, self.group(axis))

    def size(self, axis):
        return 2

    def first_rank(self, axis):
        return 0


class _Env:
    def __init__(self):
        self.grid = _Grid()


def test_a_strategy_is_built_on_the_axis_it_reduces_over():
    assert Strategy.reduces_over == GRADIENT_AXIS
    env = _Env()
    strategy = Strategy(config(), env)
    assert (strategy.group.axis, strategy.process_group) == (GRADIENT_AXIS, f"group:{GRADIENT_AXIS}")

    class OverDp(Strategy):
        reduces_over = "dp"

    env = _Env()
    over_dp = OverDp(config(), env)
    assert (over_dp.group.axis, over_dp.process_group) == ("dp", "group:dp") and env.grid.asked == ["dp"]
