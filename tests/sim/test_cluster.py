"""The cluster catalog: peaks from labkit.hardware, links per level, and which link a group uses."""
import ast
from pathlib import Path

import pytest

import labkit.sim
from labkit.hardware import gpu_peak_tflops
from labkit.sim.cluster import CLUSTERS, cluster


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_every_cluster_has_a_peak_memory_two_levels_and_sources(name):
    c = CLUSTERS[name]
    dtype = "fp16" if "V100" in c.gpu.name else "bf16"
    assert c.gpu.peak_flops(dtype) == gpu_peak_tflops(c.gpu.name, dtype) * 1e12
    assert c.gpu.memory_bytes > 0 and c.gpu.source and c.source
    assert c.intra.bandwidth > c.inter.bandwidth > 0  # NVLink is faster than any NIC share
    assert c.intra.source and c.inter.source


def test_the_catalog_has_the_issues_gpus():
    names = {c.gpu.name for c in CLUSTERS.values()}
    for gpu in ("V100", "A100", "H100", "H200", "B200"):
        assert any(gpu in n for n in names), gpu


def test_v100_has_no_bf16_peak():
    with pytest.raises(ValueError, match="bf16"):
        cluster("dgx2h-v100").gpu.peak_flops("bf16")


def test_groups_use_the_link_of_their_span():
    c = cluster("dgx-a100")
    assert c.link_for(1, 1) is None
    assert c.link_for(1, 8) is c.intra  # a TP group of 8 fills a node
    assert c.link_for(1, 16) is c.inter
    assert c.link_for(4, 2) is c.intra  # 2 ranks 4 apart: still one node
    assert c.link_for(8, 2) is c.inter


def test_resizing_and_unknown_names():
    assert cluster("dgx-a100", 1536).nodes == 192
    assert cluster("dgx-a100", 3).nodes == 1
    assert cluster("dgx2h-v100", 512).gpus == 512
    with pytest.raises(ValueError, match="unknown cluster"):
        cluster("tpu-v4")


def test_the_package_init_imports_nothing():
    """``import labkit.sim.<module>`` must stay cheap: the package itself imports nothing."""
    tree = ast.parse(Path(labkit.sim.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_the_catalog_has_the_a100_40gb_beside_the_80gb():
    """The 40 GB A100: the 80 GB's peak, SMs and network, half the memory, HBM2 at 1,555 GB/s (the 80 GB: 2,039), so
    the model's memory-bound terms run 2,039/1,555 times longer on it, and GEMMs too narrow for their FLOPs (the
    roofline of labkit.sim.gemm) a little longer."""
    assert "dgx-a100-40gb" in CLUSTERS
    small, big = cluster("dgx-a100-40gb", 8), cluster("dgx-a100", 8)
    assert (small.gpu.memory_bytes, small.gpu.memory_bandwidth) == (40e9, 1555e9)
    assert small.gpu.peak_flops("bf16") == big.gpu.peak_flops("bf16") == 312e12
    assert (small.intra, small.inter) == (big.intra, big.inter)
    from labkit.sim.step import Layout, ModelShape, step_time

    shape, layout = ModelShape(6144, 48, 64, 2048, 51200), Layout(tp=8, micro_batch=4)
    on_40, on_80 = step_time(shape, layout, small), step_time(shape, layout, big)
    assert on_40.attention_memory == pytest.approx(on_80.attention_memory * 2039 / 1555)
    assert small.gpu.sms == big.gpu.sms == 108
    assert on_80.compute < on_40.compute < 1.01 * on_80.compute and on_40.gpu_memory == 40e9
