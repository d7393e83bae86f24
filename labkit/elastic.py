"""Elastic shrink: a run that loses a node for good continues on the smaller world from its newest checkpoint.

:func:`lose_a_node` starts two torchrun agents, one worker each, with elastic membership (``--nnodes 1:2``) on a c10d
rendezvous that node 0 hosts, and returns an :class:`ElasticRun`: a :class:`labkit.launcher.Run`, so a
``RunDashboard`` follows it like any run. Once the run has logged ``kill_after`` steps, node 1 — its agent and its
worker — is SIGKILLed and never comes back (recorded in ``faults.jsonl`` first, so its recovery can be measured).
Node 0's worker fails on its next collective; its agent restarts it (``fault.max_restarts``); the rendezvous, which
needs at least one node, closes with the one left once the lost one has missed its heartbeats
(:data:`KEEP_ALIVE_MISSES` of :data:`KEEP_ALIVE_S`) and ``last_call_s`` has passed without another; the new worker
resumes from the newest checkpoint, saved by 2 ranks and loaded by 1 (:mod:`labkit.fault.reshard`: the same global
batch, twice the gradient accumulation). Its ``resume`` event says ``saved_world_size 2, world_size 1, resharded:
true``, and the dashboard's title shows the drop (``2 → 1``). :func:`shrink_report` reads what happened from the
run's files, :func:`shrink_text` says it.

Like :func:`labkit.launcher.launch`, nothing outlives its owner: each agent watches the process that started it
(``python -m labkit.elastic`` wraps torchrun) and ends its worker when that process dies; ``stop()`` ends both.
This module sits above the launcher (as :mod:`labkit.soak` does): ``labkit.fault`` never imports it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Union

from labkit.config import Config, ConfigError
from labkit.launcher import (Run, WorkerProcess, free_port, is_running, prepare_run, read_pid_file, signal_worker,
                             worker_threads_env)

NODES = 2  # the run starts on 2 nodes of one worker each and may go on with 1
LOST_NODE = 1  # the node lost for good: node 0 hosts the rendezvous store, which must outlive the loss
LAST_CALL_S = 10  # once one node has joined, the rendezvous waits this long for another (torch's last_call_timeout):
# at the start both agents start together, so the first group has both even when the machine is slow to start them;
# after the loss it is what the shrink waits before going on alone
KEEP_ALIVE_S, KEEP_ALIVE_MISSES = 1, 3  # a node whose heartbeat is this many beats late is dead to the rendezvous:
# until then the lost node still counts as a member and the next round cannot start (torch's default: 5 s × 3)


def shrink_problems(cfg: Config, kill_after: int) -> list[str]:
    """Why ``cfg`` cannot lose a node after ``kill_after`` steps and continue ([] if it can); the world-size checks
    (:func:`labkit.validation.validate` at 2 and at 1) come on top, in :func:`check_shrink`."""
    problems = []
    steps, every = cfg.run.steps, cfg.fault.checkpoint_every
    if not 0 < kill_after < steps - 1:
        problems.append(f"kill_after={kill_after}: the node must be lost after step 0 and before the last steps "
                        f"(run.steps={steps}): choose 1 to {steps - 2}")
    if not isinstance(every, int) or every < 1 or every >= kill_after:
        problems.append(f"fault.checkpoint_every={every!r}: a checkpoint must be saved, and a step logged after it, "
                        f"before the node is lost (an integer from 1 to kill_after - 1 = {kill_after - 1}), or the "
                        f"smaller world starts from step 0")
    if cfg.fault.max_restarts < 1:
        problems.append("fault.max_restarts=0: node 0's agent must be allowed to restart its worker once")
    return problems


def check_shrink(cfg: Config, kill_after: int) -> None:
    """Raise :class:`ConfigError` naming every problem before any process starts: the shrink's own
    (:func:`shrink_problems`) and the config's at world 2 and at world 1 (the global batch must split over both)."""
    from labkit.validation import validate

    problems = shrink_problems(cfg, kill_after)
    for world in (NODES, 1):
        try:
            validate(cfg, nproc=1, nnodes=world)
        except ConfigError as error:
            problems += [f"at world size {world}: {p}" for p in error.problems]
    if problems:
        raise ConfigError(problems)


def agent_command(config: Path, run_dir: Path, node: int, port: int, max_restarts: int,
                  last_call_s: int = LAST_CALL_S) -> list[str]:
    """The command of node ``node``'s agent: torchrun (wrapped by this module's ``main``), one worker, elastic
    membership 1 to :data:`NODES` on a c10d rendezvous at 127.0.0.1:``port`` that node 0 hosts."""
    conf = (f"is_host={'true' if node == 0 else 'false'},last_call_timeout={int(last_call_s)},"
            f"keep_alive_interval={KEEP_ALIVE_S},keep_alive_max_attempt={KEEP_ALIVE_MISSES}")
    return [sys.executable, "-m", "labkit.elastic", "--nnodes", f"1:{NODES}", "--nproc-per-node", "1",
            "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", run_dir.name, "--rdzv-conf", conf, "--local-addr", "127.0.0.1", "--monitor-interval", "0.1",
            "-m", "labkit", "train", str(config), "--run-dir", str(run_dir)]


