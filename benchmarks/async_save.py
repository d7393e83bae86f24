"""Checkpoints that do not stop training: what ``fault.async_save`` buys per save, against a synchronous save.

One process saves the same training state — a GPT's weights and AdamW's two moments, after a real step — with
labkit's :class:`labkit.fault.Checkpointer` (DCP), synchronously and asynchronously, in interleaved rounds (sync
first in even rounds, async first in odd ones). Per save, measured:

* **blocked** — how long the training loop waits (the clock around ``save``): the whole write for a synchronous
  save; only the copy of the state into staging memory for an async one, whose writing goes on in a background
  thread (the save's own ``SaveRecord.blocking_s``);
* **total** — from the save's start until every file is written and the checkpoint sealed (async: the background
  write's end, waited for before the next save, as the trainer does);
* **extra host memory** — what the process's resident set (the OS's ``VmRSS``) grew by from just before the async
  save to just after it returned: the staged copy the background thread writes from, held until it is done. A lower
  bound: memory the allocator already holds (freed by an earlier save) is reused without growing the resident set,
  so a small state's copy can show as nothing; the full size's tensors are large enough to be mapped afresh.

Each round's async/sync ratio of blocked time is kept; their median and IQR say "faster" only when the IQR
excludes 1.0 (:mod:`labkit.rounds`). Results: ``benchmarks/results/async_save.jsonl``.

    .venv/bin/python benchmarks/async_save.py [--n-embd 384] [--n-layer 6] [--rounds 8]
    .venv/bin/python benchmarks/async_save.py --quick     # a smoke run (tests/benchmarks)
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.cpu import cpu_model
from labkit.fault import Checkpointer
from labkit.launcher import free_port
from labkit.model.gpt import GPT, GPTShape
from labkit.results import results_path, write_results
from labkit.rounds import MIN_ROUNDS, describe, ratio_summary

NAME = "async_save"
FULL = {"n_embd": 384, "n_layer": 6, "rounds": 8}
QUICK = {"n_embd": 64, "n_layer": 2, "rounds": MIN_ROUNDS}


def resident_bytes() -> int:
    """This process's resident set, as the OS counts it (``VmRSS`` in /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def training_state(n_embd: int, n_layer: int) -> tuple[dict, int]:
    """A GPT's weights and AdamW's state after one real step, as a DCP state dict, and its bytes."""
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=256, block_size=64, n_layer=n_layer, n_head=4, n_embd=n_embd))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 64))
    model(ids, ids)[1].backward()
    optimizer.step()
    tensors = [*model.state_dict().values(), *(v for s in optimizer.state.values() for v in s.values())]
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    return state, sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def one_save(state: dict, directory: Path, step: int, asynchronous: bool) -> dict:
    """One save: blocked and total seconds, and (async) the resident set's growth while the staged copy is held."""
    checkpointer = Checkpointer(directory, keep=1, async_save=asynchronous, log=lambda line: None)
    before = resident_bytes()
    start = time.perf_counter()
    record = checkpointer.save(step, state)
    blocked = time.perf_counter() - start
    held = resident_bytes() - before
    checkpointer.close()  # the async write finishes and the checkpoint is sealed
    return {"blocked_s": blocked, "record_blocking_s": record.blocking_s, "total_s": record.total_s,
            "extra_rss_bytes": held, "bytes_on_disk": record.total_bytes}


def rounds_of_saves(state: dict, rounds: int) -> list[dict]:
    """``rounds`` rounds of one sync and one async save, alternating which goes first."""
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            saves = {asynchronous: one_save(state, Path(root) / f"r{r}-{int(asynchronous)}", r, asynchronous)
                     for asynchronous in order}
            sync, background = saves[False], saves[True]
            rows.append({"round": r + 1, "first": "async" if order[0] else "sync",
                         **{f"sync_{k}": v for k, v in sync.items()},
                         **{f"async_{k}": v for k, v in background.items()},
                         "async_vs_sync_blocked": background["blocked_s"] / sync["blocked_s"]})
            print(f"  round {r + 1}: sync blocked {1e3 * sync['blocked_s']:7.1f} ms   async blocked "
                  f"{1e3 * background['blocked_s']:7.1f} ms (written {1e3 * background['total_s']:7.1f} ms, "
                  f"+{background['extra_rss_bytes'] / 2**20:6.1f} MiB held)")
    return rows


def summarise(rows: list[dict], state_bytes: int) -> dict:
    spread = ratio_summary([row["async_vs_sync_blocked"] for row in rows])
    median = lambda key: statistics.median(row[key] for row in rows)  # noqa: E731
    return {"check": "async/sync time the training loop is blocked per save", **spread,
            "summary": describe(spread, "async/sync blocked"),
            "sync_blocked_s": median("sync_blocked_s"), "async_blocked_s": median("async_blocked_s"),
            "sync_total_s": median("sync_total_s"), "async_total_s": median("async_total_s"),
            "async_extra_rss_bytes": median("async_extra_rss_bytes"), "state_bytes": state_bytes,
            "extra_rss_vs_state": median("async_extra_rss_bytes") / state_bytes, "cpu": cpu_model()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, the fewest rounds: a smoke run")
    parser.add_argument("--n-embd", type=int)
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args(argv)
    size = {**(QUICK if args.quick else FULL),
            **{k: v for k, v in (("n_embd", args.n_embd), ("n_layer", args.n_layer), ("rounds", args.rounds)) if v}}
    if size["rounds"] < 1:
        parser.error("--rounds must be >= 1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        state, state_bytes = training_state(size["n_embd"], size["n_layer"])
        print(f"one process, DCP through labkit's Checkpointer; a GPT of n_embd {size['n_embd']}, {size['n_layer']} "
              f"layers, AdamW after one step: {state_bytes / 2**20:.1f} MiB of state; {size['rounds']} rounds")
        rows = rounds_of_saves(state, size["rounds"])
    finally:
        dist.destroy_process_group()
    summary = summarise(rows, state_bytes)
    print(f"  {summary['summary']}; async total {summary['async_total_s'] * 1e3:.0f} ms vs sync "
          f"{summary['sync_total_s'] * 1e3:.0f} ms; the async save held {summary['extra_rss_vs_state']:.2f}× the "
          f"state in extra resident memory")
    settings = {**size, "quick": args.quick, "torch": torch.__version__}
    write_results(NAME, rows, settings, table="async_save_rounds")
    write_results(NAME, [summary], settings, table="async_save")
    print(f"results: appended to {results_path(NAME)}")


if __name__ == "__main__":
    main()
