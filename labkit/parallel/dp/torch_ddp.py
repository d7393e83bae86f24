"""Data parallelism with PyTorch's DistributedDataParallel (production reference).

Every rank holds a full copy of the model and sees a different shard of each global batch.
After backward the gradients are averaged across ranks (all-reduce), so every replica takes the
identical optimizer step and the replicas never drift apart. DDP makes this fast by packing
gradients into buckets and launching each bucket's all-reduce as soon as backward has filled
it, overlapping communication with the rest of backward — labkit's ``ddp_bucketed`` is the
same idea in ~100 readable lines.

labkit registers a communication hook that performs the same averaging all-reduce through
labkit's communication layer, so its time and bytes are measured — or, with
``comm.compression``, a compressor's hook (``labkit.comm.compress``).
"""
from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from labkit.comm import compressor_from_config
from labkit.comm.collectives import timed_allreduce_hook
from labkit.parallel.dp.base import Strategy
from labkit.parallel.ep import expert_parameters
from labkit.parallel.spec import STRATEGIES, refusing


@STRATEGIES.register
class TorchDDP(Strategy):
    name, order = "torch_ddp", 10
    compresses = True  # comm.compression's compressor is DDP's comm hook
    refuses = {
        **refusing("tp", "torch's DDP has no sharding rule for DTensor parameters (\"c10d.broadcast_.default does not "
                         "have a sharding strategy\"): torch's own 2-D layout is FSDP2 over dp beside DTensor",
                   ("dtensor",)),
        **refusing("pp", "torch's DDP decides in each forward whether the next backward communicates, which a "
                         "pipeline's interleaved forwards and backwards do not fit")}  # either pipeline

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.env.local_rank] if self.env.device == "cuda" else None
        experts = [name for name, _ in expert_parameters(model)]  # held apart under ep: labkit.parallel.ep's to sum
        if experts:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
        ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.cfg.parallel.dp.bucket_mb,
                                      gradient_as_bucket_view=True, process_group=self.process_group)
        self.compressor = compressor_from_config(self.cfg, self.comm_timer, self.process_group)
        if self.compressor is None:  # torch's engine calls the hook: it is handed the timer (no step context in C++)
            ddp.register_comm_hook((self.comm_timer, self.process_group), timed_allreduce_hook)
        else:
            self.compressor.name_parameters(model)
            ddp.register_comm_hook(*self.compressor.ddp_hook())
        return ddp

    def no_sync(self, module: nn.Module):
        return module.no_sync()
