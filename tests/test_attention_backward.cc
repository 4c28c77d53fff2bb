// tests/test_attention_backward.cc - gradients of attention for every positional scheme.
//
//   1. The float64 oracle (ref::attention_backward) against central finite differences of
//      L = sum(dout * out) computed with ref::attention: dq, dk, dv and every learned parameter
//      of every scheme, 5-point (Richardson) stencil, relative error <= 1e-6 per tensor.
//      Parameter tables are float32 even in the oracle: they hold multiples of 2^-12 below 4 in
//      magnitude and are perturbed by h = 2^-8, so x +- h and x +- 2h are exact in float32.
//   2. lse: the oracle's against log(sum(exp(scores))) of ref::attention_scores under the mask;
//      the float32 forward's against the oracle's; -inf on fully masked rows.
//   3. attention_merge of the attentions over two parts of the keys (positions kept global)
//      equals the attention over all of them.
//   4. The float32 backward (attention_backward, attention_backward_naive) against the oracle on
//      identical inputs: max |fast - ref| <= 2 max |naive - ref| + 1e-6 max(1, max |ref|) per
//      tensor (STYLE.md's tolerance), on every compiled SIMD target, bit-identical for 1, 2 and
//      3 threads.
//   5. Validation: every malformed argument throws ShapeError / ValueError naming it.
//   6. RoPE's inverse rotation is the transpose of the forward; learned_backward is the exact
//      gradient of add_learned.
// Every failure prints the seed (POSENC_TEST_SEED replays it), the shape, the scheme and options.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attention_cases.h"
#include "attention_shapes.h"
#include "hwy/targets.h"
#include "kernels/attention_kernels.h"
#include "kernels/bf16_dot.h"
#include "kernels/parallel.h"
#include "kernels/simd.h"
#include "posenc/posenc.h"
#include "test_util.h"

namespace {

using namespace posenc;
using posenc_test::Rng;

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- shapes, views, random inputs -----------------------------------------------------------

using namespace attn_test;

// Table entries for finite differences: multiples of 2^-12 with |x| < 4, so that x +- 2^-8 and
// x +- 2^-7 are exact in float32.
std::vector<float> table_values(Rng& rng, int64_t n, double sd) {
  auto v = randn<double>(rng, static_cast<std::size_t>(n), sd);
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double x = std::clamp(std::round(v[i] * 4096.0), -16000.0, 16000.0) / 4096.0;
    out[i] = static_cast<float>(x);
  }
  return out;
}

// Positions in force (docs/attention.md defaults when not given).
Positions query_positions(const Positions* qp, const Shape& s) {
  return qp ? *qp : Positions::offset(s.seq_k - s.seq_q);
}
Positions key_positions(const Positions* kp) { return kp ? *kp : Positions::offset(0); }

// The mask, written independently of the library.
bool visible(const AttentionOptions& o, int64_t pos_q, int64_t pos_k) {
  const int64_t rel = pos_k - pos_q;
  if (o.causal && rel > 0) return false;
  if (o.window && std::abs(rel) >= *o.window) return false;
  return true;
}

bool sees_nothing(const Shape& s, const AttentionOptions& o, const Positions& qp,
                  const Positions& kp, int64_t b, int64_t i) {
  for (int64_t j = 0; j < s.seq_k; ++j) {
    if (visible(o, qp.at(b, i), kp.at(b, j))) return false;
  }
  return true;
}

// Restricts SIMD dispatch to one target for the scope.
struct SimdTargetScope {
  explicit SimdTargetScope(int64_t target) { kernels::set_simd_target_for_test(target); }
  ~SimdTargetScope() { kernels::set_simd_target_for_test(0); }
};

// ---- gradients ---------------------------------------------------------------------------------

// Owned gradient buffers (row-major) with the views over them: dq, dk, dv and each parameter
// gradient of the scheme, filled with `fill` beforehand (the backward must overwrite them).
template <class T>
struct Grads {
  std::vector<T> dq, dk, dv, dbias, dslopes, drel_k, drel_v, dr_w_bias, dr_r_bias, dr_net, dpos_key,
      dpos_query, dsinks;
  AttentionGradsOf<T> g;
  std::vector<std::pair<std::string, std::vector<T>*>> named;

  const std::vector<T>* find(const std::string& name) const {
    for (const auto& [n, v] : named) {
      if (n == name) return v;
    }
    return nullptr;
  }
};

template <class T>
std::unique_ptr<Grads<T>> make_grads(const Shape& s, const PositionScheme& scheme, T fill = T(7),
                                     bool sinks = false) {
  auto out = std::make_unique<Grads<T>>();
  Grads<T>& x = *out;
  auto add = [&]<std::size_t R>(std::vector<T>& store, View<T, R>& view,
                                const std::array<int64_t, R>& sh, const std::string& name) {
    store.assign(numel(sh), fill);
    view = View<T, R>::contiguous(store.data(), sh);
    x.named.emplace_back(name, &store);
  };
  add(x.dq, x.g.dq, qshape(s), "dq");
  add(x.dk, x.g.dk, kshape(s), "dk");
  add(x.dv, x.g.dv, kshape(s), "dv");
  if (const auto* t = std::get_if<T5Bias>(&scheme)) {
    add(x.dbias, x.g.drelative_attention_bias, t->table.shape, "drelative_attention_bias");
  } else if (std::holds_alternative<Alibi>(scheme)) {
    add(x.dslopes, x.g.dslopes, std::array<int64_t, 1>{s.heads_q}, "dslopes");
  } else if (const auto* sh = std::get_if<Shaw>(&scheme)) {
    add(x.drel_k, x.g.drel_k, sh->rel_k.shape, "drel_k");
    if (sh->rel_v.data != nullptr) add(x.drel_v, x.g.drel_v, sh->rel_v.shape, "drel_v");
  } else if (const auto* xl = std::get_if<TransformerXL>(&scheme)) {
    add(x.dr_w_bias, x.g.dr_w_bias, xl->r_w_bias.shape, "dr_w_bias");
    add(x.dr_r_bias, x.g.dr_r_bias, xl->r_r_bias.shape, "dr_r_bias");
    add(x.dr_net, x.g.dr_net, xl->r_net.shape, "dr_net");
  } else if (const auto* db = std::get_if<DeBERTa>(&scheme)) {
    add(x.dpos_key, x.g.dpos_key, db->pos_key.shape, "dpos_key");
    add(x.dpos_query, x.g.dpos_query, db->pos_query.shape, "dpos_query");
  }
  if (sinks) add(x.dsinks, x.g.dsinks, std::array<int64_t, 1>{s.heads_q}, "dsinks");
  return out;
}

