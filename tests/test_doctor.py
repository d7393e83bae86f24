"""``labkit doctor``: the lab verdicts from constructed checks, the pure helpers, the CLI report,
and a real gloo run."""
import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from labkit import doctor
from labkit.cli import main as cli_main
from labkit.config import ConfigError
from labkit.doctor import FAIL, FULL, LABS, NO, OK, SLOW, WARN, Check, lab_verdicts
from labkit.text import too_wide

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHECK_NAMES = ["cores", "memory", "torch", "gpu", "gloo", "step", "bf16", "ports", "jupyter", "kernel", "browser",
               "disk"]


def machine(cores=2, gpus=0, bf16_fast=True, gloo=OK, jupyter=OK, low_memory=False) -> list[Check]:
    """Checks as a machine with these facts would return them."""
    return [Check("cores", OK if cores > 1 else WARN, f"{cores} usable", data={"cores": cores}),
            Check("memory", WARN if low_memory else OK, "", data={"low": low_memory}),
            Check("torch", OK, "2.13.0+cpu"),
            Check("gpu", OK, "", data={"count": gpus}),
            Check("gloo", gloo, "", data={"ran": True}),
            Check("bf16", OK, "", data={"fast": bf16_fast, "lab06": "" if bf16_fast else "bf16 is emulated here"}),
            Check("jupyter", jupyter, "")]


REFERENCE = doctor.Reference(0.30, {"model.n_layer": 2}, 2, "benchmarks/results/data_parallel.jsonl, torch_ddp")


def by_name(verdicts):
    return {v.notebook: v for v in verdicts}


def test_the_registry_names_every_lab_notebook_once():
    assert [lab.notebook for lab in LABS] == sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def test_two_cores_run_every_lab_at_full_speed():
    verdicts = lab_verdicts(machine(cores=2))
    assert {v.speed for v in verdicts} == {FULL}
    # the parts that start more processes than cores say so, without slowing the lab's verdict
    assert any("4 processes take turns on 2 cores" in r for r in by_name(verdicts)["03_model_parallel"].reasons)


def test_one_core_makes_the_multi_process_labs_slow_and_nothing_else():
    verdicts = by_name(lab_verdicts(machine(cores=1)))
    multi = {lab.notebook for lab in LABS if lab.procs >= 2}
    assert multi == {"00_quickstart", "01_cap_tradeoffs", "02_data_parallel", "03_model_parallel",
                     "04_communication", "06_mixed_precision", "07_fault_tolerance", "09_optimization_loop",
                     "11_capstone", "12_context_parallel", "13_mixture_of_experts"}
    assert {name for name, v in verdicts.items() if v.speed == SLOW} == multi
    assert "2 processes on 1 core: they take turns" in verdicts["02_data_parallel"].reasons[0]
    assert verdicts["08_scaling_laws"].speed == FULL  # its live points train one process


def test_emulated_bf16_slows_lab_06_and_says_what_it_does_instead():
    verdicts = by_name(lab_verdicts(machine(bf16_fast=False)))
    assert [n for n, v in verdicts.items() if v.speed != FULL] == ["06_mixed_precision"]
    assert verdicts["06_mixed_precision"].reasons == ("bf16 is emulated here",)


def test_the_lab_06_text_describes_the_shortened_bf16_run():
    text = doctor.lab06_text({"speedup": 0.31})
    assert "×0.31" in text and "fewer steps" in text and "fp16 is refused on a CPU" in text


def test_unmeasured_bf16_is_said_not_guessed():
    checks = machine()
    checks[5] = Check("bf16", OK, "not measured (--quick)", data={"fast": None})
    v = by_name(lab_verdicts(checks))["06_mixed_precision"]
    assert v.speed == FULL and v.reasons == ("bf16's speed was not measured (--quick)",)


