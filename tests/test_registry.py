"""labkit.registry: one declaration per strategy or compressor, read by everything that lists or checks them.

The toy entries below are registered the way a new module would register them, and nothing else is
edited: config loading, validation, the option lists, the memory and wire tables and the tuning
flowchart all pick them up, and forget them once unregistered.
"""
from __future__ import annotations

import sys
import typing

import pytest

from helpers import tiny_config
from labkit.comm.compress import COMPRESSORS, Compressor, build_compressor
from labkit.config import CommConfig, ConfigError, DataParallelConfig, compressor_names, load_config, strategy_names, \
    sync_names
from labkit.parallel import STRATEGIES, SYNC_STRATEGIES, build_strategy
from labkit.validation import validate
from labkit.parallel.dp.base import Strategy
from labkit.parallel.dp.local_sgd import LocalSGD
from labkit.parallel.reports.data_parallel import analytic_wire_bytes, predict_rank_memory
from labkit.registry import Registry, import_submodules


# ---------------------------------------------------------------- the generic registry

class Entry:
    def __init__(self, name, order=None, found=()):
        self.name, self.found = name, list(found)
        if order is not None:
            self.order = order

    def problems(self, cfg, world):
        return self.found


def test_registry_orders_by_declared_order_then_registration():
    reg = Registry("comm.compression", what="gadget")
    for entry in (Entry("c"), Entry("b", order=2), Entry("a", order=1), Entry("d")):
        assert reg.register(entry) is entry
    assert reg.names() == ("a", "b", "c", "d") and list(reg) == ["a", "b", "c", "d"] and len(reg) == 4
    assert reg["b"].name == "b" and reg.get("a").name == "a" and "c" in reg
    reg.unregister("c")
    assert reg.names() == ("a", "b", "d")


def test_registry_refuses_a_second_entry_of_the_same_name_and_a_nameless_one():
    reg = Registry("k", what="gadget")
    reg.register(Entry("a"))
    with pytest.raises(ValueError, match="gadget: 'a' is already registered"):
        reg.register(Entry("a"))
    with pytest.raises(ValueError, match="gadget: an entry needs a non-empty string 'name'"):
        reg.register(Entry(""))


def test_registry_get_lists_the_choices_and_the_nearest():
    reg = Registry("k", what="gadget", choices="available")
    reg.register(Entry("topk"))
    reg.register(Entry("sign"))
    with pytest.raises(ValueError, match=r"^unknown gadget 'topx'; available: topk, sign \(did you mean 'topk'\?\)$"):
        reg.get("topx")
    with pytest.raises(ValueError, match=r"^unknown gadget 'zzz'; available: topk, sign$"):
        reg.get("zzz")


def test_registry_collects_every_entrys_problems_once_each():
    reg = Registry("comm.compression", what="gadget")
    reg.register(Entry("a", found=["shared", "only a"]))
    reg.register(Entry("b", found=["shared"]))
    reg.register(type("NoChecks", (), {"name": "c"}))  # an entry need not check anything
    assert reg.problems(None, 1) == ["shared", "only a"]
    assert reg.chosen(tiny_config(**{"comm.compression": "sign"})) == "sign"


