"""Resharding: a checkpoint saved by 4 processes resumes on 2 or 3, or in another layout, or is refused.

One torchrun launch at world 4 trains each layout 6 steps, saving at step 3 (DDP, ZeRO-1, ZeRO-2, FSDP2; dp 2 × tp 2
three ways; dp 2 × pp 2); one launch at world 2 and one at world 3 then, per layout that fits them, (a) load that
checkpoint and save the loaded state again at the new world size (``resave``), and (b) resume training from it
(``train``); world 2 also resumes tp 2 → tp 1 and pp 2 → pp 1. What is checked:

* the state loaded at the new world size — model, optimizer moments and step, loader position, step — gathered
  whole equals, bit for bit, the state saved at world 4 gathered whole (:func:`labkit.fault.reshard.gathered`; in
  another layout, under the old layout's names);
* the resumed run reads the same global samples (the global batch of 12 is fixed; the loader's position is in
  global steps) and continues where the world-4 run did: its losses at steps 4 and 5 and final weights equal the
  world-4 run's *within a tolerance*, not bit for bit: on 2 ranks each gradient is a sum over 6 micro-batches per
  rank, then over 2 ranks, where on 4 ranks it was 3 per rank over 4 ranks — the same numbers added in another
  order, so float32 rounding differs (measured: at most 2.3e-8 relative in the loss, 7.5e-9 in a weight);
* a checkpoint of another model shape, or with a shard file gone, is refused on every rank with an error naming
  the tensor or file, before anything is loaded, and the checkpoint directory is left byte for byte as it was; a
  corrupt file is refused by name and the corrupt checkpoint is never overwritten;
* under torchrun with elastic membership, a run that loses a node for good continues on the smaller world from its
  newest checkpoint, resharded, and says so in its events.
"""
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from labkit.fault.checkpoint import Checkpointer, flip_byte, list_checkpoints, verify, write_manifest
from labkit.fault.reshard import (CheckpointMismatch, blocks_per_stage, differences, fit_problems, flat_state, gathered,
                                  joined, relayout_plan, sources)
from labkit.launcher import free_port

SAVED_AT = 3  # run.steps 6, fault.checkpoint_every 4: one save, after step 3
TINY = {"run.seed": 7, "run.eval_every": 0, "run.steps": 6, "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32,
        "model.block_size": 32, "data.batch_size": 12, "data.micro_batch_size": 1, "optim.warmup_steps": 2,
        "fault.checkpoint_every": 4, "fault.keep_last": 5}  # a global batch of 12 splits over 4, 3 and 2 ranks
DP_TP = {"parallel.tp.degree": 2}  # dp 2 × tp 2 at world 4, dp 1 × tp 2 at world 2 (world 3 does not hold tp 2)
LAYOUTS = {  # name → (overrides, the world sizes it resumes at from world 4)
    "torch_ddp": ({"parallel.dp.strategy": "torch_ddp"}, (2, 3)),
    "zero1": ({"parallel.dp.strategy": "zero1"}, (2, 3)),
    "zero2": ({"parallel.dp.strategy": "zero2"}, (2, 3)),
    "fsdp2": ({"parallel.dp.strategy": "fsdp2"}, (2, 3)),
    "zero3": ({"parallel.dp.strategy": "zero3"}, (2, 3)),  # weights sliced too
    "torch_ddp-dp2xtp2": ({"parallel.dp.strategy": "torch_ddp", **DP_TP}, (2,)),  # labkit's tensor-parallel layers
    "zero1-dp2xtp2": ({"parallel.dp.strategy": "zero1", **DP_TP}, (2,)),
    "fsdp2-dp2xtp2": ({"parallel.dp.strategy": "fsdp2", "parallel.tp.impl": "dtensor", **DP_TP}, (2,)),  # DTensor's
    "ddp_naive-dp2xpp2": ({"parallel.dp.strategy": "ddp_naive", "parallel.pp.degree": 2, "model.n_layer": 2}, ()),
}
RESUMED = [(name, world) for name, (_, worlds) in LAYOUTS.items() for world in worlds]
CROSS = {  # another layout at world 2: name → (the world-4 layout it resumes, what changes)
    "tp2-to-tp1": ("fsdp2-dp2xtp2", {"parallel.tp.degree": 1, "parallel.tp.impl": "labkit"}),  # q, k, v → qkv
    "pp2-to-pp1": ("ddp_naive-dp2xpp2", {"parallel.pp.degree": 1}),  # two stages' names → the GPT's
}
LOSS_TOLERANCE = 1e-6  # relative: the same sums in another order (module docstring; measured: <= 3e-8)
WEIGHT_TOLERANCE = 1e-6  # absolute, on weights of order 0.1 after two more AdamW steps (measured: <= 8e-9)


