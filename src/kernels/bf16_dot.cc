// src/kernels/bf16_dot.cc - decoding scores with vdpbf16ps (see bf16_dot.h).
//
// Compiled with AVX512_BF16 enabled (src/CMakeLists.txt) when the compiler supports it, and then
// only called after the run-time check in simd.cc. Nothing in this file may run on a processor
// without AVX-512: it has no static initializers and no entry points other than the kernels
// and the benchmark's chains (bf16_dot_chains), each called only after that check.
//
// Layout of the work, as in the Highway decoding kernel's half-precision path: keys are read in
// memory order, key by key and, within a key, head by head (one contiguous run per key of a
// [seq, heads, dim] cache). For each (key, head, block of 4 query rows) the 4 accumulators of
// 16 lanes are folded into one vector whose quarter r holds row r's 4 partial sums; after 4 keys
// the 4 folded vectors are transposed and added within their 128-bit quarters, which leaves
// row r's scores for the 4 keys in quarter r, stored with one 4-float store per row.
#include "kernels/bf16_dot.h"

#if defined(POSENC_HAVE_BF16_DOT) && defined(__AVX512BF16__)
// GCC 12 reports the intrinsics' own undefined-vector placeholders (_mm512_undefined_*) as
// "may be used uninitialized" where they are inlined: a false positive of the headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>

namespace posenc::kernels {
namespace {

// Quarters [x0 + x2, x1 + x3, y0 + y2, y1 + y3] (quarter = 4 lanes).
inline __m512 FoldHalves(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
}

// 4 rows' accumulators to one vector: quarter r = row r's 4 partial sums.
inline __m512 Fold4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 h01 = FoldHalves(a0, a1), h23 = FoldHalves(a2, a3);
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(h01, h23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// p[j] quarter r = row r's partial sums for key j: lane 4 r + j of the result is their total.
inline __m512 Transpose4(const float* p) {
  const __m512 p0 = _mm512_loadu_ps(p), p1 = _mm512_loadu_ps(p + 16);
  const __m512 p2 = _mm512_loadu_ps(p + 32), p3 = _mm512_loadu_ps(p + 48);
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(p0, p1), _mm512_unpackhi_ps(p0, p1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(p2, p3), _mm512_unpackhi_ps(p2, p3));
  return _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
}

// Row block (4 query rows qb, q_stride apart) against one key row kr: the folded vector.
inline __m512 Key4(const uint16_t* qb, int64_t q_stride, int64_t dim, const uint16_t* kr) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t x = 0;
  for (; x + 32 <= dim; x += 32) {
    const __m512bh kv = (__m512bh)_mm512_loadu_si512(kr + x);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(qb + x), kv);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(qb + q_stride + x), kv);
    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(qb + 2 * q_stride + x), kv);
    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(qb + 3 * q_stride + x), kv);
  }
  if (x < dim) {
    // The key's tail by a masked load (nothing past the row is read); q holds zeros there.
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << (dim - x)) - 1);
    const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(m, kr + x);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(qb + x), kv);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(qb + q_stride + x), kv);
    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(qb + 2 * q_stride + x), kv);
    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(qb + 3 * q_stride + x), kv);
  }
  return Fold4(a0, a1, a2, a3);
}

}  // namespace

void decode_scores_bf16_dot(const uint16_t* qb, int64_t q_stride, int64_t dim,
                            int64_t rows_per_head, int64_t heads, const uint16_t* k,
                            int64_t kstride, int64_t hstride, int64_t nk, float* s,
                            int64_t s_stride, float* part, const PrefetchRows& ahead) {
  const int64_t blocks_per_head = rows_per_head / 4, blocks = heads * blocks_per_head;
  for (int64_t c0 = 0; c0 < nk; c0 += 4) {
    const int64_t kb = std::min<int64_t>(4, nk - c0);
    for (int64_t j = 0; j < 4; ++j) {
      prefetch_row(ahead, c0 + j);
      // Past kb: the last key again, its scores land in columns the caller overwrites.
      const uint16_t* kr = k + (c0 + std::min(j, kb - 1)) * kstride;
      for (int64_t g = 0; g < heads; ++g) {
        for (int64_t b = 0; b < blocks_per_head; ++b) {
          const int64_t blk = g * blocks_per_head + b;
          _mm512_storeu_ps(part + (blk * 4 + j) * 16,
                           Key4(qb + blk * 4 * q_stride, q_stride, dim, kr + g * hstride));
        }
      }
    }
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const __m512 t = Transpose4(part + blk * 64);
      float* row = s + blk * 4 * s_stride + c0;
      _mm_storeu_ps(row, _mm512_extractf32x4_ps(t, 0));
      _mm_storeu_ps(row + s_stride, _mm512_extractf32x4_ps(t, 1));
      _mm_storeu_ps(row + 2 * s_stride, _mm512_extractf32x4_ps(t, 2));
      _mm_storeu_ps(row + 3 * s_stride, _mm512_extractf32x4_ps(t, 3));
    }
  }
}

