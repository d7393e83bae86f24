"""Pipeline parallelism from scratch: the GPT cut into stages, micro-batches flowing through them.

Each of ``p`` ranks holds a contiguous slice of the blocks (a *stage*): stage 0 also the embeddings,
the last stage also the final LayerNorm, the output layer and the loss. A forward pass is a relay:
stage s receives activations (micro_batch, T, n_embd) from stage s − 1, runs its blocks and sends the
result to s + 1; the backward pass relays the gradients of those activations the other way. Nothing
else crosses a stage boundary, which is why pipelines stretch across the slowest links of a cluster.

One batch through p stages would leave all but one rank idle at any moment, so the batch is split
into ``m`` micro-batches that follow each other down the pipe. What is left idle, the *bubble*, is the
filling and draining at both ends: p − 1 slots of each stage's m + p − 1, so the idle share is

    bubble = (p − 1) / (m + p − 1)            (GPipe and 1F1B alike: more micro-batches, less bubble)

The schedules differ in memory. **GPipe** (all forward, all backward) runs m forwards before the first
backward, so every stage holds the activations of all m micro-batches at once. **1F1B**
(PipeDream-Flush, Megatron's default) starts each micro-batch's backward as soon as it can:

* *warm-up*: stage s runs min(p − s − 1, m) forwards, just enough to fill the pipe below it;
* *steady state*: one forward, then one backward, the backward freeing what its forward kept;
* *cool-down*: the backwards left over, draining the pipe.

So stage s holds at most min(p − s, m) micro-batches' activations, whatever m is: the bubble shrinks
with more micro-batches, the memory does not grow. Each micro-batch's loss is divided by m, so the
gradients add up to one step of the mean loss, exactly as gradient accumulation would.

The output layer shares its weight with the token embedding (weight tying), but with p > 1 they sit
on the first and the last stage. Each keeps its own copy; after backward the two gradients are summed
over a group of exactly those two ranks, so both copies take the same update (as Megatron does).

Sends are asynchronous (``comm.collectives.isend``): a stage never waits to hand work on, only to receive it,
which is what makes the schedules deadlock-free. (A blocking send on gloo returns only once the receiver has
asked for the message, so two neighbours each sending first would wait for each other for ever.) Each send is
counted on the ``CommTimer`` when launched, each receive (``comm.collectives.irecv``) timed from asking to having
(waiting for a neighbour).
"""
from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.comm import collectives
from labkit.comm.axes import AxisGroup, process_group
from labkit.metrics.memory import count_saved_bytes
from labkit.model.gpt import GPT

SCHEDULES = ("gpipe", "1f1b")

PIPELINE = AxisGroup("pp")  # the stages' sends: global ranks (the default group), counted on the pp axis


def stage_layers(n_layer: int, n_stages: int, ends: tuple[float, float] = (0.0, 0.0)) -> list[range]:
    """The blocks of each stage, contiguous, so that the costliest stage costs as little as it can.

    A block costs 1; ``ends`` is what the first stage carries besides its blocks (the embedding) and the last (the
    final LayerNorm, the output layer and the loss), in blocks. Each stage gets as many blocks as fit under the
    smallest cost that holds them all; then blocks are taken back, one at a time, from the costliest stage (the
    later one on a tie) until they add up to ``n_layer``. With ``ends`` (0, 0) that is the even split, earlier
    stages taking one more when it does not divide; a heavy head gives the last stage fewer blocks, as Megatron's
    uneven first and last stages and torchtitan's layer splits do. :func:`partition` takes ``ends`` from a shape."""
    if n_stages < 1 or n_layer < n_stages:
        raise ValueError(f"cannot split {n_layer} blocks into {n_stages} pipeline stages: every stage needs at least "
                         f"one block (n_layer >= parallel.pp.degree >= 1)")
    extra = [0.0] * n_stages
    extra[0] += ends[0]
    extra[-1] += ends[1]
    fits = [max(1, math.floor(limit - x + 1e-9)) for limit in _cost_limits(n_layer, extra) for x in extra]
    caps = next(fits[i:i + n_stages] for i in range(0, len(fits), n_stages) if sum(fits[i:i + n_stages]) >= n_layer)
    sizes = list(caps)
    while sum(sizes) > n_layer:
        k = max((s for s in range(n_stages) if sizes[s] > 1), key=lambda s: (round(sizes[s] + extra[s], 9), s))
        sizes[k] -= 1
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def _cost_limits(n_layer: int, extra: list[float]) -> list[float]:
    """Every cost a stage can have (k blocks plus its extra), smallest first: the candidates for the largest one."""
    return sorted({k + x for k in range(1, n_layer + 1) for x in set(extra)})


