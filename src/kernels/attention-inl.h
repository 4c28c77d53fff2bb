// src/kernels/attention-inl.h - micro-kernels shared by the fused attention forward
// (attention_hwy.cc) and backward (attention_backward_hwy.cc): score tiles S = Q . Kt, the
// P . V accumulation and a dot product, per Highway target.
//
// Included once per target by the kernels' .cc files after hwy/foreach_target.h (the guard
// below re-expands for each target).
#if defined(POSENC_KERNELS_ATTENTION_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_ATTENTION_INL_H_
#undef POSENC_KERNELS_ATTENTION_INL_H_
#else
#define POSENC_KERNELS_ATTENTION_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "hwy/highway.h"
#include "kernels/fetch_queue.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;

// Keys per tile: a multiple of every target's lane count (<= 16 floats).
constexpr int64_t kTileK = 64;

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Targets with 16 vector registers of 8 floats (AVX2) also run the score and P.V micro-kernels
// on blocks of 6 rows (12 accumulators).
constexpr bool kSixRows = HWY_MAX_BYTES == 32 && HWY_TARGET != HWY_SCALAR;

// About how many register blocks ScoresTile and AccumulateTile run for `tiles` score tiles of
// rows_pad rows and `passes` P.V passes over dpad columns: the steps that fetch a FetchQueue's
// lines.
inline int64_t ProductBlocks(int64_t rows_pad, int64_t dpad, int64_t tiles, int64_t passes) {
  const int64_t n = static_cast<int64_t>(hn::Lanes(DF()));
  const int64_t w = (HWY_MAX_BYTES >= 64 ? 4 : 2) * n;  // columns per block
  const int64_t rows = kSixRows ? 6 : 4;
  return (rows_pad + rows - 1) / rows *
         (tiles * ((kTileK + w - 1) / w) + passes * ((dpad + w - 1) / w));
}

// The micro-kernel of both products: for R rows i and V vectors of columns,
// C[i][x] (+)= sum_{k < kn} A[i * as + k] * B[k * bs + x], x < V lanes (rows of C cs apart; C
// loaded first when `load`, else zero). Each element is one chain of fused multiply-adds in k
// order, whatever R and V: 4 x 4 (16 accumulators, AVX-512's 32 registers), 4 x 2 and 6 x 2
// (8 and 12, AVX2's 16), and fewer vectors where a causal diagonal tile's rows need fewer keys.
template <int R, int V>
HWY_INLINE void Block(const float* HWY_RESTRICT a, int64_t as, const float* b, int64_t bs,
                      int64_t kn, float* HWY_RESTRICT c, int64_t cs, bool load) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<DF> acc[R][V];
  HWY_UNROLL(6)
  for (int i = 0; i < R; ++i) {
    HWY_UNROLL(4)
    for (int j = 0; j < V; ++j) acc[i][j] = load ? hn::LoadU(d, c + i * cs + j * n) : hn::Zero(d);
  }
  for (int64_t k = 0; k < kn; ++k) {
    hn::Vec<DF> bv[V];
    HWY_UNROLL(4)
    for (int j = 0; j < V; ++j) bv[j] = hn::LoadU(d, b + k * bs + j * n);
    HWY_UNROLL(6)
    for (int i = 0; i < R; ++i) {
      const auto w = hn::Set(d, a[i * as + k]);
      HWY_UNROLL(4)
      for (int j = 0; j < V; ++j) acc[i][j] = hn::MulAdd(w, bv[j], acc[i][j]);
    }
  }
  HWY_UNROLL(6)
  for (int i = 0; i < R; ++i) {
    HWY_UNROLL(4)
    for (int j = 0; j < V; ++j) hn::StoreU(acc[i][j], d, c + i * cs + j * n);
  }
}

// The columns rows [r, r + R) need: the largest of cols[r..r + R) (cols: per row, how many of
// the tile's first columns it sees), or all `all` columns when there is no such bound.
HWY_INLINE int64_t BlockColumns(const int32_t* cols, int64_t r, int64_t rows, int64_t all) {
  if (cols == nullptr) return all;
  int32_t most = 0;
  for (int64_t i = r; i < r + rows; ++i) most = std::max(most, cols[i]);
  return std::min<int64_t>(most, all);
}