def _launch(nproc: int, root: Path, cases: list[dict]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", str(nproc), "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()),
                           str(Path(__file__).parents[1] / "reshard_cases.py"), str(root), json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]


def _case(name: str, layout: str, checkpoints: Path, action: str = "train", **extra) -> dict:
    overrides = {**TINY, **LAYOUTS[layout][0], "fault.checkpoint_dir": str(checkpoints), **extra}
    return {"name": name, "action": action, "overrides": overrides}


def _digests(directory: Path) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """World 4 trains every layout; worlds 2 and 3 re-save and resume each that fits them, and world 2 meets two
    checkpoints that do not fit."""
    root = tmp_path_factory.mktemp("reshard")
    _launch(4, root, [_case(f"{name}-w4", name, root / f"{name}-w4" / "checkpoints") for name in LAYOUTS])
    for name, world in RESUMED:  # the runs read copies: the world-4 checkpoints stay as saved
        shutil.copytree(root / f"{name}-w4" / "checkpoints", root / f"{name}-copy{world}")
    bad_shape, lost_shard = root / "bad-shape", root / "lost-shard"
    shutil.copytree(root / "torch_ddp-w4" / "checkpoints", bad_shape)
    shutil.copytree(root / "fsdp2-w4" / "checkpoints", lost_shard)
    _lose_a_shard(lost_shard / f"step_{SAVED_AT:08d}")
    before = {d: _digests(d) for d in (bad_shape, lost_shard)}
    for world in (2, 3):
        cases = [c for name, w in RESUMED if w == world
                 for c in (_case(f"{name}-resave{world}", name, root / f"{name}-copy{world}", "resave"),
                           _case(f"{name}-w{world}", name, root / f"{name}-copy{world}"))]
        if world == 3:  # and back up: a world-2 checkpoint (the state loaded at 2, saved again) resumed on 3
            shutil.copytree(root / "torch_ddp-resave2" / "resaved", root / "grow-copy")
            cases.append(_case("grow-2-to-3", "torch_ddp", root / "grow-copy"))
        if world == 2:
            cases += [_case("bad-shape-run", "torch_ddp", bad_shape, "refuse", **{"model.n_embd": 48}),
                      _case("lost-shard-run", "fsdp2", lost_shard, "refuse")]
            for name, (source, change) in CROSS.items():
                shutil.copytree(root / f"{source}-w4" / "checkpoints", root / f"{name}-copy")
                cases += [_case(f"{name}-resave", source, root / f"{name}-copy", "resave", **change),
                          _case(f"{name}-w2", source, root / f"{name}-copy", **change)]
        _launch(world, root, cases)
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


def assert_continues_like(full, again, label: str) -> None:
    """The resumed run's steps 4 and 5 and its final weights equal the world-4 run's, within the tolerances (the
    same sums in another order)."""
    steps = {e["step"]: e["loss"] for e in _events(full, "step")}
    resumed = {e["step"]: e["loss"] for e in _events(again, "step")}
    assert sorted(resumed) == [4, 5]
    assert all(resumed[s] == pytest.approx(steps[s], rel=LOSS_TOLERANCE) for s in resumed)
    want, got = (torch.load(d / "final_model.pt", weights_only=True) for d in (full, again))
    assert want.keys() == got.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    print(f"{label}: losses {[resumed[s] / steps[s] - 1 for s in resumed]} relative, weights {worst:.3g}")
    assert worst <= WEIGHT_TOLERANCE, f"{label}: largest weight difference {worst:.3g}"


