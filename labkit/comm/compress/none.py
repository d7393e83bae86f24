"""``none``: the uncompressed baseline every compressor is measured against.

Sum the gradient over ranks with one all-reduce, then divide by the world size. Nothing is
approximated and nothing is remembered; it sends 2·(p−1)/p × 4 bytes per fp32 entry.

torch's DDP (no hook) scales each gradient by 1/p while copying it into the bucket and then sums;
we sum and then divide. For power-of-two world sizes (2, 4, 8, ...) scaling by 1/p is exact in
binary floating point and commutes with the sum, so the two are *bitwise* identical (barring
subnormal underflow); for other world sizes they may differ in the last bit.
"""
from __future__ import annotations

import torch

from labkit.comm.compress.base import COMPRESSORS, Compressor


@COMPRESSORS.register
class NoCompression(Compressor):
    name, order = "none", 0

    def _allreduce(self, bucket_index: int, grad: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(grad.clone()).div_(self.world)
