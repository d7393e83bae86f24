"""The optimisation flowchart as pure decisions: classify, propose, accept.

The source text's flowchart for making a training run faster::

    measure utilisation (MFU)
      ├─ below the threshold (70%) → where does the time go?
      │    ├─ exposed communication > 35% of the step → communication_bound:
      │    │      compress gradients, or synchronise less often
      │    └─ otherwise                              → compute_bound:
      │           mixed precision, model shapes that suit the hardware
      └─ at or above it                              → utilization_ok:
             a bigger batch, more parallelism
    then, whatever the branch → kernels_and_compile: attention kernels, compilation

"Communication overhead" is what communication costs the step: its **exposed** share
(``comm_exposed_frac``, what backward did not hide), not its share **in flight** (``comm_frac``, from
launch to completion: a bucketed all-reduce overlapping backward is in flight most of the step and
costs little, and waits for a straggler count too). The flowchart goes by the exposed share, and by
the in-flight share only where exposed time cannot be measured from the host (``fsdp2``), saying so.

This module holds the decisions only; :mod:`labkit.tuning.runner` launches the runs. Its loop:
measure the current config, ``classify`` it, take the next of ``candidate_actions`` for that
node, measure the trial, ``accept`` or reject it, log a :class:`Decision`, repeat; once a
node's candidates are spent, go to ``next_node``. Because every function here is pure, each
step of the walk can be tested — and replayed — without launching anything.

Nothing is kept on faith. A change is kept only when the measurement says it helped by more than
the run-to-run noise *and* the loss did not get worse: a compressed gradient that trains to a
worse model has not made training faster.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from labkit.config import apply_overrides
from labkit.metrics.communication import SCALING_COLLAPSES, SCALING_HOLDS

COMMUNICATION_BOUND = "communication_bound"
COMPUTE_BOUND = "compute_bound"
UTILIZATION_OK = "utilization_ok"
KERNELS_AND_COMPILE = "kernels_and_compile"
NODES = (COMMUNICATION_BOUND, COMPUTE_BOUND, UTILIZATION_OK, KERNELS_AND_COMPILE)
LAUNCH_KEYS = ("nproc",)
"""Override keys that are launch arguments (``labkit train --nproc N``), not config keys."""


@dataclass
class Thresholds:
    """Where the flowchart branches, and what counts as "faster". Fractions are 0–1.

    Two tests guard ``accept`` because each alone fails: a 1% gain can be "significant" on a
    very quiet machine and still not worth a change (``min_speedup``), and a 10% gain can be luck
    on a noisy one (``noise_sigmas``: the gain must exceed that many standard errors).
    """

    utilization: float = 0.70  # MFU below this: look for the bottleneck
    comm_frac: float = SCALING_COLLAPSES  # exposed communication share of the step above this: communication-bound
    min_speedup: float = 1.03  # keep a change only if it is at least 3% faster ...
    noise_sigmas: float = 2.0  # ... and faster by more than this many standard errors of the difference
    loss_tolerance: float = 0.02  # ... and its loss is at most 2% (relative) worse

    def validate(self) -> None:
        """Raise ``ValueError`` naming each out-of-range threshold (fractions are 0–1, not percent)."""
        problems = []

        def check(name: str, ok, allowed: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                percent = allowed.startswith("a fraction") and isinstance(value, (int, float)) and 1 < value <= 100
                hint = f"; did you mean {value / 100:g}?" if percent else ""
                problems.append(f"{name}={value!r}: must be {allowed}{hint}")

        check("utilization", lambda v: 0 < v <= 1, "a fraction in (0, 1] (0.70 means 70% of peak)")
        check("comm_frac", lambda v: 0 < v <= 1, "a fraction in (0, 1] (0.35 means 35% of the step)")
        check("loss_tolerance", lambda v: 0 <= v < 1, "a fraction in [0, 1) (0.02 means 2% worse at most)")
        check("min_speedup", lambda v: 1 <= v < 10, "a ratio in [1, 10) (1.03 means 3% faster)")
        check("noise_sigmas", lambda v: 0 <= v < 100, "a number of standard errors in [0, 100) (2 is usual)")
        if problems:
            raise ValueError("invalid optimisation thresholds:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class Measurement:
    """What one configuration did. ``repeats`` (tokens/s of repeated runs) give the noise to beat."""

    tokens_per_s: float
    mfu: float | None  # None: no honest peak is known for this device ("n/a")
    comm_frac: float | None  # communication in flight, share of the step (overlapped with backward or not)
    loss: float | None
    tokens_per_s_std: float | None = None  # spread between repeats, when only the summary is known
    repeats: list[float] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    comm_exposed_frac: float | None = None  # exposed: what backward did not hide (decides); None: not measurable

    @classmethod
    def from_repeats(cls, repeats: list[float], **fields: Any) -> Measurement:
        return cls(tokens_per_s=statistics.fmean(repeats), repeats=list(repeats), **fields)

    def standard_error(self) -> float | None:
        """Uncertainty of ``tokens_per_s``: std of the repeats / √n, or the given std; None if unknown."""
        if len(self.repeats) >= 2:
            return statistics.stdev(self.repeats) / math.sqrt(len(self.repeats))
        return self.tokens_per_s_std


@dataclass
class Candidate:
    """One thing to try: config overrides (dotted keys), and why."""

    node: str
    overrides: dict[str, Any]
    reason: str
    available: bool = True
    unavailable_reason: str = ""
    changes_model: bool = False  # the runner decides whether such a change is allowed

    @property
    def feature(self) -> str:
        key, value = next(iter(self.overrides.items()))
        return f"{key}={value}"


@dataclass
class Decision:
    """One line of the optimiser's log: what was tried at which node, the numbers, and the verdict."""

    iteration: int
    node: str
    candidate: Candidate | None
    baseline: Measurement
    trial: Measurement | None
    kept: bool
    reason: str


