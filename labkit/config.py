"""Typed run configuration: dataclasses, YAML loading, ``--set`` overrides, and the values derived from
them (device, backend, gradient accumulation, ``auto`` choices).

The flow is one way: ``load_config(path, overrides)`` → :class:`Config` →
``labkit.validation.validate(config, nproc)`` → ``launch``. Workers receive the resolved config as JSON.

This module holds the data and its loading. Types are checked here (a key that does not exist, a
value that is not one of the allowed ones, each with a did-you-mean); the rules of each subsystem
live with the subsystem and :mod:`labkit.validation` collects them. The allowed strategies and
compressors come from their registries.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from labkit.metrics.anomaly import AnomalyThresholds


class ConfigError(ValueError):
    """A configuration problem found before any worker started. ``problems`` lists each one."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid labkit config ({len(self.problems)} problem(s)):\n{lines}")


# ---------------------------------------------------------------- choices owned by registries
# A strategy or compressor is declared once, in its own module (labkit.registry), so the values of
# the keys that select one come from the registries. The annotations below are strings (``from
# __future__ import annotations``) that ``typing.get_type_hints`` evaluates each time a config is
# built from a dict: the registries load on first use, and an entry registered later is accepted.

def strategy_names() -> tuple[str, ...]:
    """``parallel.dp.strategy``'s values: the registered data-parallel strategies."""
    from labkit.parallel import STRATEGIES

    return STRATEGIES.names()


def strategy_choices() -> tuple[str, ...]:
    """``parallel.dp.strategy``'s values: ``auto`` (:func:`resolve_strategy`), then the registered strategies."""
    from labkit.parallel import spec

    return spec.strategy_choices()


def layout_choices(name: str) -> tuple[str, ...]:
    """``parallel.tp.impl``, ``parallel.pp.impl``, ``parallel.pp.schedule``, ``parallel.cp.impl`` and
    ``parallel.cp.layout``'s values (labkit.parallel.spec)."""
    from labkit.parallel import spec

    return getattr(spec, name)


def sync_names() -> tuple[str, ...]:
    """``comm.sync``'s values: ``every_step``, then the registered sync strategies (local SGD, DiLoCo)."""
    from labkit.parallel import sync_modes

    return sync_modes()


def compressor_names() -> tuple[str, ...]:
    """``comm.compression``'s values: the registered compressors (``none`` first)."""
    from labkit.comm.compress import COMPRESSORS

    return COMPRESSORS.names()


def collective_algorithm_names() -> tuple[str, ...]:
    """``comm.collective_algorithm``'s values: the emulated network's collective algorithms (labkit.comm.network)."""
    from labkit.comm.network import ALGORITHMS

    return tuple(ALGORITHMS)


@dataclass
class MoEConfig:  # labkit/model/moe.py; its ranges and what it combines with: labkit.model.moe.moe_problems
    experts: int = 0  # experts per MoE layer; 0: the dense GPT
    top_k: int = 2  # experts each token goes through
    capacity_factor: Optional[float] = 1.25  # an expert takes ⌈top_k·tokens/experts × this⌉; null: dropless
    balance: Literal["aux_loss", "loss_free", "none"] = "aux_loss"  # Switch's loss, or DeepSeek-V3's bias
    aux_loss_alpha: float = 0.01  # α of the auxiliary loss α·E·Σ fᵢ·Pᵢ
    bias_update: float = 0.001  # u: the loss-free bias's step after every optimizer step
    every: int = 1  # every N-th block's MLP is a mixture of experts (1: all)
    shared_expert: bool = False  # one more MLP that every token goes through (DeepSeek's shared expert)
    impl: Literal["grouped", "loop"] = "grouped"  # one grouped matmul for all experts, or a loop (the reference)


@dataclass
class ModelConfig:
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    block_size: int = 64
    dropout: float = 0.0
    bias: bool = False
    vocab_size: Optional[int] = None  # None: taken from the dataset's tokenizer
    freeze: list[str] = field(default_factory=list)  # parameter-name prefixes to freeze, e.g. ["wpe"]
    recompute: Literal["none", "selective", "full"] = "none"  # activation checkpointing
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixtures of experts in place of MLPs


