"""Benchmark results files: each result table a JSON line, with the commit, date, machine and settings.

A benchmark ends with :func:`write_results`; a notebook that discusses its outcome reads the shipped
file back (:func:`load_results`, :func:`latest`) and renders the table from it (:func:`markdown_table`,
:func:`provenance`), so every figure it shows comes from a run. Files live in ``benchmarks/results/``
(``$LABKIT_RESULTS_DIR`` if set), one per benchmark: ``NAME.jsonl``.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Union

from labkit.hardware import cpu_fingerprint
from labkit.metrics.events import json_safe  # NaN and infinity are not JSON: null

REPO = Path(__file__).resolve().parents[1]
REQUIRED = ("benchmark", "table", "commit", "date", "machine", "settings", "rows")


def results_dir() -> Path:
    """$LABKIT_RESULTS_DIR if set, else the repository's benchmarks/results/ (read at call time)."""
    return Path(os.environ.get("LABKIT_RESULTS_DIR") or REPO / "benchmarks" / "results")


def results_path(name: Union[str, Path]) -> Path:
    """``"compression"`` -> benchmarks/results/compression.jsonl; a path ending in .jsonl is kept."""
    path = Path(name)
    return path if path.suffix == ".jsonl" else results_dir() / f"{name}.jsonl"


def machine_fingerprint() -> dict:
    """What the numbers depend on: the CPU (model, cores, ISA flags, torch's kernel level), torch, the GPU if any."""
    import torch

    return {**cpu_fingerprint(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def git(*args: str, cwd: Optional[Path] = None) -> Optional[str]:
    """The output of a git command in the checkout (or ``cwd``), or None outside one (or without git)."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd or REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit() -> str:
    """The checkout's HEAD, or "unknown" outside a git checkout."""
    return git("rev-parse", "HEAD") or "unknown"


def uncommitted_changes() -> Optional[bool]:
    """Whether tracked files differ from HEAD (the numbers then come from code no commit holds); None if unknown.

    Results files do not count (``benchmarks/results/`` and ``$LABKIT_RESULTS_DIR``'s files, where inside the
    checkout): a run's own first table would otherwise mark its second. Asked once per process, at first use.
    """
    return _uncommitted(REPO, tuple(results_pathspecs()))


def results_pathspecs() -> list[str]:
    """git pathspecs that leave out the results folders inside the checkout."""
    repo = REPO.resolve()
    folders = {repo / "benchmarks" / "results", results_dir().resolve()}
    inside = sorted(str(f.relative_to(repo)) for f in folders if f.is_relative_to(repo) and f != repo)
    return [f":(exclude){folder}" for folder in inside]


@functools.lru_cache(maxsize=None)
def _uncommitted(repo: Path, excluded: tuple[str, ...]) -> Optional[bool]:
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", *excluded, cwd=repo)
    return None if status is None else bool(status)


def write_results(name: Union[str, Path], rows: list[dict], settings: dict, *, table: str = "results",
                  notes: str = "") -> Path:
    """Append one result table to ``name``'s results file (one JSON line); returns the file's path."""
    record = {"benchmark": Path(name).stem, "table": table, "commit": git_commit(),
              "uncommitted_changes": uncommitted_changes(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_fingerprint(),
              "settings": json_safe(settings), "rows": json_safe(rows), "notes": notes}
    path = results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def load_results(name: Union[str, Path]) -> list[dict]:
    """Every record of a results file, oldest first; a line without the required fields is an error."""
    path = results_path(name)
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        missing = [key for key in REQUIRED if key not in record]
        if missing:
            raise ValueError(f"{path}:{number}: record without {', '.join(missing)}")
        records.append(record)
    return records


def latest(records: list[dict], table: str, **settings) -> dict:
    """The newest record of ``table`` whose settings include every given ``key=value``."""
    for record in reversed(records):
        if record["table"] == table and all(record["settings"].get(k) == v for k, v in settings.items()):
            return record
    wanted = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    raise LookupError(f"no {table!r} table{' with ' + wanted if wanted else ''} in these results")


Column = tuple[str, str, str]  # header, row key, format spec


def markdown_table(rows: list[dict], columns: list[Column]) -> str:
    """A markdown table: one line per row, each cell ``format(row[key], spec)``; a missing value is "–"."""
    def cell(value, spec: str) -> str:
        return "–" if value is None else format(value, spec)
    lines = ["| " + " | ".join(header for header, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(key), spec) for _, key, spec in columns) + " |" for row in rows]
    return "\n".join(lines)


def describe_machine(machine: Union[dict, str]) -> str:
    """A fingerprint in one line; a transcribed record's machine is already a sentence."""
    if isinstance(machine, str):
        return machine
    gpu = f", {machine['gpu']}" if machine.get("gpu") else ""
    isa = " ".join(machine["isa"]) or "no listed ISA flags"
    return f"{machine['cpu']} ({machine['cores']} cores; {isa}), torch {machine['torch']}{gpu}"


def provenance(record: dict, path: Optional[Union[str, Path]] = None) -> str:
    """Where a table's numbers come from: the file, commit, date and machine of its record."""
    where = f"`{Path(path).name}`, " if path else ""
    commit = record["commit"][:7] if len(record["commit"]) == 40 else record["commit"]
    commit += " (with uncommitted changes)" if record.get("uncommitted_changes") else ""
    line = (f"{where}{record['table']} table; commit {commit}; date: {record['date']}; "
            f"machine: {describe_machine(record['machine'])}")
    return line + (f". {record['source']}" if record.get("source") else ".")
