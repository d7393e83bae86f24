"""Dry runs of labkit's real training code at scale, on torch's **fake** process group.

``dry_run(cfg, world, rank)`` makes this process rank ``rank`` of a world of ``world`` ranks on torch's fake
backend (``torch.testing._internal.distributed.fake_pg``: every collective returns at once and moves no data),
builds the model, the tp/pp split and the data-parallel strategy with the trainer's own set-up
(:func:`labkit.train.build_trainer`, the rank grid of :func:`labkit.parallel.mesh.build_grid`) and runs one
real training step (:meth:`labkit.train.Trainer.step`). Nothing is re-implemented, so what is recorded is what
the real code launches at that scale:

* **every collective** of the step — kind, the process group's size and axis, bytes (labkit's convention:
  an all-gather's output, a reduce-scatter's input, otherwise the tensor) and wire bytes (the ring formulas of
  :func:`labkit.comm.collectives.wire_bytes`). A recording layer wraps, while the run lasts, the real
  torch functions labkit's communication layer captured at import (``collectives._all_reduce`` …) and the
  ``torch.distributed`` functions the rest of the code calls directly (pipeline sends, the gradient norm's
  one number); both are put back afterwards. The CommTimers' own counters are read too and checked against it;
* **model-state memory of this rank**: what ``strategy.memory_breakdown`` measures from the tensors, beside
  :func:`labkit.parallel.layout_report.predicted_rank_memory_for_layout`.

:func:`compare` sets the recorded bytes beside the analytic counts for the same layout: the dp axis against
the strategy's declared wire volume, wire_factor(m)·(p−1)/p·Ψ (:mod:`labkit.parallel.report`; Ψ this rank's
parameters, :func:`labkit.parallel.layout_report.predicted_rank_params`, plus the padding ZeRO's flat
buckets and FSDP2's dim-0 shards add so that they cut into p equal slices), the tp axis against m ×
:func:`labkit.parallel.tp_volume.tp_wire_bytes` for this stage's parts, the pp axis against the activations a
stage sends. They must agree exactly (compared as exact fractions: a wire byte count is (p−1)/p of something).

Times are not measured: the fake group moves nothing, so a time would mean nothing. The process group is
destroyed at the end and every patched function restored, so a dry run leaves no global state behind.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist

FAKE_LABEL = "fake process group: no data moved; bytes and memory are the real code's, times are not measured"
RING_FACTOR = {"all_reduce": lambda p: Fraction(2 * (p - 1), p), "all_gather": lambda p: Fraction(p - 1, p),
               "reduce_scatter": lambda p: Fraction(p - 1, p), "broadcast": lambda p: Fraction(1),
               "send": lambda p: Fraction(1), "recv": lambda p: Fraction(0)}
FP32 = 4


@dataclass
class Call:
    """One collective as launched: ``source`` is "labkit" (through labkit.comm.collectives) or "torch" (a
    ``torch.distributed`` function called directly)."""

    kind: str
    group_size: int
    axis: str
    nbytes: int
    source: str

    @property
    def wire_exact(self) -> Fraction:
        return RING_FACTOR[self.kind](self.group_size) * self.nbytes if self.group_size > 1 else Fraction(0)

    @property
    def wire(self) -> int:
        """What labkit's CommTimer counts for it (``wire_bytes`` rounds each call down to a byte)."""
        if self.kind in ("send", "recv"):
            return self.nbytes if self.kind == "send" else 0
        from labkit.comm.collectives import wire_bytes

        return wire_bytes(self.kind, self.nbytes, self.group_size)


@dataclass
class Recorder:
    """Collects :class:`Call` records while ``recording`` is on; ``axis_of`` names a group's axis."""

    axis_of: object = None
    calls: list = field(default_factory=list)
    recording: bool = False

    def add(self, kind: str, tensor_bytes: int, group, source: str) -> None:
        if not self.recording:
            return
        if kind in ("send", "recv"):
            size, axis = 2, self.axis_of("p2p")
        else:
            size = dist.get_world_size(group)
            axis = self.axis_of(group)
        self.calls.append(Call(kind, size, axis, tensor_bytes, source))


