// tests/test_sinusoidal.cc - fixed sinusoidal encodings (docs/sinusoidal.md, docs/precision.md)
// against hand-computed values and an independent long double evaluation written here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "posenc/error.h"
#include "posenc/sinusoidal.h"
#include "posenc/tensor.h"
#include "test_util.h"

namespace {

using posenc::Positions;
using posenc::SinDenominator;
using posenc::SinLayout;
using posenc::SinOddDim;
using posenc::SinusoidalConfig;
using posenc_test::Rng;
using posenc_test::Strided;
using posenc_test::ulp_f32;

constexpr int64_t kP16 = int64_t{1} << 16;
constexpr int64_t kP20 = int64_t{1} << 20;
constexpr int64_t kP24 = int64_t{1} << 24;
constexpr int64_t kP40 = int64_t{1} << 40;

std::string describe(const SinusoidalConfig& c) {
  return "dim " + std::to_string(c.dim) + " base " + std::to_string(c.base) + " layout " +
         (c.layout == SinLayout::kInterleaved ? "interleaved" : "concat") + " den " +
         (c.denominator == SinDenominator::kDim ? "dim" : "half-1") + " origin " +
         std::to_string(c.origin);
}

// Exponent of w_i = base^(-exponent) from docs/sinusoidal.md: 2i/d, or i/(d/2 - 1) (divisor 1 when
// d/2 - 1 < 1). Odd zero-padded widths use the frequencies of d - 1.
long double exponent_ld(const SinusoidalConfig& c, int64_t i) {
  const int64_t half = c.dim / 2;
  if (c.denominator == SinDenominator::kDim) {
    return 2.0L * static_cast<long double>(i) / static_cast<long double>(2 * half);
  }
  return static_cast<long double>(i) / static_cast<long double>(std::max<int64_t>(half - 1, 1));
}

// w_i in long double (relative error about 2^-63).
long double freq_ld(const SinusoidalConfig& c, int64_t i) {
  return std::exp(-exponent_ld(c, i) * std::log(static_cast<long double>(c.base)));
}

// Relative error bound of a double frequency computed as pow(base, -e): pow is within 1 ulp
// (2^-52), and rounding e = 2i/d to double (2^-53 relative) is amplified by |e ln base|.
double freq_rel_err(const SinusoidalConfig& c, int64_t i) {
  const double e = static_cast<double>(exponent_ld(c, i));
  return 0x1p-52 + std::fabs(e * std::log(c.base)) * 0x1p-53;
}

// PE[p, k] in long double, straight from docs/sinusoidal.md. `angle_err` receives a bound on the
// error of the angle p*w as the library forms it in double: the frequency error (freq_rel_err),
// half an ulp for the product, and the reference's own 2^-60 (0 for a zero column).
long double pe_ld(const SinusoidalConfig& c, int64_t p, int64_t k, double* angle_err = nullptr) {
  const int64_t half = c.dim / 2;
  if (angle_err) *angle_err = 0;
  if (k >= 2 * half) return 0;
  const int64_t i = c.layout == SinLayout::kInterleaved ? k / 2 : (k < half ? k : k - half);
  const bool is_sin = c.layout == SinLayout::kInterleaved ? k % 2 == 0 : k < half;
  const long double a = static_cast<long double>(p) * freq_ld(c, i);
  if (angle_err) *angle_err = static_cast<double>(a) * (freq_rel_err(c, i) + 0x1p-53 + 0x1p-60);
  return is_sin ? std::sin(a) : std::cos(a);
}

// Bound on |float32 result - exact value|: one float32 ulp (rounding once to float32, plus the
// last-bit slack of a double sin/cos) plus the angle error (|d sin| <= |d a|).
double pe_bound(long double value, double angle_err) {
  return ulp_f32(static_cast<double>(value)) + angle_err;
}

// Largest error of the float32 table rows at `positions` (via sinusoidal_encode) against the long
// double formula, in units of pe_bound; also returns the largest absolute error.
struct Accuracy {
  double worst_ratio = 0, worst_abs = 0;
};
Accuracy measure(const SinusoidalConfig& c, const std::vector<int64_t>& positions) {
  const int64_t n = static_cast<int64_t>(positions.size());
  std::vector<float> out(static_cast<std::size_t>(n * c.dim));
  posenc::sinusoidal_encode(c, positions,
                            posenc::View<float, 2>::contiguous(out.data(), {n, c.dim}));
  Accuracy acc;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t k = 0; k < c.dim; ++k) {
      double angle_err;
      const int64_t p = positions[static_cast<std::size_t>(r)];
      const long double want = pe_ld(c, p, k, &angle_err);
      const double got = out[static_cast<std::size_t>(r * c.dim + k)];
      const double err = std::fabs(got - static_cast<double>(want));
      acc.worst_abs = std::max(acc.worst_abs, err);
      acc.worst_ratio = std::max(acc.worst_ratio, err / pe_bound(want, angle_err));
    }
  }
  return acc;
}

