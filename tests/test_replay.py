"""Recorded runs played back (labkit.recordings): released in order and on time, ending as recorded, written to a
run directory of their own; the shipped recordings are whole; a dashboard follows a replay as it follows a run."""
import gzip
import json
from pathlib import Path

import pytest

import labkit
from labkit.metrics.events import read_events
from labkit.recordings import RECORDINGS_DIR, RecordedRun, events_file, load_events, replay, shipped_names

SHIPPED = ("quickstart", "fault_restart")
SUMMARY = {"status": "finished", "steps_completed": 3, "final_loss": 1.5}


class FakeClock:
    """A clock that only moves when told to (or when a replay sleeps on it)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def write_recording(folder: Path, times=(100.0, 101.0, 103.0, 104.0), faults=(), gz=False) -> Path:
    """A tiny recording: a start, steps, an end at ``times`` (seconds), and its summary."""
    folder.mkdir(parents=True, exist_ok=True)
    types = ["start"] + ["step"] * (len(times) - 2) + ["end"]
    events = [{"type": t, "time": at, **({"step": i - 1, "loss": 2.0 - i / 10} if t == "step" else {})}
              for i, (t, at) in enumerate(zip(types, times))]
    events[-1]["status"] = "finished"
    text = "".join(json.dumps(e) + "\n" for e in events)
    if gz:
        (folder / "events.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    else:
        (folder / "events.jsonl").write_text(text)
    (folder / "summary.json").write_text(json.dumps(SUMMARY))
    (folder / "config.json").write_text("{}")
    (folder / "meta.json").write_text(json.dumps({"date": "2026-01-02T03:04:05+00:00", "nproc": 2,
                                                  "machine": {"cpu": "Test CPU", "cores": 2, "gpu": None}}))
    if faults:
        (folder / "faults.jsonl").write_text("".join(json.dumps(f) + "\n" for f in faults))
    return folder


def on_disk(run) -> list[dict]:
    return read_events(run.run_dir / "events.jsonl")[0]


# ---------------------------------------------------------------- playing back

def test_events_are_released_in_order_by_their_own_time_scaled_by_speed(tmp_path):
    clock = FakeClock()
    run = RecordedRun(write_recording(tmp_path / "rec"), speed=2, clock=clock, sleep=clock.sleep)
    seen = []
    for now, expected in [(0.0, 1), (0.49, 1), (0.5, 2), (1.49, 2), (1.5, 3), (1.99, 3)]:
        clock.now = now
        assert len(run.events()) == expected, now
        assert run.status == "running" and run.summary is None
        assert not (run.run_dir / "summary.json").exists()
        seen.append(len(on_disk(run)))
    assert seen == sorted(seen) and seen[-1] == 3  # the file the painter reads grows with the replay
    clock.now = 2.0
    assert run.status == "finished"
    assert run.summary == SUMMARY
    assert json.loads((run.run_dir / "summary.json").read_text()) == SUMMARY
    assert [e["time"] for e in run.events()] == [100.0, 101.0, 103.0, 104.0]
    assert on_disk(run) == run.events()


def test_wait_sleeps_until_the_last_event_then_says_the_recorded_status(tmp_path):
    clock = FakeClock()
    run = replay(write_recording(tmp_path / "rec"), speed=4, clock=clock, sleep=clock.sleep)
    assert run.wait(timeout=0.5) == "running" and clock.now == pytest.approx(0.5)
    assert run.wait() == "finished"
    assert clock.now == pytest.approx(1.0, abs=0.01)  # 4 recorded seconds at ×4


def test_speed_none_releases_everything_at_once(tmp_path):
    run = replay(write_recording(tmp_path / "rec", gz=True), speed=None)
    assert run.status == "finished" and len(run.events()) == 4 and len(on_disk(run)) == 4
    assert "all at once" in run.label and "Test CPU (2 cores), 2026-01-02" in run.label


def test_stop_ends_the_replay_where_it_is(tmp_path):
    clock = FakeClock()
    run = replay(write_recording(tmp_path / "rec"), speed=1, clock=clock, sleep=clock.sleep)
    clock.now = 1.0
    assert run.stop() == "stopped"
    clock.now = 100.0
    assert run.status == "stopped" and len(run.events()) == 2 and run.summary is None
    assert run.wait() == "stopped"


def test_metrics_are_columns_of_the_released_steps(tmp_path):
    clock = FakeClock()
    run = replay(write_recording(tmp_path / "rec"), speed=1, clock=clock, sleep=clock.sleep)
    assert run.metrics["step"] == [] and "loss" in run.metrics  # before any step: a live run's empty columns
    clock.now = 3.0
    assert run.metrics["step"] == [0, 1] and run.metrics["loss"] == [1.9, 1.8]


def test_a_fault_record_goes_out_with_the_first_event_after_it(tmp_path):
    clock = FakeClock()
    fault = {"type": "fault", "time": 102.0, "kind": "kill", "rank": 1, "step": 1}
    run = replay(write_recording(tmp_path / "rec", faults=[fault]), speed=1, clock=clock, sleep=clock.sleep)
    clock.now = 1.5
    run.events()
    assert not (run.run_dir / "faults.jsonl").exists()
    clock.now = 3.0
    run.events()
    assert read_events(run.run_dir / "faults.jsonl")[0] == [fault]


def test_the_shipped_files_are_never_written(tmp_path):
    folder = write_recording(tmp_path / "rec")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    run = replay(folder, speed=None)
    assert run.run_dir != folder and not run.run_dir.is_relative_to(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    run.cleanup()
    assert not run.run_dir.exists()


# ---------------------------------------------------------------- clear errors

def test_a_missing_recording_names_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="no recording at .*nowhere.*shipped recordings: .*quickstart"):
        replay(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'empty'}.*events"):
        replay(tmp_path / "empty")


def test_a_garbled_recording_names_the_file_and_line(tmp_path):
    folder = write_recording(tmp_path / "rec")
    lines = (folder / "events.jsonl").read_text().splitlines()
    (folder / "events.jsonl").write_text("\n".join([lines[0], '{"type": "step", "ti', *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=f"{folder / 'events.jsonl'}:2: not a JSON event"):
        replay(folder)
    (folder / "events.jsonl").write_text('{"type": "step"}\n')
    with pytest.raises(ValueError, match=":1: an event needs a type and a numeric time"):
        replay(folder)


def test_a_broken_gzip_or_summary_is_named(tmp_path):
    folder = write_recording(tmp_path / "rec", gz=True)
    (folder / "events.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=f"{folder / 'events.jsonl.gz'}: unreadable"):
        replay(folder)
    folder = write_recording(tmp_path / "rec2")
    (folder / "summary.json").write_text("{oops")
    with pytest.raises(ValueError, match=f"{folder / 'summary.json'}: not valid JSON"):
        replay(folder)
    (folder / "summary.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"{folder / 'summary.json'}: missing"):
        replay(folder)


def test_speed_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="positive"):
        replay(write_recording(tmp_path / "rec"), speed=0)


# ---------------------------------------------------------------- the shipped recordings

@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_recording_is_whole_small_and_says_where_it_ran(name):
    folder = RECORDINGS_DIR / name
    assert name in shipped_names()
    assert sum(p.stat().st_size for p in folder.iterdir()) < 300_000
    assert not (folder / "checkpoints").exists()
    events = load_events(events_file(folder))
    types = [e["type"] for e in events]
    assert types[0] == "start" and types[-1] == "end" and types.count("step") >= 100
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "finished" == events[-1]["status"]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["machine"]["cpu"] and meta["date"][:4].isdigit()
    assert (folder / "config.json").exists()


def test_the_quickstart_recording_is_notebook_00s_full_size_run():
    config = labkit.load_config(RECORDINGS_DIR / "quickstart" / "config.json")
    shipped = labkit.load_config(Path(__file__).parents[1] / "configs" / "quickstart.yaml")
    assert config.model == shipped.model and config.run.steps == shipped.run.steps  # full size, not quick mode
    summary = json.loads((RECORDINGS_DIR / "quickstart" / "summary.json").read_text())
    assert summary["steps_completed"] == config.run.steps and summary["world_size"] == 2


def test_the_fault_recording_was_killed_and_restarted_from_a_checkpoint():
    from labkit.fault.recovery import recovery_report

    run = replay("fault_restart", speed=None)
    types = [e["type"] for e in run.events()]
    assert "resume" in types and types.count("start") == 2 and "checkpoint" in types
    (fault,) = recovery_report(run.run_dir)
    assert fault["kind"] == "kill" and fault["rank"] == 1 and fault["recovery_s"] is not None
    assert fault["resumed_at_step"] <= fault["step"]
    assert run.summary["restarts"] == 1


# ---------------------------------------------------------------- dashboards

def test_a_dashboard_says_it_shows_a_recording(tmp_path):
    """The ended replay's picture is drawn here (no painter process): the headline and title name the recording."""
    from labkit.widgets import RunDashboard

    run = replay("quickstart", speed=None)
    dashboard = RunDashboard()
    dashboard.update(run, final=True)
    assert dashboard.text.startswith(f"{run.label} · step 600/600 — finished")
    assert dashboard.png and dashboard.png.startswith(b"\x89PNG")


