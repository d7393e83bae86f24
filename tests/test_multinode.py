"""Multi-node on an existing engine: torchrun's elastic agents meeting through the c10d rendezvous.

Two torchrun agents on loopback play two "nodes" (``--nnodes 2``, one worker each: world 2 on 2 cores),
both running ``labkit train CONFIG --run-dir RUN`` into the same run directory, as on a cluster with a
shared filesystem. What a cluster would show, seen here:

* the c10d rendezvous hands out the global ranks: ``--node-rank`` does not choose them (the agent with
  ``--node-rank 1`` may host rank 0), so the tests never assume which agent holds which rank;
* only rank 0 writes ``events.jsonl`` and ``summary.json``; the other ranks' numbers arrive in it as
  per-rank lists (``rank_step_time_s`` ...).
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

TORCHRUN = Path(sys.executable).with_name("torchrun")
RUN_TIMEOUT_S = 300  # a two-node run takes ~20 s here; a busy shared machine can take several times that


# ---------------------------------------------------------------- starting "nodes"

def _config(path: Path, **dotted) -> Path:
    from labkit.config import save_config
    from helpers import tiny_config

    # one thread per worker, as the one-node run's auto setting gives 2 workers on 2 cores: same arithmetic
    save_config(tiny_config(**{"run.threads_per_proc": 1, **dotted}), path)
    return path


def _start_nodes(config: Path, run_dir: Path, nnodes: int, nproc_per_node: int, max_restarts: int = 0,
                 entry: tuple = ("-m", "labkit")) -> list:
    """``nnodes`` torchrun agents on loopback, one rendezvous (c10d, same id and endpoint), logs beside RUN."""
    from labkit.launcher import free_port

    port = free_port()
    nodes = []
    for node in range(nnodes):
        cmd = [str(TORCHRUN), "--nnodes", str(nnodes), "--node-rank", str(node),
               "--nproc-per-node", str(nproc_per_node), "--max-restarts", str(max_restarts),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_dir.name,
               "--local-addr", "127.0.0.1", "--monitor-interval", "0.1",
               *entry, "train", str(config), "--run-dir", str(run_dir)]
        log = open(run_dir.parent / f"{run_dir.name}-node{node}.log", "wb")
        nodes.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", "LABKIT_PROGRESS": "0"},
                                      start_new_session=True))
        log.close()
    return nodes


def _logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(run_dir.parent.glob(f"{run_dir.name}-node*.log")))


def _end(nodes: list) -> None:
    """Whatever happened, no agent (nor, through its session, any worker) outlives the test."""
    for node in nodes:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def _wait_nodes(nodes: list, run_dir: Path, timeout: float = RUN_TIMEOUT_S) -> list:
    deadline = time.time() + timeout
    try:
        for node in nodes:
            try:
                node.wait(max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the nodes did not finish within {timeout:.0f} s\n{_logs(run_dir)}")
    finally:
        _end(nodes)
    return [node.returncode for node in nodes]


def _run_nodes(config: Path, run_dir: Path, nnodes: int, nproc_per_node: int, **kwargs) -> None:
    codes = _wait_nodes(_start_nodes(config, run_dir, nnodes, nproc_per_node, **kwargs), run_dir)
    assert codes == [0] * nnodes, _logs(run_dir)
    _assert_nothing_left(run_dir)


def _assert_nothing_left(run_dir: Path) -> None:
    from helpers import processes_mentioning

    deadline = time.time() + 10  # a SIGKILLed worker can take a moment to be reaped on a busy machine
    while processes_mentioning(str(run_dir)) and time.time() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(run_dir)) == []


def _events(run_dir: Path, kind: str = None) -> list:
    events = [json.loads(line) for line in open(run_dir / "events.jsonl")]
    return [e for e in events if kind is None or e["type"] == kind]


def _final(run_dir: Path) -> dict:
    return torch.load(run_dir / "final_model.pt", weights_only=True)


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- two nodes = one node of the same world size

@pytest.mark.multiproc
def test_two_nodes_train_exactly_like_one_node_of_the_same_world_size(tmp_path):
    """Two agents x 1 worker and one agent x 2 workers form the same world of 2 (gloo, 1 thread per worker):
    the same shards, the same all-reduce of two gradients (a + b is b + a, bitwise), so the per-step losses
    and the final model are bit-for-bit equal, not just close."""
    config = _config(tmp_path / "config.json", **{"run.steps": 8})
    two, one = tmp_path / "two-nodes", tmp_path / "one-node"
    t0 = time.time()
    _run_nodes(config, two, nnodes=2, nproc_per_node=1)
    _run_nodes(config, one, nnodes=1, nproc_per_node=2)
    print(f"two nodes and one node: {time.time() - t0:.1f} s")

    for run_dir in (two, one):
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
        (start,) = _events(run_dir, "start")
        assert start["world_size"] == 2 and start["backend"] == "gloo"
    losses = {d: [e["loss"] for e in _events(d, "step")] for d in (two, one)}
    assert len(losses[two]) == 8 and losses[two] == losses[one]  # bitwise: == on floats
    assert _bitwise_equal(_final(two), _final(one))

    # one writer: rank 0 alone wrote the log (one start, one end, each step once), with every rank's numbers
    assert [e["type"] for e in _events(two)].count("end") == 1
    assert [e["step"] for e in _events(two, "step")] == list(range(8))
    assert all(len(e["rank_step_time_s"]) == 2 for e in _events(two, "step"))
    assert list((two / "pids").glob("rank*.pid")) == []  # each worker removed its own pid file


# ---------------------------------------------------------------- a killed node's worker, restarted and rejoined

STEPS, EVERY, KILL_AFTER = 300, 25, 60  # 300 tiny steps take ~4 s: long enough to kill the worker mid-run
RESTARTING = {"run.steps": STEPS, "fault.checkpoint_every": EVERY, "fault.max_restarts": 1, "fault.keep_last": 3,
              "comm.timeout_s": 6.0}


@pytest.mark.multiproc
def test_a_killed_nodes_worker_restarts_and_rejoins_bit_for_bit(tmp_path):
    """SIGKILL rank 1's worker (``labkit kill RUN --rank 1``, through the shared run directory's pid files)
    mid-run: its agent restarts it, the other agent sees a node waiting in the c10d rendezvous and restarts
    its own worker, the new group of 2 resumes from the newest checkpoint and ends with the same model and
    loss curve, bit for bit, as an uninterrupted run.

    The new group forms because labkit's store namespace counts formations per rank, not the agent's own
    restart count (``labkit.distributed._store``): the healthy node's agent restarts its worker uncounted.
    """
    from labkit.launcher import _alive, kill_rank
    from labkit.metrics.events import final_trajectory

    config = _config(tmp_path / "config.json", **RESTARTING)
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    t0 = time.time()
    _run_nodes(config, clean, nnodes=2, nproc_per_node=1, max_restarts=1)

    nodes = _start_nodes(config, killed, nnodes=2, nproc_per_node=1, max_restarts=1)
    try:
        deadline = time.time() + RUN_TIMEOUT_S
        while time.time() < deadline and all(n.poll() is None for n in nodes):
            if (killed / "events.jsonl").exists() and len(_events(killed, "step")) >= KILL_AFTER:
                break
            time.sleep(0.05)
        assert all(n.poll() is None for n in nodes), _logs(killed)
        pid = kill_rank(killed, 1)
    except BaseException:
        _end(nodes)
        raise
    codes = _wait_nodes(nodes, killed)
    print(f"clean and killed two-node runs: {time.time() - t0:.1f} s")
    assert codes == [0, 0], _logs(killed)
    _assert_nothing_left(killed)
    assert not _alive(pid)

    summary = json.loads((killed / "summary.json").read_text())
    assert summary["status"] == "finished", _logs(killed)
    (fault,) = summary["faults"]
    assert fault["kind"] == "kill" and fault["rank"] == 1 and 0 <= fault["steps_recomputed"] <= EVERY
    assert 0 < fault["recovery_s"] < 120
    (resume,) = _events(killed, "resume")
    assert resume["next_step"] % EVERY == 0 and 0 < resume["next_step"] < STEPS
    assert len(_events(killed, "start")) == 2 and len(_events(killed, "attempt_end")) == 1
    assert _bitwise_equal(_final(killed), _final(clean))
    curve = {d: [(e["step"], e["loss"]) for e in final_trajectory(_events(d))] for d in (clean, killed)}
    assert curve[killed] == curve[clean] and len(curve[clean]) == STEPS
