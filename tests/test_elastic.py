"""labkit.elastic without processes: a shrink that cannot work is refused before anything starts, the agents'
command, which worker belongs to which agent, and what the run's files say happened. (The run itself, two torchrun
agents losing one: tests/fault/test_elastic_shrink.py.)"""
import os

import pytest

from helpers import tiny_config
from labkit.config import ConfigError
from labkit.elastic import agent_command, check_shrink, lose_a_node, node_workers, parent_pid, shrink_facts, shrink_text
from labkit.launcher import write_pid_file

GOOD = {"run.steps": 20, "fault.checkpoint_every": 5, "fault.max_restarts": 1}


@pytest.mark.parametrize("overrides, kill_after, says", [
    ({}, 0, "kill_after=0: the node must be lost after step 0"),
    ({}, 19, "choose 1 to 18"),
    ({"fault.checkpoint_every": 0}, 10, "fault.checkpoint_every=0: a checkpoint must be saved, and a step"),
    ({"fault.checkpoint_every": 12}, 10, "fault.checkpoint_every=12"),
    ({"fault.checkpoint_every": 10}, 10, "an integer from 1 to kill_after - 1 = 9"),
    ({"fault.max_restarts": 0}, 10, "fault.max_restarts=0"),
    ({"data.batch_size": 6, "data.micro_batch_size": 2}, 10, "at world size 2: "),
])
def test_a_shrink_that_cannot_work_is_refused_before_any_process_starts(tmp_path, overrides, kill_after, says):
    cfg = tiny_config(**{**GOOD, **overrides})
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        lose_a_node(cfg, kill_after=kill_after, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing written, nothing started


def test_a_shrink_that_can_work_passes_every_check():
    check_shrink(tiny_config(**GOOD), kill_after=10)  # the global batch of 8 splits over 2 ranks and over 1
    check_shrink(tiny_config(**GOOD), kill_after=6)  # the first checkpoint is saved after step 4, step 5 logged after


def test_each_agent_runs_torchrun_with_elastic_membership_on_node_0s_rendezvous(tmp_path):
    run_dir = tmp_path / "shrink-1"
    host, other = (agent_command(tmp_path / "config.json", run_dir, node, 29512, max_restarts=1, last_call_s=7)
                   for node in (0, 1))
    assert host[1:3] == ["-m", "labkit.elastic"]  # torchrun, wrapped: it ends when its starter dies
    for cmd, is_host in ((host, "true"), (other, "false")):
        assert cmd[cmd.index("--nnodes") + 1] == "1:2" and cmd[cmd.index("--nproc-per-node") + 1] == "1"
        assert cmd[cmd.index("--rdzv-endpoint") + 1] == "127.0.0.1:29512"
        assert cmd[cmd.index("--rdzv-id") + 1] == "shrink-1" and cmd[cmd.index("--max-restarts") + 1] == "1"
        assert cmd[cmd.index("--rdzv-conf") + 1] == (f"is_host={is_host},last_call_timeout=7,keep_alive_interval=1,"
                                                     "keep_alive_max_attempt=3")  # a lost node is dead after 3 s
        assert cmd[-6:] == ["-m", "labkit", "train", str(tmp_path / "config.json"), "--run-dir", str(run_dir)]


def test_a_worker_is_found_under_the_agent_that_started_it(tmp_path):
    assert parent_pid(os.getpid()) == os.getppid()
    write_pid_file(tmp_path / "pids", 1)  # this process, as rank 1's worker; its parent plays the agent
    (worker,) = node_workers(tmp_path, os.getppid()).values()
    assert list(node_workers(tmp_path, os.getppid())) == [1] and worker.pid == os.getpid()
    assert node_workers(tmp_path, os.getpid()) == {}  # not a child of itself


def shrink_events() -> tuple[list[dict], list[dict]]:
    """Two ranks train steps 0-11 (a checkpoint after step 9); node 1 is lost at t=11.5, recorded at step 11 (step 11
    still lands, at t=12: the loss stopped step 12); the survivor sees it at 12.3; one rank resumes at step 10 at t=25
    and trains to step 19."""
    events = [{"type": "start", "time": 0.0, "world_size": 2, "steps": 20},
              *({"type": "step", "time": 1.0 + i, "step": i, "loss": 3.0 - 0.1 * i} for i in range(12)),
              {"type": "start", "time": 24.0, "world_size": 1, "steps": 20},
              {"type": "resume", "time": 25.0, "next_step": 10, "saved_world_size": 2, "world_size": 1,
               "resharded": True},
              *({"type": "step", "time": 26.0 + i, "step": 10 + i,
                 "loss": 3.0 - 0.1 * (10 + i) + (2e-8 if i == 1 else 0)} for i in range(10)),
              {"type": "end", "time": 40.0, "status": "finished"}]
    faults = [{"type": "fault", "time": 11.5, "kind": "kill", "rank": 1, "step": 11, "node": 1},
              {"type": "detected", "time": 12.3, "rank": 0}]
    return events, faults


def test_the_report_reads_the_drop_the_resume_and_the_recovery_from_the_files():
    facts = shrink_facts(*shrink_events())
    assert facts["world_sizes"] == [2, 1] and facts["resharded"] is True
    assert (facts["saved_world_size"], facts["world_size"]) == (2, 1)
    assert facts["lost_rank"] == 1 and facts["lost_at_step"] == 12 and facts["resumed_at_step"] == 10
    assert facts["steps_recomputed"] == 2 and facts["steps_again"] == 2  # steps 10 and 11, on 2 ranks then on 1
    assert facts["loss_rel_diff"] == pytest.approx(2e-8 / (3.0 - 1.1), rel=1e-3)
    assert facts["detected_s"] == pytest.approx(0.8) and facts["recovery_s"] == pytest.approx(14.5)
    assert facts["last_step"] == 19 and facts["status"] == "finished"
    text = shrink_text(facts)
    for said in ("node 1 (rank 1) lost for good at step 12", "world size of each attempt: 2 → 1",
                 "resumed at step 10 from the checkpoint saved by 2 rank(s), loaded by 1 (resharded)",
                 "2 step(s) done again", "the 2 step(s) done again on 1 rank(s) have the losses they had on 2, "
                 "within 1.1e-08", "seen by the survivor after 0.80 s", "training again 14.5 s after the loss",
                 "the run finished: 20/20 steps"):
        assert said in text, said


def test_equal_losses_are_said_to_be_equal_bit_for_bit():
    events, faults = shrink_events()
    events = [dict(e, loss=3.0 - 0.1 * e["step"]) if e["type"] == "step" else e for e in events]
    assert "have the losses they had on 2, bit for bit" in shrink_text(shrink_facts(events, faults))


def test_a_run_that_lost_no_node_says_so():
    events, _ = shrink_events()
    events = [e for e in events if e["type"] != "resume" and e.get("world_size") != 1]
    assert shrink_text(shrink_facts(events, [])) == "no node was lost (world sizes 2; the run finished)"
