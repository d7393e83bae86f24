"""Dry runs of labkit's real training step on torch's fake process group, at 64 and 1,024 simulated ranks.

Every layout is checked the same way: each recorded-vs-analytic row of :func:`labkit.sim.dryrun_counts.compare` is
exact (dp bytes = the strategy's declared wire volume for this rank's parameters, padding included; tp bytes =
m × tp_wire_bytes; pp bytes = the activations a stage sends; the CommTimers agree with the recording; memory =
the exact prediction), and independently of that module, a few numbers are recomputed here from labkit's
report functions.

What does not dry-run (said by ``dry_run_problems`` before anything starts, and tested below):
``parallel.pp.impl=torch`` — torch.distributed.pipelining receives the previous stage's output shapes as a
pickled object (``recv_object_list``) and the fake group delivers nothing, so a non-first stage reads a
garbage size and fails to allocate; ``parallel.tp.impl=dtensor`` runs, but DTensor's collectives bypass
labkit's layer (torch's functional collectives), so its tp bytes are not recorded. labkit's own pipeline
(send/recv through ``collectives.isend``/``irecv``, which call ``dist.isend``/``irecv``) runs on every stage.
"""
from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch.distributed as dist

from labkit.config import ConfigError, load_config
from labkit.sim.dryrun import FAKE_LABEL, compare, dry_run, format_result
from labkit.sim.dryrun_counts import analytic, implementation_memory
from labkit.sim.dryrun_record import Call

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.yaml"


def config(**dotted):
    base = {"data.micro_batch_size": 1, "parallel.dp.strategy": "ddp_naive"}
    return load_config(CONFIG, {**base, **dotted})


def assert_all_equal(result, expect_rows):
    rows = compare(result)
    whats = " | ".join(r["what"] for r in rows)
    for prefix in expect_rows:
        assert any(r["what"].startswith(prefix) for r in rows), (prefix, whats)
    bad = [r for r in rows if not r["equal"]]
    assert not bad, bad
    assert not result["step_skipped"]  # the optimizer stepped: its state exists (none on an FSDP2 rank past every
    assert result["memory"]["optimizer"] > 0 or result["strategy"] == "fsdp2"  # small dim 0: 1,024 ranks, 256 rows)


def assert_model_terms(result, tp_left_out=Fraction(0), pp_share=Fraction(1)):
    """labkit.sim.step's own byte terms beside the recording (its report says so): dp equal for the DDPs and equal
    but for the padding for ZeRO-1/2; tp equal but for ``tp_left_out`` (what the model leaves out, by hand); pp
    recorded = ``pp_share`` × the model's (a middle stage: all of it)."""
    assert "recorded vs labkit.sim.step's own terms" in format_result(result)
    from labkit.sim.dryrun_counts import model_rows

    rows = {r["axis"]: r for r in model_rows(result)}
    p, psi, strategy = result["mesh"]["dp"], result["params"], result["strategy"]
    if p > 1 and strategy in ("ddp_naive", "ddp_bucketed", "torch_ddp") and result["mesh"]["tp"] == 1:
        assert rows["dp"]["recorded"] == rows["dp"]["model"] == Fraction(2 * (p - 1), p) * 4 * psi
    if p > 1 and strategy in ("zero1", "zero2") and result["mesh"]["tp"] == 1:
        padding = Fraction(2 * (p - 1), p) * 4 * (result["layout"]["padded"] - psi)
        assert rows["dp"]["recorded"] - rows["dp"]["model"] == padding
    if "tp" in rows:
        assert rows["tp"]["recorded"] - rows["tp"]["model"] == tp_left_out
    if "pp" in rows:
        assert rows["pp"]["recorded"] == pp_share * rows["pp"]["model"]


DP_ONLY = [(world, strategy) for world in (64, 1024) for strategy in ("ddp_naive", "zero1", "zero2", "zero3", "fsdp2")]
DP_ONLY += [(1024, "ddp_bucketed"), (1024, "torch_ddp")]


