"""Participant exercises, generated from their solutions.

Each exercise is written **once**, as a solution notebook, ``workshops/exercises/solutions/NN_topic.ipynb``
(``NN`` is the lab it belongs to). The participant's notebook, ``workshops/exercises/NN_topic.ipynb``, is
generated from it and never edited by hand, so a fix to an exercise is made in one place.

What the solution notebook marks:

* **the solution**, inside any cell, between two marker lines::

      def ring_bytes(op, nbytes, p):
          ### BEGIN SOLUTION
          return 2 * (p - 1) * nbytes // p
          ### END SOLUTION

  In the participant's copy of a code cell the lines between the markers become one line at the
  markers' indentation, ``raise NotImplementedError(...)``: the cell still runs (it defines the function),
  and calling the function says what is missing. In a markdown cell they become ``*Your answer:*``.
* **a stub** other than that: a "fix this code" exercise shows the broken code instead. It is written just
  before the solution, as comment lines between ``### BEGIN STUB`` and ``### END STUB``; the participant's
  copy has those lines uncommented in place of the solution::

          ### BEGIN STUB
          # owned = sum(slices)          (the bug: a reduce-scatter sums, it does not average)
          ### END STUB
          ### BEGIN SOLUTION
          owned = sum(slices) / world
          ### END SOLUTION

* **the check**: exactly one code cell tagged ``check`` (cell metadata ``"tags": ["check"]``). It asserts
  against labkit's own functions, so it passes with the solution and fails with the stub — the tests
  (``tests/workshop/test_exercises.py``) run both.

Every solution region lies inside a function body, so the participant's notebook runs from top to
bottom until the check cell, which is where the missing part is felt.

Generation is deterministic: the same solution gives the same bytes (cell ids are kept, outputs and
execution counts are cleared, JSON is written the way JupyterLab writes it), so ``--check`` can compare
the committed notebooks with what would be generated now.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_STUB, END_STUB = "### BEGIN STUB", "### END STUB"
MARKERS = (BEGIN_SOLUTION, END_SOLUTION, BEGIN_STUB, END_STUB)
CHECK_TAG = "check"
CODE_STUB = 'raise NotImplementedError("your turn: write this part, then run the check cell")'
MARKDOWN_STUB = "*Your answer:*"
SOLUTIONS = Path("workshops/exercises/solutions")  # relative to the repository root
PARTICIPANTS = SOLUTIONS.parent
DATA = PARTICIPANTS / "data"


class ExerciseError(ValueError):
    """A solution notebook the generator cannot turn into an exercise (names the notebook and the cell)."""


def repo_root() -> Path:
    """The checkout labkit is imported from (the workshop material is not part of the installed package)."""
    return Path(__file__).resolve().parents[2]


def exercise_data(name: str) -> Path:
    """A file the exercises read, ``workshops/exercises/data/NAME``, wherever the notebook runs from."""
    path = repo_root() / DATA / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: the exercises' data ships in the labkit repository's "
                                f"{DATA}/ (see its README.md)")
    return path


# ---------------------------------------------------------------- one cell's source

def _marker(line: str) -> str | None:
    stripped = line.strip()
    return stripped if stripped in MARKERS else None


def _uncomment(line: str, where: str) -> str:
    """A stub line as the participant sees it: the first ``# `` (or ``#``) after the indentation removed."""
    body = line.lstrip()
    if not body:
        return line
    if not body.startswith("#"):
        raise ExerciseError(f"{where}: every line between {BEGIN_STUB} and {END_STUB} is a comment "
                            f"(the solution must still run), got {line.rstrip()!r}")
    indent = line[: len(line) - len(body)]
    return indent + (body[2:] if body.startswith("# ") else body[1:])


def participant_lines(lines: list[str], cell_type: str, where: str = "cell") -> list[str]:
    """``lines`` (each ending in a newline, but perhaps the last) with every marked solution replaced.

    A solution region becomes the stub written just before it, or else one stub line at the indentation
    of its ``### BEGIN SOLUTION`` marker (code cells) or ``*Your answer:*`` (markdown cells)."""
    out: list[str] = []
    stub: list[str] | None = None  # the lines of a STUB block waiting for its solution
    i = 0
    while i < len(lines):
        marker = _marker(lines[i])
        if marker is None:
            if stub is not None:
                raise ExerciseError(f"{where}: a {END_STUB} must be followed at once by {BEGIN_SOLUTION}")
            out.append(lines[i])
            i += 1
            continue
        end = {BEGIN_STUB: END_STUB, BEGIN_SOLUTION: END_SOLUTION}.get(marker)
        if end is None:
            raise ExerciseError(f"{where}: {marker} without its opening marker")
        if marker == BEGIN_STUB and stub is not None:
            raise ExerciseError(f"{where}: a {END_STUB} must be followed at once by {BEGIN_SOLUTION}")
        close = next((j for j in range(i + 1, len(lines)) if _marker(lines[j]) is not None), None)
        if close is None or _marker(lines[close]) != end:
            raise ExerciseError(f"{where}: {marker} is not closed by {end} (regions do not nest)")
        body = lines[i + 1: close]
        if marker == BEGIN_STUB:
            stub = [_uncomment(line, where) for line in body]
        else:
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            default = CODE_STUB if cell_type == "code" else MARKDOWN_STUB
            out += stub if stub is not None else [f"{indent}{default}\n"]
            stub = None
        i = close + 1
    if stub is not None:
        raise ExerciseError(f"{where}: a {END_STUB} must be followed at once by {BEGIN_SOLUTION}")
    if out and out[-1].endswith("\n") and not (lines and lines[-1].endswith("\n")):
        out[-1] = out[-1][:-1]  # the source ended without a newline: so does the copy
    return out


