"""A split model saves and resumes (DCP) bit for bit, and a crashed 2-D run recovers to the same model.

Every part of a split model is a different tensor on a different rank (labkit's tensor-parallel slices,
the pipeline's stages), saved under its coordinates (``labkit.fault.recovery.model_part_key``); DTensor's
slices are placed by DCP itself. Context parallelism's ranks hold copies, as replicas do. One 4-process group
runs, per layout, a 10-step run saving every 4 steps, then a fresh run that resumes from its newest checkpoint
(step 7) and trains steps 8 and 9. And a crash (``fault.inject``) recovered by the elastic agent ends at the
uninterrupted model, at world 4 and 8.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import labkit
from helpers import processes_mentioning, tiny_config
from labkit.launcher import free_port

BASE = {"run.seed": 7, "run.eval_every": 0, "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32,
        "model.block_size": 16, "data.batch_size": 8, "data.micro_batch_size": 2, "optim.warmup_steps": 2}
TP2, PP2, CP2 = {"parallel.tp.degree": 2}, {"parallel.pp.degree": 2}, {"parallel.cp.degree": 2}
MOE = {"model.moe.experts": 4, "model.moe.top_k": 2, "model.moe.capacity_factor": 1.0}
LAYOUTS = {
    "dp2_tp2-torch_ddp": TP2,
    "dp2_tp2-zero2": {**TP2, "parallel.dp.strategy": "zero2"},
    "dp2_tp2-fsdp2-sp": {**TP2, "parallel.dp.strategy": "fsdp2", "parallel.tp.sequence_parallel": True},
    "dp2_tp2-dtensor-fsdp2": {**TP2, "parallel.tp.impl": "dtensor", "parallel.dp.strategy": "fsdp2"},
    "dp2_pp2-ddp_naive": {**PP2, "parallel.dp.strategy": "ddp_naive"},
    "dp2_pp2-zero1": {**PP2, "parallel.dp.strategy": "zero1"},
    "dp2_pp2-torch-fsdp2": {**PP2, "parallel.dp.strategy": "fsdp2", "parallel.pp.impl": "torch"},
    "tp2_pp2-ddp_bucketed": {**TP2, **PP2, "parallel.dp.strategy": "ddp_bucketed"},
    # context parallelism: a cp group's ranks hold the same parameters, like replicas (one copy saved)
    "dp2_cp2-ring-zero2": {**CP2, "parallel.dp.strategy": "zero2"},
    "dp2_cp2-ulysses-fsdp2": {**CP2, "parallel.cp.impl": "ulysses", "parallel.dp.strategy": "fsdp2"},
    "tp2_cp2-ring-torch_ddp": {**TP2, **CP2, "data.micro_batch_size": 4},
    "pp2_cp2-ring-ddp_naive": {**PP2, **CP2, "parallel.dp.strategy": "ddp_naive"},
    # expert parallelism: each ep rank's experts and their optimizer state are its own (saved under its ep coordinate)
    # (dp 4 with ddp_bucketed: torch's DDP rebuilds its buckets after its first step, which for the resumed run is
    # step 8, and gloo's ring sums 4 ranks' values in an order that depends on where an element falls in its bucket)
    "dp4_ep2-moe-ddp_bucketed": {**MOE, "parallel.ep.degree": 2, "parallel.dp.strategy": "ddp_bucketed"},
    "dp2_ep2_tp2-moe-ddp_bucketed": {**MOE, **TP2, "parallel.ep.degree": 2, "parallel.dp.strategy": "ddp_bucketed"},
    "dp2_ep2_pp2-moe-ddp_naive": {**MOE, **PP2, "parallel.ep.degree": 2, "parallel.dp.strategy": "ddp_naive",
                                  "model.moe.balance": "loss_free", "model.moe.bias_update": 0.01},
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout-resume")
    cases = []
    for name, layout in LAYOUTS.items():
        full = {**BASE, **layout, "run.steps": 10, "run.save_final": True, "fault.checkpoint_every": 4,
                "fault.keep_last": 5, "fault.checkpoint_dir": str(root / f"{name}-full" / "checkpoints")}
        cases += [{"name": f"{name}-full", "overrides": full}, {"name": f"{name}-resumed", "overrides": full}]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", "4", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()),
                           str(Path(__file__).parents[1] / "dp_cases.py"), str(root), json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert processes_mentioning(str(root)) == []  # no worker outlives its group
    return root


def _events(run_dir, kind):
    return [e for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == kind]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_resumes_bit_for_bit(resumed, name):
    full, again = resumed / f"{name}-full", resumed / f"{name}-resumed"
    (resume,) = _events(again, "resume")
    assert resume["next_step"] == 8 and [e["step"] for e in _events(again, "step")] == [8, 9]
    assert [e["loss"] for e in _events(again, "step")] == [e["loss"] for e in _events(full, "step")][8:]
    want, got = (torch.load(d / "final_model.pt", weights_only=True) for d in (full, again))
    assert _equal(got, want), name
    assert [s["step"] for s in _events(full, "checkpoint")] == [3, 7]


CRASHED = {  # name: (layout, world size, the rank that crashes)
    "dp2_tp2": (TP2, 4, 3),
    "dp2_tp2-dtensor-sp": ({**TP2, "parallel.tp.impl": "dtensor", "parallel.tp.sequence_parallel": True,
                            "parallel.dp.strategy": "fsdp2"}, 4, 3),
    # rank 6 is (dp 1, stage 1, tp 0): the last stage, which computes the loss
    "dp2_tp2_pp2-labkit": ({**TP2, **PP2, "parallel.dp.strategy": "zero2"}, 8, 6),
    "dp2_tp2_pp2-torch": ({**TP2, **PP2, "parallel.pp.impl": "torch", "parallel.dp.strategy": "fsdp2"}, 8, 6),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", CRASHED)
def test_a_crashed_run_recovers_to_the_uninterrupted_model(name):
    """Through the elastic agent: one rank crashes at step 7, the whole group restarts from the step-4
    checkpoint, and the final model equals a run that never failed, bit for bit. dp × tp = 2 × 2 (labkit's
    slices, and DTensor's with sequence parallelism) and dp × pp × tp = 2 × 2 × 2 (both pipelines)."""
    layout, world, rank = CRASHED[name]
    # a crash closes its peers' connections at once: no timeout is waited for. 8 processes on 2 busy cores can wait
    # longer than a short one for a neighbour's first step (6 s expired at world 8, load 15: that step took 19 s)
    faulted = {**BASE, **layout, "run.steps": 12, "run.save_final": True, "fault.checkpoint_every": 5,
               "fault.max_restarts": 1, "fault.keep_last": 3, "comm.timeout_s": 120.0, "fault.inject_rank": rank,
               "fault.inject_step": 7}
    clean = labkit.launch(tiny_config(**faulted), nproc=world)
    assert clean.wait(timeout=600) == "finished", clean.log()[-3000:]
    assert clean.summary["restarts"] == 0, clean.log()[-3000:]  # uninterrupted: it never failed
    crashed = labkit.launch(tiny_config(**faulted, **{"fault.inject": "crash"}), nproc=world)
    assert crashed.wait(timeout=600) == "finished", crashed.log()[-3000:]
    (fault,) = crashed.summary["faults"]
    assert crashed.summary["restarts"] == 1 and fault["kind"] == "crash" and fault["rank"] == rank
    (resume,) = [e for e in _events(crashed.run_dir, "resume") if e["attempt"] == 1]
    assert resume["next_step"] == 5 and [s["step"] for s in _events(clean.run_dir, "checkpoint")] == [4, 9]
    assert crashed.metrics["loss"] == clean.metrics["loss"]
    want, got = (torch.load(r.run_dir / "final_model.pt", weights_only=True) for r in (clean, crashed))
    assert _equal(got, want), name
    assert processes_mentioning(str(crashed.run_dir)) == [] == processes_mentioning(str(clean.run_dir))
