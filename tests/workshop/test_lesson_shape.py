"""Every lab notebook has the shape of a lesson: it opens with questions, objectives and its teaching and exercise
minutes, and ends with key points (labkit.workshop.lesson); the minutes are its block's in the two-day agenda and the
objectives its section's in labs.md, so the three places cannot drift apart."""
import json

import pytest

from labkit.workshop import exercises as ex
from labkit.workshop import lesson

ROOT = ex.repo_root()
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
TWO_DAY = (ROOT / "workshops" / "two_day.md").read_text(encoding="utf-8")
LABS = (ROOT / "workshops" / "labs.md").read_text(encoding="utf-8")


def notebook(path):
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_has_the_shape_of_a_lesson(path):
    lab = path.name[:2]
    problems = lesson.shape_problems(notebook(path), path.name, lesson.agenda_minutes(TWO_DAY).get(lab),
                                     lesson.lab_objectives(LABS).get(lab))
    assert not problems, "\n".join(problems)


def test_the_agenda_and_labs_md_have_an_entry_for_every_notebook():
    labs = {path.name[:2] for path in NOTEBOOKS}
    assert labs and labs <= set(lesson.agenda_minutes(TWO_DAY)), "a lab with no block in two_day.md"
    objectives = lesson.lab_objectives(LABS)
    assert all(len(objectives.get(lab, [])) >= 2 for lab in labs), "a lab with no objectives in labs.md"


def test_the_minutes_are_read_from_the_agenda_as_written():
    assert lesson.agenda_minutes("### 09:10 · 00 · A run (40 min: lab 30, exercise 10)\n") == {"00": (30, 10)}
    assert lesson.agenda_minutes("### 10:45 · 02 · DP (65 min: lab 40, exercise 10, exercise 15)\n") == {"02": (40, 25)}
    capstone = "### 14:25 · 11 · Capstone (35 min: baseline and flowchart 5, attempts 20, leaderboard 5, close 5)\n"
    assert lesson.agenda_minutes(capstone) == {"11": (15, 20)}
    with pytest.raises(ValueError, match="do not add up"):
        lesson.agenda_minutes("### 09:10 · 00 · A run (45 min: lab 30, exercise 10)\n")


def shaped(first: str, last: str) -> dict:
    return {"cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": first},
                      {"cell_type": "markdown", "id": "b", "metadata": {}, "source": last}]}


GOOD_FIRST = ("# 00 · A run\n\n**Teaching:** 30 min · **Exercises:** 10 min\n\n"
              "**Questions**\n\n* Why?\n* How\n  so?\n\n"
              "**Objectives.** After this lab you can\n\n* read a run;\n* launch\n  one.\n\n---\n\nText.")
GOOD_LAST = "## Key points\n\n* One.\n* Two.\n* Three."


def test_a_notebook_out_of_shape_is_caught():
    good = shaped(GOOD_FIRST, GOOD_LAST)
    objectives = ["read a run;", "launch one."]
    assert lesson.opening(good)["questions"] == ["Why?", "How so?"]
    assert lesson.shape_problems(good, "x", (30, 10), objectives) == []
    cases = {
        "no minutes": (shaped(GOOD_FIRST.replace("**Teaching:**", "Teaching:"), GOOD_LAST), "gives no"),
        "other minutes": (shaped(GOOD_FIRST.replace("30 min", "35 min"), GOOD_LAST), "two_day.md's block says"),
        "no questions": (shaped(GOOD_FIRST.replace("**Questions**", "Questions"), GOOD_LAST), "questions"),
        "a statement": (shaped(GOOD_FIRST.replace("* Why?", "* Because."), GOOD_LAST), "ending in '?'"),
        "other objectives": (shaped(GOOD_FIRST.replace("read a run", "read two runs"), GOOD_LAST), "not labs.md's"),
        "no key points": (shaped(GOOD_FIRST, "## Try\n\n* One.\n* Two.\n* Three."), "Key points"),
        "too few": (shaped(GOOD_FIRST, "## Key points\n\n* One."), "three or more"),
    }
    for case, (nb, says) in cases.items():
        problems = lesson.shape_problems(nb, "x", (30, 10), objectives)
        assert len(problems) == 1 and says in problems[0], (case, problems)
