// tests/test_relative.cc - Shaw, Transformer-XL and DeBERTa specifics: index functions, the XL
// rel_shift trick (right only under a causal mask), memory segments, DeBERTa's log buckets and the
// released code's gather-then-transpose p2c, checked against the float64 reference scores.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "attention_cases.h"
#include "posenc/posenc.h"

namespace {

using namespace posenc;

std::vector<double> randn(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<float>(nd(rng));
  return v;
}

TEST(Shaw, IndexClipsAtK) {
  EXPECT_EQ(shaw_index(0, 3), 3);
  EXPECT_EQ(shaw_index(-3, 3), 0);
  EXPECT_EQ(shaw_index(-100, 3), 0);
  EXPECT_EQ(shaw_index(3, 3), 6);
  EXPECT_EQ(shaw_index(1000, 3), 6);
  EXPECT_EQ(shaw_index(5, 0), 0);
}

// Shaw scores: scale * q . (k + rel_k[clamp(rel)]); beyond the clip distance every key gets the
// same relative term.
TEST(Shaw, ScoresUseTheClippedTable) {
  std::mt19937_64 rng(3);
  const int64_t len = 9, dim = 4;
  const auto q = randn(rng, len * dim), k = randn(rng, len * dim);
  const auto rk = cases::randn_f(rng, 5 * dim);  // K = 2
  const Shaw shaw{shaw_table(View<const float, 2>::contiguous(rk.data(), {5, dim})), {}};
  const auto s = ref::attention_scores(
      View<const double, 4>::contiguous(q.data(), {1, len, 1, dim}),
      View<const double, 4>::contiguous(k.data(), {1, len, 1, dim}), shaw, {}, 0, 0);
  for (int64_t i = 0; i < len; ++i) {
    for (int64_t j = 0; j < len; ++j) {
      const int64_t idx = std::clamp<int64_t>(j - i, -2, 2) + 2;
      double want = 0;
      for (int64_t c = 0; c < dim; ++c)
        want += q[i * dim + c] * (k[j * dim + c] + rk[idx * dim + c]);
      EXPECT_NEAR(s[i * len + j], want / 2.0, 1e-12) << i << "," << j;
    }
  }
}

TEST(TransformerXL, SinusoidIsConcatLayout) {
  const auto r = xl_sinusoid(3, 8);
  for (int i = 0; i < 4; ++i) {
    const double w = std::pow(1e4, -2.0 * i / 8);
    EXPECT_DOUBLE_EQ(r[i], std::sin(3 * w));
    EXPECT_DOUBLE_EQ(r[4 + i], std::cos(3 * w));
  }
  EXPECT_THROW(xl_sinusoid(1, 7), ValueError);
}

struct XlSetup {
  int64_t heads = 2, dim = 4, dm = 6, seq_q = 5, mem = 3;
  std::vector<float> u, v, w;
  std::vector<double> q, k;
  TransformerXL xl() const {
    return {View<const float, 2>::contiguous(u.data(), {heads, dim}),
            View<const float, 2>::contiguous(v.data(), {heads, dim}),
            View<const float, 2>::contiguous(w.data(), {heads * dim, dm})};
  }
  int64_t seq_k() const { return seq_q + mem; }
};

XlSetup make_xl(uint64_t seed) {
  XlSetup x;
  std::mt19937_64 rng(seed);
  x.u = cases::randn_f(rng, x.heads * x.dim);
  x.v = cases::randn_f(rng, x.heads * x.dim);
  x.w = cases::randn_f(rng, x.heads * x.dim * x.dm);
  x.q = randn(rng, x.seq_q * x.heads * x.dim);
  x.k = randn(rng, x.seq_k() * x.heads * x.dim);
  return x;
}

// (q_i + v) . r(delta) for head h, from the formula of docs/.
double xl_bd(const XlSetup& x, int64_t h, int64_t i, int64_t delta) {
  const auto big_r = xl_sinusoid(delta, x.dm);
  double acc = 0;
  for (int64_t c = 0; c < x.dim; ++c) {
    double r = 0;
    for (int64_t m = 0; m < x.dm; ++m) r += x.w[(h * x.dim + c) * x.dm + m] * big_r[m];
    acc += (x.q[(i * x.heads + h) * x.dim + c] + x.v[h * x.dim + c]) * r;
  }
  return acc;
}

// The reference implementation computes BD against distances klen-1 .. 0 and shifts rows with
// rel_shift (pad a zero column, reshape, drop a row). Emulated here: it agrees with posenc's
// distance indexing on every cell a causal mask keeps, and disagrees above the diagonal, where
// posenc stays right without a mask.
TEST(TransformerXL, RelShiftIsOnlyRightUnderACausalMask) {
  const auto x = make_xl(11);
  const int64_t ql = x.seq_q, kl = x.seq_k(), mlen = x.mem, h = 1;
  std::vector<double> raw(ql * kl);  // raw[i][m] = BD(i, distance kl - 1 - m)
  for (int64_t i = 0; i < ql; ++i)
    for (int64_t m = 0; m < kl; ++m) raw[i * kl + m] = xl_bd(x, h, i, kl - 1 - m);
  // Padded P [ql, kl + 1] with P[r][0] = 0; flattened, drop the first ql entries, view [ql, kl].
  auto padded = [&](int64_t t) {
    const int64_t r = t / (kl + 1), c = t % (kl + 1);
    return c == 0 ? 0.0 : raw[r * kl + c - 1];
  };
  // posenc's AC + BD scores; remove AC by using the same scores with zero content terms is not
  // possible, so compare BD directly: scale * ((q+u).k + BD) - scale * (q+u).k.
  const auto s = ref::attention_scores(
      View<const double, 4>::contiguous(x.q.data(), {1, ql, x.heads, x.dim}),
      View<const double, 4>::contiguous(x.k.data(), {1, kl, x.heads, x.dim}), x.xl(), {}, 0, h);
  const double scale = 1.0 / std::sqrt(static_cast<double>(x.dim));
  int mismatches_above = 0;
  for (int64_t i = 0; i < ql; ++i) {
    for (int64_t j = 0; j < kl; ++j) {
      double ac = 0;
      for (int64_t c = 0; c < x.dim; ++c) {
        ac += (x.q[(i * x.heads + h) * x.dim + c] + x.u[h * x.dim + c]) *
              x.k[(j * x.heads + h) * x.dim + c];
      }
      const double bd = s[i * kl + j] / scale - ac;
      const int64_t delta = (mlen + i) - j;  // query i sits at mlen + i
      EXPECT_NEAR(bd, xl_bd(x, h, i, delta), 1e-10);
      const double shifted = padded(ql + i * kl + j);
      if (j <= mlen + i) {
        EXPECT_NEAR(shifted, bd, 1e-10) << "visible cell " << i << "," << j;
      } else if (std::abs(shifted - bd) > 1e-6) {
        ++mismatches_above;
      }
    }
  }
  EXPECT_GT(mismatches_above, 0) << "rel_shift should be wrong above the diagonal";
}

// Memory segment (Lk > Lq) with and without a mask: float32 path equals the oracle.
TEST(TransformerXL, MemorySegmentFloat32MatchesReference) {
  const auto x = make_xl(12);
  for (bool causal : {false, true}) {
    const std::vector<float> qf(x.q.begin(), x.q.end()), kf(x.k.begin(), x.k.end());
    std::vector<float> out(qf.size());
    std::vector<double> out_ref(qf.size());
    const AttentionOptions opt{.causal = causal};
    attention(View<const float, 4>::contiguous(qf.data(), {1, x.seq_q, x.heads, x.dim}),
              View<const float, 4>::contiguous(kf.data(), {1, x.seq_k(), x.heads, x.dim}),
              View<const float, 4>::contiguous(kf.data(), {1, x.seq_k(), x.heads, x.dim}), x.xl(),
              opt, View<float, 4>::contiguous(out.data(), {1, x.seq_q, x.heads, x.dim}));
    ref::attention(View<const double, 4>::contiguous(x.q.data(), {1, x.seq_q, x.heads, x.dim}),
                   View<const double, 4>::contiguous(x.k.data(), {1, x.seq_k(), x.heads, x.dim}),
                   View<const double, 4>::contiguous(x.k.data(), {1, x.seq_k(), x.heads, x.dim}),
                   x.xl(), opt,
                   View<double, 4>::contiguous(out_ref.data(), {1, x.seq_q, x.heads, x.dim}));
    for (std::size_t t = 0; t < out.size(); ++t) EXPECT_NEAR(out[t], out_ref[t], 1e-5);
  }
}

// ---- DeBERTa -----------------------------------------------------------------------------------

TEST(Deberta, PlainSpanClipsRho) {
  const DebertaBuckets b{.max_relative_positions = 4};
  EXPECT_EQ(b.span(), 4);
  EXPECT_EQ(deberta_c2p_index(10, 10, b), 4);
  EXPECT_EQ(deberta_c2p_index(10, 7, b), 7);
  EXPECT_EQ(deberta_c2p_index(10, 2, b), 7);  // rho = 8 clamps to 2K - 1
  EXPECT_EQ(deberta_c2p_index(2, 10, b), 0);  // rho = -8 clamps to 0
  // Default (docs/deberta.md as amended): the checkpoints' index, rho + K, the same row as c2p.
  EXPECT_EQ(b.p2c, DebertaP2c::kModel);
  EXPECT_EQ(deberta_p2c_index(10, 7, b), 7);
  EXPECT_EQ(deberta_p2c_index(2, 10, b), 0);
  DebertaBuckets paper = b;
  paper.p2c = DebertaP2c::kPaper;
  EXPECT_EQ(deberta_p2c_index(10, 7, paper), 1);  // the paper's delta(j, i): -rho + K
  EXPECT_EQ(deberta_p2c_index(2, 10, paper), 7);
}

// docs/deberta.md: "they differ first at |rho| = 1643 for 512 buckets / 4096 positions (427 vs
// 428)".
TEST(Deberta, Float32AndFloat64LogBucketsDifferFirstAt1643) {
  DebertaBuckets f32{.max_relative_positions = 4096, .position_buckets = 512};
  DebertaBuckets f64 = f32;
  f64.float64_log = true;
  int64_t first = -1;
  for (int64_t r = 0; r <= 4096 && first < 0; ++r) {
    if (deberta_bucket(r, f32) != deberta_bucket(r, f64)) first = r;
  }
  EXPECT_EQ(first, 1643);
  EXPECT_EQ(deberta_bucket(1643, f32), 427);
  EXPECT_EQ(deberta_bucket(1643, f64), 428);
  EXPECT_EQ(deberta_bucket(-1643, f32), -427);
}

// Log buckets from the formula of docs/ in double: |rho| <= mid exact, odd symmetry, monotone, and
// saturation near max_relative_positions.
TEST(Deberta, LogBucketProperties) {
  DebertaBuckets b{.max_relative_positions = 512, .position_buckets = 256, .float64_log = true};
  const int64_t mid = 128;
  int64_t prev = 0;
  for (int64_t r = 0; r < 3000; ++r) {
    const int64_t v = deberta_bucket(r, b);
    EXPECT_EQ(deberta_bucket(-r, b), -v);
    if (r <= mid) {
      EXPECT_EQ(v, r);
    }
    EXPECT_GE(v, prev);
    prev = v;
    if (r > mid) {
      const double want =
          std::ceil(std::log(static_cast<double>(r) / mid) / std::log(511.0 / mid) * (mid - 1)) +
          mid;
      EXPECT_EQ(v, static_cast<int64_t>(want)) << r;
    }
  }
  EXPECT_EQ(deberta_bucket(511, b), 255);
}

// The released code computes p2c as gather(k . pos_query^T, index = clamp(-r_pos + K)) along the
// key axis and transposes. Emulated literally here; DebertaP2c::kModel equals it.
TEST(Deberta, ModelP2cEqualsGatherThenTranspose) {
  std::mt19937_64 rng(21);
  const int64_t len = 11, dim = 3, heads = 1;
  const DebertaBuckets b{
      .max_relative_positions = 20, .position_buckets = 6, .p2c = DebertaP2c::kModel};
  const int64_t kspan = b.span();
  const auto q = randn(rng, len * dim), k = randn(rng, len * dim);
  const auto pk = cases::randn_f(rng, 2 * kspan * dim), pq = cases::randn_f(rng, 2 * kspan * dim);
  std::vector<float> zeros(pk.size(), 0.0f);
  // Scores with pos_key = 0 isolate q.k + p2c.
  const DeBERTa deb{View<const float, 3>::contiguous(zeros.data(), {2 * kspan, heads, dim}),
                    View<const float, 3>::contiguous(pq.data(), {2 * kspan, heads, dim}), b};
  const auto s = ref::attention_scores(
      View<const double, 4>::contiguous(q.data(), {1, len, 1, dim}),
      View<const double, 4>::contiguous(k.data(), {1, len, 1, dim}), deb, {.scale = 1.0}, 0, 0);
  // p2c_att[a][r] = k_a . pos_query[r];  r_pos[a][c] = bucket(a - c);
  // g[a][c] = p2c_att[a][clamp(-r_pos[a][c] + K)];  term[i][j] = g[j][i].
  for (int64_t i = 0; i < len; ++i) {
    for (int64_t j = 0; j < len; ++j) {
      const int64_t a = j, c = i;
      const int64_t idx = std::clamp<int64_t>(-deberta_bucket(a - c, b) + kspan, 0, 2 * kspan - 1);
      double term = 0, qk = 0;
      for (int64_t d = 0; d < dim; ++d) {
        term += k[a * dim + d] * pq[idx * dim + d];
        qk += q[i * dim + d] * k[j * dim + d];
      }
      EXPECT_NEAR(s[i * len + j], qk + term, 1e-12) << i << "," << j;
    }
  }
}

TEST(Deberta, Validation) {
  EXPECT_THROW(validate(DebertaBuckets{.max_relative_positions = 0}), ValueError);
  EXPECT_THROW(validate(DebertaBuckets{.max_relative_positions = 100, .position_buckets = -1}),
               ValueError);
  EXPECT_THROW(validate(DebertaBuckets{.max_relative_positions = 10, .position_buckets = 64}),
               ValueError);
  EXPECT_NO_THROW(validate(DebertaBuckets{.max_relative_positions = 512, .position_buckets = 256}));
}

TEST(Deberta, DefaultScaleIsOneOverSqrt3D) {
  const int64_t dim = 12;
  std::vector<double> q(dim, 1.0), k(dim, 1.0);
  std::vector<float> zeros(2 * 2 * dim, 0.0f);
  const DeBERTa deb{View<const float, 3>::contiguous(zeros.data(), {4, 1, dim}),
                    View<const float, 3>::contiguous(zeros.data(), {4, 1, dim}),
                    {.max_relative_positions = 2}};
  const auto s = ref::attention_scores(View<const double, 4>::contiguous(q.data(), {1, 1, 1, dim}),
                                       View<const double, 4>::contiguous(k.data(), {1, 1, 1, dim}),
                                       deb, {}, 0, 0);
  EXPECT_NEAR(s[0], 12.0 / std::sqrt(36.0), 1e-14);
}

}  // namespace
