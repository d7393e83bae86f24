"""``powersgd``: send a rank-r approximation of each gradient matrix (Vogels et al. 2019).

A weight gradient G (n×m) is close to low rank, so it is nearly P·Qᵀ with P n×r and Q m×r: send
(n + m)·r numbers instead of n·m. PowerSGD finds P and Q with one step of power iteration, and —
the trick that makes it a *linear* compressor — both factors can be **all-reduced**:

    P = Σ_i G_i·Q   (all-reduce);  P ← orthonormalise(P);  Q = Σ_i G_iᵀ·P / p  (all-reduce)

so P·Qᵀ = P·Pᵀ·mean(G): the average gradient projected on an r-dimensional subspace. Q is kept
for the next step (*warm start*: the power iteration continues across steps instead of starting
from noise), and error feedback keeps what the projection missed: error ← (G + error) − P·Qᵀ.
The first ``start_powerSGD_iter`` steps are plain all-reduces (early training is sensitive, and
DDP rebuilds its buckets after step 1); a matrix is compressed only if
(n + m)·r·min_compression_rate < n·m (config ``comm.powersgd_min_compression_rate``), so biases and
other 1-D tensors always go uncompressed; raising it also sends small matrices whole, such as a small
vocabulary's embedding, which has little to gain and most to lose from a low-rank approximation.

Two paths:

* ``ddp_hook()`` runs torch's own ``powerSGD_hook`` per *layer* matrix of each bucket, one bucket
  at a time, with its all-reduces routed through labkit's counting wrappers (see
  :mod:`labkit.comm.compress.powersgd_ddp`).
* ``allreduce(bucket_index, flat)`` (labkit's own ``ddp_bucketed``) sees only a flat bucket, so it
  folds it into one near-square matrix (zero-padded) — the same algorithm at bucket granularity,
  usually less accurate at the same rank than per-layer compression.
"""
import math

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from labkit.comm.compress.base import COMPRESSORS, Compressor
from labkit.comm.compress.options import require_bool, require_int
from labkit.comm.compress.powersgd_ddp import powersgd_ddp_hook
from labkit.comm.compress.randomk import shared_generator


