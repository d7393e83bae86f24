"""The busy-core demo (notebook 09) ends with its owner, like every worker: no orphan keeps a core busy."""
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from labkit.launcher import _alive, cpu_hog

pytestmark = pytest.mark.multiproc  # every test here starts worker processes


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
    return int(utime) + int(stime)


def owner_with_a_hog(then: str) -> tuple[subprocess.Popen, int]:
    """A process that starts a hog, prints its pid, then runs ``then``; returns (owner, hog pid)."""
    script = textwrap.dedent(f"""
        import time
        from labkit.launcher import start_cpu_hog
        print(start_cpu_hog().pid, flush=True)
        {then}
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    return owner, int(owner.stdout.readline())


def test_the_hog_keeps_a_core_busy_and_stops_with_its_block():
    with cpu_hog() as hog:
        time.sleep(1.0)  # the interpreter starts, then spins
        before = cpu_ticks(hog.pid)
        time.sleep(1.0)
        assert cpu_ticks(hog.pid) - before > 5  # spinning, not sleeping (ticks are 1/100 s; the cores are shared)
    assert hog.returncode == -signal.SIGKILL


def test_the_hog_dies_with_an_owner_killed_by_sigkill():
    owner, hog = owner_with_a_hog("time.sleep(600)")
    assert _alive(hog)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert wait_for(lambda: not _alive(hog), timeout=5)


def test_the_hog_is_stopped_when_its_owner_exits_normally():
    owner, hog = owner_with_a_hog("time.sleep(0.5)")  # ends without stopping the hog: atexit must
    assert owner.wait(timeout=30) == 0
    assert wait_for(lambda: not _alive(hog), timeout=5)
