"""Exact parameter counts and model FLOPs per token — the numerator of MFU.

Training FLOPs per token ≈ 6·N + 12·L·H·Q·T (Chowdhery et al. 2022, PaLM, appendix B):
each matmul weight costs 2 FLOPs per token forward (multiply + add) and 4 backward (gradients
for input and weight), hence 6N; attention adds QKᵀ and A·V, 2·2·T·d per token per layer
forward, ×3 with backward = 12·L·d·T with d = H·Q (heads × head size). The attention term is
counted for the full T×T matrix, as PaLM does, even though a causal kernel may skip half of it.

N here is the number of parameters that take part in matmuls-per-token: all parameters except
the position embeddings (a lookup, no matmul). The token embedding is counted because, tied to
the LM head, it *is* a (V × d) matmul. LayerNorm weights are included, as nanoGPT does; they add
< 0.1% for any real model. With mixtures of experts (``model.moe``) N counts the *active* parameters, those one
token goes through: the router, its top-k experts and the shared expert, not every expert.
"""
from __future__ import annotations

from labkit.model.gpt import GPTShape


def count_params(shape: GPTShape) -> dict[str, int]:
    """Parameter counts by hand, from the shape alone (tests compare with the real module).

    With mixtures of experts (``shape.moe``) ``total`` holds every expert — what memory holds — and ``active``
    what one token uses: the router, its ``top_k`` experts and the shared expert, in place of the MLP
    (FLOPs and MFU count these: ``flops_params``). A dense GPT's are equal."""
    d, L, V, T = shape.n_embd, shape.n_layer, shape.vocab_size, shape.block_size
    b = 1 if shape.bias else 0
    ln = d + b * d
    attn = 3 * d * d + b * 3 * d + d * d + b * d
    mlp = 4 * d * d + b * 4 * d + 4 * d * d + b * d
    per_block = 2 * ln + attn + mlp
    token_emb, pos_emb = V * d, T * d
    total = token_emb + pos_emb + L * per_block + ln  # lm_head shares token_emb
    experts, active = _moe_params(getattr(shape, "moe", None), L, d, shape.bias)  # a sim shape has none
    return {
        "total": total + experts,
        "active": total + active,
        "embedding": token_emb + pos_emb,
        "non_embedding": total + experts - token_emb - pos_emb,
        "per_block": per_block,
        "flops_params": total + active - pos_emb,
    }


def moe_layer_params(moe, d: int, bias: bool) -> tuple[int, int]:
    """(all, active) parameters one mixture-of-experts layer adds over the dense MLP it replaces: a router (E·d),
    E experts of the MLP's shape and maybe a shared one, of which a token goes through the router, k experts and
    the shared one. (0, 0) for a dense GPT (``moe`` None)."""
    if moe is None:
        return 0, 0
    b = 1 if bias else 0
    mlp = 4 * d * d + b * 4 * d + 4 * d * d + b * d
    router, shared = moe.experts * d, mlp if moe.shared_expert else 0
    return router + moe.experts * mlp + shared - mlp, router + moe.top_k * mlp + shared - mlp


def _moe_params(moe, n_layer: int, d: int, bias: bool) -> tuple[int, int]:
    """(all, active) parameters every MoE layer of the GPT adds together (:func:`moe_layer_params`)."""
    layers = moe.layers(n_layer) if moe is not None else 0
    held, active = moe_layer_params(moe, d, bias)
    return layers * held, layers * active


def flops_per_token(shape: GPTShape, seq_len: int | None = None) -> float:
    """Training (forward + backward) FLOPs per token: 6N + 12·L·H·Q·T."""
    T = seq_len or shape.block_size
    N = count_params(shape)["flops_params"]
    return 6.0 * N + 12.0 * shape.n_layer * shape.n_embd * T


def part_flops_per_token(shape) -> dict[str, float]:
    """The same count split by where it runs: each ``block`` (its matmuls and attention), the ``head`` (the final
    LayerNorm and the output layer) and the ``embedding`` (lookups: no matmul, 0). n_layer·block + head + embedding
    is :func:`flops_per_token`. A pipeline balances its stages on these (``labkit.parallel.pp.pipeline.partition``);
    ``shape`` is anything with ``n_layer``, ``n_embd``, ``vocab_size``, ``block_size`` and ``bias``."""
    d, V, T = shape.n_embd, shape.vocab_size, shape.block_size
    ln = d + (d if shape.bias else 0)
    per_block = count_params(GPTShape(vocab_size=V, block_size=T, n_layer=1, n_head=1, n_embd=d,
                                      bias=shape.bias))["per_block"]
    return {"embedding": 0.0, "block": 6.0 * per_block + 12.0 * d * T, "head": 6.0 * (V * d + ln)}
