"""The README says only what the code does: notebooks, config keys, strategy and compressor names, make targets.

Each test reads README.md as it is, so a rename in the code (a key, a strategy, a make target) or a new notebook
that the README does not follow makes one of them fail.
"""
import re
from pathlib import Path

import pytest

from labkit.comm.compress import COMPRESSORS
from labkit.config import Config, ConfigError, load_config
from labkit.parallel import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

# `--set section.key=value` in the "Where things are" table is the syntax, not a key.
PLACEHOLDER_KEYS = {"section.key"}


def code_spans(text: str) -> list[str]:
    """The text of every fenced code block and every inline `code` span (commands live there, not in prose)."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.DOTALL)
    rest = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return fenced + re.findall(r"`([^`\n]+)`", rest)


def set_overrides(text: str) -> list[tuple[str, str]]:
    """Every ``--set key=value`` in the README, and every inline `section.key=value`, as (key, value)."""
    pairs = re.findall(r"--set\s+([A-Za-z_][\w.]*)=([^\s`\]]+)", text)
    pairs += re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)=([^\s`]+)`", text)  # e.g. `fault.async_save=true`
    return list(dict.fromkeys((key, value) for key, value in pairs if key not in PLACEHOLDER_KEYS))


SECTIONS = tuple(Config().to_dict())  # model, data, optim, parallel, ...
FILE_SUFFIXES = {"py", "yaml", "json", "jsonl", "sqlite", "ipynb", "sh", "pt", "txt"}  # `precision.py` is a file


def config_keys_named(text: str) -> list[str]:
    """Every backticked `section.key` (no value) whose first part is a config section, e.g. `run.runs_dir`."""
    return list(dict.fromkeys(key for key in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", text)
                              if key.split(".")[0] in SECTIONS and key.rsplit(".", 1)[1] not in FILE_SUFFIXES
                              and key not in PLACEHOLDER_KEYS))


def listed_names(after: str) -> list[str]:
    """The backticked names in the parenthesised list that follows ``after`` in the README."""
    start = README.find(after)
    assert start >= 0, f"the README no longer contains {after!r}: update this test to where the list moved"
    match = re.match(r"\s*\(([^)]*)\)", README[start + len(after):])
    assert match, f"no parenthesised list right after {after!r} in the README"
    names = re.findall(r"`([^`]+)`", match.group(1))
    assert names, f"the list after {after!r} names nothing"
    return names


# ---------------------------------------------------------------- (a) notebooks

@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_every_notebook_is_described(notebook):
    # fails as soon as a notebook is added (or renamed) without a paragraph in the README
    assert f"notebooks/{notebook}" in README, f"README.md does not name notebooks/{notebook}"


def test_every_notebook_the_readme_names_exists():
    named = set(re.findall(r"notebooks/(\w+\.ipynb)", README))
    assert named, "the README names no notebook"
    missing = sorted(n for n in named if not (ROOT / "notebooks" / n).is_file())
    assert not missing, f"the README names notebooks that do not exist: {missing}"


# ---------------------------------------------------------------- (b) --set keys

def test_the_readme_shows_set_overrides():
    assert len(set_overrides(README)) >= 10  # the extraction still finds the README's examples
    assert "run.runs_dir" in config_keys_named(README)


@pytest.mark.parametrize("key, value", set_overrides(README))
def test_every_set_override_is_a_valid_config_key_and_value(key, value):
    # load_config parses "key=value" as --set does and raises ConfigError for an unknown key or a value
    # outside the key's type or choices (test_a_bad_key_is_refused shows that it can fail)
    load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize("key", config_keys_named(README))
def test_every_config_key_the_readme_names_exists(key):
    # a key is looked up in the default config's nested dict: a renamed or invented key raises KeyError
    node = Config().to_dict()
    for part in key.split("."):
        assert isinstance(node, dict) and part in node, f"`{key}` is in the README but is no config key"
        node = node[part]


def test_a_bad_key_is_refused():
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["parallel.dp.stratgy=zero2"])
    with pytest.raises(ConfigError, match="is not one of"):
        load_config(None, ["parallel.dp.strategy=zero4"])


# ---------------------------------------------------------------- (c) strategies and compressors

def test_the_strategies_listed_are_the_registered_ones():
    listed = listed_names("`--set parallel.dp.strategy=zero2`")
    assert set(listed) <= set(STRATEGIES), f"not in labkit.parallel.STRATEGIES: {set(listed) - set(STRATEGIES)}"
    assert set(listed) == set(STRATEGIES), f"the README's list misses {set(STRATEGIES) - set(listed)}"


def test_the_compressors_listed_are_the_registered_ones():
    listed = listed_names("gradient compression")
    assert set(listed) <= set(COMPRESSORS), f"not in labkit.comm.compress.COMPRESSORS: {set(listed) - set(COMPRESSORS)}"
    # every real compressor is listed ("none" is the absence of one)
    assert set(listed) == set(COMPRESSORS) - {"none"}, (
        f"the README's list misses {set(COMPRESSORS) - {'none'} - set(listed)}")


# ---------------------------------------------------------------- (d) make targets

def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    # "name:" at the start of a line, not a ":=" assignment
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, flags=re.MULTILINE))


def readme_make_targets() -> set[str]:
    return {target for span in code_spans(README)
            for target in re.findall(r"(?:^|[\s;(])make\s+([a-z][\w-]*)", span, flags=re.MULTILINE)}


def test_the_readme_names_make_targets():
    assert {"lab", "test", "benchmark"} <= readme_make_targets()  # the extraction still finds them


@pytest.mark.parametrize("target", sorted(readme_make_targets()))
def test_every_make_target_in_the_readme_exists(target):
    # fails for a target the README mentions that the Makefile lacks (e.g. a renamed "make bench")
    assert target in makefile_targets(), f"`make {target}` is in the README but not in the Makefile"


def make_recipe(target: str) -> str:
    """The command lines of one Makefile target (the tab-indented lines after ``target:``)."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    match = re.search(rf"^{re.escape(target)}\s*:(?!=)[^\n]*\n((?:\t[^\n]*\n?)*)", text, flags=re.MULTILINE)
    assert match, f"no `{target}` target in the Makefile"
    return match.group(1)


