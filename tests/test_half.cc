// tests/test_half.cc - bf16 / f16: conversions, attention (every scheme, both types, mixed
// float32 q with a half KV cache), apply_rope and rerotate_rope against the float64 oracle on
// the rounded inputs; the native half-precision RoPE kernel bit for bit against widening,
// float32 RoPE and narrowing, on every compiled SIMD target.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_cases.h"
#include "hwy/targets.h"
#include "kernels/rope_kernels.h"
#include "kernels/simd.h"
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

// ---------------------------------------------------------------------------------------------
// The native half-precision RoPE kernel (src/kernels/rope_hwy.cc): bit for bit what widening
// every element exactly, float32 apply_rope / rerotate_rope and from_float<T> give, on every
// compiled Highway target.

// Restricts dispatch to one Highway target for its lifetime (0 = none afterwards).
class TargetScope {
 public:
  explicit TargetScope(int64_t bit) { kernels::set_simd_target_for_test(bit); }
  ~TargetScope() { kernels::set_simd_target_for_test(0); }
  TargetScope(const TargetScope&) = delete;
  TargetScope& operator=(const TargetScope&) = delete;
};

std::vector<int64_t> simd_targets() {
  std::vector<int64_t> t;
  for (const int64_t bit : hwy::SupportedAndGeneratedTargets()) t.push_back(bit);
  return t;
}

template <class H>
constexpr DType dtype_of() {
  return std::is_same_v<H, bf16> ? DType::kBF16 : DType::kF16;
}

// Widening of every pattern; rounding of every float whose top 20 bits vary, with the low 12
// bits at the rounding boundaries (0, 1, just below / at / above half of the dropped bits of
// f16, all ones) and one random pattern: halfway points, subnormals, overflow, NaN, +-0.
TEST(HalfRopeKernel, ConversionsEveryPatternEveryTarget) {
  std::vector<uint16_t> pats(0x10000);
  for (uint32_t b = 0; b < 0x10000u; ++b) pats[b] = static_cast<uint16_t>(b);
  Rng rng(posenc_test::test_seed(), 700);
  std::vector<float> floats;
  floats.reserve(size_t{7} << 20);
  for (uint32_t hi = 0; hi < (1u << 20); ++hi) {
    const uint32_t r = static_cast<uint32_t>(rng.engine()()) & 0xfffu;
    for (uint32_t lo : {0x000u, 0x001u, 0x7ffu, 0x800u, 0x801u, 0xfffu, r}) {
      floats.push_back(std::bit_cast<float>(hi << 12 | lo));
    }
  }
  for (const int64_t target : simd_targets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    TargetScope scope(target);
    // Odd lengths and offsets reach the scalar tails too.
    for (const int64_t n : {int64_t{0x10000}, int64_t{0xffff}, int64_t{13}}) {
      std::vector<float> wide(static_cast<std::size_t>(n));
      kernels::half_to_float(DType::kBF16, pats.data() + 0x10000 - n, wide.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = pats[static_cast<std::size_t>(0x10000 - n + i)];
        ASSERT_EQ(std::bit_cast<uint32_t>(wide[i]), std::bit_cast<uint32_t>(to_float(bf16{h})))
            << "bf16 " << h;
      }
      kernels::half_to_float(DType::kF16, pats.data() + 0x10000 - n, wide.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = pats[static_cast<std::size_t>(0x10000 - n + i)];
        ASSERT_EQ(std::bit_cast<uint32_t>(wide[i]), std::bit_cast<uint32_t>(to_float(f16{h})))
            << "f16 " << h;
      }
    }
    for (const int64_t off : {0, 3}) {
      const int64_t n = static_cast<int64_t>(floats.size()) - off;
      std::vector<uint16_t> b(static_cast<std::size_t>(n)), f(static_cast<std::size_t>(n));
      kernels::float_to_half(DType::kBF16, floats.data() + off, b.data(), n);
      kernels::float_to_half(DType::kF16, floats.data() + off, f.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const float x = floats[static_cast<std::size_t>(i + off)];
        ASSERT_EQ(b[i], bf16_from_float(x).bits) << std::hex << std::bit_cast<uint32_t>(x);
        ASSERT_EQ(f[i], f16_from_float(x).bits) << std::hex << std::bit_cast<uint32_t>(x);
      }
    }
  }
}

