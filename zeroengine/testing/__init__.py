"""Helpers for zeroengine's own tests (and users' tests): multi-process harness, parity helpers."""
from .harness import DistributedTestError, free_port, run_distributed

__all__ = ["DistributedTestError", "free_port", "run_distributed"]
