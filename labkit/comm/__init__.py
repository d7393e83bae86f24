"""The communication layer: collectives (counted, timed, optionally over an emulated network),
bookkeeping between ranks that is not training traffic (:mod:`labkit.comm.control`: uncounted, untimed)
and gradient compressors. (Communicating less often — local SGD, DiLoCo — is a data-parallel
strategy: :mod:`labkit.parallel.dp.local_sgd`.)"""
from labkit.comm.collectives import timed_allreduce_hook


def compressor_from_config(cfg, timer, group=None):
    """The compressor ``comm.compression`` names, with its options from the config, averaging over
    ``group`` (the data-parallel group; None: the world); None for "none"."""
    name = cfg.comm.compression
    if name == "none":
        return None
    from labkit.comm.compress import COMPRESSORS, build_compressor

    return build_compressor(name, timer=timer, group=group, **COMPRESSORS.get(name).options_from_config(cfg))


__all__ = ["timed_allreduce_hook", "compressor_from_config"]