// A [batch, seq, heads, dim] view into `buf` in one of three layouts: row-major, padded
// (every stride larger than the dense one), or batch-inner ([seq, batch, heads] order, padded).
enum class Layout { kDense, kPadded, kBatchInner };

template <class T>
View<T, 4> layout_view(std::vector<std::remove_const_t<T>>& buf, const std::array<int64_t, 4>& s,
                       Layout layout) {
  View<T, 4> v;
  v.shape = s;
  if (layout == Layout::kDense) {
    v.stride = {s[1] * s[2] * s[3], s[2] * s[3], s[3], 1};
  } else if (layout == Layout::kPadded) {
    const int64_t h = s[3] + 3, i = s[2] * h + 5;
    v.stride = {s[1] * i + 7, i, h, 1};
  } else {
    const int64_t h = s[3] + 2, b = s[2] * h + 1;
    v.stride = {b, s[0] * b + 3, h, 1};
  }
  int64_t need = 1;
  for (std::size_t d = 0; d < 4; ++d) need += (s[d] - 1) * v.stride[d];
  buf.resize(static_cast<std::size_t>(need));
  v.data = buf.data();
  return v;
}

// layout_view filled with `src` (row-major order).
template <class T>
View<T, 4> filled_layout_view(std::vector<T>& buf, const std::array<int64_t, 4>& s, Layout layout,
                              const std::vector<T>& src) {
  const View<T, 4> v = layout_view<T>(buf, s, layout);
  std::size_t e = 0;
  for (int64_t a = 0; a < s[0]; ++a)
    for (int64_t b = 0; b < s[1]; ++b)
      for (int64_t c = 0; c < s[2]; ++c)
        for (int64_t d = 0; d < s[3]; ++d) v(a, b, c, d) = src[e++];
  return v;
}

// x's elements row-major.
template <class T>
std::vector<std::remove_const_t<T>> gather(const View<T, 4>& v) {
  std::vector<std::remove_const_t<T>> out;
  for (int64_t a = 0; a < v.shape[0]; ++a)
    for (int64_t b = 0; b < v.shape[1]; ++b)
      for (int64_t c = 0; c < v.shape[2]; ++c)
        for (int64_t d = 0; d < v.shape[3]; ++d) out.push_back(v(a, b, c, d));
  return out;
}

template <class H>
std::vector<uint16_t> bits_of(const std::vector<H>& v) {
  std::vector<uint16_t> b(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) b[i] = v[i].bits;
  return b;
}

// Random values rounded to H, with NaNs (quiet and signalling, with payloads), infinities,
// zeros, subnormals and the largest finite values sprinkled in.
template <class H>
std::vector<H> half_values(std::mt19937_64& rng, int64_t n, bool specials) {
  std::vector<H> x = round_all<H>(cases::randn_f(rng, n, 3.0));
  if (!specials) return x;
  const bool is_bf = std::is_same_v<H, bf16>;
  const std::vector<uint16_t> sp =
      is_bf ? std::vector<uint16_t>{0x7fc1, 0x7f81, 0xffa0, 0x7f80, 0xff80, 0x0000,
                                    0x8000, 0x0001, 0x807f, 0x7f7f, 0xff7f, 0x0080}
            : std::vector<uint16_t>{0x7e05, 0x7c01, 0xfd00, 0x7c00, 0xfc00, 0x0000,
                                    0x8000, 0x0001, 0x83ff, 0x7bff, 0xfbff, 0x0400};
  for (std::size_t i = 0; i < x.size(); i += 7) x[i].bits = sp[(i / 7) % sp.size()];
  return x;
}

// What the widening path computes: every element widened, float32 RoPE, one rounding.
template <class H>
std::vector<uint16_t> rope_oracle(const RopeFrequencies& f, RopeStyle style,
                                  const View<const H, 4>& x, const Positions* pos, Direction dir) {
  std::vector<float> xf;
  for (const H& h : gather(x)) xf.push_back(to_float(h));
  std::vector<float> of(xf.size());
  apply_rope(f, style, View<const float, 4>::contiguous(xf.data(), x.shape),
             View<float, 4>::contiguous(of.data(), x.shape), pos, dir);
  std::vector<uint16_t> out;
  for (float v : of) out.push_back(from_float<H>(v).bits);
  return out;
}

