// tests/test_attention_sinks.cc - attention sinks (gpt-oss) and chunked local attention
// (Llama 4): AttentionOptions::sinks, AttentionOptions::chunk, AttentionGradsOf::dsinks.
//
//   1. The float64 oracle's forward against formulas written here: the softmax with the sink as
//      an extra denominator entry over ref::attention_scores under a mask written here (chunk
//      included), for every scheme without a value term; the exact identities linking attention
//      with and without sinks (lse_s = log(exp(lse) + exp(sink)), out_s = out (1 -
//      exp(sink - lse_s))) for every scheme.
//   2. The oracle's backward (dq, dk, dv, dsinks and every scheme parameter) against 5-point
//      central finite differences of L = sum(dout * out) computed with ref::attention, with
//      sinks, with chunks (causal, windowed, bidirectional) and with both, for every scheme.
//   3. The float32 paths (attention / attention_backward, attention_naive /
//      attention_backward_naive) against the oracle: max |fast - ref| <= 2 max |naive - ref| +
//      1e-6 max(1, max |ref|) per tensor (STYLE.md), and the naive path within 1e-4 max(1,
//      max |ref|) of the oracle.
//   4. Rows that see no key: with sinks out = 0, lse = sink, zero dq and no error; without sinks
//      a chunk that hides every key is an error unless allowed.
//   5. Chunked attention equals, chunk by chunk, the attention over that chunk's keys alone
//      (positions kept global), with causal masks and windows.
//   6. Validation messages name the argument.
// Every failure prints the seed (POSENC_TEST_SEED replays it), the shape, scheme and options.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attention_cases.h"
#include "attention_shapes.h"
#include "posenc/posenc.h"
#include "test_util.h"

