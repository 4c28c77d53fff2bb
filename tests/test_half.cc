// tests/test_half.cc - bf16 / f16: conversions, attention (every scheme, both types, mixed
// float32 q with a half KV cache), apply_rope and rerotate_rope against the float64 oracle on
// the rounded inputs.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_cases.h"
#include "posenc/posenc.h"
#include "test_util.h"

namespace posenc {
namespace {

using posenc_test::Rng;

// The nearest representable value by brute force over every finite pattern of x's sign, ties to
// the even mantissa (the reference for the bit-twiddling conversion).
template <class H>
uint16_t nearest(float x) {
  uint16_t best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  const uint32_t sign = std::signbit(x) ? 0x8000u : 0u;  // a tiny x rounds to a zero of its sign
  for (uint32_t b = sign; b < sign + 0x8000u; ++b) {
    const float v = to_float(H{static_cast<uint16_t>(b)});
    if (!std::isfinite(v)) continue;
    const double d = std::fabs(static_cast<double>(v) - x);
    if (d < best_d || (d == best_d && (b & 1u) == 0 && (best & 1u) == 1)) {
      best_d = d;
      best = static_cast<uint16_t>(b);
    }
  }
  return best;
}

TEST(Half, WideningThenNarrowingIsTheIdentity) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float f = to_float(f16{h}), g = to_float(bf16{h});
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(to_float(f16_from_float(f)))) << b;
    } else {
      EXPECT_EQ(f16_from_float(f).bits, h) << b;
    }
    if (std::isnan(g)) {
      EXPECT_TRUE(std::isnan(to_float(bf16_from_float(g)))) << b;
    } else {
      EXPECT_EQ(bf16_from_float(g).bits, h) << b;
    }
  }
}

TEST(Half, RoundsToNearestEven) {
  // Ties and edges by hand.
  EXPECT_EQ(to_float(f16_from_float(65504.0f)), 65504.0f);
  EXPECT_EQ(to_float(f16_from_float(65519.996f)), 65504.0f);
  EXPECT_TRUE(std::isinf(to_float(f16_from_float(65520.0f))));  // tie -> even (infinity)
  EXPECT_EQ(to_float(f16_from_float(0x1p-25f)), 0.0f);          // tie -> even (zero)
  EXPECT_EQ(to_float(f16_from_float(0x1.8p-24f)), 0x1p-23f);    // tie 1.5 -> 2
  EXPECT_EQ(to_float(f16_from_float(1.0f + 0x1p-11f)), 1.0f);   // tie -> even
  EXPECT_EQ(to_float(f16_from_float(1.0f + 0x1.8p-10f)), 1.0f + 0x1p-9f);
  EXPECT_EQ(to_float(bf16_from_float(1.0f + 0x1p-8f)), 1.0f);  // tie -> even
  EXPECT_EQ(to_float(bf16_from_float(1.0f + 0x1.8p-7f)), 1.0f + 0x1p-6f);
  EXPECT_TRUE(std::isinf(to_float(bf16_from_float(std::numeric_limits<float>::max()))));
  EXPECT_TRUE(std::signbit(to_float(f16_from_float(-0.0f))));
  // Random floats over the f16 range (normals and subnormals) against brute force.
  Rng rng(posenc_test::test_seed(), 11);
  std::uniform_real_distribution<double> e(-27.0, 16.5);
  for (int i = 0; i < 300; ++i) {
    const float x = static_cast<float>((i % 2 ? -1.0 : 1.0) * std::exp2(e(rng.engine())));
    SCOPED_TRACE(x);
    if (std::fabs(x) < 65504.0f) {
      EXPECT_EQ(f16_from_float(x).bits, nearest<f16>(x));
    }
    if (std::fabs(x) < 1e30f) {
      EXPECT_EQ(bf16_from_float(x).bits, nearest<bf16>(x));
    }
  }
}

template <class H>
std::vector<H> round_all(const std::vector<float>& x) {
  std::vector<H> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = from_float<H>(x[i]);
  return out;
}

template <class H>
std::vector<double> widen(const std::vector<H>& x) {
  std::vector<double> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = to_float(x[i]);
  return out;
}

// Half of one unit in the last place of the type at v (the rounding bound of one narrowing).
template <class H>
double half_ulp(double v) {
  const int mant = std::is_same_v<H, bf16> ? 7 : 10;
  const double a = std::max(std::fabs(v), std::is_same_v<H, bf16> ? 0x1p-126 : 0x1p-14);
  return std::exp2(std::floor(std::log2(a)) - mant - 1);
}

struct Case {
  int64_t batch, seq_q, seq_k, heads_q, heads_kv, dim;
};

