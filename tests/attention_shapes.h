// tests/attention_shapes.h - what the attention gradient tests share: a problem shape, its
// q / k / lse layouts, contiguous views over vectors, random inputs and trace strings.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
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

}  // namespace attn_test