namespace {

using namespace posenc;
using posenc_test::Rng;

constexpr double kInf = std::numeric_limits<double>::infinity();

using namespace attn_test;

// Multiples of 2^-12 below 4 in magnitude: x +- 2^-8 and x +- 2^-7 are exact in float32, so the
// float32 parameter tables can be perturbed for finite differences.
void quantize(std::vector<float>& v) {
  for (auto& x : v) {
    x = static_cast<float>(
        std::clamp(std::round(static_cast<double>(x) * 4096.0), -16000.0, 16000.0) / 4096.0);
  }
}

// The mask, written independently of the library (floor division for the chunk index).
int64_t chunk_of(int64_t pos, int64_t c) {
  return static_cast<int64_t>(std::floor(static_cast<double>(pos) / static_cast<double>(c)));
}
bool visible(const AttentionOptions& o, int64_t pos_q, int64_t pos_k) {
  const int64_t rel = pos_k - pos_q;
  if (o.causal && rel > 0) return false;
  if (o.window && std::abs(rel) >= *o.window) return false;
  if (o.chunk && chunk_of(pos_k, *o.chunk) != chunk_of(pos_q, *o.chunk)) return false;
  return true;
}

// A scheme with quantized float32 tables (and explicit ALiBi slopes) whose entries a finite
// difference can perturb: `tables` lists each learned parameter's storage with its gradient name.
struct Box {
  std::unique_ptr<cases::SchemeBox> box;
  std::vector<std::pair<std::string, std::vector<float>*>> tables;
  std::vector<std::pair<std::string, std::vector<double>*>> tables64;  // ALiBi slopes
};

Box make_box(const std::string& name, int64_t heads, int64_t dim, Rng& rng, int variant) {
  Box b;
  b.box = cases::make_scheme(name, heads, dim, rng.engine(), variant);
  quantize(b.box->a);
  quantize(b.box->b);
  PositionScheme& s = b.box->scheme;
  if (auto* a = std::get_if<Alibi>(&s)) {
    a->slopes = alibi_slopes(AlibiConfig{.heads = heads, .max_bias = a->max_bias});
    b.tables64.push_back({"dslopes", &a->slopes});
  } else if (std::holds_alternative<T5Bias>(s)) {
    b.tables.push_back({"drelative_attention_bias", &b.box->a});
  } else if (std::holds_alternative<Shaw>(s)) {
    b.tables.push_back({"drel_k", &b.box->a});
    b.tables.push_back({"drel_v", &b.box->b});
  } else if (std::holds_alternative<TransformerXL>(s)) {
    b.tables.push_back({"dr_w_bias|dr_r_bias", &b.box->a});
    b.tables.push_back({"dr_net", &b.box->b});
  } else if (std::holds_alternative<DeBERTa>(s)) {
    b.tables.push_back({"dpos_key", &b.box->a});
    b.tables.push_back({"dpos_query", &b.box->b});
  }
  return b;
}

// Gradient buffers for every parameter of `scheme` (filled with 7: the backward must overwrite).
struct Grads {
  std::vector<double> dq, dk, dv, dsinks, p1, p2;
  AttentionGradsOf<double> g;
};

std::unique_ptr<Grads> make_grads(const Shape& s, const PositionScheme& scheme, bool sinks) {
  auto x = std::make_unique<Grads>();
  auto add = [](std::vector<double>& buf, auto& view, const auto& shape) {
    buf.assign(numel(shape), 7.0);
    view = std::remove_reference_t<decltype(view)>::contiguous(buf.data(), shape);
  };
  add(x->dq, x->g.dq, qshape(s));
  add(x->dk, x->g.dk, kshape(s));
  add(x->dv, x->g.dv, kshape(s));
  if (sinks) add(x->dsinks, x->g.dsinks, std::array<int64_t, 1>{s.heads_q});
  if (const auto* t = std::get_if<T5Bias>(&scheme)) {
    add(x->p1, x->g.drelative_attention_bias, t->table.shape);
  } else if (std::holds_alternative<Alibi>(scheme)) {
    add(x->p1, x->g.dslopes, std::array<int64_t, 1>{s.heads_q});
  } else if (const auto* sh = std::get_if<Shaw>(&scheme)) {
    add(x->p1, x->g.drel_k, sh->rel_k.shape);
    add(x->p2, x->g.drel_v, sh->rel_v.shape);
  } else if (const auto* xl = std::get_if<TransformerXL>(&scheme)) {
    // dr_w_bias and dr_r_bias side by side in p1 (as the box stores r_w_bias and r_r_bias).
    x->p1.assign(2 * numel(xl->r_w_bias.shape), 7.0);
    x->g.dr_w_bias = View<double, 2>::contiguous(x->p1.data(), xl->r_w_bias.shape);
    x->g.dr_r_bias =
        View<double, 2>::contiguous(x->p1.data() + numel(xl->r_w_bias.shape), xl->r_r_bias.shape);
    add(x->p2, x->g.dr_net, xl->r_net.shape);
  } else if (const auto* db = std::get_if<DeBERTa>(&scheme)) {
    add(x->p1, x->g.dpos_key, db->pos_key.shape);
    add(x->p2, x->g.dpos_query, db->pos_query.shape);
  }
  return x;
}

template <class F>
double richardson(F&& f_at, double h) {
  return (8.0 * (f_at(h) - f_at(-h)) - (f_at(2 * h) - f_at(-2 * h))) / (12.0 * h);
}

// max |fd - analytic| / max(max |analytic|, 1e-3) <= 1e-6.
void expect_fd_close(const std::string& name, const std::vector<double>& analytic,
                     const std::vector<double>& fd) {
  ASSERT_EQ(analytic.size(), fd.size()) << name;
  double amax = 0, err = 0;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < fd.size(); ++i) {
    amax = std::max(amax, std::abs(analytic[i]));
    double e = std::abs(fd[i] - analytic[i]);
    if (std::isnan(e)) e = kInf;
    if (e > err) err = e, worst = i;
  }
  EXPECT_LE(err / std::max(amax, 1e-3), 1e-6)
      << name << ": max |fd - analytic| " << err << " at element " << worst << " (fd " << fd[worst]
      << ", analytic " << analytic[worst] << "), max |analytic| " << amax;
}

