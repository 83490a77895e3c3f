"""The ``closure`` argument of ``optimizer.step``, run as torch's optimizers run it.

Shared by the kernels' optimizers (ops) and the partition-aware ones (optim), so
the rule lives once: grad enabled inside a step that is itself ``no_grad``.
"""
from __future__ import annotations

from typing import Callable

import torch


def run_closure(closure: Callable[[], float] | None):
    """The loss from ``closure`` (with grad enabled, as torch optimizers do), if given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
