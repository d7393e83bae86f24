"""Quick mode keeps what the questions ask about, and every agenda block's runs leave the room time to talk.

* labs.md's table "Quick mode keeps every question's run" has one row per run a question names (each lab's
  "Runs, and what to ask first"), and each row holds against its notebook cell, in quick mode and in full: a check
  such as `` `ms` ⊇ `[1, 4, 8]` `` is evaluated on the values the cell itself assigns, with ``labkit.QUICK`` set
  one way and then the other (nothing runs: the cell's assignments are read with :mod:`ast` and evaluated alone).
* Each agenda block's notebook, by its Run All time in quick mode as measured in a real browser
  (``benchmarks/results/browser_times.jsonl``), takes at most 40% of the block's lab minutes: the rest is the
  questions before each run and the reading after it.
"""
from __future__ import annotations

import ast
import inspect
import json
import re
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from labkit.parallel.reports.data_parallel import strategy_summary
from labkit.results import load_results
from labkit.tuning.flowchart import COMMUNICATION_BOUND, candidate_actions
from labkit.workshop import exercises as ex

ROOT = ex.repo_root()
LABS = (ROOT / "workshops" / "labs.md").read_text(encoding="utf-8")
AGENDAS = ("one_day.md", "two_day.md")
KINDS = ("same runs", "by hand", "shipped", "fewer:")
STEADY_STEPS = 8  # issue 39: lab 02 compares strategies on at least 8 steps after its warm-up
RUNS_SHARE = 0.40  # of a block's lab minutes, the most its runs may take


# ---------------------------------------------------------------- labs.md: the runs and the table


def question_runs() -> set[tuple[str, int]]:
    """(lab, run) for every numbered run under a lab's "Runs, and what to ask first"."""
    sections = re.split(r'<a id="lab-(\d\d)"></a>', LABS.split('<a id="quick-mode"></a>')[0])
    runs = set()
    for lab, body in zip(sections[1::2], sections[2::2]):
        listed = body.split("**Runs, and what to ask first.**")[1].split("\n\n**")[0]
        runs |= {(lab, int(n)) for n in re.findall(r"^(\d+)\. ", listed, flags=re.MULTILINE)}
    return runs


@dataclass(frozen=True)
class Row:
    lab: str
    run: int
    what: str
    cell: str
    quick: str

    def __str__(self) -> str:
        return f"lab {self.lab} run {self.run}"


def quick_table() -> list[Row]:
    """The rows of labs.md's quick-mode table."""
    section = LABS.split('<a id="quick-mode"></a>')[1]
    rows = re.findall(r"^\| (\d\d) · (\d+) \| ([^|]+) \| `([\w-]+)` \| ([^|]+) \|$", section, flags=re.MULTILINE)
    return [Row(lab, int(run), what.strip(), cell, quick.strip()) for lab, run, what, cell, quick in rows]


ROWS = quick_table()


def cell_source(lab: str, cell_id: str) -> str:
    (path,) = (ROOT / "notebooks").glob(f"{lab}_*.ipynb")
    cells = [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c.get("id") == cell_id]
    assert len(cells) == 1, f"{path.name} has {len(cells)} cells with id {cell_id!r}"
    return "".join(cells[0]["source"])


# ---------------------------------------------------------------- a cell's own values, in either mode


def cell_names(tree: ast.Module, quick: bool) -> dict:
    """What the cell's top-level assignments give, evaluated alone in order, inside the branch of a top-level ``if``
    that the mode takes (an assignment that needs more than literals, ``QUICK``, ``labkit.QUICK`` and the names
    before it is left out)."""
    names = {"__builtins__": {"len": len, "range": range, "sorted": sorted},
             "QUICK": quick, "labkit": SimpleNamespace(QUICK=quick)}
    assign(tree.body, names)
    return names


def assign(statements: list[ast.stmt], names: dict) -> None:
    for statement in statements:
        if isinstance(statement, ast.If):
            assign(statement.body if value_of(statement.test, names) else statement.orelse, names)
        elif isinstance(statement, ast.AugAssign) and isinstance(statement.target, ast.Name):
            update = ast.BinOp(ast.Name(statement.target.id, ast.Load()), statement.op, statement.value)
            names[statement.target.id] = value_of(ast.fix_missing_locations(update), names)
        elif isinstance(statement, ast.Assign):
            try:
                value = value_of(statement.value, names)
            except Exception:  # noqa: BLE001 — a call into labkit, a run: not a setting
                continue
            for target in statement.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = value
                elif isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts):
                    names.update(zip((t.id for t in target.elts), value))


def value_of(node: ast.expr, names: dict):
    expression = ast.fix_missing_locations(ast.Expression(node))
    return eval(compile(expression, "<cell>", "eval"), names)  # noqa: S307 — the repository's own notebook cell