namespace {

// Rows [r, r + 4) against keys [0, 16 nv): acc[i][j] over the pairs p < np, then stored.
template <int NV>
inline void PrefillBlock(const uint32_t* q0, int64_t qs32, int64_t np, const uint32_t* kt, float* s,
                         int64_t ss) {
  __m512 acc[4][NV];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    __m512bh kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(kt + p * 64 + 16 * j);
    for (int i = 0; i < 4; ++i) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(q0[i * qs32 + p]));
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w, kv[j]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(s + i * ss + 16 * j, acc[i][j]);
}

}  // namespace

void prefill_scores_bf16_dot(const uint16_t* qb, int64_t q_stride, int64_t dim, const uint32_t* kt,
                             int64_t rows_pad, float* s, int64_t ss, const int32_t* cols) {
  const int64_t np = (dim + 1) / 2;
  const int64_t qs32 = q_stride / 2;  // q rows as pairs (q_stride is even)
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qb);
  for (int64_t r = 0; r < rows_pad; r += 4) {
    int64_t nc = 64;
    if (cols != nullptr) {
      nc = 0;
      for (int64_t i = r; i < r + 4; ++i) nc = std::max<int64_t>(nc, cols[i]);
      nc = std::min<int64_t>(nc, 64);
    }
    const int64_t nv = (nc + 15) / 16;
    const uint32_t* q0 = q32 + r * qs32;
    float* s0 = s + r * ss;
    if (nv == 4) {
      PrefillBlock<4>(q0, qs32, np, kt, s0, ss);
    } else if (nv == 3) {
      PrefillBlock<3>(q0, qs32, np, kt, s0, ss);
    } else if (nv == 2) {
      PrefillBlock<2>(q0, qs32, np, kt, s0, ss);
    } else if (nv == 1) {
      PrefillBlock<1>(q0, qs32, np, kt, s0, ss);
    }
  }
}

void pack_bf16_pairs(const float* kt32, int64_t dim, uint32_t* kt) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < dim / 2; ++p) {
    const float* lo = kt32 + 2 * p * 64;
    const float* hi = lo + 64;
    for (int64_t c = 0; c < 64; c += 16) {
      const __m512i a = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(lo + c)), 16);
      const __m512i b = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(hi + c)), high);
      _mm512_storeu_si512(kt + p * 64 + c, _mm512_or_si512(a, b));
    }
  }
  if (dim % 2 != 0) {  // the last dim paired with a zero
    const float* lo = kt32 + (dim - 1) * 64;
    for (int64_t c = 0; c < 64; c += 16) {
      _mm512_storeu_si512(kt + (dim / 2) * 64 + c,
                          _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(lo + c)), 16));
    }
  }
}

// The chains as named variables, so that each stays in a register.
#define POSENC_BF16_CHAINS(X) \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

float bf16_dot_chains(int64_t iterations, uint16_t factor_bits) {
  static_assert(kBf16DotChains == 16 && kBf16DotLanes == 16);
#define POSENC_BF16_INIT(i) __m512 c##i = _mm512_set1_ps(1.0f + 0.0625f * (i));
  POSENC_BF16_CHAINS(POSENC_BF16_INIT)
#undef POSENC_BF16_INIT
  const __m512bh f = (__m512bh)_mm512_set1_epi16(static_cast<short>(factor_bits));
  for (int64_t it = 0; it < iterations; ++it) {
#define POSENC_BF16_STEP(i) c##i = _mm512_dpbf16_ps(c##i, f, f);
    POSENC_BF16_CHAINS(POSENC_BF16_STEP)
#undef POSENC_BF16_STEP
  }
  __m512 sum = _mm512_setzero_ps();
#define POSENC_BF16_SUM(i) sum = _mm512_add_ps(sum, c##i);
  POSENC_BF16_CHAINS(POSENC_BF16_SUM)
#undef POSENC_BF16_SUM
  // Lane by lane (_mm512_reduce_add_ps goes through GCC 12's undefined-vector placeholders).
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  float total = 0;
  for (const float x : lanes) total += x;
  return total;
}
#undef POSENC_BF16_CHAINS

}  // namespace posenc::kernels

#else  // no AVX512_BF16 in this build: never called (bf16_dot_supported() is false)

#include "posenc/error.h"

namespace posenc::kernels {

void decode_scores_bf16_dot(const uint16_t*, int64_t, int64_t, int64_t, int64_t, const uint16_t*,
                            int64_t, int64_t, int64_t, float*, int64_t, float*,
                            const PrefetchRows&) {
  throw Error("internal: decode_scores_bf16_dot called in a build without AVX512_BF16");
}

void prefill_scores_bf16_dot(const uint16_t*, int64_t, int64_t, const uint32_t*, int64_t, float*,
                             int64_t, const int32_t*) {
  throw Error("internal: prefill_scores_bf16_dot called in a build without AVX512_BF16");
}

void pack_bf16_pairs(const float*, int64_t, uint32_t*) {
  throw Error("internal: pack_bf16_pairs called in a build without AVX512_BF16");
}

float bf16_dot_chains(int64_t, uint16_t) {
  throw Error("internal: bf16_dot_chains called in a build without AVX512_BF16");
}

}  // namespace posenc::kernels

#endif
