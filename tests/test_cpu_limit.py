"""The cores labkit plans for honour a container's CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``) as well
as the affinity mask: on a 64-core hub that gives each user 2 CPUs, 2 workers get one thread each, not 32.

The cgroup trees here are fake directories (``tmp_path``) read through the same functions as the real
``/sys/fs/cgroup``."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from labkit import cpu
from labkit.cpu import cgroup_cpu_limit, usable_cores


def tree(root: Path, files: dict[str, str], proc: str) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "proc_cgroup").write_text(proc)
    return root / "proc_cgroup"


def test_cgroup_v2_quota_of_the_process_group(tmp_path):
    proc = tree(tmp_path, {"hub/user1/cpu.max": "200000 100000\n", "hub/cpu.max": "max 100000\n"}, "0::/hub/user1\n")
    assert cgroup_cpu_limit(tmp_path, proc) == 2.0


def test_a_parents_tighter_quota_binds_its_children(tmp_path):
    proc = tree(tmp_path, {"hub/user1/cpu.max": "400000 100000", "hub/cpu.max": "150000 100000"}, "0::/hub/user1")
    assert cgroup_cpu_limit(tmp_path, proc) == 1.5


def test_cgroup_v1_cfs_quota(tmp_path):
    proc = tree(tmp_path, {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
                           "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"},
                "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_limit(tmp_path, proc) == 0.5


def test_a_namespaced_container_reads_its_own_root(tmp_path):
    """Inside a container with its own cgroup namespace, /proc/self/cgroup says "/" and the root is its group."""
    assert cgroup_cpu_limit(tmp_path, tree(tmp_path, {"cpu.max": "300000 100000"}, "0::/\n")) == 3.0


@pytest.mark.parametrize("files,proc", [
    ({"cpu.max": "max 100000"}, "0::/"),  # v2 without a limit
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, "3:cpu:/"),  # v1 without a limit
    ({}, "0::/user.slice"),  # no controller files at all (macOS, WSL without cgroups)
    ({"cpu.max": "garbage"}, "0::/"),  # unreadable: no limit rather than a crash
])
def test_no_quota_is_no_limit(tmp_path, files, proc):
    assert cgroup_cpu_limit(tmp_path, tree(tmp_path, files, proc)) is None


def test_no_proc_file_is_no_limit(tmp_path):
    assert cgroup_cpu_limit(tmp_path, tmp_path / "missing") is None


def test_usable_cores_is_the_affinity_cut_to_the_quota_rounded_down():
    assert usable_cores(affinity=64, limit=2.0) == 2
    assert usable_cores(affinity=64, limit=2.7) == 2  # a third thread would wait for the next period
    assert usable_cores(affinity=64, limit=0.5) == 1  # never none
    assert usable_cores(affinity=2, limit=8.0) == 2  # the affinity binds first
    assert usable_cores(affinity=64, limit=None) == 64


def test_each_worker_takes_its_share_of_the_quota_not_of_the_cores(monkeypatch):
    """A 64-core hub, a 2-CPU limit, 2 workers: one thread each (it was 32 each before the quota counted)."""
    from labkit.config import load_config
    from labkit.distributed import threads_per_proc
    from labkit.doctor import check_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(cpu, "cgroup_cpu_limit", lambda *a, **k: 2.0)
    assert threads_per_proc(load_config(None, {}), 2) == 1
    check = check_cores()
    assert check.data == {"cores": 2} and "2 usable of 64 (limited by a control-group CPU quota of 2)" in check.found


# ---------------------------------------------------------------- a process's CPU seconds and its tree, from /proc

def fake_process(proc, pid: int, ppid: int, cmdline: str, utime: int = 0, stime: int = 0) -> None:
    """/proc/PID/stat and cmdline as the kernel writes them (the name in parentheses may hold spaces and ')')."""
    (proc / str(pid)).mkdir(parents=True)
    rest = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 10
    (proc / str(pid) / "stat").write_text(f"{pid} (a name) with) {' '.join(rest)}\n")
    (proc / str(pid) / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")


def test_a_processs_cpu_seconds_and_tree_are_read_from_proc(tmp_path):
    from labkit.cpu import process_cpu_seconds, process_tree

    tick = os.sysconf("SC_CLK_TCK")
    fake_process(tmp_path, 10, 1, "jupyter-lab --port 1", utime=3 * tick, stime=tick)
    fake_process(tmp_path, 11, 10, "python -m ipykernel_launcher -f k.json")
    fake_process(tmp_path, 12, 11, "python -m labkit.worker")
    fake_process(tmp_path, 20, 1, "chromium --type=renderer")
    (tmp_path / "self").mkdir()  # not a process: skipped
    assert process_cpu_seconds(10, tmp_path) == pytest.approx(4.0)
    assert process_cpu_seconds(99, tmp_path) is None  # gone
    assert process_tree(10, tmp_path) == {10: "jupyter-lab --port 1", 11: "python -m ipykernel_launcher -f k.json",
                                          12: "python -m labkit.worker"}
    assert process_tree(99, tmp_path) == {}
