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
from labkit.parallel.mesh import AXES, FLATTENED, HSDP, WORLD, ParallelDims, RankGrid, build_grid

WORKER = Path(__file__).parent / "mesh_worker.py"


def _cfg(dp="auto", tp=1, pp=1):
    return SimpleNamespace(parallel=SimpleNamespace(dp=SimpleNamespace(degree=dp), tp=SimpleNamespace(degree=tp),
                                                    pp=SimpleNamespace(degree=pp)))


def test_coordinates_and_ranks_are_inverse_and_tp_is_innermost():
    dims = ParallelDims(dp=2, pp=3, tp=4)
    assert dims.world_size == 24 and dims.shape == (3, 1, 2, 1, 1, 4)  # AXES: pp, dp_replicate, dp_shard, ep, cp, tp
    assert [dims.rank_at(**dims.coordinate(r)) for r in range(24)] == list(range(24))
    assert dims.coordinate(5) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    assert dims.axis_ranks(5, "tp") == [4, 5, 6, 7]  # neighbours: one node's fastest links
    assert dims.axis_ranks(5, "dp") == [1, 5]
    assert dims.axis_ranks(5, "pp") == [5, 13, 21]  # outermost: the stages furthest apart (across nodes)
    assert dims.axis_ranks(5, WORLD) == list(range(24))
    with pytest.raises(ValueError, match="outside the grid"):
        dims.coordinate(24)
    with pytest.raises(ValueError, match="unknown mesh axis 'sp'"):
        dims.size("sp")
    assert dims.axis_ranks(5, "dp_cp") == dims.axis_ranks(5, "dp")  # cp = 1: the gradient axis is dp


def test_context_parallel_sits_between_dp_and_tp_and_averages_with_dp():
    """r = ((p·dp + d)·cp + c)·tp + t; the dp_cp group holds every rank that differs only on dp or cp."""
    dims = ParallelDims(dp=2, pp=2, tp=2, cp=2)
    assert dims.shape == (2, 1, 2, 1, 2, 2) and dims.world_size == 16
    assert [dims.rank_at(**dims.coordinate(r)) for r in range(16)] == list(range(16))
    assert dims.coordinate(11) == {"pp": 1, "dp": 0, "cp": 1, "tp": 1}
    assert dims.axis_ranks(11, "cp") == [9, 11]
    assert dims.axis_ranks(11, "tp") == [10, 11]
    assert dims.axis_ranks(11, "pp") == [3, 11]
    assert dims.axis_ranks(11, "dp_cp") == [9, 11, 13, 15]  # index d·cp + c: a block of neighbours in one stage
    assert [dims.coordinate_on(r, "dp_cp") for r in (9, 11, 13, 15)] == [0, 1, 2, 3]
    assert dims.size("dp_cp") == 4 and dims.describe() == "pp=2 × dp=2 × cp=2 × tp=2"
    assert ParallelDims(dp=4).describe() == "pp=1 × dp=4 × tp=1"  # an axis of 1 that was never there is not named


def test_hsdp_splits_dp_into_replica_groups_of_shards_that_hold_whole_cp_groups():
    """d = d_r · dp_shard + d_s: a shard group (dp_shard × cp) is a block of neighbours; replicas of it are strided."""
    dims = ParallelDims(dp=4, pp=1, tp=2, cp=2, dp_shard=2)
    assert dims.shape == (1, 2, 2, 1, 2, 2) and dims.world_size == 16
    assert dims.sizes() == {"pp": 1, "dp": 4, "cp": 2, "tp": 2, "dp_shard": 2}  # what a start event records
    assert [dims.rank_at(**dims.coordinate(r)) for r in range(16)] == list(range(16))
    assert dims.coordinate(13) == {"pp": 0, "dp": 3, "cp": 0, "tp": 1}
    assert dims.axis_ranks(13, "dp_shard_cp") == [9, 11, 13, 15]  # 2 replicas × their 2 cp ranks: one shard group
    assert dims.axis_ranks(13, "dp_replicate") == [5, 13]  # the same shard in the other group
    assert dims.axis_ranks(13, "dp") == [1, 5, 9, 13] and dims.axis_ranks(13, "dp_cp") == [1, 3, 5, 7, 9, 11, 13, 15]
    assert dims.describe() == "pp=1 × dp=4 (2 replicate × 2 shard) × cp=2 × tp=2"
    with pytest.raises(ValueError, match="must divide dp=4"):
        ParallelDims(dp=4, dp_shard=3)


