// tests/test_half_attention.cc - attention on bf16 / f16 storage runs the fused kernel on the
// storage itself (rows widened as they are loaded, the output rounded once). Widening is exact
// and the kernel's arithmetic is the float32 kernel's, so the result must equal the float32
// attention of the widened inputs rounded once to the output type, bit for bit: every scheme,
// prefill and decoding (dot products on the half-precision key and value rows), GQA, mixed
// float32 q with a half KV cache, strided views, every compiled Highway target, 1/2/3 threads.
// Decoding with a bf16 query and cache on a processor with AVX512_BF16 would use vdpbf16ps for
// the scores (another summation order; tests/test_bf16_dot.cc): these tests turn it off to
// compare the widening kernel bit for bit.
#include <gtest/gtest.h>

#include <random>

#include "attention_cases.h"
#include "hwy/targets.h"
#include "kernels/bf16_dot.h"
#include "kernels/simd.h"
#include "posenc/posenc.h"

namespace {

using namespace posenc;

[[maybe_unused]] const bool kWideningKernel = (kernels::set_bf16_dot_for_test(0), true);

struct Shape {
  int64_t batch, seq_q, seq_k, heads_q, heads_kv, dim;
};

template <class T>
std::vector<T> rounded(const std::vector<float>& x) {
  std::vector<T> o(x.size());
  for (size_t i = 0; i < x.size(); ++i) o[i] = from_float<T>(x[i]);
  return o;
}

template <class T>
std::vector<float> widened(const std::vector<T>& x) {
  std::vector<float> o(x.size());
  for (size_t i = 0; i < x.size(); ++i) o[i] = to_float(x[i]);
  return o;
}

template <class T>
std::vector<uint16_t> bits(const std::vector<T>& x) {
  std::vector<uint16_t> o(x.size());
  for (size_t i = 0; i < x.size(); ++i) o[i] = x[i].bits;
  return o;
}

// Q: float or the half type T; out like Q. Compares against the float32 path on widened inputs.
template <class Q, class T>
void check(const Shape& s, const PositionScheme& scheme, const AttentionOptions& opt, uint64_t seed,
           const Positions* qp = nullptr, const Positions* kp = nullptr) {
  std::mt19937_64 rng(seed);
  const auto qf = cases::randn_f(rng, s.batch * s.seq_q * s.heads_q * s.dim);
  const auto kf = cases::randn_f(rng, s.batch * s.seq_k * s.heads_kv * s.dim);
  const auto vf = cases::randn_f(rng, s.batch * s.seq_k * s.heads_kv * s.dim);
  const std::array<int64_t, 4> qs{s.batch, s.seq_q, s.heads_q, s.dim};
  const std::array<int64_t, 4> ks{s.batch, s.seq_k, s.heads_kv, s.dim};
  const auto k = rounded<T>(kf), v = rounded<T>(vf);
  const auto q = rounded<Q>(qf);
  std::vector<Q> out(q.size());
  attention(View<const Q, 4>::contiguous(q.data(), qs), View<const T, 4>::contiguous(k.data(), ks),
            View<const T, 4>::contiguous(v.data(), ks), scheme, opt,
            View<Q, 4>::contiguous(out.data(), qs), qp, kp);
  // The float32 path on the widened values.
  const auto qw = widened(q), kw = widened(k), vw = widened(v);
  std::vector<float> want(q.size());
  attention(View<const float, 4>::contiguous(qw.data(), qs),
            View<const float, 4>::contiguous(kw.data(), ks),
            View<const float, 4>::contiguous(vw.data(), ks), scheme, opt,
            View<float, 4>::contiguous(want.data(), qs), qp, kp);
  if constexpr (std::is_same_v<Q, float>) {
    EXPECT_EQ(out, want);
  } else {
    EXPECT_EQ(bits(out), bits(rounded<Q>(want)));
  }
}

const std::vector<Shape> kShapes = {
    {1, 70, 70, 4, 2, 32},   // prefill, keys transposed once per group
    {2, 9, 40, 4, 1, 17},    // few rows, odd head_dim (packed values, scalar tails)
    {1, 1, 3000, 8, 2, 64},  // decoding: dot products on the stored rows, split keys
    {1, 2, 200, 8, 8, 16},   // decoding, MHA
    {1, 1, 333, 8, 2, 36},   // decoding, odd head_dim and key count (block and dim tails)
    {2, 1, 150, 2, 2, 12},   // decoding, one row per kv head (padded 4-row blocks)
};

template <class T>
void every_scheme(uint64_t seed0) {
  uint64_t seed = seed0;
  for (const auto& s : kShapes) {
    for (const auto& name : cases::kSchemes) {
      for (bool causal : {true, false}) {
        ++seed;
        SCOPED_TRACE(name + (causal ? " causal" : "") + " Lq " + std::to_string(s.seq_q) + " Lk " +
                     std::to_string(s.seq_k) + " D " + std::to_string(s.dim));
        std::mt19937_64 rng(seed);
        const auto box =
            cases::make_scheme(name, s.heads_q, s.dim, rng, static_cast<int>(seed % 4));
        const Positions qp = Positions::offset(s.seq_k - s.seq_q);
        const Positions kp = Positions::offset(0);
        check<T, T>(s, box->scheme, {.causal = causal}, seed, &qp, &kp);
        check<float, T>(s, box->scheme, {.causal = causal}, seed, &qp, &kp);
      }
    }
  }
}

TEST(HalfAttentionNative, Bf16EqualsFloat32OnWidenedInputs) { every_scheme<bf16>(10); }
TEST(HalfAttentionNative, F16EqualsFloat32OnWidenedInputs) { every_scheme<f16>(500); }

TEST(HalfAttentionNative, EveryCompiledSimdTarget) {
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    kernels::set_simd_target_for_test(target);
    for (const char* name : {"none", "rope", "alibi"}) {
      SCOPED_TRACE(name);
      std::mt19937_64 rng(3);
      const auto box = cases::make_scheme(name, 4, 24, rng, 1);
      const Positions qp = Positions::offset(299), kp = Positions::offset(0);
      check<bf16, bf16>({1, 1, 300, 4, 2, 24}, box->scheme, {.causal = true}, 21, &qp, &kp);
      check<f16, f16>({1, 1, 300, 4, 2, 24}, box->scheme, {.causal = true}, 22, &qp, &kp);
      check<float, f16>({1, 1, 300, 4, 2, 24}, box->scheme, {.causal = true}, 23, &qp, &kp);
      check<bf16, bf16>({1, 33, 77, 4, 2, 24}, box->scheme, {.causal = true}, 24);
      check<f16, f16>({1, 33, 77, 4, 2, 24}, box->scheme, {.causal = true}, 25);
    }
  }
  kernels::set_simd_target_for_test(0);
}

