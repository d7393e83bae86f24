"""labkit.comm.axes: the step says which timer counts each axis; a collective on an AxisGroup finds it there."""
import threading

import torch

from labkit.comm import collectives as comm
from labkit.comm.axes import AxisGroup, counting, process_group, timer_for
from labkit.metrics.timers import CommTimer


def test_each_axis_is_counted_on_the_timer_the_step_set_for_it_even_on_the_same_ranks():
    tp, cp, grads = CommTimer(), CommTimer(), CommTimer()
    same_ranks = None  # dp = 1: the gradient axis and cp are the same ranks, torch's one group
    with counting({"tp": tp, "cp": cp, "dp_cp": grads}):
        assert timer_for(AxisGroup("tp")) is tp
        assert timer_for(AxisGroup("cp", same_ranks)) is cp and timer_for(AxisGroup("dp_cp", same_ranks)) is grads
    assert timer_for(AxisGroup("tp")) is not tp  # after the step: nobody counts the axis


def test_a_timer_given_by_the_caller_wins_and_a_plain_group_is_uncounted():
    mine, tp = CommTimer(), CommTimer()
    with counting({"tp": tp}):
        assert timer_for(AxisGroup("tp"), mine) is mine
        assert timer_for(None) is not tp and timer_for(None) is not timer_for(None)  # a fresh one each time


def test_an_inner_block_overrides_an_axis_and_the_outer_comes_back():
    outer, inner = CommTimer(), CommTimer()
    with counting({"tp": outer, "cp": outer}):
        with counting({"tp": inner}):
            assert timer_for(AxisGroup("tp")) is inner and timer_for(AxisGroup("cp")) is outer
        assert timer_for(AxisGroup("tp")) is outer


def test_a_collective_launched_on_another_thread_is_counted_on_the_steps_timer():
    """An autograd thread (CUDA's backward) runs a layer's collective: the table is the process's, not a thread's."""
    tp, seen = CommTimer(), []
    with counting({"tp": tp}):
        thread = threading.Thread(target=lambda: seen.append(timer_for(AxisGroup("tp"))))
        thread.start()
        thread.join()
    assert seen == [tp]


def test_the_group_behind_an_axis_group_is_torchs():
    assert process_group(AxisGroup("tp", "pg")) == "pg" and process_group("pg") == "pg" and process_group(None) is None


def test_a_collective_on_an_axis_group_counts_on_that_axis():
    """A real gloo group of one: it moves nothing, but the call is counted on its axis's timer and no other."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tp, cp = CommTimer(), CommTimer()
        with counting({"tp": tp, "cp": cp}):
            comm.all_reduce(torch.ones(3), AxisGroup("tp"))
        assert tp.collect()["comm_calls"] == 1 and cp.collect()["comm_calls"] == 0
    finally:
        dist.destroy_process_group()
