"""Small synthetic corpora whose *true* entropy we know exactly.

Why synthetic text?  A language model's loss (cross-entropy, nats/token) can
never go below the entropy rate of the source that produced the text.  For
real text that floor is unknown; for text sampled from a known random process
we can compute it exactly, so every training curve gets a ruler: "the model is
0.05 nats above the best any model could ever do".

Each corpus is produced by a function of a seed (NumPy ``Generator``), and the
seed is recorded in ``datasets/<name>.json`` next to the text, so the shipped
files can be regenerated bit for bit::

    python -m labkit.data.corpora            # rewrites datasets/*.txt, *.json
    python -m labkit.data.corpora --out /tmp/corpora

Sampling draws all randomness *sequentially* from one generator, so a shorter
generation is an exact prefix of a longer one (cheap to test).
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

MARKOV_ALPHABET = "abcdefghijklmnop"  # 16 symbols
ZIPF_ALPHABET = "abcdefghijklmnopqrstuvwxyz012345"  # 32 symbols, most frequent first
BIGRAM_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/"  # 64 symbols
_MODULE = "labkit.data.corpora"  # not __name__: that is "__main__" under python -m


class DatasetNotFoundError(ValueError):
    """Raised when a name is neither a shipped corpus nor an existing file."""


# ----------------------------------------------------------------- entropy --

def shannon_entropy(p: np.ndarray) -> float:
    """H(p) = -sum p log p in nats (0 log 0 = 0)."""
    p = np.asarray(p, dtype=np.float64)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def pair_state_transition_matrix(P: np.ndarray) -> np.ndarray:
    """Rewrite an order-2 chain P[a, b, c] = P(c | a, b) as an order-1 chain.

    The state is the pair (a, b); reading c moves it to (b, c).  Turning the
    chain into an ordinary 256 x 256 stochastic matrix lets us use the
    standard tools (stationary distribution, entropy rate) unchanged.
    """
    k = P.shape[0]
    T = np.zeros((k * k, k * k), dtype=np.float64)
    for a in range(k):
        for b in range(k):
            T[a * k + b, b * k:(b + 1) * k] = P[a, b]
    return T


def stationary_distribution(T: np.ndarray, tol: float = 1e-15, max_iter: int = 100_000) -> np.ndarray:
    """The distribution pi with pi T = pi, by power iteration in float64."""
    pi = np.full(T.shape[0], 1.0 / T.shape[0])
    for _ in range(max_iter):
        nxt = pi @ T
        nxt /= nxt.sum()
        if np.abs(nxt - pi).sum() < tol:
            return nxt
        pi = nxt
    raise RuntimeError("power iteration did not converge; is the chain irreducible?")


def markov_entropy_rate(P: np.ndarray) -> float:
    """H = sum_s pi(s) H(P(. | s)): the best achievable loss in nats/symbol.

    Once the chain is in its stationary regime, the next symbol depends only
    on the current pair state s, so the uncertainty left is the entropy of
    row s, averaged over how often s is visited.
    """
    k = P.shape[0]
    pi = stationary_distribution(pair_state_transition_matrix(P))
    rows = P.reshape(k * k, k)
    return float(sum(pi[s] * shannon_entropy(rows[s]) for s in range(k * k)))


# ----------------------------------------------------------------- markov --

def markov_transitions(rng: np.random.Generator, k: int = 16, concentration: float = 0.3) -> np.ndarray:
    """Draw P[a, b, :] = P(next | a, b) for an order-2 chain over k symbols.

    Structure, so there is something to learn at every order: each last
    symbol b first gets a sparse preference Q[b] ~ Dirichlet(0.3), then every
    row (a, b) is drawn around Q[b].  A unigram model sees almost uniform
    text, a bigram model (knowing b) gets most of the way, and only a model
    that uses two symbols of context reaches the entropy floor.
    """
    base = rng.dirichlet(np.full(k, concentration), size=k)  # Q[b]
    total = k * concentration
    P = np.empty((k, k, k))
    for a in range(k):
        for b in range(k):
            alpha = total * (0.75 * base[b] + 0.25 / k)
            P[a, b] = rng.dirichlet(alpha)
    return P


def sample_markov(P: np.ndarray, pi: np.ndarray, rng: np.random.Generator, length: int) -> np.ndarray:
    """Sample `length` symbols, starting from the stationary distribution.

    One uniform number per symbol, drawn in a single sequential call, makes
    the sample a prefix-consistent function of the seed.
    """
    k = P.shape[0]
    start = min(int(np.searchsorted(np.cumsum(pi), rng.random(), side="right")), k * k - 1)
    cdfs = np.cumsum(P.reshape(k * k, k), axis=1)
    cdfs[:, -1] = 1.0  # guard against round-off: u < 1 always lands on a symbol
    cdf_rows = cdfs.tolist()
    out = np.empty(max(length, 2), dtype=np.int64)
    out[0], out[1] = divmod(start, k)
    state = start
    for i, u in enumerate(rng.random(max(length - 2, 0)).tolist(), start=2):
        c = bisect.bisect_right(cdf_rows[state], u)
        out[i] = c
        state = (state % k) * k + c
    return out[:length]


def markov_corpus(seed: int = 1234, length: int = 1_000_000) -> tuple[str, dict]:
    """Order-2 Markov chain over 16 letters 'a'..'p'."""
    rng = np.random.default_rng(seed)
    P = markov_transitions(rng, k=len(MARKOV_ALPHABET))
    pi = stationary_distribution(pair_state_transition_matrix(P))
    ids = sample_markov(P, pi, rng, length)
    text = _ids_to_text(ids, MARKOV_ALPHABET)
    meta = _metadata(
        "markov", "markov_corpus", seed, text, MARKOV_ALPHABET, markov_entropy_rate(P),
        "Order-2 Markov chain over 16 symbols a..p. Transition rows are Dirichlet "
        "draws around a sparse per-last-symbol preference, so both one and two "
        "symbols of context help. Entropy = exact entropy rate of the chain.",
    )
    return text, meta


# ------------------------------------------------------------------- zipf --

def zipf_probabilities(k: int = 32, s: float = 1.1) -> np.ndarray:
    """p(rank r) proportional to 1 / r**s for r = 1..k (most frequent first)."""
    weights = 1.0 / np.arange(1, k + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def zipf_corpus(seed: int = 4321, length: int = 500_000) -> tuple[str, dict]:
    """I.i.d. symbols with Zipf(1.1) frequencies: context is useless here.

    A model can only learn the unigram frequencies, so its loss should drop
    to the entropy quickly and stay flat: a good sanity check for a trainer.
    """
    rng = np.random.default_rng(seed)
    p = zipf_probabilities(len(ZIPF_ALPHABET), 1.1)
    cdf = np.cumsum(p)
    cdf[-1] = 1.0
    ids = np.searchsorted(cdf, rng.random(length), side="right")
    text = _ids_to_text(ids, ZIPF_ALPHABET)
    meta = _metadata(
        "zipf", "zipf_corpus", seed, text, ZIPF_ALPHABET, shannon_entropy(p),
        "I.i.d. symbols over 32 characters (a..z then 0..5, in rank order) with "
        "Zipf(s=1.1) probabilities. Entropy = Shannon entropy of that distribution.",
    )
    return text, meta


# ----------------------------------------------------------------- bigram --

def bigram_transitions(rng: np.random.Generator, k: int = 64, concentration: float = 0.1) -> np.ndarray:
    """Draw P[a, :] = P(next | a) for an order-1 chain over k symbols: k independent sparse rows."""
    return rng.dirichlet(np.full(k, concentration), size=k)


def chain_entropy_rate(P: np.ndarray) -> float:
    """H = sum_a pi(a) H(P(. | a)) for an order-1 chain: its best achievable loss in nats/symbol."""
    pi = stationary_distribution(P)
    return float(sum(pi[a] * shannon_entropy(P[a]) for a in range(len(P))))


def sample_chain(P: np.ndarray, rng: np.random.Generator, length: int) -> np.ndarray:
    """Sample an order-1 chain from its stationary distribution (one uniform number per symbol)."""
    cdfs = np.cumsum(P, axis=1)
    cdfs[:, -1] = 1.0
    rows = cdfs.tolist()
    pi = stationary_distribution(P)
    u = rng.random(length).tolist()
    out = np.empty(length, dtype=np.int64)
    state = min(int(np.searchsorted(np.cumsum(pi), u[0], side="right")), len(P) - 1)
    out[0] = state
    for i in range(1, length):
        state = bisect.bisect_right(rows[state], u[i])
        out[i] = state
    return out


def bigram_corpus(seed: int = 2024, length: int = 2_000_000) -> tuple[str, dict]:
    """Order-1 Markov chain over 64 symbols with sparse random rows: the scaling-law corpus.

    Nothing to discover but a 64 × 64 table of next-symbol probabilities, so the loss falls
    smoothly, without the plateaus of the order-2 corpus: it is limited by how well a model of
    a given size can represent the table (its width bounds the rank of its logits) and by how
    many samples of each row it has seen. Both shrink as power laws — the regime that scaling
    laws describe — towards an exactly known floor.
    """
    rng = np.random.default_rng(seed)
    P = bigram_transitions(rng, k=len(BIGRAM_ALPHABET))
    ids = sample_chain(P, rng, length)
    text = _ids_to_text(ids, BIGRAM_ALPHABET)
    meta = _metadata(
        "bigram", "bigram_corpus", seed, text, BIGRAM_ALPHABET, chain_entropy_rate(P),
        "Order-1 Markov chain over 64 symbols (a..z, A..Z, 0..9, +, /); each row a Dirichlet(0.1) draw. "
        "Made for scaling-law sweeps: smooth learning curves. Entropy = exact entropy rate of the chain.",
    )
    return text, meta


# ---------------------------------------------------- the best model's loss --

def _true_rows(meta: dict) -> Optional[tuple[int, np.ndarray]]:
    """(order, log-probability table) of the process that generated a shipped corpus, from its seed."""
    generator, k = str(meta.get("generator", "")), len(meta.get("alphabet", ""))
    rng = np.random.default_rng(meta.get("seed"))
    if generator == f"{_MODULE}.bigram_corpus":
        return 1, np.log(bigram_transitions(rng, k=k))  # [previous, next]
    if generator == f"{_MODULE}.markov_corpus":
        return 2, np.log(markov_transitions(rng, k=k))  # [two back, previous, next]
    if generator == f"{_MODULE}.zipf_corpus":
        return 0, np.log(zipf_probabilities(k, 1.1))
    return None


def true_nll(text: str, meta: Optional[dict]) -> Optional[np.ndarray]:
    """-log p(symbol | the symbols before it), symbol by symbol, under the process that made ``text``.

    This is the loss of the best possible model, token by token. Its mean over a long text is the
    entropy rate, but over one finite sample it is not: on 65,536 validation tokens it differs by
    a few thousandths of a nat, as much as a trained model's whole distance from the floor. So the
    fair ruler for a loss measured on particular tokens is this, averaged over the same tokens
    (:func:`labkit.data.validation_floor`). The first ``order`` symbols (whose context is not in the
    text) are NaN. None when ``meta`` is not one of this module's corpora.
    """
    found = _true_rows(meta or {})
    if found is None:
        return None
    order, log_p = found
    lookup = np.full(256, -1, dtype=np.int64)
    lookup[np.frombuffer(meta["alphabet"].encode("ascii"), dtype=np.uint8)] = np.arange(len(meta["alphabet"]))
    ids = lookup[np.frombuffer(text.encode("ascii"), dtype=np.uint8)]
    if (ids < 0).any():
        raise ValueError(f"text has symbols outside the {meta.get('name')} alphabet: not that corpus")
    nll = np.full(len(ids), np.nan)
    contexts = [ids[order - back:len(ids) - back] for back in range(order, 0, -1)]
    nll[order:] = -log_p[(*contexts, ids[order:])]
    return nll


# --------------------------------------------------------------- registry --

CORPORA: dict[str, Callable[..., tuple[str, dict]]] = {
    "markov": markov_corpus,
    "zipf": zipf_corpus,
    "bigram": bigram_corpus,
}


def generate(name: str, seed: Optional[int] = None, length: Optional[int] = None) -> tuple[str, dict]:
    """Text and metadata of corpus `name`; seed/length default to the recorded ones."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r} (known: {', '.join(sorted(CORPORA))})")
    kwargs = {key: value for key, value in (("seed", seed), ("length", length)) if value is not None}
    return CORPORA[name](**kwargs)


