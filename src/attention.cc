// src/attention.cc - scaled dot-product attention with every positional scheme
// (docs/attention.md).
//
// One implementation templated on the scalar type: T = double is the float64 oracle
// (posenc::ref::attention), T = float the simple float32 path (float accumulation). Both go one
// row of scores at a time (ref::attention_scores materializes a [seq_q, seq_k] block). The fused,
// tiled kernel of the next stage replaces the float32 path and is tested against the T = double
// instantiation.
//
// Score order (docs/attention.md, Score order): s = scale * (q.k + relative-content terms)
// + bias; mask; softmax over keys; weighted sum of values (+ Shaw's value term).
#include "posenc/attention.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <unordered_map>

#include "attention/mask.h"
#include "attention/model_inputs.h"
#include "attention_half.h"
#include "common.h"
#include "hwy/aligned_allocator.h"
#include "kernels/attention_kernels.h"
#include "kernels/parallel.h"
#include "posenc/schemes.h"

namespace posenc {

std::string scheme_name(const PositionScheme& scheme) {
  return scheme_info(static_cast<SchemeKind>(scheme.index())).name;
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

// RoPE on dims [r.offset, r.offset + rotary_dim) of each head of x into out (which may be x
// itself), the other dims copied: DeepSeek's decoupled RoPE, forward or inverse.
template <class T>
void rotate_heads(const Rope& r, View<const T, 4> x, View<T, 4> out, const Positions* pos,
                  Direction dir, int threads) {
  if (out.data != x.data) {
    for (int64_t b = 0; b < x.shape[0]; ++b)
      for (int64_t i = 0; i < x.shape[1]; ++i)
        for (int64_t h = 0; h < x.shape[2]; ++h)
          for (int64_t c = 0; c < x.shape[3]; ++c) out(b, i, h, c) = x(b, i, h, c);
  }
  View<T, 4> part = out;
  part.data = out.data + r.offset * out.stride[3];
  part.shape[3] = out.shape[3] - r.offset;
  if constexpr (std::is_same_v<T, double>) {
    ref::apply_rope(r.freqs, r.style, View<const T, 4>(part), part, pos, dir);
  } else {
    apply_rope(r.freqs, r.style, View<const T, 4>(part), part, pos, dir, threads);
  }
}

// q and k rotated by RoPE into contiguous copies.
template <class T>
void rotated_copies(const Rope& r, const View<const T, 4>& q, const View<const T, 4>& k,
                    const Positions& qp, const Positions& kp, int threads, std::vector<T>& q_rot,
                    std::vector<T>& k_rot) {
  q_rot.resize(static_cast<std::size_t>(q.numel()));
  k_rot.resize(static_cast<std::size_t>(k.numel()));
  auto qo = View<T, 4>::contiguous(q_rot.data(), q.shape);
  auto ko = View<T, 4>::contiguous(k_rot.data(), k.shape);
  if (r.offset > 0) {
    rotate_heads<T>(r, q, qo, &qp, Direction::kForward, threads);
    rotate_heads<T>(r, k, ko, &kp, Direction::kForward, threads);
  } else if constexpr (std::is_same_v<T, double>) {
    ref::apply_rope(r.freqs, r.style, q, qo, &qp);
    ref::apply_rope(r.freqs, r.style, k, ko, &kp);
  } else {
    apply_rope(r.freqs, r.style, q, qo, &qp, Direction::kForward, threads);
    apply_rope(r.freqs, r.style, k, ko, &kp, Direction::kForward, threads);
  }
}

// Everything a scheme needs, validated and precomputed once per call (O(L) or O(L*K)). Parameter
// tables are views of scalar T: the scheme's float32 views for T = float; for T = double (the
// oracle) the float64 tables of ref::SchemeTables when given, else the float32 ones widened.
template <class T>
struct Prepared {
  int kind = 0;  // PositionScheme index
  double scale = 1.0;
  // Attention sinks [heads_q] (AttentionOptions::sinks, or ref::SchemeTables::sinks for the
  // oracle); empty: none.
  std::vector<T> sinks;
  // rope: the scheme, and rotated copies of q and k (contiguous [B, L, H, D]) for the simple
  // paths (the fused kernels rotate rows as they load them, see fill_fused_params).
  const Rope* rope = nullptr;
  std::vector<T> q_rot, k_rot;
  // alibi
  std::vector<double> slopes;
  // t5
  T5BucketConfig t5;
  View<const T, 2> t5_table;
  // shaw
  View<const T, 3> rel_k, rel_v;
  int64_t shaw_k = 0;
  // xl: projected r(delta) [H * D] per distance, built on demand before the loop.
  View<const T, 2> xl_content_bias, xl_position_bias, xl_rnet;
  double xl_base = 1e4;
  std::unordered_map<int64_t, std::vector<T>> xl_r;
  // deberta
  View<const T, 3> pos_key, pos_query;
  DebertaBuckets deberta;
  // float32 tables widened to T (the oracle without float64 tables); deque: stable addresses.
  std::deque<std::vector<T>> widened;
};

// The table the T path computes with: for T = float the scheme's float32 view; for T = double
// the float64 view when it has data, else the float32 view widened (row-major copy of the same
// shape), else an empty view of the float32 view's shape (the callers report it missing).
template <class T, std::size_t R>
View<const T, R> table_for(const View<const float, R>& f32, const View<const double, R>* f64,
                           std::deque<std::vector<T>>& widened) {
  if constexpr (std::is_same_v<T, float>) {
    return f32;
  } else {
    if (f64 != nullptr && f64->data != nullptr) return *f64;
    View<const T, R> out{nullptr, f32.shape, {}};
    if (f32.data == nullptr) return out;
    detail::require_data(f32, "attention: table");
    std::vector<T>& buf = widened.emplace_back(static_cast<std::size_t>(f32.numel()));
    std::array<int64_t, R> idx{};
    for (std::size_t n = 0; n < buf.size(); ++n) {
      int64_t off = 0;
      for (std::size_t d = 0; d < R; ++d) off += idx[d] * f32.stride[d];
      buf[n] = static_cast<T>(f32.data[off]);
      for (std::size_t d = R; d-- > 0;) {
        if (++idx[d] < f32.shape[d]) break;
        idx[d] = 0;
      }
    }
    return View<const T, R>::contiguous(buf.data(), f32.shape);
  }
}

// Rejects float64 tables that the scheme does not have (ref::SchemeTables).
void check_tables_belong(const PositionScheme& scheme, const ref::SchemeTables& t) {
  const int kind = static_cast<int>(scheme.index());
  auto check = [&](const void* data, bool belongs, const char* name) {
    if (data != nullptr && !belongs) {
      fail("ref::attention: float64 table " + std::string(name) + " is not a parameter of scheme " +
           scheme_name(scheme));
    }
  };
  check(t.relative_attention_bias.data, kind == 3, "relative_attention_bias");
  check(t.rel_k.data, kind == 4, "rel_k");
  check(t.rel_v.data, kind == 4, "rel_v");
  check(t.r_w_bias.data, kind == 5, "r_w_bias");
  check(t.r_r_bias.data, kind == 5, "r_r_bias");
  check(t.r_net.data, kind == 5, "r_net");
  check(t.pos_key.data, kind == 6, "pos_key");
  check(t.pos_query.data, kind == 6, "pos_query");
}

// simple_path: also build what only the simple (non-fused) paths use: RoPE's rotated copies of
// q and k, Transformer-XL's projected distance table.
template <class T>
Prepared<T> prepare(const PositionScheme& scheme, const AttentionOptions& opt, const Dims& d,
                    const View<const T, 4>& q, const View<const T, 4>& k, const Positions& qp,
                    const Positions& kp, bool simple_path = true,
                    const ref::SchemeTables* tables = nullptr) {
  Prepared<T> p;
  if (tables) check_tables_belong(scheme, *tables);
  // The float64 table of `name` when there is one (the oracle only).
  auto f64 = [&](auto member) { return tables ? &(tables->*member) : nullptr; };
  p.kind = static_cast<int>(scheme.index());
  const double default_scale =
      1.0 / std::sqrt(static_cast<double>(std::holds_alternative<DeBERTa>(scheme) ? 3 : 1) *
                      static_cast<double>(d.head_dim));
  p.scale = opt.scale.value_or(default_scale);
  if (tables != nullptr && tables->sinks.data != nullptr) {
    require_table_shape(tables->sinks, {d.heads_q}, "attention: sinks (float64) [heads_q]");
    for (int64_t h = 0; h < d.heads_q; ++h) p.sinks.push_back(static_cast<T>(tables->sinks(h)));
  } else if (opt.sinks.data != nullptr) {
    require_table_shape(opt.sinks, {d.heads_q}, "attention: sinks [heads_q]");
    for (int64_t h = 0; h < d.heads_q; ++h) p.sinks.push_back(static_cast<T>(opt.sinks(h)));
  }
  if (const auto* r = std::get_if<Rope>(&scheme)) {
    const auto& f = r->freqs;
    if (f.inv_freq.empty()) fail("attention: rope: freqs.inv_freq is empty");
    if (r->offset < 0 || r->offset > d.head_dim) {
      fail("attention: rope: offset (" + std::to_string(r->offset) + ") must lie in [0, head_dim " +
           std::to_string(d.head_dim) + "]");
    }
    if (r->offset + f.rotary_dim() > d.head_dim) {
      fail<ShapeError>("attention: rope: rotary_dim (" + std::to_string(f.rotary_dim()) + ")" +
                       (r->offset > 0 ? " from offset " + std::to_string(r->offset) : "") +
                       " exceeds head_dim (" + std::to_string(d.head_dim) + ")");
    }
    for (double w : f.inv_freq) {
      if (!std::isfinite(w)) fail("attention: rope: freqs.inv_freq has a non-finite entry");
    }
    if (!std::isfinite(f.attention_factor) || f.attention_factor <= 0) {
      fail("attention: rope: attention_factor must be finite and > 0");
    }
    p.rope = r;
    if (simple_path) rotated_copies(*r, q, k, qp, kp, opt.num_threads, p.q_rot, p.k_rot);
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
    const auto table =
        table_for<T>(t->table, f64(&ref::SchemeTables::relative_attention_bias), p.widened);
    if (table.data == nullptr)
      fail<ShapeError>("attention: t5: relative_attention_bias is missing");
    p.t5 = T5BucketConfig{.num_buckets = table.shape[0],
                          .max_distance = t->max_distance,
                          .bidirectional = t->bidirectional.value_or(!opt.causal)};
    validate(p.t5);
    require_table_shape(table, {p.t5.num_buckets, d.heads_q},
                        "attention: t5: relative_attention_bias [num_buckets, heads]");
    p.t5_table = table;
  } else if (const auto* s = std::get_if<Shaw>(&scheme)) {
    const auto rel_k = table_for<T>(s->rel_k, f64(&ref::SchemeTables::rel_k), p.widened);
    const auto rel_v = table_for<T>(s->rel_v, f64(&ref::SchemeTables::rel_v), p.widened);
    const int64_t rows = rel_k.shape[0];
    if (rel_k.data == nullptr) fail<ShapeError>("attention: shaw: rel_k is missing");
    if (rows < 1 || rows % 2 == 0) {
      fail<ShapeError>("attention: shaw: rel_k must have 2K+1 (odd) rows (got " +
                       std::to_string(rows) + ")");
    }
    const int64_t th = rel_k.shape[1];
    if (th != 1 && th != d.heads_q) {
      fail<ShapeError>("attention: shaw: rel_k heads (" + std::to_string(th) +
                       ") must be 1 (shared) or heads_q (" + std::to_string(d.heads_q) + ")");
    }
    require_table_shape(rel_k, {rows, th, d.head_dim},
                        "attention: shaw: rel_k [2K+1, heads, head_dim]");
    if (rel_v.data != nullptr) {
      const int64_t tv = rel_v.shape[1];
      if (tv != 1 && tv != d.heads_q) {
        fail<ShapeError>("attention: shaw: rel_v heads (" + std::to_string(tv) +
                         ") must be 1 (shared) or heads_q (" + std::to_string(d.heads_q) + ")");
      }
      require_table_shape(rel_v, {rows, tv, d.head_dim},
                          "attention: shaw: rel_v [2K+1, heads, head_dim]");
    }
    p.rel_k = rel_k;
    p.rel_v = rel_v.data != nullptr ? rel_v : View<const T, 3>{};
    p.shaw_k = (rows - 1) / 2;
  } else if (const auto* x = std::get_if<TransformerXL>(&scheme)) {
    const auto u = table_for<T>(x->r_w_bias, f64(&ref::SchemeTables::r_w_bias), p.widened);
    const auto vb = table_for<T>(x->r_r_bias, f64(&ref::SchemeTables::r_r_bias), p.widened);
    const auto rnet = table_for<T>(x->r_net, f64(&ref::SchemeTables::r_net), p.widened);
    require_table_shape(u, {d.heads_q, d.head_dim}, "attention: xl: r_w_bias [heads, head_dim]");
    require_table_shape(vb, {d.heads_q, d.head_dim}, "attention: xl: r_r_bias [heads, head_dim]");
    const int64_t dm = rnet.shape[1];
    require_table_shape(rnet, {d.heads_q * d.head_dim, dm},
                        "attention: xl: r_net [heads * head_dim, d_model]");
    if (dm < 2 || dm % 2 != 0) {
      fail<ShapeError>("attention: xl: r_net's d_model (" + std::to_string(dm) +
                       ") must be even and >= 2");
    }
    if (!std::isfinite(x->base) || x->base <= 1.0) fail("attention: xl: base must be > 1");
    p.xl_content_bias = u;
    p.xl_position_bias = vb;
    p.xl_rnet = rnet;
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
        const T* w = p.xl_rnet.data + o * p.xl_rnet.stride[0];
        for (int64_t m = 0; m < dm; ++m) {
          acc += w[m * p.xl_rnet.stride[1]] * static_cast<T>(rr[static_cast<std::size_t>(m)]);
        }
        proj[static_cast<std::size_t>(o)] = acc;
      }
      p.xl_r.emplace(delta, std::move(proj));
    };
    for (int64_t b = 0; simple_path && b < d.batch && d.seq_q > 0 && d.seq_k > 0; ++b) {
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
    const auto pos_key = table_for<T>(db->pos_key, f64(&ref::SchemeTables::pos_key), p.widened);
    const auto pos_query =
        table_for<T>(db->pos_query, f64(&ref::SchemeTables::pos_query), p.widened);
    if (pos_key.data == nullptr) fail<ShapeError>("attention: deberta: pos_key is missing");
    if (pos_query.data == nullptr) fail<ShapeError>("attention: deberta: pos_query is missing");
    require_table_shape(
        pos_key, {2 * span, d.heads_q, d.head_dim},
        "attention: deberta: pos_key [2K, heads, head_dim] (K = " + std::to_string(span) + ")");
    require_table_shape(
        pos_query, {2 * span, d.heads_q, d.head_dim},
        "attention: deberta: pos_query [2K, heads, head_dim] (K = " + std::to_string(span) + ")");
    p.pos_key = pos_key;
    p.pos_query = pos_query;
    p.deberta = db->buckets;
  }
  return p;
}

template <class T>
void require_finite_inputs(const View<const T, 4>& q, const View<const T, 4>& k,
                           const View<const T, 4>& v) {
  detail::require_all_finite(q, "attention: q");
  detail::require_all_finite(k, "attention: k");
  detail::require_all_finite(v, "attention: v");
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
                        const Positions* query_positions, const Positions* key_positions,
                        bool check_finite = true) {
  Problem<T> pr{q, k, v, validate_shapes(q, k, v, out_shape), {}, {}, opt};
  const Dims& d = pr.d;
  if (opt.scale) detail::require_finite(*opt.scale, "attention: scale");
  if (opt.window && *opt.window < 1) {
    fail("attention: window must be >= 1 (got " + std::to_string(*opt.window) + ")");
  }
  if (opt.chunk && *opt.chunk < 1) {
    fail("attention: chunk must be >= 1 (got " + std::to_string(*opt.chunk) + ")");
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
  if (check_finite) require_finite_inputs(q, k, v);
  return pr;
}

detail::MaskRule mask_rule(const AttentionOptions& opt) {
  return {.causal = opt.causal, .window = opt.window.value_or(0), .chunk = opt.chunk.value_or(0)};
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
        const T* rk = p.rel_k.data + idx * p.rel_k.stride[0] + th * p.rel_k.stride[1];
        for (int64_t c = 0; c < dim; ++c) {
          content += qr[c * qs] * static_cast<T>(rk[c * p.rel_k.stride[2]]);
        }
        break;
      }
      case 5: {  // xl: u.k + (q + v).r(delta)
        const T* u = p.xl_content_bias.data + h * p.xl_content_bias.stride[0];
        const T* vv = p.xl_position_bias.data + h * p.xl_position_bias.stride[0];
        const T* r = p.xl_r.at(pq - pk).data() + h * dim;
        for (int64_t c = 0; c < dim; ++c) {
          content += static_cast<T>(u[c * p.xl_content_bias.stride[1]]) * kr[c * ks] +
                     (qr[c * qs] + static_cast<T>(vv[c * p.xl_position_bias.stride[1]])) * r[c];
        }
        break;
      }
      case 6: {  // deberta: q . pos_key[c2p] + k . pos_query[p2c]
        const T* pkey = p.pos_key.data +
                        deberta_c2p_index(pq, pk, p.deberta) * p.pos_key.stride[0] +
                        h * p.pos_key.stride[1];
        const T* pqry = p.pos_query.data +
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
void run(const Problem<T>& pr, const Prepared<T>& p, View<T, 4> out,
         const View<T, 3>* lse = nullptr) {
  const Dims& d = pr.d;
  const detail::MaskRule mask = mask_rule(pr.opt);
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
          if (!mask.visible(pq, pr.kp.at(b, j))) {
            s[static_cast<std::size_t>(j)] = -std::numeric_limits<T>::infinity();
          } else {
            mx = std::max(mx, s[static_cast<std::size_t>(j)]);
          }
        }
        T* o = out.data + b * out.stride[0] + i * out.stride[1] + h * out.stride[2];
        const bool sink = !p.sinks.empty();
        const T sink_logit = sink ? p.sinks[static_cast<std::size_t>(h)] : T(0);
        if (mx == -std::numeric_limits<T>::infinity() && sink) {
          // Only the sink in the denominator: no value vector, so out = 0 and lse = sink.
          for (int64_t c = 0; c < d.head_dim; ++c) o[c * out.stride[3]] = T(0);
          if (lse) (*lse)(b, h, i) = sink_logit;
          continue;
        }
        if (mx == -std::numeric_limits<T>::infinity()) {
          if (!pr.opt.allow_fully_masked) {
            fail("attention: query " + std::to_string(i) + " (batch " + std::to_string(b) +
                 ", position " + std::to_string(pq) +
                 ") sees no key under the mask; allow_fully_masked gives 0 for such rows");
          }
          for (int64_t c = 0; c < d.head_dim; ++c) o[c * out.stride[3]] = T(0);
          if (lse) (*lse)(b, h, i) = -std::numeric_limits<T>::infinity();
          continue;
        }
        if (sink) mx = std::max(mx, sink_logit);
        T sum = 0;
        for (auto& x : s) {
          x = x == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(x - mx);
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
          if (p.kind == 4 && p.rel_v.data != nullptr) {
            const int64_t idx = shaw_index(pr.kp.at(b, j) - pq, p.shaw_k);
            const int64_t th = p.rel_v.shape[1] == 1 ? 0 : h;
            const T* rv = p.rel_v.data + idx * p.rel_v.stride[0] + th * p.rel_v.stride[1];
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

// ---- backward -------------------------------------------------------------------------------

template <class T, std::size_t R>
void require_grad(const View<T, R>& g, const std::array<int64_t, R>& want,
                  const std::string& name) {
  detail::require_data(g, name);
  if (g.shape != want) {
    fail<ShapeError>(name + " has shape " + shape_str(g.shape) + ", expected " + shape_str(want));
  }
  if (g.data == nullptr && g.numel() > 0) fail<ShapeError>(name + " is missing");
}

// Validates the backward's extra inputs and the gradient views against the problem and scheme;
// zeroes every gradient that will be written.
template <class T>
void check_backward_args(const Problem<T>& pr, const PositionScheme& scheme, const Prepared<T>& p,
                         const View<const T, 4>& out, const View<const T, 3>& lse,
                         const View<const T, 4>& dout, const AttentionGradsOf<T>& g) {
  const Dims& d = pr.d;
  const std::string w = "attention_backward: ";
  require_grad(out, pr.q.shape, w + "out");
  require_grad(dout, pr.q.shape, w + "dout");
  require_grad(lse, {d.batch, d.heads_q, d.seq_q}, w + "lse [batch, heads_q, seq_q]");
  require_grad(g.dq, pr.q.shape, w + "dq");
  require_grad(g.dk, pr.k.shape, w + "dk");
  require_grad(g.dv, pr.v.shape, w + "dv");
  detail::require_all_finite(out, w + "out");
  detail::require_all_finite(dout, w + "dout");
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
  const int kind = static_cast<int>(scheme.index());
  const std::string sn = scheme_name(scheme);
  auto param = [&](const auto& gv, bool belongs, const auto& want, const std::string& name) {
    if (gv.data == nullptr) return;
    if (!belongs) fail(w + name + " is not a parameter of scheme " + sn);
    require_grad(gv, want, w + name);
  };
  // Table shapes as the call computes with them (Prepared: float64 tables of the oracle included).
  param(g.drelative_attention_bias, kind == 3, p.t5_table.shape, "drelative_attention_bias");
  param(g.dslopes, kind == 2, std::array<int64_t, 1>{d.heads_q}, "dslopes [heads_q]");
  if (g.drel_v.data != nullptr && kind == 4 && p.rel_v.data == nullptr) {
    fail(w + "drel_v given but the scheme has no rel_v");
  }
  param(g.drel_k, kind == 4, p.rel_k.shape, "drel_k");
  param(g.drel_v, kind == 4, p.rel_v.shape, "drel_v");
  param(g.dr_w_bias, kind == 5, p.xl_content_bias.shape, "dr_w_bias");
  param(g.dr_r_bias, kind == 5, p.xl_position_bias.shape, "dr_r_bias");
  param(g.dr_net, kind == 5, p.xl_rnet.shape, "dr_net");
  param(g.dpos_key, kind == 6, p.pos_key.shape, "dpos_key");
  param(g.dpos_query, kind == 6, p.pos_query.shape, "dpos_query");
  if (g.dsinks.data != nullptr && p.sinks.empty()) {
    fail(w + "dsinks given but the attention has no sinks (AttentionOptions::sinks)");
  }
  param(g.dsinks, !p.sinks.empty(), std::array<int64_t, 1>{d.heads_q}, "dsinks [heads_q]");
  auto zero = [](const auto& v) {
    if (v.data != nullptr) detail::fill_view(v, T(0));
  };
  zero(g.dq), zero(g.dk), zero(g.dv), zero(g.drelative_attention_bias), zero(g.dslopes);
  zero(g.drel_k), zero(g.drel_v), zero(g.dr_w_bias), zero(g.dr_r_bias), zero(g.dr_net);
  zero(g.dpos_key), zero(g.dpos_query), zero(g.dsinks);
}

// The materialized backward, one score row at a time (T = double: the oracle; T = float: the
// simple float32 path). For row i of head h: P_j = exp(s_ij - lse_i) on visible keys,
// dP_j = dout_i . (v_j + rel_v[idx]), D_i = dout_i . out_i, dS_j = P_j (dP_j - D_i); each
// score term then passes dS on (the score order and docs/attention.md "Backward").
template <class T>
void run_backward(const Problem<T>& pr, const Prepared<T>& p, const View<const T, 4>& out,
                  const View<const T, 3>& lse, const View<const T, 4>& dout,
                  const AttentionGradsOf<T>& g, const PositionScheme& scheme) {
  const Dims& d = pr.d;
  const detail::MaskRule mask = mask_rule(pr.opt);
  const int64_t dim = d.head_dim;
  const auto ud = [](int64_t x) { return static_cast<std::size_t>(x); };
  const T scale = static_cast<T>(p.scale);
  const bool rope = p.kind == 1;
  // RoPE: gradients with respect to the rotated q and k first, rotated back at the end.
  std::vector<T> dq_rot, dk_rot;
  View<T, 4> dq = g.dq, dk = g.dk;
  if (rope) {
    dq_rot.assign(ud(pr.q.numel()), T(0));
    dk_rot.assign(ud(pr.k.numel()), T(0));
    dq = View<T, 4>::contiguous(dq_rot.data(), pr.q.shape);
    dk = View<T, 4>::contiguous(dk_rot.data(), pr.k.shape);
  }
  // Transformer-XL: dr(delta) [heads_q * head_dim] per distance, projected onto r_net at the end.
  std::map<int64_t, std::vector<T>> xl_dr;
  std::vector<T> s(ud(d.seq_k)), prob(ud(d.seq_k)), qrow(ud(dim)), dq_acc(ud(dim));
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.heads_q; ++h) {
      const int64_t hk = h / d.group;
      for (int64_t i = 0; i < d.seq_q; ++i) {
        const T l = lse(b, h, i);
        if (l == -std::numeric_limits<T>::infinity()) continue;  // no visible key
        score_row(pr, p, b, h, i, s.data());
        const int64_t pq = pr.qp.at(b, i);
        for (int64_t c = 0; c < dim; ++c) {
          qrow[ud(c)] =
              rope ? p.q_rot[ud(((b * d.seq_q + i) * d.heads_q + h) * dim + c)] : pr.q(b, i, h, c);
        }
        T dsum = 0;  // D_i
        for (int64_t c = 0; c < dim; ++c) dsum += dout(b, i, h, c) * out(b, i, h, c);
        // The sink: probability exp(sink - lse) and no value, so dS_sink = -P_sink D_i.
        if (!p.sinks.empty() && g.dsinks.data != nullptr) {
          g.dsinks(h) -= std::exp(p.sinks[ud(h)] - l) * dsum;
        }
        std::fill(dq_acc.begin(), dq_acc.end(), T(0));
        for (int64_t j = 0; j < d.seq_k; ++j) {
          const int64_t pk = pr.kp.at(b, j);
          if (!mask.visible(pq, pk)) continue;
          const T pj = std::exp(s[ud(j)] - l);
          if (pj == T(0)) continue;
          const int64_t rel = pk - pq;
          auto kval = [&](int64_t c) {
            return rope ? p.k_rot[ud(((b * d.seq_k + j) * d.heads_kv + hk) * dim + c)]
                        : pr.k(b, j, hk, c);
          };
          // dP and the value-side gradients.
          T dp = 0;
          for (int64_t c = 0; c < dim; ++c) {
            dp += dout(b, i, h, c) * pr.v(b, j, hk, c);
            g.dv(b, j, hk, c) += pj * dout(b, i, h, c);
          }
          int64_t shaw_idx = 0;
          if (p.kind == 4) shaw_idx = shaw_index(rel, p.shaw_k);
          if (p.kind == 4 && p.rel_v.data != nullptr) {
            const int64_t th = p.rel_v.shape[1] == 1 ? 0 : h;
            for (int64_t c = 0; c < dim; ++c) {
              dp += dout(b, i, h, c) * static_cast<T>(p.rel_v(shaw_idx, th, c));
              if (g.drel_v.data) g.drel_v(shaw_idx, th, c) += pj * dout(b, i, h, c);
            }
          }
          const T ds = pj * (dp - dsum);
          const T sds = scale * ds;
          // The content term q . k (XL: (q + u) . k).
          for (int64_t c = 0; c < dim; ++c) {
            const T kc = kval(c);
            T qc = qrow[ud(c)];
            if (p.kind == 5) qc += static_cast<T>(p.xl_content_bias(h, c));
            dq_acc[ud(c)] += sds * kc;
            dk(b, j, hk, c) += sds * qc;
          }
          switch (p.kind) {
            case 2:  // alibi: bias -m |pq - pk|
              if (g.dslopes.data) {
                g.dslopes(h) -= ds * static_cast<T>(rel < 0 ? -rel : rel);
              }
              break;
            case 3:  // t5: bias table[bucket, h]
              if (g.drelative_attention_bias.data) {
                g.drelative_attention_bias(t5_bucket(rel, p.t5), h) += ds;
              }
              break;
            case 4: {  // shaw: q . rel_k[idx]
              const int64_t th = p.rel_k.shape[1] == 1 ? 0 : h;
              for (int64_t c = 0; c < dim; ++c) {
                dq_acc[ud(c)] += sds * static_cast<T>(p.rel_k(shaw_idx, th, c));
                if (g.drel_k.data) g.drel_k(shaw_idx, th, c) += sds * qrow[ud(c)];
              }
              break;
            }
            case 5: {  // xl: u . k (above) + (q + v) . r(delta)
              const T* r = p.xl_r.at(pq - pk).data() + h * dim;
              auto& dr = xl_dr[pq - pk];
              if (dr.empty()) dr.assign(ud(d.heads_q * dim), T(0));
              for (int64_t c = 0; c < dim; ++c) {
                dq_acc[ud(c)] += sds * r[c];
                if (g.dr_w_bias.data) g.dr_w_bias(h, c) += sds * kval(c);
                if (g.dr_r_bias.data) g.dr_r_bias(h, c) += sds * r[c];
                dr[ud(h * dim + c)] +=
                    sds * (qrow[ud(c)] + static_cast<T>(p.xl_position_bias(h, c)));
              }
              break;
            }
            case 6: {  // deberta: q . pos_key[c2p] + k . pos_query[p2c]
              const int64_t c2p = deberta_c2p_index(pq, pk, p.deberta);
              const int64_t p2c = deberta_p2c_index(pq, pk, p.deberta);
              for (int64_t c = 0; c < dim; ++c) {
                dq_acc[ud(c)] += sds * static_cast<T>(p.pos_key(c2p, h, c));
                dk(b, j, hk, c) += sds * static_cast<T>(p.pos_query(p2c, h, c));
                if (g.dpos_key.data) g.dpos_key(c2p, h, c) += sds * qrow[ud(c)];
                if (g.dpos_query.data) g.dpos_query(p2c, h, c) += sds * kval(c);
              }
              break;
            }
            default:
              break;
          }
        }
        for (int64_t c = 0; c < dim; ++c) dq(b, i, h, c) += dq_acc[ud(c)];
      }
    }
  }
  if (p.kind == 5 && g.dr_net.data) {
    // r(delta) = W_r R(delta): dW_r[o][m] = sum_delta dr(delta)[o] R(delta)[m].
    const int64_t dm = p.xl_rnet.shape[1];
    for (const auto& [delta, dr] : xl_dr) {
      const auto rr = xl_sinusoid(delta, dm, p.xl_base);
      for (int64_t o = 0; o < d.heads_q * dim; ++o) {
        const T x = dr[ud(o)];
        if (x == T(0)) continue;
        for (int64_t m = 0; m < dm; ++m) g.dr_net(o, m) += x * static_cast<T>(rr[ud(m)]);
      }
    }
  }
  if (rope) {
    const auto& r = std::get<Rope>(scheme);
    if (r.offset > 0) {
      rotate_heads<T>(r, View<const T, 4>(dq), g.dq, &pr.qp, Direction::kInverse,
                      pr.opt.num_threads);
      rotate_heads<T>(r, View<const T, 4>(dk), g.dk, &pr.kp, Direction::kInverse,
                      pr.opt.num_threads);
    } else if constexpr (std::is_same_v<T, double>) {
      ref::apply_rope(r.freqs, r.style, View<const T, 4>(dq), g.dq, &pr.qp, Direction::kInverse);
      ref::apply_rope(r.freqs, r.style, View<const T, 4>(dk), g.dk, &pr.kp, Direction::kInverse);
    } else {
      apply_rope(r.freqs, r.style, View<const T, 4>(dq), g.dq, &pr.qp, Direction::kInverse,
                 pr.opt.num_threads);
      apply_rope(r.freqs, r.style, View<const T, 4>(dk), g.dk, &pr.kp, Direction::kInverse,
                 pr.opt.num_threads);
    }
  }
}

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
  run_backward<T>(pr, p, out, lse, dout, grads, scheme);
}

bool all_finite(const View<float, 4>& x) {
  bool ok = true;
  for (int64_t b = 0; b < x.shape[0]; ++b)
    for (int64_t i = 0; i < x.shape[1]; ++i)
      for (int64_t h = 0; h < x.shape[2]; ++h) {
        const float* r = &x(b, i, h, 0);
        for (int64_t c = 0; c < x.shape[3]; ++c) ok &= std::isfinite(r[c * x.stride[3]]);
      }
  return ok;
}

// ---- the fused float32 path ------------------------------------------------------------------

// Rejects (or, when allowed, leaves to the kernel's zero output) query rows that see no key:
// O((seq_q + seq_k) log seq_k) per batch row with the key positions sorted.
void check_fully_masked(const Problem<float>& pr) {
  const Dims& d = pr.d;
  // With sinks a row without visible keys is well defined (all weight on the sink).
  if (pr.opt.allow_fully_masked || d.seq_q == 0 || pr.opt.sinks.data != nullptr) return;
  const detail::MaskRule mask = mask_rule(pr.opt);
  for (int64_t b = 0; b < d.batch; ++b) {
    std::vector<int64_t> ks(static_cast<std::size_t>(d.seq_k));
    for (int64_t j = 0; j < d.seq_k; ++j) ks[static_cast<std::size_t>(j)] = pr.kp.at(b, j);
    std::sort(ks.begin(), ks.end());
    for (int64_t i = 0; i < d.seq_q; ++i) {
      const int64_t pq = pr.qp.at(b, i);
      const auto [lo, hi] = mask.key_range(pq);  // the visible key positions
      const auto it = std::lower_bound(ks.begin(), ks.end(), lo);
      if (it == ks.end() || *it > hi) {
        fail("attention: query " + std::to_string(i) + " (batch " + std::to_string(b) +
             ", position " + std::to_string(pq) +
             ") sees no key under the mask; allow_fully_masked gives 0 for such rows");
      }
    }
  }
}

// Fills kernels::FusedAttentionParams (positions as int32 offsets, per-scheme tables) and runs
// the fused kernel. Returns false when the call is outside the kernel's domain.
// The kernels' view of a problem: positions as int32 offsets from a per-row base, the
// per-scheme tables (bias by distance, dense Shaw / DeBERTa tables, XL's sinusoid rows) in `t`.
// Shared by the fused forward and backward. Returns false when the call is outside the kernels'
// domain (positions too sparse for int32 distance tables).
struct FusedTables {
  std::vector<int32_t> qpos, kpos, dmax, c2p, p2c;
  std::vector<float> bias, rel_k, rel_v, pos_key, pos_query, xl_sin, xl_rnet, xl_content_bias,
      xl_position_bias, sinks;
  // RoPE: cos/sin by position and the per-row table offsets, or (outside the table's domain)
  // rotated copies of q and k.
  hwy::AlignedFreeUniquePtr<double[]> rope_cs;
  std::vector<int64_t> rope_base;
  std::vector<float> q_rot, k_rot;
};

bool fill_fused_params(const Problem<float>& pr, const Prepared<float>& p, FusedTables& tab,
                       kernels::FusedAttentionParams& fp, bool allow_rope_copies = true) {
  const Dims& d = pr.d;
  constexpr int64_t kPad = 64;  // the kernel's key tile: tables are padded by one tile
  // Positions relative to a per-row base; distance range per row.
  auto& qpos = tab.qpos;
  auto& kpos = tab.kpos;
  auto& dmax = tab.dmax;
  qpos.assign(static_cast<std::size_t>(d.batch * d.seq_q), 0);
  kpos.assign(static_cast<std::size_t>(d.batch * d.seq_k), 0);
  dmax.assign(static_cast<std::size_t>(d.batch), 0);
  int64_t range = 0, gdmin = std::numeric_limits<int64_t>::max(),
          gdmax = std::numeric_limits<int64_t>::min();
  // Per-row bases and the range of absolute positions (RoPE's table).
  std::vector<int64_t> bases(static_cast<std::size_t>(d.batch));
  int64_t plo = std::numeric_limits<int64_t>::max(), phi = std::numeric_limits<int64_t>::min();
  for (int64_t b = 0; b < d.batch; ++b) {
    int64_t qlo = pr.qp.at(b, 0), qhi = qlo, klo = pr.kp.at(b, 0), khi = klo;
    for (int64_t i = 0; i < d.seq_q; ++i) {
      qlo = std::min(qlo, pr.qp.at(b, i));
      qhi = std::max(qhi, pr.qp.at(b, i));
    }
    for (int64_t j = 0; j < d.seq_k; ++j) {
      klo = std::min(klo, pr.kp.at(b, j));
      khi = std::max(khi, pr.kp.at(b, j));
    }
    int64_t base = std::min(qlo, klo);
    if (pr.opt.chunk) {
      // Chunk boundaries are absolute: the base is a multiple of the chunk (floor division).
      base = mask_rule(pr.opt).chunk_start(base);
    }
    bases[static_cast<std::size_t>(b)] = base;
    plo = std::min({plo, qlo, klo});
    phi = std::max({phi, qhi, khi});
    if (std::max(qhi, khi) - base >= (int64_t{1} << 30)) return false;
    for (int64_t i = 0; i < d.seq_q; ++i) {
      qpos[static_cast<std::size_t>(b * d.seq_q + i)] = static_cast<int32_t>(pr.qp.at(b, i) - base);
    }
    for (int64_t j = 0; j < d.seq_k; ++j) {
      kpos[static_cast<std::size_t>(b * d.seq_k + j)] = static_cast<int32_t>(pr.kp.at(b, j) - base);
    }
    dmax[static_cast<std::size_t>(b)] = static_cast<int32_t>(qhi - klo);
    range = std::max(range, (qhi - klo) - (qlo - khi) + 1);
    gdmin = std::min(gdmin, qlo - khi);
    gdmax = std::max(gdmax, qhi - klo);
  }
  const bool tables = p.kind == 2 || p.kind == 3 || p.kind == 5 || p.kind == 6;
  if (tables && range > 4 * (d.seq_q + d.seq_k) + 4096) return false;

  fp.q = pr.q.data;
  fp.q_stride = {pr.q.stride[0], pr.q.stride[1], pr.q.stride[2]};
  fp.k = pr.k.data;
  fp.k_stride = {pr.k.stride[0], pr.k.stride[1], pr.k.stride[2]};
  if (p.kind == 1) {
    // RoPE: the kernels rotate q and k rows as they load them, from cos/sin by absolute position
    // (O(positions x rotary_dim) doubles) when that table is no larger than rotated copies of q
    // and k would be (sparse positions) and the angles are the accurate ones; else the copies.
    const Rope& r = *p.rope;
    const int64_t pairs = static_cast<int64_t>(r.freqs.inv_freq.size());
    const int64_t padded = kernels::rope_table_padded(pairs);
    const double table_bytes =
        static_cast<double>(phi - plo + 1) * static_cast<double>(2 * padded * 8);
    const double copy_bytes =
        static_cast<double>(d.batch * (d.seq_q * d.heads_q + d.seq_k * d.heads_kv)) *
        static_cast<double>(d.head_dim * 4);
    if (r.freqs.angles == RopeAngles::kAccurate && table_bytes <= copy_bytes) {
      const int64_t n = phi - plo + 1;
      tab.rope_cs = hwy::AllocateAligned<double>(static_cast<std::size_t>(n * 2 * padded));
      kernels::rope_fill_table(r.freqs.inv_freq.data(), pairs, r.freqs.attention_factor, plo, n,
                               tab.rope_cs.get(), kernels::resolve_threads(pr.opt.num_threads));
      tab.rope_base.resize(static_cast<std::size_t>(d.batch));
      for (int64_t b = 0; b < d.batch; ++b) {
        tab.rope_base[static_cast<std::size_t>(b)] = bases[static_cast<std::size_t>(b)] - plo;
      }
      fp.rope.cs = tab.rope_cs.get();
      fp.rope.padded = padded;
      fp.rope.pairs = pairs;
      fp.rope.offset = r.offset;
      fp.rope.head_dim = d.head_dim;
      fp.rope.interleaved = r.style == RopeStyle::kInterleaved;
      fp.rope_base = tab.rope_base.data();
    } else {
      if (!allow_rope_copies) return false;
      rotated_copies(r, pr.q, pr.k, pr.qp, pr.kp, pr.opt.num_threads, tab.q_rot, tab.k_rot);
      fp.q = tab.q_rot.data();
      fp.q_stride = {d.seq_q * d.heads_q * d.head_dim, d.heads_q * d.head_dim, d.head_dim};
      fp.k = tab.k_rot.data();
      fp.k_stride = {d.seq_k * d.heads_kv * d.head_dim, d.heads_kv * d.head_dim, d.head_dim};
    }
  }
  fp.v = pr.v.data;
  fp.v_stride = {pr.v.stride[0], pr.v.stride[1], pr.v.stride[2]};
  fp.batch = d.batch;
  fp.seq_q = d.seq_q;
  fp.seq_k = d.seq_k;
  fp.heads_q = d.heads_q;
  fp.heads_kv = d.heads_kv;
  fp.head_dim = d.head_dim;
  fp.scale = static_cast<float>(p.scale);
  fp.mask = mask_rule(pr.opt);
  if (pr.opt.sinks.data != nullptr) {
    tab.sinks.resize(static_cast<std::size_t>(d.heads_q));
    for (int64_t h = 0; h < d.heads_q; ++h) {
      tab.sinks[static_cast<std::size_t>(h)] = pr.opt.sinks(h);
    }
    fp.sinks = tab.sinks.data();
  }
  fp.qpos = qpos.data();
  fp.kpos = kpos.data();
  fp.num_threads = pr.opt.num_threads;
  const int threads = kernels::resolve_threads(pr.opt.num_threads);

  // ALiBi and T5: bias by distance per (batch row, head), index dmax - delta.
  auto& bias = tab.bias;
  if (p.kind == 2 || p.kind == 3) {
    const int64_t len = range + kPad;
    bias.assign(static_cast<std::size_t>(d.batch * d.heads_q * len), 0.0f);
    kernels::parallel_for(d.batch * d.heads_q, threads, [&](int64_t bh) {
      const int64_t b = bh / d.heads_q, h = bh % d.heads_q;
      float* row = bias.data() + bh * len;
      for (int64_t t = 0; t < range; ++t) {
        const int64_t delta = dmax[static_cast<std::size_t>(b)] - t;
        if (p.kind == 2) {
          row[t] = static_cast<float>(-p.slopes[static_cast<std::size_t>(h)] *
                                      static_cast<double>(delta < 0 ? -delta : delta));
        } else {
          row[t] = p.t5_table(t5_bucket(-delta, p.t5), h);
        }
      }
    });
    fp.bias = bias.data();
    fp.bias_len = len;
    fp.bias_batch_stride = d.heads_q * len;
    fp.bias_dmax = dmax.data();
  }

  // Shaw: contiguous tables.
  auto& rel_k = tab.rel_k;
  auto& rel_v = tab.rel_v;
  auto dense3 = [](const View<const float, 3>& x) {
    std::vector<float> o(static_cast<std::size_t>(x.numel()));
    std::size_t at = 0;
    for (int64_t a = 0; a < x.shape[0]; ++a)
      for (int64_t b = 0; b < x.shape[1]; ++b)
        for (int64_t c = 0; c < x.shape[2]; ++c) o[at++] = x(a, b, c);
    return o;
  };
  if (p.kind == 4) {
    rel_k = dense3(p.rel_k);
    fp.shaw_rel_k = rel_k.data();
    fp.shaw_rel_k_heads = p.rel_k.shape[1];
    fp.shaw_k = p.shaw_k;
    if (p.rel_v.data != nullptr) {
      rel_v = dense3(p.rel_v);
      fp.shaw_rel_v = rel_v.data();
      fp.shaw_rel_v_heads = p.rel_v.shape[1];
    }
  }

  // DeBERTa: row indices by distance, pos_key dense, p2c values k_j . pos_query[r, h].
  auto& pos_key = tab.pos_key;
  auto& pos_query = tab.pos_query;
  auto& c2p = tab.c2p;
  auto& p2c = tab.p2c;
  if (p.kind == 6) {
    const int64_t span2 = 2 * p.deberta.span();
    const int64_t len = range + kPad;
    c2p.assign(static_cast<std::size_t>(len), 0);
    p2c.assign(static_cast<std::size_t>(len), 0);
    // One index table for every batch row: index by (global dmax - delta).
    for (int64_t t = 0; t < len; ++t) {
      const int64_t delta = gdmax - t;
      c2p[static_cast<std::size_t>(t)] =
          static_cast<int32_t>(deberta_c2p_index(delta, 0, p.deberta));
      p2c[static_cast<std::size_t>(t)] =
          static_cast<int32_t>(deberta_p2c_index(delta, 0, p.deberta));
    }
    if (gdmax - gdmin + 1 > range) return false;  // rows with different distance ranges
    for (auto& x : dmax) x = static_cast<int32_t>(gdmax);
    pos_key = dense3(p.pos_key);
    fp.deberta_pos_key = pos_key.data();
    fp.deberta_span = p.deberta.span();
    fp.deberta_c2p = c2p.data();
    fp.deberta_p2c = p2c.data();
    fp.deberta_len = len;
    fp.deberta_dmax = dmax.data();
    pos_query = dense3(p.pos_query);
    fp.deberta_pos_query = pos_query.data();
    if (span2 * ((d.seq_k + kPad - 1) / kPad * kPad + 16) >= (int64_t{1} << 31)) return false;
  }

  // Transformer-XL: the sinusoid rows R(delta) for the distances a mask can leave visible (the
  // kernel projects them with r_net), u and v dense.
  auto& xl_sin = tab.xl_sin;
  auto& xl_rnet = tab.xl_rnet;
  auto& xl_content_bias = tab.xl_content_bias;
  auto& xl_position_bias = tab.xl_position_bias;
  if (p.kind == 5) {
    int64_t dlo = gdmin, dhi = gdmax;
    mask_rule(pr.opt).clip_distances(dlo, dhi);
    dhi = std::max(dhi, dlo);
    const int64_t len = dhi - dlo + 1;
    const int64_t dm = p.xl_rnet.shape[1];
    xl_sin.resize(static_cast<std::size_t>(len * dm));
    // R(delta) for delta = dhi - t: exact sin/cos at the start of each block of 32 distances,
    // then rotations by -w (delta decreases by 1 per row) in double; 31 steps add ~1e-14.
    const int64_t half = dm / 2;
    std::vector<double> w(static_cast<std::size_t>(half)), cw(w.size()), sw(w.size());
    for (int64_t i = 0; i < half; ++i) {
      w[static_cast<std::size_t>(i)] =
          std::pow(p.xl_base, -2.0 * static_cast<double>(i) / static_cast<double>(dm));
      cw[static_cast<std::size_t>(i)] = std::cos(w[static_cast<std::size_t>(i)]);
      sw[static_cast<std::size_t>(i)] = std::sin(w[static_cast<std::size_t>(i)]);
    }
    constexpr int64_t kBlock = 32;
    kernels::parallel_for((len + kBlock - 1) / kBlock, threads, [&](int64_t blk) {
      const int64_t t0 = blk * kBlock, t1 = std::min(len, t0 + kBlock);
      for (int64_t i = 0; i < half; ++i) {
        const auto ui = static_cast<std::size_t>(i);
        const double a = static_cast<double>(dhi - t0) * w[ui];
        double sn = std::sin(a), cs = std::cos(a);
        for (int64_t t = t0; t < t1; ++t) {
          xl_sin[static_cast<std::size_t>(t * dm + i)] = static_cast<float>(sn);
          xl_sin[static_cast<std::size_t>(t * dm + half + i)] = static_cast<float>(cs);
          const double ns = sn * cw[ui] - cs * sw[ui];
          cs = cs * cw[ui] + sn * sw[ui];
          sn = ns;
        }
      }
    });
    xl_rnet.resize(static_cast<std::size_t>(d.heads_q * d.head_dim * dm));
    for (int64_t o = 0; o < d.heads_q * d.head_dim; ++o)
      for (int64_t m = 0; m < dm; ++m)
        xl_rnet[static_cast<std::size_t>(o * dm + m)] = p.xl_rnet(o, m);
    xl_content_bias.resize(static_cast<std::size_t>(d.heads_q * d.head_dim));
    xl_position_bias.resize(xl_content_bias.size());
    for (int64_t h = 0; h < d.heads_q; ++h) {
      for (int64_t c = 0; c < d.head_dim; ++c) {
        xl_content_bias[static_cast<std::size_t>(h * d.head_dim + c)] = p.xl_content_bias(h, c);
        xl_position_bias[static_cast<std::size_t>(h * d.head_dim + c)] = p.xl_position_bias(h, c);
      }
    }
    fp.xl_sin = xl_sin.data();
    fp.xl_rnet = xl_rnet.data();
    fp.xl_dmodel = dm;
    fp.xl_len = len;
    fp.xl_dmax = dhi;
    fp.xl_content_bias = xl_content_bias.data();
    fp.xl_position_bias = xl_position_bias.data();
  }
  return true;
}

bool run_fused(const Problem<float>& pr, const Prepared<float>& p, View<float, 4> out,
               int* nan_score, const View<float, 3>* lse) {
  const Dims& d = pr.d;
  if (!pr.q.last_dim_contiguous() || !pr.k.last_dim_contiguous() || !pr.v.last_dim_contiguous() ||
      !out.last_dim_contiguous()) {
    return false;
  }
  if (d.batch == 0 || d.seq_q == 0) return true;
  if (d.seq_k == 0) {  // every row fully masked (and allowed)
    for (int64_t b = 0; b < d.batch; ++b)
      for (int64_t i = 0; i < d.seq_q; ++i)
        for (int64_t h = 0; h < d.heads_q; ++h)
          for (int64_t c = 0; c < d.head_dim; ++c) out(b, i, h, c) = 0.0f;
    return true;
  }
  kernels::FusedAttentionParams fp;
  FusedTables tables;
  if (!fill_fused_params(pr, p, tables, fp)) return false;
  fp.out = out.data;
  fp.out_stride = {out.stride[0], out.stride[1], out.stride[2]};
  fp.nan_score = nan_score;
  if (lse) {
    fp.lse = lse->data;
    fp.lse_stride = {lse->stride[0], lse->stride[1], lse->stride[2]};
  }
  kernels::fused_attention(fp);
  return true;
}

// Copies a dense row-major float buffer into a strided gradient view of the same shape.
template <std::size_t R>
void copy_dense(const std::vector<float>& src, const View<float, R>& dst) {
  if (dst.data == nullptr) return;
  std::array<int64_t, R> idx{};
  for (int64_t n = 0; n < dst.numel(); ++n) {
    int64_t off = 0;
    for (std::size_t d = 0; d < R; ++d) off += idx[d] * dst.stride[d];
    dst.data[off] = src[static_cast<std::size_t>(n)];
    for (std::size_t d = R; d-- > 0;) {
      if (++idx[d] < dst.shape[d]) break;
      idx[d] = 0;
    }
  }
}

// The fused backward (kernels::fused_attention_backward). Returns false outside its domain (the
// forward's, plus unit-stride last dimensions of every gradient).
bool run_fused_backward(const Problem<float>& pr, const Prepared<float>& p,
                        const View<const float, 4>& out, const View<const float, 3>& lse,
                        const View<const float, 4>& dout, const AttentionGrads& g,
                        const PositionScheme& scheme) {
  const Dims& d = pr.d;
  if (!pr.q.last_dim_contiguous() || !pr.k.last_dim_contiguous() || !pr.v.last_dim_contiguous() ||
      !out.last_dim_contiguous() || !dout.last_dim_contiguous() || !g.dq.last_dim_contiguous() ||
      !g.dk.last_dim_contiguous() || !g.dv.last_dim_contiguous()) {
    return false;
  }
  if (d.batch == 0 || d.seq_q == 0 || d.seq_k == 0) return true;  // gradients are zero
  kernels::FusedBackwardParams bp;
  FusedTables tab;
  if (!fill_fused_params(pr, p, tab, bp.fwd)) return false;
  const auto ud = [](int64_t x) { return static_cast<std::size_t>(x); };
  bp.fwd.out = const_cast<float*>(out.data);
  bp.fwd.out_stride = {out.stride[0], out.stride[1], out.stride[2]};
  bp.fwd.lse = const_cast<float*>(lse.data);
  bp.fwd.lse_stride = {lse.stride[0], lse.stride[1], lse.stride[2]};
  bp.dout = dout.data;
  bp.dout_stride = {dout.stride[0], dout.stride[1], dout.stride[2]};
  // RoPE: gradients with respect to the rotated q and k, rotated back in place below.
  const View<float, 4> dq = g.dq, dk = g.dk;
  bp.dq = dq.data;
  bp.dq_stride = {dq.stride[0], dq.stride[1], dq.stride[2]};
  bp.dk = dk.data;
  bp.dk_stride = {dk.stride[0], dk.stride[1], dk.stride[2]};
  bp.dv = g.dv.data;
  bp.dv_stride = {g.dv.stride[0], g.dv.stride[1], g.dv.stride[2]};
  std::vector<float> dbias, drel_k, drel_v, dpos_key, dpos_query, du, dvb, drnet, dsinks;
  if (g.dsinks.data != nullptr) {
    dsinks.resize(ud(d.heads_q));
    bp.dsinks = dsinks.data();
  }
  const bool want_bias = (p.kind == 2 && g.dslopes.data != nullptr) ||
                         (p.kind == 3 && g.drelative_attention_bias.data != nullptr);
  if (want_bias) {
    dbias.resize(ud(d.batch * bp.fwd.bias_batch_stride));
    bp.dbias = dbias.data();
  }
  if (p.kind == 4) {
    drel_k.resize(ud(p.rel_k.numel()));
    bp.shaw_drel_k = drel_k.data();
    if (g.drel_v.data != nullptr) {
      drel_v.resize(ud(p.rel_v.numel()));
      bp.shaw_drel_v = drel_v.data();
    }
  }
  if (p.kind == 6) {
    dpos_key.resize(ud(p.pos_key.numel()));
    dpos_query.resize(ud(p.pos_query.numel()));
    bp.deberta_dpos_key = dpos_key.data();
    bp.deberta_dpos_query = dpos_query.data();
  }
  if (p.kind == 5) {
    du.resize(ud(d.heads_q * d.head_dim));
    dvb.resize(du.size());
    bp.xl_du = du.data();
    bp.xl_dv = dvb.data();
    if (g.dr_net.data != nullptr) {
      drnet.resize(ud(p.xl_rnet.numel()));
      bp.xl_drnet = drnet.data();
    }
  }
  kernels::fused_attention_backward(bp);
  if (want_bias) {
    // Sum the per-distance gradients into T5 buckets or ALiBi slopes, in a fixed order.
    const int64_t len = bp.fwd.bias_len;
    for (int64_t h = 0; h < d.heads_q; ++h) {
      std::vector<double> acc(p.kind == 3 ? ud(p.t5.num_buckets) : 1, 0.0);
      for (int64_t b = 0; b < d.batch; ++b) {
        const float* row = dbias.data() + b * bp.fwd.bias_batch_stride + h * len;
        const int64_t dmax = bp.fwd.bias_dmax[b];
        for (int64_t t = 0; t < len; ++t) {
          if (row[t] == 0.0f) continue;
          const int64_t delta = dmax - t;
          if (p.kind == 3) {
            acc[ud(t5_bucket(-delta, p.t5))] += row[t];
          } else {
            acc[0] -= static_cast<double>(row[t]) * static_cast<double>(delta < 0 ? -delta : delta);
          }
        }
      }
      if (p.kind == 3) {
        for (int64_t u = 0; u < p.t5.num_buckets; ++u) {
          g.drelative_attention_bias(u, h) = static_cast<float>(acc[ud(u)]);
        }
      } else {
        g.dslopes(h) = static_cast<float>(acc[0]);
      }
    }
  }
  copy_dense(drel_k, g.drel_k);
  copy_dense(drel_v, g.drel_v);
  copy_dense(dpos_key, g.dpos_key);
  copy_dense(dpos_query, g.dpos_query);
  if (p.kind == 5) {
    copy_dense(du, g.dr_w_bias);
    copy_dense(dvb, g.dr_r_bias);
    copy_dense(drnet, g.dr_net);
  }
  if (g.dsinks.data != nullptr) copy_dense(dsinks, g.dsinks);
  if (p.kind == 1) {
    const auto& r = std::get<Rope>(scheme);
    rotate_heads<float>(r, View<const float, 4>(g.dq), g.dq, &pr.qp, Direction::kInverse,
                        pr.opt.num_threads);
    rotate_heads<float>(r, View<const float, 4>(g.dk), g.dk, &pr.kp, Direction::kInverse,
                        pr.opt.num_threads);
  }
  return true;
}

void attention_impl(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
                    const PositionScheme& scheme, const AttentionOptions& options,
                    View<float, 4> out, const View<float, 3>* lse, const Positions* query_positions,
                    const Positions* key_positions) {
  if (detail::forward_model_inputs(q, k, v, scheme, options, out, query_positions,
                                   [&](auto qv, auto vv, const AttentionOptions& o, auto ov) {
                                     attention_impl(qv, k, vv, scheme, o, ov, lse, query_positions,
                                                    key_positions);
                                   })) {
    return;
  }
  detail::require_data(out, "attention: out");
  // Inputs are not scanned for NaN/Inf up front (on a decode step that pass would read the whole
  // KV cache a second time); a non-finite output is traced back to its input below instead.
  auto pr = make_problem<float>(q, k, v, out.shape, options, query_positions, key_positions,
                                /*check_finite=*/false);
  if (lse) {
    require_grad(*lse, {pr.d.batch, pr.d.heads_q, pr.d.seq_q},
                 std::string("attention: lse [batch, heads_q, seq_q]"));
  }
  int nan_score = 0;
  bool fused = false;
  {
    const auto p = prepare<float>(scheme, options, pr.d, q, k, pr.qp, pr.kp,
                                  /*simple_path=*/false);
    check_fully_masked(pr);
    fused = run_fused(pr, p, out, &nan_score, lse);
  }
  if (!fused) {
    // Outside the fused kernel's domain (positions too sparse for int32 distance tables, a
    // non-contiguous last dimension): the simple path.
    const auto pn = prepare<float>(scheme, options, pr.d, q, k, pr.qp, pr.kp);
    run<float>(pr, pn, out, lse);
  }
  if (nan_score != 0 || !all_finite(out)) {
    require_finite_inputs(q, k, v);
    fail(
        "attention: the output is not finite although q, k and v are: the scores overflow "
        "float32 (inputs or scale too large)");
  }
}

}  // namespace

bool detail::attention_fused_storage(const StorageViews& s, const PositionScheme& scheme,
                                     const AttentionOptions& options,
                                     const Positions* query_positions,
                                     const Positions* key_positions) {
  detail::require_data(s.out, "attention: out");
  auto pr = make_problem<float>(s.q, s.k, s.v, s.out.shape, options, query_positions, key_positions,
                                /*check_finite=*/false);
  const Dims& d = pr.d;
  if (!s.q.last_dim_contiguous() || !s.k.last_dim_contiguous() || !s.v.last_dim_contiguous() ||
      !s.out.last_dim_contiguous() || d.batch == 0 || d.seq_q == 0 || d.seq_k == 0) {
    return false;
  }
  const auto p = prepare<float>(scheme, options, d, s.q, s.k, pr.qp, pr.kp,
                                /*simple_path=*/false);
  check_fully_masked(pr);
  kernels::FusedAttentionParams fp;
  FusedTables tables;
  if (!fill_fused_params(pr, p, tables, fp, /*allow_rope_copies=*/false)) return false;
  auto bits = [](const float* x) { return reinterpret_cast<const uint16_t*>(x); };
  fp.q_type = s.q_type;
  fp.kv_type = s.kv_type;
  fp.out_type = s.out_type;
  if (fp.q_type != DType::kF32) fp.q16 = bits(fp.q), fp.q = nullptr;
  if (fp.kv_type != DType::kF32) {
    fp.k16 = bits(fp.k), fp.k = nullptr;
    fp.v16 = bits(fp.v), fp.v = nullptr;
  }
  fp.out = s.out.data;
  fp.out_stride = {s.out.stride[0], s.out.stride[1], s.out.stride[2]};
  if (fp.out_type != DType::kF32) {
    fp.out16 = reinterpret_cast<uint16_t*>(fp.out);
    fp.out = nullptr;
  }
  int nan_score = 0;
  fp.nan_score = &nan_score;
  kernels::fused_attention(fp);
  if (nan_score != 0) return false;
  if (fp.out_type == DType::kF32) return all_finite(s.out);
  // Half output: an infinity or NaN may come from the float32 result (the widened path reports
  // it) or from rounding a finite result past the type's range (the widened path gives the same).
  const uint16_t exp_mask = fp.out_type == DType::kBF16 ? 0x7f80 : 0x7c00;
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t i = 0; i < d.seq_q; ++i)
      for (int64_t h = 0; h < d.heads_q; ++h) {
        const uint16_t* row =
            fp.out16 + b * s.out.stride[0] + i * s.out.stride[1] + h * s.out.stride[2];
        for (int64_t c = 0; c < d.head_dim; ++c) {
          if ((row[c] & exp_mask) == exp_mask) return false;
        }
      }
  return true;
}