def as_matrix(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` zero-padded and folded into a near-square (rows × cols) matrix."""
    cols = math.isqrt(flat.numel() - 1) + 1 if flat.numel() > 1 else 1
    rows = -(-flat.numel() // cols)
    return torch.cat([flat, flat.new_zeros(rows * cols - flat.numel())]).view(rows, cols)


def orthonormalise(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(matrix).Q


def plain_rng_state(rng) -> tuple:
    """numpy ``RandomState.get_state()`` as plain types (its key a list of ints, not an array), so a
    checkpoint holding it loads with ``torch.load(weights_only=True)``; ``set_state`` takes it back."""
    algorithm, key, pos, has_gauss, cached_gaussian = rng.get_state()
    return algorithm, key.tolist(), int(pos), int(has_gauss), float(cached_gaussian)


@COMPRESSORS.register
class PowerSGD(Compressor):
    name, order = "powersgd", 30
    defaults = {"rank": 2, "start_powerSGD_iter": 2, "warm_start": True, "use_error_feedback": True,
                "min_compression_rate": 2.0, "seed": 0}
    config_options = {"rank": "comm.powersgd_rank", "start_powerSGD_iter": "comm.powersgd_start_iter",
                      "warm_start": "comm.powersgd_warm_start", "use_error_feedback": "comm.error_feedback",
                      "min_compression_rate": "comm.powersgd_min_compression_rate", "seed": "run.seed"}
    collective, error_feedback = "all-reduce ×2", True
    advice = "PowerSGD: a low-rank sketch of each gradient, 10–100× fewer bytes, error feedback keeps what it missed"

    @classmethod
    def problems(cls, cfg, world: int) -> list[str]:
        c, found = cfg.comm, []
        if c.powersgd_rank < 1:
            found.append(f"comm.powersgd_rank: must be >= 1, got {c.powersgd_rank}")
        if c.powersgd_min_compression_rate < 1:
            found.append(f"comm.powersgd_min_compression_rate: must be >= 1 (1 compresses every matrix its factors "
                         f"make smaller), got {c.powersgd_min_compression_rate}")
        if c.compression == cls.name and c.powersgd_start_iter < 2 and (c.powersgd_warm_start or c.error_feedback):
            found.append(f"comm.powersgd_start_iter={c.powersgd_start_iter}: must be >= 2 with warm start or error "
                         "feedback on (DDP rebuilds its buckets after the first step)")
        return found

    def __init__(self, timer, group=None, **options):
        super().__init__(timer, group=group, **options)
        o = self.options
        self.torch_state = torch_powersgd.PowerSGDState(
            process_group=group, matrix_approximation_rank=o["rank"], start_powerSGD_iter=o["start_powerSGD_iter"],
            min_compression_rate=o["min_compression_rate"], use_error_feedback=o["use_error_feedback"],
            warm_start=o["warm_start"], random_seed=o["seed"])

    # -- torch's per-bucket state (error, Ps, Qs) follows the parameters too (see base.place) -------
    per_parameter_keys = ("error", "torch_error", "torch_p", "torch_q")
    _TORCH_DICTS = {"torch_error": "error_dict", "torch_p": "p_memory_dict", "torch_q": "q_memory_dict"}

    def _take_state(self, bucket_index: int) -> dict:
        state = super()._take_state(bucket_index)
        for key, attr in self._TORCH_DICTS.items():
            memory = getattr(self.torch_state, attr)
            if bucket_index in memory:
                state[key] = memory.pop(bucket_index)
        return state

    def _give_state(self, bucket_index: int, state: dict) -> None:
        state = dict(state)
        if state.get("torch_p") is None or state.get("torch_q") is None:  # torch re-draws both, or neither
            state.pop("torch_p", None)
            state.pop("torch_q", None)
        for key, attr in self._TORCH_DICTS.items():
            if state.get(key) is not None:
                getattr(self.torch_state, attr)[bucket_index] = state.pop(key)
        super()._give_state(bucket_index, state)

    def _split(self, key: str, tensor: torch.Tensor, layout: tuple) -> dict:
        if key not in ("torch_p", "torch_q"):
            return super()._split(key, tensor, layout)
        pieces, start = {}, 0
        for name, p_numel, q_numel in self.torch_segments(layout):
            numel = p_numel if key == "torch_p" else q_numel
            pieces[name] = tensor[start:start + numel].clone()
            start += numel
        return pieces

    def _join(self, key: str, pieces: dict, layout: tuple):
        if key not in ("torch_p", "torch_q"):
            return super()._join(key, pieces, layout)
        names = [name for name, _, _ in self.torch_segments(layout)]
        return torch.cat([pieces[name] for name in names]) if names and all(n in pieces for n in names) else None

    def torch_segments(self, layout: tuple) -> list[tuple[str, int, int]]:
        """(name, P numel, Q numel) of each compressed matrix, in the order torch's hook packs its
        Ps and Qs: grouped by matrix shape (first appearance), bucket order within a shape."""
        state, by_shape = self.torch_state, {}
        for name, shape in layout:
            n = shape[0] if shape else 1
            m = math.prod(shape) // max(n, 1)
            rank = min(n, m, state.matrix_approximation_rank)
            if torch_powersgd._should_compress(n, m, rank, state.min_compression_rate)[0]:
                by_shape.setdefault((n, m), []).append((name, n * rank, m * rank))
        return [segment for group in by_shape.values() for segment in group]

    def global_state(self) -> dict:
        return {"torch_iter": self.torch_state.iter, "torch_rng": plain_rng_state(self.torch_state.rng)}

    def load_global_state(self, state: dict) -> None:
        self.torch_state.iter = state["torch_iter"]
        self.torch_state.rng.set_state(state["torch_rng"])

    def check_options(self, o: dict) -> None:
        require_int(self.name, "rank", o["rank"], 1, " (the rank r of the P·Qᵀ approximation; 1-4 is typical)")
        for key in ("warm_start", "use_error_feedback"):
            require_bool(self.name, key, o[key])
        needs_two = o["warm_start"] or o["use_error_feedback"]
        why = " (torch needs >= 2 with warm_start or use_error_feedback: DDP rebuilds buckets after step 1)"
        require_int(self.name, "start_powerSGD_iter", o["start_powerSGD_iter"], 2 if needs_two else 0,
                    why if needs_two else "")
        if isinstance(o["min_compression_rate"], bool) or not isinstance(o["min_compression_rate"], (int, float)):
            raise ValueError(f"powersgd: min_compression_rate={o['min_compression_rate']!r} must be a number, e.g. 2")
        require_int(self.name, "seed", o["seed"], 0)

    def _allreduce(self, bucket_index: int, grad: torch.Tensor) -> torch.Tensor:
        state = self.state.setdefault(bucket_index, {"step": 0})
        step, state["step"] = state["step"], state["step"] + 1
        matrix = as_matrix(grad)
        rank = min(self.options["rank"], *matrix.shape)
        worth_it = sum(matrix.shape) * rank * self.options["min_compression_rate"] < matrix.numel()
        if step < self.options["start_powerSGD_iter"] or not worth_it:
            return self.all_reduce_sum(grad.clone()).div_(self.world)
        error = self.error_buffer(bucket_index, grad) if self.options["use_error_feedback"] else torch.zeros_like(grad)
        matrix = as_matrix(grad + error)
        q = state.get("q") if self.options["warm_start"] else None
        if q is None or q.shape != (matrix.shape[1], rank):  # cold start: the same noise on every rank
            generator = shared_generator(self.options["seed"], bucket_index, step)
            q = torch.randn(matrix.shape[1], rank, generator=generator).to(grad.dtype)
        p = orthonormalise(self.all_reduce_sum(matrix @ orthonormalise(q)))
        q = self.all_reduce_sum(matrix.T @ p).div_(self.world)
        state["q"] = q
        approx = (p @ q.T).flatten()[: grad.numel()]
        error.copy_(matrix.flatten()[: grad.numel()] - approx)  # what the projection missed, locally
        return approx

    def ddp_hook(self):
        """``(self, hook)``: torch's per-layer PowerSGD (``self.torch_state``), counted and serialised."""
        return self, powersgd_ddp_hook
