"""Mixed precision: the fp16 scaler's metrics, fp8's refusals, and notebook 06's number formats."""
import json
import math

import pytest
import torch

import labkit.train as train_module
from labkit.config import ConfigError, load_config
from labkit.validation import validate
from labkit.model import GPT, GPTShape
from labkit.precision import (Precision, _fp8_filter, build_precision, comparison_rows, fp8_capable, fp8_problems,
                              number_formats, overflowed, prepare_model, round_trip, scaled_round_trip, scaler_state,
                              scaler_trajectory, log_uniform_gradients)
from labkit.metrics.steps import overflow_steps
from labkit.train import train
from labkit.plots import illegible_texts
from labkit.widgets.precision import (ComparisonPlan, compare_precisions, comparison_figure, comparison_verdict,
                                      formats_figure, plan_comparison, scaler_figure)
from helpers import tiny_config


def step_events(run_dir):
    return [e for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == "step"]


# ---------------------------------------------------------------- fp16: the scaler as metrics

def test_overflow_is_a_lowered_scale():
    assert overflowed(65536.0, 32768.0)
    assert not overflowed(65536.0, 65536.0)
    assert not overflowed(65536.0, 131072.0)  # growth after a run of clean steps
    assert scaler_state(None, None) == {"loss_scale": None, "overflow": False}


def test_scaler_state_reads_a_real_scaler_after_an_inf_gradient():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for weight, want_overflow, want_scale in [(torch.ones(3), False, 1024.0),
                                              (torch.tensor([1.0, math.inf, 1.0]), True, 512.0)]:
        before = float(scaler.get_scale())
        opt.zero_grad()
        scaler.scale((p * weight).sum()).backward()  # the gradient is `weight`
        scaler.step(opt)
        scaler.update()
        assert scaler_state(scaler, before) == {"loss_scale": want_scale, "overflow": want_overflow}
    assert torch.allclose(p.detach(), torch.full((3,), 0.9))  # the first step applied, the second skipped


def test_scaler_trajectory_flags_exactly_the_skipped_steps():
    rows = scaler_trajectory(steps=12, spike_steps=(7,), init_scale=2.0**16, growth_interval=3)
    assert [r["step"] for r in rows if r["overflow"]] == [7]
    for r in rows:
        assert r["weights_changed"] is not r["overflow"]  # a skipped step leaves the weights alone
        assert r["loss_scale"] == (r["scale_before"] / 2 if r["overflow"] else r["loss_scale"])
    assert rows[2]["loss_scale"] == 2.0**17  # doubled after 3 clean steps
    too_high = scaler_trajectory(steps=6, spike_steps=(), init_scale=2.0**40, growth_interval=100)
    assert too_high[0]["overflow"] and too_high[-1]["loss_scale"] < 2.0**40


def _cpu_fp16(init_scale: float, growth_interval: int):
    """fp16 with a real CPU GradScaler: labkit refuses fp16 training on CPU (slow), tests force it."""
    def build(cfg, device):
        return Precision("fp16", device, torch.amp.GradScaler("cpu", init_scale=init_scale,
                                                               growth_interval=growth_interval))
    return build


def test_trainer_records_every_overflow_and_counts_them(tmp_path, monkeypatch):
    monkeypatch.setattr(train_module, "build_precision", _cpu_fp16(2.0**40, 2000))
    summary = train(tiny_config(**{"run.steps": 4}), tmp_path)
    events = step_events(tmp_path)
    # any gradient × 2^40 overflows fp16: every step is skipped and the scale halves each time
    assert [e["overflow"] for e in events] == [True] * 4 and all(e["skipped"] for e in events)
    assert [e["loss_scale"] for e in events] == [2.0**39, 2.0**38, 2.0**37, 2.0**36]
    assert summary["overflow_steps"] == 4


