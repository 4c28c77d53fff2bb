// tests/test_alibi.cc - ALiBi slopes and bias (docs/alibi.md) against exact powers of two, an
// implementation written here from the wording of docs/alibi.md, and MPT's formulation.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "posenc/alibi.h"
#include "posenc/error.h"
#include "test_util.h"

namespace {

using posenc::AlibiConfig;

// docs/alibi.md, written from its wording: for a power of two H, m_h = 2^(-B h / H), h = 1..H;
// otherwise n = 2^floor(log2 H): the n power-of-two slopes, then the slopes for 2n heads taking
// every other one (indices 0, 2, 4, ...) until there are H slopes. Long double, so a 1-ulp
// comparison with the library's double is meaningful.
std::vector<long double> power_of_two_set(int64_t n, double max_bias) {
  std::vector<long double> s;
  for (int64_t h = 1; h <= n; ++h) {
    s.push_back(std::exp2(-static_cast<long double>(max_bias) * static_cast<long double>(h) /
                          static_cast<long double>(n)));
  }
  return s;
}
std::vector<long double> spec_slopes(int64_t heads, double max_bias) {
  int64_t n = 1;
  while (2 * n <= heads) n *= 2;
  std::vector<long double> s = power_of_two_set(n, max_bias);
  const auto doubled = power_of_two_set(2 * n, max_bias);
  for (std::size_t idx = 0; static_cast<int64_t>(s.size()) < heads; idx += 2) {
    s.push_back(doubled.at(idx));
  }
  return s;
}

// MPT (`gen_slopes`): c' = 2^ceil(log2 H), m = 2^(-k B / c') for k = 1..c', reordered as
// slopes[1::2] ++ slopes[::2] and cut to H when H is not a power of two.
std::vector<long double> mpt_slopes(int64_t heads, double max_bias) {
  int64_t c = 1;
  while (c < heads) c *= 2;
  const auto all = power_of_two_set(c, max_bias);
  if (c == heads) return all;
  std::vector<long double> s;
  for (std::size_t k = 1; k < all.size(); k += 2) s.push_back(all[k]);
  for (std::size_t k = 0; k < all.size(); k += 2) s.push_back(all[k]);
  s.resize(static_cast<std::size_t>(heads));
  return s;
}

void expect_slopes(const std::vector<double>& got, const std::vector<long double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t h = 0; h < got.size(); ++h) {
    // exp2 in double is within 1 ulp of the exact power of two.
    const double w = static_cast<double>(want[h]);
    EXPECT_NEAR(got[h], w, w * 0x1p-52) << "head " << h;
  }
}

TEST(Alibi, EightHeadsArePowersOfOneHalf) {
  const auto s = posenc::alibi_slopes({.heads = 8});
  ASSERT_EQ(s.size(), 8u);
  for (int h = 1; h <= 8; ++h) EXPECT_EQ(s[static_cast<std::size_t>(h - 1)], std::ldexp(1.0, -h));
}

TEST(Alibi, PowersOfTwoHeadCounts) {
  // m_h = 2^(-8h/H): exact powers of two whenever 8h/H is an integer.
  EXPECT_EQ(posenc::alibi_slopes({.heads = 1}), std::vector<double>{0x1p-8});
  EXPECT_EQ(posenc::alibi_slopes({.heads = 2}), (std::vector<double>{0x1p-4, 0x1p-8}));
  EXPECT_EQ(posenc::alibi_slopes({.heads = 4}),
            (std::vector<double>{0x1p-2, 0x1p-4, 0x1p-6, 0x1p-8}));
  const auto s16 = posenc::alibi_slopes({.heads = 16});
  ASSERT_EQ(s16.size(), 16u);
  for (int h = 1; h <= 16; ++h) {
    const double want = std::pow(2.0, -0.5 * h);  // 2^(-8h/16)
    EXPECT_NEAR(s16[static_cast<std::size_t>(h - 1)], want, want * 0x1p-52) << h;
    if (h % 2 == 0) {
      EXPECT_EQ(s16[static_cast<std::size_t>(h - 1)], std::ldexp(1.0, -h / 2));
    }
  }
  for (int64_t heads : {32, 64, 128}) {
    SCOPED_TRACE("H " + std::to_string(heads));
    expect_slopes(posenc::alibi_slopes({.heads = heads}), spec_slopes(heads, 8));
  }
}

TEST(Alibi, TwelveHeadsByHand) {
  // n = 8: 2^-1 .. 2^-8, then every other slope of the 16-head set 2^(-h/2):
  // h = 1, 3, 5, 7 -> 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (BLOOM's extra_base^(1, 3, 5, 7)).
  const auto s = posenc::alibi_slopes({.heads = 12});
  ASSERT_EQ(s.size(), 12u);
  for (int h = 1; h <= 8; ++h) EXPECT_EQ(s[static_cast<std::size_t>(h - 1)], std::ldexp(1.0, -h));
  const double extra[] = {std::sqrt(0.5), std::sqrt(0.5) / 2, std::sqrt(0.5) / 4,
                          std::sqrt(0.5) / 8};
  for (int j = 0; j < 4; ++j) {
    EXPECT_NEAR(s[static_cast<std::size_t>(8 + j)], extra[j], extra[j] * 0x1p-52) << j;
  }
}

