// tests/test_check.cc - the property checks behind `posenc check`.
#include <gtest/gtest.h>

#include <cmath>

#include "posenc/posenc.h"

namespace {

using namespace posenc;

TEST(Check, AllPropertiesHold) {
  const auto results = run_checks();
  EXPECT_GE(results.size(), 16u);
  for (const auto& r : results) {
    EXPECT_TRUE(r.pass) << r.scheme << ": " << r.property << " measured " << r.measured << " "
                        << r.expect;
    EXPECT_FALSE(r.property.empty());
    EXPECT_FALSE(r.expect.empty());
  }
}

TEST(Check, ResultsDoNotDependOnTheSeedBeyondRounding) {
  for (uint64_t seed : {1ull, 2ull, 12345ull}) {
    for (const auto& r : run_checks({.seed = seed})) EXPECT_TRUE(r.pass) << r.property;
  }
}

TEST(Check, SeedNumbers) {
  // The seed's PyTorch session prints 7.4852, 7.4852 and 6.1370 (float32, 4 decimals).
  EXPECT_NEAR(sinusoidal_dot(16, 105, 106), 7.4852, 5e-5);
  EXPECT_NEAR(sinusoidal_dot(16, 5, 6), 7.4852, 5e-5);
  EXPECT_NEAR(sinusoidal_dot(16, 5, 10), 6.1370, 5e-5);
  // Closed form: PE(a).PE(b) = sum_i cos((a - b) w_i).
  double want = 0;
  for (int i = 0; i < 8; ++i) want += std::cos(5.0 * std::pow(1e4, -2.0 * i / 16));
  EXPECT_NEAR(sinusoidal_dot(16, 5, 10), want, 1e-12);
}

TEST(Check, MaskBreaksPermutationSymmetry) {
  EXPECT_LT(query_permutation_error(false, 7), 1e-12);
  EXPECT_LT(key_permutation_error(false, 7), 1e-12);
  EXPECT_GT(query_permutation_error(true, 7), 1e-3);
  EXPECT_GT(key_permutation_error(true, 7), 1e-3);
}

TEST(Check, RelativeSchemes) {
  for (const char* s : {"alibi", "t5", "shaw", "xl", "deberta", "rope"}) {
    EXPECT_LT(relative_score_spread(s, 3), 1e-9) << s;
  }
  EXPECT_THROW(relative_score_spread("sinusoidal", 3), ValueError);
  EXPECT_LT(rope_norm_error(3), 1e-12);
}

}  // namespace
