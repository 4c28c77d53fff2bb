// tests/test_model_inputs.cc - what model families ask of attention beyond their scheme, done by
// the library for every entry point (float32 fused and naive, half precision, the float64 oracle,
// forward and backward):
//   1. v narrower than q and k (DeepSeek's multi-head latent attention) gives exactly the result
//      of v zero-padded to head_dim, cut back to v's width (out, lse, dq, dk, dv);
//   2. AttentionOptions::query_temperature (Llama 4's NoPE layers) gives exactly the result of
//      the query rows scaled by attention_temperature at their positions, and dq times the same
//      factors;
//   3. the errors name the problem.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "posenc/posenc.h"

namespace {

using namespace posenc;

using Shape4 = std::array<int64_t, 4>;

int64_t count(const Shape4& s) { return s[0] * s[1] * s[2] * s[3]; }

template <class T>
std::vector<T> random_values(const Shape4& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> n;
  std::vector<T> x(static_cast<std::size_t>(count(s)));
  for (T& e : x) e = static_cast<T>(n(rng));
  return x;
}

// x [.., from] -> [.., to], zero-padded or cut.
template <class T>
std::vector<T> resize(const std::vector<T>& x, int64_t from, int64_t to) {
  const std::size_t rows = x.size() / static_cast<std::size_t>(from);
  std::vector<T> out(rows * static_cast<std::size_t>(to), T{});
  for (std::size_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < std::min(from, to); ++c) out[r * to + c] = x[r * from + c];
  }
  return out;
}

template <class T>
View<const T, 4> cv(const std::vector<T>& x, const Shape4& s) {
  return View<const T, 4>::contiguous(x.data(), s);
}
template <class T>
View<T, 4> mv(std::vector<T>& x, const Shape4& s) {
  return View<T, 4>::contiguous(x.data(), s);
}

constexpr int64_t kB = 2, kLq = 5, kLk = 7, kHq = 4, kHkv = 2, kD = 8, kDv = 5;
const Shape4 kQ{kB, kLq, kHq, kD}, kK{kB, kLk, kHkv, kD}, kV{kB, kLk, kHkv, kDv},
    kVp{kB, kLk, kHkv, kD}, kO{kB, kLq, kHq, kDv}, kOp{kB, kLq, kHq, kD};

std::vector<PositionScheme> schemes() {
  RopeConfig rc;
  rc.head_dim = kD;
  rc.base = 100;
  return {NoPositions{}, Alibi{}, Rope{rope_frequencies(rc, 32), RopeStyle::kHalf, 0}};
}

// Forward and backward of a narrow v against v zero-padded, for T = float (fused and naive) or
// double (the oracle).
template <class T>
void check_narrow(const PositionScheme& scheme, bool naive) {
  const auto q = random_values<T>(kQ, 1), k = random_values<T>(kK, 2), v = random_values<T>(kV, 3);
  const auto vp = resize(v, kDv, kD);
  AttentionOptions opt;
  opt.causal = true;
  std::vector<T> out(count(kO)), outp(count(kOp)), lse(kB * kHq * kLq), lsep(lse.size());
  const auto lv = View<T, 3>::contiguous(lse.data(), {kB, kHq, kLq});
  const auto lvp = View<T, 3>::contiguous(lsep.data(), {kB, kHq, kLq});
  if constexpr (std::is_same_v<T, double>) {
    ref::attention(cv(q, kQ), cv(k, kK), cv(v, kV), scheme, opt, mv(out, kO), lv);
    ref::attention(cv(q, kQ), cv(k, kK), cv(vp, kVp), scheme, opt, mv(outp, kOp), lvp);
  } else if (naive) {
    attention_naive(cv(q, kQ), cv(k, kK), cv(v, kV), scheme, opt, mv(out, kO));
    attention_naive(cv(q, kQ), cv(k, kK), cv(vp, kVp), scheme, opt, mv(outp, kOp));
    EXPECT_EQ(out, resize(outp, kD, kDv));
    // The naive path has no lse output: the backward below reads the fused forward's.
    attention(cv(q, kQ), cv(k, kK), cv(vp, kVp), scheme, opt, mv(outp, kOp), lvp);
  } else {
    attention(cv(q, kQ), cv(k, kK), cv(v, kV), scheme, opt, mv(out, kO), lv);
    attention(cv(q, kQ), cv(k, kK), cv(vp, kVp), scheme, opt, mv(outp, kOp), lvp);
  }
  if (!naive) {
    EXPECT_EQ(out, resize(outp, kD, kDv));
    EXPECT_EQ(lse, lsep);
  }
  // Backward from the padded forward's out (cut), dout narrow vs padded.
  const auto dout = random_values<T>(kO, 4);
  const auto out_cut = resize(outp, kD, kDv);
  std::vector<T> dq(count(kQ)), dk(count(kK)), dv(count(kV)), dqp(count(kQ)), dkp(count(kK)),
      dvp(count(kVp));
  AttentionGradsOf<T> g{.dq = mv(dq, kQ), .dk = mv(dk, kK), .dv = mv(dv, kV)};
  AttentionGradsOf<T> gp{.dq = mv(dqp, kQ), .dk = mv(dkp, kK), .dv = mv(dvp, kVp)};
  const auto doutp = resize(dout, kDv, kD);
  const auto clv = View<const T, 3>::contiguous(lsep.data(), {kB, kHq, kLq});
  if constexpr (std::is_same_v<T, double>) {
    ref::attention_backward(cv(q, kQ), cv(k, kK), cv(v, kV), cv(out_cut, kO), clv, cv(dout, kO),
                            scheme, opt, g);
    ref::attention_backward(cv(q, kQ), cv(k, kK), cv(vp, kVp), cv(outp, kOp), clv, cv(doutp, kOp),
                            scheme, opt, gp);
  } else if (naive) {
    attention_backward_naive(cv(q, kQ), cv(k, kK), cv(v, kV), cv(out_cut, kO), clv, cv(dout, kO),
                             scheme, opt, g);
    attention_backward_naive(cv(q, kQ), cv(k, kK), cv(vp, kVp), cv(outp, kOp), clv, cv(doutp, kOp),
                             scheme, opt, gp);
  } else {
    attention_backward(cv(q, kQ), cv(k, kK), cv(v, kV), cv(out_cut, kO), clv, cv(dout, kO), scheme,
                       opt, g);
    attention_backward(cv(q, kQ), cv(k, kK), cv(vp, kVp), cv(outp, kOp), clv, cv(doutp, kOp),
                       scheme, opt, gp);
  }
  EXPECT_EQ(dq, dqp);
  EXPECT_EQ(dk, dkp);
  EXPECT_EQ(dv, resize(dvp, kD, kDv));
}