// Bitwise equality of two gradient sets (distinguishes -0 and +0).
template <class T>
::testing::AssertionResult same_bits(const Grads<T>& a, const Grads<T>& b) {
  for (std::size_t t = 0; t < a.named.size(); ++t) {
    const auto& x = *a.named[t].second;
    const auto& y = *b.named[t].second;
    if (x.size() != y.size() ||
        (!x.empty() && std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) != 0)) {
      std::size_t e = 0;
      while (e < x.size() && posenc_test::same_bits(x[e], y[e])) ++e;
      return ::testing::AssertionFailure()
             << a.named[t].first << " differs at element " << e << ": " << x[e] << " vs " << y[e];
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- scheme tables owned for the finite differences ------------------------------------------

struct Owned {
  std::string label;
  std::vector<float> a, b, c;
  PositionScheme scheme;
};
using OwnedPtr = std::unique_ptr<Owned>;

OwnedPtr fd_none() {
  auto o = std::make_unique<Owned>();
  o->label = "none";
  o->scheme = NoPositions{};
  return o;
}

OwnedPtr fd_rope(std::vector<double> inv_freq, double attention_factor, RopeStyle style,
                 int64_t offset = 0) {
  auto o = std::make_unique<Owned>();
  RopeFrequencies f;
  f.inv_freq = std::move(inv_freq);
  f.attention_factor = attention_factor;
  o->label = std::string("rope ") + (style == RopeStyle::kHalf ? "half" : "interleaved") +
             " rotary_dim " + std::to_string(f.rotary_dim()) + " af " +
             std::to_string(attention_factor) + " offset " + std::to_string(offset);
  o->scheme = Rope{f, style, offset};
  return o;
}

OwnedPtr fd_alibi(std::vector<double> slopes, double max_bias = 8.0) {
  auto o = std::make_unique<Owned>();
  o->label = slopes.empty() ? "alibi default slopes" : "alibi given slopes";
  o->scheme = Alibi{std::move(slopes), max_bias};
  return o;
}

OwnedPtr fd_t5(Rng& rng, int64_t num_buckets, int64_t heads, int64_t max_distance,
               std::optional<bool> bidirectional = std::nullopt) {
  auto o = std::make_unique<Owned>();
  o->a = table_values(rng, num_buckets * heads, 1.0);
  o->label =
      "t5 NB " + std::to_string(num_buckets) + " MD " + std::to_string(max_distance) +
      (bidirectional ? (*bidirectional ? " bidirectional=true" : " bidirectional=false") : "");
  o->scheme = T5Bias{.table = View<const float, 2>::contiguous(o->a.data(), {num_buckets, heads}),
                     .max_distance = max_distance,
                     .bidirectional = bidirectional};
  return o;
}

// Shaw with rel_k [2K+1, heads_k, D] and rel_v [2K+1, heads_v, D] (heads_v = 0: no rel_v).
OwnedPtr fd_shaw(Rng& rng, int64_t k, int64_t heads_k, int64_t heads_v, int64_t dim) {
  auto o = std::make_unique<Owned>();
  o->a = table_values(rng, (2 * k + 1) * heads_k * dim, 0.5);
  Shaw s{View<const float, 3>::contiguous(o->a.data(), {2 * k + 1, heads_k, dim}), {}};
  if (heads_v > 0) {
    o->b = table_values(rng, (2 * k + 1) * heads_v * dim, 0.5);
    s.rel_v = View<const float, 3>::contiguous(o->b.data(), {2 * k + 1, heads_v, dim});
  }
  o->label = "shaw K " + std::to_string(k) + " rel_k heads " + std::to_string(heads_k) +
             " rel_v heads " + std::to_string(heads_v);
  o->scheme = s;
  return o;
}

OwnedPtr fd_xl(Rng& rng, int64_t heads, int64_t dim, int64_t d_model) {
  auto o = std::make_unique<Owned>();
  o->a = table_values(rng, heads * dim, 0.5);
  o->b = table_values(rng, heads * dim, 0.5);
  o->c = table_values(rng, heads * dim * d_model, 0.3);
  o->label = "xl d_model " + std::to_string(d_model);
  o->scheme = TransformerXL{View<const float, 2>::contiguous(o->a.data(), {heads, dim}),
                            View<const float, 2>::contiguous(o->b.data(), {heads, dim}),
                            View<const float, 2>::contiguous(o->c.data(), {heads * dim, d_model})};
  return o;
}

OwnedPtr fd_deberta(Rng& rng, int64_t heads, int64_t dim, DebertaBuckets cfg) {
  auto o = std::make_unique<Owned>();
  const int64_t k = cfg.span();
  o->a = table_values(rng, 2 * k * heads * dim, 0.5);
  o->b = table_values(rng, 2 * k * heads * dim, 0.5);
  o->label = std::string("deberta ") + (cfg.p2c == DebertaP2c::kModel ? "kModel" : "kPaper") +
             " max_relative_positions " + std::to_string(cfg.max_relative_positions) +
             " position_buckets " + std::to_string(cfg.position_buckets);
  o->scheme = DeBERTa{View<const float, 3>::contiguous(o->a.data(), {2 * k, heads, dim}),
                      View<const float, 3>::contiguous(o->b.data(), {2 * k, heads, dim}), cfg};
  return o;
}

// The learned parameters of a scheme, element by element in row-major order, named as their
// gradients. The tables are the test's own (non-const) buffers seen through const views.
struct ParamRef {
  std::string grad_name;
  std::vector<float*> f;   // float32 table entries
  std::vector<double*> d;  // or float64 entries (ALiBi slopes)
};

template <std::size_t R>
std::vector<float*> elements(const View<const float, R>& t) {
  std::vector<float*> out;
  posenc_test::for_each_index(t.shape, [&](const std::array<int64_t, R>& i) {
    out.push_back(const_cast<float*>(t.data + posenc_test::offset_of(t, i)));
  });
  return out;
}

std::vector<ParamRef> param_refs(PositionScheme& scheme) {
  std::vector<ParamRef> r;
  if (auto* t = std::get_if<T5Bias>(&scheme)) {
    r.push_back({"drelative_attention_bias", elements(t->table), {}});
  } else if (auto* a = std::get_if<Alibi>(&scheme)) {
    ParamRef p{"dslopes", {}, {}};
    for (auto& x : a->slopes) p.d.push_back(&x);
    r.push_back(p);
  } else if (auto* s = std::get_if<Shaw>(&scheme)) {
    r.push_back({"drel_k", elements(s->rel_k), {}});
    if (s->rel_v.data != nullptr) r.push_back({"drel_v", elements(s->rel_v), {}});
  } else if (auto* x = std::get_if<TransformerXL>(&scheme)) {
    r.push_back({"dr_w_bias", elements(x->r_w_bias), {}});
    r.push_back({"dr_r_bias", elements(x->r_r_bias), {}});
    r.push_back({"dr_net", elements(x->r_net), {}});
  } else if (auto* db = std::get_if<DeBERTa>(&scheme)) {
    r.push_back({"dpos_key", elements(db->pos_key), {}});
    r.push_back({"dpos_query", elements(db->pos_query), {}});
  }
  return r;
}

// ---- 1. finite differences of the float64 oracle ---------------------------------------------

// f'(x) by the 5-point stencil (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h; f_at(delta)
// evaluates f at x + delta.
template <class F>
double richardson(F&& f_at, double h) {
  return (8.0 * (f_at(h) - f_at(-h)) - (f_at(2 * h) - f_at(-2 * h))) / (12.0 * h);
}

constexpr std::size_t kMaxChecked = 1500;  // elements per tensor (a random subset beyond)

std::vector<std::size_t> pick(std::size_t n, Rng& rng) {
  std::vector<std::size_t> idx(n);
  for (std::size_t i = 0; i < n; ++i) idx[i] = i;
  if (n > kMaxChecked) {
    std::shuffle(idx.begin(), idx.end(), rng.engine());
    idx.resize(kMaxChecked);
    std::sort(idx.begin(), idx.end());
  }
  return idx;
}

// max |fd - analytic| / max(max |analytic|, 1e-3) <= 1e-6 over the checked elements.
void expect_fd_close(const std::string& name, const std::vector<double>& analytic,
                     const std::vector<std::size_t>& idx, const std::vector<double>& fd) {
  double amax = 0;
  for (double a : analytic) amax = std::max(amax, std::abs(a));
  double err = 0;
  std::size_t worst = 0;
  for (std::size_t t = 0; t < idx.size(); ++t) {
    double e = std::abs(fd[t] - analytic[idx[t]]);
    if (std::isnan(e)) e = kInf;
    if (e > err || t == 0) err = e, worst = t;
  }
  const double rel = err / std::max(amax, 1e-3);
  EXPECT_LE(rel, 1e-6) << name << ": relative error " << rel << " (max |fd - analytic| " << err
                       << " at element " << (idx.empty() ? 0 : idx[worst]) << ": fd "
                       << (idx.empty() ? 0.0 : fd[worst]) << ", analytic "
                       << (idx.empty() ? 0.0 : analytic[idx[worst]]) << "; max |analytic| " << amax
                       << "; " << idx.size() << " of " << analytic.size() << " elements checked)";
}

struct FdCase {
  std::string label;
  Shape s;
  OwnedPtr sch;
  AttentionOptions opt;
  std::optional<Positions> qp, kp;
};

void check_finite_differences(FdCase& c, uint64_t stream) {
  const Shape& s = c.s;
  SCOPED_TRACE(c.label + " | " + c.sch->label + " | " + str(s) + " | " + str(c.opt) +
               (c.qp ? " | explicit query positions" : "") +
               (c.kp ? " | explicit key positions" : "") + " | stream " + std::to_string(stream) +
               " " + posenc_test::seed_trace());
  Rng rng(posenc_test::test_seed(), stream);
  auto q = randn<double>(rng, numel(qshape(s)));
  auto k = randn<double>(rng, numel(kshape(s)));
  auto v = randn<double>(rng, numel(kshape(s)));
  const auto dout = randn<double>(rng, numel(qshape(s)));
  const Positions* qp = c.qp ? &*c.qp : nullptr;
  const Positions* kp = c.kp ? &*c.kp : nullptr;
  auto loss = [&](const PositionScheme& scheme) {
    std::vector<double> out(q.size());
    ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, c.opt,
                   mview(out, qshape(s)), qp, kp);
    double l = 0;
    for (std::size_t i = 0; i < out.size(); ++i) l += dout[i] * out[i];
    return l;
  };

  std::vector<double> out(q.size()), lse(numel(lshape(s)));
  ref::attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), c.sch->scheme,
                 c.opt, mview(out, qshape(s)), mview(lse, lshape(s)), qp, kp);
  auto g = make_grads<double>(s, c.sch->scheme);
  ref::attention_backward(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)),
                          cview(out, qshape(s)), cview(lse, lshape(s)), cview(dout, qshape(s)),
                          c.sch->scheme, c.opt, g->g, qp, kp);

  // Rows without a visible key: lse -inf and a zero dq row; every other lse finite.
  const Positions pq = query_positions(qp, s), pk = key_positions(kp);
  const auto l = mview(lse, lshape(s));
  const auto dq = mview(g->dq, qshape(s));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < s.seq_q; ++i) {
      const bool masked = sees_nothing(s, c.opt, pq, pk, b, i);
      for (int64_t h = 0; h < s.heads_q; ++h) {
        if (masked) {
          EXPECT_EQ(l(b, h, i), -kInf) << "lse of fully masked row b " << b << " i " << i;
          for (int64_t x = 0; x < s.dim; ++x) {
            EXPECT_EQ(dq(b, i, h, x), 0.0) << "dq of fully masked row b " << b << " i " << i;
          }
        } else {
          EXPECT_TRUE(std::isfinite(l(b, h, i))) << "lse b " << b << " h " << h << " i " << i;
        }
      }
    }

  // q, k, v (float64: any step; 1e-3 balances truncation h^4 against rounding eps / h).
  struct Input {
    const char* grad;
    std::vector<double>* x;
  };
  for (const Input in : {Input{"dq", &q}, Input{"dk", &k}, Input{"dv", &v}}) {
    const auto idx = pick(in.x->size(), rng);
    std::vector<double> fd;
    for (const std::size_t e : idx) {
      const double x0 = (*in.x)[e];
      fd.push_back(richardson(
          [&](double delta) {
            (*in.x)[e] = x0 + delta;
            const double r = loss(c.sch->scheme);
            (*in.x)[e] = x0;
            return r;
          },
          1e-3));
    }
    expect_fd_close(in.grad, *g->find(in.grad), idx, fd);
  }

  // Parameters. ALiBi's default slopes are the parameter too: differentiate at their values.
  PositionScheme work = c.sch->scheme;
  if (auto* a = std::get_if<Alibi>(&work); a != nullptr && a->slopes.empty()) {
    a->slopes = alibi_slopes({.heads = s.heads_q, .max_bias = a->max_bias});
    EXPECT_EQ(loss(work), loss(c.sch->scheme)) << "explicit default slopes change the output";
  }
  const auto refs = param_refs(work);
  std::size_t n_params = 0;
  for (const auto& [name, vec] : g->named) {
    if (name != "dq" && name != "dk" && name != "dv") ++n_params;
  }
  EXPECT_EQ(n_params, refs.size()) << "parameter gradients requested vs parameters of the scheme";
  for (const ParamRef& p : refs) {
    const std::vector<double>* grad = g->find(p.grad_name);
    ASSERT_NE(grad, nullptr) << p.grad_name;
    const std::size_t n = p.f.empty() ? p.d.size() : p.f.size();
    ASSERT_EQ(grad->size(), n) << p.grad_name;
    const auto idx = pick(n, rng);
    std::vector<double> fd;
    for (const std::size_t e : idx) {
      if (!p.f.empty()) {
        float* x = p.f[e];
        const float x0 = *x;
        ASSERT_EQ(std::round(static_cast<double>(x0) * 4096.0), static_cast<double>(x0) * 4096.0);
        fd.push_back(richardson(
            [&](double delta) {
              const double moved = static_cast<double>(x0) + delta;
              *x = static_cast<float>(moved);
              EXPECT_EQ(static_cast<double>(*x), moved) << "inexact float32 perturbation";
              const double r = loss(work);
              *x = x0;
              return r;
            },
            1.0 / 256.0));
      } else {
        double* x = p.d[e];
        const double x0 = *x;
        fd.push_back(richardson(
            [&](double delta) {
              *x = x0 + delta;
              const double r = loss(work);
              *x = x0;
              return r;
            },
            1e-4));
      }
    }
    expect_fd_close(p.grad_name, *grad, idx, fd);
  }
}

