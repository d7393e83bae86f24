"""The code's lint is part of the tests: ruff, configured once in pyproject.toml, runs before pytest in both
`make test` and `make test-fast`, pinned in the test extras like every tool the tests run."""
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parents[1]


def recipe(target: str) -> tuple[str, str]:
    """(prerequisites, command lines) of one Makefile target."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    match = re.search(rf"^{target}\s*:(?!=)([^\n]*)\n((?:\t[^\n]*\n?)*)", text, flags=re.MULTILINE)
    assert match, f"no `{target}` target in the Makefile"
    return match.group(1), match.group(2)


def test_both_test_targets_lint_the_code_first():
    assert "ruff check labkit benchmarks tests" in recipe("lint")[1]
    for target in ("test", "test-fast"):
        assert "lint" in recipe(target)[0].split(), f"`make {target}` does not run `make lint`"


def test_ruff_is_pinned_and_configured_where_the_code_is():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert any(re.fullmatch(r"ruff==[\d.]+", dep) for dep in project["project"]["optional-dependencies"]["test"])
    ruff = project["tool"]["ruff"]
    assert ruff["line-length"] == 120 and set(ruff["lint"]["select"]) >= {"E", "F", "W"}