@dataclass
class DataConfig:
    dataset: str = "markov"  # a shipped corpus name or a path to any text file
    tokenizer: Literal["char", "byte"] = "char"
    batch_size: int = 16  # global batch, in sequences, per optimizer step
    micro_batch_size: int = 8  # per rank, per forward/backward
    val_fraction: float = 0.1


@dataclass
class OptimConfig:
    name: Literal["adamw", "adam", "sgd", "adafactor"] = "adamw"
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class DataParallelConfig:
    degree: Union[int, Literal["auto"]] = "auto"  # "auto": world size / (tp * pp)
    strategy: Literal[strategy_choices()] = "torch_ddp"  # labkit/parallel/; auto: one that combines with tp and pp
    bucket_mb: float = 25.0
    # fsdp2 only: the ranks each shard group holds, HSDP's shard inside and replicate across: whole cp groups,
    # the mesh's dp_shard × cp (labkit.parallel.mesh); 0: every rank of dp (× cp) in one shard group, plain FSDP
    shard_degree: int = 0


@dataclass
class TensorParallelConfig:  # labkit/parallel/tp/layers.py; what combines with it: labkit/parallel/parallelize.py
    degree: int = 1  # ranks that split every layer's matrices (Megatron-LM)
    impl: Literal[layout_choices("TP_IMPLS")] = "labkit"  # labkit's own layers, or torch's DTensor parallelize_module
    sequence_parallel: bool = False  # also split layer-norm/dropout activations along the sequence


@dataclass
class PipelineParallelConfig:  # labkit/parallel/pp/pipeline.py; micro-batches per step = the gradient accumulation
    degree: int = 1  # stages the layers are cut into
    # all-forward-all-backward, one-forward-one-backward, or 1F1B over 2 interleaved stages per rank (see checks)
    schedule: Literal[layout_choices("PP_SCHEDULES")] = "1f1b"
    # labkit's send/recv schedules, or torch.distributed.pipelining
    impl: Literal[layout_choices("PP_IMPLS")] = "labkit"


@dataclass
class ContextParallelConfig:  # labkit/parallel/cp/; what combines with it: labkit/parallel/layout_checks.py
    degree: int = 1  # ranks that split every sequence (each holds its chunks; attention passes keys and values)
    # ring attention, all-gather KV (Llama 3), Ulysses all-to-all (DeepSpeed), or torch's context_parallel (CUDA)
    impl: Literal[layout_choices("CP_IMPLS")] = "ring"
    # head_tail: rank r holds chunks r and 2·cp−1−r (balanced causal work); contiguous: chunk r alone
    layout: Literal[layout_choices("CP_LAYOUTS")] = "head_tail"


@dataclass
class ExpertParallelConfig:  # labkit/parallel/ep/; its checks: labkit.parallel.ep.expert_parallel_problems
    degree: int = 1  # dp ranks that split each MoE layer's experts (tokens reach them by all-to-all); divides dp
    impl: Literal[layout_choices("EP_IMPLS")] = "labkit"  # labkit's all-to-all dispatch (labkit/parallel/ep/)


@dataclass
class ParallelConfig:
    dp: DataParallelConfig = field(default_factory=DataParallelConfig)
    tp: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pp: PipelineParallelConfig = field(default_factory=PipelineParallelConfig)
    cp: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    ep: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)


@dataclass
class PrecisionConfig:
    # auto: labkit.hardware.recommend(); fp8: torchao float8 on GPUs with compute capability >= 8.9 (labkit[fp8])
    mode: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "fp32"


@dataclass
class AttentionConfig:
    # auto: labkit.hardware.recommend(); labkit_triton and flash_attn need a CUDA GPU (see labkit.model.attention)
    backend: Literal["auto", "naive", "sdpa", "labkit_flash", "labkit_triton", "flash_attn"] = "sdpa"


