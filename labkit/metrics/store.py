"""Run history: every finished run recorded in one SQLite file (layer 2 of monitoring).

Layer 1 (``events.jsonl``, the progress bar, a live dashboard) answers "how is *this* run
doing right now?" and then forgets. Questions about many runs need a memory:

* **Trends and regressions.** The same config, run every day, quietly getting 15% slower
  after a change to the code or the machine. Each run looks fine alone; only a history with
  the config, the git commit and the hardware of every run shows when it started.
* **Comparisons.** "What differs between the fast run and the slow one?" is a diff of two
  configs plus their metrics side by side.

SQLite needs no server and is one file next to the runs. WAL mode lets readers work while a
writer writes, and a busy timeout makes concurrent writers (several launches at once) wait
instead of failing. The schema carries a version so an old file can be migrated forward —
and a file written by a newer labkit is refused rather than misread. The store accepts a URL
(``sqlite:///runs/labkit-runs.sqlite``) so that a server database could be added later.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Union

from labkit.hardware import cpu_model
from labkit.metrics.communication import exposed_frac
from labkit.metrics.events import final_trajectory

STEP_KEYS = ("loss", "tokens_per_s", "step_time_s", "comm_frac", "comm_exposed_frac", "mfu", "tflops",
             "max_mem_bytes")
"""Per-step columns kept in the ``steps`` table (``series`` also knows ``val_loss``). Communication twice:
``comm_frac`` in flight (overlapped or not) and ``comm_exposed_frac`` exposed (what backward did not hide)."""
SUMMARY_METRICS = ("status", "steps_completed", "final_loss", "val_loss", "tokens_per_s", "step_time_s",
                   "comm_frac", "comm_exposed_frac", "tflops", "mfu", "max_mem_bytes", "world_size", "wall_time_s")
RUN_COLUMNS = ("final_loss", "val_loss", "tokens_per_s", "mfu", "comm_frac", "comm_exposed_frac", "steps",
               "world_size", "restarts", "alerts")
PERCENT = ("mfu", "comm_frac", "comm_exposed_frac")
"""Metrics shown as percentages."""

# MIGRATIONS[i] takes the schema from version i to i + 1; add new ones at the end, never edit old ones.
MIGRATIONS = ["""
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, run_dir TEXT, name TEXT, created REAL, status TEXT, config_json TEXT,
    config_hash TEXT, hardware_json TEXT, labkit_version TEXT, git_commit TEXT, summary_json TEXT,
    final_loss REAL, val_loss REAL, tokens_per_s REAL, mfu REAL, comm_frac REAL, steps INTEGER,
    world_size INTEGER);
CREATE INDEX IF NOT EXISTS runs_created ON runs (created);
CREATE INDEX IF NOT EXISTS runs_config_hash ON runs (config_hash);
CREATE TABLE IF NOT EXISTS steps (
    run_id TEXT, step INTEGER, loss REAL, tokens_per_s REAL, step_time_s REAL, comm_frac REAL,
    mfu REAL, tflops REAL, max_mem_bytes INTEGER, PRIMARY KEY (run_id, step));