TEST(Alibi, NonPowersOfTwoFollowTheSpec) {
  for (int64_t heads : {3, 5, 6, 7, 12, 20, 24, 40, 71, 80, 96, 130}) {
    SCOPED_TRACE("H " + std::to_string(heads));
    const auto got = posenc::alibi_slopes({.heads = heads});
    expect_slopes(got, spec_slopes(heads, 8));
    // MPT's construction yields the same sequence.
    expect_slopes(got, mpt_slopes(heads, 8));
  }
}

TEST(Alibi, MaxBiasGeneralises) {
  // B = 16, H = 8: m_h = 2^(-16h/8) = 2^(-2h) exactly.
  const auto s = posenc::alibi_slopes({.heads = 8, .max_bias = 16});
  ASSERT_EQ(s.size(), 8u);
  for (int h = 1; h <= 8; ++h) {
    EXPECT_EQ(s[static_cast<std::size_t>(h - 1)], std::ldexp(1.0, -2 * h));
  }
  for (double b : {1.0, 4.0, 12.5, 16.0}) {
    for (int64_t heads : {1, 4, 6, 12, 20}) {
      SCOPED_TRACE("H " + std::to_string(heads) + " B " + std::to_string(b));
      const auto got = posenc::alibi_slopes({.heads = heads, .max_bias = b});
      expect_slopes(got, spec_slopes(heads, b));
      expect_slopes(got, mpt_slopes(heads, b));
    }
  }
}

TEST(Alibi, SlopesArePositiveAndDistinct) {
  for (int64_t heads = 1; heads <= 300; ++heads) {
    const auto s = posenc::alibi_slopes({.heads = heads});
    ASSERT_EQ(s.size(), static_cast<std::size_t>(heads));
    std::vector<double> sorted = s;
    std::sort(sorted.begin(), sorted.end());
    ASSERT_GT(sorted.front(), 0.0) << "H " << heads;
    ASSERT_LT(sorted.back(), 1.0) << "H " << heads;
    ASSERT_TRUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end())
        << "repeated slope for H " << heads;
    // The first n slopes decrease geometrically.
    int64_t n = 1;
    while (2 * n <= heads) n *= 2;
    for (int64_t h = 1; h < n; ++h) {
      ASSERT_LT(s[static_cast<std::size_t>(h)], s[static_cast<std::size_t>(h - 1)]);
    }
  }
}

TEST(Alibi, InvalidConfigsThrowValueError) {
  EXPECT_THROW(posenc::alibi_slopes({.heads = 0}), posenc::ValueError);
  EXPECT_THROW(posenc::alibi_slopes({.heads = -3}), posenc::ValueError);
  EXPECT_THROW(posenc::alibi_slopes({.heads = 8, .max_bias = 0}), posenc::ValueError);
  EXPECT_THROW(posenc::alibi_slopes({.heads = 8, .max_bias = -8}), posenc::ValueError);
  EXPECT_THROW(posenc::alibi_slopes({.heads = 8, .max_bias = std::nan("")}), posenc::ValueError);
  EXPECT_THROW(posenc::alibi_slopes({.heads = 8, .max_bias = HUGE_VAL}), posenc::ValueError);
  try {
    posenc::alibi_slopes({.heads = 0});
  } catch (const posenc::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("heads"), std::string::npos) << e.what();
  }
}

TEST(Alibi, BiasIsSymmetricAndLinearInDistance) {
  posenc_test::Rng rng(posenc_test::test_seed(), 40);
  SCOPED_TRACE(posenc_test::seed_trace());
  const auto slopes = posenc::alibi_slopes({.heads = 12});
  for (double m : slopes) {
    EXPECT_EQ(posenc::alibi_bias(m, 5, 5), 0.0);
    for (int trial = 0; trial < 50; ++trial) {
      const int64_t q = rng.integer(0, int64_t{1} << 40), k = rng.integer(0, int64_t{1} << 40);
      const double b = posenc::alibi_bias(m, q, k);
      EXPECT_EQ(b, posenc::alibi_bias(m, k, q));
      // -m |q - k|: one rounding of an exact integer times m.
      const double dist = static_cast<double>(q > k ? q - k : k - q);
      EXPECT_EQ(b, -m * dist);
      EXPECT_LE(b, 0.0);
      // Causal form on visible cells (k <= q): -m (q - k).
      if (k <= q) {
        EXPECT_EQ(b, -m * static_cast<double>(q - k));
      }
    }
  }
  // Linear: with a power-of-two slope every product is exact, so the bias is additive.
  const double m = 0x1p-3;
  for (int64_t d1 : {1, 7, 130, 1 << 20}) {
    for (int64_t d2 : {2, 3, 1 << 24}) {
      EXPECT_EQ(posenc::alibi_bias(m, d1 + d2, 0),
                posenc::alibi_bias(m, d1, 0) + posenc::alibi_bias(m, d2, 0));
    }
  }
  // Distance 2^40 at slope 2^-8: -2^32 exactly.
  EXPECT_EQ(posenc::alibi_bias(0x1p-8, 0, int64_t{1} << 40), -0x1p32);
}

}  // namespace