// Every scheme: half q, k, v -> half out within half an ulp of the oracle on the rounded inputs
// (plus the float32 kernel's own error); float32 q with a half KV cache -> float32 out close to
// the oracle; 1, 2 and 3 threads bit-identical.
template <class H>
void check_attention(const Case& c, uint64_t stream) {
  const std::array<int64_t, 4> qs{c.batch, c.seq_q, c.heads_q, c.dim},
      ks{c.batch, c.seq_k, c.heads_kv, c.dim};
  const auto n = [](const std::array<int64_t, 4>& s) {
    return static_cast<int64_t>(s[0] * s[1] * s[2] * s[3]);
  };
  for (const auto& name : cases::kSchemes) {
    for (bool causal : {false, true}) {
      Rng rng(posenc_test::test_seed(), ++stream);
      SCOPED_TRACE(name + (causal ? " causal " : " ") + posenc_test::seed_trace());
      const auto box =
          cases::make_scheme(name, c.heads_q, c.dim, rng.engine(), static_cast<int>(stream % 4));
      const auto qf = cases::randn_f(rng.engine(), n(qs)), kf = cases::randn_f(rng.engine(), n(ks)),
                 vf = cases::randn_f(rng.engine(), n(ks));
      const std::vector<H> q = round_all<H>(qf), k = round_all<H>(kf), v = round_all<H>(vf);
      const std::vector<double> qd = widen(q), kd = widen(k), vd = widen(v);
      AttentionOptions opt{.causal = causal};
      std::vector<double> want(qd.size());
      ref::attention(View<const double, 4>::contiguous(qd.data(), qs),
                     View<const double, 4>::contiguous(kd.data(), ks),
                     View<const double, 4>::contiguous(vd.data(), ks), box->scheme, opt,
                     View<double, 4>::contiguous(want.data(), qs));
      std::vector<H> out(qd.size());
      std::vector<uint16_t> first;
      for (int threads : {1, 2, 3}) {
        opt.num_threads = threads;
        attention(View<const H, 4>::contiguous(q.data(), qs),
                  View<const H, 4>::contiguous(k.data(), ks),
                  View<const H, 4>::contiguous(v.data(), ks), box->scheme, opt,
                  View<H, 4>::contiguous(out.data(), qs));
        std::vector<uint16_t> bits(out.size());
        for (std::size_t i = 0; i < out.size(); ++i) bits[i] = out[i].bits;
        if (first.empty()) {
          first = bits;
        } else {
          ASSERT_EQ(bits, first) << threads << " threads";
        }
      }
      for (std::size_t i = 0; i < out.size(); ++i) {
        const double got = to_float(out[i]);
        ASSERT_LE(std::fabs(got - want[i]), half_ulp<H>(want[i]) + 2e-5 * (1 + std::fabs(want[i])))
            << "element " << i << ": " << got << " vs " << want[i];
      }
      // Mixed: float32 q (the unrounded values) with the half KV cache.
      std::vector<double> qfd(qf.begin(), qf.end()), want2(qd.size());
      opt.num_threads = 0;
      ref::attention(View<const double, 4>::contiguous(qfd.data(), qs),
                     View<const double, 4>::contiguous(kd.data(), ks),
                     View<const double, 4>::contiguous(vd.data(), ks), box->scheme, opt,
                     View<double, 4>::contiguous(want2.data(), qs));
      std::vector<float> out2(qd.size());
      attention(View<const float, 4>::contiguous(qf.data(), qs),
                View<const H, 4>::contiguous(k.data(), ks),
                View<const H, 4>::contiguous(v.data(), ks), box->scheme, opt,
                View<float, 4>::contiguous(out2.data(), qs));
      for (std::size_t i = 0; i < out2.size(); ++i) {
        ASSERT_NEAR(out2[i], want2[i], 2e-5 * (1 + std::fabs(want2[i]))) << "mixed, element " << i;
      }
    }
  }
}

TEST(HalfAttention, Bf16EverySchemeAgainstTheOracle) {
  check_attention<bf16>({2, 17, 70, 4, 2, 16}, 100);
  check_attention<bf16>({1, 1, 130, 8, 1, 8}, 200);  // decode, GQA 8
}

TEST(HalfAttention, F16EverySchemeAgainstTheOracle) {
  check_attention<f16>({2, 17, 70, 4, 2, 16}, 300);
  check_attention<f16>({1, 1, 130, 8, 1, 8}, 400);
}