std::vector<int64_t> iota_ids(int64_t n, int64_t start = 0, int64_t step = 1) {
  std::vector<int64_t> ids(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = start + step * i;
  return ids;
}

std::vector<FdCase> fd_cases() {
  Rng rng(posenc_test::test_seed(), 1000);
  std::vector<FdCase> cs;
  auto add = [&](std::string label, Shape s, OwnedPtr sch, AttentionOptions opt,
                 std::optional<Positions> qp = std::nullopt,
                 std::optional<Positions> kp = std::nullopt) {
    cs.push_back(FdCase{std::move(label), s, std::move(sch), opt, std::move(qp), std::move(kp)});
  };
  const auto shared = [](std::vector<int64_t> ids) { return Positions::shared(std::move(ids)); };
  const auto per_row = [](std::vector<int64_t> ids, int64_t b, int64_t l) {
    return Positions::per_row(std::move(ids), b, l);
  };
  // Sparse, unsorted per-row ids shared by several cases (B = 2, Lq = 4, Lk = 6).
  const auto qrow = per_row({9, 2, 14, 5, 30, 3, 41, 12}, 2, 4);
  const auto krow = per_row({0, 3, 4, 8, 13, 20, 44, 1, 40, 5, 12, 30}, 2, 6);

  // NoPositions.
  add("MHA", {2, 4, 4, 2, 2, 4}, fd_none(), {});
  add("GQA Lq < Lk", {2, 3, 6, 4, 2, 5}, fd_none(), {.causal = true});
  add("MQA window", {2, 5, 5, 4, 1, 4}, fd_none(), {.window = 2});
  add("scale, per-row sparse positions", {2, 4, 6, 2, 2, 4}, fd_none(), {.scale = 0.7}, qrow, krow);
  add("fully masked rows", {2, 4, 7, 2, 1, 4}, fd_none(),
      {.causal = true, .window = 3, .allow_fully_masked = true}, shared({0, 3, 40, 6}),
      shared(iota_ids(7, 1)));
  // RoPE: half and interleaved, partial rotary (fewer inv_freq than head_dim / 2), af != 1.
  add("GQA", {2, 4, 6, 4, 2, 4}, fd_rope({1.0, 0.01}, 1.0, RopeStyle::kHalf), {.causal = true});
  add("per-row sparse positions", {2, 4, 6, 2, 2, 6},
      fd_rope({0.9, 0.21}, 1.3, RopeStyle::kInterleaved), {}, qrow, krow);
  add("MQA window, shared positions", {2, 4, 5, 2, 1, 6},
      fd_rope({0.7, 0.05}, 0.8, RopeStyle::kHalf), {.causal = true, .window = 4},
      shared({3, 7, 8, 12}), shared({1, 4, 7, 8, 11}));
  add("full rotary interleaved, Lq < Lk", {2, 3, 5, 2, 2, 4},
      fd_rope({1.0, 0.1}, 1.0, RopeStyle::kInterleaved), {.causal = true});
  // Decoupled RoPE (DeepSeek): dims [2, 6) of 7 rotate, dims 0, 1 and 6 pass through.
  add("decoupled, offset 2 of head_dim 7", {2, 4, 5, 2, 1, 7},
      fd_rope({0.8, 0.03}, 1.2, RopeStyle::kInterleaved, 2), {.causal = true});
  // ALiBi: given and default slopes.
  add("given slopes, shared sparse positions", {2, 4, 6, 4, 2, 4},
      fd_alibi({0.5, 0.25, 0.125, 0.7}), {}, shared({2, 9, 4, 15}), shared({0, 5, 6, 10, 16, 20}));
  add("default slopes", {2, 5, 5, 4, 4, 4}, fd_alibi({}), {.causal = true});
  add("default slopes (16), window, per-row", {2, 4, 6, 2, 1, 4}, fd_alibi({}, 16.0),
      {.window = 9, .allow_fully_masked = true}, qrow, krow);
  // T5: bidirectional and causal bucketing, distances beyond max_distance (log and last buckets).
  add("bidirectional, far positions", {2, 4, 7, 2, 1, 4}, fd_t5(rng, 8, 2, 10), {},
      shared({0, 5, 30, 100}), shared({0, 1, 3, 9, 20, 50, 200}));
  add("causal, far per-row positions", {2, 4, 6, 2, 2, 4}, fd_t5(rng, 8, 2, 12), {.causal = true},
      per_row({10, 40, 80, 150, 3, 4, 5, 200}, 2, 4),
      per_row({0, 9, 10, 30, 70, 140, 0, 1, 2, 3, 4, 5}, 2, 6));
  add("causal with bidirectional buckets", {2, 3, 5, 4, 2, 4}, fd_t5(rng, 6, 4, 8, true),
      {.causal = true});
  add("bidirectional default positions", {2, 6, 6, 2, 2, 4}, fd_t5(rng, 10, 2, 5), {});
  // Shaw: shared and per-head tables, distances beyond the clip K.
  add("shared tables", {2, 4, 6, 2, 1, 4}, fd_shaw(rng, 2, 1, 1, 4), {});
  add("per-head tables, GQA, sparse positions", {2, 4, 6, 4, 2, 4}, fd_shaw(rng, 1, 4, 4, 4),
      {.causal = true}, shared({3, 8, 9, 20}), shared({0, 2, 3, 8, 9, 15}));
  add("per-head rel_k, shared rel_v, window", {2, 4, 6, 2, 2, 4}, fd_shaw(rng, 2, 2, 1, 4),
      {.window = 10, .allow_fully_masked = true}, qrow, krow);
  add("no rel_v", {2, 3, 5, 2, 2, 4}, fd_shaw(rng, 1, 1, 0, 4), {.causal = true});
  add("fully masked rows", {2, 4, 7, 2, 1, 4}, fd_shaw(rng, 2, 2, 2, 4),
      {.causal = true, .window = 3, .allow_fully_masked = true}, shared({0, 3, 40, 6}),
      shared(iota_ids(7, 1)));
  // Transformer-XL: memory segment (Lk > Lq), with and without causal.
  add("memory", {2, 3, 6, 2, 2, 4}, fd_xl(rng, 2, 4, 6), {});
  add("memory causal GQA", {2, 4, 7, 2, 1, 4}, fd_xl(rng, 2, 4, 8), {.causal = true});
  add("per-row positions window", {2, 4, 6, 2, 2, 4}, fd_xl(rng, 2, 4, 4),
      {.window = 12, .allow_fully_masked = true}, qrow, krow);
  // DeBERTa: both p2c forms, plain and log buckets, distances beyond the span.
  add("plain", {2, 4, 7, 2, 2, 4},
      fd_deberta(rng, 2, 4, {.max_relative_positions = 3, .p2c = DebertaP2c::kPaper}), {});
  add("plain causal GQA", {2, 4, 7, 2, 1, 4},
      fd_deberta(rng, 2, 4, {.max_relative_positions = 3, .p2c = DebertaP2c::kModel}),
      {.causal = true});
  add("log buckets, sparse positions", {2, 4, 6, 2, 1, 4},
      fd_deberta(rng, 2, 4,
                 {.max_relative_positions = 12, .position_buckets = 6, .p2c = DebertaP2c::kPaper}),
      {}, shared({0, 7, 16, 30}), shared({1, 2, 9, 15, 25, 40}));
  add("log buckets causal per-row", {2, 4, 6, 2, 2, 4},
      fd_deberta(rng, 2, 4,
                 {.max_relative_positions = 12, .position_buckets = 6, .p2c = DebertaP2c::kModel}),
      {.causal = true, .allow_fully_masked = true}, qrow, krow);
  add("log buckets float64 log, window", {2, 4, 6, 2, 2, 4},
      fd_deberta(rng, 2, 4,
                 {.max_relative_positions = 10,
                  .position_buckets = 4,
                  .float64_log = true,
                  .p2c = DebertaP2c::kPaper}),
      {.window = 20}, shared({0, 7, 16, 30}), shared({1, 2, 9, 15, 25, 40}));
  return cs;
}

TEST(AttentionBackward, OracleMatchesFiniteDifferences) {
  auto cs = fd_cases();
  uint64_t stream = 2000;
  for (auto& c : cs) check_finite_differences(c, ++stream);
}

// The DeBERTa and T5 cases above reach the branches they are meant to: log buckets, clamped
// rows and the last T5 bucket.
TEST(AttentionBackward, FiniteDifferenceCasesReachEveryBucketBranch) {
  const T5BucketConfig t5b{.num_buckets = 8, .max_distance = 10, .bidirectional = true};
  // |rel| = 200 > max_distance: the last bucket of its half.
  EXPECT_EQ(t5_bucket(200, t5b), 7);
  EXPECT_EQ(t5_bucket(-100, t5b), 3);
  const T5BucketConfig t5c{.num_buckets = 8, .max_distance = 12, .bidirectional = false};
  EXPECT_EQ(t5_bucket(-150, t5c), 7);
  EXPECT_GT(t5_bucket(-10, t5c), 4);  // the log range
  const DebertaBuckets db{.max_relative_positions = 12, .position_buckets = 6};
  // |rho| > mid = 3: log bucketed (not the identity), and beyond the span: clamped rows.
  EXPECT_NE(deberta_bucket(7, db), 7);
  EXPECT_EQ(deberta_c2p_index(40, 0, db), 2 * db.span() - 1);
  EXPECT_EQ(deberta_c2p_index(0, 40, db), 0);
}

// ---- 2. lse -------------------------------------------------------------------------------------

// log(sum(exp(s))) over the visible keys of one score row (-inf when none).
double masked_logsumexp(const std::vector<double>& scores, int64_t row, const Shape& s,
                        const AttentionOptions& o, const Positions& qp, const Positions& kp,
                        int64_t b) {
  double mx = -kInf;
  for (int64_t j = 0; j < s.seq_k; ++j) {
    if (visible(o, qp.at(b, row), kp.at(b, j))) {
      mx = std::max(mx, scores[static_cast<std::size_t>(row * s.seq_k + j)]);
    }
  }
  if (mx == -kInf) return -kInf;
  long double sum = 0;
  for (int64_t j = 0; j < s.seq_k; ++j) {
    if (visible(o, qp.at(b, row), kp.at(b, j))) {
      sum += std::exp(
          static_cast<long double>(scores[static_cast<std::size_t>(row * s.seq_k + j)] - mx));
    }
  }
  return mx + static_cast<double>(std::log(sum));
}

void check_lse(const Shape& s, const PositionScheme& scheme, const AttentionOptions& opt, Rng& rng,
               const Positions* qp = nullptr, const Positions* kp = nullptr,
               bool check_scores = true) {
  const auto q = randn<float>(rng, numel(qshape(s)));
  const auto k = randn<float>(rng, numel(kshape(s)));
  const auto v = randn<float>(rng, numel(kshape(s)));
  const auto qd = promote(q), kd = promote(k), vd = promote(v);
  std::vector<double> out(qd.size()), lse(numel(lshape(s)));
  ref::attention(cview(qd, qshape(s)), cview(kd, kshape(s)), cview(vd, kshape(s)), scheme, opt,
                 mview(out, qshape(s)), mview(lse, lshape(s)), qp, kp);
  const auto l = mview(lse, lshape(s));
  const Positions pq = query_positions(qp, s), pk = key_positions(kp);
  if (check_scores) {
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t h = 0; h < s.heads_q; ++h) {
        const auto sc = ref::attention_scores(cview(qd, qshape(s)), cview(kd, kshape(s)), scheme,
                                              opt, b, h, qp, kp);
        for (int64_t i = 0; i < s.seq_q; ++i) {
          const double want = masked_logsumexp(sc, i, s, opt, pq, pk, b);
          if (want == -kInf) {
            EXPECT_EQ(l(b, h, i), -kInf) << "b " << b << " h " << h << " i " << i;
          } else {
            EXPECT_NEAR(l(b, h, i), want, 1e-12 * std::max(1.0, std::abs(want)))
                << "b " << b << " h " << h << " i " << i;
          }
        }
      }
  }
  // Float32 forward: out and lse.
  std::vector<float> out32(q.size(), -5.0f), lse32(lse.size(), -5.0f);
  attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, opt,
            mview(out32, qshape(s)), mview(lse32, lshape(s)), qp, kp);
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t e = 0; e < lse.size(); ++e) {
    if (lse[e] == -kInf) {
      EXPECT_EQ(lse32[e], -std::numeric_limits<float>::infinity()) << "float32 lse at " << e;
      continue;
    }
    double r = std::abs(static_cast<double>(lse32[e]) - lse[e]) / std::max(1.0, std::abs(lse[e]));
    if (std::isnan(r)) r = kInf;
    if (r > worst) worst = r, at = e;
  }
  EXPECT_LE(worst, 1e-5) << "float32 lse at " << at << ": " << lse32[at] << " vs oracle "
                         << lse[at];
  // The float32 out with lse equals the out of the overload without it.
  std::vector<float> out_plain(q.size(), -5.0f);
  attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), scheme, opt,
            mview(out_plain, qshape(s)), qp, kp);
  EXPECT_EQ(out32, out_plain) << "out differs with and without lse";
}

