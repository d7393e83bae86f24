"""Every data-parallel strategy, labkit's and torch's, trains the same model as one process would.

Real gloo process groups at world sizes 2 and 4 (one torchrun launch each, all strategies inside),
compared with single-process training on the full batch.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_config
from labkit.config import ConfigError
from labkit.validation import validate
from labkit.parallel import STRATEGIES
from labkit.parallel.dp.ddp import make_buckets
from labkit.parallel.dp.zero import ShardedOptimizer
from labkit.train import train

BASE = {"run.name": "dp", "run.steps": 4, "run.eval_every": 0, "run.seed": 7, "model.n_layer": 2,
        "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16, "data.batch_size": 8,
        "data.micro_batch_size": 2, "optim.warmup_steps": 2}
VARIANTS = {
    "base": {},
    "frozen": {"model.freeze": ["wpe", "blocks.0.ln_1"]},  # tied wte/lm_head is in every variant
}
DEEP = {"model.n_layer": 6}  # ZeRO-3's memory: more blocks than it may hold gathered at once (root, running, next)
ALL = list(STRATEGIES)


def cases():
    out = [{"name": f"{s}-{v}", "overrides": {**BASE, **extra, "parallel.dp.strategy": s}}
           for v, extra in VARIANTS.items() for s in ALL]
    for s in ("ddp_bucketed", "zero2"):  # many buckets, each parameter larger than a bucket
        out.append({"name": f"{s}-tiny_buckets", "overrides": {**BASE, "parallel.dp.strategy": s,
                                                               "parallel.dp.bucket_mb": 0.001}})
    # labkit's ZeRO-3 shards over the gradient axis, dp × cp (world 2: dp 1 × cp 2, 4 micro-batches a step)
    out.append({"name": "zero3-cp2", "overrides": {**BASE, "parallel.dp.strategy": "zero3", "parallel.cp.degree": 2}})
    out += [{"name": f"{s}-deep", "overrides": {**BASE, **DEEP, "parallel.dp.strategy": s}} for s in ("zero3", "fsdp2")]
    return out


def overrides_of(case: str) -> dict:
    return next(c["overrides"] for c in cases() if c["name"] == case)


def variant_of(case: str) -> str:
    """The single-process run a case is compared with: its variant (``zero3-deep``: deep), else the base one."""
    variant = case.rsplit("-", 1)[1]
    return variant if variant in (*VARIANTS, "deep") else "base"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process training on the full batch, per variant."""
    root = tmp_path_factory.mktemp("reference")
    for variant, extra in {**VARIANTS, "deep": DEEP}.items():
        train(tiny_config(**{**BASE, **extra, "data.micro_batch_size": 8}), root / variant)
    return root


@pytest.fixture(scope="module", params=[2, 4])
def world(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"world{request.param}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([Path(sys.executable).parent / "torchrun", "--nproc-per-node", str(request.param),
                           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                           str(Path(__file__).parents[1] / "dp_cases.py"), str(root), json.dumps(cases())],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return request.param, root


def _free_port():
    from labkit.launcher import free_port

    return free_port()


def _losses(run_dir):
    return [e["loss"] for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == "step"]


def _steps(run_dir):
    return [e for e in map(json.loads, open(run_dir / "events.jsonl")) if e["type"] == "step"]


