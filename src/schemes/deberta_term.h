// src/schemes/deberta_term.h - DeBERTa's disentangled attention term (docs/deberta.md):
// q · pos_key[c2p(delta)] + k · pos_query[p2c(delta)] added to the content score (scale
// 1/sqrt(3D) by default). The interface: schemes/term.h.
#pragma once

#include <string>
#include <tuple>
#include <vector>

#include "schemes/term.h"

namespace posenc::attn {

template <class T>
struct DebertaTerm : NoTerm<T> {
  static constexpr int kScoreTerms = 3;  // c2c, c2p, p2c
  static constexpr bool kDistanceTables = true;
  View<const T, 3> pos_key, pos_query;  // [2K, heads_q, head_dim]
  DebertaBuckets buckets;

  void prepare(const DeBERTa& db, TermInputs<T>& in) {
    const Dims& d = in.d;
    validate(db.buckets);
    const int64_t span = db.buckets.span();
    pos_key = in.table(db.pos_key, &ref::SchemeTables::pos_key);
    pos_query = in.table(db.pos_query, &ref::SchemeTables::pos_query);
    if (pos_key.data == nullptr) fail<ShapeError>("attention: deberta: pos_key is missing");
    if (pos_query.data == nullptr) fail<ShapeError>("attention: deberta: pos_query is missing");
    require_table_shape(
        pos_key, {2 * span, d.heads_q, d.head_dim},
        "attention: deberta: pos_key [2K, heads, head_dim] (K = " + std::to_string(span) + ")");
    require_table_shape(
        pos_query, {2 * span, d.heads_q, d.head_dim},
        "attention: deberta: pos_query [2K, heads, head_dim] (K = " + std::to_string(span) + ")");
    buckets = db.buckets;
  }

  void score(const Cell<T>& c, T& content, T&) const {
    const T* pkey = pos_key.data + deberta_c2p_index(c.pq, c.pk, buckets) * pos_key.stride[0] +
                    c.h * pos_key.stride[1];
    const T* pqry = pos_query.data + deberta_p2c_index(c.pq, c.pk, buckets) * pos_query.stride[0] +
                    c.h * pos_query.stride[1];
    for (int64_t x = 0; x < c.dim; ++x) {
      content += c.q(x) * static_cast<T>(pkey[x * pos_key.stride[2]]) +
                 c.k(x) * static_cast<T>(pqry[x * pos_query.stride[2]]);
    }
  }

  void grad(const Cell<T>& c, T, T, T sds, CellGrads<T>& g) const {
    const int64_t c2p = deberta_c2p_index(c.pq, c.pk, buckets);
    const int64_t p2c = deberta_p2c_index(c.pq, c.pk, buckets);
    for (int64_t x = 0; x < c.dim; ++x) {
      g.dq_row[x] += sds * static_cast<T>(pos_key(c2p, c.h, x));
      g.dk(x) += sds * static_cast<T>(pos_query(p2c, c.h, x));
      if (g.g.dpos_key.data) g.g.dpos_key(c2p, c.h, x) += sds * c.q(x);
      if (g.g.dpos_query.data) g.g.dpos_query(p2c, c.h, x) += sds * c.k(x);
    }
  }

  // Its learned tables by parameter name, and their gradient fields (bind_param_grad).
  static auto grad_fields(AttentionGradsOf<T>& g) {
    return std::make_tuple(std::pair{"pos_key", &g.dpos_key},
                           std::pair{"pos_query", &g.dpos_query});
  }
  void check_grads(const AttentionGradsOf<T>& g, GradCheck<T>& chk) const {
    chk.own(g.dpos_key, pos_key.shape, "dpos_key");
    chk.own(g.dpos_query, pos_query.shape, "dpos_query");
  }

  // The kernel: row indices by distance (one table for every batch row, indexed by the global
  // dmax - delta), pos_key and pos_query dense; it forms the c2p and p2c products itself.
  bool fill_kernel(KernelInputs& in) const {
    const Dims& d = in.pr.d;
    const int64_t span2 = 2 * buckets.span();
    const int64_t len = in.range + KernelInputs::kPad;
    std::vector<int32_t>& c2p = in.i32.emplace_back(static_cast<std::size_t>(len), 0);
    std::vector<int32_t>& p2c = in.i32.emplace_back(static_cast<std::size_t>(len), 0);
    for (int64_t t = 0; t < len; ++t) {
      const int64_t delta = in.gdmax - t;
      c2p[static_cast<std::size_t>(t)] = static_cast<int32_t>(deberta_c2p_index(delta, 0, buckets));
      p2c[static_cast<std::size_t>(t)] = static_cast<int32_t>(deberta_p2c_index(delta, 0, buckets));
    }
    if (in.gdmax - in.gdmin + 1 > in.range) return false;  // rows with different distance ranges
    for (auto& x : in.dmax) x = static_cast<int32_t>(in.gdmax);
    in.fp.deberta_pos_key = in.f32.emplace_back(dense3(pos_key)).data();
    in.fp.deberta_span = buckets.span();
    in.fp.deberta_c2p = c2p.data();
    in.fp.deberta_p2c = p2c.data();
    in.fp.deberta_len = len;
    in.fp.deberta_dmax = in.dmax.data();
    in.fp.deberta_pos_query = in.f32.emplace_back(dense3(pos_query)).data();
    const int64_t kpad = KernelInputs::kPad;
    return span2 * ((d.seq_k + kpad - 1) / kpad * kpad + 16) < (int64_t{1} << 31);
  }
  void bind_grads(KernelGrads& kg) const {
    kg.bp.deberta_dpos_key = kg.f32.emplace_back(static_cast<std::size_t>(pos_key.numel())).data();
    kg.bp.deberta_dpos_query =
        kg.f32.emplace_back(static_cast<std::size_t>(pos_query.numel())).data();
  }
  void fold_grads(KernelGrads& kg) const {
    copy_dense(kg.bp.deberta_dpos_key, kg.g.dpos_key);
    copy_dense(kg.bp.deberta_dpos_query, kg.g.dpos_query);
  }

  // The scheme from settings, parameter tensors and a model config (schemes/deberta.cc).
  static void build(detail::SchemeBuild& b, const ModelLayer* layer);
};

}  // namespace posenc::attn
