"""Tests for labkit.data: shipped corpora, tokenizers, and the sharded loader."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import assert_equal_but_floats
from labkit.data import (ByteTokenizer, CharTokenizer, DatasetNotFoundError, ShardedLoader,
                         TokenDataset, available_datasets, build_datasets, build_tokenizer,
                         generate, load_metadata, resolve_dataset, split_tokens, true_nll,
                         validation_floor, validation_loader)
from labkit.data import corpora

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "datasets"
FLOAT64_REL = 1000 * np.finfo(np.float64).eps  # ~2e-13: far below any digit the metadata is read for


@pytest.fixture(scope="module")
def shipped_text():
    return {name: (SHIPPED_DIR / f"{name}.txt").read_text(encoding="utf-8") for name in corpora.CORPORA}


def shipped_meta(name):
    return json.loads((SHIPPED_DIR / f"{name}.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------- corpora --

@pytest.mark.parametrize("name", sorted(corpora.CORPORA))
def test_shipped_corpus_equals_regeneration_from_recorded_seed(name):
    meta = shipped_meta(name)
    text, regenerated_meta = generate(name, seed=meta["seed"], length=meta["length"])
    assert text.encode("utf-8") == (SHIPPED_DIR / f"{name}.txt").read_bytes()  # the text: exactly
    # The entropy goes through LAPACK (the chain's stationary distribution) and numpy's SIMD logs, whose
    # last bits depend on the CPU (AVX2 and AVX-512 machines differ by an ulp): floats to a tight tolerance.
    assert_equal_but_floats(regenerated_meta, meta, rel=FLOAT64_REL)
    assert meta["generator"] == f"labkit.data.corpora.{corpora.CORPORA[name].__name__}"
    assert meta["entropy_bits_per_token"] == pytest.approx(meta["entropy_nats_per_token"] / np.log(2))


@pytest.mark.parametrize("name", sorted(corpora.CORPORA))
def test_shorter_generation_is_a_prefix(name):
    full, _ = generate(name, length=20_000)
    short, _ = generate(name, length=5_000)
    assert full.startswith(short) and len(short) == 5_000
    other_seed, _ = generate(name, seed=shipped_meta(name)["seed"] + 1, length=5_000)
    assert other_seed != short


def plug_in_conditional_entropy(ids: np.ndarray, k: int, order: int) -> float:
    """Empirical H(next | previous `order` symbols) in nats, from counts."""
    context = np.zeros(len(ids) - order, dtype=np.int64)
    for i in range(order):
        context = context * k + ids[i:len(ids) - order + i]
    joint = np.bincount(context * k + ids[order:], minlength=k ** (order + 1)).reshape(-1, k)
    n = joint.sum()
    p_joint = joint[joint > 0] / n
    p_context = joint.sum(1)
    p_context = p_context[p_context > 0] / n
    return float(-(p_joint * np.log(p_joint)).sum() + (p_context * np.log(p_context)).sum())


def test_markov_entropy_rate_matches_empirical_estimate(shipped_text):
    meta = shipped_meta("markov")
    ids = CharTokenizer(meta["alphabet"]).encode(shipped_text["markov"])
    empirical = plug_in_conditional_entropy(ids, 16, order=2)
    assert empirical == pytest.approx(meta["entropy_nats_per_token"], abs=0.01)


def test_bigram_entropy_rate_matches_empirical_estimate(shipped_text):
    meta = shipped_meta("bigram")
    ids = CharTokenizer(meta["alphabet"]).encode(shipped_text["bigram"])
    assert plug_in_conditional_entropy(ids, 64, order=1) == pytest.approx(meta["entropy_nats_per_token"], abs=0.01)
    assert plug_in_conditional_entropy(ids, 64, order=0) > meta["entropy_nats_per_token"] + 1.0  # context matters


def test_markov_has_structure_below_its_symbol_entropy(shipped_text):
    meta = shipped_meta("markov")
    ids = CharTokenizer(meta["alphabet"]).encode(shipped_text["markov"])
    order0 = plug_in_conditional_entropy(ids, 16, order=0)
    order1 = plug_in_conditional_entropy(ids, 16, order=1)
    rate = meta["entropy_nats_per_token"]
    assert rate < order1 - 0.2 < order0 - 0.4  # each symbol of context helps


def test_zipf_entropy_matches_empirical_entropy(shipped_text):
    meta = shipped_meta("zipf")
    ids = CharTokenizer(meta["alphabet"]).encode(shipped_text["zipf"])
    assert plug_in_conditional_entropy(ids, 32, order=0) == pytest.approx(
        meta["entropy_nats_per_token"], abs=0.01)
    p = corpora.zipf_probabilities(32, 1.1)
    assert meta["entropy_nats_per_token"] == pytest.approx(-(p * np.log(p)).sum(), rel=1e-12)


@pytest.mark.parametrize("name, order", [("zipf", 0), ("bigram", 1), ("markov", 2)])
def test_true_nll_is_the_generating_process_loss_and_averages_to_the_entropy_rate(name, order):
    text, meta = generate(name, length=300_000)
    nll = true_nll(text, meta)
    assert np.isnan(nll[:order]).all() and not np.isnan(nll[order:]).any()
    assert np.nanmean(nll) == pytest.approx(meta["entropy_nats_per_token"], abs=0.01)
    if name == "bigram":
        ids = np.array([meta["alphabet"].index(symbol) for symbol in text[:50]])
        P = corpora.bigram_transitions(np.random.default_rng(meta["seed"]), k=64)
        assert nll[1:50] == pytest.approx(-np.log(P[ids[:49], ids[1:50]]))


def test_true_nll_is_unknown_for_a_users_text():
    assert true_nll("any text at all", None) is None
    with pytest.raises(ValueError, match="outside the bigram alphabet"):
        true_nll("not bigram text!", shipped_meta("bigram"))


def test_validation_floor_is_the_chains_loss_on_exactly_the_evaluated_tokens():
    _, val, tok, meta = build_datasets("bigram", "char", block_size=64)
    P = corpora.bigram_transitions(np.random.default_rng(meta["seed"]), k=64)
    nll, count = 0.0, 0
    for rank in range(2):  # what Trainer.evaluate scores: 8 micro-batches of 4 on each of 2 ranks
        loader = validation_loader(val, 4, rank, 2)
        for _ in range(8):
            x, y = loader.next_micro_batch()
            x, y = (np.array([meta["alphabet"].index(s) for s in tok.decode(t.flatten())]) for t in (x, y))
            nll, count = nll - np.log(P[x, y]).sum(), count + y.size
    floor = validation_floor("bigram", val, 0.1, micro_batch_size=4, world_size=2, eval_batches=8)
    assert floor == pytest.approx(nll / count, rel=1e-12)
    assert abs(floor - meta["entropy_nats_per_token"]) > 1e-3  # 2,048 tokens: a sample, not the rate


def test_validation_floor_is_none_for_a_users_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("some text of my own " * 50)
    _, val, _, _ = build_datasets(path, "char", block_size=8)
    assert validation_floor(path, val, 0.1, micro_batch_size=2, world_size=1, eval_batches=2) is None


def test_stationary_distribution_is_fixed_point():
    P = corpora.markov_transitions(np.random.default_rng(0), k=4)
    T = corpora.pair_state_transition_matrix(P)
    pi = corpora.stationary_distribution(T)
    np.testing.assert_allclose(pi @ T, pi, atol=1e-12)
    assert pi.sum() == pytest.approx(1.0)


def test_regenerate_to_folder_and_main(tmp_path, capsys):
    assert corpora.main(["--out", str(tmp_path), "--only", "zipf"]) == 0
    assert "zipf.txt" in capsys.readouterr().out
    assert available_datasets(tmp_path) == ["zipf"]
    assert (tmp_path / "zipf.txt").read_bytes() == (SHIPPED_DIR / "zipf.txt").read_bytes()


# ------------------------------------------------------- finding datasets --

def test_available_and_resolve_shipped(monkeypatch):
    monkeypatch.delenv("LABKIT_DATASETS", raising=False)
    assert {"markov", "zipf"} <= set(available_datasets())
    assert resolve_dataset("markov") == (SHIPPED_DIR / "markov.txt").resolve()
    assert load_metadata("zipf")["name"] == "zipf"


def test_bad_name_lists_available(tmp_path):
    (tmp_path / "alpha.txt").write_text("abc")
    (tmp_path / "alpha.json").write_text("{}")
    with pytest.raises(DatasetNotFoundError) as info:
        resolve_dataset("markvo", datasets_dir=SHIPPED_DIR)
    assert isinstance(info.value, ValueError)
    assert "'markvo'" in str(info.value) and "markov, zipf" in str(info.value)
    with pytest.raises(DatasetNotFoundError, match=r"available: alpha\)"):
        resolve_dataset("beta", datasets_dir=tmp_path)


def test_env_var_overrides_datasets_dir(tmp_path, monkeypatch):
    (tmp_path / "mine.txt").write_text("hello")
    (tmp_path / "mine.json").write_text("{}")
    monkeypatch.setenv("LABKIT_DATASETS", str(tmp_path))
    assert available_datasets() == ["mine"]
    assert resolve_dataset("mine") == (tmp_path / "mine.txt").resolve()


def test_user_file_end_to_end_with_byte_tokenizer(tmp_path):
    text = "héllo wörld, any UTF-8 text is a dataset. " * 20
    path = tmp_path / "notes.txt"
    path.write_text(text, encoding="utf-8")
    train, val, tok, meta = build_datasets(str(path), "byte", block_size=8, val_fraction=0.1)
    assert meta is None and load_metadata(path) is None
    assert tok.vocab_size == 256
    all_ids = torch.cat([train.tokens, val.tokens])
    assert tok.decode(all_ids) == text
    x, y = ShardedLoader(train, micro_batch_size=4, seed=0).next_micro_batch()
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.int64


def test_too_small_dataset_errors_are_explained(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("abcdefghij" * 3)
    with pytest.raises(ValueError, match="validation split.*val_fraction"):
        build_datasets(path, "char", block_size=8, val_fraction=0.1)
    train, _, _, _ = build_datasets(path, "char", block_size=4, val_fraction=0.0)
    with pytest.raises(ValueError, match="global batch needs 16"):
        ShardedLoader(train, micro_batch_size=4, world_size=2, grad_accum=2)


# -------------------------------------------------------------- tokenizer --

def test_char_tokenizer_round_trip_and_sorted_vocab():
    tok = CharTokenizer.from_text("banana ñ!")
    assert tok.alphabet == "".join(sorted(set("banana ñ!")))
    ids = tok.encode("nab ñ!")
    assert ids.dtype == np.int64 and tok.decode(ids) == "nab ñ!"
    assert tok.decode(torch.as_tensor(ids)) == "nab ñ!" and tok.decode(list(ids)) == "nab ñ!"
    assert tok.vocab_size == 6


def test_char_tokenizer_unknown_char():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match=r"'z' \(U\+007A\) at position 2"):
        tok.encode("abzc")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([0, 3])


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer("byte", "")
    text = "naïve — 日本"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and ids.max() < 256
    assert tok.decode(ids) == text
    assert isinstance(tok, ByteTokenizer)
    with pytest.raises(ValueError, match="char, byte"):
        build_tokenizer("bpe", "x")


def test_shipped_corpora_are_one_token_per_symbol(shipped_text):
    tok = build_tokenizer("char", shipped_text["markov"])
    assert tok.vocab_size == 16 and len(tok.encode(shipped_text["markov"][:100])) == 100


# ----------------------------------------------------------------- loader --

def make_dataset(n_samples=37, block_size=4):
    """Tokens 0..n-1 so every sample row is distinct and identifies its index."""
    return TokenDataset(torch.arange(n_samples * block_size + 1), block_size)


def rows(x):
    return Counter(tuple(r) for r in x.tolist())


def test_dataset_windows_and_shift():
    ds = TokenDataset(torch.arange(11), block_size=3)
    assert len(ds) == 3
    x, y = ds[1]
    assert x.tolist() == [3, 4, 5] and y.tolist() == [4, 5, 6]
    xb, yb = ds.batch(torch.tensor([2, 0]))
    assert torch.equal(xb[:, 1:], yb[:, :-1]) and xb[0].tolist() == [6, 7, 8]


def test_split_tokens_is_contiguous_tail():
    train, val = split_tokens(torch.arange(100), 0.1)
    assert train.tolist() == list(range(90)) and val.tolist() == list(range(90, 100))


def test_same_seed_same_batches_different_seed_different():
    ds = make_dataset()
    a, b, c = (ShardedLoader(ds, 3, seed=s) for s in (7, 7, 8))
    first = [a.next_micro_batch()[0] for _ in range(10)]
    assert all(torch.equal(f, b.next_micro_batch()[0]) for f in first)
    assert not all(torch.equal(f, c.next_micro_batch()[0]) for f in first)


def test_y_is_x_shifted_in_loader_batches():
    x, y = ShardedLoader(make_dataset(), 5, seed=1).next_micro_batch()
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_ranks_split_exactly_the_single_process_global_batch(world_size, grad_accum):
    ds, micro, seed = make_dataset(), 2, 3
    ranks = [ShardedLoader(ds, micro, r, world_size, grad_accum, seed) for r in range(world_size)]
    single = ShardedLoader(ds, micro * world_size * grad_accum, 0, 1, 1, seed)
    seen_this_epoch = Counter()
    for step in range(2 * single.steps_per_epoch + 1):  # crosses epoch boundaries
        if step % single.steps_per_epoch == 0:
            seen_this_epoch = Counter()
        union = Counter()
        for _ in range(grad_accum):
            for loader in ranks:
                union += rows(loader.next_micro_batch()[0])
        assert max(union.values()) == 1  # disjoint across ranks and micro-batches
        assert union == rows(single.next_micro_batch()[0])
        assert not set(union) & set(seen_this_epoch)  # no sample twice in an epoch
        seen_this_epoch += union


def test_epoch_drops_remainder_and_reshuffles():
    ds = make_dataset(n_samples=10)
    loader = ShardedLoader(ds, 3, seed=0)
    assert loader.steps_per_epoch == 3
    epoch0 = [loader.next_micro_batch()[0] for _ in range(3)]
    assert loader.state_dict() == {"epoch": 1, "step_in_epoch": 0, "micro": 0, "seed": 0}
    epoch1 = loader.next_micro_batch()[0]
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(1))[:3]
    assert (epoch1[:, 0] // 4).tolist() == expected.tolist()
    assert len(rows(torch.cat(epoch0))) == 9


@pytest.mark.parametrize("consumed", [0, 1, 3, 4, 9, 17])  # mid-accum, step and epoch edges
def test_resume_from_state_dict_yields_the_same_stream(consumed):
    ds = make_dataset(n_samples=21)
    original = ShardedLoader(ds, 2, rank=1, world_size=2, grad_accum=2, seed=5)  # 2 steps/epoch
    for _ in range(consumed):
        original.next_micro_batch()
    state = original.state_dict()
    assert all(type(v) is int for v in state.values())
    resumed = ShardedLoader(ds, 2, rank=1, world_size=2, grad_accum=2, seed=999)
    resumed.next_micro_batch()  # a stale position and permutation must be replaced
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for _ in range(10):
        (xa, ya), (xb, yb) = original.next_micro_batch(), resumed.next_micro_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_load_state_dict_rejects_state_from_another_setup():
    loader = ShardedLoader(make_dataset(), 2, grad_accum=2)
    with pytest.raises(ValueError, match="does not fit"):
        loader.load_state_dict({"epoch": 0, "step_in_epoch": 0, "micro": 2, "seed": 0})


@pytest.mark.parametrize("micro, dp", [(4, 2), (8, 2), (2, 4), (16, 1)])
def test_eval_samples_scores_the_same_sequences_whatever_the_micro_batch_and_dp(micro, dp):
    """With ``run.eval_samples`` an evaluation's sequences do not depend on the micro-batch size or dp: the capstone
    scores an attempt's time to a validation loss, which must be measured on the same tokens as the baseline's."""
    from labkit.config import Config, eval_micro_batches
    from labkit.data.loader import validation_loader

    ds = TokenDataset(torch.arange(100 * 8 + 1), 8)
    run = Config().replace(**{"run.eval_samples": 32}).run
    batches = eval_micro_batches(run, micro, dp)
    scored = sorted(int(i) for rank in range(dp) for loader in [validation_loader(ds, micro, rank, dp)]
                    for _ in range(batches) for i in loader.next_indices())
    reference = validation_loader(ds, 32, 0, 1).next_indices()
    assert scored == sorted(int(i) for i in reference) and batches * micro * dp == 32
    assert eval_micro_batches(Config().run, micro, dp) == Config().run.eval_batches  # unset: as before


def test_eval_samples_that_do_not_split_into_whole_micro_batches_are_refused():
    from labkit.config import ConfigError, load_config
    from labkit.validation import validate

    cfg = load_config(None, {"run.eval_samples": 20, "data.micro_batch_size": 4, "data.batch_size": 16})
    with pytest.raises(ConfigError, match=r"run.eval_samples=20: must be a positive multiple of .* = 4 × 2 = 8"):
        validate(cfg, nproc=2, check_data=False)