@pytest.mark.multiproc
@pytest.mark.parametrize("case", [c["name"] for c in cases()])
def test_strategy_equals_single_process_training(world, reference, case):
    size, root = world
    variant = variant_of(case)
    assert _losses(root / case) == pytest.approx(_losses(reference / variant), rel=1e-5)
    got, want = (torch.load(d / "final_model.pt", weights_only=True) for d in (root / case, reference / variant))
    assert got.keys() == want.keys()
    for key in want:
        # Adam divides by √v: float32 rounding differences in tiny gradients grow to ~1e-6 in 4 steps
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=f"{case} {key} at world {size}")
    if variant == "frozen":  # frozen parameters never moved
        initial = torch.load(reference / variant / "final_model.pt", weights_only=True)
        assert torch.equal(got["wpe.weight"], initial["wpe.weight"])


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2], indirect=True)
def test_same_arithmetic_order_gives_bitwise_equal_models(world):
    """At world 2 an all-reduce sums two numbers (a+b = b+a exactly, and halving is exact), and
    labkit's DDPs average and step exactly as torch DDP does, on parameters and gradients held in
    tensors of the same shapes: their models are bit-for-bit equal on every CPU."""
    size, root = world
    want = torch.load(root / "torch_ddp-base" / "final_model.pt", weights_only=True)
    for case in ("ddp_naive-base", "ddp_bucketed-base", "ddp_bucketed-tiny_buckets"):
        got = torch.load(root / case / "final_model.pt", weights_only=True)
        assert all(torch.equal(got[k], want[k]) for k in want), case


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2], indirect=True)
def test_fsdp2_equals_torch_ddp_to_float32_rounding(world):
    """FSDP2 runs the same forward, backward and AdamW, but not provably in the same arithmetic order
    on every CPU: its parameters are views into all-gathered buffers (other alignment, so BLAS may take
    another kernel path), its optimizer steps shards (other SIMD tails) and its gradient norm adds
    per-shard partial sums. On an AMD AVX2 machine the models differed in the last bits. So: equal to
    float32 rounding, the tolerance torch.testing derives from the dtype (rtol 1.3e-6, atol 1e-5)."""
    size, root = world
    want = torch.load(root / "torch_ddp-base" / "final_model.pt", weights_only=True)
    got = torch.load(root / "fsdp2-base" / "final_model.pt", weights_only=True)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=f"fsdp2 {key}")  # dtype-derived tolerances


@pytest.mark.multiproc
@pytest.mark.parametrize("variant", ["base", "frozen", "deep"])
def test_zero3_trains_the_model_fsdp2_trains(world, variant):
    """labkit's ZeRO-3 and torch's (FSDP2) beside each other: the same loss and gradient norm at every step (2
    micro-batches per step at world 2, one at world 4; clipped to norm 1, which the base model's first steps exceed)
    and the same final model, to float32 rounding (FSDP2's test above says why not bit for bit)."""
    size, root = world
    zero3, fsdp2 = _steps(root / f"zero3-{variant}"), _steps(root / f"fsdp2-{variant}")
    assert [e["loss"] for e in zero3] == pytest.approx([e["loss"] for e in fsdp2], rel=1e-6)
    assert [e["grad_norm"] for e in zero3] == pytest.approx([e["grad_norm"] for e in fsdp2], rel=1e-6)
    if variant == "base":  # optim.grad_clip = 1: clipping acted (the first step's norm is above it)
        assert zero3[0]["grad_norm"] > 1.0
    got, want = (torch.load(root / f"{s}-{variant}" / "final_model.pt", weights_only=True) for s in ("zero3", "fsdp2"))
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=f"zero3 {variant} {key} at world {size}")


def _zero3_units(case: str, vocab: int) -> tuple[list[list[tuple[int, bool]]], int]:
    """labkit's ZeRO-3 units of a case's model, blocks first and the root last: each unit's flat shards as
    (elements, trainable) — per unit, the trainable matrices (decayed), the trainable vectors, the frozen parameters —
    and Ψ, the model's parameters (the tied embedding once)."""
    from labkit.config import load_config
    from labkit.model.gpt import GPT, GPTShape

    cfg = load_config(None, overrides_of(case))
    with torch.device("meta"):
        model = GPT(GPTShape.from_config(cfg.model, vocab))
    frozen = {id(q) for name, q in model.named_parameters() if name.startswith(tuple(cfg.model.freeze))}
    in_blocks = {id(q) for block in model.blocks for q in block.parameters()}
    units = [list(block.parameters()) for block in model.blocks]
    units.append([q for q in model.parameters() if id(q) not in in_blocks])
    kinds = [lambda q: id(q) not in frozen and q.dim() >= 2, lambda q: id(q) not in frozen and q.dim() < 2,
             lambda q: id(q) in frozen]
    shards = [[(sum(q.numel() for q in unit if kind(q)), i < 2) for i, kind in enumerate(kinds)] for unit in units]
    return [[s for s in unit if s[0]] for unit in shards], sum(q.numel() for q in model.parameters())


