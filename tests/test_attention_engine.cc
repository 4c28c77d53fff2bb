// tests/test_attention_engine.cc - what engines feed attention: logit soft-capping
// (AttentionOptions::softcap), block masks (AttentionOptions::block_mask) and packed
// variable-length sequences (PackedSequences, attention_varlen).
//
//   1. Soft-capping in the float64 oracle against a materialized reference written here: the
//      uncapped scores of ref::attention_scores (scale, every positional term and bias), capped
//      as cap * tanh(s / cap), masked, softmax (sinks in the denominator), times v; for every
//      scheme without a value term.
//   2. The oracle's backward with soft-capping against central finite differences of
//      L = sum(dout * out), every scheme.
//   3. The fused float32 forward and backward and the simple path against the oracle (every
//      scheme, causal / window / sinks, prefill and decode shapes, every compiled SIMD target):
//      max |fast - ref| <= 2 max |naive - ref| + 1e-6 max(1, max |ref|).
//   4. The half-precision kernels with soft-capping equal the float32 path on the widened inputs
//      rounded once.
//   5. Validation: softcap <= 0, NaN, inf are errors naming the option.
//   6. Block masks (documents, prefix per row and per document, global tokens with windows, dense
//      masks, and their combinations with causal): the oracle equals the oracle under the same
//      visibility written here as a dense mask; the fused forward and backward and the simple
//      path against the oracle for every scheme on every compiled SIMD target; documents of
//      lengths around the key tiles (1, 63, 64, 65, several tiles, more than one block takes in
//      a run) with GQA, odd head_dim, causal / bidirectional / sinks; fully masked rows;
//      validation.
//   7. Varlen: the fused forward, lse and backward on random packings (lengths 1..L, empty
//      sequences) against ref::attention_varlen, the concatenation of each sequence's own oracle
//      (table gradients: the per-sequence gradients summed); long documents over many kv heads
//      give the same bits at every thread count; bf16 equals the widened float32 path;
//      cu_seqlens validation.
// Failures print the seed (POSENC_TEST_SEED replays it), shape, scheme and options.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attention_cases.h"
#include "attention_shapes.h"
#include "hwy/targets.h"
#include "kernels/bf16_dot.h"
#include "kernels/parallel.h"
#include "kernels/simd.h"
#include "posenc/posenc.h"
#include "test_util.h"

namespace {

using namespace posenc;
using namespace attn_test;
using posenc_test::Rng;

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string trace(const std::string& name, int variant, const Shape& s, const AttentionOptions& o) {
  return name + " variant " + std::to_string(variant) + " " + str(s) + " " + str(o) +
         (o.softcap ? " softcap " + std::to_string(*o.softcap) : std::string()) + " " +
         posenc_test::seed_trace();
}

// ---- 1. the oracle against a materialized softcapped softmax ---------------------------------

TEST(Softcap, OracleMatchesMaterializedReference) {
  const Shape s{2, 6, 11, 4, 2, 8};
  for (const auto& name : cases::kSchemes) {
    if (name == "shaw") continue;  // a value term: out is not softmax(S) v alone
    for (int variant = 0; variant < 2; ++variant) {
      Rng rng(posenc_test::test_seed(), 10 + variant);
      auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), variant);
      const PositionScheme& scheme = box->scheme;
      // Large inputs: scores well past the cap, where tanh bends.
      const auto q = randn<double>(rng, numel(qshape(s)), 3.0);
      const auto k = randn<double>(rng, numel(kshape(s)), 3.0);
      const auto v = randn<double>(rng, numel(kshape(s)));
      const std::vector<float> sinks = {0.5f, -1.0f, 2.0f, 0.0f};
      for (AttentionOptions opt :
           {AttentionOptions{.causal = true}, AttentionOptions{.window = 4}, AttentionOptions{}}) {
        for (const double cap : {2.0, 30.0}) {
          opt.softcap = cap;
          opt.sinks = variant == 1 ? View<const float, 1>::contiguous(sinks.data(), {4})
                                   : View<const float, 1>{};
          SCOPED_TRACE(trace(name, variant, s, opt));
          std::vector<double> out(q.size()), lse(numel(lshape(s)));
          ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, opt,
                         mview(out, qshape(s)), mview(lse, lshape(s)));
          AttentionOptions raw = opt;
          raw.softcap.reset();
          const auto o = mview(out, qshape(s));
          const auto l = mview(lse, lshape(s));
          const auto vv = cview(v, kshape(s));
          for (int64_t b = 0; b < s.batch; ++b) {
            for (int64_t h = 0; h < s.heads_q; ++h) {
              const auto sc = ref::attention_scores(cview(q, qshape(s)), cview(k, kshape(s)),
                                                    scheme, raw, b, h);
              for (int64_t i = 0; i < s.seq_q; ++i) {
                const int64_t pq = s.seq_k - s.seq_q + i;
                std::vector<double> w(static_cast<std::size_t>(s.seq_k), 0.0);
                double denom = opt.sinks.data ? std::exp(static_cast<double>(sinks[h])) : 0.0;
                for (int64_t j = 0; j < s.seq_k; ++j) {
                  const int64_t rel = j - pq;
                  if (opt.causal && rel > 0) continue;
                  if (opt.window && std::abs(rel) >= *opt.window) continue;
                  const double x = cap * std::tanh(sc[i * s.seq_k + j] / cap);
                  w[j] = std::exp(x);
                  denom += w[j];
                }
                EXPECT_NEAR(l(b, h, i), std::log(denom), 1e-12);
                for (int64_t c = 0; c < s.dim; ++c) {
                  double num = 0;
                  for (int64_t j = 0; j < s.seq_k; ++j) num += w[j] * vv(b, j, h / 2, c);
                  EXPECT_NEAR(o(b, i, h, c), num / denom, 1e-12) << "b " << b << " i " << i;
                }
              }
            }
          }
        }
      }
    }
  }
}

