// Single-threaded fp32 GEMMs for one expert's few rows against its large weight, on AVX2 + FMA.
//
// Why not MKL here: an expert at 64 experts and 4096 tokens gets ~64-128 rows, and its weight
// (512 x 2048, 4 MiB) is used once per GEMM. A BLAS packs the big operand before computing,
// so every weight is read from memory, written to a packing buffer and read again, with no
// arithmetic overlapping that first read: measured on a 2-core AVX2 host, 64 experts' forward
// GEMMs ran at 57-75 GFLOPS per thread against 83-94 for one dense GEMM of the same FLOPs.
// These kernels pack only the small operand (the rows, which stay in L1/L2) and read the weight
// where it lies, once, with the next panel prefetched while the current one is computed:
// 79-101 GFLOPS on the same host, as fast as the dense GEMM.
//
// One micro-kernel serves all three products: a 6 x 16 tile of 12 AVX accumulators,
// acc[i][0..16) += a_i(k) * b(k)[0..16) over the contraction, where a_i(k) is a scalar
// broadcast from row i of one operand and b(k) 16 packed floats of the other.
//   nt: C[m][n] = sum_k A[m][k] W[n][k]   (forward: the weight's rows broadcast, rows packed)
//   nn: C[m][k] = sum_n A[m][n] W[n][k]   (input gradient: 16 weight columns packed per strip)
//   tn: C[n][k] = sum_m A[m][n] B[m][k]   (weight gradient: written once, streaming stores)
#include "moe_small_gemm.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ZE_SMALL_GEMM 1
#endif

namespace ze {
namespace moe {
namespace small_gemm {

#if ZE_SMALL_GEMM
namespace {

constexpr int64_t kMR = 6;    // broadcast rows per tile
constexpr int64_t kNR = 16;   // vector lanes per tile (two AVX registers)
constexpr int64_t kKC = 256;  // contraction block: a 6 x 256 weight panel (6 KiB) stays in L1
constexpr int64_t kMC = 128;  // rows per block of the weight gradient (its packed rows stay in L2)

// A 32-byte aligned scratch buffer per thread, grown on demand (the packed small operand).
float* scratch(int64_t floats, int slot) {
  thread_local std::vector<float> buffers[2];
  std::vector<float>& buf = buffers[slot];
  if (static_cast<int64_t>(buf.size()) < floats + 8) buf.resize(floats + 8);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 31) & ~uintptr_t{31});
}

// t[i][0..16) = sum over k < kc of a[i * a_row + k * a_step] * b[k * 16 + 0..16), for i < R.
// b is packed and 32-byte aligned. When pf is set, the lines of the next panel's R rows
// (pf + i * a_row, contiguous) are prefetched, one per 16 steps.
template <int R>
inline void micro(const float* a, int64_t a_row, int64_t a_step, const float* b, int64_t kc, float (*t)[kNR],
                  const float* pf) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  // Named accumulators, not an array: gcc keeps an indexed __m256 array in memory (measured: half speed).
  const float* a0 = a;
  const float* a1 = a + (R > 1 ? a_row : 0);
  const float* a2 = a + (R > 2 ? 2 * a_row : 0);
  const float* a3 = a + (R > 3 ? 3 * a_row : 0);
  const float* a4 = a + (R > 4 ? 4 * a_row : 0);
  const float* a5 = a + (R > 5 ? 5 * a_row : 0);
  for (int64_t k = 0; k < kc; ++k, b += kNR) {
    if (pf != nullptr && (k & 15) == 0) {
      for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(pf + i * a_row + k), _MM_HINT_T0);
    }
    const int64_t o = k * a_step;
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
    __m256 x = _mm256_broadcast_ss(a0 + o);
    c00 = _mm256_fmadd_ps(x, b0, c00);
    c01 = _mm256_fmadd_ps(x, b1, c01);
    if (R > 1) {
      x = _mm256_broadcast_ss(a1 + o);
      c10 = _mm256_fmadd_ps(x, b0, c10);
      c11 = _mm256_fmadd_ps(x, b1, c11);
    }
    if (R > 2) {
      x = _mm256_broadcast_ss(a2 + o);
      c20 = _mm256_fmadd_ps(x, b0, c20);
      c21 = _mm256_fmadd_ps(x, b1, c21);
    }
    if (R > 3) {
      x = _mm256_broadcast_ss(a3 + o);
      c30 = _mm256_fmadd_ps(x, b0, c30);
      c31 = _mm256_fmadd_ps(x, b1, c31);
    }
    if (R > 4) {
      x = _mm256_broadcast_ss(a4 + o);
      c40 = _mm256_fmadd_ps(x, b0, c40);
      c41 = _mm256_fmadd_ps(x, b1, c41);
    }
    if (R > 5) {
      x = _mm256_broadcast_ss(a5 + o);
      c50 = _mm256_fmadd_ps(x, b0, c50);
      c51 = _mm256_fmadd_ps(x, b1, c51);
    }
  }
  _mm256_store_ps(t[0], c00);
  _mm256_store_ps(t[0] + 8, c01);
  if (R > 1) _mm256_store_ps(t[1], c10), _mm256_store_ps(t[1] + 8, c11);
  if (R > 2) _mm256_store_ps(t[2], c20), _mm256_store_ps(t[2] + 8, c21);
  if (R > 3) _mm256_store_ps(t[3], c30), _mm256_store_ps(t[3] + 8, c31);
  if (R > 4) _mm256_store_ps(t[4], c40), _mm256_store_ps(t[4] + 8, c41);
  if (R > 5) _mm256_store_ps(t[5], c50), _mm256_store_ps(t[5] + 8, c51);
}

