"""The cluster catalog: GPUs, the links between them, and whole clusters — each figure with its source.

A cluster here is what the step model needs and nothing more: how fast one GPU multiplies (its dense
peak, from :data:`labkit.hardware.PEAK_TFLOPS`, or a measured rate for a calibrated device), how much memory it
has and how fast that memory streams (HBM bandwidth, for the memory-bound kernels), and two levels of network:

* **intra** — inside a node (NVLink through NVSwitch): every GPU of the node reaches every other.
* **inter** — between nodes (InfiniBand or Ethernet): the node's NICs, shared by its GPUs.

Bandwidths are **per GPU, per direction**, in bytes/s: what one rank can push into a ring at once.
Vendors often quote NVLink *bidirectional* (V100 "300 GB/s" = 150 GB/s each way); the catalog halves
those. For the inter level it is the node's NIC bandwidth divided by its GPUs (a DGX has one NIC per
GPU), as every GPU of a node talks at once in a data-parallel all-reduce.

Latencies are per message (α in the α–β model): a few µs for NVLink, more for a NIC. They are order
of magnitude figures (NCCL's tuning model uses a few µs per hop), and matter only for small messages.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from labkit.hardware import gpu_peak_tflops

GB = 1e9


@dataclass(frozen=True)
class Link:
    """One network level: per-GPU, per-direction bandwidth (bytes/s) and per-message latency (s), and the
    collective algorithms its library chooses between per message (NCCL: ring or tree; gloo: the ring)."""
    name: str
    bandwidth: float
    latency: float
    source: str
    algorithms: tuple[str, ...] = ("ring", "tree")


@dataclass(frozen=True)
class GPU:
    """A GPU model: its exact torch name (the key of labkit.hardware's peak table), its memory and the
    memory's bandwidth (bytes/s), and its streaming multiprocessors (``sms``: how many GEMM tiles run at once,
    :mod:`labkit.sim.gemm`). ``peaks`` (TFLOP/s by precision) replaces the datasheet table for a device
    that has none: a CPU whose rate was measured (:mod:`labkit.sim.calibrate`)."""
    name: str
    memory_bytes: float
    source: str
    memory_bandwidth: float = float("inf")  # bytes/s; inf: memory-bound kernels cost nothing
    peaks: Optional[tuple[tuple[str, float], ...]] = None  # ((precision, TFLOP/s), ...) instead of the table
    sms: Optional[int] = None  # streaming multiprocessors (datasheet), for labkit.sim.gemm; None: no waves

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s at ``precision`` (``peaks``, else labkit.hardware's datasheet table);
        ValueError if none."""
        tflops = dict(self.peaks).get(precision) if self.peaks is not None else gpu_peak_tflops(self.name, precision)
        if not tflops:
            raise ValueError(f"{self.name} has no published dense {precision} peak")
        return tflops * 1e12


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` GPUs, an ``intra`` link inside a node, ``inter`` between."""
    name: str
    gpu: GPU
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link
    source: str

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def with_gpus(self, gpus: int) -> "Cluster":
        """The same cluster with enough nodes for ``gpus`` GPUs (at least one node)."""
        return dataclasses.replace(self, nodes=max(1, -(-gpus // self.gpus_per_node)))

    def link_for(self, stride: int, size: int) -> Optional[Link]:
        """The link a group of ``size`` ranks ``stride`` apart uses: ``intra`` if it fits in one node,
        else ``inter`` (its slowest hop); ``None`` for a group of one (no communication)."""
        if size <= 1:
            return None
        return self.intra if stride * size <= self.gpus_per_node else self.inter


V100 = GPU("Tesla V100-SXM2-32GB", 32 * GB, "NVIDIA V100 datasheet: 125 TFLOP/s fp16 tensor, 32 GB HBM2 at 900 GB/s",
           900 * GB, sms=80)
A100 = GPU("NVIDIA A100-SXM4-80GB", 80 * GB,
           "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 80 GB HBM2e at 2,039 GB/s", 2039 * GB, sms=108)
A100_40GB = GPU("NVIDIA A100-SXM4-40GB", 40 * GB,
                "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 40 GB HBM2 at 1,555 GB/s", 1555 * GB, sms=108)
H100 = GPU("NVIDIA H100 80GB HBM3", 80 * GB,
           "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense, 80 GB HBM3 at 3.35 TB/s", 3350 * GB, sms=132)
H200 = GPU("NVIDIA H200", 141 * GB,
           "NVIDIA H200 SXM datasheet: H100's 989 TFLOP/s bf16 dense, 141 GB HBM3e at 4.8 TB/s", 4800 * GB, sms=132)
B200 = GPU("NVIDIA B200", 180 * GB,
           "NVIDIA DGX B200 datasheet: 2.25 PFLOP/s bf16 dense, 1,440 GB over 8 GPUs at 64 TB/s (8 TB/s each)",
           8000 * GB, sms=148)

NVSWITCH_V100 = Link("NVSwitch (NVLink 2)", 150 * GB, 5e-6,
                     "DGX-2: 6 NVLink 2 links x 25 GB/s each way per V100 (300 GB/s bidirectional)")
NVSWITCH_A100 = Link("NVSwitch (NVLink 3)", 300 * GB, 5e-6,
                     "DGX A100: 12 NVLink 3 links x 25 GB/s each way (600 GB/s bidirectional)")
NVSWITCH_H100 = Link("NVSwitch (NVLink 4)", 450 * GB, 5e-6,
                     "DGX H100/H200: 18 NVLink 4 links, 900 GB/s bidirectional")
NVSWITCH_B200 = Link("NVSwitch (NVLink 5)", 900 * GB, 5e-6, "DGX B200: NVLink 5, 1.8 TB/s bidirectional per GPU")
IB_EDR_DGX2H = Link("InfiniBand EDR", 100 * GB / 16, 10e-6,
                    "DGX-2H: 8 x 100 Gb/s EDR per 16 GPUs = 100 GB/s per server (Shoeybi et al. 2019)")
IB_HDR = Link("InfiniBand HDR", 25 * GB, 10e-6, "DGX A100 (Selene): 8 x 200 Gb/s HDR per 8 GPUs, one NIC per GPU")
IB_NDR = Link("InfiniBand NDR", 50 * GB, 10e-6, "DGX H100/H200/B200: 8 x 400 Gb/s NDR (ConnectX-7), one NIC per GPU")
ETHERNET_100G = Link("Ethernet 100 Gb/s", 100e9 / 8 / 8, 30e-6,
                     "one 100 Gb/s NIC shared by 8 GPUs (a modest cloud node)")

CLUSTERS: dict[str, Cluster] = {
    "dgx2h-v100": Cluster("dgx2h-v100", V100, 16, 32, NVSWITCH_V100, IB_EDR_DGX2H,
                          "32 DGX-2H, 512 V100 (Shoeybi et al. 2019, arXiv:1909.08053, §5)"),
    "dgx-a100": Cluster("dgx-a100", A100, 8, 280, NVSWITCH_A100, IB_HDR,
                        "Selene-like DGX A100 SuperPOD (Narayanan et al. 2021, arXiv:2104.04473, §5)"),
    "dgx-a100-40gb": Cluster("dgx-a100-40gb", A100_40GB, 8, 32, NVSWITCH_A100, IB_HDR,
                             "DGX A100 320GB nodes: the 40 GB A100 (less memory, 1,555 GB/s), the 80 GB's network"),
    "dgx-a100-ethernet": Cluster("dgx-a100-ethernet", A100, 8, 16, NVSWITCH_A100, ETHERNET_100G,
                                 "DGX A100 nodes on 100 Gb/s Ethernet: an illustration, not a product"),
    "dgx-h100": Cluster("dgx-h100", H100, 8, 32, NVSWITCH_H100, IB_NDR, "DGX H100 SuperPOD reference architecture"),
    "dgx-h200": Cluster("dgx-h200", H200, 8, 32, NVSWITCH_H100, IB_NDR, "DGX H200 (H100 networking, more memory)"),
    "dgx-b200": Cluster("dgx-b200", B200, 8, 32, NVSWITCH_B200, IB_NDR, "DGX B200 SuperPOD reference architecture"),
}


def cluster(name: str, gpus: Optional[int] = None) -> Cluster:
    """A catalog cluster by name, resized to ``gpus`` GPUs when given."""
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster {name!r}: choose one of {', '.join(CLUSTERS)}")
    return CLUSTERS[name] if gpus is None else CLUSTERS[name].with_gpus(gpus)