double dot_rows(const std::vector<float>& t, int64_t dim, int64_t r0, int64_t r1) {
  double s = 0;
  for (int64_t k = 0; k < dim; ++k) {
    s += static_cast<double>(t[static_cast<std::size_t>(r0 * dim + k)]) *
         static_cast<double>(t[static_cast<std::size_t>(r1 * dim + k)]);
  }
  return s;
}

// ----------------------------------------------------------------------------------------------
// Hand-computed values.

TEST(Sinusoidal, PositionZeroIsSinZeroCosOne) {
  for (int64_t d : {2, 4, 16, 130}) {
    for (auto layout : {SinLayout::kInterleaved, SinLayout::kConcat}) {
      const SinusoidalConfig c{.dim = d, .layout = layout};
      SCOPED_TRACE(describe(c));
      const auto t = posenc::sinusoidal_table(c, 1);
      ASSERT_EQ(t.size(), static_cast<std::size_t>(d));
      for (int64_t k = 0; k < d; ++k) {
        const bool is_sin = layout == SinLayout::kInterleaved ? k % 2 == 0 : k < d / 2;
        EXPECT_EQ(t[static_cast<std::size_t>(k)], is_sin ? 0.0f : 1.0f) << "k " << k;
      }
    }
  }
}

TEST(Sinusoidal, PositionOneDimFourByHand) {
  // d = 4: w_0 = 1, w_1 = 10000^(-2/4) = 0.01. One rounding from double to float32 is allowed
  // to differ by at most 1 ulp from rounding the C library's sin/cos of the same argument.
  const float s1 = static_cast<float>(std::sin(1.0)), c1 = static_cast<float>(std::cos(1.0));
  const float s01 = static_cast<float>(std::sin(0.01)), c01 = static_cast<float>(std::cos(0.01));
  const std::vector<float> inter = {0, 1, 0, 1, s1, c1, s01, c01};
  const std::vector<float> concat = {0, 0, 1, 1, s1, s01, c1, c01};
  const auto ti = posenc::sinusoidal_table({.dim = 4}, 2);
  const auto tc = posenc::sinusoidal_table({.dim = 4, .layout = SinLayout::kConcat}, 2);
  for (std::size_t k = 0; k < 8; ++k) {
    EXPECT_LE(posenc_test::ulp_distance(ti[k], inter[k]), 1) << "interleaved " << k;
    EXPECT_LE(posenc_test::ulp_distance(tc[k], concat[k]), 1) << "concat " << k;
  }
  const auto w = posenc::sinusoidal_frequencies({.dim = 4});
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0], 1.0);
  EXPECT_NEAR(w[1], 0.01, 0.01 * 0x1p-52);
}

TEST(Sinusoidal, FrequenciesFollowTheFormula) {
  for (double base : {1e4, 500.0, 1e6}) {
    for (int64_t d : {2, 4, 6, 16, 130, 1024}) {
      for (auto den : {SinDenominator::kDim, SinDenominator::kHalfMinusOne}) {
        const SinusoidalConfig c{.dim = d, .base = base, .denominator = den};
        SCOPED_TRACE(describe(c));
        const auto w = posenc::sinusoidal_frequencies(c);
        ASSERT_EQ(w.size(), static_cast<std::size_t>(d / 2));
        EXPECT_EQ(w[0], 1.0);
        for (int64_t i = 0; i < d / 2; ++i) {
          const double want = static_cast<double>(freq_ld(c, i));
          EXPECT_NEAR(w[static_cast<std::size_t>(i)], want, want * freq_rel_err(c, i)) << "i " << i;
          if (i > 0) {
            EXPECT_LT(w[static_cast<std::size_t>(i)], w[static_cast<std::size_t>(i - 1)]);
          }
        }
      }
    }
  }
}

