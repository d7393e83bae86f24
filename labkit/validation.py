"""Is this configuration runnable here? Said before any worker starts, every problem at once.

A distributed run fails expensively: every worker has to start, import torch and join a process group
before a typo in a key can bite. So labkit checks the whole configuration *before* any process starts,
and every error names the key and the fix: ``validate(cfg, nproc)`` raises one
:class:`~labkit.config.ConfigError` listing each problem.

Each part of labkit checks its own keys, next to its code; this module only collects them:

===========================================  ===============================================
where                                        what it checks
===========================================  ===============================================
here (:func:`config_problems`)               the model shape, batch, optimizer and run ranges
:func:`labkit.parallel.mesh.grid_problems`   dp × pp × tp = world size; the batch split
here (:func:`machine_problems`)              device, backend, processes this machine can host
:func:`labkit.parallel.layout_checks.       what tp and pp need of the model; which dp
layout_problems`                             strategies and settings combine with them
``labkit.precision``, ``model.attention``,   their modes and kernels on this device; compile
``labkit.compile``                           verification's steps
the registries (``labkit.registry``)         every strategy, compressor and sync strategy its
                                             own keys and what it combines with
``comm.network``, ``fault.checks``,          the emulated network, faults and checkpoints, the
``consistency.checks``, ``metrics.anomaly``  CAP lab, the alert thresholds
``labkit.data``                              that the dataset exists
``labkit.model.moe``                         ``model.moe``'s ranges; the layouts it does not
                                             combine with yet
===========================================  ===============================================
"""
from __future__ import annotations

from typing import Any

from labkit.config import (Config, ConfigError, cpu_count, data_parallel_degree, max_procs, resolve_backend,
                           resolve_device, resolve_strategy)


def parameter_names(n_layer: int, moe=None) -> list[str]:
    """The GPT's parameter names (they depend on the depth and the experts only), from a one-wide model."""
    from labkit.model import GPT, GPTShape
    from labkit.model.moe import MoEShape

    return [n for n, _ in
            GPT(GPTShape(vocab_size=2, block_size=1, n_layer=n_layer, n_head=1, n_embd=1,
                         moe=MoEShape.from_config(moe))).named_parameters()]


def config_problems(cfg: Config, nproc: int) -> list[str]:
    """The config's own ranges: model shape, batch, optimizer, run, and settings no subsystem owns."""
    problems: list[str] = []
    m, d = cfg.model, cfg.data

    def positive(key: str, value: Any) -> None:
        if isinstance(value, (int, float)) and value <= 0:
            problems.append(f"{key}: must be > 0, got {value}")

    for key, value in [("model.n_layer", m.n_layer), ("model.n_head", m.n_head), ("model.n_embd", m.n_embd),
                       ("model.block_size", m.block_size), ("data.batch_size", d.batch_size),
                       ("data.micro_batch_size", d.micro_batch_size), ("run.steps", cfg.run.steps),
                       ("optim.lr", cfg.optim.lr), ("metrics.log_every", cfg.metrics.log_every)]:
        positive(key, value)
    if nproc < 1:
        problems.append(f"nproc: must be >= 1, got {nproc}")
    if m.n_head > 0 and m.n_embd % m.n_head:
        problems.append(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}; "
                        f"pick n_embd as a multiple of n_head (e.g. {m.n_head * max(1, m.n_embd // m.n_head)})")
    for key, beta in (("optim.beta1", cfg.optim.beta1), ("optim.beta2", cfg.optim.beta2)):
        if not 0 <= beta < 1:
            problems.append(f"{key}: must be in [0, 1), got {beta}; the defaults are 0.9 and 0.95")
    if cfg.optim.weight_decay < 0:
        problems.append(f"optim.weight_decay: must be >= 0 (0 turns decay off), got {cfg.optim.weight_decay}")
    if cfg.optim.warmup_steps < 0:
        problems.append(f"optim.warmup_steps: must be >= 0 (0 starts at the peak learning rate), "
                        f"got {cfg.optim.warmup_steps}")
    if not 0 <= m.dropout < 1:
        problems.append(f"model.dropout: must be in [0, 1), got {m.dropout}")
    if not 0 < d.val_fraction < 1:
        problems.append(f"data.val_fraction: must be in (0, 1), got {d.val_fraction}")
    if m.freeze:
        names = parameter_names(m.n_layer, m.moe)
        for prefix in m.freeze:
            if not any(n.startswith(prefix) for n in names):
                problems.append(f"model.freeze: {prefix!r} matches no parameter; names start with: "
                                f"{', '.join(sorted({n.rsplit('.', 1)[0] for n in names})[:12])}, ...")
        if all(any(n.startswith(f) for f in m.freeze) for n in names):
            problems.append("model.freeze freezes every parameter: nothing would train")
    if cfg.metrics.profile_steps < 0 or cfg.metrics.max_diagnoses < 0:
        problems.append("metrics.profile_steps and metrics.max_diagnoses: must be >= 0 (0 disables profiling)")
    samples = cfg.run.eval_samples
    if samples is not None:
        dp = data_parallel_degree(cfg, nproc) if nproc >= 1 else 1
        per_batch = d.micro_batch_size * dp
        if samples < 1 or (per_batch > 0 and samples % per_batch):
            problems.append(f"run.eval_samples={samples}: must be a positive multiple of data.micro_batch_size × the "
                            f"data-parallel degree = {d.micro_batch_size} × {dp} = {per_batch}, so every rank scores "
                            "whole micro-batches of the same sequences")
    threads = cfg.run.threads_per_proc
    if threads != "auto" and threads < 1:
        problems.append(f"run.threads_per_proc: must be >= 1 or 'auto', got {threads}")
    return problems



