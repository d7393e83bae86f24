"""The instructor's material says only what labkit does: its notebooks, configs, keys, commands and exercises exist,
every `labkit train` command in it would start on this machine, and the agendas' minutes add up.

Each test reads the files as they are (``workshops/*.md``), so a renamed key, notebook or exercise, or a block moved
without moving the next one, fails here.
"""
import re

import pytest

from labkit.cli import _parser
from labkit.config import Config, load_config
from labkit.validation import validate
from labkit.workshop import exercises as ex
from test_readme import config_keys_named, set_overrides

ROOT = ex.repo_root()
DOCS = {path.name: path.read_text(encoding="utf-8") for path in sorted((ROOT / "workshops").glob("*.md"))}
AGENDAS = ("one_day.md", "two_day.md")
DAY_MINUTES = 6 * 60  # a teaching day, breaks and lunch included
EXERCISES = {path.stem for path in ex.solution_paths(ROOT)}
GPU_ONLY = ("fp16", "fp8", "cuda", "nccl", "flash_attn", "labkit_triton")


def all_docs() -> str:
    return "\n".join(DOCS.values())


def test_the_material_is_there():
    assert {"README.md", "labs.md", *AGENDAS} <= set(DOCS)


# ---------------------------------------------------------------- names that must exist


@pytest.mark.parametrize("path",
                         sorted(set(re.findall(r"(?:notebooks|configs|benchmarks/results)/[\w/]+\.\w+", all_docs()))))
def test_every_file_named_exists(path):
    assert (ROOT / path).is_file(), f"the workshop material names {path}, which does not exist"


def test_every_exercise_named_exists():
    named = set(re.findall(r"`(?:exercises/)?(\d\d_[a-z0-9_]+?)(?:\.ipynb)?`", all_docs()))
    assert named, "the material names no exercise"
    assert named <= EXERCISES, f"named but not an exercise: {sorted(named - EXERCISES)}"
    two_day = set(re.findall(r"`(\d\d_[a-z0-9_]+)`", DOCS["two_day.md"]))
    assert EXERCISES <= two_day, f"exercises the two-day workshop never gives: {sorted(EXERCISES - two_day)}"


