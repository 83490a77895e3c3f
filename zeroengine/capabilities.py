"""Features the config can describe but this build cannot run yet.

The config schema is DeepSpeed's whole contract, and some of it (parameter offload,
monitors, stage-3 tuning) lands in later
work. A user who asks for one of those must hear so before training starts,
not discover it as an out-of-memory or a missing log: numerics-changing or
memory-changing features are refused with a ConfigError; pure performance
knobs that are accepted but not yet honoured are named in one warning.
Delete a line here when its feature lands.
"""
from __future__ import annotations

import warnings

from zeroengine.config import ConfigError

_STAGE3_TUNING_DEFAULTS = {
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
}


def check_supported(cfg) -> None:
    zero = cfg.zero_optimization
    if zero.offload_param is not None:
        raise ConfigError("zero_optimization.offload_param",
                          "parameter offload is not implemented in this build yet; remove the block "
                          "(or set its device to \"none\")")
    if cfg.monitor.enabled:
        raise ConfigError("monitor", "the CSV / TensorBoard monitors are not implemented in this build yet; "
                          "set their 'enabled' to false")
    if zero.stage == 3:
        tuned = [k for k, default in _STAGE3_TUNING_DEFAULTS.items() if getattr(zero, k) != default]
        if tuned:
            warnings.warn(f"zero_optimization.{', '.join(tuned)}: accepted but not yet honoured by this build's "
                          "stage 3 (it gathers each module's parameters just in time, without prefetch, and "
                          "partitions every trainable parameter); numerics are unaffected", stacklevel=3)
