"""The training loop, one worker per rank. Short on purpose: every decision lives elsewhere.

Each step: for every micro-batch, forward and backward (communicating only on the last one,
when gradient accumulation is on), then one optimizer step. Around it, measurement: where the
time went (data, compute, communication), how many model FLOPs that was, and what fraction of
the device's peak (MFU). Rank 0 writes one JSON line per step to ``RUN_DIR/events.jsonl``.

Which strategy, precision, attention kernel or dataset runs is chosen by the config through
small registries (``labkit.parallel``, ``labkit.precision``, ``labkit.model.attention``,
``labkit.data``), so this file does not change when one is added.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from labkit.comm.network import current as current_network
from labkit.comm.network import network_from_config, set_network
from labkit.compile import CompileVerifier, compile_in_place
from labkit.config import Config, grad_accum_steps, resolve_auto
from labkit.data import ShardedLoader, build_datasets, validation_floor, validation_loader
from labkit.fault.inject import restart_attempt
from labkit.fault.recovery import recovery_report
from labkit.fault.tolerance import FaultTolerance
from labkit.distributed import DistEnv, exit_when_orphaned, init_distributed, shutdown_distributed
from labkit.hardware import device_peak
from labkit.metrics import EventWriter, StepClock, achieved_tflops, mfu
from labkit.metrics.timers import PartTimes
from labkit.metrics.diagnosis import Watchdog
from labkit.metrics.events import attempt_ends_early, first_event_time, write_json
from labkit.metrics.memory import memory_capacity_bytes, memory_kind, peak_memory_bytes
from labkit.model import GPT, GPTShape, count_params, flops_per_token
from labkit.optim import lr_at, set_lr
from labkit.parallel import build_strategy
from labkit.precision import Precision, build_precision, prepare_model, scaler_state

STEP_FIELDS = ["loss", "step_time_s", "comm_s", "comm_bytes", "max_mem_bytes"]


class Stopped(Exception):
    """Raised in a worker when it is asked to stop (SIGTERM from the agent, or Ctrl-C)."""


@dataclass
class Trainer:
    cfg: Config
    env: DistEnv
    module: torch.nn.Module  # what we call: the strategy-wrapped model
    model: torch.nn.Module  # the bare model underneath
    strategy: object
    optimizer: torch.optim.Optimizer
    precision: Precision
    loader: ShardedLoader
    accum: int
    activation_bytes: int | None = None  # what forward saves for backward, per micro-batch (measured once)
    bookkeeping: PartTimes = field(default_factory=PartTimes)  # host time of the loop's own measuring

    def step(self, clock: StepClock, step: int = 0, poison: bool = False, skip: bool = False,
             slow_s: float = 0.0) -> dict:
        """One optimizer step over ``accum`` micro-batches; returns this rank's measurements.

        ``poison`` makes this rank's gradients NaN (fault injection); ``skip`` drops the update on
        purpose. A non-finite global gradient norm always drops the update: a NaN is never applied.
        ``slow_s`` adds compute time on this rank (an injected straggler).
        """
        clock.reset()
        start = time.perf_counter()
        if slow_s:
            with clock.phase("fwd_bwd"):
                time.sleep(slow_s)
        loss = self._forward_backward(clock, poison)
        with clock.phase("sync"):
            self.strategy.sync_gradients(self.module)
        with clock.phase("optimizer"):
            grad_norm, skipped, scaler = self._optimizer_step(skip)
        with clock.phase("sync"):
            self.strategy.after_optimizer_step(self.model, step)
        with clock.phase("optimizer"):
            with self.bookkeeping.part("memory accounting"):
                memory = self.strategy.memory_breakdown(self.model, self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss, "grad_norm": grad_norm, "skipped": skipped, **scaler, **memory,
                "activation_bytes": self.activation_bytes, **self._timings(start, clock)}

    def _forward_backward(self, clock: StepClock, poison: bool = False) -> float:
        """Accumulate gradients over the micro-batches, communicating only after the last one."""
        loss_sum = 0.0
        for micro in range(self.accum):
            with clock.phase("data"):
                x, y = (t.to(self.env.torch_device) for t in self.loader.next_micro_batch())
            last = micro == self.accum - 1
            counting = self.activation_bytes is None  # once: the first micro-batch of the run
            with clock.phase("fwd_bwd"), (nullcontext() if last else self.strategy.no_sync(self.module)):
                with self.precision.autocast(), (count_saved_bytes(self.model.parameters()) if counting else nullcontext()) as saved:
                    _, loss = self.module(x, y)
                if counting:
                    self.activation_bytes = saved.total
                loss = loss / self.accum
                if poison and last:
                    loss = loss * float("nan")
                scaler = self.precision.scaler
                (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.item()
        return loss_sum

    def _optimizer_step(self, skip: bool = False) -> tuple[float, bool, dict]:
        """Clip to the global gradient norm and step (through the fp16 loss scaler if there is one).

        Returns the norm, whether the update was dropped, and the scaler's ``loss_scale`` and
        ``overflow`` (the scaler lowered its scale: this step's gradients held an inf or NaN and it
        skipped the update). The norm is global (all ranks agree), so when one rank's gradients are
        NaN every rank drops the same update.
        """
        scaler, clip = self.precision.scaler, self.cfg.optim.grad_clip
        scale_before = float(scaler.get_scale()) if scaler else None
        if scaler:
            scaler.unscale_(self.optimizer)
        grad_norm = float(self.strategy.clip_grad_norm(self.model, self.optimizer, clip if clip > 0 else float("inf")))
        skipped = skip or not math.isfinite(grad_norm)
        if scaler:  # the scaler drops a non-finite step itself, and lowers its scale
            if not skip:
                scaler.step(self.optimizer)
            scaler.update()
        elif not skipped:
            self.optimizer.step()
        return grad_norm, skipped, scaler_state(scaler, scale_before)

    def _timings(self, start: float, clock: StepClock) -> dict:
        """Step time, split into data, compute and (exposed) communication, plus bytes and memory."""
        step_time = time.perf_counter() - start
        with self.bookkeeping.part("memory accounting"):
            peak = peak_memory_bytes(self.env.device)
        with self.bookkeeping.part("step timing"):
            comm = self.strategy.comm_timer.collect()
            timeline = step_timeline(start, clock.spans, comm.pop("comm_intervals"))
            comm.update(self.strategy.comm_stats(comm["comm_bytes"]))
            if not self.strategy.exposed_comm_measurable:
                comm["comm_exposed_s"] = None
            exposed = comm["comm_exposed_s"]
            compute = None if exposed is None else max(0.0, step_time - clock.totals["data"] - exposed)
        return {"step_time_s": step_time, "data_s": clock.totals["data"], "compute_s": compute, **comm,
                "max_mem_bytes": peak, "timeline": timeline}

    @torch.no_grad()
    def evaluate(self, val_ds) -> float:
        """Mean validation loss over the same ``eval_batches`` micro-batches every time, all ranks.

        The same tokens whatever ``run.seed`` (see :func:`labkit.data.validation_loader`).
        """
        self.model.eval()
        loader = validation_loader(val_ds, self.cfg.data.micro_batch_size, self.env.rank, self.env.world_size)
        total = torch.zeros(1, dtype=torch.float64, device=self.env.torch_device)
        for _ in range(self.cfg.run.eval_batches):
            x, y = (t.to(self.env.torch_device) for t in loader.next_micro_batch())
            with self.precision.autocast():
                total += self.model(x, y)[1].double()
        self.model.train()
        dist.all_reduce(total)
        return total.item() / (self.cfg.run.eval_batches * self.env.world_size)


class count_saved_bytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the tensors autograd saves for backward (the activations), each storage counted once.

    Under FSDP2 the gathered full weights that backward needs are saved too, and counted here.
    """

    def __init__(self, exclude=()):
        self.total = 0
        self._seen = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                      for p in exclude}  # weights are not activations

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._seen:
                self._seen.add(storage.data_ptr())
                self.total += storage.nbytes()
            return tensor

        super().__init__(pack, lambda tensor: tensor)

    def __enter__(self):
        super().__enter__()
        return self