// ---- 2. the oracle's backward against finite differences -------------------------------------

TEST(Softcap, OracleBackwardMatchesFiniteDifferences) {
  const Shape s{1, 4, 6, 2, 1, 4};
  for (const auto& name : cases::kSchemes) {
    Rng rng(posenc_test::test_seed(), 20);
    auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 0);
    auto q = randn<double>(rng, numel(qshape(s)), 2.0);
    auto k = randn<double>(rng, numel(kshape(s)), 2.0);
    auto v = randn<double>(rng, numel(kshape(s)));
    const auto dout = randn<double>(rng, numel(qshape(s)));
    const AttentionOptions opt{.causal = true, .softcap = 1.5};
    SCOPED_TRACE(trace(name, 0, s, opt));
    auto loss = [&] {
      std::vector<double> out(q.size());
      ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), box->scheme,
                     opt, mview(out, qshape(s)));
      double l = 0;
      for (std::size_t i = 0; i < out.size(); ++i) l += dout[i] * out[i];
      return l;
    };
    std::vector<double> out(q.size()), lse(numel(lshape(s)));
    ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), box->scheme, opt,
                   mview(out, qshape(s)), mview(lse, lshape(s)));
    std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
    AttentionGradsOf<double> g;
    g.dq = mview(dq, qshape(s)), g.dk = mview(dk, kshape(s)), g.dv = mview(dv, kshape(s));
    ref::attention_backward(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)),
                            cview(out, qshape(s)), cview(lse, lshape(s)), cview(dout, qshape(s)),
                            box->scheme, opt, g);
    auto check = [&](const char* what, std::vector<double>& x, const std::vector<double>& an) {
      double amax = 0, err = 0;
      for (std::size_t n = 0; n < x.size(); ++n) {
        const double x0 = x[n], h = 1e-4;
        x[n] = x0 + h;
        const double up = loss();
        x[n] = x0 - h;
        const double dn = loss();
        x[n] = x0;
        err = std::max(err, std::abs((up - dn) / (2 * h) - an[n]));
        amax = std::max(amax, std::abs(an[n]));
      }
      EXPECT_LE(err, 1e-6 * std::max(1.0, amax)) << what;
      EXPECT_GT(amax, 0.0) << what;
    };
    check("dq", q, dq);
    check("dk", k, dk);
    check("dv", v, dv);
  }
}

// ---- 3. float32 paths against the oracle ------------------------------------------------------

struct F32Grads {
  std::vector<float> dq, dk, dv;
  AttentionGrads g;
};

// The fused forward (out, lse) and backward and the simple paths against the oracle, on random
// inputs of standard deviation sd (the tolerance rule of expect_tolerance).
void compare_paths(const PositionScheme& scheme, const Shape& s, const AttentionOptions& opt,
                   Rng& rng, double sd = 1.0) {
  const auto q = randn<float>(rng, numel(qshape(s)), sd),
             k = randn<float>(rng, numel(kshape(s)), sd);
  const auto v = randn<float>(rng, numel(kshape(s))), dout = randn<float>(rng, numel(qshape(s)));
  const auto qd = promote(q), kd = promote(k), vd = promote(v), doutd = promote(dout);
  std::vector<double> outd(q.size()), lsed(numel(lshape(s)));
  ref::attention(cview(qd, qshape(s)), cview(kd, kshape(s)), cview(vd, kshape(s)), scheme, opt,
                 mview(outd, qshape(s)), mview(lsed, lshape(s)));
  std::vector<float> out(q.size(), -5.0f), naive(q.size(), -5.0f), lse(lsed.size(), -5.0f);
  attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, opt,
            mview(out, qshape(s)), mview(lse, lshape(s)));
  attention_naive(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, opt,
                  mview(naive, qshape(s)));
  expect_tolerance("out", out, naive, outd);
  expect_lse(lse, lsed);
  std::vector<float> out32(outd.begin(), outd.end()), lse32(lsed.begin(), lsed.end());
  std::vector<double> dqd(q.size()), dkd(k.size()), dvd(v.size());
  AttentionGradsOf<double> gd;
  gd.dq = mview(dqd, qshape(s)), gd.dk = mview(dkd, kshape(s)), gd.dv = mview(dvd, kshape(s));
  ref::attention_backward(cview(qd, qshape(s)), cview(kd, kshape(s)), cview(vd, kshape(s)),
                          cview(outd, qshape(s)), cview(lsed, lshape(s)), cview(doutd, qshape(s)),
                          scheme, opt, gd);
  auto run32 = [&](auto fn) {
    auto r = std::make_unique<F32Grads>();
    r->dq.assign(q.size(), 7.0f), r->dk.assign(k.size(), 7.0f), r->dv.assign(v.size(), 7.0f);
    r->g.dq = mview(r->dq, qshape(s)), r->g.dk = mview(r->dk, kshape(s));
    r->g.dv = mview(r->dv, kshape(s));
    fn(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), cview(out32, qshape(s)),
       cview(lse32, lshape(s)), cview(dout, qshape(s)), scheme, opt, r->g, nullptr, nullptr);
    return r;
  };
  const auto fast = run32(&attention_backward);
  const auto slow = run32(&attention_backward_naive);
  expect_tolerance("dq", fast->dq, slow->dq, dqd);
  expect_tolerance("dk", fast->dk, slow->dk, dkd);
  expect_tolerance("dv", fast->dv, slow->dv, dvd);
}