template <class H>
std::vector<uint16_t> rerotate_oracle(const RopeFrequencies& from, const RopeFrequencies& to,
                                      RopeStyle style, const View<const H, 4>& k,
                                      const Positions* pos) {
  std::vector<float> kf;
  for (const H& h : gather(k)) kf.push_back(to_float(h));
  rerotate_rope(from, to, style, View<float, 4>::contiguous(kf.data(), k.shape), pos);
  std::vector<uint16_t> out;
  for (float v : kf) out.push_back(from_float<H>(v).bits);
  return out;
}

struct KernelCase {
  std::array<int64_t, 4> shape;  // batch, seq, heads, head_dim
  int64_t rotary;
};

template <class H>
void check_native_rope(uint64_t stream) {
  // Full, partial (rotary < head_dim) and short rows (scalar tails on every target); the last
  // case is big enough for 2 and 3 threads to split it.
  const KernelCase kcases[] = {{{2, 5, 3, 64}, 64},
                               {{1, 6, 2, 40}, 24},
                               {{2, 3, 2, 10}, 6},
                               {{1, 4, 1, 2}, 2},
                               {{2, 48, 4, 128}, 96}};
  for (const int64_t target : simd_targets()) {
    TargetScope scope(target);
    for (const KernelCase& kc : kcases) {
      const auto s = kc.shape;
      const int64_t n = s[0] * s[1] * s[2] * s[3];
      Rng rng(posenc_test::test_seed(), ++stream);
      const std::vector<H> src = half_values<H>(rng.engine(), n, true);
      RopeFrequencies f = rope_frequencies({.head_dim = s[3],
                                            .rotary_dim = kc.rotary,
                                            .base = 500000.0,
                                            .scaling = {.type = RopeScalingType::kYarn,
                                                        .factor = 4.0,
                                                        .original_max_position_embeddings = 4096}});
      ASSERT_NE(f.attention_factor, 1.0);
      std::vector<int64_t> ids(static_cast<std::size_t>(s[0] * s[1]));
      std::uniform_int_distribution<int64_t> pd(0, int64_t{1} << 20);
      for (auto& id : ids) id = pd(rng.engine());
      ids[0] = int64_t{1} << 20;
      const Positions per_row = Positions::per_row(ids, s[0], s[1]);
      const Positions offset = Positions::offset(1000);
      for (const Positions* pos : {static_cast<const Positions*>(nullptr), &offset, &per_row}) {
        for (const auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
          for (const auto dir : {Direction::kForward, Direction::kInverse}) {
            for (const Layout lx : {Layout::kDense, Layout::kPadded, Layout::kBatchInner}) {
              SCOPED_TRACE(std::string(hwy::TargetName(target)) + " shape " + shape_str(s) + " R " +
                           std::to_string(kc.rotary) +
                           (style == RopeStyle::kHalf ? " half" : " interleaved") +
                           (dir == Direction::kForward ? " forward" : " inverse") + " layout " +
                           std::to_string(static_cast<int>(lx)) + " positions " +
                           (pos == nullptr   ? "none"
                            : pos == &offset ? "offset"
                                             : "per_row") +
                           " " + posenc_test::seed_trace());
              std::vector<H> xbuf;
              const View<H, 4> xv = filled_layout_view<H>(xbuf, s, lx, src);
              const View<const H, 4> x = xv;
              const std::vector<uint16_t> want = rope_oracle(f, style, x, pos, dir);
              // Out of place, into each layout, at 1, 2 and 3 threads.
              for (const Layout lo : {Layout::kDense, Layout::kPadded, Layout::kBatchInner}) {
                if (lo != lx && s[0] * s[1] > 100) continue;
                for (int threads : {1, 2, 3}) {
                  std::vector<H> obuf;
                  const View<H, 4> out = layout_view<H>(obuf, s, lo);
                  apply_rope(f, style, x, out, pos, dir, threads);
                  ASSERT_EQ(bits_of(gather(out)), want)
                      << "out of place, layout " << int(lo) << ", " << threads << " threads";
                }
              }
              // In place.
              for (int threads : {1, 3}) {
                std::vector<H> ybuf = xbuf;
                View<H, 4> y = xv;
                y.data = ybuf.data();
                apply_rope(f, style, View<const H, 4>(y), y, pos, dir, threads);
                ASSERT_EQ(bits_of(gather(y)), want) << "in place, " << threads << " threads";
              }
            }
          }
        }
      }
    }
  }
}

