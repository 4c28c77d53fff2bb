// src/attention/reference.cc - the materialized attention, forward and backward, one row of
// scores at a time: T = double is the float64 oracle (posenc::ref::attention,
// ref::attention_backward, ref::attention_scores), T = float the simple float32 path
// (attention_naive, attention_backward_naive, and the fallback of the fused path). Straight from
// the formulas of docs/attention.md: s = scale * (q·k + the term's content) + the term's bias;
// mask; softmax over keys (sinks in the denominator); sum of values (+ the term's value part).
// Each scheme's part is its term (src/schemes/*_term.h).
#include "attention/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "attention/block_mask.h"
#include "attention/model_inputs.h"
#include "attention/prepared.h"
#include "posenc/size.h"

namespace posenc {
namespace attn {

namespace {

template <class T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

// The rows a cell's scores read: q and k, or their rotated copies.
template <class T>
struct Rows {
  const T* q;
  std::array<int64_t, 4> qs;
  const T* k;
  std::array<int64_t, 4> ks;

  Rows(const Problem<T>& pr, const Prepared<T>& p) {
    const Dims& d = pr.d;
    if (p.q_rot.empty()) {
      q = pr.q.data, qs = pr.q.stride;
      k = pr.k.data, ks = pr.k.stride;
    } else {
      q = p.q_rot.data();
      qs = {d.seq_q * d.heads_q * d.head_dim, d.heads_q * d.head_dim, d.head_dim, 1};
      k = p.k_rot.data();
      ks = {d.seq_k * d.heads_kv * d.head_dim, d.heads_kv * d.head_dim, d.head_dim, 1};
    }
  }
  Cell<T> cell(const Problem<T>& pr, int64_t b, int64_t h, int64_t i, int64_t j) const {
    const int64_t hk = h / pr.d.group;
    return Cell<T>{b,
                   h,
                   hk,
                   i,
                   j,
                   pr.qp.at(b, i),
                   pr.kp.at(b, j),
                   pr.d.head_dim,
                   q + b * qs[0] + i * qs[1] + h * qs[2],
                   qs[3],
                   k + b * ks[0] + j * ks[1] + hk * ks[2],
                   ks[3]};
  }
};

// Scores of query i against every key (row of length seq_k), before masking.
// The cap in T: a double cap outside float's normal range is clamped to it in the float path
// (0 would divide by zero, infinity make cap * tanh(0) NaN; docs/attention.md, Soft-capping).
template <class T>
T capped_value(double cap) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<float>(std::clamp<double>(cap, std::numeric_limits<float>::min(),
                                                 std::numeric_limits<float>::max()));
  } else {
    return static_cast<T>(cap);
  }
}

// cap * tanh(x / cap); in float, x itself where |x / cap| < 2^-12 (tanh(y) = y to float's
// precision there, and a subnormal quotient would lose it).
template <class T>
T soft_cap(T x, T cap) {
  const T y = x / cap;
  if constexpr (std::is_same_v<T, float>) {
    if (std::abs(y) < 1.0f / 4096.0f) return x;
  }
  return cap * std::tanh(y);
}

template <class T, class Term>
void score_row(const Problem<T>& pr, const Prepared<T>& p, const Term& term, const Rows<T>& rows,
               int64_t b, int64_t h, int64_t i, T* s) {
  const T scale = static_cast<T>(p.scale);
  for (int64_t j = 0; j < pr.d.seq_k; ++j) {
    const Cell<T> c = rows.cell(pr, b, h, i, j);
    T content = 0;
    for (int64_t x = 0; x < c.dim; ++x) content += c.q(x) * c.k(x);
    T bias = 0;
    term.score(c, content, bias);
    s[j] = scale * content + bias;
  }
  if (pr.opt.softcap) {
    const T cap = capped_value<T>(*pr.opt.softcap);
    for (int64_t j = 0; j < pr.d.seq_k; ++j) s[j] = soft_cap(s[j], cap);
  }
}

[[noreturn]] void fail_fully_masked(int64_t b, int64_t i, int64_t pq) {
  fail("attention: query " + std::to_string(i) + " (batch " + std::to_string(b) + ", position " +
       std::to_string(pq) +
       ") sees no key under the mask; allow_fully_masked gives 0 for such rows");
}

template <class T, class Term>
void forward_rows(const Problem<T>& pr, const Prepared<T>& p, const Term& term, View<T, 4> out,
                  const View<T, 3>* lse) {
  const Dims& d = pr.d;
  const TokenMask mask = make_token_mask(pr);
  const Rows<T> rows(pr, p);
  std::vector<T> s(static_cast<std::size_t>(d.seq_k));
  std::vector<T> acc(static_cast<std::size_t>(d.head_dim));
  const auto& v = pr.v;
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.heads_q; ++h) {
      const int64_t hk = h / d.group;
      for (int64_t i = 0; i < d.seq_q; ++i) {
        score_row(pr, p, term, rows, b, h, i, s.data());
        const int64_t pq = pr.qp.at(b, i);
        T mx = kNegInf<T>;
        for (int64_t j = 0; j < d.seq_k; ++j) {
          if (!mask.visible(b, i, j, pq, pr.kp.at(b, j))) {
            s[static_cast<std::size_t>(j)] = kNegInf<T>;
          } else {
            mx = std::max(mx, s[static_cast<std::size_t>(j)]);
          }
        }
        T* o = out.data + b * out.stride[0] + i * out.stride[1] + h * out.stride[2];
        const bool sink = !p.sinks.empty();
        const T sink_logit = sink ? p.sinks[static_cast<std::size_t>(h)] : T(0);
        if (mx == kNegInf<T>) {
          // Only the sink in the denominator (no value vector: out = 0, lse = sink), or no key.
          if (!sink && !pr.opt.allow_fully_masked) fail_fully_masked(b, i, pq);
          for (int64_t c = 0; c < d.head_dim; ++c) o[c * out.stride[3]] = T(0);
          if (lse) (*lse)(b, h, i) = sink ? sink_logit : kNegInf<T>;
          continue;
        }
        if (sink) mx = std::max(mx, sink_logit);
        T sum = 0;
        for (auto& x : s) {
          x = x == kNegInf<T> ? T(0) : std::exp(x - mx);
          sum += x;
        }
        if (sink) sum += std::exp(sink_logit - mx);  // the sink: in the denominator only
        if (lse) (*lse)(b, h, i) = mx + std::log(sum);
        std::fill(acc.begin(), acc.end(), T(0));
        for (int64_t j = 0; j < d.seq_k; ++j) {
          const T a = s[static_cast<std::size_t>(j)];
          if (a == T(0)) continue;
          const T* vr = v.data + b * v.stride[0] + j * v.stride[1] + hk * v.stride[2];
          for (int64_t c = 0; c < d.head_dim; ++c) {
            acc[static_cast<std::size_t>(c)] += a * vr[c * v.stride[3]];
          }
          if constexpr (Term::kValues) term.value(rows.cell(pr, b, h, i, j), a, acc.data());
        }
        const T inv = T(1) / sum;
        for (int64_t c = 0; c < d.head_dim; ++c) {
          o[c * out.stride[3]] = acc[static_cast<std::size_t>(c)] * inv;
        }
      }
    }
  }
}

