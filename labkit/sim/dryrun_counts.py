"""A dry run's analytic counts: the bytes and model-state memory one rank *should* show, from the layout alone.

:func:`compare` sets what :mod:`labkit.sim.dryrun_record` recorded beside these counts for the same layout:

* the dp axis against the strategy's declared wire volume, wire_factor(m)·(p−1)/p·Ψ over the p = dp·cp ranks that
  hold the same parameters (the gradient axis, ``dp_cp`` when cp > 1)
  (:mod:`labkit.parallel.reports.data_parallel`; Ψ this rank's parameters,
  :func:`labkit.parallel.reports.layout.predicted_rank_params`, plus the padding ZeRO's flat buckets and
  FSDP2's dim-0 shards add so that they cut into p equal slices: :func:`layout_facts`);
* the tp axis against m × :func:`labkit.parallel.tp.volume.tp_wire_bytes` for this stage's parts;
* the pp axis against the activations a stage sends, and the tied embedding's all-reduce;
* the cp axis against m × the stage's layers × :func:`labkit.parallel.cp.volume.cp_wire_bytes` (forward, again under
  recompute, and backward), in whole bytes per call as that formula and the CommTimers count them;
* every byte count of a token (tp's activations, pp's, cp's blocks) for this rank's block_size/cp tokens;
* the CommTimers' own counters against the recording, and the memory against :func:`implementation_memory`.

They must agree exactly. A wire byte count is (p−1)/p of something, so both sides are exact fractions, from
the one table of ring factors (:data:`labkit.comm.collectives.WIRE_FACTOR`); only the CommTimers' row and the cp row
are in whole bytes, each call rounded down once, as the counters (and ``cp_wire_bytes``) do.

The step model's own terms are set beside the recording too (:func:`model_rows`): the ring bytes of
:func:`labkit.sim.step.tp_messages`, :func:`~labkit.sim.step.pp_messages`, :func:`~labkit.sim.step.dp_messages` and
:func:`labkit.sim.context.cp_messages` for the same layout — the very functions the model's times are built on, not a
second copy. The model is simpler than labkit's code, so these need not agree; each row says what the model leaves
out (:data:`MODEL_LEAVES_OUT`).
"""
from __future__ import annotations

import math
from fractions import Fraction

from labkit.comm.collectives import wire_exact
from labkit.comm.network import others_share

FP32 = 4


def gradient_axis(mesh: dict) -> str:
    """The recording's name of the data-parallel strategy's group: "dp_cp" (dp × cp) when cp > 1, else "dp"."""
    return "dp_cp" if mesh["cp"] > 1 else "dp"


def gradient_ranks(mesh: dict) -> int:
    return mesh["dp"] * mesh["cp"]


def shard_ranks(mesh: dict) -> int:
    """The ranks FSDP2 shards over: dp × cp, or with HSDP one shard group, dp_shard × cp (``mesh`` names dp_shard
    only then)."""
    return mesh.get("dp_shard", mesh["dp"]) * mesh["cp"]


def dp_axes(mesh: dict) -> tuple[str, ...]:
    """The recording's names of the groups the data-parallel strategy sends on: its gradient axis, or with HSDP the
    shard group and the replica groups (:func:`labkit.sim.dryrun_record.axis_namer`)."""
    from labkit.parallel.mesh import SHARD_AXIS

    return (SHARD_AXIS, "dp_replicate") if "dp_shard" in mesh else (gradient_axis(mesh),)


def _padded(numels, p: int) -> int:
    """Each of ``numels`` rounded up to a multiple of p (so that it cuts into p equal slices), summed."""
    return sum(math.ceil(n / p) * p for n in numels)