TEST(HalfRopeKernel, Bf16BitIdenticalToWideningEveryTarget) { check_native_rope<bf16>(800); }
TEST(HalfRopeKernel, F16BitIdenticalToWideningEveryTarget) { check_native_rope<f16>(900); }

// x broadcast over the batch (stride 0), shared positions; the widening path's cases (float32
// angles, strided head_dim, overlapping x and out) keep their results too.
template <class H>
void check_rope_other_views() {
  Rng rng(posenc_test::test_seed(), 1000);
  const std::array<int64_t, 4> s{3, 6, 2, 16};
  const std::vector<H> src = half_values<H>(rng.engine(), s[1] * s[2] * s[3], true);
  const RopeFrequencies f = rope_frequencies({.head_dim = 16, .rotary_dim = 12});
  const Positions pos = Positions::shared({0, 1, 4095, 65537, 999999, 1 << 20});
  View<const H, 4> x = View<const H, 4>::contiguous(src.data(), {1, s[1], s[2], s[3]});
  x.shape[0] = s[0];
  x.stride[0] = 0;
  for (const auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    std::vector<H> out(static_cast<std::size_t>(s[0] * s[1] * s[2] * s[3]));
    apply_rope(f, style, x, View<H, 4>::contiguous(out.data(), s), &pos);
    EXPECT_EQ(bits_of(out), rope_oracle(f, style, x, &pos, Direction::kForward));
    // float32 angles (widening path).
    const RopeFrequencies f32 =
        rope_frequencies({.head_dim = 16, .rotary_dim = 12}, 0, RopeAngles::kFloat32);
    apply_rope(f32, style, x, View<H, 4>::contiguous(out.data(), s), &pos);
    EXPECT_EQ(bits_of(out), rope_oracle(f32, style, x, &pos, Direction::kForward));
    // Strided head_dim (widening path): every other element of a wider row.
    std::vector<H> wide(2 * out.size());
    View<H, 4> ws = View<H, 4>::contiguous(wide.data(), {s[0], s[1], s[2], 2 * s[3]});
    ws.shape[3] = s[3];
    ws.stride[3] = 2;
    apply_rope(f, style, x, ws, &pos);
    EXPECT_EQ(bits_of(gather(ws)), rope_oracle(f, style, x, &pos, Direction::kForward));
    // out overlapping x one token later (widening path: x is read whole before out is written).
    std::vector<H> buf(static_cast<std::size_t>((s[1] + 1) * s[2] * s[3]));
    for (std::size_t i = 0; i < src.size(); ++i) buf[i] = src[i];
    const std::array<int64_t, 4> s1{1, s[1], s[2], s[3]};
    const auto xo = View<const H, 4>::contiguous(buf.data(), s1);
    const std::vector<uint16_t> want = rope_oracle(f, style, xo, &pos, Direction::kForward);
    const auto oo = View<H, 4>::contiguous(buf.data() + s[2] * s[3], s1);
    apply_rope(f, style, xo, oo, &pos);
    EXPECT_EQ(bits_of(gather(oo)), want);
  }
}

TEST(HalfRopeKernel, Bf16BroadcastAndWideningPathViews) { check_rope_other_views<bf16>(); }
TEST(HalfRopeKernel, F16BroadcastAndWideningPathViews) { check_rope_other_views<f16>(); }