// The materialized backward, one score row at a time. For row i of head h:
// P_j = exp(s_ij - lse_i) on visible keys, dP_j = dout_i . (v_j + the term's value part),
// D_i = dout_i . out_i, dS_j = P_j (dP_j - D_i); then dS passes to q, k (content) and the term.
template <class T, class Term>
void backward_rows(const Problem<T>& pr, const Prepared<T>& p, const Term& term,
                   const View<const T, 4>& out, const View<const T, 3>& lse,
                   const View<const T, 4>& dout, const AttentionGradsOf<T>& g) {
  const Dims& d = pr.d;
  const TokenMask mask = make_token_mask(pr);
  const Rows<T> rows(pr, p);
  const int64_t dim = d.head_dim;
  const auto ud = [](int64_t x) { return static_cast<std::size_t>(x); };
  const T scale = static_cast<T>(p.scale);
  const bool capped = pr.opt.softcap.has_value();
  const T cap = capped_value<T>(pr.opt.softcap.value_or(1.0));
  // Rotated q and k (RoPE): their gradients first, rotated back by the term at the end.
  const bool rotated = !p.q_rot.empty();
  std::vector<T> dq_rot, dk_rot;
  View<T, 4> dq = g.dq, dk = g.dk;
  if (rotated) {
    dq_rot.assign(ud(pr.q.numel()), T(0));
    dk_rot.assign(ud(pr.k.numel()), T(0));
    dq = View<T, 4>::contiguous(dq_rot.data(), pr.q.shape);
    dk = View<T, 4>::contiguous(dk_rot.data(), pr.k.shape);
  }
  std::vector<T> s(ud(d.seq_k)), dq_acc(ud(dim));
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.heads_q; ++h) {
      const int64_t hk = h / d.group;
      for (int64_t i = 0; i < d.seq_q; ++i) {
        const T l = lse(b, h, i);
        if (l == kNegInf<T>) continue;  // no visible key
        score_row(pr, p, term, rows, b, h, i, s.data());
        const int64_t pq = pr.qp.at(b, i);
        const T* dorow = &dout(b, i, h, 0);
        const int64_t dos = dout.stride[3];
        T dsum = 0;  // D_i
        for (int64_t c = 0; c < dim; ++c) dsum += dout(b, i, h, c) * out(b, i, h, c);
        // The sink: probability exp(sink - lse) and no value, so dS_sink = -P_sink D_i.
        if (!p.sinks.empty() && g.dsinks.data != nullptr) {
          g.dsinks(h) -= std::exp(p.sinks[ud(h)] - l) * dsum;
        }
        std::fill(dq_acc.begin(), dq_acc.end(), T(0));
        for (int64_t j = 0; j < d.seq_k; ++j) {
          if (!mask.visible(b, i, j, pq, pr.kp.at(b, j))) continue;
          const T pj = std::exp(s[ud(j)] - l);
          if (pj == T(0)) continue;
          const Cell<T> c = rows.cell(pr, b, h, i, j);
          // dP and the value-side gradients.
          T dp = 0;
          for (int64_t x = 0; x < dim; ++x) {
            dp += dout(b, i, h, x) * pr.v(b, j, hk, x);
            g.dv(b, j, hk, x) += pj * dout(b, i, h, x);
          }
          term.value_dp(c, dorow, dos, dp);
          T ds = pj * (dp - dsum);
          if (capped) {
            // d(cap tanh(x / cap)) / dx = 1 - tanh^2, from the capped score.
            const T t = s[ud(j)] / cap;
            ds *= T(1) - t * t;
          }
          const T sds = scale * ds;
          // The content term q . k (XL: (q + u) . k).
          CellGrads<T> cg{dq_acc.data(), &dk(b, j, hk, 0), dk.stride[3], dorow, dos, g};
          for (int64_t x = 0; x < dim; ++x) {
            dq_acc[ud(x)] += sds * c.k(x);
            cg.dk(x) += sds * term.key_query(c, x);
          }
          term.grad(c, pj, ds, sds, cg);
        }
        for (int64_t x = 0; x < dim; ++x) dq(b, i, h, x) += dq_acc[ud(x)];
      }
    }
  }
  term.finish_grads(pr, g, View<const T, 4>(dq), View<const T, 4>(dk));
}

