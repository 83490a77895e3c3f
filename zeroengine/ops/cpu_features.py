"""Which x86 SIMD extensions this CPU has, and the compiler flags that use them.

The CPU ops are compiled for the machine that loads them (not ``-march=native``,
so the choice is explicit and part of the build hash): AVX-512F if present, else
AVX2 with FMA, else portable scalar code. ``ZEROENGINE_SIMD=avx512|avx2|scalar``
forces a level, e.g. to build one portable binary for a mixed cluster.
"""
from __future__ import annotations

import enum
import functools
import os
from pathlib import Path

SIMD_ENV = "ZEROENGINE_SIMD"


class SimdLevel(str, enum.Enum):
    AVX512 = "avx512"
    AVX2 = "avx2"
    SCALAR = "scalar"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """Feature flags of this CPU, lower case (``avx2``, ``fma``, ``avx512f``, ...)."""
    cpuinfo_path = Path("/proc/cpuinfo")
    if cpuinfo_path.exists():  # Linux: instant, where py-cpuinfo may take a second
        for line in cpuinfo_path.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    import cpuinfo

    return frozenset(f.lower() for f in cpuinfo.get_cpu_info().get("flags", []))


def simd_level(flags: frozenset[str] | None = None) -> SimdLevel:
    """The widest level the CPU supports, unless ``ZEROENGINE_SIMD`` forces one."""
    forced = os.environ.get(SIMD_ENV)
    if forced:
        try:
            return SimdLevel(forced.lower())
        except ValueError:
            valid = ", ".join(level.value for level in SimdLevel)
            raise ValueError(f"{SIMD_ENV}={forced!r}: expected one of {valid}") from None
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        return SimdLevel.AVX512
    if {"avx2", "fma"} <= flags:
        return SimdLevel.AVX2
    return SimdLevel.SCALAR


def simd_compile_flags(level: SimdLevel, flags: frozenset[str] | None = None) -> list[str]:
    """gcc/clang flags for ``level``; the ``ZE_USE_*`` define selects the code path in simd.h."""
    flags = cpu_flags() if flags is None else flags
    if level is SimdLevel.AVX512:
        # Every AVX-512F CPU also has AVX2, FMA and F16C.
        return ["-mavx512f", "-mavx2", "-mfma", "-mf16c", "-DZE_USE_AVX512"]
    if level is SimdLevel.AVX2:
        f16c = ["-mf16c"] if "f16c" in flags else []
        return ["-mavx2", "-mfma", *f16c, "-DZE_USE_AVX2"]
    return []