TEST(Sinusoidal, HalfMinusOneLastFrequencyIsExactlyOneOverBase) {
  for (double base : {1e4, 1e5, 7.0}) {
    for (int64_t d : {4, 8, 16, 64, 80, 512, 1024}) {
      const SinusoidalConfig c{
          .dim = d, .base = base, .denominator = SinDenominator::kHalfMinusOne};
      SCOPED_TRACE(describe(c));
      const auto w = posenc::sinusoidal_frequencies(c);
      EXPECT_EQ(w.front(), 1.0);
      EXPECT_EQ(w.back(), 1.0 / base);
      // Under the paper's denominator the last frequency stays above 1/base.
      const auto wp = posenc::sinusoidal_frequencies({.dim = d, .base = base});
      EXPECT_GT(wp.back(), 1.0 / base);
    }
  }
  // d = 2: one frequency, 1 (divisor 1).
  const auto w2 =
      posenc::sinusoidal_frequencies({.dim = 2, .denominator = SinDenominator::kHalfMinusOne});
  ASSERT_EQ(w2.size(), 1u);
  EXPECT_EQ(w2[0], 1.0);
}

// ----------------------------------------------------------------------------------------------
// Structure.

TEST(Sinusoidal, InterleavedAndConcatArePermutations) {
  for (int64_t d : {2, 6, 16, 130}) {
    for (auto den : {SinDenominator::kDim, SinDenominator::kHalfMinusOne}) {
      const SinusoidalConfig ci{.dim = d, .denominator = den, .origin = 3};
      SinusoidalConfig cc = ci;
      cc.layout = SinLayout::kConcat;
      SCOPED_TRACE(describe(cc));
      const int64_t len = 37, half = d / 2;
      const auto ti = posenc::sinusoidal_table(ci, len);
      const auto tc = posenc::sinusoidal_table(cc, len);
      for (int64_t r = 0; r < len; ++r) {
        for (int64_t i = 0; i < half; ++i) {
          const auto at = [&](int64_t k) { return static_cast<std::size_t>(r * d + k); };
          ASSERT_TRUE(posenc_test::same_bits(tc[at(i)], ti[at(2 * i)])) << r << ", " << i;
          ASSERT_TRUE(posenc_test::same_bits(tc[at(half + i)], ti[at(2 * i + 1)]))
              << r << ", " << i;
        }
      }
    }
  }
}

TEST(Sinusoidal, OriginShiftsRows) {
  for (int64_t origin : {1, 2, 1000}) {
    const SinusoidalConfig c0{.dim = 16, .layout = SinLayout::kConcat};
    SinusoidalConfig ck = c0;
    ck.origin = origin;
    SCOPED_TRACE(describe(ck));
    const int64_t len = 20;
    const auto t0 = posenc::sinusoidal_table(c0, origin + len);
    const auto tk = posenc::sinusoidal_table(ck, len);
    const std::vector<float> tail(t0.begin() + origin * 16, t0.end());
    EXPECT_EQ(tk, tail);
  }
}

TEST(Sinusoidal, FloatTableIsTheDoubleReferenceRoundedOnce) {
  for (int64_t d : {2, 16, 130}) {
    for (auto layout : {SinLayout::kInterleaved, SinLayout::kConcat}) {
      for (int64_t origin : {int64_t{0}, kP20}) {
        const SinusoidalConfig c{.dim = d, .layout = layout, .origin = origin};
        SCOPED_TRACE(describe(c));
        const auto t = posenc::sinusoidal_table(c, 9);
        const auto r = posenc::ref::sinusoidal_table(c, 9);
        ASSERT_EQ(t.size(), r.size());
        for (std::size_t k = 0; k < t.size(); ++k) {
          ASSERT_EQ(t[k], static_cast<float>(r[k])) << "element " << k;
        }
        // ref::sinusoidal_value agrees with the reference table.
        EXPECT_EQ(posenc::ref::sinusoidal_value(c, origin + 4, d - 1),
                  r[static_cast<std::size_t>(4 * d + d - 1)]);
      }
    }
  }
}