def write_corpus(name: str, out_dir: Path | str, length: Optional[int] = None) -> Path:
    """Write <out_dir>/<name>.txt (exact UTF-8 bytes, no newline) and <name>.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text, meta = generate(name, length=length)
    txt_path = out_dir / f"{name}.txt"
    txt_path.write_bytes(text.encode("utf-8"))
    (out_dir / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return txt_path


def regenerate_all(out_dir: Path | str) -> list[Path]:
    return [write_corpus(name, out_dir) for name in CORPORA]


# ------------------------------------------------------- finding datasets --

def default_datasets_dir() -> Path:
    """$LABKIT_DATASETS if set, else the repository's datasets/ folder.

    Read at call time, so setting the variable in a test or a launcher works
    even after labkit was imported.
    """
    env = os.environ.get("LABKIT_DATASETS")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / "datasets"


DATASETS_DIR: Path = default_datasets_dir()


def available_datasets(datasets_dir: Path | str | None = None) -> list[str]:
    """Names of shipped corpora: every <name>.txt with a <name>.json beside it."""
    folder = Path(datasets_dir) if datasets_dir is not None else default_datasets_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.txt") if p.with_suffix(".json").is_file())


def resolve_dataset(name_or_path: Path | str, datasets_dir: Path | str | None = None) -> Path:
    """A shipped name ("markov") -> its .txt; else any existing text file path."""
    folder = Path(datasets_dir) if datasets_dir is not None else default_datasets_dir()
    names = available_datasets(folder)
    if str(name_or_path) in names:
        return (folder / f"{name_or_path}.txt").resolve()
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path.resolve()
    raise DatasetNotFoundError(
        f"dataset {str(name_or_path)!r} not found: not a shipped dataset "
        f"(available: {', '.join(names) or f'none in {folder}'}) and no file at that path"
    )


def load_metadata(name_or_path: Path | str, datasets_dir: Path | str | None = None) -> Optional[dict]:
    """The corpus metadata json, or None for a user's own text file."""
    meta_path = resolve_dataset(name_or_path, datasets_dir).with_suffix(".json")
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    # a json that merely happens to sit beside a user's file is not ours
    is_ours = isinstance(meta, dict) and str(meta.get("generator", "")).startswith(f"{_MODULE}.")
    return meta if is_ours else None