# ---------------------------------------------------------------- classify

def classify(m: Measurement, thresholds: Thresholds | None = None) -> tuple[str, str]:
    """The flowchart node for measurement ``m``, and the reason in words.

    Communication-bound means exposed communication above ``thresholds.comm_frac``; the share in flight
    stands in only where exposed time was not measured, and the reason says so (:func:`communication_overhead`).
    """
    t = thresholds or Thresholds()
    t.validate()
    comm, comm_text, aside = communication_overhead(m)
    comm_bound = comm is not None and comm > t.comm_frac
    above, below = f"(> {t.comm_frac:.0%}{aside})", f"(<= {t.comm_frac:.0%}{aside})"
    watch = (f"; communication is above the {SCALING_HOLDS:.0%} line under which scaling holds: watch it"
             if comm is not None and not comm_bound and comm > SCALING_HOLDS else "")
    if m.mfu is None:
        if comm_bound:
            return COMMUNICATION_BOUND, (f"MFU n/a (no known peak for this device), so utilisation is unknown; "
                                         f"{comm_text} {above}: communication-bound")
        return COMPUTE_BOUND, (f"MFU n/a (no known peak for this device), so utilisation is unknown; {comm_text} "
                               f"{below}: trying compute actions, since without a peak we cannot "
                               "say utilisation is already good" + watch)
    if m.mfu >= t.utilization:
        return UTILIZATION_OK, (f"MFU {m.mfu:.0%} >= {t.utilization:.0%}: the device is busy; "
                                "scale up the work instead (bigger batch, more processes)")
    if comm_bound:
        return COMMUNICATION_BOUND, (f"MFU {m.mfu:.0%} < {t.utilization:.0%} and {comm_text} {above}: "
                                     "communication-bound")
    return COMPUTE_BOUND, (f"MFU {m.mfu:.0%} < {t.utilization:.0%} and {comm_text} {below}: "
                           "compute-bound — the device is busy with something slower than it could be" + watch)


def communication_overhead(m: Measurement) -> tuple[float | None, str, str]:
    """The communication share the flowchart decides on, how to say it, and an aside for beside the threshold.

    The exposed share (what the step waited for) when measured; otherwise the share in flight, and the
    words say that it stands in for exposed time (it counts overlapped time too, so it overstates the cost).
    """
    if m.comm_exposed_frac is not None:
        in_flight = "" if m.comm_frac is None else f"; in flight {m.comm_frac:.0%}, overlap included"
        return m.comm_exposed_frac, f"exposed communication is {m.comm_exposed_frac:.0%} of the step", in_flight
    if m.comm_frac is not None:
        return m.comm_frac, f"communication in flight is {m.comm_frac:.0%} of the step", (
            "; exposed time not measured, so judged on communication in flight, overlap included")
    return None, "communication share unknown", ""


def next_node(node: str) -> str | None:
    """Where the flowchart goes once ``node``'s candidates are spent: kernels and compilation, then done."""
    if node not in NODES:
        raise ValueError(f"unknown flowchart node {node!r}; nodes are {', '.join(NODES)}")
    return None if node == KERNELS_AND_COMPILE else KERNELS_AND_COMPILE


