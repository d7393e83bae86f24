"""The workshop's exercises: generated from their solutions, current, free of solution text, and each check able to
pass and to fail.

Every exercise runs here, in this process, twice — its code cells executed in order in one namespace, as a kernel
runs them: the solution notebook must pass its check cell; the participant notebook must run every cell before the
check and then fail the check, with ``NotImplementedError`` (a stub) or ``AssertionError`` (code to fix).
"""
import json
import re
import shutil

import pytest

from labkit.cli import main as labkit_main
from labkit.workshop import exercises as ex

ROOT = ex.repo_root()
NAMES = [path.name for path in ex.solution_paths(ROOT)]
# exercises whose check starts gloo processes (labkit.workshop.ranks): the participants write multi-process code
MULTIPROC = [path.name for path in ex.solution_paths(ROOT) if "run_on_ranks(" in path.read_text(encoding="utf-8")]
RUNS = [pytest.param(name, marks=pytest.mark.multiproc) if name in MULTIPROC else name for name in NAMES]


def solution(name: str) -> dict:
    return json.loads((ROOT / ex.SOLUTIONS / name).read_text(encoding="utf-8"))


def participant(name: str) -> dict:
    return json.loads((ROOT / ex.PARTICIPANTS / name).read_text(encoding="utf-8"))


def source(cell: dict) -> str:
    return "".join(cell["source"])


def run_until_check(notebook: dict, name: str):
    """Run the code cells in order in one namespace, up to and including the check cell.

    Returns the exception the check cell raised (None if it passed). A cell before the check that raises fails the
    test: a participant's notebook must run up to the check, where the missing part is felt. Cells after the check
    (explorations) run for the solution only."""
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        code = compile(source(cell), f"{name}, cell {i}", "exec")
        if ex.is_check(cell):
            try:
                exec(code, namespace)
            except Exception as error:  # noqa: BLE001 — the caller judges which failure is right
                return error
            return None
        exec(code, namespace)
    raise AssertionError(f"{name} has no check cell")


# ---------------------------------------------------------------- the folder


CAPSTONE = "11"  # the capstone notebook is itself the exercise: "make this run fast", scored and ranked


