"""Gradient compression: bytes saved against loss lost, and throughput on a slow (emulated) link.

Same model, steps and seed for every compressor, 2 gloo processes, AdamW, the smooth ``bigram``
corpus (exact entropy floor 2.3234 nats). Loss is the validation loss on the same 65,536 tokens for
every run (labkit's validation order does not follow the seed), compared two ways:

- **loss vs none**: final loss relative to the uncompressed run's;
- **gap vs none**: the gap above the floor relative to uncompressed's gap. This is the measure we hold
  the targets to: near the floor, a loss 0.5% higher can be a gap 50% larger, i.e. half again as much
  left unlearned. The floor is the generating chain's own loss on the very tokens scored
  (``summary["val_floor"]``, :func:`labkit.data.validation_floor`): on 65,536 tokens it sits a
  little off the entropy rate (+0.0015 nats on the shipped corpus, −0.0034 on the 16M-character one
  below: 14% and 41% of uncompressed's gap), and
  that shared offset would otherwise bend every ratio. The ratio against the entropy rate is printed
  too, in brackets.

Targets (from the issue): ``powersgd`` ≥ 8× fewer bytes and ``topk`` (1%, error feedback) ≥ 30× fewer
bytes, each with a final gap within 5% of uncompressed's; at an emulated 1 Gb/s, compression raises
throughput.

**Every run: AdamW peak lr 1.5e-2 after 200 warmup steps, weight decay 0, (β1, β2) (0.5, 0.95)** (``--lr``,
``--warmup-steps``, ``--weight-decay``, ``--beta1``; ``--betas`` and ``--lrs`` can still give one compressor its
own). The warmup was the last setting we checked. At the config's 20 steps up to 1.5e-2, each of seed 9's runs
spiked early: the uncompressed training loss fell from 4.19 to about 3.4 by step 9, climbed back to 4.4 at step 13
and stayed near 4 until step 22. PowerSGD spiked too and recovered slowest. Its training loss stayed 0.06 to 0.44
nats above uncompressed's over steps 50 to 200 (averaged per 50 and 100 steps; seeds 9, 10, 11), and the lag
shrank to about 0.0004 nats by the end: that lag was its whole final excess. Warmed up over 200 steps (4% of the
run), the loss falls smoothly from the start (seeds 1337 and 1), and PowerSGD's training loss is level with
uncompressed's from about step 100. On the seeds we tuned on, 1337 and 1, uncompressed's gap went from 0.00483 to
0.00463 and from 0.00449 to 0.00459, a mean no worse, so 200 stays. PowerSGD's went from 0.00480 to 0.00438 and
from 0.00475 to 0.00438. Top-k's went from 0.00496 to 0.00443 (seed 1337).

These settings were written down before they were judged on three fresh seeds (``--seeds 15 16 17``):

    powersgd  −6.0%  −4.6%  −3.3%  [−4.6%]    8.2× fewer bytes
    topk      −5.1%  −4.5%  −0.9%  [−3.5%]    50.0× fewer bytes

**Both meet the target.** PowerSGD (rank 8) sends 8.2× fewer bytes than uncompressed, and top-k (1%, error
feedback) 50× fewer. Both end with a gap above the floor no larger than uncompressed's, on every seed: gaps
0.00440, 0.00466 and 0.00431 for PowerSGD, 0.00444, 0.00466 and 0.00442 for top-k, against 0.00468, 0.00489 and
0.00446. The final losses are all within 0.01% of uncompressed's. Why both end a little below uncompressed we
have not measured, and a seed moves these ratios by a few points, so we claim no more than the issue's target:
a gap within 5% of uncompressed's. The lesson we take for tuning a cluster: settle
every setting of the baseline before blaming the compressor, and judge on seeds you did not tune on.

**How we got here.** The newest steps come first here, then the older ones in the order we took them.

**Weight decay 0 (``--weight-decay``), still at the config's 20 warmup steps.** Of all the settings, decay
mattered most: every number from "Before that" on was measured at the config's 0.1. But no token is trained on
twice here, so there is nothing for a regulariser to do, and decay only pulls the weights off the optimum. At 0,
uncompressed's gap fell from 0.00771 to 0.00483 (seed 1337, lr 1.5e-2), and on that seed the compressors' excess
nearly vanished: PowerSGD 0.00480 (−0.6%) and top-k 0.00496 (+2.7%), both at the shared betas. The betas top-k
had been given while decay was on, (0, 0.99), now hurt it: 0.00557 (+15.3%); (0, 0.95) gave 0.00612. Our reading,
not a measurement: decoupled decay shrinks every weight on every step, while error feedback delivers the
compressed gradient late (top-k's in bursts), so a compressed weight settles where decay balances a weaker push,
nearer zero than the uncompressed one. With decay off, a delayed gradient is only delayed. The baseline was
re-tuned at 0: peak lr 1e-2, 1.5e-2, 2e-2 and 3e-2 gave 0.00508, 0.00483, 0.00457 and 0.00676 on seed 1337, and
1.5e-2 and 2e-2 gave 0.00449 and 0.00518 on seed 1, so 1.5e-2 stays (best mean); weight decay 0.01 gave 0.00496
(seed 1337).

Those settings were chosen on seeds 1337 and 1 and written down before they were judged on three fresh
seeds (``--seeds 9 10 11``, 20 warmup steps):

    powersgd  +8.9%  +6.6%  +7.6%  [+7.7%]    8.2× fewer bytes
    topk      +3.9%  +3.7%  +3.7%  [+3.8%]    50.0× fewer bytes

**Top-k meets the target** (1%, error feedback, 50× fewer bytes, gap +3.8%), on every seed and with far less
spread between seeds than at weight decay 0.1. **PowerSGD did not**: seed 1337's −0.6% was one lucky seed. Its excess
on these seeds is larger than it was with decay (+6.1% on seeds 6, 7 and 8), against a baseline whose gap is
about 40% smaller (mean 0.0047 on seeds 9–11, 0.0077 on seeds 6–8 with decay), so in nats it shrank. The final
losses are all within 0.02% of uncompressed's.

A wider projection helped PowerSGD only a little with decay off: rank 16 (min rate 3, so the same matrices are
compressed) gave gaps 0.00480 and 0.00461 on seeds 1337 and 1, against rank 8's 0.00480 and 0.00475, and at
5.0× fewer bytes it misses the byte target.

Two more tries for PowerSGD at 20 warmup steps, neither a fix. Its own peak lr 2e-2 (``--lrs powersgd=0.02``)
looked better on seeds 1337 and 1: gaps 0.00491 and 0.00458. On fresh seeds 12, 13 and 14 it was +26.6%
(0.00502, 0.00612 and 0.00602, against 0.00451, 0.00466 and 0.00439 for uncompressed at 1.5e-2; uncompressed
at 2e-2 was worse, 0.00476, 0.00556 and 0.00421). Rank 16 with its factors all-reduced in bf16 (a prototype;
min rate 3; the same 8.2× fewer bytes as rank 8) gave 0.00481 and 0.00488 on seeds 1337 and 1, no better
than rank 8, so it was not built.

**Before that, everything was measured at weight decay 0.1**, and top-k's own betas below were chosen under it.

**AdamW β1 0.5 for every run, not the config's 0.9 (``--beta1``); top-k at its own β1 0 and β2 0.99
(``--betas``).** These were chosen at the config's peak learning rate, 1e-2; the benchmark now runs at
1.5e-2 (``--lr``, below). Error feedback keeps each coordinate's unsent gradient and sends it later, so what a
compressor delivers is already a sum over past steps, much as momentum is. Adam's β1 then averages
again on top, and the two lags add up. Lowering β1 from 0.9 to 0.5 helped every run, uncompressed
included; below 0.5 only top-k kept gaining on average. At 4,800 steps on the 16M corpus (gap vs none
at the same betas, seeds 1337 / 1 / 2, mean in brackets):

    β1 0.9   powersgd  +3.9%  +4.9%  +8.5%  [+5.8%]    topk  +12.1% +10.7% +15.3%  [+12.7%]
    β1 0.5   powersgd  +2.1%  +7.2%  +5.1%  [+4.8%]    topk   +4.4% +10.7% +10.9%  [ +8.7%]
    β1 0.2   powersgd  +9.0%  +5.7%  +2.3%  [+5.7%]    topk   +8.3%  +7.4%  +7.6%  [ +7.7%]
    β1 0                                               topk   −2.0%  +3.0%  +8.1%  [ +3.0%]

Uncompressed is as good at β1 0.5 as at 0.2 (mean gap 0.00784 and 0.00780) and worse at 0.9
(0.00831) and at 0 (0.00808). Top-k keeps improving down to β1 0, so its +3.0% there is partly
a weaker baseline: against uncompressed at β1 0.5, top-k at β1 0 is +2.2%, +6.3% and +9.9%
[+6.1%]. Raising β1 to 0.98 instead (2,400 steps on the shipped corpus) made top-k's excess +46%.

Top-k's aggregate is also bursty: most entries are sent rarely, each time with many steps' worth at
once, and Adam divides by a running mean of squared gradients. A longer window for that mean helped
top-k at β1 0: with β2 0.99 its gaps were +2.5%, +4.4% and +9.1% [+5.3%] of uncompressed's at
(0.5, 0.95). β2 0.999 hurt (+18.9% and +27.1% on the first two seeds), and β2 0.99 did not help
uncompressed (mean gap 0.00808 at β1 0.5). So each compressor runs at the best betas we found for it,
as DGC and its successors each get their own momentum: uncompressed and PowerSGD at (0.5, 0.95),
top-k at (0, 0.99). Every table header says which.

Those betas were picked on seeds 1337, 1 and 2, and picking the best of many runs favours whichever
was lucky on those seeds. So they were judged on three fresh seeds, run after the settings were
fixed (``--seeds 3 4 5 --lr 0.01``, 4,800 steps):

    powersgd  +7.5%  +7.3%  +4.2%  [+6.3%]    8.2× fewer bytes
    topk      +4.6%  +9.6%  +1.7%  [+5.3%]    50.0× fewer bytes

Neither met the 5% tolerance on the fresh mean, nor on the mean of all six seeds (PowerSGD +5.6%,
top-k +5.3%). Both were within a single seed's spread of it: a seed moves a ratio by several points,
which is why ``--seeds`` judges the mean. The final losses were all within 0.04% of uncompressed's.

**Peak learning rate 1.5e-2 for every run (``--lr``), not the config's 1e-2.** Everything above was
measured at 1e-2, and 1e-2 is not the uncompressed run's best. Its gap at 1e-2, 1.5e-2, 2e-2 and 3e-2
was 0.00811, 0.00771, 0.00763 and 0.00867 on seed 1337, and 0.00765, 0.00730 and 0.00775 on seed 1
(3e-2 not run). A baseline below its best flatters every compressor measured against it. The
compressors gained less from 1.5e-2: PowerSGD's gaps went from 0.00828 to 0.00825 and from 0.00820 to
0.00801, top-k's from 0.00831 to 0.00816 and from 0.00799 to 0.00820. Their excesses grew to +7.0% and
+9.7% (PowerSGD) and +5.8% and +12.3% (top-k). So the benchmark now runs at 1.5e-2, and the verdict at it
comes from three more fresh seeds, run after that was fixed (``--seeds 6 7 8``):

    powersgd  +5.4%  +5.2%  +7.8%  [+6.1%]    8.2× fewer bytes
    topk      +9.3%  +11.1%  +11.4%  [+10.6%]    50.0× fewer bytes

Neither meets the 5% tolerance. PowerSGD's excess is about what it was at 1e-2 (+6.3% on seeds 3, 4
and 5); top-k's is twice as large (+5.3% there), every seed above +9%. Top-k gained nothing from 1.5e-2
on the tuning seeds, so most of the rise in its excess is the baseline's gain. The final losses are all within
0.04% of uncompressed's.

Numbers below that name β1 0.9 were measured with ``--beta1 0.9``; all below were at lr 1e-2.

Five more ideas failed, at 4,800 steps (gaps against uncompressed on the same seed and settings):

- **PowerSGD at β2 0.99** (seeds 1337 and 1): +4.1% and +8.4%, against +2.1% and +7.2% at 0.95.
- **PowerSGD at rank 16** (lr 1.5e-2, min rate 3 so the same matrices are compressed; 5.0× fewer bytes):
  gaps 0.00835 and 0.00800 on seeds 1337 and 1, against rank 8's 0.00825 and 0.00801. Its excess was not
  made of what rank 8 leaves out.
- **Top-k with its error memory flushed** by a dense all-reduce every 100 steps, a prototype, not shipped
  (CSER, Xie et al. 2020, resets the error this way; 33.6× fewer bytes): gaps 0.01018 at (0, 0.99) and
  0.00860 at (0.5, 0.95), against 0.00816 without (seed 1337, lr 1.5e-2). Each flush is one large burst.
- **EF21** (Richtárik et al. 2021), a prototype for top-k, not shipped: each rank sends the top-k of the
  *change* in its gradient since what it last sent, and every rank applies the running sum of all that was
  sent, a dense estimate instead of sparse bursts. Gap 0.051 on seed 1337, six times uncompressed's. An
  entry that is not sent again keeps a stale value, and Adam turns even a small stale value into a
  full-size step.
- **Top-k with each burst given the full Adam step it stands for**, a prototype, not shipped: the aggregate
  divided by a running mean of squared *dense local* gradients (all-reduced every 100 steps, within the
  byte budget) instead of Adam's running mean of the aggregate's squares. It diverged within 300 steps
  (seed 1337, loss 172). A burst that carries T steps' worth then moves a weight T steps at once, with no
  gradient in between to say it has gone far enough. Adam applied to the aggregate itself remembers the
  bursts in its running mean and so moves a rarely sent weight less than a dense run would, roughly √T
  steps' worth per burst: stable but slow. That trade-off is our reading of top-k's excess.

The corpus is regenerated (same seed, so the same chain) at 16M characters in a temporary folder,
so 4,800 steps (9.8M tokens) never train on a token twice. On the shipped 1.8M-token training split
the runs would see each token five times: by 4,800 steps uncompressed's training loss is below the
floor (it fits its sample), and the comparison then measures memorisation as much as learning.
``--corpus-length 0`` uses the shipped corpus instead.

PowerSGD sends a matrix dense unless its rank-r factors are ``--powersgd-min-rate`` times smaller
(torch's ``min_compression_rate``, config ``comm.powersgd_min_compression_rate``). The default 6
sends the tied 64×128 token embedding (and the position embedding) dense at rank 8: their factors
would be only 5.3× smaller, so they cost little to send whole. The tied embedding is both the
model's input and its output table, and the chain it must learn (64 rows of 64 log-probabilities)
has full rank: rank 8 passes on a slice of its gradient per step and error feedback holds the rest
back, which is our reading of why it helps so much. Sending those 16,384 numbers dense costs 8.2×
fewer bytes instead of 11.2×; on the shipped corpus it cut PowerSGD's gap excess from +15.8% to +10.4%.

With error feedback nothing is lost, only delayed. ``--horizons`` measures how the excess changes as
training gets longer: the same three runs trained to several lengths (each a whole run with its own
cosine schedule, not a checkpoint of a longer one). Longer training did not close the gap: at 9,600
steps (``--steps 9600 --corpus-length 32000000 --seeds 3 --lr 0.01``, so still no token seen twice) PowerSGD's
excess was +11.1% and top-k's +13.0%, against +7.5% and +4.6% at 4,800 steps on the same seed. The
gaps all shrank, uncompressed's fastest: 0.0080 → 0.0066, PowerSGD's 0.0086 → 0.0073, top-k's
0.0084 → 0.0075 (each length scored on its own corpus's validation tokens).

    .venv/bin/python benchmarks/compression.py [--steps 4800] [--powersgd-rank 8] [--powersgd-min-rate 6]
        [--horizons 600 2400] [--dataset bigram|markov] [--skip-throughput]
        [--compressors none powersgd topk] [--corpus-length 16000000] [--seeds 1337 1 2]
        [--topk-ratios 0.01 0.05 0.25] [--beta1 0.5] [--betas topk=0,0.99 powersgd=0.2,0.95] [--lr 0.015]
        [--lrs powersgd=0.02] [--weight-decay 0] [--warmup-steps 200]

``--topk-ratios`` runs top-k at other densities against the same uncompressed run. With β1 0.9, at
4,800 steps on the 16M corpus (seed 1337), the gap excess was +12.1% at 1% (50× fewer bytes), +8.8% at 5%
(10×), +6.0% at 10% (5×) and +0.3% at 25% (2×). At that β1, top-k met the 5% tolerance only
somewhere between 10% and 25% density, far from the 30× byte target.

Takes about 40 min on 2 cores (the throughput rounds, then 7 runs of 4,800 steps); ``--horizons 600 2400``
adds ~10 min.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import time

import labkit
from labkit.config import ConfigError, validate
from labkit.data.corpora import CORPORA, write_corpus

COMPRESSORS = ["none", "fp16", "bf16", "powersgd", "topk", "sign", "randomk"]
BYTES_TARGETS = {"powersgd": 8.0, "topk": 30.0}  # at least this many times fewer bytes than none
GAP_TOLERANCE = 0.05  # final gap above the floor at most 5% larger than uncompressed's
EVAL_BATCHES = 64  # × 8 sequences × 64 tokens × 2 ranks = 65,536 validation tokens


def bench_config(args):
    return labkit.load_config("configs/quickstart.yaml").replace(**{
        "run.name": "compression-bench", "run.save_final": False, "run.eval_batches": EVAL_BATCHES,
        "metrics.progress": False, "metrics.alerts": False, "data.dataset": args.dataset,
        "comm.powersgd_rank": args.powersgd_rank, "comm.powersgd_min_compression_rate": args.powersgd_min_rate,
        "optim.beta1": args.beta1, "optim.lr": args.lr, "optim.weight_decay": args.weight_decay,
        "optim.warmup_steps": args.warmup_steps,
        "model.n_layer": 2, "model.n_embd": 128,
        "run.runs_dir": "/tmp/labkit-bench-runs"})


def compressor_settings(compressor: str, own: dict) -> dict:
    """The config overrides of one compressor's runs: the compressor, and its own AdamW settings if it has them."""
    return {"comm.compression": compressor, **own.get(compressor, {})}


