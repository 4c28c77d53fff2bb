// src/attention/merge.cc - attention_merge: two partial attentions over disjoint key sets into
// the attention over their union, from their outputs and log-sum-exps (docs/attention.md, The
// log-sum-exp and merging).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/problem.h"

namespace posenc {

using attn::fail;
using attn::require_grad;

void attention_merge(View<const float, 4> out_a, View<const float, 3> lse_a,
                     View<const float, 4> out_b, View<const float, 3> lse_b, View<float, 4> out,
                     View<float, 3> lse) {
  const std::string w = "attention_merge: ";
  detail::require_data(out_a, w + "out_a");
  const auto& sh = out_a.shape;
  require_grad(out_b, sh, w + "out_b");
  require_grad(out, sh, w + "out");
  const std::array<int64_t, 3> ls{sh[0], sh[2], sh[1]};
  require_grad(lse_a, ls, w + "lse_a [batch, heads_q, seq_q]");
  require_grad(lse_b, ls, w + "lse_b [batch, heads_q, seq_q]");
  require_grad(lse, ls, w + "lse [batch, heads_q, seq_q]");
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < sh[0]; ++b)
    for (int64_t i = 0; i < sh[1]; ++i)
      for (int64_t h = 0; h < sh[2]; ++h) {
        const float la = lse_a(b, h, i), lb = lse_b(b, h, i);
        if (std::isnan(la) || std::isnan(lb) || la == -kNegInf || lb == -kNegInf) {
          fail(w + "lse is NaN or +inf at [" + std::to_string(b) + ", " + std::to_string(h) + ", " +
               std::to_string(i) + "]");
        }
        const float m = std::max(la, lb);
        if (m == kNegInf) {
          for (int64_t c = 0; c < sh[3]; ++c) out(b, i, h, c) = 0.0f;
          lse(b, h, i) = kNegInf;
          continue;
        }
        const double wa = la == kNegInf ? 0.0 : std::exp(static_cast<double>(la) - m);
        const double wb = lb == kNegInf ? 0.0 : std::exp(static_cast<double>(lb) - m);
        const double inv = 1.0 / (wa + wb);
        for (int64_t c = 0; c < sh[3]; ++c) {
          out(b, i, h, c) = static_cast<float>((wa * static_cast<double>(out_a(b, i, h, c)) +
                                                wb * static_cast<double>(out_b(b, i, h, c))) *
                                               inv);
        }
        lse(b, h, i) = static_cast<float>(m + std::log(wa + wb));
      }
}

}  // namespace posenc
