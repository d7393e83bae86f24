"""A pid file names a worker by pid *and* start time: a reused pid never gets the worker's signal."""
import os
import signal
import subprocess

import pytest

from labkit.launcher import (Run, WorkerProcess, is_running, kill_rank, process_start_time, read_pid_file,
                             remove_pid_file, write_pid_file)


@pytest.fixture
def sleepers():
    """Live processes that are not workers; every one is ended after the test."""
    started = []

    def start() -> subprocess.Popen:
        started.append(subprocess.Popen(["sleep", "600"]))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def as_worker(proc: subprocess.Popen) -> WorkerProcess:
    return WorkerProcess(proc.pid, process_start_time(proc.pid))


def impostor(proc: subprocess.Popen) -> WorkerProcess:
    """What a stale pid file looks like once its pid went to ``proc``: same pid, another start time."""
    return WorkerProcess(proc.pid, process_start_time(proc.pid) - 1)


def killed(proc: subprocess.Popen) -> bool:
    try:
        return proc.wait(timeout=10) == -signal.SIGKILL
    except subprocess.TimeoutExpired:
        return False


def test_a_worker_records_its_pid_and_start_time_and_the_pid_file_stays_readable(tmp_path):
    pid_file = write_pid_file(tmp_path / "pids", 3)
    assert pid_file == tmp_path / "pids" / "rank3.pid" and int(pid_file.read_text()) == os.getpid()
    me = read_pid_file(pid_file)
    assert me == (os.getpid(), process_start_time(os.getpid())) and is_running(me)
    assert sorted(p.name for p in (tmp_path / "pids").iterdir()) == ["rank3.pid", "rank3.start"]
    remove_pid_file(pid_file)
    assert list((tmp_path / "pids").iterdir()) == []


def test_start_time_tells_a_process_from_a_later_one_with_its_pid(sleepers):
    proc = sleepers()
    assert is_running(as_worker(proc))
    assert not is_running(impostor(proc)) and not is_running(WorkerProcess(proc.pid, None))


def test_cleanup_kills_the_workers_and_spares_a_process_that_reused_a_pid(tmp_path, sleepers):
    pids = tmp_path / "run" / "pids"
    worker, stranger, old_format = sleepers(), sleepers(), sleepers()
    write_pid_file(pids, 0, as_worker(worker))
    write_pid_file(pids, 1, impostor(stranger))
    (pids / "rank2.pid").write_text(str(old_format.pid))  # no start time: cannot be shown to be the worker
    run = Run(tmp_path / "run", None, 3)
    assert run.worker_pids == {worker.pid, stranger.pid, old_format.pid}
    run.stop()
    assert killed(worker)
    assert stranger.poll() is None and old_format.poll() is None


def test_kill_rank_refuses_a_stale_pid_file_and_kills_the_real_worker(tmp_path, sleepers):
    pids = tmp_path / "pids"
    worker, stranger = sleepers(), sleepers()
    write_pid_file(pids, 0, as_worker(worker))
    write_pid_file(pids, 1, impostor(stranger))
    with pytest.raises(ValueError, match="not signalled"):
        kill_rank(tmp_path, 1)
    assert stranger.poll() is None and not (tmp_path / "faults.jsonl").exists()  # nothing recorded either
    assert kill_rank(tmp_path, 0) == worker.pid and killed(worker)
    assert stranger.poll() is None