def lose_a_node(cfg: Config, kill_after: int, run_dir: Union[str, Path, None] = None,
                last_call_s: int = LAST_CALL_S) -> "ElasticRun":
    """Start the run on two nodes and lose node 1 for good after ``kill_after`` steps (the module's docstring).
    Returns at once; ``wait()`` or a dashboard's ``follow`` waits for the end."""
    check_shrink(cfg, kill_after)
    run_dir = prepare_run(cfg, NODES, run_dir)
    note_nodes(run_dir)
    port = free_port()
    env = {**os.environ, **worker_threads_env(cfg, 1), "LABKIT_PARENT_PID": str(os.getpid()),
           "LABKIT_PROGRESS": "0", "PYTHONUNBUFFERED": "1"}
    nodes = []
    for node in range(NODES):
        with open(run_dir / f"node{node}.log", "ab") as log:
            nodes.append(subprocess.Popen(
                agent_command(run_dir / "config.json", run_dir, node, port, cfg.fault.max_restarts, last_call_s),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True))
    return ElasticRun(run_dir, nodes, kill_after)


def note_nodes(run_dir: Path) -> None:
    """``launch.json`` says how the run was laid out: :data:`NODES` elastic nodes of one process each."""
    path = run_dir / "launch.json"
    info = json.loads(path.read_text())
    path.write_text(json.dumps({**info, "nnodes": f"1:{NODES}", "nproc_per_node": 1}) + "\n")


class ElasticRun(Run):
    """A run on two elastic nodes (``process``: node 0's agent, whose exit ends the run) that loses node 1 for good
    once ``kill_after`` steps are logged; ``lost`` is that fault's record once it happened."""

    def __init__(self, run_dir: Path, nodes: list[subprocess.Popen], kill_after: int, poll_s: float = 0.05):
        super().__init__(run_dir, nodes[0], nproc=len(nodes))
        self.nodes = nodes
        self.lost: Optional[dict] = None
        self._loser = threading.Thread(target=self._lose_node_after, args=(kill_after, poll_s), daemon=True,
                                       name="labkit-elastic-loss")
        self._loser.start()

    def _lose_node_after(self, steps: int, poll_s: float) -> None:
        from labkit.metrics.events import read_events

        offset, logged = 0, 0
        while self.process.poll() is None and self.nodes[LOST_NODE].poll() is None:
            events, offset = read_events(self.run_dir / "events.jsonl", offset)
            logged += sum(e.get("type") == "step" for e in events)
            if logged >= steps:
                self.lose_node(LOST_NODE)
                return
            time.sleep(poll_s)

    def lose_node(self, node: int = LOST_NODE) -> dict:
        """SIGKILL node ``node``'s agent and worker (its whole process group), for good; returns the fault's record
        (kind ``kill``, the rank its worker had, the step it stopped)."""
        from labkit.fault.inject import record_fault
        from labkit.fault.recovery import last_step_seen

        agent = self.nodes[node]
        workers = node_workers(self.run_dir, agent.pid)
        last = last_step_seen(self.run_dir)
        self.lost = record_fault(self.run_dir, "kill", next(iter(workers), None), 0 if last is None else last + 1,
                                 node=node, pid=agent.pid, for_good=True)
        for worker in workers.values():  # in a session of its own: not in the agent's process group
            signal_worker(worker, signal.SIGKILL)
        end_node(agent, grace_s=0)
        return self.lost

    def wait(self, timeout: Optional[float] = None) -> str:
        """Until node 0's agent exits (the run's end); then the other node, had it not been lost, is ended too."""
        status = super().wait(timeout)
        for node in self.nodes[1:]:
            end_node(node, grace_s=10)
        self._loser.join(1)
        return status

    def stop(self, grace_s: float = 10.0) -> str:
        for node in self.nodes[1:]:
            end_node(node, grace_s=0)
        return super().stop(grace_s)


def end_node(agent: subprocess.Popen, grace_s: float) -> None:
    """Wait up to ``grace_s`` for an agent to exit, then SIGKILL its process group (its worker with it)."""
    if agent.poll() is None and grace_s > 0:
        try:
            agent.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    if agent.poll() is None:
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def node_workers(run_dir: Path, agent_pid: int) -> dict[int, WorkerProcess]:
    """Rank → the live worker (``pids/rankN.pid``) that is a child of process ``agent_pid``."""
    workers = {}
    for pid_file in sorted((Path(run_dir) / "pids").glob("rank*.pid")):
        try:
            worker = read_pid_file(pid_file)
        except (OSError, ValueError):
            continue
        if is_running(worker) and parent_pid(worker.pid) == agent_pid:
            workers[int(pid_file.stem[len("rank"):])] = worker
    return workers


