import json
import os

import pytest

from labkit.hardware import cpu_fingerprint, cpu_peak_tflops, device_peak, gpu_peak_tflops, match_gpu
from labkit.metrics import CommTimer, EventWriter, achieved_tflops, mfu, read_events
from labkit.metrics.timers import union_length


@pytest.mark.parametrize("name,row", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("NVIDIA B200", "B200"),
    ("NVIDIA GeForce GTX 1080", None),
])
def test_gpu_names_match_the_right_row(name, row):
    assert match_gpu(name) == row


def test_unknown_peaks_are_none_not_guesses():
    assert gpu_peak_tflops("NVIDIA GeForce GTX 1080", "bf16") is None
    assert gpu_peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # V100 has no bf16 tensor cores
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4)
    assert mfu(1.0, None) is None and mfu(1.0, 4.0) == 0.25


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(dtype, threads):
        calls.append((dtype, threads))
        return 0.123

    first = cpu_peak_tflops("fp32", 3, measure=fake_measure)
    second = cpu_peak_tflops("fp32", 3, measure=fake_measure)
    cpu_peak_tflops("bf16", 3, measure=fake_measure)
    assert first["tflops"] == second["tflops"] == 0.123 and calls == [("fp32", 3), ("bf16", 3)]
    assert len(json.loads((tmp_path / "cpu_peak.json").read_text())) == 2


def test_real_cpu_measurement_is_plausible():
    from labkit.hardware import measure_matmul_tflops

    assert 1e-4 < measure_matmul_tflops("fp32", threads=1, size=256, seconds=0.1) < 50


@pytest.mark.multiproc
def test_cpu_fingerprint_names_the_kernel_level_that_was_forced():
    """ATEN_CPU_CAPABILITY lowers torch's kernels (how an AVX-512 machine runs an AVX2 machine's paths):
    the fingerprint reports the level in force, read from torch in a fresh process."""
    import subprocess
    import sys

    code = "from labkit.hardware import cpu_fingerprint; print(cpu_fingerprint()['torch_cpu_capability'])"
    forced = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                            capture_output=True, text=True, check=True).stdout.strip()
    assert forced == "DEFAULT"
    here = cpu_fingerprint()
    assert here["cpu"] and here["cores"] >= 1 and set(here["isa"]) <= {"avx2", "fma", "avx512f", "avx512_bf16",
                                                                        "avx512_fp16", "amx_bf16"}


def test_user_override_wins():
    assert device_peak("cpu", "fp32", 1, override=2.5) == {"tflops": 2.5, "source": "metrics.peak_tflops (set by the user)"}


def test_achieved_tflops():
    assert achieved_tflops(6e6, 1000, 2.0, 2) == pytest.approx(6e6 * 1000 / 2 / 2 / 1e12)


def test_union_length_does_not_double_count_overlaps():
    assert union_length([]) == 0
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert union_length([(3, 4), (0, 10)]) == pytest.approx(10.0)


def test_comm_timer_collects_and_resets():
    timer = CommTimer()
    a = timer.launched(100)
    b = timer.launched(50)
    timer.completed(a)
    timer.completed(b)
    got = timer.collect()
    assert got["comm_bytes"] == 150 and got["comm_calls"] == 2 and got["comm_s"] >= 0
    assert got["comm_exposed_s"] <= got["comm_s"] + 1e-9
    assert timer.collect() == {"comm_s": 0.0, "comm_exposed_s": 0.0, "comm_bytes": 0, "comm_calls": 0,
                               "comm_intervals": []}


def test_exposed_communication_is_what_runs_after_compute_is_done():
    now = [0.0]
    timer = CommTimer(clock=lambda: now[0])

    def at(t, action, *args):
        now[0] = t
        return action(*args)

    a = at(2.0, timer.launched, 10)  # bucket 1 launched mid-backward...
    at(4.0, timer.completed, a)  # ...and done while backward still computes: hidden
    at(4.5, timer.grad_ready)  # last gradient ready: compute is over
    b = at(4.5, timer.launched, 10)
    at(7.0, timer.completed, b)  # the step waits 2.5 s on this one
    got = timer.collect()
    assert got["comm_s"] == pytest.approx(4.5) and got["comm_exposed_s"] == pytest.approx(2.5)
    c = at(10.0, timer.launched, 10)  # no hooks (naive DDP): compute ends when backward returns
    at(9.0, timer.backward_done)
    at(11.0, timer.completed, c)
    assert timer.collect()["comm_exposed_s"] == pytest.approx(1.0)


def test_events_round_trip_and_tail_incrementally(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = EventWriter(path)
    writer.write("step", step=0, loss=float("nan"), mfu=None)
    events, offset = read_events(path)
    assert events[0]["loss"] is None and events[0]["type"] == "step"  # NaN is not JSON: written as null
    with open(path, "a") as f:
        f.write('{"type": "step", "st')  # a line still being written is not read
    more, offset2 = read_events(path, offset)
    assert more == [] and offset2 == offset
    with open(path, "a") as f:
        f.write('ep": 1}\n')
    more, _ = read_events(path, offset)
    assert more == [{"type": "step", "step": 1}]
    writer.close()


def test_recommend_explains_each_choice():
    from labkit.hardware import detect, recommend

    h100 = {"device": "cuda", "count": 8, "name": "NVIDIA H100", "bf16": True, "fp16": True, "fp8": True,
            "flash_attn": True, "triton": True}
    advice = recommend(h100)
    assert advice["backend"][0] == "nccl" and advice["precision"][0] == "bf16"
    assert advice["attention"][0] == "flash_attn" and advice["compile"][0] == "verify"
    v100 = dict(h100, name="Tesla V100", bf16=False, fp8=False, flash_attn=False)
    assert recommend(v100)["precision"][0] == "fp16" and recommend(v100)["attention"][0] == "sdpa"
    here = detect()
    assert here["device"] == "cpu" and recommend(here)["backend"][0] == "gloo"
    assert recommend(here)["precision"][0] == ("bf16" if here["bf16"] else "fp32")
    assert all(len(reason) > 20 for _, reason in recommend(here).values())


def test_auto_settings_are_resolved_with_a_reason(tmp_path):
    import json

    from helpers import tiny_config
    from labkit.hardware import detect
    from labkit.train import train

    summary = train(tiny_config(**{"run.steps": 2, "precision.mode": "auto", "attention.backend": "auto"}), tmp_path)
    start = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])
    expected = "bf16" if detect()["bf16"] else "fp32"
    assert summary["auto"]["precision.mode"].startswith(f"auto → {expected}: ")
    assert summary["auto"]["attention.backend"].startswith("auto → sdpa: ") and start["auto"] == summary["auto"]
    assert start["attention_kernel"].startswith("sdpa → ")


def test_a_failure_during_a_requested_stop_is_reported_as_the_stop(tmp_path):
    from labkit.metrics.events import as_requested_stop, request_stop

    seen = {"status": "failed", "error": "DistBackendError: peer closed"}
    assert as_requested_stop(dict(seen), tmp_path)["status"] == "failed"  # no request: a real failure
    request_stop(tmp_path)
    summary = as_requested_stop(dict(seen), tmp_path)
    assert summary["status"] == "stopped" and "peer closed" in summary["error"]
    assert as_requested_stop({"status": "finished"}, tmp_path)["status"] == "finished"