TEST(ModelInputs, NarrowValuesEqualZeroPaddedValues) {
  for (const PositionScheme& s : schemes()) {
    SCOPED_TRACE(scheme_name(s));
    check_narrow<float>(s, false);
    check_narrow<float>(s, true);
    check_narrow<double>(s, false);
  }
}

TEST(ModelInputs, NarrowValuesInHalfPrecision) {
  const auto qf = random_values<float>(kQ, 5), kf = random_values<float>(kK, 6),
             vf = random_values<float>(kV, 7);
  std::vector<bf16> q(qf.size()), k(kf.size()), v(vf.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = bf16_from_float(qf[i]);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = bf16_from_float(kf[i]);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = bf16_from_float(vf[i]);
  const auto vp = resize(v, kDv, kD);
  AttentionOptions opt;
  opt.causal = true;
  for (const PositionScheme& s : schemes()) {
    std::vector<bf16> out(count(kO)), outp(count(kOp));
    attention(cv(q, kQ), cv(k, kK), cv(v, kV), s, opt, mv(out, kO));
    attention(cv(q, kQ), cv(k, kK), cv(vp, kVp), s, opt, mv(outp, kOp));
    const auto cut = resize(outp, kD, kDv);
    for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i].bits, cut[i].bits) << i;
    // float32 queries over the bf16 cache.
    std::vector<float> o32(count(kO)), o32p(count(kOp));
    attention(cv(qf, kQ), cv(k, kK), cv(v, kV), s, opt, mv(o32, kO));
    attention(cv(qf, kQ), cv(k, kK), cv(vp, kVp), s, opt, mv(o32p, kOp));
    EXPECT_EQ(o32, resize(o32p, kD, kDv));
  }
}

