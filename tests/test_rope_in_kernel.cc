// tests/test_rope_in_kernel.cc - the fused kernels rotate q and k rows by RoPE as they load them
// (cos/sin by position, no rotated copies). The rotated rows equal apply_rope's bit for bit, so
// attention with Rope must equal attention without positions on apply_rope'd q and k exactly:
// forward (prefill with keys transposed once per group, few query blocks, decoding), backward
// (dv equal, dq and dk equal after the inverse rotation), half and interleaved styles, partial
// rotary, a rotary offset (DeepSeek), per-row positions with different bases, and the fallback
// to rotated copies when positions are too sparse for the table.
#include <gtest/gtest.h>

#include <random>

#include "hwy/targets.h"
#include "kernels/simd.h"
#include "posenc/posenc.h"

namespace {

using namespace posenc;

struct Shape {
  int64_t batch, seq_q, seq_k, heads_q, heads_kv, dim;
};

std::vector<float> randn(int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& e : x) e = nd(rng);
  return x;
}

using V4 = View<const float, 4>;

// x rotated like the scheme does: dims [offset, offset + R) of each head.
std::vector<float> rotated(const Rope& r, const std::vector<float>& x,
                           const std::array<int64_t, 4>& shape, const Positions& pos,
                           Direction dir = Direction::kForward) {
  std::vector<float> out = x;
  View<float, 4> part = View<float, 4>::contiguous(out.data(), shape);
  part.data += r.offset;
  part.shape[3] -= r.offset;
  apply_rope(r.freqs, r.style, V4(part), part, &pos, dir, 1);
  return out;
}

struct Run {
  std::vector<float> out, lse, dq, dk, dv;
};

Run forward_backward(const Shape& s, const PositionScheme& scheme, const AttentionOptions& opt,
                     const std::vector<float>& q, const std::vector<float>& k,
                     const std::vector<float>& v, const std::vector<float>& dout,
                     const Positions& qp, const Positions& kp) {
  const std::array<int64_t, 4> qs{s.batch, s.seq_q, s.heads_q, s.dim};
  const std::array<int64_t, 4> ks{s.batch, s.seq_k, s.heads_kv, s.dim};
  Run r;
  r.out.assign(q.size(), 0.0f);
  r.lse.assign(static_cast<size_t>(s.batch * s.heads_q * s.seq_q), 0.0f);
  const auto lse = View<float, 3>::contiguous(r.lse.data(), {s.batch, s.heads_q, s.seq_q});
  attention(V4::contiguous(q.data(), qs), V4::contiguous(k.data(), ks),
            V4::contiguous(v.data(), ks), scheme, opt, View<float, 4>::contiguous(r.out.data(), qs),
            lse, &qp, &kp);
  r.dq.assign(q.size(), 0.0f);
  r.dk.assign(k.size(), 0.0f);
  r.dv.assign(k.size(), 0.0f);
  AttentionGrads g;
  g.dq = View<float, 4>::contiguous(r.dq.data(), qs);
  g.dk = View<float, 4>::contiguous(r.dk.data(), ks);
  g.dv = View<float, 4>::contiguous(r.dv.data(), ks);
  attention_backward(V4::contiguous(q.data(), qs), V4::contiguous(k.data(), ks),
                     V4::contiguous(v.data(), ks), V4::contiguous(r.out.data(), qs),
                     View<const float, 3>(lse), V4::contiguous(dout.data(), qs), scheme, opt, g,
                     &qp, &kp);
  return r;
}

// Rope attention == none attention on rotated inputs, forward and backward, bit for bit.
void check(const Shape& s, const Rope& rope, const AttentionOptions& opt, const Positions& qp,
           const Positions& kp, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto q = randn(s.batch * s.seq_q * s.heads_q * s.dim, rng);
  const auto k = randn(s.batch * s.seq_k * s.heads_kv * s.dim, rng);
  const auto v = randn(s.batch * s.seq_k * s.heads_kv * s.dim, rng);
  const auto dout = randn(s.batch * s.seq_q * s.heads_q * s.dim, rng);
  const std::array<int64_t, 4> qs{s.batch, s.seq_q, s.heads_q, s.dim};
  const std::array<int64_t, 4> ks{s.batch, s.seq_k, s.heads_kv, s.dim};
  const Run a = forward_backward(s, rope, opt, q, k, v, dout, qp, kp);
  const auto qr = rotated(rope, q, qs, qp), kr = rotated(rope, k, ks, kp);
  const Run b = forward_backward(s, NoPositions{}, opt, qr, kr, v, dout, qp, kp);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.dv, b.dv);
  EXPECT_EQ(a.dq, rotated(rope, b.dq, qs, qp, Direction::kInverse));
  EXPECT_EQ(a.dk, rotated(rope, b.dk, ks, kp, Direction::kInverse));
}

