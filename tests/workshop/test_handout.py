"""``labkit workshop handout DIR`` (``make handout``): a participants' copy of the repository that holds every lab and
every exercise, and no solution."""
import json

import pytest

from labkit.cli import main as labkit_main
from labkit.workshop import exercises as ex
from labkit.workshop import handout

ROOT = ex.repo_root()


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    dest = tmp_path_factory.mktemp("room") / "handout"
    written = handout.write_handout(dest, ROOT)
    return dest, written


def test_the_handout_holds_every_lab_and_every_participant_exercise(copy):
    dest, written = copy
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert (dest / "notebooks" / path.name).read_text(encoding="utf-8") == path.read_text(encoding="utf-8")
    for path, text in ex.generate(ROOT).items():
        assert (dest / path.relative_to(ROOT)).read_text(encoding="utf-8") == text
    for needed in ("pyproject.toml", "Makefile", "labkit/__init__.py", "configs/quickstart.yaml",
                   "workshops/exercises/data/straggler_events.jsonl", handout.NOTE):
        assert (dest / needed).is_file(), f"the handout lacks {needed}"
    assert len(written) > 100


def test_the_handout_holds_no_solution(copy):
    dest, _ = copy
    assert not (dest / ex.SOLUTIONS).exists() and not (dest / "tests").exists()
    assert not (dest / "workshops" / "labs.md").exists()
    assert handout.leaks(dest, ROOT) == []
    secrets = handout.secret_lines(ROOT)
    assert len(secrets) >= len(ex.solution_paths(ROOT)), "too few solution lines to look for"
    notebooks = {p: "\n".join("".join(c["source"]) for c in json.loads(p.read_text(encoding="utf-8"))["cells"])
                 for p in dest.rglob("*.ipynb")}
    for path, text in notebooks.items():
        for marker in ex.MARKERS:
            assert marker not in text, f"{path}: {marker}"
        assert not [line for line in secrets if line in text], path
    assert "HANDOUT.md" in handout.NOTE and "solutions" in (dest / handout.NOTE).read_text(encoding="utf-8")


def test_a_solution_in_the_handout_is_caught(copy, tmp_path):
    dest, _ = copy
    secret = next(line for line in handout.secret_lines(ROOT) if '"' in line)  # escaped in a notebook's JSON
    planted = tmp_path / "planted"
    (planted / "notebooks").mkdir(parents=True)
    (planted / "notebooks" / "x.ipynb").write_text(json.dumps({"cells": [{"source": secret}]}), encoding="utf-8")
    (planted / "workshops" / "exercises" / "solutions").mkdir(parents=True)
    (planted / "notes.md").write_text(f"{ex.BEGIN_SOLUTION} in prose is no leak, {secret} is", encoding="utf-8")
    found = handout.leaks(planted, ROOT)
    assert any("solutions/ is in the handout" in line for line in found)
    assert any(line.startswith("notebooks/x.ipynb holds a solution line") for line in found)
    assert any(line.startswith("notes.md holds a solution line") for line in found)


def test_a_notebook_with_a_solution_region_is_blanked():
    text = json.dumps({"cells": [
        {"cell_type": "code", "source": "def f():\n    ### BEGIN SOLUTION\n    return 42\n    ### END SOLUTION\n",
         "outputs": [{"output_type": "stream"}], "execution_count": 3, "metadata": {}},
        {"cell_type": "markdown", "source": "Why?\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION\n", "metadata": {}}]})
    cells = json.loads(handout.blanked_notebook(text, "x.ipynb"))["cells"]
    assert "".join(cells[0]["source"]) == f"def f():\n    {ex.CODE_STUB}\n"
    assert cells[0]["outputs"] == [] and cells[0]["execution_count"] is None
    assert "".join(cells[1]["source"]) == f"Why?\n{ex.MARKDOWN_STUB}\n"


def test_the_handout_replaces_an_earlier_one_and_refuses_other_folders(tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "thesis.tex").write_text("mine", encoding="utf-8")
    with pytest.raises(handout.HandoutError, match="not empty"):
        handout.write_handout(busy, ROOT)
    assert (busy / "thesis.tex").read_text(encoding="utf-8") == "mine"
    with pytest.raises(handout.HandoutError, match="inside the repository"):
        handout.write_handout(ROOT / "notebooks" / "copy", ROOT)
    assert labkit_main(["workshop", "handout"]) == 2
    assert "name the folder" in capsys.readouterr().err
    again = tmp_path / "again"
    assert labkit_main(["workshop", "handout", str(again)]) == 0
    (again / "stale.txt").write_text("from an older handout", encoding="utf-8")
    assert labkit_main(["workshop", "handout", str(again)]) == 0
    assert not (again / "stale.txt").exists() and (again / handout.NOTE).is_file()