TEST(AttentionBackward, LseMatchesScoresAndFloat32) {
  uint64_t stream = 3000;
  const auto kp =
      Positions::per_row({0, 3, 4, 8, 13, 20, 44, 45, 50, 1, 40, 5, 12, 30, 31, 32, 33, 60}, 2, 9);
  const auto qp = Positions::per_row({9, 2, 14, 5, 30, 3, 41, 12, 0, 70}, 2, 5);
  for (const auto& name : cases::kSchemes) {
    for (int variant = 0; variant < 4; ++variant) {
      Rng rng(posenc_test::test_seed(), ++stream);
      const Shape s{2, 5, 9, 4, 2, 8};
      const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), variant);
      SCOPED_TRACE(name + " variant " + std::to_string(variant) + " " + str(s) + " stream " +
                   std::to_string(stream) + " " + posenc_test::seed_trace());
      check_lse(s, box->scheme, {}, rng);
      check_lse(s, box->scheme, {.causal = true}, rng);
      // Explicit per-row positions, window, fully masked rows.
      check_lse(s, box->scheme, {.causal = true, .window = 6, .allow_fully_masked = true}, rng, &qp,
                &kp);
      check_lse(s, box->scheme, {.window = 3, .allow_fully_masked = true}, rng, &qp, &kp);
    }
  }
  // Several key tiles, and a decode step long enough for the split-and-merge path.
  for (const Shape s : {Shape{1, 130, 130, 4, 2, 16}, Shape{1, 1, 5000, 8, 2, 32}}) {
    for (const auto& name : cases::kSchemes) {
      Rng rng(posenc_test::test_seed(), ++stream);
      const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 1);
      SCOPED_TRACE(name + " " + str(s) + " stream " + std::to_string(stream) + " " +
                   posenc_test::seed_trace());
      check_lse(s, box->scheme, {.causal = true}, rng, nullptr, nullptr, s.seq_k < 1000);
      check_lse(s, box->scheme, {}, rng, nullptr, nullptr, false);
    }
  }
}

// ---- 3. merge ----------------------------------------------------------------------------------

TEST(AttentionBackward, MergeOfKeyPartsEqualsAttentionOverAllKeys) {
  uint64_t stream = 4000;
  const int64_t n = 9;
  const Shape s{2, 5, n, 4, 2, 8};
  // Global key ids (sparse) and query ids; in the causal case query 0 sees no key at all, and
  // others see none of one part.
  const std::vector<int64_t> key_ids = {1, 2, 3, 5, 8, 9, 11, 14, 15};
  const auto qp = Positions::shared({0, 4, 8, 13, 15});
  for (const auto& name : cases::kSchemes) {
    for (bool causal : {false, true}) {
      Rng rng(posenc_test::test_seed(), ++stream);
      const auto box =
          cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), static_cast<int>(stream % 4));
      const auto q = randn<float>(rng, numel(qshape(s)));
      const auto k = randn<float>(rng, numel(kshape(s)));
      const auto v = randn<float>(rng, numel(kshape(s)));
      const AttentionOptions opt{.causal = causal, .allow_fully_masked = true};
      const auto kp_all = Positions::shared(key_ids);
      std::vector<float> out(q.size()), lse(numel(lshape(s)));
      attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(v, kshape(s)), box->scheme, opt,
                mview(out, qshape(s)), mview(lse, lshape(s)), &qp, &kp_all);
      // Keys [lo, hi) of k and v as views into the full buffers.
      auto part = [&](const std::vector<float>& t, int64_t lo, int64_t hi) {
        auto view = cview(t, kshape(s));
        view.data += lo * view.stride[1];
        view.shape[1] = hi - lo;
        return view;
      };
      for (const int64_t m : {int64_t{1}, int64_t{2}, int64_t{4}, n - 1}) {
        SCOPED_TRACE(name + (causal ? " causal" : " bidirectional") + " split at " +
                     std::to_string(m) + " " + str(s) + " stream " + std::to_string(stream) + " " +
                     posenc_test::seed_trace());
        const auto kpa = Positions::shared({key_ids.begin(), key_ids.begin() + m});
        const auto kpb = Positions::shared({key_ids.begin() + m, key_ids.end()});
        std::vector<float> oa(q.size()), ob(q.size()), la(lse.size()), lb(lse.size());
        attention(cview(q, qshape(s)), part(k, 0, m), part(v, 0, m), box->scheme, opt,
                  mview(oa, qshape(s)), mview(la, lshape(s)), &qp, &kpa);
        attention(cview(q, qshape(s)), part(k, m, n), part(v, m, n), box->scheme, opt,
                  mview(ob, qshape(s)), mview(lb, lshape(s)), &qp, &kpb);
        std::vector<float> om(q.size(), -3.0f), lm(lse.size(), -3.0f);
        attention_merge(cview(oa, qshape(s)), cview(la, lshape(s)), cview(ob, qshape(s)),
                        cview(lb, lshape(s)), mview(om, qshape(s)), mview(lm, lshape(s)));
        // Some row is fully masked in one part (causal): the case is exercised.
        if (causal) {
          const bool some_inf =
              std::any_of(la.begin(), la.end(), [](float x) { return std::isinf(x); }) ||
              std::any_of(lb.begin(), lb.end(), [](float x) { return std::isinf(x); });
          EXPECT_TRUE(some_inf);
        }
        EXPECT_TRUE(posenc_test::all_close(om, out, 1e-5, 1e-5)) << "out";
        for (std::size_t e = 0; e < lse.size(); ++e) {
          if (std::isinf(lse[e])) {
            EXPECT_EQ(lm[e], lse[e]) << "lse at " << e;
          } else {
            EXPECT_NEAR(lm[e], lse[e], 1e-5 * std::max(1.0f, std::abs(lse[e]))) << "lse at " << e;
          }
        }
        // In place into the `a` buffers: the same bits.
        attention_merge(cview(oa, qshape(s)), cview(la, lshape(s)), cview(ob, qshape(s)),
                        cview(lb, lshape(s)), mview(oa, qshape(s)), mview(la, lshape(s)));
        EXPECT_EQ(oa, om) << "merge in place (out aliases out_a)";
        EXPECT_EQ(la, lm) << "merge in place (lse aliases lse_a)";
      }
    }
  }
}

// ---- 4. the float32 backward against the oracle -------------------------------------------------

struct F32Problem {
  Shape s;
  std::vector<float> q, k, v, dout, out, lse;
  std::vector<double> qd, kd, vd, doutd, outd, lsed;
};

// Random inputs; out and lse from the fused forward (float32) and from the oracle (float64, on
// the same float values promoted).
// bf16: q, k, v and dout rounded to bf16 values (bf16 training's widened operands).
F32Problem make_problem(const Shape& s, const PositionScheme& scheme, const AttentionOptions& opt,
                        Rng& rng, const Positions* qp, const Positions* kp, bool bf16 = false) {
  F32Problem p;
  p.s = s;
  p.q = randn<float>(rng, numel(qshape(s)));
  p.k = randn<float>(rng, numel(kshape(s)));
  p.v = randn<float>(rng, numel(kshape(s)));
  p.dout = randn<float>(rng, numel(qshape(s)));
  for (auto* x : {&p.q, &p.k, &p.v, &p.dout}) {
    for (float& e : *x) e = bf16 ? to_float(bf16_from_float(e)) : e;
  }
  p.qd = promote(p.q), p.kd = promote(p.k), p.vd = promote(p.v), p.doutd = promote(p.dout);
  p.out.assign(p.q.size(), -5.0f);
  p.lse.assign(numel(lshape(s)), -5.0f);
  attention(cview(p.q, qshape(s)), cview(p.k, kshape(s)), cview(p.v, kshape(s)), scheme, opt,
            mview(p.out, qshape(s)), mview(p.lse, lshape(s)), qp, kp);
  p.outd.assign(p.q.size(), 0.0);
  p.lsed.assign(p.lse.size(), 0.0);
  ref::attention(cview(p.qd, qshape(s)), cview(p.kd, kshape(s)), cview(p.vd, kshape(s)), scheme,
                 opt, mview(p.outd, qshape(s)), mview(p.lsed, lshape(s)), qp, kp);
  return p;
}

using BackwardFn = void (*)(View<const float, 4>, View<const float, 4>, View<const float, 4>,
                            View<const float, 4>, View<const float, 3>, View<const float, 4>,
                            const PositionScheme&, const AttentionOptions&, const AttentionGrads&,
                            const Positions*, const Positions*);

std::unique_ptr<Grads<float>> run_backward(BackwardFn fn, const F32Problem& p,
                                           const PositionScheme& scheme,
                                           const AttentionOptions& opt, const Positions* qp,
                                           const Positions* kp, float fill = 7.0f) {
  const Shape& s = p.s;
  auto g = make_grads<float>(s, scheme, fill, opt.sinks.data != nullptr);
  fn(cview(p.q, qshape(s)), cview(p.k, kshape(s)), cview(p.v, kshape(s)), cview(p.out, qshape(s)),
     cview(p.lse, lshape(s)), cview(p.dout, qshape(s)), scheme, opt, g->g, qp, kp);
  return g;
}

std::unique_ptr<Grads<double>> run_ref_backward(const F32Problem& p, const PositionScheme& scheme,
                                                const AttentionOptions& opt, const Positions* qp,
                                                const Positions* kp) {
  const Shape& s = p.s;
  auto g = make_grads<double>(s, scheme, 7.0, opt.sinks.data != nullptr);
  ref::attention_backward(cview(p.qd, qshape(s)), cview(p.kd, kshape(s)), cview(p.vd, kshape(s)),
                          cview(p.outd, qshape(s)), cview(p.lsed, lshape(s)),
                          cview(p.doutd, qshape(s)), scheme, opt, g->g, qp, kp);
  return g;
}

// max |fast - ref| <= 2 max |naive - ref| + 1e-6 max(1, max |ref|), tensor by tensor; fully
// masked rows (oracle lse -inf) have float32 lse -inf and zero dq.
void expect_within_twice_naive(const F32Problem& p, const Grads<float>& fast,
                               const Grads<float>& naive, const Grads<double>& ref) {
  ASSERT_EQ(fast.named.size(), ref.named.size());
  for (std::size_t t = 0; t < ref.named.size(); ++t) {
    const auto& [name, r] = ref.named[t];
    const double ef = max_abs_err(*fast.named[t].second, *r);
    const double en = max_abs_err(*naive.named[t].second, *r);
    double mag = 0;
    for (double x : *r) mag = std::max(mag, std::abs(x));
    EXPECT_LE(ef, 2 * en + 1e-6 * std::max(1.0, mag))
        << name << ": fast error " << ef << ", naive error " << en << ", max |ref| " << mag;
  }
  const Shape& s = p.s;
  const auto dq = cview(fast.dq, qshape(s));
  const auto l = cview(p.lsed, lshape(s));
  const auto l32 = cview(p.lse, lshape(s));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h)
      for (int64_t i = 0; i < s.seq_q; ++i) {
        if (l(b, h, i) != -kInf) continue;
        EXPECT_EQ(l32(b, h, i), -std::numeric_limits<float>::infinity());
        for (int64_t x = 0; x < s.dim; ++x) {
          EXPECT_EQ(dq(b, i, h, x), 0.0f) << "dq of fully masked row b " << b << " i " << i;
        }
      }
}

