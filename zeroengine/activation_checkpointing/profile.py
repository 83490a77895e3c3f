"""``profile``: time spent in each checkpointed segment's forward and recompute.

Segments are named by what was checkpointed (a wrapped module's path such as
``blocks.3``, or the function's qualified name). With
``synchronize_checkpoint_boundary`` the accelerator is synchronized at each
boundary, so the times measure the segment's kernels rather than their launch.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch


@dataclass
class SegmentTimes:
    forward_calls: int = 0
    forward_s: float = 0.0
    recompute_calls: int = 0
    recompute_s: float = 0.0


_TIMES: dict[str, SegmentTimes] = defaultdict(SegmentTimes)


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(name: str, phase: str, enabled: bool, sync: bool):
    if sync:
        synchronize()
    start = time.perf_counter() if enabled else 0.0
    try:
        yield
    finally:
        if sync:
            synchronize()
        if enabled:
            record = _TIMES[name]
            setattr(record, f"{phase}_calls", getattr(record, f"{phase}_calls") + 1)
            setattr(record, f"{phase}_s", getattr(record, f"{phase}_s") + time.perf_counter() - start)


def profile_report() -> dict[str, dict]:
    """``{segment: {forward_calls, forward_s, recompute_calls, recompute_s}}`` since the last reset."""
    return {name: dict(vars(t)) for name, t in _TIMES.items()}


def format_profile() -> str:
    lines = [f"{'segment':<32} {'fwd calls':>9} {'fwd ms':>10} {'recompute calls':>15} {'recompute ms':>12}"]
    for name, t in sorted(_TIMES.items()):
        lines.append(f"{name:<32} {t.forward_calls:>9} {1e3 * t.forward_s:>10.2f} {t.recompute_calls:>15} "
                     f"{1e3 * t.recompute_s:>12.2f}")
    return "\n".join(lines)


def reset_profile() -> None:
    _TIMES.clear()
