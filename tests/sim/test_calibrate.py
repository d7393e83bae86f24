"""labkit.sim.calibrate: the fits recover known constants from synthetic measurements, the prediction's pieces
(the oversubscription rule, gloo's reduce-scatter, the collectives a dry run counts), the table and the shipped
results file; and benchmarks/sim_calibration.py's quick mode.

Behaviour only: no timing is asserted (the measured step times live in the benchmark's results file)."""
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from labkit.comm.network import collective_cost
from labkit.config import load_config
from labkit.results import load_results, results_path
from labkit.sim.calibrate import (BAR, Calibration, Measured, calibrate, core_share, extra_terms, fit_link,
                                  layout_of, least_squares_two, machine_cluster, predict,
                                  recorded_comm_seconds)
from labkit.sim.calibrate_report import calibration_text, error_rows
from labkit.text import too_wide
from labkit.sim.layout import Layout, ModelShape
from labkit.sim.step import collective_seconds, total_params

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRUE = Calibration(rate=70e9, layer_overhead_s=3e-3, optimizer_s_per_param=5e-9,
                   links=((2, 1e-3, 1.2e9), (4, 2e-3, 0.8e9)), cores=2, fsdp_unit_overhead_s=7e-3)
SIZES = [4096, 65536, 1 << 20, 4 << 20, 16 << 20]


def timed(cal: Calibration, latency_scale: float = 1.0) -> list[dict]:
    """Synthetic timed all-reduces: what the step model's own collective cost gives on ``cal``'s links, their
    latency × ``latency_scale`` (timed alone, a collective overstates what a step pays per round; β as is)."""
    def link(p):
        return dataclasses.replace(cal.link(p), latency=cal.link(p).latency * latency_scale)
    return [{"op": "all_reduce", "world": p, "bytes": n, "back_to_back": 0.0,
             "seconds": collective_seconds("all_reduce", n, p, link(p), 1.0)} for p, _, _ in cal.links for n in SIZES]


def run(name, shape, layout, processes, cal=TRUE, fit_for=None, calls=None) -> Measured:
    """A synthetic measured run whose step and optimizer phase are what ``cal`` predicts."""
    step = predict(shape, layout, cal, processes, calls)["total"]
    return Measured(name, shape, layout, processes, step, extra_terms(shape, layout, cal, processes)["optimizer"],
                    fit_for, calls)


SMALL, MEDIUM, DEEP = ModelShape(128, 4, 4, 64, 16), ModelShape(256, 4, 4, 64, 16), ModelShape(192, 8, 4, 64, 16)
DDP2 = Layout(dp=2, micro_batch=4, micro_batches=2, overlap_dp=False, attention="flash")
TP = dict(micro_batch=4, micro_batches=4, overlap_dp=False, attention="flash")
FSDP2 = Layout(dp=2, zero=3, micro_batch=4, micro_batches=2, overlap_dp=False, attention="flash")


def fit_runs(cal=TRUE) -> list[Measured]:
    return [run(f"ddp2_{i}", shape, DDP2, 2, cal, "compute") for i, shape in enumerate((SMALL, MEDIUM, DEEP))] + [
        run("tp2", MEDIUM, Layout(tp=2, **TP), 2, cal, "latency"), run("tp4", MEDIUM, Layout(tp=4, **TP), 4, cal, "latency"),
        run("fsdp2", MEDIUM, FSDP2, 2, cal, "fsdp")]


def test_fit_link_recovers_alpha_and_beta_at_each_process_count():
    samples = timed(TRUE) + [{"op": "send", "world": 2, "bytes": 4096, "seconds": 9.0, "back_to_back": 0.0}]
    for processes, alpha, beta in TRUE.links:  # the other ops are not fitted on
        got_alpha, got_beta = fit_link(samples, processes)
        assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_beta == pytest.approx(beta, rel=1e-6)
    with pytest.raises(ValueError, match="two sizes"):
        fit_link(samples[:1], 2)


def test_least_squares_two_solves_exactly_and_pins_a_negative_unknown_at_zero():
    rows = [(a, b, 2 * a + 3 * b, 1.0) for a, b in ((1, 0), (0, 1), (1, 1), (2, 5))]
    assert least_squares_two(rows) == pytest.approx((2, 3))
    x, y = least_squares_two([(1, 1, 1.0, 1.0), (1, 2, 0.5, 1.0)])  # unconstrained: x = 1.5, y = -0.5
    assert y == 0.0 and x == pytest.approx(0.75)


