"""The model-parallel RNG tracker (labkit.parallel.rng): dropout masks alike where the ranks hold the same
activation, apart where they hold different tokens — checked on real gloo ranks with dropout 0.1, while rank 0
draws from torch's default generator alone (as it does when it times a matmul)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.launcher import free_port
from labkit.parallel.rng import RNGTracker, TrackedDropout, seeds_for

BASE = {"run.name": "rng", "run.seed": 7, "run.eval_every": 0, "run.save_final": False, "model.n_layer": 2,
        "model.n_head": 4, "model.n_embd": 32, "model.block_size": 16, "model.dropout": 0.1,
        "data.batch_size": 8, "data.micro_batch_size": 2}
CASES = {"tp2": {"parallel.tp.degree": 2},  # with dp 2: every case runs on 4 processes
         "tp2_sp": {"parallel.tp.degree": 2, "parallel.tp.sequence_parallel": True},
         "cp2": {"parallel.cp.degree": 2},
         "tp2_cp2": {"parallel.tp.degree": 2, "parallel.cp.degree": 2}}


@pytest.fixture(scope="module")
def masks(tmp_path_factory):
    out = tmp_path_factory.mktemp("rng")
    cases = [{"name": name, "overrides": {**BASE, **layout}} for name, layout in CASES.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    worker = Path(__file__).with_name("rng_worker.py")
    proc = subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", "4", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), str(worker), str(out), json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in CASES}


def pairs_apart_on(ranks: list[dict], axis: str) -> list[tuple[dict, dict]]:
    """Pairs of ranks whose coordinates differ on ``axis`` alone."""
    return [(a, b) for i, a in enumerate(ranks) for b in ranks[i + 1:]
            if [k for k in a["coord"] if a["coord"][k] != b["coord"][k]] == [axis]]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(CASES))
def test_masks_are_alike_over_tp_and_apart_over_sequence_shards(masks, name):
    ranks = masks[name]
    sequence_parallel = CASES[name].get("parallel.tp.sequence_parallel", False)
    for rank in ranks:
        assert rank["tracked"] == 5 and len(rank["masks"]) == 5  # the embedding's and each block's two
        assert all(0.02 < m["dropped"] < 0.25 for m in rank["masks"].values())
    for axis in ("tp", "cp"):
        apart = axis == "cp" or sequence_parallel  # each holds other tokens: its own mask
        for a, b in pairs_apart_on(ranks, axis):
            for module, mask in a["masks"].items():
                assert (mask["digest"] != b["masks"][module]["digest"]) == apart, (name, axis, module)
    assert pairs_apart_on(ranks, "tp") or pairs_apart_on(ranks, "cp")


def test_seeds_alike_over_replicas_apart_over_shards_and_stages():
    sizes = {"dp": 2, "pp": 2, "cp": 2, "tp": 2}

    def seeds(sp=False, **coord):
        return seeds_for(7, {"dp": 0, "pp": 0, "cp": 0, "tp": 0, **coord}, sizes, sp)
    assert seeds(tp=1) == seeds(tp=0) == seeds(dp=1)  # tp without SP, and dp replicas: alike
    assert seeds(cp=1)["sharded"] != seeds()["sharded"] and seeds(cp=1)["replicated"] == seeds()["replicated"]
    assert seeds(True, tp=1)["sharded"] != seeds(True)["sharded"]
    assert len({seeds(True, cp=c, tp=t)["sharded"] for c in (0, 1) for t in (0, 1)}) == 4
    assert seeds(pp=1)["replicated"] != seeds()["replicated"]


def test_a_fork_continues_its_own_stream_and_leaves_the_default_one_where_it_was():
    tracker = RNGTracker({"a": 1}, "cpu")
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)
    with tracker.fork("a"):
        second = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))  # one stream, seeded 1, across the forks


def test_a_tracked_dropout_is_the_identity_in_eval():
    layer = TrackedDropout(0.5, RNGTracker({"sharded": 3}, "cpu"), "sharded").eval()
    x = torch.ones(4, 4)
    assert torch.equal(layer(x), x)
    assert float((layer.train()(x) == 0).float().mean()) > 0