void check_float32(const std::string& name, int variant, const Shape& s,
                   const AttentionOptions& opt, Rng& rng) {
  auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), variant);
  SCOPED_TRACE(trace(name, variant, s, opt));
  compare_paths(box->scheme, s, opt, rng, 2.0);
}

TEST(Softcap, Float32PathsMatchOracle) {
  Rng rng(posenc_test::test_seed(), 30);
  for (const Shape& s : {Shape{2, 9, 21, 4, 1, 8}, Shape{1, 70, 70, 4, 2, 16}}) {
    for (const auto& name : cases::kSchemes) {
      for (int variant = 0; variant < 2; ++variant) {
        check_float32(name, variant, s, {.causal = true, .softcap = 3.0}, rng);
        check_float32(name, variant, s, {.window = 5, .softcap = 50.0}, rng);
      }
    }
  }
}

// Decoding shapes (one or a few queries against many keys: the kernel's dot-product path), on
// every compiled SIMD target.
TEST(Softcap, DecodeOnEveryTarget) {
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    kernels::set_simd_target_for_test(target);
    Rng rng(posenc_test::test_seed(), 40);
    for (const auto& name : cases::kSchemes) {
      check_float32(name, 0, Shape{2, 1, 300, 8, 2, 16}, {.causal = true, .softcap = 4.0}, rng);
      check_float32(name, 1, Shape{1, 3, 131, 4, 4, 8}, {.softcap = 2.5}, rng);
    }
  }
  kernels::set_simd_target_for_test(0);
}

// ---- 4. half precision ------------------------------------------------------------------------

TEST(Softcap, HalfKernelsEqualWidenedFloat32) {
  Rng rng(posenc_test::test_seed(), 50);
  const Shape s{2, 5, 140, 4, 2, 16};
  for (const auto& name : cases::kSchemes) {
    auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 0);
    const AttentionOptions opt{.causal = true, .softcap = 3.0};
    SCOPED_TRACE(trace(name, 0, s, opt));
    const auto qf = randn<float>(rng, numel(qshape(s)), 2.0);
    const auto kf = randn<float>(rng, numel(kshape(s)), 2.0);
    const auto vf = randn<float>(rng, numel(kshape(s)));
    std::vector<bf16> q(qf.size()), k(kf.size()), v(vf.size());
    for (std::size_t i = 0; i < qf.size(); ++i) q[i] = bf16_from_float(qf[i]);
    for (std::size_t i = 0; i < kf.size(); ++i)
      k[i] = bf16_from_float(kf[i]), v[i] = bf16_from_float(vf[i]);
    std::vector<float> qw(q.size()), kw(k.size()), vw(v.size());
    for (std::size_t i = 0; i < q.size(); ++i) qw[i] = to_float(q[i]);
    for (std::size_t i = 0; i < k.size(); ++i) kw[i] = to_float(k[i]);
    for (std::size_t i = 0; i < v.size(); ++i) vw[i] = to_float(v[i]);
    std::vector<float> want(q.size());
    attention(cview(qw, qshape(s)), cview(kw, kshape(s)), cview(vw, kshape(s)), box->scheme, opt,
              mview(want, qshape(s)));
    std::vector<bf16> got(q.size());
    attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), box->scheme, opt,
              mview(got, qshape(s)));
    for (std::size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i].bits, bf16_from_float(want[i]).bits) << "element " << i;
    }
    // float32 q with a bf16 cache.
    std::vector<float> mixed(q.size());
    attention(cview(qw, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), box->scheme, opt,
              mview(mixed, qshape(s)));
    for (std::size_t i = 0; i < mixed.size(); ++i) ASSERT_EQ(mixed[i], want[i]) << "element " << i;
  }
}

// ---- 5. validation ----------------------------------------------------------------------------

TEST(Softcap, InvalidValuesAreErrors) {
  const Shape s{1, 2, 2, 1, 1, 4};
  std::vector<float> q(numel(qshape(s)), 0.5f), out(q.size());
  for (const double bad : {0.0, -1.0, std::nan(""), kInf}) {
    try {
      attention(cview(q, qshape(s)), cview(q, kshape(s)), cview(q, kshape(s)), NoPositions{},
                {.softcap = bad}, mview(out, qshape(s)));
      ADD_FAILURE() << "softcap " << bad << " accepted";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("softcap"), std::string::npos) << e.what();
    }
  }
}

}  // namespace

