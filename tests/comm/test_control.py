"""labkit.comm.control (what ranks say to each other that is not training traffic: uncounted, untimed) and the
pipeline's asynchronous pair, labkit.comm.collectives.isend / irecv (counted at launch, the receive timed)."""
import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from labkit.comm import collectives, control
from labkit.metrics.timers import CommTimer
from labkit.sim.dryrun_record import Recorder, recording


@pytest.fixture
def world1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bookkeeping_is_seen_by_a_dry_runs_recorder_as_a_torch_call(world1):
    """control looks torch.distributed's functions up when called, so the dry run still sees the gradient norm's
    one number (8 bytes, source "torch") where the layer's own captured functions would hide it."""
    recorder = Recorder(axis_of=lambda group: "world", recording=True)
    with recording(recorder):
        squares = control.sum_over_ranks(torch.full((1,), 9.0, dtype=torch.float64))
        control.max_over_ranks(torch.zeros(3))
    assert [(c.kind, c.nbytes, c.source) for c in recorder.calls] == [("all_reduce", 8, "torch"),
                                                                      ("all_reduce", 12, "torch")]
    assert squares.item() == 9.0


def test_one_rank_gets_back_what_it_said(world1):
    assert control.broadcast_object({"path": "ckpt"}) == {"path": "ckpt"}
    assert control.all_gather_objects([1, 2]) == [[1, 2]]
    parts = control.all_gather_tensors(torch.arange(4.0))
    assert len(parts) == 1 and torch.equal(parts[0], torch.arange(4.0))
    control.barrier()


# ---------------------------------------------------------------- two gloo processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    said = {"rank": rank}
    results = {"object": control.broadcast_object(said),
               "tensor": control.broadcast_tensor(torch.tensor([10.0 + rank])),
               "max": control.max_over_ranks(torch.tensor([rank, -rank], dtype=torch.float64)),
               "sum": control.sum_over_ranks(torch.tensor([rank + 1.0])),
               "objects": control.all_gather_objects(said),
               "tensors": control.all_gather_tensors(torch.full((2,), float(rank)))}
    full, part = torch.zeros(4), torch.full((2,), rank + 1.0)
    control.bare_collective("all_gather", full, part)()
    results["gathered"] = full.clone()
    control.bare_collective("reduce_scatter", torch.arange(4.0), part)()
    results["scattered"] = part.clone()
    control.bare_collective("send", full.fill_(7.0 if rank == 0 else 0.0), part)()
    results["sent"] = full.clone()
    timer, tensor = CommTimer(), torch.full((6,), 3.0) if rank == 0 else torch.zeros(6)
    if rank == 0:
        collectives.isend(tensor, 1, timer=timer).wait()
    else:
        collectives.irecv(tensor, 0, timer=timer).wait()
    results["p2p"], results["p2p_bytes"] = tensor, timer.collect()["comm_bytes"]
    control.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_two_ranks_agree_through_control_and_the_pipelines_pair(tmp_path):
    mp.spawn(two_ranks, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    first, second = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    for rank, got in enumerate((first, second)):
        assert got["object"] == {"rank": 0}  # rank 0's, on every rank
        assert got["tensor"].tolist() == [10.0]
        assert got["max"].tolist() == [1.0, 0.0] and got["sum"].tolist() == [3.0]
        assert got["objects"] == [{"rank": 0}, {"rank": 1}]  # in rank order
        assert [t.tolist() for t in got["tensors"]] == [[0.0, 0.0], [1.0, 1.0]]
        assert got["gathered"].tolist() == [1.0, 1.0, 2.0, 2.0]
        assert got["scattered"].tolist() == [[0.0, 2.0], [4.0, 6.0]][rank]  # the sum, rank r's half
        assert got["sent"].tolist() == [7.0] * 4  # rank 0 kept its own, rank 1 received it
        assert got["p2p"].tolist() == [3.0] * 6
    assert (first["p2p_bytes"], second["p2p_bytes"]) == (24, 0)  # the sender counts the bytes
