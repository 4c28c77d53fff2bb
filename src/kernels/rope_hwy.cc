// src/kernels/rope_hwy.cc - float32 rotary position embedding (RoPE, Su et al. 2021, docs/rope.md)
// with accurate angles (docs/precision.md), Highway dynamic dispatch.
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
#include <type_traits>

#include "hwy/aligned_allocator.h"
#include "kernels/parallel.h"
#include "kernels/rope_kernels.h"
#include "kernels/simd.h"
#include "posenc/half.h"

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

// Half-precision rows (DType::kBF16 / kF16): the exact widening to_float and the rounding
// from_float<T> of posenc/half.h, lane by lane with integer operations, the same on every target
// (Highway 1.0.3's DemoteTo to bf16 truncates, and its f16 conversions are emulated on some
// targets); scalar tails take the functions of posenc/half.h themselves. Like f16_from_float,
// the f16 subnormal rounding assumes the default floating-point environment (round to nearest,
// no flush to zero).

// Lanes(d) values at p widened exactly to float32 (d: a float descriptor).
template <bool kBF16, class D>
HWY_INLINE hn::Vec<D> WidenVec(D df, const uint16_t* p) {
  const hn::RebindToSigned<D> di;
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<uint16_t, D> dh;
  const auto h = hn::PromoteTo(du, hn::LoadU(dh, p));
  if constexpr (kBF16) {
    return hn::BitCast(df, hn::ShiftLeft<16>(h));
  } else {
    const auto k7fff = hn::Set(di, 0x7fff);
    const auto hi = hn::BitCast(di, h);
    const auto em = hn::And(hi, k7fff);
    const auto sign = hn::BitCast(di, hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u))));
    // Normal: rebias the exponent by 127 - 15; infinity / NaN (exponent 31): to 255.
    const auto bias = hn::IfThenElse(hn::Gt(em, hn::Set(di, 0x7bff)), hn::Set(di, 0x70000000),
                                     hn::Set(di, 0x38000000));
    auto bits = hn::Add(hn::ShiftLeft<13>(em), bias);
    // Zero and subnormals: em * 2^-24, exact in float32.
    const auto sub = hn::BitCast(di, hn::Mul(hn::ConvertTo(df, em), hn::Set(df, 0x1p-24f)));
    bits = hn::IfThenElse(hn::Lt(em, hn::Set(di, 0x400)), sub, bits);
    return hn::BitCast(df, hn::Or(sign, bits));
  }
}

// v rounded to nearest even (bf16_from_float / f16_from_float): the result's bits are the high
// half of each 32-bit lane for bf16, the low half for f16 (the other half is garbage).
template <bool kBF16, class D>
HWY_INLINE hn::Vec<hn::RebindToSigned<D>> NarrowBits(D df, hn::Vec<D> v) {
  const hn::RebindToSigned<D> di;
  const hn::RebindToUnsigned<D> du;
  if constexpr (kBF16) {
    const auto u = hn::BitCast(du, v);
    // Round to nearest even on the dropped 16 bits (a carry into the exponent gives infinity);
    // NaN: the quiet bit set, (u >> 16) | 0x40 in the high half.
    const auto lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
    const auto rounded = hn::Add(hn::Add(u, hn::Set(du, 0x7fffu)), lsb);
    const auto quiet = hn::Or(u, hn::Set(du, 0x400000u));
    return hn::BitCast(di, hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet, rounded));
  } else {
    const auto u = hn::BitCast(di, v);
    const auto abs = hn::And(u, hn::Set(di, 0x7fffffff));
    const auto sign =
        hn::And(hn::BitCast(di, hn::ShiftRight<16>(hn::BitCast(du, u))), hn::Set(di, 0x8000));
    // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
    const auto rebias = hn::Sub(abs, hn::Set(di, 112 << 23));
    auto r = hn::ShiftRight<13>(hn::Add(hn::Add(rebias, hn::Set(di, 0xfff)),
                                        hn::And(hn::ShiftRight<13>(rebias), hn::Set(di, 1))));
    // Below 2^-14: m = round(|x| 2^24) to nearest even, the float32 sum |x| + 1/2 (ulp 2^-24).
    const auto sub = hn::Sub(hn::BitCast(di, hn::Add(hn::BitCast(df, abs), hn::Set(df, 0.5f))),
                             hn::Set(di, 0x3f000000));
    r = hn::IfThenElse(hn::Lt(abs, hn::Set(di, 0x38800000)), sub, r);
    // >= 65520 rounds to infinity; NaN keeps its top payload bits, quiet.
    r = hn::IfThenElse(hn::Lt(abs, hn::Set(di, 0x477ff000)), r, hn::Set(di, 0x7c00));
    const auto nan =
        hn::Or(hn::Set(di, 0x7e00), hn::And(hn::ShiftRight<13>(abs), hn::Set(di, 0x3ff)));
    r = hn::IfThenElse(hn::Gt(abs, hn::Set(di, 0x7f800000)), nan, r);
    return hn::Or(sign, r);
  }
}