// Every row of scores of one (batch row, query head): [seq_q, seq_k].
template <class T>
void score_rows(const Problem<T>& pr, const Prepared<T>& p, int64_t b, int64_t h, T* s) {
  const Rows<T> rows(pr, p);
  std::visit(
      [&](const auto& term) {
        for (int64_t i = 0; i < pr.d.seq_q; ++i) {
          score_row(pr, p, term, rows, b, h, i, s + i * pr.d.seq_k);
        }
      },
      p.term);
}

template <class T, std::size_t R>
void zero(const View<T, R>& v) {
  if (v.data != nullptr) detail::fill_view(v, T(0));
}

}  // namespace

template <class T>
void zero_qkv_grads(const AttentionGradsOf<T>& g) {
  zero(g.dq), zero(g.dk), zero(g.dv);
}

template <class T>
void run(const Problem<T>& pr, const Prepared<T>& p, View<T, 4> out, const View<T, 3>* lse) {
  std::visit([&](const auto& term) { forward_rows(pr, p, term, out, lse); }, p.term);
}

template <class T>
void run_backward(const Problem<T>& pr, const Prepared<T>& p, const View<const T, 4>& out,
                  const View<const T, 3>& lse, const View<const T, 4>& dout,
                  const AttentionGradsOf<T>& g) {
  std::visit([&](const auto& term) { backward_rows(pr, p, term, out, lse, dout, g); }, p.term);
}

