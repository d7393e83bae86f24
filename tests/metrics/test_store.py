"""The run store: runs recorded into SQLite, read back, compared, and watched for regressions."""
import json
import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from labkit.metrics.store import (SCHEMA_VERSION, RunStore, StoreError, default_store_path, downsample,
                                  format_compare, format_run, format_runs_table, sqlite_path)

CONFIG = {"model": {"n_layer": 2, "n_embd": 64}, "optim": {"lr": 0.01},
          "run": {"name": "quick", "steps": 10, "runs_dir": "runs"}}


def make_run(root: Path, run_id: str, *, created=1000.0, steps=10, speed=1000.0, lr=0.01, name="quick",
             summary=True, end=True) -> Path:
    """A small fake run directory written by hand."""
    run_dir = root / run_id
    run_dir.mkdir(parents=True)
    config = json.loads(json.dumps(CONFIG))
    config["optim"]["lr"], config["run"]["name"] = lr, name
    (run_dir / "config.json").write_text(json.dumps(config))
    events = [{"type": "start", "time": created, "world_size": 2, "backend": "gloo", "device": "cpu",
               "params": {"total": 1000}, "flops_per_token": 6000.0, "peak_tflops": 0.1, "strategy": "torch_ddp"}]
    events += [{"type": "step", "step": s, "loss": 3.0 - 0.01 * s, "lr": lr, "tokens_per_s": speed,
                "step_time_s": 0.01, "comm_frac": 0.1, "tflops": 0.01, "mfu": None if s == 0 else 0.25,
                "max_mem_bytes": 1 << 20} for s in range(steps)]
    events.append({"type": "eval", "step": steps - 1, "val_loss": 2.5})
    if end:
        events.append({"type": "end", "status": "finished"})
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({
            "status": "finished", "final_loss": 3.0 - 0.01 * (steps - 1), "val_loss": 2.5, "tokens_per_s": speed,
            "step_time_s": 0.01, "comm_frac": 0.1, "tflops": 0.01, "mfu": 0.25, "steps_completed": steps,
            "world_size": 2, "wall_time_s": 1.0}))
    return run_dir


@pytest.fixture
def store(tmp_path):
    with RunStore(tmp_path / "store.sqlite") as s:
        yield s


def test_record_list_get_series(store, tmp_path):
    store.record_run(make_run(tmp_path, "r1", created=1000.0))
    assert store.record_run(make_run(tmp_path, "r2", created=2000.0, lr=0.02)) == "r2"
    rows = store.list_runs()
    assert [r["id"] for r in rows] == ["r2", "r1"]  # newest first
    assert rows[0]["tokens_per_s"] == 1000.0 and rows[0]["steps"] == 10 and rows[0]["status"] == "finished"
    assert [r["id"] for r in store.list_runs(limit=1)] == ["r2"]
    run = store.get_run("r1")
    assert run["config"]["optim"]["lr"] == 0.01 and run["summary"]["mfu"] == 0.25
    assert run["hardware"]["world_size"] == 2 and run["hardware"]["backend"] == "gloo" and run["hardware"]["cpu_model"]
    assert run["labkit_version"] and run["name"] == "quick"
    steps, losses = store.series("r1", "loss")
    assert steps == list(range(10)) and losses[0] == pytest.approx(3.0)
    assert store.series("r1", "mfu")[1][0] is None
    assert store.series("r1", "val_loss") == ([9], [2.5])
    with pytest.raises(ValueError):
        store.series("r1", "nonsense")
    with pytest.raises(KeyError):
        store.get_run("missing")


def test_list_by_name_and_prefix(store, tmp_path):
    store.record_run(make_run(tmp_path, "alpha-1", name="alpha"))
    store.record_run(make_run(tmp_path, "beta-1", name="beta"))
    assert [r["id"] for r in store.list_runs(name="beta")] == ["beta-1"]
    assert store.get_run("alp")["id"] == "alpha-1"


