// src/kernels/decode-inl.h - the fused forward's decoding micro-kernels (attention_hwy.cc): key
// and value rows widened from half precision, scores as dot products of few query rows against
// many key rows (DotScoresWide and its blocks), and P . V accumulated over the columns of the
// kv heads (AccumulateWide, AccumulateWideColumns), with the half-cache prefetch of bf16_dot.h.
//
// Included once per target by attention_hwy.cc after hwy/foreach_target.h (the guard below
// re-expands for each target).
#if defined(POSENC_KERNELS_DECODE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_DECODE_INL_H_
#undef POSENC_KERNELS_DECODE_INL_H_
#else
#define POSENC_KERNELS_DECODE_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "kernels/attention-inl.h"
#include "kernels/bf16_dot.h"
#include "posenc/dtype.h"
#include "posenc/half.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Key / value elements as float32 vectors: float32 as is, bf16 and f16 widened exactly.
HWY_INLINE hn::Vec<DF> LoadKV(DF d, const float* p) { return hn::LoadU(d, p); }
HWY_INLINE hn::Vec<DF> LoadKV(DF d, const bf16* p) {
  const hn::Rebind<hwy::bfloat16_t, DF> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::bfloat16_t*>(p)));
}
HWY_INLINE hn::Vec<DF> LoadKV(DF d, const f16* p) {
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
}

// dst[x] = src[x] widened to float32, x < n.
template <class T>
HWY_INLINE void WidenRow(const T* HWY_RESTRICT src, float* HWY_RESTRICT dst, int64_t n) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  int64_t x = 0;
  for (; x + lanes <= n; x += lanes) hn::StoreU(LoadKV(d, src + x), d, dst + x);
  for (; x < n; ++x) dst[x] = to_float(src[x]);
}
HWY_INLINE void WidenRow(DType type, const uint16_t* src, float* dst, int64_t n) {
  if (type == DType::kBF16) {
    WidenRow(reinterpret_cast<const bf16*>(src), dst, n);
  } else {
    WidenRow(reinterpret_cast<const f16*>(src), dst, n);
  }
}

// Dot products of one key row kr against 4 query rows (qp, dim floats apart) over x < dv, one
// accumulator per row (a[r] lane l: the sum over x = l mod lanes).
template <class T>
HWY_INLINE void DotAccumulate4(const float* HWY_RESTRICT qp, int64_t dim, int64_t dv, const T* kr,
                               hn::Vec<DF>* a) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  a[0] = a[1] = a[2] = a[3] = hn::Zero(d);
  for (int64_t x = 0; x < dv; x += n) {
    const auto kv = LoadKV(d, kr + x);
    a[0] = hn::MulAdd(hn::LoadU(d, qp + x), kv, a[0]);
    a[1] = hn::MulAdd(hn::LoadU(d, qp + dim + x), kv, a[1]);
    a[2] = hn::MulAdd(hn::LoadU(d, qp + 2 * dim + x), kv, a[2]);
    a[3] = hn::MulAdd(hn::LoadU(d, qp + 3 * dim + x), kv, a[3]);
  }
}

