// src/attention.cc - scaled dot-product attention with every positional scheme (SPEC §0, §3-§8).
//
// One implementation templated on the scalar type: T = double is the float64 oracle
// (posenc::ref::attention), T = float the simple float32 path (float accumulation). Both go one
// row of scores at a time (ref::attention_scores materializes a [seq_q, seq_k] block). The fused,
// tiled kernel of the next stage replaces the float32 path and is tested against the T = double
// instantiation.
//
// Score order (SPEC §0): s = scale * (q.k + relative-content terms) + bias; mask; softmax over
// keys; weighted sum of values (+ Shaw's value term).
#include "posenc/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

#include "common.h"

namespace posenc {

std::string scheme_name(const PositionScheme& scheme) {
  static const char* kNames[] = {"none", "rope", "alibi", "t5", "shaw", "xl", "deberta"};
  return kNames[scheme.index()];
}

namespace {

using detail::fail;

struct Dims {
  int64_t batch, seq_q, seq_k, heads_q, heads_kv, head_dim, group;
};

template <class T>
Dims validate_shapes(const View<const T, 4>& q, const View<const T, 4>& k,
                     const View<const T, 4>& v, const std::array<int64_t, 4>& out_shape) {
  detail::require_data(q, "attention: q");
  detail::require_data(k, "attention: k");
  detail::require_data(v, "attention: v");
  const std::string qs = shape_str(q.shape), ks = shape_str(k.shape), vs = shape_str(v.shape);
  if (k.shape != v.shape) {
    fail<ShapeError>("attention: k " + ks + " and v " + vs +
                     " must have the same shape [batch, seq_k, heads_kv, head_dim]");
  }
  if (q.shape[0] != k.shape[0]) {
    fail<ShapeError>("attention: q " + qs + " and k " + ks + " differ in batch");
  }
  if (q.shape[3] != k.shape[3]) {
    fail<ShapeError>("attention: q " + qs + " and k " + ks + " differ in head_dim");
  }
  if (q.shape[3] < 1) fail<ShapeError>("attention: head_dim must be >= 1 (q " + qs + ")");
  if (k.shape[2] < 1 || q.shape[2] < 1) {
    fail<ShapeError>("attention: heads must be >= 1 (q " + qs + ", k " + ks + ")");
  }
  if (q.shape[2] % k.shape[2] != 0) {
    fail<ShapeError>("attention: k: kv heads (" + std::to_string(k.shape[2]) +
                     ") must divide q heads (" + std::to_string(q.shape[2]) + ")");
  }
  if (out_shape != q.shape) {
    fail<ShapeError>("attention: out " + shape_str(out_shape) + " must have q's shape " + qs);
  }
  return Dims{q.shape[0],
              q.shape[1],
              k.shape[1],
              q.shape[2],
              k.shape[2],
              q.shape[3],
              q.shape[2] / k.shape[2]};
}

template <class V>
void require_table_shape(const V& t, const std::array<int64_t, V{}.shape.size()>& want,
                         const std::string& name) {
  detail::require_data(t, name);
  if (t.data == nullptr) fail<ShapeError>(name + " is missing");
  if (t.shape != want) {
    fail<ShapeError>(name + " has shape " + shape_str(t.shape) + ", expected " + shape_str(want));
  }
  detail::require_all_finite(t, name);
}

// Everything a scheme needs, validated and precomputed once per call (O(L) or O(L*K)).
template <class T>
struct Prepared {
  int kind = 0;  // PositionScheme index
  double scale = 1.0;
  // rope: rotated copies of q and k (contiguous [B, L, H, D]).
  std::vector<T> q_rot, k_rot;
  // alibi
  std::vector<double> slopes;
  // t5
  T5BucketConfig t5;
  View<const float, 2> t5_table;
  // shaw
  View<const float, 3> rel_k, rel_v;
  int64_t shaw_k = 0;
  // xl: projected r(delta) [H * D] per distance, built on demand before the loop.
  View<const float, 2> xl_u, xl_v, xl_rnet;
  double xl_base = 1e4;
  std::unordered_map<int64_t, std::vector<T>> xl_r;
  // deberta
  View<const float, 3> pos_key, pos_query;
  DebertaBuckets deberta;
};

template <class T>
Prepared<T> prepare(const PositionScheme& scheme, const AttentionOptions& opt, const Dims& d,
                    const View<const T, 4>& q, const View<const T, 4>& k, const Positions& qp,
                    const Positions& kp) {
  Prepared<T> p;
  p.kind = static_cast<int>(scheme.index());
  const double default_scale =
      1.0 / std::sqrt(static_cast<double>(std::holds_alternative<DeBERTa>(scheme) ? 3 : 1) *
                      static_cast<double>(d.head_dim));
  p.scale = opt.scale.value_or(default_scale);
  if (const auto* r = std::get_if<Rope>(&scheme)) {
    const auto& f = r->freqs;
    if (f.inv_freq.empty()) fail("attention: rope: freqs.inv_freq is empty");
    if (f.rotary_dim() > d.head_dim) {
      fail<ShapeError>("attention: rope: rotary_dim (" + std::to_string(f.rotary_dim()) +
                       ") exceeds head_dim (" + std::to_string(d.head_dim) + ")");
    }
    p.q_rot.resize(static_cast<std::size_t>(q.numel()));
    p.k_rot.resize(static_cast<std::size_t>(k.numel()));
    auto qo = View<T, 4>::contiguous(p.q_rot.data(), q.shape);
    auto ko = View<T, 4>::contiguous(p.k_rot.data(), k.shape);
    if constexpr (std::is_same_v<T, double>) {
      ref::apply_rope(f, r->style, q, qo, &qp);
      ref::apply_rope(f, r->style, k, ko, &kp);
    } else {
      apply_rope(f, r->style, q, qo, &qp);
      apply_rope(f, r->style, k, ko, &kp);
    }
  } else if (const auto* a = std::get_if<Alibi>(&scheme)) {
    if (a->slopes.empty()) {
      p.slopes = alibi_slopes(AlibiConfig{.heads = d.heads_q, .max_bias = a->max_bias});
    } else {
      if (static_cast<int64_t>(a->slopes.size()) != d.heads_q) {
        fail<ShapeError>("attention: alibi: " + std::to_string(a->slopes.size()) +
                         " slopes given for " + std::to_string(d.heads_q) + " query heads");
      }
      for (double s : a->slopes) detail::require_finite(s, "attention: alibi: slope");
      p.slopes = a->slopes;
    }
  } else if (const auto* t = std::get_if<T5Bias>(&scheme)) {
    if (t->table.data == nullptr)
      fail<ShapeError>("attention: t5: relative_attention_bias is missing");
    p.t5 = T5BucketConfig{.num_buckets = t->table.shape[0],
                          .max_distance = t->max_distance,
                          .bidirectional = t->bidirectional.value_or(!opt.causal)};
    validate(p.t5);
    require_table_shape(t->table, {p.t5.num_buckets, d.heads_q},
                        "attention: t5: relative_attention_bias [num_buckets, heads]");
    p.t5_table = t->table;
  } else if (const auto* s = std::get_if<Shaw>(&scheme)) {
    const int64_t rows = s->rel_k.shape[0];
    if (s->rel_k.data == nullptr) fail<ShapeError>("attention: shaw: rel_k is missing");
    if (rows < 1 || rows % 2 == 0) {
      fail<ShapeError>("attention: shaw: rel_k must have 2K+1 (odd) rows (got " +
                       std::to_string(rows) + ")");
    }
    const int64_t th = s->rel_k.shape[1];
    if (th != 1 && th != d.heads_q) {
      fail<ShapeError>("attention: shaw: rel_k heads (" + std::to_string(th) +
                       ") must be 1 (shared) or heads_q (" + std::to_string(d.heads_q) + ")");
    }
    require_table_shape(s->rel_k, {rows, th, d.head_dim},
                        "attention: shaw: rel_k [2K+1, heads, head_dim]");
    if (s->rel_v.data != nullptr) {
      const int64_t tv = s->rel_v.shape[1];
      if (tv != 1 && tv != d.heads_q) {
        fail<ShapeError>("attention: shaw: rel_v heads (" + std::to_string(tv) +
                         ") must be 1 (shared) or heads_q (" + std::to_string(d.heads_q) + ")");
      }
      require_table_shape(s->rel_v, {rows, tv, d.head_dim},
                          "attention: shaw: rel_v [2K+1, heads, head_dim]");
    }
    p.rel_k = s->rel_k;
    p.rel_v = s->rel_v;
    p.shaw_k = (rows - 1) / 2;
  } else if (const auto* x = std::get_if<TransformerXL>(&scheme)) {
    require_table_shape(x->r_w_bias, {d.heads_q, d.head_dim},
                        "attention: xl: r_w_bias [heads, head_dim]");
    require_table_shape(x->r_r_bias, {d.heads_q, d.head_dim},
                        "attention: xl: r_r_bias [heads, head_dim]");
    const int64_t dm = x->r_net.shape[1];
    require_table_shape(x->r_net, {d.heads_q * d.head_dim, dm},
                        "attention: xl: r_net [heads * head_dim, d_model]");
    if (dm < 2 || dm % 2 != 0) {
      fail<ShapeError>("attention: xl: r_net's d_model (" + std::to_string(dm) +
                       ") must be even and >= 2");
    }
    if (!std::isfinite(x->base) || x->base <= 1.0) fail("attention: xl: base must be > 1");
    p.xl_u = x->r_w_bias;
    p.xl_v = x->r_r_bias;
    p.xl_rnet = x->r_net;
    p.xl_base = x->base;
    // Project R(delta) for every distance that occurs: O(#distances * H * D * Dm). Distances of
    // a batch row lie in [min_q - max_k, max_q - min_k]: O(seq_q + seq_k) of them for contiguous
    // positions; sparse ids with a wide range fall back to visiting the cells.
    const int64_t hd = d.heads_q * d.head_dim;
    auto add = [&](int64_t delta) {
      if (p.xl_r.count(delta)) return;
      const auto rr = xl_sinusoid(delta, dm, x->base);
      std::vector<T> proj(static_cast<std::size_t>(hd));
      for (int64_t o = 0; o < hd; ++o) {
        T acc = 0;
        const float* w = x->r_net.data + o * x->r_net.stride[0];
        for (int64_t m = 0; m < dm; ++m) {
          acc += static_cast<T>(w[m * x->r_net.stride[1]]) *
                 static_cast<T>(rr[static_cast<std::size_t>(m)]);
        }
        proj[static_cast<std::size_t>(o)] = acc;
      }
      p.xl_r.emplace(delta, std::move(proj));
    };
    for (int64_t b = 0; b < d.batch && d.seq_q > 0 && d.seq_k > 0; ++b) {
      int64_t qlo = qp.at(b, 0), qhi = qlo, klo = kp.at(b, 0), khi = klo;
      for (int64_t i = 1; i < d.seq_q; ++i) {
        qlo = std::min(qlo, qp.at(b, i));
        qhi = std::max(qhi, qp.at(b, i));
      }
      for (int64_t j = 1; j < d.seq_k; ++j) {
        klo = std::min(klo, kp.at(b, j));
        khi = std::max(khi, kp.at(b, j));
      }
      if ((qhi - klo) - (qlo - khi) <= 4 * (d.seq_q + d.seq_k)) {
        for (int64_t delta = qlo - khi; delta <= qhi - klo; ++delta) add(delta);
      } else {
        for (int64_t i = 0; i < d.seq_q; ++i) {
          for (int64_t j = 0; j < d.seq_k; ++j) add(qp.at(b, i) - kp.at(b, j));
        }
      }
    }
  } else if (const auto* db = std::get_if<DeBERTa>(&scheme)) {
    validate(db->buckets);
    const int64_t span = db->buckets.span();
    if (db->pos_key.data == nullptr) fail<ShapeError>("attention: deberta: pos_key is missing");
    if (db->pos_query.data == nullptr) fail<ShapeError>("attention: deberta: pos_query is missing");
    require_table_shape(
        db->pos_key, {2 * span, d.heads_q, d.head_dim},
        "attention: deberta: pos_key [2K, heads, head_dim] (K = " + std::to_string(span) + ")");
    require_table_shape(
        db->pos_query, {2 * span, d.heads_q, d.head_dim},
        "attention: deberta: pos_query [2K, heads, head_dim] (K = " + std::to_string(span) + ")");
    p.pos_key = db->pos_key;
    p.pos_query = db->pos_query;
    p.deberta = db->buckets;
  }
  return p;
}

template <class T>
struct Problem {
  View<const T, 4> q, k, v;
  Dims d;
  Positions qp, kp;
  AttentionOptions opt;
};

template <class T>
Problem<T> make_problem(View<const T, 4> q, View<const T, 4> k, View<const T, 4> v,
                        const std::array<int64_t, 4>& out_shape, const AttentionOptions& opt,
                        const Positions* query_positions, const Positions* key_positions) {
  Problem<T> pr{q, k, v, validate_shapes(q, k, v, out_shape), {}, {}, opt};
  const Dims& d = pr.d;
  if (opt.scale) detail::require_finite(*opt.scale, "attention: scale");
  if (opt.window && *opt.window < 1) {
    fail("attention: window must be >= 1 (got " + std::to_string(*opt.window) + ")");
  }
  if (opt.num_threads < 0) fail("attention: num_threads must be >= 0");
  if (!query_positions && d.seq_q > d.seq_k) {
    fail("attention: query length (" + std::to_string(d.seq_q) + ") exceeds key length (" +
         std::to_string(d.seq_k) +
         "): the default positions put queries last in the key sequence; pass explicit "
         "query and key positions");
  }
  pr.qp = query_positions ? *query_positions : Positions::offset(d.seq_k - d.seq_q);
  pr.kp = key_positions ? *key_positions : Positions::offset(0);
  pr.qp.validate(d.batch, d.seq_q, "attention: query positions");
  pr.kp.validate(d.batch, d.seq_k, "attention: key positions");
  detail::require_all_finite(q, "attention: q");
  detail::require_all_finite(k, "attention: k");
  detail::require_all_finite(v, "attention: v");
  return pr;
}

template <class T>
bool visible(const AttentionOptions& opt, int64_t pos_q, int64_t pos_k) {
  const int64_t rel = pos_k - pos_q;
  if (opt.causal && rel > 0) return false;
  if (opt.window && (rel < 0 ? -rel : rel) >= *opt.window) return false;
  return true;
}

// Scores of query i against every key (row of length seq_k), before masking.
template <class T>
void score_row(const Problem<T>& pr, const Prepared<T>& p, int64_t b, int64_t h, int64_t i, T* s) {
  const Dims& d = pr.d;
  const int64_t hk = h / d.group;
  const int64_t dim = d.head_dim;
  const View<const T, 4>& q = pr.q;
  const View<const T, 4>& k = pr.k;
  const T* qr = q.data + b * q.stride[0] + i * q.stride[1] + h * q.stride[2];
  int64_t qs = q.stride[3];
  const T* kbase = k.data + b * k.stride[0] + hk * k.stride[2];
  int64_t kj_stride = k.stride[1], ks = k.stride[3];
  if (p.kind == 1) {  // rope: rotated contiguous copies
    qr = p.q_rot.data() + ((b * d.seq_q + i) * d.heads_q + h) * dim;
    qs = 1;
    kbase = p.k_rot.data() + (b * d.seq_k * d.heads_kv + hk) * dim;
    kj_stride = d.heads_kv * dim;
    ks = 1;
  }
  const T scale = static_cast<T>(p.scale);
  const int64_t pq = pr.qp.at(b, i);
  for (int64_t j = 0; j < d.seq_k; ++j) {
    const T* kr = kbase + j * kj_stride;
    const int64_t pk = pr.kp.at(b, j);
    T content = 0;
    for (int64_t c = 0; c < dim; ++c) content += qr[c * qs] * kr[c * ks];
    T bias = 0;
    switch (p.kind) {
      case 2:  // alibi
        bias = static_cast<T>(alibi_bias(p.slopes[static_cast<std::size_t>(h)], pq, pk));
        break;
      case 3:  // t5
        bias = static_cast<T>(p.t5_table.data[t5_bucket(pk - pq, p.t5) * p.t5_table.stride[0] +
                                              h * p.t5_table.stride[1]]);
        break;
      case 4: {  // shaw: q . rel_k[idx]
        const int64_t idx = shaw_index(pk - pq, p.shaw_k);
        const int64_t th = p.rel_k.shape[1] == 1 ? 0 : h;
        const float* rk = p.rel_k.data + idx * p.rel_k.stride[0] + th * p.rel_k.stride[1];
        for (int64_t c = 0; c < dim; ++c) {
          content += qr[c * qs] * static_cast<T>(rk[c * p.rel_k.stride[2]]);
        }
        break;
      }
      case 5: {  // xl: u.k + (q + v).r(delta)
        const float* u = p.xl_u.data + h * p.xl_u.stride[0];
        const float* vv = p.xl_v.data + h * p.xl_v.stride[0];
        const T* r = p.xl_r.at(pq - pk).data() + h * dim;
        for (int64_t c = 0; c < dim; ++c) {
          content += static_cast<T>(u[c * p.xl_u.stride[1]]) * kr[c * ks] +
                     (qr[c * qs] + static_cast<T>(vv[c * p.xl_v.stride[1]])) * r[c];
        }
        break;
      }
      case 6: {  // deberta: q . pos_key[c2p] + k . pos_query[p2c]
        const float* pkey = p.pos_key.data +
                            deberta_c2p_index(pq, pk, p.deberta) * p.pos_key.stride[0] +
                            h * p.pos_key.stride[1];
        const float* pqry = p.pos_query.data +
                            deberta_p2c_index(pq, pk, p.deberta) * p.pos_query.stride[0] +
                            h * p.pos_query.stride[1];
        for (int64_t c = 0; c < dim; ++c) {
          content += qr[c * qs] * static_cast<T>(pkey[c * p.pos_key.stride[2]]) +
                     kr[c * ks] * static_cast<T>(pqry[c * p.pos_query.stride[2]]);
        }
        break;
      }
      default:
        break;
    }
    s[j] = scale * content + bias;
  }
}

template <class T>
void run(const Problem<T>& pr, const Prepared<T>& p, View<T, 4> out) {
  const Dims& d = pr.d;
  std::vector<T> s(static_cast<std::size_t>(d.seq_k));
  std::vector<T> acc(static_cast<std::size_t>(d.head_dim));
  const auto& v = pr.v;
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.heads_q; ++h) {
      const int64_t hk = h / d.group;
      for (int64_t i = 0; i < d.seq_q; ++i) {
        score_row(pr, p, b, h, i, s.data());
        const int64_t pq = pr.qp.at(b, i);
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < d.seq_k; ++j) {
          if (!visible<T>(pr.opt, pq, pr.kp.at(b, j))) {
            s[static_cast<std::size_t>(j)] = -std::numeric_limits<T>::infinity();
          } else {
            mx = std::max(mx, s[static_cast<std::size_t>(j)]);
          }
        }
        T* o = out.data + b * out.stride[0] + i * out.stride[1] + h * out.stride[2];
        if (mx == -std::numeric_limits<T>::infinity()) {
          if (!pr.opt.allow_fully_masked) {
            fail("attention: query " + std::to_string(i) + " (batch " + std::to_string(b) +
                 ", position " + std::to_string(pq) +
                 ") sees no key under the mask; allow_fully_masked gives 0 for such rows");
          }
          for (int64_t c = 0; c < d.head_dim; ++c) o[c * out.stride[3]] = T(0);
          continue;
        }
        T sum = 0;
        for (auto& x : s) {
          x = x == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(x - mx);
          sum += x;
        }
        std::fill(acc.begin(), acc.end(), T(0));
        for (int64_t j = 0; j < d.seq_k; ++j) {
          const T a = s[static_cast<std::size_t>(j)];
          if (a == T(0)) continue;
          const T* vr = v.data + b * v.stride[0] + j * v.stride[1] + hk * v.stride[2];
          for (int64_t c = 0; c < d.head_dim; ++c) {
            acc[static_cast<std::size_t>(c)] += a * vr[c * v.stride[3]];
          }
          if (p.kind == 4 && p.rel_v.data != nullptr) {
            const int64_t idx = shaw_index(pr.kp.at(b, j) - pq, p.shaw_k);
            const int64_t th = p.rel_v.shape[1] == 1 ? 0 : h;
            const float* rv = p.rel_v.data + idx * p.rel_v.stride[0] + th * p.rel_v.stride[1];
            for (int64_t c = 0; c < d.head_dim; ++c) {
              acc[static_cast<std::size_t>(c)] += a * static_cast<T>(rv[c * p.rel_v.stride[2]]);
            }
          }
        }
        const T inv = T(1) / sum;
        for (int64_t c = 0; c < d.head_dim; ++c) {
          o[c * out.stride[3]] = acc[static_cast<std::size_t>(c)] * inv;
        }
      }
    }
  }
}

}  // namespace