def step_timeline(start: float, spans, comm_intervals) -> dict:
    """Where one step's time went, as [start, end] seconds from the step's start, for a timeline plot."""
    def rel(a: float, b: float) -> list[float]:
        return [round(a - start, 6), round(b - start, 6)]

    phases: dict[str, list] = {}
    for name, a, b in spans:
        phases.setdefault(name, []).append(rel(a, b))
    return {**phases, "comm": [rel(a, b) for a, b in comm_intervals]}


def freeze(model: torch.nn.Module, prefixes: list[str]) -> None:
    for name, p in model.named_parameters():
        if any(name.startswith(prefix) for prefix in prefixes):
            p.requires_grad_(False)


def gather_ranks(stats: dict, env: DistEnv) -> dict[str, list[float]]:
    """Every rank's measurements, on every rank (one small collective, outside the timed step)."""
    table = torch.zeros(env.world_size, len(STEP_FIELDS), dtype=torch.float64, device=env.torch_device)
    table[env.rank] = torch.tensor([float(stats[k]) for k in STEP_FIELDS], dtype=torch.float64)
    if env.world_size > 1:  # a group of one has gathered already (and its backend's thread stays asleep)
        dist.all_reduce(table)  # each rank filled its own row: the sum is the gathered table
    table = table.T.tolist()
    return dict(zip(STEP_FIELDS, table))