template <class T>
void check_backward_args(const Problem<T>& pr, const PositionScheme& scheme, const Prepared<T>& p,
                         const View<const T, 4>& out, const View<const T, 3>& lse,
                         const View<const T, 4>& dout, const AttentionGradsOf<T>& g,
                         bool zero_qkv) {
  const Dims& d = pr.d;
  const std::string w = "attention_backward: ";
  require_grad(out, pr.q.shape, w + "out");
  require_grad(dout, pr.q.shape, w + "dout");
  require_grad(lse, {d.batch, d.heads_q, d.seq_q}, w + "lse [batch, heads_q, seq_q]");
  require_grad(g.dq, pr.q.shape, w + "dq");
  require_grad(g.dk, pr.k.shape, w + "dk");
  require_grad(g.dv, pr.v.shape, w + "dv");
  detail::require_all_finite(out, w + "out", pr.opt.num_threads);
  detail::require_all_finite(dout, w + "dout", pr.opt.num_threads);
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.heads_q; ++h)
      for (int64_t i = 0; i < d.seq_q; ++i) {
        const T x = lse(b, h, i);
        if (std::isnan(x) || x == std::numeric_limits<T>::infinity()) {
          fail(w + "lse: " + detail::num(static_cast<double>(x)) + " at [" + std::to_string(b) +
               ", " + std::to_string(h) + ", " + std::to_string(i) +
               "] (finite, or -inf for a row with no visible key)");
        }
      }
  // The term's parameter gradients (shapes as the call computes with them, the oracle's float64
  // tables included); any other parameter gradient given is not the scheme's.
  GradCheck<T> chk{w, {}};
  std::visit([&](const auto& term) { term.check_grads(g, chk); }, p.term);
  const auto owned = [&](const void* data) {
    return std::find(chk.owned.begin(), chk.owned.end(), data) != chk.owned.end();
  };
  const std::pair<const void*, const char*> params[] = {
      {g.drelative_attention_bias.data, "drelative_attention_bias"},
      {g.dslopes.data, "dslopes [heads_q]"},
      {g.drel_k.data, "drel_k"},
      {g.drel_v.data, "drel_v"},
      {g.dr_w_bias.data, "dr_w_bias"},
      {g.dr_r_bias.data, "dr_r_bias"},
      {g.dr_net.data, "dr_net"},
      {g.dpos_key.data, "dpos_key"},
      {g.dpos_query.data, "dpos_query"}};
  for (const auto& [data, name] : params) {
    if (data != nullptr && !owned(data)) {
      fail(w + name + " is not a parameter of scheme " + scheme_name(scheme));
    }
  }
  if (g.dsinks.data != nullptr && p.sinks.empty()) {
    fail(w + "dsinks given but the attention has no sinks (AttentionOptions::sinks)");
  }
  if (g.dsinks.data != nullptr) require_grad(g.dsinks, {d.heads_q}, w + "dsinks [heads_q]");
  if (zero_qkv) zero_qkv_grads(g);
  zero(g.drelative_attention_bias), zero(g.dslopes);
  zero(g.drel_k), zero(g.drel_v), zero(g.dr_w_bias), zero(g.dr_r_bias), zero(g.dr_net);
  zero(g.dpos_key), zero(g.dpos_query), zero(g.dsinks);
}

template void run(const Problem<float>&, const Prepared<float>&, View<float, 4>,
                  const View<float, 3>*);
template void run(const Problem<double>&, const Prepared<double>&, View<double, 4>,
                  const View<double, 3>*);
template void run_backward(const Problem<float>&, const Prepared<float>&,
                           const View<const float, 4>&, const View<const float, 3>&,
                           const View<const float, 4>&, const AttentionGradsOf<float>&);
