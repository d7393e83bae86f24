"""A model split over the rank grid trains the same model as one process would.

Every data-parallel strategy that does not refuse a model-parallel layout (``refuses`` in labkit.parallel.spec)
is run on the dp axis of that layout, with real gloo
process groups (one torchrun launch per world size, every case inside), and compared with
single-process training on the full batch: the loss of every step and the whole final model (the
slices gathered back: ``labkit.parallel.parallelize.whole_model_state``). Every run also evaluates (after steps
1 and 3), and its validation loss is one process's on the same tokens. Context parallelism (each sequence cut over
the cp axis: ring, all-gather KV and Ulysses, head-tail and contiguous chunks) is one more layout among them, and so
is HSDP (FSDP2 over 2 replicas × 2 shards: ``parallel.dp.shard_degree``), whose bytes and memory per rank are also
checked against their formulas.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import processes_mentioning, tiny_config
from labkit.config import load_config
from labkit.launcher import free_port
from labkit.parallel import STRATEGIES
from labkit.parallel.reports.activation_memory import SCALAR_SLACK, activation_memory
from labkit.train import train

BASE = {"run.name": "layout", "run.steps": 4, "run.eval_every": 2, "run.seed": 7, "run.save_final": True,
        "model.n_layer": 2, "model.n_head": 4, "model.n_embd": 32, "model.block_size": 16, "model.bias": True,
        "data.batch_size": 8, "data.micro_batch_size": 2, "optim.warmup_steps": 2}


def takers(axis: str, impl: str) -> list[str]:
    return [name for name, s in STRATEGIES.items() if (axis, impl) not in s.refuses]


def pipeline(impl: str, schedule: str, strategy: str = "ddp_naive", **extra) -> dict:
    return {**BASE, "parallel.pp.degree": 2, "parallel.pp.impl": impl, "parallel.pp.schedule": schedule,
            "parallel.dp.strategy": strategy, **extra}


def context(impl: str, layout: str, strategy: str = "ddp_bucketed", cp: int = 2, **extra) -> dict:
    return {**BASE, "parallel.cp.degree": cp, "parallel.cp.impl": impl, "parallel.cp.layout": layout,
            "parallel.dp.strategy": strategy, **extra}


def cases(world: int) -> list[dict]:
    if world == 2:  # one pipeline of 2 stages: m = 4 = 2p micro-batches, and m = 1
        out = [{"name": "tp2", "overrides": {**BASE, "parallel.tp.degree": 2}}]
        out += [{"name": f"pp2-{impl}-{schedule}", "overrides": pipeline(impl, schedule)}
                for impl in ("labkit", "torch") for schedule in ("gpipe", "1f1b")]
        out.append({"name": "pp2-labkit-1f1b-m1",
                    "overrides": pipeline("labkit", "1f1b", **{"data.micro_batch_size": 8})})
        out.append({"name": "tp2-sp",
                    "overrides": {**BASE, "parallel.tp.degree": 2, "parallel.tp.sequence_parallel": True}})
        for sp in (False, True):
            out.append({"name": f"tp2-dtensor{'-sp' * sp}", "overrides": {
                **BASE, "parallel.tp.degree": 2, "parallel.tp.impl": "dtensor", "parallel.tp.sequence_parallel": sp,
                "parallel.dp.strategy": "fsdp2"}})
        out += [{"name": f"cp2-{impl}-{layout}", "overrides": context(impl, layout)}
                for impl in ("ring", "allgather", "ulysses") for layout in ("head_tail", "contiguous")]
        return out
    if world == 8:  # every axis at once: dp × tp × pp = 2 × 2 × 2, and dp × cp × tp = 2 × 2 × 2
        return [{"name": f"dp2_tp2_pp2-{impl}",
                 "overrides": pipeline(impl, "1f1b", "zero2", **{"parallel.tp.degree": 2})}
                for impl in ("labkit", "torch")] + \
            [{"name": "dp2_cp2_tp2-ring",
              "overrides": context("ring", "head_tail", "zero2", **{"parallel.tp.degree": 2})},
             {"name": "dp4_tp2-hsdp2",  # tp's slices, sharded by FSDP2 in groups of 2, replicated over 2 groups
              "overrides": {**BASE, "parallel.tp.degree": 2, "parallel.dp.strategy": "fsdp2",
                            "parallel.dp.shard_degree": 2}}]
    out = [{"name": f"dp2_tp2-{s}", "overrides": {**BASE, "parallel.tp.degree": 2, "parallel.dp.strategy": s}}
           for s in takers("tp", "labkit")]
    out.append({"name": "tp4", "overrides": {**BASE, "parallel.tp.degree": 4, "data.micro_batch_size": 8}})
    out += [{"name": f"dp2_pp2-labkit-{s}", "overrides": pipeline("labkit", "1f1b", s)} for s in takers("pp", "labkit")]
    out += [{"name": f"dp2_pp2-torch-{s}", "overrides": pipeline("torch", "gpipe", s)} for s in takers("pp", "torch")]
    out += [{"name": f"dp2_tp2-sp-{s}", "overrides": {**BASE, "parallel.tp.degree": 2, "parallel.dp.strategy": s,
                                                      "parallel.tp.sequence_parallel": True}}
            for s in ("torch_ddp", "zero2", "fsdp2")]
    out += [{"name": f"dp2_cp2-ring-{s}", "overrides": context("ring", "head_tail", s)}
            for s in ("torch_ddp", "ddp_bucketed", "zero1", "zero2", "fsdp2")]
    out.append({"name": "cp4-ring", "overrides": context("ring", "head_tail", cp=4, **{"data.micro_batch_size": 8})})
    out += [{"name": f"pp2_cp2-{impl}-{schedule}", "overrides": context("ring", "head_tail", "ddp_naive", **{
        "parallel.pp.degree": 2, "parallel.pp.impl": impl, "parallel.pp.schedule": schedule})}
        for impl, schedule in (("labkit", "1f1b"), ("labkit", "gpipe"), ("torch", "gpipe"))]
    out += [{"name": f"tp2_cp2-{impl}", "overrides": context(impl, "head_tail", **{"parallel.tp.degree": 2,
                                                                                    "data.micro_batch_size": 8})}
            for impl in ("ring", "ulysses")]
    hsdp = {"parallel.dp.strategy": "fsdp2", "parallel.dp.shard_degree": 2}  # 2 replicas × 2 shards
    out += [{"name": "dp4-hsdp2", "overrides": {**BASE, **hsdp}},
            {"name": "dp2_cp2-hsdp2", "overrides": context("ring", "head_tail", "fsdp2",
                                                           **{"parallel.dp.shard_degree": 2})}]
    out.append({"name": "dp2_tp2-dtensor-fsdp2", "overrides": {
        **BASE, "parallel.tp.degree": 2, "parallel.tp.impl": "dtensor", "parallel.dp.strategy": "fsdp2"}})
    out += [{"name": f"tp2_pp2-{impl}", "overrides": pipeline(impl, "1f1b", **{"parallel.tp.degree": 2})}
            for impl in ("labkit", "torch")]
    return out


def scored_per_batch(overrides: dict, world: int) -> int:
    """Samples one evaluation batch scores: each dp coordinate reads ``micro_batch_size`` of its own."""
    dp = world // (overrides.get("parallel.tp.degree", 1) * overrides.get("parallel.pp.degree", 1)
                   * overrides.get("parallel.cp.degree", 1))
    return overrides["data.micro_batch_size"] * dp


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, Path]:
    """One process's runs, by micro-batch size: 8 (the full batch) for training, and 2, 4 and 8 for the
    validation tokens each layout scores (one process reading a layout's dp shards at once)."""
    roots = {}
    for micro in (2, 4, 8):
        roots[micro] = tmp_path_factory.mktemp(f"reference{micro}")
        train(tiny_config(**{**BASE, "data.micro_batch_size": micro}), roots[micro])
    return roots


@pytest.fixture(scope="module", params=[2, 4, 8])
def world(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"layouts{request.param}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", str(request.param),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           str(Path(__file__).parents[1] / "dp_cases.py"), str(root), json.dumps(cases(request.param))],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert processes_mentioning(str(root)) == []  # no worker outlives its group
    return request.param, root


def _steps(run_dir):
    return [e for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == "step"]


def _evals(run_dir) -> list[tuple[int, float]]:
    return [(e["step"], e["val_loss"]) for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == "eval"]


def test_every_layout_case_has_strategies_to_run():
    assert {"torch_ddp", "ddp_naive", "ddp_bucketed", "zero1", "zero2", "fsdp2"} <= set(takers("tp", "labkit"))
    assert {"ddp_naive", "ddp_bucketed", "zero1", "zero2", "fsdp2"} <= set(takers("pp", "labkit"))
    assert {"ddp_naive", "zero2", "fsdp2"} <= set(takers("pp", "torch"))


@pytest.mark.multiproc
def test_split_model_equals_single_process_training(world, references):
    size, root, reference = *world, references[8]
    want_steps = _steps(reference)
    want = torch.load(reference / "final_model.pt", weights_only=True)
    for case in cases(size):
        name = case["name"]
        got_steps = _steps(root / name)
        assert [e["loss"] for e in got_steps] == pytest.approx([e["loss"] for e in want_steps], rel=1e-5), name
        # the gradient norm is one number over the whole model: slices summed, replicated parameters once
        want_norms = [e["grad_norm"] for e in want_steps]
        assert [e["grad_norm"] for e in got_steps] == pytest.approx(want_norms, rel=1e-4), name
        got = torch.load(root / name / "final_model.pt", weights_only=True)
        assert got.keys() == want.keys(), name
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
        o = case["overrides"]
        if o.get("parallel.tp.impl") == "dtensor":  # DTensor's collectives run inside torch
            assert all(e["model_comm_bytes"] is None for e in got_steps), name
        elif o.get("parallel.tp.degree", 1) * o.get("parallel.cp.degree", 1) > 1:  # counted apart from dp's
            assert all(e["model_comm_bytes"] > 0 for e in got_steps), name
        if o.get("parallel.pp.degree", 1) > 1:  # both schedules time their chunks: each stage's idle share
            assert all(0 < idle < 1 for e in got_steps for idle in e["rank_pipeline_idle"]), name
            sent = [e["pipeline_comm_bytes"] for e in got_steps]  # torch's schedule sends inside torch: not counted
            assert all(b > 0 if o["parallel.pp.impl"] == "labkit" else b is None for b in sent), name


@pytest.mark.multiproc
def test_split_model_evaluates_as_one_process(world, references):
    """The validation loss of every layout (its ``eval`` events and summary.json's latest) is one process's on the
    same tokens: the stages relay one micro-batch (``relay_loss``), the slices compute one loss, dp averages."""
    size, root = world
    for case in cases(size):
        name, reference = case["name"], references[scored_per_batch(case["overrides"], size)]
        want, got = _evals(reference), _evals(root / name)
        assert [s for s, _ in got] == [s for s, _ in want] == [1, 3], name
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5), name
        summary = json.loads((root / name / "summary.json").read_text())
        assert summary["val_loss"] == pytest.approx(json.loads((reference / "summary.json").read_text())["val_loss"],
                                                    rel=1e-5), name