CREATE TABLE IF NOT EXISTS evals (run_id TEXT, step INTEGER, val_loss REAL, PRIMARY KEY (run_id, step));
""", """
ALTER TABLE runs ADD COLUMN restarts INTEGER;
ALTER TABLE runs ADD COLUMN alerts INTEGER;
CREATE TABLE IF NOT EXISTS alerts (run_id TEXT, step INTEGER, kind TEXT, rank INTEGER, message TEXT);
CREATE INDEX IF NOT EXISTS alerts_run ON alerts (run_id);
""", """
ALTER TABLE runs ADD COLUMN comm_exposed_frac REAL;
ALTER TABLE steps ADD COLUMN comm_exposed_frac REAL;
"""]
SCHEMA_VERSION = len(MIGRATIONS)


class StoreError(RuntimeError):
    """The store file cannot be used by this version of labkit."""


def default_store_path(runs_dir: Union[str, Path] = "runs") -> Path:
    """``$LABKIT_RUN_STORE`` if set, else ``<runs_dir>/labkit-runs.sqlite``."""
    return Path(os.environ.get("LABKIT_RUN_STORE") or Path(runs_dir) / "labkit-runs.sqlite")


def sqlite_path(url_or_path: Union[str, Path]) -> str:
    """A filesystem path (or ``:memory:``) from a plain path or a ``sqlite:///path`` URL."""
    text = str(url_or_path)
    if "://" not in text:
        return text
    scheme, rest = text.split("://", 1)
    if scheme != "sqlite":
        raise ValueError(f"run store {text!r}: only sqlite is supported (sqlite:///path or a plain path); "
                         f"{scheme!r} databases are not shipped with labkit")
    if rest and not rest.startswith("/"):
        raise ValueError(f"run store {text!r}: write sqlite:///relative/path or sqlite:////absolute/path")
    return rest[1:] or ":memory:"  # sqlite:///rel → rel, sqlite:////abs → /abs, sqlite:// → in memory


def flatten(d: dict, prefix: str = "") -> dict:
    """``{"optim": {"lr": 0.01}}`` → ``{"optim.lr": 0.01}``."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_fingerprint(config: dict, world_size: Any = None, device: Any = None, backend: Any = None) -> str:
    """Hash of what decides throughput: the config minus its ``run`` section (name, steps, seed...),
    plus what "auto" resolved to (world size, device, backend)."""
    key = {"config": {k: v for k, v in config.items() if k != "run"}, "world_size": world_size,
           "device": device, "backend": backend}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]


def downsample(items: list, n: int) -> list:
    """At most ``n`` items: the first, the last and evenly spaced ones between."""
    if len(items) <= n:
        return list(items)
    if n < 2:
        return items[-1:] if n == 1 else []
    return [items[i] for i in sorted({round(k * (len(items) - 1) / (n - 1)) for k in range(n)})]


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_events(path: Path) -> list[dict]:
    """Events from a JSON-lines file, skipping a line cut short by a crash."""
    events = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return events
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _hardware(start: dict) -> dict:
    return {"cpu_model": cpu_model(), "gpu_name": start.get("gpu_name"), "peak_source": start.get("peak_source"),
            "torch_version": _version("torch"), "python": platform.python_version(),
            "platform": platform.platform(), "hostname": platform.node(), "world_size": start.get("world_size"),
            "backend": start.get("backend"), "device": start.get("device")}


def _metrics(summary: dict, start: dict, steps: list, evals: list) -> dict:
    """The denormalised columns: from the summary, or from the events when a run left none."""
    last = steps[-1][1] if steps else {}
    speeds = [e["tokens_per_s"] for _, e in steps if e.get("tokens_per_s") is not None]
    return {"final_loss": summary.get("final_loss", last.get("loss")),
            "val_loss": summary.get("val_loss", evals[-1][1].get("val_loss") if evals else None),
            "tokens_per_s": summary.get("tokens_per_s", statistics.mean(speeds) if speeds else None),
            "mfu": summary.get("mfu", last.get("mfu")), "comm_frac": summary.get("comm_frac", last.get("comm_frac")),
            "comm_exposed_frac": summary.get("comm_exposed_frac", last.get("comm_exposed_frac")),
            "steps": summary.get("steps_completed", len(steps)),
            "world_size": summary.get("world_size", start.get("world_size")),
            "restarts": summary.get("restarts"), "alerts": len(summary["alerts"]) if "alerts" in summary else None}


def read_run_dir(run_dir: Union[str, Path]) -> tuple[dict, list, list]:
    """``(runs row, [(step, step event)], [(step, eval event)])`` from a run directory's files."""
    run_dir = Path(run_dir).resolve()
    config, summary = _read_json(run_dir / "config.json"), _read_json(run_dir / "summary.json") or {}
    events = _read_events(run_dir / "events.jsonl")
    if config is None and not events:
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json, no events.jsonl)")
    config = config or {}
    start = next((e for e in events if e.get("type") == "start"), {})
    end = next((e for e in reversed(events) if e.get("type") == "end"), {})
    # events written before comm_exposed_frac existed: derived from comm_exposed_s
    steps = [(e["step"], {**e, "comm_exposed_frac": exposed_frac(e)}) for e in final_trajectory(events)]
    evals = sorted({e["step"]: e for e in events if e.get("type") == "eval" and "step" in e}.items())
    launch = _read_json(run_dir / "launch.json") or {}
    run = {"id": run_dir.name, "run_dir": str(run_dir), "name": config.get("run", {}).get("name") or run_dir.name,
           "created": launch.get("created") or start.get("time") or run_dir.stat().st_mtime,
           "status": summary.get("status") or end.get("status") or "unknown", "config_json": json.dumps(config),
           "config_hash": config_fingerprint(config, start.get("world_size"), start.get("device"),
                                             start.get("backend")),
           "hardware_json": json.dumps(_hardware(start)), "labkit_version": _version("labkit"),
           "git_commit": _git_commit(), "summary_json": json.dumps(summary), **_metrics(summary, start, steps, evals)}
    return run, steps, evals


