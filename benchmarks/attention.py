"""Attention backends on the CPU: time and peak memory of one forward + backward.

naive (materialises the seq × seq scores), sdpa (torch's fused kernel) and labkit_flash (FlashAttention-2
in plain PyTorch, ``labkit.model.flash``), causal, batch 1, 8 heads, head dim 64, float32, 2 threads.
Every (backend, seq) point runs in a fresh process (this file with ``--one BACKEND SEQ``), so one point's
allocations cannot inflate another's peak. Peak memory is the rise of the process's peak RSS
(``ru_maxrss``) during the first full-size pass over its value after imports, input creation and a tiny
warm-up pass (lazy library set-up is not the backend's memory); time is the best of several timed runs
after one warm-up. The points run in ``--rounds`` interleaved rounds (every backend and length once per round, the
order alternating), so a slow spell of the shared machine falls on every backend alike; each row is one round's
point, and the ``ratios`` rows give each length's labkit_flash / sdpa time ratio over the rounds (median, IQR, every
round: :func:`labkit.rounds.ratio_summary`). Targets: labkit_flash peak memory ≤ 10% of naive at 4096 tokens;
labkit_flash time within 3× of sdpa (median round). The table is appended to ``benchmarks/results/attention.jsonl``.

``--table tiles --backends sdpa labkit_flash labkit_flash_64 --seqs 2048 4096`` measures the tile size of
``labkit.model.flash`` (its default 128 × 128 against 64 × 64: ``labkit_flash_64``) the same way.

    .venv/bin/python benchmarks/attention.py [--seqs 512 1024 2048 4096 8192] [--repeats 3] [--rounds 6]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from labkit.results import write_results
from labkit.rounds import ratio_summary

BACKENDS = ("naive", "sdpa", "labkit_flash")
TILE_BACKENDS = {"labkit_flash_64": 64}  # labkit_flash with other tiles than its default 128 x 128 (--table tiles)
BATCH, HEADS, HEAD_DIM, THREADS = 1, 8, 64, 2
TIME_BUDGET_S = 45.0  # per point: stop repeating once the runs have taken this long
MIN_TIMED_S = 2.0     # per point: keep repeating quick runs until they add up to this


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure_one(backend: str, seq: int, repeats: int) -> dict:
    """Runs in the child: time and peak-RSS rise of forward + backward for one backend at one length."""
    import torch

    torch.set_num_threads(THREADS)
    from labkit.model.attention import naive_attention, sdpa_attention
    from labkit.model.flash import flash_attention, labkit_flash_attention

    fns = {"naive": naive_attention, "sdpa": sdpa_attention, "labkit_flash": labkit_flash_attention}
    fns.update({name: (lambda q, k, v, t=tile: flash_attention(q, k, v, block_q=t, block_k=t))
                for name, tile in TILE_BACKENDS.items()})
    fn = fns[backend]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen).requires_grad_() for _ in range(3))
    d_out = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen)

    def step(q, k, v, d_out) -> float:
        start = time.perf_counter()
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), d_out)
        return time.perf_counter() - start

    # A tiny pass first, so one-off lazy set-up (autograd engine, kernel libraries, thread pool: ~50 MiB)
    # is not charged to the backend; then the baseline, then the real sizes.
    tiny = [x[..., :32, :].detach().requires_grad_() for x in (q, k, v)]
    step(*tiny, d_out[..., :32, :])
    baseline = peak_rss_bytes()
    warmup = step(q, k, v, d_out)
    peak = peak_rss_bytes() - baseline  # of this first full-size pass: later repeats can only add malloc
    times: list[float] = []
    # Best of at least `repeats` runs (more, up to MIN_TIMED_S, when they are quick: the host is shared,
    # and the minimum is the run least disturbed by other load), within TIME_BUDGET_S.
    while (len(times) < repeats or sum(times) < MIN_TIMED_S) and sum(times) + warmup < TIME_BUDGET_S:
        times.append(step(q, k, v, d_out))
    times = times or [warmup]
    return {"backend": backend, "seq": seq, "time_s": min(times), "warmup_s": warmup, "runs": len(times),
            "peak_mib": peak / 2**20}


def run_point(backend: str, seq: int, repeats: int, timeout: float) -> dict:
    """One measurement in a fresh Python process; a failure or timeout becomes a row with an error."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS))
    cmd = [sys.executable, os.path.abspath(__file__), "--one", backend, str(seq), "--repeats", str(repeats)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"backend": backend, "seq": seq, "error": f"timeout after {timeout:.0f}s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        reason = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return {"backend": backend, "seq": seq, "error": reason[:80]}
    return json.loads(lines[-1])


def print_table(rows: list[dict]) -> None:
    by_key = {(r["backend"], r["seq"]): r for r in rows}
    print(f"{'seq':>6} {'backend':<13} {'time (s)':>9} {'peak (MiB)':>11} {'time / sdpa':>12} {'mem / naive':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['seq']:>6} {r['backend']:<13} {r['error']}")
            continue
        sdpa, naive = by_key.get(("sdpa", r["seq"]), {}), by_key.get(("naive", r["seq"]), {})
        t_ratio = f"{r['time_s'] / sdpa['time_s']:.2f}×" if "time_s" in sdpa else "-"
        m_ratio = f"{100 * r['peak_mib'] / naive['peak_mib']:.1f}%" if naive.get("peak_mib", 0) > 0 else "-"
        print(f"{r['seq']:>6} {r['backend']:<13} {r['time_s']:>9.3f} {r['peak_mib']:>11.1f} "
              f"{t_ratio:>12} {m_ratio:>12}")


def time_ratios(rows: list[dict], backend: str = "labkit_flash", against: str = "sdpa") -> list[dict]:
    """Each length's ``backend`` / ``against`` time over the rounds (one ratio per round that has both)."""
    ok = {(r["backend"], r["seq"], r.get("round", 0)): r["time_s"] for r in rows if "error" not in r}
    out = []
    for seq in sorted({s for b, s, _ in ok if b == backend}):
        rounds = sorted({r for b, s, r in ok if s == seq})
        ratios = [ok[(backend, seq, r)] / ok[(against, seq, r)] for r in rounds
                  if (backend, seq, r) in ok and (against, seq, r) in ok]
        if ratios:
            out.append({"ratio": f"{backend}/{against}", "seq": seq, **ratio_summary(ratios)})
    return out


def print_targets(rows: list[dict]) -> None:
    ok = {(r["backend"], r["seq"]): r for r in rows if "error" not in r and r.get("round", 0) == 0}
    seqs = sorted({s for b, s in ok if b == "labkit_flash"})
    mem_seq = 4096 if 4096 in seqs else (seqs[-1] if seqs else None)
    flash, naive = ok.get(("labkit_flash", mem_seq)), ok.get(("naive", mem_seq))
    if flash and naive and naive["peak_mib"] > 0:
        pct = 100 * flash["peak_mib"] / naive["peak_mib"]
        print(f"target: labkit_flash peak memory ≤ 10% of naive at {mem_seq}: "
              f"{flash['peak_mib']:.1f} / {naive['peak_mib']:.1f} MiB = {pct:.1f}%  {'PASS' if pct <= 10 else 'FAIL'}")
    ratios = {r["seq"]: r for r in time_ratios(rows)}
    if ratios:
        worst = max(r["median"] for r in ratios.values())
        listed = ", ".join(f"{s}: {r['median']:.2f}× (IQR {r['q1']:.2f}–{r['q3']:.2f}, {r['n_rounds']} rounds)"
                           for s, r in ratios.items())
        print(f"target: labkit_flash time within 3× of sdpa (median round): {listed}  "
              f"{'PASS' if worst <= 3 else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS + tuple(TILE_BACKENDS), default=list(BACKENDS))
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds of every point (ratios: median, IQR)")
    parser.add_argument("--table", choices=("attention", "tiles"), default="attention")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (best is kept)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds allowed per point")
    parser.add_argument("--one", nargs=2, metavar=("BACKEND", "SEQ"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args.repeats)))
        return
    print(f"causal attention fwd+bwd, batch {BATCH}, {HEADS} heads, head dim {HEAD_DIM}, float32, "
          f"{THREADS} threads, one fresh process per point")
    rows = []
    for r in range(args.rounds):
        order = args.backends if r % 2 == 0 else args.backends[::-1]  # alternate who goes first
        print(f"round {r + 1}/{args.rounds} (load average {os.getloadavg()[0]:.2f})", flush=True)
        for seq in args.seqs:
            for backend in order:
                rows.append({**run_point(backend, seq, args.repeats, args.timeout), "round": r})
                print(f"  {json.dumps(rows[-1])}", flush=True)
    print()
    print_table([row for row in rows if row["round"] == 0])
    ratios = time_ratios(rows) + [x for b in TILE_BACKENDS if b in args.backends for x in time_ratios(rows, b)]
    for x in ratios:
        print(f"{x['ratio']} at {x['seq']}: median {x['median']:.2f}× (IQR {x['q1']:.2f}–{x['q3']:.2f}), "
              f"rounds {', '.join(f'{v:.2f}' for v in x['rounds'])}{'  DRIFTING' if x['drifting'] else ''}")
    print_targets(rows)
    settings = {"seqs": args.seqs, "backends": args.backends, "repeats": args.repeats, "rounds": args.rounds,
                "timeout_s": args.timeout, "batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32",
                "threads": THREADS}
    record_rows = rows + [{"backend": "ratio", **x} for x in ratios]
    print(f"results: appended to {write_results('attention', record_rows, settings, table=args.table)}")


if __name__ == "__main__":
    main()