def unread_quick_branches(tree: ast.Module) -> list[int]:
    """Lines where the cell chooses by ``QUICK`` somewhere the table's checks cannot read: a loop's items, a call's
    positional argument... Readable: a top-level assignment's value, a top-level ``if``'s test, a keyword's value
    and a dict's value (a config override)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    readable = ({s.value for s in tree.body if isinstance(s, (ast.Assign, ast.AugAssign))}
                | {s.test for s in tree.body if isinstance(s, ast.If)}
                | {n.value for n in ast.walk(tree) if isinstance(n, ast.keyword)}
                | {v for n in ast.walk(tree) if isinstance(n, ast.Dict) for v in n.values})
    unread = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Name) and node.id == "QUICK") or (isinstance(node, ast.Attribute)
                                                                   and node.attr == "QUICK"):
            above = node
            while above in parents and above not in readable:
                above = parents[above]
            if above not in readable:
                unread.append(node.lineno)
    return unread


def evaluated(source: str, what: str, quick: bool):
    """``what`` as the cell has it: an expression of its names, ``"key"`` (a key of a dict it writes, a config
    override) or ``name=`` (a keyword it passes)."""
    tree = ast.parse(source)
    names = cell_names(tree, quick)
    if what.endswith("="):
        nodes = [k.value for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg == what[:-1]]
    elif what.startswith('"'):
        key = ast.literal_eval(what)
        nodes = [v for d in ast.walk(tree) if isinstance(d, ast.Dict)
                 for k, v in zip(d.keys, d.values) if isinstance(k, ast.Constant) and k.value == key]
    else:
        return eval(what, names)  # noqa: S307 — labs.md's own check
    assert len(nodes) == 1, f"the cell passes {what} {len(nodes)} times"
    return value_of(nodes[0], names)


def check(source: str, spec: str, quick: bool) -> None:
    """One check of the table's last column: `` `what` ⊇ `[...]` `` or `` `what` ≥ `n` ``."""
    match = re.fullmatch(r"`([^`]+)` (⊇|≥) `([^`]+)`", spec)
    assert match, f"not a check: {spec!r}"
    what, op, wanted = match[1], match[2], ast.literal_eval(match[3])
    unread = unread_quick_branches(ast.parse(source))
    assert not unread, f"line {unread[0]} of the cell chooses by QUICK where the checks cannot read it"
    value = evaluated(source, what, quick)
    mode = "quick" if quick else "full"
    if op == "⊇":
        missing = [item for item in wanted if item not in value]
        assert not missing, f"in {mode} mode {what} is {value!r}: it lacks {missing}"
    else:
        assert value >= wanted, f"in {mode} mode {what} is {value!r}, under {wanted!r}"


# ---------------------------------------------------------------- the tests


def test_the_table_ties_every_run_a_question_names_and_no_other():
    runs, tied = question_runs(), [(row.lab, row.run) for row in ROWS]
    assert len(runs) >= 40, "labs.md's runs were not found: update question_runs to its layout"
    assert len(tied) == len(set(tied)), "a run has two rows"
    assert not runs - set(tied), f"runs with no row in the quick-mode table: {sorted(runs - set(tied))}"
    assert not set(tied) - runs, f"rows for runs labs.md does not have: {sorted(set(tied) - runs)}"


@pytest.mark.parametrize("row", ROWS, ids=str)
def test_quick_mode_runs_what_the_row_says(row):
    source = cell_source(row.lab, row.cell)
    kind = next((k for k in KINDS if row.quick.startswith(k)), None)
    if kind == "same runs":
        assert "QUICK" not in source, f"{row}: cell {row.cell} has a quick-mode branch; say what it leaves out"
    elif kind == "fewer:":
        assert "QUICK" in source, f"{row}: cell {row.cell} has no quick-mode branch: it runs the same runs"
    elif kind is None:
        for spec in row.quick.split("; "):
            for quick in (True, False):
                check(source, spec, quick)