void attention(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<float, 4> out,
               const Positions* query_positions, const Positions* key_positions) {
  attention_impl(q, k, v, scheme, options, out, nullptr, query_positions, key_positions);
}

void attention(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
               const PositionScheme& scheme, const AttentionOptions& options, View<float, 4> out,
               View<float, 3> lse, const Positions* query_positions,
               const Positions* key_positions) {
  attention_impl(q, k, v, scheme, options, out, &lse, query_positions, key_positions);
}

void attention_merge(View<const float, 4> out_a, View<const float, 3> lse_a,
                     View<const float, 4> out_b, View<const float, 3> lse_b, View<float, 4> out,
                     View<float, 3> lse) {
  const std::string w = "attention_merge: ";
  detail::require_data(out_a, w + "out_a");
  const auto& sh = out_a.shape;
  require_grad(out_b, sh, w + "out_b");
  require_grad(out, sh, w + "out");
  const std::array<int64_t, 3> ls{sh[0], sh[2], sh[1]};
  require_grad(lse_a, ls, w + "lse_a [batch, heads_q, seq_q]");
  require_grad(lse_b, ls, w + "lse_b [batch, heads_q, seq_q]");
  require_grad(lse, ls, w + "lse [batch, heads_q, seq_q]");
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < sh[0]; ++b)
    for (int64_t i = 0; i < sh[1]; ++i)
      for (int64_t h = 0; h < sh[2]; ++h) {
        const float la = lse_a(b, h, i), lb = lse_b(b, h, i);
        if (std::isnan(la) || std::isnan(lb) || la == -kNegInf || lb == -kNegInf) {
          fail(w + "lse is NaN or +inf at [" + std::to_string(b) + ", " + std::to_string(h) + ", " +
               std::to_string(i) + "]");
        }
        const float m = std::max(la, lb);
        if (m == kNegInf) {
          for (int64_t c = 0; c < sh[3]; ++c) out(b, i, h, c) = 0.0f;
          lse(b, h, i) = kNegInf;
          continue;
        }
        const double wa = la == kNegInf ? 0.0 : std::exp(static_cast<double>(la) - m);
        const double wb = lb == kNegInf ? 0.0 : std::exp(static_cast<double>(lb) - m);
        const double inv = 1.0 / (wa + wb);
        for (int64_t c = 0; c < sh[3]; ++c) {
          out(b, i, h, c) = static_cast<float>((wa * static_cast<double>(out_a(b, i, h, c)) +
                                                wb * static_cast<double>(out_b(b, i, h, c))) *
                                               inv);
        }
        lse(b, h, i) = static_cast<float>(m + std::log(wa + wb));
      }
}

