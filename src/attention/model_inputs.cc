// src/attention/model_inputs.cc - the query temperature and narrower value heads of
// model_inputs.h.
#include "attention/model_inputs.h"

#include <cmath>
#include <string>
#include <variant>

namespace posenc {

double attention_temperature(const AttentionTemperature& t, int64_t pos) {
  // log(floor((p + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0 on float32 tensors.
  const float p = static_cast<float>(pos) + 1.0f;
  const float f = std::floor(p / static_cast<float>(t.floor_scale));
  return static_cast<double>(std::log(f + 1.0f) * static_cast<float>(t.attn_scale) + 1.0f);
}

namespace detail {

std::vector<double> query_factors(const AttentionTemperature& t, int64_t batch, int64_t seq_q,
                                  int64_t seq_k, const Positions* query_positions) {
  if (!(t.floor_scale > 0) || !std::isfinite(t.floor_scale) || !std::isfinite(t.attn_scale)) {
    fail(
        "attention: query_temperature needs a finite floor_scale > 0 and a finite attn_scale "
        "(got floor_scale " +
        num(t.floor_scale) + ", attn_scale " + num(t.attn_scale) + ")");
  }
  if (!query_positions && seq_q > seq_k) {
    fail("attention: query length (" + std::to_string(seq_q) + ") exceeds key length (" +
         std::to_string(seq_k) +
         "): the default positions put queries last in the key sequence; pass explicit "
         "query and key positions");
  }
  const Positions qp = query_positions ? *query_positions : Positions::offset(seq_k - seq_q);
  qp.validate(batch, seq_q, "attention: query positions");
  std::vector<double> f(static_cast<std::size_t>(batch * seq_q));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < seq_q; ++i) {
      f[static_cast<std::size_t>(b * seq_q + i)] = attention_temperature(t, qp.at(b, i));
    }
  }
  return f;
}

bool has_shaw_values(const PositionScheme& scheme) {
  const auto* s = std::get_if<Shaw>(&scheme);
  return s != nullptr && s->rel_v.data != nullptr;
}

void check_narrow_values(const std::array<int64_t, 4>& q, const std::array<int64_t, 4>& k,
                         const std::array<int64_t, 4>& v, const std::array<int64_t, 4>* out,
                         bool has_rel_v) {
  const std::string vs = shape_str(v);
  if (v[0] != k[0] || v[1] != k[1] || v[2] != k[2] || v[3] < 1 || v[3] > q[3]) {
    fail<ShapeError>("attention: v " + vs + " must have the same shape as k " + shape_str(k) +
                     " [batch, seq_k, heads_kv, head_dim], or that shape with a head dim between "
                     "1 and q's head_dim " +
                     std::to_string(q[3]) + " (narrower values: multi-head latent attention)");
  }
  if (has_rel_v) {
    fail("attention: Shaw's rel_v needs v with q's head_dim " + std::to_string(q[3]) + " (v " + vs +
         ")");
  }
  if (out != nullptr && *out != std::array<int64_t, 4>{q[0], q[1], q[2], v[3]}) {
    fail<ShapeError>(
        "attention: out " + shape_str(*out) + " must be [batch, seq_q, heads_q, " +
        "v's head dim] = " + shape_str(std::array<int64_t, 4>{q[0], q[1], q[2], v[3]}));
  }
}

}  // namespace detail
}  // namespace posenc