def test_calibrate_recovers_every_constant_from_synthetic_runs():
    """Alone, the timed collectives overstate α threefold here; the latency runs put it right."""
    held = run("pp2", MEDIUM, Layout(pp=2, micro_batch=2, micro_batches=8, overlap_dp=False), 2)
    got = calibrate(timed(TRUE, latency_scale=3.0), fit_runs() + [held], cores=2)
    assert got.rate == pytest.approx(TRUE.rate, rel=1e-6)
    assert got.layer_overhead_s == pytest.approx(TRUE.layer_overhead_s, rel=1e-6)
    assert got.optimizer_s_per_param == pytest.approx(TRUE.optimizer_s_per_param, rel=1e-6)
    assert got.fsdp_unit_overhead_s == pytest.approx(TRUE.fsdp_unit_overhead_s, rel=1e-6)
    for (p, a, b), (q, c, d) in zip(got.links, TRUE.links):
        assert p == q and a == pytest.approx(c, rel=1e-5) and b == pytest.approx(d, rel=1e-5)
    assert all(abs(row["error"]) < 1e-5 and row["held"] for row in error_rows(fit_runs() + [held], got))
    without = calibrate(timed(TRUE, latency_scale=3.0), [r for r in fit_runs() if r.fit_for == "compute"], cores=2)
    assert without.link(2).latency > 2 * TRUE.link(2).latency  # no latency run: the timed α stands


def test_a_run_fixes_only_what_it_is_fitted_for():
    with pytest.raises(ValueError, match="fit_for"):
        Measured("x", MEDIUM, DDP2, 2, 1.0, 0.1, "everything")
    with pytest.raises(ValueError, match="compute"):
        calibrate(timed(TRUE), [r for r in fit_runs() if r.fit_for != "compute"], cores=2)
    fsdp_share = predict(MEDIUM, FSDP2, TRUE, 2)["fsdp_overhead"]
    assert fsdp_share == pytest.approx(2 * (4 + 1) * 7e-3)  # 2 micro-batches × (4 blocks + the root) units
    assert predict(MEDIUM, DDP2, TRUE, 2)["fsdp_overhead"] == 0


def test_oversubscription_gives_each_process_its_share_of_a_core():
    assert core_share(2, 2) == 1.0 and core_share(1, 2) == 1.0 and core_share(4, 2) == 0.5 and core_share(8, 2) == 0.25
    assert machine_cluster(TRUE, 4).gpu.peak_flops("fp32") == pytest.approx(TRUE.rate / 2)
    assert machine_cluster(TRUE, 2).gpu.peak_flops("fp32") == pytest.approx(TRUE.rate)
    assert machine_cluster(TRUE, 4).intra.latency == 2e-3  # the link measured with 4 processes
    assert machine_cluster(TRUE, 4).intra.algorithms == ("ring",)  # gloo runs a ring, whatever the size
    # the same work per rank (4 sequences) on 4 processes takes twice as long on 2 cores, the same on 4 cores
    four, two = Layout(dp=4, micro_batch=4, overlap_dp=False), Layout(dp=2, micro_batch=4, overlap_dp=False)
    for term in ("compute", "layer_overhead", "optimizer"):
        assert predict(MEDIUM, four, TRUE, 4)[term] == pytest.approx(2 * predict(MEDIUM, two, TRUE, 2)[term])
        roomy = dataclasses.replace(TRUE, cores=4)
        assert predict(MEDIUM, four, roomy, 4)[term] == pytest.approx(predict(MEDIUM, two, roomy, 2)[term])


def test_a_gloo_reduce_scatter_is_costed_as_an_all_reduce_and_a_recv_as_a_send():
    link = TRUE.link(2)
    one = recorded_comm_seconds([("reduce_scatter", 2, 1 << 20)], link)
    assert one == pytest.approx(collective_seconds("all_reduce", 1 << 20, 2, link, 1.0))
    assert one > collective_seconds("reduce_scatter", 1 << 20, 2, link, 1.0)
    assert recorded_comm_seconds([("recv", 2, 4096)], link) == recorded_comm_seconds([("send", 2, 4096)], link)


def test_uncounted_comm_is_what_the_recorded_calls_add_to_the_step_models_count():
    params = 4 * total_params(MEDIUM)  # every gradient, fp32
    one_bucket = predict(MEDIUM, DDP2, TRUE, 2, calls=(("all_reduce", 2, params),))
    assert one_bucket["uncounted_comm"] == pytest.approx(0.0, abs=1e-12)  # DDP's single all-reduce: counted
    per_tensor = predict(MEDIUM, DDP2, TRUE, 2, calls=(("all_reduce", 2, params / 27),) * 27)
    cost = collective_cost("all_reduce", params / 27, 2)
    assert per_tensor["uncounted_comm"] == pytest.approx(26 * cost.rounds * 1e-3, rel=1e-6)  # 26 latencies more
    assert per_tensor["total"] - one_bucket["total"] == pytest.approx(per_tensor["uncounted_comm"])