// Strided (non-contiguous) half views: every other head of a larger buffer.
TEST(HalfAttention, StridedViews) {
  Rng rng(posenc_test::test_seed(), 500);
  const int64_t L = 9, H = 2, D = 8;
  const std::vector<bf16> big = round_all<bf16>(cases::randn_f(rng.engine(), L * 2 * H * D));
  View<const bf16, 4> x = View<const bf16, 4>::contiguous(big.data(), {1, L, 2 * H, D});
  x.shape[2] = H;
  x.stride[2] *= 2;
  std::vector<bf16> dense(static_cast<std::size_t>(L * H * D));
  for (int64_t i = 0; i < L; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d)
        dense[static_cast<std::size_t>((i * H + h) * D + d)] = x(0, i, h, d);
  const std::array<int64_t, 4> s{1, L, H, D};
  std::vector<bf16> a(dense.size()), b(dense.size());
  const Rope rope{rope_frequencies({.head_dim = D}), RopeStyle::kHalf};
  attention(x, x, x, rope, {.causal = true}, View<bf16, 4>::contiguous(a.data(), s));
  const auto dv = View<const bf16, 4>::contiguous(dense.data(), s);
  attention(dv, dv, dv, rope, {.causal = true}, View<bf16, 4>::contiguous(b.data(), s));
  for (std::size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i].bits, b[i].bits) << i;
  // Errors name the argument, as in float32.
  std::vector<bf16> small(4);
  EXPECT_THROW(attention(View<const bf16, 4>::contiguous(small.data(), {1, 1, 1, 4}), dv, dv, rope,
                         {}, View<bf16, 4>::contiguous(a.data(), s)),
               ShapeError);
}

// RoPE in half types at positions up to 2^20: the output rounding dominates, not the angle.
template <class H>
void check_rope() {
  Rng rng(posenc_test::test_seed(), 600);
  const int64_t L = 6, Hh = 3, D = 64;
  const std::array<int64_t, 4> s{1, L, Hh, D};
  const std::vector<H> x = round_all<H>(cases::randn_f(rng.engine(), L * Hh * D));
  const std::vector<double> xd = widen(x);
  const RopeFrequencies f = rope_frequencies({.head_dim = D, .base = 500000.0});
  for (const auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    const Positions pos = Positions::shared({0, 1, 4095, 65537, 999999, 1 << 20});
    std::vector<double> want(xd.size());
    ref::apply_rope(f, style, View<const double, 4>::contiguous(xd.data(), s),
                    View<double, 4>::contiguous(want.data(), s), &pos);
    std::vector<H> out(x.size());
    apply_rope(f, style, View<const H, 4>::contiguous(x.data(), s),
               View<H, 4>::contiguous(out.data(), s), &pos);
    for (std::size_t i = 0; i < out.size(); ++i) {
      ASSERT_LE(std::fabs(to_float(out[i]) - want[i]), half_ulp<H>(want[i]) + 1e-6)
          << "element " << i;
    }
    // In place gives the same bits; the inverse brings x back within two roundings.
    std::vector<H> y = x;
    apply_rope(f, style, View<const H, 4>::contiguous(y.data(), s),
               View<H, 4>::contiguous(y.data(), s), &pos);
    for (std::size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i].bits, out[i].bits) << i;
    apply_rope(f, style, View<const H, 4>::contiguous(y.data(), s),
               View<H, 4>::contiguous(y.data(), s), &pos, Direction::kInverse);
    for (std::size_t i = 0; i < y.size(); ++i) {
      ASSERT_NEAR(to_float(y[i]), xd[i], 4 * half_ulp<H>(xd[i]) + 4 * half_ulp<H>(1.0)) << i;
    }
    // Re-rotation of a half cache: from base 500000 to 10^6, as rope at the new frequencies.
    const RopeFrequencies g = rope_frequencies({.head_dim = D, .base = 1e6});
    std::vector<H> cache = out;
    rerotate_rope(f, g, style, View<H, 4>::contiguous(cache.data(), s), &pos);
    std::vector<double> want_g(xd.size());
    ref::apply_rope(g, style, View<const double, 4>::contiguous(xd.data(), s),
                    View<double, 4>::contiguous(want_g.data(), s), &pos);
    for (std::size_t i = 0; i < cache.size(); ++i) {
      // Two roundings: the cache's and the re-rotated value's.
      ASSERT_NEAR(to_float(cache[i]), want_g[i], 4 * half_ulp<H>(want_g[i]) + 4 * half_ulp<H>(1.0))
          << i;
    }
  }
}

TEST(HalfRope, Bf16AtLargePositions) { check_rope<bf16>(); }
TEST(HalfRope, F16AtLargePositions) { check_rope<f16>(); }

}  // namespace
}  // namespace posenc