// Sinks as float32 values that are exact multiples of 2^-12 (so the float32 option and the
// float64 table hold the same numbers), spread around the scores' range.
std::vector<float> make_sinks(Rng& rng, int64_t heads) {
  auto s = randn<float>(rng, static_cast<std::size_t>(heads), 1.5);
  quantize(s);
  return s;
}

// ---- 1. the oracle's forward ----------------------------------------------------------------

TEST(AttentionSinks, OracleForwardMatchesFormula) {
  const Shape s{2, 5, 9, 4, 2, 6};
  for (const auto& name : cases::kSchemes) {
    for (int variant = 0; variant < 2; ++variant) {
      Rng rng(posenc_test::test_seed(), 100 + variant);
      Box box = make_box(name, s.heads_q, s.dim, rng, variant);
      const PositionScheme& scheme = box.box->scheme;
      auto q = randn<double>(rng, numel(qshape(s)));
      auto k = randn<double>(rng, numel(kshape(s)));
      auto v = randn<double>(rng, numel(kshape(s)));
      const auto sinks = make_sinks(rng, s.heads_q);
      for (const AttentionOptions& base :
           {AttentionOptions{}, AttentionOptions{.causal = true, .chunk = 3},
            AttentionOptions{.window = 3, .chunk = 4}, AttentionOptions{.causal = true}}) {
        AttentionOptions opt = base;
        opt.sinks = View<const float, 1>::contiguous(sinks.data(), {s.heads_q});
        SCOPED_TRACE(name + " variant " + std::to_string(variant) + " " + str(s) + " " + str(opt) +
                     " " + posenc_test::seed_trace());
        std::vector<double> out(q.size()), lse(numel(lshape(s)));
        ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, opt,
                       mview(out, qshape(s)), mview(lse, lshape(s)));
        // Without sinks (rows the mask empties allowed): the identities.
        AttentionOptions plain = opt;
        plain.sinks = {};
        plain.allow_fully_masked = true;
        std::vector<double> out0(q.size()), lse0(lse.size());
        ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, plain,
                       mview(out0, qshape(s)), mview(lse0, lshape(s)));
        const auto o = mview(out, qshape(s)), o0 = mview(out0, qshape(s));
        const auto l = mview(lse, lshape(s)), l0 = mview(lse0, lshape(s));
        const bool value_term = std::holds_alternative<Shaw>(scheme);
        for (int64_t b = 0; b < s.batch; ++b)
          for (int64_t h = 0; h < s.heads_q; ++h) {
            const double sink = sinks[static_cast<std::size_t>(h)];
            const auto sc =
                ref::attention_scores(cview(q, qshape(s)), cview(k, kshape(s)), scheme, opt, b, h);
            const int64_t hk = h / (s.heads_q / s.heads_kv);
            for (int64_t i = 0; i < s.seq_q; ++i) {
              // Identities with the sink-free attention.
              const double want_lse = std::log(std::exp(l0(b, h, i)) + std::exp(sink));
              EXPECT_NEAR(l(b, h, i), want_lse, 1e-12) << "lse b " << b << " h " << h << " i " << i;
              const double keep = 1.0 - std::exp(sink - l(b, h, i));
              for (int64_t c = 0; c < s.dim; ++c) {
                EXPECT_NEAR(o(b, i, h, c), o0(b, i, h, c) * keep, 1e-12);
              }
              // The formula over the scores (no value term: every scheme but Shaw).
              if (value_term) continue;
              const int64_t pq = s.seq_k - s.seq_q + i;
              double denom = std::exp(sink);
              std::vector<double> num(static_cast<std::size_t>(s.dim), 0.0);
              for (int64_t j = 0; j < s.seq_k; ++j) {
                if (!visible(opt, pq, j)) continue;
                const double e = std::exp(sc[static_cast<std::size_t>(i * s.seq_k + j)]);
                denom += e;
                for (int64_t c = 0; c < s.dim; ++c) {
                  num[static_cast<std::size_t>(c)] +=
                      e * v[static_cast<std::size_t>(((b * s.seq_k + j) * s.heads_kv + hk) * s.dim +
                                                     c)];
                }
              }
              EXPECT_NEAR(l(b, h, i), std::log(denom), 1e-12);
              for (int64_t c = 0; c < s.dim; ++c) {
                EXPECT_NEAR(o(b, i, h, c), num[static_cast<std::size_t>(c)] / denom, 1e-12)
                    << "out b " << b << " i " << i << " h " << h << " c " << c;
              }
            }
          }
      }
    }
  }
}

