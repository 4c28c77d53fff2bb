// src/kernels/rope_hwy.cc - float32 rotary position embedding (RoPE, Su et al. 2021, SPEC §3)
// with accurate angles (SPEC §10), Highway dynamic dispatch.
//
// For every token (b, i) at position p and pair k < R/2, with w_k = inv_freq[k]:
//   a = p * w_k (double, the same product the float64 reference forms),
//   c = cos(a) * af,  s = +-sin(a) * af  (sign - for Direction::kInverse),
//   half:         y[k] = x[k] c - x[k+R/2] s,  y[k+R/2] = x[k+R/2] c + x[k] s
//   interleaved:  y[2k] = x[2k] c - x[2k+1] s, y[2k+1] = x[2k+1] c + x[2k] s
// and dims >= R are copied through.
//
// Precision. The angle is reduced modulo pi/2 in double with a four-part Cody-Waite constant
// whose first three parts have 22 significant bits, so k * part is exact for |k| < 2^31 and the
// first subtraction is exact; the residual error is ~1e-16 rad, independent of p up to
// |a| = 2^31. cos/sin of the reduced argument (|r| <= pi/4) come from their Taylor series to
// degree 18/17 (truncation < 1e-19), and the rotation is formed in double from the float inputs
// and rounded once to float32. The output therefore equals the float64 reference rounded to float32
// except when that value lies within ~1e-15 relative of a rounding boundary (then it may differ by
// one ulp of the output). Lanes with |a| > 2^31 (positions beyond ~2^31 at the fastest frequency)
// take std::cos/std::sin of the same double angle, as the reference does.
//
// Cost. cos/sin are computed once per (token, pair) into a small per-item table and reused by
// every head of every tensor (q and k in the fused entry point): at 32 heads of 128 dims the table
// is a few percent of the work, and the rotation itself (float -> double, 2 mul + 2 fma, double
// -> float) stays well below the cost of streaming the tensor through memory.
//
// Threads. Work items are (batch row, block of tokens); a token is never split, and each output
// element is computed by the same instructions whatever the thread count or block size, so the
// results are bit-identical for any number of threads.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "hwy/aligned_allocator.h"
#include "kernels/parallel.h"
#include "kernels/rope_kernels.h"
#include "kernels/simd.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/rope_hwy.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;

// 2/pi and pi/2 = kPio2A + kPio2B + kPio2C + kPio2D: A, B, C have 22 significant bits (exact
// products with integers below 2^31), D is the double nearest the rest (pi/2 to ~2^-122).
constexpr double kTwoOverPi = 0.63661977236758134308;
constexpr double kPio2A = 0x1.921fbp+0;
constexpr double kPio2B = 0x1.5110bp-22;
constexpr double kPio2C = 0x1.1846980p-44;
constexpr double kPio2D = 0x1.3198a2e037073p-69;
// Largest |angle| reduced in SIMD: |round(a * 2/pi)| < 2^31 keeps the products above exact.
constexpr double kVectorAngleLimit = 2147483648.0;

// Taylor coefficients 1/n! (alternating signs), folded to double at compile time.
constexpr double kS3 = -1.0 / 6.0;
constexpr double kS5 = kS3 / -20.0;
constexpr double kS7 = kS5 / -42.0;
constexpr double kS9 = kS7 / -72.0;
constexpr double kS11 = kS9 / -110.0;
constexpr double kS13 = kS11 / -156.0;
constexpr double kS15 = kS13 / -210.0;
constexpr double kS17 = kS15 / -272.0;
constexpr double kC2 = -0.5;
constexpr double kC4 = kC2 / -12.0;
constexpr double kC6 = kC4 / -30.0;
constexpr double kC8 = kC6 / -56.0;
constexpr double kC10 = kC8 / -90.0;
constexpr double kC12 = kC10 / -132.0;
constexpr double kC14 = kC12 / -182.0;
constexpr double kC16 = kC14 / -240.0;
constexpr double kC18 = kC16 / -306.0;

#if HWY_HAVE_FLOAT64

using DD = hn::ScalableTag<double>;
using VD = hn::Vec<DD>;
using DF = hn::Rebind<float, DD>;  // as many floats as a double vector has lanes