@dataclass
class CommConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = 300.0
    # gradient compression (labkit/comm/compress/): what each bucket's all-reduce puts on the wire
    compression: Literal[compressor_names()] = "none"
    compression_ratio: float = 0.01  # topk / randomk: fraction of entries sent
    powersgd_rank: int = 2
    powersgd_start_iter: int = 2  # plain all-reduce before this step (>= 2 with warm start or error feedback)
    powersgd_warm_start: bool = True
    # a matrix goes dense unless its rank-r factors are this many times smaller: small full-rank ones
    # (a small vocabulary's embedding) lose most to a low-rank approximation and cost least to send
    powersgd_min_compression_rate: float = 2.0
    error_feedback: bool = True  # powersgd: keep what the projection missed for the next step
    # communication frequency (labkit/parallel/dp/local_sgd.py)
    sync: Literal[sync_names()] = "every_step"
    sync_every: int = 8  # H: steps between synchronisations for local_sgd / diloco
    outer_lr: float = 0.7  # DiLoCo's outer Nesterov step
    outer_momentum: float = 0.9
    # an emulated network (labkit/comm/network.py): each collective takes at least its algorithm's rounds·α + bytes/β
    latency_us: float = 0.0
    bandwidth_gbps: Optional[float] = None  # None: loopback as it is, not emulated
    collective_algorithm: Literal[collective_algorithm_names()] = "ring"  # ring: (p-1)·α per pass; tree: log2(p)·α
    # consistency models, the CAP lab (labkit/consistency/): None runs the regular trainer
    consistency: Optional[Literal["sync", "local_sgd", "ssp", "async"]] = None
    staleness: int = 2  # ssp: a worker may run at most s clocks ahead of the slowest; 0 is synchronous
    duration_s: Optional[float] = None  # wall-clock length of a consistency run (None: run.steps only)
    measure_every: int = 1  # steps between parameter snapshots (divergence between replicas)
    # network faults at labkit's communication layer (consistency runs)
    partition_rank: Optional[int] = None  # isolate this rank: its messages are held until the partition heals
    partition_start_s: float = 1.0  # seconds after the run starts
    partition_s: float = 0.0  # how long the partition lasts; 0: none
    slow_rank: Optional[int] = None  # a straggler: this rank computes slow_factor× slower
    slow_factor: float = 1.0


@dataclass
class FaultConfig:
    max_restarts: int = 0  # the elastic agent restarts the whole group after a failure, this many times
    # steps between checkpoints (labkit/fault/checkpoint.py); 0: none; auto: Young/Daly's √(2·δ·M) from the first
    # save's measured cost δ, the measured step time and fault.mtbf_s (labkit/fault/tolerance.py)
    checkpoint_every: Union[int, Literal["auto"]] = 0
    mtbf_s: float = 3600.0  # the mean time between failures checkpoint_every=auto plans for (seconds)
    checkpoint_dir: Optional[str] = None  # default RUN_DIR/checkpoints; a run resumes from its newest valid one
    keep_last: int = 2  # finished checkpoints kept on disk
    async_save: bool = False  # write in a background thread; training waits only for the copy to CPU
    # deliberate faults (labkit/fault/inject.py); each fires once: a restarted run passes its step unharmed
    inject: Literal["none", "crash", "hang", "straggler", "nan", "corrupt_checkpoint"] = "none"
    inject_rank: int = 1
    inject_step: int = 10
    straggler_ms: float = 100.0
    straggler_steps: int = 0  # steps a straggler stays slow; 0: to the end (a slow node stays slow)
    # a chaos soak (labkit/fault/chaos.py): a seeded stream of this many faults in one run (0: none), on random
    # ranks, the gaps exponential of mean chaos_every steps; a kill comes from outside (labkit.soak.run_chaos)
    chaos_faults: int = 0
    chaos_every: float = 20.0
    chaos_seed: int = 0
    chaos_kinds: list[str] = field(default_factory=lambda: ["all"])  # all: every kind (labkit.fault.chaos)
    # the timeout ladder (labkit/fault/checks.py): comm.timeout_s < watchdog_s < rendezvous_timeout_s
    watchdog_s: Optional[float] = None  # a rank that finishes no step for this long ends its attempt (None: off)
    rendezvous_timeout_s: float = 600.0  # how long ranks wait for each other to (re)join a group
    skip_steps: list[int] = field(default_factory=list)  # updates dropped on purpose (what the nan guard does)