// S[r][c] = q_r . k_c straight from row-major keys (no transposition), for few rows (decoding):
// each key row is loaded once and reduced against up to 4 query rows. Columns >= nk get 0.
template <class T>
HWY_INLINE void DotScores(const float* HWY_RESTRICT qp, int64_t dim, const T* k, int64_t kstride,
                          int64_t nk, int64_t rows_pad, float* HWY_RESTRICT s,
                          bool zero_tail = true) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const int64_t dv = dim / n * n;
  for (int64_t r = 0; r < rows_pad; r += 4) {
    const float* q0 = qp + r * dim;
    for (int64_t c = 0; c < nk; ++c) {
      const T* kr = k + c * kstride;
      hn::Vec<DF> a[4];
      DotAccumulate4(q0, dim, dv, kr, a);
      float t0 = hn::GetLane(hn::SumOfLanes(d, a[0])), t1 = hn::GetLane(hn::SumOfLanes(d, a[1]));
      float t2 = hn::GetLane(hn::SumOfLanes(d, a[2])), t3 = hn::GetLane(hn::SumOfLanes(d, a[3]));
      // Tails with explicit fused multiply-adds: the same bits whatever the compiler contracts
      // or vectorizes for each key type.
      for (int64_t x = dv; x < dim; ++x) {
        const float kx = to_float(kr[x]);
        t0 = std::fma(q0[x], kx, t0), t1 = std::fma(q0[dim + x], kx, t1);
        t2 = std::fma(q0[2 * dim + x], kx, t2), t3 = std::fma(q0[3 * dim + x], kx, t3);
      }
      s[r * kTileK + c] = t0, s[(r + 1) * kTileK + c] = t1;
      s[(r + 2) * kTileK + c] = t2, s[(r + 3) * kTileK + c] = t3;
    }
    for (int64_t c = nk; zero_tail && c < kTileK; ++c) {
      for (int64_t rr = 0; rr < 4; ++rr) s[(r + rr) * kTileK + c] = 0.0f;
    }
  }
}

// Decoding dot products. A half-precision cache is read in memory order, key by key and, within
// a key, head by head (one contiguous run per key in a [seq, heads, dim] cache): blocks of
// several keys per head made interleaved streams that were read much more slowly (measured on
// AVX-512). Each (key, head) gives 4 accumulators (4 query rows), folded at once into one vector of
// lanes / 4 partial sums per row; the partial vectors of lanes / 4 keys are then folded together.
// A float32 cache keeps blocks of lanes / 4 keys x 4 rows (DotBlock: each query vector loaded
// once per block), which measured faster for it; so does a half cache on 8-lane targets (AVX2,
// see kStreamHalfDecode), where it takes fewer instructions and cycles per (key, kv head)
// (figures in docs/performance.md, Measured design choices). Either way each score costs about two
// operations instead of a full horizontal sum, and every score is summed by the same tree of
// pairwise additions (the vector grouping does not change a bit). Targets with fewer than 4 float
// lanes use DotScores.
constexpr size_t kLanesMax = HWY_LANES(float);

// Half-precision caches on 8-lane targets (AVX2): both passes read the cache in key blocks and
// fetch their own rows kStreamAhead keys ahead (PrefetchRows `stream`), instead of fetching one
// pass's rows during the other (`ahead`, kept for 16-lane targets, where it was measured). On
// AVX2 that measured faster for bf16 and f16 decoding (figures in docs/performance.md); the
// same prefetch made no difference to a float32 cache, which goes without.
constexpr bool kStreamHalfDecode = kLanesMax == 8;
constexpr int64_t kStreamAhead = 16;

#if HWY_TARGET != HWY_SCALAR
constexpr bool kBlockedDecode = kLanesMax >= 4 && kLanesMax <= 16;

// Lane a + n / 2 folded onto lane a: lanes [0, n / 2) of the result hold x's, the others y's.
HWY_INLINE hn::Vec<DF> FoldHalves(DF d, hn::Vec<DF> x, hn::Vec<DF> y) {
  return hn::Add(hn::ConcatLowerLower(d, y, x), hn::ConcatUpperUpper(d, y, x));
}
// Adjacent lanes summed: lanes [0, n / 2) of the result hold x's pairs, the others y's.
HWY_INLINE hn::Vec<DF> FoldPairs(DF d, hn::Vec<DF> x, hn::Vec<DF> y) {
  return hn::Add(hn::ConcatEven(d, y, x), hn::ConcatOdd(d, y, x));
}

