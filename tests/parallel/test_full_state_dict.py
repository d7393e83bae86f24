"""``Strategy.full_state_dict``'s two modes on real gloo processes: FSDP2 gathers its shards onto rank 0
only (for saving) or onto every rank (for comparing), and both are the whole model's weights."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import processes_mentioning
from labkit.launcher import free_port

WORKER = Path(__file__).parent / "state_dict_worker.py"


@pytest.mark.multiproc
def test_fsdp2_full_state_dict_on_rank0_only_or_everywhere(tmp_path):
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(WORKER), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert processes_mentioning(str(tmp_path)) == []  # no worker outlives its group
    seen = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    whole = seen[0]["before"]
    assert all(torch.equal(whole[k], seen[1]["before"][k]) for k in whole)  # the same seed on both ranks
    # really sharded: each rank held half of the first dimension of every parameter
    assert seen[0]["sharded"]["wte.weight"][0] * 2 == whole["wte.weight"].shape[0]

    def same(state):
        return state.keys() == whole.keys() and all(torch.equal(state[k].cpu(), whole[k]) for k in whole)

    for rank, s in enumerate(seen):
        assert same(s["everywhere"]), rank  # comparing: the whole model on every rank
        assert not any(hasattr(v, "to_local") for v in s["everywhere"].values())  # plain tensors, not DTensors
    assert same(seen[0]["rank0"])  # saving: the whole model on rank 0, in CPU memory ...
    assert all(v.device.type == "cpu" for v in seen[0]["rank0"].values())
    assert seen[1]["rank0"] == {}  # ... and nothing gathered onto the other rank