void check_backward(const Shape& s, const PositionScheme& scheme, const AttentionOptions& opt,
                    Rng& rng, const Positions* qp = nullptr, const Positions* kp = nullptr) {
  SCOPED_TRACE(scheme_name(scheme) + " " + str(s) + " " + str(opt));
  const auto p = make_problem(s, scheme, opt, rng, qp, kp);
  const auto ref = run_ref_backward(p, scheme, opt, qp, kp);
  const auto naive = run_backward(&attention_backward_naive, p, scheme, opt, qp, kp);
  const auto fast = run_backward(&attention_backward, p, scheme, opt, qp, kp);
  expect_within_twice_naive(p, *fast, *naive, *ref);
}

// Every scheme, causal and not, MHA / GQA 4 / GQA 8, sizes around the lane counts and the tiles
// (1, 2, 15, 16, 17, 63, 64, 65, 130) and Lq != Lk.
TEST(AttentionBackward, Float32MatchesOracleWithinTwiceNaiveError) {
  const std::vector<Shape> shapes = {
      {1, 1, 1, 1, 1, 1},      {1, 2, 2, 2, 2, 2},    {2, 15, 17, 8, 2, 16}, {1, 16, 16, 8, 1, 12},
      {1, 17, 65, 8, 8, 8},    {2, 63, 64, 8, 2, 8},  {1, 64, 65, 8, 1, 16}, {1, 65, 130, 4, 4, 8},
      {1, 130, 130, 8, 2, 16}, {1, 2, 130, 8, 1, 32},
  };
  uint64_t stream = 5000;
  for (const auto& s : shapes) {
    for (const auto& name : cases::kSchemes) {
      for (bool causal : {false, true}) {
        ++stream;
        if (name == "rope" && s.dim < 2) continue;
        Rng rng(posenc_test::test_seed(), stream);
        SCOPED_TRACE("stream " + std::to_string(stream) + " variant " + std::to_string(stream % 4) +
                     " " + posenc_test::seed_trace());
        const auto box =
            cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), static_cast<int>(stream % 4));
        check_backward(s, box->scheme, {.causal = causal}, rng);
      }
    }
  }
}

// Explicit shared, per-row, sparse and unsorted positions, windows, fully masked rows, Lq > Lk,
// and positions too far apart for the fused forward's int32 distance tables.
TEST(AttentionBackward, Float32PositionsWindowsAndMaskedRows) {
  uint64_t stream = 6000;
  {
    const Shape s{2, 5, 70, 4, 2, 16};
    std::vector<int64_t> kids(2 * 70);
    for (int64_t j = 0; j < 70; ++j) {
      kids[static_cast<std::size_t>(j)] = 3 * j;        // gaps
      kids[static_cast<std::size_t>(70 + j)] = 69 - j;  // descending
    }
    const auto kp = Positions::per_row(kids, 2, 70);
    const auto qp = Positions::per_row({0, 50, 100, 150, 400, 10, 20, 30, 40, 500}, 2, 5);
    for (const auto& name : cases::kSchemes) {
      for (bool causal : {false, true}) {
        for (int64_t window : {0, 9}) {
          Rng rng(posenc_test::test_seed(), ++stream);
          SCOPED_TRACE("per-row sparse, stream " + std::to_string(stream) + " " +
                       posenc_test::seed_trace());
          const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 1);
          AttentionOptions opt{.causal = causal, .allow_fully_masked = true};
          if (window) opt.window = window;
          check_backward(s, box->scheme, opt, rng, &qp, &kp);
        }
      }
    }
  }
  {
    // Lq > Lk with shared explicit positions (queries interleaved with the keys).
    const Shape s{2, 20, 7, 8, 2, 8};
    const auto qp = Positions::shared(iota_ids(20));
    const auto kp = Positions::shared(iota_ids(7, 0, 3));
    for (const auto& name : cases::kSchemes) {
      Rng rng(posenc_test::test_seed(), ++stream);
      SCOPED_TRACE("Lq > Lk, stream " + std::to_string(stream) + " " + posenc_test::seed_trace());
      const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 2);
      check_backward(s, box->scheme, {.causal = true}, rng, &qp, &kp);
      check_backward(s, box->scheme, {.causal = true, .window = 4, .allow_fully_masked = true}, rng,
                     &qp, &kp);
    }
  }
  {
    // Query rows on alternating sides of a causal tile's diagonal (positions 10 and 100 against
    // keys 0..127): the second tile's rows that see a key form more runs than the backward
    // tracks, so its products take every row.
    const Shape s{1, 40, 128, 2, 1, 16};
    std::vector<int64_t> qids(40);
    for (int64_t i = 0; i < 40; ++i) qids[static_cast<std::size_t>(i)] = i % 2 == 0 ? 10 : 100;
    const auto qp = Positions::shared(qids);
    const auto kp = Positions::shared(iota_ids(128));
    for (const auto& name : cases::kSchemes) {
      Rng rng(posenc_test::test_seed(), ++stream);
      SCOPED_TRACE("alternating rows, stream " + std::to_string(stream) + " " +
                   posenc_test::seed_trace());
      const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 1);
      check_backward(s, box->scheme, {.causal = true}, rng, &qp, &kp);
    }
  }
  {
    // Positions about 2^40 apart: the forward takes the simple path.
    const Shape s{1, 4, 6, 2, 1, 8};
    const int64_t far = int64_t{1} << 40;
    const auto qp = Positions::shared({3, 10, far + 2, far + 9});
    const auto kp = Positions::shared({0, 2, 9, far, far + 1, far + 5});
    for (const auto& name : cases::kSchemes) {
      Rng rng(posenc_test::test_seed(), ++stream);
      SCOPED_TRACE("far positions, stream " + std::to_string(stream) + " " +
                   posenc_test::seed_trace());
      const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 1);
      check_backward(s, box->scheme, {.causal = true}, rng, &qp, &kp);
      check_backward(s, box->scheme, {}, rng, &qp, &kp);
    }
  }
}

// Groups whose query blocks are not a multiple of 4 rows per head (3 and 5 query heads per kv
// head), and Shaw / DeBERTa tables longer than one 64-row chunk, shared and per head.
TEST(AttentionBackward, OddGroupsAndLongRelativeTables) {
  uint64_t stream = 6500;
  for (const Shape& s : {Shape{1, 70, 90, 6, 2, 12}, Shape{2, 40, 40, 5, 1, 7}}) {
    for (bool causal : {false, true}) {
      for (int variant = 0; variant < 4; ++variant) {
        Rng rng(posenc_test::test_seed(), ++stream);
        SCOPED_TRACE("stream " + std::to_string(stream) + " " + posenc_test::seed_trace());
        auto& e = rng.engine();
        // Shaw K = 40: 81 table rows, shared (variant 0, 2) or per head (1, 3).
        const int64_t k = 40, th = variant % 2 ? s.heads_q : 1;
        const auto rk = cases::randn_f(e, (2 * k + 1) * th * s.dim, 0.5);
        const auto rv = cases::randn_f(e, (2 * k + 1) * th * s.dim, 0.5);
        Shaw shaw{View<const float, 3>::contiguous(rk.data(), {2 * k + 1, th, s.dim}), {}};
        if (variant < 2) {
          shaw.rel_v = View<const float, 3>::contiguous(rv.data(), {2 * k + 1, th, s.dim});
        }
        check_backward(s, shaw, {.causal = causal}, rng);
        // DeBERTa with 2K = 100 rows (log buckets past 20) in both p2c forms.
        DebertaBuckets cfg{.max_relative_positions = 50, .position_buckets = variant < 2 ? 0 : 40};
        cfg.p2c = variant % 2 ? DebertaP2c::kModel : DebertaP2c::kPaper;
        const int64_t span = cfg.span();
        const auto pk = cases::randn_f(e, 2 * span * s.heads_q * s.dim, 0.5);
        const auto pq = cases::randn_f(e, 2 * span * s.heads_q * s.dim, 0.5);
        const DeBERTa deb{View<const float, 3>::contiguous(pk.data(), {2 * span, s.heads_q, s.dim}),
                          View<const float, 3>::contiguous(pq.data(), {2 * span, s.heads_q, s.dim}),
                          cfg};
        check_backward(s, deb, {.causal = causal}, rng);
      }
    }
  }
}

// Attention sinks and chunked local attention on the fused path: every scheme, causal and not,
// chunks smaller than and equal to the key tile, with a window, against the oracle;
// bit-identical for 1 and 3 threads.
TEST(AttentionBackward, SinksAndChunksOnTheFusedPath) {
  uint64_t stream = 6700;
  for (const Shape& s : {Shape{2, 70, 130, 4, 2, 16}, Shape{1, 17, 40, 3, 1, 8}}) {
    for (const auto& name : cases::kSchemes) {
      for (int mode = 0; mode < 4; ++mode) {
        Rng rng(posenc_test::test_seed(), ++stream);
        SCOPED_TRACE("mode " + std::to_string(mode) + " stream " + std::to_string(stream) + " " +
                     posenc_test::seed_trace());
        const auto box =
            cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), static_cast<int>(stream % 4));
        const auto sinks = cases::randn_f(rng.engine(), s.heads_q, 1.5);
        AttentionOptions opt{.causal = mode % 2 == 0};
        if (mode != 1) opt.sinks = View<const float, 1>::contiguous(sinks.data(), {s.heads_q});
        if (mode >= 1) opt.chunk = mode == 3 ? 64 : 7;
        if (mode == 2) opt.window = 5;
        check_backward(s, box->scheme, opt, rng);
        // Thread-count invariance with these options.
        const auto p = make_problem(s, box->scheme, opt, rng, nullptr, nullptr);
        opt.num_threads = 1;
        const auto g1 = run_backward(&attention_backward, p, box->scheme, opt, nullptr, nullptr);
        opt.num_threads = 3;
        const auto g3 = run_backward(&attention_backward, p, box->scheme, opt, nullptr, nullptr);
        EXPECT_TRUE(same_bits(*g1, *g3));
      }
    }
  }
}