class _WithResult:
    """An async collective's work whose future holds its output tensors, as gloo's and NCCL's do: the fake
    group's future completes with None, and torch DDP's communication hook (labkit's
    ``timed_all_reduce_mean``) reads the reduced bucket from it."""

    def __init__(self, work, result):
        self._work, self._result = work, result

    def get_future(self):
        return self._work.get_future().then(lambda _: self._result)

    def wait(self, *args):
        return self._work.wait(*args)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


@contextmanager
def recording(recorder: Recorder):
    """Wrap the real functions labkit's layer captured, and the torch.distributed ones called directly."""
    from labkit.comm import collectives as layer

    def wrap(real, kind, source, pick):
        def recorded(*args, **kwargs):
            nbytes, group = pick(*args, **kwargs)
            recorder.add(kind, nbytes, group, source)
            if kind == "recv":  # the fake group writes nothing: a received buffer would be uninitialised memory
                args[0].zero_()  # (NaNs in it would make the step skip its update); zeros keep the step finite
            work = real(*args, **kwargs)
            if source == "labkit" and kwargs.get("async_op") and work is not None:
                return _WithResult(work, [args[0]])
            return work
        return recorded

    def first(tensor, *a, group=None, **k):
        return _nbytes(tensor), group

    def gather_out(output, input, group=None, **k):
        return _nbytes(output), group

    def scatter_in(output, input, op=None, group=None, **k):
        return _nbytes(input), group

    def p2p(tensor, *a, **k):
        return _nbytes(tensor), None

    def gather_list(outputs, input, group=None, **k):
        return _nbytes(input) * len(outputs), group

    layer_names = {"_all_reduce": ("all_reduce", first), "_all_gather_single": ("all_gather", gather_out),
                   "_reduce_scatter_single": ("reduce_scatter", scatter_in), "_broadcast": ("broadcast", first)}
    torch_names = {"all_reduce": ("all_reduce", first), "broadcast": ("broadcast", first),
                   "all_gather_single": ("all_gather", gather_out), "all_gather_into_tensor": ("all_gather", gather_out),
                   "reduce_scatter_single": ("reduce_scatter", scatter_in),
                   "reduce_scatter_tensor": ("reduce_scatter", scatter_in), "all_gather": ("all_gather", gather_list),
                   "send": ("send", p2p), "isend": ("send", p2p), "recv": ("recv", p2p), "irecv": ("recv", p2p)}
    saved_layer = {name: getattr(layer, name) for name in layer_names}
    saved_torch = {name: getattr(dist, name) for name in torch_names}
    try:
        for name, (kind, pick) in layer_names.items():
            setattr(layer, name, wrap(saved_layer[name], kind, "labkit", pick))
        for name, (kind, pick) in torch_names.items():
            setattr(dist, name, wrap(saved_torch[name], kind, "torch", pick))
        yield recorder
    finally:
        for name, real in saved_layer.items():
            setattr(layer, name, real)
        for name, real in saved_torch.items():
            setattr(dist, name, real)


def _axis_namer(grid):
    """A function naming a process group by the grid axis whose ranks it holds ("dp", "pp", "tp", "world"),
    "tied" for a pipeline's first and last stage (the tied embedding's group), else "group of N"."""
    from labkit.parallel.mesh import AXES

    by_ranks = {}
    for axis in (*reversed(AXES), "world"):  # a one-axis grid: the dp group *is* the world, named dp
        by_ranks.setdefault(tuple(grid.ranks(axis)), axis)
    pp = grid.ranks("pp")
    by_ranks.setdefault((pp[0], pp[-1]), "tied")
    if grid.size("dp") == grid.dims.world_size:
        by_ranks[tuple(range(grid.dims.world_size))] = "dp"

    def axis_of(group) -> str:
        if group == "p2p":
            return "pp"
        ranks = tuple(range(grid.dims.world_size)) if group is None else tuple(dist.get_process_group_ranks(group))
        return by_ranks.get(ranks, f"group of {len(ranks)}")
    return axis_of