def partition_ends(shape) -> tuple[float, float]:
    """The first and the last stage's extra work, in blocks, from the counted training FLOPs per token
    (:func:`labkit.model.flops.part_flops_per_token`): the embedding (a lookup, 0) and the head."""
    from labkit.model.flops import part_flops_per_token

    parts = part_flops_per_token(shape)
    return parts["embedding"] / parts["block"], parts["head"] / parts["block"]


def partition(shape, n_stages: int) -> list[range]:
    """The blocks of each of ``n_stages`` stages of a model of this ``shape``, balanced on counted cost
    (:func:`stage_layers` with :func:`partition_ends`): the one split every part of labkit uses. ``shape`` is a
    :class:`~labkit.model.gpt.GPTShape` or anything with its fields (a dict too)."""
    shape = SimpleNamespace(**shape) if isinstance(shape, dict) else shape
    return stage_layers(shape.n_layer, n_stages, partition_ends(shape))


def describe_partition(shape, n_stages: int) -> list[dict]:
    """Each stage's blocks and counted cost (in blocks): what a run reports of its split."""
    first, last = partition_ends(shape)
    layers = partition(shape, n_stages)
    return [{"stage": s, "blocks": [r.start, r.stop - 1], "n_blocks": len(r),
             "cost_blocks": round(float(len(r)) + (first if s == 0 else 0) + (last if s == n_stages - 1 else 0), 4)}
            for s, r in enumerate(layers)]


