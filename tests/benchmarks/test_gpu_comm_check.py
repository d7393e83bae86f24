"""benchmarks/gpu_comm_check.py (issue 25's GPU check): its CPU dry run, and its table and verdict on GPU-shaped
numbers, so the script that a GPU machine runs once is exercised here."""
import json

import torch

from helpers import load_benchmark

check = load_benchmark("gpu_comm_check")


def gpu_shaped_result(mechanism_status="ok") -> dict:
    mechanism = {"kind": "mechanism", "status": mechanism_status, "timing": "cuda events (unverified on this backend)",
                 "comm_s": 0.0201, "want_comm_s": 0.0200, "exposed_s": 0.0150, "want_exposed_s": 0.0150,
                 "start_offset_s": 0.0101, "want_start_offset_s": 0.0100, "host_clock_comm_s": 2e-5}
    nccl = {"kind": "nccl", "status": "ok", "size_bytes": 64 << 20, "world": 1, "wire_bytes": 0, "model_s": 0.0,
            "network": "loopback (not emulated)", "timer_async_s": 3e-5, "timer_blocking_s": 3e-5, "events_s": 3e-5,
            "host_at_enqueue_s": 1e-5, "all_gather_events_s": 4e-5, "copy_events_s": 3.5e-5,
            "copy_bandwidth_bytes_per_s": 3.8e12, "queued_start_offset_events_s": 0.0101, "queued_behind_s": 0.0100,
            "queued_start_offset_host_s": 1e-6}
    memory = [{"kind": "memory", "strategy": name, "world": 1, "first_step_peak_optimizer_bytes": 3 << 20,
               **{f"peak_{p}_bytes": (i + 1) << 20 for i, p in enumerate(check.PHASES)},
               "param_bytes": 1 << 20, "grad_bytes": 1 << 20, "optimizer_bytes": 2 << 20} for name in check.STRATEGIES]
    result = {"gpu": True, "device": "NVIDIA H200", "torch": "2.11", "timing": mechanism["timing"],
              "mechanism": mechanism, "nccl": nccl, "memory": memory}
    return {**result, "verdict": check.verdict(result)}


def test_table_and_verdict_of_a_gpu_run():
    result = gpu_shaped_result()
    assert result["verdict"].startswith("cuda-event timing agrees")
    text = check.table(result)
    assert "known 20 ms collective" in text and "zero2" in text and "0 wire bytes" in text
    assert gpu_shaped_result("MISMATCH")["verdict"].startswith("cuda-event timing DISAGREES")
    assert check.close(1.01, 1.0, 0.02, 0.0) and not check.close(1.05, 1.0, 0.02, 0.0)


def test_dry_run_on_cpu(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        assert check.main(["--dry-run", "--out", str(tmp_path / "comm_check.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "comm_check.json").read_text())
    assert not result["gpu"] and result["timing"] == "host clock (gloo: completion is real)"
    assert [r["strategy"] for r in result["memory"]] == list(check.STRATEGIES)
    assert result["nccl"]["wire_bytes"] == 0 and result["nccl"]["model_s"] == 0.0  # one rank sends nothing
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "verdict: dry run" in out
    assert check.main(["--table", str(tmp_path / "comm_check.json")]) == 0
