"""Runs several training configs in one process group: ``torchrun --nproc-per-node W dp_cases.py OUT CASES``.

Used by test_data_parallel.py so that many strategies are checked with real gloo processes at the
cost of one launch per world size. CASES is a JSON list of {"name": ..., "overrides": {...}}.
"""
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from labkit.config import load_config
from labkit.distributed import init_distributed, shutdown_distributed
from labkit.train import train

out, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
init_distributed(load_config(None, cases[0]["overrides"]))
for case in cases:
    train(load_config(None, case["overrides"]), out / case["name"])
    dist.barrier()
shutdown_distributed()
sys.stdout.flush()
os._exit(0)  # as labkit's workers do: no C++ destructors racing the backend's threads
