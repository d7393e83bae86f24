"""One rank of tests/parallel/test_tensor_dtensor.py (torchrun, gloo): torch's DTensor tensor parallelism
(labkit.parallel.tp.dtensor) against labkit's own and the full model, with and without sequence
parallelism, for each tiny GPT (attention naive/sdpa × bias on/off).

Checks the loss, every gradient (``full_tensor()`` against the full model's, ``to_local()`` against labkit's
shard), the tied embedding, two AdamW steps, and the collectives ``CommDebugMode`` counts per block against
labkit's, with their bytes. Writes OUT/rankN.json: {"checks": {case: {check: bool}}, "collectives": ...}."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from tp_cases import BATCH, BLOCK, CASES, EMBD, LAYERS, case_name, close, tiny_gpt
from tp_cases import batch as make_batch

from labkit.comm.collectives import wire_bytes
from labkit.comm.axes import AxisGroup, counting
from labkit.metrics.timers import CommTimer
from labkit.parallel.tp.sequence import sync_sequence_parallel_grads
from labkit.parallel.tp.model import parallelize_gpt
from labkit.parallel.tp.dtensor import (count_dtensor_collectives, loss_parallel_context, parallelize_gpt_dtensor,
                                            reduce_partial_grads)
from labkit.parallel.tp.volume import tp_wire_bytes

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (size,))
checks: dict[str, dict[str, bool]] = {}
collectives: dict[str, dict] = {}


def check(case: str, name: str, ok: bool, detail: str = "") -> None:
    checks.setdefault(case, {})[name] = bool(ok)
    if not ok:
        print(f"rank {rank} {case} {name} FAILED {detail}", file=sys.stderr)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def counterpart(name: str, params: dict, grad: bool = True) -> torch.Tensor:
    """The tensor in a fused-q/k/v model (the full one, or labkit's split one) that the DTensor model's
    parameter ``name`` corresponds to: ``attn.q.weight`` is the first third of ``attn.qkv.weight``'s rows."""
    for i, part in enumerate(("q", "k", "v")):
        if f".attn.{part}." in name:
            fused = params[name.replace(f".attn.{part}.", ".attn.qkv.")]
            return (fused.grad if grad else fused.detach()).chunk(3, dim=0)[i]
    return params[name].grad if grad else params[name].detach()


def forward_backward(model, idx, targets, dtensor: bool):
    if not dtensor:
        _, loss = model(idx, targets)
        loss.backward()
        return loss.detach()
    with loss_parallel_context():
        _, loss = model(idx, targets)
        loss.backward()
    return whole(loss.detach())


def compare_gradients(case: str, dt_model, full, labkit_model) -> None:
    full_params, labkit_params = dict(full.named_parameters()), dict(labkit_model.named_parameters())
    for name, p in dt_model.named_parameters():
        want_full, want_local = counterpart(name, full_params), counterpart(name, labkit_params)
        got_full, got_local = whole(p.grad), local(p.grad)
        check(case, f"grad_full:{name}", close(got_full, want_full), f"{(got_full - want_full).abs().max():.3g}")
        check(case, f"grad_local_vs_labkit:{name}", close(got_local, want_local))


def compare_collectives(case: str, sp: bool, per_module: dict, counted, labkit_bytes: int) -> None:
    """Per block: DTensor issues labkit's collectives (2 all-reduces each way; or 2 all-gathers and 2
    reduce-scatters each way with SP), with labkit's bytes; the whole model's bytes differ only by the
    position embedding's gradient all-gather (SP), which labkit replaces by its after-backward sync."""
    want = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2} if sp else {"all_reduce": 2}
    for i in range(LAYERS):
        block = per_module.get(f"GPT.blocks.{i}", {})
        for key in ("forward", "backward"):
            check(case, f"block{i}_{key}_collectives", block.get(key) == want, f"{block}")
    expected = tp_wire_bytes(BATCH, BLOCK, EMBD, LAYERS, size, 4, sequence_parallel=sp)["total"]
    position_gather = wire_bytes("all_gather", BLOCK * EMBD * 4, size) if sp else 0
    check(case, "bytes_equal_labkit_plus_position_gather", counted.bytes == expected + position_gather,
          f"{counted.bytes} vs {expected} + {position_gather}")
    check(case, "labkit_counted_the_analytic_bytes", labkit_bytes == expected, f"{labkit_bytes} vs {expected}")
    collectives[case] = {"per_module": per_module, "bytes": counted.bytes, "labkit_bytes": labkit_bytes,
                         "calls": counted.calls}


def take_steps(case: str, dt_model, full, steps: int = 2) -> None:
    """AdamW on the DTensor parameters (plain and DTensor alike) keeps them equal to the full model's."""
    opt_dt = torch.optim.AdamW(dt_model.parameters(), lr=1e-2)
    opt_full = torch.optim.AdamW(full.parameters(), lr=1e-2)
    for step in range(steps):
        idx, targets = make_batch(seed=10 + step)
        for model, opt, dtensor in ((dt_model, opt_dt, True), (full, opt_full, False)):
            opt.zero_grad(set_to_none=True)
            forward_backward(model, idx, targets, dtensor)
            if dtensor:
                reduce_partial_grads(model)
            opt.step()
    full_params = dict(full.named_parameters())
    for name, p in dt_model.named_parameters():
        got, want = whole(p.detach()), counterpart(name, full_params, grad=False)
        # 1e-4: see tensor_gpt_worker.py (Adam turns the key bias's rounding-noise gradient into ~1e-5 steps)
        ok = close(got, want, 1e-4, 1e-4)
        check(case, f"param_after_{steps}_steps:{name}", ok, f"{(got - want).abs().max():.3g}")


def run(c: dict, sp: bool) -> None:
    case = f"{case_name(c)}_sp{int(sp)}"
    idx, targets = make_batch(seed=1)
    full = tiny_gpt(**c)
    full_loss = forward_backward(full, idx, targets, False)
    labkit_timer = CommTimer()
    labkit_model = parallelize_gpt(tiny_gpt(**c), AxisGroup("tp"), sequence_parallel=sp)
    with counting({"tp": labkit_timer}):
        labkit_loss = forward_backward(labkit_model, idx, targets, False)
    labkit_bytes = labkit_timer.bytes
    if sp:
        sync_sequence_parallel_grads(labkit_model)
    dt_model = parallelize_gpt_dtensor(tiny_gpt(**c), mesh, sequence_parallel=sp)
    check(case, "head_tied_to_embedding_as_one_dtensor",
          dt_model.lm_head.weight is dt_model.wte.weight and isinstance(dt_model.wte.weight, DTensor))
    losses = []
    per_module, counted = count_dtensor_collectives(
        lambda: losses.append(forward_backward(dt_model, idx, targets, True)), size)
    check(case, "loss_equals_full", close(losses[0], full_loss), f"{losses[0]} vs {full_loss}")
    check(case, "loss_equals_labkit", close(losses[0], labkit_loss))
    compare_collectives(case, sp, per_module, counted, labkit_bytes)
    _, reduced = count_dtensor_collectives(lambda: reduce_partial_grads(dt_model), size)
    collectives[case]["partial_grad_reduction"] = reduced.calls
    compare_gradients(case, dt_model, full, labkit_model)
    take_steps(case, dt_model, full)


for c in CASES:
    for sp in (False, True):
        run(c, sp)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"checks": checks, "collectives": collectives}, f, default=str)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as labkit's workers do: no C++ static destructors racing gloo's threads ("terminate called ...")