// rerotate_rope on half caches: the widening path's bits, every target, strided caches.
template <class H>
void check_native_rerotate(uint64_t stream) {
  const KernelCase kcases[] = {{{2, 5, 3, 64}, 64}, {{1, 6, 2, 40}, 24}, {{2, 3, 2, 10}, 6}};
  for (const int64_t target : simd_targets()) {
    TargetScope scope(target);
    for (const KernelCase& kc : kcases) {
      const auto s = kc.shape;
      Rng rng(posenc_test::test_seed(), ++stream);
      const std::vector<H> src = half_values<H>(rng.engine(), s[0] * s[1] * s[2] * s[3], true);
      const RopeFrequencies from =
          rope_frequencies({.head_dim = s[3], .rotary_dim = kc.rotary, .base = 500000.0});
      const RopeFrequencies to =
          rope_frequencies({.head_dim = s[3],
                            .rotary_dim = kc.rotary,
                            .base = 1e6,
                            .scaling = {.type = RopeScalingType::kYarn,
                                        .factor = 2.0,
                                        .original_max_position_embeddings = 1024}});
      std::vector<int64_t> ids(static_cast<std::size_t>(s[0] * s[1]));
      std::uniform_int_distribution<int64_t> pd(0, int64_t{1} << 20);
      for (auto& id : ids) id = pd(rng.engine());
      const Positions per_row = Positions::per_row(ids, s[0], s[1]);
      for (const Positions* pos : {static_cast<const Positions*>(nullptr), &per_row}) {
        for (const auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
          for (const Layout l : {Layout::kDense, Layout::kPadded, Layout::kBatchInner}) {
            SCOPED_TRACE(std::string(hwy::TargetName(target)) + " shape " + shape_str(s) +
                         (style == RopeStyle::kHalf ? " half" : " interleaved") + " layout " +
                         std::to_string(static_cast<int>(l)) + " " + posenc_test::seed_trace());
            std::vector<H> buf;
            const View<H, 4> k = filled_layout_view<H>(buf, s, l, src);
            const std::vector<uint16_t> want =
                rerotate_oracle(from, to, style, View<const H, 4>(k), pos);
            rerotate_rope(from, to, style, k, pos);
            ASSERT_EQ(bits_of(gather(k)), want);
          }
        }
      }
    }
  }
}

TEST(HalfRopeKernel, Bf16RerotateBitIdenticalToWidening) { check_native_rerotate<bf16>(1100); }
TEST(HalfRopeKernel, F16RerotateBitIdenticalToWidening) { check_native_rerotate<f16>(1200); }

// The half entry points fail exactly as the float32 ones do.
template <class H>
void check_rope_errors() {
  const std::array<int64_t, 4> s{1, 3, 2, 8};
  std::vector<H> xh(48), oh(48);
  std::vector<float> xf(48), of(48);
  const RopeFrequencies f = rope_frequencies({.head_dim = 8});
  const RopeFrequencies wide = rope_frequencies({.head_dim = 16});
  const Positions short_pos = Positions::shared({0, 1});
  const Positions neg = Positions::shared({0, -1, 2});
  auto message = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(typeid(e).name()) + ": " + e.what();
    }
    return "no error";
  };
  struct Bad {
    const RopeFrequencies* f;
    std::array<int64_t, 4> out_shape;
    const Positions* pos;
    int threads;
  };
  const Bad bads[] = {{&wide, s, nullptr, 1},
                      {&f, {1, 3, 2, 4}, nullptr, 1},
                      {&f, s, &short_pos, 1},
                      {&f, s, &neg, 1},
                      {&f, s, nullptr, -1}};
  for (const Bad& b : bads) {
    const std::string want = message([&] {
      apply_rope(*b.f, RopeStyle::kHalf, View<const float, 4>::contiguous(xf.data(), s),
                 View<float, 4>::contiguous(of.data(), b.out_shape), b.pos, Direction::kForward,
                 b.threads);
    });
    EXPECT_NE(want, "no error");
    EXPECT_EQ(message([&] {
                apply_rope(*b.f, RopeStyle::kHalf, View<const H, 4>::contiguous(xh.data(), s),
                           View<H, 4>::contiguous(oh.data(), b.out_shape), b.pos,
                           Direction::kForward, b.threads);
              }),
              want);
    if (b.out_shape == s && b.threads == 1) {
      const std::string want_k = message([&] {
        rerotate_rope(f, *b.f, RopeStyle::kHalf, View<float, 4>::contiguous(xf.data(), s), b.pos);
      });
      EXPECT_NE(want_k, "no error");
      EXPECT_EQ(message([&] {
                  rerotate_rope(f, *b.f, RopeStyle::kHalf, View<H, 4>::contiguous(xh.data(), s),
                                b.pos);
                }),
                want_k);
    }
  }
}

TEST(HalfRopeKernel, Bf16ErrorsAsFloat32) { check_rope_errors<bf16>(); }
TEST(HalfRopeKernel, F16ErrorsAsFloat32) { check_rope_errors<f16>(); }

}  // namespace
}  // namespace posenc