TEST(Sinusoidal, OddDimIsAnErrorUnlessZeroPadded) {
  EXPECT_THROW(posenc::sinusoidal_table({.dim = 7}, 3), posenc::ValueError);
  EXPECT_THROW(posenc::validate(SinusoidalConfig{.dim = 1}), posenc::ValueError);
  for (auto den : {SinDenominator::kDim, SinDenominator::kHalfMinusOne}) {
    for (auto layout : {SinLayout::kInterleaved, SinLayout::kConcat}) {
      for (int64_t d : {3, 7, 17}) {
        // fairseq: the even table of width d - 1, then a zero column.
        const SinusoidalConfig odd{
            .dim = d, .layout = layout, .denominator = den, .odd_dim = SinOddDim::kZeroPad};
        SinusoidalConfig even = odd;
        even.dim = d - 1;
        SCOPED_TRACE(describe(odd));
        const int64_t len = 11;
        const auto to = posenc::sinusoidal_table(odd, len);
        const auto te = posenc::sinusoidal_table(even, len);
        ASSERT_EQ(to.size(), static_cast<std::size_t>(len * d));
        for (int64_t r = 0; r < len; ++r) {
          for (int64_t k = 0; k < d - 1; ++k) {
            EXPECT_EQ(to[static_cast<std::size_t>(r * d + k)],
                      te[static_cast<std::size_t>(r * (d - 1) + k)]);
          }
          EXPECT_TRUE(posenc_test::same_bits(to[static_cast<std::size_t>(r * d + d - 1)], 0.0f));
        }
      }
    }
  }
  // dim 1 zero-padded: no frequency at all, a single zero column.
  const auto t1 = posenc::sinusoidal_table({.dim = 1, .odd_dim = SinOddDim::kZeroPad}, 3);
  EXPECT_EQ(t1, std::vector<float>(3, 0.0f));
}

TEST(Sinusoidal, InvalidConfigsThrowValueError) {
  const double nan = std::nan("");
  const double inf = HUGE_VAL;
  for (const SinusoidalConfig& c :
       {SinusoidalConfig{.dim = 0}, SinusoidalConfig{.dim = -2},
        SinusoidalConfig{.dim = 8, .base = 1.0}, SinusoidalConfig{.dim = 8, .base = 0.5},
        SinusoidalConfig{.dim = 8, .base = -1e4}, SinusoidalConfig{.dim = 8, .base = nan},
        SinusoidalConfig{.dim = 8, .base = inf}, SinusoidalConfig{.dim = 8, .origin = -1}}) {
    SCOPED_TRACE(describe(c));
    EXPECT_THROW(posenc::validate(c), posenc::ValueError);
    EXPECT_THROW(posenc::sinusoidal_table(c, 4), posenc::ValueError);
    EXPECT_THROW(posenc::sinusoidal_frequencies(c), posenc::ValueError);
  }
  EXPECT_THROW(posenc::sinusoidal_table({.dim = 8}, -1), posenc::ValueError);
  EXPECT_TRUE(posenc::sinusoidal_table({.dim = 8}, 0).empty());
  // Every library error is also a posenc::Error and a std::invalid_argument.
  EXPECT_THROW(posenc::sinusoidal_table({.dim = 0}, 1), posenc::Error);
  EXPECT_THROW(posenc::sinusoidal_table({.dim = 0}, 1), std::invalid_argument);
}

// ----------------------------------------------------------------------------------------------
// Accuracy (docs/precision.md).

