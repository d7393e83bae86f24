"""Precision modes, chosen by ``precision.mode``.

Weights, gradients and optimizer state stay fp32 ("master weights"); only the forward and
backward math runs in lower precision under ``torch.autocast``. bf16 keeps fp32's exponent
range, so it needs no loss scaling; fp16 has a narrow range, so small gradients underflow to
zero unless the loss is scaled up first (``GradScaler``) — which is why fp16 needs a scaler.
Every step event records the scaler's ``loss_scale`` and whether it skipped the step (``overflow``).
fp8 (``torchao.float8``, GPUs with compute capability >= 8.9) runs the Linear layers' matmuls in
fp8 with per-tensor scales, inside bf16 autocast; :func:`prepare_model` converts the model.

The functions at the end are the notebook's (06): number formats from ``torch.finfo``, what a cast
does to small and large values, and loss scaling shown with tensors on the CPU.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Precision:
    mode: str
    device: str
    scaler: Optional[torch.amp.GradScaler] = None

    @property
    def peak_dtype(self) -> str:
        """Which column of the peak table MFU is measured against."""
        if self.mode == "fp32" and self.device == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            return "tf32"
        return self.mode

    def autocast(self):
        if self.mode == "fp32":
            return nullcontext()
        # fp8: the converted Linear layers do their matmuls in fp8; the rest of the model runs in bf16
        dtype = torch.float16 if self.mode == "fp16" else torch.bfloat16
        return torch.autocast(device_type=self.device, dtype=dtype)


def build_precision(cfg, device: str) -> Precision:
    mode = cfg.precision.mode
    if mode == "fp16" and device != "cuda":
        raise ValueError("precision.mode=fp16 needs a CUDA GPU; use bf16 or fp32 on CPU")
    if mode == "fp8":
        capability = torch.cuda.get_device_capability() if device == "cuda" else None
        problems = fp8_problems(device, capability)
        if problems:
            raise ValueError("; ".join(problems))
    scaler = torch.amp.GradScaler(device) if mode == "fp16" else None
    return Precision(mode=mode, device=device, scaler=scaler)


# ---------------------------------------------------------------- fp16: the loss scaler as metrics

def overflowed(scale_before: float, scale_after: float) -> bool:
    """Did the scaler skip this step? ``GradScaler.update()`` lowers the scale (× backoff_factor, 0.5)
    exactly when the step's gradients held an inf or NaN — and ``scaler.step`` then skipped the update.
    It never lowers the scale otherwise (it only grows it, after ``growth_interval`` clean steps)."""
    return scale_after < scale_before


def scaler_state(scaler: Optional[torch.amp.GradScaler], scale_before: Optional[float]) -> dict:
    """The two per-step metrics: ``loss_scale`` (None without a scaler) and ``overflow``."""
    if scaler is None or scale_before is None:
        return {"loss_scale": None, "overflow": False}
    after = float(scaler.get_scale())
    return {"loss_scale": after, "overflow": overflowed(scale_before, after)}


# ---------------------------------------------------------------- fp8 through torchao

FP8_MIN_CAPABILITY = (8, 9)  # Ada (L4, L40S, RTX 4090), Hopper (H100, H200), Blackwell: fp8 tensor cores
TORCHAO_MIN_VERSION = (0, 7)


def fp8_capable(capability: Optional[tuple[int, int]]) -> bool:
    """Whether a CUDA compute capability (major, minor) has fp8 tensor cores: sm_89 or newer."""
    return capability is not None and tuple(capability) >= FP8_MIN_CAPABILITY


def torchao_version() -> Optional[str]:
    """The installed torchao's version, or None (looked up without importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchao")
    except PackageNotFoundError:
        return None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def fp8_problems(device: str, capability: Optional[tuple[int, int]] = None, gpu_name: str = "",
                 torchao: Optional[str] = "unknown") -> list[str]:
    """Why ``precision.mode=fp8`` cannot run here (empty when it can), each with what to use instead.

    ``torchao`` is its installed version or None; ``"unknown"`` looks it up."""
    if torchao == "unknown":
        torchao = torchao_version()
    instead = "use precision.mode=bf16 instead (same range as fp32, no loss scaling)"
    if device != "cuda":
        return [f"precision.mode=fp8 needs an NVIDIA GPU with fp8 tensor cores (compute capability >= 8.9: "
                f"L4, L40S, RTX 4090, H100, H200, B200); this run is on {device.upper()}, which has no fp8 "
                f"arithmetic: {instead}"]
    problems = []
    if not fp8_capable(capability):
        sm = f"sm_{capability[0]}{capability[1]}" if capability else "an unknown compute capability"
        problems.append(f"precision.mode=fp8 needs compute capability >= 8.9 (fp8 tensor cores: Ada, Hopper, "
                        f"Blackwell); {gpu_name or 'this GPU'} is {sm}: {instead}")
    if torchao is None:
        problems.append("precision.mode=fp8 trains through torchao (torchao.float8), which is not installed: "
                        "pip install 'labkit[fp8]' (torchao>=0.7), or " + instead)
    elif _version_tuple(torchao) < TORCHAO_MIN_VERSION:
        problems.append(f"precision.mode=fp8 needs torchao>=0.7 (torchao.float8.convert_to_float8_training); "
                        f"torchao {torchao} is installed: pip install -U 'labkit[fp8]', or " + instead)
    return problems


