"""One rank of tests/parallel/test_context_parallel.py (torchrun, gloo): every context-parallel variant, layout,
mask and dtype checked against one-rank attention over the whole sequence (labkit.parallel.cp.check), the bytes
counted at the collectives beside labkit.parallel.cp.volume's, and each bug of the zoo switched on in turn.
Writes OUT/rankN.json."""
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.parallel.cp import LAYOUTS, VARIANTS, attention
from labkit.parallel.cp.bugs import BUGS, bug
from labkit.parallel.cp.check import TOLERANCE, gradient_check
from labkit.parallel.cp.volume import cp_wire_bytes

dist.init_process_group("gloo")
rank, cp = dist.get_rank(), dist.get_world_size()

results = {"cases": {}, "bugs": {}}
for variant, layout, causal, dtype in itertools.product(VARIANTS, LAYOUTS, (True, False), TOLERANCE):
    checked = gradient_check(attention(variant), layout, causal, dtype)
    checked["expected"] = cp_wire_bytes(variant, cp, checked["block_bytes"])
    results["cases"][f"{variant}-{layout}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"] = checked

for name in BUGS:
    with bug(name):
        results["bugs"][name] = gradient_check(attention("ring"), "head_tail", causal=True)
results["after_the_zoo"] = gradient_check(attention("ring"), "head_tail", causal=True)["ok"]

for layout in LAYOUTS:  # the ring's own record of each step: which block, how much work on it
    q = torch.randn(1, 2, 4 * cp, 4)
    timeline = []
    attention("ring")(q, q, q, layout=layout, timeline=timeline)
    results[f"timeline-{layout}"] = timeline

try:  # Ulysses with heads that cp does not divide: refused, with the reason
    odd = torch.zeros(1, cp + 1, 2 * cp, 4)
    attention("ulysses")(odd, odd, odd)
    results["ulysses_odd_heads"] = "ran"
except ValueError as e:
    results["ulysses_odd_heads"] = str(e)

Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(results))
dist.barrier()
dist.destroy_process_group()