def test_compare(store, tmp_path):
    store.record_run(make_run(tmp_path, "a", lr=0.01, speed=1000.0))
    store.record_run(make_run(tmp_path, "b", lr=0.02, speed=800.0))
    rows = {k: (va, vb) for k, va, vb in store.compare("a", "b")}
    assert rows["optim.lr"] == (0.01, 0.02)
    assert "model.n_layer" not in rows  # equal config keys are left out
    assert rows["tokens_per_s"] == (1000.0, 800.0) and rows["final_loss"][0] == rows["final_loss"][1]
    text = format_compare(store.compare("a", "b"), "a", "b")
    assert "optim.lr" in text and "25.0%" in text


def test_record_is_idempotent(store, tmp_path):
    run_dir = make_run(tmp_path, "r1")
    store.record_run(run_dir)
    store.record_run(run_dir)
    assert len(store.list_runs()) == 1
    assert len(store.series("r1", "loss")[0]) == 10


def test_downsampling_keeps_first_and_last(store, tmp_path):
    store.record_run(make_run(tmp_path, "long", steps=1234), max_steps=100)
    steps, _ = store.series("long", "loss")
    assert len(steps) <= 100 and steps[0] == 0 and steps[-1] == 1233 and steps == sorted(steps)
    assert downsample(list(range(5)), 10) == list(range(5))
    assert downsample(list(range(11)), 3) == [0, 5, 10]


def test_missing_summary_tolerated(store, tmp_path):
    store.record_run(make_run(tmp_path, "crashed", summary=False, end=False))
    store.record_run(make_run(tmp_path, "ended", summary=False))
    crashed, ended = store.get_run("crashed"), store.get_run("ended")
    assert crashed["status"] == "unknown" and crashed["summary"] == {}
    assert ended["status"] == "finished"
    assert ended["final_loss"] == pytest.approx(2.91) and ended["tokens_per_s"] == 1000.0 and ended["steps"] == 10


def test_torn_last_line_tolerated(store, tmp_path):
    run_dir = make_run(tmp_path, "torn", summary=False, end=False)
    with open(run_dir / "events.jsonl", "a") as f:
        f.write('{"type": "step", "step": 10, "lo')
    store.record_run(run_dir)
    assert store.series("torn", "loss")[0][-1] == 9


def test_not_a_run_dir(store, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        store.record_run(tmp_path / "empty")


def test_wal_mode_and_schema_version(tmp_path):
    path = tmp_path / "s.sqlite"
    RunStore(f"sqlite:///{path}").close()  # sqlite:/// + absolute path = sqlite:////abs
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "s.sqlite"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="upgrade labkit"):
        RunStore(path)


def test_urls_and_default_path(monkeypatch):
    assert sqlite_path("sqlite:///runs/x.sqlite") == "runs/x.sqlite"
    assert sqlite_path("sqlite:////abs/x.sqlite") == "/abs/x.sqlite"
    assert sqlite_path("runs/x.sqlite") == "runs/x.sqlite"
    with pytest.raises(ValueError, match="only sqlite"):
        RunStore("postgresql://user@host/db")
    monkeypatch.delenv("LABKIT_RUN_STORE", raising=False)
    assert default_store_path("elsewhere") == Path("elsewhere/labkit-runs.sqlite")
    monkeypatch.setenv("LABKIT_RUN_STORE", "/tmp/x.sqlite")
    assert default_store_path() == Path("/tmp/x.sqlite")


def _record_many(db: str, root: str, prefix: str, barrier) -> None:
    """Module level so that a 'spawn' child can import it."""
    barrier.wait(30)  # both start writing together
    with RunStore(db) as store:
        for i in range(10):
            store.record_run(Path(root) / f"{prefix}{i}")


@pytest.mark.multiproc
def test_two_processes_write_concurrently(tmp_path):
    for prefix in "ab":
        for i in range(10):
            make_run(tmp_path / "runs", f"{prefix}{i}", created=float(i))
    db = str(tmp_path / "store.sqlite")
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_record_many, args=(db, str(tmp_path / "runs"), p, barrier)) for p in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    with RunStore(db) as store:
        assert len(store.list_runs(limit=100)) == 20