def test_import_submodules_registers_every_module_of_a_package(tmp_path, monkeypatch):
    """A new part is a new file: the package imports every public module, and each registers itself."""
    package = tmp_path / "toyparts"
    package.mkdir()
    (package / "__init__.py").write_text("from labkit.registry import Registry\nPARTS = Registry('k', what='part')\n")
    for name, order in (("first", 2), ("second", 1), ("_private", 0)):
        (package / f"{name}.py").write_text(
            f"from toyparts import PARTS\n\n\n@PARTS.register\nclass Part:\n    name, order = {name!r}, {order}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import toyparts

    try:
        import_submodules("toyparts", toyparts.__path__)
        assert toyparts.PARTS.names() == ("second", "first")  # _private is not imported
    finally:
        for module in [m for m in sys.modules if m == "toyparts" or m.startswith("toyparts.")]:
            del sys.modules[module]


# ---------------------------------------------------------------- the live registries

def test_the_config_choices_are_the_registries():
    assert strategy_names() == tuple(STRATEGIES) == ("torch_ddp", "ddp_naive", "ddp_bucketed", "zero1", "zero2",
                                                     "zero3", "fsdp2")
    assert compressor_names() == tuple(COMPRESSORS) == ("none", "fp16", "bf16", "powersgd", "topk", "sign", "randomk")
    assert sync_names() == ("every_step", *SYNC_STRATEGIES) == ("every_step", "local_sgd", "diloco")
    assert typing.get_args(typing.get_type_hints(DataParallelConfig)["strategy"]) == ("auto", *STRATEGIES)
    assert typing.get_args(typing.get_type_hints(CommConfig)["compression"]) == tuple(COMPRESSORS)


def test_each_strategy_declares_its_facts():
    stages = {name: s.zero_stage for name, s in STRATEGIES.items()}
    assert stages == {"torch_ddp": 0, "ddp_naive": 0, "ddp_bucketed": 0, "zero1": 1, "zero2": 2, "zero3": 3,
                      "fsdp2": 3}
    assert [name for name, s in STRATEGIES.items() if s.compresses] == ["torch_ddp", "ddp_bucketed"]
    assert {name: s.wire_factor(3) for name, s in STRATEGIES.items()} == {
        "torch_ddp": 2, "ddp_naive": 2, "ddp_bucketed": 2, "zero1": 2, "zero2": 2, "zero3": 7, "fsdp2": 7}
    assert all(issubclass(s, Strategy) and s.name == name for name, s in {**STRATEGIES, **SYNC_STRATEGIES}.items())
    assert all(issubclass(s, LocalSGD) for s in SYNC_STRATEGIES.values())


def test_each_compressor_declares_where_its_options_come_from():
    cfg = tiny_config(**{"comm.compression_ratio": 0.05, "comm.powersgd_rank": 3, "run.seed": 7})
    assert COMPRESSORS["topk"].options_from_config(cfg) == {"ratio": 0.05}
    assert COMPRESSORS["randomk"].options_from_config(cfg) == {"ratio": 0.05, "seed": 7}
    assert COMPRESSORS["powersgd"].options_from_config(cfg)["rank"] == 3
    assert all(COMPRESSORS[n].options_from_config(cfg) == {} for n in ("none", "fp16", "bf16", "sign"))
    for name, c in COMPRESSORS.items():  # every option read from the config is one the compressor accepts
        assert set(c.config_options) <= set(c.defaults), name
    assert {n: (c.collective, c.error_feedback) for n, c in COMPRESSORS.items()} == {
        "none": ("all-reduce", False), "fp16": ("all-reduce", False), "bf16": ("all-reduce", False),
        "powersgd": ("all-reduce ×2", True), "topk": ("all-gather", True), "sign": ("all-gather", True),
        "randomk": ("all-reduce", False)}


# ---------------------------------------------------------------- adding one: a single declaration

@pytest.fixture
def toy_compressor():
    @COMPRESSORS.register
    class Toy(Compressor):
        name, order = "toyzip", 55
        defaults = {"level": 1}
        config_options = {"level": "comm.powersgd_rank"}  # a real compressor would bring its own key
        advice = "toyzip: squeeze the gradients"

        @classmethod
        def problems(cls, cfg, world):
            return ["comm.compression=toyzip: needs an even world"] if cfg.comm.compression == cls.name \
                and world % 2 else []

    yield Toy
    COMPRESSORS.unregister("toyzip")


@pytest.fixture
def toy_strategy():
    @STRATEGIES.register
    class ToyDP(Strategy):
        name, order = "toy_dp", 35
        zero_stage, compresses = 2, True

        @classmethod
        def wire_factor(cls, accum: int = 1) -> float:
            return 4

        @classmethod
        def problems(cls, cfg, world):
            found = super().problems(cfg, world)
            if cfg.parallel.dp.strategy == cls.name and world > 4:
                found.append("parallel.dp.strategy=toy_dp: at most 4 ranks")
            return found

    yield ToyDP
    STRATEGIES.unregister("toy_dp")


def test_a_registered_compressor_is_accepted_everywhere(toy_compressor):
    from labkit.tuning.flowchart import _communication

    cfg = load_config(None, {"comm.compression": "toyzip", "comm.powersgd_rank": 3})  # the config accepts it
    assert cfg.comm.compression == "toyzip"
    # the widget's list, before randomk
    assert "toyzip" in compressor_names() and compressor_names().index("toyzip") == 6
    validate(cfg, nproc=2, check_data=False)  # its checks run, and pass
    with pytest.raises(ConfigError, match="comm.compression=toyzip: needs an even world"):
        validate(cfg, nproc=1, check_data=False)
    assert build_compressor("toyzip").options == {"level": 1}
    assert COMPRESSORS["toyzip"].options_from_config(cfg) == {"level": 3}
    candidates = _communication({})  # the tuning flowchart proposes it, with its own reason
    assert [c.overrides.get("comm.compression") for c in candidates][:4] == ["bf16", "powersgd", "topk", "toyzip"]
    assert any(c.reason.startswith("toyzip: squeeze the gradients") for c in candidates)


def test_an_unregistered_compressor_is_refused_again(toy_compressor):
    COMPRESSORS.unregister("toyzip")
    with pytest.raises(ConfigError, match="comm.compression: 'toyzip' is not one of"):
        load_config(None, {"comm.compression": "toyzip"})
    COMPRESSORS.register(toy_compressor)  # for the fixture's clean-up


def test_a_registered_strategy_is_accepted_everywhere(toy_strategy):
    cfg = load_config(None, {"parallel.dp.strategy": "toy_dp", "comm.compression": "topk"})
    assert "toy_dp" in strategy_names() and strategy_names().index("toy_dp") == 3
    validate(cfg, nproc=2, check_data=False)  # it takes a compressor: declared compresses=True
    with pytest.raises(ConfigError, match="parallel.dp.strategy=toy_dp: at most 4 ranks"):
        validate(cfg, nproc=5, check_data=False)
    # the other strategies' composition rule names it among those that take a compressor
    with pytest.raises(ConfigError, match="use parallel.dp.strategy=torch_ddp or ddp_bucketed or toy_dp, not zero2"):
        validate(cfg.replace(**{"parallel.dp.strategy": "zero2"}), nproc=2, check_data=False)
    assert predict_rank_memory(1000, 2, "toy_dp").gradients == 2000  # fp32 grads, stage 2: halved
    assert analytic_wire_bytes("toy_dp", 1000, 2) == 4 * 0.5 * 4000
    assert STRATEGIES.get("toy_dp") is toy_strategy and build_strategy.__module__ == "labkit.parallel"


def test_an_unknown_strategy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown parallel.dp.strategy 'zero4'; available: torch_ddp, .*fsdp2 "
                                         r"\(did you mean 'zero3'\?\)"):
        STRATEGIES.get("zero4")
    with pytest.raises(ConfigError, match=r"parallel.dp.strategy: 'fsdp3' is not one of .* \(did you mean 'fsdp2'\?\)"):
        load_config(None, {"parallel.dp.strategy": "fsdp3"})