def _fp8_filter(module: torch.nn.Module, fqn: str) -> bool:
    """Which Linear layers become fp8: not the output head (tied to the embedding, and the most
    precision-sensitive matmul), and only those whose dimensions are multiples of 16 (fp8 GEMM tiles)."""
    if fqn.split(".")[-1] == "lm_head" or not isinstance(module, torch.nn.Linear):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def prepare_model(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """Adapt the bare model to its precision before a strategy wraps it (fp8 only; others unchanged).

    fp8: torchao swaps each eligible ``nn.Linear`` for a ``Float8Linear``. Its weights stay fp32 (the
    master weights the optimizer updates); each forward casts the weight, the input and (in backward)
    the output gradient to fp8 with a per-tensor scale, multiplies on the fp8 tensor cores and returns
    the result in the autocast dtype (bf16). Everything else (embeddings, norms, softmax) runs in bf16.
    """
    if mode != "fp8":
        return model
    from torchao.float8 import convert_to_float8_training  # optional extra: labkit[fp8]

    return convert_to_float8_training(model, module_filter_fn=_fp8_filter)


def fp8_linear_count(model: torch.nn.Module) -> int:
    """How many layers run their matmuls in fp8 (0 for a model that was not converted)."""
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


# ---------------------------------------------------------------- notebook 06: formats and loss scaling

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "fp8 e4m3": torch.float8_e4m3fn, "fp8 e5m2": torch.float8_e5m2}
"""The formats of mixed-precision training. e4m3 (more precision) holds weights and activations in
fp8 training; e5m2 (more range) holds gradients. ``fn``: finite only, no inf (its top code is NaN)."""


def number_formats() -> list[dict]:
    """One row per format, from ``torch.finfo``: bits, exponent and mantissa bits, range, epsilon.

    A float is ±1.m × 2^e: the exponent bits set the range, the mantissa bits the precision. ``eps`` is
    the gap between 1 and the next number (2^-mantissa): the relative rounding error is at most eps/2.
    Below ``smallest_normal`` numbers lose precision (subnormals) down to ``smallest_subnormal``; below
    half of that they round to 0 (underflow). Above ``max`` they become inf (overflow).
    """
    rows = []
    for name, dtype in FORMATS.items():
        info = torch.finfo(dtype)
        mantissa = round(-math.log2(info.eps))
        rows.append({"name": name, "dtype": str(dtype).replace("torch.", ""), "bits": info.bits,
                     "exponent_bits": info.bits - 1 - mantissa, "mantissa_bits": mantissa,
                     "max": float(info.max), "smallest_normal": float(info.smallest_normal),
                     "smallest_subnormal": float(info.smallest_normal) * float(info.eps),
                     "eps": float(info.eps), "decimal_digits": (mantissa + 1) * math.log10(2)})
    return rows


def formats_table(rows: Optional[list[dict]] = None) -> str:
    """:func:`number_formats` as a printable table."""
    rows = rows or number_formats()
    head = (f"{'format':9s} {'bits':>4s} {'exp':>4s} {'mant':>4s} {'max':>10s} {'min normal':>11s} "
            f"{'min subnormal':>13s} {'eps':>9s} {'digits':>6s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['name']:9s} {r['bits']:4d} {r['exponent_bits']:4d} {r['mantissa_bits']:4d} "
                     f"{r['max']:10.3g} {r['smallest_normal']:11.3g} {r['smallest_subnormal']:13.3g} "
                     f"{r['eps']:9.3g} {r['decimal_digits']:6.1f}")
    return "\n".join(lines)


def round_trip(values, formats=("bf16", "fp16", "fp8 e4m3", "fp8 e5m2")) -> list[dict]:
    """What storing each fp32 value in each format gives back: ``{"value": v, "fp16": ..., ...}``.

    0.0 for an underflow, inf for an overflow. torch's cast to fp8 e4m3fn saturates at ±448 instead
    (the format has no inf) — which is why fp8 training scales each tensor before casting it.
    """
    x = torch.tensor([float(v) for v in values], dtype=torch.float32)
    out = {name: x.to(FORMATS[name]).float().tolist() for name in formats}
    return [{"value": float(v), **{name: out[name][i] for name in formats}} for i, v in enumerate(x.tolist())]