@pytest.mark.parametrize("world,strategy", DP_ONLY)
def test_data_parallel_bytes_and_memory_match_the_analytic_counts(world, strategy):
    result = dry_run(config(**{"parallel.dp.strategy": strategy, "data.batch_size": world}), world, rank=world - 1)
    assert result["mesh"] == {"dp": world, "pp": 1, "cp": 1, "tp": 1}
    assert_all_equal(result, ["dp wire bytes", "CommTimers", "param bytes", "grad bytes", "optimizer bytes"])
    assert_model_terms(result)
    assert {c.group_size for c in result["calls"] if c.axis == "dp"} == {world}
    if strategy.startswith("ddp") or strategy == "torch_ddp":  # no padding: report.py's own formula, unchanged
        from labkit.parallel.reports.layout import predicted_rank_memory_for_layout
        from labkit.parallel.reports.data_parallel import analytic_wire_bytes

        recorded = sum(c.wire_exact for c in result["calls"] if c.axis == "dp")
        assert recorded == Fraction(analytic_wire_bytes(strategy, result["params"], world))
        predicted = predicted_rank_memory_for_layout(result["shape"], result["mesh"], world - 1, strategy)
        assert result["memory"] == {"param": predicted.parameters, "grad": predicted.gradients,
                                    "optimizer": predicted.optimizer_state}


@pytest.mark.parametrize("world,overrides,rank", [
    (64, {}, 63), (1024, {}, 1000),  # 8 and 128 replica groups of 8 ranks
    (64, {"parallel.cp.degree": 2}, 37),  # a shard group of 4 replicas × their 2 cp ranks
    (64, {"parallel.pp.degree": 2}, 63)])  # the last stage: the tied embedding's rows within its shard group
