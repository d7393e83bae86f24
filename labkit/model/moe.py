"""A mixture of experts: many MLPs in a block, of which each token uses only ``top_k`` (``model.moe``).

A dense GPT block sends every token through one MLP. A mixture-of-experts (MoE) layer holds E MLPs of that
same shape, the **experts**, and a small **router** that picks, for each token, the k experts it goes
through: E times the MLP's parameters, but only k MLPs' worth of compute per token (Shazeer et al. 2017;
GShard; Switch Transformer, Fedus et al. 2021; DeepSeek-V3). The layer, one token's way through it:

1. **route** (:func:`router_probabilities`): a linear map d → E and a softmax, in fp32 whatever the
   autocast — Switch Transformer §2.4: a bf16 router diverges (the softmax's exponent turns the rounding of
   the logits into large changes of the probabilities, and so of the choice);
2. **select** (:func:`select_experts`): the k most probable experts; their probabilities are the **gate**
   weights, renormalised to sum to 1 when k > 1 (with k = 1 the gate is the probability itself, which is how
   the router's weights get a gradient at all);
3. **capacity** (:func:`expert_capacity`, :func:`within_capacity`): an expert takes at most
   C = ⌈k·T/E × capacity_factor⌉ of the k·T token-to-expert assignments of a forward's T tokens, first come
   (token order) first served; an assignment over it is **dropped**: that expert adds nothing to the token,
   whose residual passes through the block unchanged (with both of its experts full, the layer outputs 0
   for it). ``capacity_factor: null`` drops nothing (dropless): every expert takes all it is given;
4. **compute** (:class:`Experts`): each expert on the tokens it took — a loop over the experts
   (:func:`combine_loop`, the reference) or all of them at once with one grouped matmul per layer
   (:func:`combine_grouped`, ``torch._grouped_mm``: the rows of all experts side by side, a group each);
5. **combine**: each token's output is the sum of its experts' outputs weighted by its gates, plus the
   optional **shared expert** every token goes through (DeepSeek's: common knowledge kept out of the experts).

Left alone, a router sends most tokens to a few experts (they learn faster, so they get chosen more).
``balance`` picks the remedy:

* ``aux_loss`` — Switch Transformer's auxiliary loss α·E·Σᵢ fᵢ·Pᵢ (:func:`switch_aux_loss`), added to the
  training loss: fᵢ the share of assignments routed to expert i, Pᵢ the router's mean probability for it.
  It is α at perfect balance and grows as the two concentrate on the same experts;
* ``loss_free`` — DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the probabilities
  **for the choice only** (the gates stay the unbiased probabilities), moved after every optimizer step by a
  fixed amount u against each expert's load, bᵢ += u·sign(mean load − loadᵢ), then mean-centred
  (:func:`loss_free_update`). A buffer, not a parameter: no gradient changes it, and no loss term pulls the
  model away from the language-modelling objective;
* ``none``.

Every forward in training counts what the router did (:class:`RoutingTally`): tokens per expert (the load),
max/mean load (1 is perfect balance, E is everything to one expert) and the share of assignments dropped.
The trainer sums a step's counts over the data-parallel replicas, puts them in the step event and moves the
loss-free biases (:class:`labkit.callbacks.ExpertRouting`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F



@dataclass(frozen=True)
class MoEShape:
    """What the model needs of ``model.moe`` (``labkit.config.MoEConfig``; read there for each setting)."""

    experts: int
    top_k: int = 2
    capacity_factor: Optional[float] = 1.25  # None: dropless
    balance: str = "aux_loss"  # "aux_loss", "loss_free" or "none"
    aux_loss_alpha: float = 0.01
    bias_update: float = 0.001  # u, the loss-free bias's step
    every: int = 1  # every N-th block's MLP is a mixture of experts
    shared_expert: bool = False
    impl: str = "grouped"  # how the experts run: "grouped" (one grouped matmul) or "loop" (the reference)

    @classmethod
    def from_config(cls, moe_cfg) -> Optional["MoEShape"]:
        """``model.moe`` as the model takes it; None for a dense GPT (``experts: 0``, or no ``moe`` at all)."""
        if moe_cfg is None or moe_cfg.experts <= 0:
            return None
        return cls(**{f.name: getattr(moe_cfg, f.name) for f in dataclasses.fields(cls)})

    def replaces(self, layer: int) -> bool:
        """Whether block ``layer``'s MLP is a mixture of experts: the ``every``-th, 2·``every``-th, … block
        (``every: 2`` makes blocks 1, 3, 5, … MoE and leaves 0, 2, 4, … dense, as Switch Transformer does)."""
        return self.every >= 1 and (layer + 1) % self.every == 0

    def layers(self, n_layer: int) -> int:
        """How many of ``n_layer`` blocks are mixtures of experts."""
        return n_layer // self.every if self.every >= 1 else 0


# ---------------------------------------------------------------- 1–3: route, select, capacity


def router_probabilities(tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(T, d) tokens → (T, E) probabilities over the experts, computed in fp32 even under a bf16 autocast."""
    with torch.autocast(tokens.device.type, enabled=False):
        logits = F.linear(tokens.float(), weight.float())
    return logits.softmax(dim=-1)


