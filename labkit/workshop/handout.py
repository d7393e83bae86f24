"""A participant's copy of the workshop: the repository as a clean clone has it, without the solutions.

``labkit workshop handout DIR`` (``make handout``) writes into DIR every file of the checkout that git does not
ignore, except what gives answers away (:data:`LEFT_OUT`): the exercises' solution notebooks, the instructor's notes
with the expected outcome of every question asked before a run, and the tests, which run the solutions and keep
wrong answers found in review. The participant notebooks are generated afresh from the solutions
(:mod:`labkit.workshop.exercises`), every other notebook has its solution regions blanked the same way and its
outputs cleared, and ``HANDOUT.md`` says what was left out. Before it returns, the copy is searched for any solution
line (:func:`leaks`): a handout that holds one is an error, not a warning.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from labkit.workshop import exercises as ex

LEFT_OUT = {
    f"{ex.SOLUTIONS.as_posix()}/": "the exercises' solutions (the participants' notebooks are generated from them)",
    "workshops/labs.md": "the instructor's notes: the expected outcome of every question asked before a run",
    "tests/": "the test suite: it runs the solutions and keeps the wrong answers found in review",
}
NOTE = "HANDOUT.md"
SKIPPED_WHEN_WALKING = {".git", ".venv", "runs", "__pycache__", ".ipynb_checkpoints", ".pytest_cache", "handout"}
SHORTEST_SECRET = 12  # a solution line shorter than this is too common to look for ("return m", "m += 1")


class HandoutError(ValueError):
    """The handout cannot be written where it was asked for, or it would give a solution away."""


def tracked_files(root: Path) -> list[str]:
    """The repository's files, as paths relative to ``root``: git's tracked files and the new ones it does not
    ignore, or (no git) a walk that skips what a clean clone would not have."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True).stdout
        return sorted({p for p in out.decode().split("\0") if p and (root / p).is_file()})
    except (OSError, subprocess.CalledProcessError):
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                      if p.is_file() and not SKIPPED_WHEN_WALKING & set(p.relative_to(root).parts))


def left_out(path: str) -> bool:
    return any(path == kept or (kept.endswith("/") and path.startswith(kept)) for kept in LEFT_OUT)


def blanked_notebook(text: str, name: str) -> str:
    """A notebook with every solution region blanked (as in a participant's exercise) and no outputs."""
    notebook = json.loads(text)
    for i, cell in enumerate(notebook.get("cells", [])):
        lines = ex._lines(cell.get("source", []))
        cell["source"] = ex.participant_lines(lines, cell.get("cell_type", "code"), f"{name}, cell {i}")
        if cell.get("cell_type") == "code":
            cell.update(outputs=[], execution_count=None)
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def secret_lines(root: Path) -> list[str]:
    """Every line of a solution region that is long enough to look for and that the participant's notebook of the
    same exercise does not also hold (a line the stub keeps is no secret)."""
    secrets = set()
    for path in ex.solution_paths(root):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        visible = "\n".join("".join(ex.participant_lines(ex._lines(c["source"]), c["cell_type"])) for c in cells)
        for cell in cells:
            for region in ex.solution_regions(ex._lines(cell["source"])):
                secrets |= {line.strip() for line in region
                            if len(line.strip()) >= SHORTEST_SECRET and line.strip() not in visible}
    return sorted(secrets)


def leaks(dest: Path, root: Path) -> list[str]:
    """Why the handout in ``dest`` gives a solution away (empty: it does not). Looked for: a left-out path, a
    solution marker in a notebook, a solution line in any notebook or text outside ``labkit/`` (the library the
    exercises are checked against implements the answers, as a textbook's appendix would)."""
    found = [f"{p} is in the handout" for p in LEFT_OUT if (dest / p.rstrip("/")).exists()]
    secrets = secret_lines(root)
    for path in sorted(p for p in dest.rglob("*") if p.is_file()):
        name = path.relative_to(dest).as_posix()
        if name.startswith("labkit/"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if path.suffix == ".ipynb":  # the cells' text: in the file's JSON a quote or a backslash is escaped
            text = "\n".join("".join(ex._lines(c.get("source", []))) for c in json.loads(text).get("cells", []))
            found += [f"{name} holds the marker {m!r}" for m in (ex.BEGIN_SOLUTION, ex.BEGIN_STUB) if m in text]
        found += [f"{name} holds a solution line: {line!r}" for line in secrets if line in text]
    return found


def note(written: int) -> str:
    lines = ["# A participant's copy of labkit's workshop", "",
             f"Written by `labkit workshop handout` ({written} files). Install and open it as the repository's README "
             "says (`make lab`, or `make workshop` for the exercises). Left out, because they give answers away:", ""]
    lines += [f"* `{path}` — {why}" for path, why in LEFT_OUT.items()]
    lines += ["", "The exercises in `workshops/exercises/` are the participants' notebooks: write the part marked "
              "`raise NotImplementedError(...)`, then run the check cell.", ""]
    return "\n".join(lines)


def prepare(dest: Path) -> None:
    """An empty ``dest``: a previous handout there is replaced; any other non-empty folder is refused."""
    if dest.exists() and not dest.is_dir():
        raise HandoutError(f"{dest} is a file, not a folder")
    if dest.is_dir() and any(dest.iterdir()):
        if not (dest / NOTE).is_file():
            raise HandoutError(f"{dest} is not empty and holds no earlier handout ({NOTE}); choose another folder")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)


def write_handout(dest: str | Path, root: Path | None = None) -> list[str]:
    """Write the participant's copy into ``dest``; returns the files written (relative paths)."""
    root, dest = Path(root or ex.repo_root()).resolve(), Path(dest).resolve()
    if dest == root or root in dest.parents and dest.relative_to(root).parts[0] != "handout":
        raise HandoutError(f"{dest} is inside the repository; write the handout to ./handout or outside it")
    prepare(dest)
    generated = {path.relative_to(root).as_posix(): text for path, text in ex.generate(root).items()}
    written = []
    for name in tracked_files(root):
        if left_out(name):
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name in generated:
            target.write_text(generated[name], encoding="utf-8")
        elif name.endswith(".ipynb"):
            target.write_text(blanked_notebook((root / name).read_text(encoding="utf-8"), name), encoding="utf-8")
        else:
            shutil.copy2(root / name, target)
        written.append(name)
    (dest / NOTE).write_text(note(len(written)), encoding="utf-8")
    problems = leaks(dest, root)
    if problems:
        raise HandoutError("the handout would give solutions away:\n" + "\n".join(problems))
    return written


def main(directory: str | None) -> int:
    """``labkit workshop handout DIR``."""
    if not directory:
        print("labkit workshop handout DIR: name the folder to write the participants' copy into", file=sys.stderr)
        return 2
    try:
        written = write_handout(directory)
    except (HandoutError, ex.ExerciseError) as error:
        print(f"labkit: {error}", file=sys.stderr)
        return 2
    print(f"labkit: wrote a participant's copy of {len(written)} files to {directory} (solutions left out: "
          f"{', '.join(LEFT_OUT)}; see {NOTE} there)", file=sys.stderr)
    return 0
