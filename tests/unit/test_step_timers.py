"""wall_clock_breakdown: phase times per optimizer step, whatever the print window and accumulation."""
import re
import time

from zeroengine.progress import StepTimers


def test_phase_times_are_per_optimizer_step():
    timers = StepTimers()
    for _ in range(4):  # 4 optimizer steps of 2 micro-steps, each forward ~10 ms
        for _ in range(2):
            timers.start("forward")
            time.sleep(0.01)
            timers.stop("forward")
        timers.start("step")
        timers.stop("step")
    line = timers.report_and_reset()
    forward = float(re.search(r"forward ([0-9.]+)ms", line).group(1))
    assert 19 <= forward < 40 and line.endswith("(per step)")  # 2 x 10 ms per step, not 80 ms for the window
    assert timers.steps == 0 and not timers.totals
