"""Offloading to CPU memory: which buckets are offloaded, and their streamed optimizer step."""
from .placement import OffloadPlacement, place_buckets
from .step import OffloadedStep

__all__ = ["OffloadPlacement", "OffloadedStep", "place_buckets"]