@dataclass
class MetricsConfig:
    log_every: int = 1
    peak_tflops: Optional[float] = None  # override the peak used for MFU (per device)
    progress: bool = True
    # layer 3 (labkit/metrics/anomaly.py, diagnosis.py): alerts on rolling baselines, then a profile
    alerts: bool = True
    anomaly: AnomalyThresholds = field(default_factory=AnomalyThresholds)
    profile_steps: int = 3  # steps profiled after an alert (0: alerts only)
    max_diagnoses: int = 2  # profiles per run at most (traces are large)


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 1337
    steps: int = 100
    eval_every: int = 50  # 0 disables periodic evaluation
    eval_batches: int = 4
    # sequences each evaluation scores, whatever data.micro_batch_size and the data-parallel degree (they must
    # divide it); None: eval_batches micro-batches per data-parallel rank (so the set grows with either)
    eval_samples: Optional[int] = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads_per_proc: Union[int, Literal["auto"]] = "auto"
    runs_dir: str = "runs"
    save_final: bool = True  # write final_model.pt (rank 0) for inspection and tests
    compile: Literal["off", "on", "verify"] = "off"  # verify: time eager vs compiled steps, keep the faster


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **dotted: Any) -> "Config":
        """A copy with dotted keys changed: ``cfg.replace(**{"model.n_layer": 4})``."""
        return from_dict(apply_overrides(self.to_dict(), dotted))