// cos(a) and sin(a) for |a| <= kVectorAngleLimit, to ~1e-16 absolute.
HWY_INLINE void CosSin(DD d, VD a, VD& cos_a, VD& sin_a) {
  const VD k = hn::Round(hn::Mul(a, hn::Set(d, kTwoOverPi)));
  // a - k pi/2: k * kPio2A is exact and so is its difference with a (Cody-Waite); the later
  // parts are corrections well below a double ulp of pi/4. Fused or not, the result is the same
  // to ~1e-16.
  VD r = hn::NegMulAdd(k, hn::Set(d, kPio2A), a);
  r = hn::NegMulAdd(k, hn::Set(d, kPio2B), r);
  r = hn::NegMulAdd(k, hn::Set(d, kPio2C), r);
  r = hn::NegMulAdd(k, hn::Set(d, kPio2D), r);

  const VD r2 = hn::Mul(r, r);
  VD ps = hn::MulAdd(r2, hn::Set(d, kS17), hn::Set(d, kS15));
  ps = hn::MulAdd(ps, r2, hn::Set(d, kS13));
  ps = hn::MulAdd(ps, r2, hn::Set(d, kS11));
  ps = hn::MulAdd(ps, r2, hn::Set(d, kS9));
  ps = hn::MulAdd(ps, r2, hn::Set(d, kS7));
  ps = hn::MulAdd(ps, r2, hn::Set(d, kS5));
  ps = hn::MulAdd(ps, r2, hn::Set(d, kS3));
  const VD sin_r = hn::MulAdd(hn::Mul(ps, r2), r, r);
  VD pc = hn::MulAdd(r2, hn::Set(d, kC18), hn::Set(d, kC16));
  pc = hn::MulAdd(pc, r2, hn::Set(d, kC14));
  pc = hn::MulAdd(pc, r2, hn::Set(d, kC12));
  pc = hn::MulAdd(pc, r2, hn::Set(d, kC10));
  pc = hn::MulAdd(pc, r2, hn::Set(d, kC8));
  pc = hn::MulAdd(pc, r2, hn::Set(d, kC6));
  pc = hn::MulAdd(pc, r2, hn::Set(d, kC4));
  pc = hn::MulAdd(pc, r2, hn::Set(d, kC2));
  const VD cos_r = hn::MulAdd(pc, r2, hn::Set(d, 1.0));

  // Quadrant q = k mod 4 (exact: k is an integer below 2^31): a = r + q pi/2.
  const VD q = hn::NegMulAdd(hn::Floor(hn::Mul(k, hn::Set(d, 0.25))), hn::Set(d, 4.0), k);
  const auto q1 = hn::Eq(q, hn::Set(d, 1.0));
  const auto q2 = hn::Eq(q, hn::Set(d, 2.0));
  const auto q3 = hn::Eq(q, hn::Set(d, 3.0));
  const auto odd = hn::Or(q1, q3);
  const VD s = hn::IfThenElse(odd, cos_r, sin_r);
  const VD c = hn::IfThenElse(odd, sin_r, cos_r);
  sin_a = hn::IfThenElse(hn::Or(q2, q3), hn::Neg(s), s);
  cos_a = hn::IfThenElse(hn::Or(q1, q2), hn::Neg(c), c);
}

#endif  // HWY_HAVE_FLOAT64

// c[k] = cos(pos w_k) af, s[k] = sign sin(pos w_k) af for k < n (n a multiple of the vector
// length; `inv_freq` zero-padded to n).
void FillCosSin(const double* HWY_RESTRICT inv_freq, size_t n, double pos, double af, double sign,
                double* HWY_RESTRICT c, double* HWY_RESTRICT s) {
  size_t k = 0;
#if HWY_HAVE_FLOAT64
  const DD d;
  const size_t lanes = hn::Lanes(d);
  const VD vpos = hn::Set(d, pos);
  const VD vaf = hn::Set(d, af);
  const VD vsaf = hn::Set(d, sign * af);
  const VD limit = hn::Set(d, kVectorAngleLimit);
  for (; k + lanes <= n; k += lanes) {
    const VD a = hn::Mul(vpos, hn::Load(d, inv_freq + k));
    if (hn::AllTrue(d, hn::Le(hn::Abs(a), limit))) {
      VD cv, sv;
      CosSin(d, a, cv, sv);
      hn::Store(hn::Mul(cv, vaf), d, c + k);
      hn::Store(hn::Mul(sv, vsaf), d, s + k);
    } else {
      // Huge (or non-finite) angles: the reference's own formula, lane by lane.
      hn::Store(a, d, c + k);
      for (size_t j = k; j < k + lanes; ++j) {
        const double aj = c[j];
        c[j] = std::cos(aj) * af;
        s[j] = sign * std::sin(aj) * af;
      }
    }
  }
#endif
  for (; k < n; ++k) {
    const double a = pos * inv_freq[k];
    c[k] = std::cos(a) * af;
    s[k] = sign * std::sin(a) * af;
  }
}

