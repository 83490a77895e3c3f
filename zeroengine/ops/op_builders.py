"""The concrete ops: which sources make each one, and how it is compiled."""
from __future__ import annotations

from zeroengine.ops.builder import CPUOpBuilder, CUDAOpBuilder
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
        """Adds whether the small-row expert GEMMs are compiled in (they need AVX2 + FMA; without them
        the grouped expert GEMMs use ATen's, see ops/csrc/moe/moe_small_gemm_cpu.cpp)."""
        status = super().status()
        if status["compatible"]:
            level = self.simd_level()
            status["detail"] = ("small-row expert GEMMs: on" if level is not SimdLevel.SCALAR
                                else "small-row expert GEMMs: off, ATen's GEMMs instead (SIMD scalar)")
        return status


class MoEDispatchCUDABuilder(CUDAOpBuilder):
    """MoE token permutation and weighted un-permutation on CUDA (ops/csrc/moe/moe_dispatch{.cu,_cuda.cpp})."""

    NAME = "moe_dispatch_cuda"
    SOURCE_DIR = "moe"
    SOURCES = ("moe_dispatch_cuda.cpp", "moe_dispatch.cu")