// Stores v rounded to nearest even at p.
template <bool kBF16, class D>
HWY_INLINE void NarrowVec(D df, hn::Vec<D> v, uint16_t* p) {
  const hn::RebindToSigned<D> di;
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<uint16_t, D> dh;
  auto bits = NarrowBits<kBF16>(df, v);
  if constexpr (kBF16) {
    bits = hn::BitCast(di, hn::ShiftRight<16>(hn::BitCast(du, bits)));
  } else {
    bits = hn::And(bits, hn::Set(di, 0xffff));
  }
  hn::StoreU(hn::DemoteTo(dh, bits), dh, p);  // bits <= 0xffff: exact
}

// NarrowVec of a at pa and of b at pb, the two packed together.
template <bool kBF16, class D>
HWY_INLINE void NarrowVec2(D df, hn::Vec<D> a, hn::Vec<D> b, uint16_t* pa, uint16_t* pb) {
#if HWY_TARGET == HWY_SCALAR
  NarrowVec<kBF16>(df, a, pa);
  NarrowVec<kBF16>(df, b, pb);
#else
  const hn::Repartition<uint16_t, D> dh2;  // 2 Lanes(df) halves: a's, then b's
  const hn::Half<decltype(dh2)> dh;
  const auto ta = hn::BitCast(dh2, NarrowBits<kBF16>(df, a));
  const auto tb = hn::BitCast(dh2, NarrowBits<kBF16>(df, b));
  const auto both = kBF16 ? hn::ConcatOdd(dh2, tb, ta) : hn::ConcatEven(dh2, tb, ta);
  hn::StoreU(hn::LowerHalf(dh, both), dh, pa);
  hn::StoreU(hn::UpperHalf(dh, both), dh, pb);
#endif
}

template <bool kBF16>
HWY_INLINE float WidenOne(uint16_t h) {
  if constexpr (kBF16) {
    return to_float(bf16{h});
  } else {
    return to_float(f16{h});
  }
}

template <bool kBF16>
HWY_INLINE uint16_t NarrowOne(float x) {
  if constexpr (kBF16) {
    return bf16_from_float(x).bits;
  } else {
    return f16_from_float(x).bits;
  }
}

using DF32 = hn::ScalableTag<float>;

template <bool kBF16>
void WidenRowT(const uint16_t* HWY_RESTRICT src, float* HWY_RESTRICT dst, size_t n) {
  const DF32 df;
  const size_t lanes = hn::Lanes(df);
  size_t j = 0;
  for (; j + lanes <= n; j += lanes) hn::StoreU(WidenVec<kBF16>(df, src + j), df, dst + j);
  for (; j < n; ++j) dst[j] = WidenOne<kBF16>(src[j]);
}

template <bool kBF16>
void NarrowRowT(const float* HWY_RESTRICT src, uint16_t* HWY_RESTRICT dst, size_t n) {
  const DF32 df;
  const size_t lanes = hn::Lanes(df);
  size_t j = 0;
  for (; j + lanes <= n; j += lanes) NarrowVec<kBF16>(df, hn::LoadU(df, src + j), dst + j);
  for (; j < n; ++j) dst[j] = NarrowOne<kBF16>(src[j]);
}

// dst = narrow(widen(src)) for n values: what a copied dim of a half row becomes (NaNs quiet).
template <bool kBF16>
void RoundTripRowT(const uint16_t* src, uint16_t* dst, size_t n) {
  const DF32 df;
  const size_t lanes = hn::Lanes(df);
  size_t j = 0;
  for (; j + lanes <= n; j += lanes) NarrowVec<kBF16>(df, WidenVec<kBF16>(df, src + j), dst + j);
  for (; j < n; ++j) dst[j] = NarrowOne<kBF16>(WidenOne<kBF16>(src[j]));
}

void WidenRow(DType t, const uint16_t* HWY_RESTRICT src, float* HWY_RESTRICT dst, size_t n) {
  if (t == DType::kBF16) {
    WidenRowT<true>(src, dst, n);
  } else {
    WidenRowT<false>(src, dst, n);
  }
}