def zero3_wire_bytes(case: str, p: int, m: int, vocab: int) -> int:
    """What one rank of labkit's ZeRO-3 sends per step (labkit.parallel.dp.zero3), call by call as the counters count:
    each flat shard padded to a multiple of p; a block's shards all-gathered twice per micro-batch (forward and
    backward), the root's once (kept from its forward to its backward); every trainable shard reduce-scattered once;
    the gradient norm one float64 all-reduced."""
    from labkit.comm.collectives import wire_bytes

    units, _ = _zero3_units(case, vocab)
    padded = lambda n: -(-n // p) * p  # noqa: E731
    sent = wire_bytes("all_reduce", 8, p)
    for i, unit in enumerate(units):
        gathers = m if i == len(units) - 1 else 2 * m
        for n, trainable in unit:
            sent += gathers * wire_bytes("all_gather", 4 * padded(n), p)
            sent += wire_bytes("reduce_scatter", 4 * padded(n), p) if trainable else 0
    return sent


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["zero3-base", "zero3-frozen", "zero3-cp2", "zero3-deep"])
def test_zero3_sends_two_all_gathers_and_one_reduce_scatter_of_the_model(world, case):
    """Counted at labkit's collectives, every step: exactly :func:`zero3_wire_bytes` (m micro-batches per step: 2 at
    world 2, 1 at world 4; 4 and 2 for dp × cp). With one micro-batch that is (p−1)/p · (3Ψ − root) · 4 B + the
    norm's, against DDP's all-reduce 2(p−1)/p · 4Ψ: 1.5× less the root's second all-gather."""
    p, root = world
    start = next(e for e in map(json.loads, open(root / case / "events.jsonl")) if e["type"] == "start")
    m = start["grad_accum"]
    want = zero3_wire_bytes(case, p, m, start["vocab_size"])
    assert [e["comm_bytes"] for e in _steps(root / case)] == [want] * BASE["run.steps"]
    if case == "zero3-base" and m == 1:
        units, psi = _zero3_units(case, start["vocab_size"])
        ddp = _steps(root / "ddp_naive-base")[-1]["comm_bytes"]
        assert ddp == 2 * (p - 1) * 4 * psi // p  # no padding in this model at p = 2 or 4
        root_bytes = 4 * sum(n for n, _ in units[-1])
        assert want == (p - 1) * (3 * 4 * psi - root_bytes) // p + wire_bytes_of_norm(p)
        assert 1.4 < want / ddp <= 1.5 + wire_bytes_of_norm(p) / ddp


def wire_bytes_of_norm(p: int) -> int:
    from labkit.comm.collectives import wire_bytes

    return wire_bytes("all_reduce", 8, p)


@pytest.mark.multiproc
def test_zero3_holds_its_slices_and_gathers_one_unit_at_a_time(world):
    """Every rank's model states, measured from its tensors, are the ZeRO paper's stage-3 prediction Ψ/p each
    (labkit.parallel.reports.layout.rank_memory: weights 4, gradients 4, Adam 8 bytes per parameter, over p), exactly:
    these models pad nothing at p = 2 or 4. The forward's peak, read by the allocation tracker on the tracked step, is
    within that prediction + the largest unit + the activations forward saves (what any strategy holds): a ZeRO-3
    that kept its blocks gathered would hold all of them at the forward's end, far above. At world 4 only: with 2
    micro-batches a step the second forward also holds the first's full local gradients (no_sync, as FSDP2)."""
    from labkit.config import load_config
    from labkit.parallel.reports.layout import rank_memory
    from labkit.parallel.reports.data_parallel import predict_rank_memory

    p, root = world
    for case in ("zero3-base", "zero3-frozen", "zero3-cp2", "zero3-deep"):
        events = [json.loads(line) for line in open(root / case / "events.jsonl")]
        for r in rank_memory(events, load_config(None, overrides_of(case))):
            if case == "zero3-frozen":  # frozen parameters: sliced, without gradients or optimizer state
                assert r["measured"]["param"] == r["predicted"]["param"], r
                assert r["measured"]["grad"] < r["predicted"]["grad"], r
            else:
                assert r["measured"] == r["predicted"], (case, r)
    if p != 4:
        return
    events = [json.loads(line) for line in open(root / "zero3-deep" / "events.jsonl")]
    start = next(e for e in events if e["type"] == "start")
    units, psi = _zero3_units("zero3-deep", start["vocab_size"])
    unit_bytes = [4 * sum(n for n, _ in unit) for unit in units]
    predicted = predict_rank_memory(psi, p, "zero3").model_states
    (tracked,) = [e for e in _steps(root / "zero3-deep") if e["rank_peak_forward_bytes"][0] is not None]
    bound = predicted + max(unit_bytes) + tracked["activation_bytes"]
    peaks = tracked["rank_peak_forward_bytes"]
    assert all(peak <= bound for peak in peaks), (peaks, bound)
    kept_gathered = tracked["param_bytes"] + tracked["optimizer_bytes"] + sum(unit_bytes) + tracked["activation_bytes"]
    assert bound < kept_gathered  # the check can tell: 6 blocks gathered at once would not fit under it