// v[0, n) (n = lanes) reduced: lane a of the result is the sum of the lanes of v[a].
HWY_INLINE hn::Vec<DF> ReduceTree(DF d, hn::Vec<DF>* v, size_t n) {
  for (size_t i = 0; i < n / 2; ++i) {
    v[i] = hn::Add(hn::ConcatLowerLower(d, v[2 * i + 1], v[2 * i]),
                   hn::ConcatUpperUpper(d, v[2 * i + 1], v[2 * i]));
  }
  for (size_t count = n / 2; count > 1; count /= 2) {
    for (size_t i = 0; i < count / 2; ++i) {
      v[i] = hn::Add(hn::ConcatEven(d, v[2 * i + 1], v[2 * i]),
                     hn::ConcatOdd(d, v[2 * i + 1], v[2 * i]));
    }
  }
  return v[0];
}

// Makes the compiler keep v in a register: without it GCC folds a query vector's load into each
// of the block's multiply-adds (one load per product instead of one per vector).
template <class V>
HWY_INLINE void KeepInRegister(V& v) {
#if HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG) && HWY_TARGET != HWY_SCALAR && \
    HWY_TARGET != HWY_EMU128
  asm("" : "+v"(v.raw));
#else
  (void)v;
#endif
}

// S[r][c] = q_r . k_c for 4 rows r (qp, dim floats apart) and keys c < kb <= lanes / 4 (rows
// kstride apart from k); S rows kTileK apart.
template <class T>
HWY_INLINE void DotBlock(const float* HWY_RESTRICT qp, int64_t dim, const T* k, int64_t kstride,
                         int64_t kb, float* HWY_RESTRICT s) {
  const DF d;
  constexpr size_t kMax = kBlockedDecode ? kLanesMax : 4;
  const size_t n = hn::Lanes(d), keys = n / 4;
  const int64_t nn = static_cast<int64_t>(n);
  const int64_t dv = dim / nn * nn;
  hn::Vec<DF> acc[kMax];
  for (size_t a = 0; a < n; ++a) acc[a] = hn::Zero(d);
  const T* kr[kMax / 4];
  for (size_t j = 0; j < keys; ++j) {
    kr[j] = k + std::min<int64_t>(static_cast<int64_t>(j), kb - 1) * kstride;
  }
  for (int64_t x = 0; x < dv; x += nn) {
    hn::Vec<DF> kv[kMax / 4];
    for (size_t j = 0; j < keys; ++j) kv[j] = LoadKV(d, kr[j] + x);
    for (size_t r = 0; r < 4; ++r) {
      auto qv = hn::LoadU(d, qp + static_cast<int64_t>(r) * dim + x);
      KeepInRegister(qv);
      for (size_t j = 0; j < keys; ++j)
        acc[r * keys + j] = hn::MulAdd(qv, kv[j], acc[r * keys + j]);
    }
  }
  HWY_ALIGN float sum[kMax];
  hn::Store(ReduceTree(d, acc, n), d, sum);
  if (kb == static_cast<int64_t>(keys) && dv == dim) {
    // A full block without tails: each row's kMax / 4 scores are one fixed-size copy (with the
    // query vectors kept in registers, measured faster for float32 decoding than the general
    // loop below; docs/performance.md).
    for (size_t r = 0; r < 4; ++r) {
      std::memcpy(s + static_cast<int64_t>(r) * kTileK, sum + r * (kMax / 4),
                  sizeof(float) * (kMax / 4));
    }
    return;
  }
  for (size_t r = 0; r < 4; ++r) {
    const float* q = qp + static_cast<int64_t>(r) * dim;
    for (int64_t j = 0; j < kb; ++j) {
      float t = sum[r * keys + static_cast<size_t>(j)];
      // Tails with explicit fused multiply-adds (the same bits for every key type).
      for (int64_t x = dv; x < dim; ++x) t = std::fma(q[x], to_float(kr[j][x]), t);
      s[static_cast<int64_t>(r) * kTileK + j] = t;
    }
  }
}
// Scores of one key (row kr) against 4 query rows (qp, dim floats apart), x < dv: lanes
// [r n / 4, (r + 1) n / 4) of the result are row r's partial sums.
template <class T>
HWY_INLINE hn::Vec<DF> DotKey4(const float* HWY_RESTRICT qp, int64_t dim, int64_t dv, const T* kr) {
  const DF d;
  hn::Vec<DF> a[4];
  DotAccumulate4(qp, dim, dv, kr, a);
  return FoldPairs(d, FoldHalves(d, a[0], a[1]), FoldHalves(d, a[2], a[3]));
}
#else
constexpr bool kBlockedDecode = false;
#endif