void NarrowRow(DType t, const float* HWY_RESTRICT src, uint16_t* HWY_RESTRICT dst, size_t n) {
  if (t == DType::kBF16) {
    NarrowRowT<true>(src, dst, n);
  } else {
    NarrowRowT<false>(src, dst, n);
  }
}

// The rows of one token of a half-precision tensor, x -> out (out may equal x). When the SIMD
// loops of RotateHalf / RotateInterleaved cover every rotated dim, their instructions run on
// values widened in registers and each result is rounded as it is stored; otherwise each row is
// widened into `row`, rotated there by RotateHalf / RotateInterleaved themselves and rounded
// back. Either way the bits are those of the float32 kernel's output rounded once, copied dims
// included (NaNs come back quiet, as narrowing a float32 copy gives).
#if HWY_HAVE_FLOAT64 && HWY_TARGET != HWY_SCALAR
// One full float vector of half values (2 * Lanes(DD) of them) widened at p and promoted to two
// double vectors, lo and hi; and the reverse step, two double vectors demoted to one float vector.
// Widening and rounding on full vectors take one integer sequence per two double vectors.
static_assert(std::is_same_v<hn::Half<DF32>, DF>, "a float vector is two double vectors");
template <bool kBF16>
HWY_INLINE void WidenToDoubles(const uint16_t* p, VD& lo, VD& hi) {
  // The full float vector is widened first (WidenVec: PromoteTo from a half-width load), then
  // split into its lower and upper halves: every step keeps lane order at any vector width. A
  // block-local shortcut (interleaving the bf16 values with zeros, ZipLower / ZipUpper) would
  // give the right values only while the 16-bit vector is one 128-bit block (AVX2 and below).
  const DD d;
  const hn::Half<DF32> dfh;
  const auto w = WidenVec<kBF16>(DF32(), p);
  lo = hn::PromoteTo(d, hn::LowerHalf(dfh, w));
  hi = hn::PromoteTo(d, hn::UpperHalf(dfh, w));
}
HWY_INLINE hn::Vec<DF32> DemoteToFloats(VD lo, VD hi) {
  const DF df;
  return hn::Combine(DF32(), hn::DemoteTo(df, hi), hn::DemoteTo(df, lo));
}
#endif