// S[r][c] = sum_{k < dim} Qp[r][k] * Kt[k][c] for r < rows_pad (multiple of 4), c < kTileK; Qp
// rows qs floats apart (0: dim), S rows ss apart; accumulate: S += instead of S =. cols (may be
// null): per row, the number of leading columns it needs (a causal diagonal tile); each block of
// rows then computes only the vectors of columns its rows need, and leaves the others unwritten.
HWY_INLINE void ScoresTile(const float* HWY_RESTRICT qp, int64_t dim, const float* HWY_RESTRICT kt,
                           int64_t rows_pad, float* HWY_RESTRICT s, int64_t ss = kTileK,
                           int64_t qs = 0, bool accumulate = false, const int32_t* cols = nullptr,
                           FetchQueue* fetch = nullptr, int64_t fetch_n = 0) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  if (qs == 0) qs = dim;
  // Column chunk: 4 vectors when registers allow (AVX-512: 32 registers), else 2.
  const int64_t cv = HWY_MAX_BYTES >= 64 ? 4 : 2;
  const int64_t chunk = cv * n;
  int64_t r = 0;
  if constexpr (kSixRows) {
    // 6 rows x 2 vectors: 12 accumulators (of 16 registers), so that 12 independent chains of
    // fused multiply-adds cover their latency; the rest in blocks of 4. Each score is the same
    // chain in k order either way.
    for (const int64_t end = rows_pad / 12 * 12; r < end; r += 6) {
      const int64_t nc = BlockColumns(cols, r, 6, kTileK);
      for (int64_t c0 = 0; c0 < nc; c0 += 2 * n) {
        float* s0 = s + r * ss + c0;
        if (nc - c0 > n) {
          Block<6, 2>(qp + r * qs, qs, kt + c0, kTileK, dim, s0, ss, accumulate);
        } else {  // the rows need one more vector of columns only
          Block<6, 1>(qp + r * qs, qs, kt + c0, kTileK, dim, s0, ss, accumulate);
        }
        if (fetch != nullptr) fetch->Issue(fetch_n);
      }
    }
  }
  for (; r < rows_pad; r += 4) {
    const float* q0 = qp + r * qs;
    const int64_t nc = BlockColumns(cols, r, 4, kTileK);
    for (int64_t c0 = 0; c0 < nc; c0 += chunk) {
      // The chunk's vectors: fewer in the last chunk when the rows need fewer columns.
      const int64_t nv = std::min<int64_t>(cv, (nc - c0 + n - 1) / n);
      float* s0 = s + r * ss + c0;
      if (nv == 4) {
        Block<4, 4>(q0, qs, kt + c0, kTileK, dim, s0, ss, accumulate);
      } else if (nv == 3) {
        Block<4, 3>(q0, qs, kt + c0, kTileK, dim, s0, ss, accumulate);
      } else if (nv == 2) {
        Block<4, 2>(q0, qs, kt + c0, kTileK, dim, s0, ss, accumulate);
      } else {
        Block<4, 1>(q0, qs, kt + c0, kTileK, dim, s0, ss, accumulate);
      }
      if (fetch != nullptr) fetch->Issue(fetch_n);
    }
  }
}

// O[r][:] += sum_{c < nk} P[r][c] * V[c][:] for r < rows_pad (multiple of 4); columns
// [0, dpad) with dpad a multiple of lanes; V rows vstride floats apart with at least dpad
// readable. P rows are ps floats apart (default kTileK), O rows os floats apart (0: dpad). cols
// (may be null): per row, how many leading columns of P it needs (see ScoresTile); each block of
// rows reads only as many. accumulate false: O = instead of O += (every row and column written).
HWY_INLINE void AccumulateTile(const float* HWY_RESTRICT pm, int64_t nk, const float* v,
                               int64_t vstride, int64_t dpad, int64_t rows_pad,
                               float* HWY_RESTRICT o, int64_t ps = kTileK, int64_t os = 0,
                               const int32_t* cols = nullptr, FetchQueue* fetch = nullptr,
                               int64_t fetch_n = 0, bool accumulate = true) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  const int64_t dv = HWY_MAX_BYTES >= 64 ? 4 : 2;
  if (os == 0) os = dpad;
  int64_t r = 0;
  if constexpr (kSixRows) {
    // 6 rows x 2 vectors (see ScoresTile); dpad is a multiple of 2 vectors here or the rest of
    // the row goes to the blocks of 4 below.
    if (dpad % (2 * n) == 0) {
      for (const int64_t end = rows_pad / 12 * 12; r < end; r += 6) {
        const int64_t kn = BlockColumns(cols, r, 6, nk);
        for (int64_t x0 = 0; x0 < dpad; x0 += 2 * n) {
          Block<6, 2>(pm + r * ps, ps, v + x0, vstride, kn, o + r * os + x0, os, accumulate);
          if (fetch != nullptr) fetch->Issue(fetch_n);
        }
      }
    }
  }
  for (; r < rows_pad; r += 4) {
    const float* p0 = pm + r * ps;
    float* o0 = o + r * os;
    const int64_t kn = BlockColumns(cols, r, 4, nk);
    for (int64_t x0 = 0; x0 < dpad; x0 += dv * n) {
      if (fetch != nullptr) fetch->Issue(fetch_n);
      const int64_t nv = std::min<int64_t>(dv, (dpad - x0) / n);
      if (nv == 4) {
        Block<4, 4>(p0, ps, v + x0, vstride, kn, o0 + x0, os, accumulate);
      } else if (nv == 2) {
        // Two vectors x 4 rows: 8 independent accumulators.
        Block<4, 2>(p0, ps, v + x0, vstride, kn, o0 + x0, os, accumulate);
      } else {
        for (int64_t xv = 0; xv < nv; ++xv) {
          const int64_t x = x0 + xv * n;
          auto a0 = hn::Zero(d), a1 = a0, a2 = a0, a3 = a0;
          if (accumulate) {
            a0 = hn::LoadU(d, o0 + x), a1 = hn::LoadU(d, o0 + os + x);
            a2 = hn::LoadU(d, o0 + 2 * os + x), a3 = hn::LoadU(d, o0 + 3 * os + x);
          }
          for (int64_t c = 0; c < kn; ++c) {
            const auto vv = hn::LoadU(d, v + c * vstride + x);
            a0 = hn::MulAdd(hn::Set(d, p0[c]), vv, a0);
            a1 = hn::MulAdd(hn::Set(d, p0[ps + c]), vv, a1);
            a2 = hn::MulAdd(hn::Set(d, p0[2 * ps + c]), vv, a2);
            a3 = hn::MulAdd(hn::Set(d, p0[3 * ps + c]), vv, a3);
          }
          hn::StoreU(a0, d, o0 + x), hn::StoreU(a1, d, o0 + os + x);
          hn::StoreU(a2, d, o0 + 2 * os + x), hn::StoreU(a3, d, o0 + 3 * os + x);
        }
      }
    }
  }
}