namespace {

// ---- 6. block masks ---------------------------------------------------------------------------

// A random block mask for batch rows of seq_q queries and seq_k keys (default positions: key j at
// j, query i at seq_k - seq_q + i), with the owned arrays its views point into.
struct MaskCase {
  std::vector<int32_t> qdoc, kdoc;
  std::vector<int64_t> prefix;
  std::vector<uint8_t> dense;
  BlockMask mask;
};

// kind bits: 1 documents, 2 prefix, 4 global tokens, 8 dense.
std::unique_ptr<MaskCase> make_mask(const Shape& s, int kind, Rng& rng) {
  auto m = std::make_unique<MaskCase>();
  const int64_t B = s.batch, Lq = s.seq_q, Lk = s.seq_k;
  if (kind & 1) {
    // Documents as runs over key positions; queries take the document of their position.
    m->kdoc.resize(static_cast<std::size_t>(B * Lk));
    m->qdoc.resize(static_cast<std::size_t>(B * Lq));
    for (int64_t b = 0; b < B; ++b) {
      int32_t doc = 0;
      for (int64_t j = 0; j < Lk; ++j) {
        if (j > 0 && rng.integer(0, 9) == 0) ++doc;
        m->kdoc[b * Lk + j] = doc;
      }
      for (int64_t i = 0; i < Lq; ++i) m->qdoc[b * Lq + i] = m->kdoc[b * Lk + (Lk - Lq + i)];
    }
    m->mask.query_documents = View<const int32_t, 2>::contiguous(m->qdoc.data(), {B, Lq});
    m->mask.key_documents = View<const int32_t, 2>::contiguous(m->kdoc.data(), {B, Lk});
  }
  if (kind & 2) {
    const int64_t n = (kind & 1) ? 1 + *std::max_element(m->kdoc.begin(), m->kdoc.end()) : B;
    for (int64_t x = 0; x < n; ++x) m->prefix.push_back(rng.integer(0, Lk / 2));
    m->mask.prefix = View<const int64_t, 1>::contiguous(m->prefix.data(), {n});
  }
  if (kind & 4) m->mask.global_positions = {0, Lk / 3, Lk - 1, Lk + 5};
  if (kind & 8) {
    m->dense.resize(static_cast<std::size_t>(B * Lq * Lk));
    for (auto& x : m->dense) x = rng.integer(0, 3) != 0;
    m->mask.dense = View<const uint8_t, 3>::contiguous(m->dense.data(), {B, Lq, Lk});
  }
  return m;
}

// The visibility of query i and key j written here from the documented rule.
bool sees(const MaskCase& m, const AttentionOptions& o, const Shape& s, int64_t b, int64_t i,
          int64_t j) {
  const int64_t pq = s.seq_k - s.seq_q + i, pk = j, rel = pk - pq;
  if (!m.qdoc.empty() && m.qdoc[b * s.seq_q + i] != m.kdoc[b * s.seq_k + j]) return false;
  if (!m.dense.empty() && m.dense[(b * s.seq_q + i) * s.seq_k + j] == 0) return false;
  const auto& g = m.mask.global_positions;
  if (std::find(g.begin(), g.end(), pq) != g.end() ||
      std::find(g.begin(), g.end(), pk) != g.end()) {
    return true;
  }
  if (!m.prefix.empty()) {
    const int64_t at = m.qdoc.empty() ? b : m.kdoc[b * s.seq_k + j];
    if (pk < m.prefix[at]) return true;
  }
  if (o.causal && rel > 0) return false;
  if (o.window && std::abs(rel) >= *o.window) return false;
  return true;
}

std::string kind_name(int kind) {
  std::string n;
  if (kind & 1) n += "documents ";
  if (kind & 2) n += "prefix ";
  if (kind & 4) n += "global ";
  if (kind & 8) n += "dense ";
  return n;
}

TEST(BlockMask, OracleEqualsTheRuleAsADenseMask) {
  const Shape s{2, 9, 23, 4, 2, 8};
  Rng rng(posenc_test::test_seed(), 60);
  for (const auto& name : cases::kSchemes) {
    auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 0);
    const auto q = randn<double>(rng, numel(qshape(s))), k = randn<double>(rng, numel(kshape(s)));
    const auto v = randn<double>(rng, numel(kshape(s)));
    for (int kind = 1; kind < 16; ++kind) {
      for (AttentionOptions base :
           {AttentionOptions{.causal = true}, AttentionOptions{.window = 4}, AttentionOptions{}}) {
        base.allow_fully_masked = true;
        // T5's bucketing follows `causal` unless set: the same buckets for both runs below.
        if (auto* t5 = std::get_if<T5Bias>(&box->scheme)) t5->bidirectional = !base.causal;
        const auto m = make_mask(s, kind, rng);
        AttentionOptions opt = base;
        opt.block_mask = m->mask;
        SCOPED_TRACE(trace(name, 0, s, opt) + " " + kind_name(kind));
        std::vector<uint8_t> dense(static_cast<std::size_t>(s.batch * s.seq_q * s.seq_k));
        for (int64_t b = 0; b < s.batch; ++b)
          for (int64_t i = 0; i < s.seq_q; ++i)
            for (int64_t j = 0; j < s.seq_k; ++j) {
              dense[(b * s.seq_q + i) * s.seq_k + j] = sees(*m, base, s, b, i, j);
            }
        AttentionOptions plain{.allow_fully_masked = true};
        plain.block_mask.dense =
            View<const uint8_t, 3>::contiguous(dense.data(), {s.batch, s.seq_q, s.seq_k});
        std::vector<double> out(q.size()), want(q.size()), lse(numel(lshape(s))),
            lse_want(lse.size());
        ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), box->scheme,
                       opt, mview(out, qshape(s)), mview(lse, lshape(s)));
        ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), box->scheme,
                       plain, mview(want, qshape(s)), mview(lse_want, lshape(s)));
        ASSERT_EQ(out, want);
        ASSERT_EQ(lse, lse_want);
      }
    }
  }
}

void check_block_mask_float32(const std::string& name, const Shape& s, int kind,
                              AttentionOptions opt, Rng& rng) {
  auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 1);
  const auto m = make_mask(s, kind, rng);
  opt.block_mask = m->mask;
  opt.allow_fully_masked = true;
  SCOPED_TRACE(trace(name, 1, s, opt) + " " + kind_name(kind));
  compare_paths(box->scheme, s, opt, rng);
}

TEST(BlockMask, Float32PathsMatchOracle) {
  Rng rng(posenc_test::test_seed(), 70);
  for (const Shape& s : {Shape{2, 70, 150, 4, 2, 16}, Shape{1, 130, 130, 2, 1, 8}}) {
    for (const auto& name : cases::kSchemes) {
      for (int kind : {1, 2, 3, 4, 5, 8, 15}) {
        check_block_mask_float32(name, s, kind, {.causal = true}, rng);
        check_block_mask_float32(name, s, kind, {.window = 9}, rng);
      }
      check_block_mask_float32(name, s, 6, {}, rng);
    }
  }
}

