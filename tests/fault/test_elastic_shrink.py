"""labkit.elastic.lose_a_node, the notebook's way to shrink: two torchrun agents of one worker each, node 1 lost for
good after some steps, the run continues on one rank from its newest checkpoint, resharded, and its files say so."""
import pytest

from helpers import tiny_config
from labkit.elastic import lose_a_node, shrink_report
from labkit.widgets.dashboard_panels import world_sizes

STEPS, EVERY, KILL_AFTER = 60, 10, 25


@pytest.mark.multiproc
def test_a_run_that_loses_a_node_continues_resharded_on_one_rank(tmp_path):
    cfg = tiny_config(**{"run.steps": STEPS, "fault.checkpoint_every": EVERY, "fault.max_restarts": 1,
                         "fault.keep_last": 3, "comm.timeout_s": 6.0, "run.threads_per_proc": 1})
    run = lose_a_node(cfg, kill_after=KILL_AFTER, run_dir=tmp_path / "run")
    try:
        status = run.wait(timeout=300)
    finally:
        run.stop()
    logs = "".join((tmp_path / "run" / f"node{n}.log").read_text(errors="replace")[-2000:] for n in (0, 1))
    assert status == "finished", logs
    assert run.lost is not None and run.lost["node"] == 1 and run.lost["rank"] in (0, 1), run.lost
    facts = shrink_report(run)
    assert facts["world_sizes"] == [2, 1] and facts["resharded"] is True, facts
    assert (facts["saved_world_size"], facts["world_size"]) == (2, 1)
    assert facts["resumed_at_step"] % EVERY == 0 and KILL_AFTER - EVERY <= facts["resumed_at_step"] <= KILL_AFTER + 1
    assert facts["lost_at_step"] >= KILL_AFTER and facts["recovery_s"] > 0
    assert facts["last_step"] == STEPS - 1 and facts["status"] == "finished"
    assert world_sizes(run.events()) == "2 → 1"  # the dashboard's title
    assert all(node.poll() is not None for node in run.nodes)  # no agent outlives the run