def test_trend_and_regressions(store, tmp_path):
    for i, speed in enumerate([1000.0, 1020.0, 980.0, 700.0, 1010.0]):
        store.record_run(make_run(tmp_path, f"r{i}", created=1000.0 + i, speed=speed))
    store.record_run(make_run(tmp_path, "other", created=2000.0, speed=100.0, lr=0.5))  # another config
    trend = store.trend("r0")
    assert [r["id"] for r in trend] == ["r0", "r1", "r2", "r3", "r4"]
    assert [r["tokens_per_s"] for r in trend] == [1000.0, 1020.0, 980.0, 700.0, 1010.0]
    assert [r["id"] for r in store.trend({"optim": {"lr": 0.5}})] == ["other"]
    assert [r["id"] for r in store.trend({"optim.lr": 0.01})] == ["r0", "r1", "r2", "r3", "r4"]
    assert len(store.trend("quick")) == 6  # by name
    flagged = store.regressions(threshold=0.1)
    assert [r["id"] for r in flagged] == ["r3"]
    assert flagged[0]["baseline_tokens_per_s"] == 1000.0 and flagged[0]["drop"] == pytest.approx(0.3)
    assert store.regressions(threshold=0.5) == []


def test_formatting_shows_na(store, tmp_path):
    store.record_run(make_run(tmp_path, "crashed", summary=False, end=False))
    rows = store.list_runs()
    rows[0]["mfu"] = None
    table = format_runs_table(rows)
    assert "crashed" in table and "n/a" in table
    header, rule, row = table.splitlines()
    starts = [i for i, c in enumerate(rule) if c == "-" and (i == 0 or rule[i - 1] == " ")]
    assert [header.index(h) for h in header.split()] == starts  # columns aligned
    assert all(row[i - 1] == " " for i in starts[1:])
    text = format_run(store.get_run("crashed"))
    assert "n/a" in text and "optim.lr" in text and "cpu_model" in text
    assert format_runs_table([]) == "no runs recorded"
    assert "n/a" in format_compare([("mfu", None, 0.5)])


def test_records_a_real_run(store, tmp_path):
    from helpers import tiny_config
    from labkit.train import train

    real = tmp_path / "real-run"
    train(tiny_config(**{"run.steps": 3, "run.eval_every": 3}), real)  # a real (one-process) labkit run
    run_id = store.record_run(real)
    run = store.get_run(run_id)
    assert run["status"] == "finished" and run["steps"] == run["summary"]["steps_completed"]
    assert store.series(run_id, "loss")[0]


def test_migration_from_schema_1_keeps_old_runs_and_adds_alerts_and_restarts(tmp_path):
    from labkit.metrics.store import MIGRATIONS

    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0])  # the store as labkit with schema 1 left it, with one run
    conn.execute("INSERT INTO runs (id, name, created, status, config_json, summary_json, tokens_per_s) "
                 "VALUES ('old-run', 'quick', 1.0, 'finished', '{}', '{}', 900.0)")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    run_dir = make_run(tmp_path, "new-run")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(restarts=1, alerts=[{"step": 7, "kind": "straggler", "rank": 1, "message": "rank 1 is slow"}])
    (run_dir / "summary.json").write_text(json.dumps(summary))
    with RunStore(path) as store:
        old = store.get_run("old-run")
        assert old["tokens_per_s"] == 900.0 and old["restarts"] is None and old["alerts"] is None
        store.record_run(run_dir)
        new = store.get_run("new-run")
        assert (new["restarts"], new["alerts"]) == (1, 1)
        assert store.list_alerts("new-run") == [{"step": 7, "kind": "straggler", "rank": 1,
                                                 "message": "rank 1 is slow"}]
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3


