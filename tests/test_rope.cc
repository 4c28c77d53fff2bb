// tests/test_rope.cc - rotary position embedding (docs/rope.md and its scaling section,
// docs/precision.md) against an independent long double formula written here (complex rotation per
// pair), plus the HF frequency scalings checked against hand computations.
#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <cstdio>
#include <functional>
#include <numbers>
#include <string>
#include <vector>

#include "posenc/error.h"
#include "posenc/rope.h"
#include "posenc/tensor.h"
#include "test_util.h"

namespace {

using posenc::Direction;
using posenc::Positions;
using posenc::RopeConfig;
using posenc::RopeFrequencies;
using posenc::RopeScaling;
using posenc::RopeScalingType;
using posenc::RopeStyle;
using posenc::View;
using posenc_test::Rng;
using posenc_test::Strided;
using posenc_test::ulp_f32;

using Shape = std::array<int64_t, 4>;  // [batch, seq, heads, head_dim]
using PositionFn = std::function<int64_t(int64_t, int64_t)>;

constexpr int64_t kP16 = int64_t{1} << 16;
constexpr int64_t kP20 = int64_t{1} << 20;
constexpr int64_t kP24 = int64_t{1} << 24;

const char* style_name(RopeStyle s) { return s == RopeStyle::kHalf ? "half" : "interleaved"; }

std::string describe(const Shape& s, int64_t r, RopeStyle style) {
  return "x " + posenc::shape_str(s) + " rotary_dim " + std::to_string(r) + " style " +
         style_name(style);
}

// docs/rope.md inverse frequencies theta^(-2i/R) in long double.
long double inv_freq_ld(double theta, int64_t r, int64_t i) {
  return std::exp(-2.0L * static_cast<long double>(i) / static_cast<long double>(r) *
                  std::log(static_cast<long double>(theta)));
}

// Bound on the relative error of a double theta^(-2i/R) from pow: 1 ulp, plus the rounding of the
// exponent 2i/R amplified by |2i/R ln theta|.
double inv_freq_rel_err(double theta, int64_t r, int64_t i) {
  return 0x1p-52 +
         2.0 * static_cast<double>(i) / static_cast<double>(r) * std::log(theta) * 0x1p-53;
}

// The rotation of docs/rope.md, written independently of the library: the pair (x0, x1) (indices
// (i, i + R/2) for half, (2i, 2i + 1) for interleaved) is the complex number x0 + i x1 and becomes
// (x0 + i x1) * af * e^{i sign a} with a = p * inv_freq[i] (long double). Dims >= R pass through.
// `bound` receives, per element, a bound on |float32 output - exact| for an implementation that
// forms a in double and rounds once: one float32 ulp of the result plus |z| af (a 2^-52 + 2^-48)
// (angle rounding, double cos/sin and products).
struct Expected {
  std::vector<long double> y;
  std::vector<double> bound;
};
Expected rope_expected(const std::vector<float>& x, const Shape& s, const std::vector<double>& inv,
                       double af, RopeStyle style, const PositionFn& position, double sign = 1) {
  const int64_t pairs = static_cast<int64_t>(inv.size()), d = s[3];
  Expected e;
  e.y.assign(x.begin(), x.end());
  e.bound.assign(x.size(), 0.0);
  for (int64_t b = 0; b < s[0]; ++b) {
    for (int64_t l = 0; l < s[1]; ++l) {
      const long double p = static_cast<long double>(position(b, l));
      for (int64_t h = 0; h < s[2]; ++h) {
        const std::size_t row = static_cast<std::size_t>(((b * s[1] + l) * s[2] + h) * d);
        for (int64_t i = 0; i < pairs; ++i) {
          const std::size_t i0 =
              row + static_cast<std::size_t>(style == RopeStyle::kHalf ? i : 2 * i);
          const std::size_t i1 =
              row + static_cast<std::size_t>(style == RopeStyle::kHalf ? i + pairs : 2 * i + 1);
          const long double a = p * static_cast<long double>(inv[static_cast<std::size_t>(i)]);
          const std::complex<long double> z(x[i0], x[i1]);
          const std::complex<long double> y =
              z * std::polar(static_cast<long double>(af), static_cast<long double>(sign) * a);
          e.y[i0] = y.real();
          e.y[i1] = y.imag();
          const double slack = static_cast<double>(std::abs(z)) * std::fabs(af) *
                               (static_cast<double>(a) * 0x1p-52 + 0x1p-48);
          e.bound[i0] = ulp_f32(static_cast<double>(y.real())) + slack;
          e.bound[i1] = ulp_f32(static_cast<double>(y.imag())) + slack;
        }
      }
    }
  }
  return e;
}

void expect_matches(const std::vector<float>& got, const Expected& want, const Shape& s) {
  ASSERT_EQ(got.size(), want.y.size());
  for (std::size_t k = 0; k < got.size(); ++k) {
    const int64_t flat = static_cast<int64_t>(k);
    ASSERT_NEAR(got[k], static_cast<double>(want.y[k]), want.bound[k])
        << "at [" << flat / (s[1] * s[2] * s[3]) << ", " << flat / (s[2] * s[3]) % s[1] << ", "
        << flat / s[3] % s[2] << ", " << flat % s[3] << "]";
  }
}

// Dims >= R must equal the input bit for bit.
void expect_pass_through(const std::vector<float>& got, const std::vector<float>& x, int64_t d,
                         int64_t r) {
  for (std::size_t k = 0; k < x.size(); ++k) {
    if (static_cast<int64_t>(k) % d >= r) {
      ASSERT_TRUE(posenc_test::same_bits(got[k], x[k])) << "pass-through element " << k;
    }
  }
}

RopeFrequencies default_freqs(int64_t d, int64_t r = 0, double theta = 1e4) {
  return posenc::rope_frequencies(RopeConfig{.head_dim = d, .rotary_dim = r, .base = theta});
}

std::vector<float> random_x(Rng& rng, const Shape& s) {
  auto x = rng.values(static_cast<std::size_t>(s[0] * s[1] * s[2] * s[3]), -2.0, 2.0);
  // A negative zero in a pass-through or rotated slot: copies must keep its sign bit.
  if (!x.empty()) x.back() = -0.0f;
  return x;
}

// ----------------------------------------------------------------------------------------------
// The rotation.

TEST(Rope, HandComputedSmallCase) {
  // D = 4, theta = 100: inv_freq = [1, 100^(-2/4) = 0.1], position 1, x = (1, 2, 3, 4).
  const double c1 = std::cos(1.0), s1 = std::sin(1.0), c2 = std::cos(0.1), s2 = std::sin(0.1);
  const std::vector<double> half = {c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + s1, 4 * c2 + 2 * s2};
  const std::vector<double> inter = {c1 - 2 * s1, 2 * c1 + s1, 3 * c2 - 4 * s2, 4 * c2 + 3 * s2};
  const auto freqs = default_freqs(4, 0, 100.0);
  ASSERT_EQ(freqs.inv_freq.size(), 2u);
  for (auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    SCOPED_TRACE(style_name(style));
    std::vector<float> x = {1, 2, 3, 4};
    const auto pos = Positions::offset(1);
    posenc::apply_rope(freqs, style, View<float, 4>::contiguous(x.data(), {1, 1, 1, 4}), &pos);
    const auto& want = style == RopeStyle::kHalf ? half : inter;
    for (std::size_t k = 0; k < 4; ++k) EXPECT_NEAR(x[k], want[k], 4 * ulp_f32(want[k])) << k;
  }
}

TEST(Rope, MatchesIndependentFormula) {
  Rng rng(posenc_test::test_seed(), 30);
  SCOPED_TRACE(posenc_test::seed_trace());
  for (int64_t d : {2, 8, 64, 130}) {
    for (int64_t r : {d, d / 2 - (d / 2) % 2, int64_t{2}}) {
      if (r < 2) continue;
      for (auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
        const Shape s = {2, 7, 3, d};
        SCOPED_TRACE(describe(s, r, style));
        const auto freqs = default_freqs(d, r);
        const auto x0 = random_x(rng, s);
        std::vector<int64_t> shared_ids(7), row_ids(14);
        for (auto& id : shared_ids) id = rng.integer(0, kP20);
        // Per row: left padding in row 0 (repeated 0), a packed row 1 (restarts).
        row_ids = {0, 0, 0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3};
        const auto off = Positions::offset(5), shared = Positions::shared(shared_ids),
                   per_row = Positions::per_row(row_ids, 2, 7);
        struct PosCase {
          const char* name;
          const Positions* pos;
          PositionFn fn;
        };
        const PosCase cases[] = {
            {"default", nullptr, [](int64_t, int64_t l) { return l; }},
            {"offset 5", &off, [](int64_t, int64_t l) { return 5 + l; }},
            {"shared", &shared,
             [&](int64_t, int64_t l) { return shared_ids[static_cast<std::size_t>(l)]; }},
            {"per row", &per_row,
             [&](int64_t b, int64_t l) { return row_ids[static_cast<std::size_t>(b * 7 + l)]; }},
        };
        for (const auto& pc : cases) {
          SCOPED_TRACE(pc.name);
          const auto want = rope_expected(x0, s, freqs.inv_freq, 1.0, style, pc.fn);
          // Out of place between two different non-contiguous layouts.
          Strided<float, 4> x(s, x0, 1, {1, 0, 2, 3});
          Strided<float, 4> out(s, 2, {2, 3, 0, 1}, 2);
          posenc::apply_rope(freqs, style, x.cview(), out.view(), pc.pos);
          EXPECT_TRUE(out.outside_untouched());
          EXPECT_EQ(x.values(), x0);
          expect_matches(out.values(), want, s);
          expect_pass_through(out.values(), x0, d, r);
          // In place on a padded view with a strided last dimension.
          Strided<float, 4> y(s, x0, 3, Strided<float, 4>::identity(), 3);
          posenc::apply_rope(freqs, style, y.view(), pc.pos);
          EXPECT_TRUE(y.outside_untouched());
          expect_matches(y.values(), want, s);
          expect_pass_through(y.values(), x0, d, r);
        }
      }
    }
  }
}

TEST(Rope, InPlaceEqualsOutOfPlaceBitwise) {
  Rng rng(posenc_test::test_seed(), 31);
  SCOPED_TRACE(posenc_test::seed_trace());
  for (auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    for (auto dir : {Direction::kForward, Direction::kInverse}) {
      const Shape s = {3, 5, 4, 130};
      SCOPED_TRACE(describe(s, 96, style));
      const auto freqs = default_freqs(130, 96, 5e5);
      const auto x0 = random_x(rng, s);
      const auto pos = Positions::offset(kP20 - 2);
      std::vector<float> out(x0.size()), inplace = x0;
      posenc::apply_rope(freqs, style, View<const float, 4>::contiguous(x0.data(), s),
                         View<float, 4>::contiguous(out.data(), s), &pos, dir);
      posenc::apply_rope(freqs, style, View<float, 4>::contiguous(inplace.data(), s), &pos, dir);
      for (std::size_t k = 0; k < out.size(); ++k) {
        ASSERT_TRUE(posenc_test::same_bits(out[k], inplace[k])) << k;
      }
      // The two-argument form with out == x is the same in-place call.
      std::vector<float> alias = x0;
      const auto av = View<float, 4>::contiguous(alias.data(), s);
      posenc::apply_rope(freqs, style, av, av, &pos, dir);
      EXPECT_EQ(alias, out);
    }
  }
}

TEST(Rope, BroadcastInputWithZeroStride) {
  // x with heads stride 0 (one vector read for every head) rotated into a full output.
  Rng rng(posenc_test::test_seed(), 32);
  SCOPED_TRACE(posenc_test::seed_trace());
  const auto one = rng.values(2 * 3 * 8);
  const View<const float, 4> x{one.data(), {2, 3, 4, 8}, {24, 8, 0, 1}};
  std::vector<float> out(2 * 3 * 4 * 8);
  posenc::apply_rope(default_freqs(8), RopeStyle::kHalf, x,
                     View<float, 4>::contiguous(out.data(), {2, 3, 4, 8}));
  std::vector<float> want(2 * 3 * 1 * 8);
  posenc::apply_rope(default_freqs(8), RopeStyle::kHalf,
                     View<const float, 4>::contiguous(one.data(), {2, 3, 1, 8}),
                     View<float, 4>::contiguous(want.data(), {2, 3, 1, 8}));
  for (std::size_t k = 0; k < out.size(); ++k) {
    const std::size_t bl = k / 32, dd = k % 8;
    ASSERT_EQ(out[k], want[bl * 8 + dd]) << k;
  }
}

TEST(Rope, InverseUndoesForward) {
  Rng rng(posenc_test::test_seed(), 33);
  SCOPED_TRACE(posenc_test::seed_trace());
  RopeConfig yarn{
      .head_dim = 64,
      .scaling = {
          .type = RopeScalingType::kYarn, .factor = 4, .original_max_position_embeddings = 4096}};
  for (bool scaled : {false, true}) {
    for (auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
      const Shape s = {2, 7, 3, 64};
      SCOPED_TRACE(describe(s, 64, style) + (scaled ? " yarn af" : " af 1"));
      const auto freqs = scaled ? posenc::rope_frequencies(yarn) : default_freqs(64);
      const double af = freqs.attention_factor;
      if (scaled) {
        ASSERT_GT(af, 1.0);
      }
      const auto x0 = random_x(rng, s);
      for (int64_t start : {int64_t{0}, kP20, kP24, int64_t{1} << 40}) {
        SCOPED_TRACE("offset " + std::to_string(start));
        const auto pos = Positions::offset(start);
        std::vector<float> y = x0;
        const auto v = View<float, 4>::contiguous(y.data(), s);
        posenc::apply_rope(freqs, style, v, &pos);
        posenc::apply_rope(freqs, style, v, &pos, Direction::kInverse);
        // Inverse(forward(x)) = af^2 x: two float32 roundings of a rotation, so within a few
        // 2^-24 of each pair's norm; we require 1e-6 relative to the pair norm.
        for (std::size_t k = 0; k < y.size(); k += 64) {
          for (std::size_t i = 0; i < 32; ++i) {
            const std::size_t i0 = k + (style == RopeStyle::kHalf ? i : 2 * i);
            const std::size_t i1 = k + (style == RopeStyle::kHalf ? i + 32 : 2 * i + 1);
            const double norm = std::hypot(x0[i0], x0[i1]);
            ASSERT_NEAR(y[i0], af * af * x0[i0], 1e-6 * af * af * norm) << i0;
            ASSERT_NEAR(y[i1], af * af * x0[i1], 1e-6 * af * af * norm) << i1;
          }
        }
      }
    }
  }
}

TEST(Rope, InverseMatchesNegativeAngle) {
  Rng rng(posenc_test::test_seed(), 34);
  SCOPED_TRACE(posenc_test::seed_trace());
  RopeConfig cfg{.head_dim = 16,
                 .scaling = {.type = RopeScalingType::kYarn,
                             .factor = 8,
                             .original_max_position_embeddings = 256,
                             .attention_factor = 1.25}};
  const auto freqs = posenc::rope_frequencies(cfg);
  ASSERT_EQ(freqs.attention_factor, 1.25);
  for (auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    const Shape s = {1, 5, 2, 16};
    SCOPED_TRACE(describe(s, 16, style));
    const auto x0 = random_x(rng, s);
    const auto pos = Positions::offset(1000);
    std::vector<float> y = x0;
    posenc::apply_rope(freqs, style, View<float, 4>::contiguous(y.data(), s), &pos,
                       Direction::kInverse);
    expect_matches(
        y,
        rope_expected(
            x0, s, freqs.inv_freq, 1.25, style, [](int64_t, int64_t l) { return 1000 + l; }, -1.0),
        s);
  }
}

TEST(Rope, PreservesNormWhenAttentionFactorIsOne) {
  Rng rng(posenc_test::test_seed(), 35);
  SCOPED_TRACE(posenc_test::seed_trace());
  for (int64_t d : {2, 8, 130}) {
    for (auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
      const Shape s = {2, 7, 3, d};
      SCOPED_TRACE(describe(s, d, style));
      const auto x0 = random_x(rng, s);
      std::vector<float> y = x0;
      const auto pos = Positions::offset(rng.integer(0, kP24));
      posenc::apply_rope(default_freqs(d), style, View<float, 4>::contiguous(y.data(), s), &pos);
      for (std::size_t k = 0; k < y.size(); k += static_cast<std::size_t>(d)) {
        double nx = 0, ny = 0;
        for (std::size_t j = k; j < k + static_cast<std::size_t>(d); ++j) {
          nx += static_cast<double>(x0[j]) * x0[j];
          ny += static_cast<double>(y[j]) * y[j];
        }
        // Each element is within one float32 rounding: |ny - nx| / nx <= ~2^-22.
        ASSERT_NEAR(std::sqrt(ny), std::sqrt(nx), 1e-6 * std::sqrt(nx)) << "vector at " << k;
      }
    }
  }
}

TEST(Rope, DotProductDependsOnlyOnRelativePosition) {
  // <rope(q, m), rope(k, n)> is a function of n - m (float64 reference). The double angles are
  // within about 2^-52 * p rad, which bounds the spread of the dot products.
  Rng rng(posenc_test::test_seed(), 36);
  SCOPED_TRACE(posenc_test::seed_trace());
  for (auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    for (int64_t r : {64, 32}) {
      SCOPED_TRACE(std::string(style_name(style)) + " R " + std::to_string(r));
      const auto freqs = default_freqs(64, r);
      std::vector<double> q(64), k(64);
      for (auto& v : q) v = rng.uniform();
      for (auto& v : k) v = rng.uniform();
      double qn = 0, kn = 0;
      for (std::size_t u = 0; u < 64; ++u) {
        qn += q[u] * q[u];
        kn += k[u] * k[u];
      }
      const double scale = std::sqrt(qn * kn);
      auto rotated_dot = [&](int64_t m, int64_t n) {
        std::vector<double> qr(64), kr(64);
        const auto pm = Positions::offset(m), pn = Positions::offset(n);
        posenc::ref::apply_rope(freqs, style,
                                View<const double, 4>::contiguous(q.data(), {1, 1, 1, 64}),
                                View<double, 4>::contiguous(qr.data(), {1, 1, 1, 64}), &pm);
        posenc::ref::apply_rope(freqs, style,
                                View<const double, 4>::contiguous(k.data(), {1, 1, 1, 64}),
                                View<double, 4>::contiguous(kr.data(), {1, 1, 1, 64}), &pn);
        double dot = 0;
        for (std::size_t u = 0; u < 64; ++u) dot += qr[u] * kr[u];
        return dot;
      };
      for (int64_t delta : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{-3}, int64_t{1000}}) {
        const int64_t m0 = std::max<int64_t>(0, -delta);
        const double base = rotated_dot(m0, m0 + delta);
        for (int64_t m : {m0 + 1, m0 + 100, kP16, kP20}) {
          const double tol = 8.0 * static_cast<double>(m + std::abs(delta) + 1) * 0x1p-52 * scale;
          EXPECT_NEAR(rotated_dot(m, m + delta), base, tol) << "m " << m << " delta " << delta;
        }
      }
      // ... and it does change with the offset (the property is not vacuous).
      EXPECT_GT(std::fabs(rotated_dot(0, 1) - rotated_dot(0, 5)), 1e-6 * scale);
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Precision at long contexts (docs/rope.md, docs/precision.md).

TEST(Rope, Float32MatchesFloat64AtLargePositions) {
  // The float32 output against (a) ref::apply_rope (float64, same inputs) in ulps of the
  // reference value and (b) the independent long double rotation in ulps of the pair magnitude.
  // Measured with the default seed on x86-64 (glibc): (a) max 0.5 ulp at 2^16, 2^20 and 2^24,
  // i.e. the output is the float64 result correctly rounded; (b) max ~0.5 ulp of |z|.
  Rng rng(posenc_test::test_seed(), 37);
  SCOPED_TRACE(posenc_test::seed_trace());
  for (int64_t p0 : {kP16, kP20, kP24}) {
    for (auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
      const Shape s = {2, 4, 2, 128};
      SCOPED_TRACE(describe(s, 128, style) + " positions from " + std::to_string(p0));
      const auto freqs = default_freqs(128, 0, 5e5);
      const auto x0 = random_x(rng, s);
      std::vector<int64_t> ids = {p0 - 1, p0, p0 + 1, p0 + 12345, p0, p0 - 7, p0 + 3, p0 + 999};
      const auto pos = Positions::per_row(ids, 2, 4);
      std::vector<float> y(x0.size());
      posenc::apply_rope(freqs, style, View<const float, 4>::contiguous(x0.data(), s),
                         View<float, 4>::contiguous(y.data(), s), &pos);
      std::vector<double> xd(x0.begin(), x0.end()), yd(x0.size());
      posenc::ref::apply_rope(freqs, style, View<const double, 4>::contiguous(xd.data(), s),
                              View<double, 4>::contiguous(yd.data(), s), &pos);
      const auto exact = rope_expected(
          x0, s, freqs.inv_freq, 1.0, style,
          [&](int64_t b, int64_t l) { return ids[static_cast<std::size_t>(b * 4 + l)]; });
      double worst_ref = 0, worst_exact = 0;
      for (std::size_t k = 0; k < y.size(); ++k) {
        worst_ref = std::max(worst_ref, std::fabs(y[k] - yd[k]) / ulp_f32(yd[k]));
        // Pair magnitude of element k (its partner in the pair).
        const std::size_t row = k / 128 * 128, j = k % 128;
        const std::size_t partner =
            style == RopeStyle::kHalf ? row + (j + 64) % 128 : row + (j ^ 1u);
        const double mag = std::hypot(static_cast<double>(x0[k]), static_cast<double>(x0[partner]));
        worst_exact = std::max(
            worst_exact,
            std::fabs(static_cast<double>(y[k]) - static_cast<double>(exact.y[k])) / ulp_f32(mag));
      }
      std::printf(
          "[ measured ] rope %s p~%lld: max err %.3f ulp vs ref::apply_rope, %.3f ulp(|z|) "
          "vs exact\n",
          style_name(style), static_cast<long long>(p0), worst_ref, worst_exact);
      EXPECT_LE(worst_ref, 0.5);
      EXPECT_LE(worst_exact, 2.0);
    }
  }
}

TEST(Rope, Float32AnglesWouldBeWrongAt2To20) {
  // Why the library forms p * inv_freq in double: the float32 recipe of the peers (inv_freq and
  // the product in float32) is off by more than 1e-3 rad at p = 2^20 for the high frequencies
  // (i = 0 is exact since inv_freq[0] = 1; from i = 1 on both roundings bite), while the library's
  // output stays within float32 rounding of the exact rotation.
  const int64_t p = kP20;
  const auto freqs = default_freqs(128);
  double worst = 0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < 64; ++i) {
    const float a32 =
        static_cast<float>(p) * static_cast<float>(freqs.inv_freq[static_cast<std::size_t>(i)]);
    const long double exact = static_cast<long double>(p) * inv_freq_ld(1e4, 128, i);
    const double err = static_cast<double>(std::fabs(static_cast<long double>(a32) - exact));
    if (i == 0) {
      EXPECT_EQ(err, 0.0);
    }
    if (err > worst) worst = err, worst_i = i;
  }
  std::printf("[ measured ] float32 angle error at p = 2^20: %.3g rad (pair %lld)\n", worst,
              static_cast<long long>(worst_i));
  EXPECT_GT(worst, 1e-3);
  // A float32-angle rotation of a unit pair at that frequency is off by about `worst`; the library
  // rotation is within float32 rounding.
  std::vector<float> x(128, 0.0f);
  x[static_cast<std::size_t>(worst_i)] = 1.0f;  // half style: pair (worst_i, worst_i + 64)
  const auto pos = Positions::offset(p);
  posenc::apply_rope(freqs, RopeStyle::kHalf, View<float, 4>::contiguous(x.data(), {1, 1, 1, 128}),
                     &pos);
  const long double a = static_cast<long double>(p) * inv_freq_ld(1e4, 128, worst_i);
  EXPECT_NEAR(x[static_cast<std::size_t>(worst_i)], static_cast<double>(std::cos(a)), 1.2e-7);
  EXPECT_NEAR(x[static_cast<std::size_t>(worst_i + 64)], static_cast<double>(std::sin(a)), 1.2e-7);
}

// ----------------------------------------------------------------------------------------------
// Frequencies (docs/rope.md, scaling).

TEST(RopeFrequencies, DefaultIsThetaToMinusTwoIOverR) {
  for (double theta : {1e4, 5e5, 1e6}) {
    for (auto [d, r] : {std::pair<int64_t, int64_t>{128, 0},
                        {128, 128},
                        {128, 32},
                        {64, 16},
                        {80, 20},
                        {2, 0},
                        {130, 0}}) {
      SCOPED_TRACE("theta " + std::to_string(theta) + " D " + std::to_string(d) + " R " +
                   std::to_string(r));
      const auto f = default_freqs(d, r, theta);
      const int64_t rr = r == 0 ? d : r;
      ASSERT_EQ(f.inv_freq.size(), static_cast<std::size_t>(rr / 2));
      EXPECT_EQ(f.rotary_dim(), rr);
      EXPECT_EQ(f.attention_factor, 1.0);
      EXPECT_EQ(f.inv_freq[0], 1.0);
      for (int64_t i = 0; i < rr / 2; ++i) {
        const double want = static_cast<double>(inv_freq_ld(theta, rr, i));
        EXPECT_NEAR(f.inv_freq[static_cast<std::size_t>(i)], want,
                    want * inv_freq_rel_err(theta, rr, i))
            << "i " << i;
      }
    }
  }
}

TEST(RopeFrequencies, LinearDividesByFactor) {
  const auto base = default_freqs(128, 0, 1e4);
  for (double f : {2.0, 4.0, 0.5, 3.7}) {
    RopeConfig cfg{.head_dim = 128, .scaling = {.type = RopeScalingType::kLinear, .factor = f}};
    const auto lin = posenc::rope_frequencies(cfg, 100000);
    ASSERT_EQ(lin.inv_freq.size(), 64u);
    EXPECT_EQ(lin.attention_factor, 1.0);
    for (std::size_t i = 0; i < 64; ++i) {
      EXPECT_NEAR(lin.inv_freq[i], base.inv_freq[i] / f, base.inv_freq[i] / f * 0x1p-52) << i;
    }
  }
}

TEST(RopeFrequencies, Llama3Bands) {
  // Llama 3.1: Lo = 8192, f = 8, low = 1, high = 4, theta = 500000, R = 128.
  // wl_i = 2 pi theta^(2i/128). By hand: wl < Lo/high = 2048 iff
  //   i < 64 ln(2048 / 2pi) / ln(500000) = 64 * 5.787 / 13.122 = 28.2,
  // wl > Lo/low = 8192 iff i > 64 ln(8192 / 2pi) / ln(500000) = 64 * 7.173 / 13.122 = 34.98.
  // So i in [0, 28] keeps inv_freq, i in [35, 63] divides it by 8 and i in [29, 34] blends.
  const RopeConfig cfg{.head_dim = 128,
                       .base = 5e5,
                       .scaling = {.type = RopeScalingType::kLlama3,
                                   .factor = 8,
                                   .original_max_position_embeddings = 8192,
                                   .low_freq_factor = 1,
                                   .high_freq_factor = 4}};
  const auto f = posenc::rope_frequencies(cfg, 131072);
  const auto base = default_freqs(128, 0, 5e5);
  ASSERT_EQ(f.inv_freq.size(), 64u);
  EXPECT_EQ(f.attention_factor, 1.0);
  for (std::size_t i = 0; i < 64; ++i) {
    SCOPED_TRACE("i " + std::to_string(i));
    const double inv = base.inv_freq[i];
    const double tol = inv * 0x1p-50;
    if (i <= 28) {
      EXPECT_NEAR(f.inv_freq[i], inv, tol);
    } else if (i >= 35) {
      EXPECT_NEAR(f.inv_freq[i], inv / 8, tol);
    } else {
      const double wl = 2 * std::numbers::pi / inv;
      const double sigma = (8192 / wl - 1) / (4 - 1);
      EXPECT_GT(sigma, 0.0);
      EXPECT_LT(sigma, 1.0);
      EXPECT_NEAR(f.inv_freq[i], (1 - sigma) * inv / 8 + sigma * inv, tol);
      EXPECT_LT(f.inv_freq[i], inv);
      EXPECT_GT(f.inv_freq[i], inv / 8);
    }
    if (i > 0) {
      EXPECT_LT(f.inv_freq[i], f.inv_freq[i - 1]);  // still monotone
    }
  }
}

TEST(RopeFrequencies, Yarn) {
  // R = 128, theta = 10000, Lo = 4096, f = 4. By hand:
  //   corr(32) = 128 ln(4096 / (2 pi 32)) / (2 ln 10000) = 128 * 3.0141 / 18.4207 = 20.94 -> 20
  //   corr(1)  = 128 ln(4096 / (2 pi))    / (2 ln 10000) = 128 * 6.4799 / 18.4207 = 45.03 -> 46
  // so pairs i <= 20 keep inv_freq, i >= 46 use inv_freq / 4, and between them
  // ramp = (i - 20) / 26 blends. Attention factor 0.1 ln 4 + 1.
  RopeConfig cfg{
      .head_dim = 128,
      .scaling = {
          .type = RopeScalingType::kYarn, .factor = 4, .original_max_position_embeddings = 4096}};
  const auto base = default_freqs(128);
  {
    const auto f = posenc::rope_frequencies(cfg);
    EXPECT_NEAR(f.attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-15);
    for (std::size_t i = 0; i < 64; ++i) {
      const double inv = base.inv_freq[i];
      const double ramp = std::clamp((static_cast<double>(i) - 20.0) / 26.0, 0.0, 1.0);
      EXPECT_NEAR(f.inv_freq[i], inv / 4 * ramp + inv * (1 - ramp), inv * 0x1p-50) << i;
      if (i <= 20) {
        EXPECT_NEAR(f.inv_freq[i], inv, inv * 0x1p-52) << i;
      }
      if (i >= 46) {
        EXPECT_NEAR(f.inv_freq[i], inv / 4, inv * 0x1p-52) << i;
      }
    }
  }
  {
    // truncate = false: the unrounded corrections 20.94.. and 45.03.. bound the ramp.
    RopeConfig c2 = cfg;
    c2.scaling.truncate = false;
    const auto f = posenc::rope_frequencies(c2);
    const double lo = 128 * std::log(4096 / (2 * std::numbers::pi * 32)) / (2 * std::log(1e4));
    const double hi = 128 * std::log(4096 / (2 * std::numbers::pi)) / (2 * std::log(1e4));
    EXPECT_NEAR(lo, 20.94, 0.01);
    EXPECT_NEAR(hi, 45.03, 0.01);
    for (std::size_t i = 0; i < 64; ++i) {
      const double inv = base.inv_freq[i];
      const double ramp = std::clamp((static_cast<double>(i) - lo) / (hi - lo), 0.0, 1.0);
      EXPECT_NEAR(f.inv_freq[i], inv / 4 * ramp + inv * (1 - ramp), inv * 0x1p-48) << i;
    }
  }
  {
    // Explicit attention_factor wins; otherwise mscale / mscale_all_dim when both are given.
    RopeConfig c3 = cfg;
    c3.scaling.attention_factor = 0.75;
    EXPECT_EQ(posenc::rope_frequencies(c3).attention_factor, 0.75);
    RopeConfig c4 = cfg;
    c4.scaling.mscale = 1.0;
    c4.scaling.mscale_all_dim = 0.707;
    const double want = (0.1 * 1.0 * std::log(4.0) + 1) / (0.1 * 0.707 * std::log(4.0) + 1);
    EXPECT_NEAR(posenc::rope_frequencies(c4).attention_factor, want, 1e-15);
    RopeConfig c5 = cfg;
    c5.scaling.mscale = 1.0;
    c5.scaling.mscale_all_dim = 1.0;  // DeepSeek-V3 style: equal mscales cancel
    EXPECT_NEAR(posenc::rope_frequencies(c5).attention_factor, 1.0, 1e-15);
    RopeConfig c6 = cfg;
    c6.scaling.factor = 1.0;  // mscale(f <= 1) = 1
    EXPECT_EQ(posenc::rope_frequencies(c6).attention_factor, 1.0);
  }
}

TEST(RopeFrequencies, DynamicNtkChangesOnlyAboveOriginalLength) {
  const RopeConfig cfg{.head_dim = 64,
                       .scaling = {.type = RopeScalingType::kDynamic,
                                   .factor = 2,
                                   .original_max_position_embeddings = 2048}};
  const auto base = default_freqs(64);
  for (int64_t len : {0, 1, 1000, 2048}) {
    const auto f = posenc::rope_frequencies(cfg, len);
    EXPECT_EQ(f.inv_freq, base.inv_freq) << "seq_len " << len;
    EXPECT_EQ(f.attention_factor, 1.0);
  }
  for (int64_t len : {2049, 4096, 100000}) {
    SCOPED_TRACE("seq_len " + std::to_string(len));
    const auto f = posenc::rope_frequencies(cfg, len);
    // theta' = theta ((f L / Lo) - (f - 1))^(R / (R - 2)).
    const long double theta =
        1e4L * std::pow(2.0L * static_cast<long double>(len) / 2048.0L - 1.0L, 64.0L / 62.0L);
    EXPECT_EQ(f.inv_freq[0], 1.0);
    for (int64_t i = 1; i < 32; ++i) {
      const double want = static_cast<double>(
          std::exp(-2.0L * static_cast<long double>(i) / 64.0L * std::log(theta)));
      EXPECT_NEAR(f.inv_freq[static_cast<std::size_t>(i)], want, want * 1e-14) << i;
      EXPECT_LT(f.inv_freq[static_cast<std::size_t>(i)],
                base.inv_freq[static_cast<std::size_t>(i)]);
    }
  }
}

TEST(RopeFrequencies, LongRopeSwitchesAboveOriginalLength) {
  // R = 8: 4 pairs; Lo = 4096, max_position_embeddings = 131072 -> s = 32 and
  // af = sqrt(1 + ln 32 / ln 4096) = sqrt(1 + 5/12) exactly in real arithmetic.
  const std::vector<double> short_f = {1.0, 1.25, 1.5, 2.0}, long_f = {1.0, 2.0, 4.0, 8.0};
  RopeConfig cfg{.head_dim = 8,
                 .scaling = {.type = RopeScalingType::kLongRope,
                             .original_max_position_embeddings = 4096,
                             .max_position_embeddings = 131072,
                             .short_factor = short_f,
                             .long_factor = long_f}};
  auto expect_ext = [&](int64_t len, const std::vector<double>& ext) {
    SCOPED_TRACE("seq_len " + std::to_string(len));
    const auto f = posenc::rope_frequencies(cfg, len);
    ASSERT_EQ(f.inv_freq.size(), 4u);
    for (std::size_t i = 0; i < 4; ++i) {
      const double want = 1.0 / (ext[i] * std::pow(1e4, 2.0 * static_cast<double>(i) / 8.0));
      EXPECT_NEAR(f.inv_freq[i], want, want * 0x1p-50) << i;
    }
    EXPECT_NEAR(f.attention_factor, std::sqrt(17.0 / 12.0), 1e-15);
  };
  expect_ext(0, short_f);
  expect_ext(100, short_f);
  expect_ext(4096, short_f);  // exactly Lo: still short
  expect_ext(4097, long_f);
  expect_ext(131072, long_f);
  cfg.scaling.attention_factor = 1.2;
  EXPECT_EQ(posenc::rope_frequencies(cfg, 10).attention_factor, 1.2);
  cfg.scaling.attention_factor = 0;
  cfg.scaling.max_position_embeddings = 4096;  // s = 1 -> af = 1
  EXPECT_EQ(posenc::rope_frequencies(cfg, 10).attention_factor, 1.0);
}

// ----------------------------------------------------------------------------------------------
// Errors.

TEST(RopeFrequencies, ProportionalRotatesTheFirstPairsOverTheWholeHead) {
  // R = 16 (8 pairs), partial_rotary_factor 0.3: floor(0.3 * 16 / 2) = 2 pairs rotate with
  // theta^(-2i/16) / factor (the exponent over the whole R); the other 6 have frequency 0.
  RopeConfig cfg{
      .head_dim = 16,
      .base = 1e6,
      .scaling = {
          .type = RopeScalingType::kProportional, .factor = 2.0, .partial_rotary_factor = 0.3}};
  for (const auto angles : {posenc::RopeAngles::kAccurate, posenc::RopeAngles::kFloat32}) {
    const auto f = posenc::rope_frequencies(cfg, 0, angles);
    ASSERT_EQ(f.inv_freq.size(), 8u);
    for (std::size_t i = 0; i < 8; ++i) {
      const double want = i < 2 ? std::pow(1e6, -2.0 * static_cast<double>(i) / 16.0) / 2.0 : 0.0;
      EXPECT_NEAR(f.inv_freq[i], want,
                  want * (angles == posenc::RopeAngles::kFloat32 ? 0x1p-22 : 0x1p-50))
          << i;
    }
    EXPECT_EQ(f.attention_factor, 1.0);
  }
  // A factor of 1 rotates every pair as the default does; 0 rotates none.
  cfg.scaling.partial_rotary_factor = 1.0;
  cfg.scaling.factor = 1.0;
  RopeConfig plain{.head_dim = 16, .base = 1e6};
  EXPECT_EQ(posenc::rope_frequencies(cfg).inv_freq, posenc::rope_frequencies(plain).inv_freq);
  cfg.scaling.partial_rotary_factor = 0.0;
  for (double v : posenc::rope_frequencies(cfg).inv_freq) EXPECT_EQ(v, 0.0);
  // Frequency 0: those dims pass through the rotation unchanged, at any position.
  cfg.scaling.partial_rotary_factor = 0.25;
  const auto f = posenc::rope_frequencies(cfg);
  std::vector<float> x(16);
  for (std::size_t i = 0; i < 16; ++i) x[i] = 0.5f + static_cast<float>(i);
  std::vector<float> y = x;
  const auto pos = Positions::offset(123456);
  posenc::apply_rope(f, RopeStyle::kHalf, View<float, 4>::contiguous(y.data(), {1, 1, 1, 16}),
                     &pos);
  for (std::size_t i : {2u, 3u, 4u, 5u, 6u, 7u, 10u, 11u, 12u, 13u, 14u, 15u}) {
    EXPECT_EQ(y[i], x[i]) << i;
  }
  EXPECT_NE(y[0], x[0]);
  EXPECT_NE(y[9], x[9]);
}

TEST(RopeValidation, BadConfigsThrowValueError) {
  const double nan = std::nan("");
  std::vector<RopeConfig> bad = {
      {.head_dim = 0},
      {.head_dim = -4},
      {.head_dim = 8, .rotary_dim = 7},
      {.head_dim = 8, .rotary_dim = 10},
      {.head_dim = 128, .rotary_dim = 130},
      {.head_dim = 7},  // rotary_dim 0 means R = D = 7: odd
      {.head_dim = 8, .rotary_dim = -2},
      {.head_dim = 8, .base = 1.0},
      {.head_dim = 8, .base = 0.5},
      {.head_dim = 8, .base = nan},
      {.head_dim = 8, .scaling = {.type = RopeScalingType::kLinear, .factor = 0}},
      {.head_dim = 8, .scaling = {.type = RopeScalingType::kDynamic, .factor = 2}},  // no Lo
      {.head_dim = 8,
       .scaling = {.type = RopeScalingType::kLlama3,
                   .factor = 8,
                   .original_max_position_embeddings = 8192,
                   .low_freq_factor = 4,
                   .high_freq_factor = 1}},
      {.head_dim = 8, .scaling = {.type = RopeScalingType::kYarn, .factor = 4}},  // no Lo
      {.head_dim = 8,
       .scaling = {.type = RopeScalingType::kLongRope,
                   .original_max_position_embeddings = 4096,
                   .short_factor = {1, 1, 1},
                   .long_factor = {1, 1, 1, 1}}},
      {.head_dim = 8,
       .scaling = {.type = RopeScalingType::kLongRope,
                   .original_max_position_embeddings = 4096,
                   .short_factor = {1, 1, 1, 1},
                   .long_factor = {1, 1, 1, 1, 1}}},
      {.head_dim = 8,
       .scaling = {.type = RopeScalingType::kLongRope,
                   .original_max_position_embeddings = 4096,
                   .short_factor = {1, 1, 0, 1},
                   .long_factor = {1, 1, 1, 1}}},
      {.head_dim = 8,
       .scaling = {.type = RopeScalingType::kProportional, .partial_rotary_factor = 1.5}},
      {.head_dim = 8,
       .scaling = {.type = RopeScalingType::kProportional, .partial_rotary_factor = -0.1}},
      {.head_dim = 8, .scaling = {.type = RopeScalingType::kProportional, .factor = 0}},
  };
  for (std::size_t k = 0; k < bad.size(); ++k) {
    SCOPED_TRACE("bad config " + std::to_string(k));
    EXPECT_THROW(posenc::validate(bad[k]), posenc::ValueError);
    EXPECT_THROW(posenc::rope_frequencies(bad[k]), posenc::ValueError);
  }
  // The message names the field.
  try {
    posenc::validate(RopeConfig{.head_dim = 8, .rotary_dim = 7});
    ADD_FAILURE() << "did not throw";
  } catch (const posenc::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("rotary_dim"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(posenc::validate(RopeConfig{.head_dim = 8, .rotary_dim = 8}));
  EXPECT_NO_THROW(posenc::validate(RopeConfig{.head_dim = 7, .rotary_dim = 6}));
  EXPECT_THROW(posenc::rope_frequencies({.head_dim = 8}, -1), posenc::ValueError);
}

TEST(RopeValidation, ApplyRejectsBadShapesAndPositions) {
  std::vector<float> buf(2 * 3 * 2 * 32);
  const Shape s = {2, 3, 2, 32};
  const auto x = View<float, 4>::contiguous(buf.data(), s);
  // rotary_dim 64 > head_dim 32 of x.
  EXPECT_THROW(posenc::apply_rope(default_freqs(64), RopeStyle::kHalf, x), posenc::ShapeError);
  // out of a different shape.
  std::vector<float> other(2 * 3 * 1 * 32);
  EXPECT_THROW(posenc::apply_rope(default_freqs(32), RopeStyle::kHalf, View<const float, 4>(x),
                                  View<float, 4>::contiguous(other.data(), {2, 3, 1, 32})),
               posenc::ShapeError);
  const auto f = default_freqs(32);
  // Positions outside [0, 2^48].
  for (int64_t bad : {int64_t{-1}, posenc::kMaxPosition + 1}) {
    const auto shared = Positions::shared({0, bad, 2});
    EXPECT_THROW(posenc::apply_rope(f, RopeStyle::kHalf, x, &shared), posenc::ValueError) << bad;
  }
  const auto too_far = Positions::offset(posenc::kMaxPosition - 1);  // seq 3 reaches 2^48 + 1
  EXPECT_THROW(posenc::apply_rope(f, RopeStyle::kHalf, x, &too_far), posenc::ValueError);
  const auto edge = Positions::offset(posenc::kMaxPosition - 2);  // last token at exactly 2^48
  EXPECT_NO_THROW(posenc::apply_rope(f, RopeStyle::kHalf, x, &edge));
  // Position ids of the wrong shape.
  const auto rows = Positions::per_row({0, 1, 2}, 1, 3);
  EXPECT_THROW(posenc::apply_rope(f, RopeStyle::kHalf, x, &rows), posenc::ShapeError);
  const auto shared2 = Positions::shared({0, 1});
  EXPECT_THROW(posenc::apply_rope(f, RopeStyle::kInterleaved, x, &shared2), posenc::ShapeError);
  // Empty frequencies.
  EXPECT_THROW(posenc::apply_rope(RopeFrequencies{}, RopeStyle::kHalf, x), posenc::ValueError);
}

}  // namespace