// Whether a cache whose keys are kstride apart and heads hstride apart is read head by head
// (each head's rows in key order) rather than key by key across heads: when the heads lie
// farther apart than the keys (head-major caches, [heads, seq] per batch row or per page), so
// that the passes read one run of memory at a time instead of one stream per head, each head's
// rows fetched kStreamAhead keys ahead within the head (prefetch_row_head; float32 caches too).
// Read key by key, a head-major float32 cache (8 kv heads 16 MB apart at 32k keys: 8 streams
// per pass, each crossing a 4 KB page every 8 keys) decoded 1.5x slower than a token-major one;
// head by head alone 1.3x, with the per-head prefetch at parity (Zen 3, 2 threads; `posenc bench
// --filter head_major`, docs/attention.md). The order changes no bit: each score is its own dot
// product, and each output row's multiply-adds stay in key order.
HWY_INLINE bool HeadsOuter(int64_t kstride, int64_t hstride) { return hstride > kstride; }

// Decoding, all kv heads at once: S[g gstride + r][c] = q_{g, r} . k_{c, g}, keys read in memory
// order (see above). gstride is a multiple of 4; columns >= nk get 0 (unless !zero_tail: then
// only columns < nk are written, as for the runs of a paged cache).
// part: nkv gstride lanes / 4 floats (aligned).
template <class T>
HWY_INLINE void DotScoresWide(const float* HWY_RESTRICT qp, int64_t dim, int64_t gstride,
                              int64_t nkv, const T* k, int64_t kstride, int64_t hstride, int64_t nk,
                              float* HWY_RESTRICT s, [[maybe_unused]] float* HWY_RESTRICT part,
                              [[maybe_unused]] const PrefetchRows& ahead,
                              [[maybe_unused]] const PrefetchRows& stream, bool zero_tail = true) {
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kBlockedDecode) {
    if constexpr (sizeof(T) != 2 || kLanesMax == 8) {
      // float32 (and half on AVX2): blocks of lanes / 4 keys x 4 rows (each query vector
      // loaded once per block), which reads a float32 cache faster than the key-by-key order
      // below.
      const int64_t keys = static_cast<int64_t>(hn::Lanes(DF())) / 4;
      // Key blocks across heads, or head by head (HeadsOuter): one loop nest either way (a single
      // copy of the block's code).
      const bool by_head = HeadsOuter(kstride, hstride);
      const int64_t nc = (nk + keys - 1) / keys;
      for (int64_t a = 0; a < (by_head ? nkv : nc); ++a) {
        for (int64_t b = 0; b < (by_head ? nc : nkv); ++b) {
          const int64_t g = by_head ? a : b, c = (by_head ? b : a) * keys;
          if (by_head) {  // each head's own rows fetched ahead
            for (int64_t j = 0; j < keys; ++j) {
              prefetch_row_head(ahead, c + j, g);
              prefetch_row_head(stream, c + j + kStreamAhead, g);
            }
          } else if (g == 0) {
            for (int64_t j = 0; j < keys; ++j) {
              prefetch_row(ahead, c + j);
              prefetch_row(stream, c + j + kStreamAhead);
            }
          }
          const int64_t kb = std::min(keys, nk - c);
          for (int64_t r = 0; r < gstride; r += 4) {
            DotBlock(qp + (g * gstride + r) * dim, dim, k + c * kstride + g * hstride, kstride, kb,
                     s + (g * gstride + r) * kTileK + c);
          }
        }
      }
    } else {
      const DF d;
      const int64_t n = static_cast<int64_t>(hn::Lanes(d)), keys = n / 4;
      const int64_t dv = dim / n * n, blocks = nkv * gstride / 4;
      // part: the partial vectors of a group of `keys` keys, [row block][key of the group][n].
      HWY_ALIGN float sum[kLanesMax];
      for (int64_t c0 = 0; c0 < nk; c0 += keys) {
        const int64_t kb = std::min(keys, nk - c0);
        for (int64_t j = 0; j < keys; ++j) {
          const T* kr = k + (c0 + std::min(j, kb - 1)) * kstride;  // past kb: a repeat, unused
          prefetch_row(ahead, c0 + j);
          for (int64_t g = 0; g < nkv; ++g) {
            for (int64_t r = 0; r < gstride; r += 4) {
              const int64_t blk = (g * gstride + r) / 4;
              hn::Store(DotKey4(qp + (g * gstride + r) * dim, dim, dv, kr + g * hstride), d,
                        part + (blk * keys + j) * n);
            }
          }
        }
        for (int64_t blk = 0; blk < blocks; ++blk) {
          // The remaining folds across the group's keys: lane j * 4 + r holds key j, row r.
          hn::Vec<DF> v[4];
          for (int64_t j = 0; j < keys; ++j) v[j] = hn::Load(d, part + (blk * keys + j) * n);
          for (int64_t count = keys; count > 1; count /= 2) {
            for (int64_t i = 0; i < count / 2; ++i) v[i] = FoldPairs(d, v[2 * i], v[2 * i + 1]);
          }
          hn::Store(v[0], d, sum);
          const float* q = qp + blk * 4 * dim;
          for (int64_t r = 0; r < 4; ++r) {
            for (int64_t j = 0; j < kb; ++j) {
              float t = sum[j * 4 + r];
              // Tails with explicit fused multiply-adds (the same bits for every key type).
              const T* kr = k + (c0 + j) * kstride + (blk * 4 / gstride) * hstride;
              for (int64_t x = dv; x < dim; ++x) t = std::fma(q[r * dim + x], to_float(kr[x]), t);
              s[(blk * 4 + r) * kTileK + c0 + j] = t;
            }
          }
        }
      }
    }
  } else