# ---------------------------------------------------------------- helpers --

def _ids_to_text(ids: np.ndarray, alphabet: str) -> str:
    return np.frombuffer(alphabet.encode("ascii"), dtype=np.uint8)[ids].tobytes().decode("ascii")


def _metadata(name: str, fn: str, seed: int, text: str, alphabet: str, nats: float, description: str) -> dict:
    return {
        "name": name,
        "generator": f"{_MODULE}.{fn}",
        "seed": seed,
        "length": len(text),
        "alphabet": alphabet,
        "entropy_nats_per_token": nats,
        "entropy_bits_per_token": nats / float(np.log(2.0)),
        "description": description,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labkit.data.corpora",
        description="Regenerate the shipped corpora from their recorded seeds.",
    )
    parser.add_argument("--out", default=None, help="output folder (default: the datasets/ folder)")
    parser.add_argument("--only", choices=sorted(CORPORA), action="append", help="regenerate just this corpus")
    args = parser.parse_args(argv)
    out_dir = Path(args.out) if args.out else default_datasets_dir()
    for name in args.only or list(CORPORA):
        path = write_corpus(name, out_dir)
        meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
        print(f"{path}: {meta['length']:,} chars, entropy {meta['entropy_nats_per_token']:.6f} "
              f"nats = {meta['entropy_bits_per_token']:.6f} bits per token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
