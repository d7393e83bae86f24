"""launch() → Run: real workers through the elastic agent, and nothing left behind."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import tiny_config
from labkit.config import ConfigError
from labkit.launcher import _alive, launch


def wait_for(predicate, timeout=60.0, poll=0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return False


@pytest.mark.multiproc
def test_launch_returns_at_once_then_events_and_summary(tmp_path):
    run = launch(tiny_config(**{"run.steps": 8}), nproc=2, run_dir=tmp_path / "run")
    # at once: back before any worker has trained a step (they import torch first), on a busy machine too
    assert run.status == "running" and run.metrics["step"] == []
    assert run.wait(timeout=120) == "finished", run.log()
    m = run.metrics
    assert m["step"] == list(range(8)) and all(x > 0 for x in m["tokens_per_s"])
    assert run.summary["status"] == "finished" and run.summary["world_size"] == 2
    assert (tmp_path / "run" / "config.json").exists()


@pytest.mark.multiproc
def test_stop_leaves_no_process_alive(tmp_path):
    run = launch(tiny_config(**{"run.steps": 100000}), nproc=2, run_dir=tmp_path / "run")
    assert wait_for(lambda: len(run.metrics.get("step", [])) >= 2), run.log()
    workers = run.worker_pids
    assert len(workers) == 2 and all(_alive(p) for p in workers)
    assert run.stop() == "stopped"
    assert not _alive(run.process.pid)
    assert not any(_alive(p) for p in workers)
    assert run.summary["status"] == "stopped"  # the data written so far is kept
    assert run.summary["steps_completed"] >= 2


@pytest.mark.multiproc
def test_a_launcher_that_outlives_the_grace_period_is_killed_and_so_are_its_workers(tmp_path):
    """No grace at all: the agent is SIGKILLed before it can end its workers, so stop() must end them."""
    run = launch(tiny_config(**{"run.steps": 100000}), nproc=2, run_dir=tmp_path / "run")
    assert wait_for(lambda: len(run.metrics.get("step", [])) >= 1), run.log()
    workers = run.worker_pids
    assert len(workers) == 2
    assert run.stop(grace_s=0) == "stopped"
    assert not _alive(run.process.pid) and not any(_alive(p) for p in workers)
    assert run.summary["status"] == "stopped"


@pytest.mark.multiproc
def test_killing_the_notebook_ends_every_worker(tmp_path):
    """The notebook process dies without warning (SIGKILL): launcher and workers must follow."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from helpers import tiny_config
        import labkit
        run = labkit.launch(tiny_config(**{{"run.steps": 100000}}), nproc=2, run_dir={str(tmp_path / 'run')!r})
        print(run.process.pid, flush=True)
        time.sleep(600)
    """)
    notebook = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    launcher_pid = int(notebook.stdout.readline())
    pid_dir = tmp_path / "run" / "pids"
    assert wait_for(lambda: len(list(pid_dir.glob("*.pid"))) == 2 and (tmp_path / "run" / "events.jsonl").exists())
    workers = [int(p.read_text()) for p in pid_dir.glob("*.pid")]
    notebook.send_signal(signal.SIGKILL)
    notebook.wait()
    assert wait_for(lambda: not _alive(launcher_pid) and not any(_alive(p) for p in workers), timeout=30)


def test_bad_config_raises_before_any_process(tmp_path):
    with pytest.raises(ConfigError, match="data.batch_size=6"):
        launch(tiny_config(**{"data.batch_size": 6}), nproc=2, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.multiproc
def test_an_existing_run_is_never_overwritten(tmp_path):
    run = launch(tiny_config(**{"run.steps": 2}), nproc=1, run_dir=tmp_path / "run")
    assert run.wait(timeout=60) == "finished"
    before = (tmp_path / "run" / "events.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a run"):
        launch(tiny_config(), nproc=1, run_dir=tmp_path / "run")
    assert (tmp_path / "run" / "events.jsonl").read_text() == before


@pytest.mark.multiproc
def test_worker_failure_is_reported(tmp_path):
    data = tmp_path / "latin1.txt"
    data.write_bytes("café au lait ".encode("latin-1") * 2000)  # not UTF-8: the workers fail reading it
    run = launch(tiny_config(**{"data.dataset": str(data)}), nproc=2, run_dir=tmp_path / "run")
    assert run.wait(timeout=60) == "failed"
    assert "worker (local rank" in run.log()
    assert run.summary["status"] == "failed" and "UTF-8" in run.summary["error"]


@pytest.mark.multiproc
def test_kernel_interrupt_during_wait_stops_the_run(tmp_path):
    """A notebook's interrupt button sends SIGINT to the kernel while it waits on the run."""
    import threading

    run = launch(tiny_config(**{"run.steps": 100000}), nproc=2, run_dir=tmp_path / "run")
    assert wait_for(lambda: len(run.worker_pids) == 2)
    workers = run.worker_pids
    main = threading.main_thread().ident
    # as ipykernel does while a cell runs: a test runner started in the background inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(1.0, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            run.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert run.status == "stopped" and not any(_alive(p) for p in workers)