@pytest.mark.multiproc
@pytest.mark.parametrize("name, world", RESUMED)
def test_a_checkpoint_saved_by_4_loads_on_fewer_bit_for_bit(resharded, name, world):
    root, _ = resharded
    saved = gathered(root / f"{name}-w4" / "checkpoints" / f"step_{SAVED_AT:08d}")
    loaded = gathered(root / f"{name}-resave{world}" / "resaved" / f"step_{SAVED_AT:08d}")
    assert differences(_without_rng(saved), _without_rng(loaded)) == []
    assert any(torch.is_tensor(v) and v.numel() > 1 for v in _flat_optimizer(loaded)), "optimizer state was compared"
    assert saved["loader"] == loaded["loader"] and saved["step"] == loaded["step"] == SAVED_AT


def _flat_optimizer(state: dict) -> list:
    """Every value under an ``optim`` key, however deep (a tensor-parallel part nests it under ``tp0``, ``tp1``)."""
    def leaves(value):
        return [x for v in value.values() for x in leaves(v)] if isinstance(value, dict) else [value]
    return [x for key, value in state.items() if isinstance(value, dict)
            for x in (leaves(value) if key == "optim" else _flat_optimizer(value))]


@pytest.mark.multiproc
@pytest.mark.parametrize("name, world", RESUMED)
def test_the_resumed_run_continues_the_saved_one_on_fewer_ranks(resharded, name, world):
    root, _ = resharded
    full, again = root / f"{name}-w4", root / f"{name}-w{world}"
    (resume,) = _events(again, "resume")
    assert resume["next_step"] == SAVED_AT + 1 and resume["resharded"] is True
    assert resume["saved_world_size"] == 4 and resume["world_size"] == world
    assert_continues_like(full, again, f"{name} at world {world}")


@pytest.mark.multiproc
def test_a_world_grown_back_resumes_too(resharded):
    """A checkpoint of world 2 resumed on 3 (an elastic group that got a node back): ranks 0 and 1 take their saved
    random state, rank 2, which did not exist, keeps its own; the run goes on as the world-4 one did."""
    root, _ = resharded
    (resume,) = _events(root / "grow-2-to-3", "resume")
    assert resume["saved_world_size"] == 2 and resume["world_size"] == 3 and resume["resharded"] is True
    steps = {e["step"]: e["loss"] for e in _events(root / "torch_ddp-w4", "step")}
    resumed = {e["step"]: e["loss"] for e in _events(root / "grow-2-to-3", "step")}
    assert sorted(resumed) == [4, 5] and all(resumed[s] == pytest.approx(steps[s], rel=LOSS_TOLERANCE) for s in resumed)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", CROSS)
def test_a_checkpoint_of_another_layout_loads_bit_for_bit(resharded, name):
    """Each entry of the state loaded in the new layout equals, bit for bit, what the checkpoint holds under the old
    layout's names (a pipeline stage's block, or q, k and v joined into qkv: labkit.fault.reshard.sources)."""
    root, _ = resharded
    source = CROSS[name][0]
    saved = flat_state(gathered(root / f"{source}-w4" / "checkpoints" / f"step_{SAVED_AT:08d}"))
    loaded = flat_state(gathered(root / f"{name}-resave" / "resaved" / f"step_{SAVED_AT:08d}"))
    compared = 0
    for key, value in loaded.items():
        if key.startswith(("rng.", "optim.param_groups.")):
            continue  # each rank's own; this run's own (the learning rate follows the step)
        olds = sources(key, set(saved), blocks_per_stage(set(saved)))
        assert olds is not None, key
        want = joined([saved[old] for old in olds]) if torch.is_tensor(value) else saved[olds[0]]
        assert (torch.equal(value, want) if torch.is_tensor(value) else value == want), key
        compared += torch.is_tensor(value) and key.startswith("optim.state.")
    assert compared >= 3, "optimizer state was compared"