def test_exposed_communication_round_trips_beside_the_share_in_flight(store, tmp_path):
    run_dir = make_run(tmp_path, "r1")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    for e in events:
        if e["type"] == "step":
            e["comm_exposed_frac"] = 0.02
    events[1].pop("comm_exposed_frac")  # an older event: derived from its seconds
    events[1]["comm_exposed_s"] = 0.003
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "comm_exposed_frac": 0.02}))
    store.record_run(run_dir)
    row = store.list_runs()[0]
    assert (row["comm_frac"], row["comm_exposed_frac"]) == (0.1, 0.02)
    assert store.get_run("r1")["comm_exposed_frac"] == 0.02
    steps, shares = store.series("r1", "comm_exposed_frac")
    assert steps == list(range(10)) and shares[0] == pytest.approx(0.3) and shares[1:] == [0.02] * 9
    assert store.series("r1", "comm_frac")[1] == [0.1] * 10  # the columns did not shift
    header = format_runs_table([row]).splitlines()[0]
    assert "comm-in-flight" in header and "comm-exposed" in header and "2.0%" in format_runs_table([row])
    compared = dict((k, (a, b)) for k, a, b in store.compare("r1", "r1"))
    assert compared["comm_exposed_frac"] == (0.02, 0.02) and "2.0%" in format_run(store.get_run("r1"))


def test_a_schema_2_store_opens_and_gains_the_exposed_column(tmp_path):
    from labkit.metrics.store import MIGRATIONS

    path = tmp_path / "schema2.sqlite"
    conn = sqlite3.connect(path)
    for script in MIGRATIONS[:2]:  # the store as labkit with schema 2 left it, with one run and its steps
        conn.executescript(script)
    conn.execute("INSERT INTO runs (id, name, created, status, config_json, summary_json, comm_frac) "
                 "VALUES ('old-run', 'quick', 1.0, 'finished', '{}', '{}', 0.4)")
    conn.execute("INSERT INTO steps VALUES ('old-run', 0, 2.0, 900.0, 0.1, 0.4, NULL, 0.01, 1048576)")
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()
    with RunStore(path) as store:
        old = store.get_run("old-run")
        assert old["comm_frac"] == 0.4 and old["comm_exposed_frac"] is None
        assert store.series("old-run", "comm_frac") == ([0], [0.4])
        assert store.series("old-run", "comm_exposed_frac") == ([0], [None])
        store.record_run(make_run(tmp_path, "new-run"))  # a new run writes into the migrated tables
        assert store.series("new-run", "comm_frac")[1] == [0.1] * 10
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_restarted_run_shows_each_step_once_as_the_attempt_that_carried_on_computed_it(store, tmp_path):
    from labkit.launcher import open_run
    from labkit.metrics.events import final_trajectory

    run_dir = make_run(tmp_path, "restarted", steps=8, summary=False, end=False)
    first_attempt = (run_dir / "events.jsonl").read_text()
    resumed = [{"type": "start", "time": 1001.0, "world_size": 2}, {"type": "resume", "next_step": 5}]
    resumed += [{"type": "step", "step": s, "loss": 10.0 + s} for s in range(5, 7)]  # still running
    (run_dir / "events.jsonl").write_text(first_attempt + "".join(json.dumps(e) + "\n" for e in resumed))
    live = open_run(run_dir).metrics
    assert live["step"] == [0, 1, 2, 3, 4, 5, 6] and live["loss"][5:] == [15.0, 16.0]  # step 7 was the lost attempt's
    with open(run_dir / "events.jsonl", "a") as f:
        f.write("".join(json.dumps({"type": "step", "step": s, "loss": 10.0 + s}) + "\n" for s in range(7, 10)))
    store.record_run(run_dir)
    steps, losses = store.series("restarted", "loss")
    assert steps == open_run(run_dir).metrics["step"] == list(range(10))
    assert (losses[:5] == pytest.approx([3.0 - 0.01 * s for s in range(5)])
            and losses[5:] == [10.0 + s for s in range(5, 10)])
    assert [e["step"] for e in final_trajectory([{"type": "step", "step": s} for s in (0, 1, 2, 1, 2, 0, 1)])] == [0, 1]
