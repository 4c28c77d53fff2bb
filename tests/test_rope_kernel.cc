// tests/test_rope_kernel.cc - the float32 RoPE kernel (src/kernels/rope_hwy.cc, reached through
// apply_rope / apply_rope_qk) against the float64 oracle ref::apply_rope, on every compiled
// Highway target and at 1, 2 and 3 threads.
//
// Tolerance. The kernel forms the angle p * inv_freq in double exactly as the reference does,
// reduces it modulo pi/2 with an error of ~1e-16 rad, evaluates cos/sin to ~1e-16 and the
// rotation in double, then rounds once to float32. Its double result thus differs from the
// reference's by at most a few 1e-16 of the pair magnitude |z| = max(|x0|, |x1|) * af, and the
// float32 output is the reference rounded to nearest unless the reference lies within that
// distance of a rounding boundary:
//   |y - y_ref| <= 0.5 ulp(y_ref) + 2^-40 |z|.
// This is stronger than the contract (2 float32 ulps of |z|) and the float32 rotation it
// allowed; both are checked. Dims >= rotary_dim are copied bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "kernels/simd.h"
#include "posenc/error.h"
#include "posenc/rope.h"
#include "posenc/tensor.h"
#include "test_util.h"

namespace {

using posenc::Direction;
using posenc::Positions;
using posenc::RopeAngles;
using posenc::RopeConfig;
using posenc::RopeFrequencies;
using posenc::RopeStyle;
using posenc::View;
using posenc_test::Rng;
using posenc_test::same_bits;
using posenc_test::Strided;
using posenc_test::ulp_f32;

using Shape = std::array<int64_t, 4>;  // [batch, seq, heads, head_dim]
using Order = std::array<std::size_t, 4>;

constexpr int64_t kP20 = int64_t{1} << 20;
constexpr int64_t kP24 = int64_t{1} << 24;
constexpr int64_t kP30 = int64_t{1} << 30;

const char* style_name(RopeStyle s) { return s == RopeStyle::kHalf ? "half" : "interleaved"; }

// Restricts dispatch to one Highway target for its lifetime (0 = no restriction afterwards,
// also when an assertion returns early).
class TargetScope {
 public:
  explicit TargetScope(int64_t bit) { posenc::kernels::set_simd_target_for_test(bit); }
  ~TargetScope() { posenc::kernels::set_simd_target_for_test(0); }
  TargetScope(const TargetScope&) = delete;
  TargetScope& operator=(const TargetScope&) = delete;
};

std::vector<int64_t> targets() {
  std::vector<int64_t> t;
  for (const int64_t bit : hwy::SupportedAndGeneratedTargets()) t.push_back(bit);
  return t;
}

RopeFrequencies freqs_for(int64_t head_dim, int64_t rotary, double af, double base = 1e4) {
  RopeFrequencies f = posenc::rope_frequencies(
      RopeConfig{.head_dim = head_dim, .rotary_dim = rotary, .base = base});
  f.attention_factor = af;
  return f;
}

// Index of the pair partner of dim j of a row (j < rotary).
int64_t partner(RopeStyle style, int64_t rotary, int64_t j) {
  if (style == RopeStyle::kInterleaved) return j ^ 1;
  return j < rotary / 2 ? j + rotary / 2 : j - rotary / 2;
}

// Checks y (row-major, from the kernel) against the float64 reference on x (row-major).
::testing::AssertionResult matches_reference(const std::vector<float>& x,
                                             const std::vector<float>& y, const Shape& s,
                                             const RopeFrequencies& f, RopeStyle style,
                                             const Positions& pos, Direction dir) {
  std::vector<double> xd(x.begin(), x.end()), yd(x.size());
  posenc::ref::apply_rope(f, style, View<const double, 4>::contiguous(xd.data(), s),
                          View<double, 4>::contiguous(yd.data(), s), &pos, dir);
  const int64_t d = s[3], r = f.rotary_dim();
  const double af = std::fabs(f.attention_factor);
  double worst = 0;  // in ulps of |z|
  for (std::size_t e = 0; e < y.size(); ++e) {
    const int64_t j = static_cast<int64_t>(e) % d;
    if (j >= r) {
      if (!same_bits(y[e], x[e])) {
        return ::testing::AssertionFailure() << "pass-through dim " << j << " (element " << e
                                             << ") changed: " << x[e] << " -> " << y[e];
      }
      continue;
    }
    const std::size_t mate =
        e - static_cast<std::size_t>(j) + static_cast<std::size_t>(partner(style, r, j));
    const double mag =
        std::max(std::fabs(static_cast<double>(x[e])), std::fabs(static_cast<double>(x[mate]))) *
        af;
    const double err = std::fabs(static_cast<double>(y[e]) - yd[e]);
    const double tight = 0.5 * ulp_f32(yd[e]) + 0x1p-40 * mag;
    const double contract = 2.0 * ulp_f32(mag);
    if (!(err <= tight) || !(err <= contract)) {
      return ::testing::AssertionFailure()
             << "element " << e << " (dim " << j << "): got " << y[e] << ", float64 reference "
             << yd[e] << ", error " << err << " > " << std::min(tight, contract) << " (|z| " << mag
             << ")";
    }
    if (mag > 0) worst = std::max(worst, err / ulp_f32(mag));
  }
  return ::testing::AssertionSuccess() << "max error " << worst << " ulp(|z|)";
}

Positions make_positions(Rng& rng, int kind, int64_t base, int64_t batch, int64_t seq) {
  if (kind == 0) return Positions::offset(base);
  std::vector<int64_t> ids(static_cast<std::size_t>(kind == 1 ? seq : batch * seq));
  for (auto& id : ids) id = base + rng.integer(0, 5000);
  return kind == 1 ? Positions::shared(ids) : Positions::per_row(ids, batch, seq);
}

const char* kPosKind[] = {"offset", "shared", "per_row"};

// Memory layouts of a [batch, seq, heads, head_dim] view: pad per dim and dim order.
struct Layout {
  int64_t pad;
  Order order;
};
const Layout kLayouts[] = {
    {0, {0, 1, 2, 3}},  // contiguous
    {3, {0, 1, 2, 3}},  // padded rows
    {1, {1, 0, 2, 3}},  // seq outermost ([seq, batch, ...] in memory)
    {2, {0, 2, 1, 3}},  // heads before seq ([batch, heads, seq, head_dim] in memory)
};

// ----------------------------------------------------------------------------------------------

TEST(RopeKernel, MatchesFloat64ReferenceOnEveryTargetAndThreadCount) {
  Rng rng(posenc_test::test_seed(), 1);
  SCOPED_TRACE(posenc_test::seed_trace());
  const std::vector<int64_t> dims = {2, 4, 6, 8, 10, 14, 16, 17, 18, 30, 34, 64, 96, 128, 130};
  const std::vector<int64_t> seqs = {1, 2, 7, 33};
  const std::vector<int64_t> bases = {0, 1000, kP20, kP24, kP30};
  const std::vector<double> afs = {1.0, 1.2079441541679836, 0.5};
  int64_t counter = 0;
  for (const int64_t d : dims) {
    std::vector<int64_t> rotaries = {d % 2 == 0 ? d : d - 1, std::max<int64_t>(2, d / 2 & ~1)};
    if (rotaries[0] == rotaries[1]) rotaries.pop_back();
    for (const int64_t r : rotaries) {
      for (const auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
        for (const int64_t seq : seqs) {
          ++counter;
          const int64_t heads = 1 + counter % 5;
          const Shape s = {2, seq, heads, d};
          const int kind = static_cast<int>(counter % 3);
          const int64_t base = bases[static_cast<std::size_t>(counter % 5)];
          const Direction dir = counter % 2 ? Direction::kInverse : Direction::kForward;
          const double af = afs[static_cast<std::size_t>(counter % 3)];
          const bool in_place = counter % 4 < 2;
          const Layout& lx = kLayouts[static_cast<std::size_t>(counter % 4)];
          const Layout& lo = kLayouts[static_cast<std::size_t>((counter / 4) % 4)];
          const auto f = freqs_for(d, r, af, counter % 2 ? 1e4 : 5e5);
          const auto pos = make_positions(rng, kind, base, s[0], s[1]);
          const auto x0 = rng.values(static_cast<std::size_t>(2 * seq * heads * d), -2.0, 2.0);
          SCOPED_TRACE("x " + posenc::shape_str(s) + " rotary_dim " + std::to_string(r) + " " +
                       style_name(style) + " positions " + kPosKind[kind] + " from " +
                       std::to_string(base) + (dir == Direction::kInverse ? " inverse" : "") +
                       " af " + std::to_string(af) + (in_place ? " in place" : " out of place") +
                       " layouts " + std::to_string(counter % 4) + "/" +
                       std::to_string((counter / 4) % 4));
          std::vector<float> first;
          for (const int64_t bit : targets()) {
            TargetScope scope(bit);
            SCOPED_TRACE(std::string("target ") + hwy::TargetName(bit));
            for (const int threads : {1, 2, 3}) {
              SCOPED_TRACE("threads " + std::to_string(threads));
              Strided<float, 4> x(s, x0, lx.pad, lx.order);
              std::vector<float> y;
              if (in_place) {
                posenc::apply_rope(f, style, x.view(), &pos, dir, threads);
                y = x.values();
                ASSERT_TRUE(x.outside_untouched());
              } else {
                Strided<float, 4> out(s, lo.pad, lo.order);
                posenc::apply_rope(f, style, x.cview(), out.view(), &pos, dir, threads);
                y = out.values();
                ASSERT_TRUE(out.outside_untouched());
                ASSERT_EQ(x.values(), x0) << "input modified";
              }
              if (threads == 1) {
                ASSERT_TRUE(matches_reference(x0, y, s, f, style, pos, dir));
                first = y;
              } else {
                for (std::size_t e = 0; e < y.size(); ++e) {
                  ASSERT_TRUE(same_bits(y[e], first[e]))
                      << "element " << e << " differs from the 1-thread result";
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(RopeKernel, LargePositions) {
  // Up to 2^30 the angle p * inv_freq[0] = p is reduced in SIMD; above 2^31 those lanes take
  // std::cos/std::sin of the same double angle. Both must stay within the bound, up to the
  // largest accepted position.
  Rng rng(posenc_test::test_seed(), 2);
  SCOPED_TRACE(posenc_test::seed_trace());
  const Shape s = {1, 6, 3, 128};
  for (const int64_t p0 :
       {kP24 - 3, kP30 - 3, (int64_t{1} << 31) - 3, int64_t{1} << 40, posenc::kMaxPosition - 5}) {
    for (const auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
      const auto f = freqs_for(128, 128, 1.0, 5e5);
      const auto pos = Positions::offset(p0);
      const auto x0 = rng.values(static_cast<std::size_t>(6 * 3 * 128));
      for (const int64_t bit : targets()) {
        TargetScope scope(bit);
        SCOPED_TRACE(std::string("target ") + hwy::TargetName(bit) + " " + style_name(style) +
                     " positions from " + std::to_string(p0));
        for (const auto dir : {Direction::kForward, Direction::kInverse}) {
          std::vector<float> y(x0.size());
          posenc::apply_rope(f, style, View<const float, 4>::contiguous(x0.data(), s),
                             View<float, 4>::contiguous(y.data(), s), &pos, dir);
          EXPECT_TRUE(matches_reference(x0, y, s, f, style, pos, dir));
        }
      }
    }
  }
}

TEST(RopeKernel, BroadcastAndStridedHeadDim) {
  // Stride-0 inputs (one row broadcast over heads and tokens) go through the kernel; a strided or
  // broadcast head_dim falls back to the scalar path. All match the reference.
  Rng rng(posenc_test::test_seed(), 3);
  SCOPED_TRACE(posenc_test::seed_trace());
  const Shape s = {2, 5, 3, 34};
  const auto f = freqs_for(34, 30, 1.1);
  const auto pos = Positions::offset(kP20);
  const auto row = rng.values(34);
  std::vector<float> materialized(static_cast<std::size_t>(2 * 5 * 3 * 34));
  for (std::size_t e = 0; e < materialized.size(); ++e) materialized[e] = row[e % 34];
  for (const auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    for (const int64_t bit : targets()) {
      TargetScope scope(bit);
      SCOPED_TRACE(std::string("target ") + hwy::TargetName(bit) + " " + style_name(style));
      View<const float, 4> bx{row.data(), s, {0, 0, 0, 1}};
      std::vector<float> y(materialized.size());
      posenc::apply_rope(f, style, bx, View<float, 4>::contiguous(y.data(), s), &pos);
      EXPECT_TRUE(matches_reference(materialized, y, s, f, style, pos, Direction::kForward));

      // head_dim with stride 2, in place and out of place.
      Strided<float, 4> xs(s, materialized, 1, Strided<float, 4>::identity(), 2);
      Strided<float, 4> outs(s, 2, {3, 2, 1, 0}, 1);  // head_dim outermost
      posenc::apply_rope(f, style, xs.cview(), outs.view(), &pos, Direction::kInverse, 2);
      EXPECT_TRUE(
          matches_reference(materialized, outs.values(), s, f, style, pos, Direction::kInverse));
      posenc::apply_rope(f, style, xs.view(), &pos, Direction::kForward, 2);
      EXPECT_TRUE(
          matches_reference(materialized, xs.values(), s, f, style, pos, Direction::kForward));
      EXPECT_TRUE(xs.outside_untouched());

      // A broadcast head_dim (stride 0): every element of a row equal.
      const float v = 0.75f;
      View<const float, 4> bd{&v, s, {0, 0, 0, 0}};
      posenc::apply_rope(f, style, bd, View<float, 4>::contiguous(y.data(), s), &pos);
      EXPECT_TRUE(matches_reference(std::vector<float>(y.size(), v), y, s, f, style, pos,
                                    Direction::kForward));
    }
  }
}

TEST(RopeKernel, QkEqualsSeparateCallsBitForBit) {
  Rng rng(posenc_test::test_seed(), 4);
  SCOPED_TRACE(posenc_test::seed_trace());
  struct Case {
    int64_t d, r, heads_q, heads_kv;
    RopeAngles angles;
    int64_t k_inner_step;  // 2: k's head_dim strided (scalar path for k)
  };
  const Case cases[] = {
      {128, 128, 8, 2, RopeAngles::kAccurate, 1}, {64, 32, 4, 4, RopeAngles::kAccurate, 1},
      {30, 30, 3, 1, RopeAngles::kAccurate, 1},   {17, 16, 5, 5, RopeAngles::kAccurate, 1},
      {64, 64, 4, 2, RopeAngles::kAccurate, 2},   {64, 48, 4, 2, RopeAngles::kFloat32, 1}};
  for (const auto& c : cases) {
    for (const auto style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
      const Shape sq = {2, 9, c.heads_q, c.d}, sk = {2, 9, c.heads_kv, c.d};
      auto f =
          posenc::rope_frequencies(RopeConfig{.head_dim = c.d, .rotary_dim = c.r}, 0, c.angles);
      f.attention_factor = c.angles == RopeAngles::kAccurate ? 1.25 : 1.0;
      const auto pos = make_positions(rng, 2, kP24, 2, 9);
      const auto q0 = rng.values(static_cast<std::size_t>(2 * 9 * c.heads_q * c.d));
      const auto k0 = rng.values(static_cast<std::size_t>(2 * 9 * c.heads_kv * c.d));
      for (const int64_t bit : targets()) {
        TargetScope scope(bit);
        SCOPED_TRACE(std::string("target ") + hwy::TargetName(bit) + " " + style_name(style) +
                     " q " + posenc::shape_str(sq) + " k " + posenc::shape_str(sk) +
                     " rotary_dim " + std::to_string(c.r));
        for (const auto dir : {Direction::kForward, Direction::kInverse}) {
          for (const int threads : {1, 2, 3}) {
            Strided<float, 4> q(sq, q0, 1, {0, 2, 1, 3});
            Strided<float, 4> k(sk, k0, 2, Strided<float, 4>::identity(), c.k_inner_step);
            posenc::apply_rope_qk(f, style, q.view(), k.view(), &pos, dir, threads);
            std::vector<float> q1 = q0, k1 = k0;
            posenc::apply_rope(f, style, View<float, 4>::contiguous(q1.data(), sq), &pos, dir, 1);
            posenc::apply_rope(f, style, View<float, 4>::contiguous(k1.data(), sk), &pos, dir, 1);
            const auto qv = q.values(), kv = k.values();
            for (std::size_t e = 0; e < q1.size(); ++e) {
              ASSERT_TRUE(same_bits(qv[e], q1[e])) << "q element " << e << " threads " << threads;
            }
            for (std::size_t e = 0; e < k1.size(); ++e) {
              ASSERT_TRUE(same_bits(kv[e], k1[e])) << "k element " << e << " threads " << threads;
            }
            ASSERT_TRUE(q.outside_untouched());
            ASSERT_TRUE(k.outside_untouched());
            if (c.angles == RopeAngles::kAccurate) {
              EXPECT_TRUE(matches_reference(q0, qv, sq, f, style, pos, dir));
              EXPECT_TRUE(matches_reference(k0, kv, sk, f, style, pos, dir));
            }
          }
        }
      }
    }
  }
}

TEST(RopeKernel, QkValidates) {
  const auto f = freqs_for(8, 8, 1.0);
  std::vector<float> q(2 * 3 * 4 * 8), k(2 * 3 * 2 * 8), k_short(2 * 2 * 2 * 8), k4(2 * 3 * 2 * 4);
  auto qv = View<float, 4>::contiguous(q.data(), {2, 3, 4, 8});
  auto kv = View<float, 4>::contiguous(k.data(), {2, 3, 2, 8});
  EXPECT_NO_THROW(posenc::apply_rope_qk(f, RopeStyle::kHalf, qv, kv));
  EXPECT_THROW(posenc::apply_rope_qk(f, RopeStyle::kHalf, qv,
                                     View<float, 4>::contiguous(k_short.data(), {2, 2, 2, 8})),
               posenc::ShapeError);
  EXPECT_THROW(posenc::apply_rope_qk(f, RopeStyle::kHalf, qv,
                                     View<float, 4>::contiguous(k4.data(), {2, 3, 2, 4})),
               posenc::ShapeError);
  EXPECT_THROW(posenc::apply_rope_qk(f, RopeStyle::kHalf, qv, kv, nullptr, Direction::kForward, -1),
               posenc::ValueError);
  EXPECT_THROW(posenc::apply_rope(f, RopeStyle::kHalf, qv, nullptr, Direction::kForward, -2),
               posenc::ValueError);
  const auto far = Positions::offset(posenc::kMaxPosition);
  EXPECT_THROW(posenc::apply_rope_qk(f, RopeStyle::kHalf, qv, kv, &far), posenc::ValueError);
  // Empty tensors are fine.
  EXPECT_NO_THROW(posenc::apply_rope_qk(f, RopeStyle::kHalf, View<float, 4>{nullptr, {2, 0, 4, 8}},
                                        View<float, 4>{nullptr, {2, 0, 2, 8}}));
}

TEST(RopeKernel, ModelShapeAllThreads) {
  // llama-3 8B decode-ish block: 16 tokens, 32 q heads, 8 kv heads, head_dim 128, theta 5e5, at
  // a long-context offset; all threads (num_threads 0) against one thread.
  Rng rng(posenc_test::test_seed(), 5);
  SCOPED_TRACE(posenc_test::seed_trace());
  const Shape sq = {1, 16, 32, 128}, sk = {1, 16, 8, 128};
  const auto f = freqs_for(128, 128, 1.0, 5e5);
  const auto pos = Positions::offset(100000);
  const auto q0 = rng.values(static_cast<std::size_t>(16 * 32 * 128));
  const auto k0 = rng.values(static_cast<std::size_t>(16 * 8 * 128));
  std::vector<float> qa = q0, ka = k0, qb = q0, kb = k0;
  posenc::apply_rope_qk(f, RopeStyle::kHalf, View<float, 4>::contiguous(qa.data(), sq),
                        View<float, 4>::contiguous(ka.data(), sk), &pos, Direction::kForward, 0);
  posenc::apply_rope_qk(f, RopeStyle::kHalf, View<float, 4>::contiguous(qb.data(), sq),
                        View<float, 4>::contiguous(kb.data(), sk), &pos, Direction::kForward, 1);
  for (std::size_t e = 0; e < qa.size(); ++e) ASSERT_TRUE(same_bits(qa[e], qb[e])) << e;
  for (std::size_t e = 0; e < ka.size(); ++e) ASSERT_TRUE(same_bits(ka[e], kb[e])) << e;
  EXPECT_TRUE(matches_reference(q0, qa, sq, f, RopeStyle::kHalf, pos, Direction::kForward));
  EXPECT_TRUE(matches_reference(k0, ka, sk, f, RopeStyle::kHalf, pos, Direction::kForward));
}

}  // namespace