// Decoupled RoPE (Rope::offset, DeepSeek's [nope | rope] heads) on the fused path: gradients
// against the oracle, and the forward against RoPE applied by hand to the rotated dims only.
TEST(AttentionBackward, DecoupledRopeOffset) {
  uint64_t stream = 6900;
  for (const Shape& s : {Shape{2, 70, 130, 4, 2, 24}, Shape{1, 17, 40, 3, 1, 12}}) {
    for (const int64_t offset : {int64_t{8}, int64_t{4}}) {
      for (const RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
        Rng rng(posenc_test::test_seed(), ++stream);
        SCOPED_TRACE("offset " + std::to_string(offset) + " stream " + std::to_string(stream) +
                     " " + posenc_test::seed_trace());
        RopeConfig cfg;
        cfg.head_dim = s.dim - offset;
        const Rope rope{rope_frequencies(cfg), style, offset};
        check_backward(s, rope, {.causal = true}, rng);
        // Forward: the same as rotating dims [offset, D) by hand and attending without positions.
        const auto p = make_problem(s, rope, {.causal = true}, rng, nullptr, nullptr);
        const auto ud = [](int64_t i) { return static_cast<std::size_t>(i); };
        const auto rotate = [&](const std::vector<float>& x, std::array<int64_t, 4> shape,
                                const Positions& pos) {
          std::vector<float> part, out = x;
          const int64_t rows = shape[0] * shape[1] * shape[2], w = s.dim - offset;
          part.resize(static_cast<std::size_t>(rows * w));
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < w; ++c) part[ud(r * w + c)] = x[ud(r * s.dim + offset + c)];
          std::vector<float> rot(part.size());
          std::array<int64_t, 4> ps = shape;
          ps[3] = w;
          apply_rope(rope.freqs, style, View<const float, 4>::contiguous(part.data(), ps),
                     View<float, 4>::contiguous(rot.data(), ps), &pos);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < w; ++c) out[ud(r * s.dim + offset + c)] = rot[ud(r * w + c)];
          return out;
        };
        const std::array<int64_t, 4> qs{s.batch, s.seq_q, s.heads_q, s.dim},
            ks{s.batch, s.seq_k, s.heads_kv, s.dim};
        // Default positions: keys at j, queries at seq_k - seq_q + i.
        const std::vector<float> qr = rotate(p.q, qs, Positions::offset(s.seq_k - s.seq_q)),
                                 kr = rotate(p.k, ks, Positions::offset(0));
        std::vector<float> want(p.q.size()), got(p.q.size());
        attention(View<const float, 4>::contiguous(qr.data(), qs),
                  View<const float, 4>::contiguous(kr.data(), ks),
                  View<const float, 4>::contiguous(p.v.data(), ks), NoPositions{}, {.causal = true},
                  View<float, 4>::contiguous(want.data(), qs));
        attention(View<const float, 4>::contiguous(p.q.data(), qs),
                  View<const float, 4>::contiguous(p.k.data(), ks),
                  View<const float, 4>::contiguous(p.v.data(), ks), rope, {.causal = true},
                  View<float, 4>::contiguous(got.data(), qs));
        for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << i;
      }
    }
  }
  // The rotated dims must fit the head.
  const Shape s{1, 2, 2, 1, 1, 8};
  Rng rng(posenc_test::test_seed(), 6999);
  RopeConfig cfg;
  cfg.head_dim = 6;
  const auto p = make_problem(s, NoPositions{}, {}, rng, nullptr, nullptr);
  std::vector<float> out(p.q.size());
  const std::array<int64_t, 4> sh{1, 2, 1, 8};
  for (const int64_t offset : {int64_t{4}, int64_t{-1}}) {
    EXPECT_THROW(attention(View<const float, 4>::contiguous(p.q.data(), sh),
                           View<const float, 4>::contiguous(p.k.data(), sh),
                           View<const float, 4>::contiguous(p.v.data(), sh),
                           Rope{rope_frequencies(cfg), RopeStyle::kHalf, offset}, {},
                           View<float, 4>::contiguous(out.data(), sh)),
                 Error);
  }
}

// Every Highway target compiled into the library and supported here.
TEST(AttentionBackward, Float32EveryCompiledSimdTarget) {
  const Shape s{1, 33, 77, 4, 2, 24};
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    SimdTargetScope scope(target);
    uint64_t stream = 7000;
    for (const auto& name : cases::kSchemes) {
      for (bool causal : {false, true}) {
        Rng rng(posenc_test::test_seed(), ++stream);
        SCOPED_TRACE("stream " + std::to_string(stream) + " " + posenc_test::seed_trace());
        const auto box =
            cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), static_cast<int>(stream % 4));
        check_backward(s, box->scheme, {.causal = causal}, rng);
      }
    }
  }
}

// Bit-identical gradients for 1, 2 and 3 threads (prefill and a decode-like shape).
// The backward forms an item's key operands once when they fit a per-thread budget, tile by tile
// otherwise (long sequences): the second path on small shapes, by a zero budget.
TEST(AttentionBackward, TileByTileKeyOperands) {
  struct Budget {
    Budget() { kernels::set_backward_item_budget_for_test(0); }
    ~Budget() { kernels::set_backward_item_budget_for_test(-1); }
  } budget;
  uint64_t stream = 9000;
  for (const Shape& s :
       {Shape{2, 33, 77, 4, 2, 24}, Shape{1, 65, 130, 8, 1, 12}, Shape{1, 17, 17, 2, 2, 16}}) {
    for (const auto& name : cases::kSchemes) {
      for (bool causal : {false, true}) {
        Rng rng(posenc_test::test_seed(), ++stream);
        SCOPED_TRACE("stream " + std::to_string(stream) + " " + posenc_test::seed_trace());
        const auto box =
            cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), static_cast<int>(stream % 4));
        AttentionOptions opt{.causal = causal};
        if (causal) opt.window = 40;
        check_backward(s, box->scheme, opt, rng);
      }
    }
  }
}

// attention_backward does not zero dq, dk and dv before the fused kernel, which writes every
// element of them: gradients holding NaN beforehand come out bit-identical to gradients holding
// 7, for every scheme, causal, windowed and unmasked, GQA, rows that see no key, both forms of
// the key operands (formed once per item, and tile by tile) and 1 and 3 threads.
TEST(AttentionBackward, WritesEveryElementOfTheGradients) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  uint64_t stream = 8500;
  for (const int64_t budget : {int64_t{-1}, int64_t{0}}) {
    kernels::set_backward_item_budget_for_test(budget);
    for (const Shape& s :
         {Shape{2, 33, 77, 4, 2, 24}, Shape{1, 65, 70, 8, 1, 16}, Shape{1, 3, 5, 2, 2, 8}}) {
      for (const auto& name : cases::kSchemes) {
        for (int variant = 0; variant < 3; ++variant) {
          Rng rng(posenc_test::test_seed(), ++stream);
          SCOPED_TRACE(name + " variant " + std::to_string(variant) + " " + str(s) + " budget " +
                       std::to_string(budget) + " " + posenc_test::seed_trace());
          const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), variant);
          AttentionOptions opt;
          opt.causal = variant != 0;
          if (variant == 2) opt.window = 9;
          opt.num_threads = variant == 1 ? 3 : 1;
          // Keys placed after the first queries: under the causal mask those rows see none
          // (output and gradient 0).
          const Positions kp = Positions::offset(2);
          const Positions* k_positions = variant == 1 ? &kp : nullptr;
          opt.allow_fully_masked = variant == 1;
          const auto p = make_problem(s, box->scheme, opt, rng, nullptr, k_positions);
          const auto g7 =
              run_backward(&attention_backward, p, box->scheme, opt, nullptr, k_positions);
          const auto gn =
              run_backward(&attention_backward, p, box->scheme, opt, nullptr, k_positions, nan);
          EXPECT_TRUE(same_bits(*gn, *g7));
        }
      }
    }
  }
  kernels::set_backward_item_budget_for_test(-1);
}

TEST(AttentionBackward, ThreadCountDoesNotChangeGradients) {
  uint64_t stream = 8000;
  for (const Shape s : {Shape{2, 70, 90, 4, 2, 16}, Shape{1, 3, 300, 8, 1, 16}}) {
    for (const auto& name : cases::kSchemes) {
      for (int variant : {1, 2}) {
        Rng rng(posenc_test::test_seed(), ++stream);
        SCOPED_TRACE(name + " variant " + std::to_string(variant) + " " + str(s) + " stream " +
                     std::to_string(stream) + " " + posenc_test::seed_trace());
        const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), variant);
        const AttentionOptions base{.causal = variant == 1};
        const auto p = make_problem(s, box->scheme, base, rng, nullptr, nullptr);
        std::unique_ptr<Grads<float>> first;
        for (int threads : {1, 2, 3}) {
          AttentionOptions opt = base;
          opt.num_threads = threads;
          auto g = run_backward(&attention_backward, p, box->scheme, opt, nullptr, nullptr);
          if (!first) {
            first = std::move(g);
          } else {
            EXPECT_TRUE(same_bits(*g, *first)) << threads << " threads vs 1";
          }
        }
      }
    }
  }
}

// Probabilities far below 2^-126: ALiBi with steep slopes over 300 keys (exp(-2 * 299) of the
// farthest), where P, dS and their products pass through the subnormal range, which the
// backward's items flush to zero (kernels/float_env.h). The gradients stay within twice the
// naive float32 error of the float64 oracle; and the floating-point environment of the caller's
// thread and of every worker thread is what it was before the call (subnormal results kept).
TEST(AttentionBackward, SubnormalProbabilitiesAndTheCallersFloatEnvironment) {
  const auto subnormals_kept = [] {
    volatile float tiny = 1e-38f;  // normal; half of it is subnormal
    const float half = tiny * 0.5f;
    return half != 0.0f;
  };
  ASSERT_TRUE(subnormals_kept());
  uint64_t stream = 8500;
  for (const Shape s : {Shape{1, 300, 300, 4, 4, 16}, Shape{2, 70, 300, 4, 2, 8}}) {
    for (bool causal : {true, false}) {
      for (int threads : {1, 3}) {
        Rng rng(posenc_test::test_seed(), ++stream);
        SCOPED_TRACE(str(s) + " causal " + std::to_string(causal) + " threads " +
                     std::to_string(threads) + " " + posenc_test::seed_trace());
        const PositionScheme scheme = Alibi{{2.0, 1.0, 0.5, 0.25}};
        check_backward(s, scheme, {.causal = causal, .num_threads = threads}, rng);
        EXPECT_TRUE(subnormals_kept()) << "the calling thread";
        std::vector<int> kept(static_cast<size_t>(threads), 0);
        kernels::for_each_thread(threads,
                                 [&](int t) { kept[static_cast<size_t>(t)] = subnormals_kept(); });
        for (int t = 0; t < threads; ++t)
          EXPECT_TRUE(kept[static_cast<size_t>(t)]) << "thread " << t;
      }
    }
  }
}