void attention(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<float, 4> out,
               const Positions* query_positions, const Positions* key_positions) {
  detail::require_data(out, "attention: out");
  auto pr = make_problem<float>(q, k, v, out.shape, options, query_positions, key_positions);
  const auto p = prepare<float>(scheme, options, pr.d, q, k, pr.qp, pr.kp);
  run<float>(pr, p, out);
}

namespace ref {

void attention(View<const double, 4> q, View<const double, 4> k, View<const double, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<double, 4> out,
               const Positions* query_positions, const Positions* key_positions) {
  detail::require_data(out, "ref::attention: out");
  auto pr = make_problem<double>(q, k, v, out.shape, options, query_positions, key_positions);
  const auto p = prepare<double>(scheme, options, pr.d, q, k, pr.qp, pr.kp);
  run<double>(pr, p, out);
}

std::vector<double> attention_scores(View<const double, 4> q, View<const double, 4> k,
                                     const PositionScheme& scheme, const AttentionOptions& options,
                                     int64_t batch_index, int64_t head,
                                     const Positions* query_positions,
                                     const Positions* key_positions) {
  auto pr = make_problem<double>(q, k, k, q.shape, options, query_positions, key_positions);
  if (batch_index < 0 || batch_index >= pr.d.batch || head < 0 || head >= pr.d.heads_q) {
    fail("attention_scores: batch_index/head out of range");
  }
  const auto p = prepare<double>(scheme, options, pr.d, q, k, pr.qp, pr.kp);
  std::vector<double> s(static_cast<std::size_t>(pr.d.seq_q * pr.d.seq_k));
  for (int64_t i = 0; i < pr.d.seq_q; ++i) {
    score_row(pr, p, batch_index, head, i, s.data() + i * pr.d.seq_k);
  }
  return s;
}

}  // namespace ref
}  // namespace posenc
