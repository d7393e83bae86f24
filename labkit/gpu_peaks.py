"""The GPUs' peak FLOP/s, from the vendors' datasheets: what a GPU run's MFU is a percentage of.

Dense (not 2:4-sparse) tensor-core figures, one row per device name exactly as ``torch.cuda.get_device_name()``
reports it. A device not listed, or a precision its datasheet does not give, has no peak: MFU is then "n/a"
(``labkit.hardware.device_peak`` says so), never a neighbour's number.
"""
from __future__ import annotations

from typing import Optional

# TFLOP/s per device, dense (not 2:4-sparse), from the vendors' datasheets. Where a datasheet gives only
# the sparse figure (marked "*"), the dense one is half of it. A precision the datasheet does not give, or
# the device lacks, is absent or None: MFU is then "n/a".
H100_SXM = {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}  # H100 SXM5 and H200 SXM
H100_PCIE = {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}
HOPPER_NVL = {"fp8": 1670.5, "bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}  # H100 NVL, H200 NVL
A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}  # SXM4 and PCIe, 40 and 80 GB alike
V100_SXM2 = {"bf16": None, "fp16": 125.0, "tf32": None, "fp32": 15.7}  # Volta: no bf16, no tf32
V100_PCIE = {"bf16": None, "fp16": 112.0, "tf32": None, "fp32": 14.0}

# Keyed by the exact name torch.cuda.get_device_name() reports. A new SKU gets its own row, never a
# neighbour's: "L40" is not an "L4", an "A10G" is not an "A10", an "H100 NVL" is not an SXM part.
PEAK_TFLOPS: dict[str, dict[str, Optional[float]]] = {
    "NVIDIA B200": {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},  # HGX B200
    "NVIDIA H200": H100_SXM,  # H200 SXM: H100's compute, more memory
    "NVIDIA H200 NVL": HOPPER_NVL,
    "NVIDIA H100 80GB HBM3": H100_SXM,  # H100 SXM5
    "NVIDIA H100 PCIe": H100_PCIE,
    "NVIDIA H100 NVL": HOPPER_NVL,  # per GPU of the NVLink-bridged pair
    "NVIDIA A100-SXM4-40GB": A100,
    "NVIDIA A100-SXM4-80GB": A100,
    "NVIDIA A100-PCIE-40GB": A100,
    "NVIDIA A100 80GB PCIe": A100,
    "NVIDIA L40S": {"fp8": 733.0, "bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "NVIDIA L40": {"fp8": 362.0, "bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "NVIDIA L4": {"fp8": 242.5, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "NVIDIA A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "NVIDIA A10G": {},  # AWS's variant of the A10, with its own clocks: NVIDIA publishes no figures for it
    "NVIDIA GeForce RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},  # fp32 accumulate
    "NVIDIA GeForce RTX 4090 D": {},  # the cut-down 4090 sold in China: no published tensor figures
    "Tesla V100-SXM2-16GB": V100_SXM2,
    "Tesla V100-SXM2-32GB": V100_SXM2,
    "Tesla V100-PCIE-16GB": V100_PCIE,
    "Tesla V100-PCIE-32GB": V100_PCIE,
    "Tesla T4": {"bf16": None, "fp16": 65.0, "tf32": None, "fp32": 8.1},
    "AMD Instinct MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
}


def normalise_gpu_name(name: str) -> str:
    """Compare names as written, forgiving only case, spacing and a leading "NVIDIA "."""
    return " ".join(name.split()).casefold().removeprefix("nvidia ")


def match_gpu(device_name: str) -> Optional[str]:
    """The table row for exactly this device ("NVIDIA H100 80GB HBM3"), or None for a device not listed.

    No substring matching: "NVIDIA L40" contains "L4", "NVIDIA A10G" contains "A10", and each is a
    different chip. An unknown name gets no peak rather than a neighbour's.
    """
    wanted = normalise_gpu_name(device_name)
    return next((key for key in PEAK_TFLOPS if normalise_gpu_name(key) == wanted), None)


def gpu_peak_tflops(device_name: str, dtype: str) -> Optional[float]:
    """The datasheet's dense peak of this device at this precision, or None where none is known."""
    key = match_gpu(device_name)
    return PEAK_TFLOPS[key].get(dtype) if key else None
