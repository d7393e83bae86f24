"""Scaling sweeps on live runs, the fits on the shipped sweep, and the lab's pictures and planner."""
from pathlib import Path

import pytest
import yaml

from labkit.data import build_datasets
from labkit.model import GPT, GPTShape
from labkit.scaling.report import fit_report, fit_sweep
from labkit.scaling.sweep import SweepSpec, config_overrides, read_results, run_sweep
from labkit.widgets.scaling import (BudgetPlanner, allocation_figure, curves_figure, isoflop_figure,
                                    surface_figure)

ROOT = Path(__file__).parents[2]
SHIPPED = ROOT / "datasets" / "scaling" / "bigram"
SPEC = ROOT / "configs" / "scaling" / "bigram.yaml"


def _spec(tmp_path, **raw) -> Path:
    body = {"name": "tiny", "base": str(ROOT / "configs" / "quickstart.yaml"),
            "overrides": {"model.n_layer": 1, "model.n_head": 2, "metrics.progress": False, "run.save_final": False,
                          "run.runs_dir": "/tmp/labkit-test-runs", "metrics.alerts": False},
            "sizes": [{"model.n_embd": 16}, {"model.n_embd": 32}], "tokens": [20480], **raw}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.mark.parametrize("raw, message", [
    ({"epochs": 3}, "unknown sweep key"),
    ({"sizes": []}, "at least one entry in 'sizes'"),
    ({"tokens": [-5]}, "positive number"),
])
def test_bad_sweep_specs_are_refused(tmp_path, raw, message):
    with pytest.raises(ValueError, match=message):
        SweepSpec.load(_spec(tmp_path, **raw))


def test_points_size_each_run_and_isoflop_sets_keep_6ND_on_budget(tmp_path):
    spec = SweepSpec.load(_spec(tmp_path, isoflops=[1e10]))
    points = dict(spec.points())
    assert len(points) == 4 and points["n_embd16-steps10"]["run.steps"] == 10  # 20480 tokens / 2048 per step
    for size in spec.sizes:
        iso = next(o for n, o in points.items() if "-C" in n and all(o[k] == v for k, v in size.items()))
        n = spec.params(size)
        tokens = iso["run.steps"] * spec.tokens_per_step()
        assert abs(6 * n * tokens - 1e10) <= 6 * n * spec.tokens_per_step() / 2  # within half a step
        assert iso["_budget"] == 1e10 and "_budget" not in config_overrides(iso)


def test_parameter_count_is_the_real_models(tmp_path):
    spec = SweepSpec.load(_spec(tmp_path))
    cfg = spec.base.replace(**spec.sizes[1])
    _, _, tokenizer, _ = build_datasets(cfg.data.dataset, cfg.data.tokenizer, cfg.model.block_size, 0.1)
    model = GPT(GPTShape.from_config(cfg.model, tokenizer.vocab_size))
    assert spec.params(spec.sizes[1]) == sum(p.numel() for p in model.parameters())


@pytest.mark.multiproc
def test_sweep_is_resumable(tmp_path):
    spec = SweepSpec.load(_spec(tmp_path))
    said = []
    first = run_sweep(spec, tmp_path / "out", on_progress=said.append, limit=1)
    assert len(first) == 1 and first[0]["name"] == "n_embd16-steps10"
    row = first[0]
    assert row["tokens"] == 10 * 2048 and row["flops_6nd"] == 6 * row["params"] * row["tokens"]
    assert row["flops"] > row["flops_6nd"] * 0.9 and row["val_loss"] > 0 and len(row["curve"]) == 10
    said.clear()
    both = run_sweep(spec, tmp_path / "out", on_progress=said.append)
    assert [r["name"] for r in both] == ["n_embd16-steps10", "n_embd32-steps10"]
    assert said[0] == "[1/1] n_embd32-steps10 (1 done before)"  # the finished point was not rerun
    assert (tmp_path / "out" / "sweep.yaml").exists()


def test_shipped_sweep_recovers_the_entropy_floor():
    results = read_results(SHIPPED)
    spec = SweepSpec.load(SPEC)
    assert {r["name"] for r in results} == {name for name, _ in spec.points()}  # every point, nothing else
    fits = fit_sweep(results, n_bootstrap=10)
    floor = 2.323428375441827
    assert fits.floor == pytest.approx(floor)
    assert abs(fits.parametric.E - floor) / floor < 0.10, fit_report(results)
    assert fits.isoflop is not None and 0 < fits.isoflop.a < 1, fits.problems
    print(fit_report(results))


def test_shipped_markov_sweep_is_complete():
    """The counter-example the notebook shows (a plateau breaks the power law) is a full sweep too."""
    spec = SweepSpec.load(ROOT / "configs" / "scaling" / "markov.yaml")
    results = read_results(ROOT / "datasets" / "scaling" / "markov")
    assert sorted(r["name"] for r in results) == sorted(name for name, _ in spec.points())


def test_lab_figures_and_planner_on_the_shipped_sweep():
    results = read_results(SHIPPED)
    fits = fit_sweep(results, n_bootstrap=5)
    curves = curves_figure(results, fits.floor)
    assert any("entropy floor" in t for t in curves.axes[0].get_legend_handles_labels()[1])
    assert len(isoflop_figure(results, fits.isoflop).axes[0].lines) > 3
    labels = surface_figure(results, fits.parametric, fits.floor).axes[0].get_legend_handles_labels()[1]
    assert f"fitted E = {fits.parametric.E:.4f}" in labels and "true entropy floor = 2.3234" in labels
    assert len(allocation_figure(fits.parametric.params).axes[0].lines) == 3
    planner = BudgetPlanner(fits.parametric.params, fits.flops_per_second, 2048)
    small = planner.current_plan()
    planner.minutes.value = 100.0
    big = planner.current_plan()
    assert big.flops == pytest.approx(small.flops * 10)
    assert big.recommended.n_params > small.recommended.n_params and "<b" not in planner.table.value
    assert f"{big.recommended.n_params:,.0f}" in planner.table.value
    planner.law.value = "Chinchilla published"
    assert planner.current_plan().recommended.predicted_loss > 1.69  # Chinchilla's E


def test_cli_fit_and_bad_spec(tmp_path, capsys):
    from labkit.cli import main

    assert main(["scaling", "fit", str(SHIPPED)]) == 0
    assert "approach 3" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsizes: []\n")
    assert main(["scaling", "sweep", str(bad)]) == 2
    assert "at least one entry in 'sizes'" in capsys.readouterr().err