// Half style: pairs (k, k + pairs).
HWY_INLINE void RotateHalf(const float* x, float* out, size_t pairs, const double* HWY_RESTRICT c,
                           const double* HWY_RESTRICT s) {
  size_t k = 0;
#if HWY_HAVE_FLOAT64
  const DD d;
  const DF df;
  const size_t lanes = hn::Lanes(d);
  for (; k + lanes <= pairs; k += lanes) {
    const VD x0 = hn::PromoteTo(d, hn::LoadU(df, x + k));
    const VD x1 = hn::PromoteTo(d, hn::LoadU(df, x + pairs + k));
    const VD cv = hn::Load(d, c + k);
    const VD sv = hn::Load(d, s + k);
    const VD y0 = hn::MulSub(x0, cv, hn::Mul(x1, sv));
    const VD y1 = hn::MulAdd(x1, cv, hn::Mul(x0, sv));
    hn::StoreU(hn::DemoteTo(df, y0), df, out + k);
    hn::StoreU(hn::DemoteTo(df, y1), df, out + pairs + k);
  }
#endif
  for (; k < pairs; ++k) {
    const double x0 = static_cast<double>(x[k]);
    const double x1 = static_cast<double>(x[k + pairs]);
    out[k] = static_cast<float>(x0 * c[k] - x1 * s[k]);
    out[k + pairs] = static_cast<float>(x1 * c[k] + x0 * s[k]);
  }
}

// Interleaved style: pairs (2k, 2k + 1). `c2`/`s2` hold the pair tables lane by lane:
// c2[2k] = c2[2k + 1] = c[k], s2[2k] = -s[k], s2[2k + 1] = s[k], so that
// y[j] = x[j] c2[j] + x[j ^ 1] s2[j], with x[j ^ 1] a swap of adjacent lanes.
HWY_INLINE void RotateInterleaved(const float* x, float* out, size_t rotary,
                                  const double* HWY_RESTRICT c, const double* HWY_RESTRICT s,
                                  const double* HWY_RESTRICT c2, const double* HWY_RESTRICT s2) {
  size_t j = 0;
#if HWY_HAVE_FLOAT64
  const DD d;
  const DF df;
  const size_t lanes = hn::Lanes(d);
  if (lanes >= 2) {  // even, so every vector holds whole pairs
    for (; j + lanes <= rotary; j += lanes) {
      const VD xv = hn::PromoteTo(d, hn::LoadU(df, x + j));
      const VD y =
          hn::MulAdd(xv, hn::Load(d, c2 + j), hn::Mul(hn::Reverse2(d, xv), hn::Load(d, s2 + j)));
      hn::StoreU(hn::DemoteTo(df, y), df, out + j);
    }
  }
#else
  (void)c2;
  (void)s2;
#endif
  for (; j < rotary; j += 2) {
    const size_t k = j / 2;
    const double x0 = static_cast<double>(x[j]);
    const double x1 = static_cast<double>(x[j + 1]);
    out[j] = static_cast<float>(x0 * c[k] - x1 * s[k]);
    out[j + 1] = static_cast<float>(x1 * c[k] + x0 * s[k]);
  }
}

