// src/schemes/shaw_term.h - the attention term of Shaw et al.'s relative position representations
// (docs/shaw.md): q · rel_k[idx] added to the content score, sum_j P_ij rel_v[idx] to the output,
// idx = clamp(pos_k - pos_q, -K, K) + K. The interface: schemes/term.h.
#pragma once

#include <string>
#include <tuple>
#include <vector>

#include "schemes/term.h"

namespace posenc::attn {

template <class T>
struct ShawTerm : NoTerm<T> {
  static constexpr bool kValues = true;
  View<const T, 3> rel_k, rel_v;  // [2K+1, 1 or heads_q, head_dim]; rel_v may be empty
  int64_t kk = 0;                 // K

  void prepare(const Shaw& s, TermInputs<T>& in) {
    const Dims& d = in.d;
    rel_k = in.table(s.rel_k, &ref::SchemeTables::rel_k);
    const auto rv = in.table(s.rel_v, &ref::SchemeTables::rel_v);
    const int64_t rows = rel_k.shape[0];
    if (rel_k.data == nullptr) fail<ShapeError>("attention: shaw: rel_k is missing");
    if (rows < 1 || rows % 2 == 0) {
      fail<ShapeError>("attention: shaw: rel_k must have 2K+1 (odd) rows (got " +
                       std::to_string(rows) + ")");
    }
    // [2K+1, 1 (shared) or heads_q, head_dim].
    const auto check = [&](const View<const T, 3>& t, const std::string& name) {
      const int64_t th = t.shape[1];
      if (th != 1 && th != d.heads_q) {
        fail<ShapeError>("attention: shaw: " + name + " heads (" + std::to_string(th) +
                         ") must be 1 (shared) or heads_q (" + std::to_string(d.heads_q) + ")");
      }
      require_table_shape(t, {rows, th, d.head_dim},
                          "attention: shaw: " + name + " [2K+1, heads, head_dim]");
    };
    check(rel_k, "rel_k");
    if (rv.data != nullptr) {
      check(rv, "rel_v");
      rel_v = rv;
    }
    kk = (rows - 1) / 2;
  }

  int64_t index(const Cell<T>& c) const { return shaw_index(c.pk - c.pq, kk); }

  void score(const Cell<T>& c, T& content, T&) const {
    const int64_t th = rel_k.shape[1] == 1 ? 0 : c.h;
    const T* rk = rel_k.data + index(c) * rel_k.stride[0] + th * rel_k.stride[1];
    for (int64_t x = 0; x < c.dim; ++x) content += c.q(x) * static_cast<T>(rk[x * rel_k.stride[2]]);
  }

  void value(const Cell<T>& c, T p, T* acc) const {
    if (rel_v.data == nullptr) return;
    const int64_t th = rel_v.shape[1] == 1 ? 0 : c.h;
    const T* rv = rel_v.data + index(c) * rel_v.stride[0] + th * rel_v.stride[1];
    for (int64_t x = 0; x < c.dim; ++x) acc[x] += p * static_cast<T>(rv[x * rel_v.stride[2]]);
  }

  // The value term's part of dP: dp += dout · rel_v[idx].
  void value_dp(const Cell<T>& c, const T* dout, int64_t ds, T& dp) const {
    if (rel_v.data == nullptr) return;
    const int64_t th = rel_v.shape[1] == 1 ? 0 : c.h, idx = index(c);
    for (int64_t x = 0; x < c.dim; ++x) dp += dout[x * ds] * static_cast<T>(rel_v(idx, th, x));
  }

  void grad(const Cell<T>& c, T p, T, T sds, CellGrads<T>& g) const {
    const int64_t idx = index(c);
    if (rel_v.data != nullptr && g.g.drel_v.data) {
      const int64_t th = rel_v.shape[1] == 1 ? 0 : c.h;
      for (int64_t x = 0; x < c.dim; ++x) g.g.drel_v(idx, th, x) += p * g.dout(x);
    }
    const int64_t th = rel_k.shape[1] == 1 ? 0 : c.h;
    for (int64_t x = 0; x < c.dim; ++x) {
      g.dq_row[x] += sds * static_cast<T>(rel_k(idx, th, x));
      if (g.g.drel_k.data) g.g.drel_k(idx, th, x) += sds * c.q(x);
    }
  }

  // Its learned tables by parameter name, and their gradient fields (bind_param_grad).
  static auto grad_fields(AttentionGradsOf<T>& g) {
    return std::make_tuple(std::pair{"rel_k", &g.drel_k}, std::pair{"rel_v", &g.drel_v});
  }
  void check_grads(const AttentionGradsOf<T>& g, GradCheck<T>& chk) const {
    if (g.drel_v.data != nullptr && rel_v.data == nullptr) {
      fail(chk.where + "drel_v given but the scheme has no rel_v");
    }
    chk.own(g.drel_k, rel_k.shape, "drel_k");
    chk.own(g.drel_v, rel_v.shape, "drel_v");
  }

  // The kernel: dense tables; it forms the per-query projections itself.
  bool fill_kernel(KernelInputs& in) const {
    const std::vector<float>& k = in.f32.emplace_back(dense3(rel_k));
    in.fp.shaw_rel_k = k.data();
    in.fp.shaw_rel_k_heads = rel_k.shape[1];
    in.fp.shaw_k = kk;
    if (rel_v.data != nullptr) {
      const std::vector<float>& v = in.f32.emplace_back(dense3(rel_v));
      in.fp.shaw_rel_v = v.data();
      in.fp.shaw_rel_v_heads = rel_v.shape[1];
    }
    return true;
  }
  void bind_grads(KernelGrads& kg) const {
    kg.bp.shaw_drel_k = kg.f32.emplace_back(static_cast<std::size_t>(rel_k.numel())).data();
    if (kg.g.drel_v.data != nullptr) {
      kg.bp.shaw_drel_v = kg.f32.emplace_back(static_cast<std::size_t>(rel_v.numel())).data();
    }
  }
  void fold_grads(KernelGrads& kg) const {
    copy_dense(kg.bp.shaw_drel_k, kg.g.drel_k);
    if (kg.bp.shaw_drel_v != nullptr) copy_dense(kg.bp.shaw_drel_v, kg.g.drel_v);
  }

  // The scheme from settings, parameter tensors and a model config (schemes/shaw.cc).
  static void build(detail::SchemeBuild& b, const ModelLayer* layer);
};

}  // namespace posenc::attn