TEST(BlockMask, EveryTargetAndDecode) {
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    kernels::set_simd_target_for_test(target);
    Rng rng(posenc_test::test_seed(), 80);
    for (const auto& name : cases::kSchemes) {
      check_block_mask_float32(name, Shape{1, 67, 140, 2, 1, 8}, 15, {.causal = true}, rng);
      check_block_mask_float32(name, Shape{2, 1, 200, 4, 2, 16}, 7, {.window = 50}, rng);
    }
  }
  kernels::set_simd_target_for_test(0);
}

// Documents of chosen lengths in one row: a document within one key tile, on a tile boundary,
// one past it, over several tiles (whose query blocks see all of them in one run: their scores
// first, then one softmax and one P . V written straight to the output where the rows allow it)
// and longer than such a run; GQA with query rows read in place (head_dim a whole number of
// vectors) or padded (odd head_dim); causal, bidirectional and with sinks; every SIMD target
// (every scheme on the best one).
void check_document_lengths(const std::string& name, const std::vector<int64_t>& lengths,
                            int64_t dim, Rng& rng) {
  std::vector<int32_t> docs;
  for (std::size_t d = 0; d < lengths.size(); ++d) {
    docs.insert(docs.end(), static_cast<std::size_t>(lengths[d]), static_cast<int32_t>(d));
  }
  const int64_t L = static_cast<int64_t>(docs.size());
  const std::vector<float> sinks = {0.5f, -1.0f, 1.5f, 0.25f};
  const Shape s{1, L, L, 4, 2, dim};
  auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 0);
  for (int variant = 0; variant < 3; ++variant) {
    AttentionOptions opt{.causal = variant != 1};
    if (variant == 2) opt.sinks = View<const float, 1>::contiguous(sinks.data(), {4});
    opt.block_mask.query_documents = View<const int32_t, 2>::contiguous(docs.data(), {1, L});
    opt.block_mask.key_documents = opt.block_mask.query_documents;
    if (auto* t5 = std::get_if<T5Bias>(&box->scheme)) t5->bidirectional = !opt.causal;
    SCOPED_TRACE(trace(name, variant, s, opt));
    compare_paths(box->scheme, s, opt, rng);
  }
}

TEST(BlockMask, DocumentLengthsAroundTilesEveryTarget) {
  const std::vector<int64_t> lengths = {1, 63, 64, 65, 128, 200, 9, 131};
  const auto targets = hwy::SupportedAndGeneratedTargets();
  for (const int64_t target : targets) {
    SCOPED_TRACE(hwy::TargetName(target));
    kernels::set_simd_target_for_test(target);
    Rng rng(posenc_test::test_seed(), 85);
    for (const auto& name : cases::kSchemes) {
      if (target != targets.front() && name != "none" && name != "rope") continue;
      for (const int64_t dim : {32, 13}) {
        // Sanitized: the odd (padded) head dim for two schemes, the in-place one for all.
        if (posenc_test::kSanitized && dim == 13 && name != "none" && name != "t5") continue;
        check_document_lengths(name, lengths, dim, rng);
      }
    }
  }
  kernels::set_simd_target_for_test(0);
  // A document longer than the tiles one block takes in a single run.
  Rng rng(posenc_test::test_seed(), 86);
  check_document_lengths("none", {70, 600, 5}, 16, rng);
}

TEST(BlockMask, FullyMaskedRows) {
  const Shape s{1, 3, 5, 1, 1, 4};
  Rng rng(posenc_test::test_seed(), 90);
  const auto q = randn<float>(rng, numel(qshape(s))), k = randn<float>(rng, numel(kshape(s)));
  std::vector<uint8_t> dense(15, 1);
  for (int j = 0; j < 5; ++j) dense[5 + j] = 0;  // query 1 sees nothing
  AttentionOptions opt;
  opt.block_mask.dense = View<const uint8_t, 3>::contiguous(dense.data(), {1, 3, 5});
  std::vector<float> out(q.size()), lse(3);
  try {
    attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(k, kshape(s)), NoPositions{}, opt,
              mview(out, qshape(s)));
    ADD_FAILURE() << "a fully masked row was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("query 1 "), std::string::npos) << e.what();
  }
  opt.allow_fully_masked = true;
  attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(k, kshape(s)), NoPositions{}, opt,
            mview(out, qshape(s)), mview(lse, std::array<int64_t, 3>{1, 1, 3}));
  for (int c = 0; c < 4; ++c) EXPECT_EQ(out[4 + c], 0.0f);
  EXPECT_EQ(lse[1], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isfinite(lse[0]) && std::isfinite(lse[2]));
}

