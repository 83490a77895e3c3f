"""Offloading to CPU memory: which buckets are offloaded, and their streamed optimizer step."""
from .delayed import DelayedUpdate
from .placement import OffloadPlacement, place_buckets
from .step import OffloadedStep

__all__ = ["DelayedUpdate", "OffloadPlacement", "OffloadedStep", "place_buckets"]
