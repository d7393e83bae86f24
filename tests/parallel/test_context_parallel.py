"""Context parallelism on real gloo process groups: ring attention, all-gather KV and Ulysses, contiguous and
head-tail, causal and not, in float64 and float32 — forward output and every gradient equal to one-rank attention
over the whole sequence, and the bytes counted at the collectives equal to each variant's formula."""
import pytest

from labkit.parallel.cp.sharding import rank_work

from tp_cases import run_workers

WORKER = __import__("pathlib").Path(__file__).with_name("cp_worker.py")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def ranks(request, tmp_path_factory):
    return request.param, run_workers(WORKER, request.param, tmp_path_factory.mktemp(f"cp{request.param}"))


@pytest.mark.multiproc
def test_every_variant_equals_one_rank_attention_forward_and_backward(ranks):
    cp, per_rank = ranks
    assert len(per_rank[0]["cases"]) == 3 * 2 * 2 * 2
    wrong = [(r, name, case["errors"]) for r, results in enumerate(per_rank) for name, case in results["cases"].items()
             if not case["ok"]]
    assert not wrong, f"cp = {cp}: output or a gradient differs from one rank's attention: {wrong}"


@pytest.mark.multiproc
def test_the_bytes_counted_at_the_collectives_are_the_formulas(ranks):
    cp, per_rank = ranks
    for results in per_rank:
        for name, case in results["cases"].items():
            assert case["bytes"] == case["expected"], name
    ring = per_rank[0]["cases"]["ring-head_tail-causal-float32"]["bytes"]
    assert ring["backward"] == ring["forward"] * (2 * cp - 1) // (cp - 1)  # a little over twice the forward


@pytest.mark.multiproc
def test_ulysses_refuses_heads_that_cp_does_not_divide(ranks):
    cp, per_rank = ranks
    assert all(f"{cp + 1} heads do not divide by {cp}" in r["ulysses_odd_heads"] for r in per_rank)


@pytest.mark.multiproc
def test_the_check_catches_every_bug_of_the_zoo_and_the_zoo_puts_everything_back(ranks):
    cp, per_rank = ranks
    for name in ("stale_kv", "no_lse_rescale", "mask_off_by_one_chunk"):
        assert not any(r["bugs"][name]["ok"] for r in per_rank) or name == "stale_kv" and cp == 1, name
        assert max(max(r["bugs"][name]["errors"].values()) for r in per_rank) > 1e-3, name
    assert all(r["after_the_zoo"] for r in per_rank)


@pytest.mark.multiproc
def test_the_ring_records_each_step_the_block_it_held_and_the_work_it_did(ranks):
    cp, per_rank = ranks
    for rank, results in enumerate(per_rank):
        for layout in ("contiguous", "head_tail"):
            timeline = results[f"timeline-{layout}"]
            assert [e["block"] for e in timeline] == [(rank - step) % cp for step in range(cp)]
            assert sum(e["work_blocks"] for e in timeline) == rank_work(rank, cp, layout)
            assert all(e["compute_s"] >= 0 and e["wait_s"] >= 0 for e in timeline)