TEST(BlockMask, Validation) {
  const Shape s{2, 3, 5, 1, 1, 4};
  std::vector<float> q(numel(qshape(s)), 0.5f), k(numel(kshape(s)), 0.5f), out(q.size());
  std::vector<int32_t> qd(6, 0), kd(10, 0);
  std::vector<int64_t> prefix = {1, -2};
  std::vector<uint8_t> dense(30, 1);
  auto expect_error = [&](const AttentionOptions& o, const std::string& what) {
    try {
      attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(k, kshape(s)), NoPositions{}, o,
                mview(out, qshape(s)));
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  AttentionOptions o;
  o.block_mask.query_documents = View<const int32_t, 2>::contiguous(qd.data(), {2, 3});
  expect_error(o, "key_documents");
  o.block_mask.key_documents = View<const int32_t, 2>::contiguous(kd.data(), {2, 4});
  expect_error(o, "key_documents");
  o = {};
  o.block_mask.prefix = View<const int64_t, 1>::contiguous(prefix.data(), {2});
  expect_error(o, "prefix[1] is negative");
  o.block_mask.prefix = View<const int64_t, 1>::contiguous(prefix.data(), {1});
  expect_error(o, "expected batch");
  o = {};
  o.block_mask.query_documents = View<const int32_t, 2>::contiguous(qd.data(), {2, 3});
  o.block_mask.key_documents = View<const int32_t, 2>::contiguous(kd.data(), {2, 5});
  kd[3] = 4;
  o.block_mask.prefix = View<const int64_t, 1>::contiguous(prefix.data(), {1});
  expect_error(o, "document 4");
  o = {};
  o.block_mask.dense = View<const uint8_t, 3>::contiguous(dense.data(), {2, 5, 3});
  expect_error(o, "dense has shape");
}

// ---- 7. varlen --------------------------------------------------------------------------------

struct Packing {
  std::vector<int64_t> cu_q{0}, cu_k{0};
};

// num_seqs sequences of 1..max_len keys (one empty when `empty`), queries len_k - r for a random
// r (decode-like tails) or len_k.
Packing random_packing(Rng& rng, int n, int64_t max_len, bool empty, bool prefill) {
  Packing p;
  for (int s = 0; s < n; ++s) {
    int64_t lk = rng.integer(1, max_len);
    int64_t lq = prefill ? lk : rng.integer(1, lk);
    if (empty && s == n / 2) lq = 0, lk = rng.integer(0, 3);
    p.cu_q.push_back(p.cu_q.back() + lq);
    p.cu_k.push_back(p.cu_k.back() + lk);
  }
  return p;
}

void check_varlen(const std::string& name, const Packing& pk, int64_t hq, int64_t hkv, int64_t dim,
                  AttentionOptions opt, Rng& rng) {
  auto box = cases::make_scheme(name, hq, dim, rng.engine(), 0);
  const PositionScheme& scheme = box->scheme;
  const int64_t tq = pk.cu_q.back(), tk = pk.cu_k.back();
  const PackedSequences packed = pack_sequences(pk.cu_q, pk.cu_k, tq, tk);
  const std::array<int64_t, 3> qs{tq, hq, dim}, ks{tk, hkv, dim};
  const std::array<int64_t, 2> ls{hq, tq};
  const auto q = randn<float>(rng, numel(qs)), k = randn<float>(rng, numel(ks));
  const auto v = randn<float>(rng, numel(ks)), dout = randn<float>(rng, numel(qs));
  const auto qd = promote(q), kd = promote(k), vd = promote(v), doutd = promote(dout);
  std::string lens;
  for (std::size_t s = 1; s < pk.cu_q.size(); ++s) {
    lens += std::to_string(pk.cu_q[s] - pk.cu_q[s - 1]) + "/" +
            std::to_string(pk.cu_k[s] - pk.cu_k[s - 1]) + " ";
  }
  SCOPED_TRACE(name + " Hq" + std::to_string(hq) + " Hkv" + std::to_string(hkv) + " D" +
               std::to_string(dim) + " " + str(opt) + " lengths q/k " + lens +
               posenc_test::seed_trace());
  // The oracle: each sequence alone.
  std::vector<double> outd(q.size()), lsed(numel(ls));
  ref::attention_varlen(cview(qd, qs), cview(kd, ks), cview(vd, ks), packed, scheme, opt, {},
                        mview(outd, qs), mview(lsed, ls));
  std::vector<float> out(q.size(), -5.0f), lse(lsed.size(), -5.0f), naive(q.size(), -5.0f);
  attention_varlen(cview(q, qs), cview(k, ks), cview(v, ks), packed, scheme, opt, mview(out, qs),
                   mview(lse, ls));
  const AttentionOptions popt = packed.options(opt);
  attention_naive(as_batch(cview(q, qs)), as_batch(cview(k, ks)), as_batch(cview(v, ks)), scheme,
                  popt, as_batch(mview(naive, qs)), &packed.query_positions, &packed.key_positions);
  expect_tolerance("out", out, naive, outd);
  expect_lse(lse, lsed);
  // Gradients: the per-sequence oracle's, table gradients summed over the sequences.
  std::vector<double> dqd(q.size(), 0.0), dkd(k.size(), 0.0), dvd(v.size(), 0.0);
  const auto* t5 = std::get_if<T5Bias>(&scheme);
  std::vector<double> dtable(t5 ? numel(t5->table.shape) : 0, 0.0);
  for (std::size_t s = 0; s + 1 < pk.cu_q.size(); ++s) {
    const int64_t q0 = pk.cu_q[s], lq = pk.cu_q[s + 1] - q0;
    const int64_t k0 = pk.cu_k[s], lk = pk.cu_k[s + 1] - k0;
    if (lq == 0 || lk == 0) continue;
    auto sub = [](auto x, int64_t at, int64_t len) {
      x.data += at * x.stride[0];
      x.shape[0] = len;
      return as_batch(x);
    };
    std::vector<double> dt(dtable.size());
    AttentionGradsOf<double> g;
    g.dq = sub(mview(dqd, qs), q0, lq), g.dk = sub(mview(dkd, ks), k0, lk);
    g.dv = sub(mview(dvd, ks), k0, lk);
    if (t5) g.drelative_attention_bias = mview(dt, t5->table.shape);
    std::vector<double> lse_s(static_cast<std::size_t>(hq * lq));
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < lq; ++i) lse_s[h * lq + i] = lsed[h * tq + q0 + i];
    ref::attention_backward(sub(cview(qd, qs), q0, lq), sub(cview(kd, ks), k0, lk),
                            sub(cview(vd, ks), k0, lk), sub(cview(outd, qs), q0, lq),
                            cview(lse_s, std::array<int64_t, 3>{1, hq, lq}),
                            sub(cview(doutd, qs), q0, lq), scheme, opt, g);
    for (std::size_t x = 0; x < dt.size(); ++x) dtable[x] += dt[x];
  }
  std::vector<float> out32(outd.begin(), outd.end()), lse32(lsed.begin(), lsed.end());
  auto run32 = [&](auto fn, std::vector<float>& dq, std::vector<float>& dk, std::vector<float>& dv,
                   std::vector<float>& dt) {
    dq.assign(q.size(), 7.0f), dk.assign(k.size(), 7.0f), dv.assign(v.size(), 7.0f);
    dt.assign(dtable.size(), 7.0f);
    AttentionGrads g;
    g.dq = as_batch(mview(dq, qs)), g.dk = as_batch(mview(dk, ks)), g.dv = as_batch(mview(dv, ks));
    if (t5) g.drelative_attention_bias = mview(dt, t5->table.shape);
    fn(as_batch(cview(q, qs)), as_batch(cview(k, ks)), as_batch(cview(v, ks)),
       as_batch(cview(out32, qs)),
       View<const float, 3>::contiguous(lse32.data(), std::array<int64_t, 3>{1, hq, tq}),
       as_batch(cview(dout, qs)), scheme, popt, g, &packed.query_positions, &packed.key_positions);
  };
  std::vector<float> dq, dk, dv, dt, ndq, ndk, ndv, ndt;
  run32(&attention_backward, dq, dk, dv, dt);
  run32(&attention_backward_naive, ndq, ndk, ndv, ndt);
  expect_tolerance("dq", dq, ndq, dqd);
  expect_tolerance("dk", dk, ndk, dkd);
  expect_tolerance("dv", dv, ndv, dvd);
  if (t5) expect_tolerance("drelative_attention_bias", dt, ndt, dtable);
}

