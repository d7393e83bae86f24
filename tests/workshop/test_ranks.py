"""labkit.workshop.ranks.run_on_ranks: a function from a notebook, run on real gloo processes, each rank's result
back in order; a rank's exception comes back as the same kind, a rank left waiting as a TimeoutError, and no worker
outlives the call."""
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from labkit.workshop.ranks import run_on_ranks


def summed(rank, world, base):
    tensor = torch.tensor([float(base + rank)])
    dist.all_reduce(tensor)
    return rank, world, dist.get_rank(), float(tensor)


def unfinished(rank, world):
    if rank == 1:
        raise NotImplementedError("your turn")
    return rank


def waits_for_ever(rank, world):
    dist.recv(torch.zeros(1), 1 - rank)  # each waits for the other to send: a deadlock
    return rank


@pytest.mark.multiproc
def test_each_rank_runs_the_function_in_one_gloo_group():
    assert run_on_ranks(summed, 3, 10) == [(r, 3, r, 33.0) for r in range(3)]
    assert multiprocessing.active_children() == []


@pytest.mark.multiproc
def test_a_rank_s_exception_comes_back_by_kind_and_names_the_rank():
    with pytest.raises(NotImplementedError, match="rank 1: your turn") as raised:
        run_on_ranks(unfinished, 2)
    assert any("unfinished" in note for note in raised.value.__notes__)  # the worker's traceback
    assert multiprocessing.active_children() == []


@pytest.mark.multiproc
def test_a_rank_left_waiting_times_out_and_is_stopped():
    with pytest.raises((TimeoutError, RuntimeError), match="(?i)timed out|did not finish"):
        run_on_ranks(waits_for_ever, 2, timeout_s=3)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("world", [0, 9, 2.0])
def test_a_bad_world_is_refused_before_any_process_starts(world):
    with pytest.raises(ValueError, match="1 to 8 processes"):
        run_on_ranks(summed, world, 0)
