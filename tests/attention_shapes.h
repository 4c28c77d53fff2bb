// tests/attention_shapes.h - what the attention gradient tests share: a problem shape, its
// q / k / lse layouts, contiguous views over vectors, random inputs, trace strings and the
// float32-against-oracle tolerance rule.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "posenc/posenc.h"
#include "test_util.h"

namespace attn_test {

using posenc::AttentionOptions;
using posenc::View;
using posenc_test::Rng;

struct Shape {
  int64_t batch, seq_q, seq_k, heads_q, heads_kv, dim;
};

inline std::string str(const Shape& s) {
  return "B" + std::to_string(s.batch) + " Lq" + std::to_string(s.seq_q) + " Lk" +
         std::to_string(s.seq_k) + " Hq" + std::to_string(s.heads_q) + " Hkv" +
         std::to_string(s.heads_kv) + " D" + std::to_string(s.dim);
}

inline std::string str(const AttentionOptions& o) {
  std::string r = o.causal ? "causal" : "bidirectional";
  if (o.window) r += " window " + std::to_string(*o.window);
  if (o.chunk) r += " chunk " + std::to_string(*o.chunk);
  if (o.sinks.data) r += " sinks";
  if (o.allow_fully_masked) r += " allow_fully_masked";
  if (o.scale) r += " scale " + std::to_string(*o.scale);
  if (o.num_threads) r += " threads " + std::to_string(o.num_threads);
  return r;
}

inline std::array<int64_t, 4> qshape(const Shape& s) {
  return {s.batch, s.seq_q, s.heads_q, s.dim};
}
inline std::array<int64_t, 4> kshape(const Shape& s) {
  return {s.batch, s.seq_k, s.heads_kv, s.dim};
}
inline std::array<int64_t, 3> lshape(const Shape& s) { return {s.batch, s.heads_q, s.seq_q}; }

template <std::size_t R>
inline std::size_t numel(const std::array<int64_t, R>& sh) {
  int64_t n = 1;
  for (auto d : sh) n *= d;
  return static_cast<std::size_t>(n);
}

template <class T, std::size_t R>
inline View<const T, R> cview(const std::vector<T>& x, const std::array<int64_t, R>& sh) {
  return View<const T, R>::contiguous(x.data(), sh);
}
template <class T, std::size_t R>
inline View<T, R> mview(std::vector<T>& x, const std::array<int64_t, R>& sh) {
  return View<T, R>::contiguous(x.data(), sh);
}

template <class T>
inline std::vector<T> randn(Rng& rng, std::size_t n, double sd = 1.0) {
  std::normal_distribution<double> nd(0.0, sd);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(nd(rng.engine()));
  return v;
}

inline std::vector<double> promote(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// max |a - ref| (NaN counts as infinite).
inline double max_abs_err(const std::vector<float>& a, const std::vector<double>& ref) {
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    double d = std::abs(static_cast<double>(a[i]) - ref[i]);
    if (std::isnan(d)) d = std::numeric_limits<double>::infinity();
    e = std::max(e, d);
  }
  return e;
}

inline double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) m = std::max(m, std::abs(v));
  return m;
}

// The tolerance rule of the float32 paths: max |fast - ref| <= 2 max |naive - ref| +
// 1e-6 max(1, max |ref|), and the naive path within 1e-4 max(1, max |ref|) of the oracle.
inline void expect_tolerance(const std::string& what, const std::vector<float>& fast,
                             const std::vector<float>& naive, const std::vector<double>& ref) {
  const double ef = max_abs_err(fast, ref), en = max_abs_err(naive, ref);
  const double mag = std::max(1.0, max_abs(ref));
  EXPECT_LE(ef, 2 * en + 1e-6 * mag) << what << ": fast " << ef << ", naive " << en;
  EXPECT_LE(en, 1e-4 * mag) << what << ": naive error " << en << ", max |ref| " << mag;
}

// The float32 lse against the oracle's: -inf exactly where the oracle has it (rows with no
// visible key), else within 1e-5 relative.
inline void expect_lse(const std::vector<float>& lse, const std::vector<double>& ref) {
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (ref[i] == -std::numeric_limits<double>::infinity()) {
      EXPECT_EQ(lse[i], -std::numeric_limits<float>::infinity()) << "lse " << i;
    } else {
      EXPECT_NEAR(lse[i], ref[i], 1e-5 * std::max(1.0, std::abs(ref[i]))) << "lse " << i;
    }
  }
}

}  // namespace attn_test
