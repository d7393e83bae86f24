"""The proof that no rank holds more than its part: a GPT whose training state does not fit a per-process memory
cap cannot train in one process, and trains under the same cap split over pp = 4 and over tp = 2 × pp = 2.

The cap is the kernel's: ``RLIMIT_DATA`` set on torchrun, inherited by every process it starts (the launcher
included). The model: 8 layers of width 1024 (100.7 M parameters: 403 MB of fp32 weights, 1.61 GB with their
gradients and Adam's two moments); the cap: 1.5 GiB of data segment per process. Every number compared comes
from the kernel (``/proc/self/status``) or from labkit's prediction of a rank's part
(``labkit.parallel.layout_report.rank_memory``, which also reads what the run's ranks held).
"""
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.config import load_config
from labkit.launcher import free_port
from labkit.model import GPTShape
from labkit.parallel.layout_report import predicted_rank_memory_for_layout, rank_memory, start_event
from labkit.parallel.mesh import ParallelDims
from labkit.recordings import load_events

pytestmark = pytest.mark.multiproc

CAP = 3 * 2**29  # 1.5 GiB of data segment per process
MODEL = {"run.name": "memory-cap", "run.steps": 2, "run.eval_every": 0, "run.save_final": False, "run.seed": 3,
         "model.n_layer": 8, "model.n_head": 8, "model.n_embd": 1024, "model.block_size": 16,
         "data.batch_size": 4, "data.micro_batch_size": 1, "parallel.dp.strategy": "ddp_naive"}
UNIT = 12 * 1024**2 * 4  # the largest unit made real whole before it is cut: one block's weights (12·d², fp32)
START_UP_ALLOWANCE = 2 * UNIT  # a block being cut, and one freed but still kept by the C allocator
# A process holds ≈ 400 MB before any model (torch, gloo, labkit, the corpus, torch's meta kernels: each rank reads
# it below as rss_before_build), and a step adds activations and transient buffers (the gradients' flat copy for the
# all-reduce, Adam's temporaries): the fixed allowance beside 1.2 × the rank's predicted model state.
RUN_ALLOWANCE = 640 * 2**20


def launch(tmp_path: Path, nproc: int, **layout) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "-".join(f"{k}{v}" for k, v in layout.items())
    out.mkdir()
    overrides = {**MODEL, **{f"parallel.{axis}.degree": degree for axis, degree in layout.items()}}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    worker = Path(__file__).with_name("memory_cap_worker.py")
    proc = subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", str(nproc),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           str(worker), str(out), json.dumps(overrides)],
                          capture_output=True, text=True, env=env, timeout=600,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, (CAP, CAP)))
    return proc, out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("cap"), 1, pp=1)


def test_the_whole_model_cannot_train_in_one_process_under_the_cap(one_process):
    proc, out = one_process
    events = load_events(out / "run" / "events.jsonl") if (out / "run" / "events.jsonl").exists() else []
    assert proc.returncode != 0
    assert "can't allocate memory" in proc.stderr or "MemoryError" in proc.stderr, proc.stderr[-3000:]
    assert not any(e.get("type") == "step" for e in events)  # not one step
    assert not list(out.glob("rank*.json"))


@pytest.mark.parametrize("layout", [{"pp": 4}, {"tp": 2, "pp": 2}], ids=["pp4", "tp2_pp2"])
def test_the_same_model_trains_under_the_same_cap_split_over_ranks(tmp_path, layout):
    proc, out = launch(tmp_path, 4, **layout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = load_events(out / "run" / "events.jsonl")
    steps = [e for e in events if e.get("type") == "step"]
    assert len(steps) == MODEL["run.steps"] and all(0 < s["loss"] < 10 for s in steps)
    cfg = load_config(None, {**MODEL, **{f"parallel.{k}.degree": v for k, v in layout.items()}})
    parts = rank_memory(events, cfg)
    shape = GPTShape.from_config(cfg.model, start_event(events)["vocab_size"])
    whole = predicted_rank_memory_for_layout(shape, ParallelDims(1, 1, 1), 0, "ddp_naive").model_states
    assert whole > CAP  # the cap is below the whole model's training state …
    for part in parts:
        record = json.loads((out / f"rank{part['rank']}.json").read_text())
        assert record["data_limit_bytes"] == CAP  # … and every rank trained under it
        assert part["measured_total"] == part["predicted_total"], part  # what it held: its part
        built = record["peak_rss_after_build_bytes"] - record["rss_before_build_bytes"]
        assert built <= 1.2 * part["predicted"]["param"] + START_UP_ALLOWANCE, (built, part)
        assert record["peak_rss_bytes"] <= 1.2 * part["predicted_total"] + RUN_ALLOWANCE, (record, part)