def parent_pid(pid: int) -> Optional[int]:
    """The parent of process ``pid`` (Linux's ``/proc``), None if it is gone or unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after the name (which may hold spaces): state, then the ppid


# ---------------------------------------------------------------- what happened, from the run's files

def shrink_report(run) -> dict:
    """The shrink, from the run's events and faults: the world size of each attempt, where the node was lost and the
    run resumed, from a checkpoint saved by how many ranks, the steps done again, the seconds from the loss to the
    first step on the smaller world, and the end."""
    from labkit.metrics.events import read_events

    events, _ = read_events(Path(run.run_dir) / "events.jsonl")
    faults, _ = read_events(Path(run.run_dir) / "faults.jsonl")
    return shrink_facts(events, faults)


def shrink_facts(events: list[dict], faults: list[dict]) -> dict:
    """:func:`shrink_report` of these events and fault records (``loss_rel_diff``: the largest relative difference
    between a step's loss on the smaller world and its loss before the loss of the node, over the steps done again)."""
    from labkit.fault.recovery import match_recoveries

    resume = next((e for e in events if e.get("type") == "resume"), {})
    lost = next(iter(match_recoveries(faults, events)), {})
    steps = [e["step"] for e in events if e.get("type") == "step"]
    end = next((e for e in reversed(events) if e.get("type") == "end"), {})
    start = next((e for e in events if e.get("type") == "start"), {})
    before = {e["step"]: e["loss"] for e in events if e.get("type") == "step" and e["time"] < resume.get("time", 0)}
    again = [(before[e["step"]], e["loss"]) for e in events if e.get("type") == "step"
             and e["time"] > resume.get("time", float("inf")) and e["step"] in before]
    return {"world_sizes": [e.get("world_size") for e in events if e.get("type") == "start"],
            "steps_again": len(again),
            "loss_rel_diff": max((abs(b / a - 1) for a, b in again if a), default=None),
            "lost_rank": lost.get("rank"), "lost_at_step": lost.get("step"),
            "resumed_at_step": resume.get("next_step"), "saved_world_size": resume.get("saved_world_size"),
            "world_size": resume.get("world_size"), "resharded": resume.get("resharded"),
            "steps_recomputed": lost.get("steps_recomputed"), "detected_s": lost.get("detected_s"),
            "recovery_s": lost.get("recovery_s"), "last_step": steps[-1] if steps else None,
            "steps": start.get("steps"), "status": end.get("status")}


def shrink_text(facts: dict) -> str:
    """What :func:`shrink_facts` found, in sentences (or what did not happen)."""
    sizes = " → ".join(str(s) for s in facts["world_sizes"]) or "none"
    if facts["lost_at_step"] is None:
        return f"no node was lost (world sizes {sizes}; the run {facts['status'] or 'has not ended'})"
    lines = [f"node 1 (rank {facts['lost_rank']}) lost for good at step {facts['lost_at_step']}; world size of each "
             f"attempt: {sizes}"]
    if facts["resumed_at_step"] is None:
        lines.append("no resume on record: the run did not continue")
    else:
        how = "resharded" if facts["resharded"] else "not resharded"
        lines.append(f"resumed at step {facts['resumed_at_step']} from the checkpoint saved by "
                     f"{facts['saved_world_size']} rank(s), loaded by {facts['world_size']} ({how}); "
                     f"{facts['steps_recomputed']} step(s) done again")
    if facts["steps_again"]:
        within = ("bit for bit" if facts["loss_rel_diff"] == 0 else f"within {facts['loss_rel_diff']:.1e} (relative: "
                  "the same sums in another order)")
        lines.append(f"the {facts['steps_again']} step(s) done again on {facts['world_size']} rank(s) have the losses "
                     f"they had on {facts['saved_world_size']}, {within}")
    if facts["recovery_s"] is not None:
        seen = "" if facts["detected_s"] is None else f"seen by the survivor after {facts['detected_s']:.2f} s, "
        lines.append(f"{seen}training again {facts['recovery_s']:.1f} s after the loss")
    done = "n/a" if facts["last_step"] is None else facts["last_step"] + 1
    lines.append(f"the run {facts['status'] or 'has not ended'}: {done}/{facts['steps']} steps")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    """torchrun, ended (SIGTERM: its agent ends its worker) when the process that started it dies."""
    from torch.distributed.run import main as torchrun

    from labkit.launcher import watch_parent_from_env

    watch_parent_from_env()
    torchrun(argv)


if __name__ == "__main__":
    main()
