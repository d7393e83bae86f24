"""Peak memory per phase of a step: labkit's allocation tracker, beside torch's MemTracker, and in real runs."""
import json

import pytest
import torch

from helpers import tiny_config
from labkit.launcher import launch
from labkit.metrics.memory import UNTRACKED, AllocationTracker, PhasePeaks, held_tensors, tracked_memory_step
from labkit.metrics.steps import PHASES
from labkit.model import GPT
from labkit.model.gpt import GPTShape
from labkit.train import train

MiB = 2**20
PEAK_KEYS = [f"rank_peak_{phase}_bytes" for phase in PHASES]


def steps(run_dir):
    return [e for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == "step"]


def test_the_peak_of_a_known_sequence_of_allocations_is_exact():
    tracker = AllocationTracker()
    with tracker:
        a = torch.empty(MiB, dtype=torch.uint8)
        b = torch.empty(2 * MiB, dtype=torch.uint8)
        del a
        c = torch.empty(MiB // 2, dtype=torch.uint8)
    assert tracker.peak == 3 * MiB and tracker.current == 2 * MiB + MiB // 2
    tracker.reset_peak()
    assert tracker.peak == 2 * MiB + MiB // 2
    del b, c  # freed after the mode was left: still subtracted
    assert tracker.current == 0
    tracker.close()


def test_views_count_once_what_lived_before_is_held_and_resizes_are_followed():
    kept = torch.empty(MiB, dtype=torch.uint8)
    tracker = AllocationTracker().hold([kept, kept[:10], kept.view(2, -1)])
    assert tracker.current == MiB  # one storage, however many views of it
    with tracker:
        views = [kept[i:] for i in range(5)]  # new tensors, no new storage
        assert tracker.current == MiB
        grown = torch.empty(0, dtype=torch.uint8)
        grown.untyped_storage().resize_(MiB)  # FSDP2 gathers into storages like this, past dispatch
        assert tracker.current == 2 * MiB
        grown.untyped_storage().resize_(0)
        assert tracker.current == MiB
    del kept, views
    assert tracker.current == 0
    tracker.close()


def test_the_peak_equals_torchs_memtracker_for_a_training_step():
    """Both follow the same step at once (two dispatch modes): the same peak, to the byte or nearly."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=16, block_size=32, n_layer=2, n_head=2, n_embd=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 16, (4, 32))

    def step():
        _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on
    ours = AllocationTracker().hold(held_tensors(model, optimizer)).hold([idx])
    native = MemTracker()
    native.track_external(model, optimizer, idx)
    with native, ours:
        step()
    ours.close()
    (native_peak,) = [snapshot["Total"] for snapshot in native.get_tracker_snapshot("peak").values()]
    state = sum(p.numel() * 4 * 3 for p in model.parameters())  # weights and Adam's two moments
    assert ours.peak > state
    assert ours.peak == pytest.approx(native_peak, rel=0.01)


def test_phase_peaks_keep_each_phases_largest_span_and_untracked_steps_give_none():
    kept = torch.empty(MiB, dtype=torch.uint8)
    peaks = PhasePeaks("cpu", [kept])
    for size in (MiB, 3 * MiB, 2 * MiB):  # three micro-batches' forwards
        with peaks.phase("forward"):
            torch.empty(size, dtype=torch.uint8)
    with peaks.phase("backward"):
        assert peaks.current_bytes() == MiB  # what is alive now: the kept tensor
        x = torch.empty(MiB // 4, dtype=torch.uint8)
    assert peaks.stats() == {"peak_forward_bytes": 4 * MiB, "peak_backward_bytes": MiB + MiB // 4,
                             "peak_optimizer_bytes": None, "growth_backward_bytes": MiB // 4}
    with UNTRACKED.phase("forward"):
        pass
    assert UNTRACKED.stats() == dict.fromkeys(("peak_forward_bytes", "peak_backward_bytes", "peak_optimizer_bytes",
                                               "growth_backward_bytes"))
    assert UNTRACKED.current_bytes is None
    del x


def test_on_cuda_each_phase_reads_the_allocators_peak_and_the_run_peak_survives_the_resets(monkeypatch):
    """No GPU here: the caching allocator's two counters are stood in for (allocated now, peak since a reset)."""
    import labkit.metrics.memory as memory

    allocator = {"now": 10 * MiB, "peak": 50 * MiB}  # the process peaked before this step

    def allocate(nbytes):
        allocator["now"] += nbytes
        allocator["peak"] = max(allocator["peak"], allocator["now"])

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: allocator["now"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: allocator.update(peak=allocator["now"]))
    monkeypatch.setattr(memory, "_cuda_peak_before_resets", 0)
    peaks = PhasePeaks("cuda")
    with peaks.phase("forward"):
        allocate(4 * MiB)
    with peaks.phase("backward"):
        allocate(2 * MiB)
        allocate(-6 * MiB)
    assert peaks.stats() == {"peak_forward_bytes": 14 * MiB, "peak_backward_bytes": 16 * MiB,
                             "peak_optimizer_bytes": None, "growth_backward_bytes": 2 * MiB}
    assert memory.peak_memory_bytes("cuda") == 50 * MiB  # max_mem_bytes: still the peak since the start


def test_the_tracked_step_is_a_logged_step_inside_the_warm_up():
    assert tracked_memory_step(0) == 1  # the second step
    assert tracked_memory_step(3) == 4  # a resumed attempt's second
    assert tracked_memory_step(0, log_every=10) == 10  # step 1 would not be written
    assert tracked_memory_step(5, log_every=4) == 8
    assert tracked_memory_step(0, after=8) == 8  # run.compile=verify times steps 1-7


def test_a_tracked_step_records_each_phases_peak(tmp_path):
    train(tiny_config(**{"run.save_final": False}), tmp_path)
    events = steps(tmp_path)
    tracked = [e for e in events if e["rank_peak_backward_bytes"] != [None]]
    assert [e["step"] for e in tracked] == [1]  # and every other step says None
    assert all(e[key] == [None] for e in events if e["step"] != 1 for key in PEAK_KEYS)
    e = tracked[0]
    (forward,), (backward,), (optimizer,) = (e[key] for key in PEAK_KEYS)
    # forward holds the weights, the optimizer state (built in step 0) and one micro-batch's activations
    assert forward >= e["param_bytes"] + e["optimizer_bytes"] + e["activation_bytes"]
    assert forward <= backward  # backward starts from everything forward kept, and adds the gradients
    assert backward >= e["param_bytes"] + e["grad_bytes"] + e["optimizer_bytes"]
    assert optimizer >= e["param_bytes"] + e["grad_bytes"] + e["optimizer_bytes"]
    assert optimizer < backward  # the activations are gone by the optimizer step


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["ddp_naive", "zero1"])
def test_step_events_carry_every_ranks_phase_peaks(tmp_path, strategy):
    run = launch(tiny_config(**{"run.steps": 3, "run.save_final": False, "parallel.dp.strategy": strategy}),
                 nproc=2, run_dir=tmp_path)
    try:
        assert run.wait(timeout=180) == "finished", run.log()
    finally:
        run.stop()
    events = steps(tmp_path)
    assert [e["step"] for e in events] == [0, 1, 2]
    for e in events:
        assert all(len(e[key]) == 2 for key in PEAK_KEYS)
        if e["step"] != 1:
            assert all(e[key] == [None, None] for key in PEAK_KEYS)
            continue
        for rank in range(2):
            states = e["rank_param_bytes"][rank] + e["rank_grad_bytes"][rank] + e["rank_optimizer_bytes"][rank]
            forward, backward, optimizer = (e[key][rank] for key in PEAK_KEYS)
            assert 0 < forward <= backward
            assert backward >= states and optimizer >= states  # ZeRO-1: each rank's half of the optimizer state