template <bool kBF16>
void RotateHalfRows(const uint16_t* x, int64_t x_stride, uint16_t* out, int64_t out_stride,
                    int64_t heads, size_t head_dim, size_t pairs, bool interleaved,
                    const double* HWY_RESTRICT c, const double* HWY_RESTRICT s,
                    const double* HWY_RESTRICT c2, const double* HWY_RESTRICT s2, float* row) {
  const size_t rotary = 2 * pairs, pass = head_dim - rotary;
#if HWY_HAVE_FLOAT64
  const DD d;
  const DF df;
  const size_t lanes = hn::Lanes(d);
  if (!interleaved && pairs % lanes == 0) {
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* xr = x + h * x_stride;
      uint16_t* orow = out + h * out_stride;
      size_t k = 0;
#if HWY_TARGET != HWY_SCALAR
      // Two double vectors per step, widened and rounded as full float vectors (WidenToDoubles,
      // DemoteToFloats), the rotation on each as below. The same operations per value, so the
      // same bits: a third fewer instructions in a loop that is bound by them on AVX2 (bf16 and
      // f16 rows are half the bytes of float32 ones).
      for (; k + 2 * lanes <= pairs; k += 2 * lanes) {
        VD x0a, x0b, x1a, x1b;
        WidenToDoubles<kBF16>(xr + k, x0a, x0b);
        WidenToDoubles<kBF16>(xr + pairs + k, x1a, x1b);
        const VD ca = hn::Load(d, c + k), cb = hn::Load(d, c + k + lanes);
        const VD sa = hn::Load(d, s + k), sb = hn::Load(d, s + k + lanes);
        const VD y0a = hn::MulSub(x0a, ca, hn::Mul(x1a, sa));
        const VD y0b = hn::MulSub(x0b, cb, hn::Mul(x1b, sb));
        const VD y1a = hn::MulAdd(x1a, ca, hn::Mul(x0a, sa));
        const VD y1b = hn::MulAdd(x1b, cb, hn::Mul(x0b, sb));
        NarrowVec2<kBF16>(DF32(), DemoteToFloats(y0a, y0b), DemoteToFloats(y1a, y1b), orow + k,
                          orow + pairs + k);
      }
#endif
      for (; k < pairs; k += lanes) {
        const VD x0 = hn::PromoteTo(d, WidenVec<kBF16>(df, xr + k));
        const VD x1 = hn::PromoteTo(d, WidenVec<kBF16>(df, xr + pairs + k));
        const VD cv = hn::Load(d, c + k);
        const VD sv = hn::Load(d, s + k);
        const VD y0 = hn::MulSub(x0, cv, hn::Mul(x1, sv));
        const VD y1 = hn::MulAdd(x1, cv, hn::Mul(x0, sv));
        NarrowVec2<kBF16>(df, hn::DemoteTo(df, y0), hn::DemoteTo(df, y1), orow + k,
                          orow + pairs + k);
      }
      if (pass > 0) RoundTripRowT<kBF16>(xr + rotary, orow + rotary, pass);
    }
    return;
  }
  if (interleaved && lanes >= 2 && rotary % lanes == 0) {
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* xr = x + h * x_stride;
      uint16_t* orow = out + h * out_stride;
      size_t j = 0;
      for (; j + 2 * lanes <= rotary; j += 2 * lanes) {
#if HWY_TARGET != HWY_SCALAR
        VD xa, xb;  // as in the half style above: the same bits
        WidenToDoubles<kBF16>(xr + j, xa, xb);
#else
        const VD xa = hn::PromoteTo(d, WidenVec<kBF16>(df, xr + j));
        const VD xb = hn::PromoteTo(d, WidenVec<kBF16>(df, xr + j + lanes));
#endif
        const VD ya =
            hn::MulAdd(xa, hn::Load(d, c2 + j), hn::Mul(hn::Reverse2(d, xa), hn::Load(d, s2 + j)));
        const VD yb = hn::MulAdd(xb, hn::Load(d, c2 + j + lanes),
                                 hn::Mul(hn::Reverse2(d, xb), hn::Load(d, s2 + j + lanes)));
#if HWY_TARGET != HWY_SCALAR
        NarrowVec<kBF16>(DF32(), DemoteToFloats(ya, yb), orow + j);
#else
        NarrowVec2<kBF16>(df, hn::DemoteTo(df, ya), hn::DemoteTo(df, yb), orow + j,
                          orow + j + lanes);
#endif
      }
      for (; j < rotary; j += lanes) {
        const VD xv = hn::PromoteTo(d, WidenVec<kBF16>(df, xr + j));
        const VD y =
            hn::MulAdd(xv, hn::Load(d, c2 + j), hn::Mul(hn::Reverse2(d, xv), hn::Load(d, s2 + j)));
        NarrowVec<kBF16>(df, hn::DemoteTo(df, y), orow + j);
      }
      if (pass > 0) RoundTripRowT<kBF16>(xr + rotary, orow + rotary, pass);
    }
    return;
  }
#endif
  for (int64_t h = 0; h < heads; ++h) {
    WidenRowT<kBF16>(x + h * x_stride, row, head_dim);
    if (interleaved) {
      RotateInterleaved(row, row, rotary, c, s, c2, s2);
    } else {
      RotateHalf(row, row, pairs, c, s);
    }
    NarrowRowT<kBF16>(row, out + h * out_stride, head_dim);
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
  // One widened row for bf16 / f16 tensors.
  const size_t head_dim = static_cast<size_t>(p.head_dim);
  bool any_half = false;
  for (int t = 0; t < p.num_tensors; ++t) any_half |= p.tensors[t].dtype != DType::kF32;
  hwy::AlignedFreeUniquePtr<float[]> row_buf;
  if (any_half) row_buf = hwy::AllocateAligned<float>(head_dim);
  float* row = row_buf.get();
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
      if (tt.dtype != DType::kF32) {
        // Rotated as the float32 rows below are, from values widened exactly (RotateHalfRows).
        const uint16_t* x = tt.x_half + b * tt.x_stride[0] + i * tt.x_stride[1];
        uint16_t* out = tt.out_half + b * tt.out_stride[0] + i * tt.out_stride[1];
        if (tt.dtype == DType::kBF16) {
          RotateHalfRows<true>(x, tt.x_stride[2], out, tt.out_stride[2], tt.heads, head_dim, pairs,
                               p.interleaved, c, s, c2, s2, row);
        } else {
          RotateHalfRows<false>(x, tt.x_stride[2], out, tt.out_stride[2], tt.heads, head_dim, pairs,
                                p.interleaved, c, s, c2, s2, row);
        }
        continue;
      }
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
    const int64_t elem = p.tensors[t].dtype == DType::kF32 ? 4 : 2;
    row_bytes += p.tensors[t].heads * p.head_dim * elem;
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

// The per-position table of rope_fill_table: FillCosSin of each position, blocks of positions
// in parallel (each row is computed by the same instructions whatever the thread count).
void RopeFillTable(const double* inv_freq, int64_t pairs, double af, int64_t pos0, int64_t n,
                   double* cs, int num_threads) {
  const int64_t padded = rope_table_padded(pairs);
  auto inv = hwy::AllocateAligned<double>(static_cast<size_t>(padded));
  std::copy(inv_freq, inv_freq + pairs, inv.get());
  std::fill(inv.get() + pairs, inv.get() + padded, 0.0);
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::clamp<int64_t>(blocks, 1, std::max(num_threads, 1)));
  parallel_for(blocks, threads, [&](int64_t blk) HWY_ATTR {
    for (int64_t t = blk * kBlock; t < std::min(n, (blk + 1) * kBlock); ++t) {
      double* c = cs + t * 2 * padded;
      FillCosSin(inv.get(), static_cast<size_t>(padded), static_cast<double>(pos0 + t), af, 1.0, c,
                 c + padded);
    }
  });
}

