// src/schemes/t5_term.h - T5's attention term (docs/t5.md): a learned bias per (bucket of the
// relative position, head) after the scale; its gradient drelative_attention_bias. The interface:
// schemes/term.h.
#pragma once

#include <string>
#include <tuple>
#include <vector>

#include "schemes/bias_table.h"
#include "schemes/term.h"

namespace posenc::attn {

template <class T>
struct T5Term : NoTerm<T> {
  static constexpr bool kDistanceTables = true;
  T5BucketConfig cfg;
  View<const T, 2> table;  // [num_buckets, heads_q]

  void prepare(const T5Bias& t, TermInputs<T>& in) {
    table = in.table(t.table, &ref::SchemeTables::relative_attention_bias);
    if (table.data == nullptr)
      fail<ShapeError>("attention: t5: relative_attention_bias is missing");
    cfg = T5BucketConfig{.num_buckets = table.shape[0],
                         .max_distance = t.max_distance,
                         .bidirectional = t.bidirectional.value_or(!in.opt.causal)};
    validate(cfg);
    require_table_shape(table, {cfg.num_buckets, in.d.heads_q},
                        "attention: t5: relative_attention_bias [num_buckets, heads]");
  }

  void score(const Cell<T>& c, T&, T& bias) const {
    bias = static_cast<T>(
        table.data[t5_bucket(c.pk - c.pq, cfg) * table.stride[0] + c.h * table.stride[1]]);
  }

  void grad(const Cell<T>& c, T, T ds, T, CellGrads<T>& g) const {
    if (g.g.drelative_attention_bias.data) {
      g.g.drelative_attention_bias(t5_bucket(c.pk - c.pq, cfg), c.h) += ds;
    }
  }

  // Its learned tables by parameter name, and their gradient fields (bind_param_grad).
  static auto grad_fields(AttentionGradsOf<T>& g) {
    return std::make_tuple(std::pair{"relative_attention_bias", &g.drelative_attention_bias});
  }
  void check_grads(const AttentionGradsOf<T>& g, GradCheck<T>& chk) const {
    chk.own(g.drelative_attention_bias, table.shape, "drelative_attention_bias");
  }

  bool fill_kernel(KernelInputs& in) const {
    fill_bias_table(in, [&](int64_t h, int64_t delta) { return table(t5_bucket(-delta, cfg), h); });
    return true;
  }
  void bind_grads(KernelGrads& kg) const {
    if (kg.g.drelative_attention_bias.data != nullptr) bind_bias_grads(kg);
  }
  // Per bucket: the sum of dS over its distances, in a fixed order.
  void fold_grads(KernelGrads& kg) const {
    if (kg.g.drelative_attention_bias.data == nullptr) return;
    fold_bias_grads(
        kg, cfg.num_buckets,
        [&](int64_t delta) {
          return std::pair<int64_t, double>{t5_bucket(-delta, cfg), 1.0};
        },
        kg.g.drelative_attention_bias);
  }

  // The scheme from settings, parameter tensors and a model config (schemes/t5.cc).
  static void build(detail::SchemeBuild& b, const ModelLayer* layer);
};

}  // namespace posenc::attn
