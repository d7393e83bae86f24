"""Layer 3 on live runs: an injected straggler is detected, named and profiled; nothing is changed."""
import json
from pathlib import Path

import pytest

import labkit
from helpers import tiny_config
from labkit.config import ConfigError, validate

WATCHED = {"run.steps": 40, "model.n_embd": 64, "data.batch_size": 16, "data.micro_batch_size": 8, "metrics.anomaly.window": 12, "metrics.anomaly.min_baseline": 6,
           "metrics.anomaly.warmup_steps": 4, "metrics.anomaly.cooldown_steps": 50, "metrics.profile_steps": 2,
           "metrics.max_diagnoses": 4}


def _alerts(run):
    return [e for e in run.events() if e["type"] == "alert"]


def test_straggler_is_named_profiled_and_left_alone():
    run = labkit.launch(tiny_config(**{**WATCHED, "fault.inject": "straggler", "fault.inject_rank": 1,
                                       "fault.inject_step": 20, "fault.straggler_ms": 80.0}), nproc=2)
    assert run.wait(timeout=300) == "finished", run.log()[-3000:]
    stragglers = [a for a in _alerts(run) if a["kind"] == "straggler"]
    assert len(stragglers) == 1, _alerts(run)  # one incident, one alert
    alert = stragglers[0]
    assert alert["rank"] == 1 and 20 <= alert["step"] <= 25 and "rank 1" in alert["message"]
    traces = [Path(t) for t in alert["traces"]]
    assert [t.name for t in traces] == [f"{traces[0].name.split('-')[0]}-rank1.json",
                                        f"{traces[0].name.split('-')[0]}-rank0.json"]  # straggler beside a healthy rank
    for trace in traces:
        assert json.loads(trace.read_text())["traceEvents"], trace
        text = trace.with_suffix(".txt").read_text()
        assert "compute" in text and "communication" in text and "Self CPU" in text
    assert "straggler" in [a["kind"] for a in run.summary["alerts"]]
    # never a silent change: the run trained the configuration it was given, to the end
    assert run.metrics["step"][-1] == 39 and run.summary["restarts"] == 0


def test_clean_run_false_alarm_rate_is_reported():
    run = labkit.launch(tiny_config(**WATCHED), nproc=2)
    assert run.wait(timeout=300) == "finished", run.log()[-3000:]
    alerts = _alerts(run)
    judged = 40 - WATCHED["metrics.anomaly.warmup_steps"]
    print(f"clean 2-process run: {len(alerts)} alert(s) in {judged} judged steps "
          f"(false-alarm rate {len(alerts) / judged:.1%}): {[a['message'] for a in alerts]}")
    assert not [a for a in alerts if a["kind"] in ("straggler", "loss_nonfinite", "loss_spike")]


def test_bad_thresholds_are_refused_before_workers_start():
    with pytest.raises(ConfigError, match="metrics.anomaly.throughput_drop=1.5"):
        validate(tiny_config(**{"metrics.anomaly.throughput_drop": 1.5}), nproc=2)
    with pytest.raises(ConfigError, match="metrics.profile_steps"):
        validate(tiny_config(**{"metrics.profile_steps": -1}), nproc=1)