TEST(Sinusoidal, AccurateToFloat32UpTo2To24) {
  // Positions spread over [0, 2^24], including powers of two and their neighbours.
  std::vector<int64_t> pos = {0,    1,        2,        3,    7,        130,      kP16 - 1,
                              kP16, kP16 + 1, kP20 - 1, kP20, kP20 + 3, kP24 - 1, kP24};
  Rng rng(posenc_test::test_seed(), 10);
  SCOPED_TRACE(posenc_test::seed_trace());
  for (int j = 0; j < 50; ++j) pos.push_back(rng.integer(0, kP24));
  for (int64_t d : {16, 64, 130}) {
    for (auto den : {SinDenominator::kDim, SinDenominator::kHalfMinusOne}) {
      const SinusoidalConfig c{.dim = d, .denominator = den};
      SCOPED_TRACE(describe(c));
      const Accuracy acc = measure(c, pos);
      EXPECT_LE(acc.worst_ratio, 1.0) << "max abs error " << acc.worst_abs;
      // At 2^24 the double angle is still good to ~4e-9 rad: far below float32 resolution.
      EXPECT_LT(acc.worst_abs, 1.2e-7);
    }
  }
}

TEST(Sinusoidal, ExactFrequenciesAreCorrectlyRoundedUpTo2To40) {
  // base 256, d 16: w_i = 256^(-i/8) = 2^-i, exact in double, so p*w is exact and the float32
  // value must be the correctly rounded sin/cos up to the last bit (1 ulp allows for a double
  // rounding that lands on a float32 midpoint). This checks range reduction at huge angles.
  const SinusoidalConfig c{.dim = 16, .base = 256.0};
  const auto w = posenc::sinusoidal_frequencies(c);
  for (std::size_t i = 0; i < w.size(); ++i) ASSERT_EQ(w[i], std::ldexp(1.0, -static_cast<int>(i)));
  std::vector<int64_t> pos;
  for (int64_t base : {kP16, kP20, kP24, int64_t{1} << 32, kP40, posenc::kMaxPosition - 8}) {
    for (int64_t o = -3; o <= 3; ++o) pos.push_back(base + o);
  }
  std::vector<float> out(pos.size() * 16);
  posenc::sinusoidal_encode(
      c, pos,
      posenc::View<float, 2>::contiguous(out.data(), {static_cast<int64_t>(pos.size()), 16}));
  int64_t exact = 0, total = 0;
  for (std::size_t r = 0; r < pos.size(); ++r) {
    for (int64_t k = 0; k < 16; ++k) {
      // Reference with the exact frequency 2^-i (a long double exp/log would be off by ~2^-64,
      // i.e. 2^-16 rad at p = 2^48).
      const long double a = std::ldexp(static_cast<long double>(pos[r]), -static_cast<int>(k / 2));
      const float want = static_cast<float>(k % 2 == 0 ? std::sin(a) : std::cos(a));
      const float got = out[r * 16 + static_cast<std::size_t>(k)];
      EXPECT_LE(posenc_test::ulp_distance(got, want), 1) << "p " << pos[r] << " k " << k;
      exact += got == want;
      ++total;
    }
  }
  EXPECT_GE(exact, total - total / 100) << exact << " of " << total << " correctly rounded";
}

