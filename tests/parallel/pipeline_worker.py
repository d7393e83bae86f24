"""One rank of tests/parallel/test_pipeline.py (torchrun, gloo): a GPT cut into WORLD_SIZE pipeline stages, run
by labkit's schedules and by torch's, against the whole model on every rank (built from the same seed).

Writes OUT/rankN.json: ``checks`` (name → list of booleans, all must hold; labkit's and torch's gradients bitwise
equal among them) and ``timelines`` (this rank's spans of one 1F1B step at m = 2p, labkit's and torch's, for the
measured and the replayed bubble)."""
import faulthandler
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from labkit.comm.axes import AxisGroup, counting
from labkit.metrics.timers import CommTimer
from labkit.model.gpt import GPT, GPTShape
from labkit.parallel.pp.pipeline import (GPTStage, PipelineSchedule, expected_p2p_bytes, peak_activations_in_flight,
                                      tied_embedding_group)
from labkit.parallel.pp.torch_pipelining import TorchPipelineSchedule, interleaved_stages

faulthandler.dump_traceback_later(150, exit=True)  # a hung rank prints where it hangs and ends itself
dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a receive nobody answers fails, not waits
rank, p = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
SHAPE = GPTShape(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_embd=16, attention="naive", bias=False,
                 dropout=0.0)
MODEL = GPT(SHAPE)  # the same weights on every rank
MICRO, T = 2, 8
IMPLS = {"labkit": PipelineSchedule, "torch": TorchPipelineSchedule}
TIED_GROUP = tied_embedding_group([list(range(p))])  # collective: every rank calls it; None on a middle stage
TIED = AxisGroup("pp", TIED_GROUP) if TIED_GROUP is not None else None  # the sum of the copies: pipeline traffic
PP = AxisGroup("pp")  # the pipeline is the world here
prev_rank, next_rank = (rank - 1 if rank > 0 else None), (rank + 1 if rank < p - 1 else None)
checks, timelines = {}, {}


def close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def refused(call) -> bool:
    try:
        call()
    except ValueError as e:
        return "needs at least as many micro-batches as stages" in str(e)
    return False


def reference(m: int, model=MODEL):
    """The whole model's mean loss over m micro-batches' worth of sequences, and its gradients by name."""
    x = torch.randint(0, SHAPE.vocab_size, (m * MICRO, T))
    y = torch.randint(0, SHAPE.vocab_size, (m * MICRO, T))
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    grads = {name: model.get_parameter(name).grad.clone() for name, _ in model.named_parameters(remove_duplicate=False)}
    return list(zip(x.split(MICRO), y.split(MICRO))), loss.item(), grads


def run(impl: str, schedule: str, micro_batches, model=MODEL):
    if schedule == "interleaved_1f1b":
        stage = interleaved_stages(model, rank, p, per_rank=2)
    else:
        stage = GPTStage.from_gpt(model, rank, p)
    timer = CommTimer()
    runner = IMPLS[impl](stage, rank, p, prev_rank, next_rank, schedule=schedule, pp_group=PP, tied_group=TIED)
    with counting({"pp": timer}):  # as a training step counts the pp axis: sends, the loss broadcast, the tied sum
        loss = runner.run(micro_batches)
    return runner, loss, timer.collect()


def stage_grads(runner) -> dict:
    """This rank's gradients, by the name the same parameter has in the whole GPT."""
    modules = runner.modules if hasattr(runner, "modules") else [runner.module]
    return {module.gpt_name(n): q.grad for module in modules for n, q in module.named_parameters()}


def check_against_reference(name: str, loss: float, got: dict, want_loss: float, want_grads: dict) -> None:
    checks[f"{name}_loss"] = [abs(loss - want_loss) <= 1e-5 * abs(want_loss)]
    checks[f"{name}_grads"] = [close(g, want_grads[n]) for n, g in got.items()]


def check_labkit_accounting(name: str, runner, comm: dict, schedule: str, m: int) -> None:
    """Bytes sent against the analytic count, activations held against the schedule's peak, one F and one B
    per micro-batch in the timeline."""
    sent = expected_p2p_bytes(rank, p, m, MICRO * T * SHAPE.n_embd * 4)
    broadcast = 4  # the loss, one float32, from the last stage
    tied = SHAPE.vocab_size * SHAPE.n_embd * 4 if rank in (0, p - 1) else 0  # an all-reduce over 2 ranks: n bytes
    checks[f"{name}_bytes"] = [runner.p2p_bytes == sent, comm["comm_bytes"] == sent + broadcast + tied]
    checks[f"{name}_in_flight"] = [runner.max_in_flight == peak_activations_in_flight(p, m, schedule, rank)]
    checks[f"{name}_timeline"] = [sorted((s["kind"], s["mb"]) for s in runner.timeline)
                                  == sorted((k, i) for k in "FB" for i in range(m))]


def same(a: dict, b: dict, exactly: bool) -> list:
    return [torch.equal(g, b[n]) if exactly else close(g, b[n]) for n, g in a.items()]


for m in sorted({1, p - 1, p, 2 * p}):
    micro_batches, want_loss, want_grads = reference(m)
    grads = {}
    for impl in IMPLS:
        for schedule in ("gpipe", "1f1b"):
            name = f"{impl}_{schedule}_m{m}"
            if (impl, schedule) == ("torch", "1f1b") and m < p:
                checks[f"{name}_refused"] = [refused(lambda: run(impl, schedule, micro_batches))]
                continue
            runner, loss, comm = run(impl, schedule, micro_batches)
            grads[(impl, schedule)] = stage_grads(runner)
            check_against_reference(name, loss, grads[(impl, schedule)], want_loss, want_grads)
            if impl == "labkit":
                check_labkit_accounting(name, runner, comm, schedule, m)
            checks[f"{name}_timeline_spans"] = [sorted((s["kind"], s["mb"]) for s in runner.timeline)
                                                == sorted((k, i) for k in "FB" for i in range(m))]
            if schedule == "1f1b" and m == 2 * p:
                timelines[impl] = runner.timeline
    # the two schedules run each micro-batch's backward in the same order, so every gradient is the same sum
    checks[f"labkit_1f1b_equals_gpipe_m{m}"] = same(grads[("labkit", "1f1b")], grads[("labkit", "gpipe")], True)
    for schedule in ("gpipe", "1f1b"):  # torch run with labkit's loss scaling does labkit's arithmetic, bitwise
        if ("torch", schedule) in grads:
            checks[f"labkit_vs_torch_{schedule}_m{m}"] = same(grads[("labkit", schedule)],
                                                              grads[("torch", schedule)], True)
    if ("torch", "1f1b") in grads:
        checks[f"torch_1f1b_equals_gpipe_m{m}"] = same(grads[("torch", "1f1b")], grads[("torch", "gpipe")], True)

# torch's interleaved 1F1B: two stages per rank, so a model of 2p blocks
torch.manual_seed(1)
DEEP = GPT(GPTShape(**{**SHAPE.__dict__, "n_layer": 2 * p}))
for m in (p, 2 * p):
    micro_batches, want_loss, want_grads = reference(m, DEEP)
    runner, loss, _ = run("torch", "interleaved_1f1b", micro_batches, DEEP)
    check_against_reference(f"torch_interleaved_1f1b_m{m}", loss, stage_grads(runner), want_loss, want_grads)

with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"checks": checks, "timelines": timelines}, f)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as labkit's workers do: no C++ static destructors racing gloo's threads ("terminate called ...")