def test_a_failed_gloo_run_stops_every_multi_process_lab():
    verdicts = by_name(lab_verdicts(machine(gloo=FAIL)))
    stopped = {n for n, v in verdicts.items() if v.speed == NO}
    assert stopped == {lab.notebook for lab in LABS if lab.procs >= 2}
    assert verdicts["05_flash_attention"].speed == FULL and verdicts["10_scaling_out"].speed == FULL


def test_without_jupyter_no_lab_runs():
    assert {v.speed for v in lab_verdicts(machine(jupyter=FAIL))} == {NO}


def test_one_gpu_cannot_host_the_two_process_runs_but_the_cap_lab_stays_on_the_cpu():
    verdicts = by_name(lab_verdicts(machine(gpus=1)))
    assert verdicts["00_quickstart"].speed == NO and "run.device=cpu" in verdicts["00_quickstart"].reasons[0]
    assert verdicts["01_cap_tradeoffs"].speed == FULL
    assert verdicts["08_scaling_laws"].speed == FULL
    assert not any("no GPU" in r for r in verdicts["05_flash_attention"].reasons)
    two = by_name(lab_verdicts(machine(gpus=2, cores=1)))  # on GPUs the cores do not decide
    assert two["02_data_parallel"].speed == FULL and two["01_cap_tradeoffs"].speed == SLOW


def test_no_gpu_lab_05_compares_the_cpu_kernels():
    v = by_name(lab_verdicts(machine()))["05_flash_attention"]
    assert v.speed == FULL and "no GPU: it compares the CPU kernels" in v.reasons[0]


def test_low_memory_slows_the_labs_that_train():
    verdicts = by_name(lab_verdicts(machine(low_memory=True)))
    assert verdicts["07_fault_tolerance"].speed == SLOW and verdicts["10_scaling_out"].speed == FULL


def test_meminfo_reads_kib_as_bytes():
    info = doctor.meminfo("MemTotal:       16384 kB\nMemAvailable:    2048 kB\nHugePages_Total:       0\n")
    assert info == {"MemTotal": 16384 * 1024, "MemAvailable": 2048 * 1024, "HugePages_Total": 0}


def test_memory_check_from_meminfo_text():
    low = doctor.check_memory(lambda: "MemTotal: 8388608 kB\nMemAvailable: 1048576 kB\n")
    assert (low.status, low.found, low.data["low"]) == (WARN, "1.0 GiB available of 8.0 GiB", True)
    assert doctor.check_memory(lambda: "MemTotal: 8388608 kB\nMemAvailable: 4194304 kB\n").status == OK


def test_memory_check_falls_back_off_linux():
    def no_proc():
        raise OSError("no /proc here")
    check = doctor.check_memory(no_proc)
    assert "in all" in check.found and "available" not in check.data


def test_torch_series():
    assert doctor.torch_series_ok("2.13.0+cpu") and doctor.torch_series_ok("2.13.1+cu128")
    assert not doctor.torch_series_ok("2.12.0") and not doctor.torch_series_ok("2.1.3")


def test_browser_missing_is_a_warning_not_a_failure():
    check = doctor.check_browser(which=lambda name: None, platform="linux")
    assert check.status == WARN and "http://127.0.0.1:8888" in check.advice
    found = doctor.check_browser(which=lambda name: "/usr/bin/firefox" if name == "firefox" else None)
    assert (found.status, found.found) == (OK, "firefox (/usr/bin/firefox)")


def test_disk_thresholds(tmp_path):
    class Usage:
        def __init__(self, free):
            self.free = free
    assert doctor.check_disk(tmp_path / "runs" / "x", lambda p: Usage(100 * 2**20)).status == FAIL
    assert doctor.check_disk(tmp_path, lambda p: Usage(2**30)).status == WARN
    assert doctor.check_disk(tmp_path, lambda p: Usage(50 * 2**30)).status == OK


def test_exit_code_fails_only_on_a_failed_check():
    assert doctor.exit_code([Check("a", OK, ""), Check("b", WARN, "")]) == 0
    assert doctor.exit_code([Check("a", OK, ""), Check("b", FAIL, "")]) == 1


