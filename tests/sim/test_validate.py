"""The model against published runs: one test per paper's table, asserting its bar point by point.

Where the model misses a bar the table says so (``held=False``) and the miss is listed here by name
(KNOWN_MISSES): a test fails if a held point stops holding, if a listed miss starts holding (update the
list, and the report), or if any row's ``held`` disagrees with its bar recomputed from the numbers.
"""
import re
from pathlib import Path

import pytest

from labkit.sim import step, validate
from labkit.text import too_wide

KNOWN_MISSES = {"Shoeybi 2019": set(), "Narayanan 2021": set(), "Korthikanti 2022": set()}
KNOWN_ORDER_MISSES = {384}  # GPU counts where the model does not put PTD-P 174.6B ahead of ZeRO-3, as published


@pytest.fixture(scope="module")
def table():
    return validate.validation_table()


def rows_of(table, paper):
    rows = [r for r in table if r.paper == paper]
    assert rows
    return rows


def test_shoeybi_2019_weak_scaling_within_8_points(table):
    rows = rows_of(table, "Shoeybi 2019")
    assert len(rows) == 8
    for r in rows:
        assert r.error == pytest.approx(r.predicted - r.published, abs=0.11)
        assert r.held == (abs(r.error) <= 8), r
    assert {r.point for r in rows if not r.held} == KNOWN_MISSES["Shoeybi 2019"]
    # model parallel alone holds everywhere: the TP all-reduce over NVSwitch is the whole story there
    assert all(r.held for r in rows if "model parallel" in r.point and "data" not in r.point)
    mp = [r.predicted for r in rows if "data" not in r.point]
    assert mp == sorted(mp, reverse=True)  # efficiency falls as the model-parallel group grows, as published


def test_narayanan_2021_table2_within_20_percent_and_in_shape(table):
    rows = rows_of(table, "Narayanan 2021")
    points = [r for r in rows if not r.point.startswith("shape")]
    assert len(points) == 12
    for r in points:
        assert r.error == pytest.approx(r.predicted / r.published - 1, abs=3e-3)
        assert r.held == (abs(r.error) <= 0.20), r
    assert {r.point for r in rows if not r.held} == KNOWN_MISSES["Narayanan 2021"]
    assert all(r.held for r in points if r.point.startswith("PTD-P"))
    by_point = {r.point: r.predicted for r in points}
    # Published, PTD-P beats ZeRO-3 at every shared GPU count, by more as GPUs grow. Modelled, it does at 768 and 1536
    # but not at 384 (a miss, listed): ZeRO-3's whole-width GEMMs fill the tiles better than PTD-P's 1/8 slices
    # (labkit.sim.gemm), and at 384 GPUs ZeRO-3's gathers still hide, so the model puts it ahead (160 vs 152).
    beats = {gpus: by_point[f"PTD-P 174.6B, {gpus} GPUs"] > by_point[f"ZeRO-3 174.6B, {gpus} GPUs"]
             for gpus in (384, 768, 1536)}
    assert {gpus for gpus, ok in beats.items() if not ok} == KNOWN_ORDER_MISSES
    gaps = [by_point[f"PTD-P 174.6B, {g} GPUs"] - by_point[f"ZeRO-3 174.6B, {g} GPUs"] for g in (384, 768, 1536)]
    assert gaps == sorted(gaps)  # PTD-P's lead grows with the GPUs
    zero = [by_point[f"ZeRO-3 174.6B, {g} GPUs"] for g in (384, 768, 1536)]
    for (before, after), published in zip(zip(zero, zero[1:]), (144 / 88, 88 / 44)):  # published 144 → 88 → 44
        assert before / after > 1.5 and before / after == pytest.approx(published, rel=0.20)  # each doubling


def test_korthikanti_2022_mfu_hfu_within_10_percent(table):
    rows = rows_of(table, "Korthikanti 2022")
    assert len(rows) == 8
    for r in rows:
        assert r.error == pytest.approx(r.predicted / r.published - 1, abs=3e-3)
        assert r.held == (abs(r.error) <= 0.10), r
    assert {r.point for r in rows if not r.held} == KNOWN_MISSES["Korthikanti 2022"]
    for model in ("22B", "175B", "530B", "1T"):  # HFU ≥ MFU: the recomputed attention counted by the paper
        mfu, hfu = (next(r.predicted for r in rows if r.point.startswith(f"{model} {w}")) for w in ("MFU", "HFU"))
        assert hfu > mfu


def test_every_row_is_in_the_text_table(table):
    text = validate.format_table(table)
    assert f"{sum(r.held for r in table)}/{len(table)} points within their bar" in text
    for r in table:
        assert r.point in text
    assert text.count(" NO") == sum(not r.held for r in table)
    assert f"MATMUL_EFFICIENCY={step.MATMUL_EFFICIENCY}" in text and f"OVERLAP_COST={step.OVERLAP_COST}" in text
    assert not too_wide(text)  # prints in a notebook without wrapping