class RunStore:
    """The history of runs in one SQLite file. ``RunStore()`` opens :func:`default_store_path`."""

    def __init__(self, url_or_path: Union[str, Path, None] = None, timeout_s: float = 30.0):
        self.path = sqlite_path(url_or_path if url_or_path is not None else default_store_path())
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
        try:
            self._enable_wal(timeout_s)
            self._migrate()
        except BaseException:
            self.conn.close()
            raise

    def _enable_wal(self, timeout_s: float) -> None:
        """Switch to WAL; on a brand-new file two processes may race here, and SQLite answers
        "locked" at once instead of waiting (no busy handler for this pragma), so retry."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.conn.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "RunStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _transaction(self):
        self.conn.execute("BEGIN IMMEDIATE")  # take the write lock now: waits (busy_timeout) for other writers
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def _migrate(self) -> None:
        with self._transaction() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(f"run store {self.path} has schema version {version}, but this labkit knows "
                                 f"only up to {SCHEMA_VERSION}: upgrade labkit or use another store file")
            for v in range(version, SCHEMA_VERSION):
                for statement in filter(str.strip, MIGRATIONS[v].split(";")):
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def record_run(self, run_dir: Union[str, Path], max_steps: int = 500) -> str:
        """Record (insert or replace) one run directory; returns its id, the directory's name."""
        run, steps, evals = read_run_dir(run_dir)
        with self._transaction() as conn:
            conn.execute(f"INSERT OR REPLACE INTO runs ({', '.join(run)}) VALUES ({', '.join('?' * len(run))})",
                         list(run.values()))
            conn.execute("DELETE FROM steps WHERE run_id = ?", (run["id"],))
            conn.execute("DELETE FROM evals WHERE run_id = ?", (run["id"],))
            conn.executemany(f"INSERT INTO steps (run_id, step, {', '.join(STEP_KEYS)}) "
                             f"VALUES (?, ?, {', '.join('?' * len(STEP_KEYS))})",
                             [(run["id"], s, *(e.get(k) for k in STEP_KEYS)) for s, e in downsample(steps, max_steps)])
            conn.executemany("INSERT INTO evals VALUES (?, ?, ?)",
                             [(run["id"], s, e.get("val_loss")) for s, e in evals])
            conn.execute("DELETE FROM alerts WHERE run_id = ?", (run["id"],))
            conn.executemany("INSERT INTO alerts VALUES (?, ?, ?, ?, ?)",
                             [(run["id"], a.get("step"), a.get("kind"), a.get("rank"), a.get("message"))
                              for a in json.loads(run["summary_json"]).get("alerts") or []])
        return run["id"]

    def record_all(self, runs_dir: Union[str, Path] = "runs") -> list[str]:
        """Record every run directory under ``runs_dir`` (e.g. runs made before the store existed)."""
        dirs = sorted(d for d in Path(runs_dir).iterdir() if (d / "events.jsonl").exists())
        return [self.record_run(d) for d in dirs]

    def list_runs(self, limit: int = 50, name: Optional[str] = None) -> list[dict]:
        """Newest first: id, name, created, status and the summary columns."""
        where, args = ("WHERE name = ?", [name]) if name else ("", [])
        rows = self.conn.execute(f"SELECT id, name, created, status, config_hash, {', '.join(RUN_COLUMNS)} FROM runs "
                                 f"{where} ORDER BY created DESC, id DESC LIMIT ?", [*args, limit])
        return [dict(r) for r in rows]

    def _resolve(self, run_id: str) -> str:
        """A run id, or an unambiguous prefix of one."""
        ids = [r[0] for r in self.conn.execute("SELECT id FROM runs WHERE id = ? OR id LIKE ? ESCAPE '\\'",
                                                (run_id, run_id.replace("%", r"\%").replace("_", r"\_") + "%"))]
        if run_id in ids or len(ids) == 1:
            return run_id if run_id in ids else ids[0]
        raise KeyError(f"no run {run_id!r} in the store" if not ids else f"{run_id!r} is ambiguous: {ids[:5]}")

    def get_run(self, run_id: str) -> dict:
        """Everything about one run; ``config``, ``summary``, ``hardware`` as dicts."""
        run = dict(self.conn.execute("SELECT * FROM runs WHERE id = ?", (self._resolve(run_id),)).fetchone())
        for key in ("config", "summary", "hardware"):
            run[key] = json.loads(run.pop(f"{key}_json") or "{}")
        return run

    def list_alerts(self, run_id: str) -> list[dict]:
        """The anomaly alerts a run raised (layer 3), in step order."""
        rows = self.conn.execute("SELECT step, kind, rank, message FROM alerts WHERE run_id = ? ORDER BY step",
                                 (self._resolve(run_id),))
        return [dict(r) for r in rows]

    def series(self, run_id: str, key: str) -> tuple[list[int], list]:
        """``(steps, values)`` of one per-step metric (or ``val_loss``) of a run."""
        table = "evals" if key == "val_loss" else "steps"
        if key not in STEP_KEYS and key != "val_loss":
            raise ValueError(f"unknown series {key!r}; known: {', '.join(STEP_KEYS)}, val_loss")
        rows = self.conn.execute(f"SELECT step, {key} FROM {table} WHERE run_id = ? ORDER BY step",
                                 (self._resolve(run_id),)).fetchall()
        return [r[0] for r in rows], [r[1] for r in rows]

    def compare(self, a: str, b: str) -> list[tuple[str, Any, Any]]:
        """``(key, value_a, value_b)``: the config keys that differ, then hardware that differs, then metrics."""
        ra, rb = self.get_run(a), self.get_run(b)
        rows = []
        for section, prefix in (("config", ""), ("hardware", "hardware.")):
            fa, fb = flatten(ra[section]), flatten(rb[section])
            rows += [(prefix + k, fa.get(k), fb.get(k)) for k in sorted(fa.keys() | fb.keys())
                     if fa.get(k) != fb.get(k)]
        return rows + [(k, ra["summary"].get(k), rb["summary"].get(k)) for k in SUMMARY_METRICS]

    def trend(self, match: Union[str, dict]) -> list[dict]:
        """Runs of one config, oldest first: (id, created, tokens_per_s, ...) — "is it getting slower?".

        ``match``: a run id (→ runs with its config fingerprint), a config fingerprint, a run name,
        or a dict of config values (nested or dotted keys) that the runs' configs must contain."""
        cols = f"id, name, created, status, config_hash, git_commit, {', '.join(RUN_COLUMNS)}"
        if isinstance(match, dict):
            want = flatten(match)
            rows = self.conn.execute(f"SELECT {cols}, config_json FROM runs ORDER BY created, id").fetchall()
            rows = [r for r in rows if all(flatten(json.loads(r["config_json"])).get(k, object()) == v
                                           for k, v in want.items())]
            return [{k: r[k] for k in r.keys() if k != "config_json"} for r in rows]
        row = self.conn.execute("SELECT config_hash FROM runs WHERE id = ?", (match,)).fetchone()
        if row or self.conn.execute("SELECT 1 FROM runs WHERE config_hash = ?", (match,)).fetchone():
            where, arg = "config_hash = ?", row[0] if row else match
        else:
            where, arg = "name = ?", match
        return [dict(r) for r in self.conn.execute(f"SELECT {cols} FROM runs WHERE {where} ORDER BY created, id",
                                                   (arg,))]

    def regressions(self, threshold: float = 0.1, min_history: int = 1) -> list[dict]:
        """Runs whose tokens/s is more than ``threshold`` below the median of the earlier runs of the
        same config fingerprint (at least ``min_history`` of them)."""
        rows = self.conn.execute("SELECT id, name, created, config_hash, git_commit, tokens_per_s FROM runs "
                                 "WHERE tokens_per_s IS NOT NULL ORDER BY created, id").fetchall()
        history: dict[str, list[float]] = {}
        flagged = []
        for r in rows:
            earlier = history.setdefault(r["config_hash"], [])
            if len(earlier) >= min_history:
                baseline = statistics.median(earlier)
                if r["tokens_per_s"] < (1 - threshold) * baseline:
                    flagged.append({**dict(r), "baseline_tokens_per_s": baseline, "n_earlier": len(earlier),
                                    "drop": 1 - r["tokens_per_s"] / baseline})
            earlier.append(r["tokens_per_s"])
        return flagged