#endif
  {
    for (int64_t c = 0; c < nk; ++c) {
      for (int64_t g = 0; g < nkv; ++g) {
        DotScores(qp + g * gstride * dim, dim, k + c * kstride + g * hstride, kstride, 1, gstride,
                  s + g * gstride * kTileK + c, /*zero_tail=*/false);
      }
    }
  }
  for (int64_t r = 0; zero_tail && r < nkv * gstride; ++r) {
    std::fill(s + r * kTileK + nk, s + (r + 1) * kTileK, 0.0f);
  }
}

// Bit c of seen[b] (c < nk): some row of the 4-row block b has a nonzero weight for key c.
HWY_INLINE void SeenKeys(const float* HWY_RESTRICT pm, int64_t rows, int64_t nk, uint64_t* seen) {
  static_assert(kTileK <= 64, "one 64-bit word per block");
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t b = 0; b < rows / 4; ++b) {
    uint64_t bits = 0;
    for (int64_t c = 0; c < nk; c += n) {
      const float* p = pm + b * 4 * kTileK + c;
      const auto z = hn::Zero(d);
      const auto m = hn::Or(
          hn::Or(hn::Ne(hn::Load(d, p), z), hn::Ne(hn::Load(d, p + kTileK), z)),
          hn::Or(hn::Ne(hn::Load(d, p + 2 * kTileK), z), hn::Ne(hn::Load(d, p + 3 * kTileK), z)));
      uint8_t mb[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      hn::StoreMaskBits(d, m, mb);
      uint64_t w = 0;
      for (size_t i = 0; i < 8; ++i) w |= uint64_t{mb[i]} << (8 * i);
      if (n < 64) w &= (uint64_t{1} << n) - 1;
      bits |= w << c;
    }
    if (nk < 64) bits &= (uint64_t{1} << nk) - 1;
    seen[b] = bits;
  }
}

