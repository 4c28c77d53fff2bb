// src/deberta.cc - DeBERTa relative positions and log buckets (He et al. 2021, "DeBERTa:
// Decoding-enhanced BERT with Disentangled Attention"; docs/deberta.md).
#include "posenc/deberta.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "common.h"

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

}  // namespace posenc
