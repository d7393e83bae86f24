"""One rank of tests/parallel/test_tensor.py (torchrun, gloo): labkit's tensor-parallel layers against the
full layers they split, every rank computing the full reference from the same seed. Writes OUT/rankN.json."""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, shard_range
from labkit.parallel.tp.model import VocabParallelEmbedding, vocab_parallel_cross_entropy

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)  # the same full weights and inputs on every rank
results = {}


def close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# a column layer gathering its outputs
full = nn.Linear(8, 12)
x = torch.randn(3, 5, 8, requires_grad=True)
x_tp = x.detach().clone().requires_grad_(True)
layer = ColumnParallelLinear.from_linear(full, gather_output=True)
(full(x) ** 2).sum().backward()
(layer(x_tp) ** 2).sum().backward()
start, end = shard_range(12, None)
results["column"] = [close(layer(x_tp.detach()), full(x.detach())), close(x_tp.grad, x.grad),
                     close(layer.weight.grad, full.weight.grad[start:end]),
                     close(layer.bias.grad, full.bias.grad[start:end])]

# an MLP: column (no gather) → gelu → row, one all-reduce each way
up, down = nn.Linear(8, 16), nn.Linear(16, 8)
x = torch.randn(4, 8, requires_grad=True)
x_tp = x.detach().clone().requires_grad_(True)
up_tp, down_tp = ColumnParallelLinear.from_linear(up), RowParallelLinear.from_linear(down)
want = down(F.gelu(up(x)))
got = down_tp(F.gelu(up_tp(x_tp)))
(want ** 2).sum().backward()
(got ** 2).sum().backward()
s, e = shard_range(16, None)
results["mlp"] = [close(got, want), close(x_tp.grad, x.grad), close(up_tp.weight.grad, up.weight.grad[s:e]),
                  close(down_tp.weight.grad, down.weight.grad[:, s:e]), close(down_tp.bias.grad, down.bias.grad)]

# torch's own tensor parallelism (DTensor, parallelize_module) on the same MLP: the native one beside labkit's
import copy  # noqa: E402

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

native = nn.Sequential(copy.deepcopy(up), nn.GELU(), copy.deepcopy(down))
for p in native.parameters():
    p.grad = None
parallelize_module(native, init_device_mesh("cpu", (dist.get_world_size(),)),
                   {"0": ColwiseParallel(), "2": RowwiseParallel()})
x_native = x.detach().clone().requires_grad_(True)
out = native(x_native)
(out ** 2).sum().backward()
results["dtensor"] = [close(out, got), close(x_native.grad, x_tp.grad),
                      close(native[0].weight.grad.to_local(), up_tp.weight.grad),
                      close(native[2].weight.grad.to_local(), down_tp.weight.grad),
                      close(native[2].bias.grad.full_tensor(), down_tp.bias.grad)]

# a whole GPT block: heads split across the ranks, the MLP by columns then rows, layer norms replicated
from labkit.model.gpt import Block, GPTShape  # noqa: E402
from labkit.parallel.tp.layers import parallelize_block  # noqa: E402

block = Block(GPTShape(vocab_size=12, block_size=6, n_layer=1, n_head=4, n_embd=16, bias=True, attention="naive"))
block_tp = parallelize_block(copy.deepcopy(block))
x = torch.randn(2, 6, 16, requires_grad=True)
x_tp = x.detach().clone().requires_grad_(True)
want, got = block(x), block_tp(x_tp)
(want ** 2).sum().backward()
(got ** 2).sum().backward()
heads = slice(*shard_range(16, None))
qkv_rows = torch.cat([torch.arange(16)[heads] + part * 16 for part in range(3)])
results["block"] = [close(got, want), close(x_tp.grad, x.grad),
                    close(block_tp.ln_1.weight.grad, block.ln_1.weight.grad),
                    close(block_tp.attn.qkv.weight.grad, block.attn.qkv.weight.grad[qkv_rows]),
                    close(block_tp.attn.proj.weight.grad, block.attn.proj.weight.grad[:, heads]),
                    close(block_tp.mlp.fc.weight.grad, block.mlp.fc.weight.grad[slice(*shard_range(64, None))])]

# the embedding and the loss, split by vocabulary
emb = nn.Embedding(12, 6)
ids = torch.randint(0, 12, (2, 7))
emb_tp = VocabParallelEmbedding.from_embedding(emb)
(emb(ids) * torch.arange(6.0)).sum().backward()
(emb_tp(ids) * torch.arange(6.0)).sum().backward()
results["embedding"] = [close(emb_tp(ids), emb(ids)),
                        close(emb_tp.weight.grad, emb.weight.grad[emb_tp.start:emb_tp.end])]

logits = torch.randn(2, 7, 12, requires_grad=True)
target = torch.randint(0, 12, (2, 7))
vs, ve = shard_range(12, None)
shard = logits.detach()[..., vs:ve].clone().requires_grad_(True)
loss = F.cross_entropy(logits.view(-1, 12), target.view(-1))
loss.backward()
loss_tp = vocab_parallel_cross_entropy(shard, target, vs)
loss_tp.backward()
results["cross_entropy"] = [close(loss_tp, loss), close(shard.grad, logits.grad[..., vs:ve])]

with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as labkit's workers do: no C++ static destructors racing gloo's threads ("terminate called ...")