def test_the_two_efficiencies_are_the_fit_not_hand_tuned():
    assert validate.fit_constants() == (step.MATMUL_EFFICIENCY, step.NETWORK_EFFICIENCY)


def test_the_overlap_cost_is_the_published_measurement_not_a_fit():
    """Lee et al. 2025 measured an average 18.9% compute slowdown beside a collective: the model takes it as is."""
    assert step.OVERLAP_COST == 0.189
    source = Path(step.__file__).read_text()
    assert "arXiv:2507.03114" in source and "18.9%" in source
    assert "Lee et al. 2025" in validate.format_table()


def test_without_the_overlap_cost_no_pair_of_efficiencies_holds_every_bar():
    """The measured slowdown earns its place: with OVERLAP_COST = 0, the best (matmul, network) pair still misses
    bars (Shoeybi's model + data parallel drop and ZeRO-3's shape cannot both be met)."""
    eff, net = validate.fit_constants(slow=0.0)
    rows = validate.validation_table(eff, net, 0.0)
    assert not all(r.held for r in rows) and max(r.bar_units for r in rows) > 1
    assert "the overlap cost given" in validate.format_table(rows, eff, net, 0.0)


def test_the_reference_tables_live_in_the_package_with_their_citations():
    for name in ("megatron_2019_weak_scaling.csv", "megatron_ptdp_2021_table2_vs_zero3.csv",
                 "megatron_korthikanti_2022_mfu_hfu.csv", "korthikanti_2022_table3_layouts.csv"):
        path = validate.REFERENCE / name
        assert path.parent == Path(validate.__file__).parent / "reference"
        assert re.search(r"arXiv:\d{4}\.\d{5}", path.read_text().splitlines()[0]), name
    source = Path(validate.__file__).read_text()
    assert "shared" not in source  # the project never reads ../shared at run time


