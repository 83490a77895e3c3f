"""ZeRO stages: one strategy object per stage, built by :func:`factory.build_zero_optimizer`.

Public: ``GatheredParameters`` (full stage-3 parameters inside a ``with`` block).
"""
from .gathered import GatheredParameters

__all__ = ["GatheredParameters"]