@pytest.mark.multiproc
@pytest.mark.parametrize("name", CROSS)
def test_a_run_resumed_in_another_layout_continues_the_saved_one(resharded, name):
    """Judged by labkit's own gathering of the final weights (final_model.pt: the GPT's names and shapes, whatever
    the layout), not by the translation under test."""
    root, _ = resharded
    full, again = root / f"{CROSS[name][0]}-w4", root / f"{name}-w2"
    (resume,) = _events(again, "resume")
    assert resume["next_step"] == SAVED_AT + 1 and resume["resharded"] is True
    assert_continues_like(full, again, name)


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
    new_rank = {"rng": {"rank3": {"cpu": torch.get_rng_state()}}}  # a rank the saving world did not have: its own
    assert fit_problems(path, {"model": {"w": torch.empty(4, 3), "b": torch.empty(3)}, "step": 0, **new_rank}) == []
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


# ---------------------------------------------------------------- elastic shrink under torchrun

ELASTIC_STEPS, ELASTIC_EVERY, KILL_AFTER = 300, 25, 60  # 300 tiny steps: long enough to lose a node mid-run
ELASTIC = {"run.steps": ELASTIC_STEPS, "fault.checkpoint_every": ELASTIC_EVERY, "fault.max_restarts": 1,
           "fault.keep_last": 3, "comm.timeout_s": 6.0, "run.threads_per_proc": 1}


def _elastic_node(config: Path, run_dir: Path, node: int, port: int) -> subprocess.Popen:
    """One of two torchrun agents (``--nnodes 1:2``: the run goes on with one); node 0 hosts the rendezvous store, so
    losing node 1 leaves the store alive. The rendezvous waits 10 s for a second node once one has come (last call):
    both start together, so the first group has both even when the machine is slow to start them."""
    conf = f"is_host={'true' if node == 0 else 'false'},last_call_timeout=10"
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "1:2", "--nproc-per-node", "1",
           "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
           run_dir.name, "--rdzv-conf", conf, "--local-addr", "127.0.0.1", "--monitor-interval", "0.1",
           "-m", "labkit", "train", str(config), "--run-dir", str(run_dir)]
    log = open(run_dir.parent / f"node{node}.log", "wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LABKIT_PROGRESS": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)


def _end_node(node: subprocess.Popen) -> None:
    if node.poll() is None:
        os.killpg(node.pid, signal.SIGKILL)
    node.wait()


@pytest.mark.multiproc
def test_an_elastic_run_that_loses_a_node_for_good_continues_resharded_on_fewer(tmp_path):
    """Two agents (one worker each) train; node 1 is killed, agent and worker, and never comes back. Node 0's worker
    fails on its next collective, its agent restarts it, the rendezvous closes with the one node left (min 1), and the
    run resumes from its newest checkpoint resharded onto world 1 (twice the gradient accumulation: the same global
    batch), says so in its events, and finishes every step. The steps done on 2 ranks before the loss and again on 1
    after it have the same losses within LOSS_TOLERANCE (the same sums in another order). The dashboard's title shows
    the drop (2 → 1)."""
    from helpers import tiny_config
    from labkit.config import save_config
    from labkit.widgets.dashboard_panels import world_sizes

    config, run_dir = tmp_path / "config.json", tmp_path / "run"
    save_config(tiny_config(**ELASTIC), config)
    port = free_port()
    nodes = [_elastic_node(config, run_dir, node, port) for node in (0, 1)]
    try:
        deadline = time.time() + 300
        while time.time() < deadline and all(n.poll() is None for n in nodes):
            if (run_dir / "events.jsonl").exists() and len(_events(run_dir, "step")) >= KILL_AFTER:
                break
            time.sleep(0.05)
        assert all(n.poll() is None for n in nodes), _node_logs(tmp_path)
        _end_node(nodes[1])  # for good
        nodes[0].wait(timeout=300)
    finally:
        for node in nodes:
            _end_node(node)
    assert nodes[0].returncode == 0, _node_logs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished", _node_logs(tmp_path)
    assert [e["world_size"] for e in _events(run_dir, "start")] == [2, 1]
    (resume,) = _events(run_dir, "resume")
    assert resume["resharded"] is True and resume["saved_world_size"] == 2 and resume["world_size"] == 1
    assert resume["next_step"] % ELASTIC_EVERY == 0 and KILL_AFTER - ELASTIC_EVERY <= resume["next_step"]
    before = {e["step"]: e["loss"] for e in _events(run_dir, "step") if e["time"] < resume["time"]}
    after = [e for e in _events(run_dir, "step") if e["time"] > resume["time"]]
    assert [e["step"] for e in after] == list(range(resume["next_step"], ELASTIC_STEPS))
    again = [(before[e["step"]], e["loss"]) for e in after if e["step"] in before]  # done on 2 ranks, then on 1
    assert len(again) >= KILL_AFTER - resume["next_step"]
    assert all(loss == pytest.approx(first, rel=LOSS_TOLERANCE) for first, loss in again)
    assert world_sizes(_events(run_dir, "start")) == "2 → 1"