// Rotates tokens [i0, i1) of batch row b of every tensor.
void RopeTokens(const RopeParams& p, const double* HWY_RESTRICT inv_freq, size_t padded, int64_t b,
                int64_t i0, int64_t i1) {
  const size_t pairs = static_cast<size_t>(p.pairs);
  const size_t rotary = 2 * pairs;
  const size_t pass = static_cast<size_t>(p.head_dim) - rotary;
  const double sign = p.inverse ? -1.0 : 1.0;
  // c, s (padded pairs each) and, for the interleaved style, c2, s2 (2 * padded each).
  auto table = hwy::AllocateAligned<double>(p.interleaved ? 6 * padded : 2 * padded);
  double* c = table.get();
  double* s = c + padded;
  double* c2 = s + padded;
  double* s2 = c2 + 2 * padded;
  for (int64_t i = i0; i < i1; ++i) {
    const double pos = static_cast<double>(p.positions->at(b, i));
    FillCosSin(inv_freq, padded, pos, p.attention_factor, sign, c, s);
    if (p.interleaved) {
      for (size_t k = 0; k < pairs; ++k) {
        c2[2 * k] = c2[2 * k + 1] = c[k];
        s2[2 * k] = -s[k];
        s2[2 * k + 1] = s[k];
      }
    }
    for (int t = 0; t < p.num_tensors; ++t) {
      const RopeTensor& tt = p.tensors[t];
      const float* x = tt.x + b * tt.x_stride[0] + i * tt.x_stride[1];
      float* out = tt.out + b * tt.out_stride[0] + i * tt.out_stride[1];
      for (int64_t h = 0; h < tt.heads; ++h) {
        const float* xr = x + h * tt.x_stride[2];
        float* orow = out + h * tt.out_stride[2];
        if (p.interleaved) {
          RotateInterleaved(xr, orow, rotary, c, s, c2, s2);
        } else {
          RotateHalf(xr, orow, pairs, c, s);
        }
        if (pass > 0 && orow != xr) std::memcpy(orow + rotary, xr + rotary, pass * sizeof(float));
      }
    }
  }
}

void RopeF32(const RopeParams& p) {
  if (p.batch <= 0 || p.seq <= 0 || p.pairs <= 0) return;
#if HWY_HAVE_FLOAT64
  const size_t lanes = hn::Lanes(DD());
#else
  const size_t lanes = 1;
#endif
  const size_t pairs = static_cast<size_t>(p.pairs);
  const size_t padded = (pairs + lanes - 1) / lanes * lanes;
  auto inv_freq = hwy::AllocateAligned<double>(padded);
  std::copy(p.inv_freq, p.inv_freq + pairs, inv_freq.get());
  std::fill(inv_freq.get() + pairs, inv_freq.get() + padded, 0.0);

  // Threads only for calls big enough to repay a parallel region (>= 16 KiB of rows per thread;
  // a decode step runs serially), then blocks of tokens of ~64 KiB of rows each, halved until
  // every thread has a few items. None of this changes a single output bit.
  int64_t row_bytes = 0;
  for (int t = 0; t < p.num_tensors; ++t) {
    row_bytes += p.tensors[t].heads * p.head_dim * static_cast<int64_t>(sizeof(float));
  }
  row_bytes = std::max<int64_t>(row_bytes, 1);
  const int threads = static_cast<int>(std::clamp<int64_t>(
      p.batch * p.seq * row_bytes / (int64_t{1} << 14), 1, std::max(p.num_threads, 1)));
  int64_t block = std::clamp<int64_t>((int64_t{1} << 16) / row_bytes, 1, p.seq);
  const int64_t want_items = 4 * static_cast<int64_t>(threads);
  while (block > 1 && p.batch * ((p.seq + block - 1) / block) < want_items) block = (block + 1) / 2;
  const int64_t blocks = (p.seq + block - 1) / block;

  const double* inv = inv_freq.get();
  parallel_for(p.batch * blocks, threads, [&](int64_t item) HWY_ATTR {
    const int64_t b = item / blocks;
    const int64_t i0 = (item % blocks) * block;
    RopeTokens(p, inv, padded, b, i0, std::min(p.seq, i0 + block));
  });
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(RopeF32);

void rope_f32(const RopeParams& p) {
  // Honour POSENC_SIMD_TARGET before the first dispatch (throws ValueError for unknown names).
  static const bool env_applied = !simd_target_name().empty();
  (void)env_applied;
  HWY_DYNAMIC_DISPATCH(RopeF32)(p);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