def dry_run_problems(cfg) -> list[str]:
    """What runs for real but not in a dry run (on the fake group), one sentence each."""
    found = []
    if cfg.parallel.pp.degree > 1 and cfg.parallel.pp.impl == "torch":
        found.append("parallel.pp.impl=torch cannot dry-run: torch.distributed.pipelining learns the shapes of a "
                     "stage's inputs by receiving a pickled object from the previous stage (recv_object_list), and "
                     "the fake process group delivers nothing (the size it reads is garbage); use "
                     "parallel.pp.impl=labkit")
    if cfg.parallel.tp.degree > 1 and cfg.parallel.tp.impl == "dtensor":
        found.append("parallel.tp.impl=dtensor is not counted by a dry run: DTensor's collectives run inside "
                     "torch (functional collectives), not through labkit's communication layer, so their bytes "
                     "are not recorded; use parallel.tp.impl=labkit")
    if cfg.comm.consistency is not None or cfg.comm.sync != "every_step":
        found.append("a dry run runs the per-step trainer: comm.consistency and comm.sync are not simulated")
    if cfg.precision.mode != "fp32" or cfg.model.freeze or cfg.comm.compression != "none":
        found.append("a dry run's analytic counts are for fp32 training of every parameter without gradient "
                     "compression: set precision.mode=fp32, model.freeze=[] and comm.compression=none")
    return found