template void check_backward_args(const Problem<float>&, const PositionScheme&,
                                  const Prepared<float>&, const View<const float, 4>&,
                                  const View<const float, 3>&, const View<const float, 4>&,
                                  const AttentionGradsOf<float>&, bool);
template void zero_qkv_grads(const AttentionGradsOf<float>&);

namespace {

template <class T>
void backward_materialized(View<const T, 4> q, View<const T, 4> k, View<const T, 4> v,
                           View<const T, 4> out, View<const T, 3> lse, View<const T, 4> dout,
                           const PositionScheme& scheme, const AttentionOptions& options,
                           const AttentionGradsOf<T>& grads, const Positions* query_positions,
                           const Positions* key_positions,
                           const ref::SchemeTables* tables = nullptr) {
  auto pr = make_problem<T>(q, k, v, q.shape, options, query_positions, key_positions);
  const auto p = prepare<T>(scheme, options, pr.d, q, k, pr.qp, pr.kp, true, tables);
  check_backward_args(pr, scheme, p, out, lse, dout, grads);
  run_backward<T>(pr, p, out, lse, dout, grads);
}

}  // namespace
}  // namespace attn

using attn::make_problem;
using attn::prepare;
using attn::require_grad;
using attn::run;

void attention_backward_naive(View<const float, 4> q, View<const float, 4> k,
                              View<const float, 4> v, View<const float, 4> out,
                              View<const float, 3> lse, View<const float, 4> dout,
                              const PositionScheme& scheme, const AttentionOptions& options,
                              const AttentionGrads& grads, const Positions* query_positions,
                              const Positions* key_positions) {
  const auto self = [](auto&&... a) { attention_backward_naive(a...); };
  if (detail::backward_model_inputs(self, q, k, v, out, lse, dout, scheme, options, grads,
                                    query_positions, key_positions)) {
    return;
  }
  attn::backward_materialized<float>(q, k, v, out, lse, dout, scheme, options, grads,
                                     query_positions, key_positions);
}

void attention_naive(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
                     const PositionScheme& scheme, const AttentionOptions& options,
                     View<float, 4> out, const Positions* query_positions,
                     const Positions* key_positions) {
  if (detail::forward_model_inputs(q, k, v, scheme, options, out, query_positions,
                                   [&](auto qv, auto vv, const AttentionOptions& o, auto ov) {
                                     attention_naive(qv, k, vv, scheme, o, ov, query_positions,
                                                     key_positions);
                                   })) {
    return;
  }
  detail::require_data(out, "attention_naive: out");
  auto pr = make_problem<float>(q, k, v, out.shape, options, query_positions, key_positions);
  const auto p = prepare<float>(scheme, options, pr.d, q, k, pr.qp, pr.kp);
  run<float>(pr, p, out, nullptr);
}