def test_trainer_records_the_growing_scale_without_overflow(tmp_path, monkeypatch):
    monkeypatch.setattr(train_module, "build_precision", _cpu_fp16(1.0, 2))
    summary = train(tiny_config(**{"run.steps": 6}), tmp_path)
    events = step_events(tmp_path)
    assert [e["loss_scale"] for e in events] == [1.0, 2.0, 2.0, 4.0, 4.0, 8.0]
    assert not any(e["overflow"] or e["skipped"] for e in events) and summary["overflow_steps"] == 0
    assert events[-1]["loss"] < events[0]["loss"]


def test_without_a_scaler_the_metrics_say_so(tmp_path):
    summary = train(tiny_config(**{"run.steps": 2}), tmp_path)
    assert [(e["loss_scale"], e["overflow"]) for e in step_events(tmp_path)] == [(None, False)] * 2
    assert summary["overflow_steps"] == 0
    assert overflow_steps([{"overflow": True}, {"overflow": False}, {}]) == 1


# ---------------------------------------------------------------- fp8

def test_fp8_on_cpu_is_refused_with_the_reason_and_the_fix():
    with pytest.raises(ConfigError) as error:
        validate(load_config(None, {"precision.mode": "fp8", "run.device": "cpu"}), nproc=1)
    (problem,) = [p for p in error.value.problems if "fp8" in p]
    assert "CPU" in problem and "8.9" in problem and "precision.mode=bf16" in problem
    with pytest.raises(ValueError, match="fp8 needs an NVIDIA GPU"):
        build_precision(load_config(None, {"precision.mode": "fp8"}), "cpu")


def test_fp8_on_gpus_needs_sm89_and_torchao():
    assert fp8_capable((8, 9)) and fp8_capable((9, 0)) and fp8_capable((10, 0))
    assert not fp8_capable((8, 0)) and not fp8_capable((8, 6)) and not fp8_capable(None)
    (old_gpu,) = fp8_problems("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", torchao="0.8.0")
    assert "sm_80" in old_gpu and "A100" in old_gpu and "precision.mode=bf16" in old_gpu
    (missing,) = fp8_problems("cuda", (9, 0), "NVIDIA H100", torchao=None)
    assert "torchao" in missing and "labkit[fp8]" in missing and "bf16" in missing
    (too_old,) = fp8_problems("cuda", (9, 0), "NVIDIA H100", torchao="0.5.0")
    assert "torchao 0.5.0" in too_old
    assert fp8_problems("cuda", (9, 0), "NVIDIA H100", torchao="0.10.0+cu126") == []
    assert fp8_problems("cuda", (8, 9), "NVIDIA L4", torchao="0.7.0") == []
    assert len(fp8_problems("cuda", (7, 5), "Tesla T4", torchao=None)) == 2


def test_fp8_converts_the_block_linears_but_not_the_tied_head():
    model = GPT(GPTShape(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=64))
    chosen = [name for name, m in model.named_modules() if _fp8_filter(m, name)]
    assert len(chosen) == 8 and all(n.split(".")[-1] in ("qkv", "proj", "fc") for n in chosen)
    assert not _fp8_filter(model.lm_head, "lm_head") and not _fp8_filter(torch.nn.Linear(64, 65), "h.0.fc")
    assert prepare_model(model, "bf16") is model  # only fp8 changes the model
    assert Precision("fp8", "cpu").autocast().fast_dtype == torch.bfloat16


# ---------------------------------------------------------------- notebook 06: formats and loss scaling

