// src/schemes/deberta.cc - DeBERTa relative positions and log buckets (He et al. 2021, "DeBERTa:
// Decoding-enhanced BERT with Disentangled Attention"; docs/deberta.md).
#include "posenc/deberta.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "common.h"
#include "schemes/build.h"
#include "schemes/deberta_term.h"

namespace posenc {

void validate(const DebertaBuckets& cfg) {
  detail::require_positive(cfg.max_relative_positions, "deberta: max_relative_positions");
  // The span K bounds the table's 2K rows and rho + K: at most 2^48, like positions.
  for (const auto& [name, v] : {std::pair{"max_relative_positions", cfg.max_relative_positions},
                                std::pair{"position_buckets", cfg.position_buckets}}) {
    if (v > kMaxPosition) {
      detail::fail(std::string("deberta: ") + name + " must be <= 2^48 (got " + std::to_string(v) +
                   ")");
    }
  }
  if (cfg.position_buckets < 0) {
    detail::fail("deberta: position_buckets must be >= 0 (got " +
                 std::to_string(cfg.position_buckets) + ")");
  }
  if (cfg.position_buckets > 0) {
    if (cfg.position_buckets < 4) {
      detail::fail("deberta: position_buckets must be 0 or >= 4 (got " +
                   std::to_string(cfg.position_buckets) + ")");
    }
    const int64_t mid = cfg.position_buckets / 2;
    if (cfg.max_relative_positions - 1 <= mid) {
      detail::fail(
          "deberta: max_relative_positions - 1 (" + std::to_string(cfg.max_relative_positions - 1) +
          ") must exceed position_buckets / 2 (" + std::to_string(mid) + ") for log bucketing");
    }
  }
}

int64_t deberta_bucket(int64_t rho, const DebertaBuckets& cfg) {
  if (cfg.position_buckets <= 0) return rho;
  const int64_t mid = cfg.position_buckets / 2;
  const int64_t a = rho < 0 ? -rho : rho;
  if (a <= mid) return rho;
  const int64_t sign = rho < 0 ? -1 : 1;
  double v;
  if (cfg.float64_log) {
    v = std::ceil(
        std::log(static_cast<double>(a) / static_cast<double>(mid)) /
        std::log(static_cast<double>(cfg.max_relative_positions - 1) / static_cast<double>(mid)) *
        static_cast<double>(mid - 1));
  } else {
    // float32 throughout, as the HF model code evaluates it: (max - 1) / mid is a Python double
    // rounded to float32 before its log.
    const float q = static_cast<float>(a) / static_cast<float>(mid);
    const float den = std::log(static_cast<float>(
        static_cast<double>(cfg.max_relative_positions - 1) / static_cast<double>(mid)));
    v = static_cast<double>(std::ceil(std::log(q) / den * static_cast<float>(mid - 1)));
  }
  return sign * (static_cast<int64_t>(v) + mid);
}

int64_t deberta_c2p_index(int64_t pos_q, int64_t pos_k, const DebertaBuckets& cfg) {
  const int64_t k = cfg.span();
  return std::clamp<int64_t>(deberta_bucket(pos_q - pos_k, cfg) + k, 0, 2 * k - 1);
}

int64_t deberta_p2c_index(int64_t pos_q, int64_t pos_k, const DebertaBuckets& cfg) {
  const int64_t k = cfg.span();
  const int64_t rho = deberta_bucket(pos_q - pos_k, cfg);
  return std::clamp<int64_t>((cfg.p2c == DebertaP2c::kPaper ? -rho : rho) + k, 0, 2 * k - 1);
}

namespace attn {

// The scheme from its settings, parameters and model config (build_scheme).
template <class T>
void DebertaTerm<T>::build(detail::SchemeBuild& b, const ModelLayer*) {
  DebertaBuckets buckets;
  if (b.model) {
    b.conflict(b.settings.position_buckets.has_value(), "position_buckets");
    b.conflict(b.settings.max_relative_positions.has_value(), "max_relative_positions");
    buckets = b.model->deberta;
    const auto& types = b.model->pos_att_type;
    const bool c2p = std::find(types.begin(), types.end(), "c2p") != types.end();
    const bool p2c = std::find(types.begin(), types.end(), "p2c") != types.end();
    if (!c2p || !p2c) {
      detail::fail(b.settings.config_name + ": pos_att_type '" + detail::join(types, "|") +
                   "' lacks c2p or p2c; posenc's DeBERTa scheme computes both");
    }
  } else {
    buckets.position_buckets = b.settings.position_buckets.value_or(buckets.position_buckets);
    buckets.max_relative_positions =
        b.settings.max_relative_positions.value_or(buckets.max_relative_positions);
  }
  buckets.p2c = b.settings.deberta_p2c.value_or(buckets.p2c);
  buckets.float64_log = b.settings.deberta_float64_log.value_or(buckets.float64_log);
  validate(buckets);
  const ParamTensor* pk = b.get("pos_key", {3}, "[2K, heads, head_dim]", true);
  const ParamTensor* pq = b.get("pos_query", {3}, "[2K, heads, head_dim]", true);
  const int64_t k = buckets.span();
  const std::string setting =
      buckets.position_buckets > 0 ? "position_buckets " : "max_relative_positions ";
  const std::string origin =
      (b.model ? b.settings.config_name + ": " : std::string()) + setting + std::to_string(k);
  for (const auto& [name, t] : {std::pair{"pos_key", pk}, std::pair{"pos_query", pq}}) {
    if (t->shape[0] != 2 * k) {
      detail::fail<ShapeError>(b.pname(name) + " has " + std::to_string(t->shape[0]) +
                               " rows, expected 2K = " + std::to_string(2 * k) + " (K = " + origin +
                               ")");
    }
  }
  DeBERTa db;
  db.buckets = buckets;
  if (b.f64) {
    b.out.tables64.pos_key = b.view<double, 3>(*pk);
    b.out.tables64.pos_query = b.view<double, 3>(*pq);
  } else {
    db.pos_key = b.view<float, 3>(*pk);
    db.pos_query = b.view<float, 3>(*pq);
  }
  b.learned("pos_key", *pk, pk->shape);
  b.learned("pos_query", *pq, pq->shape);
  b.out.scheme = db;
}
template void DebertaTerm<float>::build(detail::SchemeBuild&, const ModelLayer*);

}  // namespace attn

}  // namespace posenc