// ---- 2. the oracle's backward against finite differences ------------------------------------

void check_fd(const std::string& name, int variant, const Shape& s, AttentionOptions opt,
              bool with_sinks, uint64_t stream) {
  Rng rng(posenc_test::test_seed(), stream);
  Box box = make_box(name, s.heads_q, s.dim, rng, variant);
  PositionScheme& scheme = box.box->scheme;
  auto q = randn<double>(rng, numel(qshape(s)));
  auto k = randn<double>(rng, numel(kshape(s)));
  auto v = randn<double>(rng, numel(kshape(s)));
  const auto dout = randn<double>(rng, numel(qshape(s)));
  auto sinks = promote(make_sinks(rng, s.heads_q));
  ref::SchemeTables tables;
  if (with_sinks) tables.sinks = View<const double, 1>::contiguous(sinks.data(), {s.heads_q});
  SCOPED_TRACE(name + " variant " + std::to_string(variant) + " " + str(s) + " " + str(opt) +
               (with_sinks ? " sinks (float64 table)" : "") + " stream " + std::to_string(stream) +
               " " + posenc_test::seed_trace());
  auto loss = [&] {
    std::vector<double> out(q.size());
    ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, opt,
                   tables, mview(out, qshape(s)));
    double l = 0;
    for (std::size_t i = 0; i < out.size(); ++i) l += dout[i] * out[i];
    return l;
  };
  std::vector<double> out(q.size()), lse(numel(lshape(s)));
  ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, opt, tables,
                 mview(out, qshape(s)), mview(lse, lshape(s)));
  auto g = make_grads(s, scheme, with_sinks);
  ref::attention_backward(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)),
                          cview(out, qshape(s)), cview(lse, lshape(s)), cview(dout, qshape(s)),
                          scheme, opt, tables, g->g);
  auto fd_of = [&](std::vector<double>& x, double h) {
    std::vector<double> fd(x.size());
    for (std::size_t n = 0; n < x.size(); ++n) {
      const double x0 = x[n];
      fd[n] = richardson(
          [&](double delta) {
            x[n] = x0 + delta;
            const double l = loss();
            x[n] = x0;
            return l;
          },
          h);
    }
    return fd;
  };
  expect_fd_close("dq", g->dq, fd_of(q, 1e-3));
  expect_fd_close("dk", g->dk, fd_of(k, 1e-3));
  expect_fd_close("dv", g->dv, fd_of(v, 1e-3));
  if (with_sinks) expect_fd_close("dsinks", g->dsinks, fd_of(sinks, 1e-3));
  // Scheme parameters: float32 tables perturbed by exact steps of 2^-8.
  for (std::size_t t = 0; t < box.tables.size(); ++t) {
    std::vector<float>& x = *box.tables[t].second;
    std::vector<double> fd(x.size());
    for (std::size_t n = 0; n < x.size(); ++n) {
      const float x0 = x[n];
      fd[n] = richardson(
          [&](double delta) {
            x[n] = static_cast<float>(static_cast<double>(x0) + delta);
            const double l = loss();
            x[n] = x0;
            return l;
          },
          1.0 / 256);
    }
    expect_fd_close(box.tables[t].first, t == 0 ? g->p1 : g->p2, fd);
  }
  for (auto& [gname, x] : box.tables64) expect_fd_close(gname, g->p1, fd_of(*x, 1e-3));
}

