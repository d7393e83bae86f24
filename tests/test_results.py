"""Results files: what a benchmark writes, what a notebook reads back, and the text rendered from it."""
import json
import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from helpers import load_benchmark
import torch

from labkit import results
from labkit.comm.compress.report import verdict_markdown, verdict_sentence
from labkit.results import (REQUIRED, latest, load_results, markdown_table, provenance, results_path,
                            write_results)

ROOT = Path(__file__).resolve().parents[1]


def read_lines(path: Path) -> list[dict]:
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_each_table_is_one_json_line_with_commit_date_machine_and_settings(tmp_path):
    path = tmp_path / "bench.jsonl"
    before = datetime.now(timezone.utc).replace(microsecond=0)
    write_results(path, [{"x": 1}], {"steps": 3}, table="first")
    write_results(path, [{"x": 2}, {"x": 3}], {"steps": 4}, table="second", notes="a note")
    first, second = read_lines(path)
    assert all(key in first and key in second for key in REQUIRED)
    assert (first["table"], first["rows"], first["settings"]) == ("first", [{"x": 1}], {"steps": 3})
    assert (second["rows"], second["settings"], second["notes"]) == ([{"x": 2}, {"x": 3}], {"steps": 4}, "a note")
    assert first["benchmark"] == "bench"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                             ":(exclude)benchmarks/results"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert first["commit"] == (head or "unknown") and first["uncommitted_changes"] == bool(status)
    assert datetime.fromisoformat(first["date"]) >= before and datetime.fromisoformat(first["date"]).tzinfo
    machine = first["machine"]
    assert (machine["cores"], machine["torch"]) == (os.cpu_count(), torch.__version__)
    assert machine["cpu"] and isinstance(machine["isa"], list) and "gpu" in machine


def test_a_missing_number_is_written_as_null_not_nan(tmp_path):
    path = write_results(tmp_path / "nan.jsonl", [{"exposed_s": float("nan"), "ok": 1.5}], {"inf": float("inf")})
    (record,) = read_lines(path)
    assert record["rows"] == [{"exposed_s": None, "ok": 1.5}] and record["settings"] == {"inf": None}


def test_a_name_goes_to_the_results_folder_which_the_environment_can_move(tmp_path, monkeypatch):
    assert results_path("compression") == ROOT / "benchmarks" / "results" / "compression.jsonl"
    monkeypatch.setenv("LABKIT_RESULTS_DIR", str(tmp_path))
    assert write_results("cap", [{"mode": "sync"}], {}) == tmp_path / "cap.jsonl"
    assert load_results("cap")[0]["rows"] == [{"mode": "sync"}]


def test_outside_a_git_checkout_the_commit_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "REPO", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert results.git_commit() == "unknown" and results.uncommitted_changes() is None


def committed_checkout(root: Path) -> Path:
    """A git checkout with one source file and one results file, both committed."""
    (root / "benchmarks" / "results").mkdir(parents=True)
    (root / "code.py").write_text("x = 1\n")
    (root / "benchmarks" / "results" / "bench.jsonl").write_text("")
    (root / "other_results").mkdir()
    (root / "other_results" / "moved.jsonl").write_text("")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start"]):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)
    return root


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """results.REPO moved to a fresh committed checkout (one this process has not asked about)."""
    root = committed_checkout(tmp_path / "repo")
    monkeypatch.setattr(results, "REPO", root)
    monkeypatch.delenv("LABKIT_RESULTS_DIR", raising=False)
    return root


def test_a_run_s_own_tables_do_not_mark_its_next_table_as_uncommitted(checkout):
    (checkout / "benchmarks" / "results" / "bench.jsonl").write_text("{}\n")  # an earlier process's table
    for table in ("first", "second", "third"):
        write_results("bench", [{"x": 1}], {}, table=table)  # appends to the committed results file
    _, first, second, third = read_lines(checkout / "benchmarks" / "results" / "bench.jsonl")
    assert [first["uncommitted_changes"], second["uncommitted_changes"], third["uncommitted_changes"]] == [False] * 3


def test_results_in_labkit_results_dir_do_not_count_either(checkout, monkeypatch):
    monkeypatch.setenv("LABKIT_RESULTS_DIR", str(checkout / "other_results"))
    (checkout / "other_results" / "moved.jsonl").write_text("{}\n")  # an earlier process's table
    write_results("moved", [{"x": 1}], {}, table="first")
    write_results("moved", [{"x": 2}], {}, table="second")
    tables = read_lines(checkout / "other_results" / "moved.jsonl")[1:]
    assert [r["uncommitted_changes"] for r in tables] == [False, False]


