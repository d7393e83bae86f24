"""Numbers in the notebooks' prose come from a run or a results file, never typed in.

Every percentage, ratio, approximate figure or decimal with a unit (0.2 s, 12.5 MB, 4.2 GFLOP/s, 1,234.5
tokens/s) in a markdown cell, and every decimal with a unit in a code cell, must be either one of the source text's
own claims, quoted as its claim (a marker such as "the source text" earlier in the cell or in the same
paragraph), or a listed figure that states no measured outcome: a setting, the arithmetic of a formula, or a
cited paper's or datasheet's number. Measured outcomes are rendered by code cells from a run or from
``benchmarks/results/``.
"""
import json
import re
from pathlib import Path

import pytest

from labkit.results import REQUIRED, load_results, results_dir

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

NUMBER = r"\d+(?:[.,]\d+)*"
DECIMAL = r"\d+(?:,\d{3})*\.\d+"
# a decimal with a unit of time, memory or speed: 0.218 s, 12.5 MB, 1.3 GiB, 4.2 GFLOP/s, 1,234.5 tokens/s
UNIT = re.compile(rf"(?:[~≈]\s?)?{DECIMAL}(?:\s*[–-]\s*{DECIMAL})?\s*"
                  r"(?:ms|µs|s|seconds?|[kKMGT]i?B|[GT]FLOP/s|tokens/s)(?!\w)")
FIGURE = re.compile(
    rf"{UNIT.pattern}"  # first, so that "~0.5 s" is one figure with its unit
    rf"|[~≈]\s?{NUMBER}(?:\s*[–-]\s*{NUMBER})?(?:\s*(?:%|×(?!\s*\d)))?"  # ~35%, ≈2.02, ~15 (s)
    rf"|{NUMBER}(?:\s*[–-]\s*{NUMBER})?\s*(?:%|×(?!\s*\d))"  # 42%, 40–60%, 1.6× (not a 64 × 64 shape)
    rf"|{NUMBER}x\b"  # 2x
    rf"|{NUMBER}\s+times\s+(?:faster|slower)\b")  # 3 times faster
CLAIM_MARKER = re.compile(r"\bsource text\b|\bthe text(?:'s| reports| claims)\b", re.IGNORECASE)
SEED_CLAIMS = {"35%", "25%", "42%", "58%", "83%", "40–60%", "18%", "70%"}  # the source text's figures

# Figures that state no measured outcome, by notebook: (the phrase around the figure, why it may stay).
NOT_OUTCOMES = {
    "00_quickstart.ipynb": [("8× faster than it trained", "a setting: replay(speed=8)")],
    "01_cap_tradeoffs.ipynb": [("the last worker computes 3× slower", "a setting: comm.slow_factor")],
    "02_data_parallel.ipynb": [
        ("(≈1.5×, more with gradient accumulation", "arithmetic: FSDP2's gathers, from the ring formulas"),
        ("no extra bytes and FSDP2 about 1.5×", "arithmetic: FSDP2's gathers (the objective copied from labs.md)"),
        ("31.4 / 16.6 / 1.9 GB for stages 1 / 2 / 3", "published: Rajbhandari et al. 2020 (ZeRO), Figure 1"),
        ("A tiny bucket (0.001 MB)", "a setting for the reader to try: parallel.dp.bucket_mb")],
    "05_flash_attention.ipynb": [
        ("its memory grows 4× when the sequence doubles", "arithmetic: n × n scores"),
        ("one number per row (the log-sum-exp): 2×", "arithmetic: memory linear in n")],
    "06_mixed_precision.ipynb": [
        ("at 16× the plain fp32 rate on an A100 (312 vs 19.5 TFLOP/s) and ~15× on an H100 SXM (989 vs 67), twice "
         "their TF32 rate; the H100 does fp8 at 2× its bf16", "published: NVIDIA's datasheets, labkit/gpu_peaks.py")],
    "07_fault_tolerance.ipynb": [("played back 4× faster than it happened", "a setting: replay(speed=4)")],
    "08_scaling_laws.ipynb": [
        ("for a 10× budget make the model ~5.4× bigger", "published: Kaplan et al. 2020"),
        ("(N_opt ∝ C^≈0.5)", "published: Hoffmann et al. 2022"),
        ("(¼×, ½×, 2×, 4× the size)", "a setting: the planner's neighbours")],
    "09_optimization_loop.ipynb": [
        ("the noise and the 3% threshold", "a setting: Thresholds.min_speedup"),
        ("more than 10% below the median", "a setting: regressions(threshold=0.10)"),
        ("a **utilisation threshold** of 5%", "a setting for the reader to try"),
        ("a **communication threshold** of 80%", "a setting for the reader to try")],
}
# Notebooks that discuss a benchmark's outcome, and the results files they render it from.
DISCUSSES = {"04_communication.ipynb": ["compression", "compression_history"]}