void attention_backward(View<const float, 4> q, View<const float, 4> k, View<const float, 4> v,
                        View<const float, 4> out, View<const float, 3> lse,
                        View<const float, 4> dout, const PositionScheme& scheme,
                        const AttentionOptions& options, const AttentionGrads& grads,
                        const Positions* query_positions, const Positions* key_positions) {
  if (detail::backward_model_inputs(
          q, k, v, out, dout, scheme, options, grads, query_positions,
          [&](auto qv, auto vv, auto ov, auto dov, const AttentionOptions& o, const auto& g) {
            attention_backward(qv, k, vv, ov, lse, dov, scheme, o, g, query_positions,
                               key_positions);
          })) {
    return;
  }
  auto pr = make_problem<float>(q, k, v, q.shape, options, query_positions, key_positions);
  const auto p = prepare<float>(scheme, options, pr.d, q, k, pr.qp, pr.kp,
                                /*simple_path=*/false);
  check_backward_args(pr, scheme, p, out, lse, dout, grads);
  if (!run_fused_backward(pr, p, out, lse, dout, grads, scheme)) {
    // Outside the fused kernel's domain: the simple path.
    const auto pn = prepare<float>(scheme, options, pr.d, q, k, pr.qp, pr.kp);
    run_backward<float>(pr, pn, out, lse, dout, grads, scheme);
  }
}

