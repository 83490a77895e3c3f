"""Features the config can describe but this build cannot run yet.

The config schema is DeepSpeed's whole contract, and some of it (parameter offload)
lands in later
work. A user who asks for one of those must hear so before training starts,
not discover it as an out-of-memory or a missing log: numerics-changing or
memory-changing features are refused with a ConfigError; pure performance
knobs that are accepted but not yet honoured are named in one warning.
Delete a line here when its feature lands.
"""
from __future__ import annotations

from zeroengine.config import ConfigError


def check_supported(cfg) -> None:
    zero = cfg.zero_optimization
    if zero.offload_param is not None:
        raise ConfigError("zero_optimization.offload_param",
                          "parameter offload is not implemented in this build yet; remove the block "
                          "(or set its device to \"none\")")
