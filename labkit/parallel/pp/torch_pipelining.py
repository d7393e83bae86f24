"""The same pipeline driven by torch's own engine, ``torch.distributed.pipelining``, beside labkit's.

The split is labkit's (:class:`labkit.parallel.pp.pipeline.GPTStage`); what torch brings is the schedule
runner: ``PipelineStage`` wraps a stage's module and owns its sends and receives, ``ScheduleGPipe`` and
``Schedule1F1B`` run the micro-batches in the order labkit's docstring describes, and
``ScheduleInterleaved1F1B`` runs a schedule labkit does not write: **interleaved 1F1B** (Narayanan et
al. 2021). Each rank holds v stages instead of one, not contiguous but strided: with p ranks the model
is cut into v·p stages and rank r holds stages r, r + p, r + 2p, ... A micro-batch then travels round
the ranks v times, each visit v times shorter, so the fill and drain shrink v-fold:

    bubble = (p − 1) / (v·m + p − 1)           (v = 1: the plain schedules)

at the price of v times as many messages. Build the stages with :func:`interleaved_stages`.

The differences worth knowing when reading labkit's and torch's side by side:

* torch computes the loss itself, outside the module: the last stage's module returns logits and the
  schedule calls ``loss_fn(logits, targets)`` on them.
* torch scales gradients after the fact: with ``scale_grads=True`` (its default) it divides every
  ``.grad`` of the stage by m once the last backward is done, which would also divide gradients
  accumulated before the step. labkit divides each micro-batch's loss by m before its backward. Here
  ``scale_grads=False`` and the loss function divides by m, so torch does labkit's arithmetic (the
  tests find the gradients bitwise equal).
* torch's ``Schedule1F1B`` refuses fewer micro-batches than stages (m < p); labkit's runs them (all
  warm-up, no steady state). Interleaved 1F1B needs m to be a multiple of max(1, m // p).
* torch's first step exchanges no shapes here: each stage is given its input and output shapes up front
  (static metadata), as labkit's schedule knows them.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Optional, Union

import torch
import torch.nn as nn

from labkit.comm.axes import process_group
from labkit.parallel.pp.pipeline import ActivationPeak, GPTStage, allreduce_tied_embedding, shared_loss

TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def interleaved_stages(model, stage: int, n_stages: int, per_rank: int = 2) -> list[GPTStage]:
    """The ``per_rank`` stages rank ``stage`` of p = ``n_stages`` holds: stages stage, stage + p, ... of per_rank·p."""
    return [GPTStage.from_gpt(model, stage + k * n_stages, per_rank * n_stages) for k in range(per_rank)]


class _Autocast(nn.Module):
    """The stage run under an autocast context (torch calls the module itself, so the context goes inside it)."""

    def __init__(self, stage_module: nn.Module, autocast):
        super().__init__()
        self.stage_module, self.autocast = stage_module, autocast

    def forward(self, *args):
        with self.autocast():
            return self.stage_module(*args)


class TorchPipelineSchedule:
    """torch's GPipe / 1F1B / interleaved 1F1B over this rank's stage(s), with labkit's ``PipelineSchedule`` interface.

    ``stage_module`` is one :class:`GPTStage`, or for "interleaved_1f1b" the list :func:`interleaved_stages` makes;
    ``stage``/``n_stages`` count ranks. ``prev_rank``/``next_rank`` are accepted so the two are interchangeable, but
    torch finds the neighbours itself: stage s talks to the ranks at positions s ± 1 of ``pp_group`` (None: world)."""

    def __init__(self, stage_module: Union[GPTStage, list[GPTStage]], stage: int, n_stages: int,
                 prev_rank: Optional[int] = None, next_rank: Optional[int] = None, schedule: str = "1f1b",
                 pp_group=None, tied_group=None, autocast=nullcontext):
        if schedule not in TORCH_SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; torch's are {', '.join(TORCH_SCHEDULES)}")
        self.modules = list(stage_module) if isinstance(stage_module, (list, tuple)) else [stage_module]
        if (schedule == "interleaved_1f1b") != (len(self.modules) > 1) or (len(self.modules) > 1 and n_stages < 2):
            raise ValueError("interleaved 1F1B takes several stages per rank (interleaved_stages) over 2 or more "
                             "ranks; gpipe and 1f1b take one")
        self.stage, self.n_stages, self.schedule = stage, n_stages, schedule
        self.is_first, self.is_last = self.modules[0].is_first, self.modules[-1].is_last
        self.pp_group, self.tied_group, self.autocast = pp_group, tied_group, autocast
        first_parameter = next(self.modules[0].parameters())
        self.dtype, self.device = first_parameter.dtype, first_parameter.device
        self._built_for, self._torch_schedule = None, None
        self.timeline: list[dict] = []  # as labkit's schedule keeps it (torch receives between chunks: wait 0)
        self.idle_share = self.idle_s = 0.0
        self.memory_probe = None  # as labkit's schedule: read between forwards on a tracked step
        self.activation_peak_bytes, self._activations = None, None

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward and backward of every micro-batch (x, y) in torch's schedule; the mean loss, on every stage."""
        schedule = self._schedule_for(len(micro_batches), micro_batches[0][0])
        xs, ys = (torch.cat(part) for part in zip(*micro_batches))  # torch splits them again into the same m
        losses = []
        inputs = (xs,) if self.is_first else ()
        targets = {"target": ys, "losses": losses} if self.is_last else {}
        self.timeline, began = [], time.perf_counter()
        self._activations = ActivationPeak(self.memory_probe if len(self.modules) == 1 else None)
        schedule.step(*inputs, **targets, return_outputs=False)
        self.activation_peak_bytes = self._activations.peak
        wall = time.perf_counter() - began
        self.idle_s = max(0.0, wall - sum(span["end"] - span["start"] for span in self.timeline))
        self.idle_share = self.idle_s / max(wall, 1e-12)
        tied = self.modules[0] if self.is_first else self.modules[-1]  # the copy of the tied embedding held here
        allreduce_tied_embedding(tied, self.tied_group)
        return shared_loss(losses, self.n_stages, self.pp_group)

    def _schedule_for(self, m: int, x: torch.Tensor):
        """torch's schedule is built for one micro-batch count and shape: build it again when they change."""
        if self.schedule == "1f1b" and m < self.n_stages:
            raise ValueError(f"torch's Schedule1F1B needs at least as many micro-batches as stages (m={m} < "
                             f"p={self.n_stages}); labkit's 1F1B (parallel.pp.impl: labkit) or GPipe runs it")
        key = (m, tuple(x.shape))
        if self._built_for != key:
            from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                      ScheduleInterleaved1F1B)

            stages = [PipelineStage(self._autocast(module), module.stage, module.n_stages, self.device,
                                    *self._example_tensors(module, x), group=process_group(self.pp_group))
                  for module in self.modules]
            if len(stages) == 1:  # one stage per rank: its chunks are timed as labkit's are (interleaved: not)
                self._time_chunks(stages[0])
            loss_fn = self._loss_fn(m)
            if self.schedule == "interleaved_1f1b":
                self._torch_schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False)
            else:
                runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.schedule]
                self._torch_schedule = runner(stages[0], m, loss_fn=loss_fn, scale_grads=False)
            self._built_for = key
        return self._torch_schedule

    def _autocast(self, module: nn.Module) -> nn.Module:
        return module if self.autocast is nullcontext else _Autocast(module, self.autocast)

    def _loss_fn(self, m: int):
        criterion = self.modules[-1].criterion if self.is_last else None

        def share_of_mean_loss(logits, targets):  # each micro-batch's share, as labkit's schedule computes it
            start, cpu = time.perf_counter(), time.thread_time()
            loss = criterion(logits, targets) / m
            if self.timeline:  # torch computes the loss after the forward chunk: part of that forward's work
                span = self.timeline[-1]
                span["end"] += time.perf_counter() - start
                span["cpu"] += time.thread_time() - cpu
            return loss
        return share_of_mean_loss

    def _time_chunks(self, stage) -> None:
        """Record every forward and backward chunk torch runs on ``stage`` as a span of ``self.timeline`` (kind,
        micro-batch, start, end, CPU time; wait 0: torch's schedule waits for its messages between chunks, so a
        stage's idle time is what lies between its spans)."""
        def timed(kind: str, run):
            def chunk(chunk_id: int, *args, **kwargs):
                if kind == "B":
                    self._activations.backward_begins()
                start, cpu = time.perf_counter(), time.thread_time()
                out = run(chunk_id, *args, **kwargs)
                if kind == "F":
                    self._activations.after_forward()
                self.timeline.append({"kind": kind, "mb": chunk_id, "start": start, "end": time.perf_counter(),
                                      "wait": 0.0, "cpu": time.thread_time() - cpu})
                return out
            return chunk
        stage.forward_one_chunk = timed("F", stage.forward_one_chunk)
        stage.backward_one_chunk = timed("B", stage.backward_one_chunk)

    def _example_tensors(self, module: GPTStage, x: torch.Tensor):
        """A micro-batch's input and output, on the meta device: the shapes torch would otherwise ask around for.

        torch also reads ``requires_grad`` off them: an activation given without it is sent forward but its
        gradient is never sent back (stage 0 then fails in backward with "Output gradient: ('None',)")."""
        def example(width):
            return torch.empty(x.size(0), x.size(1), width, dtype=self.dtype, device="meta", requires_grad=True)
        inputs = x.to("meta") if module.is_first else example(module.shape.n_embd)
        return inputs, example(module.lm_head.weight.shape[0] if module.is_last else module.shape.n_embd)  # tp: a slice