void attention_backward_naive(View<const float, 4> q, View<const float, 4> k,
                              View<const float, 4> v, View<const float, 4> out,
                              View<const float, 3> lse, View<const float, 4> dout,
                              const PositionScheme& scheme, const AttentionOptions& options,
                              const AttentionGrads& grads, const Positions* query_positions,
                              const Positions* key_positions) {
  if (detail::backward_model_inputs(
          q, k, v, out, dout, scheme, options, grads, query_positions,
          [&](auto qv, auto vv, auto ov, auto dov, const AttentionOptions& o, const auto& g) {
            attention_backward_naive(qv, k, vv, ov, lse, dov, scheme, o, g, query_positions,
                                     key_positions);
          })) {
    return;
  }
  backward_materialized<float>(q, k, v, out, lse, dout, scheme, options, grads, query_positions,
                               key_positions);
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
  run<float>(pr, p, out);
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
  run<double>(pr, p, out);
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
  backward_materialized<double>(q, k, v, out, lse, dout, scheme, options, grads, query_positions,
                                key_positions, &tables);
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
    fail("attention_scores: batch_index/head out of range");
  }
  const auto p = prepare<double>(scheme, options, pr.d, q, k, pr.qp, pr.kp, true, &tables);
  std::vector<double> s(static_cast<std::size_t>(pr.d.seq_q * pr.d.seq_k));
  for (int64_t i = 0; i < pr.d.seq_q; ++i) {
    score_row(pr, p, batch_index, head, i, s.data() + i * pr.d.seq_k);
  }
  return s;
}

}  // namespace ref
}  // namespace posenc