def layout_facts(cfg, trainer) -> dict:
    """What the exact count needs of this rank's part beyond its parameter count: the padding that cutting
    into p equal slices adds, from the sizes of the parameters this rank holds and the strategy's rule.

    * ZeRO-1/2: each flat bucket (``parallel.dp.bucket_mb``, per parameter group) padded to a multiple of p;
      ``slice`` is this rank's elements of all of them;
    * FSDP2: each parameter's dim 0 padded to a multiple of p, per FSDP unit (each block; the root holds the
      rest). ``units`` lists (is_root, padded elements); ``slice`` is this rank's elements of all of them,
      ``local`` its rows without the padding (the size of its optimizer state);
    * labkit's ZeRO-3: per unit (each block, the root) one flat shard per parameter group and one of its frozen
      parameters, each padded to a multiple of p. ``units`` lists (is_root, padded elements, padded trainable
      elements); ``slice`` is this rank's elements of all of them, ``trainable_slice`` of the trainable ones (the
      gradients' and the optimizer state's size).

    p: the ranks the strategy shards over: the gradient axis (dp × cp), or FSDP2's shard group (HSDP: dp_shard × cp)."""
    from labkit.parallel.mesh import GRADIENT_AXIS, SHARD_AXIS

    from labkit.parallel.ep import is_expert

    model, name = trainer.model, trainer.strategy.name
    p = trainer.env.grid.size(SHARD_AXIS if name == "fsdp2" else GRADIENT_AXIS)
    trainable = [q for q in model.parameters() if q.requires_grad]
    facts = {"padded": sum(q.numel() for q in trainable if not is_expert(q)), "units": [],
             "experts": sum(q.numel() for q in trainable if is_expert(q))}  # under ep: summed apart, by its hook
    if name in ("zero1", "zero2"):
        facts["padded"] = _zero_padded(cfg, model, p)
    elif name == "fsdp2":
        facts.update(_fsdp2_units(model, p, trainer.env.grid.coord(SHARD_AXIS)))
    elif name == "zero3":
        facts.update(_zero3_units(cfg, model, p))
    facts["slice"] = facts["padded"] // p
    return facts