def test_report_text_fits_the_projector():
    checks = machine(cores=1, bf16_fast=False, gloo=FAIL) + [
        Check("kernel", WARN, "a long finding " * 12, "a long piece of advice " * 10),
        doctor.step_check(0.9, REFERENCE, load=3.2, cores=1)]
    text = doctor.report_text(checks, lab_verdicts(checks))
    assert too_wide(text) == [] and "not ready: fix gloo first" in text


def test_cli_quick_json_names_every_check_and_every_lab():
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli_main(["doctor", "--quick", "--json"])
    report = json.loads(out.getvalue())
    assert [c["name"] for c in report["checks"]] == CHECK_NAMES
    assert {c["status"] for c in report["checks"]} <= {OK, WARN, FAIL}
    assert [lab["notebook"] for lab in report["labs"]] == [lab.notebook for lab in LABS]
    assert code == (0 if report["ok"] else 1) and report["ok"] == all(c["status"] != FAIL for c in report["checks"])
    gloo = next(c for c in report["checks"] if c["name"] == "gloo")
    assert gloo["data"]["ran"] is False  # --quick starts no process
    step = next(c for c in report["checks"] if c["name"] == "step")
    assert step["data"]["ran"] is False and "not timed (--quick)" in step["found"] and "load" in step["found"]


def test_cli_quick_text_fits_the_projector():
    out = io.StringIO()
    with redirect_stdout(out):
        cli_main(["doctor", "--quick"])
    assert too_wide(out.getvalue()) == [] and "labs" in out.getvalue().splitlines()


@pytest.mark.multiproc
def test_a_real_gloo_all_reduce_passes_here():
    check = doctor.check_gloo(run=True)
    assert check.status == OK, check.found
    assert check.data == {"ran": True} and "all-reduced over loopback" in check.found


# ---------------------------------------------------------------- the timed step: the verdict on constructed timings

@pytest.mark.parametrize("measured, ratio, slow", [(0.30, 1.0, False), (0.15, 0.5, False), (0.60, 2.0, False),
                                                   (0.63, 2.1, True), (3.0, 10.0, True)])
def test_slow_is_a_measured_step_above_the_stated_ratio(measured, ratio, slow):
    got_ratio, got_slow = doctor.step_verdict(measured, 0.30)
    assert got_ratio == pytest.approx(ratio) and got_slow is slow
    assert doctor.step_verdict(measured, 0.30, threshold=0.4)[1] is True  # the threshold is the one compared with


def test_a_slow_step_says_slow_with_its_ratio_and_what_to_do():
    check = doctor.step_check(0.75, REFERENCE, load=0.4, cores=2)
    assert check.status == WARN and check.found.startswith("slow: a 2-process step took 0.75 s, 2.5× the reference's")
    assert "above 2×" in check.found and "load 0.4 on 2 cores" in check.found and "quick mode" in check.advice
    assert check.found.endswith("; the reference: " + REFERENCE.where)
    assert check.data["slow"] is True and check.data["ratio"] == pytest.approx(2.5)


def test_a_busy_machine_is_told_to_close_programs_before_it_is_called_slow_for_good():
    check = doctor.step_check(0.75, REFERENCE, load=3.5, cores=2)
    assert check.status == WARN and "the machine is busy (load 3.5 on 2 cores)" in check.advice


def test_a_step_near_the_reference_is_ok_and_says_where_slow_begins():
    check = doctor.step_check(0.33, REFERENCE, load=0.2, cores=2)
    assert check.status == OK and "slow" not in check.found.split(",")[0]
    assert "1.1× the reference's 0.30 s (slow above 2×)" in check.found and check.data["slow"] is False


