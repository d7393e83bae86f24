"""Fault management: checkpoints (``checkpoint``), deliberate failures (``inject``) and recovery
(``recovery``) — the source text's "state synchronisation and recovery" component.

The promise, tested for every fault kind: a run that crashed and recovered ends with the same
model, bit for bit, as one that never crashed.
"""
from labkit.fault.checkpoint import Checkpointer, list_checkpoints, newest_valid, verify
from labkit.fault.inject import FAULT_KINDS, FaultInjector, record_fault
from labkit.fault.recovery import (expected_overhead, recovery_report, restore_training_state, training_state,
                                   young_daly_interval)
from labkit.fault.reshard import CheckpointMismatch

__all__ = ["Checkpointer", "CheckpointMismatch", "list_checkpoints", "newest_valid", "verify", "FAULT_KINDS",
           "FaultInjector", "record_fault", "expected_overhead", "recovery_report", "restore_training_state",
           "training_state", "young_daly_interval"]