namespace ref {

void attention(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<double, 4> out,
               const Positions* query_positions, const Positions* key_positions) {
  attention(q, k, v, scheme, options, SchemeTables{}, out, query_positions, key_positions);
}

void attention(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<double, 4> out,
               View<double, 3> lse, const Positions* query_positions,
               const Positions* key_positions) {
  attention(q, k, v, scheme, options, SchemeTables{}, out, lse, query_positions, key_positions);
}

void attention_backward(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
                        View<const double, 4> out, View<const double, 3> lse,
                        View<const double, 4> dout, const PositionScheme& scheme,
                        const AttentionOptions& options, const AttentionGradsOf<double>& grads,
                        const Positions* query_positions, const Positions* key_positions) {
  attention_backward(q, k, v, out, lse, dout, scheme, options, SchemeTables{}, grads,
                     query_positions, key_positions);
}

void attention(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options,
               const SchemeTables& tables, View<double, 4> out, const Positions* query_positions,
               const Positions* key_positions) {
  if (detail::forward_model_inputs(
          q, k, v, scheme, options, out, query_positions,
          [&](auto qv, auto vv, const AttentionOptions& o, auto ov) {
            attention(qv, k, vv, scheme, o, tables, ov, query_positions, key_positions);
          },
          tables.rel_v.data != nullptr)) {
    return;
  }
  detail::require_data(out, "ref::attention: out");
  auto pr = make_problem<double>(q, k, v, out.shape, options, query_positions, key_positions);
  const auto p = prepare<double>(scheme, options, pr.d, q, k, pr.qp, pr.kp, true, &tables);
  run<double>(pr, p, out, nullptr);
}

void attention(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options,
               const SchemeTables& tables, View<double, 4> out, View<double, 3> lse,
               const Positions* query_positions, const Positions* key_positions) {
  if (detail::forward_model_inputs(
          q, k, v, scheme, options, out, query_positions,
          [&](auto qv, auto vv, const AttentionOptions& o, auto ov) {
            attention(qv, k, vv, scheme, o, tables, ov, lse, query_positions, key_positions);
          },
          tables.rel_v.data != nullptr)) {
    return;
  }
  detail::require_data(out, "ref::attention: out");
  auto pr = make_problem<double>(q, k, v, out.shape, options, query_positions, key_positions);
  require_grad(lse, {pr.d.batch, pr.d.heads_q, pr.d.seq_q},
               std::string("ref::attention: lse [batch, heads_q, seq_q]"));
  const auto p = prepare<double>(scheme, options, pr.d, q, k, pr.qp, pr.kp, true, &tables);
  run<double>(pr, p, out, &lse);
}

void attention_backward(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
                        View<const double, 4> out, View<const double, 3> lse,
                        View<const double, 4> dout, const PositionScheme& scheme,
                        const AttentionOptions& options, const SchemeTables& tables,
                        const AttentionGradsOf<double>& grads, const Positions* query_positions,
                        const Positions* key_positions) {
  if (detail::backward_model_inputs(
          q, k, v, out, dout, scheme, options, grads, query_positions,
          [&](auto qv, auto vv, auto ov, auto dov, const AttentionOptions& o, const auto& g) {
            attention_backward(qv, k, vv, ov, lse, dov, scheme, o, tables, g, query_positions,
                               key_positions);
          },
          tables.rel_v.data != nullptr)) {
    return;
  }
  attn::backward_materialized<double>(q, k, v, out, lse, dout, scheme, options, grads,
                                      query_positions, key_positions, &tables);
}

std::vector<double> attention_scores(View<const double, 4> q, View<const double, 4> k,
                                     const PositionScheme& scheme, const AttentionOptions& options,
                                     int64_t batch_index, int64_t head,
                                     const Positions* query_positions,
                                     const Positions* key_positions) {
  return attention_scores(q, k, scheme, options, SchemeTables{}, batch_index, head, query_positions,
                          key_positions);
}

std::vector<double> attention_scores(View<const double, 4> q, View<const double, 4> k,
                                     const PositionScheme& scheme, const AttentionOptions& options,
                                     const SchemeTables& tables, int64_t batch_index, int64_t head,
                                     const Positions* query_positions,
                                     const Positions* key_positions) {
  if (options.query_temperature) {
    const auto qs = detail::scale_query_rows<double>(
        q, detail::query_factors(*options.query_temperature, q.shape[0], q.shape[1], k.shape[1],
                                 query_positions));
    AttentionOptions plain = options;
    plain.query_temperature.reset();
    return attention_scores(qs.view(), k, scheme, plain, tables, batch_index, head, query_positions,
                            key_positions);
  }
  auto pr = make_problem<double>(q, k, k, q.shape, options, query_positions, key_positions);
  if (batch_index < 0 || batch_index >= pr.d.batch || head < 0 || head >= pr.d.heads_q) {
    attn::fail("attention_scores: batch_index/head out of range");
  }
  const auto p = prepare<double>(scheme, options, pr.d, q, k, pr.qp, pr.kp, true, &tables);
  checked_elements("attention_scores: the scores [seq_q, seq_k]",
                   {{"seq_q", pr.d.seq_q}, {"seq_k", pr.d.seq_k}}, sizeof(double));
  std::vector<double> s(static_cast<std::size_t>(pr.d.seq_q * pr.d.seq_k));
  attn::score_rows(pr, p, batch_index, head, s.data());
  return s;
}

}  // namespace ref
}  // namespace posenc
