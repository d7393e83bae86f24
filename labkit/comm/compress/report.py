"""The compression benchmark's results in words and tables, written from its results file.

``benchmarks/compression.py`` appends its tables to ``benchmarks/results/compression.jsonl``: ``accuracy``
(one row per seed and compressor), ``verdict`` (one row per compressor with a target: the mean over
seeds, each seed's value and the targets) and ``throughput``. Notebook 04 renders them with these
functions, so the figures it shows are the benchmark's, never typed in.
"""
from __future__ import annotations

from labkit.results import latest, markdown_table, provenance

ACCURACY_COLUMNS = [("seed", "seed", "d"), ("compressor", "compressor", "s"), ("loss", "loss", ".4f"),
                    ("gap above the floor", "gap", ".5f"), ("gap vs none", "gap_vs_none", "+.1%"),
                    ("MB sent", "mb_sent", ",.2f"), ("× fewer bytes", "fewer_bytes", ".1f")]
THROUGHPUT_COLUMNS = [("compressor", "compressor", "s"), ("tokens/s", "tokens_per_s", ",.0f"),
                      ("× none", "vs_none", ".2f"), ("comm in flight", "comm_frac", ".1%")]


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def over_seeds(row: dict) -> str:
    """The opening of a verdict's bracket: "the mean over seeds 15, 16, 17 (-6.0%, -4.6%, -3.3%; " or "on seed 1 ("."""
    seeds = row["seeds"]
    if len(seeds) == 1:
        return f"on seed {seeds[0]} ("
    each = ", ".join(f"{g:+.1%}" for g in row["gap_vs_none_each"])
    return f"the mean over seeds {', '.join(map(str, seeds))} ({each}; "


def verdict_sentence(row: dict, settings: dict) -> str:
    """One compressor against its targets, e.g. "**powersgd** sent 8.2× fewer bytes … (… target ≤ +5%: met)."."""
    return (f"**{row['compressor']}** sent {row['fewer_bytes']:.1f}× fewer bytes than uncompressed (target ≥ "
            f"{row['bytes_target']:g}×: {met(row['fewer_bytes'] >= row['bytes_target'])}) and ended "
            f"{settings['steps']:,} steps with a gap above the floor {row['gap_vs_none']:+.1%} of uncompressed's, "
            f"{over_seeds(row)}target ≤ {row['gap_tolerance']:+.0%}: "
            f"{met(row['gap_vs_none'] <= row['gap_tolerance'])}).")


def settings_line(settings: dict) -> str:
    """The settings every run of a table shared, in the benchmark header's words."""
    beta1, beta2 = settings["betas"]
    length = settings["corpus_length"]
    corpus = (f"{settings['dataset']} corpus regenerated at {length:,} characters" if length
              else f"the shipped {settings['dataset']} corpus")
    return (f"{settings['steps']:,} steps, {settings['nproc']} processes, {corpus}, powersgd rank "
            f"{settings['powersgd_rank']} (min rate {settings['powersgd_min_rate']:g}), topk "
            f"{settings['topk_ratio']:.0%}, AdamW peak lr {settings['lr']:g} after {settings['warmup_steps']} warmup "
            f"steps, weight decay {settings['weight_decay']:g}, (β1, β2) ({beta1:g}, {beta2:g}); gap = validation "
            f"loss − the chain's own loss on the {settings['eval_tokens']:,} tokens scored")


def verdict_markdown(records: list[dict], **settings) -> str:
    """The accuracy table, the verdict sentences and where they come from, for the runs matching ``settings``."""
    accuracy, verdict = latest(records, "accuracy", **settings), latest(records, "verdict", **settings)
    return "\n\n".join([settings_line(accuracy["settings"]) + ":",
                        markdown_table(accuracy["rows"], ACCURACY_COLUMNS),
                        " ".join(verdict_sentence(row, verdict["settings"]) for row in verdict["rows"]),
                        "Source: " + provenance(verdict, "compression.jsonl")])


def throughput_markdown(records: list[dict], **settings) -> str:
    """Tokens/s and communication in flight on the emulated slow link, with the record's provenance."""
    record = latest(records, "throughput", **settings)
    s = record["settings"]
    head = (f"At an emulated {s['bandwidth_gbps']:g} Gb/s ({s['latency_us']:g} µs latency), {s['steps']} steps a run, "
            f"median of {s['repeats']} interleaved rounds:")
    return "\n\n".join([head, markdown_table(record["rows"], THROUGHPUT_COLUMNS),
                        "Source: " + provenance(record, "compression.jsonl")])


def history_markdown(records: list[dict], step: str) -> str:
    """One step of the tuning history (``compression_history.jsonl``): what was tried, its rows, the reading."""
    record = next((r for r in records if r.get("step") == step), None)
    if record is None:
        raise LookupError(f"no history step {step!r}; steps: {', '.join(r.get('step', '?') for r in records)}")
    columns = [(key, key, "") for key in record["rows"][0]]
    return "\n\n".join([record["what"], markdown_table(record["rows"], columns), f"Reading: {record['finding']}",
                        "Source: " + provenance(record, "compression_history.jsonl")])