def select_experts(probs: torch.Tensor, k: int, bias: Optional[torch.Tensor] = None):
    """Each token's k experts and their gate weights, both (T, k).

    ``bias`` (loss-free balancing) shifts the scores the choice is made on; the gates are the unbiased
    probabilities of the chosen experts, renormalised to sum to 1 when k > 1."""
    scores = probs if bias is None else probs + bias
    chosen = scores.topk(k, dim=-1).indices
    gates = probs.gather(-1, chosen)
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return chosen, gates


def expert_capacity(tokens: int, experts: int, top_k: int, factor: Optional[float]) -> Optional[int]:
    """C = ⌈k·T/E × factor⌉: the assignments one expert takes in a forward of T tokens (None: dropless).

    k·T/E is an expert's share of the k·T assignments at perfect balance (with k = 1, Switch Transformer's
    tokens/experts × capacity factor); the factor is the slack left for imbalance."""
    if factor is None:
        return None
    return math.ceil(top_k * tokens / experts * factor)


def within_capacity(chosen: torch.Tensor, experts: int, capacity: Optional[int]) -> torch.Tensor:
    """(T, k) booleans: which assignments their expert takes. Each expert serves its assignments in token order
    and takes the first ``capacity`` of them (a token appears at most once in an expert's queue)."""
    if capacity is None:
        return torch.ones_like(chosen, dtype=torch.bool)
    one_hot = F.one_hot(chosen.reshape(-1), experts)  # (T·k, E), token by token
    place_in_queue = ((one_hot.cumsum(dim=0) - 1) * one_hot).sum(dim=-1)
    return (place_in_queue < capacity).view_as(chosen)


# ---------------------------------------------------------------- balance


def switch_aux_loss(probs: torch.Tensor, load: torch.Tensor, alpha: float) -> torch.Tensor:
    """Switch Transformer's load-balancing loss α·E·Σᵢ fᵢ·Pᵢ (eq. 4).

    fᵢ = loadᵢ / Σ load, the share of the assignments routed to expert i (counts: no gradient), and
    Pᵢ = the mean over tokens of the router's probability for expert i (the gradient flows through it,
    pushing probability away from the experts that already get the most)."""
    experts = probs.size(-1)
    routed_share = load.float() / load.sum()
    mean_probability = probs.mean(dim=0)
    return alpha * experts * (routed_share * mean_probability).sum()


@torch.no_grad()
def loss_free_update(bias: torch.Tensor, load: torch.Tensor, step: float) -> None:
    """DeepSeek-V3's balancing, in place: bᵢ += u·sign(mean load − loadᵢ), then mean-centred — an overloaded
    expert's score goes down by u, an underloaded one's up, whatever the size of the imbalance."""
    load = load.to(bias.dtype)
    bias += step * torch.sign(load.mean() - load)
    bias -= bias.mean()


# ---------------------------------------------------------------- 4: the experts


class ExpertLinear(nn.Module):
    """E linear layers of one shape, stacked: ``weight`` (E, out, in) and ``bias`` (E, out) or None.

    One tensor for all E experts: a grouped matmul takes it whole, and an expert that gets no token in a
    step still has a gradient (its slice is zero), so data parallelism sees every parameter used."""

    def __init__(self, experts: int, fan_in: int, fan_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, fan_out, fan_in))
        self.bias = nn.Parameter(torch.empty(experts, fan_out)) if bias else None


