"""The rank grid (labkit.parallel.mesh): pure layout arithmetic, torch's own meshes, and real gloo groups."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from labkit.distributed import DistEnv
from labkit.launcher import free_port
from labkit.parallel.mesh import AXES, WORLD, ParallelDims, RankGrid, build_grid

WORKER = Path(__file__).parent / "mesh_worker.py"


def _cfg(dp="auto", tp=1, pp=1):
    return SimpleNamespace(parallel=SimpleNamespace(dp=SimpleNamespace(degree=dp), tp=SimpleNamespace(degree=tp),
                                                    pp=SimpleNamespace(degree=pp)))


def test_coordinates_and_ranks_are_inverse_and_tp_is_innermost():
    dims = ParallelDims(dp=2, pp=3, tp=4)
    assert dims.world_size == 24 and dims.shape == (3, 2, 1, 4)  # AXES: pp, dp, cp, tp (torchtitan's order)
    assert [dims.rank_at(**dims.coordinate(r)) for r in range(24)] == list(range(24))
    assert dims.coordinate(5) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    assert dims.axis_ranks(5, "tp") == [4, 5, 6, 7]  # neighbours: one node's fastest links
    assert dims.axis_ranks(5, "dp") == [1, 5]
    assert dims.axis_ranks(5, "pp") == [5, 13, 21]  # outermost: the stages furthest apart (across nodes)
    assert dims.axis_ranks(5, WORLD) == list(range(24))
    with pytest.raises(ValueError, match="outside the grid"):
        dims.coordinate(24)
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'"):
        dims.size("ep")
    assert dims.axis_ranks(5, "dp_cp") == dims.axis_ranks(5, "dp")  # cp = 1: the gradient axis is dp


def test_context_parallel_sits_between_dp_and_tp_and_averages_with_dp():
    """r = ((p·dp + d)·cp + c)·tp + t; the dp_cp group holds every rank that differs only on dp or cp."""
    dims = ParallelDims(dp=2, pp=2, tp=2, cp=2)
    assert dims.shape == (2, 2, 2, 2) and dims.world_size == 16
    assert [dims.rank_at(**dims.coordinate(r)) for r in range(16)] == list(range(16))
    assert dims.coordinate(11) == {"pp": 1, "dp": 0, "cp": 1, "tp": 1}
    assert dims.axis_ranks(11, "cp") == [9, 11]
    assert dims.axis_ranks(11, "tp") == [10, 11]
    assert dims.axis_ranks(11, "pp") == [3, 11]
    assert dims.axis_ranks(11, "dp_cp") == [9, 11, 13, 15]  # index d·cp + c: a block of neighbours in one stage
    assert [dims.coordinate_on(r, "dp_cp") for r in (9, 11, 13, 15)] == [0, 1, 2, 3]
    assert dims.size("dp_cp") == 4 and dims.describe() == "pp=2 × dp=2 × cp=2 × tp=2"
    assert ParallelDims(dp=4).describe() == "pp=1 × dp=4 × tp=1"  # an axis of 1 that was never there is not named


def test_dp_auto_takes_what_cp_leaves_too():
    cfg = _cfg(tp=2)
    cfg.parallel.cp = SimpleNamespace(degree=2)
    assert ParallelDims.from_config(cfg, 8) == ParallelDims(dp=2, tp=2, cp=2)


def test_dp_auto_takes_what_tp_and_pp_leave():
    assert ParallelDims.from_config(_cfg(), 8) == ParallelDims(8, 1, 1)
    assert ParallelDims.from_config(_cfg(tp=2, pp=2), 8) == ParallelDims(2, 2, 2)
    assert ParallelDims.from_config(_cfg(dp=4, tp=2), 8) == ParallelDims(4, 1, 2)


def test_a_hand_made_env_is_a_data_parallel_grid_of_the_world():
    env = DistEnv(1, 4, 1, 4, "cpu", "gloo", 1)
    assert env.grid.dims == ParallelDims(dp=4)
    assert env.grid.coord("dp") == 1 and env.grid.size("dp") == 4 and env.grid.group("dp") is None
    with pytest.raises(RuntimeError, match="without a device mesh"):
        RankGrid(ParallelDims(2, 1, 2), 0).group("dp")


@pytest.mark.parametrize("rank", [0, 13, 37, 63])
def test_torch_device_mesh_at_scale_matches_the_arithmetic_on_the_fake_process_group(rank):
    """A dry run at 64 ranks on torch's fake process group (no communication: it lays out groups only)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = ParallelDims(dp=4, pp=2, tp=4, cp=2)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=64)
    try:
        grid = build_grid(dims, rank, "cpu")
        assert list(grid.device_mesh.get_coordinate()) == [grid.coord(a) for a in AXES]
        for axis in (*AXES, "dp_cp"):
            assert dist.get_process_group_ranks(grid.group(axis)) == dims.axis_ranks(rank, axis), axis
            assert grid.submesh(axis).size() == dims.size(axis)
    finally:
        dist.destroy_process_group()


def _run_grid(tmp_path, dp, pp, tp, cp=1):
    world = dp * pp * tp * cp
    out = tmp_path / f"{dp}x{pp}x{tp}x{cp}"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           str(WORKER), str(dp), str(pp), str(tp), str(cp), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ParallelDims(dp, pp, tp, cp), [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.multiproc
@pytest.mark.parametrize("shape", [(2, 1, 2), (1, 2, 2), (4, 1, 1), (2, 1, 1, 2)])
def test_real_gloo_groups_follow_the_grid_and_strategies_average_over_the_gradient_axis(tmp_path, shape):
    """Strategies average over dp (× cp: the ranks holding the same parameters), never tp or pp; the loader gives
    each dp coordinate its own samples, and every rank of one replica — its tp, pp and cp ranks — the same ones."""
    dims, seen = _run_grid(tmp_path, *shape)
    for rank, s in enumerate(seen):
        assert s["coordinate"] == s["mesh_coordinate"] == [dims.coordinate(rank)[a] for a in AXES]
        for axis in (*AXES, "dp_cp"):
            members = dims.axis_ranks(rank, axis)
            assert s["groups"][axis] == members
            assert s["sums"][axis] == sum(members)  # an all-reduce over the axis reached its members only
        replicas = dims.axis_ranks(rank, "dp_cp")
        assert s["weight_after_wrap"] == replicas[0]  # every replica starts from the first one's weights
        assert s["averaged_grad"] == sum(replicas) / len(replicas)  # averaged over dp × cp, not the world
        same_replica = [seen[r]["indices"] for r in
                        dims.axis_ranks(rank, "tp") + dims.axis_ranks(rank, "pp") + dims.axis_ranks(rank, "cp")]
        assert all(i == s["indices"] for i in same_replica)  # parts of one replica read the same samples
    shards = {tuple(s["indices"]) for s in seen}
    assert len(shards) == dims.dp  # and each dp coordinate reads its own
    assert len({i for shard in shards for i in shard}) == 2 * dims.dp