void micro_rows(int64_t rows, const float* a, int64_t a_row, int64_t a_step, const float* b, int64_t kc,
                float (*t)[kNR], const float* pf) {
  switch (rows) {
    case 6: return micro<6>(a, a_row, a_step, b, kc, t, pf);
    case 5: return micro<5>(a, a_row, a_step, b, kc, t, pf);
    case 4: return micro<4>(a, a_row, a_step, b, kc, t, pf);
    case 3: return micro<3>(a, a_row, a_step, b, kc, t, pf);
    case 2: return micro<2>(a, a_row, a_step, b, kc, t, pf);
    default: return micro<1>(a, a_row, a_step, b, kc, t, pf);
  }
}

}  // namespace

bool available() { return true; }

void nt(const float* a, const float* w, const float* bias, float* c, int64_t m, int64_t n, int64_t k) {
  const int64_t blocks = (m + kNR - 1) / kNR;
  float* packed = scratch(blocks * kNR * kKC, 0);
  alignas(32) float t[kMR][kNR];
  for (int64_t kb = 0; kb < k; kb += kKC) {
    const int64_t kc = std::min(kKC, k - kb);
    // rows kb..kb+kc of a^T, 16 rows of a per block, zero-padded past m
    for (int64_t blk = 0; blk < blocks; ++blk) {
      float* p = packed + blk * kNR * kc;
      for (int64_t j = 0; j < kNR; ++j) {
        const int64_t row = blk * kNR + j;
        if (row < m) {
          const float* src = a + row * k + kb;
          for (int64_t q = 0; q < kc; ++q) p[q * kNR + j] = src[q];
        } else {
          for (int64_t q = 0; q < kc; ++q) p[q * kNR + j] = 0.f;
        }
      }
    }
    for (int64_t n0 = 0; n0 < n; n0 += kMR) {
      const int64_t rows = std::min(kMR, n - n0);
      const float* panel = w + n0 * k + kb;
      const float* next = n0 + 2 * kMR + kMR <= n ? panel + 2 * kMR * k : nullptr;  // two panels ahead
      for (int64_t blk = 0; blk < blocks; ++blk) {
        micro_rows(rows, panel, k, 1, packed + blk * kNR * kc, kc, t, blk == 0 ? next : nullptr);
        const int64_t cols = std::min(kNR, m - blk * kNR);
        for (int64_t j = 0; j < cols; ++j) {
          float* out = c + (blk * kNR + j) * n + n0;
          for (int64_t i = 0; i < rows; ++i) {
            const float v = t[i][j];
            out[i] = kb == 0 ? (bias != nullptr ? bias[n0 + i] + v : v) : out[i] + v;
          }
        }
      }
    }
  }
}