def _zero3_units(cfg, model, p: int) -> dict:
    """labkit's ZeRO-3: each unit's flat shards (one per parameter group, one of the frozen parameters), padded."""
    from labkit.optim import param_groups
    from labkit.parallel.dp.zero3 import units_of

    groups = [{id(q) for q in group["params"]} for group in param_groups(model, cfg.optim)]
    owned, units = units_of(model), []
    for i, params in enumerate(owned):  # the blocks, then the root
        stepped = _padded((sum(q.numel() for q in params if id(q) in group) for group in groups), p)
        frozen = _padded([sum(q.numel() for q in params if not q.requires_grad)], p)
        units.append((i == len(owned) - 1, frozen + stepped, stepped))
    trainable = sum(t for _, _, t in units)
    return {"units": units, "padded": sum(n for _, n, _ in units), "trainable_slice": trainable // p}


def _zero_padded(cfg, model, p: int) -> int:
    """labkit's ZeRO: the elements of every flat bucket of every parameter group, each padded to p slices."""
    from labkit.optim import param_groups
    from labkit.parallel.dp.ddp import bucket_params

    buckets = [piece for group in param_groups(model, cfg.optim) if group["params"]
               for piece in bucket_params(group["params"], cfg.parallel.dp.bucket_mb * 2**20)]
    return _padded((sum(q.numel() for q in piece) for piece in buckets), p)


def own_rows(n: int, p: int, r: int) -> int:
    """Rank ``r``'s rows of ``n`` cut into p by FSDP2 (torch.chunk's: ⌈n/p⌉ each, the last ranks fewer or none)."""
    rows = math.ceil(n / p)
    return max(0, min(rows, n - r * rows))


def _fsdp2_units(model, p: int, r: int) -> dict:
    """FSDP2: each unit's elements with every dim 0 padded to p rows, and rank ``r``'s unpadded elements."""
    def padded(params):  # FSDP2's DTensor parameters keep their full (unsharded) shape
        return sum(math.ceil(q.shape[0] / p) * p * math.prod(q.shape[1:]) for q in params)

    in_blocks = [list(block.parameters()) for block in model.blocks]
    seen = {id(q) for params in in_blocks for q in params}
    units = [(False, padded(params)) for params in in_blocks]
    units.append((True, padded([q for q in model.parameters() if id(q) not in seen])))
    return {"units": units, "padded": sum(n for _, n in units),
            "local": sum(own_rows(q.shape[0], p, r) * math.prod(q.shape[1:]) for q in model.parameters())}


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
    if name == "zero3":  # the slices of every flat shard; gradients and Adam's moments of the trainable ones only
        t = result["layout"]["trainable_slice"]
        return {"param": FP32 * s, "grad": FP32 * t, "optimizer": 2 * FP32 * t}
    return {"param": FP32 * psi, "grad": FP32 * psi, "optimizer": 2 * FP32 * psi}


def _dp_bytes(result: dict) -> Fraction:
    """The data-parallel axis: the strategy's passes round the ring, each (p−1)/p of its padded bytes."""
    from labkit.parallel.spec import STRATEGIES

    dp, m, units = gradient_ranks(result["mesh"]), result["micro_batches"], result["layout"]["units"]
    if dp == 1:
        return Fraction(0)
    share = others_share(dp) * FP32
    if result["strategy"] == "fsdp2" and units:
        # an all-gather per forward and per backward of every micro-batch for each block; the root (embeddings,
        # final norm) stays gathered from its forward to its backward (FSDP2 does not reshard the root after
        # forward); one reduce-scatter per unit: Σ (2m+1)·P_block + (m+1)·P_root, of the padded sizes, over the
        # shard group; with HSDP, each unit's gradient shard then all-reduced over the g replica groups
        shard = shard_ranks(result["mesh"])
        groups = dp // shard
        gathers = others_share(shard) * FP32 * sum(((m + 1) if root else (2 * m + 1)) * n for root, n in units)
        return gathers + 2 * others_share(groups) * FP32 * sum(n // shard for _, n in units)
    if result["strategy"] == "zero3" and units:  # as FSDP2's, but only the trainable shards are reduce-scattered
        return share * sum((m if root else 2 * m) * n + trainable for root, n, trainable in units)
    factor = STRATEGIES[result["strategy"]].wire_factor(m)  # declared: wire_factor(m)·(p−1)/p·Ψ (padded)
    return Fraction(factor) * share * result["layout"]["padded"]


def _tp_bytes(result: dict) -> Fraction:
    """The tensor-parallel axis: m micro-batches of this stage's parts of tp_wire_bytes, plus SP's sync."""
    from labkit.parallel.pp.pipeline import partition
    from labkit.parallel.tp.volume import sequence_parallel_sync_bytes, tp_wire_bytes

    cfg, mesh, stage = result["cfg"], result["mesh"], result["coordinate"]["pp"]
    model, tp, sp = cfg.model, mesh["tp"], bool(cfg.parallel.tp.sequence_parallel)
    layers = partition(result["shape"], mesh["pp"])[stage]  # the trainer's split: balanced on counted cost
    moe = result["shape"].moe
    experts = sum(moe.replaces(layer) for layer in layers) if moe is not None else 0  # MoE blocks: attention's only
    parts = tp_wire_bytes(cfg.data.micro_batch_size, model.block_size // mesh["cp"], model.n_embd, len(layers), tp,
                          FP32, sp, model.recompute)
    blocks = (len(layers) - experts) * parts["per_layer"] + experts * parts["per_moe_layer"]
    per_micro = blocks + (parts["embedding"] if stage == 0 else 0) + \
        (parts["head"] + parts["loss"] if stage == mesh["pp"] - 1 else 0)
    sync = sequence_parallel_sync_bytes(model.n_embd, model.n_layer, model.block_size, model.bias, tp) if sp else 0
    return Fraction(result["micro_batches"] * per_micro + sync)


def _pp_bytes(result: dict) -> dict:
    """The pipeline: activations sent on (forward) and their gradients sent back (backward), and the tied
    embedding's gradient summed over its two copies (the first and the last stage): the whole copy, or under FSDP2,
    whose gradients are this rank's rows by the time the strategy's hooks run, those rows (none on the last ranks of
    a vocabulary shorter than its shard group)."""
    cfg, mesh, stage = result["cfg"], result["mesh"], result["coordinate"]["pp"]
    first, last, model = stage == 0, stage == mesh["pp"] - 1, cfg.model
    activation = cfg.data.micro_batch_size * model.block_size // mesh["cp"] * model.n_embd * FP32
    rows = result["shape"].vocab_size // mesh["tp"]
    if result["strategy"] == "fsdp2":
        rows = own_rows(rows, shard_ranks(mesh), result["shard_coordinate"])
    tied = rows * model.n_embd * FP32 if (first or last) else 0
    return {"pp": result["micro_batches"] * ((not last) + (not first)) * wire_exact("send", activation, 2),
            "tied": wire_exact("all_reduce", tied, 2)}


def _cp_bytes(result: dict) -> int:
    """Context parallelism: every layer of this stage, every micro-batch, sends cp_wire_bytes' forward (twice under
    recompute: the checkpoint reruns the attention) and backward, in whole bytes per call."""
    from labkit.parallel.pp.pipeline import partition
    from labkit.sim.context import forward_passes, layer_wire_bytes

    shape, lay = model_layout(result)
    layers = len(partition(result["shape"], lay.pp)[result["coordinate"]["pp"]])
    wire = layer_wire_bytes(shape, lay, FP32)
    return result["micro_batches"] * layers * (forward_passes(lay) * wire["forward"] + wire["backward"])


def analytic(result: dict) -> dict:
    """The bytes this rank should send in the step, per axis, from the layout alone (and ZeRO's/FSDP2's
    padding, :func:`layout_facts`); exact fractions."""
    out = {"dp": _dp_bytes(result)}
    if result["mesh"]["tp"] > 1:
        out["tp"] = _tp_bytes(result)
    if result["mesh"]["pp"] > 1:
        out.update(_pp_bytes(result))
    if result["mesh"]["cp"] > 1:
        out["cp"] = _cp_bytes(result)
    if result["mesh"].get("ep", 1) > 1:
        out.update(_ep_bytes(result))
    return out


def _ep_bytes(result: dict) -> dict:
    """Expert parallelism, from this rank's routing in the step (the MoE layers' tallies: each expert's kept rows,
    summed over the micro-batches): per MoE layer and micro-batch the counts exchanged first (E int64, (ep − 1)/ep of
    them; again when a full recompute reruns the layer), and the rows whose expert another ep rank holds, sent by
    the dispatch and returned by the combine, forward (again under full recompute) and backward — on the fake group
    a rank's arrivals are its own rows, so the combine returns as many as the dispatch sent. And the experts'
    gradients, all-reduced over the ranks holding the same experts (``expert_dp_cp``)."""
    cfg, mesh, routing = result["cfg"], result["mesh"], result["routing"]
    ep, index, experts = mesh["ep"], result["ep_coordinate"], cfg.model.moe.experts
    mine = slice(index * experts // ep, (index + 1) * experts // ep)
    passes = 2 if cfg.model.recompute == "full" else 1
    rows = sum(sum(kept) - sum(kept[mine]) for kept in routing)
    counts = passes * len(routing) * result["micro_batches"] * wire_exact("all_to_all", 8 * experts, ep)
    replicas = result["expert_replicas"]
    return {"ep": (2 * passes + 2) * rows * cfg.model.n_embd * FP32 + counts,
            "experts": wire_exact("all_reduce", FP32 * result["layout"]["experts"], replicas)}


def _wire(calls, axis: str, big: bool | None = None, source: str | None = None) -> Fraction:
    """Exact recorded wire bytes on ``axis``; ``big`` True/False keeps the model-sized calls or only the scalar
    ones (8 bytes and under: a gradient norm's or a loss's one number)."""
    return sum((c.wire_exact for c in calls if c.axis == axis and (not source or c.source == source)
                and (big is None or (c.nbytes > 8) == big)), Fraction(0))


def compare(result: dict) -> list[dict]:
    """Rows (what, recorded, analytic, equal): recorded bytes against the analytic counts for this layout, the
    CommTimers' counters against the recording, and the model-state memory against the prediction."""
    want, mesh, calls = analytic(result), result["mesh"], result["calls"]
    rows = []

    def row(what, recorded, expected):
        rows.append({"what": what, "recorded": recorded, "analytic": expected, "equal": recorded == expected})

    if gradient_ranks(mesh) > 1:
        over = (", HSDP: shard group and replica groups" if "dp_shard" in mesh else
                ", over dp × cp" if mesh["cp"] > 1 else "")
        row(f"dp wire bytes, {result['strategy']} (model-sized collectives{over})",
            sum(_wire(calls, axis, big=True) for axis in dp_axes(mesh)), want["dp"])
    if mesh["tp"] > 1:
        row("tp wire bytes (m × tp_wire_bytes + SP sync)", _wire(calls, "tp", source="labkit"), want["tp"])
    if mesh["pp"] > 1:
        sent = _wire([c for c in calls if c.kind in ("send", "recv")], "pp")  # the ring's sends are cp's
        row("pp wire bytes (activations and their gradients)", sent, want["pp"])
        tied_axis = "pp" if mesh["pp"] == 2 else "tied"
        row("tied embedding all-reduce (first and last stage)",
            _wire([c for c in calls if c.kind == "all_reduce"], tied_axis, big=True), want["tied"])
    if mesh["cp"] > 1:
        row(f"cp wire bytes, {result['cfg'].parallel.cp.impl} (m × layers × cp_wire_bytes)",
            sum(c.wire for c in calls if c.axis == "cp"), want["cp"])
    if mesh.get("ep", 1) > 1:
        row("ep wire bytes (the routed rows that leave, both ways, and the counts)", _wire(calls, "ep"), want["ep"])
        row("expert gradients (all-reduced over the ranks holding the same experts)",
            _wire(calls, "expert_dp_cp"), want["experts"])
    labkit_calls = sum(c.wire for c in calls if c.source == "labkit")
    sends = sum(c.wire for c in calls if c.source == "torch" and c.kind == "send")
    row("CommTimers' counters (labkit layer + pipeline sends)", sum(result["counted"].values()), labkit_calls + sends)
    exact = implementation_memory(result)
    for key in ("param", "grad", "optimizer"):
        row(f"{key} bytes of this rank", result["memory"][key], exact[key])
    return rows


# What labkit.sim.step's byte terms leave out of what labkit's real code sends, per axis (the dry run's rows say it).
MODEL_LEAVES_OUT = {
    "dp": "the padding to p equal slices (ZeRO, FSDP2); FSDP2's root kept gathered and one reduce-scatter a step (the "
          "model: ZeRO-3 reduce-scatters every micro-batch); HSDP's shard groups (the model shards over all of dp × "
          "cp); the parameters labkit replicates over tp or holds on one stage (the model splits them evenly over "
          "tp·pp); under expert parallelism the experts' own group (the ranks holding the same experts: the model "
          "all-reduces a rank's experts over all of dp × cp)",
    "tp": "the embedding's and the output layer's all-reduce and the loss's three per-token ones; the recompute's "
          "reruns (the model: Megatron-LM's 2 a layer under full recompute; labkit's checkpoint reruns fewer); "
          "sequence parallelism's gradient sync",
    "pp": "that the first and the last stage send one way (the model counts a middle stage: one send each way per "
          "micro-batch); the tied embedding's all-reduce",
    "cp": "that a stage holds ⌈L/pp⌉ layers (labkit's partition balances them on counted cost)",
    "ep": "this rank's routing (the model: perfect balance unless told the "
          "imbalance, and the busiest stage's ⌈MoE layers/pp⌉); a full recompute's rerun of the dispatch",
}


def model_layout(result: dict):
    """The dry run's model and layout as :mod:`labkit.sim.step` takes them (labkit's pipeline sends whole
    activations: no scatter/gather)."""
    from labkit.sim.step import Layout, ModelShape

    cfg, mesh = result["cfg"], result["mesh"]
    zero, cp = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}.get(result["strategy"], 0), cfg.parallel.cp
    return ModelShape.from_gpt(result["shape"]), Layout(
        dp=mesh["dp"], tp=mesh["tp"], pp=mesh["pp"], cp=mesh["cp"], cp_impl=cp.impl, cp_layout=cp.layout,
        micro_batch=cfg.data.micro_batch_size,
        micro_batches=result["micro_batches"], zero=zero, recompute=cfg.model.recompute,
        sequence_parallel=bool(cfg.parallel.tp.sequence_parallel), pp_scatter_gather=False, ep=mesh.get("ep", 1))


def model_terms(result: dict) -> dict[str, Fraction]:
    """labkit.sim.step's own bytes for the dry run's layout, per axis with more than one rank: the ring bytes of its
    messages (fp32, as a dry run trains), per micro-batch times m for tp and pp."""
    from labkit.sim import context, experts, step

    shape, lay = model_layout(result)

    def ring(messages, group: int) -> Fraction:
        return sum((count * wire_exact(op, Fraction(nbytes), group) for count, op, nbytes in messages), Fraction(0))
    terms = {"dp": ring(step.dp_messages(shape, lay, FP32), lay.gradient_ranks),
             "tp": lay.micro_batches * ring([step.tp_messages(shape, lay, FP32)], lay.tp),
             "pp": lay.micro_batches * ring([step.pp_messages(shape, lay, FP32)], 2),
             "cp": lay.micro_batches * ring(context.cp_messages(shape, lay, FP32), lay.cp),
             "ep": lay.micro_batches * ring(experts.ep_messages(shape, lay, FP32), lay.ep)}
    degree = {**result["mesh"], "dp": lay.gradient_ranks}
    return {axis: bytes_ for axis, bytes_ in terms.items() if degree.get(axis, 1) > 1}


def model_rows(result: dict) -> list[dict]:
    """Rows (axis, recorded, model, what the model leaves out): the recorded wire bytes of each axis beside
    :func:`model_terms` (dp: the model-sized collectives over dp × cp; tp: labkit's layer; pp: the pipeline's sends;
    cp: context parallelism's calls)."""
    calls = result["calls"]
    recorded = {"dp": sum(_wire(calls, axis, big=True) for axis in dp_axes(result["mesh"])),
                "tp": _wire(calls, "tp", source="labkit"),
                "pp": _wire([c for c in calls if c.kind in ("send", "recv")], "pp"), "cp": _wire(calls, "cp"),
                "ep": _wire(calls, "ep")}
    return [{"axis": axis, "recorded": recorded[axis], "model": term, "leaves_out": MODEL_LEAVES_OUT[axis]}
            for axis, term in model_terms(result).items()]