def _node_logs(root: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(root.glob("node*.log")))


def test_a_corrupt_checkpoint_is_refused_by_name_and_kept_when_its_step_is_saved_again(group, tmp_path):
    """A flipped byte: the resume refuses that checkpoint in a line naming the file and takes the one before; when the
    run saves that step again the corrupt one is set aside (``.invalid``), byte for byte as it was, not replaced."""
    checkpointer = Checkpointer(tmp_path, keep=5, log=lambda line: None)
    for step in (1, 2):
        checkpointer.save(step, {"model": {"w": torch.full((4, 3), float(step))}, "step": step})
    corrupt = tmp_path / "step_00000002"
    flipped = flip_byte(corrupt)
    before = _digests(corrupt)
    lines = []
    path, state = Checkpointer(tmp_path, log=lines.append).restore(lambda: {"model": {"w": torch.empty(4, 3)},
                                                                             "step": 0})
    assert path.name == "step_00000001" and state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(4, 3))
    assert lines == [f"checkpoint skipped: step_00000002: {flipped.name} does not match its SHA-256 (corrupted); "
                     "trying the previous one"]
    checkpointer.save(2, {"model": {"w": torch.full((4, 3), 2.0)}, "step": 2})
    assert _digests(tmp_path / "step_00000002.invalid") == before and verify(corrupt) is None
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000001"]


def test_with_every_checkpoint_corrupt_the_resume_is_refused_naming_each_and_changes_nothing(group, tmp_path):
    """No valid checkpoint left: the run stops with one error naming each checkpoint's problem, instead of starting
    afresh beside them (which would throw the run's progress away unasked); the directory stays byte for byte."""
    checkpointer = Checkpointer(tmp_path, keep=5, log=lambda line: None)
    for step in (1, 2):
        checkpointer.save(step, {"model": {"w": torch.full((4, 3), float(step))}, "step": step})
    newest, oldest = flip_byte(tmp_path / "step_00000002"), tmp_path / "step_00000001" / "manifest.json"
    oldest.write_text("{")
    before, lines = _digests(tmp_path), []
    with pytest.raises(CheckpointMismatch, match=(
            rf"no valid checkpoint to resume from in {re.escape(str(tmp_path))}: step_00000002: {newest.name} does "
            r"not match its SHA-256 \(corrupted\); step_00000001: unreadable manifest\.json .*Nothing was loaded")):
        Checkpointer(tmp_path, log=lines.append).restore(lambda: {"model": {"w": torch.empty(4, 3)}, "step": 0})
    assert _digests(tmp_path) == before and len(lines) == 2
    assert Checkpointer(tmp_path / "none", log=lines.append).restore(dict) is None  # no checkpoint: a fresh start


