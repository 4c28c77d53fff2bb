// src/schemes/xl.cc - Transformer-XL relative sinusoid R(delta) (Dai et al. 2019;
// docs/transformer-xl.md).
#include "posenc/xl.h"

#include <cmath>

#include "common.h"
#include "schemes/build.h"
#include "schemes/xl_term.h"

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

namespace attn {

// The scheme from its settings, parameters and model config (build_scheme).
template <class T>
void XlTerm<T>::build(detail::SchemeBuild& b, const ModelLayer*) {
  const ParamTensor* u = b.get("r_w_bias", {2}, "[heads, head_dim]", true);
  const ParamTensor* v = b.get("r_r_bias", {2}, "[heads, head_dim]", true);
  const ParamTensor* r = b.get("r_net", {2}, "[heads * head_dim, d_model]", true);
  TransformerXL xl;
  xl.base = b.settings.base.value_or(1e4);
  if (b.f64) {
    b.out.tables64.r_w_bias = b.view<double, 2>(*u);
    b.out.tables64.r_r_bias = b.view<double, 2>(*v);
    b.out.tables64.r_net = b.view<double, 2>(*r);
  } else {
    xl.r_w_bias = b.view<float, 2>(*u);
    xl.r_r_bias = b.view<float, 2>(*v);
    xl.r_net = b.view<float, 2>(*r);
  }
  b.learned("r_w_bias", *u, u->shape);
  b.learned("r_r_bias", *v, v->shape);
  b.learned("r_net", *r, r->shape);
  b.out.scheme = xl;
}
template void XlTerm<float>::build(detail::SchemeBuild&, const ModelLayer*);

}  // namespace attn

}  // namespace posenc