def step_event(step: int, lr: float, stats: dict, ranks: dict, tokens: int, fpt: float, peak, env) -> dict:
    step_time = stats["step_time_s"]
    slowest = max(ranks["step_time_s"])
    tflops = achieved_tflops(fpt, tokens, slowest, env.world_size)
    return {
        "step": step, "loss": sum(ranks["loss"]) / env.world_size, "lr": lr, "grad_norm": stats["grad_norm"],
        "tokens": tokens, "tokens_per_s": tokens / slowest, "step_time_s": step_time,
        "data_s": stats["data_s"], "compute_s": stats["compute_s"], "comm_s": stats["comm_s"],
        "comm_exposed_s": stats["comm_exposed_s"], "comm_frac": stats["comm_s"] / step_time,
        "comm_bytes": stats["comm_bytes"], "comm_calls": stats["comm_calls"], "raw_bytes": stats["raw_bytes"],
        "compression_ratio": stats["compression_ratio"], "compress_s": stats["compress_s"], "tflops": tflops,
        "mfu": mfu(tflops, peak), "max_mem_bytes": int(max(ranks["max_mem_bytes"])),
        "param_bytes": stats["param_bytes"], "grad_bytes": stats["grad_bytes"],
        "optimizer_bytes": stats["optimizer_bytes"], "activation_bytes": stats["activation_bytes"],
        "timeline": stats["timeline"], "skipped": stats["skipped"],
        "loss_scale": stats.get("loss_scale"), "overflow": bool(stats.get("overflow", False)),
        "rank_step_time_s": ranks["step_time_s"],
        "rank_comm_s": ranks["comm_s"],
        # time not spent in communication: in synchronous training every rank's step takes as long
        # as the slowest one's, so a straggler shows here (more busy) and in its peers' comm_s (waiting)
        "rank_busy_s": [t - c for t, c in zip(ranks["step_time_s"], ranks["comm_s"])],
        "rank_comm_bytes": ranks["comm_bytes"],
    }


def attention_kernel(cfg: Config, shape: GPTShape, env: DistEnv, precision: Precision) -> str:
    """The attention kernel that runs for this model's micro-batches (sdpa picks one per shape and dtype)."""
    from labkit.model.attention import describe_kernel

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}.get(precision.mode, torch.float32)
    q = torch.zeros(cfg.data.micro_batch_size, shape.n_head, shape.block_size, shape.n_embd // shape.n_head,
                    dtype=dtype, device=env.torch_device)
    return describe_kernel(cfg.attention.backend, q)


def check_same_config(cfg: Config) -> None:
    """Every rank must train the same configuration; a mismatch is an error, not a silent divergence."""
    mine = json.dumps(cfg.to_dict(), sort_keys=True)
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    if box[0] != mine:
        raise ValueError(f"rank {dist.get_rank()} has a different configuration from rank 0; start every rank "
                         "with the same config file and --set overrides")