// Decoding PV from a half-precision cache: per 4-row block and run of NV output vectors, the
// 4 x NV accumulators stay in registers over all the tile's keys (the values of one head are
// read as columns of the tile, which the prefetch put in L2), so each output vector is loaded
// and stored once per tile instead of once per 4 keys. Each output element is the same chain of
// fused multiply-adds in key order as in AccumulateWide; keys that no row of the block sees are
// skipped (their values never reach the output).
template <int NV, class T>
HWY_INLINE void AccumulateColumns(const float* HWY_RESTRICT pm, int64_t nk, const T* v,
                                  int64_t vstride, uint64_t bits, int64_t x0, int64_t dpad,
                                  float* HWY_RESTRICT o) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<DF> a[4][NV];
  for (int64_t r = 0; r < 4; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = hn::Load(d, o + r * dpad + x0 + j * n);
  for (int64_t c = 0; c < nk; ++c) {
    if (((bits >> c) & 1) == 0) continue;
    const T* vr = v + c * vstride + x0;
    hn::Vec<DF> vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = LoadKV(d, vr + j * n);
    for (int64_t r = 0; r < 4; ++r) {
      const auto w = hn::Set(d, pm[r * kTileK + c]);
      for (int j = 0; j < NV; ++j) a[r][j] = hn::MulAdd(w, vv[j], a[r][j]);
    }
  }
  for (int64_t r = 0; r < 4; ++r)
    for (int j = 0; j < NV; ++j) hn::Store(a[r][j], d, o + r * dpad + x0 + j * n);
}

template <class T>
HWY_INLINE void AccumulateWideColumns(const float* HWY_RESTRICT pm, int64_t nk, const T* v,
                                      int64_t vstride, int64_t hstride, int64_t nkv,
                                      int64_t gstride, int64_t dim, int64_t dpad,
                                      float* HWY_RESTRICT o, const uint64_t* seen,
                                      const PrefetchRows& ahead) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const int64_t dv = dim / n * n;
  const int64_t blocks = nkv * gstride / 4;
  for (int64_t g = 0; g < nkv; ++g) {
    const T* vg = v + g * hstride;
    for (int64_t r0 = g * gstride; r0 < (g + 1) * gstride; r0 += 4) {
      // The next tile's keys, spread over the blocks.
      for (int64_t c = r0 / 4 * kTileK / blocks; c < (r0 / 4 + 1) * kTileK / blocks; ++c) {
        prefetch_row(ahead, c);
      }
      const uint64_t bits = seen[r0 / 4];
      if (bits == 0) continue;
      const float* pb = pm + r0 * kTileK;
      float* ob = o + r0 * dpad;
      int64_t x0 = 0;
      for (; x0 + 4 * n <= dv; x0 += 4 * n) {
        AccumulateColumns<4>(pb, nk, vg, vstride, bits, x0, dpad, ob);
      }
      switch ((dv - x0) / n) {
        case 3:
          AccumulateColumns<3>(pb, nk, vg, vstride, bits, x0, dpad, ob);
          break;
        case 2:
          AccumulateColumns<2>(pb, nk, vg, vstride, bits, x0, dpad, ob);
          break;
        case 1:
          AccumulateColumns<1>(pb, nk, vg, vstride, bits, x0, dpad, ob);
          break;
        default:
          break;
      }
      for (int64_t c = 0; dv < dim && c < nk; ++c) {  // tails, key by key
        if (((bits >> c) & 1) == 0) continue;
        for (int64_t r = 0; r < 4; ++r) {
          const float w = pb[r * kTileK + c];
          for (int64_t x = dv; x < dim; ++x) {
            ob[r * dpad + x] = std::fma(w, to_float(vg[c * vstride + x]), ob[r * dpad + x]);
          }
        }
      }
    }
  }
}