TEST(AttentionSinks, OracleBackwardMatchesFiniteDifferences) {
  const Shape s{1, 5, 7, 4, 2, 4};
  uint64_t stream = 200;
  for (const auto& name : cases::kSchemes) {
    for (int variant = 0; variant < 2; ++variant) {
      check_fd(name, variant, s, {}, true, stream++);
      check_fd(name, variant, s, {.causal = true, .chunk = 3}, true, stream++);
      check_fd(name, variant, s, {.causal = true, .allow_fully_masked = true, .chunk = 3}, false,
               stream++);
      check_fd(name, variant, s, {.window = 2, .chunk = 4}, variant == 1, stream++);
    }
  }
}

// ---- 3. the float32 paths against the oracle ------------------------------------------------

struct F32Grads {
  std::vector<float> dq, dk, dv, dsinks;
  AttentionGrads g;
};

void check_float32(const std::string& name, int variant, const Shape& s, AttentionOptions opt,
                   Rng& rng, bool with_sinks) {
  auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), variant);
  const PositionScheme& scheme = box->scheme;
  const auto sinks = make_sinks(rng, s.heads_q);
  if (with_sinks) opt.sinks = View<const float, 1>::contiguous(sinks.data(), {s.heads_q});
  SCOPED_TRACE(name + " variant " + std::to_string(variant) + " " + str(s) + " " + str(opt) + " " +
               posenc_test::seed_trace());
  const auto q = randn<float>(rng, numel(qshape(s))), k = randn<float>(rng, numel(kshape(s)));
  const auto v = randn<float>(rng, numel(kshape(s))), dout = randn<float>(rng, numel(qshape(s)));
  const auto qd = promote(q), kd = promote(k), vd = promote(v), doutd = promote(dout);
  std::vector<double> outd(q.size()), lsed(numel(lshape(s)));
  ref::attention(cview(qd, qshape(s)), cview(kd, kshape(s)), cview(vd, kshape(s)), scheme, opt,
                 mview(outd, qshape(s)), mview(lsed, lshape(s)));
  std::vector<float> out(q.size(), -5.0f), out_naive(q.size(), -5.0f), lse(lsed.size(), -5.0f);
  attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, opt,
            mview(out, qshape(s)), mview(lse, lshape(s)));
  attention_naive(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, opt,
                  mview(out_naive, qshape(s)));
  expect_tolerance("out", out, out_naive, outd);
  expect_lse(lse, lsed);

  // The backward from the oracle's out and lse (rounded): both float32 paths on the same input.
  std::vector<float> out32(outd.begin(), outd.end()), lse32(lsed.begin(), lsed.end());
  AttentionGradsOf<double> gd;
  std::vector<double> dqd(q.size()), dkd(k.size()), dvd(v.size()), dsd(sinks.size());
  gd.dq = mview(dqd, qshape(s)), gd.dk = mview(dkd, kshape(s)), gd.dv = mview(dvd, kshape(s));
  if (with_sinks) gd.dsinks = mview(dsd, std::array<int64_t, 1>{s.heads_q});
  ref::attention_backward(cview(qd, qshape(s)), cview(kd, kshape(s)), cview(vd, kshape(s)),
                          cview(outd, qshape(s)), cview(lsed, lshape(s)), cview(doutd, qshape(s)),
                          scheme, opt, gd);
  auto run32 = [&](auto fn) {
    auto r = std::make_unique<F32Grads>();
    r->dq.assign(q.size(), 7.0f), r->dk.assign(k.size(), 7.0f), r->dv.assign(v.size(), 7.0f);
    r->dsinks.assign(sinks.size(), 7.0f);
    r->g.dq = mview(r->dq, qshape(s)), r->g.dk = mview(r->dk, kshape(s));
    r->g.dv = mview(r->dv, kshape(s));
    if (with_sinks) r->g.dsinks = mview(r->dsinks, std::array<int64_t, 1>{s.heads_q});
    fn(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), cview(out32, qshape(s)),
       cview(lse32, lshape(s)), cview(dout, qshape(s)), scheme, opt, r->g, nullptr, nullptr);
    return r;
  };
  const auto fast = run32(&attention_backward);
  const auto naive = run32(&attention_backward_naive);
  expect_tolerance("dq", fast->dq, naive->dq, dqd);
  expect_tolerance("dk", fast->dk, naive->dk, dkd);
  expect_tolerance("dv", fast->dv, naive->dv, dvd);
  if (with_sinks) expect_tolerance("dsinks", fast->dsinks, naive->dsinks, dsd);
}

