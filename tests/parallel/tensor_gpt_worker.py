"""One rank of tests/parallel/test_tensor.py's whole-GPT test (torchrun, gloo): labkit's tensor-parallel GPT,
with and without sequence parallelism, against the full model every rank also computes from the same seed.

For each tiny GPT (attention naive/sdpa × bias on/off): the loss, every parameter's gradient slice, three
AdamW steps on the local shards, the wire bytes of one forward+backward per part against
``labkit.parallel.tp.volume``, and which parameters sequence parallelism flags. Writes OUT/rankN.json:
{case: {check: bool}}, and prints what failed with its largest difference."""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from tp_cases import BATCH, BLOCK, CASES, EMBD, HEADS, LAYERS, VOCAB, case_name, close, labkit_shard, tiny_gpt
from tp_cases import batch as make_batch

from labkit.comm.axes import AxisGroup, counting
from labkit.metrics.timers import CommTimer
from labkit.model.gpt import GPT, GPTShape
from labkit.parallel.tp.sequence import sequence_parallel_params, sync_sequence_parallel_grads
from labkit.parallel.tp.model import parallelize_gpt
from labkit.parallel.tp.volume import sequence_parallel_sync_bytes, tp_wire_bytes

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
results: dict[str, dict[str, bool]] = {}
STEPS = 3


def check(case: str, name: str, ok: bool, detail: str = "") -> None:
    results.setdefault(case, {})[name] = bool(ok)
    if not ok:
        print(f"rank {rank} {case} {name} FAILED {detail}", file=sys.stderr)


def time_parts_separately(model, kind: str) -> dict[str, CommTimer]:
    """One CommTimer per part of the split model: each part's layers hold the world's group under a name of the
    part's own (an axis to itself), so that counting() sends each part's collectives to its timer."""
    parts = {"embedding": [model.wte], "head": [model.lm_head], "loss": [model.criterion]}
    for i, block in enumerate(model.blocks):
        parts[f"block{i}"] = [module for module in block.modules() if hasattr(module, "group")]
    for part, modules in parts.items():
        for module in modules:
            module.group = AxisGroup(f"{kind}:{part}")
    return {part: CommTimer() for part in parts}


def train_step(model, optimizer, idx, targets, sequence_parallel: bool, timers: dict[str, CommTimer]):
    """One step, each axis of ``timers`` counted on its timer; "sync" counts sequence parallelism's gradient sum."""
    optimizer.zero_grad(set_to_none=True)
    with counting(timers):
        _, loss = model(idx, targets)
        loss.backward()
        if sequence_parallel:
            sync_sequence_parallel_grads(model, AxisGroup("sync"))
    optimizer.step()
    return loss.detach()