class GPTStage(nn.Module):
    """One stage's slice of a GPT. ``embed`` and ``head`` are the GPT's own functions over the same
    attribute names, so a stage computes exactly what the same layers compute in the whole model."""

    embed = GPT.embed
    head = GPT.head

    def __init__(self, shape, stage: int, n_stages: int, layers: range, parts: nn.ModuleDict):
        super().__init__()
        self.shape, self.stage, self.n_stages, self.layers = shape, stage, n_stages, layers
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.position_ids = None  # GPT.embed's: a stage holds whole sequences
        for name, module in parts.items():
            setattr(self, name, module)

    @classmethod
    def from_gpt(cls, model: GPT, stage: int, n_stages: int) -> "GPTStage":
        """Copy stage ``stage``'s layers out of ``model`` (which every rank built from the same seed; the trainer
        builds it on the meta device, so the copy is of shapes, made real afterwards: ``labkit.model.init``).

        The parts are deep-copied together, so with one stage the tie between ``wte`` and ``lm_head`` survives
        the copy; with several, the last stage's ``lm_head.weight`` becomes its own Parameter (equal to wte's)."""
        layers = partition(model.shape, n_stages)[stage]
        parts = {}
        if stage == 0:
            parts.update(wte=model.wte, wpe=model.wpe, drop=model.drop)
        parts["blocks"] = nn.ModuleList(model.blocks[i] for i in layers)
        if stage == n_stages - 1:
            parts.update(ln_f=model.ln_f, lm_head=model.lm_head, criterion=model.criterion)
        parts = copy.deepcopy(nn.ModuleDict(parts))
        for p in parts.parameters():
            p.grad = None  # the model's gradients (if it ran backward) are not this stage's
        return cls(model.shape, stage, n_stages, layers, parts)

    def gpt_name(self, name: str) -> str:
        """The name of this stage's parameter ``name`` in the whole GPT (``blocks.0.x`` → ``blocks.{first}.x``)."""
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            return f"blocks.{self.layers[int(index)]}.{rest}"
        return name

    def forward(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Stage 0 takes token ids, the others activations; the last returns the loss (logits without targets)."""
        x = self.embed(inputs) if self.is_first else inputs
        for block in self.blocks:
            x = block(x)
        if not self.is_last:
            return x
        logits = self.head(x)
        return logits if targets is None else self.criterion(logits, targets)


# ---------------------------------------------------------------- the tied embedding across stages


def tied_embedding_group(pipelines: list[list[int]]):
    """The group summing the tied embedding's gradient that this rank belongs to (None: it holds no copy).

    ``pipelines`` lists the global ranks of every pipeline in stage order (one list per data/tensor-parallel
    coordinate). **Every rank must call this, with the same list**: ``dist.new_group`` is collective over the
    whole world, even for the groups a rank is not in."""
    mine = None
    for ranks in pipelines:
        if len(ranks) < 2:
            continue
        group = dist.new_group([ranks[0], ranks[-1]])
        if dist.get_rank() in (ranks[0], ranks[-1]):
            mine = group
    return mine


def allreduce_tied_embedding(stage_module: GPTStage, group) -> None:
    """Sum wte's gradient (first stage) and lm_head's (last stage) so both copies take the same step.

    Called by the first and the last stage of a pipeline, after backward, with their group from
    :func:`tied_embedding_group`; a pipeline of one stage (a real tie) or a rank without a copy does nothing."""
    if group is None or stage_module.n_stages == 1:
        return
    weight = stage_module.wte.weight if stage_module.is_first else stage_module.lm_head.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    grad = weight.grad.to_local() if hasattr(weight.grad, "to_local") else weight.grad  # FSDP: both ends hold
    collectives.all_reduce(grad, group)  # the same dp slice of their copy


# ---------------------------------------------------------------- schedules, ideal and measured


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; labkit's are {', '.join(SCHEDULES)}")


def stage_order(p: int, m: int, schedule: str, stage: int) -> list[tuple[str, int]]:
    """The (kind, micro-batch) sequence stage ``stage`` runs: ("F", i) forward, ("B", i)
    backward."""
    _check_schedule(schedule)
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(p - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: the next forward, then the oldest backward
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]  # cool-down


def ideal_schedule(p: int, m: int, schedule: str) -> list[list[Optional[tuple[str, int]]]]:
    """The textbook grid: ``grid[stage][slot]`` is the ("F"|"B", micro-batch) run in that slot, None when idle.

    Every forward and every backward takes one slot (a real backward takes about twice a forward: that
    stretches the picture, not the bubble). A step runs as soon as what it needs is done: F(s, i) after
    F(s − 1, i), B(s, i) after B(s + 1, i). Both schedules take 2(m + p − 1) slots."""
    orders = [stage_order(p, m, schedule, s) for s in range(p)]
    finished, grid, slot = {}, [[] for _ in range(p)], 0  # finished: (stage, kind, i) → the slot it ran in
    while any(orders):
        for s, order in enumerate(orders):
            need = _needs(order[0], s, p) if order else None
            ready = bool(order) and (need is None or finished.get(need, slot) < slot)
            grid[s].append(order[0] if ready else None)
        for s, order in enumerate(orders):
            if grid[s][slot] is not None:
                finished[(s, *order.pop(0))] = slot
        slot += 1
    return grid


def _needs(step: tuple[str, int], stage: int, p: int) -> Optional[tuple[int, str, int]]:
    """What another stage must have done before ``stage`` runs ``step`` (its own order does the rest)."""
    kind, i = step
    if kind == "F":
        return (stage - 1, "F", i) if stage > 0 else None
    return (stage + 1, "B", i) if stage < p - 1 else None


def format_grid(grid) -> list[str]:
    """One text line per stage, e.g. ``F0 F1 .  B0`` ("." idle): what a notebook prints before it draws."""
    width = max((len(f"{c[0]}{c[1]}") for row in grid for c in row if c), default=1)
    return [" ".join((f"{c[0]}{c[1]}" if c else ".").ljust(width) for c in row).rstrip() for row in grid]


def ideal_bubble(p: int, m: int) -> float:
    """The idle share of a pipeline step: (p − 1) / (m + p − 1)."""
    return (p - 1) / (m + p - 1)


def peak_activations_in_flight(p: int, m: int, schedule: str, stage: int) -> int:
    """How many micro-batches' activations stage ``stage`` holds at once: m for GPipe, min(p − stage, m) for 1F1B."""
    return m if schedule == "gpipe" else min(p - stage, m)


def bubble_fraction(timelines: list[list[dict]]) -> float:
    """The measured bubble: the idle share of (stages × makespan), from each rank's ``schedule.timeline``.

    Busy time is each span's length less its wait in recv; the makespan runs from the earliest span start to the
    latest end on any rank (``time.perf_counter`` is one clock for every process of a machine)."""
    spans = [span for timeline in timelines for span in timeline]
    makespan = max(s["end"] for s in spans) - min(s["start"] for s in spans)
    busy = sum(s["end"] - s["start"] - s["wait"] for s in spans)
    return 1.0 - busy / (len(timelines) * makespan)


def span_busy_s(span: dict, clock: str = "wall") -> float:
    """A span's own work: its wall time less its wait in a receive ("wall"), or the CPU time its thread used
    ("cpu": ``time.thread_time``, the OS's per-thread clock, which does not run while the stage is descheduled —
    what the span would take with a core to itself)."""
    if clock == "cpu":
        return span["cpu"]
    return span["end"] - span["start"] - span["wait"]


def replayed_bubble(timelines: list[list[dict]], clock: str = "wall") -> float:
    """The bubble one step's own spans leave when nothing waits but for data: each stage's forwards and backwards,
    with the durations they took (:func:`span_busy_s`), replayed in the order they ran, each as soon as its stage
    is free and its input is there (F(s, i) after F(s − 1, i), B(s, i) after B(s + 1, i)), no message latency, a
    core per stage. This is what the schedule and the stages' imbalance alone leave idle; with the "wall" clock it
    is never above :func:`bubble_fraction` of the same spans (a replay waits no longer than the run did)."""
    p, done, free = len(timelines), {}, [0.0] * len(timelines)
    queues = [list(spans) for spans in timelines]
    while any(queues):
        progressed = False
        for s, queue in enumerate(queues):
            while queue:
                span = queue[0]
                need = (s - 1, "F", span["mb"]) if span["kind"] == "F" else (s + 1, "B", span["mb"])
                if 0 <= need[0] < p and need not in done:
                    break
                start = max(free[s], done.get(need, 0.0))
                free[s] = done[(s, span["kind"], span["mb"])] = start + span_busy_s(span, clock)
                queue.pop(0)
                progressed = True
        if not progressed:
            raise ValueError("the spans do not replay: a stage waits for a step no stage ran")
    busy = sum(span_busy_s(span, clock) for spans in timelines for span in spans)
    return 1.0 - busy / (p * max(free))


def expected_p2p_bytes(stage: int, p: int, m: int, activation_bytes: int) -> int:
    """Bytes stage ``stage`` sends in one step: m activations down the pipe, m gradients back up."""
    return m * activation_bytes * ((stage < p - 1) + (stage > 0))


def shared_loss(losses: list[torch.Tensor], n_stages: int, pp_group) -> float:
    """The step's mean loss on every stage: the last stage sums its micro-batches' shares (each loss / m) and
    broadcasts it over ``pp_group`` (None: the world, the pipeline then being ranks 0..p − 1); the others pass []."""
    loss = torch.stack(losses).detach().sum().float() if losses else torch.zeros(())
    if n_stages > 1:
        group = process_group(pp_group)
        last = n_stages - 1 if group is None else dist.get_process_group_ranks(group)[-1]
        loss = loss.to("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        collectives.broadcast(loss, last, pp_group)
    return loss.item()


class ActivationPeak:
    """A stage's activation peak, read by an allocator-level instrument over the real schedule.

    ``probe`` returns the bytes allocated now (:meth:`labkit.metrics.memory.PhasePeaks.current_bytes`: the
    allocation tracker's live storages on CPU, the CUDA allocator's count on a GPU); None: not a tracked step.
    Read when the schedule starts and after every forward until the first backward. Until then the stage has
    made no gradient and freed nothing it will keep, so what has grown is the micro-batches' activations alone;
    and it is the peak: neither schedule holds more micro-batches later (1F1B runs one backward per forward)."""

    def __init__(self, probe):
        self.probe, self.peak = probe, None
        self.base = probe() if probe is not None else None

    def after_forward(self) -> None:
        if self.base is not None:
            self.peak = max(self.peak or 0, self.probe() - self.base)

    def backward_begins(self) -> None:
        self.base = None  # gradients are made from here on: the reading would count them as activations


class PipelineSchedule:
    """Runs one training step's forwards and backwards of a stage, in GPipe or 1F1B order.

    ``prev_rank``/``next_rank`` are the global ranks of the neighbouring stages (None at the ends); ``pp_group``
    is the pipeline's process group (None: the world) over which the last stage broadcasts the loss;
    ``tied_group`` (:func:`tied_embedding_group`) sums the tied embedding's gradient after backward.
    ``autocast`` is a context factory wrapped around each forward (mixed precision); ``no_sync`` one wrapped
    around every backward but the stage's last, so a data-parallel strategy that communicates from backward
    hooks does so once per step, as under gradient accumulation."""

    def __init__(self, stage_module: GPTStage, stage: int, n_stages: int, prev_rank: Optional[int] = None,
                 next_rank: Optional[int] = None, schedule: str = "1f1b",
                 pp_group=None, tied_group=None, autocast=nullcontext, no_sync=nullcontext):
        _check_schedule(schedule)
        self.module, self.stage, self.n_stages, self.schedule = stage_module, stage, n_stages, schedule
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.pp_group, self.tied_group, self.autocast, self.no_sync = pp_group, tied_group, autocast, no_sync
        self.dtype = next(stage_module.parameters()).dtype
        self.timeline: list[dict] = []
        self.max_in_flight = self.p2p_bytes = 0
        # this stage's share (and seconds) of the last run spent waiting: its bubble
        self.idle_share = self.idle_s = 0.0
        self.activation_bytes = None  # what one micro-batch's forward saves for backward here (measured once)
        self.memory_probe = None  # bytes allocated now (PhasePeaks.current_bytes) on a tracked step, else None
        self.activation_peak_bytes = None  # the most the stage's held micro-batches took, read by the probe

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward and backward of every micro-batch (x, y); gradients accumulate into ``.grad``.

        Every stage is given the same list (only stage 0 reads x, only the last stage y). Returns
        the mean loss over the micro-batches, the same float on every stage."""
        self.timeline, self.max_in_flight, self.p2p_bytes = [], 0, 0
        self._held, self._sends, self._losses, self._micro_batches = {}, [], [], micro_batches
        m = len(micro_batches)
        order, began = stage_order(self.n_stages, m, self.schedule, self.stage), time.perf_counter()
        activations = ActivationPeak(self.memory_probe)
        for kind, i in order:
            start, cpu = time.perf_counter(), time.thread_time()
            if kind == "F":
                wait = self._forward(i, m)
                activations.after_forward()
            else:
                activations.backward_begins()
                with nullcontext() if (kind, i) == order[-1] else self.no_sync():
                    wait = self._backward(i)
            self.timeline.append({"kind": kind, "mb": i, "start": start, "end": time.perf_counter(),
                                  "wait": wait, "cpu": time.thread_time() - cpu})
        for work, _ in self._sends:
            work.wait()
        busy = sum(s["end"] - s["start"] - s["wait"] for s in self.timeline)
        wall = time.perf_counter() - began
        self.idle_s = max(0.0, wall - busy)
        self.idle_share = self.idle_s / max(wall, 1e-12)
        self.activation_peak_bytes = activations.peak
        self._sends, self._micro_batches = [], None  # nothing of this step outlives it
        allreduce_tied_embedding(self.module, self.tied_group)
        return shared_loss(self._losses, self.n_stages, self.pp_group)

    def _forward(self, i: int, m: int) -> float:
        x, y = self._micro_batches[i]
        wait = 0.0
        if not self.is_first:
            x, wait = self._recv((x.size(0), x.size(1), self.module.shape.n_embd), self.prev_rank)
            x.requires_grad_(True)
        counting = self.activation_bytes is None
        with self.autocast(), count_saved_bytes(self.module.parameters()) if counting else nullcontext() as saved:
            out = self.module(x, y if self.is_last else None)
        if counting:  # × the micro-batches held at once (max_in_flight): this stage's activation memory
            self.activation_bytes = saved.total
        if self.is_last:
            out = out / m  # each micro-batch's share of the mean loss
            self._losses.append(out.detach())
        else:
            self._send(out.detach(), self.next_rank)
        self._held[i] = (x, out)  # what backward needs: autograd keeps this micro-batch's activations alive
        self.max_in_flight = max(self.max_in_flight, len(self._held))
        return wait

    def _backward(self, i: int) -> float:
        x, out = self._held.pop(i)  # popping frees the activations once backward is done
        wait = 0.0
        if self.is_last:
            out.backward()
        else:
            grad, wait = self._recv(out.shape, self.next_rank)
            out.backward(grad)
        if not self.is_first:
            self._send(x.grad, self.prev_rank)
        return wait

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        if tensor.dtype != self.dtype:
            raise RuntimeError(f"stage {self.stage} would send {tensor.dtype}, its neighbour expects {self.dtype}")
        self.p2p_bytes += tensor.numel() * tensor.element_size()
        tensor = tensor.contiguous()
        self._sends.append((collectives.isend(tensor, dst, PIPELINE), tensor))  # it must live until sent

    def _recv(self, shape, src: int) -> tuple[torch.Tensor, float]:
        tensor = torch.empty(shape, dtype=self.dtype, device=next(self.module.parameters()).device)
        asked = time.perf_counter()
        collectives.irecv(tensor, src, PIPELINE).wait()  # the time here is this stage's share of the bubble
        return tensor, time.perf_counter() - asked


@torch.no_grad()
def relay_loss(stage_module: GPTStage, x: torch.Tensor, y: torch.Tensor, prev_rank: Optional[int],
               next_rank: Optional[int], pp_group=None, autocast=nullcontext) -> float:
    """Forward only, one micro-batch down the pipe (an evaluation): each stage receives, runs its layers and
    sends on; the last stage's loss, on every stage. Nothing it sends is counted: an evaluation runs between steps,
    where no timer counts the pp axis (:func:`labkit.comm.axes.counting`)."""
    dtype = next(stage_module.parameters()).dtype
    if not stage_module.is_first:
        x = torch.empty(x.size(0), x.size(1), stage_module.shape.n_embd, dtype=dtype, device=y.device)
        collectives.irecv(x, prev_rank).wait()
    with autocast():
        out = stage_module(x, y if stage_module.is_last else None)
    if not stage_module.is_last:
        collectives.isend(out.to(dtype).contiguous(), next_rank).wait()
    return shared_loss([out.float()] if stage_module.is_last else [], stage_module.n_stages, pp_group)