TEST(AttentionSinks, Float32PathsMatchOracle) {
  Rng rng(posenc_test::test_seed(), 300);
  for (const Shape& s : {Shape{2, 7, 19, 4, 1, 8}, Shape{1, 33, 33, 8, 2, 16}}) {
    for (const auto& name : cases::kSchemes) {
      for (int variant = 0; variant < 2; ++variant) {
        check_float32(name, variant, s, {}, rng, true);
        check_float32(name, variant, s, {.causal = true, .chunk = 8}, rng, true);
        check_float32(name, variant, s, {.causal = true, .window = 5, .chunk = 6}, rng, false);
        check_float32(name, variant, s, {.window = 4, .chunk = 5}, rng, true);
      }
    }
  }
}

// ---- 4. rows that see no key ----------------------------------------------------------------

TEST(AttentionSinks, FullyMaskedRowsWithSinks) {
  // Query positions 0..3 against keys at 4..9, causal: every row sees nothing.
  const Shape s{1, 4, 6, 2, 1, 4};
  Rng rng(posenc_test::test_seed(), 400);
  const auto q = randn<float>(rng, numel(qshape(s))), k = randn<float>(rng, numel(kshape(s)));
  const auto v = randn<float>(rng, numel(kshape(s))), dout = randn<float>(rng, numel(qshape(s)));
  const std::vector<float> sinks = {0.75f, -1.5f};
  const std::vector<int64_t> qids = {0, 1, 2, 5}, kids = {4, 5, 6, 7, 8, 9};
  const Positions qp = Positions::shared(qids), kp = Positions::shared(kids);
  AttentionOptions opt{.causal = true};
  opt.sinks = View<const float, 1>::contiguous(sinks.data(), {2});
  std::vector<float> out(q.size(), 9.0f), lse(numel(lshape(s)), 9.0f);
  // No allow_fully_masked: with sinks such rows are defined, not an error.
  attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), NoPositions{}, opt,
            mview(out, qshape(s)), mview(lse, lshape(s)), &qp, &kp);
  const auto o = mview(out, qshape(s));
  const auto l = mview(lse, lshape(s));
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < 3; ++i) {
      EXPECT_EQ(l(0, h, i), sinks[static_cast<std::size_t>(h)]) << "h " << h << " i " << i;
      for (int64_t c = 0; c < s.dim; ++c) EXPECT_EQ(o(0, i, h, c), 0.0f);
    }
    EXPECT_GT(l(0, h, 3), sinks[static_cast<std::size_t>(h)]);  // sees keys 4 and 5
  }
  // The oracle agrees, and its backward leaves those rows' dq at 0 and dsinks unaffected.
  const auto qd = promote(q), kd = promote(k), vd = promote(v), doutd = promote(dout);
  std::vector<double> outd(q.size()), lsed(lse.size());
  ref::attention(cview(qd, qshape(s)), cview(kd, kshape(s)), cview(vd, kshape(s)), NoPositions{},
                 opt, mview(outd, qshape(s)), mview(lsed, lshape(s)), &qp, &kp);
  for (int64_t h = 0; h < 2; ++h) EXPECT_EQ(lsed[static_cast<std::size_t>(h * 4)], sinks[h]);
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), ds(2);
  AttentionGradsOf<double> g{
      .dq = mview(dq, qshape(s)), .dk = mview(dk, kshape(s)), .dv = mview(dv, kshape(s))};
  g.dsinks = mview(ds, std::array<int64_t, 1>{2});
  ref::attention_backward(cview(qd, qshape(s)), cview(kd, kshape(s)), cview(vd, kshape(s)),
                          cview(outd, qshape(s)), cview(lsed, lshape(s)), cview(doutd, qshape(s)),
                          NoPositions{}, opt, g, &qp, &kp);
  const auto dqv = mview(dq, qshape(s));
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t c = 0; c < s.dim; ++c) EXPECT_EQ(dqv(0, i, h, c), 0.0);
  // dsinks from row 3 alone: -exp(sink - lse) D.
  for (int64_t h = 0; h < 2; ++h) {
    double dsum = 0;
    for (int64_t c = 0; c < s.dim; ++c) {
      const auto at = static_cast<std::size_t>((3 * s.heads_q + h) * s.dim + c);
      dsum += doutd[at] * outd[at];
    }
    const double want = -std::exp(sinks[h] - lsed[static_cast<std::size_t>(h * 4 + 3)]) * dsum;
    EXPECT_NEAR(ds[static_cast<std::size_t>(h)], want, 1e-14);
  }
  // Without sinks a row the chunk empties is an error unless allowed.
  const std::vector<int64_t> kids2 = {0, 1, 2, 3, 4, 5};
  const Positions kp2 = Positions::shared(kids2);
  const std::vector<int64_t> qids2 = {0, 1, 2, 12};
  const Positions qp2 = Positions::shared(qids2);
  std::vector<float> out2(q.size());
  EXPECT_THROW(attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)),
                         NoPositions{}, {.chunk = 4}, mview(out2, qshape(s)), &qp2, &kp2),
               ValueError);
  attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), NoPositions{},
            {.allow_fully_masked = true, .chunk = 4}, mview(out2, qshape(s)), &qp2, &kp2);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t c = 0; c < s.dim; ++c) EXPECT_EQ(out2[((3 * 2) + h) * 4 + c], 0.0f);
}