def test_expert_parallelism_borrows_the_innermost_dp_ranks_and_experts_average_over_the_rest():
    """d = (d_r·dp_shard + d_s)·ep + e: an ep group is a block of dp neighbours (within a cp and tp coordinate); the
    ranks holding the same experts (expert_dp_cp) are the dp × cp ranks at the same ep coordinate."""
    dims = ParallelDims(dp=4, tp=2, cp=2, ep=2)
    assert dims.shape == (1, 1, 2, 2, 2, 2) and dims.world_size == 16
    assert dims.sizes() == {"pp": 1, "dp": 4, "cp": 2, "tp": 2, "ep": 2}
    assert [dims.rank_at(**dims.coordinate(r)) for r in range(16)] == list(range(16))
    assert dims.coordinate(13) == {"pp": 0, "dp": 3, "cp": 0, "tp": 1} and dims.coordinate_on(13, "ep") == 1
    assert dims.axis_ranks(13, "ep") == [9, 13]  # dp 2 and 3: the same cp and tp coordinate
    assert dims.axis_ranks(13, "dp") == [1, 5, 9, 13]  # every replica still reads its own sequences
    assert dims.axis_ranks(13, "expert_dp_cp") == [5, 7, 13, 15]  # ep coordinate 1: the same experts
    assert dims.axis_ranks(13, "dp_cp") == [1, 3, 5, 7, 9, 11, 13, 15]
    assert dims.describe() == "pp=1 × dp=4 (ep=2) × cp=2 × tp=2"
    assert ParallelDims(dp=4, ep=4).axis_ranks(2, "expert_dp_cp") == [2]  # each rank alone with its experts
    with pytest.raises(ValueError, match="ep=3 must divide"):
        ParallelDims(dp=4, ep=3)


def test_the_shard_degree_counts_ranks_of_dp_x_cp_and_only_whole_cp_groups_make_hsdp():
    def dims(shard, cp=1, world=8):
        cfg = _cfg()
        cfg.parallel.cp = SimpleNamespace(degree=cp)
        cfg.parallel.dp.shard_degree = shard
        return ParallelDims.from_config(cfg, world)
    assert dims(0) == dims(8) == ParallelDims(dp=8)  # one shard group of every replica: plain FSDP
    assert dims(2) == ParallelDims(dp=8, dp_shard=2) and dims(4, cp=2) == ParallelDims(dp=4, cp=2, dp_shard=2)
    assert dims(8, cp=2) == ParallelDims(dp=4, cp=2)  # all 8 ranks of dp × cp: one shard group
    assert dims(3) == ParallelDims(dp=8) and dims(1, cp=2) == ParallelDims(dp=4, cp=2)  # refused by fsdp2's checks


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
@pytest.mark.parametrize("dp_shard", [0, 2])
def test_torch_device_mesh_at_scale_matches_the_arithmetic_on_the_fake_process_group(rank, dp_shard):
    """A dry run at 64 ranks on torch's fake process group (no communication: it lays out groups only); with
    and without HSDP's split of dp."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = ParallelDims(dp=4, pp=2, tp=4, cp=2, dp_shard=dp_shard)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=64)
    try:
        grid = build_grid(dims, rank, "cpu")
        assert list(grid.device_mesh.get_coordinate()) == [grid.coord(a) for a in AXES]
        if dp_shard:  # HSDP's 2-D mesh: rows are the replica groups, columns the shard group
            hsdp = grid.submesh(("dp_replicate", "dp_shard_cp"))
            assert hsdp.shape == (2, 4) and tuple(hsdp.get_coordinate()) == (grid.coord("dp_replicate"),
                                                                      grid.coord("dp_shard_cp"))
            for dim, axis in enumerate(HSDP):
                assert dist.get_process_group_ranks(hsdp.get_group(dim)) == dims.axis_ranks(rank, axis), axis
        for axis in (*AXES, *FLATTENED):
            assert dist.get_process_group_ranks(grid.group(axis)) == dims.axis_ranks(rank, axis), axis
            assert grid.submesh(axis).size() == dims.size(axis)
    finally:
        dist.destroy_process_group()


def _run_grid(tmp_path, dp, pp, tp, cp=1, dp_shard=0):
    world = dp * pp * tp * cp
    out = tmp_path / f"{dp}x{pp}x{tp}x{cp}x{dp_shard}"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           str(WORKER), str(dp), str(pp), str(tp), str(cp), str(dp_shard), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return ParallelDims(dp, pp, tp, cp, dp_shard), seen


@pytest.mark.multiproc
@pytest.mark.parametrize("shape", [(2, 1, 2), (1, 2, 2), (4, 1, 1), (2, 1, 1, 2), (4, 1, 1, 1, 2)])
def test_real_gloo_groups_follow_the_grid_and_strategies_average_over_the_gradient_axis(tmp_path, shape):
    """Strategies average over dp (× cp: the ranks holding the same parameters), never tp or pp; the loader gives
    each dp coordinate its own samples, and every rank of one replica — its tp, pp and cp ranks — the same ones."""
    dims, seen = _run_grid(tmp_path, *shape)
    for rank, s in enumerate(seen):
        assert s["coordinate"] == s["mesh_coordinate"] == [dims.coordinate_on(rank, a) for a in AXES]
        for axis in (*AXES, *FLATTENED):
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