def test_the_checks_fail_on_the_quick_mode_before_issue_39():
    """The checks read the quick branch: the old notebook 03 (m = 1 and 4) and 01 (s = 0 skipped) fail them."""
    with pytest.raises(AssertionError, match="lacks"):
        check("ms = [1, 4] if QUICK else [1, 2, 4, 8, 16]\n", "`ms` ⊇ `[1, 4, 8]`", quick=True)
    check("ms = [1, 4] if QUICK else [1, 2, 4, 8, 16]\n", "`ms` ⊇ `[1, 4, 8]`", quick=False)
    old_02 = 'config = load(...).replace(**{"run.steps": 4 if labkit.QUICK else 12})\n'
    with pytest.raises(AssertionError, match="under"):
        check(old_02, '`"run.steps"` ≥ `10`', quick=True)
    old_01 = ('cases = [("ssp", 0), ("ssp", 4), ("async", None)]\n'
              'for mode, s in cases[1:] if labkit.QUICK else cases:\n    run(mode, s)\n')
    with pytest.raises(AssertionError, match="line 2 of the cell chooses by QUICK"):
        check(old_01, '`cases` ⊇ `[("ssp", 0)]`', quick=True)
    narrowed = 'cases = [("ssp", 0), ("ssp", 4)]\nif labkit.QUICK:\n    cases = cases[1:]\n'
    with pytest.raises(AssertionError, match=r"\('ssp', 0\)"):
        check(narrowed, '`cases` ⊇ `[("ssp", 0)]`', quick=True)
    check(narrowed, '`cases` ⊇ `[("ssp", 0)]`', quick=False)


def test_lab_02_compares_strategies_on_eight_steady_steps_in_quick_mode():
    """The strategy summary drops its warm-up steps; what is left in quick mode is at least 8 steps per strategy."""
    (row,) = [r for r in ROWS if (r.lab, r.run) == ("02", 1)]
    steps = evaluated(cell_source(row.lab, row.cell), '"run.steps"', quick=True)
    warmup = inspect.signature(strategy_summary).parameters["skip"].default
    assert steps - warmup >= STEADY_STEPS, f"quick mode: {steps} steps, {warmup} dropped as warm-up"


def test_lab_09s_one_quick_trial_is_the_bf16_its_question_asks_about():
    """Quick mode's loop measures one trial: on the communication branch (0.05 Gb/s) the first candidate, bf16."""
    first = candidate_actions(COMMUNICATION_BOUND, {"comm.compression": "none", "comm.sync": "every_step"})[0]
    assert first.overrides.get("comm.compression") == "bf16", first.overrides


# ---------------------------------------------------------------- the agendas: runs within 40% of a block


@dataclass(frozen=True)
class Block:
    agenda: str
    start: str
    name: str
    notebook: str
    lab_minutes: int

    def __str__(self) -> str:
        return f"{self.agenda} {self.start} {self.name}"


def agenda_blocks(agenda: str) -> list[Block]:
    """Each block of an agenda's timetable that runs a notebook, with its lab minutes: the block's minutes less
    its exercises and its close (the heading's split, e.g. "45 min: lab 35, exercise 10")."""
    text = (ROOT / "workshops" / agenda).read_text(encoding="utf-8")
    notebooks = {(start, name): nb for start, name, nb in
                 re.findall(r"^\| (\d\d:\d\d) \| *\d+ *\| ([^|]+?) \|[^|]*`notebooks/(\d\d_\w+\.ipynb)`", text, re.M)}
    blocks = []
    for start, name, length, parts in re.findall(r"^### (\d\d:\d\d) · (.+?) \((\d+) min(?:: ([^)]*))?\)$", text, re.M):
        if (start, name) not in notebooks:
            continue
        split = [(part.rsplit(" ", 1)[0], int(part.rsplit(" ", 1)[1])) for part in parts.split(", ")] if parts else []
        talk = sum(m for what, m in split if what in ("exercise", "close"))
        blocks.append(Block(agenda, start, name, notebooks[start, name], int(length) - talk))
    return blocks


BLOCKS = [block for agenda in AGENDAS for block in agenda_blocks(agenda)]


def measured_quick_seconds() -> dict[str, float]:
    """Each notebook's newest Run All time in quick mode in the browser (benchmarks/browser_times.py)."""
    newest = {}
    for record in load_results("browser_times"):
        for row in record["rows"]:
            if row["mode"] == "quick" and row["seconds"] is not None:
                newest[row["notebook"]] = row["seconds"]
    return newest


def test_every_block_that_runs_a_notebook_is_found():
    labs = {path.name for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert {b.notebook for b in BLOCKS if b.agenda == "two_day.md"} == labs
    assert len([b for b in BLOCKS if b.agenda == "one_day.md"]) == 6  # M1–M6
    assert all(b.lab_minutes > 0 for b in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_a_blocks_runs_take_at_most_40_percent_of_its_lab_minutes(block):
    seconds = measured_quick_seconds().get(block.notebook)
    if seconds is None:
        pytest.skip(f"{block.notebook} has no quick-mode browser time yet: "
                    f"benchmarks/browser_times.py --modes quick --notebooks {block.notebook[:2]}")
    budget = RUNS_SHARE * 60 * block.lab_minutes
    assert seconds <= budget, (f"{block}: Run All took {seconds:.0f} s in quick mode, over {RUNS_SHARE:.0%} of its "
                               f"{block.lab_minutes} lab minutes ({budget:.0f} s)")