def test_quick_mode_and_a_missing_reference_time_nothing_but_still_read_the_load():
    quick = doctor.check_step(run=False, measure=pytest.fail, reference=lambda: REFERENCE, load=lambda: 5.0)
    assert quick.data["ran"] is False and "not timed (--quick)" in quick.found and "load 5.0" in quick.found
    assert quick.status == (WARN if 5.0 > quick.data["cores"] else OK)
    none = doctor.check_step(run=True, measure=pytest.fail, reference=lambda: None, load=lambda: None)
    assert "no reference" in none.found and "load not readable here" in none.found and none.status == OK


def test_a_failed_timed_run_is_a_warning_with_its_reason():
    def fails(error):
        def measure(reference):
            raise error
        return measure
    for error in (RuntimeError("no end within 300 s"), ConfigError("refused here")):
        check = doctor.check_step(run=True, measure=fails(error), reference=lambda: REFERENCE, load=lambda: 0.1)
        assert check.status == WARN and f"did not finish: {error}" in check.found and check.data["ran"]


def test_check_step_compares_what_it_measured_with_the_reference():
    check = doctor.check_step(measure=lambda ref: 3 * ref.step_s, reference=lambda: REFERENCE, load=lambda: 0.5)
    assert check.data["ratio"] == pytest.approx(3.0) and check.data["slow"] is True


def test_a_measured_slow_step_slows_every_multi_process_lab():
    checks = machine() + [doctor.step_check(0.9, REFERENCE, load=0.1, cores=2)]
    verdicts = by_name(lab_verdicts(checks))
    assert {n for n, v in verdicts.items() if v.speed == SLOW} == {lab.notebook for lab in LABS if lab.procs >= 2}
    assert any("3.0× the reference machine's" in r for r in verdicts["02_data_parallel"].reasons)
    assert verdicts["08_scaling_laws"].speed == FULL
    fast = by_name(lab_verdicts(machine() + [doctor.step_check(0.3, REFERENCE, load=0.1, cores=2)]))
    assert {v.speed for v in fast.values()} == {FULL}


def test_the_reference_is_the_newest_full_two_process_ddp_row_of_the_shipped_results():
    ref = doctor.load_reference()
    assert ref is not None, "benchmarks/results/data_parallel.jsonl has no full 2-process table"
    assert ref.step_s > 0 and ref.shape["parallel.dp.strategy"] == "torch_ddp" and ref.warmup_steps >= 1
    assert re.fullmatch(r"benchmarks/results/data_parallel\.jsonl, torch_ddp, \d{4}-\d\d-\d\d, .+, \d+ cores",
                        ref.where), ref.where
    records = [{"table": "data_parallel", "date": "2026-01-0%d" % i, "machine": "a laptop",
                "settings": {"quick": quick, "nproc": 2, "shape": {"n": i}, "warmup_steps": 2},
                "rows": [{"variant": "zero1", "step_s": 9.0}, {"variant": "torch_ddp", "step_s": float(i)}]}
               for i, quick in ((1, False), (2, False), (3, True))]
    assert doctor.step_reference(records) == doctor.Reference(
        2.0, {"n": 2}, 2, "benchmarks/results/data_parallel.jsonl, torch_ddp, 2026-01-02, a laptop")


@pytest.mark.multiproc
def test_a_real_two_process_step_is_timed_and_judged_here():
    check = doctor.check_step(run=True)
    data = check.data
    assert data["ran"] is True and data["step_s"] > 0, check.found
    # the format and the verdict's consistency with what was measured; never the timing itself
    assert data["ratio"] == pytest.approx(data["step_s"] / data["reference_s"])
    assert data["slow"] is (data["ratio"] > doctor.SLOW_RATIO)
    assert re.match(r"(slow: )?a 2-process step took \d+\.\d\d s, \d+\.\d× the reference's \d+\.\d\d s "
                    r"\((above|slow above) 2×\); load \d+\.\d on \d+ cores?; the reference: "
                    r"benchmarks/results/data_parallel\.jsonl, torch_ddp, \d{4}-\d\d-\d\d, .+, \d+ cores$",
                    check.found), check.found
    assert check.found.startswith("slow: ") is data["slow"] and check.status == (WARN if data["slow"] else OK)