# ---------------------------------------------------------------- candidates

def _communication(cur: dict) -> list[Candidate]:
    def compress(kind: str, why: str) -> Candidate:
        extra = {"comm.sync": "every_step"} if cur.get("comm.sync", "every_step") != "every_step" else {}
        back = " (and back to per-step synchronisation)" if extra else ""
        return Candidate(COMMUNICATION_BOUND, {"comm.compression": kind, **extra}, why + back)

    def sync(kind: str, why: str) -> Candidate:
        every = cur.get("comm.sync_every", 8)
        extra = {"comm.compression": "none"} if cur.get("comm.compression", "none") != "none" else {}
        return Candidate(COMMUNICATION_BOUND, {"comm.sync": kind, "comm.sync_every": every, **extra},
                         f"{why} (synchronise every {every} steps; replaces gradient compression)")

    # what to try, and why: each compressor and sync strategy declares its own ``advice`` (None: not proposed)
    from labkit.comm.compress import COMPRESSORS
    from labkit.parallel import SYNC_STRATEGIES

    return ([compress(name, c.advice) for name, c in COMPRESSORS.items() if c.advice]
            + [sync(name, s.advice) for name, s in SYNC_STRATEGIES.items() if s.advice])


def _compute(cur: dict) -> list[Candidate]:
    out = [Candidate(COMPUTE_BOUND, {"precision.mode": "bf16"},
                     "bf16 autocast: tensor cores run bf16 matmuls at several times the fp32 rate and "
                     "activations take half the memory (on CPUs without bf16 units it may be slower)")]
    n_embd, n_head = cur.get("model.n_embd"), cur.get("model.n_head")
    known = isinstance(n_embd, int) and isinstance(n_head, int) and n_head > 0
    if known and (n_embd % 64 or (n_embd // n_head) % 64):
        width = max(64, -(-n_embd // 64) * 64)
        out.append(Candidate(COMPUTE_BOUND, {"model.n_embd": width, "model.n_head": width // 64},
                             f"n_embd {n_embd} / n_head {n_head} → {width} / {width // 64}: widths and head sizes "
                             "that are multiples of 64 fill the hardware's matrix tiles; this changes the model",
                             changes_model=True))
    return out


def _scale_up(cur: dict, max_nproc: int | None) -> list[Candidate]:
    nproc, micro, batch = cur.get("nproc", 1), cur.get("data.micro_batch_size", 8), cur.get("data.batch_size", 16)
    out = []
    bigger = {"data.micro_batch_size": 2 * micro}
    if batch % (nproc * 2 * micro):
        bigger["data.batch_size"] = 2 * batch
        why = f"micro-batch {micro} → {2 * micro} (global batch {batch} → {2 * batch}: this changes the optimisation)"
    else:
        why = f"micro-batch {micro} → {2 * micro}: bigger kernels, fewer accumulation steps, same global batch"
    out.append(Candidate(UTILIZATION_OK, bigger, why))
    more = {"nproc": 2 * nproc}
    if batch % (2 * nproc * micro):
        more["data.batch_size"] = 2 * batch
    why = f"{nproc} → {2 * nproc} processes: more devices (or cores) on the work"
    if "data.batch_size" in more:
        why += f" (global batch {batch} → {2 * batch}: this changes the optimisation)"
    more_procs = Candidate(UTILIZATION_OK, more, why)
    if max_nproc is None or 2 * nproc > max_nproc:
        more_procs.available = False
        more_procs.unavailable_reason = (f"this machine allows at most {max_nproc} processes" if max_nproc
                                         else "the machine's process limit is unknown (pass max_nproc)")
    return out + [more_procs]


def _kernels(cur: dict) -> list[Candidate]:
    return [Candidate(KERNELS_AND_COMPILE, {"attention.backend": "sdpa"},
                      "torch's fused scaled_dot_product_attention (a flash-style kernel where one exists)"),
            Candidate(KERNELS_AND_COMPILE, {"attention.backend": "labkit_flash"},
                      "labkit's FlashAttention-2 in plain PyTorch: O(n) attention memory; written to be read, "
                      "so expect it to lose on speed"),
            Candidate(KERNELS_AND_COMPILE, {"run.compile": "verify"},
                      "torch.compile, verified: time eager and compiled steps and keep the faster")]


def candidate_actions(node: str, current: Mapping[str, Any],
                      available: Mapping[str, bool | str] | None = None, *,
                      max_nproc: int | None = None) -> list[Candidate]:
    """What to try at ``node``, in order, given the settings in effect.

    ``current``: dotted settings in effect, e.g. the flattened config plus the overrides kept so far
    (``nproc`` for the process count). Candidates already in effect are skipped; the shape advice
    needs ``model.n_embd`` and ``model.n_head``.

    ``available``: feature → True, or False / a reason string when it is missing on this machine,
    keyed ``"key=value"`` (``"attention.backend=labkit_flash"``) or by key (``"comm.compression"``);
    unlisted features count as available. Unavailable candidates come back marked, with the reason,
    so a report can say what was not tried and why.
    """
    builders = {COMMUNICATION_BOUND: _communication, COMPUTE_BOUND: _compute, KERNELS_AND_COMPILE: _kernels,
                UTILIZATION_OK: lambda cur: _scale_up(cur, max_nproc)}
    if node not in builders:
        raise ValueError(f"unknown flowchart node {node!r}; nodes are {', '.join(NODES)}")
    cur, available = dict(current), dict(available or {})
    out = []
    for candidate in builders[node](cur):
        if all(cur.get(k) == v for k, v in candidate.overrides.items()):
            continue  # already applied
        key = next(iter(candidate.overrides))
        verdict = available.get(candidate.feature, available.get(key, True))
        if verdict is not True and candidate.available:
            candidate.available = False
            candidate.unavailable_reason = verdict if isinstance(verdict, str) else "not available on this machine"
        out.append(candidate)
    return out


# ---------------------------------------------------------------- accept

def accept(baseline: Measurement, trial: Measurement, thresholds: Thresholds | None = None) -> tuple[bool, str]:
    """Keep ``trial`` only if it is faster beyond noise and by ``min_speedup``, and its loss is not worse."""
    t = thresholds or Thresholds()
    t.validate()
    if trial.loss is None or not math.isfinite(trial.loss):
        return False, "rejected: the trial's loss is not finite"
    if baseline.loss is not None and math.isfinite(baseline.loss):
        worst = baseline.loss + t.loss_tolerance * abs(baseline.loss)
        if trial.loss > worst:
            return False, (f"rejected: loss {trial.loss:.4f} is worse than {baseline.loss:.4f} by more than "
                           f"{t.loss_tolerance:.0%}")
    if baseline.tokens_per_s <= 0:
        return False, "rejected: the baseline throughput is not positive; nothing to compare against"
    speedup = trial.tokens_per_s / baseline.tokens_per_s
    rate = f"{baseline.tokens_per_s:,.0f} → {trial.tokens_per_s:,.0f} tokens/s ({speedup:.3f}×)"
    if speedup < t.min_speedup:
        return False, f"rejected: {rate}, below the {t.min_speedup:g}× needed to count as faster"
    errors = [e for e in (baseline.standard_error(), trial.standard_error()) if e is not None]
    if not errors:
        return True, f"kept: {rate}; no repeats, so noise unknown: judged on the {t.min_speedup:g}× ratio alone"
    noise = math.sqrt(sum(e * e for e in errors))
    gain = trial.tokens_per_s - baseline.tokens_per_s
    if gain <= t.noise_sigmas * noise:
        return False, (f"rejected: {rate}, but the gain {gain:,.0f} tokens/s is within {t.noise_sigmas:g}× the "
                       f"noise ({noise:,.0f} tokens/s)")
    beyond = f"{gain / noise:.1f}× the noise" if noise else "repeats that did not vary (no noise)"
    return True, f"kept: {rate}, {beyond}, loss within {t.loss_tolerance:.0%}"


# ---------------------------------------------------------------- the result

def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"n_embd": 64}}`` → ``{"model.n_embd": 64}``: the form ``current`` and overrides use."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        out.update(flatten(value, dotted + ".") if isinstance(value, Mapping) else {dotted: value})
    return out


def best_config_yaml(base: dict, overrides: Mapping[str, Any]) -> str:
    """The base config with the kept overrides applied, as YAML; launch arguments become a comment."""
    launch = {k: v for k, v in overrides.items() if k in LAUNCH_KEYS}
    config = apply_overrides(base, {k: v for k, v in overrides.items() if k not in LAUNCH_KEYS})
    header = "# found by labkit.tuning; kept: " + (", ".join(f"{k}={v}" for k, v in overrides.items()) or "nothing")
    if launch:
        header += "\n# launch with: " + " ".join(f"--{k} {v}" for k, v in launch.items())
    return header + "\n" + yaml.safe_dump(config, sort_keys=False)
