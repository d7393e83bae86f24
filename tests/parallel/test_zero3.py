"""labkit's ZeRO-3 (labkit.parallel.dp.zero3), taken apart in one process: when each unit is gathered, prefetched and
freed, and that the step it takes is the plain model's. (Real process groups, and FSDP2 beside it:
tests/parallel/test_data_parallel.py.)"""
import copy

import pytest
import torch

from helpers import tiny_config
from labkit.config import ConfigError
from labkit.distributed import DistEnv
from labkit.model.gpt import GPT, GPTShape
from labkit.optim import build_optimizer, set_lr
from labkit.parallel.dp.zero3 import Zero3
from labkit.validation import validate

SHAPE = GPTShape(vocab_size=16, block_size=8, n_layer=3, n_head=2, n_embd=16)


def states(strategy: Zero3) -> list[str]:
    """Each unit (blocks in order, then the root): gathered, arriving (its all-gather launched), or freed."""
    def state(unit) -> str:
        if unit.gathered:
            assert all(full.untyped_storage().nbytes() == full.numel() * 4 for full in unit.full)
            return "gathered"
        if unit.works:
            return "arriving"
        assert all(full.untyped_storage().nbytes() == 0 for full in unit.full)  # freed: no bytes behind the views
        return "freed"

    return [state(unit) for unit in strategy.units]


@pytest.fixture
def sharded(group_of_one):
    torch.manual_seed(0)
    model = GPT(SHAPE)
    plain = copy.deepcopy(model)
    strategy = Zero3(tiny_config(**{"parallel.dp.strategy": "zero3"}), DistEnv(0, 1, 0, 1, "cpu", "gloo", 1))
    strategy.wrap(model)
    yield strategy, model, plain
    strategy.close()


def test_each_block_is_gathered_just_before_it_runs_forward_and_backward_and_freed_after(sharded):
    strategy, model, _ = sharded
    seen = []
    for i, block in enumerate(model.blocks):  # registered after the strategy's hooks: they see what those did
        block.register_forward_pre_hook(lambda _m, _a, i=i: seen.append(("forward", i, states(strategy))))
        block.register_full_backward_pre_hook(lambda _m, _g, i=i: seen.append(("backward", i, states(strategy))))
    assert states(strategy) == ["freed"] * 4  # between steps a rank holds its slices only
    x = torch.randint(0, 16, (2, 8))
    _, loss = model(x, x)
    assert states(strategy) == ["freed", "freed", "freed", "gathered"]  # the root waits for its backward
    loss.register_hook(lambda _g: seen.append(("backward starts", None, states(strategy))))  # after the strategy's
    loss.backward()
    assert states(strategy) == ["freed"] * 4
    G, A, F = "gathered", "arriving", "freed"
    assert seen == [("forward", 0, [G, A, F, G]), ("forward", 1, [F, G, A, G]), ("forward", 2, [F, F, G, G]),
                    ("backward starts", None, [F, F, A, G]),  # the head's backward first: the last block arrives
                    ("backward", 2, [F, A, G, G]), ("backward", 1, [A, G, F, G]), ("backward", 0, [G, F, F, G])]


def test_the_step_on_the_slices_is_the_plain_models(sharded):
    """Two steps of AdamW with clipping: the gradients reduce-scattered into the slices are the plain model's, and
    after each step the weights the next forward gathers are the plain model's (to float32 rounding)."""
    strategy, model, plain = sharded
    optimizer = strategy.build_optimizer(model, strategy.cfg.optim)
    reference = build_optimizer(plain, strategy.cfg.optim)  # what a single process steps: same groups, same options
    for opt in (optimizer, reference):
        set_lr(opt, 0.01)
    for _ in range(2):
        x = torch.randint(0, 16, (2, 8))
        _, loss = model(x, x)
        loss.backward()
        strategy.sync_gradients(model)
        norm = strategy.clip_grad_norm(model, optimizer, 0.5)
        _, want = plain(x, x)
        want.backward()
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
        assert norm == pytest.approx(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)), rel=1e-5)
        optimizer.step()
        reference.step()
        optimizer.zero_grad()
        reference.zero_grad()
    got = strategy.full_state_dict(model, everywhere=True)
    assert states(strategy) == ["freed"] * 4
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(got[key], value, msg=key)
    held = strategy.memory_breakdown(model, optimizer)
    psi = sum(p.numel() for p in plain.parameters())
    assert (held["param_bytes"], held["optimizer_bytes"]) == (4 * psi, 8 * psi)  # one rank: every slice is whole


def test_evaluation_gathers_outside_the_step_and_frees_everything(sharded):
    """Between steps no timer counts the gradient axis: an evaluation's gathers are no step's bytes. The same forward
    under a step's counting sends its 8 gathers (4 units, 2 shards each) on the strategy's axis."""
    from labkit.comm.axes import counting
    from labkit.metrics.timers import CommTimer

    strategy, model, _ = sharded
    strategy.comm_timer.collect()
    with torch.no_grad():
        model(torch.randint(0, 16, (2, 8)))
    assert states(strategy) == ["freed"] * 4
    assert strategy.comm_timer.calls == 0  # not a step's
    probe = CommTimer()
    with torch.no_grad(), counting({strategy.reduces_over: probe}):
        model(torch.randint(0, 16, (2, 8)))
    assert probe.calls == 8 and strategy.comm_timer.calls == 0 and states(strategy) == ["freed"] * 4


def test_zero3_refuses_what_it_does_not_run_before_any_worker_starts():
    with pytest.raises(ConfigError, match="does not combine with parallel.tp.impl=labkit"):
        validate(tiny_config(**{"parallel.dp.strategy": "zero3", "parallel.tp.degree": 2}), nproc=2, check_data=False)
    with pytest.raises(ConfigError, match="run.compile=on with parallel.dp.strategy=zero3"):
        validate(tiny_config(**{"parallel.dp.strategy": "zero3", "run.compile": "on"}), nproc=2, check_data=False)
    with pytest.raises(ConfigError, match="optim.name=adafactor keeps per-matrix statistics"):
        validate(tiny_config(**{"parallel.dp.strategy": "zero3", "optim.name": "adafactor"}), nproc=2,
                 check_data=False)
