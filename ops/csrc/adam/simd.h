// The handful of vector operations the CPU Adam kernel needs, for the one ISA
// the builder selected at compile time (-DZE_USE_AVX512 or -DZE_USE_AVX2; neither
// means a portable scalar build).
//
// Each ISA is a struct of static functions over its register type. The kernel is
// a template over such a struct: it is instantiated once with `VecOps` for the
// bulk of a tensor and once with `ScalarOps` for the remainder, so the math is
// written a single time and the tail cannot drift from the vector body.
#pragma once

#include <cmath>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(ZE_USE_AVX512) || defined(ZE_USE_AVX2)
#include <immintrin.h>
#endif

#if defined(ZE_USE_AVX512) && !defined(__AVX512F__)
#error "ZE_USE_AVX512 needs -mavx512f"
#endif
#if defined(ZE_USE_AVX2) && !(defined(__AVX2__) && defined(__FMA__))
#error "ZE_USE_AVX2 needs -mavx2 -mfma"
#endif

namespace ze {

// One float at a time. 16-bit conversions go through c10's types, which round
// to nearest even exactly like Tensor.to(dtype).
struct ScalarOps {
  using Reg = float;
  static constexpr int kWidth = 1;

  static Reg set1(float x) { return x; }
  static Reg load(const float* p) { return *p; }
  static Reg load(const c10::BFloat16* p) { return static_cast<float>(*p); }
  static Reg load(const c10::Half* p) { return static_cast<float>(*p); }
  static void store(float* p, Reg x) { *p = x; }
  static void store(c10::BFloat16* p, Reg x) { *p = c10::BFloat16(x); }
  static void store(c10::Half* p, Reg x) { *p = c10::Half(x); }
  static Reg add(Reg a, Reg b) { return a + b; }
  static Reg mul(Reg a, Reg b) { return a * b; }
  static Reg div(Reg a, Reg b) { return a / b; }
  static Reg sqrt(Reg a) { return std::sqrt(a); }
  // a * b + c, rounded once where the build has FMA, as the vector body's fmadd is: a tensor's tail then rounds
  // exactly like its body (ISO C++ mode keeps GCC from contracting a * b + c on its own). The portable build
  // has no vector body to agree with, and may run where fma is a slow library call.
#if defined(__FMA__)
  static Reg fmadd(Reg a, Reg b, Reg c) { return std::fma(a, b, c); }
#else
  static Reg fmadd(Reg a, Reg b, Reg c) { return a * b + c; }
#endif
  static void prefetch(const void*) {}  // the portable build leaves it to the hardware
};

#if defined(ZE_USE_AVX512) || defined(ZE_USE_AVX2)
// Lane-by-lane 16-bit conversion through a float buffer, for the AVX2 build on
// a CPU without F16C (no such CPU is common, but the flag is separate).
template <typename Ops, typename T>
inline typename Ops::Reg load_by_lane(const T* p) {
  alignas(64) float tmp[Ops::kWidth];
  for (int i = 0; i < Ops::kWidth; ++i) tmp[i] = static_cast<float>(p[i]);
  return Ops::load(tmp);
}

template <typename Ops, typename T>
inline void store_by_lane(T* p, typename Ops::Reg x) {
  alignas(64) float tmp[Ops::kWidth];
  Ops::store(tmp, x);
  for (int i = 0; i < Ops::kWidth; ++i) p[i] = T(tmp[i]);
}
#endif

#if defined(ZE_USE_AVX512)
struct Avx512Ops {
  using Reg = __m512;
  static constexpr int kWidth = 16;

  static Reg set1(float x) { return _mm512_set1_ps(x); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg load(const c10::BFloat16* p) {
    // A bf16 is the high half of an fp32: widen each lane and shift it up.
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static Reg load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, Reg x) { _mm512_storeu_ps(p, x); }
  static void store(c10::BFloat16* p, Reg x) {
    // Round to nearest even: add 0x7FFF plus the lowest kept bit, then drop the
    // low half. NaNs become the canonical quiet NaN, as c10::BFloat16 does,
    // because the rounding add could otherwise carry a NaN into infinity.
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
    const __m256i packed = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  }
  static void store(c10::Half* p, Reg x) {
    const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
  static Reg sqrt(Reg a) { return _mm512_sqrt_ps(a); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  // A hint only: it never faults, so it may point past the end of an array.
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
};
using VecOps = Avx512Ops;
inline const char* simd_level() { return "avx512"; }

#elif defined(ZE_USE_AVX2)
struct Avx2Ops {
  using Reg = __m256;
  static constexpr int kWidth = 8;

  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg load(const c10::BFloat16* p) {
    // A bf16 is the high half of an fp32: widen each lane and shift it up.
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static Reg load(const c10::Half* p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    return load_by_lane<Avx2Ops>(p);
#endif
  }
  static void store(float* p, Reg x) { _mm256_storeu_ps(p, x); }
  static void store(c10::BFloat16* p, Reg x) {
    // Same rounding as the AVX-512 path (see there).
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
    const __m256i high = _mm256_srli_epi32(rounded, 16);
    // packus works within 128-bit lanes, giving [a0..a3 a0..a3 | a4..a7 a4..a7];
    // the permute gathers quadwords 0 and 2 so the low 128 bits hold a0..a7.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store(c10::Half* p, Reg x) {
#if defined(__F16C__)
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
#else
    store_by_lane<Avx2Ops>(p, x);
#endif
  }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
  static Reg sqrt(Reg a) { return _mm256_sqrt_ps(a); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  // A hint only: it never faults, so it may point past the end of an array.
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
};
using VecOps = Avx2Ops;
inline const char* simd_level() { return "avx2"; }

#else
using VecOps = ScalarOps;
inline const char* simd_level() { return "scalar"; }
#endif

}  // namespace ze