def grouped_mm_fits(width: int, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` takes rows of ``width`` (d; the hidden layer is 4d): every stride of its
    operands and output a multiple of 16 bytes, as its kernels need (on the CPU too)."""
    return width * torch.empty((), dtype=dtype).element_size() % 16 == 0


def grouped_linear(rows: torch.Tensor, counts: torch.Tensor, layer: ExpertLinear) -> torch.Tensor:
    """Expert e's linear layer on its ``counts[e]`` rows, for every e at once: ``rows`` holds expert 0's rows,
    then expert 1's, …; one ``torch._grouped_mm`` (on the CPU, torch runs it as a loop of matmuls in C++). Rows
    too narrow for it (:func:`grouped_mm_fits`) take the same per-group matmuls written out."""
    weight = layer.weight.to(rows.dtype).transpose(-2, -1)  # (E, in, out)
    if grouped_mm_fits(rows.size(-1), rows.dtype):
        out = torch._grouped_mm(rows, weight, offs=counts.cumsum(dim=0).to(torch.int32))
        if out.requires_grad:  # its CPU backward needs a dense gradient (a sum's is expanded)
            out.register_hook(torch.Tensor.contiguous)
    else:
        out = torch.cat([part @ w for part, w in zip(rows.split(counts.tolist()), weight)])
    if layer.bias is not None:
        out = out + layer.bias.to(out.dtype).repeat_interleave(counts, dim=0)
    return out


class Experts(nn.Module):
    """E GPT MLPs (d → 4d → GELU → d), each the shape of ``labkit.model.gpt.MLP``, their weights stacked."""

    def __init__(self, experts: int, n_embd: int, bias: bool):
        super().__init__()
        self.fc = ExpertLinear(experts, n_embd, 4 * n_embd, bias)
        self.proj = ExpertLinear(experts, 4 * n_embd, n_embd, bias)

    def one(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``expert`` on its rows (the loop's step)."""
        fc, proj = self.fc, self.proj
        hidden = F.gelu(F.linear(rows, fc.weight[expert], None if fc.bias is None else fc.bias[expert]))
        return F.linear(hidden, proj.weight[expert], None if proj.bias is None else proj.bias[expert])

    def grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every expert on its rows at once: ``rows`` sorted by expert, ``counts[e]`` of expert e's."""
        rows = rows.to(_compute_dtype(rows))  # as F.linear would under an autocast
        return grouped_linear(F.gelu(grouped_linear(rows, counts, self.fc)), counts, self.proj)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def combine_loop(experts: Experts, tokens, chosen, gates, kept) -> torch.Tensor:
    """The reference: each expert in turn on the tokens it took, its output times the gate added to theirs."""
    out = torch.zeros_like(tokens)
    for e in range(experts.fc.weight.size(0)):
        token, slot = torch.where((chosen == e) & kept)
        contribution = gates[token, slot, None] * experts.one(e, tokens[token])
        out = out.index_add(0, token, contribution.to(out.dtype))
    return out


def combine_grouped(experts: Experts, tokens, chosen, gates, kept) -> torch.Tensor:
    """All experts at once: the kept assignments sorted by expert (token order within each), one grouped
    matmul per layer, each row times its gate added back to its token — the loop's sums, in the loop's order."""
    token, slot = torch.where(kept)
    expert = chosen[token, slot]
    order = torch.argsort(expert, stable=True)
    token, slot = token[order], slot[order]
    counts = torch.bincount(expert, minlength=experts.fc.weight.size(0))
    contribution = gates[token, slot, None] * experts.grouped(tokens[token], counts)
    return torch.zeros_like(tokens).index_add(0, token, contribution.to(tokens.dtype))


COMBINE = {"loop": combine_loop, "grouped": combine_grouped}


# ---------------------------------------------------------------- statistics


class RoutingTally:
    """What one MoE layer's router did since :meth:`reset` (the trainer resets it before each step, so a
    step's micro-batches add up): ``counts`` holds the assignments routed to each expert (its load, before
    the capacity), then the assignments dropped; ``aux_loss`` the sum of the forwards' auxiliary losses."""

    def __init__(self, experts: int):
        self.experts = experts
        self.reset()

    def reset(self) -> None:
        self.counts: Optional[torch.Tensor] = None  # made on the first forward's device
        self.kept: Optional[torch.Tensor] = None  # each expert's assignments within its capacity
        self.aux_loss, self.forwards = 0.0, 0

    def add(self, load: torch.Tensor, dropped: torch.Tensor, aux_loss: Optional[torch.Tensor],
            kept: Optional[torch.Tensor] = None) -> None:
        counts = torch.cat([load, dropped.view(1)]).double()
        self.counts = counts if self.counts is None else self.counts + counts
        kept = load if kept is None else kept
        self.kept = kept.clone() if self.kept is None else self.kept + kept
        self.forwards += 1
        if aux_loss is not None:
            self.aux_loss = self.aux_loss + aux_loss.detach().double()

    def kept_rows(self) -> list[int]:
        """Each expert's kept assignments since :meth:`reset` (the rows expert parallelism sends it; zeros before any
        forward)."""
        return [int(n) for n in self.kept.tolist()] if self.kept is not None else [0] * self.experts

    def totals(self, device=None) -> torch.Tensor:
        """``counts`` (zeros before any forward), the tensor summed over replicas."""
        return self.counts if self.counts is not None else torch.zeros(self.experts + 1, dtype=torch.float64,
                                                                       device=device)


def routing_stats(counts: torch.Tensor) -> dict:
    """A layer's load per expert, max/mean load and drop rate from its (E + 1) ``counts``."""
    load, dropped = counts[:-1], float(counts[-1])
    routed = float(load.sum())
    return {"load": [int(n) for n in load.tolist()],
            "max_mean": float(load.max()) / (routed / load.numel()) if routed else None,
            "drop_rate": dropped / routed if routed else None}


# ---------------------------------------------------------------- 5: the layer


class Router(nn.Module):
    """``weight`` (E, d), and loss-free balancing's ``score_bias`` (E,): a buffer, saved with the model and moved
    by :func:`loss_free_update`, never by a gradient."""

    def __init__(self, experts: int, n_embd: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, n_embd))
        self.register_buffer("score_bias", torch.zeros(experts))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return router_probabilities(tokens, self.weight)


class MoE(nn.Module):
    """A block's MLP as a mixture of experts: (B, T, d) → (B, T, d), as ``labkit.model.gpt.MLP``.

    Parameters: ``router.weight`` (E, d), ``experts.fc``/``experts.proj`` (stacked, :class:`ExpertLinear`),
    and ``shared`` (an ``MLP``, handed in) with a shared expert; the loss-free bias is the buffer
    ``router.score_bias``. After a forward in training, ``aux_loss`` holds its auxiliary loss (None unless
    ``balance: aux_loss``; the GPT adds it to the loss) and ``tally`` its counts."""

    def __init__(self, moe: MoEShape, n_embd: int, bias: bool = False, dropout: float = 0.0,
                 shared: Optional[nn.Module] = None, layer: int = 0):
        super().__init__()
        self.moe, self.layer = moe, layer  # layer: the block's index in the GPT, for the statistics
        self.router = Router(moe.experts, n_embd)
        self.experts = Experts(moe.experts, n_embd, bias)
        self.shared = shared
        self.dropout = nn.Dropout(dropout)
        self.aux_loss: Optional[torch.Tensor] = None
        self.tally = RoutingTally(moe.experts)
        self.last_path: Optional[str] = None  # how the experts last ran: "loop", "grouped_mm" or "grouped_split"
        # expert parallelism (labkit.parallel.ep): this rank holds some of the experts, and this sends each token to
        # its experts' ranks and back (step 4 over the ep axis); None: every expert is here
        self.expert_parallel: Optional[Callable] = None

    def route(self, tokens: torch.Tensor):
        """Steps 1–3: the router's probabilities (T, E), each token's experts and gates (T, k), and which of
        those assignments are within their expert's capacity (T, k)."""
        m = self.moe
        probs = self.router(tokens)
        chosen, gates = select_experts(probs, m.top_k, self.router.score_bias if m.balance == "loss_free" else None)
        capacity = expert_capacity(tokens.size(0), m.experts, m.top_k, m.capacity_factor)
        return probs, chosen, gates, within_capacity(chosen, m.experts, capacity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.size(-1))
        probs, chosen, gates, kept = self.route(tokens)
        load = torch.bincount(chosen.reshape(-1), minlength=self.moe.experts)
        self.aux_loss = (switch_aux_loss(probs, load, self.moe.aux_loss_alpha)
                         if self.moe.balance == "aux_loss" and self.training else None)
        if self.training and _counting():
            self.tally.add(load, (~kept).sum(), self.aux_loss, torch.bincount(chosen[kept], minlength=self.moe.experts))
        self.last_path = self._path(tokens)
        combine = self.expert_parallel or COMBINE[self.moe.impl]
        out = self.dropout(combine(self.experts, tokens, chosen, gates, kept))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view_as(x)

    def _path(self, tokens: torch.Tensor) -> str:
        if self.moe.impl == "loop":
            return "loop"
        return "grouped_mm" if grouped_mm_fits(tokens.size(-1), _compute_dtype(tokens)) else "grouped_split"

    def update_bias(self, load: torch.Tensor) -> None:
        """Loss-free balancing's step, after an optimizer step: ``load`` is the step's tokens per expert (summed
        over its micro-batches and the data-parallel replicas, so every replica moves its bias alike)."""
        loss_free_update(self.router.score_bias, load.to(self.router.score_bias.device), self.moe.bias_update)


def _counting() -> bool:
    """False while autograd's engine runs a backward: activation checkpointing (``model.recompute=full``)
    runs the forward again there, and that second forward must not count twice."""
    return torch._C._current_graph_task_id() == -1


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every mixture-of-experts layer in ``model`` (a GPT, a wrapped one, a pipeline stage), in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def step_statistics(layers: list[MoE], sum_over_replicas: Optional[Callable] = None) -> list[torch.Tensor]:
    """Each layer's counts since its tally was reset (:class:`RoutingTally`), summed over the data-parallel
    replicas by ``sum_over_replicas`` (an in-place sum over ranks; None: this rank's own)."""
    if not layers:
        return []
    device = layers[0].router.weight.device
    flat = torch.cat([m.tally.totals(device).to(device) for m in layers])
    if sum_over_replicas is not None:
        sum_over_replicas(flat)
    return list(flat.split([m.moe.experts + 1 for m in layers]))


def step_event_fields(layers: list[MoE], counts: list[torch.Tensor]) -> dict:
    """The step event's routing fields, one entry per MoE layer: its block index, load per expert,
    max/mean load, drop rate, and mean auxiliary loss over the step's forwards on this rank (None without)."""
    stats = [routing_stats(c) for c in counts]
    return {"moe_layers": [m.layer for m in layers],
            "moe_load": [s["load"] for s in stats],
            "moe_max_mean": [s["max_mean"] for s in stats],
            "moe_drop_rate": [s["drop_rate"] for s in stats],
            "moe_aux_loss": [float(m.tally.aux_loss) / m.tally.forwards
                             if m.moe.balance == "aux_loss" and m.tally.forwards else None for m in layers]}


def _split_model_problems(cfg) -> list[str]:
    """What a mixture of experts does not run beside yet: each model-parallel layout it is not written or checked for
    (tests/parallel/test_expert_parallel.py checks tp and pp with labkit's implementations)."""
    p, m, found = cfg.parallel, cfg.model.moe, []
    here = f"model.moe.experts={m.experts}"
    if p.tp.degree > 1 and p.tp.impl != "labkit":
        found.append(f"{here} with parallel.tp.impl={p.tp.impl}: its plan splits every block's MLP, and an MoE layer "
                     "stays whole on each tp rank; use parallel.tp.impl=labkit")
    if p.tp.degree > 1 and p.tp.sequence_parallel:
        found.append(f"{here} with parallel.tp.sequence_parallel: each tp rank would route only its part of the "
                     "sequence, and the experts' gradients would need a sum over tp; turn sequence parallelism off")
    if p.cp.degree > 1:
        found.append(f"{here} with parallel.cp.degree > 1: not checked in this version of labkit; set "
                     "parallel.cp.degree=1")
    if p.pp.degree > 1 and p.pp.impl != "labkit":
        found.append(f"{here} with parallel.pp.impl={p.pp.impl}: checked with labkit's schedules only; use "
                     "parallel.pp.impl=labkit")
    if p.pp.degree > 1 and m.balance == "aux_loss":
        found.append(f"{here} with parallel.pp.degree > 1 and model.moe.balance=aux_loss: a stage's auxiliary loss "
                     "would have to join the pipeline's backward (it does not yet); use model.moe.balance=loss_free "
                     "or none")
    return found


def moe_problems(cfg) -> list[str]:
    """``model.moe``'s ranges, and what it does not combine with yet; empty for a dense GPT."""
    m = cfg.model.moe
    if m.experts < 0:
        return [f"model.moe.experts: must be >= 0 (0 is the dense GPT), got {m.experts}"]
    if m.experts == 0:
        return []
    problems = []
    if not 1 <= m.top_k <= m.experts:
        problems.append(f"model.moe.top_k: each token goes to 1 to experts={m.experts} experts, got {m.top_k}")
    if m.capacity_factor is not None and m.capacity_factor <= 0:
        problems.append(f"model.moe.capacity_factor: must be > 0 (1.25 is usual; null drops nothing), "
                        f"got {m.capacity_factor}")
    if m.every < 1:
        problems.append(f"model.moe.every: must be >= 1 (1: every block's MLP is a mixture of experts), got {m.every}")
    elif m.every > cfg.model.n_layer:
        problems.append(f"model.moe.every={m.every} > model.n_layer={cfg.model.n_layer}: no block would be a "
                        "mixture of experts")
    if m.aux_loss_alpha < 0 or m.bias_update < 0:
        problems.append("model.moe.aux_loss_alpha and model.moe.bias_update: must be >= 0")
    problems += _split_model_problems(cfg)
    if cfg.comm.consistency is not None:
        problems.append("model.moe with comm.consistency: the CAP lab trains a dense GPT (model.moe.experts=0)")
    return problems