def test_the_check_runs_once_per_process_and_a_changed_source_file_counts(checkout, tmp_path, monkeypatch):
    write_results("bench", [{"x": 1}], {}, table="first")
    (checkout / "code.py").write_text("x = 2\n")
    write_results("bench", [{"x": 1}], {}, table="second")  # the process's answer, asked at its first table
    assert [r["uncommitted_changes"] for r in read_lines(checkout / "benchmarks" / "results" / "bench.jsonl")] == [
        False, False]
    edited = committed_checkout(tmp_path / "edited")  # a checkout this process has not asked about yet
    (edited / "code.py").write_text("x = 2\n")
    monkeypatch.setattr(results, "REPO", edited)
    write_results("bench", [{"x": 1}], {}, table="edited")
    assert read_lines(edited / "benchmarks" / "results" / "bench.jsonl")[0]["uncommitted_changes"] is True


def test_a_record_without_the_required_fields_is_refused_with_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_results(path, [{"x": 1}], {})
    record = read_lines(path)[0]
    del record["machine"]
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: record without machine"):
        load_results(path)


def test_latest_is_the_newest_record_of_a_table_with_those_settings():
    records = [{"table": "verdict", "settings": {"seeds": [1]}, "n": 1},
               {"table": "verdict", "settings": {"seeds": [2]}, "n": 2},
               {"table": "accuracy", "settings": {"seeds": [1]}, "n": 3},
               {"table": "verdict", "settings": {"seeds": [1]}, "n": 4}]
    assert latest(records, "verdict")["n"] == 4
    assert latest(records, "verdict", seeds=[2])["n"] == 2
    with pytest.raises(LookupError, match=r"no 'verdict' table with seeds=\[3\]"):
        latest(records, "verdict", seeds=[3])


def test_markdown_table_formats_each_cell_and_marks_a_missing_value():
    rows, columns = [{"a": 0.0123, "b": "x"}, {"a": None, "b": "y"}], [("share", "a", ".1%"), ("name", "b", "s")]
    table = markdown_table(rows, columns)
    assert table.splitlines() == ["| share | name |", "|---|---|", "| 1.2% | x |", "| – | y |"]


def test_provenance_names_commit_date_machine_and_source():
    measured = {"table": "accuracy", "commit": "a" * 40, "date": "2026-12-01T00:00:00+00:00",
                "machine": {"cpu": "EPYC", "cores": 2, "isa": ["avx2"], "torch": "2.13.0+cpu", "gpu": None}}
    assert provenance(measured, "benchmarks/results/compression.jsonl") == (
        "`compression.jsonl`, accuracy table; commit aaaaaaa; date: 2026-12-01T00:00:00+00:00; "
        "machine: EPYC (2 cores; avx2), torch 2.13.0+cpu.")
    assert "commit aaaaaaa (with uncommitted changes); date" in provenance({**measured, "uncommitted_changes": True})
    transcribed = {**measured, "commit": "71dd59e", "machine": "2-core CPU", "source": "Transcribed from a note."}
    assert provenance(transcribed).endswith("commit 71dd59e; date: 2026-12-01T00:00:00+00:00; machine: 2-core CPU. "
                                            "Transcribed from a note.")


def verdict(**changes) -> dict:
    row = {"compressor": "topk", "seeds": [3, 4], "fewer_bytes": 50.0, "bytes_target": 30.0, "gap_vs_none": 0.031,
           "gap_vs_none_each": [0.02, 0.042], "gap_tolerance": 0.05}
    return {**row, **changes}


def test_the_verdict_sentence_judges_each_target_from_the_row():
    sentence = verdict_sentence(verdict(), {"steps": 600})
    assert sentence == ("**topk** sent 50.0× fewer bytes than uncompressed (target ≥ 30×: met) and ended 600 steps "
                        "with a gap above the floor +3.1% of uncompressed's, the mean over seeds 3, 4 (+2.0%, +4.2%; "
                        "target ≤ +5%: met).")
    assert "+3.1% of uncompressed's, on seed 3 (target" in verdict_sentence(verdict(seeds=[3]), {"steps": 600})
    assert "(target ≥ 30×: NOT met)" in verdict_sentence(verdict(fewer_bytes=20.0), {"steps": 600})
    assert "target ≤ +5%: NOT met" in verdict_sentence(verdict(gap_vs_none=0.06), {"steps": 600})


