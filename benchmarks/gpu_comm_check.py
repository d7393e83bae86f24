"""The GPU check of issue 25: communication time measured with CUDA events, and peak memory per phase.

On one CUDA GPU, in one process, on a 1-rank NCCL group:

1. **mechanism** — ``CommTimer``'s CUDA-event path on a "collective" of *known* length: a 20 ms kernel on
   a stream of its own (as NCCL's is), queued behind 10 ms of compute, with 5 ms of compute beside it. The
   timer must find the 20 ms, the 15 ms of it left after compute (exposed), and place the interval 10 ms
   after the host launched it (the host clock would say ~0 ms, at the launch: the issue's bug).
2. **nccl** — a real all-reduce of a known size (64 MiB) through NCCL, timed by ``CommTimer`` as
   ``labkit.comm.collectives`` times one (start event before the launch, end event in the future's
   callback / after a blocking call), against a plain CUDA-event measurement and the α–β model
   (``labkit.comm.network``). A 1-rank group moves **no wire bytes**: the model says 0 s and what is
   measured is NCCL's local cost (an in-place 1-rank all-reduce; an out-of-place all-gather is a 64 MiB
   device copy, set beside a plain ``copy_``). The same all-reduce queued behind 10 ms of compute shows
   where each clock puts it.
3. **memory** — peak bytes allocated in each phase of a step (forward, backward, gradient sync,
   optimizer; ``torch.cuda.reset_peak_memory_stats`` / ``max_memory_allocated``) for a small GPT under
   ``torch_ddp``, ``ddp_bucketed`` and ``zero2``. Over one rank ZeRO-2's gradient and optimizer-state
   shards are the whole: it shows no saving (with p ranks they are 1/p); the rows show what each
   strategy holds beside the model.

    python benchmarks/gpu_comm_check.py [--out FILE] [--size-mib 64]
    python benchmarks/gpu_comm_check.py --dry-run     # no GPU: the same code on CPU/gloo, tiny sizes
    python benchmarks/gpu_comm_check.py --table FILE  # the table of a saved result

Without a GPU (or with ``--dry-run``) it runs what it can on CPU over gloo with tiny sizes and says so:
those numbers are not the check's. Prints one JSON line per section (``{"kind": ...}``), a table last,
and writes everything to ``--out`` (default ``$OUT/comm_check.json``, or ``benchmarks/results/``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from labkit.comm import collectives, network  # noqa: E402
from labkit.metrics import timers  # noqa: E402
from labkit.metrics.timers import CommTimer  # noqa: E402

STRATEGIES = ("torch_ddp", "ddp_bucketed", "zero2")
PHASES = ("forward", "backward", "sync", "optimizer")
MIB = 1 << 20


def median(values) -> float:
    return statistics.median(values)


def close(got: float, want: float, rel: float, abs_s: float) -> bool:
    return abs(got - want) <= max(rel * abs(want), abs_s)


# ---------------------------------------------------------------- 1. the mechanism, on a known length

def sleep_cycles_per_ms() -> float:
    """How many ``torch.cuda._sleep`` cycles make a millisecond on this GPU now (timed with events)."""
    cycles = 10_000_000
    for _ in range(2):  # the second after the clocks have risen
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        rate = cycles / a.elapsed_time(b)
    return rate


def mechanism_check(trials: int = 5) -> dict:
    rate = sleep_cycles_per_ms()
    ms = lambda n: int(n * rate)  # noqa: E731
    side = torch.cuda.Stream()
    x = torch.ones(1024, device="cuda")
    rows = []
    for _ in range(trials):
        timer = CommTimer()
        refs = {k: torch.cuda.Event(enable_timing=True) for k in ("m0", "c0", "c1", "done")}
        torch.cuda.synchronize()
        host_launch = time.perf_counter()
        refs["m0"].record()  # the GPU is idle: fires as the host issues it
        torch.cuda._sleep(ms(10))  # compute queued before the collective
        start = timer.launched(0, x)  # start event on the current stream: fires when the 10 ms are done
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the "collective": 20 ms on a stream of its own, as NCCL's
            refs["c0"].record()
            torch.cuda._sleep(ms(20))
            refs["c1"].record()
            timer.completed(start)  # end event on the collective's stream
        host_completed = time.perf_counter()  # where a host stamp would put the end (NCCL: at enqueue)
        torch.cuda._sleep(ms(5))  # compute beside it...
        timer.grad_ready()  # ...then the last gradient is ready
        refs["done"].record()
        torch.cuda.synchronize()
        got = timer.collect()
        (s, e), = got["comm_intervals"]
        want_comm = refs["c0"].elapsed_time(refs["c1"]) / 1e3
        want_exposed = max(0.0, refs["done"].elapsed_time(refs["c1"]) / 1e3)
        want_offset = refs["m0"].elapsed_time(refs["c0"]) / 1e3
        rows.append({"comm_s": got["comm_s"], "want_comm_s": want_comm, "exposed_s": got["comm_exposed_s"],
                     "want_exposed_s": want_exposed, "start_offset_s": s - host_launch,
                     "want_start_offset_s": want_offset, "host_clock_comm_s": host_completed - float(start)})
    keys = rows[0].keys()
    summary = {k: median(r[k] for r in rows) for k in keys}
    ok = (close(summary["comm_s"], summary["want_comm_s"], 0.02, 50e-6)
          and close(summary["exposed_s"], summary["want_exposed_s"], 0.02, 50e-6)
          and close(summary["start_offset_s"], summary["want_start_offset_s"], 0.0, 500e-6))
    return {"kind": "mechanism", "status": "ok" if ok else "MISMATCH", "timing": timer.timing, **summary,
            "trials": trials}


# ---------------------------------------------------------------- 2. a real NCCL all-reduce of known size

def timed_by_comm_timer(x: torch.Tensor, async_op: bool) -> float:
    """One all-reduce timed as labkit.comm.collectives times one over world > 1 (its own path skips the
    backend on a group of one): start event at launch, end event where completion is reported."""
    timer = CommTimer()
    start = timer.launched(collectives.wire_bytes("all_reduce", x.numel() * x.element_size(), 1), x)
    if async_op:
        work = dist.all_reduce(x, async_op=True)
        held = work.get_future().then(lambda fut: (timer.completed(start), fut.value())[1])
        held.wait()
    else:
        dist.all_reduce(x)
        timer.completed(start)
    torch.cuda.synchronize()
    got = timer.collect()
    assert timer.timing.startswith(timers.CUDA_EVENTS), timer.timing
    return got["comm_s"]


def timed_by_events(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def timed_by_host_at_enqueue(x: torch.Tensor) -> float:
    """What the old timer measured: launch to the future's callback, on the host clock."""
    stamps = []
    t0 = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    work.get_future().then(lambda fut: stamps.append(time.perf_counter()))
    work.wait()
    torch.cuda.synchronize()
    return stamps[0] - t0


