// posenc/shaw.h - relative position representations (Shaw, Uszkoreit, Vaswani 2018;
// docs/shaw.md).
//
//   idx = clamp(rel, -K, K) + K            (rel = pos_k - pos_q)
//   s_ij  = scale * q_i . (k_j + rel_k[idx])
//   out_i = sum_j a_ij (v_j + rel_v[idx])
#pragma once

#include <cstdint>

#include "posenc/tensor.h"

namespace posenc {

inline int64_t shaw_index(int64_t rel, int64_t max_relative_position) {
  const int64_t k = max_relative_position;
  return (rel < -k ? -k : (rel > k ? k : rel)) + k;
}

// Shaw scheme parameters (non-owning). Tables are [2K+1, table_heads, head_dim] where
// table_heads is 1 (shared by every head, the paper) or heads_q (per-head variant), chosen for
// each table independently. Use
// shaw_table() to view a [2K+1, head_dim] table as shared. rel_v may be empty (data == nullptr):
// then there is no value term.
struct Shaw {
  View<const float, 3> rel_k;
  View<const float, 3> rel_v;
  int64_t max_relative_position() const { return (rel_k.shape[0] - 1) / 2; }
};

// Views a shared [2K+1, head_dim] table as [2K+1, 1, head_dim].
inline View<const float, 3> shaw_table(View<const float, 2> t) {
  return View<const float, 3>{t.data, {t.shape[0], 1, t.shape[1]}, {t.stride[0], 0, t.stride[1]}};
}

}  // namespace posenc