TEST(Sinusoidal, ErrorAtHugePositionsIsTheDoubleAngleBound) {
  // With frequencies that are not exact in double, the angle p*w formed in double carries a
  // relative error of a few 2^-53 (freq_rel_err), about 1e-4 rad at p = 2^40: no implementation
  // using double angles is float32-exact there. The float32 table must stay within that bound
  // (pe_bound) at every scale; it is float32-exact (AccurateToFloat32UpTo2To24) below 2^24.
  for (int64_t d : {64, 130}) {
    const SinusoidalConfig c{.dim = d};
    for (int shift : {20, 24, 32, 40}) {
      SCOPED_TRACE(describe(c) + " p ~ 2^" + std::to_string(shift));
      std::vector<int64_t> pos;
      for (int64_t o = 0; o < 8; ++o) pos.push_back((int64_t{1} << shift) + o * 12345);
      const Accuracy acc = measure(c, pos);
      EXPECT_LE(acc.worst_ratio, 1.0);
      std::printf("[ measured ] sinusoidal d=%lld max |float32 - exact| at p ~ 2^%d: %.3g\n",
                  static_cast<long long>(d), shift, acc.worst_abs);
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Dot products (docs/sinusoidal.md seed check).

TEST(Sinusoidal, SeedDotProducts) {
  for (auto layout : {SinLayout::kInterleaved, SinLayout::kConcat}) {
    const auto t = posenc::sinusoidal_table({.dim = 16, .layout = layout}, 107);
    SCOPED_TRACE(layout == SinLayout::kInterleaved ? "interleaved" : "concat");
    // 4 decimals as stated in docs/sinusoidal.md.
    EXPECT_NEAR(dot_rows(t, 16, 105, 106), 7.4852, 5e-5);
    EXPECT_NEAR(dot_rows(t, 16, 5, 6), 7.4852, 5e-5);
    EXPECT_NEAR(dot_rows(t, 16, 5, 10), 6.1370, 5e-5);
  }
}

TEST(Sinusoidal, DotProductDependsOnlyOnOffset) {
  // PE(m).PE(m+k) = sum_i cos(k w_i) for any m. Each float32 entry is within ~6e-8 of exact, so
  // a d-term dot product is within d * 2^-22 of the exact sum.
  Rng rng(posenc_test::test_seed(), 11);
  SCOPED_TRACE(posenc_test::seed_trace());
  for (int64_t d : {2, 16, 130}) {
    const SinusoidalConfig c{.dim = d};
    SCOPED_TRACE(describe(c));
    const double tol = static_cast<double>(d) * 0x1p-22;
    for (int trial = 0; trial < 20; ++trial) {
      const int64_t m = rng.integer(0, trial < 10 ? 1000 : kP20);
      const int64_t k = rng.integer(0, 300);
      const std::vector<int64_t> pos = {m, m + k};
      std::vector<float> out(static_cast<std::size_t>(2 * d));
      posenc::sinusoidal_encode(c, pos, posenc::View<float, 2>::contiguous(out.data(), {2, d}));
      double want = 0;
      for (int64_t i = 0; i < d / 2; ++i) {
        want += static_cast<double>(std::cos(static_cast<long double>(k) * freq_ld(c, i)));
      }
      EXPECT_NEAR(dot_rows(out, d, 0, 1), want, tol) << "m " << m << " k " << k;
    }
  }
}

// ----------------------------------------------------------------------------------------------
// sinusoidal_encode and add_sinusoidal.

TEST(Sinusoidal, EncodeIntoStridedOutput) {
  const SinusoidalConfig c{.dim = 6, .layout = SinLayout::kConcat};
  const std::vector<int64_t> pos = {5, 0, kP20, 3};
  // Transposed storage: [n, dim] with dim outermost, and padding.
  Strided<float, 2> out({4, 6}, /*pad=*/2, {1, 0});
  posenc::sinusoidal_encode(c, pos, out.view());
  EXPECT_TRUE(out.outside_untouched());
  const auto got = out.values();
  for (std::size_t r = 0; r < pos.size(); ++r) {
    for (int64_t k = 0; k < 6; ++k) {
      const long double want = pe_ld(c, pos[r], k);
      EXPECT_NEAR(got[r * 6 + static_cast<std::size_t>(k)], static_cast<double>(want),
                  ulp_f32(static_cast<double>(want)))
          << "p " << pos[r] << " k " << k;
    }
  }
  EXPECT_THROW(posenc::sinusoidal_encode(c, {1, 2, 3}, out.view()), posenc::ShapeError);
  EXPECT_THROW(posenc::sinusoidal_encode({.dim = 8}, pos, out.view()), posenc::ShapeError);
  EXPECT_THROW(posenc::sinusoidal_encode(c, {1, -2, 3, 4}, out.view()), posenc::ValueError);
}

// Checks x_after = x_before + PE(position(b, i)) for every element: the library forms the sum in
// double and rounds once, so the float32 result is within 1 ulp of the exact sum (plus the tiny
// angle error of pe_bound).
void expect_added(const SinusoidalConfig& c, const std::vector<float>& before,
                  const std::vector<float>& after, int64_t batch, int64_t seq,
                  const std::function<int64_t(int64_t, int64_t)>& position) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < seq; ++i) {
      const int64_t p = position(b, i);
      for (int64_t k = 0; k < c.dim; ++k) {
        const std::size_t at = static_cast<std::size_t>((b * seq + i) * c.dim + k);
        double angle_err;
        const long double pe = pe_ld(c, p, k, &angle_err);
        const long double want = static_cast<long double>(before[at]) + pe;
        const double tol = pe_bound(want, angle_err);
        ASSERT_NEAR(after[at], static_cast<double>(want), tol)
            << "b " << b << " i " << i << " k " << k << " p " << p;
      }
    }
  }
}

