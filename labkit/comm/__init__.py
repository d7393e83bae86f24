"""The communication layer: collectives (counted, timed, optionally over an emulated network),
gradient compressors, and periodic synchronisation."""
from labkit.comm.collectives import timed_allreduce_hook


def compressor_from_config(cfg, timer):
    """The compressor ``comm.compression`` names, with its options from the config; None for "none"."""
    name = cfg.comm.compression
    if name == "none":
        return None
    from labkit.comm.compress import build_compressor

    options = {"topk": {"ratio": cfg.comm.compression_ratio},
               "randomk": {"ratio": cfg.comm.compression_ratio, "seed": cfg.run.seed},
               "powersgd": {"rank": cfg.comm.powersgd_rank, "start_powerSGD_iter": cfg.comm.powersgd_start_iter,
                            "warm_start": cfg.comm.powersgd_warm_start, "use_error_feedback": cfg.comm.error_feedback,
                            "min_compression_rate": cfg.comm.powersgd_min_compression_rate, "seed": cfg.run.seed}}.get(name, {})
    return build_compressor(name, timer=timer, **options)


__all__ = ["timed_allreduce_hook", "compressor_from_config"]