def test_the_loader_resumes_at_the_same_global_sample_on_fewer_ranks():
    """A world-4 loader's position, loaded by 2 and by 3 ranks (with the accumulation that keeps the global batch):
    the next step reads exactly the samples the 4 ranks would have, each once; and so on for the steps after."""
    from labkit.data.loader import ShardedLoader, TokenDataset

    data = TokenDataset(torch.arange(2000), block_size=8)

    def loaders(world: int) -> list:
        return [ShardedLoader(data, 1, rank, world, 12 // world, seed=3) for rank in range(world)]

    def next_steps(group: list, steps: int) -> list[list[int]]:
        return [sorted(int(i) for loader in group for _ in range(loader.grad_accum) for i in loader.next_indices())
                for _ in range(steps)]

    four = loaders(4)
    next_steps(four, 5)  # five steps done at world 4, then a checkpoint
    saved = four[0].state_dict()
    for world in (2, 3):
        fewer = loaders(world)
        for loader in fewer:
            loader.load_state_dict(saved)
        want = next_steps([ShardedLoader(data, 1, r, 4, 3, seed=3) for r in range(4)], 8)[5:]
        got = next_steps(fewer, 3)
        assert got == want and all(len(set(step)) == 12 for step in got)


class _Saved:
    """A checkpoint metadata entry of a tensor: its whole shape (what relayout_plan reads)."""

    def __init__(self, *size):
        self.size = torch.Size(size)


def test_another_layouts_names_are_translated_stage_by_stage_and_q_k_v_joined():
    stages = {"pp0.model.wte.weight": _Saved(16, 8), "pp0.model.blocks.0.attn.q.weight": _Saved(8, 8),
              "pp0.model.blocks.0.attn.k.weight": _Saved(8, 8), "pp0.model.blocks.0.attn.v.weight": _Saved(8, 8),
              "pp1.model.blocks.0.mlp.weight": _Saved(32, 8), "pp1.model.lm_head.weight": _Saved(16, 8),
              "pp1.optim.state.blocks.0.mlp.weight.exp_avg": _Saved(32, 8), "step": object()}
    whole = {"model.wte.weight": torch.empty(16, 8), "model.blocks.0.attn.qkv.weight": torch.empty(24, 8),
             "model.blocks.1.mlp.weight": torch.empty(32, 8), "model.lm_head.weight": torch.empty(16, 8),
             "optim.state.blocks.1.mlp.weight.exp_avg": torch.empty(32, 8), "optim.param_groups.0.lr": 0.1, "step": 0}
    plan, problems = relayout_plan(stages, whole)
    assert problems == []
    assert plan == {"model.wte.weight": ["pp0.model.wte.weight"],
                    "model.blocks.0.attn.qkv.weight": [f"pp0.model.blocks.0.attn.{x}.weight" for x in "qkv"],
                    "model.blocks.1.mlp.weight": ["pp1.model.blocks.0.mlp.weight"],
                    "model.lm_head.weight": ["pp1.model.lm_head.weight"],
                    "optim.state.blocks.1.mlp.weight.exp_avg": ["pp1.optim.state.blocks.0.mlp.weight.exp_avg"],
                    "optim.param_groups.0.lr": [], "step": ["step"]}
    _, problems = relayout_plan(stages, {**whole, "model.blocks.1.mlp.weight": torch.empty(64, 8)})
    assert problems == ["model.blocks.1.mlp.weight has shape [32, 8] in the checkpoint "
                        "(pp1.model.blocks.0.mlp.weight), [64, 8] here"]


def test_labkits_own_tensor_parallel_slices_are_refused_at_another_tp_degree():
    _, (problem,) = relayout_plan({"tp0.model.wte.weight": _Saved(8, 8), "step": object()},
                                  {"model.wte.weight": torch.empty(16, 8), "step": 0})
    assert "labkit's own tensor-parallel" in problem and "parallel.tp.impl=dtensor resumes at any tp degree" in problem