def own_settings(betas: dict, lrs: dict) -> dict[str, dict]:
    """Each compressor's own AdamW settings from ``--betas`` and ``--lrs``, as config overrides."""
    own: dict[str, dict] = {}
    for compressor, (beta1, beta2) in betas.items():
        own.setdefault(compressor, {}).update({"optim.beta1": beta1, "optim.beta2": beta2})
    for compressor, lr in lrs.items():
        own.setdefault(compressor, {})["optim.lr"] = lr
    return own


def parse_betas(text: str) -> tuple[str, tuple[float, float]]:
    """``topk=0,0.99`` -> ("topk", (0.0, 0.99))."""
    try:
        compressor, values = text.split("=")
        beta1, beta2 = (float(v) for v in values.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected COMPRESSOR=BETA1,BETA2 (e.g. topk=0,0.99), got {text!r}")
    return known(compressor), (beta1, beta2)


def parse_lr(text: str) -> tuple[str, float]:
    """``powersgd=0.02`` -> ("powersgd", 0.02)."""
    try:
        compressor, value = text.split("=")
        lr = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected COMPRESSOR=LR (e.g. powersgd=0.02), got {text!r}")
    return known(compressor), lr


def known(compressor: str) -> str:
    if compressor not in COMPRESSORS:
        raise argparse.ArgumentTypeError(f"unknown compressor {compressor!r}; choose from {', '.join(COMPRESSORS)}")
    return compressor


def train(config, steps: int, settings: dict) -> dict:
    """One finished run: final validation loss, the floor, bytes on the wire, throughput."""
    config = config.replace(**{"run.steps": steps, "run.eval_every": steps, **settings})
    r = labkit.launch(config, nproc=2)
    assert r.wait() == "finished", r.log()[-2000:]
    s, m = r.summary, r.metrics
    return {"loss": s["val_loss"], "floor": s["val_floor"], "rate": s["entropy_floor"], "bytes": sum(m["comm_bytes"]),
            "tokens_per_s": s["tokens_per_s"], "comm_frac": s["comm_frac"]}


def relative(result: dict, base: dict) -> dict:
    """Loss, gap above the floor and bytes of ``result`` against the uncompressed ``base``."""
    gap, base_gap = result["loss"] - result["floor"], base["loss"] - base["floor"]
    rate_gap = (result["loss"] - result["rate"]) / (base["loss"] - base["rate"]) - 1
    return {"loss_vs_none": result["loss"] / base["loss"] - 1, "gap": gap, "gap_vs_none": gap / base_gap - 1,
            "rate_gap_vs_none": rate_gap, "fewer_bytes": base["bytes"] / max(result["bytes"], 1)}


def verdict(compressor: str, rel: dict) -> str:
    need = BYTES_TARGETS[compressor]
    bytes_ok, gap_ok = rel["fewer_bytes"] >= need, rel["gap_vs_none"] <= GAP_TOLERANCE
    return (f"{compressor}: {rel['fewer_bytes']:.1f}× fewer bytes (target ≥ {need:g}×: "
            f"{'met' if bytes_ok else 'NOT met'}), gap {rel['gap_vs_none']:+.1%} of uncompressed's "
            f"(target ≤ {GAP_TOLERANCE:+.0%}: {'met' if gap_ok else 'NOT met'}; above the entropy rate "
            f"{rel['rate_gap_vs_none']:+.1%}); loss {rel['loss_vs_none']:+.2%} of "
            f"uncompressed's (within {GAP_TOLERANCE:.0%} on the looser measure: "
            f"{'yes' if abs(rel['loss_vs_none']) <= GAP_TOLERANCE else 'no'})")


def accuracy_table(config, steps: int, compressors: list[str], seeds: list[int], own: dict) -> dict[int, dict]:
    """The main table; returns the uncompressed run of each seed (the baseline of later tables)."""
    print(f"{steps} steps, 2 processes, each compressor against none on the same seed, powersgd rank "
          f"{config.comm.powersgd_rank} (matrices it shrinks < {config.comm.powersgd_min_compression_rate:g}× sent "
          f"dense), topk/randomk {config.comm.compression_ratio:.0%}, AdamW peak lr {config.optim.lr:g} after "
          f"{config.optim.warmup_steps} warmup steps, weight decay {config.optim.weight_decay:g}, (β1, β2) "
          f"({config.optim.beta1:g}, {config.optim.beta2:g}){describe_own(compressors, own)}; "
          f"loss = validation loss on "
          f"{EVAL_BATCHES * 8 * 64 * 2:,} fixed tokens; gap = loss − the chain's own loss on those tokens "
          "[vs none above the entropy rate]\n")
    print(f"{'seed':>4s} {'compressor':10s} {'loss':>7s} {'vs none':>8s} {'gap':>7s} {'gap vs none':>11s} "
          f"{'[rate]':>8s} {'MB sent':>9s} {'fewer bytes':>11s} {'time':>6s}")
    rels: dict[str, list[dict]] = {c: [] for c in compressors}
    bases = {}
    for seed in seeds:
        base = None
        for c in compressors:  # none first: it is the baseline
            start = time.perf_counter()
            r = train(config, steps, {**compressor_settings(c, own), "run.seed": seed})
            base = bases[seed] = base or r
            rel = relative(r, base)
            rels[c].append(rel)
            print(f"{seed:4d} {c:10s} {r['loss']:7.4f} {rel['loss_vs_none']:+8.2%} {rel['gap']:7.4f} "
                  f"{rel['gap_vs_none']:+10.1%} [{rel['rate_gap_vs_none']:+6.1%}] {r['bytes'] / 1e6:9.2f} "
                  f"{rel['fewer_bytes']:10.1f}× {time.perf_counter() - start:5.0f}s", flush=True)
    mean = {c: {key: statistics.mean(rel[key] for rel in rels[c]) for key in rels[c][0]} for c in compressors}
    if len(seeds) > 1:
        print(f"\nmean over seeds {', '.join(map(str, seeds))}: gap vs none (each seed's)")
        for c in compressors[1:]:
            each = " ".join(f"{rel['gap_vs_none']:+.1%}" for rel in rels[c])
            print(f"  {c:10s} {mean[c]['gap_vs_none']:+7.1%}   ({each})")
    print()
    for c in (c for c in BYTES_TARGETS if c in mean):
        print(verdict(c, mean[c]) + ("" if len(seeds) > 1 else "  [one seed: seeds move this by a few %]"))
    return bases


def describe_own(compressors: list[str], own: dict) -> str:
    """``, powersgd lr 0.02, topk (β1, β2) (0, 0.99)``: the settings some compressors have of their own."""
    def one(settings: dict) -> str:
        parts = [f"lr {settings['optim.lr']:g}"] if "optim.lr" in settings else []
        if "optim.beta1" in settings:
            parts.append(f"(β1, β2) ({settings['optim.beta1']:g}, {settings['optim.beta2']:g})")
        return " ".join(parts)
    return "".join(f", {c} {one(settings)}" for c, settings in own.items() if c in compressors and settings)


def horizon_table(config, horizons: list[int], own: dict) -> None:
    print("\nthe gap vs uncompressed as training gets longer (each length a whole run):")
    print(f"{'steps':>6s} {'none gap':>9s} {'powersgd':>9s} {'topk':>9s}")
    for steps in horizons:
        base = train(config, steps, compressor_settings("none", own))
        rels = [relative(train(config, steps, compressor_settings(c, own)), base)["gap_vs_none"]
                for c in ("powersgd", "topk")]
        print(f"{steps:6d} {base['loss'] - base['floor']:9.4f} {rels[0]:+9.1%} {rels[1]:+9.1%}", flush=True)


def density_table(config, steps: int, ratios: list[float], seed: int, base: dict, own: dict) -> None:
    """Top-k's gap against how much of the gradient it keeps: where does it meet the tolerance?"""
    print(f"\ntopk at several densities, {steps} steps, seed {seed}, against that seed's uncompressed run:")
    print(f"{'kept':>6s} {'fewer bytes':>11s} {'gap':>7s} {'gap vs none':>11s}")
    for ratio in ratios:
        settings = {**compressor_settings("topk", own), "comm.compression_ratio": ratio, "run.seed": seed}
        rel = relative(train(config, steps, settings), base)
        print(f"{ratio:6.1%} {rel['fewer_bytes']:10.1f}× {rel['gap']:7.4f} {rel['gap_vs_none']:+10.1%}", flush=True)


def throughput_table(config, own: dict, repeats: int = 3) -> None:
    """Tokens/s on an emulated 1 Gb/s link: median of ``repeats`` rounds, compressors interleaved."""
    slow = config.replace(**{"comm.bandwidth_gbps": 1.0, "comm.latency_us": 50.0})
    names = ("none", "bf16", "powersgd", "topk")
    rounds = [{c: train(slow, 40, compressor_settings(c, own)) for c in names} for _ in range(repeats)]
    print(f"\nthroughput on an emulated 1 Gb/s link (50 µs latency), 40 steps, median of {repeats} interleaved rounds:")
    base = statistics.median(r["none"]["tokens_per_s"] for r in rounds)
    for c in names:
        tps = statistics.median(r[c]["tokens_per_s"] for r in rounds)
        frac = statistics.median(r[c]["comm_frac"] for r in rounds)
        print(f"  {c:9s} {tps:9,.0f} tokens/s ({tps / base:5.2f}× none)   communication {100 * frac:5.1f}% of step time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4800)
    parser.add_argument("--dataset", default="bigram", choices=sorted(CORPORA),
                        help="bigram (smooth) or markov (order 2, a plateau)")
    parser.add_argument("--powersgd-rank", type=int, default=8)
    parser.add_argument("--powersgd-min-rate", type=float, default=6.0,
                        help="powersgd sends a matrix dense unless its factors are this many times smaller "
                             "(6 leaves the 64x128 embeddings dense at rank 8; torch's default is 2)")
    parser.add_argument("--horizons", type=int, nargs="*", default=[], help="also compare at these lengths")
    parser.add_argument("--topk-ratios", type=float, nargs="*", default=[],
                        help="also run topk keeping these fractions (e.g. 0.01 0.05 0.25) against none")
    parser.add_argument("--beta1", type=float, default=0.5,
                        help="AdamW beta1 of the compressors without their own betas (0.5: see the docstring; "
                             "the config's is 0.9)")
    parser.add_argument("--lr", type=float, default=1.5e-2,
                        help="AdamW's peak learning rate for every run (1.5e-2: the uncompressed run's best on "
                             "average of those tried, see the docstring; the config's is 1e-2)")
    parser.add_argument("--weight-decay", type=float, default=0.0,
                        help="AdamW's weight decay for every run (0: no token is seen twice, so there is nothing to "
                             "regularise, and decay only pulls weights off the optimum: see the docstring; the "
                             "config's is 0.1)")
    parser.add_argument("--warmup-steps", type=int, default=200,
                        help="steps of linear learning-rate warmup for every run (200: at the config's 20 every run "
                             "spiked early and PowerSGD never quite recovered, see the docstring)")
    parser.add_argument("--betas", type=parse_betas, nargs="*", default=[], metavar="COMPRESSOR=B1,B2",
                        help="give a compressor its own AdamW betas (by default every run shares --beta1 and the "
                             "config's beta2 0.95; topk=0,0.99 was top-k's own before weight decay was turned off, "
                             "see the docstring); none=B1,B2 changes the baseline")
    parser.add_argument("--lrs", type=parse_lr, nargs="*", default=[], metavar="COMPRESSOR=LR",
                        help="give a compressor its own peak learning rate (by default every run shares --lr)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--compressors", nargs="+", default=COMPRESSORS, choices=COMPRESSORS,
                        help="the accuracy table's rows (none always comes first: it is the baseline)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337],
                        help="repeat the accuracy table for these seeds; the verdict is on the mean")
    parser.add_argument("--corpus-length", type=int, default=16_000_000,
                        help="regenerate the corpus at this many characters (0: the shipped corpus)")
    args = parser.parse_args()
    own = own_settings(dict(args.betas), dict(args.lrs))
    try:  # before the corpus is written: bad settings fail at once
        config = bench_config(args)
        validate(config, nproc=2, check_data=not args.corpus_length)
    except ConfigError as error:
        parser.error(str(error))
    for compressor in own:
        try:
            validate(config.replace(**compressor_settings(compressor, own)), nproc=2, check_data=not args.corpus_length)
        except ConfigError as error:
            parser.error(f"--betas/--lrs {compressor}: {error}")
    for ratio in args.topk_ratios:  # a bad density fails now, not after the main table's runs
        try:
            validate(config.replace(**{"comm.compression": "topk", "comm.compression_ratio": ratio}), nproc=2,
                     check_data=not args.corpus_length)
        except ConfigError as error:
            parser.error(f"--topk-ratios {ratio}: {error}")
    if args.corpus_length:
        folder = tempfile.mkdtemp(prefix="labkit-corpus-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        write_corpus(args.dataset, folder, length=args.corpus_length)
        os.environ["LABKIT_DATASETS"] = folder  # the launched workers inherit it
        print(f"corpus: {args.dataset} regenerated at {args.corpus_length:,} characters in {folder}\n")
    if not args.skip_throughput:
        throughput_table(config, own)
        print()
    bases = accuracy_table(config, args.steps, ["none", *(c for c in args.compressors if c != "none")], args.seeds, own)
    if args.horizons:
        horizon_table(config, args.horizons, own)
    if args.topk_ratios:
        density_table(config, args.steps, args.topk_ratios, args.seeds[0], bases[args.seeds[0]], own)


if __name__ == "__main__":
    main()