def grads_at_step_zero(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def run_case(case: dict) -> None:
    name = case_name(case)
    full = tiny_gpt(**case)
    split = {"tp": parallelize_gpt(copy.deepcopy(full)),
             "sp": parallelize_gpt(copy.deepcopy(full), sequence_parallel=True)}
    timers = {kind: time_parts_separately(model, kind) for kind, model in split.items()}
    sync_timers = {kind: CommTimer() for kind in split}
    optimizers = {kind: torch.optim.AdamW(model.parameters(), lr=1e-2) for kind, model in split.items()}
    full_optimizer = torch.optim.AdamW(full.parameters(), lr=1e-2)
    for step in range(STEPS):
        idx, targets = make_batch(seed=step + 1)
        full_loss = train_step(full, full_optimizer, idx, targets, False, {})
        for kind, model in split.items():
            before = {part: t.bytes for part, t in timers[kind].items()}
            # grads of step 0 are checked before the optimizer moves the weights: capture them in the step
            counted = {**{f"{kind}:{part}": t for part, t in timers[kind].items()}, "sync": sync_timers[kind]}
            loss = train_step(model, optimizers[kind], idx, targets, kind == "sp", counted)
            check(name, f"{kind}_loss_step{step}", close(loss, full_loss), f"{loss} vs {full_loss}")
            if step == 0:
                compare_bytes(name, kind, {part: t.bytes - before[part] for part, t in timers[kind].items()},
                              sync_timers[kind].bytes, case["bias"])
    # The key bias's gradient is zero in exact arithmetic (each query's softmax is invariant to it): what
    # is left is rounding noise ~1e-11, different in the split model, and Adam's step lr·m/(√v + ε) turns a
    # noise gradient g into a step of about lr·|g|/ε ~ 1e-5. A wrong slice or a missed sync moves ~lr = 1e-2.
    for kind, model in split.items():
        full_params = dict(full.named_parameters())
        for pname, p in model.named_parameters():
            want = labkit_shard(pname, full_params[pname].detach(), rank, size)
            check(name, f"{kind}_param_after_{STEPS}_steps:{pname}", close(p.detach(), want, 1e-4, 1e-4),
                  f"max diff {(p.detach() - want).abs().max():.3g}")
    check_flagged(name, split["sp"], case["bias"])


def check_gradients(case: str) -> None:
    """Gradients of one forward+backward (no optimizer step): every parameter's slice equals the full model's;
    the tied embedding/head is one parameter whose gradient is the full wte.weight.grad's rows."""
    c = next(c for c in CASES if case_name(c) == case)
    full = tiny_gpt(**c)
    idx, targets = make_batch(seed=1)
    _, loss = full(idx, targets)
    loss.backward()
    full_grads = {n: p.grad for n, p in full.named_parameters()}
    for kind, sp in (("tp", False), ("sp", True)):
        model = parallelize_gpt(tiny_gpt(**c), sequence_parallel=sp)
        check(case, f"{kind}_head_tied_to_embedding", model.lm_head.weight is model.wte.weight)
        _, loss_tp = model(idx, targets)
        loss_tp.backward()
        if sp:
            sync_sequence_parallel_grads(model)
        check(case, f"{kind}_loss", close(loss_tp, loss), f"{loss_tp} vs {loss}")
        names = [n for n, _ in model.named_parameters()]
        check(case, f"{kind}_same_parameter_names", names == list(full_grads), f"{names}")
        for pname, p in model.named_parameters():
            want = labkit_shard(pname, full_grads[pname], rank, size)
            check(case, f"{kind}_grad:{pname}", close(p.grad, want), f"max diff {(p.grad - want).abs().max():.3g}")


def compare_bytes(case: str, kind: str, sent: dict[str, int], sync_sent: int, bias: bool) -> None:
    want = tp_wire_bytes(BATCH, BLOCK, EMBD, LAYERS, size, 4, sequence_parallel=kind == "sp")
    for part in ("embedding", "head", "loss"):
        check(case, f"{kind}_bytes_{part}", sent[part] == want[part], f"{sent[part]} vs {want[part]}")
    for i in range(LAYERS):
        check(case, f"{kind}_bytes_block{i}", sent[f"block{i}"] == want["per_layer"], f"{sent} vs {want}")
    check(case, f"{kind}_bytes_total", sum(sent.values()) == want["total"], f"{sum(sent.values())} vs {want}")
    want_sync = sequence_parallel_sync_bytes(EMBD, LAYERS, BLOCK, bias, size) if kind == "sp" else 0
    check(case, f"{kind}_bytes_sync", sync_sent == want_sync, f"{sync_sent} vs {want_sync}")


def check_flagged(case: str, model, bias: bool) -> None:
    """Sequence parallelism flags exactly the replicated parameters used on sequence shards."""
    flagged = {id(p) for p in sequence_parallel_params(model)}
    names = sorted(n for n, p in model.named_parameters() if id(p) in flagged)
    want = ["wpe.weight", "ln_f.weight"] + (["ln_f.bias"] if bias else [])
    for i in range(LAYERS):
        want += [f"blocks.{i}.ln_1.weight", f"blocks.{i}.ln_2.weight"]
        if bias:
            want += [f"blocks.{i}.ln_1.bias", f"blocks.{i}.ln_2.bias", f"blocks.{i}.attn.proj.bias",
                     f"blocks.{i}.mlp.proj.bias"]
    check(case, "sp_flags_exactly_the_replicated_parameters_on_shards", names == sorted(want), f"{names}")


def check_recomputation() -> None:
    """With activation checkpointing the split model still equals the full one, and the CommTimer counts the
    recomputed collectives ``tp_wire_bytes(recompute=...)`` predicts (its docstring: the early stop)."""
    idx, targets = make_batch(seed=1)
    for recompute in ("selective", "full"):
        torch.manual_seed(0)
        full = GPT(GPTShape(vocab_size=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD, bias=True,
                            attention="sdpa", recompute=recompute))
        _, loss = full(idx, targets)
        loss.backward()
        full_grads = {n: p.grad for n, p in full.named_parameters()}
        for sp in (False, True):
            case, timer = f"recompute_{recompute}", CommTimer()
            model = parallelize_gpt(copy.deepcopy(full), AxisGroup("tp"), sequence_parallel=sp)
            model.zero_grad(set_to_none=True)
            with counting({"tp": timer}):
                _, loss_tp = model(idx, targets)
                loss_tp.backward()
            want = tp_wire_bytes(BATCH, BLOCK, EMBD, LAYERS, size, 4, sp, recompute)["total"]
            check(case, f"sp{int(sp)}_bytes", timer.bytes == want, f"{timer.bytes} vs {want}")
            if sp:
                sync_sequence_parallel_grads(model)
            grads_ok = all(close(p.grad, labkit_shard(n, full_grads[n], rank, size))
                           for n, p in model.named_parameters())
            check(case, f"sp{int(sp)}_loss_and_grads", close(loss_tp, loss) and grads_ok)


def check_block_size_must_divide() -> None:
    model = GPT(GPTShape(vocab_size=VOCAB, block_size=BLOCK * size + 1, n_layer=1, n_head=HEADS, n_embd=EMBD))
    try:
        parallelize_gpt(model, sequence_parallel=True)
        ok = False
    except ValueError as error:
        ok = "block_size" in str(error)
    check("errors", "sp_refuses_a_block_size_the_tp_degree_does_not_divide", ok)


for c in CASES:
    check_gradients(case_name(c))
    run_case(c)
check_recomputation()
check_block_size_must_divide()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as labkit's workers do: no C++ static destructors racing gloo's threads ("terminate called ...")