def shared_peak(cfg: Config, env: DistEnv, precision: Precision) -> dict:
    """Rank 0 finds the per-device peak (measuring it once on CPU); every rank gets the same."""
    box = [device_peak(env.device, precision.peak_dtype, env.threads, cfg.metrics.peak_tflops)
           if env.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


SUMMARY_MEANS = ["tokens_per_s", "step_time_s", "comm_s", "comm_frac", "tflops", "mfu"]
WARMUP_SKIP = 3  # steps left out of the averages (compilation, caches), or a quarter of a shorter run


def summarize(events: list[dict], skip: int) -> dict:
    """Averages over steady-state steps (the first ``skip`` steps include warm-up costs)."""
    steady = events[skip:] or events

    def mean(key):
        values = [e[key] for e in steady if e.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {key: mean(key) for key in SUMMARY_MEANS}


class StepTally:
    """What the summary needs from an attempt's step events, in constant memory: a long run keeps no list.

    The first ``4 × WARMUP_SKIP`` events are kept (a run that short is summarized from them, skipping a
    quarter); after that the averages are running sums over every step past the warm-up, added in the
    same order as :func:`summarize` would, so both give the same numbers.
    """

    def __init__(self):
        self.head: list[dict] = []
        self.count = 0
        self.sums = {key: 0.0 for key in SUMMARY_MEANS}
        self.counts = {key: 0 for key in SUMMARY_MEANS}
        self.last: dict | None = None
        self.max_mem_bytes: int | None = None
        self.overflows = 0

    def add(self, event: dict) -> None:
        if len(self.head) < 4 * WARMUP_SKIP:
            self.head.append({key: event.get(key) for key in SUMMARY_MEANS})
        if self.count >= WARMUP_SKIP:
            for key in SUMMARY_MEANS:
                if event.get(key) is not None:
                    self.sums[key] += event[key]
                    self.counts[key] += 1
        self.count += 1
        self.last = {"step": event["step"], "loss": event["loss"]}
        self.max_mem_bytes = max(event["max_mem_bytes"], self.max_mem_bytes or 0)
        self.overflows += bool(event.get("overflow"))

    def means(self) -> dict:
        if self.count < 4 * WARMUP_SKIP:
            return summarize(self.head, skip=min(WARMUP_SKIP, self.count // 4))
        return {key: self.sums[key] / self.counts[key] if self.counts[key] else None for key in SUMMARY_MEANS}


def overflow_steps(events: list[dict]) -> int:
    """Steps the fp16 loss scaler skipped because their gradients overflowed (0 without a scaler)."""
    return sum(1 for e in events if e.get("overflow"))


def finish_summary(summary: dict, tally: StepTally, env: DistEnv, run_dir: Path, t0: float) -> None:
    """Rank 0's closing numbers; ``tally`` holds this attempt's steps (a resumed run's since its resume)."""
    if (run_dir / "faults.jsonl").exists():
        summary["faults"] = recovery_report(run_dir)
    started = first_event_time(run_dir / "events.jsonl", default=t0)  # the first attempt's start
    last = tally.last
    summary.update(steps_completed=last["step"] + 1 if last else summary.get("resumed_from_step") or 0,
                   world_size=env.world_size, backend=env.backend, device=env.device,
                   wall_time_s=time.time() - started, final_loss=last["loss"] if last else None,
                   max_mem_bytes=tally.max_mem_bytes, overflow_steps=tally.overflows, **tally.means())


def use_deterministic_kernels() -> None:
    """Deterministic kernels, so that a rerun is bit-for-bit the same, without NaN-filling new tensors.

    torch's deterministic mode also fills every uninitialised tensor (``torch.empty``) with NaN by
    default, so that code reading memory it never wrote fails loudly: a debugging aid that changes no
    correct result but writes every new activation buffer once more in each step (``aten::fill_`` in a
    profile of the step; ``benchmarks/overhead.py`` measures the loop against a bare one).
    """
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def _raise_stopped(signum, frame):
    raise Stopped(f"signal {signum}")


def train(cfg: Config, run_dir: str | Path) -> dict | None:
    """Run one worker's training; rank 0 returns the summary (others return None)."""
    if cfg.comm.consistency is not None:  # the CAP lab: sync / local SGD / SSP / async, on the same processes
        from labkit.consistency import train_consistency

        return train_consistency(cfg, run_dir)
    run_dir = Path(run_dir)
    started_group = not dist.is_initialized()
    env = init_distributed(cfg)
    check_same_config(cfg)
    cfg, auto_reasons = resolve_auto(cfg)
    set_network(network_from_config(cfg.comm))
    torch.manual_seed(cfg.run.seed)
    use_deterministic_kernels()
    sink = EventWriter(run_dir / "events.jsonl") if env.is_main else None
    t0 = time.time()
    summary: dict = {"status": "failed"}
    tally = StepTally()
    try:
        train_ds, val_ds, tokenizer, meta = build_datasets(cfg.data.dataset, cfg.data.tokenizer,
                                                           cfg.model.block_size, cfg.data.val_fraction)
        shape = GPTShape.from_config(cfg.model, tokenizer.vocab_size, cfg.attention.backend)
        model = GPT(shape).to(env.torch_device)
        precision = build_precision(cfg, env.device)
        model = prepare_model(model, precision.mode)  # fp8: Linear layers → torchao Float8Linear
        freeze(model, cfg.model.freeze)
        strategy = build_strategy(cfg, env)
        module = strategy.wrap(model)
        accum = grad_accum_steps(cfg, env.world_size)
        loader = ShardedLoader(train_ds, cfg.data.micro_batch_size, env.rank, env.world_size, accum, cfg.run.seed)
        trainer = Trainer(cfg, env, module, model, strategy, strategy.build_optimizer(model, cfg.optim),
                          precision, loader, accum)
        strategy.comm_timer.collect()  # set-up traffic (weights broadcast at wrap) is not a step's
        peak = shared_peak(cfg, env, precision)
        fpt = flops_per_token(shape)
        tokens = cfg.data.batch_size * cfg.model.block_size
        floor = (meta or {}).get("entropy_nats_per_token")
        val_floor = (validation_floor(cfg.data.dataset, val_ds, cfg.data.val_fraction, cfg.data.micro_batch_size,
                                      env.world_size, cfg.run.eval_batches) if env.is_main and val_ds is not None else None)
        kernel = attention_kernel(cfg, shape, env, precision)
        if sink:
            sink.write("start", world_size=env.world_size, backend=env.backend, device=env.device,
                       threads_per_proc=env.threads, grad_accum=accum, params=count_params(shape),
                       flops_per_token=fpt, peak_tflops=peak["tflops"], peak_source=peak["source"],
                       memory_kind=memory_kind(env.device), entropy_floor=floor, val_floor=val_floor,
                       memory_capacity_bytes=memory_capacity_bytes(env.device, env.local_rank,
                                                                   env.local_world_size),
                       dataset=cfg.data.dataset,
                       vocab_size=shape.vocab_size, steps=cfg.run.steps, strategy=strategy.name,
                       attention_kernel=kernel, auto=auto_reasons,
                       gpu_name=torch.cuda.get_device_name(env.local_rank) if env.device == "cuda" else None,
                       network=current_network().describe())
        progress = _progress_bar(cfg, env)
        clock = StepClock(env.device)
        verifier = CompileVerifier(model) if cfg.run.compile == "verify" else None
        if cfg.run.compile == "on":
            compile_in_place(model)
        watchdog = Watchdog(cfg.metrics, env, run_dir, sink) if cfg.metrics.alerts else None
        faults = FaultTolerance(cfg, env, run_dir, sink)
        first_step = faults.resume(trainer)
        if progress is not None:
            progress.update(first_step)
        parts = trainer.bookkeeping
        for step in range(first_step, cfg.run.steps):
            with parts.part("faults and checkpoints"):
                faults.before_step(step)
            lr = lr_at(step, cfg.optim, cfg.run.steps)
            set_lr(trainer.optimizer, lr)
            stats = trainer.step(clock, step, poison=faults.poisons(step), skip=faults.skips(step),
                                 slow_s=faults.slow_s(step))
            decision = verifier.record(step, stats["step_time_s"]) if verifier else None
            if decision:
                summary["compile"] = decision
                if sink:
                    sink.write("compile", step=step, **decision)
            with parts.part("gather"):
                ranks = gather_ranks(stats, env)
            with parts.part("events"):
                event = step_event(step, lr, stats, ranks, tokens, fpt, peak["tflops"], env)
                tally.add(event)
                if sink and step % cfg.metrics.log_every == 0:
                    sink.write("step", **event)
            if watchdog:
                with parts.part("watchdog"):
                    watchdog.after_step()
                    watchdog.observe(event)
            last = step == cfg.run.steps - 1
            if cfg.run.eval_every and ((step + 1) % cfg.run.eval_every == 0 or last):
                val = trainer.evaluate(val_ds)
                strategy.comm_timer.collect()  # evaluation traffic (FSDP2 gathers) is not a training step's
                if sink:
                    sink.write("eval", step=step, val_loss=val)
                summary["val_loss"] = val
            with parts.part("faults and checkpoints"):  # and checkpoints, when one is due
                faults.after_step(trainer, step)
            if progress is not None:
                with parts.part("progress"):
                    progress.set_postfix(loss=f"{event['loss']:.3f}", tok_s=f"{event['tokens_per_s']:.0f}",
                                         mfu="n/a" if event["mfu"] is None else f"{event['mfu']:.1%}")
                    progress.update(1)
            parts.count_step()
        faults.close()
        if watchdog:
            watchdog.close()
            summary["alerts"] = watchdog.alerts
        if progress is not None:
            progress.close()
        if cfg.run.save_final:
            state = strategy.full_state_dict(model)  # a collective for sharded strategies: every rank calls
            if env.is_main:
                torch.save(state, run_dir / "final_model.pt")
        summary.update(status="finished", params=count_params(shape), flops_per_token=fpt,
                       peak_tflops=peak["tflops"], peak_source=peak["source"], entropy_floor=floor, val_floor=val_floor,
                       attention_kernel=kernel, strategy=strategy.name, auto=auto_reasons, **faults.summary(),
                       bookkeeping_s_per_step=parts.per_step())
        compressor = getattr(strategy, "compressor", None)
        if compressor is not None and compressor.sent_shares():
            summary["sent_shares"] = compressor.sent_shares()  # rank 0's: where a sparsifier's bytes went
    except (Stopped, KeyboardInterrupt) as stop:
        summary.update(status="stopped", error=str(stop) or "interrupted")
        raise
    except BaseException as error:
        summary.update(status="failed", error=f"{type(error).__name__}: {error}")
        raise
    finally:
        if env.is_main:
            restarts_left = attempt_ends_early(summary, run_dir, restart_attempt(), cfg.fault.max_restarts)
            if restarts_left:  # the elastic agent will start another attempt: the run has not ended
                sink.write("attempt_end", status=summary["status"], error=summary.get("error"),
                           attempt=restart_attempt())
            else:
                finish_summary(summary, tally, env, run_dir, t0)
                sink.write("end", status=summary["status"])
                write_json(run_dir / "summary.json", summary)
            sink.close()
        if "strategy" in locals():
            strategy.close()
        if started_group and summary["status"] == "finished":
            # Free every object holding communication state before the group goes: destroying a
            # process group under a live DDP/FSDP module can abort the process.
            del trainer, module, model, strategy
            shutdown_distributed()
    return summary if env.is_main else None


def _progress_bar(cfg: Config, env: DistEnv):
    if not (env.is_main and cfg.metrics.progress and os.environ.get("LABKIT_PROGRESS", "1") != "0"):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.run.steps, desc=f"train ×{env.world_size} {env.backend}", unit="step",
                mininterval=0.5, dynamic_ncols=True)


@record  # a failure's message goes to the elastic agent's error file: the run's summary can say why
def worker_main(config_path: str | Path, run_dir: str | Path, overrides: list[str] | None = None) -> int:
    """Entry point of one worker process (under torchrun or labkit's launcher)."""
    from labkit.config import load_config
    from labkit.launcher import remove_pid_file, write_pid_file

    signal.signal(signal.SIGTERM, _raise_stopped)
    exit_when_orphaned()
    run_dir = Path(run_dir)
    pid_file = write_pid_file(run_dir / "pids", os.environ.get("RANK", "0"))  # pid and start time
    code = 0
    try:
        train(load_config(config_path, overrides), run_dir)
    except Stopped:
        code = 143
    finally:
        remove_pid_file(pid_file)
    # Everything is written and closed. Leave without running C++ static destructors, which can
    # race with the communication backend's threads and abort a process that finished its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
