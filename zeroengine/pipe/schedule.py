"""Pipeline schedules: the order in which one stage runs forward (F) and backward (B) passes of micro-batches.

An order is a list of ``(op, chunk, micro_batch)``. Every micro-batch runs forward then backward on every
stage; schedules differ in how many micro-batches a stage holds activations for at once, and in its idle time:

* **GPipe** (Huang et al. 2019): all m forwards, then all m backwards; a stage holds m micro-batches.
* **1F1B** (PipeDream-Flush, Narayanan et al. 2021; DeepSpeed's and Megatron's default): stage s of p runs
  ``p - s - 1`` warm-up forwards, then alternates one forward and one backward, then drains; a stage holds
  at most ``p - s`` micro-batches.
* **Interleaved 1F1B** (Megatron-LM's virtual pipeline, Narayanan et al. 2021 §2.2): each rank holds v model
  chunks (rank s runs virtual stages s, s + p, ..., s + (v-1)p), so a micro-batch crosses the ranks v times
  in passes v times shorter. Forwards go in groups of p micro-batches per chunk; a longer warm-up,
  ``2(p - s - 1) + (v - 1)p`` chunk-passes, keeps the steady state free of waits. Needs m divisible by p.

GPipe and 1F1B idle each stage for the same fill and drain: with equal pass times the bubble is
``(p - 1) / (m + p - 1)`` of the step. Interleaving divides the fill and drain by v:
``(p - 1) / (v·m + p - 1)``, at the price of v times the point-to-point messages and more chunk-passes held.
:func:`simulate` replays a schedule on unit times to show it. A pass of virtual stage k needs the forward of
k-1 (forward) or the backward of k+1 and its own forward (backward); with sends that do not block, any
order consistent with that is free of deadlock (``simulate`` checks it).
"""
from __future__ import annotations

SCHEDULES = ("1f1b", "gpipe", "interleaved")

Order = list[tuple[str, int, int]]  # (op "F" / "B", model chunk, micro-batch)


def gpipe(stage: int, stages: int, micro_batches: int) -> Order:
    return [("F", 0, i) for i in range(micro_batches)] + [("B", 0, i) for i in range(micro_batches)]


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> Order:
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", 0, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [("F", 0, warmup + i), ("B", 0, i)]
    order += [("B", 0, i) for i in range(micro_batches - warmup, micro_batches)]
    return order


def _chunk_pass(k: int, stages: int, chunks: int, backward: bool) -> tuple[int, int]:
    """The (chunk, micro-batch) of a rank's k-th forward (or backward) pass: p micro-batches through chunk 0,
    the same p through chunk 1, ... then the next p micro-batches; backwards take the chunks last to first."""
    group, within = divmod(k, stages * chunks)
    chunk = within // stages
    return (chunks - 1 - chunk if backward else chunk), group * stages + within % stages


def interleaved(stage: int, stages: int, micro_batches: int, chunks: int) -> Order:
    if micro_batches % stages:
        raise ValueError(f"the interleaved schedule needs the micro-batches per step ({micro_batches}) to be a "
                         f"multiple of the pipeline stages ({stages})")
    total = micro_batches * chunks
    warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    forwards = [("F", *_chunk_pass(k, stages, chunks, False)) for k in range(total)]
    backwards = [("B", *_chunk_pass(k, stages, chunks, True)) for k in range(total)]
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup:]


def schedule_for(name: str, stage: int, stages: int, micro_batches: int, chunks: int = 1) -> Order:
    """Stage ``stage``'s order. ``chunks`` > 1 (model chunks per rank) runs the interleaved schedule, which
    ``name`` must allow: "interleaved", or "1f1b" (its non-interleaved form)."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is not one of {SCHEDULES}")
    if chunks > 1:
        if name == "gpipe":
            raise ValueError("the gpipe schedule runs one model chunk per stage; with virtual stages use "
                             "\"interleaved\" (or \"1f1b\")")
        return interleaved(stage, stages, micro_batches, chunks)
    if name == "interleaved":
        raise ValueError("the interleaved schedule needs more than one model chunk per stage: build the "
                         "PipelineModule with virtual_stages > 1")
    return gpipe(stage, stages, micro_batches) if name == "gpipe" else one_f_one_b(stage, stages, micro_batches)


def max_in_flight(order: Order) -> int:
    """The most chunk-passes whose forward ran and backward did not, at once (activations held). Without
    interleaving a chunk-pass is a micro-batch through the whole stage; interleaved, through 1/v of it."""
    live = peak = 0
    for op, *_ in order:
        live += 1 if op == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(name: str, stages: int, micro_batches: int, forward_time: float = 1.0,
             backward_time: float = 2.0, chunks: int = 1) -> dict:
    """Replay the schedule with fixed pass times (of a whole stage: a chunk takes 1/chunks of them) and free
    communication: the step's makespan, each stage's busy time, and the bubble fraction (idle share of
    stages × makespan). Raises if the orders deadlock."""
    orders = [schedule_for(name, s, stages, micro_batches, chunks) for s in range(stages)]
    last_virtual = stages * chunks - 1
    done: dict[tuple[str, int, int], float] = {}  # (op, virtual stage, micro-batch) -> finish time
    clock = [0.0] * stages
    position = [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            op, chunk, i = orders[s][position[s]]
            virtual = chunk * stages + s
            if op == "F":
                needs = [("F", virtual - 1, i)] if virtual > 0 else []
            else:
                needs = [("F", virtual, i)] + ([("B", virtual + 1, i)] if virtual < last_virtual else [])
            if any(n not in done for n in needs):
                continue
            start = max([clock[s]] + [done[n] for n in needs])
            clock[s] = start + (forward_time if op == "F" else backward_time) / chunks
            done[(op, virtual, i)] = clock[s]
            position[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name!r} deadlocks at {stages} stages, {micro_batches} micro-batches"
                               + (f", {chunks} chunks" if chunks > 1 else ""))
    makespan = max(clock)
    busy = micro_batches * (forward_time + backward_time)
    return {"makespan": makespan, "busy_per_stage": busy, "bubble": 1.0 - busy / makespan,
            "max_in_flight": [max_in_flight(o) for o in orders]}