// bf16 operands (q, k, v and dout holding bf16 values, as bf16 training widens them) with
// POSENC_BF16_DOT=1 on a processor with AVX512_BF16: the backward's score tiles S and dP, and
// the forward's S, come from vdpbf16ps. Every scheme, causal and not, GQA, odd head dims, the
// causal diagonal's partial tiles, Lq != Lk, both forms of the backward's key operands: the
// gradients within twice the naive float32 error of the float64 oracle, the output within twice
// the float32 kernel's, 1 and 3 threads bit-identical, and different bits from the float32 path
// (the path ran) except where it must not run: RoPE and Transformer-XL (float32 rows), operands
// that are not bf16 values, and a subnormal bf16 value among them (vdpbf16ps would read it as 0).
TEST(AttentionBackward, Bf16OperandsByVdpbf16ps) {
  if (!kernels::bf16_dot_supported()) GTEST_SKIP() << "no AVX512_BF16 on this processor";
  struct Mode {
    ~Mode() {
      kernels::set_bf16_dot_for_test(-1);
      kernels::set_backward_item_budget_for_test(-1);
    }
  } restore;
  const auto run = [](int mode, const F32Problem& p, const PositionScheme& scheme,
                      const AttentionOptions& opt) {
    kernels::set_bf16_dot_for_test(mode);
    return run_backward(&attention_backward, p, scheme, opt, nullptr, nullptr);
  };
  const auto forward = [](int mode, const F32Problem& p, const PositionScheme& scheme,
                          const AttentionOptions& opt) {
    kernels::set_bf16_dot_for_test(mode);
    std::vector<float> out(p.q.size(), -5.0f);
    attention(cview(p.q, qshape(p.s)), cview(p.k, kshape(p.s)), cview(p.v, kshape(p.s)), scheme,
              opt, mview(out, qshape(p.s)));
    return out;
  };
  uint64_t stream = 8700;
  for (const int64_t budget : {int64_t{-1}, int64_t{0}}) {
    kernels::set_backward_item_budget_for_test(budget);
    for (const Shape& s : {Shape{1, 130, 130, 8, 2, 32}, Shape{2, 33, 77, 4, 2, 17},
                           Shape{1, 65, 70, 2, 2, 128}, Shape{1, 5, 9, 4, 1, 2}}) {
      for (const auto& name : cases::kSchemes) {
        for (bool causal : {false, true}) {
          Rng rng(posenc_test::test_seed(), ++stream);
          SCOPED_TRACE(name + " " + str(s) + (causal ? " causal" : "") + " budget " +
                       std::to_string(budget) + " " + posenc_test::seed_trace());
          const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(),
                                              static_cast<int>(stream % 4));
          const PositionScheme& scheme = box->scheme;
          AttentionOptions opt{.causal = causal};
          const auto p = make_problem(s, scheme, opt, rng, nullptr, nullptr, /*bf16=*/true);
          const auto ref = run_ref_backward(p, scheme, opt, nullptr, nullptr);
          const auto naive =
              run_backward(&attention_backward_naive, p, scheme, opt, nullptr, nullptr);
          const auto off = run(0, p, scheme, opt);
          const auto on = run(1, p, scheme, opt);
          expect_within_twice_naive(p, *on, *naive, *ref);
          const auto out_off = forward(0, p, scheme, opt);
          const auto out_on = forward(1, p, scheme, opt);
          double mag = 0;
          for (double x : p.outd) mag = std::max(mag, std::abs(x));
          EXPECT_LE(max_abs_err(out_on, p.outd),
                    2 * max_abs_err(out_off, p.outd) + 1e-6 * std::max(1.0, mag));
          opt.num_threads = 3;
          EXPECT_TRUE(same_bits(*run(1, p, scheme, opt), *on)) << "3 threads vs 1";
          EXPECT_EQ(forward(1, p, scheme, opt), out_on) << "forward, 3 threads vs 1";
          const bool float_rows = name == "rope" || name == "xl";
          if (float_rows) {
            EXPECT_TRUE(same_bits(*on, *off)) << "RoPE / XL rows are float32: no vdpbf16ps";
            EXPECT_EQ(out_on, out_off) << "forward: RoPE / XL rows are float32";
          } else if (s.dim >= 8) {
            EXPECT_FALSE(same_bits(*on, *off)) << "the vdpbf16ps tiles did not run";
            EXPECT_NE(out_on, out_off) << "the forward's vdpbf16ps tiles did not run";
          }
          if (float_rows || s.dim < 8 || HasFailure()) continue;
          // One operand element off the bf16 grid, or a subnormal bf16 value: the float32 path.
          for (const float odd : {1.0f + 0x1p-20f, 0x1p-130f}) {
            F32Problem p2 = p;
            p2.k[p2.k.size() / 2] = odd;
            EXPECT_TRUE(same_bits(*run(1, p2, scheme, opt), *run(0, p2, scheme, opt)))
                << "k holds " << odd;
            EXPECT_EQ(forward(1, p2, scheme, opt), forward(0, p2, scheme, opt))
                << "forward, k holds " << odd;
          }
        }
      }
    }
  }
}

// Gradient views with padded, permuted (non-contiguous) layouts are written in place and nothing
// outside them is touched; inputs as strided views too.
TEST(AttentionBackward, StridedViews) {
  const Shape s{2, 9, 21, 4, 2, 8};
  uint64_t stream = 8500;
  for (const auto& name : cases::kSchemes) {
    Rng rng(posenc_test::test_seed(), ++stream);
    SCOPED_TRACE(name + " " + str(s) + " stream " + std::to_string(stream) + " " +
                 posenc_test::seed_trace());
    const auto box = cases::make_scheme(name, s.heads_q, s.dim, rng.engine(), 1);
    const AttentionOptions opt{.causal = true};
    const auto p = make_problem(s, box->scheme, opt, rng, nullptr, nullptr);
    const auto ref = run_ref_backward(p, box->scheme, opt, nullptr, nullptr);
    const auto naive =
        run_backward(&attention_backward_naive, p, box->scheme, opt, nullptr, nullptr);
    using posenc_test::Strided;
    const std::array<std::size_t, 4> perm = {0, 2, 1, 3};  // [B, H, L, D] storage
    Strided<float, 4> q(qshape(s), p.q, 2, perm), k(kshape(s), p.k, 1), v(kshape(s), p.v, 3, perm),
        out(qshape(s), p.out, 1), dout(qshape(s), p.dout, 2, perm);
    Strided<float, 3> lse(lshape(s), p.lse, 2, {2, 0, 1});
    Strided<float, 4> dq(qshape(s), 2, perm), dk(kshape(s), 1), dv(kshape(s), 2, perm);
    AttentionGrads g;
    g.dq = dq.view(), g.dk = dk.view(), g.dv = dv.view();
    // The scheme's parameter gradients: padded 2-D / 3-D views.
    std::vector<std::unique_ptr<Strided<float, 2>>> p2;
    std::vector<std::unique_ptr<Strided<float, 3>>> p3;
    auto grad2 = [&](View<float, 2>& view, std::array<int64_t, 2> sh) {
      p2.push_back(std::make_unique<Strided<float, 2>>(sh, 2, std::array<std::size_t, 2>{1, 0}));
      view = p2.back()->view();
      return p2.back().get();
    };
    auto grad3 = [&](View<float, 3>& view, std::array<int64_t, 3> sh) {
      p3.push_back(std::make_unique<Strided<float, 3>>(sh, 1));
      view = p3.back()->view();
      return p3.back().get();
    };
    Strided<float, 1> dslopes({s.heads_q}, 2, {0}, 2);  // non-unit stride
    if (const auto* t = std::get_if<T5Bias>(&box->scheme)) {
      grad2(g.drelative_attention_bias, t->table.shape);
    } else if (std::holds_alternative<Alibi>(box->scheme)) {
      g.dslopes = dslopes.view();
    } else if (const auto* sh = std::get_if<Shaw>(&box->scheme)) {
      grad3(g.drel_k, sh->rel_k.shape);
      grad3(g.drel_v, sh->rel_v.shape);
    } else if (const auto* xl = std::get_if<TransformerXL>(&box->scheme)) {
      grad2(g.dr_w_bias, xl->r_w_bias.shape);
      grad2(g.dr_r_bias, xl->r_r_bias.shape);
      grad2(g.dr_net, xl->r_net.shape);
    } else if (const auto* db = std::get_if<DeBERTa>(&box->scheme)) {
      grad3(g.dpos_key, db->pos_key.shape);
      grad3(g.dpos_query, db->pos_query.shape);
    }
    attention_backward(q.cview(), k.cview(), v.cview(), out.cview(), lse.cview(), dout.cview(),
                       box->scheme, opt, g);
    // Same order as make_grads: dq, dk, dv, then the parameters.
    Grads<float> fast;
    fast.dq = dq.values(), fast.dk = dk.values(), fast.dv = dv.values();
    fast.named = {{"dq", &fast.dq}, {"dk", &fast.dk}, {"dv", &fast.dv}};
    std::vector<std::vector<float>> params;
    params.reserve(4);
    for (const auto& x : p2) params.push_back(x->values());
    for (const auto& x : p3) params.push_back(x->values());
    if (g.dslopes.data) params.push_back(dslopes.values());
    for (std::size_t t = 0; t < params.size(); ++t) {
      fast.named.emplace_back(ref->named[3 + t].first, &params[t]);
    }
    expect_within_twice_naive(p, fast, *naive, *ref);
    EXPECT_TRUE(dq.outside_untouched() && dk.outside_untouched() && dv.outside_untouched());
    EXPECT_TRUE(dslopes.outside_untouched());
    for (const auto& x : p2) EXPECT_TRUE(x->outside_untouched()) << x->describe();
    for (const auto& x : p3) EXPECT_TRUE(x->outside_untouched()) << x->describe();
  }
}

// ---- 5. validation
// -------------------------------------------------------------------------------

template <class E, class F>
void expect_error(F&& f, const std::string& needle, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no exception";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << what << ": the message \"" << e.what() << "\" does not name " << needle;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": wrong exception type: " << e.what();
  }
}

template <class T>
struct BackwardArgs {
  View<const T, 4> q, k, v, out;
  View<const T, 3> lse;
  View<const T, 4> dout;
  AttentionGradsOf<T> g;
};

// Every malformed argument of one backward entry point (`call`), on a small T5 problem.
template <class T, class Call>
void check_backward_validation(const std::string& api, Call&& call) {
  const Shape s{1, 3, 4, 2, 1, 4};
  Rng rng(posenc_test::test_seed(), 9000);
  const auto t5 = cases::make_scheme("t5", s.heads_q, s.dim, rng.engine());
  const auto shaw_box = fd_shaw(rng, 1, 1, 0, s.dim);  // no rel_v
  const auto q = randn<T>(rng, numel(qshape(s)));
  const auto k = randn<T>(rng, numel(kshape(s)));
  const auto v = randn<T>(rng, numel(kshape(s)));
  const auto dout = randn<T>(rng, numel(qshape(s)));
  const std::vector<T> out(q.size(), T(0.1));
  std::vector<T> lse(numel(lshape(s)), T(1));
  std::vector<T> big(4096, T(0)), big2(4096, T(0));
  const auto base_grads = make_grads<T>(s, t5->scheme);
  const BackwardArgs<T> ok{cview(q, qshape(s)),   cview(k, kshape(s)),   cview(v, kshape(s)),
                           cview(out, qshape(s)), cview(lse, lshape(s)), cview(dout, qshape(s)),
                           base_grads->g};
  const std::array<int64_t, 4> bad4 = {1, 3, 2, 5};
  const std::array<int64_t, 4> bad4k = {1, 4, 2, 4};  // kv heads 2 instead of 1
  SCOPED_TRACE(api);
  // The valid call passes.
  EXPECT_NO_THROW(call(ok, t5->scheme));
  auto with = [&](auto mutate) {
    BackwardArgs<T> a = ok;
    mutate(a);
    return a;
  };
  auto shape_case = [&](auto mutate, const std::string& needle) {
    const auto a = with(mutate);
    expect_error<ShapeError>([&] { call(a, t5->scheme); }, needle, "wrong shape of " + needle);
  };
  shape_case([&](auto& a) { a.g.dq = View<T, 4>::contiguous(big.data(), bad4); }, "dq");
  shape_case([&](auto& a) { a.g.dk = View<T, 4>::contiguous(big.data(), bad4k); }, "dk");
  shape_case([&](auto& a) { a.g.dv = View<T, 4>::contiguous(big.data(), bad4); }, "dv");
  shape_case([&](auto& a) { a.g.dq = View<T, 4>{}; }, "dq");  // missing
  shape_case([&](auto& a) { a.dout = View<const T, 4>::contiguous(big2.data(), bad4); }, "dout");
  shape_case([&](auto& a) { a.out = View<const T, 4>::contiguous(big2.data(), bad4); }, "out");
  shape_case(
      [&](auto& a) {
        a.lse = View<const T, 3>::contiguous(big2.data(), {s.batch, s.seq_q, s.heads_q});
      },
      "lse");
  shape_case(
      [&](auto& a) {
        a.g.drelative_attention_bias = View<T, 2>::contiguous(
            big.data(), {s.heads_q, static_cast<int64_t>(t5->a.size()) / s.heads_q});
      },
      "drelative_attention_bias");
  // Gradients of parameters the scheme does not have.
  auto value_case = [&](auto mutate, const std::string& needle, const PositionScheme& scheme) {
    const auto a = with(mutate);
    expect_error<ValueError>([&] { call(a, scheme); }, needle,
                             needle + " for " + scheme_name(scheme));
  };
  value_case(
      [&](auto& a) {
        a.g.drel_k = View<T, 3>::contiguous(big.data(), {3, 1, 4});
      },
      "drel_k", t5->scheme);
  value_case([&](auto& a) { a.g.dslopes = View<T, 1>::contiguous(big.data(), {2}); }, "dslopes",
             t5->scheme);
  value_case(
      [&](auto& a) {
        a.g.dr_net = View<T, 2>::contiguous(big.data(), {8, 4});
      },
      "dr_net", t5->scheme);
  value_case(
      [&](auto& a) {
        a.g.dpos_key = View<T, 3>::contiguous(big.data(), {4, 2, 4});
      },
      "dpos_key", t5->scheme);
  {
    // drelative_attention_bias without T5 (NoPositions), drel_v for a Shaw without rel_v.
    const auto a = ok;
    expect_error<ValueError>([&] { call(a, NoPositions{}); }, "drelative_attention_bias",
                             "drelative_attention_bias for none");
    const auto b = with([&](auto& x) {
      x.g.drelative_attention_bias = {};
      x.g.drel_k = View<T, 3>::contiguous(big.data(), {3, 1, 4});
      x.g.drel_v = View<T, 3>::contiguous(big2.data(), {3, 1, 4});
    });
    expect_error<ValueError>([&] { call(b, shaw_box->scheme); }, "drel_v",
                             "drel_v for shaw without rel_v");
  }
  // Non-finite lse (NaN, +inf) and dout.
  for (const T bad : {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity()}) {
    std::vector<T> l2 = lse;
    l2[2] = bad;
    const auto a = with([&](auto& x) { x.lse = cview(l2, lshape(s)); });
    expect_error<ValueError>([&] { call(a, t5->scheme); }, "lse", "lse " + std::to_string(bad));
  }
  {
    std::vector<T> d2 = dout;
    d2[5] = std::numeric_limits<T>::quiet_NaN();
    const auto a = with([&](auto& x) { x.dout = cview(d2, qshape(s)); });
    expect_error<ValueError>([&] { call(a, t5->scheme); }, "dout", "NaN in dout");
  }
}

