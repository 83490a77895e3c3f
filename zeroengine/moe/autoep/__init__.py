"""AutoEP: expert parallelism for the MoE blocks of Hugging Face models, from the ``expert_parallel`` config.

Each block keeps its router and shared experts; its experts module becomes a
:class:`ShardedExperts` (same call, same parameter names, this rank's experts
only) that sends tokens to the experts' ranks by all-to-all. See docs/moe.md.
"""
from .convert import Conversion, convert_moe_blocks
from .experts import ShardedExperts, swiglu_rows
from .presets import PRESETS, Preset, preset_for

__all__ = ["Conversion", "PRESETS", "Preset", "ShardedExperts", "convert_moe_blocks", "preset_for", "swiglu_rows"]