TEST(Varlen, FusedMatchesPerSequenceOracle) {
  Rng rng(posenc_test::test_seed(), 100);
  for (const auto& name : cases::kSchemes) {
    for (int rep = 0; rep < 2; ++rep) {
      const Packing pk = random_packing(rng, 5, rep == 0 ? 40 : 150, rep == 0, rep == 1);
      check_varlen(name, pk, 4, 2, 16, {.causal = true, .allow_fully_masked = true}, rng);
      check_varlen(name, pk, 2, 2, 8, {.window = 7, .allow_fully_masked = true}, rng);
    }
    check_varlen(name, random_packing(rng, 16, 3, false, true), 4, 1, 8, {.causal = true}, rng);
    // Sinks and soft-capping; an empty sequence's queries see only the sink.
    const std::vector<float> sinks = {0.5f, -1.0f, 1.5f, 0.25f};
    AttentionOptions o{.causal = true, .softcap = 5.0};
    o.sinks = View<const float, 1>::contiguous(sinks.data(), {4});
    Packing pk = random_packing(rng, 4, 70, false, false);
    pk.cu_q.push_back(pk.cu_q.back() + 2);
    pk.cu_k.push_back(pk.cu_k.back());
    check_varlen(name, pk, 4, 2, 16, o, rng);
  }
}

// Long documents (several query blocks and key tiles each, boundaries inside tiles), many kv heads
// (a work unit runs a document for a run of heads, split when there are few documents), GQA with
// padded row slots or with query rows read in place, an odd head_dim (the key-tile transpose's
// remainders) and causal diagonal tiles (only the columns a row can see are computed): the
// oracle, and the same bits at every thread count.
TEST(Varlen, LongDocumentsManyHeadsEveryThreadCount) {
  Rng rng(posenc_test::test_seed(), 105);
  struct Heads {
    int64_t hq, hkv;
  };
  for (const Heads hh : {Heads{8, 8}, Heads{6, 2}, Heads{8, 4}}) {
    for (const auto& name : cases::kSchemes) {
      const Packing pk = random_packing(rng, 4, 300, false, true);
      check_varlen(name, pk, hh.hq, hh.hkv, 13, {.causal = true}, rng);
      auto box = cases::make_scheme(name, hh.hq, 13, rng.engine(), 0);
      const int64_t tq = pk.cu_q.back(), tk = pk.cu_k.back();
      const PackedSequences packed = pack_sequences(pk.cu_q, pk.cu_k, tq, tk);
      const std::array<int64_t, 3> qs{tq, hh.hq, 13}, ks{tk, hh.hkv, 13};
      const auto q = randn<float>(rng, numel(qs)), k = randn<float>(rng, numel(ks));
      const auto v = randn<float>(rng, numel(ks));
      std::vector<float> first;
      for (const int threads : {1, 2, 3, 5}) {
        if (posenc_test::kSanitized && (threads == 2 || threads == 5)) continue;
        SCOPED_TRACE(name + " threads " + std::to_string(threads) + posenc_test::seed_trace());
        std::vector<float> out(q.size(), -5.0f);
        attention_varlen(cview(q, qs), cview(k, ks), cview(v, ks), packed, box->scheme,
                         {.causal = true, .num_threads = threads}, mview(out, qs));
        if (first.empty()) {
          first = out;
          continue;
        }
        for (std::size_t i = 0; i < out.size(); ++i) {
          ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(first[i]))
              << "element " << i;
        }
      }
    }
  }
}

