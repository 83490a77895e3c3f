"""``deepspeed.moe``: the MoE layer (``deepspeed.moe.layer.MoE``, zeroengine's; see docs/moe.md)."""
from . import layer  # noqa: F401