def _trainable_bytes(run_dir):
    state = torch.load(run_dir / "final_model.pt", weights_only=True)
    return 4 * sum(v.numel() for k, v in state.items() if k != "lm_head.weight")  # tied: counted once


@pytest.mark.multiproc
def test_wire_bytes_match_the_analytic_volumes(world):
    p, root = world
    psi_bytes = _trainable_bytes(root / "torch_ddp-base")
    ring = 2 * (p - 1) / p * psi_bytes  # an all-reduce of the gradients
    for strategy in ("torch_ddp", "ddp_naive", "ddp_bucketed"):
        assert all(abs(e["comm_bytes"] - ring) <= 8 * len(STRATEGIES) for e in _steps(root / f"{strategy}-base"))
    zero2 = _steps(root / "zero2-base")[-1]["comm_bytes"]  # reduce-scatter + all-gather (+ the norm's 8 bytes)
    assert zero2 == pytest.approx(ring, rel=0.01)
    for strategy in ("zero1", "zero2-tiny_buckets"):  # P_os sends what DDP sends (the paper's point), bucketed too
        sent = _steps(root / (strategy if "-" in strategy else f"{strategy}-base"))[-1]["comm_bytes"]
        assert sent == pytest.approx(ring, rel=0.01), strategy
    if p == 4:  # one micro-batch per step: ZeRO-3 gathers twice and reduce-scatters once ≈ 1.5× DDP
        assert 1.3 < _steps(root / "fsdp2-base")[-1]["comm_bytes"] / ring < 1.55
    frozen = _steps(root / "ddp_naive-frozen")[-1]["comm_bytes"]
    assert frozen < _steps(root / "ddp_naive-base")[-1]["comm_bytes"]  # frozen gradients are not sent


@pytest.mark.multiproc
def test_sharded_state_really_is_one_pth_per_rank(world):
    p, root = world
    full = _steps(root / "torch_ddp-base")[-1]
    for strategy in ("zero1", "zero2", "zero3", "fsdp2"):
        assert _steps(root / f"{strategy}-base")[-1]["optimizer_bytes"] * p == pytest.approx(
            full["optimizer_bytes"], rel=0.05), strategy
    assert _steps(root / "zero2-base")[-1]["grad_bytes"] * p == pytest.approx(full["grad_bytes"], rel=0.05)
    # labkit's bucketed DDP holds each gradient once, as a view of its bucket (torch's gradient_as_bucket_view)
    assert _steps(root / "ddp_bucketed-base")[-1]["grad_bytes"] == full["grad_bytes"]
    for strategy in ("zero3", "fsdp2"):
        assert _steps(root / f"{strategy}-base")[-1]["param_bytes"] * p == pytest.approx(full["param_bytes"], rel=0.05)


def test_buckets_are_filled_last_parameter_first():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 1000)]
    one = make_buckets(params, bucket_bytes=1e9)
    assert len(one) == 1 and [p.numel() for p in one[0].params] == [1000, 30, 20, 10]
    many = make_buckets(params, bucket_bytes=4 * 50)
    assert [[p.numel() for p in b.params] for b in many] == [[1000], [30, 20], [10]]  # 1000 > bucket: alone
    assert all(b.buffer.numel() == sum(p.numel() for p in b.params) for b in many)


def test_zero_refuses_an_optimizer_it_cannot_shard():
    with pytest.raises(ValueError, match="elementwise optimizer"):
        ShardedOptimizer([{"params": [torch.nn.Parameter(torch.zeros(4, 4))]}], torch.optim.Adafactor, None)
    with pytest.raises(ConfigError, match="optim.name=adafactor keeps per-matrix statistics"):
        validate(tiny_config(**{"parallel.dp.strategy": "zero2", "optim.name": "adafactor"}), nproc=1)


