// src/schemes/alibi_term.h - ALiBi's attention term (docs/alibi.md): bias -m_h |pos_q - pos_k|
// after the scale; the slopes as a learned parameter (dslopes). The interface: schemes/term.h.
#pragma once

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "schemes/bias_table.h"
#include "schemes/term.h"

namespace posenc::attn {

template <class T>
struct AlibiTerm : NoTerm<T> {
  static constexpr bool kDistanceTables = true;
  std::vector<double> slopes;

  void prepare(const Alibi& a, TermInputs<T>& in) {
    if (a.slopes.empty()) {
      slopes = alibi_slopes(AlibiConfig{.heads = in.d.heads_q, .max_bias = a.max_bias});
      return;
    }
    if (static_cast<int64_t>(a.slopes.size()) != in.d.heads_q) {
      fail<ShapeError>("attention: alibi: " + std::to_string(a.slopes.size()) +
                       " slopes given for " + std::to_string(in.d.heads_q) + " query heads");
    }
    for (double s : a.slopes) detail::require_finite(s, "attention: alibi: slope");
    slopes = a.slopes;
  }

  void score(const Cell<T>& c, T&, T& bias) const {
    bias = static_cast<T>(alibi_bias(slopes[static_cast<std::size_t>(c.h)], c.pq, c.pk));
  }

  void grad(const Cell<T>& c, T, T ds, T, CellGrads<T>& g) const {
    if (g.g.dslopes.data == nullptr) return;
    const int64_t rel = c.pk - c.pq;
    g.g.dslopes(c.h) -= ds * static_cast<T>(rel < 0 ? -rel : rel);
  }

  // Its learned tables by parameter name, and their gradient fields (bind_param_grad).
  static auto grad_fields(AttentionGradsOf<T>& g) {
    return std::make_tuple(std::pair{"slopes", &g.dslopes});
  }
  void check_grads(const AttentionGradsOf<T>& g, GradCheck<T>& chk) const {
    chk.own(g.dslopes, {static_cast<int64_t>(slopes.size())}, "dslopes [heads_q]");
  }

  // The kernel: the bias by distance per (batch row, head).
  bool fill_kernel(KernelInputs& in) const {
    fill_bias_table(in, [&](int64_t h, int64_t delta) {
      return static_cast<float>(-slopes[static_cast<std::size_t>(h)] *
                                static_cast<double>(delta < 0 ? -delta : delta));
    });
    return true;
  }
  void bind_grads(KernelGrads& kg) const {
    if (kg.g.dslopes.data != nullptr) bind_bias_grads(kg);
  }
  // dslopes_h = -sum over cells of dS |delta|, summed per distance by the kernel, in a fixed order.
  void fold_grads(KernelGrads& kg) const {
    if (kg.g.dslopes.data == nullptr) return;
    const View<float, 1>& ds = kg.g.dslopes;
    fold_bias_grads(
        kg, 1,
        [](int64_t delta) {
          return std::pair<int64_t, double>{0, -static_cast<double>(delta < 0 ? -delta : delta)};
        },
        View<float, 2>{ds.data, {1, ds.shape[0]}, {0, ds.stride[0]}});
  }

  // The scheme from settings, parameter tensors and a model config (schemes/alibi.cc).
  static void build(detail::SchemeBuild& b, const ModelLayer* layer);
};

}  // namespace posenc::attn