// ---- 5. chunks as separate attentions --------------------------------------------------------

TEST(AttentionSinks, ChunkEqualsAttentionPerChunk) {
  const Shape s{1, 23, 23, 4, 2, 8};
  Rng rng(posenc_test::test_seed(), 500);
  for (const auto& name : cases::kSchemes) {
    auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 0);
    const auto q = promote(randn<float>(rng, numel(qshape(s))));
    const auto k = promote(randn<float>(rng, numel(kshape(s))));
    const auto v = promote(randn<float>(rng, numel(kshape(s))));
    for (const int64_t c : {1, 4, 8, 30}) {
      for (const AttentionOptions& base :
           {AttentionOptions{.causal = true}, AttentionOptions{.causal = true, .window = 3},
            AttentionOptions{.window = 5}, AttentionOptions{}}) {
        AttentionOptions opt = base;
        opt.chunk = c;
        SCOPED_TRACE(name + " " + str(opt) + " " + posenc_test::seed_trace());
        std::vector<double> out(q.size());
        ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), box->scheme,
                       opt, mview(out, qshape(s)));
        for (int64_t a = 0; a < s.seq_k; a += c) {
          const int64_t n = std::min<int64_t>(c, s.seq_k - a);
          const int64_t row = s.heads_q * s.dim, krow = s.heads_kv * s.dim;
          const std::vector<double> qc(q.begin() + a * row, q.begin() + (a + n) * row);
          const std::vector<double> kc(k.begin() + a * krow, k.begin() + (a + n) * krow);
          const std::vector<double> vc(v.begin() + a * krow, v.begin() + (a + n) * krow);
          std::vector<int64_t> ids(static_cast<std::size_t>(n));
          for (int64_t t = 0; t < n; ++t) ids[static_cast<std::size_t>(t)] = a + t;
          const Positions pos = Positions::shared(ids);
          std::vector<double> oc(qc.size());
          const Shape cs{1, n, n, s.heads_q, s.heads_kv, s.dim};
          ref::attention(cview(qc, qshape(cs)), cview(kc, kshape(cs)), cview(vc, kshape(cs)),
                         box->scheme, base, mview(oc, qshape(cs)), &pos, &pos);
          for (std::size_t t = 0; t < oc.size(); ++t) {
            ASSERT_NEAR(out[static_cast<std::size_t>(a * row) + t], oc[t], 1e-12)
                << "chunk at " << a << " element " << t;
          }
        }
      }
    }
  }
}