# ---------------------------------------------------------------- building from dicts

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints are accepted as floats)."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            trial: list[str] = []
            out = _coerce(value, arg, key, trial)
            if not trial:
                return out
        problems.append(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{key}: expected a list, got {value!r}")
            return value
        (item_type,) = typing.get_args(tp)
        return [_coerce(item, item_type, f"{key}[{i}]", problems) for i, item in enumerate(value)]
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            near = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.append(f"{key}: {value!r} is not one of {', '.join(map(repr, allowed))}{hint}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            problems.append(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, problems)
    return value


def _build(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    if not isinstance(data, dict):
        problems.append(f"{prefix or 'config'}: expected a mapping of keys, got {data!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix + '.' if prefix else ''}{near[0]}'?" if near else ""
            problems.append(f"unknown key '{dotted}'{hint} (valid here: {', '.join(names)})")
            continue
        kwargs[key] = _coerce(value, hints[key], dotted, problems)
    return cls(**kwargs)


def from_dict(data: dict) -> Config:
    problems: list[str] = []
    cfg = _build(Config, data or {}, "", problems)
    if problems:
        raise ConfigError(problems)
    return cfg


# ---------------------------------------------------------------- YAML and --set

def parse_override(text: str) -> tuple[str, Any]:
    """``"model.n_layer=4"`` → ``("model.n_layer", 4)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError([f"override {text!r} must look like key=value, e.g. model.n_layer=4"])
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: dict, overrides: dict[str, Any]) -> dict:
    """Set dotted keys in a nested dict (a copy). Unknown keys are caught later by ``from_dict``."""
    data = json.loads(json.dumps(data))
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return data


def load_config(path: Union[str, Path, None] = None, overrides: Union[list[str], dict, None] = None) -> Config:
    """Load a YAML (or JSON) config file and apply ``key=value`` overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError([f"config file {str(path)!r} not found"])
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError([f"{path}: the top level must be a mapping of sections"])
    if isinstance(overrides, list):
        overrides = dict(parse_override(o) for o in overrides)
    return from_dict(apply_overrides(data, overrides or {}))


def save_config(cfg: Config, path: Union[str, Path]) -> None:
    """Atomically: another rank reading it sees the old file or the new one, never half of one."""
    from labkit.metrics.events import write_json

    write_json(path, cfg.to_dict())


# ---------------------------------------------------------------- values derived from the config and the machine

def cpu_count() -> int:
    """The cores this process may use: its CPU affinity, cut to its control group's quota
    (:func:`labkit.cpu.usable_cores`)."""
    from labkit.cpu import usable_cores

    return usable_cores()


def resolve_device(cfg: Config) -> str:
    import torch

    if cfg.run.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.run.device


def resolve_backend(cfg: Config) -> str:
    if cfg.comm.backend != "auto":
        return cfg.comm.backend
    return "nccl" if resolve_device(cfg) == "cuda" else "gloo"


def max_procs(device: str) -> int:
    """How many workers one machine supports: one per GPU, or two per CPU core on CPU.

    On CPU each worker gets at least one thread; more than two workers per core spends the
    run in context switches, so that is where labkit draws the line.
    """
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    return 2 * cpu_count()


def resolve_auto(cfg: Config) -> tuple[Config, dict[str, str]]:
    """Replace ``auto`` precision and attention by what ``labkit.hardware.recommend`` picks, and ``auto``'s
    data-parallel strategy by :func:`resolve_strategy`'s, with reasons (the start event's ``auto``)."""
    from labkit.hardware import recommend

    advice, chosen, reasons = recommend(), {}, {}
    for key, section in (("precision.mode", "precision"), ("attention.backend", "attention")):
        if _get(cfg.to_dict(), key) == "auto":
            value, why = advice[section]
            if key == "attention.backend" and _attention_problem(value, cfg):  # e.g. run.device=cpu on a GPU
                value, why = "sdpa", f"torch's fused attention ({advice[section][0]} cannot run here)"
            chosen[key], reasons[key] = value, f"auto → {value}: {why}"
    for key, value in chosen.items():
        cfg = with_value(cfg, key, value)
    cfg, why = resolve_strategy(cfg)
    return cfg, {**reasons, **({"parallel.dp.strategy": why} if why else {})}


def resolve_strategy(cfg: Config) -> tuple[Config, Optional[str]]:
    """Replace ``parallel.dp.strategy: auto`` by the first registered strategy that combines with the layout
    (:func:`labkit.parallel.layout_checks.auto_strategy`), with the reason; any other value is kept (reason None).
    A layout nothing combines with keeps ``auto``, and validation says so."""
    from labkit.parallel.layout_checks import auto_strategy
    from labkit.parallel.spec import AUTO

    if cfg.parallel.dp.strategy != AUTO:
        return cfg, None
    name, why = auto_strategy(cfg)
    return (cfg, None) if name is None else (with_value(cfg, "parallel.dp.strategy", name), f"{AUTO} → {name}: {why}")


def with_value(cfg: Any, dotted: str, value: Any) -> Any:
    """A copy of ``cfg`` with one key changed, without reading the config again (``value`` is known good)."""
    head, _, rest = dotted.partition(".")
    return dataclasses.replace(cfg, **{head: with_value(getattr(cfg, head), rest, value) if rest else value})


def _attention_problem(backend: str, cfg: Config) -> Optional[str]:
    """Why attention ``backend`` cannot run on this run's device (flash_attn, labkit_triton), or None."""
    from labkit.model.attention import backend_unavailable

    return backend_unavailable(backend, resolve_device(cfg))


def _get(data: dict, dotted: str):
    for part in dotted.split("."):
        data = data[part]
    return data


def data_parallel_degree(cfg: Config, world_size: int) -> int:
    """The number of data-parallel replicas (``dp: auto`` takes what tp and pp leave of the world)."""
    from labkit.parallel.mesh import ParallelDims

    return ParallelDims.from_config(cfg, world_size).dp


def eval_micro_batches(run: "RunConfig", micro_batch_size: int, dp: int) -> int:
    """Validation micro-batches each data-parallel rank scores per evaluation: ``run.eval_samples`` sequences split
    over ``dp`` ranks in micro-batches, else ``run.eval_batches``."""
    if run.eval_samples is None:
        return run.eval_batches
    return run.eval_samples // (micro_batch_size * dp)


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    """Micro-batches per rank per optimizer step: batch = dp × micro_batch × accumulation."""
    dp = data_parallel_degree(cfg, world_size)
    return cfg.data.batch_size // (dp * cfg.data.micro_batch_size)
