"""The shape of a lesson (the Carpentries' shape): every lab notebook opens with its questions, its objectives and
its teaching and exercise minutes, and ends with its key points.

The opening is the notebook's first markdown cell, after its title::

    **Teaching:** 30 min · **Exercises:** 10 min — …

    **Questions**

    * What …?

    **Objectives.** After this lab you can

    * …;

and its last cell is a markdown cell that starts ``## Key points`` followed by a bulleted list.

Two facts in the opening have another home, and must agree with it: the minutes are those of the lab's block in the
two-day agenda (``workshops/two_day.md``, the one agenda that runs every lab: ``(40 min: lab 30, exercise 10)``), and
the objectives are the lab's in ``workshops/labs.md``. :func:`shape_problems` says what is missing or disagrees.
"""
from __future__ import annotations

import re

MINUTES = re.compile(r"\*\*Teaching:\*\* (\d+) min · \*\*Exercises:\*\* (\d+) min")
QUESTIONS = "**Questions**"
OBJECTIVES = "**Objectives.**"
KEY_POINTS = "## Key points"
EXERCISE_PARTS = ("exercise", "attempts")  # an agenda block's hands-on parts; the capstone's are its attempts


def _text(cell: dict) -> str:
    source = cell.get("source", "")
    return source if isinstance(source, str) else "".join(source)


def bullets(text: str, after: str) -> list[str]:
    """The items of the bulleted list that follows the line starting with ``after`` (whitespace collapsed)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(after)), None)
    if start is None:
        return []
    items: list[str] = []
    for line in lines[start + 1:]:
        if line.startswith("* "):
            items.append(line[2:])
        elif items and line.startswith("  ") and line.strip():
            items[-1] += " " + line.strip()
        elif items or line.strip():
            break
    return [" ".join(item.split()) for item in items]


def agenda_minutes(two_day: str) -> dict[str, tuple[int, int]]:
    """Lab number → (teaching, exercise) minutes of its block in the two-day agenda.

    A block's heading is ``### 09:10 · 00 · Title (40 min: lab 30, exercise 10)``; its exercise minutes are the
    parts named in :data:`EXERCISE_PARTS`, its teaching minutes the rest, and together they make the block."""
    found = {}
    for lab, total, parts in re.findall(r"^### \d\d:\d\d · (\d\d) · [^\n]*\((\d+) min: ([^)]*)\)", two_day, re.M):
        split = [(name.strip(), int(minutes)) for name, minutes in re.findall(r"([^,\d]+) (\d+)", parts)]
        exercise = sum(m for name, m in split if name.startswith(EXERCISE_PARTS))
        teaching = sum(m for name, m in split if not name.startswith(EXERCISE_PARTS))
        if teaching + exercise != int(total):
            raise ValueError(f"two_day.md, block {lab}: its parts ({parts}) do not add up to {total} min")
        found[lab] = (teaching, exercise)
    return found


def lab_objectives(labs: str) -> dict[str, list[str]]:
    """Lab number → its objectives in ``workshops/labs.md`` (the list after ``**Objectives.**`` in its section)."""
    sections = re.split(r'^<a id="lab-(\d\d)"></a>$', labs, flags=re.M)
    return {lab: bullets(body, OBJECTIVES) for lab, body in zip(sections[1::2], sections[2::2])}


def opening(notebook: dict) -> dict:
    """What a notebook's first markdown cell says: minutes (or None), questions, objectives."""
    first = next((_text(c) for c in notebook.get("cells", []) if c.get("cell_type") == "markdown"), "")
    minutes = MINUTES.search(first)
    return {"minutes": (int(minutes[1]), int(minutes[2])) if minutes else None,
            "questions": bullets(first, QUESTIONS), "objectives": bullets(first, OBJECTIVES)}


def key_points(notebook: dict) -> list[str]:
    """The key points of a notebook's last cell (empty when it is not a ``## Key points`` markdown cell)."""
    cells = notebook.get("cells", [])
    last = cells[-1] if cells else {}
    if last.get("cell_type") != "markdown" or not _text(last).startswith(KEY_POINTS):
        return []
    return bullets(_text(last), KEY_POINTS)


def shape_problems(notebook: dict, name: str, minutes: tuple[int, int] | None,
                   objectives: list[str] | None) -> list[str]:
    """What keeps notebook ``name`` from the lesson's shape, or from agreeing with the agenda's ``minutes`` and
    labs.md's ``objectives`` (None: the lab has none there, which is itself a problem)."""
    found = opening(notebook)
    problems = []
    if found["minutes"] is None:
        problems.append(f"{name}: its first markdown cell gives no '**Teaching:** N min · **Exercises:** M min'")
    elif minutes is None:
        problems.append(f"{name}: workshops/two_day.md has no block for it to take its minutes from")
    elif found["minutes"] != minutes:
        problems.append(f"{name}: teaching/exercise minutes {found['minutes']}, two_day.md's block says {minutes}")
    if len(found["questions"]) < 2 or not all(q.endswith("?") for q in found["questions"]):
        problems.append(f"{name}: its opening needs {QUESTIONS} followed by two or more questions, each ending in '?'")
    if not found["objectives"]:
        problems.append(f"{name}: its opening needs {OBJECTIVES} followed by a bulleted list")
    elif found["objectives"] != objectives:
        problems.append(f"{name}: its objectives are not labs.md's for this lab (copy them from there)")
    if len(key_points(notebook)) < 3:
        problems.append(f"{name}: its last cell must be markdown starting '{KEY_POINTS}' with three or more points")
    return problems