// ---- 6. validation --------------------------------------------------------------------------

template <class E, class F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming '" << needle << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(AttentionSinks, ValidationNamesTheArgument) {
  const Shape s{1, 3, 4, 4, 2, 4};
  Rng rng(posenc_test::test_seed(), 600);
  const auto q = randn<float>(rng, numel(qshape(s))), k = randn<float>(rng, numel(kshape(s)));
  const auto v = randn<float>(rng, numel(kshape(s)));
  std::vector<float> out(q.size()), lse(numel(lshape(s)));
  auto fwd = [&](const AttentionOptions& o) {
    attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), NoPositions{}, o,
              mview(out, qshape(s)));
  };
  expect_error<ValueError>([&] { fwd({.chunk = 0}); }, "chunk must be >= 1");
  const std::vector<float> three = {0.f, 1.f, 2.f};
  AttentionOptions bad;
  bad.sinks = View<const float, 1>::contiguous(three.data(), {3});
  expect_error<ShapeError>([&] { fwd(bad); }, "sinks");
  std::vector<float> nan_sinks = {0.f, 1.f, std::nanf(""), 2.f};
  AttentionOptions nan_opt;
  nan_opt.sinks = View<const float, 1>::contiguous(nan_sinks.data(), {4});
  expect_error<ValueError>([&] { fwd(nan_opt); }, "sinks");
  std::vector<double> out64(q.size());
  const auto qd = promote(q), kd = promote(k), vd = promote(v);
  const std::vector<double> two = {0.0, 1.0};
  ref::SchemeTables t;
  t.sinks = View<const double, 1>::contiguous(two.data(), {2});
  expect_error<ShapeError>(
      [&] {
        ref::attention(cview(qd, qshape(s)), cview(kd, kshape(s)), cview(vd, kshape(s)),
                       NoPositions{}, {}, t, mview(out64, qshape(s)));
      },
      "sinks");
  // dsinks without sinks, and of the wrong shape.
  attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), NoPositions{}, {},
            mview(out, qshape(s)), mview(lse, lshape(s)));
  std::vector<float> dq(q.size()), dk(k.size()), dv(v.size()), ds(4);
  AttentionGrads g{
      .dq = mview(dq, qshape(s)), .dk = mview(dk, kshape(s)), .dv = mview(dv, kshape(s))};
  g.dsinks = mview(ds, std::array<int64_t, 1>{4});
  auto bwd = [&](const AttentionOptions& o) {
    attention_backward(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)),
                       cview(out, qshape(s)), cview(lse, lshape(s)), cview(q, qshape(s)),
                       NoPositions{}, o, g);
  };
  expect_error<ValueError>([&] { bwd({}); }, "dsinks");
  const std::vector<float> four = {0.f, 1.f, 2.f, 3.f};
  AttentionOptions ok;
  ok.sinks = View<const float, 1>::contiguous(four.data(), {4});
  g.dsinks = mview(ds, std::array<int64_t, 1>{3});
  expect_error<ShapeError>([&] { bwd(ok); }, "dsinks");
}

}  // namespace
