"""What the tensor-parallel workers share: the tiny GPTs they split and which slice of each full parameter a
tp rank holds (labkit's layout: tests/parallel/tensor_gpt_worker.py, tensor_dtensor_worker.py)."""
import itertools
import json
import subprocess
import sys
from pathlib import Path

import torch

from labkit.launcher import free_port
from labkit.model.gpt import GPT, GPTShape

VOCAB, BLOCK, LAYERS, HEADS, EMBD, BATCH = 16, 8, 2, 4, 16, 2
CASES = [dict(attention=a, bias=b) for a, b in itertools.product(("naive", "sdpa"), (True, False))]


def case_name(case: dict) -> str:
    return f"{case['attention']}_bias{int(case['bias'])}"


def tiny_gpt(attention: str, bias: bool) -> GPT:
    torch.manual_seed(0)  # the same full weights on every rank
    return GPT(GPTShape(vocab_size=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD,
                        bias=bias, attention=attention))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g), torch.randint(0, VOCAB, (BATCH, BLOCK), generator=g)


def _slice(total: int, rank: int, size: int) -> torch.Tensor:
    per = total // size
    return torch.arange(rank * per, (rank + 1) * per)


def labkit_shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's part of the full model's parameter (or gradient) ``name`` in labkit's tensor-parallel GPT."""
    if name == "wte.weight":  # by vocabulary (and the tied head with it)
        return full[_slice(VOCAB, rank, size)]
    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):  # this rank's heads of q, of k, of v
        heads = _slice(EMBD, rank, size)
        return full[torch.cat([heads + part * EMBD for part in range(3)])]
    if name.endswith("attn.proj.weight"):
        return full[:, _slice(EMBD, rank, size)]
    if name.endswith("mlp.fc.weight") or name.endswith("mlp.fc.bias"):
        return full[_slice(4 * EMBD, rank, size)]
    if name.endswith("mlp.proj.weight"):
        return full[:, _slice(4 * EMBD, rank, size)]
    return full  # replicated: position embedding, layer norms, the row layers' biases


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol)


def run_workers(worker: Path, world: int, out: Path, timeout: int = 300) -> list[dict]:
    """torchrun ``worker`` on ``world`` gloo ranks (it imports this file from its folder); each rank writes
    OUT/rankN.json, returned in rank order."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(worker), str(out)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]
