"""``fp16`` and ``bf16``: send every entry, but in 2 bytes instead of 4.

Halving the bits halves the wire bytes and needs no memory between steps. What is lost is
*precision* and, for fp16, *range*:

* fp16 keeps 11 significant bits (relative rounding error ≤ 2⁻¹¹ ≈ 4.9e-4 per cast) but only
  reaches 65504, and values below ~6e-5 lose bits (below ~6e-8 they become 0) — small gradients
  underflow. So we divide by the world size *before* the all-reduce, as torch's
  ``fp16_compress_hook`` does: the sum of p averaged entries cannot overflow where the entries
  themselves did not.
* bf16 keeps fp32's 8 exponent bits (no overflow or underflow worries) but only 8 significant
  bits: relative rounding error ≤ 2⁻⁸ ≈ 3.9e-3 per cast.

Each rank casts once, the all-reduce adds p−1 times in half precision, and we cast back:
elementwise error ≲ p·u·mean_r|g_r| with u the unit roundoff above (documented bound:
normwise relative error ≤ 1e-3 for fp16 and ≤ 1e-2 for bf16 at world ≤ 4, for gradients in
fp16's normal range). We implement it with labkit's wrappers rather than torch's hooks so bf16
also works on gloo (torch's ``bf16_compress_hook`` refuses gloo).
"""
from __future__ import annotations

import torch

from labkit.comm.compress.base import COMPRESSORS, Compressor


class HalfPrecision(Compressor):
    dtype: torch.dtype

    def _allreduce(self, bucket_index: int, grad: torch.Tensor) -> torch.Tensor:
        half = grad.div(self.world).to(self.dtype)  # divide first: no overflow in the sum
        return self.all_reduce_sum(half).to(grad.dtype)


@COMPRESSORS.register
class FP16(HalfPrecision):
    name, order = "fp16", 10
    dtype = torch.float16


@COMPRESSORS.register
class BF16(HalfPrecision):
    name, order = "bf16", 20
    advice = "send gradients in bf16: half the bytes, almost no effect on training"
    dtype = torch.bfloat16