# ---- plain-text formatting for the CLI ---------------------------------------------------------

def fmt(value: Any, percent: bool = False) -> str:
    """One value as text: ``n/a`` for None, percentages, thousands separators, 4 significant digits."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if percent:
            return f"{100 * value:.1f}%"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10000:
        return f"{value:,}"
    return str(value)


def _when(created: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if created else "n/a"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def format_runs_table(rows: list[dict]) -> str:
    header = ["id", "name", "created", "status", "steps", "loss", "val_loss", "tokens/s", "MFU", "comm-in-flight",
              "comm-exposed"]
    body = [[r["id"], str(r.get("name")), _when(r.get("created")), fmt(r.get("status")), fmt(r.get("steps")),
             fmt(r.get("final_loss")), fmt(r.get("val_loss")), fmt(r.get("tokens_per_s")),
             fmt(r.get("mfu"), percent=True), fmt(r.get("comm_frac"), percent=True),
             fmt(r.get("comm_exposed_frac"), percent=True)] for r in rows]
    return _table(header, body) if rows else "no runs recorded"


def format_run(run: dict) -> str:
    head = [["id", run["id"]], ["name", fmt(run.get("name"))], ["created", _when(run.get("created"))],
            ["status", fmt(run.get("status"))], ["run_dir", fmt(run.get("run_dir"))],
            ["git_commit", fmt(run.get("git_commit"))], ["labkit", fmt(run.get("labkit_version"))],
            ["config_hash", fmt(run.get("config_hash"))]]
    parts = [_table(["run", ""], head)]
    parts.append(_table(["metric", "value"], [[k, fmt(run.get("summary", {}).get(k), percent=k in PERCENT)]
                                             for k in SUMMARY_METRICS]))
    parts.append(_table(["hardware", ""], [[k, fmt(v)] for k, v in run.get("hardware", {}).items()]))
    parts.append(_table(["config", ""], [[k, fmt(v)] for k, v in flatten(run.get("config", {})).items()]))
    return "\n\n".join(parts)


def format_compare(rows: list[tuple[str, Any, Any]], a: str = "a", b: str = "b") -> str:
    return _table(["key", a, b], [[k, fmt(va, k in PERCENT), fmt(vb, k in PERCENT)] for k, va, vb in rows])