TEST(Sinusoidal, AddWithDefaultSharedAndPerRowPositions) {
  Rng rng(posenc_test::test_seed(), 12);
  SCOPED_TRACE(posenc_test::seed_trace());
  for (int64_t d : {2, 7, 16, 130}) {
    for (auto layout : {SinLayout::kInterleaved, SinLayout::kConcat}) {
      const SinusoidalConfig c{
          .dim = d, .layout = layout, .origin = 2, .odd_dim = SinOddDim::kZeroPad};
      const int64_t batch = 3, seq = 7;
      SCOPED_TRACE(describe(c));
      const auto x0 = rng.values(static_cast<std::size_t>(batch * seq * d), -2.0, 2.0);

      std::vector<int64_t> shared_ids(static_cast<std::size_t>(seq));
      for (auto& id : shared_ids) id = rng.integer(0, kP24);
      std::vector<int64_t> row_ids(static_cast<std::size_t>(batch * seq));
      for (auto& id : row_ids) id = rng.integer(0, 5000);
      const auto shared = Positions::shared(shared_ids);
      const auto per_row = Positions::per_row(row_ids, batch, seq);

      // Non-contiguous x: permuted [seq, batch, dim] storage with padding and a strided last dim.
      {
        Strided<float, 3> x({batch, seq, d}, x0, 2, {1, 0, 2}, 2);
        SCOPED_TRACE("default positions (origin), " + x.describe());
        posenc::add_sinusoidal(c, x.view());
        EXPECT_TRUE(x.outside_untouched());
        expect_added(c, x0, x.values(), batch, seq, [&](int64_t, int64_t i) { return 2 + i; });
      }
      {
        Strided<float, 3> x({batch, seq, d}, x0, 1);
        SCOPED_TRACE("shared positions, " + x.describe());
        posenc::add_sinusoidal(c, x.view(), &shared);
        EXPECT_TRUE(x.outside_untouched());
        // Explicit positions are absolute: the origin only sets the default.
        expect_added(c, x0, x.values(), batch, seq,
                     [&](int64_t, int64_t i) { return shared_ids[static_cast<std::size_t>(i)]; });
      }
      {
        Strided<float, 3> x({batch, seq, d}, x0, 3, {2, 1, 0});
        SCOPED_TRACE("per-row positions, " + x.describe());
        posenc::add_sinusoidal(c, x.view(), &per_row);
        EXPECT_TRUE(x.outside_untouched());
        expect_added(c, x0, x.values(), batch, seq, [&](int64_t b, int64_t i) {
          return row_ids[static_cast<std::size_t>(b * seq + i)];
        });
      }
    }
  }
}

TEST(Sinusoidal, AddRejectsBadShapesAndPositions) {
  std::vector<float> buf(2 * 3 * 8);
  const auto x = posenc::View<float, 3>::contiguous(buf.data(), {2, 3, 8});
  EXPECT_THROW(posenc::add_sinusoidal({.dim = 6}, x), posenc::ShapeError);
  const auto short_ids = Positions::shared({0, 1});
  EXPECT_THROW(posenc::add_sinusoidal({.dim = 8}, x, &short_ids), posenc::ShapeError);
  const auto rows = Positions::per_row({0, 1, 2}, 1, 3);
  EXPECT_THROW(posenc::add_sinusoidal({.dim = 8}, x, &rows), posenc::ShapeError);
  const auto negative = Positions::shared({0, -1, 2});
  EXPECT_THROW(posenc::add_sinusoidal({.dim = 8}, x, &negative), posenc::ValueError);
  EXPECT_THROW(posenc::add_sinusoidal({.dim = 0}, x), posenc::ValueError);
  // Nothing was added by the failed calls.
  EXPECT_EQ(buf, std::vector<float>(buf.size(), 0.0f));
}

}  // namespace
