"""Offloading to CPU memory: the streamed optimizer step of offloaded ZeRO stages."""
from .step import OffloadedStep

__all__ = ["OffloadedStep"]