Rope make_rope(int64_t dim, int64_t rotary, RopeStyle style, int64_t offset = 0) {
  Rope r;
  r.freqs = rope_frequencies(RopeConfig{.head_dim = rotary, .base = 1e4});
  r.style = style;
  r.offset = offset;
  (void)dim;
  return r;
}

TEST(RopeInKernel, EqualsAttentionOnRotatedInputs) {
  const std::vector<Shape> shapes = {
      {1, 130, 130, 4, 2, 32},  // prefill: keys transposed once per group
      {2, 20, 77, 4, 4, 16},    // few query blocks: keys transposed per tile
      {1, 1, 5000, 8, 2, 32},   // decoding, split keys, dot products on key rows
      {2, 3, 90, 8, 1, 24},     // MQA, few rows
  };
  uint64_t seed = 1;
  for (const auto& s : shapes) {
    for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
      for (int64_t rotary : {s.dim, s.dim / 2}) {
        for (bool causal : {true, false}) {
          SCOPED_TRACE("Lq " + std::to_string(s.seq_q) + " Lk " + std::to_string(s.seq_k) + " D " +
                       std::to_string(s.dim) + " rotary " + std::to_string(rotary) +
                       (style == RopeStyle::kHalf ? " half" : " interleaved") +
                       (causal ? " causal" : ""));
          const Positions qp = Positions::offset(s.seq_k - s.seq_q);
          const Positions kp = Positions::offset(0);
          check(s, make_rope(s.dim, rotary, style), {.causal = causal}, qp, kp, ++seed);
        }
      }
    }
  }
}

// DeepSeek's decoupled RoPE: dims [offset, offset + R) rotate, the others pass through.
TEST(RopeInKernel, RotaryOffset) {
  const Shape s{1, 70, 70, 4, 4, 24};
  for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    check(s, make_rope(s.dim, 8, style, 12), {.causal = true}, Positions::offset(0),
          Positions::offset(0), 5);
  }
}

// Per-row positions with different bases per batch row, gaps, descending keys, windows.
TEST(RopeInKernel, PerRowPositionsAndWindows) {
  const Shape s{2, 5, 70, 4, 2, 16};
  std::vector<int64_t> kids(2 * 70);
  for (int64_t j = 0; j < 70; ++j) {
    kids[static_cast<size_t>(j)] = 1000 + 3 * j;
    kids[static_cast<size_t>(70 + j)] = 69 - j;
  }
  const auto kp = Positions::per_row(kids, 2, 70);
  const auto qp = Positions::per_row({1000, 1050, 1100, 1150, 1200, 10, 20, 30, 40, 70}, 2, 5);
  for (int64_t window : {0, 9}) {
    AttentionOptions opt{.causal = true, .allow_fully_masked = true};
    if (window) opt.window = window;
    check(s, make_rope(s.dim, s.dim, RopeStyle::kHalf), opt, qp, kp, 7);
  }
}

// Positions so sparse that the cos/sin table would exceed rotated copies: the copies are used,
// with the same bits.
TEST(RopeInKernel, SparsePositionsFallBackToRotatedCopies) {
  const Shape s{1, 3, 40, 2, 2, 16};
  std::vector<int64_t> kids(40);
  for (int64_t j = 0; j < 40; ++j) kids[static_cast<size_t>(j)] = j * 100000;
  const auto kp = Positions::shared(kids);
  const auto qp = Positions::shared({3900000, 3900001, 3900002});
  check(s, make_rope(s.dim, s.dim, RopeStyle::kHalf), {.causal = true}, qp, kp, 9);
}

// Every compiled Highway target.
TEST(RopeInKernel, EveryCompiledSimdTarget) {
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    kernels::set_simd_target_for_test(target);
    check({1, 33, 77, 4, 2, 24}, make_rope(24, 24, RopeStyle::kInterleaved), {.causal = true},
          Positions::offset(44), Positions::offset(0), 11);
    check({1, 1, 300, 4, 2, 24}, make_rope(24, 16, RopeStyle::kHalf), {.causal = true},
          Positions::offset(299), Positions::offset(0), 12);
  }
  kernels::set_simd_target_for_test(0);
}

}  // namespace