def test_hsdp_bytes_and_memory_match_the_analytic_counts_over_its_shard_and_replica_groups(world, overrides, rank):
    """FSDP2 over (replica groups × a shard group of 8 ranks): the gathers and the reduce-scatter over the shard
    group, each unit's gradient shard all-reduced over the replica groups — to the byte, as FSDP2.wire_bytes says."""
    from labkit.parallel import STRATEGIES

    cp, pp = overrides.get("parallel.cp.degree", 1), overrides.get("parallel.pp.degree", 1)
    cfg = config(**{"parallel.dp.strategy": "fsdp2", "parallel.dp.shard_degree": 8,
                    "data.batch_size": world // (cp * pp) * (2 if pp > 1 else 1), **overrides})
    result = dry_run(cfg, world, rank=rank)
    assert result["mesh"]["dp_shard"] == 8 // cp
    assert_all_equal(result, ["dp wire bytes, fsdp2 (model-sized collectives, HSDP", "CommTimers", "param bytes"])
    sizes = {(c.axis, c.group_size) for c in result["calls"] if c.axis in ("dp_shard_cp", "dp_replicate")}
    assert sizes == {("dp_shard_cp", 8), ("dp_replicate", world // pp // 8)}
    if pp == 1 and cp == 1:  # no padding at this size: the live test's formula, to the byte
        units = result["layout"]["units"]
        root = sum(n for is_root, n in units if is_root)
        if result["layout"]["padded"] == result["params"]:
            want = STRATEGIES["fsdp2"].wire_bytes(result["params"], root, 8, world, result["micro_batches"])
            assert sum(c.wire_exact for c in result["calls"] if c.nbytes > 8) == want


@pytest.mark.parametrize("world,strategy", [(64, "ddp_naive"), (64, "zero2"), (1024, "ddp_naive"),
                                            (1024, "zero1"), (1024, "fsdp2")])
def test_dp_by_tp_bytes_match_tp_wire_bytes(world, strategy):
    cfg = config(**{"parallel.dp.strategy": strategy, "parallel.tp.degree": 8, "model.n_head": 8,
                    "data.batch_size": 2 * world // 8})  # two micro-batches per step
    result = dry_run(cfg, world, rank=3)
    assert result["mesh"] == {"dp": world // 8, "pp": 1, "cp": 1, "tp": 8} and result["micro_batches"] == 2
    assert_all_equal(result, ["dp wire bytes", "tp wire bytes", "CommTimers"])
    from labkit.parallel.tp.volume import tp_wire_bytes

    m = cfg.model
    tp_total = sum(c.wire for c in result["calls"] if c.axis == "tp")
    assert tp_total == 2 * tp_wire_bytes(1, m.block_size, m.n_embd, m.n_layer, 8)["total"]


def test_sequence_parallel_and_recompute_bytes_match():
    cfg = config(**{"parallel.dp.strategy": "zero2", "parallel.tp.degree": 4, "data.batch_size": 16,
                    "parallel.tp.sequence_parallel": True, "model.recompute": "full"})
    result = dry_run(cfg, 64, rank=5)
    assert_all_equal(result, ["dp wire bytes", "tp wire bytes"])
    assert {"all_gather", "reduce_scatter"} <= {c.kind for c in result["calls"] if c.axis == "tp"}


@pytest.mark.parametrize("world,tp,pp,stage", [(64, 4, 2, 0), (64, 4, 2, 1), (1024, 8, 4, 0), (1024, 8, 4, 1),
                                               (1024, 8, 4, 3)])
def test_dp_by_tp_by_pp_bytes_match(world, tp, pp, stage):
    from labkit.parallel.mesh import ParallelDims

    cfg = config(**{"parallel.tp.degree": tp, "parallel.pp.degree": pp, "model.n_head": 8, "model.n_layer": pp,
                    "data.batch_size": 4 * world // (tp * pp), "parallel.dp.strategy": "zero1"})
    dims = ParallelDims(dp=world // (tp * pp), pp=pp, tp=tp)
    rank = dims.rank_at(dp=dims.dp - 1, pp=stage, tp=1)
    result = dry_run(cfg, world, rank=rank)
    assert result["coordinate"] == {"dp": dims.dp - 1, "pp": stage, "cp": 0, "tp": 1}
    assert_all_equal(result, ["dp wire bytes", "tp wire bytes", "pp wire bytes", "tied embedding", "CommTimers"])
    # the step model's own tp and pp terms: a middle stage's blocks are all of its tp bytes and it sends both ways;
    # by hand, the first stage adds the embedding's all-reduce of an activation, the last the output layer's and the
    # loss's three of one fp32 number per token, each of 4 micro-batches; both send one way
    activation, tokens, m = 1 * cfg.model.block_size * cfg.model.n_embd * 4, 1 * cfg.model.block_size * 4, 4
    ring = Fraction(2 * (tp - 1), tp)  # an all-reduce's share of its bytes
    left_out = {0: m * ring * activation, pp - 1: m * ring * (activation + 3 * tokens)}.get(stage, Fraction(0))
    assert_model_terms(result, left_out, Fraction(1) if 0 < stage < pp - 1 else Fraction(1, 2))
    sends = [c for c in result["calls"] if c.kind == "send"]
    middle = 0 < stage < pp - 1
    assert len(sends) == 4 * (2 if middle else 1)  # 4 micro-batches: forward on, backward back
    tied = [r for r in compare(result) if r["what"].startswith("tied")][0]
    assert (tied["recorded"] > 0) == (not middle)  # only the first and the last stage hold the tied embedding


@pytest.mark.parametrize("dp_coordinate,rows", [(0, 1), (15, 1), (16, 0)])
def test_fsdp2_sums_the_tied_embedding_over_its_own_rows(dp_coordinate, rows):
    """Under FSDP2 the strategy's gradient hooks see each rank's rows: the tied embedding's all-reduce between the
    first and the last stage moves those rows (16 of vocabulary over 32 replicas: one row, or none), not the copy."""
    from labkit.parallel.mesh import ParallelDims

    cfg = config(**{"parallel.pp.degree": 2, "model.n_layer": 2, "data.batch_size": 4 * 32,
                    "parallel.dp.strategy": "fsdp2"})
    result = dry_run(cfg, 64, rank=ParallelDims(dp=32, pp=2).rank_at(dp=dp_coordinate, pp=0))
    tied = [r for r in compare(result) if r["what"].startswith("tied")][0]
    assert tied["equal"] and tied["recorded"] == rows * cfg.model.n_embd * 4


def test_compare_catches_a_missing_or_extra_collective():
    result = dry_run(config(**{"parallel.dp.strategy": "zero2", "data.batch_size": 64}), 64)
    assert all(r["equal"] for r in compare(result))
    dropped = {**result, "calls": [c for c in result["calls"] if c.kind != "all_gather"]}
    assert not next(r for r in compare(dropped) if r["what"].startswith("dp wire"))["equal"]
    extra = {**result, "calls": result["calls"] + [Call("all_reduce", 64, "dp", 4096, "labkit")]}
    assert not next(r for r in compare(extra) if r["what"].startswith("dp wire"))["equal"]
    more_memory = {**result, "memory": {**result["memory"], "grad": result["memory"]["grad"] + 4}}
    assert not next(r for r in compare(more_memory) if r["what"].startswith("grad bytes"))["equal"]
    assert implementation_memory(result)["grad"] == result["memory"]["grad"]
    assert analytic(result)["dp"] > 0


def test_a_dry_run_leaves_no_process_group_and_no_patched_function():
    from labkit.comm import collectives

    import torch

    real = (dist.all_reduce, dist.isend, dist.all_gather_single, collectives._all_reduce,
            collectives._reduce_scatter_single)
    random_state = torch.get_rng_state()
    hsdp = {"parallel.dp.strategy": "fsdp2", "parallel.dp.shard_degree": 8}
    for world, overrides in [(64, {}), (128, {}),  # twice in one process: nothing of the first is left for the second
                             (64, hsdp), (64, {**hsdp, "parallel.cp.degree": 2})]:  # equal (8, 8) meshes, new groups
        result = dry_run(config(**{"parallel.dp.strategy": "fsdp2", "data.batch_size": world, **overrides}), world)
        assert all(r["equal"] for r in compare(result)), [r for r in compare(result) if not r["equal"]]
        assert not dist.is_initialized()
        assert (dist.all_reduce, dist.isend, dist.all_gather_single, collectives._all_reduce,
                collectives._reduce_scatter_single) == real
        assert torch.equal(torch.get_rng_state(), random_state)  # the run's seed did not move the caller's


def test_a_world_the_layout_does_not_divide_gets_the_validation_error_before_anything_starts():
    cfg = config(**{"parallel.tp.degree": 8, "parallel.pp.degree": 2, "model.n_head": 8, "data.batch_size": 62})
    with pytest.raises(ConfigError, match="do not match the world size 1000"):
        dry_run(cfg, 1000)
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="data.batch_size=32 is not divisible"):
        dry_run(config(**{"data.batch_size": 32}), 1024)
    with pytest.raises(ConfigError, match="parallel.pp.impl=torch cannot dry-run"):
        dry_run(config(**{"parallel.pp.degree": 2, "parallel.pp.impl": "torch", "data.batch_size": 64}), 64)
    with pytest.raises(ValueError, match="outside the world"):
        dry_run(config(**{"data.batch_size": 64}), 64, rank=64)
    assert not dist.is_initialized()


def test_the_text_report_names_the_fake_group():
    text = format_result(dry_run(config(**{"data.batch_size": 64}), 64))
    assert FAKE_LABEL in text and "collectives of one training step" in text and "  NO" not in text


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "labkit", "sim", "dryrun", str(CONFIG), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.multiproc
def test_the_cli_prints_the_table_memory_and_comparison_at_1024_ranks():
    sets = ["parallel.tp.degree=8", "parallel.pp.degree=2", "model.n_head=8", "data.batch_size=128",
            "data.micro_batch_size=1", "parallel.dp.strategy=zero2"]
    done = _cli("--world", "1024", "--rank", "8", *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "fake process group: no data moved; bytes and memory are the real code's, times are not measured" in out
    assert "world 1024 = pp 2 × dp 64 × tp 8" in out
    for header in ("collectives of one training step", "model-state memory of this rank", "recorded vs analytic"):
        assert header in out
    table = out.split("recorded vs analytic:")[1]
    assert "yes" in table and " NO" not in table
    bad = _cli("--world", "1000", "--set", "parallel.tp.degree=8", "--set", "parallel.pp.degree=2",
               "--set", "model.n_head=8")
    assert bad.returncode == 2 and "do not match the world size 1000" in bad.stderr and "Traceback" not in bad.stderr


def test_no_line_of_the_report_is_wider_than_a_notebook_prints_without_wrapping():
    from labkit.text import too_wide

    assert not too_wide(format_result(dry_run(config(**{"data.batch_size": 64}), 64)))


CP_ROWS = ["dp wire bytes", "tp wire bytes", "pp wire bytes", "tied embedding", "cp wire bytes", "CommTimers"]


def cp_config(world, impl, layout, dp, **dotted):
    return config(**{"parallel.tp.degree": 4, "parallel.pp.degree": 4, "parallel.cp.degree": 4, "model.n_layer": 4,
                     "parallel.cp.impl": impl, "parallel.cp.layout": layout, "model.n_head": 16,
                     "data.batch_size": 2 * dp, "parallel.dp.strategy": "zero1", **dotted})


@pytest.mark.parametrize("impl,layout,stage", [("ring", "contiguous", 1), ("allgather", "head_tail", 3),
                                               ("ulysses", "head_tail", 0)])
def test_dp_by_pp_by_cp_by_tp_at_1024_ranks_counts_the_cp_bytes_to_the_byte(impl, layout, stage):
    from labkit.parallel.cp.volume import cp_wire_bytes
    from labkit.parallel.mesh import ParallelDims
    from labkit.sim.dryrun_counts import model_rows

    dims = ParallelDims(dp=16, pp=4, tp=4, cp=4)
    rank = dims.rank_at(dp=15, pp=stage, cp=3, tp=2)
    result = dry_run(cp_config(1024, impl, layout, 16), 1024, rank=rank)
    assert result["mesh"] == {"dp": 16, "pp": 4, "cp": 4, "tp": 4} and result["micro_batches"] == 2
    assert result["coordinate"] == {"dp": 15, "pp": stage, "cp": 3, "tp": 2}
    assert_all_equal(result, CP_ROWS)
    # by hand: one rank's q (k, v) block is 1 sequence × 16/4 heads × 64/4 tokens × head dim 4 × fp32 = 1,024 bytes;
    # one layer a stage, 2 micro-batches, each the formula's forward and backward
    wire = cp_wire_bytes(impl, 4, 1 * 4 * 16 * 4 * 4)
    cp_calls = [c for c in result["calls"] if c.axis == "cp"]
    assert sum(c.wire for c in cp_calls) == 2 * (wire["forward"] + wire["backward"])
    assert {c.group_size for c in cp_calls} == ({2} if impl == "ring" else {4})  # the ring: pairs of neighbours
    assert {c.group_size for c in result["calls"] if c.axis == "dp_cp"} == {64}  # gradients over dp × cp
    rows = {r["axis"]: r for r in model_rows(result)}
    assert rows["cp"]["recorded"] == rows["cp"]["model"] == 2 * (wire["forward"] + wire["backward"])
    from labkit.text import too_wide

    text = format_result(result)
    assert "world 1024 = pp 4 × dp 16 × cp 4 × tp 4" in text and not too_wide(text)


def test_cp_without_dp_tells_the_cp_calls_from_the_gradient_ones_on_the_same_group():
    # dp = 1: the gradient group (dp × cp) is the cp group; all-gather KV and ZeRO-2 both all-gather and
    # reduce-scatter on it, and each is counted on its own axis (who launched it), under recompute (forward twice)
    cfg = cp_config(64, "allgather", "head_tail", 1, **{"parallel.dp.strategy": "zero2", "model.recompute": "full"})
    result = dry_run(cfg, 64, rank=63)
    assert result["mesh"] == {"dp": 1, "pp": 4, "cp": 4, "tp": 4}
    assert_all_equal(result, CP_ROWS)
    kinds = {axis: {c.kind for c in result["calls"] if c.axis == axis} for axis in ("cp", "dp_cp")}
    assert kinds["cp"] == kinds["dp_cp"] == {"all_gather", "reduce_scatter"}
    assert len([c for c in result["calls"] if c.axis == "cp"]) == 2 * (2 + 1)  # 2 micro-batches: 2 gathers, 1 scatter


@pytest.mark.parametrize("world,overrides,rank", [
    (64, {"parallel.ep.degree": 8}, 63),
    (1024, {"parallel.ep.degree": 8}, 1000),  # 128 ranks hold each expert
    (1024, {"parallel.ep.degree": 16, "model.moe.capacity_factor": None}, 17),  # dropless
    (1024, {"parallel.ep.degree": 4, "parallel.tp.degree": 2, "parallel.pp.degree": 2, "model.moe.every": 2,
            "model.moe.balance": "loss_free", "parallel.dp.strategy": "ddp_bucketed"}, 1023)])  # the MoE stage
def test_expert_parallel_bytes_and_memory_match_to_the_byte(world, overrides, rank):
    """The dispatch's rows (this rank's routing, from its tally) both ways, the counts exchanged first, the experts'
    gradients over the ranks that hold them, the rest over dp (× cp) as without experts; memory: E/ep experts."""
    tp, pp = overrides.get("parallel.tp.degree", 1), overrides.get("parallel.pp.degree", 1)
    cfg = config(**{"model.moe.experts": 16, "model.moe.top_k": 2, "model.moe.capacity_factor": 1.0,
                    "data.batch_size": world // (tp * pp) * (2 if pp > 1 else 1), **overrides})
    result = dry_run(cfg, world, rank=rank)
    ep = overrides["parallel.ep.degree"]
    assert result["mesh"]["ep"] == ep and result["expert_replicas"] == world // (tp * pp) // ep
    assert_all_equal(result, ["dp wire bytes", "ep wire bytes", "expert gradients", "CommTimers", "param bytes"])
    assert {c.group_size for c in result["calls"] if c.axis == "ep"} == {ep}
    assert any(c.kind == "all_to_all_v" for c in result["calls"] if c.axis == "ep")
    assert sum(map(sum, result["routing"])) > 0  # the routers chose: the rows are this step's, not zeros