def dry_run(cfg, world: int, rank: int = 0) -> dict:
    """One training step of rank ``rank`` of ``world`` on the fake process group; see the module docstring.

    Raises :class:`labkit.config.ConfigError` (labkit's validation, before anything starts) for a config that
    cannot run on ``world`` ranks, and ValueError for a rank outside the world."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.config import ConfigError, resolve_auto
    from labkit.validation import validate

    # labkit's validation, before anything starts: the world as ``world`` nodes of one process each (this machine
    # hosts one rank, the one simulated), so the machine checks see one process and the layout checks the world
    validate(cfg, nproc=1, nnodes=world)
    unsupported = dry_run_problems(cfg)
    if unsupported:
        raise ConfigError(unsupported)
    if not 0 <= rank < world:
        raise ValueError(f"--rank {rank} is outside the world (ranks 0..{world - 1})")
    cfg, _ = resolve_auto(cfg)
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; a dry run needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with torch.random.fork_rng(devices=[]):  # the run's seed, without moving the caller's random state
            return _run(cfg, world, rank)
    finally:
        dist.destroy_process_group()


def _run(cfg, world: int, rank: int) -> dict:
    from labkit.data import build_datasets
    from labkit.distributed import DistEnv
    from labkit.model import GPTShape
    from labkit.parallel.layout_report import predicted_rank_memory_for_layout, predicted_rank_params
    from labkit.parallel.mesh import ParallelDims, build_grid
    from labkit.train import build_trainer

    torch.manual_seed(cfg.run.seed)
    dims = ParallelDims.from_config(cfg, world)
    grid = build_grid(dims, rank, "cpu")
    env = DistEnv(rank, world, 0, 1, "cpu", "fake", torch.get_num_threads(), grid)
    train_ds, _, tokenizer, _ = build_datasets(cfg.data.dataset, cfg.data.tokenizer, cfg.model.block_size,
                                               cfg.data.val_fraction)
    recorder = Recorder(axis_of=_axis_namer(grid))
    with recording(recorder):
        trainer = build_trainer(cfg, env, train_ds, tokenizer.vocab_size)  # set-up traffic: not recorded
        try:
            recorder.recording = True
            stats = trainer.step(trainer.batches())
            recorder.recording = False
            layout = _layout_facts(cfg, trainer)
        finally:
            trainer.strategy.close()
    shape = GPTShape.from_config(cfg.model, tokenizer.vocab_size, cfg.attention.backend)
    predicted = predicted_rank_memory_for_layout(shape, dims, rank, trainer.strategy.name)
    counted = {"dp strategy": stats["comm_bytes"], "tensor parallel": stats["model_comm_bytes"] or 0,
               "pipeline": trainer.pipeline_comm.bytes + (stats.get("pipeline_comm_bytes") or 0)}
    return {"world": world, "rank": rank, "mesh": dims.sizes(), "coordinate": dims.coordinate(rank),
            "strategy": trainer.strategy.name, "micro_batches": trainer.accum, "cfg": cfg, "shape": shape,
            "params": predicted_rank_params(shape, dims, rank), "calls": recorder.calls,
            "counted": counted, "layout": layout, "label": FAKE_LABEL, "step_skipped": bool(stats["skipped"]),
            "memory": {"param": stats["param_bytes"], "grad": stats["grad_bytes"],
                       "optimizer": stats["optimizer_bytes"]},
            "predicted_memory": {"param": predicted.parameters, "grad": predicted.gradients,
                                 "optimizer": predicted.optimizer_state}}


def _layout_facts(cfg, trainer) -> dict:
    """What the exact count needs of this rank's part beyond its parameter count: the padding that cutting
    into p equal slices adds, from the sizes of the parameters this rank holds and the strategy's rule.

    * ZeRO-1/2: each flat bucket (``parallel.dp.bucket_mb``, per parameter group) padded to a multiple of p;
      ``slice`` is this rank's elements of all of them;
    * FSDP2: each parameter's dim 0 padded to a multiple of p, per FSDP unit (each block; the root holds the
      rest). ``units`` lists (is_root, padded elements); ``slice`` is this rank's elements of all of them."""
    from labkit.optim import param_groups
    from labkit.parallel.ddp import bucket_params

    p = trainer.env.grid.size("dp")
    model, name = trainer.model, trainer.strategy.name
    facts = {"padded": sum(q.numel() for q in model.parameters() if q.requires_grad), "units": []}
    if name in ("zero1", "zero2"):
        facts["padded"] = 0
        for group in param_groups(model, cfg.optim):
            for piece in bucket_params(group["params"], cfg.parallel.dp.bucket_mb * 2**20) if group["params"] else []:
                facts["padded"] += math.ceil(sum(q.numel() for q in piece) / p) * p
    elif name == "fsdp2":
        def padded(params):  # FSDP2's DTensor parameters keep their full (unsharded) shape
            return sum(math.ceil(q.shape[0] / p) * p * math.prod(q.shape[1:]) for q in params)
        in_blocks = [list(block.parameters()) for block in model.blocks]
        seen = {id(q) for params in in_blocks for q in params}
        facts["units"] = [(False, padded(params)) for params in in_blocks]
        facts["units"].append((True, padded([q for q in model.parameters() if id(q) not in seen])))
        facts["padded"] = sum(n for _, n in facts["units"])
        r = trainer.env.grid.coord("dp")  # this rank's rows of each dim-0 split, without the padding: the
        facts["local"] = sum(max(0, min(math.ceil(q.shape[0] / p), q.shape[0] - r * math.ceil(q.shape[0] / p)))
                             * math.prod(q.shape[1:]) for q in model.parameters())  # optimizer's state is that size
    facts["slice"] = facts["padded"] // p
    return facts


def implementation_memory(result: dict) -> dict:
    """Model-state bytes labkit's strategy holds for this layout, exactly (fp32 Adam: weights 4, gradients 4,
    two moments 8 bytes per element). Beside :func:`predicted_rank_memory_for_layout` (the ZeRO paper's
    Ψ/p) it counts what cutting into p equal slices pads, and labkit's ZeRO's own fp32 copy of its slice
    (the parameter its optimizer steps) and that slice's gradient (ZeRO-1 keeps the full gradients too)."""
    psi, s, name = result["params"], result["layout"]["slice"], result["strategy"]
    if name in ("zero1", "zero2"):
        return {"param": FP32 * (psi + s), "grad": FP32 * (s + (psi if name == "zero1" else 0)),
                "optimizer": 2 * FP32 * s}
    if name == "fsdp2":
        # weights and gradients live in FSDP2's padded shard buffers; Adam's moments are zeros_like the local
        # shard, whose last ranks hold fewer rows (or none) of a small dim 0
        return {"param": FP32 * s, "grad": FP32 * s, "optimizer": 2 * FP32 * result["layout"]["local"]}
    return {"param": FP32 * psi, "grad": FP32 * psi, "optimizer": 2 * FP32 * psi}