def test_make_benchmark_runs_every_cpu_benchmark_and_the_readme_says_what_it_leaves_out():
    ran = set(re.findall(r"benchmarks/(\w+)\.py", make_recipe("benchmark")))
    scripts = {p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")}
    left_out = {name for name in scripts if name.removesuffix(".py") not in ran}
    gpu_only = {name for name in scripts if name.startswith("gpu_")}
    by_hand = {"browser_times.py", "hub_sizing.py"}  # they drive chromium (and hub_sizing a hub): run by hand
    unlisted = left_out - gpu_only - by_hand
    assert left_out == gpu_only | by_hand, f"`make benchmark` leaves out {unlisted}"
    row = next(line for line in README.splitlines() if line.startswith("| `benchmarks/` |"))
    listed = listed_names("`make benchmark` runs every CPU one")
    assert set(listed) == ran, f"the README's list of what `make benchmark` runs differs: {set(listed) ^ ran}"
    missing = [name for name in left_out if f"`{name.removesuffix('.py')}`" not in row and f"`{name}`" not in row]
    assert not missing, f"the README's benchmarks row does not say that `make benchmark` leaves out {missing}"


# ---------------------------------------------------------------- (e) the supported-platform table

# Each row of the README's table, as the machine labkit/torch_build.py would see (system, CPU, NVIDIA driver, a
# local +cpu wheel pip is configured with)
PLATFORM_ROWS = {
    "Linux x86_64, no NVIDIA GPU": ("Linux", "x86_64", False, False),
    "Linux x86_64, no NVIDIA GPU, pip configured with a local `+cpu` wheel": ("Linux", "x86_64", False, True),
    "Linux x86_64 with an NVIDIA driver": ("Linux", "x86_64", True, False),
    "macOS (arm64)": ("Darwin", "arm64", False, False),
}


def platform_table() -> dict[str, list[str]]:
    """The supported-platform table: first cell → the other cells."""
    start = README.find("| Platform | What `make lab` installs |")
    assert start >= 0, "the README has no supported-platform table"
    rows = {}
    for line in README[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_the_platform_table_names_linux_macos_and_windows():
    assert set(PLATFORM_ROWS) <= set(platform_table())
    assert {"Windows via WSL2", "Windows, native"} <= set(platform_table())


@pytest.mark.parametrize("row", sorted(PLATFORM_ROWS))
def test_each_platform_row_says_what_the_install_picks(row):
    from labkit.torch_build import Machine, choose

    system, arch, nvidia, local_wheel = PLATFORM_ROWS[row]
    (version,) = re.findall(r"^TORCH_VERSION\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    wheels = (f"torch-{version}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",) if local_wheel else ()
    args = " ".join(choose(version, Machine(system, arch, nvidia, "cp311", wheels)).args)
    said = re.findall(r"`(torch==[^`]+)`", platform_table()[row][0])
    assert said == [args], f"the README says {said} for {row!r}; labkit/torch_build.py picks {args!r}"


def test_wsl2_is_linux_and_its_nvidia_marker_is_the_one_the_install_reads():
    from labkit.torch_build import NVIDIA_MARKERS

    (marker,) = re.findall(r"`(/usr/lib/wsl/[^`]+)`", platform_table()["Windows via WSL2"][0])
    assert marker in NVIDIA_MARKERS and "as Linux" in platform_table()["Windows via WSL2"][0]


def test_the_doctor_paragraph_states_the_doctors_slow_threshold():
    from labkit.doctor import REFERENCE_RESULTS, SLOW_RATIO

    start = README.find("To check a machine before a session, run `.venv/bin/labkit doctor`")
    paragraph = README[start:README.find("\n\n", start)]
    assert start >= 0 and f"above {SLOW_RATIO:g}×" in paragraph and f"`benchmarks/results/{REFERENCE_RESULTS}.jsonl`" \
        in paragraph


def test_the_readme_states_the_dashboards_cadence_as_the_code_sets_it():
    from labkit.widgets.dashboard import EVERY_S, RunDashboard

    prose = " ".join(README.split())  # the sentence as read, whatever its line breaks
    assert f"a dashboard rewrites its headline every {EVERY_S:g} s" in prose
    assert "redraws a live sketch of loss, throughput, MFU and communication" in prose
    assert f"every {EVERY_S:g} s when a step has ended since" in prose and RunDashboard().live == "sketch"