def model_prediction_s(op: str, nbytes: int, world: int) -> float:
    """The α–β model's time for ``op`` (labkit.comm.network), on loopback's α and β: 0 for a group of one."""
    net = network.current()
    if hasattr(net, "collective_s"):
        return net.collective_s(op, nbytes, world)
    return net.transfer_s(collectives.wire_bytes(op, nbytes, world))


def nccl_check(size_mib: int, reps: int = 20) -> dict:
    n = size_mib * MIB
    x = torch.randn(n // 4, device="cuda")
    out = torch.empty_like(x)
    copy_into = torch.empty_like(x)
    for _ in range(3):  # NCCL's communicator and kernels are set up on first use
        dist.all_reduce(x)
        dist.all_gather_into_tensor(out, x)
    torch.cuda.synchronize()
    row = {"kind": "nccl", "size_bytes": n, "world": 1,
           "wire_bytes": collectives.wire_bytes("all_reduce", n, 1),
           "model_s": model_prediction_s("all_reduce", n, 1), "network": network.current().describe()}
    row["timer_async_s"] = median(timed_by_comm_timer(x, True) for _ in range(reps))
    row["timer_blocking_s"] = median(timed_by_comm_timer(x, False) for _ in range(reps))
    row["events_s"] = median(timed_by_events(lambda: dist.all_reduce(x, async_op=True).wait()) for _ in range(reps))
    row["host_at_enqueue_s"] = median(timed_by_host_at_enqueue(x) for _ in range(reps))
    row["all_gather_events_s"] = median(timed_by_events(lambda: dist.all_gather_into_tensor(out, x))
                                        for _ in range(reps))
    row["copy_events_s"] = median(timed_by_events(lambda: copy_into.copy_(x)) for _ in range(reps))
    row["copy_bandwidth_bytes_per_s"] = 2 * n / row["copy_events_s"]  # read + written
    # the same all-reduce queued behind 10 ms of compute: where each clock puts it
    rate = sleep_cycles_per_ms()
    offsets = []
    for _ in range(5):
        timer = CommTimer()
        m0, m1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        host_launch = time.perf_counter()
        m0.record()  # the GPU is idle: fires as the host issues it
        torch.cuda._sleep(int(10 * rate))
        m1.record()  # where the collective can begin
        start = timer.launched(0, x)
        work = dist.all_reduce(x, async_op=True)
        held = work.get_future().then(lambda fut: (timer.completed(start), fut.value())[1])
        held.wait()
        torch.cuda.synchronize()
        (s, e), = timer.collect()["comm_intervals"]
        offsets.append((s - host_launch, float(start) - host_launch, m0.elapsed_time(m1) / 1e3))
    row["queued_start_offset_events_s"] = median(o[0] for o in offsets)
    row["queued_start_offset_host_s"] = median(o[1] for o in offsets)
    row["queued_behind_s"] = median(o[2] for o in offsets)
    ok = (close(row["timer_async_s"], row["events_s"], 0.10, 20e-6)
          and close(row["timer_blocking_s"], row["events_s"], 0.10, 20e-6)
          and close(row["queued_start_offset_events_s"], row["queued_behind_s"], 0.0, 500e-6))
    return {**row, "status": "ok" if ok else "MISMATCH"}


def cpu_comm_dry_run(size_mib: float = 1.0) -> dict:
    """Without a GPU: the host-clock path over gloo (CPU tensors), through labkit.comm.collectives."""
    x = torch.randn(int(size_mib * MIB) // 4)
    timer = CommTimer()
    collectives.all_reduce(x, async_op=True, timer=timer).wait()
    got = timer.collect()
    return {"kind": "nccl", "status": "dry run: gloo on CPU (no CUDA GPU), not the GPU check", "world": 1,
            "size_bytes": x.numel() * 4, "wire_bytes": collectives.wire_bytes("all_reduce", x.numel() * 4, 1),
            "model_s": model_prediction_s("all_reduce", x.numel() * 4, 1), "timer_async_s": got["comm_s"],
            "timing": timer.timing, "network": network.current().describe()}


# ---------------------------------------------------------------- 3. peak memory per phase

def peak_during(fn, cuda: bool):
    """Peak bytes allocated while ``fn`` runs (None off CUDA: no peak statistics there)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    fn()
    if not cuda:
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def strategy_memory(name: str, device: str, env, shape_kw: dict, batch: int, steps: int) -> dict:
    """Peak memory per phase of ``steps`` training steps under strategy ``name`` (the last step's, and the first
    step's optimizer phase, where the optimizer state is created)."""
    from labkit.config import load_config
    from labkit.model import GPT
    from labkit.model.gpt import GPTShape
    from labkit.parallel import build_strategy

    cuda = device == "cuda"
    cfg = load_config(None, {"run.device": device, "parallel.dp.strategy": name, "optim.lr": 1e-3})
    torch.manual_seed(0)
    shape = GPTShape(attention="sdpa", **shape_kw)
    model = GPT(shape).to(env.torch_device)
    strategy = build_strategy(cfg, env)
    module = strategy.wrap(model)
    optimizer = strategy.build_optimizer(model, cfg.optim)
    x = torch.randint(0, shape.vocab_size, (batch, shape.block_size), device=env.torch_device)
    first_optimizer_peak = None
    for step in range(steps):
        state = {}

        def optimizer_step():
            strategy.clip_grad_norm(model, optimizer, 1.0)
            optimizer.step()

        peaks = {"forward": peak_during(lambda: state.update(loss=module(x, x)[1]), cuda),
                 "backward": peak_during(lambda: state.pop("loss").backward(), cuda),
                 "sync": peak_during(lambda: strategy.sync_gradients(module), cuda),
                 "optimizer": peak_during(optimizer_step, cuda)}
        held = strategy.memory_breakdown(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            first_optimizer_peak = peaks["optimizer"]
    strategy.close()
    return {"kind": "memory", "strategy": name, "world": env.world_size,
            **{f"peak_{p}_bytes": peaks[p] for p in PHASES}, "first_step_peak_optimizer_bytes": first_optimizer_peak,
            **held, "status": "ok" if cuda else "dry run: CPU (no peak statistics)"}


def memory_check(device: str, env, shape_kw: dict, batch: int, steps: int = 2) -> list[dict]:
    rows = []
    for name in STRATEGIES:
        rows.append(strategy_memory(name, device, env, shape_kw, batch, steps))
        gc.collect()  # the last strategy's model and optimizer are gone before the next one's peaks
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- the run, and its table

def verdict(result: dict) -> str:
    if not result["gpu"]:
        return "dry run (no CUDA GPU): nothing verified"
    statuses = [result["mechanism"]["status"], result["nccl"]["status"]]
    if all(s == "ok" for s in statuses):
        return ("cuda-event timing agrees with plain CUDA events: set CUDA_EVENTS_VERIFIED = True in "
                "labkit/metrics/timers.py")
    return "cuda-event timing DISAGREES: keep CUDA figures marked unverified (see the rows above)"


def table(result: dict) -> str:
    ms = lambda v: "-" if v is None else f"{1e3 * v:.3f}"  # noqa: E731
    mib = lambda v: "-" if v is None else f"{v / MIB:.1f}"  # noqa: E731
    lines = [f"comm timing ({result['device']}; torch {result['torch']}; timer says: {result.get('timing')})"]
    m = result.get("mechanism")
    if m and "comm_s" in m:
        lines += [f"  known 20 ms collective on its own stream: timer {ms(m['comm_s'])} ms vs events "
                  f"{ms(m['want_comm_s'])}; exposed {ms(m['exposed_s'])} vs {ms(m['want_exposed_s'])}  {m['status']}",
                  f"    starts {ms(m['start_offset_s'])} ms after the host launch vs {ms(m['want_start_offset_s'])} "
                  f"(a host stamp: {ms(m['host_clock_comm_s'])} ms long, at the launch)"]
    elif m:
        lines.append(f"  mechanism: {m['status']}")
    n = result["nccl"]
    lines.append(f"  all-reduce {mib(n['size_bytes'])} MiB on {n['world']} rank: {n['wire_bytes']} wire bytes, "
                 f"α–β model {ms(n['model_s'])} ms ({n['network']})")
    if "events_s" in n:
        lines += [f"    CommTimer async {ms(n['timer_async_s'])} ms, blocking {ms(n['timer_blocking_s'])} ms; plain "
                  f"events {ms(n['events_s'])} ms; old host stamp {ms(n['host_at_enqueue_s'])} ms  {n['status']}",
                  f"    local cost: 1-rank all-gather (a {mib(n['size_bytes'])} MiB copy) "
                  f"{ms(n['all_gather_events_s'])} ms, copy_ {ms(n['copy_events_s'])} ms "
                  f"({n['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s read+written)",
                  f"    queued behind {ms(n['queued_behind_s'])} ms of compute: events start it "
                  f"{ms(n['queued_start_offset_events_s'])} ms after the launch, the host clock "
                  f"{ms(n['queued_start_offset_host_s'])} ms"]
    else:
        lines.append(f"    CommTimer {ms(n['timer_async_s'])} ms ({n['timing']})  {n['status']}")
    lines.append("")
    lines.append(f"{'peak MiB':<14}" + "".join(f"{p:>11}" for p in PHASES) + f"{'1st opt':>9}"
                 + f"{'params':>9}{'grads':>9}{'optim':>9}")
    for r in result["memory"]:
        lines.append(f"{r['strategy']:<14}" + "".join(f"{mib(r[f'peak_{p}_bytes']):>11}" for p in PHASES)
                     + f"{mib(r['first_step_peak_optimizer_bytes']):>9}" + f"{mib(r.get('param_bytes')):>9}"
                     + f"{mib(r.get('grad_bytes')):>9}{mib(r.get('optimizer_bytes')):>9}")
    lines.append(f"  ({result['memory'][0]['world'] if result['memory'] else 1} rank: ZeRO-2's gradient and optimizer "
                 "shards are the whole, so no saving shows; with p ranks they are 1/p)")
    lines.append(f"verdict: {result['verdict']}")
    return "\n".join(lines)


def default_out() -> Path:
    out = os.environ.get("OUT")
    base = Path(out) if out else Path(__file__).resolve().parent / "results"
    return base / "comm_check.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--dry-run", action="store_true", help="CPU only, tiny sizes (no GPU needed)")
    parser.add_argument("--table", type=Path, default=None, help="print the table of a saved result and exit")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return 0
    gpu = torch.cuda.is_available() and not args.dry_run
    device = "cuda" if gpu else "cpu"
    if not gpu:
        print("no CUDA GPU" + (" (--dry-run)" if args.dry_run else "") +
              ": dry run on CPU over gloo, tiny sizes — these are not the GPU check's numbers", flush=True)
        torch.set_num_threads(1)
    from labkit.config import load_config
    from labkit.distributed import init_distributed

    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    result = {"kind": "comm_check", "gpu": gpu, "device": torch.cuda.get_device_name(0) if gpu else "cpu",
              "torch": torch.__version__, "cuda_events_verified": timers.CUDA_EVENTS_VERIFIED}
    try:
        if gpu:
            result["mechanism"] = mechanism_check()
            result["timing"] = result["mechanism"]["timing"]
            print(json.dumps(result["mechanism"]), flush=True)
            result["nccl"] = nccl_check(args.size_mib)
        else:
            result["mechanism"] = {"kind": "mechanism", "status": "skipped: needs CUDA streams and events"}
            result["nccl"] = cpu_comm_dry_run()
            result["timing"] = result["nccl"]["timing"]
        print(json.dumps(result["nccl"]), flush=True)
        overrides = {"run.device": device} if gpu else {"run.device": device, "run.threads_per_proc": 1}
        env = init_distributed(load_config(None, overrides))  # the group above: it builds the rank grid
        shape = (dict(vocab_size=4096, block_size=512, n_layer=4, n_head=16, n_embd=1024) if gpu else
                 dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
        result["memory"] = memory_check(device, env, shape, batch=8 if gpu else 2)
        for row in result["memory"]:
            print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()
    result["verdict"] = verdict(result)
    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print()
    print(table(result))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