// The document segments' scheduler: every item runs exactly once, and the item a call names as
// its thread's next is the one that thread runs next (-1 after its last), in increasing order.
TEST(Varlen, ParallelForAheadNamesEachThreadsNextItem) {
  for (const int64_t n : {0, 1, 2, 3, 7, 64, 257}) {
    for (const int threads : {1, 2, 3, 4}) {
      SCOPED_TRACE("n " + std::to_string(n) + " threads " + std::to_string(threads));
      std::mutex mu;
      std::vector<int> runs(static_cast<size_t>(n), 0);
      // Per OpenMP thread: the (item, next) pairs it ran, in order.
      std::vector<std::vector<std::pair<int64_t, int64_t>>> seen(kMaxThreads);
      kernels::parallel_for_ahead(n, threads, [&](int64_t i, int64_t next) {
        std::lock_guard<std::mutex> lock(mu);
        ASSERT_GE(i, 0);
        ASSERT_LT(i, n);
        ++runs[static_cast<size_t>(i)];
        seen[static_cast<size_t>(kernels::thread_index())].emplace_back(i, next);
      });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(runs[static_cast<size_t>(i)], 1) << "item " << i;
      for (const auto& calls : seen) {
        for (size_t c = 0; c < calls.size(); ++c) {
          const int64_t expect = c + 1 < calls.size() ? calls[c + 1].first : -1;
          EXPECT_EQ(calls[c].second, expect) << "call " << c << " of item " << calls[c].first;
          if (c > 0) {
            EXPECT_GT(calls[c].first, calls[c - 1].first);
          }
        }
      }
    }
  }
}

TEST(Varlen, HalfEqualsWidenedFloat32) {
  // The widening kernel (bit-identical to float32 on widened inputs): not the vdpbf16ps score
  // tiles of a processor with AVX512_BF16, whose sums are ordered by pairs
  // (tests/test_bf16_dot.cc).
  kernels::set_bf16_dot_for_test(0);
  struct Restore {
    ~Restore() { kernels::set_bf16_dot_for_test(-1); }
  } restore;
  Rng rng(posenc_test::test_seed(), 110);
  const Packing pk = random_packing(rng, 6, 90, false, true);
  const int64_t tq = pk.cu_q.back(), tk = pk.cu_k.back(), hq = 4, hkv = 2, dim = 16;
  const PackedSequences packed = pack_sequences(pk.cu_q, pk.cu_k, tq, tk);
  const std::array<int64_t, 3> qs{tq, hq, dim}, ks{tk, hkv, dim};
  for (const auto& name : cases::kSchemes) {
    auto box = cases::make_scheme(name, hq, dim, rng.engine(), 0);
    SCOPED_TRACE(name);
    const auto qf = randn<float>(rng, numel(qs)), kf = randn<float>(rng, numel(ks));
    const auto vf = randn<float>(rng, numel(ks));
    std::vector<bf16> q(qf.size()), k(kf.size()), v(vf.size());
    std::vector<float> qw(q.size()), kw(k.size()), vw(v.size());
    for (std::size_t i = 0; i < q.size(); ++i)
      q[i] = bf16_from_float(qf[i]), qw[i] = to_float(q[i]);
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = bf16_from_float(kf[i]), kw[i] = to_float(k[i]);
      v[i] = bf16_from_float(vf[i]), vw[i] = to_float(v[i]);
    }
    const AttentionOptions opt = packed.options({.causal = true});
    std::vector<float> want(q.size());
    attention_varlen(cview(qw, qs), cview(kw, ks), cview(vw, ks), packed, box->scheme,
                     {.causal = true}, mview(want, qs));
    std::vector<bf16> got(q.size());
    attention(as_batch(cview(q, qs)), as_batch(cview(k, ks)), as_batch(cview(v, ks)), box->scheme,
              opt, as_batch(mview(got, qs)), &packed.query_positions, &packed.key_positions);
    for (std::size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i].bits, bf16_from_float(want[i]).bits) << "element " << i;
    }
  }
}

TEST(Varlen, Validation) {
  auto expect_error = [](const std::vector<int64_t>& cq, const std::vector<int64_t>& ck, int64_t tq,
                         int64_t tk, const std::string& what) {
    try {
      (void)pack_sequences(cq, ck, tq, tk);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error({1, 3}, {0, 3}, 3, 3, "cu_seqlens_q[0] must be 0");
  expect_error({0, 3, 2}, {0, 3, 4}, 2, 4, "non-decreasing");
  expect_error({0, 3}, {0, 3}, 4, 3, "cu_seqlens_q ends at 3");
  expect_error({0, 3}, {0, 1, 3}, 3, 3, "both need num_seqs + 1");
  expect_error({}, {}, 0, 0, "cu_seqlens_q is empty");
  expect_error({0, 5}, {0, 3}, 5, 3, "pass query_positions");
  // Queries without keys: fully masked rows, an error unless allowed.
  const PackedSequences p = pack_sequences({0, 2, 3}, {0, 0, 4}, 3, 4);
  std::vector<float> q(3 * 4, 0.5f), k(4 * 4, 0.5f), out(q.size());
  const std::array<int64_t, 3> qs{3, 1, 4}, ks{4, 1, 4};
  EXPECT_THROW(attention_varlen(cview(q, qs), cview(k, ks), cview(k, ks), p, NoPositions{}, {},
                                mview(out, qs)),
               ValueError);
  attention_varlen(cview(q, qs), cview(k, ks), cview(k, ks), p, NoPositions{},
                   {.allow_fully_masked = true}, mview(out, qs));
  for (int c = 0; c < 8; ++c) EXPECT_EQ(out[c], 0.0f);
  EXPECT_EQ(out[8], 0.5f);
}

}  // namespace