@pytest.mark.multiproc
def test_every_ranks_activations_are_the_count_for_its_stage(world):
    """What autograd saved in one micro-batch's forward on each rank (``rank_activation_bytes``) is
    ``activation_memory``'s count for its stage, tp slice and cp chunks (every variant's), and each stage held as many
    micro-batches at once as its schedule says (m for GPipe, p − stage for 1F1B)."""
    size, root = world
    for case in cases(size):
        name, o = case["name"], case["overrides"]
        events = [json.loads(line) for line in open(root / name / "events.jsonl")]
        report = activation_memory(events, load_config(None, o))
        if o.get("parallel.tp.impl") == "dtensor":  # DTensor's modules save their own
            assert report["why_not"] and all(r["predicted"] is None for r in report["rows"]), name
            continue
        assert report["why_not"] is None, name
        for r in report["rows"]:
            if o.get("parallel.pp.impl") == "torch":  # torch's schedule runs its own loop, uncounted
                assert r["measured"] is None, name
                continue
            assert 0 <= r["measured"] - r["predicted"] <= SCALAR_SLACK, (name, r)
            assert r["held"] == r["held_predicted"], (name, r)


@pytest.mark.multiproc
def test_hsdp_sends_and_holds_what_its_formulas_say(world):
    """FSDP2 over (replicas × shards): the bytes of every step counted at the collectives are FSDP2.wire_bytes
    exactly, and each rank's weights, gradients and Adam state are the prediction for FSDP over one shard group."""
    from labkit.parallel.dp.fsdp import FSDP2
    from labkit.parallel.reports.layout import rank_memory, start_event

    size, root = world
    hsdp = [case for case in cases(size)  # the whole model's Ψ: tp's slices are checked as one process instead
            if case["overrides"].get("parallel.dp.shard_degree")
            and case["overrides"].get("parallel.tp.degree", 1) == 1]
    assert hsdp or size != 4
    for case in hsdp:
        name, o = case["name"], case["overrides"]
        events = [json.loads(line) for line in open(root / name / "events.jsonl")]
        start, cfg = start_event(events), load_config(None, o)
        replicas = size // (o.get("parallel.tp.degree", 1) * o.get("parallel.pp.degree", 1))
        psi, per_block = start["params"]["total"], start["params"]["per_block"]
        want = FSDP2.wire_bytes(psi, psi - cfg.model.n_layer * per_block, o["parallel.dp.shard_degree"], replicas,
                                start["grad_accum"])
        after_eval = {step + 1 for step, _ in _evals(root / name)}  # the root is still gathered from the evaluation
        sent = [e["comm_bytes"] for e in _steps(root / name) if e["step"] not in after_eval]
        assert sent and all(b == want for b in sent), (name, sent, want)
        for r in rank_memory(events, cfg):
            assert r["measured_total"] == r["predicted_total"], (name, r)
            assert r["predicted"]["param"] == 4 * psi / o["parallel.dp.shard_degree"], (name, r)
