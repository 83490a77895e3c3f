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
#include <cstdlib>
#include <cstring>
#include <string>
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
// Row i of the tile (when R > i): its broadcast scalar times the 16 packed floats, into its two accumulators.
#define ZE_TILE_ROW(i)                            \
  if (R > i) {                                    \
    x = _mm256_broadcast_ss(a##i + o);            \
    c##i##0 = _mm256_fmadd_ps(x, b0, c##i##0);    \
    c##i##1 = _mm256_fmadd_ps(x, b1, c##i##1);    \
  }
#define ZE_TILE_STORE(i) \
  if (R > i) _mm256_store_ps(t[i], c##i##0), _mm256_store_ps(t[i] + 8, c##i##1);

template <int R>
inline void micro(const float* a, int64_t a_row, int64_t a_step, const float* b, int64_t kc, float (*t)[kNR],
                  const float* pf) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  // Named accumulators (and a macro per row), not an array: gcc keeps an indexed __m256 array in memory
  // (measured: half speed).
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
    __m256 x;
    ZE_TILE_ROW(0)
    ZE_TILE_ROW(1)
    ZE_TILE_ROW(2)
    ZE_TILE_ROW(3)
    ZE_TILE_ROW(4)
    ZE_TILE_ROW(5)
  }
  ZE_TILE_STORE(0)
  ZE_TILE_STORE(1)
  ZE_TILE_STORE(2)
  ZE_TILE_STORE(3)
  ZE_TILE_STORE(4)
  ZE_TILE_STORE(5)
}
#undef ZE_TILE_ROW
#undef ZE_TILE_STORE

// A panel of `rows` rows of src (rows ld apart), elements [0, len) of each, as [len][W]:
// dst[q * W + j] = src[j * ld + q], zero for rows <= j < W (the rows' elements at one q adjacent).
template <int W>
void pack_rows(const float* src, int64_t ld, int64_t rows, int64_t len, float* dst) {
  for (int64_t j = 0; j < W; ++j) {
    if (j < rows) {
      for (int64_t q = 0; q < len; ++q) dst[q * W + j] = src[j * ld + q];
    } else {
      for (int64_t q = 0; q < len; ++q) dst[q * W + j] = 0.f;
    }
  }
}

// `rows` rows of src (rows ld apart, `cols` columns) in blocks of W columns, as [block][row][W]:
// dst[(block * rows + r) * W + j] = src[r * ld + block * W + j], zero past cols.
template <int W>
void pack_column_blocks(const float* src, int64_t ld, int64_t rows, int64_t cols, float* dst) {
  const int64_t blocks = (cols + W - 1) / W;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t block = 0; block < blocks; ++block) {
      float* d = dst + (block * rows + r) * W;
      for (int64_t j = 0; j < W; ++j) d[j] = block * W + j < cols ? src[r * ld + block * W + j] : 0.f;
    }
  }
}

// out[0, cols) = v (or out + v with add); a whole 16-float row by vector stores, streaming ones with
// stream (never with add: a streaming store does not read the line).
inline void write_row(float* out, const float* v, int64_t cols, bool add, bool stream) {
  if (cols == kNR && stream && !add) {
    _mm256_stream_ps(out, _mm256_load_ps(v));
    _mm256_stream_ps(out + 8, _mm256_load_ps(v + 8));
  } else if (cols == kNR) {
    __m256 v0 = _mm256_load_ps(v), v1 = _mm256_load_ps(v + 8);
    if (add) {
      v0 = _mm256_add_ps(v0, _mm256_loadu_ps(out));
      v1 = _mm256_add_ps(v1, _mm256_loadu_ps(out + 8));
    }
    _mm256_storeu_ps(out, v0);
    _mm256_storeu_ps(out + 8, v1);
  } else {
    for (int64_t j = 0; j < cols; ++j) out[j] = add ? out[j] + v[j] : v[j];
  }
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

void nt(const float* a, const float* w, const float* bias, float* c, int64_t m, int64_t n, int64_t k,
        bool out_transposed) {
  const int64_t blocks = (m + kNR - 1) / kNR;
  float* packed = scratch(blocks * kNR * kKC, 0);
  alignas(32) float t[kMR][kNR];
  for (int64_t kb = 0; kb < k; kb += kKC) {
    const int64_t kc = std::min(kKC, k - kb);
    // rows kb..kb+kc of a^T, 16 rows of a per block, zero-padded past m
    for (int64_t blk = 0; blk < blocks; ++blk) {
      pack_rows<kNR>(a + blk * kNR * k + kb, k, std::min(kNR, m - blk * kNR), kc, packed + blk * kNR * kc);
    }
    for (int64_t n0 = 0; n0 < n; n0 += kMR) {
      const int64_t rows = std::min(kMR, n - n0);
      const float* panel = w + n0 * k + kb;
      const float* next = n0 + 2 * kMR + kMR <= n ? panel + 2 * kMR * k : nullptr;  // two panels ahead
      for (int64_t blk = 0; blk < blocks; ++blk) {
        micro_rows(rows, panel, k, 1, packed + blk * kNR * kc, kc, t, blk == 0 ? next : nullptr);
        const int64_t cols = std::min(kNR, m - blk * kNR);
        if (out_transposed) {  // tile row i is 16 consecutive outputs of c's row n0 + i
          for (int64_t i = 0; i < rows; ++i) {
            write_row(c + (n0 + i) * m + blk * kNR, t[i], cols, kb > 0, false);
          }
          continue;
        }
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
      pack_rows<kMR>(a + tile * kMR * n + nb, n, std::min(kMR, m - tile * kMR), nc, pa + tile * kMR * nc);
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
        for (int64_t i = 0; i < rows; ++i) write_row(c + (m0 + i) * k + k0, t[i], cols, nb > 0 || accumulate, false);
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
    // b's rows mb..mb+mc as [16-column block][row][16], and a's as [6-column panel][row][6] (contiguous
    // broadcasts), zero-padded past k and n
    float* pb = scratch(kblocks * mc * kNR, 0);
    pack_column_blocks<kNR>(b + mb * k, k, mc, k, pb);
    float* pa = scratch(panels * mc * kMR, 1);
    pack_column_blocks<kMR>(a + mb * n, n, mc, n, pa);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t rows = std::min(kMR, n - p * kMR);
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        micro_rows(rows, pa + p * mc * kMR, 1, kMR, pb + kb * mc * kNR, mc, t, nullptr);
        const int64_t cols = std::min(kNR, k - kb * kNR);
        for (int64_t i = 0; i < rows; ++i) write_row(c + (p * kMR + i) * k + kb * kNR, t[i], cols, mb > 0, stream);
      }
    }
  }
  if (stream) _mm_sfence();  // streaming stores are weakly ordered: make them visible before returning
}

#else  // built without AVX2 + FMA: callers use ATen's GEMMs

bool available() { return false; }
void nt(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, bool) {}
void nn(const float*, const float*, float*, int64_t, int64_t, int64_t, bool) {}
void tn(const float*, const float*, float*, int64_t, int64_t, int64_t) {}

#endif

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("ZEROENGINE_MOE_SMALL_GEMM");
    return available() && (v == nullptr || std::string(v) != "0");
  }();
  return on;
}

}  // namespace small_gemm
}  // namespace moe
}  // namespace ze