def test_every_lab_has_an_exercise():
    labs = {path.name[:2] for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")} - {CAPSTONE}
    covered = {name[:2] for name in NAMES}
    assert labs, "no lab notebooks found"
    assert labs <= covered, f"labs without an exercise: {sorted(labs - covered)}"


def test_the_participant_notebooks_are_current():
    # the CI check: an edited solution whose participant notebook was not regenerated fails here
    problems = ex.stale(ROOT)
    assert not problems, "\n".join(problems) + "\nrun `labkit workshop exercises` to regenerate them"


def test_the_check_command_agrees(capsys):
    assert labkit_main(["workshop", "exercises", "--check"]) == 0
    assert "current" in capsys.readouterr().err


def test_the_check_fails_on_an_edited_missing_or_orphan_notebook(tmp_path):
    shutil.copytree(ROOT / ex.SOLUTIONS, tmp_path / ex.SOLUTIONS)
    assert ex.main(check=True, root=tmp_path) == 1  # nothing generated yet: every participant notebook is missing
    assert ex.main(root=tmp_path) == 0
    assert ex.main(check=True, root=tmp_path) == 0
    edited = tmp_path / ex.PARTICIPANTS / NAMES[0]
    edited.write_text(edited.read_text(encoding="utf-8").replace("Exercise", "Exercice", 1), encoding="utf-8")
    assert any("differs" in line for line in ex.stale(tmp_path))
    assert ex.main(check=True, root=tmp_path) == 1
    assert ex.main(root=tmp_path) == 0 and ex.stale(tmp_path) == []  # regenerating repairs it
    (tmp_path / ex.PARTICIPANTS / "99_orphan.ipynb").write_text("{}", encoding="utf-8")
    assert ex.stale(tmp_path) == [f"{ex.PARTICIPANTS / '99_orphan.ipynb'} has no solution notebook in {ex.SOLUTIONS}/"]


def test_generation_is_deterministic():
    first, second = ex.generate(ROOT), ex.generate(ROOT)
    assert first == second
    for name in NAMES:  # however the solution's JSON is laid out, the participant's bytes are the same
        reordered = json.loads(json.dumps(solution(name), sort_keys=False),
                               object_pairs_hook=lambda p: dict(reversed(p)))
        assert ex.notebook_text(ex.participant_notebook(reordered, name)) == first[ROOT / ex.PARTICIPANTS / name]


@pytest.mark.parametrize("name", NAMES)
def test_the_participant_notebook_keeps_cells_and_drops_outputs(name):
    sol, part = solution(name), participant(name)
    assert [c["id"] for c in part["cells"]] == [c["id"] for c in sol["cells"]]
    assert [c["cell_type"] for c in part["cells"]] == [c["cell_type"] for c in sol["cells"]]
    for cell in part["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
    assert part["metadata"]["labkit"]["generated_from"] == f"solutions/{name}"
    assert re.match(r"\d\d_[a-z0-9_]+\.ipynb$", name), f"{name}: exercises are named NN_topic.ipynb"
    lab = re.search(r"notebooks/(\d\d)_\w+\.ipynb", source(sol["cells"][0]))
    assert lab and lab[1] == name[:2] and (ROOT / lab[0]).is_file(), (
        f"{name}: its first cell names the lab it belongs to")


def test_the_notebooks_are_valid_nbformat():
    nbformat = pytest.importorskip("nbformat")
    for name in NAMES:
        for notebook in (solution(name), participant(name)):
            nbformat.validate(nbformat.from_dict(notebook))


@pytest.mark.parametrize("name", NAMES)
def test_no_solution_text_leaks(name):
    text = "\n".join(source(cell) for cell in participant(name)["cells"])
    for marker in ex.MARKERS:
        assert marker not in text, f"{name}: the marker {marker!r} reached the participant"
    outside = "\n".join("".join(ex.participant_lines(cell["source"], cell["cell_type"]))
                        for cell in solution(name)["cells"])
    secret = [line.strip() for cell in solution(name)["cells"] for region in ex.solution_regions(cell["source"])
              for line in region]
    # a line of 12 characters or more that the rest of the solution does not also contain is the solution's own
    secret = [line for line in secret if len(line) >= 12 and line not in outside]
    assert secret, f"{name}: no solution line is long enough to look for"
    leaked = [line for line in secret if line in text]
    assert not leaked, f"{name}: solution lines in the participant's notebook: {leaked}"


# ---------------------------------------------------------------- each check, both ways


@pytest.mark.parametrize("name", RUNS)
def test_the_solution_passes_its_check(name):
    error = run_until_check(solution(name), name)
    assert error is None, f"{name}: the solution fails its own check: {type(error).__name__}: {error}"


@pytest.mark.parametrize("name", RUNS)
def test_the_participant_notebook_fails_its_check(name):
    error = run_until_check(participant(name), name)
    assert isinstance(error, (NotImplementedError, AssertionError)), (
        f"{name}: the blank exercise {'passes its check' if error is None else f'fails with {error!r}'}; "
        "a check must fail until the participant has written the solution")


# ---------------------------------------------------------------- the marker rules


def lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def test_a_solution_becomes_a_stub_at_its_indentation():
    cell = lines("def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n")
    assert "".join(ex.participant_lines(cell, "code")) == f"def f(x):\n    '''doc'''\n    {ex.CODE_STUB}\n"
    assert ex.solution_regions(cell) == [["    return 2 * x\n"]]


def test_a_stub_block_replaces_the_solution_uncommented():
    cell = lines("def f(x):\n    ### BEGIN STUB\n    # return x  (wrong)\n    #\n    ### END STUB\n"
                 "    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n    # after")
    assert "".join(ex.participant_lines(cell, "code")) == "def f(x):\n    return x  (wrong)\n    \n    # after"


def test_a_markdown_answer_becomes_a_prompt():
    cell = lines("Why?\n\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION\n")
    assert "".join(ex.participant_lines(cell, "markdown")) == f"Why?\n\n{ex.MARKDOWN_STUB}\n"


@pytest.mark.parametrize("text, says", [
    ("### BEGIN SOLUTION\nx = 1\n", "not closed"),
    ("x = 1\n### END SOLUTION\n", "without its opening"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\nx\n### END SOLUTION\n", "not closed"),
    ("### BEGIN STUB\nx = 1\n### END STUB\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION\n", "is a comment"),
    ("### BEGIN STUB\n# x = 1\n### END STUB\nx = 0\n", "followed at once"),
    ("### BEGIN STUB\n# x = 1\n### END STUB\n", "followed at once"),
])
def test_malformed_markers_are_refused(text, says):
    with pytest.raises(ex.ExerciseError, match=says):
        ex.participant_lines(lines(text), "code")


def notebook(*cells) -> dict:
    return {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def code_cell(text: str, tags=(), outputs=()) -> dict:
    return {"cell_type": "code", "metadata": {"tags": list(tags)} if tags else {}, "source": text,
            "outputs": list(outputs), "execution_count": None}


def test_a_solution_notebook_needs_one_check_a_solution_and_no_outputs():
    solved = code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n")
    good = notebook(solved, code_cell("assert f() == 1", ["check"]))
    assert ex.solution_problems(good, "x.ipynb") == []
    assert "exactly one" in ex.solution_problems(notebook(solved), "x.ipynb")[0]
    assert "marks no solution" in ex.solution_problems(notebook(code_cell("assert 1", ["check"])), "x.ipynb")[0]
    with_output = notebook(solved, code_cell("assert f() == 1", ["check"], outputs=[{"output_type": "stream"}]))
    assert "stored outputs" in ex.solution_problems(with_output, "x.ipynb")[0]
    with pytest.raises(ex.ExerciseError, match="exactly one"):
        ex.participant_notebook(notebook(solved), "x.ipynb")
    part = ex.participant_notebook(good, "x.ipynb")  # cells without ids get stable ones
    assert [c["id"] for c in part["cells"]] == [c["id"] for c in ex.participant_notebook(good, "x.ipynb")["cells"]]
    assert len({c["id"] for c in part["cells"]}) == 2


# ---------------------------------------------------------------- in a real kernel


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["03_pipeline_bubble.ipynb", "04_ring_allreduce.ipynb"])
def test_an_exercise_runs_the_same_in_a_kernel(name):
    # the in-process runs above stand for a kernel; an exercise run by nbclient shows that they do, and a multi-process
    # one that its workers fork from a kernel as they do from a test
    nbclient, nbformat = pytest.importorskip("nbclient"), pytest.importorskip("nbformat")
    solved = nbformat.reads(json.dumps(solution(name)), as_version=4)
    nbclient.NotebookClient(solved, timeout=120, kernel_name="python3").execute()
    blank = nbformat.reads(json.dumps(participant(name)), as_version=4)
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="NotImplementedError"):
        nbclient.NotebookClient(blank, timeout=120, kernel_name="python3").execute()


# ---------------------------------------------------------------- wrong answers found in review

# (exercise, a line of its solution, a wrong answer in its place, what is wrong): each check must reject each one.
# The first was found in review (the check accepted it); the others are what a room is likely to write.
WRONG_ANSWERS = [
    ("09_find_straggler.ipynb", "others = statistics.median(busy[:rank] + busy[rank + 1:])",
     "others = statistics.median(busy)", "a median that includes the rank itself"),
    ("02_bucket_hook.ipynb", "flat /= world", "pass", "the ranks' sum where DDP averages"),
    ("03_one_f_one_b.ipynb", "warmup = min(stages - stage - 1, m)", "warmup = m", "GPipe's order"),
    ("04_ring_allreduce.ipynb", "chunks[theirs].add_(incoming)", "chunks[theirs].copy_(incoming)",
     "a reduce-scatter that copies instead of adding"),
]
WRONG_RUNS = [pytest.param(*case, marks=[pytest.mark.multiproc] if case[0] in MULTIPROC else [], id=case[3])
              for case in WRONG_ANSWERS]


def with_wrong_answer(name: str, right: str, wrong: str) -> dict:
    """The solution notebook of ``name`` with the line ``right`` of its solution replaced by ``wrong``."""
    notebook = solution(name)
    cells = [cell for cell in notebook["cells"] if right in source(cell)]
    assert len(cells) == 1, f"{name}: {len(cells)} cells hold {right!r}; update WRONG_ANSWERS"
    cells[0]["source"] = source(cells[0]).replace(right, wrong)
    return notebook


@pytest.mark.parametrize("name, right, wrong, why", WRONG_RUNS)
def test_the_check_rejects_a_wrong_answer_found_in_review(name, right, wrong, why):
    error = run_until_check(with_wrong_answer(name, right, wrong), name)
    assert isinstance(error, AssertionError), f"{name}: the check accepts {why} ({wrong!r})"