void nn(const float* a, const float* w, float* c, int64_t m, int64_t n, int64_t k, bool accumulate) {
  const int64_t tiles = (m + kMR - 1) / kMR;
  float* strip = scratch(kKC * kNR, 0);
  float* pa = scratch(tiles * kMR * kKC, 1);
  alignas(32) float t[kMR][kNR];
  for (int64_t nb = 0; nb < n; nb += kKC) {
    const int64_t nc = std::min(kKC, n - nb);
    // a's columns nb..nb+nc as [6-row tile][column][6]: contiguous broadcasts (a's rows are n apart,
    // and 6 of them at a power-of-two stride would share one L1 set)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      float* dst = pa + tile * kMR * nc;
      for (int64_t i = 0; i < kMR; ++i) {
        const int64_t row = tile * kMR + i;
        const float* src = a + row * n + nb;
        for (int64_t q = 0; q < nc; ++q) dst[q * kMR + i] = row < m ? src[q] : 0.f;
      }
    }
    for (int64_t k0 = 0; k0 < k; k0 += kNR) {
      const int64_t cols = std::min(kNR, k - k0);
      // columns k0..k0+16 of weight rows nb..nb+nc, contiguous (the weight's rows are k apart)
      for (int64_t q = 0; q < nc; ++q) {
        const float* src = w + (nb + q) * k + k0;
        if (k0 + 2 * kNR < k) _mm_prefetch(reinterpret_cast<const char*>(src + 2 * kNR), _MM_HINT_T0);
        float* dst = strip + q * kNR;
        if (cols == kNR) {
          _mm256_store_ps(dst, _mm256_loadu_ps(src));
          _mm256_store_ps(dst + 8, _mm256_loadu_ps(src + 8));
        } else {
          for (int64_t j = 0; j < kNR; ++j) dst[j] = j < cols ? src[j] : 0.f;
        }
      }
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t m0 = tile * kMR, rows = std::min(kMR, m - m0);
        micro_rows(rows, pa + tile * kMR * nc, 1, kMR, strip, nc, t, nullptr);
        for (int64_t i = 0; i < rows; ++i) {
          float* out = c + (m0 + i) * k + k0;
          if (cols == kNR) {
            __m256 v0 = _mm256_load_ps(t[i]), v1 = _mm256_load_ps(t[i] + 8);
            if (nb > 0 || accumulate) {
              v0 = _mm256_add_ps(v0, _mm256_loadu_ps(out));
              v1 = _mm256_add_ps(v1, _mm256_loadu_ps(out + 8));
            }
            _mm256_storeu_ps(out, v0);
            _mm256_storeu_ps(out + 8, v1);
          } else {
            for (int64_t j = 0; j < cols; ++j) out[j] = nb == 0 && !accumulate ? t[i][j] : out[j] + t[i][j];
          }
        }
      }
    }
  }
}

void tn(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k) {
  const int64_t kblocks = (k + kNR - 1) / kNR, panels = (n + kMR - 1) / kMR;
  alignas(32) float t[kMR][kNR];
  // Streaming stores skip reading the gradient's old lines (4 MiB per expert here) before writing them.
  const bool stream = m <= kMC && (reinterpret_cast<uintptr_t>(c) & 31) == 0 && (k % 8) == 0;
  for (int64_t mb = 0; mb < m; mb += kMC) {
    const int64_t mc = std::min(kMC, m - mb);
    // b's rows mb..mb+mc as [16-column block][row][16], zero-padded past k
    float* pb = scratch(kblocks * mc * kNR, 0);
    for (int64_t r = 0; r < mc; ++r) {
      const float* src = b + (mb + r) * k;
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        float* dst = pb + (kb * mc + r) * kNR;
        const int64_t cols = std::min(kNR, k - kb * kNR);
        for (int64_t j = 0; j < kNR; ++j) dst[j] = j < cols ? src[kb * kNR + j] : 0.f;
      }
    }
    // a's columns as [6-column panel][row][6] (contiguous broadcasts), zero-padded past n
    float* pa = scratch(panels * mc * kMR, 1);
    for (int64_t r = 0; r < mc; ++r) {
      const float* src = a + (mb + r) * n;
      for (int64_t p = 0; p < panels; ++p) {
        float* dst = pa + (p * mc + r) * kMR;
        for (int64_t i = 0; i < kMR; ++i) dst[i] = p * kMR + i < n ? src[p * kMR + i] : 0.f;
      }
    }
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t rows = std::min(kMR, n - p * kMR);
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        micro_rows(rows, pa + p * mc * kMR, 1, kMR, pb + kb * mc * kNR, mc, t, nullptr);
        const int64_t cols = std::min(kNR, k - kb * kNR);
        for (int64_t i = 0; i < rows; ++i) {
          float* out = c + (p * kMR + i) * k + kb * kNR;
          if (stream && cols == kNR) {
            _mm256_stream_ps(out, _mm256_load_ps(t[i]));
            _mm256_stream_ps(out + 8, _mm256_load_ps(t[i] + 8));
          } else {
            for (int64_t j = 0; j < cols; ++j) out[j] = mb == 0 ? t[i][j] : out[j] + t[i][j];
          }
        }
      }
    }
  }
  if (stream) _mm_sfence();  // streaming stores are weakly ordered: make them visible before returning
}

#else  // built without AVX2 + FMA: callers use ATen's GEMMs

bool available() { return false; }
void nt(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t) {}
void nn(const float*, const float*, float*, int64_t, int64_t, int64_t, bool) {}
void tn(const float*, const float*, float*, int64_t, int64_t, int64_t) {}

#endif

}  // namespace small_gemm
}  // namespace moe
}  // namespace ze
