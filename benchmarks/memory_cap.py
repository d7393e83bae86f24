"""No rank holds more than its part, measured: a GPT whose training state does not fit a per-process memory cap,
run in one process and split over pp = 4 and over tp = 2 × pp = 2, under the same cap.

The cap is the kernel's ``RLIMIT_DATA`` (1.5 GiB), set on torchrun and inherited by every process it starts. The
model: 8 layers of width 1024 (100.7 M parameters: 403 MB of fp32 weights, 1.61 GB with gradients and Adam's two
moments). Each rank (``workers/memory_cap_worker.py``) builds its part as labkit's trainer does, reading its
resident set from the kernel before and at the peak after, then trains 2 steps with labkit's loop. Per rank the
table has:

* the start-up growth (peak after the build − resident before it) beside its bound, 1.2 × the rank's predicted
  weights + :data:`START_UP_ALLOWANCE` (two blocks made real whole: one being cut, one freed but kept by the C
  allocator) — a rank that built the whole model first would hold ≥ 403 MB here;
* the run's peak resident set beside 1.2 × the rank's predicted model state + :data:`RUN_ALLOWANCE` (what a
  process holds before any model, ≈ 400 MB, and a step's transient buffers);
* what the rank held at its last step (weights, gradients, optimizer state: the run's events) = the prediction.

The one-process run must fail with the allocator's out-of-memory error. Appended to
``benchmarks/results/memory_cap.jsonl``; ``tests/parallel/test_memory_cap.py`` asserts the same bounds.

    .venv/bin/python benchmarks/memory_cap.py
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

CAP = 3 * 2**29  # 1.5 GiB of data segment per process
MODEL = {"run.name": "memory-cap", "run.steps": 2, "run.eval_every": 0, "run.save_final": False, "run.seed": 3,
         "model.n_layer": 8, "model.n_head": 8, "model.n_embd": 1024, "model.block_size": 16,
         "data.batch_size": 4, "data.micro_batch_size": 1, "parallel.dp.strategy": "ddp_naive"}
UNIT = 12 * 1024**2 * 4  # the largest unit made real whole before it is cut: one block's weights (12·d², fp32)
START_UP_ALLOWANCE = 2 * UNIT  # a block being cut, and one freed but still kept by the C allocator
RUN_ALLOWANCE = 640 * 2**20  # a process before any model (≈ 400 MB: torch, gloo, labkit, the corpus) + a step's buffers
LAYOUTS = {"one process": (1, {}), "pp4": (4, {"pp": 4}), "tp2_pp2": (4, {"tp": 2, "pp": 2})}
ROOT = Path(__file__).resolve().parents[1]


def overrides(layout: dict) -> dict:
    return {**MODEL, **{f"parallel.{axis}.degree": degree for axis, degree in layout.items()}}


def launch(out: Path, nproc: int, layout: dict, cap: int = CAP) -> subprocess.CompletedProcess:
    """torchrun of ``nproc`` workers under ``cap`` bytes of data segment each; they write into ``out``."""
    from labkit.launcher import free_port

    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", str(nproc),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           str(Path(__file__).parent / "workers" / "memory_cap_worker.py"), str(out),
                           json.dumps(overrides(layout))],
                          capture_output=True, text=True, env=env, timeout=600,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, (cap, cap)))


def whole_model_state(events: list[dict]) -> float:
    """The one-process run's predicted model state (weights, gradients, Adam): what the cap must be below."""
    from labkit.config import load_config
    from labkit.model import GPTShape
    from labkit.parallel.reports.layout import predicted_rank_memory_for_layout, start_event
    from labkit.parallel.mesh import ParallelDims

    shape = GPTShape.from_config(load_config(None, MODEL).model, start_event(events)["vocab_size"])
    return predicted_rank_memory_for_layout(shape, ParallelDims(1, 1, 1), 0, "ddp_naive").model_states


def rank_rows(out: Path, layout: dict) -> list[dict]:
    """Each rank's kernel-read memory beside its bounds and labkit's prediction of its part."""
    from labkit.config import load_config
    from labkit.parallel.reports.layout import rank_memory
    from labkit.recordings import load_events

    events = load_events(out / "run" / "events.jsonl")
    rows = []
    for part in rank_memory(events, load_config(None, overrides(layout))):
        record = json.loads((out / f"rank{part['rank']}.json").read_text())
        growth = record["peak_rss_after_build_bytes"] - record["rss_before_build_bytes"]
        start_bound = 1.2 * part["predicted"]["param"] + START_UP_ALLOWANCE
        run_bound = 1.2 * part["predicted_total"] + RUN_ALLOWANCE
        rows.append({"rank": part["rank"], "data_limit_bytes": record["data_limit_bytes"],
                     "rss_before_build_bytes": record["rss_before_build_bytes"], "start_up_growth_bytes": growth,
                     "predicted_weights_bytes": part["predicted"]["param"], "start_up_bound_bytes": start_bound,
                     "start_up_held": growth <= start_bound, "peak_rss_bytes": record["peak_rss_bytes"],
                     "predicted_model_state_bytes": part["predicted_total"], "run_bound_bytes": run_bound,
                     "run_held": record["peak_rss_bytes"] <= run_bound,
                     "measured_model_state_bytes": part["measured_total"],
                     "state_is_prediction": part["measured_total"] == part["predicted_total"],
                     "whole_model_state_bytes": whole_model_state(events)})
    return rows


def out_of_memory(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode != 0 and ("can't allocate memory" in proc.stderr or "MemoryError" in proc.stderr)


def main() -> None:
    from labkit.results import write_results

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nproc, layout) in LAYOUTS.items():
            proc = launch(Path(tmp) / name.replace(" ", "_"), nproc, layout)
            if not layout:
                rows.append({"layout": name, "returncode": proc.returncode, "out_of_memory": out_of_memory(proc)})
                print(f"{name}: exit {proc.returncode}, out of memory: {out_of_memory(proc)}")
                continue
            assert proc.returncode == 0, proc.stderr[-3000:]
            for row in rank_rows(Path(tmp) / name, layout):
                rows.append({"layout": name, **row})
                mib = {k: round(v / 2**20) for k, v in row.items() if k.endswith("bytes")}
                print(f"{name} rank {row['rank']}: start-up +{mib['start_up_growth_bytes']} MiB "
                      f"(bound {mib['start_up_bound_bytes']}), peak {mib['peak_rss_bytes']} MiB "
                      f"(bound {mib['run_bound_bytes']}), state = prediction: {row['state_is_prediction']}")
    path = write_results("memory_cap", rows, {"cap_bytes": CAP, "model": MODEL, "unit_bytes": UNIT,
                                              "start_up_allowance_bytes": START_UP_ALLOWANCE,
                                              "run_allowance_bytes": RUN_ALLOWANCE})
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
