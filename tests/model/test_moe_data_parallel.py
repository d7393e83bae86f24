"""A mixture-of-experts GPT trained by 2 data-parallel processes (real gloo ranks, one torchrun launch for every
strategy) equals one process.

Routing is decided per forward: an expert's capacity is a share of the forward's tokens and the auxiliary loss is a
forward's statistic, so one process reproduces 2 replicas when it runs the same micro-batches — the same
``data.micro_batch_size``, twice the accumulation (labkit's loader hands the 2 replicas' micro-batches of a step to
one process in the same groups). Each step's loss, the routing counts (summed over the replicas: the loss-free
bias moves by them), and the final model, the biases included, equal one process's. Stacked expert weights give an
expert with no tokens a zero gradient, not None, so torch's DDP needs no ``find_unused_parameters``.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import processes_mentioning, tiny_config
from labkit.launcher import free_port
from labkit.train import train

BASE = {"run.name": "moe", "run.steps": 4, "run.eval_every": 0, "run.seed": 7, "run.save_final": True,
        "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16, "model.bias": True,
        "data.batch_size": 8, "data.micro_batch_size": 2, "optim.warmup_steps": 2,
        "model.moe.experts": 4, "model.moe.top_k": 2, "model.moe.capacity_factor": 1.0}
VARIANTS = {"aux_loss": {},  # capacity 1.0: tokens are dropped
            "loss_free": {"model.moe.balance": "loss_free", "model.moe.bias_update": 0.01},
            "dropless": {"model.moe.capacity_factor": None, "model.moe.shared_expert": True}}
STRATEGIES = ("torch_ddp", "ddp_naive", "ddp_bucketed", "zero1", "zero2", "zero3", "fsdp2")
CASES = [{"name": f"{s}-aux_loss", "overrides": {**BASE, "parallel.dp.strategy": s}} for s in STRATEGIES] + \
    [{"name": f"{s}-{v}", "overrides": {**BASE, **VARIANTS[v], "parallel.dp.strategy": s}}
     for s, v in (("ddp_bucketed", "loss_free"), ("torch_ddp", "loss_free"), ("torch_ddp", "dropless"))]


def steps(run_dir: Path) -> list[dict]:
    return [e for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == "step"]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Path]:
    roots = {}
    for variant, overrides in VARIANTS.items():
        roots[variant] = tmp_path_factory.mktemp(f"moe-reference-{variant}")
        train(tiny_config(**{**BASE, **overrides}), roots[variant])
    return roots


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe-dp2")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           str(Path(__file__).parents[1] / "dp_cases.py"), str(root), json.dumps(CASES)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert processes_mentioning(str(root)) == []
    return root


@pytest.mark.multiproc
def test_two_data_parallel_processes_train_the_moe_gpt_one_process_trains(two_processes, references):
    for case in CASES:
        name, variant = case["name"], case["name"].split("-", 1)[1]
        want, got = steps(references[variant]), steps(two_processes / name)
        assert [e["loss"] for e in got] == pytest.approx([e["loss"] for e in want], rel=1e-5), name
        assert [e["moe_load"] for e in got] == [e["moe_load"] for e in want], name  # summed over the replicas
        assert [e["moe_drop_rate"] for e in got] == [e["moe_drop_rate"] for e in want], name
        assert (got[0]["moe_drop_rate"][0] > 0) == (variant != "dropless"), name
        one = torch.load(references[variant] / "final_model.pt", weights_only=True)
        two = torch.load(two_processes / name / "final_model.pt", weights_only=True)
        assert two.keys() == one.keys(), name
        for key in one:
            torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
        if variant == "loss_free":
            assert one["blocks.0.mlp.router.score_bias"].abs().sum() > 0, name
