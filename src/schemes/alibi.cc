// src/schemes/alibi.cc - ALiBi slopes (Press, Smith, Lewis 2022, "Train Short, Test Long";
// docs/alibi.md).
#include "posenc/alibi.h"

#include <cmath>

#include "common.h"
#include "schemes/alibi_term.h"
#include "schemes/build.h"

namespace posenc {

std::vector<double> alibi_slopes(const AlibiConfig& cfg) {
  detail::require_positive(cfg.heads, "alibi: heads");
  if (!std::isfinite(cfg.max_bias) || cfg.max_bias <= 0) {
    detail::fail("alibi: max_bias must be finite and > 0 (got " + detail::num(cfg.max_bias) + ")");
  }
  if (cfg.heads > (int64_t{1} << 20)) detail::fail("alibi: heads must be <= 2^20");
  // n = 2^floor(log2 H), computed on integers.
  int64_t n = 1;
  while (n * 2 <= cfg.heads) n *= 2;
  std::vector<double> slopes;
  slopes.reserve(static_cast<std::size_t>(cfg.heads));
  const double b = cfg.max_bias;
  for (int64_t h = 1; h <= n; ++h) {
    slopes.push_back(std::exp2(-b * static_cast<double>(h) / static_cast<double>(n)));
  }
  // Remaining heads: every other slope (h = 1, 3, 5, ...) of the 2n-head set.
  for (int64_t h = 1; static_cast<int64_t>(slopes.size()) < cfg.heads; h += 2) {
    slopes.push_back(std::exp2(-b * static_cast<double>(h) / static_cast<double>(2 * n)));
  }
  return slopes;
}

namespace attn {

// The scheme from its settings, parameters and model config (build_scheme).
template <class T>
void AlibiTerm<T>::build(detail::SchemeBuild& b, const ModelLayer*) {
  Alibi alibi;
  const ParamTensor* slopes = b.get("slopes", {1}, "[heads]", false);
  if (b.model) {
    if (b.dims.heads_q != b.model->alibi.heads) {
      detail::fail<ShapeError>(b.settings.q_name + ": heads_q " + std::to_string(b.dims.heads_q) +
                               " does not match " + b.model_name() + ": " +
                               std::to_string(b.model->alibi.heads) + " ALiBi heads");
    }
    b.conflict(b.settings.max_bias.has_value(), "max_bias");
    if (slopes) {
      detail::fail(b.pname("slopes") + " conflicts with " + b.settings.config_name +
                   " (the config's slopes are used)");
    }
    alibi.max_bias = b.model->alibi.max_bias;
    alibi.slopes = alibi_slopes(b.model->alibi);
  } else {
    alibi.max_bias = b.settings.max_bias.value_or(8.0);
    if (slopes) {
      alibi.slopes = detail::param_values<double>(
          *slopes);  // the attention call checks the count against heads_q
      b.learned("slopes", *slopes, {b.dims.heads_q});
    }
  }
  b.out.scheme = std::move(alibi);
}
template void AlibiTerm<float>::build(detail::SchemeBuild&, const ModelLayer*);

}  // namespace attn

}  // namespace posenc
