// src/xl.cc - Transformer-XL relative sinusoid R(delta) (Dai et al. 2019; docs/transformer-xl.md).
#include "posenc/xl.h"

#include <cmath>

#include "common.h"

namespace posenc {

std::vector<double> xl_sinusoid(int64_t delta, int64_t d_model, double base) {
  if (d_model < 2 || d_model % 2 != 0) {
    detail::fail("xl: d_model (r_net columns) must be even and >= 2 (got " +
                 std::to_string(d_model) + ")");
  }
  if (!std::isfinite(base) || base <= 1.0) detail::fail("xl: base must be finite and > 1");
  const int64_t half = d_model / 2;
  std::vector<double> r(static_cast<std::size_t>(d_model));
  const double dd = static_cast<double>(delta);
  for (int64_t i = 0; i < half; ++i) {
    const double w = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d_model));
    r[static_cast<std::size_t>(i)] = std::sin(dd * w);
    r[static_cast<std::size_t>(half + i)] = std::cos(dd * w);
  }
  return r;
}

}  // namespace posenc