def test_the_shipped_compression_verdict_renders_every_row_from_the_file():
    records = load_results("compression")
    text = verdict_markdown(records, seeds=[15, 16, 17])
    accuracy, judged = (latest(records, table, seeds=[15, 16, 17]) for table in ("accuracy", "verdict"))
    for row in accuracy["rows"]:
        assert f"| {row['seed']} | {row['compressor']} | {row['loss']:.4f} | {row['gap']:.5f} |" in text
    for row in judged["rows"]:
        assert verdict_sentence(row, judged["settings"]) in text
    assert f"commit {judged['commit'][:7]}" in text and judged.get("source", "") in text
    assert "Transcribed" not in text and not judged.get("uncommitted_changes")  # a run from a clean tree


@pytest.fixture(scope="module")
def compression_bench():
    return load_benchmark("compression")


def test_the_compression_benchmark_s_verdict_row_is_the_mean_over_seeds_against_its_targets(compression_bench):
    rels = [{"loss_vs_none": 0.001, "gap": 0.01, "gap_vs_none": 0.02, "rate_gap_vs_none": 0.1, "fewer_bytes": 8.0},
            {"loss_vs_none": 0.003, "gap": 0.02, "gap_vs_none": 0.06, "rate_gap_vs_none": 0.3, "fewer_bytes": 8.4}]
    row = compression_bench.verdict_row("powersgd", rels, [1, 2])
    assert row["gap_vs_none"] == pytest.approx(0.04) and row["fewer_bytes"] == pytest.approx(8.2)
    assert row["gap_vs_none_each"] == [0.02, 0.06] and row["seeds"] == [1, 2]
    assert (row["bytes_target"], row["gap_tolerance"]) == (compression_bench.BYTES_TARGETS["powersgd"],
                                                            compression_bench.GAP_TOLERANCE)
    result = {"loss": 2.33, "bytes": 2_500_000}
    line = compression_bench.accuracy_row(7, "topk", result, rels[0], 12.5)
    assert line == {"seed": 7, "compressor": "topk", "loss": 2.33, "loss_vs_none": 0.001, "gap": 0.01,
                    "gap_vs_none": 0.02, "rate_gap_vs_none": 0.1, "mb_sent": 2.5, "fewer_bytes": 8.0, "time_s": 12.5}


@pytest.mark.multiproc
def test_a_benchmark_run_appends_its_table_to_its_results_file(tmp_path):
    env = {**os.environ, "LABKIT_RESULTS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "benchmarks/attention.py", "--seqs", "64", "--backends", "sdpa",
                           "--repeats", "1", "--rounds", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(rf"results: appended to {re.escape(str(tmp_path / 'attention.jsonl'))}", done.stdout)
    (record,) = load_results(tmp_path / "attention.jsonl")
    assert (record["benchmark"], record["table"], record["settings"]["seqs"]) == ("attention", "attention", [64])
    (row,) = record["rows"]
    assert (row["backend"], row["seq"]) == ("sdpa", 64) and row["time_s"] > 0


def test_the_attention_benchmark_takes_each_lengths_ratio_over_its_rounds():
    """labkit_flash / sdpa per round and length; the median over the rounds, not the best; rounds without both skip."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("attention_bench", ROOT / "benchmarks" / "attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    times = {0: (2.0, 1.0), 1: (3.0, 1.0), 2: (1.0, 1.0), 3: (4.0, 2.0)}
    rows = [{"backend": b, "seq": 512, "round": r, "time_s": t} for r, pair in times.items()
            for b, t in zip(("labkit_flash", "sdpa"), pair)]
    rows.append({"backend": "sdpa", "seq": 512, "round": 4, "error": "timeout after 180s"})
    rows.append({"backend": "labkit_flash", "seq": 512, "round": 4, "time_s": 9.0})
    (ratio,) = bench.time_ratios(rows)
    assert ratio["seq"] == 512 and ratio["rounds"] == [2.0, 3.0, 1.0, 2.0]  # round 4 has no sdpa time
    assert ratio["median"] == 2.0 and ratio["n_rounds"] == 4 and not ratio["enough_rounds"]
