import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import gpt_loss_and_grads
from labkit.model import GPT, GPTShape, count_params, flops_per_token
from labkit.model.attention import naive_attention, sdpa_attention


@pytest.mark.parametrize("bias", [False, True])
def test_param_counts_match_the_module(bias):
    shape = GPTShape(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=24, bias=bias)
    model = GPT(shape)
    counts = count_params(shape)
    assert counts["total"] == sum(p.numel() for p in model.parameters())  # tied weight counted once
    assert counts["embedding"] == 50 * 24 + 16 * 24
    assert counts["non_embedding"] == counts["total"] - counts["embedding"]


def test_param_count_by_hand():
    # d=8, L=1, V=10, T=4, no bias: blocks 12·d² + 2 LayerNorms (2d) ; final LN d; wte V·d; wpe T·d
    shape = GPTShape(vocab_size=10, block_size=4, n_layer=1, n_head=2, n_embd=8)
    assert count_params(shape)["total"] == 12 * 64 + 2 * 8 + 8 + 80 + 32


def test_weights_are_tied():
    model = GPT(GPTShape(vocab_size=10, block_size=4, n_layer=1, n_head=2, n_embd=8))
    assert model.lm_head.weight is model.wte.weight


def test_flops_formula_by_hand():
    shape = GPTShape(vocab_size=10, block_size=4, n_layer=1, n_head=2, n_embd=8)
    n = count_params(shape)["flops_params"]
    assert n == 12 * 64 + 3 * 8 + 80
    assert flops_per_token(shape) == 6 * n + 12 * 1 * 8 * 4


def test_flops_formula_matches_counted_matmul_flops():
    """torch's FLOP counter on a real forward+backward agrees with 6N + 12LHQT within 1%.

    Naive attention: its matmuls are ops the counter sees (CPU flash SDPA is not counted).
    """
    shape = GPTShape(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64, attention="naive")
    model = GPT(shape)
    idx = torch.randint(0, 64, (2, 32))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    counted_per_token = counter.get_total_flops() / idx.numel()
    # the counter skips LayerNorm weights (no matmul): compare without them
    layernorm_params = (2 * shape.n_layer + 1) * shape.n_embd
    expected = flops_per_token(shape) - 6 * layernorm_params
    assert counted_per_token == pytest.approx(expected, rel=0.01)


def test_attention_backends_agree():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 8, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(naive_attention(q, k, v), sdpa_attention(q, k, v))


def test_attention_is_causal():
    q, k, v = (torch.randn(1, 1, 6, 4) for _ in range(3))
    out = naive_attention(q, k, v)
    v2 = v.clone()
    v2[..., 4:, :] += 100.0  # changing the future must not change the past
    torch.testing.assert_close(naive_attention(q, k, v2)[..., :4, :], out[..., :4, :])


def test_forward_rejects_too_long_sequences():
    model = GPT(GPTShape(vocab_size=10, block_size=4, n_layer=1, n_head=2, n_embd=8))
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_saved_activations_are_measured_and_scale_with_the_batch():
    from labkit.metrics.memory import count_saved_bytes

    def saved(batch, attention):
        torch.manual_seed(0)
        model = GPT(GPTShape(vocab_size=16, block_size=64, n_layer=2, n_head=2, n_embd=32, attention=attention))
        idx = torch.randint(0, 16, (batch, 64))
        with count_saved_bytes(exclude=model.parameters()) as counter:
            model(idx, idx)[1].backward()
        return counter.total

    assert saved(4, "sdpa") == pytest.approx(2 * saved(2, "sdpa"), rel=0.05)  # linear in the batch
    # naive attention keeps the (T × T) probabilities per head and layer: at least 2·2·64·64·4 bytes more
    assert saved(2, "naive") - saved(2, "sdpa") >= 2 * 2 * 2 * 64 * 64 * 4


def test_gpt_trains_the_same_with_labkit_flash_attention():
    loss_ref, grads_ref = gpt_loss_and_grads("sdpa")
    loss, grads = gpt_loss_and_grads("labkit_flash")
    torch.testing.assert_close(loss, loss_ref)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_sdpa_kernel_torch_picks_is_reported():
    from torch.nn.attention import SDPBackend

    from labkit.model.attention import describe_kernel

    q = torch.zeros(1, 2, 8, 16)
    got = describe_kernel("sdpa", q)
    assert got.startswith("sdpa → ") and got.split("→ ")[1] in SDPBackend.__members__
    assert describe_kernel("labkit_flash", q) == "labkit_flash"


def test_activation_checkpointing_saves_memory_and_changes_nothing_else():
    from labkit.metrics.memory import count_saved_bytes

    def run(recompute):
        torch.manual_seed(0)
        model = GPT(GPTShape(vocab_size=16, block_size=64, n_layer=2, n_head=2, n_embd=32, attention="naive",
                             recompute=recompute))
        idx = torch.randint(0, 16, (2, 64))
        with count_saved_bytes(exclude=model.parameters()) as saved:
            _, loss = model(idx, idx)
        loss.backward()
        return saved.total, loss, [p.grad for p in model.parameters()]

    (none, loss_none, grads_none), (sel, loss_sel, grads_sel), (full, loss_full, grads_full) = (
        run(mode) for mode in ("none", "selective", "full"))
    assert full < sel < none  # measured: recomputation keeps less for backward
    for loss, grads in ((loss_sel, grads_sel), (loss_full, grads_full)):
        assert torch.equal(loss, loss_none)
        for got, want in zip(grads, grads_none):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.multiproc
def test_compile_verify_measures_both_and_keeps_the_faster(tmp_path):
    import json

    from helpers import tiny_config
    from labkit.compile import VERIFY_STEPS
    from labkit.train import train

    summary = train(tiny_config(**{"run.steps": VERIFY_STEPS + 1, "run.compile": "verify"}), tmp_path)
    event = next(e for e in map(json.loads, open(tmp_path / "events.jsonl")) if e["type"] == "compile")
    assert event["step"] == VERIFY_STEPS - 1 and event["compile_s"] > 0
    faster = "compiled" if event["compiled_step_s"] < event["eager_step_s"] else "eager"
    assert event["kept"] == faster and summary["compile"]["kept"] == faster
    assert event["speedup"] == pytest.approx(event["eager_step_s"] / event["compiled_step_s"])


def test_compile_verify_needs_enough_steps():
    from helpers import tiny_config
    from labkit.config import ConfigError
    from labkit.validation import validate

    with pytest.raises(ConfigError, match="run.compile=verify measures 8 steps"):
        validate(tiny_config(**{"run.steps": 5, "run.compile": "verify"}), nproc=1)