# ---------------------------------------------------------------- the table and the analytic comparison

def collective_table(result: dict) -> list[dict]:
    """The step's collectives grouped by (axis, kind, group size, source): count, bytes, wire bytes."""
    rows: dict = {}
    for c in result["calls"]:
        key = (c.axis, c.kind, c.group_size, c.source)
        row = rows.setdefault(key, {"axis": c.axis, "kind": c.kind, "group": c.group_size, "source": c.source,
                                    "count": 0, "bytes": 0, "wire_bytes": 0})
        row["count"] += 1
        row["bytes"] += c.nbytes
        row["wire_bytes"] += c.wire
    return sorted(rows.values(), key=lambda r: (r["axis"], r["kind"], r["source"]))


def _wire(result, axis: str, big: bool | None = None, source: str | None = None) -> Fraction:
    """Exact recorded wire bytes on ``axis``; ``big`` True/False keeps the model-sized calls or only the scalar
    ones (8 bytes and under: a gradient norm's or a loss's one number)."""
    total = Fraction(0)
    for c in result["calls"]:
        if c.axis != axis or (source and c.source != source):
            continue
        if big is not None and (c.nbytes > 8) != big:
            continue
        total += c.wire_exact
    return total


def analytic(result: dict) -> dict:
    """The bytes this rank should send in the step, per part, from the layout alone (and ZeRO's/FSDP2's
    padding, :func:`_layout_facts`); exact fractions."""
    from labkit.parallel.pipeline import stage_layers
    from labkit.parallel.spec import STRATEGIES
    from labkit.parallel.tp_volume import sequence_parallel_sync_bytes, tp_wire_bytes

    cfg, mesh, coord, m = result["cfg"], result["mesh"], result["coordinate"], result["micro_batches"]
    model, tp_cfg = cfg.model, cfg.parallel.tp
    dp, pp, tp = mesh["dp"], mesh["pp"], mesh["tp"]
    first, last = coord["pp"] == 0, coord["pp"] == pp - 1
    out = {}
    share = Fraction(dp - 1, dp) * FP32
    units = result["layout"]["units"]
    if result["strategy"] == "fsdp2" and units:
        # an all-gather per forward and per backward of every micro-batch for each block; the root (embeddings,
        # final norm) stays gathered from its forward to its backward (FSDP2 does not reshard the root after
        # forward); one reduce-scatter per unit: Σ (2m+1)·P_block + (m+1)·P_root, of the padded sizes
        out["dp"] = share * sum(((m + 1) if root else (2 * m + 1)) * n for root, n in units)
    else:
        factor = STRATEGIES[result["strategy"]].wire_factor(m)  # declared: wire_factor(m)·(p−1)/p·Ψ (padded)
        out["dp"] = Fraction(factor) * share * result["layout"]["padded"]
    if dp == 1:
        out["dp"] = Fraction(0)
    if tp > 1:
        layers = len(stage_layers(model.n_layer, pp)[coord["pp"]])
        sp = bool(tp_cfg.sequence_parallel)
        parts = tp_wire_bytes(cfg.data.micro_batch_size, model.block_size, model.n_embd, layers, tp, FP32, sp,
                              model.recompute)
        per_micro = parts["blocks"] + (parts["embedding"] if first else 0) + \
            (parts["head"] + parts["loss"] if last else 0)
        sync = sequence_parallel_sync_bytes(model.n_embd, model.n_layer, model.block_size, model.bias, tp) if sp else 0
        out["tp"] = Fraction(m * per_micro + sync)
    if pp > 1:
        activation = cfg.data.micro_batch_size * model.block_size * model.n_embd * FP32
        out["pp"] = Fraction(m * activation * ((not last) + (not first)))  # forward sends on, backward sends back
        vocab = result["shape"].vocab_size
        tied = vocab // tp * model.n_embd * FP32 if (first or last) else 0  # the tied embedding's gradient, summed
        out["tied"] = Fraction(tied)  # over its two copies: an all-reduce of 2 sends 2·(1/2)·n
    return out


