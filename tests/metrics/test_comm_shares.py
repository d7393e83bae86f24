"""Communication in flight and exposed: both in every step event, the summary, the CLI's closing line."""
import json
from types import SimpleNamespace

import pytest
import torch

from labkit.metrics.communication import comm_text, exposed_frac
from labkit.metrics.diagnosis import shared_view
from labkit.metrics.steps import SUMMARY_MEANS, StepTally, gather_ranks, step_event

GROUP_OF_ONE = SimpleNamespace(world_size=1, torch_device=torch.device("cpu"),
                               grid=SimpleNamespace(size=lambda axis: 1, coord=lambda axis: 0))


def stats(comm_s=0.06, exposed_s=0.01, step_time_s=0.1):
    """One rank's step measurements, as ``Trainer.step`` returns them (only what the event reads)."""
    return {"loss": 2.0, "step_time_s": step_time_s, "grad_norm": 1.0, "data_s": 0.0, "compute_s": 0.05,
            "comm_s": comm_s, "comm_exposed_s": exposed_s, "comm_bytes": 1024, "comm_calls": 2, "raw_bytes": None,
            "compression_ratio": None, "compress_s": 0.0, "max_mem_bytes": 1 << 20, "param_bytes": 0,
            "grad_bytes": 0, "optimizer_bytes": 0, "activation_bytes": None, "timeline": {}, "skipped": False}


def event_of(step=0, **kw):
    s = stats(**kw)
    return step_event(step, 1e-3, s, gather_ranks(s, GROUP_OF_ONE), 1000, 6e3, None, GROUP_OF_ONE)


def test_a_step_event_has_the_share_in_flight_and_the_exposed_share():
    e = event_of(comm_s=0.06, exposed_s=0.01)
    assert e["comm_frac"] == pytest.approx(0.6) and e["comm_exposed_frac"] == pytest.approx(0.1)
    assert e["rank_comm_exposed_s"] == [pytest.approx(0.01)]  # gathered: every rank judges the same numbers
    unmeasured = event_of(exposed_s=None)  # fsdp2: the host cannot see what backward hid
    assert unmeasured["comm_exposed_frac"] is None and unmeasured["rank_comm_exposed_s"] == [None]
    assert json.loads(json.dumps(unmeasured))["comm_exposed_frac"] is None


def test_the_summary_averages_both_shares():
    assert {"comm_frac", "comm_exposed_frac", "comm_exposed_s"} <= set(SUMMARY_MEANS)
    for n in (6, 30):  # a short run (summarised from its head) and a long one (running sums)
        tally = StepTally()
        for step in range(n):
            tally.add(event_of(step, comm_s=0.06, exposed_s=0.01))
        means = tally.means()
        assert means["comm_frac"] == pytest.approx(0.6) and means["comm_exposed_frac"] == pytest.approx(0.1)
    tally = StepTally()
    for step in range(6):
        tally.add(event_of(step, exposed_s=None))
    assert tally.means()["comm_exposed_frac"] is None and tally.means()["comm_frac"] == pytest.approx(0.6)


def test_exposed_share_of_an_older_event_is_derived_from_its_seconds():
    assert exposed_frac({"comm_exposed_s": 0.02, "step_time_s": 0.1}) == pytest.approx(0.2)
    assert exposed_frac({"comm_exposed_s": None, "step_time_s": 0.1}) is None
    assert exposed_frac({"comm_exposed_frac": 0.3, "comm_exposed_s": 0.0, "step_time_s": 0.1}) == 0.3
    assert comm_text(0.6, None) == "communication in flight 60.0% (exposed n/a)"


def test_every_rank_judges_the_same_exposed_share():
    event = {"step_time_s": 0.1, "comm_frac": 0.5, "comm_exposed_frac": 0.45,  # this rank's own view
             "rank_step_time_s": [0.1, 0.1], "rank_comm_s": [0.05, 0.07], "rank_comm_exposed_s": [0.01, 0.03]}
    view = shared_view(event)
    assert view["comm_frac"] == pytest.approx(0.6) and view["comm_exposed_frac"] == pytest.approx(0.2)
    assert shared_view({**event, "rank_comm_exposed_s": [0.01, None]})["comm_exposed_frac"] is None
    assert shared_view({k: v for k, v in event.items() if k != "rank_comm_exposed_s"})["comm_exposed_frac"] is None


def test_the_cli_closing_line_shows_in_flight_and_exposed(tmp_path, capsys):
    from labkit.cli import _print_summary

    (tmp_path / "summary.json").write_text(json.dumps({
        "status": "finished", "steps_completed": 10, "final_loss": 2.0, "tokens_per_s": 1000.0, "mfu": 0.2,
        "comm_frac": 0.6, "comm_exposed_frac": 0.05}))
    _print_summary(tmp_path)
    line = capsys.readouterr().err
    assert "communication in flight 60.0% (exposed 5.0%) of step time" in line, line
    (tmp_path / "summary.json").write_text(json.dumps({"status": "finished", "comm_frac": 0.6}))
    _print_summary(tmp_path)
    assert "communication in flight 60.0% (exposed n/a)" in capsys.readouterr().err