def solution_regions(lines: list[str]) -> list[list[str]]:
    """The lines of every solution region of one cell (what must never reach a participant)."""
    regions, current = [], None
    for line in lines:
        marker = _marker(line)
        if marker == BEGIN_SOLUTION:
            current = []
        elif marker == END_SOLUTION and current is not None:
            regions.append(current)
            current = None
        elif current is not None:
            current.append(line)
    return regions


# ---------------------------------------------------------------- a notebook

def _lines(source) -> list[str]:
    """A cell's source as Jupyter stores it: a list of lines, or one string."""
    return source.splitlines(keepends=True) if isinstance(source, str) else list(source)


def _cell_id(name: str, index: int) -> str:
    return hashlib.sha1(f"{name}:{index}".encode()).hexdigest()[:8]


def is_check(cell: dict) -> bool:
    return cell.get("cell_type") == "code" and CHECK_TAG in cell.get("metadata", {}).get("tags", [])


def solution_problems(solution: dict, name: str) -> list[str]:
    """What makes a solution notebook unusable as an exercise source: no check cell or more than one, no
    solution region, a solution inside the check cell, stored outputs (notebooks are kept without them)."""
    cells = solution.get("cells", [])
    problems = []
    checks = [i for i, c in enumerate(cells) if is_check(c)]
    if len(checks) != 1:
        problems.append(f"{name}: needs exactly one code cell tagged {CHECK_TAG!r}, found {len(checks)}")
    marked = [i for i, c in enumerate(cells) if solution_regions(_lines(c.get("source", [])))]
    if not marked:
        problems.append(f"{name}: marks no solution ({BEGIN_SOLUTION} … {END_SOLUTION})")
    if set(marked) & set(checks):
        problems.append(f"{name}: the check cell holds a solution region; the check is the same for everyone")
    for i, cell in enumerate(cells):
        if cell.get("outputs") or cell.get("execution_count") is not None:
            problems.append(f"{name}: cell {i} has stored outputs; clear them (notebooks are kept without outputs)")
    return problems


def participant_notebook(solution: dict, name: str) -> dict:
    """The participant's notebook for solution notebook ``name`` (its file name): same cells and ids,
    solutions replaced by stubs, no outputs, a note in the metadata saying where it comes from."""
    problems = solution_problems(solution, name)
    if problems:
        raise ExerciseError("\n".join(problems))
    cells = []
    for i, cell in enumerate(solution["cells"]):
        kind = cell["cell_type"]
        out = {"cell_type": kind, "id": cell.get("id") or _cell_id(name, i),
               "metadata": cell.get("metadata", {}),
               "source": participant_lines(_lines(cell.get("source", [])), kind, f"{name}, cell {i}")}
        if kind == "code":
            out.update(execution_count=None, outputs=[])
        cells.append(out)
    metadata = {**solution.get("metadata", {}),
                "labkit": {"generated_from": f"{SOLUTIONS.name}/{name}",
                           "note": "generated by `labkit workshop exercises`: edit the solution, not this file"}}
    return {"cells": cells, "metadata": metadata, "nbformat": solution.get("nbformat", 4),
            "nbformat_minor": max(solution.get("nbformat_minor", 5), 5)}


def notebook_text(notebook: dict) -> str:
    """A notebook as JupyterLab writes it (one-space indent, sorted keys, UTF-8 kept, final newline)."""
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------- the folder

def solution_paths(root: Path | None = None) -> list[Path]:
    """Every solution notebook, in name order."""
    return sorted((Path(root or repo_root()) / SOLUTIONS).glob("*.ipynb"))


def generate(root: Path | None = None) -> dict[Path, str]:
    """Participant notebook path → its text, for every solution notebook under ``root``."""
    root = Path(root or repo_root())
    out = {}
    for path in solution_paths(root):
        solution = json.loads(path.read_text(encoding="utf-8"))
        out[root / PARTICIPANTS / path.name] = notebook_text(participant_notebook(solution, path.name))
    return out


def stale(root: Path | None = None) -> list[str]:
    """Why the committed participant notebooks are not what :func:`generate` writes now (empty: current)."""
    root = Path(root or repo_root())
    wanted = generate(root)
    found = []
    for path, text in wanted.items():
        if not path.is_file():
            found.append(f"{path.relative_to(root)} is missing")
        elif path.read_text(encoding="utf-8") != text:
            found.append(f"{path.relative_to(root)} differs from its solution's {SOLUTIONS / path.name}")
    for path in sorted((root / PARTICIPANTS).glob("*.ipynb")):
        if path not in wanted:
            found.append(f"{path.relative_to(root)} has no solution notebook in {SOLUTIONS}/")
    return found


def write(root: Path | None = None) -> list[Path]:
    """Write every participant notebook whose text changed; returns the paths written."""
    written = []
    for path, text in generate(root).items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written


def main(check: bool = False, root: Path | None = None) -> int:
    """``labkit workshop exercises [--check]``: write the participant notebooks, or (``check``) exit 1 if any
    committed one differs from what would be written."""
    root = Path(root or repo_root())
    try:
        if check:
            problems = stale(root)
            for line in problems:
                print(f"labkit: {line}", file=sys.stderr)
            if problems:
                print("labkit: run `labkit workshop exercises` to regenerate them", file=sys.stderr)
                return 1
            print(f"labkit: {len(solution_paths(root))} participant notebooks are current", file=sys.stderr)
            return 0
        written = write(root)
    except ExerciseError as error:
        print(f"labkit: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(f"labkit: wrote {path.relative_to(root)}", file=sys.stderr)
    print(f"labkit: {len(solution_paths(root))} exercises, {len(written)} notebook(s) rewritten", file=sys.stderr)
    return 0