def compare(result: dict) -> list[dict]:
    """Rows (what, recorded, analytic, equal): recorded bytes against the analytic counts for this layout, the
    CommTimers' counters against the recording, and the model-state memory against the prediction."""
    want = analytic(result)
    rows = []

    def row(what, recorded, expected):
        rows.append({"what": what, "recorded": recorded, "analytic": expected, "equal": recorded == expected})

    mesh = result["mesh"]
    if mesh["dp"] > 1:
        row(f"dp wire bytes, {result['strategy']} (model-sized collectives)", _wire(result, "dp", big=True),
            want["dp"])
    if mesh["tp"] > 1:
        row("tp wire bytes (m × tp_wire_bytes + SP sync)", _wire(result, "tp", source="labkit"), want["tp"])
    if mesh["pp"] > 1:
        sent = sum((c.wire_exact for c in result["calls"] if c.kind in ("send", "recv")), Fraction(0))
        row("pp wire bytes (activations and their gradients)", sent, want["pp"])
        tied_axis = "pp" if mesh["pp"] == 2 else "tied"
        recorded_tied = sum((c.wire_exact for c in result["calls"] if c.axis == tied_axis and c.kind == "all_reduce"
                             and c.nbytes > 8), Fraction(0))
        row("tied embedding all-reduce (first and last stage)", recorded_tied, want["tied"])
    labkit_calls = sum(c.wire for c in result["calls"] if c.source == "labkit")
    sends = sum(c.wire for c in result["calls"] if c.source == "torch" and c.kind == "send")
    counted = result["counted"]
    row("CommTimers' counters (labkit layer + pipeline sends)", sum(counted.values()), labkit_calls + sends)
    exact = implementation_memory(result)
    for key in ("param", "grad", "optimizer"):
        row(f"{key} bytes of this rank", result["memory"][key], exact[key])
    return rows


def _num(x) -> str:
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if isinstance(x, Fraction):
        return f"{x.numerator:,}" if x.denominator == 1 else f"{float(x):,.3f}"
    return f"{x:,}" if isinstance(x, int) else f"{x:,.3f}"


def format_result(result: dict) -> str:
    """The collective table, memory beside the prediction and the analytic comparison, as plain text."""
    mesh = result["mesh"]
    lines = [f"labkit sim dryrun — {result['label']}",
             f"world {result['world']} = dp {mesh['dp']} × pp {mesh['pp']} × tp {mesh['tp']}; rank {result['rank']} "
             f"at {result['coordinate']}; strategy {result['strategy']}; {result['micro_batches']} micro-batch(es); "
             f"{result['params']:,} parameters on this rank"
             + ("; the step dropped its update (non-finite gradient norm): no optimizer state"
                if result["step_skipped"] else ""), "",
             "collectives of one training step (this rank):",
             f"  {'axis':6s} {'kind':15s} {'group':>6s} {'via':7s} {'count':>6s} {'bytes':>14s} {'wire bytes':>14s}"]
    for r in collective_table(result):
        lines.append(f"  {r['axis']:6s} {r['kind']:15s} {r['group']:6d} {r['source']:7s} {r['count']:6d} "
                     f"{r['bytes']:14,d} {r['wire_bytes']:14,d}")
    exact = implementation_memory(result)
    lines += ["", "model-state memory of this rank (bytes): measured; predicted (layout_report, the ZeRO paper's "
              "Ψ/p); labkit's exact (with padding and ZeRO's slice copy)",
              f"  {'':10s} {'measured':>14s} {'predicted':>14s} {'exact':>14s}"]
    for key in ("param", "grad", "optimizer"):
        lines.append(f"  {key:10s} {_num(result['memory'][key]):>14s} {_num(result['predicted_memory'][key]):>14s} "
                     f"{_num(exact[key]):>14s}")
    lines += ["", "recorded vs analytic:", f"  {'what':58s} {'recorded':>16s} {'analytic':>16s}  equal"]
    for r in compare(result):
        lines.append(f"  {r['what']:58s} {_num(r['recorded']):>16s} {_num(r['analytic']):>16s}  "
                     f"{'yes' if r['equal'] else 'NO'}")
    return "\n".join(lines)