// Results do not depend on the thread count.
TEST(HalfAttentionNative, ThreadCountDoesNotChangeResults) {
  for (const Shape s : {Shape{2, 70, 90, 4, 2, 16}, Shape{1, 1, 4200, 4, 1, 16}}) {
    std::mt19937_64 rng(11);
    const auto box = cases::make_scheme("rope", s.heads_q, s.dim, rng, 0);
    const auto qf = cases::randn_f(rng, s.batch * s.seq_q * s.heads_q * s.dim);
    const auto kf = cases::randn_f(rng, s.batch * s.seq_k * s.heads_kv * s.dim);
    const auto q = rounded<bf16>(qf), k = rounded<bf16>(kf);
    const std::array<int64_t, 4> qs{s.batch, s.seq_q, s.heads_q, s.dim};
    const std::array<int64_t, 4> ks{s.batch, s.seq_k, s.heads_kv, s.dim};
    std::vector<uint16_t> first;
    for (int threads : {1, 2, 3}) {
      std::vector<bf16> out(q.size());
      attention(View<const bf16, 4>::contiguous(q.data(), qs),
                View<const bf16, 4>::contiguous(k.data(), ks),
                View<const bf16, 4>::contiguous(k.data(), ks), box->scheme,
                {.causal = true, .num_threads = threads},
                View<bf16, 4>::contiguous(out.data(), qs));
      if (first.empty()) {
        first = bits(out);
      } else {
        EXPECT_EQ(bits(out), first) << threads << " threads";
      }
    }
  }
}

// A NaN in the half-precision KV cache is reported like the float32 path reports it.
TEST(HalfAttentionNative, NonFiniteInputIsReported) {
  const std::array<int64_t, 4> qs{1, 1, 2, 8}, ks{1, 50, 1, 8};
  std::vector<bf16> q(16, bf16_from_float(0.5f)), k(400, bf16_from_float(0.25f)), v = k;
  k[77] = bf16_from_float(std::nanf(""));
  std::vector<bf16> out(16);
  EXPECT_THROW(attention(View<const bf16, 4>::contiguous(q.data(), qs),
                         View<const bf16, 4>::contiguous(k.data(), ks),
                         View<const bf16, 4>::contiguous(v.data(), ks), NoPositions{},
                         {.causal = false}, View<bf16, 4>::contiguous(out.data(), qs)),
               ValueError);
}

}  // namespace
