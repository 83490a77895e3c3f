"""``deepspeed.moe.layer``: ``MoE`` is zeroengine's :class:`zeroengine.moe.MoE` (DeepSpeed's signature; pass the
arguments after ``min_capacity`` by keyword, see docs/migrating-from-deepspeed.md)."""
from zeroengine.moe.layer import MoE

__all__ = ["MoE"]
