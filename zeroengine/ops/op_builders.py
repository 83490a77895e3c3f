"""The concrete ops: which sources make each one, and how it is compiled."""
from __future__ import annotations

import os
import sys

from zeroengine.ops.builder import CPUOpBuilder, CUDAOpBuilder, OpBuilder
from zeroengine.ops.cpu_features import SimdLevel


class CPUAdamBuilder(CPUOpBuilder):
    """Adam/AdamW over flat fp32 CPU tensors (ops/csrc/adam/cpu_adam.cpp)."""

    NAME = "cpu_adam"
    SOURCE_DIR = "adam"
    SOURCES = ("cpu_adam.cpp",)


class FusedAdamBuilder(CUDAOpBuilder):
    """Multi-tensor Adam/AdamW for CUDA (ops/csrc/adam/fused_adam.{cu,cpp})."""

    NAME = "fused_adam"
    SOURCE_DIR = "adam"
    SOURCES = ("fused_adam.cpp", "fused_adam.cu")


class MoEDispatchBuilder(CPUOpBuilder):
    """MoE token permutation and weighted un-permutation, grouped expert GEMMs, the fused top-k gate and
    the router's GEMMs on CPU (ops/csrc/moe/moe_{dispatch,grouped,gate,router}_cpu.cpp)."""

    NAME = "moe_dispatch"
    SOURCE_DIR = "moe"
    SOURCES = ("moe_dispatch_cpu.cpp", "moe_grouped_cpu.cpp", "moe_gate_cpu.cpp", "moe_small_gemm_cpu.cpp",
               "moe_router_cpu.cpp")

    def status(self) -> dict:
        """Adds whether the small-row GEMMs (experts' and router's) are in use: they need AVX2 + FMA
        (without them ATen's GEMMs run, see ops/csrc/moe/moe_small_gemm_cpu.cpp) and
        ``ZEROENGINE_MOE_SMALL_GEMM=0`` turns them off."""
        status = super().status()
        if status["compatible"]:
            if self.simd_level() is SimdLevel.SCALAR:
                status["detail"] = "small-row GEMMs: off, ATen's GEMMs instead (SIMD scalar)"
            elif os.environ.get("ZEROENGINE_MOE_SMALL_GEMM", "1") == "0":
                status["detail"] = "small-row GEMMs: off, ATen's GEMMs instead (ZEROENGINE_MOE_SMALL_GEMM=0)"
            else:
                status["detail"] = "small-row GEMMs: on"
        return status


class MoEDispatchCUDABuilder(CUDAOpBuilder):
    """MoE token permutation and weighted un-permutation on CUDA (ops/csrc/moe/moe_dispatch{.cu,_cuda.cpp})."""

    NAME = "moe_dispatch_cuda"
    SOURCE_DIR = "moe"
    SOURCES = ("moe_dispatch_cuda.cpp", "moe_dispatch.cu")


class AsyncIOBuilder(OpBuilder):
    """Asynchronous file reads and writes of tensors, a pool of threads in pread/pwrite with O_DIRECT where
    aligned (ops/csrc/aio/async_io_cpu.cpp): NVMe offload's I/O. Linux only (O_DIRECT, pread/pwrite)."""

    NAME = "async_io"
    SOURCE_DIR = "aio"
    SOURCES = ("async_io_cpu.cpp",)

    def ld_flags(self) -> list[str]:
        return [*super().ld_flags(), "-pthread"]

    def is_compatible(self) -> tuple[bool, str]:
        if not sys.platform.startswith("linux"):
            return False, f"needs Linux (O_DIRECT, pread/pwrite); this is {sys.platform}"
        return super().is_compatible()
