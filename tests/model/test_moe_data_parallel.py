"""A mixture-of-experts GPT trained by 2 data-parallel processes (real gloo ranks, one torchrun launch for every
strategy) equals one process.

Routing is decided per forward: an expert's capacity is a share of the forward's tokens and the auxiliary loss is a
forward's statistic, so one process reproduces 2 replicas when it runs the same micro-batches — the same
``data.micro_batch_size``, twice the accumulation (labkit's loader hands the 2 replicas' micro-batches of a step to
one process in the same groups). Each step's loss, the routing counts (summed over the replicas: the loss-free
bias moves by them), and the final model, the biases included, equal one process's. Stacked expert weights give an
expert with no tokens a zero gradient, not None, so torch's DDP needs no ``find_unused_parameters``.
"""
from pathlib import Path

import pytest
import torch

from helpers import assert_trains_as_one_process, run_cases, step_events, train_variants

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


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Path]:
    return train_variants(tmp_path_factory, "moe-reference", BASE, VARIANTS)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe-dp2")
    run_cases(root, CASES, nproc=2)
    return root


@pytest.mark.multiproc
def test_two_data_parallel_processes_train_the_moe_gpt_one_process_trains(two_processes, references):
    for case in CASES:
        name, variant = case["name"], case["name"].split("-", 1)[1]
        assert_trains_as_one_process(two_processes / name, references[variant], name)
        assert (step_events(two_processes / name)[0]["moe_drop_rate"][0] > 0) == (variant != "dropless"), name
        one = torch.load(references[variant] / "final_model.pt", weights_only=True)
        if variant == "loss_free":
            assert one["blocks.0.mlp.router.score_bias"].abs().sum() > 0, name