@pytest.mark.multiproc
def test_a_dashboard_follows_a_replay_unchanged():
    """The same follow loop as for a live run; the painter process draws from the replay's own directory."""
    from labkit.widgets import RunDashboard
    from labkit.widgets.dashboard import FIGURE
    from labkit.widgets.painter import painter

    clock = FakeClock()
    partial = replay("fault_restart", speed=1, clock=clock, sleep=clock.sleep)
    clock.now = 5.0
    assert partial.status == "running" and 0 < len(partial.events()) < len(replay("fault_restart", None).events())
    png, *_ = painter().submit(FIGURE, partial.run_dir / "events.jsonl", partial.label).result(timeout=120)
    assert png.startswith(b"\x89PNG")

    run = replay("fault_restart", speed=8)
    dashboard = RunDashboard()
    summary = dashboard.follow(run, every_s=0.25)
    assert summary == json.loads((RECORDINGS_DIR / "fault_restart" / "summary.json").read_text())
    assert not dashboard.drawing_stats()["errors"] and dashboard.png.startswith(b"\x89PNG")
    assert "replay ×8" in dashboard.text and "— finished" in dashboard.text


def test_a_labs_own_records_appear_when_the_replay_ends(tmp_path):
    folder = write_recording(tmp_path / "rec")
    (folder / "cap").mkdir()
    (folder / "cap" / "worker1.jsonl").write_text('{"step": 1, "t_end": 0.1}\n')
    clock = FakeClock()
    run = replay(folder, speed=1, clock=clock, sleep=clock.sleep)
    assert not (run.run_dir / "cap").exists()  # not before the end: the summary and the records come together
    clock.now = 4.0
    assert run.status == "finished"
    assert (run.run_dir / "cap" / "worker1.jsonl").read_text() == '{"step": 1, "t_end": 0.1}\n'