// kt[x * os + c] = rows[c * rs + x] for c < nk, x < dim (os: kTileK by default): a tile of key
// rows transposed (or, with the roles swapped, a transposed tile written back as rows). In 4 x 4
// blocks of 128-bit vectors (eight even/odd concatenations per block, on every target but scalar),
// one cache line of the key rows (16 floats) at a time across all rows, so that the 16 rows of the
// tile it fills stay in L1 (column by column, the 256-byte stride of those rows put each store on
// another line, and a 64-key tile of 128 dimensions is all of a 32 KiB L1).
HWY_INLINE void TransposeRows(const float* HWY_RESTRICT rows, int64_t rs, int64_t nk, int64_t dim,
                              float* HWY_RESTRICT kt, int64_t os = kTileK) {
  int64_t nk4 = 0, dim4 = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::Full128<float> d4;
  nk4 = nk / 4 * 4;
  dim4 = dim / 4 * 4;
  for (int64_t x0 = 0; x0 < dim4; x0 += 16) {
    const int64_t x1 = std::min(dim4, x0 + 16);
    for (int64_t c = 0; c < nk4; c += 4) {
      const float* r0 = rows + c * rs;
      for (int64_t x = x0; x < x1; x += 4) {
        const auto a = hn::LoadU(d4, r0 + x), b = hn::LoadU(d4, r0 + rs + x);
        const auto e = hn::LoadU(d4, r0 + 2 * rs + x), f = hn::LoadU(d4, r0 + 3 * rs + x);
        // Even and odd lanes of row pairs, then of those: whole-vector operations only.
        const auto ab_even = hn::ConcatEven(d4, b, a), ab_odd = hn::ConcatOdd(d4, b, a);
        const auto ef_even = hn::ConcatEven(d4, f, e), ef_odd = hn::ConcatOdd(d4, f, e);
        float* out = kt + x * os + c;
        hn::StoreU(hn::ConcatEven(d4, ef_even, ab_even), d4, out);  // lane 0 of a, b, e, f
        hn::StoreU(hn::ConcatEven(d4, ef_odd, ab_odd), d4, out + os);
        hn::StoreU(hn::ConcatOdd(d4, ef_even, ab_even), d4, out + 2 * os);
        hn::StoreU(hn::ConcatOdd(d4, ef_odd, ab_odd), d4, out + 3 * os);
      }
    }
  }
#endif
  for (int64_t c = 0; c < nk; ++c) {
    const float* kr = rows + c * rs;
    for (int64_t x = c < nk4 ? dim4 : 0; x < dim; ++x) kt[x * os + c] = kr[x];
  }
}

// Dot product of two float rows of length dim (for per-query / per-key projections).
HWY_INLINE float Dot(const float* a, const float* b, int64_t dim) {
  const DF d;
  const int64_t n = static_cast<int64_t>(hn::Lanes(d));
  auto acc = hn::Zero(d);
  int64_t k = 0;
  for (; k + n <= dim; k += n) acc = hn::MulAdd(hn::LoadU(d, a + k), hn::LoadU(d, b + k), acc);
  float s = hn::GetLane(hn::SumOfLanes(d, acc));
  for (; k < dim; ++k) s += a[k] * b[k];
  return s;
}

