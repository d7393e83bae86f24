"""Resharding: a checkpoint saved by 4 processes resumes on 2, and a checkpoint that does not fit is refused.

One torchrun launch at world 4 trains each strategy 6 steps, saving at step 3; one launch at world 2 then, per
strategy, (a) loads that checkpoint and saves the loaded state again at world 2 (``resave``), and (b) resumes
training from it (``train``). What is checked:

* the state loaded at world 2 — model, optimizer moments and step, loader position, step — gathered whole equals,
  bit for bit, the state saved at world 4 gathered whole (:func:`labkit.fault.reshard.gathered`);
* the resumed run reads the same global samples and continues where the world-4 run did: its losses at steps 4 and
  5 and final weights equal the world-4 run's *within a tolerance*, not bit for bit: on 2 ranks each gradient is a
  sum over 2 micro-batches per rank, then over 2 ranks, where on 4 ranks it was one micro-batch per rank over 4
  ranks — the same numbers added in another order, so float32 rounding differs (~1e-7 relative per step);
* a checkpoint of another model shape, or with a shard file gone, is refused on every rank with an error naming
  the tensor and the problem, before anything is loaded, and the checkpoint directory is left byte for byte as
  it was.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from labkit.fault.checkpoint import Checkpointer, write_manifest
from labkit.fault.reshard import CheckpointMismatch, differences, fit_problems, gathered
from labkit.launcher import free_port

STRATEGIES = ("torch_ddp", "zero1", "zero2", "fsdp2")
SAVED_AT = 3  # run.steps 6, fault.checkpoint_every 4: one save, after step 3
TINY = {"run.seed": 7, "run.eval_every": 0, "run.steps": 6, "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32,
        "model.block_size": 32, "data.batch_size": 8, "data.micro_batch_size": 2, "optim.warmup_steps": 2,
        "fault.checkpoint_every": 4, "fault.keep_last": 5}
LOSS_TOLERANCE = 1e-6  # relative: the same sums in another order (module docstring; measured: <= 3e-8)
WEIGHT_TOLERANCE = 1e-6  # absolute, on weights of order 0.1 after two more AdamW steps (measured: <= 8e-9)


def _launch(nproc: int, root: Path, cases: list[dict]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", str(nproc), "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()),
                           str(Path(__file__).parents[1] / "reshard_cases.py"), str(root), json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]


def _case(name: str, strategy: str, checkpoints: Path, action: str = "train", **extra) -> dict:
    overrides = {**TINY, "parallel.dp.strategy": strategy, "fault.checkpoint_dir": str(checkpoints), **extra}
    return {"name": name, "action": action, "overrides": overrides}


def _digests(directory: Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """World 4 trains every strategy; world 2 re-saves and resumes each, and meets two checkpoints that do not fit."""
    root = tmp_path_factory.mktemp("reshard")
    _launch(4, root, [_case(f"{s}-w4", s, root / f"{s}-w4" / "checkpoints") for s in STRATEGIES])
    for s in STRATEGIES:  # the world-2 runs read copies: the world-4 checkpoints stay as saved
        shutil.copytree(root / f"{s}-w4" / "checkpoints", root / f"{s}-copy")
    bad_shape, lost_shard = root / "bad-shape", root / "lost-shard"
    shutil.copytree(root / "torch_ddp-w4" / "checkpoints", bad_shape)
    shutil.copytree(root / "fsdp2-w4" / "checkpoints", lost_shard)
    _lose_a_shard(lost_shard / f"step_{SAVED_AT:08d}")
    before = {d: _digests(d) for d in (bad_shape, lost_shard)}
    cases = [c for s in STRATEGIES for c in (_case(f"{s}-resave", s, root / f"{s}-copy", "resave"),
                                             _case(f"{s}-w2", s, root / f"{s}-copy"))]
    cases += [_case("bad-shape-run", "torch_ddp", bad_shape, "refuse", **{"model.n_embd": 48}),
              _case("lost-shard-run", "fsdp2", lost_shard, "refuse")]
    _launch(2, root, cases)
    return root, before


def _lose_a_shard(checkpoint: Path) -> None:
    """Delete rank 3's shard file and seal the manifest again, as a copy that lost a file would look if re-sealed:
    the manifest no longer catches it, the DCP metadata still names the file."""
    (checkpoint / "__3_0.distcp").unlink()
    write_manifest(checkpoint, SAVED_AT, {"world_size": 4})


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == kind]


def _without_rng(state: dict) -> dict:
    """Each rank's RNG state is saved under its rank: rank 2 and 3's are not loaded at world 2 (nor re-saved)."""
    return {k: v for k, v in state.items() if k != "rng"}


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_checkpoint_saved_by_4_loads_on_2_bit_for_bit(resharded, strategy):
    root, _ = resharded
    saved = gathered(root / f"{strategy}-w4" / "checkpoints" / f"step_{SAVED_AT:08d}")
    loaded = gathered(root / f"{strategy}-resave" / "resaved" / f"step_{SAVED_AT:08d}")
    assert differences(_without_rng(saved), _without_rng(loaded)) == []
    assert any(torch.is_tensor(v) and v.numel() > 1 for v in _flat_optimizer(loaded)), "optimizer state was compared"
    assert saved["loader"] == loaded["loader"] and saved["step"] == loaded["step"] == SAVED_AT


def _flat_optimizer(state: dict) -> list:
    def leaves(value):
        return [x for v in value.values() for x in leaves(v)] if isinstance(value, dict) else [value]
    return leaves(state["optim"])


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_resumed_run_continues_the_saved_one_on_fewer_ranks(resharded, strategy):
    root, _ = resharded
    full, again = root / f"{strategy}-w4", root / f"{strategy}-w2"
    (resume,) = _events(again, "resume")
    assert resume["next_step"] == SAVED_AT + 1 and resume["resharded"] is True
    assert resume["saved_world_size"] == 4 and resume["world_size"] == 2
    steps = {e["step"]: e["loss"] for e in _events(full, "step")}
    resumed = {e["step"]: e["loss"] for e in _events(again, "step")}
    assert sorted(resumed) == [4, 5]
    assert all(resumed[s] == pytest.approx(steps[s], rel=LOSS_TOLERANCE) for s in resumed)
    want, got = (torch.load(d / "final_model.pt", weights_only=True) for d in (full, again))
    assert want.keys() == got.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    print(f"{strategy}: losses {[resumed[s] / steps[s] - 1 for s in resumed]} relative, weights {worst:.3g}")
    assert worst <= WEIGHT_TOLERANCE, f"{strategy}: largest weight difference {worst:.3g}"


@pytest.mark.multiproc
@pytest.mark.parametrize("name, says", [
    ("bad-shape", r"model\.\S+ has shape \[\d+(, \d+)*\] in the checkpoint, \[\d+(, \d+)*\] here"),
    ("lost-shard", r"shard file __3_0\.distcp is missing \(it held \d+ pieces: "),
])
def test_a_checkpoint_that_does_not_fit_is_refused_and_left_untouched(resharded, name, says):
    root, before = resharded
    error = (root / f"{name}-run" / "error.txt").read_text()
    assert error.startswith("CheckpointMismatch: checkpoint ") and "saved at world size 4; this run has 2" in error
    assert re.search(says, error), error
    assert "Nothing was loaded" in error
    assert _digests(root / name) == before[root / name]  # no file changed, none added, none removed


# ---------------------------------------------------------------- in one process: the checks themselves

@pytest.fixture
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _saved(directory: Path) -> Path:
    checkpointer = Checkpointer(directory, log=lambda line: None)
    checkpointer.save(2, {"model": {"w": torch.ones(4, 3), "b": torch.zeros(3)}, "step": 2})
    checkpointer.close()
    return directory / "step_00000002"


def test_fit_problems_name_each_tensor_that_does_not_fit(group, tmp_path):
    path = _saved(tmp_path)
    assert fit_problems(path, {"model": {"w": torch.empty(4, 3), "b": torch.empty(3)}, "step": 0}) == []
    problems = fit_problems(path, {"model": {"w": torch.empty(4, 5), "b": torch.empty(3, dtype=torch.float64),
                                             "extra": torch.empty(1)}, "step": 0})
    assert problems == ["model.w has shape [4, 3] in the checkpoint, [4, 5] here",
                        "model.b is torch.float32 in the checkpoint, torch.float64 here",
                        "model.extra is not in the checkpoint"]


def test_restore_refuses_a_checkpoint_of_another_shape_and_changes_nothing(group, tmp_path):
    _saved(tmp_path)
    before = _digests(tmp_path)
    with pytest.raises(CheckpointMismatch, match=r"step_00000002 \(saved at world size 1; this run has 1\) does not "
                                                 r"fit this run: model\.w has shape \[4, 3\]"):
        Checkpointer(tmp_path, log=lambda line: None).restore(lambda: {"model": {"w": torch.empty(2, 3),
                                                                                 "b": torch.empty(3)}, "step": 0})
    assert _digests(tmp_path) == before


def test_a_shard_file_shorter_than_its_pieces_is_named(group, tmp_path):
    path = _saved(tmp_path)
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:8])
    (problem,) = fit_problems(path, {"model": {"w": torch.empty(4, 3), "b": torch.empty(3)}, "step": 0})
    assert "shard file __0_0.distcp is 8 bytes, shorter than the pieces it holds (it held 3 pieces: model.b, " \
        "model.w, step)" in problem
