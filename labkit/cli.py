"""``labkit`` on the command line.

``labkit train CONFIG --nproc N`` validates the config, creates a run directory and runs the
elastic agent, which starts the N workers. The very same command is what each worker runs: a
process started by torchrun or by the agent (``TORCHELASTIC_RUN_ID`` in its environment) trains
instead of launching. So ``torchrun --nnodes 2 --nproc-per-node 8 ... -m labkit train CONFIG``
scales the same code out to many machines.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from labkit.config import ConfigError, load_config
from labkit.validation import validate


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labkit", description="labkit: distributed training you can watch")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a GPT with the given config")
    train.add_argument("config", help="YAML config file (e.g. configs/quickstart.yaml)")
    train.add_argument("--nproc", type=int, default=1, help="worker processes on this machine (default 1)")
    train.add_argument("--steps", type=int, help="shortcut for --set run.steps=N")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set model.n_layer=4 (repeatable)")
    train.add_argument("--run-dir", help="where events, summary and model go (default runs/NAME-TIME)")
    kill = sub.add_parser("kill", help="SIGKILL one worker of a live run (fault injection from outside)")
    kill.add_argument("run_dir", help="the run's directory")
    kill.add_argument("--rank", type=int, required=True, help="the rank whose worker is killed")
    scaling = sub.add_parser("scaling", help="scaling-law sweeps (resumable) and fits")
    scaling.add_argument("action", choices=["sweep", "fit"])
    scaling.add_argument("target", help="sweep: a sweep spec (configs/scaling/*.yaml); fit: a sweep's output directory")
    scaling.add_argument("--out", help="sweep: output directory (default datasets/scaling/NAME)")
    scaling.add_argument("--limit", type=int, help="sweep: run at most this many new points")
    sub.add_parser("datasets", help="list the shipped datasets and their entropy floors")
    runs = sub.add_parser("runs", help="the run history (SQLite): list, show, compare")
    runs.add_argument("action", choices=["list", "show", "compare", "record"])
    runs.add_argument("ids", nargs="*", help="run ids (a unique prefix is enough); for record: run directories")
    runs.add_argument("--store",
                      help="store path or sqlite:/// URL (default: $LABKIT_RUN_STORE or runs/labkit-runs.sqlite)")
    runs.add_argument("--limit", type=int, default=50)
    sim = sub.add_parser("sim", help="simulate labkit at scale in this one process")
    sim_sub = sim.add_subparsers(dest="sim_command", required=True)
    dryrun = sim_sub.add_parser("dryrun", help="one training step of one rank of a big world, on torch's fake "
                                "process group: every collective and the rank's model-state memory, beside the theory")
    dryrun.add_argument("config", help="YAML config file (e.g. configs/quickstart.yaml)")
    dryrun.add_argument("--world", type=int, required=True, help="simulated ranks (e.g. 1024)")
    dryrun.add_argument("--rank", type=int, default=0, help="the rank this process plays (default 0)")
    dryrun.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set parallel.tp.degree=8 (repeatable)")
    sim_sub.add_parser("validate", help="the step model (labkit.sim) against published runs, every point's error")
    sim_sub.add_parser("scenario", help="the source text's 128-GPU scenario through the step model (modelled)")
    workshop = sub.add_parser("workshop", help="workshop material: the participant exercises, their handout, the class "
                              "leaderboard")
    workshop.add_argument("action", choices=["exercises", "handout", "submit", "leaderboard"],
                          help="exercises: generate workshops/exercises/*.ipynb from their solutions; handout DIR: "
                          "write a participants' copy of the repository without the solutions; submit: export "
                          "a capstone attempt (with its baseline) for the class board; leaderboard DIR: merge the "
                          "submissions in DIR")
    workshop.add_argument("directory", nargs="?", help="leaderboard: the folder the submissions are in; handout: "
                          "the folder to write the copy into")
    workshop.add_argument("--check", action="store_true", help="exercises: write nothing; exit 1 if a committed "
                          "exercise is not what its solution generates")
    workshop.add_argument("--baseline", help="submit: the baseline run's id in your run store")
    workshop.add_argument("--attempt", help="submit: the attempt's run id")
    workshop.add_argument("--to", help="submit: the folder the class submits to")
    workshop.add_argument("--hub", help="leaderboard: the state folder of a make hub (.hub): every seat's run store")
    workshop.add_argument("--store", help="submit: store path or sqlite:/// URL (default: $LABKIT_RUN_STORE or "
                          "runs/labkit-runs.sqlite)")
    doctor = sub.add_parser("doctor", help="check this machine for the labs (cores, memory, torch, gloo, a timed "
                            "2-process step, ports, bf16, JupyterLab, browser, disk) and say which labs run at full "
                            "speed")
    doctor.add_argument("--json", action="store_true", help="print a machine-readable report")
    doctor.add_argument("--quick", action="store_true",
                        help="skip the slow probes (the gloo run, the timed step, the bf16 timing)")
    return parser


def _overrides(args) -> list[str]:
    return list(args.overrides) + ([f"run.steps={args.steps}"] if args.steps is not None else [])


def _config_from_args(args):
    return load_config(args.config, _overrides(args))


def _in_worker() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def train_command(args) -> int:
    from labkit.launcher import launch_choices, prepare_run, run_elastic, watch_parent_from_env

    if _in_worker():
        return _train_as_worker(args)
    cfg = _config_from_args(args)
    run_dir = prepare_run(cfg, args.nproc, args.run_dir)
    print(f"labkit: run directory {run_dir}  ({args.nproc} process(es))", file=sys.stderr)
    for key, why in launch_choices(cfg).items():  # what `auto` chose, before any worker starts
        print(f"labkit: {key}: {why}", file=sys.stderr)
    watch_parent_from_env()
    code = run_elastic(run_dir, args.nproc, cfg)
    _print_summary(run_dir)
    record_in_store(run_dir, cfg.run.runs_dir)
    return code


def record_in_store(run_dir: Path, runs_dir: str) -> None:
    """Add the finished run to the run history; a history problem never fails the run itself."""
    from labkit.metrics.store import RunStore, default_store_path

    try:
        with RunStore(default_store_path(runs_dir)) as store:
            store.record_run(run_dir)
    except Exception as error:  # noqa: BLE001 — the run's own files are already safe on disk
        print(f"labkit: could not record the run in the run store ({error})", file=sys.stderr)


def _train_as_worker(args) -> int:
    from labkit.config import save_config
    from labkit.worker import worker_main

    from labkit.launcher import validated_for

    cfg = _config_from_args(args)  # read once, here
    local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    run_dir = Path(args.run_dir or Path(cfg.run.runs_dir) / f"{cfg.run.name}-{os.environ['TORCHELASTIC_RUN_ID']}")
    if not validated_for(run_dir, cfg):  # started by torchrun directly: nobody has checked it yet
        validate(cfg, nproc=local, nnodes=max(1, world // local))
    resolved = run_dir / "config.json"
    if int(os.environ.get("RANK", 0)) == 0 and not resolved.exists():  # started by torchrun directly
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, resolved)
    return worker_main(cfg, run_dir)


def _print_summary(run_dir: Path) -> None:
    import json

    from labkit.metrics.communication import comm_text

    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return
    if s.get("consistency"):
        loss = "n/a" if s.get("final_loss") is None else f"{s['final_loss']:.4f}"
        print(f"labkit: {s.get('status')} — consistency {s['consistency']}, {s.get('workers')} workers, "
              f"loss {loss}, computing {s.get('busy_fraction', 0):.0%} of the time, "
              f"max divergence {s.get('divergence_max', 0):.3g}", file=sys.stderr)
        return
    mfu = "n/a" if s.get("mfu") is None else f"{s['mfu']:.1%}"
    loss = "n/a" if s.get("final_loss") is None else f"{s['final_loss']:.4f}"
    tok_s = "n/a" if s.get("tokens_per_s") is None else f"{s['tokens_per_s']:.0f}"
    comm = comm_text(s.get("comm_frac"), s.get("comm_exposed_frac"))  # in flight, and exposed (what it cost)
    split = "".join(f", {what} {s[key]:.1%}" for key, what in (("model_comm_frac", "tensor/context-parallel traffic"),
                                                                ("pipeline_idle", "pipeline bubble"))
                    if s.get(key))  # only a split model has them
    print(f"labkit: {s.get('status')} after {s.get('steps_completed')} steps — loss {loss}, "
          f"{tok_s} tokens/s, MFU {mfu}, {comm} of step time{split}", file=sys.stderr)
    params = s.get("params") or {}
    if params.get("active", params.get("total")) != params.get("total"):  # a mixture of experts
        print(f"labkit: {params['total']:,} parameters, {params['active']:,} active per token (the router, top-k "
              "experts and the shared expert: what FLOPs and MFU count; memory holds them all)", file=sys.stderr)
    if s.get("peak_source") and s.get("mfu") is not None:
        print(f"labkit: MFU is a percentage of {s['peak_source']}", file=sys.stderr)
    if s.get("compile"):
        c = s["compile"]
        print(f"labkit: compile verified — eager {1e3 * c['eager_step_s']:.1f} ms/step, compiled "
              f"{1e3 * c['compiled_step_s']:.1f} ms/step (compiling took {c['compile_s']:.1f} s): kept {c['kept']}",
              file=sys.stderr)


def kill_command(args) -> int:
    from labkit.launcher import kill_rank

    try:
        pid = kill_rank(args.run_dir, args.rank)
    except ValueError as error:
        print(f"labkit: {error}", file=sys.stderr)
        return 2
    print(f"labkit: killed rank {args.rank} (pid {pid}); with fault.max_restarts left the run restarts "
          "and resumes from its newest valid checkpoint", file=sys.stderr)
    return 0


def scaling_command(args) -> int:
    from labkit.scaling.report import fit_report
    from labkit.scaling.sweep import SweepSpec, read_results, run_sweep

    if args.action == "fit":
        print(fit_report(read_results(args.target)))
        return 0
    try:
        spec = SweepSpec.load(args.target)
    except (OSError, ValueError) as error:
        print(f"labkit: {error}", file=sys.stderr)
        return 2
    out = Path(args.out or Path("datasets") / "scaling" / spec.name)
    results = run_sweep(spec, out, on_progress=lambda line: print(f"labkit: {line}", file=sys.stderr),
                        limit=args.limit)
    print(f"labkit: {len(results)} of {len(spec.points())} points in {out / 'results.jsonl'}", file=sys.stderr)
    return 0


def datasets_command(args) -> int:
    from labkit.data import available_datasets, load_metadata

    for name in available_datasets():
        meta = load_metadata(name) or {}
        print(f"{name:12s} entropy floor {meta.get('entropy_nats_per_token', float('nan')):.4f} nats/token  "
              f"{meta.get('description', '')}")
    return 0


def runs_command(args) -> int:
    from labkit.metrics.store import RunStore, default_store_path

    needed = {"list": 0, "show": 1, "compare": 2}.get(args.action)
    if needed is not None and len(args.ids) != needed:
        print(f"labkit runs {args.action} takes {needed} run id(s), got {len(args.ids)}", file=sys.stderr)
        return 2
    with RunStore(args.store or default_store_path()) as store:
        try:
            print(_runs_output(store, args))
        except KeyError as error:  # an unknown or ambiguous run id
            print(f"labkit: {error.args[0]}", file=sys.stderr)
            return 2
    return 0


def _runs_output(store, args) -> str:
    from labkit.metrics.store import format_compare, format_run, format_runs_table

    if args.action == "list":
        return format_runs_table(store.list_runs(limit=args.limit))
    if args.action == "show":
        return format_run(store.get_run(args.ids[0]))
    if args.action == "compare":
        return format_compare(store.compare(*args.ids), *args.ids)
    return "\n".join(f"recorded {store.record_run(run_dir)}" for run_dir in args.ids)


def sim_dryrun_command(args) -> int:
    from labkit.sim.dryrun import dry_run, format_result

    cfg = load_config(args.config, list(args.overrides))
    try:
        result = dry_run(cfg, args.world, args.rank)
    except ValueError as error:
        if isinstance(error, ConfigError):
            raise
        print(f"labkit: {error}", file=sys.stderr)
        return 2
    print(format_result(result))
    return 0


def sim_command(args) -> int:
    if args.sim_command == "dryrun":
        return sim_dryrun_command(args)
    if args.sim_command == "validate":
        from labkit.sim.validate_report import validation_text

        print(validation_text())
        return 0
    from labkit.sim.scenario import format_scenario, scenario

    print(format_scenario(scenario()))
    return 0


def workshop_command(args) -> int:
    if args.action == "exercises":
        from labkit.workshop.exercises import main as exercises

        return exercises(check=args.check)
    if args.action == "handout":
        from labkit.workshop.handout import main as handout

        return handout(args.directory)
    from labkit.workshop import board

    if args.action == "leaderboard":
        if not args.directory and not args.hub:
            print("labkit workshop leaderboard DIR (or --hub .hub): name the folder the submissions are in",
                  file=sys.stderr)
            return 2
        entries, problems = board.read_submissions(args.directory) if args.directory else ([], [])
        if args.hub:
            seats, seat_problems = board.hub_entries(args.hub)
            entries, problems = entries + seats, problems + seat_problems
        print(board.board_text(board.merged_rows(entries), problems))
        return 0
    missing = [f"--{name}" for name in ("baseline", "attempt", "to") if not getattr(args, name)]
    if missing:
        print(f"labkit workshop submit needs {', '.join(missing)}", file=sys.stderr)
        return 2
    from labkit.metrics.store import RunStore

    with RunStore(args.store) as store:
        try:
            entry = board.submission(store, args.baseline, args.attempt)
        except KeyError as error:  # an unknown or ambiguous run id
            print(f"labkit workshop submit: {error.args[0]}", file=sys.stderr)
            return 2
    path = board.write_submission(entry, args.to)
    verdict = "counts" if entry["claimed_score"] is not None else f"disqualified: {entry['claimed_reason']}"
    print(f"labkit: submitted {entry['attempt']['name']} ({verdict}) to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return train_command(args)
        if args.command == "runs":
            return runs_command(args)
        if args.command == "kill":
            return kill_command(args)
        if args.command == "scaling":
            return scaling_command(args)
        if args.command == "sim":
            return sim_command(args)
        if args.command == "workshop":
            return workshop_command(args)
        if args.command == "doctor":
            from labkit.doctor import main as doctor

            return doctor(quick=args.quick, as_json=args.json)
        return datasets_command(args)
    except ConfigError as error:
        print(f"labkit: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
