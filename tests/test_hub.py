"""The hub's settings and seats (labkit/hub.py), without starting a hub: tests/browser/test_hub.py starts one."""
import json
from pathlib import Path

import pytest

from labkit.hub import (HubError, HubSettings, hub_settings, main, parse_memory, parse_users, prepare_home, seat_cores,
                        seat_env, seat_home)

ROOM = {"LABKIT_HUB_USERS": "ana, ben,chen", "LABKIT_HUB_PASSWORD": "a-room-password", "LABKIT_HUB_CPUS": "1"}


def test_sizes_are_read_in_binary_units_and_zero_means_no_cap():
    assert parse_memory("4G") == 4 * 2**30
    assert parse_memory("512M") == parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5g") == 3 * 2**29
    assert parse_memory("0") is None and parse_memory("none") is None
    with pytest.raises(HubError, match="4G or 512M"):
        parse_memory("lots")


def test_user_names_are_checked_and_deduplicated():
    assert parse_users("ana, ben ana\nchen") == ("ana", "ben", "chen")
    with pytest.raises(HubError, match="Bob"):
        parse_users("ana,Bob")
    with pytest.raises(HubError, match="names no user"):
        parse_users(" , ")


def test_the_room_settings_are_read_and_a_bad_one_is_refused_before_the_hub_starts(tmp_path):
    settings = hub_settings({**ROOM, "LABKIT_HUB_DIR": str(tmp_path), "LABKIT_QUICK": "1"})
    assert settings == HubSettings(("ana", "ben", "chen"), "a-room-password", 1, 4 * 2**30, tmp_path.resolve(), True)
    with pytest.raises(HubError, match="LABKIT_HUB_PASSWORD"):
        hub_settings({**ROOM, "LABKIT_HUB_PASSWORD": "short"})
    with pytest.raises(HubError, match="whole number"):
        hub_settings({**ROOM, "LABKIT_HUB_CPUS": "half"})
    with pytest.raises(HubError, match="lets the hub use"):
        hub_settings({**ROOM, "LABKIT_HUB_CPUS": "100000"})


def test_seats_take_consecutive_cores_and_share_one_only_when_every_core_has_a_seat():
    cores = [0, 1, 2, 3, 4, 5, 6, 7]
    assert [seat_cores(s, 2, cores) for s in range(5)] == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]]
    assert [seat_cores(s, 1, [0, 1]) for s in range(3)] == [[0], [1], [0]]
    assert seat_cores(1, 3, [0, 1, 2, 3]) == [0, 1, 3]  # wraps round
    with pytest.raises(HubError):
        seat_cores(0, 3, [0, 1])


def test_a_home_holds_a_copy_of_the_labs_that_a_second_login_does_not_overwrite(tmp_path):
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    for name in ("configs", "datasets", "benchmarks"):
        (repo / name).mkdir()
    (repo / "notebooks" / "00_quickstart.ipynb").write_text(json.dumps({"cells": []}))
    home = seat_home(tmp_path / "hub", "ana")
    notebooks = prepare_home(home, repo)
    assert notebooks == home / "notebooks" and (notebooks / "00_quickstart.ipynb").exists()
    assert (home / "configs").resolve() == repo / "configs"
    (notebooks / "00_quickstart.ipynb").write_text("ana's edits")
    prepare_home(home, repo)
    assert (notebooks / "00_quickstart.ipynb").read_text() == "ana's edits"


def test_each_seat_has_its_own_home_run_store_and_cache(tmp_path):
    settings = hub_settings({**ROOM, "LABKIT_HUB_DIR": str(tmp_path)})
    envs = [seat_env(settings, user) for user in settings.users]
    for key in ("HOME", "LABKIT_RUN_STORE", "LABKIT_CACHE_DIR", "LABKIT_HUB_SEAT"):
        assert len({env[key] for env in envs}) == 3, key
    assert envs[0]["LABKIT_RUN_STORE"] == str(tmp_path.resolve() / "users/ana/notebooks/runs/labkit-runs.sqlite")
    assert all(env["LABKIT_HUB_DIR"] == str(tmp_path.resolve()) for env in envs)
    assert "LABKIT_QUICK" not in envs[0]


def test_make_hub_stops_with_the_setting_to_fix_before_anything_starts(monkeypatch):
    monkeypatch.setenv("LABKIT_HUB_USERS", "ana")
    monkeypatch.delenv("LABKIT_HUB_PASSWORD", raising=False)
    with pytest.raises(SystemExit, match="LABKIT_HUB_PASSWORD"):
        main()


@pytest.mark.multiproc
def test_a_seat_process_runs_on_its_cores_and_cannot_allocate_past_its_data_limit():
    """The limits the spawner sets before a seat's server starts, on a plain Python process: what a seat's kernel
    and workers inherit."""
    import subprocess
    import sys

    from labkit.hub import apply_seat_limits, available_cores

    core = available_cores()[-1]
    code = ("import os\ntry:\n    b = bytearray(1536 * 2**20)\n    print('allocated')\nexcept MemoryError:\n"
            "    print('refused')\nprint(sorted(os.sched_getaffinity(0)))\n"
            "from labkit.cpu import usable_cores\nprint(usable_cores())")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                           preexec_fn=lambda: apply_seat_limits([core], 1024 * 2**20)).stdout.split("\n")
    assert shown[:3] == ["refused", f"[{core}]", "1"], shown


def test_the_readme_sizing_table_is_the_newest_measurement_rendered():
    from labkit.hub import SIZING_BEGIN, SIZING_END, sizing_table
    from labkit.results import latest, load_results

    records = load_results("hub_sizing")
    measured, estimate = latest(records, "hub_sizing"), latest(records, "hub_sizing_estimate")
    assert not measured["uncommitted_changes"] and [r["seats"] for r in measured["rows"]] == [1, 2, 3]
    assert [r["seats"] for r in estimate["rows"]] == [20, 50] and all(r["estimate"] for r in estimate["rows"])
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split(SIZING_BEGIN)[1].split(SIZING_END)[0].strip()
    assert block == sizing_table(measured, estimate)