TEST(AttentionBackward, ValidationNamesTheArgument) {
  auto float_call = [](BackwardFn fn) {
    return [fn](const BackwardArgs<float>& a, const PositionScheme& scheme) {
      fn(a.q, a.k, a.v, a.out, a.lse, a.dout, scheme, {}, a.g, nullptr, nullptr);
    };
  };
  check_backward_validation<float>("attention_backward", float_call(&attention_backward));
  check_backward_validation<float>("attention_backward_naive",
                                   float_call(&attention_backward_naive));
  check_backward_validation<double>(
      "ref::attention_backward", [](const BackwardArgs<double>& a, const PositionScheme& scheme) {
        ref::attention_backward(a.q, a.k, a.v, a.out, a.lse, a.dout, scheme, {}, a.g);
      });
}

TEST(AttentionBackward, ValidationOfLseAndMerge) {
  const Shape s{1, 3, 4, 2, 1, 4};
  Rng rng(posenc_test::test_seed(), 9100);
  const auto q = randn<float>(rng, numel(qshape(s)));
  const auto k = randn<float>(rng, numel(kshape(s)));
  const auto qd = promote(q), kd = promote(k);
  std::vector<float> out(q.size()), lse(numel(lshape(s))), big(256);
  std::vector<double> outd(q.size()), bigd(256);
  // Forward lse of the wrong shape ([B, Lq, Hq] instead of [B, Hq, Lq]).
  expect_error<ShapeError>(
      [&] {
        attention(cview(q, qshape(s)), cview(k, kshape(s)), cview(k, kshape(s)), NoPositions{}, {},
                  mview(out, qshape(s)),
                  View<float, 3>::contiguous(big.data(), {s.batch, s.seq_q, s.heads_q}));
      },
      "lse", "attention: lse shape");
  expect_error<ShapeError>(
      [&] {
        ref::attention(cview(qd, qshape(s)), cview(kd, kshape(s)), cview(kd, kshape(s)),
                       NoPositions{}, {}, mview(outd, qshape(s)),
                       View<double, 3>::contiguous(bigd.data(), {s.batch, s.seq_q, s.heads_q}));
      },
      "lse", "ref::attention: lse shape");
  // Merge: shapes and non-finite lse.
  std::vector<float> oa(q.size(), 0.5f), ob(q.size(), 0.25f), la(lse.size(), 1.0f),
      lb(lse.size(), 2.0f);
  auto merge = [&](View<const float, 3> lsa, View<const float, 3> lsb, View<const float, 4> outb) {
    attention_merge(cview(oa, qshape(s)), lsa, outb, lsb, mview(out, qshape(s)),
                    mview(lse, lshape(s)));
  };
  EXPECT_NO_THROW(merge(cview(la, lshape(s)), cview(lb, lshape(s)), cview(ob, qshape(s))));
  expect_error<ShapeError>(
      [&] {
        merge(cview(la, lshape(s)),
              View<const float, 3>::contiguous(big.data(), {s.batch, s.seq_q, s.heads_q}),
              cview(ob, qshape(s)));
      },
      "lse_b", "merge: lse_b shape");
  expect_error<ShapeError>(
      [&] {
        merge(cview(la, lshape(s)), cview(lb, lshape(s)),
              View<const float, 4>::contiguous(big.data(), {1, 3, 2, 5}));
      },
      "out_b", "merge: out_b shape");
  la[1] = std::numeric_limits<float>::quiet_NaN();
  expect_error<ValueError>(
      [&] { merge(cview(la, lshape(s)), cview(lb, lshape(s)), cview(ob, qshape(s))); }, "lse",
      "merge: NaN lse_a");
  la[1] = std::numeric_limits<float>::infinity();
  expect_error<ValueError>(
      [&] { merge(cview(la, lshape(s)), cview(lb, lshape(s)), cview(ob, qshape(s))); }, "lse",
      "merge: +inf lse_a");
  // Both sides -inf: out 0, lse -inf.
  la.assign(la.size(), -std::numeric_limits<float>::infinity());
  lb.assign(lb.size(), -std::numeric_limits<float>::infinity());
  merge(cview(la, lshape(s)), cview(lb, lshape(s)), cview(ob, qshape(s)));
  for (float x : out) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
}

// ---- 6. RoPE's inverse is its transpose; learned_backward --------------------------------------

TEST(RopeBackward, InverseIsTransposeOfForward) {
  const std::array<int64_t, 4> sh = {2, 5, 3, 10};
  const auto pos = Positions::per_row({0, 1, 2, 1000, 100000, 7, 7, 65536, 3, 999999}, 2, 5);
  uint64_t stream = 9500;
  for (const RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    for (const int64_t rotary : {int64_t{10}, int64_t{6}}) {
      for (const double af : {1.0, 1.7}) {
        Rng rng(posenc_test::test_seed(), ++stream);
        auto freqs = rope_frequencies({.head_dim = sh[3], .rotary_dim = rotary, .base = 1e4});
        freqs.attention_factor = af;
        SCOPED_TRACE(std::string(style == RopeStyle::kHalf ? "half" : "interleaved") +
                     " rotary_dim " + std::to_string(rotary) + " af " + std::to_string(af) +
                     " stream " + std::to_string(stream) + " " + posenc_test::seed_trace());
        const auto x = randn<float>(rng, numel(sh)), y = randn<float>(rng, numel(sh));
        // float64 oracle: <R x, y> = <x, R^T y> to double rounding.
        {
          const auto xd = promote(x), yd = promote(y);
          std::vector<double> rx(xd.size()), ry(yd.size());
          ref::apply_rope(freqs, style, cview(xd, sh), mview(rx, sh), &pos);
          ref::apply_rope(freqs, style, cview(yd, sh), mview(ry, sh), &pos, Direction::kInverse);
          double a = 0, b = 0, mag = 0;
          for (std::size_t i = 0; i < xd.size(); ++i) {
            a += rx[i] * yd[i];
            b += xd[i] * ry[i];
            mag += std::abs(rx[i] * yd[i]) + std::abs(xd[i] * ry[i]);
          }
          EXPECT_NEAR(a, b, 1e-14 * mag) << "float64";
        }
        // float32 (SIMD kernel on every target): each output rounded once, so the two inner
        // products differ by at most their rounding, 2^-24 relative per term (2x margin).
        for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
          SimdTargetScope scope(target);
          std::vector<float> rx(x.size()), ry(y.size());
          apply_rope(freqs, style, cview(x, sh), mview(rx, sh), &pos);
          apply_rope(freqs, style, cview(y, sh), mview(ry, sh), &pos, Direction::kInverse);
          double a = 0, b = 0, mag = 0;
          for (std::size_t i = 0; i < x.size(); ++i) {
            a += static_cast<double>(rx[i]) * y[i];
            b += static_cast<double>(x[i]) * ry[i];
            mag += std::abs(static_cast<double>(rx[i]) * y[i]) +
                   std::abs(static_cast<double>(x[i]) * ry[i]);
          }
          EXPECT_NEAR(a, b, std::ldexp(mag, -23)) << hwy::TargetName(target);
        }
      }
    }
  }
}

// learned_backward is the gradient of L(W) = sum(dy * add_learned(W, x)): with x = 0 the
// forward gathers W exactly, so dL/dW[p, c] = L(e_pc), computed through add_learned itself.
TEST(LearnedBackward, IsTheGradientOfAddLearned) {
  const int64_t batch = 2, seq = 7, dim = 6, rows = 10;
  Rng rng(posenc_test::test_seed(), 9600);
  SCOPED_TRACE(posenc_test::seed_trace());
  const auto pos = Positions::per_row({3, 3, 0, 9, 3, 1, 1, 5, 5, 5, 2, 9, 9, 0}, batch, seq);
  const auto dy = randn<float>(rng, static_cast<std::size_t>(batch * seq * dim));
  // Accumulates into the given table.
  std::vector<float> dtable(static_cast<std::size_t>(rows * dim), 0.5f);
  learned_backward(View<const float, 3>::contiguous(dy.data(), {batch, seq, dim}),
                   View<float, 2>::contiguous(dtable.data(), {rows, dim}), &pos);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < dim; ++c) {
      std::vector<float> e(static_cast<std::size_t>(rows * dim), 0.0f);
      e[static_cast<std::size_t>(r * dim + c)] = 1.0f;
      std::vector<float> x(dy.size(), 0.0f);
      add_learned(View<const float, 2>::contiguous(e.data(), {rows, dim}),
                  View<float, 3>::contiguous(x.data(), {batch, seq, dim}), &pos);
      double want = 0, mag = 0.5;
      for (std::size_t i = 0; i < x.size(); ++i) {
        want += static_cast<double>(dy[i]) * x[i];
        mag += std::abs(static_cast<double>(dy[i]) * x[i]);
      }
      EXPECT_NEAR(dtable[static_cast<std::size_t>(r * dim + c)] - 0.5, want, 4 * mag * 0x1p-24)
          << "row " << r << " column " << c;
    }
  }
}

}  // namespace