def normalise(text: str) -> str:
    """Whitespace collapsed to single spaces inside paragraphs; paragraphs kept apart by a blank line."""
    return "\n\n".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", text))


def is_seed_claim(text: str, match: re.Match) -> bool:
    """One of the source text's figures, marked as its claim before it in the cell or in its paragraph."""
    figure = re.sub(r"[~≈\s]", "", match.group()).replace("-", "–")
    end = text.find("\n\n", match.end())
    return figure in SEED_CLAIMS and bool(CLAIM_MARKER.search(text[:end if end >= 0 else len(text)]))


def listed_spans(text: str, notebook: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for phrase, _ in NOT_OUTCOMES.get(notebook, [])
            for m in re.finditer(re.escape(normalise(phrase)), text)]


def unexplained_figures(notebook: str, cell: str, pattern: re.Pattern = FIGURE) -> list[str]:
    """The typed figures of one cell that are neither a marked seed claim nor listed (code cells: ``UNIT``)."""
    text = normalise(cell)
    spans = listed_spans(text, notebook)
    return [m.group() for m in pattern.finditer(text)
            if not is_seed_claim(text, m) and not any(a <= m.start() and m.end() <= b for a, b in spans)]


def cells_of(path: Path, kind: str) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def markdown_cells(path: Path) -> list[str]:
    return cells_of(path, "markdown")


def code_of(path: Path) -> str:
    return "\n".join(cells_of(path, "code"))


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_no_notebook_types_a_measured_figure_into_its_prose(path):
    cells = enumerate(markdown_cells(path))
    typed = {i: found for i, cell in cells if (found := unexplained_figures(path.name, cell))}
    assert not typed, f"{path.name}: typed figures by markdown cell (render them from a run or a results file): {typed}"


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_no_notebook_types_a_measured_time_size_or_speed_into_its_code(path):
    cells = enumerate(cells_of(path, "code"))
    typed = {i: found for i, cell in cells if (found := unexplained_figures(path.name, cell, UNIT))}
    assert not typed, (f"{path.name}: typed figures with units by code cell (print them from a run or a results "
                       f"file): {typed}")


@pytest.mark.parametrize("text,figures", [
    ("PowerSGD's gap was 4.6% smaller than uncompressed's", ["4.6%"]),
    ("128 × 128 tiles are 1.6× faster on a 2-core CPU", ["1.6×"]),
    ("about ~15 s on 2 CPU cores, ending within ~0.05 nats", ["~15", "~0.05"]),
    ("communication at only ~20–28% of the step", ["~20–28%"]),
    ("the plateau at ≈2.02 nats", ["≈2.02"]),
    ("a 2x speed-up, or 3 times faster", ["2x", "3 times faster"]),
    ("64 × 64 and 64×128 matrices", []),
    ("a step took 0.218 s (0.5–0.7 seconds with 12.5 MB buckets)", ["0.218 s", "0.5–0.7 seconds", "12.5 MB"]),
    ("1.3 GiB held, 31.4 ms exposed, 4.25 GFLOP/s and 1,234.5 tokens/s", ["1.3 GiB", "31.4 ms", "4.25 GFLOP/s",
                                                                         "1,234.5 tokens/s"]),
    ("~0.5 s per step and 2.0 GB/s", ["~0.5 s", "2.0 GB"]),
    ("25 MB buckets, 300 s of timeout, bucket_mb=0.01, lr 3.0e-4, 0.5 steps, 2.5 samples", []),
])
def test_the_scanner_finds_typed_figures_and_not_shapes(text, figures):
    assert unexplained_figures("04_communication.ipynb", text) == figures