@pytest.mark.multiproc
def test_cli_trains_with_a_progress_bar_and_writes_the_run(tmp_path):
    env = {**os.environ, "LABKIT_PROGRESS": "1", "LABKIT_RUN_STORE": str(tmp_path / "store.sqlite")}
    proc = subprocess.run([sys.executable, "-m", "labkit", "train", "configs/quickstart.yaml", "--nproc", "2",
                           "--steps", "4", "--set", "model.n_layer=1", "--set", "run.eval_every=2",
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "4/4" in proc.stderr and "step/s" in proc.stderr  # tqdm progress bar
    assert "labkit: finished after 4 steps" in proc.stderr
    for name in ("config.json", "events.jsonl", "summary.json"):
        assert (tmp_path / "run" / name).exists()
    listing = subprocess.run([sys.executable, "-m", "labkit", "runs", "list"], capture_output=True, text=True,
                             env=env, timeout=60)
    assert listing.returncode == 0 and "run" in listing.stdout and "finished" in listing.stdout  # recorded
    shown = subprocess.run([sys.executable, "-m", "labkit", "runs", "show", "run"], capture_output=True, text=True,
                           env=env, timeout=60)
    assert shown.returncode == 0 and "model.n_layer" in shown.stdout
    missing = subprocess.run([sys.executable, "-m", "labkit", "runs", "show", "nope"], capture_output=True,
                             text=True, env=env, timeout=60)
    assert missing.returncode == 2 and "no run 'nope'" in missing.stderr


@pytest.mark.multiproc
def test_stop_before_the_first_step_still_ends_the_run_cleanly(tmp_path):
    run = launch(tiny_config(), nproc=2, run_dir=tmp_path / "run")
    assert run.stop() == "stopped"  # at once: workers have not started yet
    assert run.summary["status"] == "stopped" and run.summary["steps_completed"] == 0
    assert run.metrics["step"] == [] and run.events()[-1] == {**run.events()[-1], "type": "end", "status": "stopped"}


@pytest.mark.multiproc
def test_ctrl_c_on_the_cli_ends_every_worker(tmp_path):
    run_dir = tmp_path / "run"
    cli = subprocess.Popen([sys.executable, "-m", "labkit", "train", "configs/quickstart.yaml", "--nproc", "2",
                            "--steps", "100000", "--set", "model.n_layer=1", "--run-dir", str(run_dir)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pid_dir = run_dir / "pids"
    assert wait_for(lambda: len(list(pid_dir.glob("*.pid"))) == 2 and (run_dir / "events.jsonl").exists()
                    and '"type": "step"' in (run_dir / "events.jsonl").read_text())
    workers = [int(p.read_text()) for p in pid_dir.glob("*.pid")]
    cli.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends to the foreground process
    _, err = cli.communicate(timeout=60)
    assert cli.returncode != 0 and "stopped by SIGINT" in err
    assert wait_for(lambda: not any(_alive(p) for p in workers), timeout=30)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped"


@pytest.mark.multiproc
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", None])
def test_a_stop_that_lands_in_a_torch_callback_still_says_stopped_and_a_real_error_failed(tmp_path, sig):
    """What made Ctrl-C on the CLI sometimes end as "failed": the signal reached rank 0 while a future's ``then``
    callback ran on its main thread (torch runs it there when the collective has already completed; labkit's timed
    collectives attach one). torch stores the exception raised inside it as a RuntimeError ("Got the following
    error when running the callback: KeyboardInterrupt") and the wait raises that. Here, in one real worker
    process with the worker's own signal handlers, the signal lands inside such a callback; without a signal the
    callback fails by itself, and that is still a failure."""
    from labkit.config import save_config

    save_config(tiny_config(), tmp_path / "config.json")
    code = textwrap.dedent(f"""
        import signal, torch
        from labkit.config import load_config
        from labkit.session import WorkerSession, stop_on_signal
        signal.signal(signal.SIGTERM, stop_on_signal)  # as worker_main installs them
        signal.signal(signal.SIGINT, stop_on_signal)
        def callback(_):
            if {sig!r}:
                signal.raise_signal(getattr(signal, {sig!r}))
            raise ValueError("a real error")
        done = torch.futures.Future()
        done.set_result(None)  # the collective has completed: the callback runs here, on the main thread
        try:
            with WorkerSession(load_config({str(tmp_path / "config.json")!r}), {str(tmp_path)!r}):
                done.then(callback).wait()
        except BaseException as error:
            print(type(error).__name__ + ":", error)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.startswith("RuntimeError: Got the following error when running the callback"), done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    if sig is None:
        assert summary["status"] == "failed" and "ValueError: a real error" in summary["error"]
    else:
        assert summary["status"] == "stopped", summary
        assert summary["error"].startswith(f"signal {int(getattr(signal, sig))} (then the worker saw: RuntimeError")


@pytest.mark.multiproc
def test_a_failed_run_says_which_worker_failed_and_why_even_if_rank_0_was_stopped_first(tmp_path):
    """A peer's failure ends rank 0 too (the agent stops the group): rank 0 may have written "stopped", or
    nothing. The summary must still say failed, with the failing worker's own message from the error
    file that ``@record`` writes in a real worker process."""
    import json
    import subprocess
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from labkit.launcher import failure_reason, record_failure

    error_file = tmp_path / "error.json"
    code = ("from torch.distributed.elastic.multiprocessing.errors import record\n"
            "@record\ndef main():\n    raise ValueError('latin1.txt is not UTF-8 text')\nmain()\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)},
                          capture_output=True, text=True)
    assert done.returncode == 1 and error_file.exists()
    reason = failure_reason(ProcessFailure(local_rank=1, pid=done.returncode, exitcode=1, error_file=str(error_file)))
    assert reason.startswith("worker exit code 1: ") and "not UTF-8" in reason
    killed = ProcessFailure(local_rank=1, pid=1, exitcode=-9, error_file=str(tmp_path / "none.json"))
    assert failure_reason(killed) == "worker exit code -9: Signal 9 (SIGKILL) received by PID 1"
    silent = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(tmp_path / "none.json"))
    assert failure_reason(silent) == "worker exit code 1"  # nothing said, nothing invented

    stopped, empty = tmp_path / "stopped", tmp_path / "empty"
    for run_dir in (stopped, empty):
        run_dir.mkdir()
    (stopped / "summary.json").write_text(json.dumps({"status": "stopped", "error": "signal SIGTERM",
                                                      "steps_completed": 3}))
    for run_dir in (stopped, empty):
        record_failure(run_dir, reason)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["error"] == reason
    assert json.loads((stopped / "summary.json").read_text())["steps_completed"] == 3  # the rest is kept


def test_prepare_run_validates_once_per_run_directory(tmp_path, monkeypatch):
    import labkit.launcher as launcher

    calls = []
    real = launcher.validate
    monkeypatch.setattr(launcher, "validate", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = tiny_config()
    run_dir = launcher.prepare_run(cfg, 2, tmp_path / "run")  # launch() in the notebook
    assert launcher.prepare_run(cfg, 2, run_dir) == run_dir  # the agent it starts, on the same directory
    assert len(calls) == 1
    launcher.prepare_run(cfg.replace(**{"run.steps": 9}), 2, run_dir)  # another config: checked again
    launcher.prepare_run(cfg.replace(**{"run.steps": 9}), 1, run_dir)  # another process count: again
    assert len(calls) == 3


def test_the_quickstart_with_a_pipeline_starts_and_says_which_strategy_auto_chose_and_why(tmp_path, monkeypatch,
                                                                                       capsys):
    import labkit.launcher as launcher
    from labkit import cli

    started = []
    monkeypatch.setattr(launcher, "run_elastic", lambda run_dir, nproc, cfg: started.append(cfg) or 0)  # no workers
    monkeypatch.setattr(launcher, "watch_parent_from_env", lambda: None)
    monkeypatch.setattr(cli, "record_in_store", lambda run_dir, runs_dir: None)
    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    code = cli.main(["train", str(quickstart), "--nproc", "2", "--set", "parallel.pp.degree=2",
                     "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 0 and len(started) == 1, err
    said = "labkit: parallel.dp.strategy: auto → ddp_naive: the first strategy in labkit.parallel.STRATEGIES that runs"
    assert said in err
    recorded = json.loads((tmp_path / "run" / "launch.json").read_text())["auto"]["parallel.dp.strategy"]
    assert recorded.startswith("auto → ddp_naive: ")
    assert "torch_ddp does not run beside parallel.pp.impl=labkit" in recorded
    assert json.loads((tmp_path / "run" / "config.json").read_text())["parallel"]["dp"]["strategy"] == "auto"


COUNTING_WORKER = """
import json, sys
import labkit.cli, labkit.config
counts = {"parsed": 0, "validated": 0}
def counting(name, real):
    def wrapper(*args, **kwargs):
        counts[name] += 1
        open(sys.argv[1], "w").write(json.dumps(counts))
        return real(*args, **kwargs)
    return wrapper
labkit.config.from_dict = counting("parsed", labkit.config.from_dict)
labkit.cli.validate = counting("validated", labkit.cli.validate)
labkit.cli.main(["train", sys.argv[2], "--run-dir", sys.argv[3]])
"""


@pytest.mark.multiproc
@pytest.mark.parametrize("prepared", [True, False])
def test_a_worker_reads_its_config_once_and_validates_it_only_if_nobody_has(tmp_path, prepared):
    """A worker under labkit's agent finds its run directory validated; one started by torchrun directly
    (no launch.json) checks the config itself. Either way the config file is read once."""
    import subprocess
    import sys

    from labkit.config import save_config
    from labkit.launcher import prepare_run

    cfg = tiny_config(**{"run.steps": 2, "precision.mode": "auto", "attention.backend": "auto"})
    run_dir = tmp_path / "run"
    if prepared:
        prepare_run(cfg, 1, run_dir)
    else:
        run_dir.mkdir()
        save_config(cfg, run_dir / "config.json")
    config_file = tmp_path / "config.json"
    save_config(cfg, config_file)
    counts = tmp_path / "counts.json"
    worker_env = {**os.environ, "TORCHELASTIC_RUN_ID": "t", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                  "LOCAL_WORLD_SIZE": "1", "LABKIT_PROGRESS": "0"}
    done = subprocess.run([sys.executable, "-c", COUNTING_WORKER, str(counts), str(config_file), str(run_dir)],
                          env=worker_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    assert json.loads(counts.read_text()) == {"parsed": 1, "validated": 0 if prepared else 1}


def test_the_rendezvous_endpoint_is_kept_beside_what_prepare_run_wrote(tmp_path):
    from labkit.launcher import prepare_run, record_rendezvous

    run_dir = prepare_run(tiny_config(), 2, tmp_path / "run")
    assert record_rendezvous(run_dir, "127.0.0.1:29511") == "127.0.0.1:29511"
    info = json.loads((run_dir / "launch.json").read_text())
    assert info["rendezvous"] == "127.0.0.1:29511" and info["nproc"] == 2 and info["validated"] is True
