"""Training runs and re-saves at one world size: ``torchrun --nproc-per-node W reshard_cases.py OUT CASES``.

Used by tests/fault/test_reshard.py. CASES is a JSON list of {"name", "overrides", "action"}:

* ``train`` — ``labkit.train.train`` into OUT/name (resuming from ``fault.checkpoint_dir`` if it holds a checkpoint);
* ``resave`` — build the run at this world size, load the newest checkpoint of ``fault.checkpoint_dir`` exactly as a
  resume does, and save that state again, at this world size, into OUT/name/resaved (nothing trained): what was
  loaded, to be gathered and compared with what was saved;
* ``refuse`` — ``train``, expected to be refused: the error's text goes to OUT/name/error.txt.
"""
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from labkit.config import load_config, resolve_auto
from labkit.data import build_datasets
from labkit.distributed import init_distributed, shutdown_distributed
from labkit.fault.checkpoint import Checkpointer
from labkit.fault.recovery import training_state
from labkit.fault.tolerance import FaultTolerance
from labkit.session import WorkerSession
from labkit.train import build_trainer, train
from labkit.validation import validate


def resave(cfg, run_dir: Path) -> None:
    with WorkerSession(cfg, run_dir) as session:
        cfg = resolve_auto(cfg)[0]
        train_ds, _, tokenizer, _ = build_datasets(cfg.data.dataset, cfg.data.tokenizer, cfg.model.block_size,
                                                   cfg.data.val_fraction)
        trainer = build_trainer(cfg, session.env, train_ds, tokenizer.vocab_size)
        step = FaultTolerance(cfg, session.env, run_dir).resume(trainer) - 1
        saver = Checkpointer(run_dir / "resaved", keep=1, log=lambda line: None)
        saver.save(step, training_state(trainer, step))
        saver.close()
        trainer.strategy.close()
        session.finished()


def refuse(cfg, run_dir: Path) -> None:
    try:
        train(cfg, run_dir)
    except Exception as error:  # every rank raises the same refusal, after the same collective
        if dist.get_rank() == 0:
            (run_dir / "error.txt").write_text(f"{type(error).__name__}: {error}")
        return
    raise AssertionError(f"{run_dir.name}: expected a refusal, but the run trained")


out, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
init_distributed(load_config(None, cases[0]["overrides"]))
for case in cases:
    action = {"train": train, "resave": resave, "refuse": refuse}[case.get("action", "train")]
    cfg = load_config(None, case["overrides"])
    validate(cfg, nproc=dist.get_world_size())  # as labkit.launch would: a layout labkit refuses never runs
    action(cfg, out / case["name"])
    dist.barrier()
shutdown_distributed()
sys.stdout.flush()
os._exit(0)  # as labkit's workers do: no C++ destructors racing the backend's threads