def machine_problems(cfg: Config, nproc: int) -> list[str]:
    """What this machine cannot run: the device, the backend, the number of processes."""
    problems: list[str] = []
    if cfg.comm.consistency is not None and cfg.comm.backend != "nccl":  # the CAP lab runs on the CPU, over gloo
        from labkit.consistency.lab import cap_config

        cfg = cap_config(cfg)
    device, backend = resolve_device(cfg), resolve_backend(cfg)
    if device == "cpu" and backend == "nccl":
        problems.append("comm.backend=nccl needs CUDA GPUs; on CPU use comm.backend=gloo (or auto)")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            problems.append("run.device=cuda but no CUDA GPU is visible; use run.device=auto or cpu")
    limit = max_procs(device)
    if nproc > limit and not (device == "cpu" and nproc <= oversubscribed_limit(cfg)):
        why = (f"{limit} visible GPU(s)" if device == "cuda"
               else f"{cpu_count()} CPU core(s) → at most {limit} processes, or {OVERSUBSCRIBE_PER_CORE} per core "
                    f"for a model under {SMALL_MODEL_PARAMS / 1e6:g} M parameters")
        problems.append(f"nproc={nproc} is more than this machine supports for backend {backend} ({why}); "
                        f"use --nproc {max(limit, 1)} or fewer")
    return problems


SMALL_MODEL_PARAMS = 2_000_000  # a model this small is cheap to replicate: the cost of more processes is time
OVERSUBSCRIBE_PER_CORE = 4


def oversubscribed_limit(cfg: Config) -> int:
    """Processes a CPU may host beyond two per core: four per core, for a small model only."""
    from labkit.memory_estimate import gpt_param_count
    from labkit.model.flops import moe_layer_params
    from labkit.model.moe import MoEShape
    from labkit.parallel.layout_checks import vocab_size_of

    m = cfg.model
    params = gpt_param_count(m.n_layer, m.n_embd, vocab_size_of(cfg) or 256, m.block_size)
    moe = MoEShape.from_config(m.moe)  # every expert is held: memory counts them all
    params += moe.layers(m.n_layer) * moe_layer_params(moe, m.n_embd, m.bias)[0] if moe else 0
    return OVERSUBSCRIBE_PER_CORE * cpu_count() if params <= SMALL_MODEL_PARAMS else max_procs("cpu")


def machine_warnings(cfg: Config, nproc: int) -> list[str]:
    """What runs here but costs: more processes than two per CPU core (said at launch, kept in launch.json)."""
    if resolve_device(cfg) != "cpu" or nproc <= max_procs("cpu"):
        return []
    cores = cpu_count()
    return [f"nproc={nproc} on {cores} CPU core(s): {nproc / cores:g} processes per core share each core in turn, "
            f"so a step takes about {nproc / max_procs('cpu'):g}× as long as with {max_procs('cpu')} processes "
            "and timings are mostly waiting for a core; use it to see a layout work, not to time it"]


def validate(cfg: Config, nproc: int = 1, nnodes: int = 1, check_data: bool = True) -> None:
    """Raise :class:`ConfigError` listing every problem, before any worker starts.

    Each part of labkit checks its own keys; this only collects. The registries ask every strategy,
    compressor and sync strategy (:mod:`labkit.registry`), so a new one brings its own checks. A
    ``parallel.dp.strategy`` of ``auto`` is checked as the strategy it resolves to (``config.resolve_strategy``).
    """
    from labkit.comm.compress import COMPRESSORS
    from labkit.comm.network import network_problems
    from labkit.consistency.checks import consistency_problems
    from labkit.compile import compile_problems
    from labkit.fault.checks import fault_problems
    from labkit.metrics.anomaly import threshold_problems
    from labkit.model.attention import attention_problems
    from labkit.model.moe import moe_problems
    from labkit.parallel import STRATEGIES, SYNC_STRATEGIES
    from labkit.parallel.ep.checks import expert_parallel_problems
    from labkit.parallel.mesh import grid_problems
    from labkit.parallel.layout_checks import layout_problems
    from labkit.precision import precision_problems

    world = nproc * nnodes
    cfg, _ = resolve_strategy(cfg)  # parallel.dp.strategy=auto: every check below sees the strategy that will run
    device = resolve_device(cfg)
    problems = config_problems(cfg, nproc)
    problems += grid_problems(cfg, world, nproc, nnodes)
    problems += layout_problems(cfg, world)
    problems += machine_problems(cfg, nproc)
    problems += precision_problems(cfg.precision.mode, device)
    problems += attention_problems(cfg.attention.backend, device)
    problems += moe_problems(cfg)
    problems += expert_parallel_problems(cfg, world)
    problems += compile_problems(cfg.run)
    problems += STRATEGIES.problems(cfg, world)
    problems += network_problems(cfg.comm)
    problems += COMPRESSORS.problems(cfg, world)
    problems += SYNC_STRATEGIES.problems(cfg, world)
    problems += fault_problems(cfg.fault, world, cfg.run.steps, cfg.comm.timeout_s)
    problems += consistency_problems(cfg.comm, world)
    problems += threshold_problems(cfg.metrics.anomaly)
    if check_data:
        from labkit.data import DatasetNotFoundError, resolve_dataset

        try:
            resolve_dataset(cfg.data.dataset)
        except DatasetNotFoundError as e:
            problems.append(f"data.dataset: {e}")
    if problems:
        raise ConfigError(problems)
