"""zeroengine.zero.host_memory: stage 3's CPU gather buffers give their pages back, and glibc's mmap threshold
policy (opt-in, fixed once, the user's own setting respected, a bad value named)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroengine.zero import host_memory


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc to read resident memory")
def test_dropped_pages_leave_resident_memory_and_read_as_zeros_until_written_again():
    t = torch.empty(16 << 20)  # 64 MiB
    assert host_memory.can_drop_pages(t)
    t.fill_(3.0)
    before = _rss()
    released = host_memory.drop_pages(t)
    after = _rss()
    assert released >= (64 << 20) - 2 * 4096
    assert before - after >= 60 << 20, (before, after)
    # the storage is still valid memory: fresh zero pages, except the partial pages at its two ends
    assert torch.count_nonzero(t) <= 2 * 4096 // t.element_size()
    assert torch.count_nonzero(t[4096:-4096]) == 0
    t.fill_(5.0)  # and usable again, as a re-gather writes it
    assert torch.all(t == 5.0)


def test_a_tensor_smaller_than_a_page_releases_nothing_and_stays_intact():
    t = torch.full((16,), 7.0)
    assert host_memory.drop_pages(t) == 0
    assert torch.all(t == 7.0)


def _policy(env: dict) -> subprocess.CompletedProcess:
    code = "from zeroengine.zero import host_memory as h; print(h.map_large_allocations()); print(h.map_large_allocations())"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "ZEROENGINE_MALLOC"))}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_mmap_threshold_is_opt_in_fixed_once_and_leaves_a_users_own_choice_alone():
    default = _policy({})
    assert default.returncode == 0, default.stderr
    assert default.stdout.split() == ["None"] * 2  # off unless asked: it costs page faults
    assert _policy({"ZEROENGINE_MALLOC_MMAP_THRESHOLD": "1048576"}).stdout.split() == ["1048576"] * 2
    assert _policy({"MALLOC_MMAP_THRESHOLD_": "65536"}).stdout.split() == ["None"] * 2
    bad = _policy({"ZEROENGINE_MALLOC_MMAP_THRESHOLD": "1MiB"})
    assert bad.returncode != 0 and "ZEROENGINE_MALLOC_MMAP_THRESHOLD must be a byte count" in bad.stderr
