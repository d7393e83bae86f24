"""labkit.parallel.parallelize: what a split model needs is said before any worker starts, and the
gradient norm of a split model counts every parameter once."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import tiny_config
from labkit.config import ConfigError, load_config, resolve_auto
from labkit.fault.recovery import model_part_key
from labkit.model.gpt import GPT, GPTShape
from labkit.parallel.layout_checks import layout_problems
from labkit.parallel.parallelize import norm_shares, second_copies
from labkit.parallel.pp.pipeline import GPTStage
from labkit.parallel.tp.model import parallelize_gpt
from labkit.validation import validate


def problems(nproc: int, **overrides) -> str:
    with pytest.raises(ConfigError) as err:
        validate(tiny_config(**overrides), nproc=nproc)
    return str(err.value)


def test_a_layout_the_model_cannot_take_is_refused_with_the_fix():
    assert "model.n_head=2 is not divisible by it" in problems(
        4, **{"parallel.tp.degree": 4, "data.micro_batch_size": 8})
    assert "vocabulary (16 tokens) is not divisible" in problems(
        3, **{"parallel.tp.degree": 3, "model.n_head": 3, "model.n_embd": 24, "data.micro_batch_size": 8})
    assert "model.vocab_size to a multiple of 3" in problems(
        3, **{"parallel.tp.degree": 3, "model.n_head": 3, "model.n_embd": 24, "data.micro_batch_size": 8})
    assert "block_size=31 is not divisible" in problems(
        2, **{"parallel.tp.degree": 2, "parallel.tp.sequence_parallel": True, "model.block_size": 31,
              "data.micro_batch_size": 8})
    assert "sequence_parallel needs parallel.tp.degree > 1" in problems(1, **{"parallel.tp.sequence_parallel": True})
    assert "holds one stage per rank" in problems(
        2, **{"parallel.pp.degree": 2, "parallel.pp.schedule": "interleaved_1f1b", "model.n_layer": 4,
              "parallel.pp.impl": "torch", "parallel.dp.strategy": "ddp_naive", "data.micro_batch_size": 4})
    assert "model.n_layer=1 cannot be cut into 2 stages" in problems(
        2, **{"parallel.pp.degree": 2, "parallel.dp.strategy": "ddp_naive", "data.micro_batch_size": 8})


def test_strategies_that_do_not_combine_with_a_split_say_why_and_who_does():
    msg = problems(2, **{"parallel.pp.degree": 2, "model.n_layer": 2, "data.micro_batch_size": 8})  # torch_ddp
    assert "parallel.dp.strategy=torch_ddp does not combine with parallel.pp.impl=labkit" in msg
    assert "use parallel.dp.strategy=ddp_naive or ddp_bucketed or zero1 or zero2 or fsdp2" in msg
    msg = problems(2, **{"parallel.tp.degree": 2, "parallel.tp.impl": "dtensor", "data.micro_batch_size": 8})
    assert "c10d.broadcast_.default" in msg and "use parallel.dp.strategy=fsdp2" in msg
    split = {"parallel.tp.degree": 2, "data.micro_batch_size": 8}
    assert "comm.sync=local_sgd" in problems(2, **split, **{"comm.sync": "local_sgd"})
    assert "precision.mode=fp16 is not available with a split model" in problems(
        2, **split, **{"precision.mode": "fp16"})
    assert "run.compile=on is not verified on a split model" in problems(2, **split, **{"run.compile": "on"})
    both = {"parallel.tp.degree": 2, "parallel.pp.degree": 2, "model.n_layer": 2, "parallel.dp.strategy": "fsdp2"}
    assert "a pipeline's messages are whole-sequence" in problems(4, **both, **{"parallel.tp.sequence_parallel": True})
    assert "use parallel.tp.impl=labkit" in problems(4, **both, **{"parallel.tp.impl": "dtensor"})


CP = {"parallel.cp.degree": 2, "model.n_head": 4, "model.block_size": 16, "data.micro_batch_size": 8}


def test_a_context_parallel_layout_the_model_or_the_run_cannot_take_is_refused_with_the_fix():
    assert "cuts each sequence into 4 equal chunks, and model.block_size=18 does not divide" in problems(
        2, **{**CP, "model.block_size": 18})
    assert "4 heads do not divide by 3" in problems(
        3, **{**CP, "parallel.cp.degree": 3, "parallel.cp.impl": "ulysses", "model.block_size": 24})
    assert "(the 2 heads each tp rank holds)" in problems(
        8, **{**CP, "parallel.cp.degree": 4, "parallel.tp.degree": 2, "parallel.cp.impl": "ulysses",
              "model.block_size": 32})
    assert "needs CUDA with the flash or efficient SDPA backend" in problems(2, **{**CP, "parallel.cp.impl": "native"})
    assert "both split the sequence" in problems(
        4, **{**CP, "parallel.tp.degree": 2, "parallel.tp.sequence_parallel": True})
    assert "leave attention.backend at sdpa" in problems(2, **{**CP, "attention.backend": "naive"})
    assert "use precision.mode=fp32" in problems(2, **{**CP, "precision.mode": "bf16"})
    validate(tiny_config(**{**CP, "model.dropout": 0.1}), nproc=2)  # taken: each cp rank's own masks (parallel.rng)
    assert "comm.sync=local_sgd: replicas that drift apart" in problems(2, **{**CP, "comm.sync": "local_sgd"})
    assert "parallel degrees dp×tp×pp×cp = 1×1×1×2 = 2 do not match the world size 3" in problems(
        3, **{**CP, "parallel.dp.degree": 1})
    assert "parallel.cp.degree: must be >= 1, got 0" in problems(1, **{**CP, "parallel.cp.degree": 0})


def test_context_parallel_layouts_that_fit_are_accepted():
    for impl in ("ring", "allgather", "ulysses"):
        validate(tiny_config(**{**CP, "parallel.cp.impl": impl}), nproc=2)
    validate(tiny_config(**{**CP, "parallel.cp.layout": "contiguous", "model.block_size": 18}), nproc=2)  # 2 × 9
    validate(tiny_config(**{**CP, "data.micro_batch_size": 4}), nproc=4)  # dp 2 × cp 2
    validate(tiny_config(**{**CP, "parallel.pp.degree": 2, "model.n_layer": 2, "parallel.dp.strategy": "ddp_naive"}),
             nproc=4)  # pp 2 × cp 2
    validate(tiny_config(**{**CP, "parallel.tp.degree": 2, "parallel.dp.strategy": "zero2",
                            "data.micro_batch_size": 4}), nproc=8)  # dp 2 × cp 2 × tp 2


def test_torch_1f1b_with_fewer_micro_batches_than_stages_is_refused_before_any_worker():
    torch_1f1b = {"parallel.pp.degree": 2, "parallel.pp.impl": "torch", "parallel.pp.schedule": "1f1b",
                  "model.n_layer": 2, "parallel.dp.strategy": "ddp_naive", "data.batch_size": 8,
                  "data.micro_batch_size": 8}  # m = 8 / (1 × 8) = 1 micro-batch for 2 stages
    msg = problems(2, **torch_1f1b)
    assert "parallel.pp.impl=torch with parallel.pp.schedule=1f1b needs at least as many micro-batches" in msg
    assert "= 1 micro-batch(es) < parallel.pp.degree=2" in msg and "set data.batch_size=16 or more" in msg
    for fine in ({"data.batch_size": 16}, {"parallel.pp.schedule": "gpipe"}, {"parallel.pp.impl": "labkit"}):
        validate(tiny_config(**{**torch_1f1b, **fine}), nproc=2)  # m = p, or a schedule that runs m < p


QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


@pytest.fixture
def no_probe(monkeypatch):
    """resolve_auto without timing this CPU's bf16 (the quickstart's precision and attention are not auto)."""
    import labkit.hardware

    advice = {"precision": ("fp32", "not auto"), "attention": ("sdpa", "not auto")}
    monkeypatch.setattr(labkit.hardware, "recommend", lambda: advice)


def quickstart_choice(*overrides: str) -> tuple[str, str]:
    """The strategy a worker of the shipped quickstart trains with (resolve_auto, as the trainer calls it) and the
    reason its start event records (``auto``)."""
    cfg, auto = resolve_auto(load_config(QUICKSTART, list(overrides)))
    return cfg.parallel.dp.strategy, auto.get("parallel.dp.strategy", "")


def refusals(cfg, nproc: int) -> list[str]:
    try:
        validate(cfg, nproc=nproc)
    except ConfigError as error:
        return error.problems
    return []


def test_auto_takes_torch_ddp_for_plain_data_parallelism(no_probe):
    strategy, why = quickstart_choice()
    assert strategy == "torch_ddp"
    assert why == ("auto → torch_ddp: the first strategy in labkit.parallel.STRATEGIES (no model-parallel axis to "
                   "combine with)")


@pytest.mark.parametrize("impl", ["labkit", "torch"])
def test_auto_with_a_pipeline_takes_the_first_strategy_that_runs_beside_it(no_probe, impl):
    strategy, why = quickstart_choice("parallel.pp.degree=2", f"parallel.pp.impl={impl}")
    assert strategy == "ddp_naive"
    assert why.startswith(f"auto → ddp_naive: the first strategy in labkit.parallel.STRATEGIES that runs beside pp=2 "
                          f"(parallel.pp.impl={impl}); torch_ddp does not run beside parallel.pp.impl={impl}: torch's "
                          "DDP decides in each forward whether the next backward communicates")
    assert refusals(load_config(QUICKSTART, ["parallel.pp.degree=2", f"parallel.pp.impl={impl}"]), 2) == []


def test_auto_with_tensor_parallelism_follows_its_implementation(no_probe):
    strategy, why = quickstart_choice("parallel.tp.degree=2")
    assert strategy == "torch_ddp" and "runs beside tp=2 (parallel.tp.impl=labkit)" in why
    strategy, why = quickstart_choice("parallel.tp.degree=2", "parallel.tp.impl=dtensor")
    assert strategy == "fsdp2" and "torch_ddp does not run beside parallel.tp.impl=dtensor: torch's DDP has no " \
                                   "sharding rule for DTensor parameters" in why
    assert refusals(load_config(QUICKSTART, ["parallel.tp.degree=2", "parallel.tp.impl=dtensor"]), 2) == []


def test_auto_with_a_compressor_takes_a_strategy_that_compresses(no_probe):
    strategy, why = quickstart_choice("parallel.pp.degree=2", "comm.compression=topk")
    assert strategy == "ddp_bucketed" and "compresses its buckets (comm.compression=topk)" in why
    assert refusals(load_config(QUICKSTART, ["parallel.pp.degree=2", "comm.compression=topk"]), 2) == []


def test_an_explicit_strategy_that_does_not_combine_is_refused_with_the_reason_that_applies():
    pipeline = refusals(load_config(QUICKSTART, ["parallel.pp.degree=2", "parallel.dp.strategy=torch_ddp"]), 2)
    (line,) = [p for p in pipeline if p.startswith("parallel.dp.strategy=torch_ddp")]
    assert line.startswith("parallel.dp.strategy=torch_ddp does not combine with parallel.pp.impl=labkit: torch's "
                           "DDP decides in each forward whether the next backward communicates")
    assert "DTensor" not in line and line.endswith("use parallel.dp.strategy=ddp_naive or ddp_bucketed or zero1 or "
                                                   "zero2 or fsdp2 (or auto)")
    split = refusals(load_config(QUICKSTART, ["parallel.tp.degree=2", "parallel.tp.impl=dtensor",
                                              "parallel.dp.strategy=torch_ddp"]), 2)
    (line,) = [p for p in split if p.startswith("parallel.dp.strategy=torch_ddp")]
    assert "no sharding rule for DTensor parameters" in line and "pipeline" not in line


def test_layouts_that_fit_are_accepted():
    validate(tiny_config(**{"parallel.tp.degree": 2, "data.micro_batch_size": 8}), nproc=2)
    validate(tiny_config(**{"parallel.tp.degree": 2, "parallel.pp.degree": 2, "model.n_layer": 2,
                            "parallel.dp.strategy": "zero2", "data.micro_batch_size": 4}), nproc=8)
    assert layout_problems(tiny_config(), 1) == []


def grid(dp=1, pp=1, tp=1, coords=None, cp=1, ep=1):
    sizes = {"dp": dp, "pp": pp, "tp": tp, "cp": cp, "ep": ep, "dp_cp": dp * cp, "expert_dp_cp": dp * cp // ep}
    coords = coords or {}
    return SimpleNamespace(size=lambda axis: sizes[axis], coord=lambda axis: coords.get(axis, 0))


def test_norm_shares_count_slices_fully_and_copies_once(group_of_one):
    """At tp = 2, a slice (column and row weights, the vocabulary rows) adds its whole square from each tp
    rank, a replicated parameter (layer norms, position embedding, a row layer's bias) half from each; a
    replica of dp = 2 halves everything unless the strategy shards it; the last stage's tied copy adds 0."""
    shape = GPTShape(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8, bias=True)
    model = parallelize_gpt(GPT(shape))  # slices of a group of one: the layer types are what counts
    shares = {name: share for name, p in model.named_parameters()
              for q, share in norm_shares(model, grid(dp=2, tp=2)) if q is p}
    assert shares["wte.weight"] == shares["blocks.0.attn.qkv.weight"] == shares["blocks.1.mlp.proj.weight"] == 0.5
    assert shares["wpe.weight"] == shares["blocks.0.ln_1.weight"] == shares["blocks.0.mlp.proj.bias"] == 0.25
    sharded = {q: s for q, s in norm_shares(model, grid(dp=2, tp=2), dp_sharded=True)}
    assert sorted(set(sharded.values())) == [0.5, 1.0]
    # context parallelism's ranks hold the same parameters, as replicas do: cp = 2 halves like dp = 2
    assert {id(q): s for q, s in norm_shares(model, grid(tp=2, cp=2))} == \
        {id(q): s for q, s in norm_shares(model, grid(dp=2, tp=2))}
    last = GPTStage.from_gpt(GPT(shape), 1, 2)
    assert second_copies(last) == {id(last.lm_head.weight)}
    assert dict((id(q), s) for q, s in norm_shares(last, grid(pp=2)))[id(last.lm_head.weight)] == 0.0
    assert second_copies(GPTStage.from_gpt(GPT(shape), 0, 2)) == set()


def test_each_part_of_a_split_model_is_checkpointed_under_its_own_key():
    cfg = tiny_config(**{"parallel.tp.degree": 2})
    assert model_part_key(cfg, grid(dp=2)) is None
    assert model_part_key(cfg, grid(tp=2, coords={"tp": 1})) == "tp1"
    assert model_part_key(cfg, grid(pp=2, tp=2, coords={"pp": 1})) == "pp1_tp0"
    dtensor = tiny_config(**{"parallel.tp.degree": 2, "parallel.tp.impl": "dtensor"})
    assert model_part_key(dtensor, grid(tp=2, coords={"tp": 1})) is None  # DTensor's slices know their place
    assert model_part_key(cfg, grid(dp=4, ep=2, coords={"ep": 1})) == "ep1"  # each ep rank's experts are its own
    torch.manual_seed(0)


def test_hsdp_shard_groups_are_checked_before_any_worker():
    assert "use parallel.dp.strategy=fsdp2, or parallel.dp.shard_degree=0" in problems(
        4, **{"parallel.dp.strategy": "zero2", "parallel.dp.shard_degree": 2})
    assert "must divide the 4 ranks that hold the same parameters (dp × cp) into shard groups; use one of [1, 2, 4]" \
        in problems(4, **{"parallel.dp.strategy": "fsdp2", "parallel.dp.shard_degree": 3})
    assert "must be >= 0" in problems(2, **{"parallel.dp.strategy": "fsdp2", "parallel.dp.shard_degree": -1})
    validate(tiny_config(**{"parallel.dp.strategy": "fsdp2", "parallel.dp.shard_degree": 2, "data.batch_size": 16}),
             nproc=4)