def test_the_cli_prints_the_table_and_the_scenario(capsys):
    from labkit.cli import main

    assert main(["sim", "validate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(validate.format_table().strip() + "\n")  # the in-sample table first, the held-out after
    assert main(["sim", "scenario"]) == 0
    assert capsys.readouterr().out.startswith("The 128-GPU scenario — modelled")


def test_one_v100_rate_in_the_public_api_and_in_validate():
    """The V100 runs at one matmul efficiency everywhere: the one derived from Shoeybi et al.'s measured 39 TFLOP/s
    (its 1-GPU baseline), a named parameter of the model that the public API and ``validate`` both use."""
    from labkit.sim.cluster import cluster
    from labkit.sim.step import Layout, step_time

    base = validate.read_reference("megatron_2019_weak_scaling.csv")[0]
    derived = validate.v100_2019_efficiency(base)
    shape, one = validate.shape_2019(base), cluster("dgx2h-v100", 1)
    public = step_time(shape, Layout(micro_batch=8), one, "fp16")  # the public API, its defaults
    at_derived = step_time(shape, Layout(micro_batch=8), one, "fp16", derived)
    assert public.compute == pytest.approx(at_derived.compute, rel=2e-3)
    assert step.V100_MATMUL_EFFICIENCY == round(derived, 3)
    eight = next(r for r in validate.megatron_2019() if r.point == "8.3B model parallel, 8 GPUs")

    def per_gpu(r, tp):  # the public API's per-GPU rate, with its defaults
        s = step_time(validate.shape_2019(r), Layout(tp=tp, micro_batch=8, recompute="full"),
                      cluster("dgx2h-v100", tp), "fp16")
        return s.model_flops / s.total / s.gpus

    refs = validate.read_reference("megatron_2019_weak_scaling.csv")
    assert eight.predicted == pytest.approx(100 * per_gpu(refs[-1], 8) / per_gpu(refs[0], 1), abs=0.051)


DERIVED_POINTS = {"1.2B model parallel, 1 GPUs (baseline)"}  # 100% by construction; the V100 rate comes from it


def test_every_point_is_labelled_fitted_on_derived_or_held_out_and_counted(table):
    """The baseline row, the shape rows and HFU (MFU times a fixed FLOP ratio) are derived, not independent tests;
    the rest are the points the two efficiencies were fitted on. The table says which, and counts them."""
    text = validate.format_table(table)
    assert "23 independent points, 3 fitted or derived parameters" in text
    roles = {r.point: getattr(r, "role", None) for r in table}
    derived = {p for p in roles if p in DERIVED_POINTS or p.startswith("shape:") or " HFU " in p}
    assert {p for p, role in roles.items() if role == validate.DERIVED} == derived and len(derived) == 9
    assert all(role == validate.FITTED for p, role in roles.items() if p not in derived)
    assert sum(r.role != validate.DERIVED for r in table) == 23
    for r in table:  # each row printed with its role
        assert any(line.strip().startswith(r.point) and line.rstrip().endswith(r.role) for line in text.splitlines())
    kinds = list(step.PARAMETERS.values())
    assert kinds.count("fitted") == 2 and sum(k.startswith("derived") for k in kinds) == 1
    assert "V100_MATMUL_EFFICIENCY=0.345 (derived from Shoeybi et al. 2019's 1-GPU baseline)" in " ".join(text.split())


# Out of sample, each paper predicted by the efficiencies fitted on the other two: the rows that miss their bar
# (a miss is kept and listed, as in-sample misses would be). A test fails if one starts holding or another misses.
KNOWN_HOLDOUT_MISSES = {
    "Shoeybi 2019": {"1.2B model+data parallel, 64 GPUs", "4.2B model+data parallel, 256 GPUs",
                     "8.3B model+data parallel, 512 GPUs"},
    "Narayanan 2021": {"shape: ZeRO-3 529.6B, last/first"},
    "Korthikanti 2022": {f"{m} {w} (TP8 PP{pp}, {g} GPUs)" for m, pp, g in (("175B", 8, 64), ("530B", 35, 280),
                                                                           ("1T", 64, 512)) for w in ("MFU", "HFU")},
}


def test_leave_one_paper_out_is_printed_beside_the_in_sample_table(capsys):
    from labkit.cli import main

    assert main(["sim", "validate"]) == 0
    out = capsys.readouterr().out
    assert "Leave one paper out (out of sample)" in out
    for held in validate.PAPERS:
        others = " and ".join(p for p in validate.PAPERS if p != held)
        assert f"held out: {held} — fitted on {others}:" in out
    assert "out of sample: 17/23 independent points within their bar" in out
    assert "in sample:     23/23 independent points within their bar" in out
    assert not too_wide(out)


def test_each_held_out_paper_is_predicted_by_the_fit_on_the_other_two_and_its_misses_are_listed():
    from labkit.sim import validate_holdout as holdout

    assert holdout.FOLDS == tuple((h, tuple(p for p in validate.PAPERS if p != h)) for h in validate.PAPERS)
    for fold in holdout.leave_one_paper_out():
        assert fold.held_out not in fold.fitted_on and len(fold.fitted_on) == 2
        assert (fold.eff, fold.net) == validate.fit_constants(None, fold.fitted_on)  # the same fit, two papers
        strict = fold.held_out == validate.V100_PAPER  # its derived V100 rate is held out with it
        assert fold.v100 == (fold.eff if strict else None) and bool(fold.own_v100_rows) == strict
        rows = validate.validation_table(fold.eff, fold.net, None, (fold.held_out,), fold.v100)
        assert [(r.point, r.predicted, r.held) for r in fold.rows] == [(r.point, r.predicted, r.held) for r in rows]
        assert {r.role for r in fold.rows} == {validate.HELD_OUT, validate.DERIVED}
        for r in (r for r in fold.rows if not r.point.startswith("shape")):  # a shape row must also fall
            assert r.held == (r.bar_units <= 1), r
        assert {r.point for r in fold.rows if not r.held} == KNOWN_HOLDOUT_MISSES[fold.held_out]
    shoeybi = holdout.leave_one_paper_out()[0]
    assert all(r.held for r in shoeybi.own_v100_rows)  # with the rate derived from its own baseline: every point


# Published runs the memory model says do not fit in the GPU, though the paper ran them: a miss, listed.
KNOWN_MEMORY_MISSES = {"ZeRO-3 529.6B, 640 GPUs"}  # 84.7 GB against the catalog's 80 GB; see the test below


def test_zero3_529b_at_micro_batch_4_does_not_fit_on_560_gpus_and_its_640_point_holds(table):
    """Narayanan et al. 2021, Table 2's note: ZeRO-3's 529.6B did not fit on 560 A100 80GB at micro-batch 4 and ran
    on 640. ZeRO-3's memory counts one layer's gathered weights, its gradient and the recompute working set
    (labkit.sim.memory): 560 must not fit, and the 640-GPU point stays within its bar. Every other published run fits;
    the 640-GPU run is the model's one memory miss (the two differ by 1.9 GB of sharded model states)."""
    from labkit.sim.cluster import cluster
    from labkit.sim.step import Layout, step_time

    shape = validate.SHAPES_2021["529.6"]
    at_560 = step_time(shape, Layout(dp=560, micro_batch=4, zero=3, recompute="full"), cluster("dgx-a100", 560))
    assert not at_560.fits and at_560.memory_total > at_560.gpu_memory
    assert next(r for r in table if r.point == "ZeRO-3 529.6B, 640 GPUs").held
    for r in validate.read_reference("megatron_ptdp_2021_table2_vs_zero3.csv"):
        s_shape, lay, _ = validate.ptdp_2021_layout(r)
        s = step_time(s_shape, lay, cluster("dgx-a100", lay.gpus))
        point = f"{r['scheme']} {r['params_B']}B, {lay.gpus} GPUs"
        assert s.fits == (point not in KNOWN_MEMORY_MISSES), (point, s.memory_total)