TEST(ModelInputs, QueryTemperatureScalesTheQueries) {
  const AttentionTemperature t{.floor_scale = 3, .attn_scale = 0.25};
  const auto q = random_values<float>(kQ, 8), k = random_values<float>(kK, 9),
             v = random_values<float>(kVp, 10);
  // Default positions: query i at kLk - kLq + i.
  std::vector<float> scaled = q;
  std::vector<double> factor(kB * kLq);
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t i = 0; i < kLq; ++i) {
      const double f = attention_temperature(t, kLk - kLq + i);
      factor[b * kLq + i] = f;
      for (int64_t x = 0; x < kHq * kD; ++x) {
        scaled[(b * kLq + i) * kHq * kD + x] *= static_cast<float>(f);
      }
    }
  EXPECT_GT(factor.back(), 1.0);
  AttentionOptions plain;
  plain.causal = true;
  AttentionOptions warm = plain;
  warm.query_temperature = t;
  for (const PositionScheme& s : schemes()) {
    SCOPED_TRACE(scheme_name(s));
    std::vector<float> out(count(kOp)), want(count(kOp)), lse(kB * kHq * kLq);
    const auto lv = View<float, 3>::contiguous(lse.data(), {kB, kHq, kLq});
    attention(cv(q, kQ), cv(k, kK), cv(v, kVp), s, warm, mv(out, kOp), lv);
    attention(cv(scaled, kQ), cv(k, kK), cv(v, kVp), s, plain, mv(want, kOp));
    EXPECT_EQ(out, want);
    attention_naive(cv(q, kQ), cv(k, kK), cv(v, kVp), s, warm, mv(out, kOp));
    attention_naive(cv(scaled, kQ), cv(k, kK), cv(v, kVp), s, plain, mv(want, kOp));
    EXPECT_EQ(out, want);
    // Backward: dq through the scaling.
    const auto dout = random_values<float>(kOp, 11);
    std::vector<float> dq(count(kQ)), dk(count(kK)), dv(count(kVp)), dq2(count(kQ)), dk2(count(kK)),
        dv2(count(kVp));
    attention(cv(q, kQ), cv(k, kK), cv(v, kVp), s, warm, mv(out, kOp), lv);
    const auto clv = View<const float, 3>::contiguous(lse.data(), {kB, kHq, kLq});
    attention_backward(cv(q, kQ), cv(k, kK), cv(v, kVp), cv(out, kOp), clv, cv(dout, kOp), s, warm,
                       {.dq = mv(dq, kQ), .dk = mv(dk, kK), .dv = mv(dv, kVp)});
    attention_backward(cv(scaled, kQ), cv(k, kK), cv(v, kVp), cv(out, kOp), clv, cv(dout, kOp), s,
                       plain, {.dq = mv(dq2, kQ), .dk = mv(dk2, kK), .dv = mv(dv2, kVp)});
    for (std::size_t i = 0; i < dq2.size(); ++i) {
      dq2[i] = static_cast<float>(dq2[i] * factor[i / (kHq * kD)]);
    }
    EXPECT_EQ(dq, dq2);
    EXPECT_EQ(dk, dk2);
    EXPECT_EQ(dv, dv2);
    // The oracle and its scores.
    const std::vector<double> q64(q.begin(), q.end()), k64(k.begin(), k.end());
    std::vector<double> s64(q64);
    for (std::size_t i = 0; i < s64.size(); ++i) s64[i] *= factor[i / (kHq * kD)];
    EXPECT_EQ(ref::attention_scores(cv(q64, kQ), cv(k64, kK), s, warm, 1, 3),
              ref::attention_scores(cv(s64, kQ), cv(k64, kK), s, plain, 1, 3));
  }
}

TEST(ModelInputs, Errors) {
  const auto q = random_values<float>(kQ, 12), k = random_values<float>(kK, 13);
  const auto wide = random_values<float>({kB, kLk, kHkv, kD + 1}, 14);
  std::vector<float> out(count({kB, kLq, kHq, kD + 1}));
  try {
    attention(cv(q, kQ), cv(k, kK), cv(wide, {kB, kLk, kHkv, kD + 1}), NoPositions{}, {},
              mv(out, {kB, kLq, kHq, kD + 1}));
    ADD_FAILURE() << "v wider than q";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("same shape"), std::string::npos) << e.what();
  }
  const auto v = random_values<float>(kV, 15);
  std::vector<float> big(count(kOp));
  try {
    attention(cv(q, kQ), cv(k, kK), cv(v, kV), NoPositions{}, {}, mv(big, kOp));
    ADD_FAILURE() << "out with q's head dim";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("out [2, 5, 4, 8]"), std::string::npos) << e.what();
  }
  const auto rel = random_values<float>({5, 1, kD, 1}, 16);
  Shaw shaw{.rel_k = View<const float, 3>::contiguous(rel.data(), {5, 1, kD}),
            .rel_v = View<const float, 3>::contiguous(rel.data(), {5, 1, kD})};
  std::vector<float> o(count(kO));
  try {
    attention(cv(q, kQ), cv(k, kK), cv(v, kV), shaw, {}, mv(o, kO));
    ADD_FAILURE() << "Shaw rel_v with narrow v";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("rel_v"), std::string::npos) << e.what();
  }
  AttentionOptions bad;
  bad.query_temperature = AttentionTemperature{.floor_scale = 0, .attn_scale = 0.1};
  std::vector<float> vp(count(kVp)), op(count(kOp));
  try {
    attention(cv(q, kQ), cv(k, kK), cv(vp, kVp), NoPositions{}, bad, mv(op, kOp));
    ADD_FAILURE() << "floor_scale 0";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("floor_scale"), std::string::npos) << e.what();
  }
}

}  // namespace
