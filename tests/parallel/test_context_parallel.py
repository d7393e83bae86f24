"""Context parallelism on real gloo process groups: ring attention, all-gather KV and Ulysses, contiguous and
head-tail, causal and not, in float64 and float32 — forward output and every gradient equal to one-rank attention
over the whole sequence, and the bytes counted at the collectives equal to each variant's formula."""
import pytest

from tp_cases import run_workers

WORKER = __import__("pathlib").Path(__file__).with_name("cp_worker.py")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def ranks(request, tmp_path_factory):
    return request.param, run_workers(WORKER, request.param, tmp_path_factory.mktemp(f"cp{request.param}"))


@pytest.mark.multiproc
def test_every_variant_equals_one_rank_attention_forward_and_backward(ranks):
    cp, per_rank = ranks
    cases = [name for name in per_rank[0] if name != "ulysses_odd_heads"]
    assert len(cases) == 3 * 2 * 2 * 2
    wrong = [(r, name) for r, results in enumerate(per_rank) for name in cases
             if not (results[name]["output"] and all(results[name]["grads"]))]
    assert not wrong, f"cp = {cp}: output or a gradient differs from one rank's attention: {wrong}"


@pytest.mark.multiproc
def test_the_bytes_counted_at_the_collectives_are_the_formulas(ranks):
    cp, per_rank = ranks
    for results in per_rank:
        for name, case in results.items():
            if name != "ulysses_odd_heads":
                assert case["bytes"] == case["expected"], name
    ring = per_rank[0]["ring-head_tail-causal-float32"]["bytes"]
    assert ring["backward"] == ring["forward"] * (2 * cp - 1) // (cp - 1)  # a little over twice the forward


@pytest.mark.multiproc
def test_ulysses_refuses_heads_that_cp_does_not_divide(ranks):
    cp, per_rank = ranks
    assert all(f"{cp + 1} heads do not divide by {cp}" in r["ulysses_odd_heads"] for r in per_rank)