// Rows rotated from the table with RopeTokens' arithmetic (RotateHalf / RotateInterleaved).
void RopeRotateRows(const RopeRowTable& t, const int32_t* idx, int64_t add, int64_t n,
                    const float* x, int64_t xs, float* out, int64_t os) {
  const size_t pairs = static_cast<size_t>(t.pairs), rotary = 2 * pairs;
  const size_t padded = static_cast<size_t>(t.padded);
  const size_t off = static_cast<size_t>(t.offset);
  const size_t tail = static_cast<size_t>(t.head_dim) - off - rotary;
  // Interleaved: the lane-by-lane tables of the row's position (see RotateInterleaved).
  thread_local hwy::AlignedFreeUniquePtr<double[]> pair_tables;
  thread_local size_t pair_tables_n = 0;
  if (t.interleaved && pair_tables_n < 4 * padded) {
    pair_tables = hwy::AllocateAligned<double>(4 * padded);
    pair_tables_n = 4 * padded;
  }
  for (int64_t r = 0; r < n; ++r) {
    const double* c = t.cs + (static_cast<int64_t>(idx[r]) + add) * 2 * t.padded;
    const double* s = c + padded;
    const float* xr = x + r * xs;
    float* orow = out + r * os;
    if (orow != xr) {
      std::memcpy(orow, xr, off * sizeof(float));
      std::memcpy(orow + off + rotary, xr + off + rotary, tail * sizeof(float));
    }
    if (t.interleaved) {
      double* c2 = pair_tables.get();
      double* s2 = c2 + 2 * padded;
      for (size_t k = 0; k < pairs; ++k) {
        c2[2 * k] = c2[2 * k + 1] = c[k];
        s2[2 * k] = -s[k];
        s2[2 * k + 1] = s[k];
      }
      RotateInterleaved(xr + off, orow + off, rotary, c, s, c2, s2);
    } else {
      RotateHalf(xr + off, orow + off, pairs, c, s);
    }
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(RopeF32);
HWY_EXPORT(WidenRow);
HWY_EXPORT(NarrowRow);
HWY_EXPORT(RopeFillTable);
HWY_EXPORT(RopeRotateRows);

void rope_f32(const RopeParams& p) {
  // Honour POSENC_SIMD_TARGET before the first dispatch (throws ValueError for unknown names).
  static const bool env_applied = !simd_target_name().empty();
  (void)env_applied;
  HWY_DYNAMIC_DISPATCH(RopeF32)(p);
}

void half_to_float(DType t, const uint16_t* src, float* dst, int64_t n) {
  static const bool env_applied = !simd_target_name().empty();
  (void)env_applied;
  HWY_DYNAMIC_DISPATCH(WidenRow)(t, src, dst, static_cast<size_t>(n));
}

void float_to_half(DType t, const float* src, uint16_t* dst, int64_t n) {
  static const bool env_applied = !simd_target_name().empty();
  (void)env_applied;
  HWY_DYNAMIC_DISPATCH(NarrowRow)(t, src, dst, static_cast<size_t>(n));
}

void rope_fill_table(const double* inv_freq, int64_t pairs, double attention_factor, int64_t pos0,
                     int64_t n, double* cs, int num_threads) {
  static const bool env_applied = !simd_target_name().empty();
  (void)env_applied;
  HWY_DYNAMIC_DISPATCH(RopeFillTable)(inv_freq, pairs, attention_factor, pos0, n, cs, num_threads);
}

void rope_rotate_rows(const RopeRowTable& t, const int32_t* idx, int64_t add, int64_t n,
                      const float* x, int64_t xs, float* out, int64_t os) {
  HWY_DYNAMIC_DISPATCH(RopeRotateRows)(t, idx, add, n, x, xs, out, os);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