def test_layout_of_reads_a_labkit_config():
    base = {"model.n_layer": 4, "model.n_head": 4, "model.n_embd": 64, "data.batch_size": 16,
            "data.micro_batch_size": 4}
    ddp = layout_of(load_config(None, {**base, "parallel.dp.strategy": "torch_ddp"}), 2)
    assert (ddp.dp, ddp.tp, ddp.pp, ddp.micro_batches, ddp.zero, ddp.overlap_dp) == (2, 1, 1, 2, 0, False)
    assert ddp.attention == "flash" and ddp.bucket_bytes == 25 * 2 ** 20  # sdpa; labkit's default 25 MB buckets
    zero2 = layout_of(load_config(None, {**base, "parallel.dp.strategy": "zero2", "parallel.dp.bucket_mb": 4.0}), 2)
    assert zero2.zero == 2 and zero2.bucket_bytes == 4 * 2 ** 20
    assert layout_of(load_config(None, {**base, "parallel.dp.strategy": "fsdp2"}), 4).zero == 3
    pp = layout_of(load_config(None, {**base, "parallel.pp.degree": 2, "parallel.dp.strategy": "ddp_naive",
                                      "data.micro_batch_size": 2}), 2)
    assert (pp.dp, pp.pp, pp.micro_batches, pp.schedule) == (1, 2, 8, "1f1b")
    tp = layout_of(load_config(None, {**base, "parallel.tp.degree": 2, "parallel.dp.strategy": "ddp_naive",
                                      "attention.backend": "naive"}), 4)
    assert (tp.dp, tp.tp, tp.micro_batches, tp.attention) == (2, 2, 2, "naive")


def test_dry_run_counts_labkits_naive_ddp_one_all_reduce_per_parameter_tensor():
    from labkit.sim.calibrate_measure import dry_run_calls

    cfg = load_config(None, {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16,
                             "data.batch_size": 8, "data.micro_batch_size": 4, "parallel.dp.strategy": "ddp_naive"})
    calls = dry_run_calls(cfg, 2)
    assert {kind for kind, _, _ in calls} == {"all_reduce"} and {size for _, size, _ in calls} == {2}
    assert len(calls) == 6 * 2 + 3  # per block ln_1, qkv, proj, ln_2, fc, fc-proj; wte, wpe, ln_f
    assert sum(nbytes for *_, nbytes in calls) == 4 * total_params(ModelShape(32, 2, 2, 16, 16))


def record_for(rows, cal=TRUE) -> dict:
    return {"date": "2026-12-02", "machine": {"cpu": "a CPU", "cores": 2, "isa": [], "torch": "2.x"},
            "settings": {"cpu_model_name": "a CPU", "constants": cal.as_dict(), "load_average_1min": [0.5, 1.5]},
            "rows": rows}


def test_calibration_text_names_every_run_and_each_miss():
    runs = fit_runs() + [dataclasses.replace(run("pp2", MEDIUM, DDP2, 2), step_s=1.0)]
    text = calibration_text(record_for(error_rows(runs, TRUE)))
    assert Calibration.from_dict(TRUE.as_dict()) == TRUE
    assert "70.0 GFLOP/s" in text and "3.00 ms per micro-batch" in text and "α 1.00 ms per round, β 1.20 GB/s" in text
    for r in runs:
        assert r.name in text
    assert text.count("fit: compute") == 3 and "fit: latency" in text and "fit: fsdp" in text
    assert not too_wide(text)
    assert "OUTSIDE ±15%" in text and "0 of 1 held-out runs within ±15%" in text


def test_the_shipped_results_hold_a_full_run_whose_table_is_consistent():
    records = [r for r in load_results(results_path("sim_calibration")) if not r["settings"]["quick"]]
    assert records, "benchmarks/results/sim_calibration.jsonl holds no full run"
    record = records[-1]
    assert record["benchmark"] == "sim_calibration" and record["table"] == "calibration"
    assert {"cpu", "isa", "torch", "cores"} <= set(record["machine"])
    settings = record["settings"]
    assert len(settings["load_average_1min"]) == 2 and settings["rounds"] >= 2
    cal = Calibration.from_dict(settings["constants"])
    assert cal.rate > 0 and cal.layer_overhead_s >= 0 and cal.optimizer_s_per_param > 0
    assert {p for p, *_ in cal.links} == {2, 4} and all(a > 0 and b > 0 for _, a, b in cal.links)
    assert {(c["op"], c["world"]) for c in settings["collectives"]} >= {("all_reduce", 2), ("all_reduce", 4)}
    rows = record["rows"]
    assert sum(not r["held_out"] for r in rows) >= 2 and sum(r["held_out"] for r in rows) >= 5
    for r in rows:
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        assert r["held"] == (abs(r["error"]) <= BAR)
        assert r["predicted_s"] == pytest.approx(sum(r["terms_s"].values()))
    text = calibration_text()
    assert all(r["run"] in text for r in rows)


@pytest.mark.multiproc
def test_quick_mode_runs_and_records_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_calibration.py"), "--quick"], cwd=ROOT,
                          env={**os.environ, "LABKIT_RESULTS_DIR": str(tmp_path)}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (tmp_path / "sim_calibration.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["settings"]["quick"] is True and record["table"] == "calibration"
    bench_runs = set(record["settings"]["runs"])
    assert {r["run"] for r in record["rows"]} == bench_runs
    assert {r["processes"] for r in record["rows"]} == {2, 4}
    for r in record["rows"]:
        assert math.isfinite(r["measured_s"]) and r["measured_s"] > 0 and math.isfinite(r["predicted_s"])
    assert "held-out runs within" in done.stdout and "held-out runs within" in record["notes"]