def test_number_formats_from_finfo():
    rows = {r["name"]: r for r in number_formats()}
    bits = {name: (r["bits"], r["exponent_bits"], r["mantissa_bits"]) for name, r in rows.items()}
    assert bits == {"fp32": (32, 8, 23), "bf16": (16, 8, 7), "fp16": (16, 5, 10), "fp8 e4m3": (8, 4, 3),
                    "fp8 e5m2": (8, 5, 2)}
    assert rows["fp16"]["max"] == 65504 and rows["fp8 e4m3"]["max"] == 448 and rows["fp8 e5m2"]["max"] == 57344
    assert rows["fp16"]["smallest_subnormal"] == 2.0**-24 and rows["bf16"]["eps"] == 2.0**-7
    for name, dtype in [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp8 e5m2", torch.float8_e5m2)]:
        tiny = rows[name]["smallest_subnormal"]
        assert torch.tensor(tiny).to(dtype).item() == tiny and torch.tensor(0.49 * tiny).to(dtype).item() == 0


def test_round_trip_shows_underflow_overflow_and_saturation():
    small, big, mid = round_trip([1e-10, 7e4, 500.0])
    assert small["fp16"] == 0 and small["bf16"] != 0
    assert big["fp16"] == math.inf and math.isfinite(big["bf16"]) and big["fp8 e5m2"] == math.inf
    assert mid["fp8 e4m3"] == 448 and mid["fp16"] == 500


def test_loss_scaling_rescues_small_gradients_until_it_overflows():
    grads = log_uniform_gradients(20_000, seed=1)
    plain, scaled, too_much = (scaled_round_trip(grads, s) for s in (1.0, 2.0**16, 2.0**32))
    assert plain["zero_frac"] > 0.3 and plain["inf"] == 0
    assert scaled["zero_frac"] == 0 and scaled["inf"] == 0 and scaled["median_rel_error"] < 2.0**-11
    assert too_much["inf"] > 0
    assert scaled_round_trip(grads, 1.0, torch.bfloat16)["zero_frac"] == 0  # bf16 has fp32's range


def test_figures_draw_what_they_are_given():
    assert len(formats_figure(number_formats()).axes[0].patches) == 2 * 5
    fig = scaler_figure(scaler_trajectory(steps=8, spike_steps=(5,)))
    assert len(fig.axes[0].collections[0].get_offsets()) == 1  # one overflow marked
    fake = {m: {"steps": [0, 1, 2], "losses": [3.0, 2.5, 2.0],
                "summary": {"tokens_per_s": tps, "final_loss": 2.0, "entropy_floor": 1.48}}
            for m, tps in (("fp32", 1000.0), ("bf16", 1500.0))}
    rows = comparison_rows(fake)
    assert [(r["mode"], r["speedup"]) for r in rows] == [("fp32", 1.0), ("bf16", 1.5)]
    loss_ax, tps_ax = comparison_figure(fake).axes
    assert len(loss_ax.lines) == 3 and len(tps_ax.patches) == 2


def fake_run(tps: float, steps: int = 12, jitter: float = 0.01, loss_shift: float = 0.0) -> dict:
    """A finished run as compare_precisions returns it: tokens/s alternating ±jitter around ``tps``."""
    return {"steps": list(range(steps)), "losses": [3.0 - 0.05 * i + loss_shift for i in range(steps)],
            "tokens_per_s": [tps * (1 + jitter * (-1) ** i) for i in range(steps)],
            "summary": {"tokens_per_s": tps, "final_loss": 2.5, "entropy_floor": 1.48}}


def test_every_figure_of_notebook_06_is_legible_at_the_output_width_and_counts_whole_steps():
    trajectory = scaler_trajectory(steps=20, spike_steps=(13,), init_scale=2.0**23, growth_interval=3)
    short = {"fp32": fake_run(1000.0, steps=20), "bf16": fake_run(150.0, steps=4)}
    for fig in (formats_figure(number_formats()), scaler_figure(trajectory), comparison_figure(short)):
        assert illegible_texts(fig) == []
    ax_loss = comparison_figure({m: dict(r, steps=[0, 1, 2], losses=[3.0, 2.5, 2.0]) for m, r in short.items()}).axes[0]
    ticks = [t for t in ax_loss.get_xticks() if ax_loss.get_xlim()[0] <= t <= ax_loss.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)  # no "step 2.5"
    legend = [t.get_text() for t in comparison_figure(short).axes[0].get_legend().get_texts()]
    assert legend[:2] == ["fp32 (20 steps)", "bf16 (4 steps)"]  # a shortened run says so


FAST = {"fp32": 0.090, "bf16": 0.190, "speedup": 0.190 / 0.090, "size": 256, "threads": 1}
SLOW = {"fp32": 0.080, "bf16": 0.001, "speedup": 0.001 / 0.080, "size": 256, "threads": 1}


def test_the_comparison_is_planned_from_a_measurement_of_bf16_here():
    """The issue's EPYC (no native bf16): 20 quick steps of bf16 took 113 s. Where bf16 measures slow, it trains only
    a few steps, and the plan says why; where it is fast, both precisions train every step."""
    cfg = tiny_config(**{"run.steps": 20, "run.device": "cpu"})
    slow = plan_comparison(cfg, 2, speed=SLOW, native=[])
    assert slow.steps == {"fp32": 20, "bf16": 4} and slow.speed is SLOW
    assert "×0.013" in slow.why and "no native bf16" in slow.why and "bf16 trains 4 of the 20 steps" in slow.why
    assert "recommend() picks fp32" in slow.why
    fast = plan_comparison(cfg, 2, speed=FAST, native=["avx512_bf16"])
    assert fast.steps == {"fp32": 20, "bf16": 20} and "recommend() picks bf16" in fast.why


def test_the_verdict_explains_a_result_against_the_lesson_from_the_numbers():
    slow_plan = ComparisonPlan({"fp32": 12, "bf16": 4}, SLOW, "")
    text = comparison_verdict({"fp32": fake_run(10514.0), "bf16": fake_run(434.0, steps=4, loss_shift=0.004)},
                              slow_plan)
    assert "bf16 trained at ×0.041 of fp32's speed: the lesson reversed" in " ".join(text.split())
    assert "×0.013 of fp32's here" in " ".join(text.split()) and "differ by at most 0.004" in text
    fast_plan = ComparisonPlan({"fp32": 12, "bf16": 12}, FAST, "")
    faster = comparison_verdict({"fp32": fake_run(1000.0), "bf16": fake_run(1600.0)}, fast_plan)
    assert faster.startswith("bf16 trained ×1.60 as fast as fp32") and "matmuls alone measured ×2.1" in faster
    even = " ".join(comparison_verdict({"fp32": fake_run(1000.0, jitter=0.2), "bf16": fake_run(1040.0, jitter=0.2)},
                                       fast_plan).split())
    assert even.startswith("bf16 and fp32 trained equally fast within the step-to-step noise (×1.04")
    assert "although bf16's matmuls measured ×2.1" in even
    slower = " ".join(comparison_verdict({"fp32": fake_run(1000.0), "bf16": fake_run(800.0)}, fast_plan).split())
    assert slower.startswith("bf16 trained at ×0.80 of fp32's speed although its matmuls measured ×2.1 here")
    assert all(len(line) <= 100 for line in (text + "\n" + faster).splitlines())  # printed without wrapping mid-word


@pytest.mark.multiproc
def test_compare_precisions_trains_the_same_run_in_each_mode(tmp_path):
    cfg = tiny_config(**{"run.steps": 4, "run.runs_dir": str(tmp_path), "run.name": "prec"})
    results = compare_precisions(cfg, ("fp32", "bf16"), nproc=1, steps={"bf16": 3})
    fp32, bf16 = results["fp32"]["losses"], results["bf16"]["losses"]
    assert len(fp32) == 4 and len(bf16) == 3 and len(results["bf16"]["tokens_per_s"]) == 3
    assert fp32[:3] != bf16 and abs(fp32[0] - bf16[0]) < 0.05  # same model and data, different rounding
    assert all(r["summary"]["tokens_per_s"] > 0 for r in results.values())