// exp(x) in float32 for the forward's softmax, whose arguments are a score minus its row's
// maximum (x <= 0, -inf for a hidden score): x = n ln 2 + r with n = round(x / ln 2) and ln 2 in
// two parts, e^r by a polynomial of degree 6 (1 + r + ...: exactly 1 at r = 0) fitted for
// relative error on |r| <= ln(2) / 2 (3.7e-9 in exact arithmetic), times 2^n written into the
// exponent bits. Within one ulp of exp(x) wherever that is at least 2^-126 (0.88 ulp measured;
// 1.17 on targets without fused multiply-adds); exactly 1 at x = 0; below 2^-126 (x < -87.34)
// subnormal, and exactly 0 from n = -127 (x < -87.68) down to -inf, so a hidden score adds
// exactly nothing. 15 operations against about 26 of Highway's Exp, which also serves positive
// arguments (the backward's exp(S - lse) keeps it: there lse comes from the caller). NaN gives
// 0 (the kernels report non-finite scores before).
template <class D, class V = hn::Vec<D>>
HWY_INLINE V ExpSoftmax(D d, V x) {
  const hn::RebindToSigned<D> di;
  // -127 ln 2 rounded up: n = -127 there, whose 2^n has all-zero bits.
  const auto xc = hn::Max(x, hn::Set(d, -88.02969f));
  const auto n = hn::Round(hn::Mul(xc, hn::Set(d, 1.44269504088896341f)));
  auto r = hn::MulAdd(n, hn::Set(d, -0.693145751953125f), xc);  // exact: ln 2's first 16 bits
  r = hn::MulAdd(n, hn::Set(d, -1.428606765330187045e-6f), r);
  auto p = hn::Set(d, 0.0013879612256435339f);
  p = hn::MulAdd(p, r, hn::Set(d, 0.008368897787600452f));
  p = hn::MulAdd(p, r, hn::Set(d, 0.04166723340258259f));
  p = hn::MulAdd(p, r, hn::Set(d, 0.16666519181401968f));
  p = hn::MulAdd(p, r, hn::Set(d, 0.4999999822327935f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  const auto bits = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));
  return hn::Mul(p, hn::BitCast(d, bits));
}

// Soft-capping of scores, cap * tanh(x / cap) = x P(y^2) / Q(y^2) with y = x / cap: a rational
// minimax fit of tanh(y) / y for relative error (4.4e-8 in exact arithmetic with the float32
// coefficients below) on |y| <= 9, past which tanh(y) rounds to +-1 in float32 (x is clamped to
// +-9 cap). Multiplying x itself, not cap * y, spares a rounding: in float32 the capped score's
// relative error is within 3.9 * 2^-24 where |x| < cap (cap * std::tanh(x / cap) in float32:
// 4.1 * 2^-24) and its absolute error within 6.5 * 2^-24 * cap everywhere (std::tanh: 2.5). Nine
// fused multiply-adds and one division: a quarter of the cost of an exponential-based tanh on AVX2
// (the forward's cap costs under 5% of its time). The backward keeps the exponential-based tanh:
// its factor 1 - t^2 loses the relative accuracy of t near saturation (|y| of 3 or more), where
// the extra ulps of this form would show in dq and dk. NaN stays NaN (the kernels report
// non-finite scores); +-inf becomes +-cap.
template <class D, class V = hn::Vec<D>>
HWY_INLINE V SoftCap(D d, V x, V cap, V inv_cap) {
  const auto lim = hn::Mul(hn::Set(d, 9.0f), cap);
  const auto xc = hn::Min(hn::Max(x, hn::Neg(lim)), lim);
  const auto y = hn::Mul(xc, inv_cap);
  const auto y2 = hn::Mul(y, y);
  auto p = hn::MulAdd(hn::Set(d, 1.3420033084798888e-08f), y2, hn::Set(d, 2.0661424059653655e-05f));
  p = hn::MulAdd(p, y2, hn::Set(d, 0.0034990061540156603f));
  p = hn::MulAdd(p, y2, hn::Set(d, 0.13383989036083221f));
  p = hn::MulAdd(p, y2, hn::Set(d, 1.0f));
  auto q = hn::MulAdd(hn::Set(d, 7.804818551448989e-07f), y2, hn::Set(d, 0.00032910547452047467f));
  q = hn::MulAdd(q, y2, hn::Set(d, 0.02589024417102337f));
  q = hn::MulAdd(q, y2, hn::Set(d, 0.46717312932014465f));
  q = hn::MulAdd(q, y2, hn::Set(d, 1.0f));
  return hn::IfThenElse(hn::IsNaN(x), x, hn::Div(hn::Mul(xc, p), q));
}
}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // POSENC_KERNELS_ATTENTION_INL_H_