def test_bad_bucket_size_and_freeze_prefix_are_explained():
    with pytest.raises(ConfigError, match="parallel.dp.bucket_mb: must be > 0"):
        validate(tiny_config(**{"parallel.dp.strategy": "ddp_bucketed", "parallel.dp.bucket_mb": 0}), nproc=1)
    with pytest.raises(ConfigError, match="'lm_head' matches no parameter"):
        validate(tiny_config(**{"model.freeze": ["lm_head"]}), nproc=1)


@pytest.mark.multiproc
def test_zero2_holds_its_gradient_slice_and_the_buckets_in_flight(world):
    """ZeRO-2 frees each full gradient once its bucket is sent: the most gradient bytes alive at once in
    backward (``rank_grad_peak_bytes``) are this rank's slice Ψ/p plus, with buckets smaller than a parameter,
    two of the largest parameters: the one being sent and the one autograd just made (or, where a parameter's
    size does not divide by p, the padded buffer it is copied into beside it) — never the whole Ψ DDP holds."""
    p, root = world
    psi = _trainable_bytes(root / "torch_ddp-base")
    largest = 4 * max(v.numel() for v in torch.load(root / "torch_ddp-base" / "final_model.pt",
                                                    weights_only=True).values())
    for e in _steps(root / "zero2-tiny_buckets"):
        for peak in e["rank_grad_peak_bytes"]:
            assert psi / p <= peak <= psi / p + 2 * largest + 64 * p, (peak, psi)
            assert peak < psi
    assert all(peak is None for e in _steps(root / "zero1-base") for peak in e["rank_grad_peak_bytes"])


@pytest.mark.parametrize("stage, bucket_bytes", [(1, None), (2, None), (2, 40)])
def test_zero_leaves_parameters_without_gradients_alone_as_torch_does(group_of_one, stage, bucket_bytes):
    """A frozen and an unused parameter keep their values (AdamW's weight decay must not shrink them: the old
    sharded optimizer treated a missing gradient as zeros, and 2.0 became 1.8088 in 10 steps); the used one
    moves exactly as under torch's AdamW."""
    from labkit.metrics.timers import CommTimer

    def run(make):
        torch.manual_seed(0)
        used = torch.nn.Parameter(torch.randn(3, 4))
        frozen = torch.nn.Parameter(torch.full((2, 2), 2.0), requires_grad=False)
        unused = torch.nn.Parameter(torch.full((5, 3), 2.0))
        optimizer = make([{"params": [used, frozen, unused], "weight_decay": 0.1}])
        for _ in range(10):
            (used ** 2).sum().backward()
            if isinstance(optimizer, ShardedOptimizer):
                optimizer.shard_gradients()
            optimizer.step()
            optimizer.zero_grad()
        return used.detach(), frozen.detach(), unused.detach()

    want = run(lambda groups: torch.optim.AdamW(groups, lr=0.1))
    got = run(lambda groups: ShardedOptimizer(groups, torch.optim.AdamW, CommTimer(), stage=stage, lr=0.1,
                                              bucket_bytes=bucket_bytes))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(got[2], torch.full((5, 3), 2.0))


def test_zero_leaves_its_parameter_all_gathers_to_the_next_forward_and_each_module_waits_for_its_own(group_of_one):
    """prefetch_into: step() launches the all-gathers (in the order the forward uses the shards) and returns; the
    parameters change only when a module's forward pre-hook waits for the shard holding them, and reading the
    parameters another way (finish_gathers: checkpoints, the full state) puts every shard in place first."""
    from labkit.metrics.timers import CommTimer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = ShardedOptimizer([{"params": list(model.parameters())}], torch.optim.SGD, CommTimer(), stage=2,
                                 lr=0.5, bucket_bytes=4 * 20)  # one bucket per layer (each 4 × 4 + 4)
    optimizer.prefetch_into(model)
    assert optimizer.gather_order == [1, 0]  # buckets fill last layer first; the forward needs the first first
    x = torch.randn(2, 4)
    model(x).sum().backward()
    optimizer.shard_gradients()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # nothing in place yet
    assert sorted(optimizer._gathers) == [0, 1]
    model[0](x)  # the first layer's pre-hook: its shard only
    first, second = list(model[0].parameters()), list(model[1].parameters())
    assert not any(torch.equal(p, b) for p, b in zip(first, before[:2]))
    assert all(torch.equal(p, b) for p, b in zip(second, before[2:])) and list(optimizer._gathers) == [0]
    optimizer.finish_gathers()
    assert not optimizer._gathers and not any(torch.equal(p, b) for p, b in zip(second, before[2:]))