def log_uniform_gradients(n: int = 100_000, low: float = 1e-12, high: float = 1e-2, seed: int = 0) -> torch.Tensor:
    """Gradient-like fp32 values: magnitudes spread evenly over many orders of magnitude, random signs.
    Real gradients look like this: most entries are tiny, a few are large."""
    g = torch.Generator().manual_seed(seed)
    exponent = math.log10(low) + (math.log10(high) - math.log10(low)) * torch.rand(n, generator=g)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return sign * 10.0 ** exponent


def scaled_round_trip(grads: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float16) -> dict:
    """A loss scaler's trick on gradients held in ``dtype``: multiply by ``scale``, store, divide again.

    Returns the stored-and-unscaled values and what was lost: ``zero_frac`` (nonzero gradients that
    underflowed to 0), ``inf`` (entries that overflowed: a scaler would skip this step and halve the
    scale) and ``median_rel_error`` over the entries that survived.
    """
    grads = grads.float()
    back = (grads * scale).to(dtype).float() / scale
    nonzero = grads != 0
    finite = torch.isfinite(back)
    survived = nonzero & finite & (back != 0)
    rel = ((back - grads).abs() / grads.abs())[survived]
    return {"scale": float(scale), "values": back,
            "zero_frac": float(((back == 0) & nonzero).sum()) / max(int(nonzero.sum()), 1),
            "inf": int((~finite).sum()), "median_rel_error": float(rel.median()) if rel.numel() else float("nan")}


def scaler_trajectory(steps: int = 16, spike_steps=(9,), init_scale: float = 2.0**16, growth_interval: int = 3,
                      spike: float = 1e4, seed: int = 0) -> list[dict]:
    """A real ``torch.amp.GradScaler`` on the CPU, under fp16 autocast, on a small linear model.

    Each step: ``scaler.scale(loss).backward()``, ``scaler.step`` (skipped when a gradient is inf or
    NaN), ``scaler.update()``. At ``spike_steps`` the input is multiplied by ``spike``, like a loss
    spike in a real run: the scaled gradients overflow fp16's 65504 and become inf. Returns one row per step with the
    trainer's metrics (``loss_scale``, ``overflow`` from :func:`scaler_state`) and whether the weights
    changed — they change exactly on the steps that did not overflow.
    (CPU fp16 here only shows the mechanism; labkit's training refuses fp16 on CPU: it is slow there.)
    """
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.copy_(torch.randn(64, 64, generator=gen) / 8)
        model.bias.zero_()
    target = torch.randn(64, 64, generator=gen) / 8
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    rows = []
    for step in range(steps):
        x = torch.randn(32, 64, generator=gen) * (spike if step in spike_steps else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            y = model(x)
        loss = ((y.float() - x @ target) ** 2).mean()
        before_w = model.weight.detach().clone()
        scale_before = float(scaler.get_scale())
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        rows.append({"step": step, "loss": float(loss.detach()), "spike": step in spike_steps,
                     "scale_before": scale_before, **scaler_state(scaler, scale_before),
                     "weights_changed": not torch.equal(before_w, model.weight.detach())})
    return rows


def comparison_rows(results: dict[str, dict]) -> list[dict]:
    """Per mode: steady-state tokens/s, its ratio to the first mode's, final train loss, validation loss.

    ``results`` maps a mode to ``{"summary": ...}`` (what ``labkit.widgets.precision.compare_precisions``
    returns: one real run per mode)."""
    base = None
    rows = []
    for mode, r in results.items():
        s = r["summary"]
        base = base or s["tokens_per_s"]
        rows.append({"mode": mode, "tokens_per_s": s["tokens_per_s"], "speedup": s["tokens_per_s"] / base,
                     "final_loss": s["final_loss"], "val_loss": s.get("val_loss"),
                     "overflow_steps": s.get("overflow_steps", 0)})
    return rows


def precision_problems(mode: str, device: str) -> list[str]:
    """Why ``precision.mode`` cannot run on this run's device, said before any worker starts."""
    problems = []
    if mode == "fp16" and device == "cpu":
        problems.append("precision.mode=fp16 needs a CUDA GPU (fp16 matmuls on CPU are impractically slow); "
                        "use precision.mode=bf16 or fp32 on CPU")
    if mode == "fp8":
        if device != "cuda":
            problems += fp8_problems(device)
        elif torch.cuda.is_available():  # otherwise already said: run.device=cuda but no CUDA GPU is visible
            problems += fp8_problems(device, torch.cuda.get_device_capability(), torch.cuda.get_device_name())
    return problems