def test_every_lab_is_in_the_two_day_workshop_and_in_labs_md():
    labs = sorted(path.name for path in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for lab in labs:
        assert f"notebooks/{lab}" in DOCS["two_day.md"], f"two_day.md never runs notebooks/{lab}"
        assert f'<a id="lab-{lab[:2]}"></a>' in DOCS["labs.md"], f"labs.md has no section for {lab}"


def test_every_link_to_a_section_lands():
    for name, text in DOCS.items():
        for target, anchor in re.findall(r"\]\(([\w.]+\.md)#([\w-]+)\)", text):
            assert f'<a id="{anchor}"></a>' in DOCS[target], (
                f"{name} links to {target}#{anchor}, which has no such anchor")


# ---------------------------------------------------------------- config keys and commands


@pytest.mark.parametrize("key, value", set_overrides(all_docs()))
def test_every_set_override_is_a_valid_key_and_value(key, value):
    load_config(None, [f"{key}={value}"])  # raises ConfigError for an unknown key or a value outside its choices


@pytest.mark.parametrize("key", config_keys_named(all_docs()))
def test_every_config_key_named_exists(key):
    node = Config().to_dict()
    for part in key.split("."):
        assert isinstance(node, dict) and part in node, f"`{key}` is in the workshop material but is no config key"
        node = node[part]


def train_commands(text: str) -> list[str]:
    """Every ``labkit train …`` command: inline code (which may wrap a line) and lines of fenced blocks."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.DOTALL)
    inline = re.findall(r"`((?:\.venv/bin/)?labkit train [^`]*)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    lines = [line for block in fenced for line in block.replace("\\\n", " ").splitlines() if "labkit train" in line]
    commands = [re.sub(r"\s+", " ", c.split("#")[0]).strip() for c in inline + lines]
    return list(dict.fromkeys(c[c.index("labkit train"):] for c in commands))


COMMANDS = train_commands(all_docs())


def test_the_material_shows_train_commands():
    assert len(COMMANDS) >= 8  # the extraction still finds them


@pytest.mark.parametrize("command", COMMANDS)
def test_every_train_command_would_start_here(command):
    args = _parser().parse_args(command.split()[1:])
    overrides = list(args.overrides) + ([f"run.steps={args.steps}"] if args.steps is not None else [])
    config = load_config(ROOT / args.config, overrides)
    if any(word in command for word in GPU_ONLY):
        pytest.skip("a GPU node's command: its keys are checked, not this machine")
    validate(config, nproc=args.nproc)  # raises ConfigError naming every problem


# ---------------------------------------------------------------- the agendas add up


def minutes(clock: str) -> int:
    hours, mins = clock.split(":")
    return 60 * int(hours) + int(mins)


def timetables(text: str) -> list[list[tuple[int, int | None, str]]]:
    """Each timetable as rows of (start, minutes or None for the end row, block)."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        row = re.match(r"\| (\d\d:\d\d) \| *(\d*) *\| ([^|]+?) \|", line)
        if row:
            current.append((minutes(row[1]), int(row[2]) if row[2] else None, row[3]))
        elif current:
            tables.append(current)
            current = []
    return tables


@pytest.mark.parametrize("agenda, days", [("one_day.md", 1), ("two_day.md", 2)])
def test_each_day_adds_up_to_six_hours(agenda, days):
    tables = timetables(DOCS[agenda])
    assert len(tables) == days, f"{agenda}: {len(tables)} timetables, expected {days}"
    for table in tables:
        *blocks, end = table
        assert end[1] is None and all(b[1] for b in blocks), f"{agenda}: every row but the last has minutes"
        for (start, length, block), (next_start, _, _) in zip(table, table[1:]):
            assert start + length == next_start, f"{agenda}: {block!r} does not end where the next block starts"
        assert sum(b[1] for b in blocks) == DAY_MINUTES == end[0] - blocks[0][0], f"{agenda}: not a 6-hour day"
        assert any("Lunch" in b[2] for b in blocks) and any("Break" in b[2] for b in blocks), f"{agenda}: no breaks"


@pytest.mark.parametrize("agenda", AGENDAS)
def test_each_block_is_described_and_its_parts_add_up(agenda):
    text = DOCS[agenda]
    headings = {(minutes(m[1]), int(m[2])): m[3] for m in
                re.finditer(r"^### (\d\d:\d\d) · .+? \((\d+) min(?:: ([^)]*))?\)$", text, flags=re.MULTILINE)}
    for table in timetables(text):
        for start, length, block in table[:-1]:
            assert (start, length) in headings, f"{agenda}: no '### HH:MM · … ({length} min…)' section for {block!r}"
    for (start, length), parts in headings.items():
        if parts:
            split = [int(n) for n in re.findall(r"(\d+)", parts)]
            assert sum(split) == length, (
                f"{agenda}: the block at {start // 60:02d}:{start % 60:02d} splits {parts} ≠ {length}")



def welcome_block(agenda: str) -> str:
    """The text of an agenda's first day's "Welcome" section, up to the next block's heading."""
    match = re.search(r"^### [^\n]*Welcome[^\n]*\n(.*?)(?=^### )", DOCS[agenda], flags=re.MULTILINE | re.DOTALL)
    assert match, f"{agenda} has no Welcome block"
    return match.group(1)


@pytest.mark.parametrize("agenda", AGENDAS)
def test_the_welcome_block_runs_the_doctor_and_says_its_threshold(agenda):
    from labkit.doctor import SLOW_RATIO

    block = welcome_block(agenda)
    assert "`.venv/bin/labkit doctor`" in block, f"{agenda}: the welcome block does not run labkit doctor"
    assert "--quick" not in block, f"{agenda}: the welcome block must time the step (no --quick)"
    assert f"above {SLOW_RATIO:g}×" in block, f"{agenda}: the welcome block's threshold is not labkit.doctor's"


def test_the_workshop_readme_states_the_doctors_threshold():
    from labkit.doctor import SLOW_RATIO

    assert f"above {SLOW_RATIO:g}×" in DOCS["README.md"] and "the timed step" in DOCS["README.md"]
