"""Pipeline schedules: the order in which one stage runs forward (F) and backward (B) passes of micro-batches.

Both run every micro-batch forward then backward on every stage; they differ in how many micro-batches a
stage holds activations for at once:

* **GPipe** (Huang et al. 2019): all m forwards, then all m backwards; a stage holds m micro-batches.
* **1F1B** (PipeDream-Flush, Narayanan et al. 2021; DeepSpeed's and Megatron's default): stage s of p runs
  ``p - s - 1`` warm-up forwards, then alternates one forward and one backward, then drains; a stage holds
  at most ``p - s`` micro-batches.

Both idle each stage for the same pipeline fill and drain: with equal micro-batch times the bubble is
``(p - 1) / (m + p - 1)`` of the step. :func:`simulate` replays a schedule on unit times to show it.
Micro-batch i's forward on stage s needs i's forward on s-1; its backward needs i's backward on s+1 and
its own forward. With sends that do not block, any such order is free of deadlock.
"""
from __future__ import annotations

SCHEDULES = ("1f1b", "gpipe")


def gpipe(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(micro_batches - warmup, micro_batches)]
    return order


def schedule_for(name: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    if name == "gpipe":
        return gpipe(stage, stages, micro_batches)
    if name == "1f1b":
        return one_f_one_b(stage, stages, micro_batches)
    raise ValueError(f"pipeline schedule {name!r} is not one of {SCHEDULES}")


def max_in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward ran and backward did not, at once (activations held)."""
    live = peak = 0
    for op, _ in order:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(name: str, stages: int, micro_batches: int, forward_time: float = 1.0,
             backward_time: float = 2.0) -> dict:
    """Replay the schedule with fixed pass times and free communication: the step's makespan, each stage's
    busy time, and the bubble fraction (idle share of stages × makespan)."""
    orders = [schedule_for(name, s, stages, micro_batches) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * stages
    position = [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            op, i = orders[s][position[s]]
            needs = [("F", s - 1, i)] if op == "F" and s > 0 else []
            if op == "B":
                needs = [("F", s, i)] + ([("B", s + 1, i)] if s < stages - 1 else [])
            if any(n not in done for n in needs):
                continue
            start = max([clock[s]] + [done[n] for n in needs])
            clock[s] = start + (forward_time if op == "F" else backward_time)
            done[(op, s, i)] = clock[s]
            position[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name!r} deadlocks at {stages} stages, {micro_batches} micro-batches")
    makespan = max(clock)
    busy = micro_batches * (forward_time + backward_time)
    return {"makespan": makespan, "busy_per_stage": busy, "bubble": 1.0 - busy / makespan,
            "max_in_flight": [max_in_flight(o) for o in orders]}