def test_in_code_the_scanner_finds_decimals_with_units_and_not_settings_or_formats():
    typed = 'print("baseline: 0.218 s/step, 3.5 MB sent")  # was 0.25 ms'
    assert unexplained_figures("04_communication.ipynb", typed, UNIT) == ["0.218 s", "3.5 MB", "0.25 ms"]
    computed = 'print(f"{t:.2f} s, {mb:6.1f} MB"); cfg = {"parallel.dp.bucket_mb": 0.01, "comm.latency_us": 2000}'
    assert unexplained_figures("04_communication.ipynb", computed, UNIT) == []


def test_a_seed_figure_passes_only_where_the_text_marks_it_as_the_source_s_claim():
    claim = "above ~35% of step time in communication, scaling efficiency collapses"
    assert unexplained_figures("04_communication.ipynb", claim) == ["~35%"]
    assert unexplained_figures("04_communication.ipynb", "The source text's rule of thumb: " + claim) == []
    assert unexplained_figures("04_communication.ipynb", claim + "\n\nThe source text says so.") == ["~35%"]
    assert unexplained_figures("04_communication.ipynb", "The source text's claim: 37% of step time") == ["37%"]


def test_a_listed_figure_passes_only_in_its_own_notebook_and_phrase():
    listed = "faster, but not by more than\nthe noise and the 3% threshold"
    assert unexplained_figures("09_optimization_loop.ipynb", listed) == []
    assert unexplained_figures("04_communication.ipynb", "the noise and the 3% threshold") == ["3%"]
    assert unexplained_figures("09_optimization_loop.ipynb", "the run was 3% faster") == ["3%"]


@pytest.mark.parametrize("notebook,phrase", [(n, p) for n, entries in NOT_OUTCOMES.items() for p, _ in entries])
def test_every_listed_phrase_is_still_in_its_notebook(notebook, phrase):
    cells = [normalise(cell) for cell in markdown_cells(NOTEBOOKS / notebook)]
    assert any(normalise(phrase) in cell for cell in cells), f"{notebook} no longer says {phrase!r}: drop the entry"


@pytest.mark.parametrize("notebook,names", DISCUSSES.items())
def test_a_notebook_that_discusses_a_benchmark_renders_it_from_its_results_file(notebook, names):
    code = code_of(NOTEBOOKS / notebook)
    for name in names:
        assert f'load_results("{name}")' in code
        records = load_results(name)
        assert records
        for record in records:
            assert all(record[key] not in ("", None, {}, []) for key in REQUIRED), record["table"]


@pytest.mark.parametrize("path", sorted(results_dir().glob("*.jsonl")), ids=lambda p: p.name)
def test_every_shipped_results_file_parses_and_says_where_each_record_came_from(path):
    records = load_results(path)
    assert records
    for record in records:
        assert record["benchmark"] == path.stem.split("_history")[0]
        assert isinstance(record["settings"], dict) and isinstance(record["rows"], list) and record["rows"]
        if isinstance(record["machine"], str):  # transcribed, not measured by write_results: say from where
            assert "Transcribed from" in record["source"] and "fingerprint not recorded" in record["machine"]
