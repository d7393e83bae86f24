"""Live healing with torchft: two replica groups on a lighthouse at 127.0.0.1; one is SIGKILLed and restarted, and
rejoins with the live peer's weights while the other keeps stepping (labkit.fault.heal)."""
import pytest

from labkit.fault.heal import HealSpec, heal_run, recovery_split


def test_bad_spec_is_refused_before_any_process_starts(tmp_path):
    for bad, says in [(HealSpec(replicas=1), "at least 2 replica groups"), (HealSpec(victim=2), "not a replica"),
                      (HealSpec(kill_at=0), "kill_at")]:
        with pytest.raises(ValueError, match=says):
            heal_run(bad, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.multiproc
def test_killed_group_rejoins_with_the_live_peers_weights_while_the_other_keeps_stepping(tmp_path):
    pytest.importorskip("torchft", reason="torchft (the ft extra) is not installed")
    spec = HealSpec(replicas=2, victim=1, kill_at=6, solo_steps=3, steps_after=6, min_step_s=0.05)
    split = heal_run(spec, tmp_path, timeout_s=240)
    assert split["healed_equal_to_sender"]  # the weights it received are the live peer's, bit for bit
    assert split["healed_at_step"] > spec.kill_at  # the peer's current step, not the victim's old one
    assert split["final_equal"]  # and the two groups stepped on as one: equal, bit for bit, at the end
    assert split["healthy_steps_meanwhile"] >= spec.solo_steps  # the other group went on while it was gone
    assert split["healthy_steps_dropped"] <= 1  # at most the step the kill broke went uncommitted
    for part in ("detect_s", "respawn_s", "quorum_s", "transfer_s", "rejoin_s"):
        assert split[part] >= 0, (part, split)
    assert split["total_s"] == pytest.approx(split["respawn_s"] + split["quorum_s"] + split["transfer_s"]
                                             + split["rejoin_s"])


@pytest.mark.multiproc
def test_a_warm_standby_heals_while_the_healthy_group_commits_a_step_alone(tmp_path):
    """The replacement is up before the victim is missed: its heal runs in the quorum beside the healthy group's next
    step (torchft's asynchronous quorum), which commits without it; the step after, the two step as one."""
    pytest.importorskip("torchft", reason="torchft (the ft extra) is not installed")
    spec = HealSpec(replicas=2, victim=1, kill_at=6, solo_steps=0, steps_after=4, standby=True, min_step_s=0.05)
    split = heal_run(spec, tmp_path, timeout_s=240)
    assert split["healed_equal_to_sender"] and split["final_equal"]
    assert split["healthy_steps_meanwhile"] >= 1  # the healthy group did not wait for the heal


def test_recovery_split_reads_the_events():
    """The parts from a hand-written event log: the kill at t=10, the healthy group's failed step at 10.2, the new
    process up at 11, the transfer from 11.5 to 11.7, the first step with both groups at 11.9."""
    spec = HealSpec()
    ev = [{"type": "kill", "t": 10.0, "at": 10.0, "replica": None},
          {"type": "step", "t": 10.2, "replica": 0, "step": 9, "committed": False, "participants": 2},
          *({"type": "step", "t": 10.5 + 0.2 * i, "replica": 0, "step": 9 + i, "committed": True,
             "participants": 1} for i in range(4)),
          {"type": "send", "t": 11.45, "replica": 0, "step": 12, "digest": "ab"},
          {"type": "ready", "t": 11.0, "replica": 1, "life": 1, "params": 5},
          {"type": "recv", "t": 11.7, "began": 11.5, "replica": 1, "life": 1, "step": 12, "digest": "ab"},
          {"type": "step", "t": 11.9, "replica": 1, "life": 1, "step": 13, "committed": True, "participants": 2},
          {"type": "done", "t": 13.0, "replica": 0, "step": 20, "digest": "cd"},
          {"type": "done", "t": 13.0, "replica": 1, "life": 1, "step": 20, "digest": "cd"}]
    split = recovery_split(ev, spec)
    assert split["detect_s"] == pytest.approx(0.2) and split["respawn_s"] == pytest.approx(1.0)
    assert split["quorum_s"] == pytest.approx(0.5) and split["transfer_s"] == pytest.approx(0.2)
    assert split["rejoin_s"] == pytest.approx(0.2) and split["total_s"] == pytest.approx(1.9)
    assert split["healthy_steps_meanwhile"] == 4 and split["healthy_steps_dropped"] == 1
    assert split["healthy_longest_gap_s"] == pytest.approx(0.8)  # its last step alone (11.1) → the rejoin (11.9)
    assert split["healed_equal_to_sender"] and split["final_equal"]


@pytest.mark.multiproc
def test_local_sgd_loses_only_the_killed_groups_steps(tmp_path):
    """torchft's LocalSGD, weights averaged every 8 local steps: the victim is killed halfway between two syncs (4
    steps, at least 0.2 s, from the next: room for the driver's poll on a busy machine). The healthy group's syncs
    all commit (none of its local steps is thrown away); the victim loses its own steps since its last sync, and its
    new process rejoins at a sync with the live peer's weights."""
    pytest.importorskip("torchft", reason="torchft (the ft extra) is not installed")
    spec = HealSpec(replicas=2, victim=1, sync_every=8, kill_at=2, solo_steps=1, steps_after=2, min_step_s=0.05)
    split = heal_run(spec, tmp_path, timeout_s=240)
    assert split["healthy_steps_dropped"] == 0  # the kill fell between syncs: the healthy group lost nothing
    assert split["healthy_steps_meanwhile"] >= spec.solo_steps  # it synced on alone
    assert split["victim_local_steps_lost"] >= spec.sync_every // 2  # the victim's own steps since its last sync
    assert split["healed_equal_to_sender"] and split["healed_at_step"] > spec.kill_at
    assert split["final_equal"]