// Decoding PV, all kv heads at once (key loop outside): O[g gstride + r][:] +=
// P[g gstride + r][c] * v_{c, g}. O and P stay in L1; V is read key by key across heads (head
// by head when head-major, see HeadsOuter), in blocks of 4 keys x 4 rows: each value vector is
// loaded (widened) once per block and each O vector loaded and stored once per block. A key no row
// of the block sees (weight 0 in every row) is not read, so values under the mask never reach the
// output. `stream`: the cache's own rows, fetched kStreamAhead keys ahead (empty: none).
template <class T>
HWY_INLINE void AccumulateWide(const float* HWY_RESTRICT pm, int64_t nk, const T* v,
                               int64_t vstride, int64_t hstride, int64_t nkv, int64_t gstride,
                               int64_t dim, int64_t dpad, float* HWY_RESTRICT o,
                               const PrefetchRows& stream) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const int64_t dv = dim / n * n;
  constexpr int64_t kKeys = 4, kRows = 4;
  // Key blocks across heads, or head by head (HeadsOuter): one loop nest either way (a single
  // copy of the block's code).
  const bool by_head = HeadsOuter(vstride, hstride);
  const int64_t nc = (nk + kKeys - 1) / kKeys;
  for (int64_t a = 0; a < (by_head ? nkv : nc); ++a) {
    for (int64_t b = 0; b < (by_head ? nc : nkv); ++b) {
      const int64_t g = by_head ? a : b, c = (by_head ? b : a) * kKeys;
      if (by_head) {  // each head's own rows fetched ahead
        for (int64_t j = 0; j < kKeys; ++j) prefetch_row_head(stream, c + j + kStreamAhead, g);
      } else if (g == 0) {
        for (int64_t j = 0; j < kKeys; ++j) prefetch_row(stream, c + j + kStreamAhead);
      }
      const int64_t kb = std::min(kKeys, nk - c);
      for (int64_t r0 = g * gstride; r0 < (g + 1) * gstride; r0 += kRows) {
        // Weights of the block (0 past kb), and which keys any of its rows sees.
        float pw[kRows][kKeys];
        bool used[kKeys] = {false, false, false, false};
        bool any = false;
        for (int64_t rr = 0; rr < kRows; ++rr)
          for (int64_t j = 0; j < kKeys; ++j) {
            pw[rr][j] = j < kb ? pm[(r0 + rr) * kTileK + c + j] : 0.0f;
            used[j] = used[j] || pw[rr][j] != 0.0f;
          }
        for (int64_t j = 0; j < kKeys; ++j) any = any || used[j];
        if (!any) continue;
        const T* vr[kKeys];
        for (int64_t j = 0; j < kKeys; ++j) vr[j] = v + (c + j) * vstride + g * hstride;
        // kAll: every key of the block seen (decoding without a mask), the loop without tests;
        // otherwise the unseen keys' vectors are zero. The same multiply-adds either way.
        const auto block = [&](auto all) {
          constexpr bool kAll = decltype(all)::value;
          for (int64_t x = 0; x < dv; x += n) {
            hn::Vec<DF> vv[kKeys];
            for (int64_t j = 0; j < kKeys; ++j) {
              vv[j] = kAll || used[j] ? LoadKV(d, vr[j] + x) : hn::Zero(d);
            }
            for (int64_t rr = 0; rr < kRows; ++rr) {
              float* orow = o + (r0 + rr) * dpad + x;
              auto acc = hn::Load(d, orow);
              for (int64_t j = 0; j < kKeys; ++j) {
                acc = hn::MulAdd(hn::Set(d, pw[rr][j]), vv[j], acc);
              }
              hn::Store(acc, d, orow);
            }
          }
        };
        if (used[0] && used[1] && used[2] && used[3]) {
          block(std::true_type{});
        } else {
          block(std::false_type{});
        }
        for (int64_t rr = 0; rr < kRows; ++rr) {
          float* orow = o + (r0 + rr) * dpad;
          for (int64_t x = dv; x < dim; ++x) {
            float t = orow[x];
            for (int64_t j = 0; j < kKeys; ++j) {
              if (used[j]) t = std::fma(pw[rr][j], to_float(vr[j][x]), t);
            }
            orow[x] = t;
          }
        }
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // POSENC_KERNELS_DECODE_INL_H_
